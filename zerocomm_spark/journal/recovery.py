"""Reopening: rebuild the index, cut a torn tail, and recover the idempotence state.

1. Every segment's records are indexed from their headers (``segment.scan_segment``); the last
   segment's records are also crc-checked, since that is where a crash leaves a torn write.
2. Damage with nothing valid after it, in the last segment, is a torn tail: the file is truncated
   there. Nothing complete is lost: an acknowledged append was fully written before it returned, and
   a complete record always passes its checks. Damage elsewhere is kept and reported on read.
3. Per-publisher state, the seq index and the recent message ids come from the segments' sealed side
   files; segments without a usable one (the active segment after a crash) are decrypted and scanned,
   and closed ones get their side file rewritten.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from zerocomm_spark.errors import JournalCorruptError
from zerocomm_spark.journal import codec, index
from zerocomm_spark.journal.codec import SEGMENT_HEADER_BYTES
from zerocomm_spark.journal.index import Run, SegmentIndex, SeqIndex, State
from zerocomm_spark.journal.reader import load_record
from zerocomm_spark.journal.segment import Damage, Segment, parse_segment_name, scan_segment
from zerocomm_spark.journal.state import RecentIds

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Recovered:
    segments: list[Segment]
    state: State
    seq_index: SeqIndex
    active_runs: list[tuple[int, list[Run]]]
    recent: RecentIds


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in directory.iterdir():
        base = parse_segment_name(entry.name)
        if base is not None and entry.is_file():
            found.append((base, entry))
    found.sort()
    return found


def runs_of(batch: pa.RecordBatch) -> list[Run]:
    """Per-publisher runs of a decrypted record (recovery only; the writer knows them already)."""
    groups = batch.column("group").to_pylist()
    publishers = batch.column("publisher_did").to_pylist()
    seqs = batch.column("seq").to_pylist()
    offsets = batch.column("offset").to_pylist()
    spans: dict[index.Key, list[int]] = {}
    for g, p, seq, off in zip(groups, publishers, seqs, offsets):
        span = spans.get((g, p))
        if span is None:
            spans[(g, p)] = [seq, seq, off]
        else:
            span[1], span[2] = seq, off
    return [Run(g, p, a, b, o) for (g, p), (a, b, o) in spans.items()]


def recover(directory: Path, key: bytes, *, dedup_window: int, fsync: bool) -> Recovered:
    found = list_segments(directory)
    segments: list[Segment] = []
    for i, (base, path) in enumerate(found):
        last = i == len(found) - 1
        result = scan_segment(path, base, verify_crc=last)
        segment = result.segment
        if last:
            _repair_tail(result.tail_damage_at, result.file_size, result.header_damaged, segment)
        elif result.tail_damage_at is not None:
            segment.damaged.append(Damage(segment.end_offset, -1, result.tail_damage_at))  # end fixed below
        segments.append(segment)
    _check_contiguity(segments)

    state: State = {}
    seq_index = SeqIndex()
    active_runs: list[tuple[int, list[Run]]] = []
    ids_at_end: dict[int, pa.Array] = {}  # segment position -> recent ids as of its end (from side files)
    tail: deque[tuple[int, pa.Array]] = deque()  # (segment position, ids of one record) from scans, newest last
    tail_rows = 0
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        side = index.read_index(segment.index_path, segment.base_offset, key)
        if (side is not None and side.end_offset == segment.end_offset and side.valid_bytes == segment.size
                and len(side.records) == len(segment.records) and not segment.damaged):
            state = dict(side.state)
            runs_list = side.records
            ids_at_end[i] = side.recent_ids
        else:
            if segment.records:
                log.info("journal %s: rebuilding the index of %s", directory.name, segment.path.name)
            runs_list = []
            for entry, batch in _decrypt(segment, key):
                runs = runs_of(batch)
                runs_list.append((entry.base_offset, runs))
                index.merge(state, runs)
                ids = pa.concat_arrays([batch.column("message_id")])  # a copy: frees the record
                tail.append((i, ids))
                tail_rows += len(ids)
                while tail and tail_rows - len(tail[0][1]) >= dedup_window:
                    tail_rows -= len(tail.popleft()[1])
            if not last and not segment.damaged:
                recent = _recent_ids(ids_at_end, tail, i, dedup_window)
                index.write_index(segment.index_path, SegmentIndex(
                    segment.base_offset, segment.end_offset, segment.size, runs_list, dict(state), recent.as_array()),
                    key, fsync=fsync)
        for base, runs in runs_list:
            seq_index.add(base, runs)
        if last:
            active_runs = list(runs_list)
    recent = _recent_ids(ids_at_end, tail, len(segments) - 1, dedup_window)
    return Recovered(segments, state, seq_index, active_runs, recent)


def key_opens_records(directory: Path, key: bytes) -> bool | None:
    """Whether ``key`` decrypts the first intact record found (None if there is none): the key check
    for a journal whose key-check file was lost, before anything is written under a wrong key."""
    for base, path in list_segments(directory):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            header = codec.parse_record_header(os.pread(fd, codec.RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES))
            if header is None or header.base_offset != base:
                continue
            body = os.pread(fd, header.body_length, SEGMENT_HEADER_BYTES + codec.RECORD_HEADER_BYTES)
            if len(body) != header.body_length or not codec.crc_ok(header, body):
                continue
            return codec.decrypt_record(header, pa.py_buffer(bytearray(body)), key) is not None
        finally:
            os.close(fd)
    return None


def _recent_ids(ids_at_end: dict[int, pa.Array], tail: deque[tuple[int, pa.Array]], upto: int,
                window: int) -> RecentIds:
    """The ids of the last ``window`` rows through segment ``upto``: a side file's list plus scans after it."""
    recent = RecentIds(window)
    anchor = max((i for i in ids_at_end if i <= upto), default=-1)
    if anchor >= 0:
        recent.add_array(ids_at_end[anchor])
    for i, ids in tail:
        if anchor < i <= upto:
            recent.add_array(ids)
    return recent


