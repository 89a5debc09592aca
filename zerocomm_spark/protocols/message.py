"""The DIDComm v1 message base every protocol builds on, its decorators and the type registry.

Messages are dataclasses so a protocol module declares its fields once; ``from_dict`` validates
strictly and names the offending field (never its value: values can be payloads or keys), because
everything parsed here arrived from a peer we do not control.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
import re
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar, TypeVar

from zerocomm_spark.errors import ProtocolError, SignatureError, UnknownMessageTypeError
from zerocomm_spark.keys.keypair import KeyPair, b58decode, verify_signature

__all__ = [
    "DIDCOMM_PREFIX",
    "LEGACY_PREFIX",
    "SUPPORTED_PROTOCOLS",
    "AgentMessage",
    "Attachment",
    "ProtocolDescriptor",
    "Thread",
    "Timing",
    "b64url_decode",
    "b64url_encode",
    "message_class",
    "message_types",
    "new_id",
    "normalize_type",
    "parse_message",
    "register",
    "utc_now",
]

DIDCOMM_PREFIX = "https://didcomm.org/"
# Older Aries agents still send this prefix; RFC 0348 says to accept it and answer with the new one.
LEGACY_PREFIX = "did:sov:BzCbsNYhMrjHiqZDTUASHg;spec/"

MAX_ID_LENGTH = 256
MAX_TYPE_LENGTH = 256

M = TypeVar("M", bound="AgentMessage")


def new_id() -> str:
    return str(uuid.uuid4())


def utc_now() -> str:
    """ISO 8601 UTC with a Z, as RFC 0032 and RFC 0095 write times."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def b64url_encode(data: bytes) -> str:
    """base64url without padding, as JWS and RFC 0434 URLs use it."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Decode base64url or standard base64, padded or not: peers disagree on both choices."""
    if not isinstance(text, str):
        raise ValueError("base64 text must be a string")
    cleaned = text.strip().replace("-", "+").replace("_", "/")
    cleaned += "=" * (-len(cleaned) % 4)
    try:
        return base64.b64decode(cleaned.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError("not valid base64") from exc


def normalize_type(message_type: str) -> str:
    if message_type.startswith(LEGACY_PREFIX):
        return DIDCOMM_PREFIX + message_type[len(LEGACY_PREFIX) :]
    return message_type


_TYPE_PARTS = re.compile(r"(.+/[^/]+)/([0-9]+)\.([0-9]+)/([^/]+)")


def major_type(message_type: str) -> tuple[str, str, str] | None:
    """(protocol, major version, message name) of a message type URI, or None if it has no
    ``<protocol>/<major>.<minor>/<name>`` form or its major version is 0. Two types with the same
    triple are the same message to a recipient (RFC 0003: for major version >= 1, another minor
    version is processed, fields it does not know ignored; under 0.x any minor version may break)."""
    match = _TYPE_PARTS.fullmatch(normalize_type(message_type))
    if match is None or int(match.group(2)) == 0:
        return None
    return match.group(1), str(int(match.group(2))), match.group(4)


# --- field validation --------------------------------------------------------------------------


def _fail(error: type[ProtocolError], name: str, problem: str) -> ProtocolError:
    return error(f"field '{name}' {problem}")


def req_str(data: Mapping[str, Any], name: str, *, error: type[ProtocolError] = ProtocolError,
            max_length: int | None = None, allow_empty: bool = False) -> str:
    """A required string field, checked for presence, type and length."""
    if name not in data:
        raise _fail(error, name, "is missing")
    return _check_str(data[name], name, error=error, max_length=max_length, allow_empty=allow_empty)


def opt_str(data: Mapping[str, Any], name: str, *, error: type[ProtocolError] = ProtocolError,
            max_length: int | None = None) -> str | None:
    """An optional string field: absent or null gives None."""
    value = data.get(name)
    if value is None:
        return None
    return _check_str(value, name, error=error, max_length=max_length, allow_empty=True)


def _check_str(value: Any, name: str, *, error: type[ProtocolError], max_length: int | None,
               allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise _fail(error, name, f"must be a string, got {type(value).__name__}")
    if not allow_empty and not value:
        raise _fail(error, name, "must not be empty")
    if max_length is not None and len(value) > max_length:
        raise _fail(error, name, f"is longer than {max_length} characters")
    return value


def req_str_list(data: Mapping[str, Any], name: str, *, error: type[ProtocolError] = ProtocolError,
                 allow_empty: bool = False) -> list[str]:
    if name not in data:
        raise _fail(error, name, "is missing")
    value = data[name]
    if not isinstance(value, list):
        raise _fail(error, name, f"must be a list, got {type(value).__name__}")
    if not value and not allow_empty:
        raise _fail(error, name, "must not be empty")
    for i, item in enumerate(value):
        _check_str(item, f"{name}[{i}]", error=error, max_length=None, allow_empty=False)
    return list(value)


def req_dict(data: Mapping[str, Any], name: str, *,
             error: type[ProtocolError] = ProtocolError) -> Mapping[str, Any]:
    if name not in data:
        raise _fail(error, name, "is missing")
    value = data[name]
    if not isinstance(value, Mapping):
        raise _fail(error, name, f"must be a JSON object, got {type(value).__name__}")
    return value


def _parse_time(value: str, name: str, error: type[ProtocolError]) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise _fail(error, name, "is not an ISO 8601 time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


# --- decorators --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thread:
    """RFC 0008 ``~thread``: ``thid`` ties replies to the message that opened the thread,
    ``pthid`` ties a sub-protocol (DID exchange) to its parent (the invitation)."""

    thid: str | None = None
    pthid: str | None = None
    sender_order: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.thid is not None:
            out["thid"] = self.thid
        if self.pthid is not None:
            out["pthid"] = self.pthid
        if self.sender_order is not None:
            out["sender_order"] = self.sender_order
        return out

    @classmethod
    def from_dict(cls, data: Any, *, error: type[ProtocolError] = ProtocolError) -> "Thread":
        if not isinstance(data, Mapping):
            raise _fail(error, "~thread", "must be a JSON object")
        thid = opt_str(data, "thid", error=error, max_length=MAX_ID_LENGTH)
        pthid = opt_str(data, "pthid", error=error, max_length=MAX_ID_LENGTH)
        order = data.get("sender_order")
        if order is not None and (not isinstance(order, int) or isinstance(order, bool) or order < 0):
            raise _fail(error, "~thread.sender_order", "must be a non-negative integer")
        return cls(thid=thid or None, pthid=pthid or None, sender_order=order)


_TIMING_FIELDS = ("in_time", "out_time", "stale_time", "expires_time", "wait_until_time")


@dataclass(frozen=True)
class Timing:
    """RFC 0032 ``~timing``; only ``expires_time`` changes what a receiver does (expired: refused)."""

    in_time: str | None = None
    out_time: str | None = None
    stale_time: str | None = None
    expires_time: str | None = None
    wait_until_time: str | None = None
    delay_milli: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _TIMING_FIELDS if getattr(self, k) is not None}
        if self.delay_milli is not None:
            out["delay_milli"] = self.delay_milli
        return out

    def expired(self, now: datetime | None = None) -> bool:
        if self.expires_time is None:
            return False
        when = _parse_time(self.expires_time, "~timing.expires_time", ProtocolError)
        return when <= (now or datetime.now(timezone.utc))

    @classmethod
    def from_dict(cls, data: Any, *, error: type[ProtocolError] = ProtocolError) -> "Timing":
        if not isinstance(data, Mapping):
            raise _fail(error, "~timing", "must be a JSON object")
        values: dict[str, Any] = {}
        for name in _TIMING_FIELDS:
            value = opt_str(data, name, error=error, max_length=64)
            if value is not None:
                _parse_time(value, f"~timing.{name}", error)
            values[name] = value
        delay = data.get("delay_milli")
        if delay is not None and (not isinstance(delay, int) or isinstance(delay, bool) or delay < 0):
            raise _fail(error, "~timing.delay_milli", "must be a non-negative integer")
        return cls(delay_milli=delay, **values)


@dataclass
class Attachment:
    """RFC 0017 attachment with base64 data and an optional detached JWS (RFC 0023 signs DID docs).

    The JWS follows ACA-Py's layout, so ACA-Py agents verify ours and we verify theirs: EdDSA over
    ``protected + "." + base64url(payload)``, ``kid`` a did:key of the signing verkey.
    """

    id: str = field(default_factory=new_id)
    mime_type: str = "application/json"
    base64: str = ""
    jws: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, value: Any, *, id: str | None = None) -> "Attachment":
        raw = json.dumps(value, separators=(",", ":"), sort_keys=True).encode("utf-8")
        return cls(id=id or new_id(), base64=base64.b64encode(raw).decode("ascii"))

    def content(self) -> bytes:
        try:
            return b64url_decode(self.base64)
        except ValueError:
            raise ProtocolError("field 'data.base64' of an attachment is not valid base64") from None

    def json(self) -> Any:
        try:
            return json.loads(self.content())
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ProtocolError("field 'data.base64' of an attachment is not JSON") from None

    def _signing_input(self, protected: str) -> bytes:
        return f"{protected}.{b64url_encode(self.content())}".encode("ascii")

    def sign(self, key: KeyPair) -> None:
        """Sign the data with ``key``: proves the holder of ``key`` vouches for this DID doc."""
        from zerocomm_spark.did.peer import did_key

        kid = did_key(key.verkey)
        protected = b64url_encode(json.dumps({
            "alg": "EdDSA",
            "kid": kid,
            "jwk": {"kty": "OKP", "crv": "Ed25519", "x": b64url_encode(key.verkey_bytes), "kid": kid},
        }, separators=(",", ":")).encode("utf-8"))
        signature = key.sign(self._signing_input(protected))
        self.jws = {"header": {"kid": kid}, "protected": protected, "signature": b64url_encode(signature)}

    def signer(self) -> str:
        """Verify the JWS and return the signer's verkey; SignatureError if absent, altered or forged."""
        from zerocomm_spark.did.peer import verkey_from_did_key

        jws = self.jws
        if not isinstance(jws, Mapping):
            raise SignatureError("the attachment carries no JWS signature")
        protected = jws.get("protected")
        signature = jws.get("signature")
        if not isinstance(protected, str) or not isinstance(signature, str):
            raise SignatureError("the attachment's JWS misses 'protected' or 'signature'")
        try:
            header = json.loads(b64url_decode(protected))
            sig = b64url_decode(signature)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise SignatureError("the attachment's JWS is not valid base64url JSON") from None
        if not isinstance(header, Mapping) or header.get("alg") != "EdDSA":
            raise SignatureError("the attachment's JWS is not an EdDSA signature")
        raw_header = jws.get("header")
        unprotected: Mapping[str, Any] = raw_header if isinstance(raw_header, Mapping) else {}
        kid = header.get("kid") or unprotected.get("kid")
        if not isinstance(kid, str):
            raise SignatureError("the attachment's JWS names no signing key ('kid')")
        # ACA-Py puts the kid in both places; if they disagree someone edited the unprotected one.
        if unprotected.get("kid") not in (None, kid):
            raise SignatureError("the attachment's JWS header and protected 'kid' disagree")
        verkey = verkey_from_did_key(kid)
        jwk = header.get("jwk")
        if isinstance(jwk, Mapping) and "x" in jwk:
            try:
                if b64url_decode(str(jwk["x"])) != b58decode(verkey):
                    raise SignatureError("the attachment's JWS 'jwk' is not the key named by 'kid'")
            except ValueError:
                raise SignatureError("the attachment's JWS 'jwk' is not valid base64url") from None
        verify_signature(verkey, self._signing_input(protected), sig)
        return verkey

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"base64": self.base64}
        if self.jws is not None:
            data["jws"] = self.jws
        return {"@id": self.id, "mime-type": self.mime_type, "data": data}

    @classmethod
    def from_dict(cls, value: Any, name: str, *, error: type[ProtocolError] = ProtocolError) -> "Attachment":
        if not isinstance(value, Mapping):
            raise _fail(error, name, "must be a JSON object")
        data = value.get("data")
        if not isinstance(data, Mapping):
            raise _fail(error, f"{name}.data", "must be a JSON object")
        b64 = req_str(data, "base64", error=error) if "base64" in data else None
        if b64 is None:
            raise _fail(error, f"{name}.data.base64", "is missing (only base64 attachments are supported)")
        jws = data.get("jws")
        if jws is not None and not isinstance(jws, Mapping):
            raise _fail(error, f"{name}.data.jws", "must be a JSON object")
        return cls(
            id=opt_str(value, "@id", error=error, max_length=MAX_ID_LENGTH) or new_id(),
            mime_type=opt_str(value, "mime-type", error=error, max_length=128) or "application/json",
            base64=b64,
            jws=dict(jws) if jws is not None else None,
        )


