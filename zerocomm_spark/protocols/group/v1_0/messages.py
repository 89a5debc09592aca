"""ZeroComm group membership 1.0 (``https://didcomm.org/zerocomm-group/1.0``): the DIDComm messages.

They travel between two members over their pairwise DIDComm connection (RFC 0019 envelopes on the
peer transport, with receipts), never over the group's pub/sub sockets; the data plane's own
messages (data-batch, hello, ack, resend) and the status sections are separate (datamessage.py,
group/view.py). Requests are answered by a message threaded to them (``~thread.thid``), or by a
``problem-report`` whose code says why the peer refused.

The classes are not put in the global registry (``protocols.message.register``): an agent parses
and serves them only once ``agent.groups`` registered them (``Agent.register_protocol``), so an
agent without groups neither accepts nor discloses them.

Member entries and views are carried as JSON and checked in depth (signatures included) by
``zerocomm_spark.group.view``; here only their shape is checked, naming the field, never its value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zerocomm_spark.errors import MalformedGroupMessageError
from zerocomm_spark.protocols.message import (
    DIDCOMM_PREFIX,
    AgentMessage,
    ProtocolDescriptor,
    opt_str,
    req_str,
)

__all__ = [
    "DESCRIPTOR",
    "PROTOCOL",
    "Digest",
    "DigestResponse",
    "GroupProblemReport",
    "JoinRequest",
    "JoinResponse",
    "Leave",
    "ProblemCode",
    "Subscribe",
    "SubscribeResponse",
    "ViewUpdate",
]

PROTOCOL = DIDCOMM_PREFIX + "zerocomm-group/1.0"
DESCRIPTOR = ProtocolDescriptor(PROTOCOL, ("member",))
MAX_GROUP = 200
MAX_LIST = 10_000
_E = MalformedGroupMessageError


class ProblemCode:
    """Why a member refused a request; the joiner turns each into a typed error."""

    UNKNOWN_GROUP = "unknown-group"
    JOIN_REFUSED = "join-refused"
    SUBSCRIBE_REFUSED = "subscribe-refused"
    NOT_A_MEMBER = "not-a-member"
    NOT_READY = "not-ready"
    INVALID = "invalid-request"


def _group(data: Mapping[str, Any]) -> str:
    return req_str(data, "group", error=_E, max_length=MAX_GROUP)


def _obj(data: Mapping[str, Any], name: str, *, optional: bool = False) -> dict[str, Any] | None:
    value = data.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, Mapping):
        raise _E(f"field '{name}' must be a JSON object")
    return dict(value)


def _list(data: Mapping[str, Any], name: str) -> list[Any]:
    value = data.get(name)
    if not isinstance(value, list) or len(value) > MAX_LIST:
        raise _E(f"field '{name}' must be a list of at most {MAX_LIST} items")
    return list(value)


def _int(data: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = data.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _E(f"field '{name}' must be a non-negative integer")
    return value


def _versions(data: Mapping[str, Any], name: str) -> dict[str, int]:
    value = data.get(name)
    if not isinstance(value, Mapping) or len(value) > MAX_LIST:
        raise _E(f"field '{name}' must be an object of at most {MAX_LIST} DIDs")
    out = {}
    for did, version in value.items():
        if not isinstance(did, str) or not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise _E(f"field '{name}' maps DIDs to non-negative integers")
        out[did] = version
    return out


def _checksum(data: Mapping[str, Any], name: str = "checksum") -> str:
    value = req_str(data, name, error=_E, max_length=128)
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise _E(f"field '{name}' must be a hex SHA-256")
    return value


def _proof(data: Mapping[str, Any]) -> str:
    """A member's connection proof: base64url of a 64-byte signature, or absent (then refused later)."""
    value = data.get("proof", "")
    if not isinstance(value, str) or len(value) > 128:
        raise _E("field 'proof' must be a base64url signature")
    return value


class _Threaded(AgentMessage):
    """A reply: must carry the request's @id as ``~thread.thid``."""

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        message = super().from_dict(data)
        if message.thread is None or not message.thread.thid:
            raise _E("field '~thread.thid' is missing (the request's @id)")
        return message


@dataclass(kw_only=True)
class JoinRequest(AgentMessage):
    """Joiner -> acceptor: let me into ``group``; ``member`` is the joiner's signed entry."""

    message_type: ClassVar[str] = PROTOCOL + "/join-request"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    group: str
    member: dict[str, Any]
    proof: str = ""  # the member key's signature binding the entry to this connection (group/proof.py)

    def body(self) -> dict[str, Any]:
        return {"group": self.group, "member": self.member, "proof": self.proof}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"group": _group(data), "member": _obj(data, "member"), "proof": _proof(data)}


