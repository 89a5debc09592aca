"""Bulk frames that would decompress past a bound are refused before anything is decompressed."""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable

import pyarrow as pa
import pytest

from zerocomm_spark import errors
from zerocomm_spark.client import DEFAULT_MAX_DECODED_BYTES, ipc_to_table, table_to_ipc
from zerocomm_spark.ipc_limits import _deref, _fields, _vector, check_decoded_size

MiB = 1 << 20


def _stream(tables: list[pa.Table], compression: str | None = None, deltas: bool = False) -> bytes:
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression, emit_dictionary_deltas=deltas)
    with pa.ipc.new_stream(sink, tables[0].schema, options=options) as writer:
        for table in tables:
            writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _zeros(columns: int, column_bytes: int) -> pa.Table:
    """``columns`` int64 columns of zeros, all over one buffer: big once decoded, cheap to build."""
    zeros = pa.py_buffer(bytes(column_bytes))
    array = pa.Array.from_buffers(pa.int64(), column_bytes // 8, [None, zeros])
    return pa.table({f"c{i}": array for i in range(columns)})


def _messages(frame: bytes) -> list[pa.ipc.Message]:
    reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(pa.py_buffer(frame)))
    return list(reader)


def _batch_layout(message: pa.ipc.Message) -> tuple[int, list[tuple[int, int]], list[tuple[int, int]], int]:
    """(length, nodes, buffers, where the buffers vector starts in the metadata) of a record batch message."""
    buf = memoryview(message.metadata).cast("B")
    size = len(buf)
    root = _deref(buf, size, 0)
    _, _, header, _, _ = _fields(buf, size, root, 5)
    batch = _deref(buf, size, root + header)
    length_at, nodes_at, buffers_at, _ = _fields(buf, size, batch, 4)
    length = struct.unpack_from("<q", buf, batch + length_at)[0]
    start, count = _vector(buf, size, _deref(buf, size, batch + nodes_at), 16)
    nodes = list(struct.iter_unpack("<qq", buf[start:start + 16 * count]))
    start, count = _vector(buf, size, _deref(buf, size, batch + buffers_at), 16)
    buffers = list(struct.iter_unpack("<qq", buf[start:start + 16 * count]))
    return length, nodes, buffers, start


def _frame(metadata: bytes, body: bytes) -> bytes:
    return struct.pack("<Ii", 0xFFFFFFFF, len(metadata)) + metadata + body


_EOS = struct.pack("<Ii", 0xFFFFFFFF, 0)


# --- the bound -----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_compressed_bomb_is_refused_before_decompressing(codec: str) -> None:
    frame = _stream([_zeros(128, 8 * MiB)], codec)  # 1 GiB of zeros once decompressed
    assert len(frame) < 8 * MiB
    pool = pa.default_memory_pool()
    peak, started = pool.max_memory(), time.monotonic()
    with pytest.raises(errors.BadRequestError, match=f"more than {DEFAULT_MAX_DECODED_BYTES} bytes once "
                                                     "decompressed") as info:
        ipc_to_table(frame)
    assert time.monotonic() - started < 1.0
    assert pool.max_memory() < max(peak, 16 * MiB) + 16 * MiB  # nothing near 1 GiB was ever allocated
    assert "api.max_request_bytes" in info.value.hint and "without IPC compression" in info.value.hint


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_compressed_stream_under_the_bound_reads_as_before(codec: str) -> None:
    table = _zeros(4, 2 * MiB)
    frame = _stream([table, table.slice(5, 1000)], codec)
    assert check_decoded_size(pa.py_buffer(frame), 64 * MiB) == 4 * 2 * MiB + 4 * 8000
    assert ipc_to_table(frame, max_bytes=64 * MiB).equals(pa.concat_tables([table, table.slice(5, 1000)]))
    with pytest.raises(errors.BadRequestError, match="once decompressed"):
        ipc_to_table(frame, max_bytes=4 * MiB)
    # Buffers too small to gain from compression are stored as they are (length prefix -1).
    small = pa.table({"payload": [b"a", None, b"ccc"], "n": [1, 2, 3]})
    assert ipc_to_table(_stream([small], codec), max_bytes=1024).equals(small)


