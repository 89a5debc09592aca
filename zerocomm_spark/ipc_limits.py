"""How many bytes an Arrow IPC stream takes once read, worked out before pyarrow decompresses anything.

Why: Arrow IPC record and dictionary batches may be compressed (LZ4_FRAME or ZSTD, buffer by buffer)
and pyarrow decompresses them while reading, allocating each buffer at the size the stream declares.
A bulk frame well under ``api.max_request_bytes`` could so expand to gigabytes and take the agent
down. :func:`check_decoded_size` reads the stream message by message (pyarrow's own
``MessageReader``, so the framing is exactly what ``open_stream`` reads afterwards from the same
bytes), parses just enough of each message's flatbuffer metadata (``format/Message.fbs``) and
refuses the stream with a :class:`BadRequestError` once its decoded size passes the bound.

What counts, per record or dictionary batch:

* uncompressed: the body's length (its buffers are slices of the frame, so this over-counts);
* compressed (``RecordBatch.compression``, or the 0.17-era ``ARROW:experimental_compression``
  custom metadata that pyarrow still honours on V4 messages): each listed buffer's uncompressed
  length, the little-endian int64 that prefixes it in the body (-1: stored as is, its own length).
  Every listed buffer counts, each time it is listed, whether or not a column uses it;
* delta dictionaries: pyarrow keeps a dictionary's parts apart and concatenates them when the next
  record batch needs the dictionary, so each such batch counts the whole dictionary again (many
  small deltas interleaved with batches would otherwise grow quadratically).

The reads are bounds-checked and anything inconsistent is a BadRequestError, never an IndexError
or struct.error. pyarrow verifies each flatbuffer before handing the message over, so this is a
second line. Costs a few microseconds per message; nothing is copied.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from zerocomm_spark.errors import BadRequestError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["DECODED_BYTES_FACTOR", "check_decoded_size", "input_errors"]

#: A bulk frame may decode to this many times the request size limit (uncompressed, it is at most 1x).
DECODED_BYTES_FACTOR = 4

_NOT_IPC = "the bulk frame is not an Arrow IPC stream"
_TOO_BIG_HINT = ("Split the batch into smaller ones, or write it without IPC compression: the agent takes a "
                 f"bulk frame that decodes to at most {DECODED_BYTES_FACTOR} x api.max_request_bytes")

# Message.fbs: union MessageHeader { Schema, DictionaryBatch, RecordBatch, Tensor, SparseTensor }
_DICTIONARY_BATCH, _RECORD_BATCH = 2, 3
_V4 = 3  # Schema.fbs: enum MetadataVersion { V1, V2, V3, V4, V5 }
_LEGACY_COMPRESSION_KEY = b"ARROW:experimental_compression"

_I16 = struct.Struct("<h").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I64 = struct.Struct("<q").unpack_from
_BUFFER = struct.Struct("<qq")  # struct Buffer { offset: long; length: long; }
_SLOTS = [struct.Struct(f"<{n}H").unpack_from for n in range(6)]


class _Malformed(Exception):
    """Metadata that points outside itself or says something impossible."""


# Bounds-checked reads of a flatbuffer (``buf``, ``size`` its length). A table starts with an int32:
# its vtable's distance back; the vtable holds uint16s: its own size, the table's, then per field the
# field's offset within the table (0: absent, the default applies). Offsets to tables, vectors and
# strings are uint32s relative to where they are stored; a vector or string starts with its length.


def _outside() -> _Malformed:
    return _Malformed("the message metadata points outside itself")


def _fields(buf: memoryview, size: int, table: int, count: int) -> tuple[int, ...]:
    """The offsets of the first ``count`` fields of the table at ``table`` (0 for an absent field)."""
    if table < 0 or table + 4 > size:
        raise _outside()
    vtable = table - _I32(buf, table)[0]
    if vtable < 0 or vtable + 4 > size:
        raise _outside()
    have = min(count, max(0, (_U16(buf, vtable)[0] - 4) // 2))
    if vtable + 4 + 2 * have > size:
        raise _outside()
    return _SLOTS[have](buf, vtable + 4) + (0,) * (count - have)


def _deref(buf: memoryview, size: int, pos: int) -> int:
    """Where the uoffset stored at ``pos`` points."""
    if pos < 0 or pos + 4 > size:
        raise _outside()
    return pos + int(_U32(buf, pos)[0])


def _vector(buf: memoryview, size: int, pos: int, width: int) -> tuple[int, int]:
    """(start, count) of the vector (or string, ``width`` 1) at ``pos``."""
    if pos < 0 or pos + 4 > size:
        raise _outside()
    count = int(_U32(buf, pos)[0])
    if pos + 4 + count * width > size:
        raise _outside()
    return pos + 4, count


def _legacy_compressed(buf: memoryview, size: int, message: int, custom_metadata: int) -> bool:
    """Whether a message names a codec in its custom metadata (how Arrow 0.17 marked compression)."""
    if not custom_metadata:
        return False
    start, count = _vector(buf, size, _deref(buf, size, message + custom_metadata), 4)
    for i in range(count):
        pair = _deref(buf, size, start + 4 * i)  # table KeyValue { key: string; value: string; }
        (key,) = _fields(buf, size, pair, 1)
        if key:
            first, length = _vector(buf, size, _deref(buf, size, pair + key), 1)
            if buf[first:first + length] == _LEGACY_COMPRESSION_KEY:
                return True
    return False


def _batch_bytes(buf: memoryview, size: int, batch: int, body: "pa.Buffer | None", legacy: bool, limit: int) -> int:
    """Bytes the RecordBatch table at ``batch`` takes once its body is read (decompressed)."""
    # table RecordBatch { length: long; nodes: [FieldNode]; buffers: [Buffer]; compression: BodyCompression; ...}
    _, _, buffers, compression = _fields(buf, size, batch, 4)
    end = body.size if body is not None else 0
    if not compression and not legacy:
        return end
    if not buffers:
        return 0
    start, count = _vector(buf, size, _deref(buf, size, batch + buffers), _BUFFER.size)
    total = 0
    for offset, length in _BUFFER.iter_unpack(buf[start:start + count * _BUFFER.size]):
        if length == 0:
            continue
        if offset < 0 or length < 8 or offset + length > end:
            raise _Malformed(f"a compressed buffer (offset {offset}, length {length}) is not within the "
                             f"{end}-byte message body or lacks its 8-byte length prefix")
        declared = int(_I64(body, offset)[0])
        if declared == -1:  # stored uncompressed
            total += length - 8
        elif declared < 0:
            raise _Malformed(f"a compressed buffer declares a negative length ({declared})")
        else:
            total += declared
        if total > limit:
            break  # enough to refuse
    return total


def input_errors() -> tuple[type[BaseException], ...]:
    """What pyarrow raises on a malformed stream (a field name that is not UTF-8 included): a bad request."""
    import pyarrow as pa

    return (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, pa.ArrowKeyError, pa.ArrowIndexError,
            pa.ArrowCapacityError, pa.ArrowIOError, OSError, UnicodeDecodeError)


def check_decoded_size(source: "pa.Buffer", max_bytes: int) -> int:
    """The bytes the Arrow IPC stream in ``source`` takes once read; BadRequestError past ``max_bytes``.

    Also a BadRequestError for a stream whose framing or metadata is malformed. Reads no further
    than the end-of-stream marker, as ``pyarrow.ipc.open_stream`` does.
    """
    import pyarrow as pa

    try:
        reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(source))
        total = 0
        dictionaries: dict[int, int] = {}  # dictionary id -> its size, deltas included
        pending: set[int] = set()  # ids with deltas not yet concatenated
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                return total
            buf = memoryview(message.metadata).cast("B")
            size = len(buf)
            root = _deref(buf, size, 0)
            # table Message { version: MetadataVersion (short); header: MessageHeader (a ubyte type
            # and an offset); bodyLength: long; custom_metadata: [KeyValue]; }
            version, kind_at, header_at, _, custom_metadata = _fields(buf, size, root, 5)
            if root + kind_at >= size:
                raise _outside()
            kind = buf[root + kind_at] if kind_at else 0  # 0: NONE
            if kind != _RECORD_BATCH and kind != _DICTIONARY_BATCH:
                continue  # no body to decode (a schema), or one pyarrow refuses in a stream
            if not header_at:
                raise _Malformed("a batch message has no header")
            header = _deref(buf, size, root + header_at)
            body = message.body
            legacy = False
            if custom_metadata:  # only on V4 messages without RecordBatch.compression, as pyarrow does
                if not version or root + version + 2 > size:
                    legacy_version = 0
                else:
                    legacy_version = int(_I16(buf, root + version)[0])
                legacy = legacy_version == _V4 and _legacy_compressed(buf, size, root, custom_metadata)
            if kind == _RECORD_BATCH:
                total += _batch_bytes(buf, size, header, body, legacy, max_bytes - total)
                for ident in pending:  # concatenated for this batch
                    total += dictionaries[ident]
                pending.clear()
            else:
                # table DictionaryBatch { id: long; data: RecordBatch; isDelta: bool = false; }
                id_at, data_at, delta_at = _fields(buf, size, header, 3)
                if not data_at:
                    raise _Malformed("a dictionary batch has no data")
                if (id_at and header + id_at + 8 > size) or header + delta_at >= size:
                    raise _outside()
                ident = int(_I64(buf, header + id_at)[0]) if id_at else 0
                is_delta = bool(buf[header + delta_at]) if delta_at else False
                data = _deref(buf, size, header + data_at)
                batch_size = _batch_bytes(buf, size, data, body, legacy, max_bytes - total)
                total += batch_size
                if is_delta:
                    dictionaries[ident] = dictionaries.get(ident, 0) + batch_size
                    pending.add(ident)
                else:
                    dictionaries[ident] = batch_size
                    pending.discard(ident)
            if total > max_bytes:
                raise BadRequestError(f"the bulk frame's Arrow IPC stream would take more than {max_bytes} bytes "
                                      f"once decompressed (at least {total}); it was not read",
                                      hint=_TOO_BIG_HINT)
    except _Malformed as exc:
        raise BadRequestError(f"{_NOT_IPC}: {exc}") from None
    except input_errors() as exc:
        raise BadRequestError(f"{_NOT_IPC}: {str(exc)[:200]}") from None
