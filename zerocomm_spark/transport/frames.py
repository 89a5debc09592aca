"""Wire codec of the peer transport: one ZeroMQ frame carries exactly one network message.

The message set follows the LibraNet v1 messaging protocol (Error, Ping, Pong, RpcRequest,
RpcResponse, DirectSend). ZeroMQ already frames messages, so there is no length prefix: byte 0 is
the message type, then fixed big-endian fields, then the opaque payload. Decoding is strict —
anything truncated, over-long or unknown raises :class:`FrameError` — because the listener answers
a bad frame with an Error instead of guessing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, TypeAlias

from zerocomm_spark.errors import FrameError, FrameFieldError

__all__ = [
    "MAX_U32",
    "DirectSend",
    "Error",
    "ErrorCode",
    "Message",
    "MessageType",
    "Ping",
    "Pong",
    "ProtocolId",
    "RpcRequest",
    "RpcResponse",
    "decode",
    "encode",
    "refused_request",
]

MAX_U32 = 0xFFFF_FFFF


class MessageType(IntEnum):
    """Byte 0 of every frame."""

    ERROR = 0
    PING = 1
    PONG = 2
    RPC_REQUEST = 3
    RPC_RESPONSE = 4
    DIRECT_SEND = 5


class ProtocolId(IntEnum):
    """Application protocols multiplexed over one transport; ids 3-255 are free for later use."""

    DIDCOMM = 0  # Aries RFC 0019 (DIDComm v1) envelopes
    GROUP_CONTROL = 1  # reserved for group membership and keys
    GROUP_DATA = 2  # reserved for group messages


class ErrorCode(IntEnum):
    """Why a frame was refused.

    LibraNet v1 defines only ParsingError and NotSupported. TooLarge and Internal are our
    extension, so a caller can tell "shrink the message" and "the peer's handler failed" apart
    from protocol mismatches instead of waiting for a timeout.
    """

    PARSING_ERROR = 0
    NOT_SUPPORTED = 1
    TOO_LARGE = 2  # extension
    INTERNAL = 3  # extension


def _check_u8(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0xFF:
        raise FrameFieldError(f"{name} must be an integer 0-255, got {value!r}")
    return value


def _check_u32(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_U32:
        raise FrameFieldError(f"{name} must be an integer 0 to 2**32-1, got {value!r}")
    return value


def _as_protocol(value: int) -> int:
    """Known ids become ProtocolId for readable logs; unknown ones stay ints so the listener can
    answer NotSupported instead of ParsingError."""
    try:
        return ProtocolId(value)
    except ValueError:
        return value


def _check_payload(obj: object, value: object) -> None:
    if isinstance(value, (bytearray, memoryview)):
        object.__setattr__(obj, "payload", bytes(value))
    elif not isinstance(value, bytes):
        raise FrameFieldError(f"payload must be bytes, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class Error:
    """A refusal of a received frame.

    ``head`` is the first two bytes of the refused frame (its type and, usually, its protocol id),
    as LibraNet does; ``request_id`` is our extension, present when the refused frame was an
    RpcRequest whose id could be read, so the caller fails fast with RemoteError.
    """

    TYPE: ClassVar[MessageType] = MessageType.ERROR
    code: ErrorCode
    head: bytes
    request_id: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "code", ErrorCode(self.code))
        except ValueError:
            raise FrameFieldError(f"unknown error code {self.code!r}") from None
        if not isinstance(self.head, bytes) or len(self.head) != 2:
            raise FrameFieldError("an Error's head must be exactly the first two bytes of the frame")
        if self.request_id is not None:
            _check_u32("request_id", self.request_id)


@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness probe; the nonce must come back in the Pong."""

    TYPE: ClassVar[MessageType] = MessageType.PING
    nonce: int

    def __post_init__(self) -> None:
        _check_u32("nonce", self.nonce)


@dataclass(frozen=True, slots=True)
class Pong:
    """Answer to a Ping, echoing its nonce."""

    TYPE: ClassVar[MessageType] = MessageType.PONG
    nonce: int

    def __post_init__(self) -> None:
        _check_u32("nonce", self.nonce)


@dataclass(frozen=True, slots=True)
class RpcRequest:
    """A request answered by exactly one RpcResponse (or Error) carrying the same request_id."""

    TYPE: ClassVar[MessageType] = MessageType.RPC_REQUEST
    protocol_id: int
    request_id: int
    priority: int
    payload: bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "protocol_id", _as_protocol(_check_u8("protocol_id", self.protocol_id)))
        _check_u32("request_id", self.request_id)
        _check_u8("priority", self.priority)
        _check_payload(self, self.payload)


@dataclass(frozen=True, slots=True)
class RpcResponse:
    """The answer to an RpcRequest; carries no protocol id, the request id is enough."""

    TYPE: ClassVar[MessageType] = MessageType.RPC_RESPONSE
    request_id: int
    priority: int
    payload: bytes

    def __post_init__(self) -> None:
        _check_u32("request_id", self.request_id)
        _check_u8("priority", self.priority)
        _check_payload(self, self.payload)


