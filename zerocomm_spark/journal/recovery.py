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
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from zerocomm_spark.errors import JournalCorruptError
from zerocomm_spark.journal import codec, index
from zerocomm_spark.journal.codec import SEGMENT_HEADER_BYTES
from zerocomm_spark.journal.index import Run, SegmentIndex, SeqIndex, State
from zerocomm_spark.journal.reader import load_record
from zerocomm_spark.journal.segment import Damage, Segment, parse_segment_name, scan_segment
from zerocomm_spark.journal.state import RecentIds, id_keys

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


def recover(directory: Path, key: bytes, *, dedup_window: int, durable_end: int = 0) -> Recovered:
    """``durable_end``: offsets below it were acknowledged and read (a commit point); see scan_segment."""
    found = list_segments(directory)
    segments: list[Segment] = []
    for i, (base, path) in enumerate(found):
        last = i == len(found) - 1
        result = scan_segment(path, base, verify_crc=last, durable_end=durable_end if last else None)
        if not last and (result.segment.damaged or result.tail_damage_at is not None
                         or result.segment.end_offset > found[i + 1][0]):
            # A closed segment is scanned trusting its headers; if they do not add up, one of them may
            # be the damaged part (a flipped count or length): rescan checking every record's crc.
            result = scan_segment(path, base, verify_crc=True)
        segment = result.segment
        if last:
            _repair_tail(result.tail_damage_at, result.file_size, result.header_damaged, segment)
        elif result.tail_damage_at is not None:
            segment.damaged.append(Damage(segment.end_offset, -1, result.tail_damage_at))  # end fixed below
        segments.append(segment)
    _check_contiguity(segments)

    base = index.read_index(directory / index.BASE_STATE_FILE, 0, key)
    state: State = dict(base.state) if base is not None else {}  # publishers retention deleted entirely
    seq_index = SeqIndex()
    active_runs: list[tuple[int, list[Run]]] = []
    scanned_ids: dict[int, pa.Array] = {}  # record base -> its ids, for the newest scanned rows
    scanned_rows = 0
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        side = index.read_index(segment.index_path, segment.base_offset, key)
        if (side is not None and side.end_offset == segment.end_offset and side.valid_bytes == segment.size
                and len(side.records) == len(segment.records) and not segment.damaged):
            state = dict(side.state)
            runs_list = side.records
        else:
            if segment.records:
                log.info("journal %s: rebuilding the index of %s", directory.name, segment.path.name)
            runs_list = []
            for entry, batch in _decrypt(segment, key):
                runs = runs_of(batch)
                runs_list.append((entry.base_offset, runs))
                index.merge(state, runs)
                ids = id_keys(batch)  # the id rule's keys (new buffers: the record is freed)
                scanned_ids[entry.base_offset] = ids
                scanned_rows += len(ids)
                while len(scanned_ids) > 1:  # keep only what the newest `dedup_window` rows need
                    oldest = next(iter(scanned_ids))
                    if scanned_rows - len(scanned_ids[oldest]) < dedup_window:
                        break
                    scanned_rows -= len(scanned_ids.pop(oldest))
            if not last and not segment.damaged:
                index.write_index(segment.index_path, SegmentIndex(
                    segment.base_offset, segment.end_offset, segment.size, runs_list, dict(state)), key)
        for base, runs in runs_list:
            seq_index.add(base, runs)
        if last:
            active_runs = list(runs_list)
    recent = _recover_recent_ids(directory, key, segments, scanned_ids, dedup_window)
    return Recovered(segments, state, seq_index, active_runs, recent)


def _recover_recent_ids(directory: Path, key: bytes, segments: list[Segment], scanned: dict[int, pa.Array],
                        window: int) -> RecentIds:
    """The ids of (at least) the last ``window`` rows: the saved list, plus the rows after the point it
    was saved at (from the scan, or decrypted now); without a usable saved list, the newest records."""
    recent = RecentIds(window)
    end = segments[-1].end_offset if segments else 0
    saved = index.read_recent_ids(directory, key)
    if saved is not None and saved[0] > end:  # saved past what survived (power loss): not trustworthy
        saved = None
    earliest = segments[0].base_offset if segments else 0
    if saved is not None and len(saved[1]) < min(window, saved[0] - earliest):
        saved = None  # saved with a smaller window (or none): read the records instead
    anchor = saved[0] if saved is not None else None
    newer: list[pa.Array] = []
    rows = 0
    for segment in reversed(segments):
        if rows >= window or (anchor is not None and segment.end_offset <= anchor):
            break
        fd = -1
        try:
            for entry in reversed(segment.records):
                if rows >= window or (anchor is not None and entry.base_offset < anchor):
                    break
                ids = scanned.get(entry.base_offset)
                if ids is None:
                    if fd < 0:
                        fd = os.open(segment.path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        batch = load_record(fd, segment.path, entry, key)
                        ids = id_keys(batch)  # the id rule's keys (new buffers: the record is freed)
                    except JournalCorruptError as exc:
                        log.error("journal: %s", exc)
                        continue
                newer.append(ids)
                rows += len(ids)
        finally:
            if fd >= 0:
                os.close(fd)
    if saved is not None and rows < window:
        recent.add_array(saved[1])
    for ids in reversed(newer):
        recent.add_array(ids)
    if saved is None or saved[0] != end:  # never leave a list on disk that names rows past the end
        index.write_recent_ids(directory, end, recent.as_array(), key)
    return recent


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
        elif prev.damaged and prev.damaged[-1].end_offset == prev.end_offset \
                and prev.damaged[-1].start_offset <= cur.base_offset:
            # Its last record is damaged and its header's count overshoots: the next segment says where it ended.
            last = prev.damaged[-1]
            prev.damaged[-1] = Damage(last.start_offset, cur.base_offset, last.position)
            prev.end_offset = cur.base_offset
        elif prev.end_offset > cur.base_offset:
            raise JournalCorruptError(
                f"{cur.path} starts at offset {cur.base_offset}, inside {prev.path.name} "
                f"(which holds offsets up to {prev.end_offset - 1}): the segments overlap")
