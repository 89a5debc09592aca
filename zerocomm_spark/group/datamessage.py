"""Plaintexts of the group data plane: a *batch* of data messages per envelope, and its control messages.

Crypto dominates the cost of a small message (an envelope wraps its key for every recipient), so a
publisher packs everything queued for a group into one ``data-batch`` and pays that cost per batch.
Control messages travel in envelopes too, so they are authenticated like data:

* ``data-batch``  publisher -> members (XPUB), or one member (resend answer / push): the messages.
* ``data-hello``  publisher -> one member on the data path, until acked (proves its SUB is connected).
* ``data-ack``    member -> publisher (DirectSend): highest contiguous seq delivered (+ hello nonce).
* ``data-resend`` member -> publisher (RPC): "resend seq a..b"; answered with a ``data-batch``.

**Publisher signatures.** RFC 0019 authcrypt authenticates only the wrapped content key, and a
``shared`` envelope wraps the same key for every member: any member can unwrap it and re-encrypt a
body of its choice under the publisher's recipient entry for someone else, which that member then
reads as coming from the publisher. So every publisher-to-member message (``data-batch``,
``data-hello``) travels, in every mode, inside a ``data-signed`` wrapper::

    {"@type":".../data-signed","signature":"<base64url, 64 bytes>","message":<the exact plaintext>}

``signature`` is the detached Ed25519 signature of the publisher's *group key* over the exact bytes
of ``message`` (the data-batch JSON as encoded, signed once per batch whatever the number of
recipients). Receivers cut ``message`` out of the wrapper by position (the layout is fixed) and
verify those very bytes before parsing them, so what is verified is what is delivered; the pair
(``message`` bytes, ``signature``) also proves the batch's origin to anyone holding the publisher's
group verkey later (history). A batch meant for one member (resend answer, heartbeat: it carries
``base``/``last``/``gone``/``void``) names that member in ``member``, so it cannot be replayed to another.

Decoding validates every field and raises :class:`MalformedDataMessageError` naming the field
(never its value: values may be payloads). Payloads are base64 inside the JSON. Ids and headers must
be text UTF-8 can carry: JSON can spell a lone surrogate ("\\ud800"), and one delivered could not be
journaled by any member (it would be offered again after every restart).
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import nacl.bindings as _nacl
import nacl.exceptions

from zerocomm_spark.errors import DIDError, MalformedDataMessageError
from zerocomm_spark.keys.keypair import verkey_bytes
from zerocomm_spark.text import is_utf8_text

if TYPE_CHECKING:
    from zerocomm_spark.keys.keypair import KeyPair

__all__ = [
    "ACK",
    "DATA_BATCH",
    "HELLO",
    "MAX_BATCH_MESSAGES",
    "MAX_HEADERS",
    "MAX_ID_LENGTH",
    "MAX_SENT_AT",
    "MAX_SEQ",
    "PROTOCOL",
    "RESEND",
    "SIGNED",
    "Ack",
    "ControlMessage",
    "DataBatch",
    "DataMessage",
    "Hello",
    "ResendRequest",
    "decode",
    "decode_batch",
    "encode",
    "sign",
    "verify",
]

PROTOCOL = "https://didcomm.org/zerocomm-group/1.0"
DATA_BATCH = f"{PROTOCOL}/data-batch"
HELLO = f"{PROTOCOL}/data-hello"
ACK = f"{PROTOCOL}/data-ack"
RESEND = f"{PROTOCOL}/data-resend"
SIGNED = f"{PROTOCOL}/data-signed"

MAX_BATCH_MESSAGES = 65_536
MAX_ID_LENGTH = 256
MAX_HEADERS = 64
MAX_HEADER_LENGTH = 4096
MAX_SEQ = 2**63 - 1
# The journal keeps sent_at as int64 microseconds (about 9.2e12 s): a later time could be delivered and
# acked, then never journaled. Also below where float() of a JSON integer overflows.
MAX_SENT_AT = 9e12

_b64encode = binascii.b2a_base64
_b64decode = binascii.a2b_base64
_json_str = encode_basestring_ascii

# The data-signed wrapper has one fixed layout, so the signed bytes are cut out by position.
_SIG_BYTES = _nacl.crypto_sign_BYTES  # 64
_SIG_TEXT = 88  # padded base64url of 64 bytes
_SIGNED_HEAD = b'{"@type":"' + SIGNED.encode("ascii") + b'","signature":"'
_SIGNED_HEAD_TEXT = _SIGNED_HEAD.decode("ascii")
_SIGNED_MID = b'","message":'
_SIGNED_START = len(_SIGNED_HEAD) + _SIG_TEXT + len(_SIGNED_MID)
_TO_URL = bytes.maketrans(b"+/", b"-_")
_FROM_URL = bytes.maketrans(b"-_+/", b"+/!!")  # '+' and '/' are not base64url: make them invalid
_sign_open = _nacl.crypto_sign_open
_BAD_SIGNATURE = (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError,
                  nacl.exceptions.CryptoError)


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
    publisher no longer holds, which the member must skip), and name that member in ``member``;
    ``void`` (a range at or below ``base``) are seqs a publisher restarted after a crash skipped, which
    it may never have used: a member lacking them records them as not lost.

    Decoded from a ``data-signed`` wrapper, ``signature`` and ``signed`` (the exact bytes it signs)
    are set; :func:`verify` checks them. They take no part in equality.
    """

    group: str
    publisher: str
    messages: tuple[DataMessage, ...]
    base: int | None = None
    last: int | None = None
    gone: tuple[int, int] | None = None
    member: str | None = None
    void: tuple[int, int] | None = None
    signature: bytes | None = field(default=None, compare=False, repr=False)
    signed: bytes | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Hello:
    """Probe sent on the data path; ``base`` tells a new subscriber where its stream starts.

    Signed by the publisher like a batch (``signature``/``signed`` set when decoded from a wrapper).
    """

    group: str
    publisher: str
    subscriber: str
    nonce: str
    base: int
    last: int
    signature: bytes | None = field(default=None, compare=False, repr=False)
    signed: bytes | None = field(default=None, compare=False, repr=False)


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