# --- the message base --------------------------------------------------------------------------


@dataclass(kw_only=True)
class AgentMessage:
    """Base of every DIDComm v1 message: ``@type``, ``@id`` and the ``~thread``/``~timing`` decorators.

    Subclasses set ``message_type`` and override ``body``/``parse_body`` for their own fields.
    """

    message_type: ClassVar[str] = ""
    validation_error: ClassVar[type[ProtocolError]] = ProtocolError

    id: str = field(default_factory=new_id)
    thread: Thread | None = None
    timing: Timing | None = None

    @property
    def thid(self) -> str:
        """The thread id; RFC 0008 says a message without ~thread.thid starts its own thread."""
        return self.thread.thid if self.thread is not None and self.thread.thid else self.id

    @property
    def pthid(self) -> str | None:
        return self.thread.pthid if self.thread is not None else None

    @classmethod
    def protocol(cls) -> str:
        """The protocol URI, e.g. ``https://didcomm.org/didexchange/1.0``."""
        return cls.message_type.rsplit("/", 1)[0]

    def body(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"@type": self.message_type, "@id": self.id}
        if self.thread is not None and self.thread.to_dict():
            out["~thread"] = self.thread.to_dict()
        if self.timing is not None and self.timing.to_dict():
            out["~timing"] = self.timing.to_dict()
        out.update(self.body())
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls: type[M], data: Any) -> M:
        error = cls.validation_error
        if not isinstance(data, Mapping):
            raise error(f"a DIDComm message must be a JSON object, got {type(data).__name__}")
        got = normalize_type(req_str(data, "@type", error=error, max_length=MAX_TYPE_LENGTH))
        if got != cls.message_type and (major_type(got) is None or major_type(got) != major_type(cls.message_type)):
            raise _fail(error, "@type", f"is not {cls.message_type}")
        message_id = req_str(data, "@id", error=error, max_length=MAX_ID_LENGTH)
        thread = Thread.from_dict(data["~thread"], error=error) if data.get("~thread") is not None else None
        timing = Timing.from_dict(data["~timing"], error=error) if data.get("~timing") is not None else None
        return cls(id=message_id, thread=thread, timing=timing, **cls.parse_body(data))

    def __repr__(self) -> str:  # bodies can be payloads: show only the envelope-level facts
        return f"{type(self).__name__}(id={self.id!r}, thid={self.thid!r})"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every subclass is a @dataclass, which writes a __repr__ of all its fields (a basic message's
        # content, a join's proofs) over the one above unless the class has its own: give it this one,
        # before the decorator runs. A subclass that defines __repr__ itself keeps it.
        super().__init_subclass__(**kwargs)
        if "__repr__" not in cls.__dict__:
            cls.__repr__ = AgentMessage.__repr__  # type: ignore[method-assign]


# --- registry ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProtocolDescriptor:
    """One protocol this agent speaks, with the roles it can play (RFC 0031 ``disclose``)."""

    pid: str
    roles: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "roles": list(self.roles)}