def _decrypt(segment: Segment, key: bytes):  # -> Iterator[tuple[RecordEntry, pa.RecordBatch]]
    fd = os.open(segment.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for entry in segment.records:
            try:
                yield entry, load_record(fd, segment.path, entry, key)
            except JournalCorruptError as exc:
                # Reads of it will raise too; the rest of the journal stays usable.
                log.error("journal: %s", exc)
    finally:
        os.close(fd)


def _repair_tail(tail_damage_at: int | None, file_size: int, header_damaged: bool, segment: Segment) -> None:
    path = segment.path
    if tail_damage_at is not None:
        log.warning("journal %s: torn tail in %s, truncating %d bytes at position %d",
                    path.parent.name, path.name, file_size - tail_damage_at, tail_damage_at)
        with open(path, "r+b") as f:
            f.truncate(tail_damage_at)
        segment.file_size = tail_damage_at
        segment.size = tail_damage_at if segment.records or segment.damaged else max(tail_damage_at, 0)
    if header_damaged and not segment.records and not segment.damaged:
        # Crash while the segment was being created: nothing in it was ever acknowledged.
        log.warning("journal %s: rewriting the torn header of the empty segment %s", path.parent.name, path.name)
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write(codec.encode_segment_header(segment.base_offset, segment.created_us))
        segment.size = segment.file_size = SEGMENT_HEADER_BYTES


def _check_contiguity(segments: list[Segment]) -> None:
    for prev, cur in zip(segments, segments[1:]):
        tail = [d for d in prev.damaged if d.end_offset == -1]
        if tail:
            prev.damaged.remove(tail[0])
            if cur.base_offset > tail[0].start_offset:
                prev.damaged.append(Damage(tail[0].start_offset, cur.base_offset, tail[0].position))
            prev.end_offset = max(prev.end_offset, cur.base_offset)
        if prev.end_offset < cur.base_offset:
            log.warning("journal: offsets %d..%d are missing between %s and %s",
                        prev.end_offset, cur.base_offset - 1, prev.path.name, cur.path.name)
            prev.damaged.append(Damage(prev.end_offset, cur.base_offset, prev.size))
            prev.end_offset = cur.base_offset
        elif prev.end_offset > cur.base_offset:
            raise JournalCorruptError(
                f"{cur.path} starts at offset {cur.base_offset}, inside {prev.path.name} "
                f"(which holds offsets up to {prev.end_offset - 1}): the segments overlap")