def encode(msg: ControlMessage, *, encoded_messages: str | None = None, signer: KeyPair | None = None) -> bytes:
    """The UTF-8 JSON plaintext of a data-plane message, ready for ``envelope.pack``.

    ``encoded_messages`` (from :func:`encode_messages`) replaces ``msg.messages`` so one batch is
    serialised once for all its envelopes. ``signer`` (the publisher's group key) wraps a batch or
    hello in a ``data-signed`` wrapper (:func:`sign`); receivers refuse them unsigned.
    """
    if isinstance(msg, DataBatch):
        head: dict[str, Any] = {"@type": DATA_BATCH, "@id": uuid.uuid4().hex, "group": msg.group,
                                "publisher": msg.publisher}
        if msg.member is not None:
            head["member"] = msg.member
        if msg.base is not None:
            head["base"] = msg.base
        if msg.last is not None:
            head["last"] = msg.last
        if msg.gone is not None:
            head["gone"] = list(msg.gone)
        if msg.void is not None:
            head["void"] = list(msg.void)
        array = encoded_messages if encoded_messages is not None else encode_messages(msg.messages)
        plain = _dumps(head)[:-1] + b',"messages":' + array.encode("ascii") + b"}"
        return plain if signer is None else sign(plain, signer)
    if isinstance(msg, Hello):
        plain = _dumps({"@type": HELLO, "group": msg.group, "publisher": msg.publisher,
                        "subscriber": msg.subscriber, "nonce": msg.nonce, "base": msg.base, "last": msg.last})
        return plain if signer is None else sign(plain, signer)
    if isinstance(msg, Ack):
        body = {"@type": ACK, "group": msg.group, "publisher": msg.publisher, "member": msg.member, "seq": msg.seq}
        if msg.nonce is not None:
            body["nonce"] = msg.nonce
        return _dumps(body)
    if isinstance(msg, ResendRequest):
        return _dumps({"@type": RESEND, "group": msg.group, "publisher": msg.publisher,
                       "member": msg.member, "from": msg.first, "to": msg.last})
    raise TypeError(f"not a data-plane message: {type(msg).__name__}")


def sign(plaintext: bytes, key: KeyPair) -> bytes:
    """Wrap an encoded data-batch or hello with ``key``'s detached Ed25519 signature over its bytes."""
    signature = binascii.b2a_base64(key.sign(plaintext), newline=False).translate(_TO_URL)
    return b"".join((_SIGNED_HEAD, signature, _SIGNED_MID, plaintext, b"}"))


@lru_cache(maxsize=4096)
def _public_key(verkey: str) -> bytes | None:
    try:
        return verkey_bytes(verkey)
    except (DIDError, TypeError, ValueError):
        return None


def verify(msg: ControlMessage, verkey: str) -> bool:
    """True iff ``msg`` came in a ``data-signed`` wrapper whose signature ``verkey`` made over it.

    An unsigned message, a signature by another key and altered bytes are all False.
    """
    signature = getattr(msg, "signature", None)
    signed = getattr(msg, "signed", None)
    if signature is None or signed is None:
        return False
    public = _public_key(verkey)
    if public is None:
        return False
    try:
        _sign_open(signature + signed, public)
    except _BAD_SIGNATURE:
        return False
    return True


