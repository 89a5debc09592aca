"""Record and segment framing: how one encrypted Arrow record batch sits in a segment file.

A segment file is a 32-byte segment header followed by records, each::

    offset size field
     0     4    magic b"ZCJR"
     4     1    version: the record's cipher (crypto.py): 3 = AEGIS-256 (written), 2 = AES-256-GCM,
                1 = XChaCha20-Poly1305
     5     1    flags (0)
     6     2    reserved (0)
     8     4    body length (ciphertext + tag: 32 bytes in v3, 16 before), u32
    12     4    crc32 of the header (this field as 0) and the body
    16     8    base offset (of the record's first row), u64
    24     4    row count, u32
    28     8    min received_at, int64 microseconds
    36     8    max received_at, int64 microseconds
    44    24    random nonce material (v3: AEGIS-256 nonce, zero-padded; v2: record-key input || GCM
                nonce; v1: XChaCha20 nonce)
    68     -    body: AEAD(Arrow IPC message of the batch) || tag

Everything little-endian. The body is one Arrow IPC record batch message (no schema: it is fixed, see
``schema.JOURNAL_SCHEMA``), encrypted whole, so no column (payload, message id, publisher, headers)
is ever in clear on disk. Only the offsets, row count and the received_at range are in clear: they
let the index, retention and timestamp lookups work without the key's help. Those header fields,
the version (cipher) byte included, are the AEAD's associated data, so moving or editing them is
detected too. Every version is read; only v3 is written (v1 and v2 records from earlier journals stay
readable, and a segment may hold several versions).

The crc32 is for framing: it tells a torn or rotten record (crc fails) from an authentic-looking
record under a wrong key or tampering (crc holds, authentication fails), and it lets a scan re-find
record boundaries after damage. Reads rely on the AEAD tag (stronger) and skip it. It is the
standard crc32 (zlib's), computed with ISA-L's carry-less-multiply code when ``isal`` is installed.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import pyarrow as pa

from zerocomm_spark.journal import crypto
from zerocomm_spark.journal.schema import JOURNAL_SCHEMA

try:  # the same crc32 as zlib's, ~8x faster (it holds the GIL: ~60 us for a 1 MiB record)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values
    from zlib import crc32 as _crc32

RECORD_MAGIC = b"ZCJR"
RECORD_VERSION = crypto.WRITE_CIPHER  # the version byte new records get: their cipher
RECORD_VERSIONS = crypto.CIPHERS  # the versions a reader accepts
_RECORD = struct.Struct("<4sBBHIIQIqq24s")
RECORD_HEADER_BYTES = _RECORD.size  # 68
_AAD = struct.Struct("<4sBBHIQIqq")  # the header without crc and nonce: the AEAD's associated data
MAX_BODY_BYTES = 1 << 31  # keeps Arrow's 32-bit binary offsets and the u32 length field safe

SEGMENT_MAGIC = b"ZCJS"
SEGMENT_VERSION = 1
_SEGMENT = struct.Struct("<4sB3sQqI4s")
SEGMENT_HEADER_BYTES = _SEGMENT.size  # 32

_ZERO_CRC = b"\x00\x00\x00\x00"


@dataclass(frozen=True, slots=True)
class RecordHeader:
    body_length: int
    crc: int
    base_offset: int
    count: int
    min_ts: int
    max_ts: int
    nonce: bytes
    version: int = RECORD_VERSION

    @property
    def frame_length(self) -> int:
        return RECORD_HEADER_BYTES + self.body_length

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.count


@dataclass(frozen=True, slots=True)
class Frame:
    """An encoded record ready for writev: the header bytes and the encrypted body."""

    header: bytes
    body: pa.Buffer
    record: RecordHeader

    @property
    def length(self) -> int:
        return len(self.header) + self.body.size


def _aad(header: bytes) -> bytes:
    return header[:12] + header[16:44]


def _crc(header_zero_crc: bytes, body: pa.Buffer | bytes | memoryview) -> int:
    return _crc32(body, zlib.crc32(header_zero_crc)) & 0xFFFFFFFF


def encode_record(batch: pa.RecordBatch, base: int, min_ts: int, max_ts: int, key: bytes, *,
                  version: int = RECORD_VERSION) -> Frame:
    """One frame for a JOURNAL_SCHEMA batch whose offset column runs from ``base``.

    ``version`` (the cipher) is only ever changed by tests, to write records as older versions did.
    """
    count = batch.num_rows
    plain = batch.serialize()
    body_length = plain.size + crypto.tag_bytes(version)
    if body_length > MAX_BODY_BYTES:  # the writer splits appends well below this
        raise ValueError("record too large")
    nonce = crypto.new_nonce()
    header = _RECORD.pack(RECORD_MAGIC, version, 0, 0, body_length, 0, base, count, min_ts, max_ts, nonce)
    body = crypto.encrypt_record(version, plain, _aad(header), nonce, key)
    crc = _crc(header, body)
    header = header[:12] + crc.to_bytes(4, "little") + header[16:]
    return Frame(header, body, RecordHeader(body_length, crc, base, count, min_ts, max_ts, nonce, version))


def parse_record_header(raw: bytes | memoryview) -> RecordHeader | None:
    """The header, or None if these bytes cannot start a record (wrong magic/version, absurd size)."""
    if len(raw) < RECORD_HEADER_BYTES:
        return None
    magic, version, flags, reserved, body_length, crc, base, count, min_ts, max_ts, nonce = _RECORD.unpack_from(raw)
    if (magic != RECORD_MAGIC or version not in RECORD_VERSIONS or flags != 0 or reserved != 0
            or body_length < crypto.tag_bytes(version) or body_length > MAX_BODY_BYTES or count == 0
            or base >= 1 << 63 or min_ts > max_ts):
        return None
    return RecordHeader(body_length, crc, base, count, min_ts, max_ts, bytes(nonce), version)


def header_bytes(header: RecordHeader) -> bytes:
    return _RECORD.pack(RECORD_MAGIC, header.version, 0, 0, header.body_length, header.crc, header.base_offset,
                        header.count, header.min_ts, header.max_ts, header.nonce)


def crc_ok(header: RecordHeader, body: pa.Buffer | bytes | memoryview) -> bool:
    raw = header_bytes(header)
    return _crc(raw[:12] + _ZERO_CRC + raw[16:], body) == header.crc


def decrypt_record(header: RecordHeader, body: pa.Buffer, key: bytes) -> pa.RecordBatch | None:
    """The batch, or None if authentication fails. ``body`` may be overwritten (v1 decrypts in place)."""
    if header.version == crypto.XCHACHA20_POLY1305 and not body.is_mutable:  # v1 decrypts in place
        body = pa.py_buffer(bytearray(body.to_pybytes()))
    aad = _AAD.pack(RECORD_MAGIC, header.version, 0, 0, header.body_length, header.base_offset, header.count,
                    header.min_ts, header.max_ts)  # == _aad(header_bytes(header)), in one call
    plain = crypto.decrypt_record(header.version, body, aad, header.nonce, key)
    if plain is None:
        return None
    batch = pa.ipc.read_record_batch(plain, JOURNAL_SCHEMA)
    if batch.num_rows != header.count:  # authentic but inconsistent: a bug, never silently accepted
        return None
    return batch


def encode_segment_header(base_offset: int, created_us: int) -> bytes:
    head = _SEGMENT.pack(SEGMENT_MAGIC, SEGMENT_VERSION, b"\0\0\0", base_offset, created_us, 0, b"\0\0\0\0")
    crc = zlib.crc32(head[:24]) & 0xFFFFFFFF
    return head[:24] + crc.to_bytes(4, "little") + head[28:]


def parse_segment_header(raw: bytes) -> tuple[int, int] | None:
    """(base offset, created_us), or None if these bytes are not an intact segment header."""
    if len(raw) < SEGMENT_HEADER_BYTES:
        return None
    magic, version, _, base, created, crc, _ = _SEGMENT.unpack_from(raw)
    if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION or crc != zlib.crc32(raw[:24]) & 0xFFFFFFFF:
        return None
    return base, created
