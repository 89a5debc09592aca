"""Admission to a group: who may join, decided by the acceptor *and* by every member it subscribes to.

The thesis prototype admitted everyone (a "dummy validation", 5.3.1). Here each member holds a
policy per group, persisted with the group, and applies it at two stages:

* ``join``: a joiner asks this member (the acceptor) for the group's view;
* ``subscribe``: a joiner (or a member repairing a missing relationship) asks this member to start
  a pub/sub relationship. A member it already has a relationship with (a restart) is not asked again.

Evidence a policy can use, gathered by the manager and never taken on the joiner's word:

* the joiner's member DID (its entry is signed by the key that DID names);
* the invitation its DIDComm connection to us answered, and whether we issued it for this group
  (``agent.groups.invite(group)``);
* a *ticket*: the acceptor's signed statement "I admitted DID x into group g". It lets the other
  members check that a current member vouched for the joiner, without re-running the acceptor's
  policy (they may not know its invitations).

Policies: :class:`OpenPolicy` (anyone connected to us), :class:`AllowListPolicy` (DIDs),
:class:`InvitationPolicy` (an invitation issued for the group at the acceptor, a ticket from a
current member elsewhere), and :class:`AnyOf`/:class:`AllOf` to combine them.
"""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from zerocomm_spark.errors import ConfigurationError, DIDError, MalformedGroupMessageError, SignatureError
from zerocomm_spark.did.peer import verkey_from_did_key
from zerocomm_spark.group.view import member_did_for
from zerocomm_spark.keys.keypair import KeyPair, verify_signature
from zerocomm_spark.protocols.message import b64url_decode, b64url_encode

__all__ = [
    "AdmissionPolicy",
    "AdmissionRequest",
    "AllOf",
    "AllowListPolicy",
    "AnyOf",
    "Decision",
    "InvitationPolicy",
    "OpenPolicy",
    "Stage",
    "Ticket",
    "policy_from_dict",
]

Stage = Literal["join", "subscribe"]
TICKET_MAX_AGE_S = 365 * 24 * 3600.0  # a ticket outlives restarts; it is only evidence, members re-decide


@dataclass(frozen=True)
class AdmissionRequest:
    """What a member knows about a would-be member when it decides."""

    group: str
    stage: Stage
    member_did: str
    label: str
    role: str
    connection_did: str | None = None  # their pairwise DID on the connection the request came over
    invitation_id: str | None = None  # our OOB invitation that connection answered, if any
    group_invitation: bool = False  # that invitation was issued for this group
    vouched_by: str | None = None  # a current member whose valid ticket the requester presented


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str

    def __bool__(self) -> bool:
        return self.admitted


class AdmissionPolicy(ABC):
    """A rule a member applies to joiners; serialisable, so it survives restarts with the group."""

    kind: ClassVar[str] = ""

    @abstractmethod
    def decide(self, request: AdmissionRequest) -> Decision: ...

    @abstractmethod
    def to_dict(self) -> dict[str, Any]: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({json.dumps(self.to_dict())[:200]})"


class OpenPolicy(AdmissionPolicy):
    """Admit anyone who has a DIDComm connection with us; for closed networks and demos."""

    kind = "open"

    def decide(self, request: AdmissionRequest) -> Decision:
        return Decision(True, "the group is open")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}


class AllowListPolicy(AdmissionPolicy):
    """Admit only listed DIDs: member DIDs (``agent.groups.did``) or pairwise connection DIDs."""

    kind = "allow-list"

    def __init__(self, dids: Iterable[str]) -> None:
        if isinstance(dids, str):
            raise ConfigurationError("AllowListPolicy takes a list of DIDs, not one string")
        self.dids = frozenset(dids)
        if not all(isinstance(d, str) and d.startswith("did:") for d in self.dids):
            raise ConfigurationError("AllowListPolicy takes DIDs (strings starting with 'did:')")

    def decide(self, request: AdmissionRequest) -> Decision:
        if request.member_did in self.dids or (request.connection_did is not None and request.connection_did in self.dids):
            return Decision(True, "the DID is on the allow-list")
        return Decision(False, f"{request.member_did} is not on this member's allow-list")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "dids": sorted(self.dids)}


class InvitationPolicy(AdmissionPolicy):
    """Admit joiners that came through an invitation issued for this group.

    The acceptor checks the invitation itself; the other members check the acceptor's ticket,
    since only the acceptor knows which invitations it issued.
    """

    kind = "invitation"

    def decide(self, request: AdmissionRequest) -> Decision:
        if request.stage == "join":
            if request.group_invitation:
                return Decision(True, "the joiner answered an invitation issued for the group")
            return Decision(False, f"the connection did not come through an invitation issued for group {request.group!r}")
        if request.vouched_by is not None:
            return Decision(True, f"admitted by member {request.vouched_by}")
        if request.group_invitation:
            return Decision(True, "the requester answered an invitation issued for the group")
        return Decision(False, "no ticket from a current member vouches for the requester")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}


