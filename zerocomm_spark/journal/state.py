"""The idempotence rule: which rows of an append are new, and the runs they add to the seq index.

A row is a duplicate if its seq is at or below the last seq journaled for its (group, publisher), or
if its message id is among the last ``dedup_window`` journaled ids (or earlier in the same append).
Delivery is per-publisher FIFO, so the common append (one delivered data batch) has one publisher
and rising seqs: that case is checked with a few vectorised calls, never a Python loop per row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from zerocomm_spark.journal.index import Key, Run


class RecentIds:
    """At least the last ``window`` journaled message ids, for the id rule.

    Two generations of plain sets of the ids' UTF-8 bytes (``id_values``: made without decoding,
    about half the cost of str objects): ids go into the current one; when it holds ``window`` ids
    it becomes the previous one and the older generation is dropped whole. No per-id bookkeeping or
    eviction, and membership stays exact; the price is remembering up to 2 x ``window`` ids. Each
    generation also keeps its ids as compact Arrow arrays, so saving them in a side file at a segment
    roll costs a concatenation, not a Python loop over 10^5 strings.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._current: set[bytes] = set()
        self._previous: set[bytes] = set()
        self._current_arrays: list[pa.Array] = []
        self._previous_arrays: list[pa.Array] = []

    def __contains__(self, message_id: bytes) -> bool:
        return message_id in self._current or message_id in self._previous

    def isdisjoint(self, ids: set[bytes]) -> bool:
        return self._current.isdisjoint(ids) and self._previous.isdisjoint(ids)

    def add(self, ids: Iterable[bytes], array: pa.Array) -> None:
        """Remember ``ids`` (also given as ``array``, which is copied: it may share a record's buffer)."""
        if self.window <= 0 or len(array) == 0:
            return
        self._current.update(ids)
        self._current_arrays.append(pa.concat_arrays([array]))
        if len(self._current) >= self.window:
            self._previous, self._current = self._current, set()
            self._previous_arrays, self._current_arrays = self._current_arrays, []

    def add_array(self, array: pa.Array) -> None:
        self.add(id_values(array), array)

    def as_array(self) -> pa.Array:
        """Every id remembered, older generation first (what a side file keeps)."""
        arrays = [*self._previous_arrays, *self._current_arrays]
        return pa.concat_arrays(arrays) if arrays else pa.array([], pa.string())

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)


def id_values(array: pa.Array) -> list[bytes]:
    """A string column's values as bytes: the same UTF-8 the column holds, with no decoding."""
    return array.view(pa.binary()).to_pylist()


_EXPECTED: dict[tuple[bytes, int], tuple[pa.Buffer, pa.Buffer]] = {}


def _expected_buffers(raw: bytes, n: int) -> tuple[pa.Buffer, pa.Buffer]:
    """Offsets and data of an n-row column holding only ``raw``; cached (publishers repeat)."""
    found = _EXPECTED.get((raw, n))
    if found is None:
        if len(_EXPECTED) >= 64:
            _EXPECTED.clear()
        found = _EXPECTED[(raw, n)] = (
            pa.py_buffer(np.arange(n + 1, dtype=np.int32) * np.int32(len(raw))), pa.py_buffer(raw * n))
    return found


def constant_string(array: pa.Array) -> str | None:
    """The value if every row holds the same string (the one-publisher append), else None.

    Two memcmp's against the buffers an all-equal column must have: no per-row work.
    """
    n = len(array)
    first = array[0].as_py()
    if n == 1:
        return first
    raw = first.encode()
    width = len(raw)
    _, offsets, data = array.buffers()
    start = array.offset * 4
    expected_offsets, expected_data = _expected_buffers(raw, n)
    if array.offset:
        base = int(np.frombuffer(offsets, dtype=np.int32, count=1, offset=start)[0])
        expected_offsets = pa.py_buffer(np.frombuffer(expected_offsets, dtype=np.int32) + np.int32(base))
    else:
        base = 0
    if not offsets.slice(start, (n + 1) * 4).equals(expected_offsets):
        return None
    if width and not data.slice(base, n * width).equals(expected_data):
        return None
    return first