SUPPORTED_PROTOCOLS: tuple[ProtocolDescriptor, ...] = (
    ProtocolDescriptor("https://didcomm.org/out-of-band/1.1", ("sender", "receiver")),
    ProtocolDescriptor("https://didcomm.org/didexchange/1.0", ("requester", "responder")),
    ProtocolDescriptor("https://didcomm.org/discover-features/1.0", ("requester", "responder")),
    ProtocolDescriptor("https://didcomm.org/basicmessage/1.0", ("sender", "receiver")),
    ProtocolDescriptor("https://didcomm.org/trust_ping/1.0", ("sender", "receiver")),
)

_PROTOCOL_MODULES = (
    "zerocomm_spark.protocols.out_of_band.v1_1.messages",
    "zerocomm_spark.protocols.did_exchange.v1_0.messages",
    "zerocomm_spark.protocols.discover_features.v1_0.messages",
    "zerocomm_spark.protocols.basic_message.v1_0.messages",
    "zerocomm_spark.protocols.trust_ping.v1_0.messages",
)

_REGISTRY: dict[str, type[AgentMessage]] = {}
_BY_MAJOR: dict[tuple[str, str, str], type[AgentMessage]] = {}  # (protocol, major, name): see major_type
_loaded = False
_load_lock = threading.Lock()