class AnyOf(AdmissionPolicy):
    """Admit if any of the policies admits (e.g. allow-listed DIDs or invited joiners)."""

    kind = "any-of"

    def __init__(self, policies: Iterable[AdmissionPolicy]) -> None:
        self.policies = tuple(policies)
        if not self.policies or not all(isinstance(p, AdmissionPolicy) for p in self.policies):
            raise ConfigurationError(f"{type(self).__name__} takes one or more AdmissionPolicy objects")

    def decide(self, request: AdmissionRequest) -> Decision:
        reasons = []
        for policy in self.policies:
            decision = policy.decide(request)
            if decision.admitted:
                return decision
            reasons.append(decision.reason)
        return Decision(False, "; ".join(reasons))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "policies": [p.to_dict() for p in self.policies]}


class AllOf(AnyOf):
    """Admit only if every policy admits."""

    kind = "all-of"

    def decide(self, request: AdmissionRequest) -> Decision:
        for policy in self.policies:
            decision = policy.decide(request)
            if not decision.admitted:
                return decision
        return Decision(True, "every policy admits")


_KINDS: dict[str, type[AdmissionPolicy]] = {
    c.kind: c for c in (OpenPolicy, AllowListPolicy, InvitationPolicy, AnyOf, AllOf)
}


def policy_from_dict(data: Any) -> AdmissionPolicy:
    """Rebuild a policy stored with a group (or written in a config file)."""
    if isinstance(data, AdmissionPolicy):
        return data
    if not isinstance(data, Mapping) or data.get("kind") not in _KINDS:
        raise ConfigurationError(f"an admission policy is an object whose 'kind' is one of {', '.join(_KINDS)}")
    kind = data["kind"]
    if kind == "allow-list":
        return AllowListPolicy(data.get("dids") or [])
    if kind in ("any-of", "all-of"):
        parts = data.get("policies")
        if not isinstance(parts, list):
            raise ConfigurationError(f"a '{kind}' policy lists its 'policies'")
        return _KINDS[kind]([policy_from_dict(p) for p in parts])  # type: ignore[call-arg]
    return _KINDS[kind]()


# --- tickets -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    """``by`` admitted ``member`` into ``group`` at ``issued_at``; signed by ``by``'s member key.

    ``nonce`` is the join request's @id, so the joiner can tell a fresh ticket from a replayed one.
    """

    group: str
    member: str
    by: str
    issued_at: float
    nonce: str = ""
    signature: str = ""

    def _signed_part(self) -> bytes:
        return json.dumps({"group": self.group, "member": self.member, "by": self.by, "issued_at": self.issued_at,
                           "nonce": self.nonce}, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def issue(cls, group: str, member: str, by_key: KeyPair, *, nonce: str = "") -> "Ticket":
        ticket = cls(group, member, member_did_for(by_key.verkey), round(time.time(), 3), nonce)
        return replace(ticket, signature=b64url_encode(by_key.sign(ticket._signed_part())))

    def verify(self, *, group: str, member: str, nonce: str | None = None) -> str:
        """The DID that vouches, if the ticket is for ``member`` in ``group`` and its signature holds."""
        if self.group != group or self.member != member:
            raise SignatureError("the ticket is for another group or member")
        if nonce is not None and self.nonce != nonce:
            raise SignatureError("the ticket answers another join request")
        age = time.time() - self.issued_at
        if not -300 <= age <= TICKET_MAX_AGE_S:  # minutes of clock skew are fine (and NaN is neither)
            raise SignatureError("the ticket was issued in the future or has expired")
        try:
            verkey = verkey_from_did_key(self.by)
            signature = b64url_decode(self.signature)
        except (DIDError, ValueError):
            raise SignatureError("the ticket names an unreadable DID or signature") from None
        verify_signature(verkey, self._signed_part(), signature)
        return self.by

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "member": self.member, "by": self.by, "issued_at": self.issued_at,
                "nonce": self.nonce, "signature": self.signature}

    @classmethod
    def from_dict(cls, data: Any) -> "Ticket":
        if not isinstance(data, Mapping):
            raise MalformedGroupMessageError("a ticket must be a JSON object")
        try:
            values = {k: data[k] for k in ("group", "member", "by", "signature")}
            issued_at = data["issued_at"]
        except KeyError as exc:
            raise MalformedGroupMessageError(f"ticket field '{exc.args[0]}' is missing") from None
        if not all(isinstance(v, str) and 0 < len(v) <= 1024 for v in values.values()):
            raise MalformedGroupMessageError("ticket fields group, member, by and signature are strings")
        # An int beyond a float (10**400) made math.isfinite raise OverflowError out of every handler
        # that checks a ticket; no real clock is anywhere near 1e15 seconds.
        if (not isinstance(issued_at, (int, float)) or isinstance(issued_at, bool)
                or (isinstance(issued_at, int) and abs(issued_at) > 10**15) or not math.isfinite(issued_at)):
            raise MalformedGroupMessageError("ticket field 'issued_at' is a finite number of seconds since the epoch")
        nonce = data.get("nonce", "")
        if not isinstance(nonce, str) or len(nonce) > 256:
            raise MalformedGroupMessageError("ticket field 'nonce' is a string")
        return cls(values["group"], values["member"], values["by"], float(issued_at), nonce, values["signature"])
