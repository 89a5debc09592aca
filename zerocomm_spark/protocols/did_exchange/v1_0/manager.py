"""RFC 0023 DID exchange 1.0 flows, both roles, with the checks that make the result trustworthy.

Threading (RFC 0008/0023): the request's @id is the exchange's thread id; every message carries it as
``~thread.thid`` and the invitation's @id as ``~thread.pthid``. Each side makes a new key pair and a
did:peer:2 DID for the relationship. The response's DID doc is signed with the invitation key, which
is what binds "the party I invited" to "the DID I now talk to"; we refuse it otherwise.

The manager builds and checks messages and moves records between states; packing and sending is
the agent's job, so this module can be tested without sockets.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from zerocomm_spark.connections import ConnectionRecord, ConnectionStore
from zerocomm_spark.did.peer import DIDDocument, create_peer_did, resolve
from zerocomm_spark.errors import InvitationError, ProblemReportError, ProtocolError, ReplayError, SignatureError
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.did_exchange.v1_0.messages import (
    DIDXComplete,
    DIDXProblemReport,
    DIDXRequest,
    DIDXResponse,
)
from zerocomm_spark.protocols.message import Attachment, Thread
from zerocomm_spark.protocols.out_of_band.v1_1.manager import OutOfBandManager, ReceivedInvitation
from zerocomm_spark.transport.peer import dialable

__all__ = ["DIDExchangeManager", "KEY_PURPOSE"]

log = logging.getLogger(__name__)

KEY_PURPOSE = "relationship"
# Messages go straight to the peer's endpoint, never wrapped in a forward for a mediator (RFC 0094):
# one sent to a mediated DID's endpoint would never be delivered.
_MEDIATED = ("the %s's DID reaches it through a mediator (its DIDComm service names routingKeys), "
             "which is not supported")


def signed_did_doc(did: str, signer: KeyPair) -> Attachment:
    """The resolved DID doc of ``did`` as an attachment signed by ``signer``."""
    attachment = Attachment.from_json(resolve(did).to_dict())
    attachment.sign(signer)
    return attachment


def verify_did_doc(did: str, attachment: Attachment | None, *, signer: str | None,
                   required: bool) -> DIDDocument:
    """Resolve ``did`` and check its attached doc: signed by ``signer`` (a verkey) and about ``did``.

    did:peer:2 resolves from the DID itself, so the resolved doc is authoritative; the attachment's
    value is its signature, which proves who vouches for the DID.
    """
    doc = resolve(did)
    if attachment is None:
        if required:
            raise SignatureError("the DID doc attachment RFC 0023 requires is missing")
        return doc
    actual = attachment.signer()
    if signer is not None and actual != signer:
        raise SignatureError("the DID doc is signed by a key other than the expected one")
    attached = attachment.json()
    if not isinstance(attached, dict):
        raise ProtocolError("field 'did_doc~attach' is not a DID document (a JSON object)")
    doc_id = attached.get("id")
    if not isinstance(doc_id, str) or not doc_id:
        # A signed doc that names no DID vouches for nothing; taking it as about 'did' would be a guess.
        raise ProtocolError("field 'did_doc~attach' is a DID document with no 'id': it names no DID",
                            hint="The peer's agent must attach its full DID document (with its 'id'); ask its "
                                 "operator to upgrade, then accept a fresh invitation")
    if doc_id != did:
        raise ProtocolError("field 'did_doc~attach' describes another DID than field 'did'")
    return doc


class DIDExchangeManager:
    """Runs both sides of the DID exchange over records in a ConnectionStore."""

    def __init__(self, keystore: Keystore, connections: ConnectionStore, oob: OutOfBandManager, *,
                 endpoint: Callable[[], str] | str, label: str) -> None:
        self._keystore = keystore
        self._connections = connections
        self._oob = oob
        self._endpoint = endpoint if callable(endpoint) else (lambda: endpoint)
        self._label = label
        self._lock = threading.RLock()

    def _new_identity(self, connection_id: str) -> tuple[KeyPair, str]:
        key = self._keystore.create_key(KEY_PURPOSE, ref=connection_id)
        return key, create_peer_did(key.verkey, self._endpoint())

    # --- requester ----------------------------------------------------------------------------

    def create_request(self, invitation: ReceivedInvitation, *, label: str | None = None,
                       goal_code: str | None = None) -> tuple[ConnectionRecord, DIDXRequest, KeyPair]:
        """Our request for ``invitation`` with a new DID; returns the key to authcrypt it with."""
        record = ConnectionRecord(role="requester", state="invitation-received",
                                  invitation_id=invitation.id, invitation_key=invitation.recipient_key,
                                  their_endpoint=invitation.endpoint, their_label=invitation.label)
        key, did = self._new_identity(record.connection_id)
        request = DIDXRequest(label=label if label is not None else self._label, did=did,
                              did_doc_attach=signed_did_doc(did, key), goal_code=goal_code)
        request.thread = Thread(thid=request.id, pthid=invitation.id)
        record.thread_id = request.id
        record.my_did, record.my_verkey = did, key.verkey
        record.state = "request-sent"
        self._connections.save(record)
        return record, request, key

    def receive_response(self, response: DIDXResponse, *, recipient_verkey: str,
                         sender_verkey: str | None) -> ConnectionRecord:
        """Check the response against our request and the invitation key; on success, response-received."""
        with self._lock:
            record = self._connections.by_thread_id(response.thid, role="requester")
            if record is None or record.my_verkey != recipient_verkey:
                raise ProtocolError("the response answers no DID-exchange request of ours")
            if record.state != "request-sent":
                raise ReplayError(f"a response for this exchange was already processed (state {record.state})")
            try:
                if response.pthid is not None and response.pthid != record.invitation_id:
                    raise ProtocolError("field '~thread.pthid' is not the invitation's @id")
                doc = verify_did_doc(response.did, response.did_doc_attach,
                                     signer=record.invitation_key, required=True)
                if sender_verkey != doc.verkey:
                    raise ProtocolError("the response was not authcrypted by the key of its DID")
                if doc.service_endpoint and not dialable(doc.service_endpoint):
                    raise ProtocolError("the responder's DID names no ZeroMQ endpoint (tcp://, ipc://) to send to")
                if doc.routing_keys:
                    raise ProtocolError(_MEDIATED % "responder")
            except (ProtocolError, SignatureError) as exc:
                self.abandon(record, f"response rejected: {type(exc).__name__}")
                raise
            record.their_did, record.their_verkey = response.did, doc.verkey
            record.their_endpoint = doc.service_endpoint or record.their_endpoint
            record.state = "response-received"
            self._connections.save(record)
            return record

    def create_complete(self, record: ConnectionRecord) -> DIDXComplete:
        """The complete message; the caller marks the record completed once it was delivered."""
        if record.state != "response-received":
            raise ProtocolError(f"cannot complete an exchange in state {record.state}")
        return DIDXComplete(thread=Thread(thid=record.thread_id, pthid=record.invitation_id))

    def mark_completed(self, record: ConnectionRecord) -> ConnectionRecord:
        record.state = "completed"
        return self._connections.save(record)

    # --- responder ----------------------------------------------------------------------------

    def receive_request(self, request: DIDXRequest, *, recipient_verkey: str,
                        sender_verkey: str | None) -> tuple[ConnectionRecord, DIDXResponse, KeyPair]:
        """Accept a request to one of our invitations; returns the record, the response and our new key.

        Refuses (ReplayError) a thread id seen before and a second use of a single-use invitation,
        before anything is created, so a replay leaves no second connection behind.
        """
        invitation = self._oob.record_for_key(recipient_verkey)
        if invitation is None:
            raise InvitationError("the request is not addressed to an invitation key of ours")
        thread_id = request.thid
        with self._lock:
            if self._connections.by_thread_id(thread_id, role="responder") is not None:
                raise ReplayError("this DID-exchange request (same thread id) was already processed")
            if self._connections.by_thread_id(thread_id) is not None:
                # The requester picks the thread id, and the ids of our other exchanges are no secret
                # (group status sections are keyed by them, in clear): one connection per thread id,
                # or a peer could make its relationship stand in for another one's.
                raise ProtocolError("the thread id of this DID-exchange request is that of another exchange "
                                    "of this agent; start the request on a thread of its own")
            if request.pthid != invitation.invitation_id:
                raise ProtocolError("field '~thread.pthid' is not the @id of the invitation it was sent to")
            doc = verify_did_doc(request.did, request.did_doc_attach, signer=None, required=False)
            if request.did_doc_attach is not None and request.did_doc_attach.signer() != doc.verkey:
                raise SignatureError("the request's DID doc is not signed by the key of its DID")
            if sender_verkey != doc.verkey:
                raise ProtocolError("the request was not authcrypted by the key of its DID")
            if not doc.service_endpoint:
                raise ProtocolError("the requester's DID has no service endpoint to answer to")
            if not dialable(doc.service_endpoint):
                # Refused before the invitation is used: accepting would burn a single-use invitation
                # on a response that can never be sent, and leave the requester waiting for it.
                raise ProtocolError("the requester's DID names no ZeroMQ endpoint (tcp://, ipc://) to answer to")
            if doc.routing_keys:  # refused before the invitation is used, as above
                raise ProtocolError(_MEDIATED % "requester")
            self._oob.consume(invitation.invitation_id, thread_id)

            record = ConnectionRecord(role="responder", state="request-received", thread_id=thread_id,
                                      invitation_id=invitation.invitation_id, invitation_key=recipient_verkey,
                                      their_did=request.did, their_verkey=doc.verkey,
                                      their_endpoint=doc.service_endpoint, their_label=request.label)
            key, did = self._new_identity(record.connection_id)
            record.my_did, record.my_verkey = did, key.verkey
            response = DIDXResponse(did=did,
                                    did_doc_attach=signed_did_doc(did, self._keystore.get(recipient_verkey)),
                                    thread=Thread(thid=thread_id, pthid=invitation.invitation_id))
            record.state = "response-sent"
            self._connections.save(record)
        log.info("accepted a DID-exchange request: connection %s", record.connection_id)
        return record, response, key

    def receive_complete(self, complete: DIDXComplete, *, recipient_verkey: str,
                         sender_verkey: str | None) -> ConnectionRecord:
        with self._lock:
            record = self._connections.by_thread_id(complete.thid, role="responder")
            if record is None or record.my_verkey != recipient_verkey:
                raise ProtocolError("the complete message ends no DID exchange of ours")
            if sender_verkey != record.their_verkey:
                raise ProtocolError("the complete message was not authcrypted by the connection's key")
            if complete.pthid is not None and complete.pthid != record.invitation_id:
                raise ProtocolError("field '~thread.pthid' is not the invitation's @id")
            if record.state == "completed":
                # Already completed implicitly by their first message (RFC 0023 allows that); the
                # explicit complete adds nothing. Literal replays are caught by the agent's id cache.
                return record
            if record.state != "response-sent":
                raise ProtocolError(f"a complete message is not expected in state {record.state}")
            return self.mark_completed(record)

    # --- either side ---------------------------------------------------------------------------

    def create_problem_report(self, record: ConnectionRecord, code: str, explanation: str) -> DIDXProblemReport:
        return DIDXProblemReport(code=code, explanation=explanation,
                                 thread=Thread(thid=record.thread_id, pthid=record.invitation_id))

    def receive_problem_report(self, report: DIDXProblemReport, *, recipient_verkey: str,
                               sender_verkey: str | None) -> tuple[ConnectionRecord, ProblemReportError]:
        """Abandon the exchange the report is about; returns the error to hand to whoever waits on it."""
        record = self._connections.by_thread_id(report.thid)
        if record is None or record.my_verkey != recipient_verkey:
            raise ProtocolError("the problem report is about no DID exchange of ours")
        # Before the response we do not know their key yet; only the responder could decrypt our DID.
        if record.their_verkey is not None and sender_verkey != record.their_verkey:
            raise ProtocolError("the problem report was not authcrypted by the connection's key")
        if record.state in ("completed", "abandoned"):
            raise ProtocolError(f"a problem report is not expected in state {record.state}")
        self.abandon(record, f"peer reported {report.code}")
        return record, ProblemReportError(f"the peer abandoned the DID exchange: {report.code}")

    def abandon(self, record: ConnectionRecord, reason: str) -> ConnectionRecord:
        record.state = "abandoned"
        record.problem = reason[:200]
        log.info("DID exchange of connection %s abandoned: %s", record.connection_id, record.problem)
        return self._connections.save(record)

