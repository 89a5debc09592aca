"""RFC 0434 out-of-band flows: making invitations we can later recognise, and reading others'.

Each invitation gets its own key pair, so a DID-exchange request tells us by its recipient key which
invitation it answers, and a leaked invitation exposes nothing about our other relationships. The
invitation is remembered as a keystore record; single-use invitations refuse a second requester.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from zerocomm_spark.did.peer import did_key, resolve, verkey_from_did_key
from zerocomm_spark.errors import DIDError, InvitationError, ReplayError
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.message import utc_now
from zerocomm_spark.protocols.out_of_band.v1_1.messages import (
    DEFAULT_URL_BASE,
    DIDEXCHANGE_1_0,
    Invitation,
    Service,
)
from zerocomm_spark.transport.peer import dialable

__all__ = ["InvitationRecord", "OutOfBandManager", "ReceivedInvitation", "SUPPORTED_SCHEMES"]

log = logging.getLogger(__name__)

RECORD_KIND = "invitation"
KEY_PURPOSE = "invitation"
# The handshake protocols we can answer: DID exchange 1.0 and its later minor versions.
_DIDEXCHANGE_1_X = re.compile(re.escape(DIDEXCHANGE_1_0[:-1]) + r"[0-9]+")
#: RFC 0434 `accept` values that mean an RFC 0019 envelope, the only kind this agent sends.
_RFC0019_MEDIA_TYPES = frozenset({"didcomm/aip1", "didcomm/aip2;env=rfc19"})
# The schemes our transport can dial (an endpoint is checked whole with its dialable()).
SUPPORTED_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class InvitationRecord:
    """What we remember about an invitation we made (no secret: the key stays in the keystore)."""

    invitation_id: str
    verkey: str
    label: str | None
    multi_use: bool
    state: str = "await-response"  # RFC 0434 sender states: await-response, done
    created_at: str = field(default_factory=utc_now)
    used_by: list[str] = field(default_factory=list)  # DID-exchange thread ids it answered
    goal_code: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "InvitationRecord":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class ReceivedInvitation:
    """A validated invitation from someone else, reduced to what the DID exchange needs."""

    invitation: Invitation
    recipient_key: str  # base58 verkey to encrypt the request to
    endpoint: str

    @property
    def id(self) -> str:
        return self.invitation.id

    @property
    def label(self) -> str | None:
        return self.invitation.label


class OutOfBandManager:
    """Creates, remembers and consumes our invitations; validates received ones."""

    def __init__(self, keystore: Keystore, endpoint: Callable[[], str] | str, label: str) -> None:
        self._keystore = keystore
        self._endpoint = endpoint if callable(endpoint) else (lambda: endpoint)
        self._label = label
        self._lock = threading.RLock()

    def create_invitation(self, *, label: str | None = None, goal_code: str | None = None,
                          goal: str | None = None, multi_use: bool = False) -> tuple[Invitation, InvitationRecord]:
        """A fresh invitation whose inline service names a new key and our endpoint."""
        invitation = Invitation(
            services=[Service(recipient_keys=[], service_endpoint=self._endpoint())],
            label=label if label is not None else self._label,
            goal_code=goal_code,
            goal=goal,
            handshake_protocols=[DIDEXCHANGE_1_0],
        )
        key = self._keystore.create_key(KEY_PURPOSE, ref=invitation.id)
        service = invitation.services[0]
        assert isinstance(service, Service)
        service.recipient_keys.append(did_key(key.verkey))
        record = InvitationRecord(invitation.id, key.verkey, invitation.label, multi_use, goal_code=goal_code)
        self._save(record)
        log.info("created %s invitation %s", "multi-use" if multi_use else "single-use", invitation.id)
        return invitation, record

    def create_url(self, **kwargs: Any) -> str:
        invitation, _ = self.create_invitation(**kwargs)
        return invitation.to_url(DEFAULT_URL_BASE)

    def record_for_key(self, verkey: str) -> InvitationRecord | None:
        """Our invitation whose key ``verkey`` is, if any: how a request is matched to its invitation."""
        for data in self._keystore.records(RECORD_KIND):
            if data.get("verkey") == verkey:
                return InvitationRecord.from_dict(data)
        return None

    def get(self, invitation_id: str) -> InvitationRecord | None:
        data = self._keystore.get_record(RECORD_KIND, invitation_id)
        return None if data is None else InvitationRecord.from_dict(data)

    def records(self) -> list[InvitationRecord]:
        return [InvitationRecord.from_dict(d) for d in self._keystore.records(RECORD_KIND)]

    def consume(self, invitation_id: str, thread_id: str) -> InvitationRecord:
        """Mark the invitation used by the request ``thread_id``; ReplayError if that is not allowed.

        Atomic and persisted before the connection exists, so a crash cannot let a single-use
        invitation be answered twice.
        """
        with self._lock:
            record = self.get(invitation_id)
            if record is None:
                raise InvitationError("the request answers no invitation of ours")
            if thread_id in record.used_by:
                raise ReplayError("this DID-exchange request was already processed")
            if record.used_by and not record.multi_use:
                raise ReplayError("the single-use invitation was already used")
            record.used_by.append(thread_id)
            if not record.multi_use:
                record.state = "done"
            self._save(record)
            return record

    def _save(self, record: InvitationRecord) -> None:
        self._keystore.put_record(RECORD_KIND, record.invitation_id, record.to_dict())

    # --- receiving ------------------------------------------------------------------------------

    @staticmethod
    def parse_url(url: str) -> ReceivedInvitation:
        """Validate a received invitation URL down to one usable service, or raise InvitationError."""
        invitation = Invitation.from_url(url)
        return OutOfBandManager.receive_invitation(invitation)

    @staticmethod
    def receive_invitation(invitation: Invitation) -> ReceivedInvitation:
        # Any 1.x minor version will do (RFC 0003 semver): a didexchange/1.1 responder (ACA-Py,
        # Credo) also takes the 1.0 request we send, and may offer only 1.1 in its invitation.
        if not any(_DIDEXCHANGE_1_X.fullmatch(h) for h in invitation.handshake_protocols):
            raise InvitationError(
                "the invitation offers no handshake protocol we speak (need https://didcomm.org/didexchange/1.x)"
            )
        # RFC 0434 `accept`: the envelopes the inviter takes, if it says. Ours are RFC 0019 (DIDComm v1).
        if invitation.accept and not any(a.replace(" ", "").lower() in _RFC0019_MEDIA_TYPES for a in invitation.accept):
            shown = ", ".join(a[:64] for a in invitation.accept[:4])
            raise InvitationError(
                f"the invitation accepts only {shown}; this agent sends DIDComm v1 envelopes (RFC 0019: "
                "didcomm/aip1 or didcomm/aip2;env=rfc19)",
                hint="Ask the inviter for an invitation that accepts didcomm/aip1 or didcomm/aip2;env=rfc19")
        problems: list[str] = []
        for i, service in enumerate(invitation.services):
            try:
                if isinstance(service, str):
                    doc = resolve(service)
                    verkey, endpoint, routing = doc.verkey, doc.service_endpoint, doc.routing_keys
                else:
                    verkey = verkey_from_did_key(service.recipient_keys[0])
                    endpoint, routing = service.service_endpoint, service.routing_keys
                if routing:  # inline or in the DID's service alike: we send no forward for a mediator
                    problems.append(f"services[{i}] needs a mediator (routingKeys), which is not supported")
                    continue
            except DIDError as exc:
                problems.append(f"services[{i}]: {exc.args[0] if exc.args else exc}")
                continue
            if not dialable(endpoint):  # the transport's own check: accept() could not send to it
                problems.append(f"services[{i}] has no ZeroMQ endpoint (tcp://, ipc://)")
                continue
            return ReceivedInvitation(invitation, verkey, endpoint)
        raise InvitationError("the invitation has no usable service: " + "; ".join(problems))