def test_uncompressed_streams_count_their_bodies_and_always_fit_the_agents_bound() -> None:
    table = pa.table({"payload": [b"x" * 100] * 1000})
    frame = table_to_ipc(table)
    decoded = check_decoded_size(pa.py_buffer(frame), len(frame))
    assert 100_000 <= decoded <= len(frame)
    assert ipc_to_table(frame, max_bytes=len(frame)).equals(table)
    assert ipc_to_table(memoryview(frame)).equals(table)
    assert ipc_to_table(frame, max_bytes=None).equals(table)
    with pytest.raises(errors.BadRequestError, match="once decompressed"):
        ipc_to_table(frame, max_bytes=decoded - 1)


def test_a_stream_without_batches_is_empty() -> None:
    schema = pa.schema([("payload", pa.binary())])
    frame = _stream([schema.empty_table()])
    assert ipc_to_table(frame, max_bytes=0).num_rows == 0


# --- dictionaries --------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [None, "zstd", "lz4"])
def test_dictionary_batches_count_and_read(codec: str | None) -> None:
    first = pa.table({"d": pa.array(["a", "b", "a"] * 100).dictionary_encode()})
    second = pa.table({"d": pa.DictionaryArray.from_arrays(pa.array([0, 2, 1], pa.int32()),
                                                           pa.array(["a", "b", "c"]))})
    frame = _stream([first, second], codec, deltas=True)
    reader = pa.ipc.open_stream(frame)
    reader.read_all()
    assert reader.stats.num_dictionary_deltas == 1
    assert ipc_to_table(frame, max_bytes=1 * MiB).column("d").to_pylist() == ["a", "b", "a"] * 100 + ["a", "c", "b"]


def test_a_compressed_dictionary_bomb_is_refused() -> None:
    dictionary = _zeros(1, 64 * MiB).column(0).chunk(0)  # 64 MiB of zeros as dictionary values
    table = pa.table({"d": pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.int32()), dictionary)})
    frame = _stream([table], "zstd")
    assert len(frame) < 1 * MiB
    with pytest.raises(errors.BadRequestError, match="more than 16777216 bytes once decompressed"):
        ipc_to_table(frame, max_bytes=16 * MiB)


