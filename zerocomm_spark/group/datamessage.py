"""Plaintexts of the group data plane: a *batch* of data messages per envelope, and its control messages.

Crypto dominates the cost of a small message (an envelope wraps its key for every recipient), so a
publisher packs everything queued for a group into one ``data-batch`` and pays that cost per batch.
Control messages travel in envelopes too, so they are authenticated like data:

* ``data-batch``  publisher -> members (XPUB), or one member (resend answer / push): the messages.
* ``data-hello``  publisher -> one member on the data path, until acked (proves its SUB is connected).
* ``data-ack``    member -> publisher (DirectSend): highest contiguous seq delivered (+ hello nonce).
* ``data-resend`` member -> publisher (RPC): "resend seq a..b"; answered with a ``data-batch``.

Decoding validates every field and raises :class:`MalformedDataMessageError` naming the field
(never its value: values may be payloads). Payloads are base64 inside the JSON.
"""

from __future__ import annotations

import binascii
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, NamedTuple, TypeAlias

from zerocomm_spark.errors import MalformedDataMessageError

__all__ = [
    "ACK",
    "DATA_BATCH",
    "HELLO",
    "MAX_BATCH_MESSAGES",
    "MAX_HEADERS",
    "MAX_ID_LENGTH",
    "MAX_SEQ",
    "PROTOCOL",
    "RESEND",
    "Ack",
    "ControlMessage",
    "DataBatch",
    "DataMessage",
    "Hello",
    "ResendRequest",
    "decode",
    "decode_batch",
    "encode",
]

PROTOCOL = "https://didcomm.org/zerocomm-group/1.0"
DATA_BATCH = f"{PROTOCOL}/data-batch"
HELLO = f"{PROTOCOL}/data-hello"
ACK = f"{PROTOCOL}/data-ack"
RESEND = f"{PROTOCOL}/data-resend"

MAX_BATCH_MESSAGES = 65_536
MAX_ID_LENGTH = 256
MAX_HEADERS = 64
MAX_HEADER_LENGTH = 4096
MAX_SEQ = 2**63 - 1

_b64encode = binascii.b2a_base64
_b64decode = binascii.a2b_base64
_json_str = encode_basestring_ascii
_INF = math.inf


class DataMessage(NamedTuple):
    """One application message inside a batch. ``seq`` is per (group, publisher), from 1, contiguous.

    A NamedTuple rather than a frozen dataclass: one is built per message on both sides, and a
    tuple is several times cheaper to create.
    """

    id: str
    seq: int
    lamport: int
    sent_at: float
    payload: bytes
    headers: Mapping[str, str] | None = None

    def __repr__(self) -> str:  # payloads never appear in reprs or logs
        return f"DataMessage(id={self.id!r}, seq={self.seq}, lamport={self.lamport}, {len(self.payload)} bytes)"


@dataclass(frozen=True, slots=True)
class DataBatch:
    """Messages of one publisher in one group, ascending by seq.

    Resend answers add ``base`` (the last seq the asking member is *not* owed: its stream starts
    after it), ``last`` (the publisher's highest seq so far) and ``gone`` (an inclusive seq range the
    publisher no longer holds, which the member must skip).
    """

    group: str
    publisher: str
    messages: tuple[DataMessage, ...]
    base: int | None = None
    last: int | None = None
    gone: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Hello:
    """Probe sent on the data path; ``base`` tells a new subscriber where its stream starts."""

    group: str
    publisher: str
    subscriber: str
    nonce: str
    base: int
    last: int


@dataclass(frozen=True, slots=True)
class Ack:
    """``member`` has delivered ``publisher``'s messages up to ``seq`` (contiguously)."""

    group: str
    publisher: str
    member: str
    seq: int
    nonce: str | None = None


@dataclass(frozen=True, slots=True)
class ResendRequest:
    """``member`` asks ``publisher`` for seqs ``first``..``last`` (``last`` None: up to the newest)."""

    group: str
    publisher: str
    member: str
    first: int
    last: int | None = None


ControlMessage: TypeAlias = DataBatch | Hello | Ack | ResendRequest


# --- encoding ----------------------------------------------------------------------------------


def _dumps(obj: dict[str, Any]) -> bytes:
    # ASCII JSON: non-ASCII header text is \u-escaped, so the bytes are valid in any agent.
    return json.dumps(obj, separators=(",", ":"), check_circular=False).encode("ascii")