@dataclass(kw_only=True)
class JoinResponse(_Threaded):
    """Acceptor -> joiner: the group's settings, the acceptor's view and checksum, and a signed ticket."""

    message_type: ClassVar[str] = PROTOCOL + "/join-response"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    group: str
    settings: dict[str, Any]
    view: list[dict[str, Any]]
    checksum: str
    acceptor: str
    ticket: dict[str, Any]

    def body(self) -> dict[str, Any]:
        return {"group": self.group, "settings": self.settings, "view": self.view, "checksum": self.checksum,
                "acceptor": self.acceptor, "ticket": self.ticket}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"group": _group(data), "settings": _obj(data, "settings"), "view": _list(data, "view"),
                "checksum": _checksum(data), "acceptor": req_str(data, "acceptor", error=_E, max_length=512),
                "ticket": _obj(data, "ticket")}


@dataclass(kw_only=True)
class Subscribe(AgentMessage):
    """Member -> member: start a pub/sub relationship; carries the sender's entry (keys, endpoints)
    and the ticket that shows a current member admitted it."""

    message_type: ClassVar[str] = PROTOCOL + "/subscribe"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    group: str
    member: dict[str, Any]
    settings: dict[str, Any]
    ticket: dict[str, Any] | None = None
    proof: str = ""  # the member key's signature binding the entry to this connection (group/proof.py)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"group": self.group, "member": self.member, "settings": self.settings,
                               "proof": self.proof}
        if self.ticket is not None:
            out["ticket"] = self.ticket
        return out

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"group": _group(data), "member": _obj(data, "member"), "settings": _obj(data, "settings"),
                "ticket": _obj(data, "ticket", optional=True), "proof": _proof(data)}


@dataclass(kw_only=True)
class SubscribeResponse(_Threaded):
    """The answer: the responder's entry, its view checksum, and how far it got in the sender's stream."""

    message_type: ClassVar[str] = PROTOCOL + "/subscribe-response"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    group: str
    member: dict[str, Any]
    checksum: str
    position: int = 0  # highest seq of the subscriber's stream held here, delivered or held back (it continues after)
    your_version: int = 0  # the version of the subscriber's entry held here

    def body(self) -> dict[str, Any]:
        return {"group": self.group, "member": self.member, "checksum": self.checksum, "position": self.position,
                "your_version": self.your_version}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"group": _group(data), "member": _obj(data, "member"), "checksum": _checksum(data),
                "position": _int(data, "position", 0), "your_version": _int(data, "your_version", 0)}


@dataclass(kw_only=True)
class Digest(AgentMessage):
    """Periodic view repair: the sender's view in brief (hash and per-member versions)."""

    message_type: ClassVar[str] = PROTOCOL + "/digest"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    group: str
    state_hash: str
    versions: dict[str, int] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"group": self.group, "state_hash": self.state_hash, "versions": self.versions}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"group": _group(data), "state_hash": _checksum(data, "state_hash"),
                "versions": _versions(data, "versions")}


@dataclass(kw_only=True)
class DigestResponse(_Threaded):
    """The entries the digest's sender lacks, the DIDs the responder wants from it, and its checksum."""

    message_type: ClassVar[str] = PROTOCOL + "/digest-response"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    group: str
    checksum: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    want: list[str] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {"group": self.group, "checksum": self.checksum, "entries": self.entries, "want": self.want}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        want = _list(data, "want")
        if not all(isinstance(d, str) for d in want):
            raise _E("field 'want' must be a list of DIDs")
        return {"group": _group(data), "checksum": _checksum(data), "entries": _list(data, "entries"), "want": want}


@dataclass(kw_only=True)
class ViewUpdate(AgentMessage):
    """Entries pushed to a member: what its digest showed it lacks, or a change it must not miss."""

    message_type: ClassVar[str] = PROTOCOL + "/view-update"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    group: str
    entries: list[dict[str, Any]] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {"group": self.group, "entries": self.entries}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"group": _group(data), "entries": _list(data, "entries")}


@dataclass(kw_only=True)
class Leave(AgentMessage):
    """A member leaves (or a joiner withdraws): its signed entry with status ``left``."""

    message_type: ClassVar[str] = PROTOCOL + "/leave"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    group: str
    member: dict[str, Any]
    proof: str = ""  # the member key's signature binding the entry to this connection (group/proof.py)

    def body(self) -> dict[str, Any]:
        return {"group": self.group, "member": self.member, "proof": self.proof}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"group": _group(data), "member": _obj(data, "member"), "proof": _proof(data)}


@dataclass(kw_only=True)
class GroupProblemReport(_Threaded):
    """A refusal of a group request; ``code`` is a :class:`ProblemCode`, ``explain`` is for humans."""

    message_type: ClassVar[str] = PROTOCOL + "/problem-report"
    validation_error: ClassVar[type[MalformedGroupMessageError]] = _E

    code: str
    explain: str = ""

    def body(self) -> dict[str, Any]:
        return {"description": {"code": self.code, "en": self.explain}}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        description = _obj(data, "description")
        assert description is not None
        return {"code": req_str(description, "code", error=_E, max_length=128),
                "explain": opt_str(description, "en", error=_E, max_length=2048) or ""}