@dataclass(frozen=True, slots=True)
class DirectSend:
    """A one-way message: no answer, no delivery guarantee beyond ZeroMQ's."""

    TYPE: ClassVar[MessageType] = MessageType.DIRECT_SEND
    protocol_id: int
    priority: int
    payload: bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "protocol_id", _as_protocol(_check_u8("protocol_id", self.protocol_id)))
        _check_u8("priority", self.priority)
        _check_payload(self, self.payload)


Message: TypeAlias = Error | Ping | Pong | RpcRequest | RpcResponse | DirectSend

# Headers, type byte included. Big-endian throughout ("network order").
_ERROR = struct.Struct(">BB2s")
_ERROR_RID = struct.Struct(">BB2sI")
_NONCE = struct.Struct(">BI")
_RPC_REQUEST = struct.Struct(">BBIB")
_RPC_RESPONSE = struct.Struct(">BIB")
_DIRECT_SEND = struct.Struct(">BBB")
_ERROR_CODES = frozenset(int(c) for c in ErrorCode)


def encode(msg: Message) -> bytes:
    """One message as the bytes of one ZeroMQ frame."""
    if isinstance(msg, RpcRequest):
        return _RPC_REQUEST.pack(msg.TYPE, msg.protocol_id, msg.request_id, msg.priority) + msg.payload
    if isinstance(msg, RpcResponse):
        return _RPC_RESPONSE.pack(msg.TYPE, msg.request_id, msg.priority) + msg.payload
    if isinstance(msg, DirectSend):
        return _DIRECT_SEND.pack(msg.TYPE, msg.protocol_id, msg.priority) + msg.payload
    if isinstance(msg, (Ping, Pong)):
        return _NONCE.pack(msg.TYPE, msg.nonce)
    if isinstance(msg, Error):
        if msg.request_id is None:
            return _ERROR.pack(msg.TYPE, msg.code, msg.head)
        return _ERROR_RID.pack(msg.TYPE, msg.code, msg.head, msg.request_id)
    raise FrameFieldError(f"not a wire message: {type(msg).__name__}")


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse one frame, raising FrameError on anything that is not exactly a valid message."""
    view = data if isinstance(data, bytes) else memoryview(data).cast("B")
    size = len(view)
    if size == 0:
        raise FrameError("empty frame")
    kind = view[0]
    if kind == MessageType.RPC_REQUEST:
        _need(size, _RPC_REQUEST.size, "RpcRequest")
        _, pid, rid, prio = _RPC_REQUEST.unpack_from(view)
        return RpcRequest(pid, rid, prio, bytes(view[_RPC_REQUEST.size :]))
    if kind == MessageType.RPC_RESPONSE:
        _need(size, _RPC_RESPONSE.size, "RpcResponse")
        _, rid, prio = _RPC_RESPONSE.unpack_from(view)
        return RpcResponse(rid, prio, bytes(view[_RPC_RESPONSE.size :]))
    if kind == MessageType.DIRECT_SEND:
        _need(size, _DIRECT_SEND.size, "DirectSend")
        _, pid, prio = _DIRECT_SEND.unpack_from(view)
        return DirectSend(pid, prio, bytes(view[_DIRECT_SEND.size :]))
    if kind in (MessageType.PING, MessageType.PONG):
        name = "Ping" if kind == MessageType.PING else "Pong"
        if size != _NONCE.size:
            raise FrameError(f"a {name} frame is {_NONCE.size} bytes, got {size}")
        _, nonce = _NONCE.unpack_from(view)
        return Ping(nonce) if kind == MessageType.PING else Pong(nonce)
    if kind == MessageType.ERROR:
        if size == _ERROR.size:
            _, code, head = _ERROR.unpack_from(view)
            rid = None
        elif size == _ERROR_RID.size:
            _, code, head, rid = _ERROR_RID.unpack_from(view)
        else:
            raise FrameError(f"an Error frame is {_ERROR.size} or {_ERROR_RID.size} bytes, got {size}")
        if code not in _ERROR_CODES:
            raise FrameError(f"unknown error code {code} in an Error frame")
        return Error(ErrorCode(code), head, rid)
    raise FrameError(f"unknown message type {kind}")


def _need(size: int, header: int, name: str) -> None:
    if size < header:
        raise FrameError(f"truncated {name}: {size} bytes, its header alone is {header}")


def refused_request(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """(code, request_id) of an Error frame with a request id, whatever its code; None otherwise.

    decode() refuses codes it does not know; this lets the caller still fail the request the frame
    refuses (a newer peer may send codes this version lacks) instead of waiting for its deadline.
    """
    view = data if isinstance(data, bytes) else memoryview(data).cast("B")
    if len(view) != _ERROR_RID.size or view[0] != MessageType.ERROR:
        return None
    _, code, _, rid = _ERROR_RID.unpack_from(view)
    return code, rid
