"""What the journal knows without decrypting: per-publisher positions and the seq -> record index.

Publishers and seqs live inside the encrypted batches, so the per-publisher state (the idempotence
rule's "last seq journaled") and the seq index that ``read_by_seq`` uses cannot come from record
headers. When a segment is closed the writer saves both in a sealed side file ``<base>.idx``: the
runs of each record (publisher, first seq, last seq, last offset) and the cumulative per-publisher
state at the segment's end; and it replaces ``recent.ids``, the message ids the duplicate check
remembers (one file: only the newest list is ever needed). Reopening then decrypts only the active
segment (and any segment whose side file is missing or stale). The cumulative state outlives retention: a publisher whose rows were
all deleted is still remembered, so a late re-send is still recognised as a duplicate.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from zerocomm_spark.journal import crypto
from zerocomm_spark.journal.files import write_atomic

Key = tuple[str, str]  # (group, publisher_did)

_INDEX_MAGIC = b"ZCJI\x01"
_IDS_SCHEMA = pa.schema([pa.field("message_id", pa.string(), nullable=False)])
_RECENT_MAGIC = b"ZCJD\x02"  # 2: the id rule's keys (ids scoped by group, state.id_keys); 1 held bare ids
RECENT_IDS_FILE = "recent.ids"


@dataclass(frozen=True, slots=True)
class Run:
    """The rows of one publisher inside one record."""

    group: str
    publisher_did: str
    first_seq: int
    last_seq: int
    last_offset: int

    @property
    def key(self) -> Key:
        return (self.group, self.publisher_did)


State = dict[Key, tuple[int, int]]  # key -> (last seq, last offset)


def merge(state: State, runs: Iterable[Run]) -> None:
    for run in runs:
        state[run.key] = (run.last_seq, run.last_offset)


class SeqIndex:
    """Per publisher, the records holding its seqs, in seq order (seqs only grow with offsets)."""

    def __init__(self) -> None:
        self._runs: dict[Key, tuple[list[int], list[int], list[int]]] = {}

    def add(self, record_base: int, runs: Iterable[Run]) -> None:
        for run in runs:
            firsts, lasts, bases = self._runs.setdefault(run.key, ([], [], []))
            firsts.append(run.first_seq)
            lasts.append(run.last_seq)
            bases.append(record_base)

    def record_bases(self, key: Key, seq_from: int, seq_to: int) -> list[int]:
        """Base offsets of the records that may hold seqs in [seq_from, seq_to]."""
        entry = self._runs.get(key)
        if entry is None:
            return []
        firsts, lasts, bases = entry
        out: list[int] = []
        for i in range(bisect.bisect_left(lasts, seq_from), len(lasts)):
            if firsts[i] > seq_to:
                break
            out.append(bases[i])
        return out

    def prune_below(self, offset: int) -> None:
        """Forget records wholly deleted by retention (their bases are below ``offset``)."""
        for key in list(self._runs):
            firsts, lasts, bases = self._runs[key]
            cut = bisect.bisect_left(bases, offset)
            if cut:
                del firsts[:cut], lasts[:cut], bases[:cut]
            if not bases:
                del self._runs[key]


@dataclass(slots=True)
class SegmentIndex:
    """The contents of one ``.idx`` side file."""

    base_offset: int
    end_offset: int
    valid_bytes: int
    records: list[tuple[int, list[Run]]]
    state: State


#: The last positions of publishers whose rows retention deleted entirely, as of the earliest
#: segment left (a SegmentIndex with no records, sealed like one for base offset 0). Segments' side
#: files carry the same state, but only closed segments have one: without this file, a crash once
#: retention had deleted every closed segment forgot those publishers, and their late re-sends were
#: journaled again.
BASE_STATE_FILE = "base-state.idx"


def _aad(base_offset: int) -> bytes:
    return _INDEX_MAGIC + base_offset.to_bytes(8, "little")


def write_index(path: Path, index: SegmentIndex, key: bytes, *, fsync: bool = False) -> None:
    """Save a side file, atomically; by default without fsync: a stale or missing side file only
    costs a rescan at open (it is checked against the segment), so syncing it would buy nothing."""
    doc = {
        "base": index.base_offset,
        "end": index.end_offset,
        "bytes": index.valid_bytes,
        "records": [[base, [[r.group, r.publisher_did, r.first_seq, r.last_seq, r.last_offset] for r in runs]]
                    for base, runs in index.records],
        "state": [[g, p, seq, off] for (g, p), (seq, off) in index.state.items()],
    }
    plain = json.dumps(doc, separators=(",", ":")).encode()
    write_atomic(path, _INDEX_MAGIC + crypto.seal(plain, _aad(index.base_offset), key), fsync=fsync)


def read_index(path: Path, base_offset: int, key: bytes) -> SegmentIndex | None:
    """The side file's contents, or None if it is missing, damaged or not for this segment."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    if not blob.startswith(_INDEX_MAGIC):
        return None
    plain = crypto.open_sealed(blob[len(_INDEX_MAGIC):], _aad(base_offset), key)
    if plain is None:
        return None
    try:
        doc = json.loads(plain)
        return SegmentIndex(
            int(doc["base"]), int(doc["end"]), int(doc["bytes"]),
            [(int(base), [Run(g, p, int(a), int(b), int(o)) for g, p, a, b, o in runs])
             for base, runs in doc["records"]],
            {(g, p): (int(seq), int(off)) for g, p, seq, off in doc["state"]},
        )
    except (ValueError, KeyError, TypeError):
        return None


def write_recent_ids(directory: Path, end_offset: int, ids: pa.Array, key: bytes) -> None:
    """Save the ids the duplicate check remembers, as of ``end_offset`` (one file, replaced at each roll
    and close: only the newest is ever needed, so old segments' side files stay small). Not synced:
    a list older than the journal's end is completed by a scan at open, one past it is ignored."""
    body = pa.RecordBatch.from_arrays([ids], schema=_IDS_SCHEMA).serialize().to_pybytes()
    aad = _RECENT_MAGIC + end_offset.to_bytes(8, "little")
    write_atomic(directory / RECENT_IDS_FILE, aad + crypto.seal(body, aad, key), fsync=False)


def read_recent_ids(directory: Path, key: bytes) -> tuple[int, pa.Array] | None:
    """(end offset, ids) from the recent-ids file, or None if it is missing or damaged."""
    try:
        blob = (directory / RECENT_IDS_FILE).read_bytes()
    except OSError:
        return None
    head = len(_RECENT_MAGIC) + 8
    if len(blob) < head or not blob.startswith(_RECENT_MAGIC):
        return None
    body = crypto.open_sealed(blob[head:], blob[:head], key)
    if body is None:
        return None
    try:
        ids = pa.ipc.read_record_batch(pa.py_buffer(body), _IDS_SCHEMA).column(0)
    except pa.ArrowException:
        return None
    return int.from_bytes(blob[len(_RECENT_MAGIC):head], "little"), ids