def encode_messages(messages: Sequence[DataMessage]) -> str:
    """The JSON array of messages; built directly (it is the publisher's per-message cost) and
    reusable across the per-member envelopes of one batch."""
    parts = []
    append = parts.append
    for m in messages:
        payload = _b64encode(m.payload, newline=False).decode("ascii")
        head = (f'{{"id":{_json_str(m.id)},"seq":{m.seq:d},"lamport":{m.lamport:d},'
                f'"sent_at":{float(m.sent_at)!r},"payload":"{payload}"')
        if m.headers:
            append(f'{head},"headers":{_dumps(dict(m.headers)).decode("ascii")}}}')
        else:
            append(head + "}")
    return "[" + ",".join(parts) + "]"


def encode(msg: ControlMessage, *, encoded_messages: str | None = None) -> bytes:
    """The UTF-8 JSON plaintext of a data-plane message, ready for ``envelope.pack``.

    ``encoded_messages`` (from :func:`encode_messages`) replaces ``msg.messages`` so one batch is
    serialised once for all its envelopes.
    """
    if isinstance(msg, DataBatch):
        head: dict[str, Any] = {"@type": DATA_BATCH, "@id": uuid.uuid4().hex, "group": msg.group,
                                "publisher": msg.publisher}
        if msg.base is not None:
            head["base"] = msg.base
        if msg.last is not None:
            head["last"] = msg.last
        if msg.gone is not None:
            head["gone"] = list(msg.gone)
        array = encoded_messages if encoded_messages is not None else encode_messages(msg.messages)
        return _dumps(head)[:-1] + b',"messages":' + array.encode("ascii") + b"}"
    if isinstance(msg, Hello):
        return _dumps({"@type": HELLO, "group": msg.group, "publisher": msg.publisher,
                       "subscriber": msg.subscriber, "nonce": msg.nonce, "base": msg.base, "last": msg.last})
    if isinstance(msg, Ack):
        body = {"@type": ACK, "group": msg.group, "publisher": msg.publisher, "member": msg.member, "seq": msg.seq}
        if msg.nonce is not None:
            body["nonce"] = msg.nonce
        return _dumps(body)
    if isinstance(msg, ResendRequest):
        return _dumps({"@type": RESEND, "group": msg.group, "publisher": msg.publisher,
                       "member": msg.member, "from": msg.first, "to": msg.last})
    raise TypeError(f"not a data-plane message: {type(msg).__name__}")


# --- decoding ----------------------------------------------------------------------------------


def _bad(what: str) -> MalformedDataMessageError:
    return MalformedDataMessageError(f"invalid group data message: {what}")


def _str(obj: Mapping[str, Any], key: str, where: str, *, max_len: int = 4096) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise _bad(f"{where}{key!r} must be a non-empty string of at most {max_len} characters")
    return value


def _int(obj: Mapping[str, Any], key: str, where: str, *, low: int = 0, optional: bool = False) -> int | None:
    value = obj.get(key)
    if value is None and optional:
        return None
    if type(value) is not int or not low <= value <= MAX_SEQ:
        raise _bad(f"{where}{key!r} must be an integer from {low} to 2**63-1")
    return value