def register(cls: type[M]) -> type[M]:
    """Class decorator: make ``parse_message`` build ``cls`` for its ``@type``."""
    if not cls.message_type.startswith(DIDCOMM_PREFIX):
        raise ValueError(f"{cls.__name__}.message_type must start with {DIDCOMM_PREFIX}")
    _REGISTRY[cls.message_type] = cls
    parts = major_type(cls.message_type)
    if parts is not None:
        _BY_MAJOR[parts] = cls
    return cls


def _ensure_loaded() -> None:
    # Lazy, because the protocol modules import this one.
    global _loaded
    if _loaded:
        return
    with _load_lock:
        if not _loaded:
            for name in _PROTOCOL_MODULES:
                importlib.import_module(name)
            _loaded = True


def message_types() -> dict[str, type[AgentMessage]]:
    _ensure_loaded()
    return dict(_REGISTRY)


def message_class(message_type: str) -> type[AgentMessage]:
    _ensure_loaded()
    try:
        return _REGISTRY[normalize_type(message_type)]
    except KeyError:
        parts = major_type(message_type)
        if parts is not None and parts in _BY_MAJOR:  # another minor version of a message we know (RFC 0003)
            return _BY_MAJOR[parts]
        raise UnknownMessageTypeError(f"unsupported message type {message_type[:MAX_TYPE_LENGTH]!r}") from None


def parse_message(data: Any) -> AgentMessage:
    """Build the registered message class for ``data['@type']``, validating every field."""
    if not isinstance(data, Mapping):
        raise ProtocolError(f"a DIDComm message must be a JSON object, got {type(data).__name__}")
    message_type = req_str(data, "@type", max_length=MAX_TYPE_LENGTH)
    return message_class(message_type).from_dict(data)