@dataclass(slots=True)
class Filtered:
    """The rows of one append that are new, with what the runs and the id memory need."""

    batch: pa.RecordBatch
    duplicates: int
    single_key: Key | None  # set when every kept row has the same publisher
    seqs: np.ndarray  # kept rows' seqs
    keys: list[Key] | None  # kept rows' keys when there are several publishers
    ids: list[bytes]  # kept rows' message ids (UTF-8)

    def runs(self, start: int, stop: int, first_offset: int) -> list[Run]:
        """Runs of kept rows [start, stop) once row ``start`` is at ``first_offset``."""
        if stop <= start:
            return []
        if self.single_key is not None:
            group, publisher = self.single_key
            return [Run(group, publisher, int(self.seqs[start]), int(self.seqs[stop - 1]),
                        first_offset + stop - 1 - start)]
        assert self.keys is not None
        spans: dict[Key, list[int]] = {}
        for i in range(start, stop):
            seq = int(self.seqs[i])
            span = spans.get(self.keys[i])
            if span is None:
                spans[self.keys[i]] = [seq, seq, first_offset + i - start]
            else:
                span[1] = seq
                span[2] = first_offset + i - start
        return [Run(g, p, a, b, o) for (g, p), (a, b, o) in spans.items()]


def filter_new(batch: pa.RecordBatch, last_seq: Callable[[Key], int | None], pending: dict[Key, int],
               recent: RecentIds, pending_ids: set[bytes] | None) -> Filtered:
    """Apply the idempotence rule against what is journaled and what this group already kept.

    ``pending`` (last seq per publisher) and ``pending_ids`` (None for a one-append group) are this
    group's overlay and are updated with the kept rows; ``recent`` is not: the writer adds ids once
    their record is written, so a side file saved mid-group never names rows that a crash could lose.
    """
    n = batch.num_rows
    use_ids = recent.window > 0  # dedup_window=0 turns the id rule off (and its per-row cost)
    ids: list[bytes] = id_values(batch.column("message_id")) if use_ids else []
    id_set = set(ids)
    seqs = batch.column("seq").to_numpy(zero_copy_only=False)
    group = constant_string(batch.column("group")) if n else None
    publisher = constant_string(batch.column("publisher_did")) if group is not None else None
    if publisher is not None:
        key = (group, publisher)
        last = pending.get(key)
        if last is None:
            last = last_seq(key)
        if ((last is None or seqs[0] > last) and (n == 1 or bool(np.all(seqs[1:] > seqs[:-1])))
                and (not use_ids or (len(id_set) == n and recent.isdisjoint(id_set)
                                     and (pending_ids is None or pending_ids.isdisjoint(id_set))))):
            pending[key] = int(seqs[-1])
            if pending_ids is not None:
                pending_ids |= id_set
            return Filtered(batch, 0, key, seqs, None, ids)  # type: ignore[arg-type]
    # General case: several publishers, or duplicates to drop. Row by row, in order.
    groups = batch.column("group").to_pylist()
    publishers = batch.column("publisher_did").to_pylist()
    keep = np.zeros(n, dtype=bool)
    kept_keys: list[Key] = []
    kept_ids: list[bytes] = []
    seen: set[bytes] = set() if pending_ids is None else pending_ids
    seq_list = seqs.tolist()
    for i in range(n):
        key = (groups[i], publishers[i])
        seq = seq_list[i]
        last = pending.get(key)
        if last is None:
            last = last_seq(key)
        if last is not None and seq <= last:
            continue
        if use_ids:
            message_id = ids[i]
            if message_id in seen or message_id in recent:
                continue
            seen.add(message_id)
            kept_ids.append(message_id)
        pending[key] = seq
        keep[i] = True
        kept_keys.append(key)
    kept_count = len(kept_keys)
    kept = batch if kept_count == n else batch.filter(pa.array(keep))
    distinct = set(kept_keys)
    single = next(iter(distinct)) if len(distinct) == 1 else None
    return Filtered(kept, n - kept_count, single, seqs[keep], None if single is not None else kept_keys, kept_ids)
