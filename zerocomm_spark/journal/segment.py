"""Segment files: naming, creation, and the scan that rebuilds a segment's record index on open.

A segment is ``<base offset, 20 digits>.zcj``; its records cover ``[base, end)``. Only the last
segment is written to. The scan walks record headers (one small pread per record, so reopening a
large journal reads almost nothing); where a header does not chain (bad magic, wrong offset, runs
past the end of the file) it re-synchronises on the next record whose crc holds. What lies between
is a damaged range: reading it raises JournalCorruptError naming the file and position, and
everything around it stays readable. Damage with no valid record after it is a torn tail, unless it
is a whole record below a commit point that fails its checksum: that is damage too.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from zerocomm_spark.journal import codec
from zerocomm_spark.journal.codec import RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES, RecordHeader

log = logging.getLogger(__name__)

SEGMENT_SUFFIX = ".zcj"
INDEX_SUFFIX = ".idx"
_NAME = re.compile(r"^(\d{20})\.zcj\Z")  # \Z: "$" also matches before a final newline
_RESYNC_CHUNK = 8 << 20


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


@dataclass(slots=True)
class RecordEntry:
    """Where one record sits; the sparse index is a sorted list of these per segment."""

    position: int
    header: RecordHeader

    @property
    def base_offset(self) -> int:
        return self.header.base_offset

    @property
    def end_offset(self) -> int:
        return self.header.base_offset + self.header.count


@dataclass(frozen=True, slots=True)
class Damage:
    """Offsets [start, end) that cannot be read because the bytes at ``position`` are damaged."""

    start_offset: int
    end_offset: int
    position: int


@dataclass(slots=True)
class Segment:
    path: Path
    base_offset: int
    created_us: int
    records: list[RecordEntry] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)
    damaged: list[Damage] = field(default_factory=list)
    size: int = SEGMENT_HEADER_BYTES  # bytes through the end of the last valid record
    file_size: int = SEGMENT_HEADER_BYTES  # bytes on disk (what retention counts)
    end_offset: int = 0
    max_ts: int | None = None

    def add(self, entry: RecordEntry) -> None:
        self.records.append(entry)
        self.bases.append(entry.base_offset)
        self.size = entry.position + entry.header.frame_length
        self.file_size = max(self.file_size, self.size)
        self.end_offset = entry.end_offset
        ts = entry.header.max_ts
        if self.max_ts is None or ts > self.max_ts:
            self.max_ts = ts

    def locate(self, offset: int) -> int:
        """Index of the record holding ``offset`` (or the first record after it)."""
        i = bisect.bisect_right(self.bases, offset) - 1
        if i < 0:
            return 0
        if self.records[i].end_offset <= offset:
            return i + 1
        return i

    def damage_at(self, offset: int) -> Damage | None:
        for damage in self.damaged:
            if damage.start_offset <= offset < damage.end_offset:
                return damage
        return None

    @property
    def index_path(self) -> Path:
        return self.path.with_suffix(INDEX_SUFFIX)


def create_segment(directory: Path, base_offset: int, created_us: int) -> tuple[Segment, int]:
    """A new, empty segment and its write descriptor (append mode)."""
    path = directory / segment_name(base_offset)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, codec.encode_segment_header(base_offset, created_us))
    except BaseException:
        os.close(fd)
        raise
    return Segment(path, base_offset, created_us, end_offset=base_offset), fd


def open_for_append(segment: Segment) -> int:
    fd = os.open(segment.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    if os.fstat(fd).st_size != segment.size:
        os.ftruncate(fd, segment.size)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclass(slots=True)
class ScanResult:
    segment: Segment
    #: Position of damage with no valid record after it (a torn tail in the last segment), else None.
    tail_damage_at: int | None
    file_size: int
    header_damaged: bool


def scan_segment(path: Path, base_offset: int, *, verify_crc: bool, durable_end: int | None = None) -> ScanResult:
    """Rebuild one segment's record index from its file (see the module docstring).

    ``durable_end`` (the last segment only): a final record that fails its crc but ends at or below
    it is kept as damage - a consumer read it, so it was written in full and rotted since; above
    it, it may be a write a power loss cut short (its header on disk, not all its pages), which was
    never acknowledged as durable: truncated as a torn tail, as before.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        parsed = codec.parse_segment_header(os.pread(fd, SEGMENT_HEADER_BYTES, 0))
        header_damaged = parsed is None or parsed[0] != base_offset
        created = parsed[1] if parsed is not None else 0
        segment = Segment(path, base_offset, created, end_offset=base_offset, file_size=size)
        pos, expected = SEGMENT_HEADER_BYTES, base_offset
        tail_damage_at: int | None = None
        while pos < size:
            header = codec.parse_record_header(os.pread(fd, RECORD_HEADER_BYTES, pos))
            if (header is not None and header.base_offset == expected and pos + header.frame_length <= size
                    and (not verify_crc
                         or codec.crc_ok(header, os.pread(fd, header.body_length, pos + RECORD_HEADER_BYTES)))):
                segment.add(RecordEntry(pos, header))
                pos += header.frame_length
                expected = header.end_offset
                continue
            found = _resync(fd, pos + 1, size, expected)
            if found is None:
                if (header is not None and header.base_offset == expected and pos + header.frame_length <= size
                        and durable_end is not None and header.end_offset <= durable_end):
                    # A whole frame that fails its crc below the commit point: rot or tampering, not
                    # a torn write. Truncating it would drop rows that were acknowledged and read and
                    # hand their offsets to new rows; it stays, damaged.
                    log.warning("journal segment %s: the last record (offsets %d..%d, position %d) fails its "
                                "checksum", path.name, expected, header.end_offset - 1, pos)
                    segment.damaged.append(Damage(expected, header.end_offset, pos))
                    pos += header.frame_length
                    expected = header.end_offset
                    segment.size = pos
                    segment.end_offset = expected
                    continue
                tail_damage_at = pos
                break
            next_pos, next_header = found
            log.warning("journal segment %s: damaged bytes at position %d (offsets %d..%d unreadable)",
                        path.name, pos, expected, next_header.base_offset - 1)
            segment.damaged.append(Damage(expected, next_header.base_offset, pos))
            segment.size = pos  # provisional; add() moves it on
            pos, expected = next_pos, next_header.base_offset
            segment.end_offset = expected
        return ScanResult(segment, tail_damage_at, size, header_damaged)
    finally:
        os.close(fd)


def _resync(fd: int, start: int, size: int, expected: int) -> tuple[int, RecordHeader] | None:
    """The next position at or after ``start`` holding an intact record at or beyond ``expected``."""
    pos = start
    overlap = RECORD_HEADER_BYTES
    while pos < size:
        chunk = os.pread(fd, min(_RESYNC_CHUNK, size - pos), pos)
        if not chunk:
            return None
        at = chunk.find(codec.RECORD_MAGIC)
        while at >= 0:
            candidate = pos + at
            raw = chunk[at:at + RECORD_HEADER_BYTES]
            if len(raw) < RECORD_HEADER_BYTES:
                raw = os.pread(fd, RECORD_HEADER_BYTES, candidate)
            header = codec.parse_record_header(raw)
            if (header is not None and header.base_offset >= expected
                    and candidate + header.frame_length <= size
                    and codec.crc_ok(header, os.pread(fd, header.body_length, candidate + RECORD_HEADER_BYTES))):
                return candidate, header
            at = chunk.find(codec.RECORD_MAGIC, at + 1)
        if pos + len(chunk) >= size:
            return None
        pos += max(1, len(chunk) - overlap)
    return None