def _headers(value: Any, where: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_HEADERS:
        raise _bad(f"{where}'headers' must be an object of at most {MAX_HEADERS} entries")
    for k, v in value.items():
        if not isinstance(v, str) or not k or len(k) > MAX_HEADER_LENGTH or len(v) > MAX_HEADER_LENGTH:
            raise _bad(f"{where}'headers' must map non-empty strings to strings (each at most {MAX_HEADER_LENGTH})")
    return value


def _messages(items: list[Any]) -> tuple[DataMessage, ...]:
    """Validate and convert a batch's messages, checking strictly ascending seqs.

    The hot path of every receiver: one loop, direct indexing and exact type checks; only when an
    item fails does the slower code run that names the wrong field.
    """
    out: list[DataMessage] = []
    append = out.append
    b64 = _b64decode
    make = tuple.__new__
    cls = DataMessage
    prev = 0
    for i, item in enumerate(items):
        try:
            mid = item["id"]
            seq = item["seq"]
            lamport = item["lamport"]
            sent_at = item["sent_at"]
            payload = item["payload"]
            if (type(mid) is str and type(seq) is int and type(lamport) is int and type(payload) is str
                    and prev < seq <= MAX_SEQ and 0 <= lamport <= MAX_SEQ and 0 < len(mid) <= MAX_ID_LENGTH
                    and (type(sent_at) is float or type(sent_at) is int) and 0 <= sent_at < _INF):
                headers = item.get("headers") if len(item) > 5 else None
                if headers is not None:
                    headers = _headers(headers, f"messages[{i}].")
                append(make(cls, (mid, seq, lamport, sent_at if type(sent_at) is float else float(sent_at),
                                  b64(payload, strict_mode=True), headers)))
                prev = seq
                continue
        except (KeyError, TypeError, AttributeError):
            pass
        except (binascii.Error, ValueError):
            raise _bad(f"messages[{i}].'payload' is not valid base64") from None
        m = _message_checked(item, i)
        if m.seq <= prev:
            raise _bad("'messages' must be in strictly ascending seq order")
        append(m)
        prev = m.seq
    return tuple(out)


def _message_checked(item: Any, index: int) -> DataMessage:
    """The slow path: find the first invalid field and say which."""
    if not isinstance(item, dict):
        raise _bad(f"messages[{index}] must be an object")
    where = f"messages[{index}]."
    mid = item.get("id")
    if type(mid) is not str or not mid or len(mid) > MAX_ID_LENGTH:
        raise _bad(f"{where}'id' must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    seq = item.get("seq")
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise _bad(f"{where}'seq' must be an integer from 1 to 2**63-1")
    lamport = item.get("lamport")
    if type(lamport) is not int or not 0 <= lamport <= MAX_SEQ:
        raise _bad(f"{where}'lamport' must be an integer from 0 to 2**63-1")
    sent_at = item.get("sent_at")
    if (type(sent_at) is not float and type(sent_at) is not int) or not math.isfinite(sent_at) or sent_at < 0:
        raise _bad(f"{where}'sent_at' must be a non-negative number of epoch seconds")
    payload = item.get("payload")
    if type(payload) is not str:
        raise _bad(f"{where}'payload' must be a base64 string")
    try:
        raw = _b64decode(payload, strict_mode=True)
    except (binascii.Error, ValueError):
        raise _bad(f"{where}'payload' is not valid base64") from None
    return DataMessage(mid, seq, lamport, float(sent_at), raw, _headers(item.get("headers"), where))


def decode_batch(data: bytes | str | dict[str, Any]) -> DataBatch:
    """A validated data-batch; MalformedDataMessageError if any field is wrong."""
    msg = decode(data)
    if not isinstance(msg, DataBatch):
        raise _bad("expected a data-batch")
    return msg


def _load(data: bytes | str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(data, dict):
        return data
    try:
        obj = json.loads(data)
    except (ValueError, TypeError, RecursionError):
        raise _bad("the plaintext is not JSON") from None
    if not isinstance(obj, dict):
        raise _bad("the plaintext is not a JSON object")
    return obj


def decode(data: bytes | str | dict[str, Any]) -> ControlMessage:
    """Decode any data-plane message by its ``@type``; MalformedDataMessageError if invalid."""
    obj = _load(data)
    kind = obj.get("@type")
    if kind == DATA_BATCH:
        group = _str(obj, "group", "")
        publisher = _str(obj, "publisher", "")
        items = obj.get("messages")
        if not isinstance(items, list) or len(items) > MAX_BATCH_MESSAGES:
            raise _bad(f"'messages' must be a list of at most {MAX_BATCH_MESSAGES} messages")
        messages = _messages(items)
        base = _int(obj, "base", "", optional=True)
        last = _int(obj, "last", "", optional=True)
        gone_raw = obj.get("gone")
        gone: tuple[int, int] | None = None
        if gone_raw is not None:
            if (not isinstance(gone_raw, list) or len(gone_raw) != 2
                    or any(type(v) is not int for v in gone_raw) or not 1 <= gone_raw[0] <= gone_raw[1] <= MAX_SEQ):
                raise _bad("'gone' must be a [first, last] seq range with 1 <= first <= last")
            gone = (gone_raw[0], gone_raw[1])
        return DataBatch(group, publisher, messages, base, last, gone)
    if kind == HELLO:
        return Hello(_str(obj, "group", ""), _str(obj, "publisher", ""), _str(obj, "subscriber", ""),
                     _str(obj, "nonce", "", max_len=128), _int(obj, "base", ""), _int(obj, "last", ""))  # type: ignore[arg-type]
    if kind == ACK:
        nonce = obj.get("nonce")
        if nonce is not None and (not isinstance(nonce, str) or not nonce or len(nonce) > 128):
            raise _bad("'nonce' must be a non-empty string of at most 128 characters")
        return Ack(_str(obj, "group", ""), _str(obj, "publisher", ""), _str(obj, "member", ""),
                   _int(obj, "seq", ""), nonce)  # type: ignore[arg-type]
    if kind == RESEND:
        first = _int(obj, "from", "", low=1)
        last = _int(obj, "to", "", low=1, optional=True)
        if last is not None and last < first:  # type: ignore[operator]
            raise _bad("'to' must not be below 'from'")
        return ResendRequest(_str(obj, "group", ""), _str(obj, "publisher", ""), _str(obj, "member", ""),
                             first, last)  # type: ignore[arg-type]
    raise _bad("unknown or missing '@type' (expected a zerocomm-group/1.0 data message)")
