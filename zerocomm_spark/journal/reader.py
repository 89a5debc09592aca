"""Reading records back: one preadv into an aligned Arrow buffer, decrypt in place, zero-copy IPC.

Decryption is the cost of a read, and libsodium releases the GIL, so ranges of several records are
decrypted by a small thread pool a few records ahead of the consumer (order kept, memory bounded).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from zerocomm_spark.errors import DataLossError, JournalClosedError, JournalCorruptError, JournalTimeoutError
from zerocomm_spark.journal import codec
from zerocomm_spark.journal.codec import RECORD_HEADER_BYTES
from zerocomm_spark.journal.segment import Damage, RecordEntry


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows [start, start+length) of the record at ``entry`` in ``path`` (offsets relative to the record)."""

    path: Path
    entry: RecordEntry
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class Hole:
    """A damaged range met while reading: raises when the reader reaches it."""

    path: Path
    damage: Damage


def load_record(fd: int, path: Path, entry: RecordEntry, key: bytes) -> pa.RecordBatch:
    """The decrypted batch of one record, or JournalCorruptError naming file and position."""
    header = entry.header
    body = pa.allocate_buffer(header.body_length)
    got = os.preadv(fd, [body], entry.position + RECORD_HEADER_BYTES)
    if got != header.body_length:
        raise JournalCorruptError(
            f"{path} is shorter than its index says: the record at position {entry.position} "
            f"(offsets {entry.base_offset}..{entry.end_offset - 1}) is cut short")
    batch = codec.decrypt_record(header, body, key)
    if batch is not None:
        return batch
    # Tell rot (crc fails) from alteration or a foreign key (crc holds): the buffer was wiped, re-read.
    raw = os.pread(fd, header.body_length, entry.position + RECORD_HEADER_BYTES)
    what = ("fails its checksum (damaged on disk)" if not codec.crc_ok(header, raw)
            else "fails authentication although its checksum holds (altered, or written under another key)")
    raise JournalCorruptError(
        f"the record at {path}, position {entry.position} (offsets {entry.base_offset}..{entry.end_offset - 1}) {what}")


def open_segment(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DataLossError(f"{path.name} was deleted by retention while it was being read") from None


class _Fds:
    """Read descriptors of the segments one read touches, closed when it ends."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def get(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = open_segment(path)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _raise_hole(hole: Hole) -> None:
    d = hole.damage
    raise JournalCorruptError(
        f"offsets {d.start_offset}..{d.end_offset - 1} are unreadable: {hole.path} is damaged at position {d.position}")


def iter_pieces(plan: list[Piece | Hole], key: bytes, executor: Executor | None, prefetch: int,
                timeout: float) -> Iterator[pa.RecordBatch]:
    """Batches for each piece of the plan, in order; decrypted ahead by ``executor`` if given."""
    fds = _Fds()
    window: deque[tuple[Piece | Hole, Future[pa.RecordBatch] | None]] = deque()
    try:
        if executor is None or prefetch <= 1 or sum(isinstance(p, Piece) for p in plan) <= 1:
            for item in plan:
                if isinstance(item, Hole):
                    _raise_hole(item)
                batch = load_record(fds.get(item.path), item.path, item.entry, key)
                yield _slice(batch, item)
            return
        items = iter(plan)
        exhausted = False
        while True:
            while not exhausted and len(window) < prefetch:
                item = next(items, None)
                if item is None:
                    exhausted = True
                    break
                if isinstance(item, Hole):
                    window.append((item, None))
                else:
                    try:
                        future = executor.submit(load_record, fds.get(item.path), item.path, item.entry, key)
                    except RuntimeError:  # the pool was shut down: the journal closed under the reader
                        raise JournalClosedError("the journal was closed during the read") from None
                    window.append((item, future))
            if not window:
                return
            item, future = window.popleft()
            if future is None:
                _raise_hole(item)  # type: ignore[arg-type]
            try:
                batch = future.result(timeout=timeout)  # type: ignore[union-attr]
            except TimeoutError:
                raise JournalTimeoutError(f"reading a record took more than {timeout:g} s") from None
            yield _slice(batch, item)  # type: ignore[arg-type]
    finally:
        # Let in-flight reads finish before their descriptors close (bounded: at most `prefetch` records).
        for _, future in window:
            if future is not None:
                future.cancel()
                try:
                    future.result(timeout=timeout)
                except BaseException:
                    pass
        fds.close()


def _slice(batch: pa.RecordBatch, piece: Piece) -> pa.RecordBatch:
    if piece.start == 0 and piece.length == batch.num_rows:
        return batch
    return batch.slice(piece.start, piece.length)