def _unwrap_signed(data: bytes) -> ControlMessage:
    """Cut the signed message out of a ``data-signed`` wrapper (fixed layout) and decode it."""
    if (len(data) < _SIGNED_START + 3 or not data.endswith(b"}")
            or data[len(_SIGNED_HEAD) + _SIG_TEXT:_SIGNED_START] != _SIGNED_MID):
        raise _bad("a 'data-signed' message must be {\"@type\",\"signature\",\"message\"} in that layout")
    text = data[len(_SIGNED_HEAD):len(_SIGNED_HEAD) + _SIG_TEXT]
    try:
        signature = binascii.a2b_base64(text.translate(_FROM_URL), strict_mode=True)
    except (binascii.Error, ValueError):
        signature = b""
    if len(signature) != _SIG_BYTES:
        raise _bad("'signature' must be 64 bytes in base64url")
    signed = data[_SIGNED_START:-1]
    if signed.startswith(_SIGNED_HEAD):
        raise _bad("a 'data-signed' message cannot wrap another")
    msg = decode(signed)
    if not isinstance(msg, (DataBatch, Hello)):
        raise _bad("only a data-batch or a data-hello is signed")
    return dataclasses.replace(msg, signature=signature, signed=signed)


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
        if not is_utf8_text(k) or not is_utf8_text(v):
            raise _bad(f"{where}'headers' must be text: a key or value holds a lone surrogate")
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
                    and (mid.isascii() or is_utf8_text(mid))
                    and (type(sent_at) is float or type(sent_at) is int) and 0 <= sent_at <= MAX_SENT_AT):
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
    if not is_utf8_text(mid):
        raise _bad(f"{where}'id' must be text: it holds a lone surrogate")
    seq = item.get("seq")
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise _bad(f"{where}'seq' must be an integer from 1 to 2**63-1")
    lamport = item.get("lamport")
    if type(lamport) is not int or not 0 <= lamport <= MAX_SEQ:
        raise _bad(f"{where}'lamport' must be an integer from 0 to 2**63-1")
    sent_at = item.get("sent_at")
    # Compared, never passed to math.isfinite: that raises OverflowError for an int beyond a float.
    if (type(sent_at) is not float and type(sent_at) is not int) or not 0 <= sent_at <= MAX_SENT_AT:
        raise _bad(f"{where}'sent_at' must be a number of epoch seconds from 0 to {MAX_SENT_AT:g}")
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


def _range(obj: Mapping[str, Any], key: str) -> tuple[int, int] | None:
    raw = obj.get(key)
    if raw is None:
        return None
    if (not isinstance(raw, list) or len(raw) != 2
            or any(type(v) is not int for v in raw) or not 1 <= raw[0] <= raw[1] <= MAX_SEQ):
        raise _bad(f"'{key}' must be a [first, last] seq range with 1 <= first <= last")
    return raw[0], raw[1]


def decode(data: bytes | str | dict[str, Any]) -> ControlMessage:
    """Decode any data-plane message by its ``@type``; MalformedDataMessageError if invalid.

    A ``data-signed`` wrapper decodes to the batch or hello it wraps, with its signature attached
    (check it with :func:`verify`); only bytes (or text) can carry one, never a parsed dict.
    """
    if isinstance(data, str) and data.startswith(_SIGNED_HEAD_TEXT):
        data = data.encode("utf-8", "replace")
    if isinstance(data, (bytes, bytearray, memoryview)) and bytes(data[:len(_SIGNED_HEAD)]) == _SIGNED_HEAD:
        return _unwrap_signed(bytes(data))
    obj = _load(data)
    kind = obj.get("@type")
    if kind == SIGNED:
        raise _bad("a 'data-signed' message must be {\"@type\",\"signature\",\"message\"} in that layout")
    if kind == DATA_BATCH:
        group = _str(obj, "group", "")
        publisher = _str(obj, "publisher", "")
        member = obj.get("member")
        if member is not None:
            member = _str(obj, "member", "")
        items = obj.get("messages")
        if not isinstance(items, list) or len(items) > MAX_BATCH_MESSAGES:
            raise _bad(f"'messages' must be a list of at most {MAX_BATCH_MESSAGES} messages")
        messages = _messages(items)
        base = _int(obj, "base", "", optional=True)
        last = _int(obj, "last", "", optional=True)
        return DataBatch(group, publisher, messages, base, last, _range(obj, "gone"), member, _range(obj, "void"))
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
