"""The wire codec: exact byte layouts, round trips and strict refusal of malformed frames."""

from __future__ import annotations

import struct

import pytest

from zerocomm_spark.errors import FrameError, FrameFieldError
from zerocomm_spark.transport.frames import (
    MAX_U32,
    DirectSend,
    Error,
    ErrorCode,
    MessageType,
    Ping,
    Pong,
    ProtocolId,
    RpcRequest,
    RpcResponse,
    decode,
    encode,
)

ROUND_TRIP = [
    Error(ErrorCode.PARSING_ERROR, b"\x09\x00"),
    Error(ErrorCode.NOT_SUPPORTED, b"\x03\x07", request_id=42),
    Error(ErrorCode.TOO_LARGE, b"\x05\x00"),
    Error(ErrorCode.INTERNAL, b"\x03\x00", request_id=MAX_U32),
    Ping(0),
    Ping(MAX_U32),
    Pong(123456789),
    RpcRequest(ProtocolId.DIDCOMM, 7, 128, b'{"protected": "..."}'),
    RpcRequest(200, MAX_U32, 255, b""),
    RpcResponse(7, 0, b"\x00\x01\x02"),
    RpcResponse(0, 255, b""),
    DirectSend(ProtocolId.GROUP_DATA, 10, b"x" * 1000),
    DirectSend(ProtocolId.GROUP_CONTROL, 0, b""),
]


@pytest.mark.parametrize("msg", ROUND_TRIP, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    data = encode(msg)  # type: ignore[arg-type]
    assert data[0] == type(msg).TYPE  # type: ignore[attr-defined]
    assert decode(data) == msg
    assert decode(bytearray(data)) == msg
    assert decode(memoryview(data)) == msg


def test_exact_layouts_are_big_endian() -> None:
    assert encode(RpcRequest(1, 0x01020304, 9, b"PL")) == b"\x03\x01\x01\x02\x03\x04\x09PL"
    assert encode(RpcResponse(0x0A0B0C0D, 3, b"R")) == b"\x04\x0a\x0b\x0c\x0d\x03R"
    assert encode(DirectSend(2, 200, b"D")) == b"\x05\x02\xc8D"
    assert encode(Ping(1)) == b"\x01\x00\x00\x00\x01"
    assert encode(Pong(0xFFFFFFFE)) == b"\x02\xff\xff\xff\xfe"
    assert encode(Error(ErrorCode.NOT_SUPPORTED, b"\x03\x07")) == b"\x00\x01\x03\x07"
    assert encode(Error(ErrorCode.INTERNAL, b"\x03\x00", 5)) == b"\x00\x03\x03\x00\x00\x00\x00\x05"


def test_known_protocol_ids_decode_to_the_enum_and_unknown_stay_ints() -> None:
    known = decode(encode(DirectSend(0, 1, b"")))
    assert isinstance(known, DirectSend) and known.protocol_id is ProtocolId.DIDCOMM
    unknown = decode(encode(RpcRequest(77, 1, 1, b"")))
    assert isinstance(unknown, RpcRequest)
    assert unknown.protocol_id == 77 and not isinstance(unknown.protocol_id, ProtocolId)


def test_payload_may_carry_any_bytes_including_headers_of_other_types() -> None:
    inner = encode(Ping(5))
    msg = decode(encode(DirectSend(0, 1, inner)))
    assert isinstance(msg, DirectSend) and msg.payload == inner


MALFORMED = {
    "empty": b"",
    "unknown type": b"\x09\x00\x00",
    "unknown type 255": b"\xff" * 10,
    "truncated rpc request": b"\x03\x00\x00\x00\x01",
    "rpc request header minus one": b"\x03\x00\x00\x00\x00\x01",
    "truncated rpc response": b"\x04\x00\x00\x01",
    "truncated direct send": b"\x05\x00",
    "type byte only": b"\x03",
    "short ping": b"\x01\x00\x00\x01",
    "long ping": b"\x01\x00\x00\x00\x01\x00",
    "short pong": b"\x02\x00",
    "short error": b"\x00\x01\x03",
    "error with partial request id": b"\x00\x01\x03\x00\x00\x00",
    "over-long error": b"\x00\x01\x03\x00\x00\x00\x00\x01\x00",
    "unknown error code": b"\x00\x09\x03\x00",
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_frames_raise_frame_error(data: bytes) -> None:
    with pytest.raises(FrameError):
        decode(data)


def test_frame_error_is_not_raised_for_the_minimal_valid_frames() -> None:
    assert decode(b"\x03\x00\x00\x00\x00\x00\x00") == RpcRequest(0, 0, 0, b"")
    assert decode(b"\x04\x00\x00\x00\x00\x00") == RpcResponse(0, 0, b"")
    assert decode(b"\x05\x00\x00") == DirectSend(0, 0, b"")


@pytest.mark.parametrize(
    "build",
    [
        lambda: RpcRequest(0, 1, 256, b""),
        lambda: RpcRequest(0, 1, -1, b""),
        lambda: RpcRequest(256, 1, 1, b""),
        lambda: RpcRequest(0, MAX_U32 + 1, 1, b""),
        lambda: RpcRequest(0, 1, True, b""),
        lambda: RpcResponse(-1, 1, b""),
        lambda: RpcResponse(1, 300, b""),
        lambda: DirectSend(0, 1000, b""),
        lambda: DirectSend(0, 1, "text"),
        lambda: Ping(-5),
        lambda: Pong(2**32),
        lambda: Error(7, b"\x00\x00"),
        lambda: Error(ErrorCode.INTERNAL, b"\x03"),
        lambda: Error(ErrorCode.INTERNAL, b"\x03\x00", -1),
    ],
)
def test_out_of_range_fields_are_refused_at_construction(build) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FrameFieldError):
        build()


def test_field_errors_are_value_errors_too() -> None:
    with pytest.raises(ValueError):
        DirectSend(0, 256, b"")


def test_bytearray_payload_is_frozen_to_bytes() -> None:
    buf = bytearray(b"abc")
    msg = DirectSend(0, 1, buf)  # type: ignore[arg-type]
    buf[0] = 0
    assert msg.payload == b"abc" and isinstance(msg.payload, bytes)


def test_message_types_match_libranet_numbering() -> None:
    assert [int(t) for t in MessageType] == [0, 1, 2, 3, 4, 5]
    assert struct.unpack(">B", encode(Pong(1))[:1])[0] == MessageType.PONG