def test_delta_dictionaries_count_each_concatenation() -> None:
    # Each batch's dictionary extends the last one's: a delta of 1000 values (8000 bytes) per batch,
    # which pyarrow concatenates into a new dictionary for every batch: 8000 * (1 + 2 + ... + 50) bytes.
    values = pa.array(range(50_000), pa.int64())
    tables = [pa.table({"d": pa.DictionaryArray.from_arrays(pa.array([0, i], pa.int32()), values.slice(0, 1000 * i))})
              for i in range(1, 51)]
    frame = _stream(tables, deltas=True)
    reader = pa.ipc.open_stream(frame)
    expected = reader.read_all()
    assert reader.stats.num_dictionary_deltas == 49
    decoded = check_decoded_size(pa.py_buffer(frame), 1 << 40)
    assert decoded >= 8000 * (50 * 51 // 2)
    assert ipc_to_table(frame, max_bytes=decoded).equals(expected)
    with pytest.raises(errors.BadRequestError, match="once decompressed"):
        ipc_to_table(frame, max_bytes=2 * len(frame))  # the bodies alone fit; their concatenations do not


# --- Arrow 0.17's compression marker: a V4 message's custom metadata ------------------------------


def _legacy_metadata(length: int, nodes: list[tuple[int, int]], buffers: list[tuple[int, int]], body_length: int,
                     key: bytes = b"ARROW:experimental_compression") -> bytes:
    """A V4 RecordBatch message (no RecordBatch.compression) naming ZSTD in its custom metadata."""
    out = bytearray(4)

    def pad(align: int, extra: int = 0) -> None:
        while (len(out) + extra) % align:
            out.append(0)

    vt_message = len(out)
    out += struct.pack("<7H", 14, 24, 4, 6, 16, 8, 20)
    pad(8)
    message = len(out)
    out += struct.pack("<ihBxqII", message - vt_message, 3, 3, body_length, 0, 0)
    vt_batch = len(out)
    out += struct.pack("<5H", 10, 24, 8, 16, 20)
    pad(8)
    batch = len(out)
    out += struct.pack("<ixxxxqII", batch - vt_batch, length, 0, 0)
    pad(8, 4)
    node_vector = len(out)
    out += struct.pack("<I", len(nodes)) + b"".join(struct.pack("<qq", *n) for n in nodes)
    pad(8, 4)
    buffer_vector = len(out)
    out += struct.pack("<I", len(buffers)) + b"".join(struct.pack("<qq", *b) for b in buffers)
    pad(4)
    custom = len(out)
    out += struct.pack("<II", 1, 0)
    vt_pair = len(out)
    out += struct.pack("<4H", 8, 12, 4, 8)
    pair = len(out)
    out += struct.pack("<iII", pair - vt_pair, 0, 0)
    key_at = len(out)
    out += struct.pack("<I", len(key)) + key + b"\0"
    pad(4)
    value_at = len(out)
    out += struct.pack("<I", 4) + b"ZSTD\0"
    pad(8)
    for at, target in ((0, message), (message + 16, batch), (message + 20, custom), (batch + 16, node_vector),
                       (batch + 20, buffer_vector), (custom + 4, pair), (pair + 4, key_at), (pair + 8, value_at)):
        struct.pack_into("<I", out, at, target - at)
    return bytes(out)


def test_the_legacy_compression_marker_is_counted_as_pyarrow_reads_it() -> None:
    table = _zeros(1, 8 * MiB)
    schema_message, batch_message = _messages(_stream([table], "zstd"))
    length, nodes, buffers, _ = _batch_layout(batch_message)
    body = batch_message.body.to_pybytes()
    head = schema_message.serialize().to_pybytes()
    legacy = head + _frame(_legacy_metadata(length, nodes, buffers, len(body)), body) + _EOS
    assert pa.ipc.open_stream(legacy).read_all().equals(table)  # pyarrow does decompress it
    assert check_decoded_size(pa.py_buffer(legacy), 1 << 40) == 8 * MiB
    with pytest.raises(errors.BadRequestError, match="once decompressed"):
        ipc_to_table(legacy, max_bytes=1 * MiB)
    # Another key is just metadata: the body is then taken as stored.
    other = head + _frame(_legacy_metadata(length, nodes, buffers, len(body), key=b"ARROW:something_else"), body)
    assert check_decoded_size(pa.py_buffer(other + _EOS), 1 << 40) == len(body)


# --- malformed input -----------------------------------------------------------------------------


_Patch = Callable[[bytearray, bytearray, int], None]


def _patched(frame: bytes, message_index: int, patch: _Patch) -> bytes:
    """``frame`` with one message's metadata or body rewritten by ``patch(metadata, body, buffers_at)``."""
    messages = _messages(frame)
    out = b""
    for i, message in enumerate(messages):
        metadata = bytearray(message.metadata.to_pybytes())
        body = bytearray(message.body.to_pybytes() if message.body is not None else b"")
        if i == message_index:
            patch(metadata, body, _batch_layout(message)[3])
        out += _frame(bytes(metadata), bytes(body))
    return out + _EOS


# ``at``: where the batch's buffers vector starts; its second Buffer (the values) is at at + 16.
@pytest.mark.parametrize("damage, match", [
    (lambda meta, body, at: struct.pack_into("<q", meta, at + 16, 1 << 40), "not within"),  # offset
    (lambda meta, body, at: struct.pack_into("<q", meta, at + 16, -8), "not within"),
    (lambda meta, body, at: struct.pack_into("<q", meta, at + 24, 1 << 40), "not within"),  # length
    (lambda meta, body, at: struct.pack_into("<q", meta, at + 24, 4), "8-byte length prefix"),
    (lambda meta, body, at: struct.pack_into("<q", body, 0, -7), "negative length"),  # the length prefix
])
def test_inconsistent_compressed_metadata_is_a_bad_request(damage: _Patch, match: str) -> None:
    frame = _stream([_zeros(1, 1 * MiB)], "zstd")
    with pytest.raises(errors.BadRequestError, match=match):
        ipc_to_table(_patched(frame, 1, damage))


def test_truncated_and_garbled_streams_are_bad_requests() -> None:
    frame = _stream([_zeros(2, 64 * 1024), pa.table({"c0": [1], "c1": [2]})], "zstd")
    for cut in (3, 8, 20, len(frame) // 2, len(frame) - 9):
        with pytest.raises(errors.BadRequestError, match="not an Arrow IPC stream"):
            ipc_to_table(frame[:cut])
    with pytest.raises(errors.BadRequestError, match="not an Arrow IPC stream"):
        ipc_to_table(_frame(b"\xff" * 64, b""))
    rng = random.Random(5)
    for _ in range(3000):  # never anything but a table or a BadRequestError
        damaged = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(min(len(damaged), 1200))] = rng.randrange(256)
        try:
            ipc_to_table(bytes(damaged), max_bytes=4 * MiB)
        except errors.BadRequestError:
            pass
