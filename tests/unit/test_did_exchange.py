"""RFC 0023 DID exchange 1.0: messages, signed DID-doc attachments and both roles' flows.

Two identities with their own keystores run the exchange in-process: every message goes through
to_dict -> RFC 0019 envelope -> unpack -> parse_message, so the crypto and parsing are the real ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from zerocomm_spark.connections import ConnectionRecord, ConnectionStore
from zerocomm_spark.did.peer import did_key, resolve
from zerocomm_spark.envelope import pack, unpack
from zerocomm_spark.errors import (
    ConnectionNotFoundError,
    InvitationError,
    ProblemReportError,
    ProtocolError,
    ReplayError,
    SignatureError,
)
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.did_exchange.v1_0.manager import DIDExchangeManager, signed_did_doc, verify_did_doc
from zerocomm_spark.protocols.did_exchange.v1_0.messages import (
    DIDXComplete,
    DIDXProblemReport,
    DIDXRequest,
    DIDXResponse,
    ProblemCode,
)
from zerocomm_spark.protocols.message import AgentMessage, Attachment, Thread, b64url_decode, b64url_encode, parse_message
from zerocomm_spark.protocols.out_of_band.v1_1.manager import OutOfBandManager


@dataclass
class Side:
    keystore: Keystore
    store: ConnectionStore
    oob: OutOfBandManager
    didx: DIDExchangeManager
    endpoint: str


def _side(path: Path, label: str, port: int) -> Side:
    ks = Keystore.open(path)
    endpoint = f"tcp://127.0.0.1:{port}"
    store = ConnectionStore(ks)
    oob = OutOfBandManager(ks, endpoint, label)
    return Side(ks, store, oob, DIDExchangeManager(ks, store, oob, endpoint=endpoint, label=label), endpoint)


@pytest.fixture
def alice(tmp_path: Path) -> Iterator[Side]:
    side = _side(tmp_path / "alice", "alice", 41001)
    yield side
    side.keystore.close()


@pytest.fixture
def bob(tmp_path: Path) -> Iterator[Side]:
    side = _side(tmp_path / "bob", "bob", 41002)
    yield side
    side.keystore.close()


def _transmit(message: AgentMessage, to: str, sender: KeyPair, receiver: Keystore):
    """Through a real envelope and parser, as the agent does."""
    unpacked = unpack(pack(message.to_dict(), [to], sender=sender), receiver.find)
    return parse_message(unpacked.json()), unpacked


def _request(alice: Side, bob: Side, *, multi_use: bool = False):
    invitation, _ = alice.oob.create_invitation(multi_use=multi_use)
    received = OutOfBandManager.parse_url(invitation.to_url())
    record, request, key = bob.didx.create_request(received)
    return invitation, received, record, request, key


def _accept(alice: Side, request: DIDXRequest, key: KeyPair, to: str):
    message, unpacked = _transmit(request, to, key, alice.keystore)
    assert isinstance(message, DIDXRequest)
    return alice.didx.receive_request(message, recipient_verkey=unpacked.recipient_verkey,
                                      sender_verkey=unpacked.sender_verkey)


def test_full_exchange_threads_states_and_keys(alice: Side, bob: Side) -> None:
    invitation, received, b_record, request, b_key = _request(alice, bob)
    # Request: its @id is the thread id, pthid the invitation; a new key and did:peer:2 for the relationship.
    assert request.thread.thid == request.id and request.thread.pthid == invitation.id  # type: ignore[union-attr]
    assert b_record.state == "request-sent" and b_record.role == "requester" and b_record.thread_id == request.id
    assert request.did.startswith("did:peer:2.") and resolve(request.did).verkey == b_key.verkey
    assert {k.verkey for k in bob.keystore.keys("relationship")} == {b_key.verkey}
    assert request.did_doc_attach is not None and request.did_doc_attach.signer() == b_key.verkey

    a_record, response, a_key = _accept(alice, request, b_key, received.recipient_key)
    assert a_record.state == "response-sent" and a_record.role == "responder"
    assert a_record.their_did == request.did and a_record.their_label == "bob"
    assert a_record.their_endpoint == bob.endpoint
    assert a_key.verkey != received.recipient_key  # not the invitation key: a fresh relationship key
    assert response.thread.thid == request.id and response.thread.pthid == invitation.id  # type: ignore[union-attr]
    # The response's DID doc is signed by the invitation key, named as a did:key (RFC 0023).
    assert response.did_doc_attach.signer() == received.recipient_key  # type: ignore[union-attr]
    assert response.did_doc_attach.jws["header"]["kid"] == did_key(received.recipient_key)  # type: ignore[union-attr,index]

    message, unpacked = _transmit(response, b_key.verkey, a_key, bob.keystore)
    b_record = bob.didx.receive_response(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                         sender_verkey=unpacked.sender_verkey)
    assert b_record.state == "response-received" and b_record.their_verkey == a_key.verkey
    assert b_record.their_endpoint == alice.endpoint

    complete = bob.didx.create_complete(b_record)
    assert complete.thread.thid == request.id and complete.thread.pthid == invitation.id  # type: ignore[union-attr]
    bob.didx.mark_completed(b_record)
    message, unpacked = _transmit(complete, a_key.verkey, b_key, alice.keystore)
    a_record = alice.didx.receive_complete(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                           sender_verkey=unpacked.sender_verkey)
    assert a_record.state == "completed"
    assert bob.store.get(b_record.connection_id).state == "completed"
    # A second complete (after an implied completion, say) changes nothing.
    again = alice.didx.receive_complete(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                        sender_verkey=unpacked.sender_verkey)
    assert again.state == "completed" and len(alice.store) == 1
    # A complete from anyone but the peer is refused.
    forged, unpacked = _transmit(complete, a_key.verkey, KeyPair.generate(), alice.keystore)
    with pytest.raises(ProtocolError, match="authcrypted"):
        alice.didx.receive_complete(forged, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                    sender_verkey=unpacked.sender_verkey)


def test_messages_round_trip_and_validate() -> None:
    key = KeyPair.generate()
    did = "did:peer:2.Vz6MkoceewtP46RWtfeSsKfPqVYJvTw4ZmUfRRimahbD9Dm6e"
    request = DIDXRequest(label="bob", did=did, did_doc_attach=Attachment.from_json({"id": did}))
    request.did_doc_attach.sign(key)  # type: ignore[union-attr]
    from zerocomm_spark.protocols.message import Thread

    request.thread = Thread(thid=request.id, pthid="inv-1")
    data = request.to_dict()
    assert set(data) >= {"@type", "@id", "~thread", "label", "did", "did_doc~attach"}
    assert data["did_doc~attach"]["data"]["jws"]["header"]["kid"] == did_key(key.verkey)
    assert parse_message(data) == request

    missing_did = dict(data)
    del missing_did["did"]
    with pytest.raises(ProtocolError, match="'did'"):
        parse_message(missing_did)
    no_pthid = dict(data, **{"~thread": {"thid": request.id}})
    with pytest.raises(ProtocolError, match="pthid"):
        parse_message(no_pthid)
    with pytest.raises(ProtocolError, match="'~thread.thid'"):
        parse_message(DIDXResponse(did=did).to_dict())
    with pytest.raises(ProtocolError, match="pthid"):
        parse_message(DIDXComplete(thread=Thread(thid="t")).to_dict())
    bad_attach = dict(data, **{"did_doc~attach": {"data": {"json": {}}}})
    with pytest.raises(ProtocolError, match="did_doc~attach.data.base64"):
        parse_message(bad_attach)

    report = DIDXProblemReport(code=ProblemCode.REQUEST_NOT_ACCEPTED, explanation="no",
                               thread=Thread(thid="t"))
    assert report.to_dict()["description"] == {"code": "request_not_accepted", "en": "no"}
    assert parse_message(report.to_dict()) == report


def test_signed_attachment_verifies_and_detects_forgery(alice: Side) -> None:
    key, other = KeyPair.generate(), KeyPair.generate()
    did = "did:peer:2.Vz6MkoceewtP46RWtfeSsKfPqVYJvTw4ZmUfRRimahbD9Dm6e"
    attach = Attachment.from_json({"id": did, "service": []})
    attach.sign(key)
    assert attach.signer() == key.verkey

    # The payload changed after signing.
    tampered = Attachment.from_dict(attach.to_dict(), "a")
    tampered.base64 = Attachment.from_json({"id": did, "service": ["evil"]}).base64
    with pytest.raises(SignatureError):
        tampered.signer()

    # Signed by someone else while claiming to be `key`.
    forged = Attachment.from_dict(attach.to_dict(), "a")
    forged.sign(other)
    forged_header = json.loads(b64url_decode(forged.jws["protected"]))  # type: ignore[index]
    forged_header["kid"] = did_key(key.verkey)
    forged_header["jwk"]["x"] = b64url_encode(key.verkey_bytes)
    forged.jws["protected"] = b64url_encode(json.dumps(forged_header).encode())  # type: ignore[index]
    forged.jws["header"]["kid"] = did_key(key.verkey)  # type: ignore[index]
    with pytest.raises(SignatureError):
        forged.signer()

    # Unprotected kid edited to name another key.
    relabelled = Attachment.from_dict(attach.to_dict(), "a")
    relabelled.jws["header"] = {"kid": did_key(other.verkey)}  # type: ignore[index]
    with pytest.raises(SignatureError, match="disagree"):
        relabelled.signer()

    # A garbage signature, and no signature at all.
    broken = Attachment.from_dict(attach.to_dict(), "a")
    broken.jws["signature"] = b64url_encode(b"\x00" * 64)  # type: ignore[index]
    with pytest.raises(SignatureError):
        broken.signer()
    with pytest.raises(SignatureError, match="no JWS"):
        Attachment.from_json({}).signer()

    # A real signature by the wrong key is refused where a specific signer is required.
    real_did_key = KeyPair.generate()
    from zerocomm_spark.did.peer import create_peer_did

    peer_did = create_peer_did(real_did_key.verkey, "tcp://127.0.0.1:1")
    good = signed_did_doc(peer_did, key)
    assert verify_did_doc(peer_did, good, signer=key.verkey, required=True).verkey == real_did_key.verkey
    with pytest.raises(SignatureError, match="other than the expected"):
        verify_did_doc(peer_did, good, signer=other.verkey, required=True)
    with pytest.raises(SignatureError, match="missing"):
        verify_did_doc(peer_did, None, signer=key.verkey, required=True)


def test_deeply_nested_attachments_are_refused_as_protocol_errors() -> None:
    """A peer's JWS header or signed doc nested past the recursion limit is refused, not a RecursionError."""
    key = KeyPair.generate()
    deep = Attachment(base64=b64url_encode(b"[" * 100_000))
    deep.sign(key)  # a valid signature over garbage: the signer is who it says, the content unreadable
    assert deep.signer() == key.verkey
    with pytest.raises(ProtocolError, match="not JSON"):
        deep.json()
    header = Attachment.from_json({"id": "did:example:1"})
    header.jws = {"protected": b64url_encode(b"[" * 100_000), "signature": b64url_encode(b"\x00" * 64)}
    with pytest.raises(SignatureError, match="JSON"):
        header.signer()


def _refused_and_abandoned(bob: Side, b_record: ConnectionRecord, response: DIDXResponse, b_key: KeyPair, a_key: KeyPair,
                           error: type[Exception]) -> None:
    """Bob refuses the response with ``error`` and abandons the exchange it answers."""
    message, unpacked = _transmit(response, b_key.verkey, a_key, bob.keystore)
    with pytest.raises(error):
        bob.didx.receive_response(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                  sender_verkey=unpacked.sender_verkey)
    assert bob.store.get(b_record.connection_id).state == "abandoned"


def test_response_with_an_unreadable_signed_doc_abandons_the_exchange(alice: Side, bob: Side) -> None:
    _, received, b_record, request, b_key = _request(alice, bob)
    _, response, a_key = _accept(alice, request, b_key, received.recipient_key)
    # Signed by the invitation key (a hostile inviter), but no JSON a parser survives.
    response.did_doc_attach = Attachment(base64=b64url_encode(b"[" * 100_000))
    response.did_doc_attach.sign(alice.keystore.get(received.recipient_key))
    _refused_and_abandoned(bob, b_record, response, b_key, a_key, ProtocolError)


def test_request_with_a_hostile_did_is_a_protocol_level_refusal(alice: Side, bob: Side) -> None:
    """The requester's DID is parsed from the wire: a service whose type is a list is a DIDComm error."""
    _, received, _, request, b_key = _request(alice, bob)
    service = b64url_encode(json.dumps({"t": ["did-communication"], "s": bob.endpoint}).encode())
    request.did = request.did.split(".S")[0] + ".S" + service
    request.did_doc_attach = signed_did_doc(request.did, b_key)
    with pytest.raises(ProtocolError, match="no service endpoint"):
        _accept(alice, request, b_key, received.recipient_key)
    assert len(alice.store) == 0


def test_response_signed_by_another_key_is_rejected(alice: Side, bob: Side) -> None:
    _, received, b_record, request, b_key = _request(alice, bob)
    _, response, a_key = _accept(alice, request, b_key, received.recipient_key)
    # A man in the middle re-signs the doc with its own key: the signature is valid, the signer is not.
    response.did_doc_attach.sign(KeyPair.generate())  # type: ignore[union-attr]
    _refused_and_abandoned(bob, b_record, response, b_key, a_key, SignatureError)


def test_response_with_tampered_attachment_or_wrong_sender_is_rejected(alice: Side, bob: Side) -> None:
    _, received, b_record, request, b_key = _request(alice, bob)
    _, response, a_key = _accept(alice, request, b_key, received.recipient_key)
    data = response.to_dict()
    data["did_doc~attach"]["data"]["base64"] = Attachment.from_json({"id": response.did, "x": 1}).base64
    message, unpacked = _transmit(DIDXResponse.from_dict(data), b_key.verkey, a_key, bob.keystore)
    with pytest.raises(SignatureError):
        bob.didx.receive_response(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                  sender_verkey=unpacked.sender_verkey)

    _, received, b_record, request, b_key = _request(alice, bob)
    _, response, a_key = _accept(alice, request, b_key, received.recipient_key)
    message, unpacked = _transmit(response, b_key.verkey, KeyPair.generate(), bob.keystore)
    with pytest.raises(ProtocolError, match="authcrypted"):
        bob.didx.receive_response(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                  sender_verkey=unpacked.sender_verkey)


def test_replayed_request_makes_no_second_connection(alice: Side, bob: Side) -> None:
    invitation, received, _, request, b_key = _request(alice, bob)
    _accept(alice, request, b_key, received.recipient_key)
    assert len(alice.store) == 1
    # The very same request again.
    with pytest.raises(ReplayError, match="same thread id"):
        _accept(alice, request, b_key, received.recipient_key)
    # A new @id on the same thread.
    from zerocomm_spark.protocols.message import Thread

    again = DIDXRequest.from_dict({**request.to_dict(), "@id": "another-id"})
    again.thread = Thread(thid=request.id, pthid=invitation.id)
    with pytest.raises(ReplayError):
        _accept(alice, again, b_key, received.recipient_key)
    # A fresh request (new thread, new key) to the single-use invitation already used.
    _, request2, key2 = bob.didx.create_request(received)
    with pytest.raises(ReplayError, match="already used"):
        _accept(alice, request2, key2, received.recipient_key)
    assert len(alice.store) == 1
    assert len(alice.keystore.keys("relationship")) == 1


def test_multi_use_invitation_makes_separate_connections(alice: Side, bob: Side) -> None:
    _, received, _, request, b_key = _request(alice, bob, multi_use=True)
    first, _, _ = _accept(alice, request, b_key, received.recipient_key)
    _, request2, key2 = bob.didx.create_request(received)
    second, _, _ = _accept(alice, request2, key2, received.recipient_key)
    assert first.connection_id != second.connection_id and first.my_verkey != second.my_verkey
    assert len(alice.store) == 2


def test_request_checks(alice: Side, bob: Side) -> None:
    invitation, received, _, request, b_key = _request(alice, bob)
    # Authcrypted by a key that is not the one of the request's DID.
    with pytest.raises(ProtocolError, match="authcrypted"):
        _accept(alice, request, KeyPair.generate(), received.recipient_key)
    # Anoncrypt names no sender at all.
    unpacked = unpack(pack(request.to_dict(), [received.recipient_key]), alice.keystore.find)
    with pytest.raises(ProtocolError, match="authcrypted"):
        alice.didx.receive_request(request, recipient_verkey=unpacked.recipient_verkey, sender_verkey=None)
    # Wrong parent thread.
    from zerocomm_spark.protocols.message import Thread

    request.thread = Thread(thid=request.id, pthid="some-other-invitation")
    with pytest.raises(ProtocolError, match="pthid"):
        _accept(alice, request, b_key, received.recipient_key)
    # Sent to a key that is not an invitation key.
    with pytest.raises(InvitationError):
        alice.didx.receive_request(request, recipient_verkey=b_key.verkey, sender_verkey=b_key.verkey)
    assert len(alice.store) == 0


def test_problem_report_abandons_the_exchange(alice: Side, bob: Side) -> None:
    _, received, b_record, request, b_key = _request(alice, bob)
    a_record, _, a_key = _accept(alice, request, b_key, received.recipient_key)
    report = alice.didx.create_problem_report(a_record, ProblemCode.REQUEST_NOT_ACCEPTED, "not today")
    message, unpacked = _transmit(report, b_key.verkey, a_key, bob.keystore)
    record, error = bob.didx.receive_problem_report(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                                    sender_verkey=unpacked.sender_verkey)
    assert record.state == "abandoned" and isinstance(error, ProblemReportError)
    assert "request_not_accepted" in str(error)
    with pytest.raises(ProtocolError):  # no second abandon
        bob.didx.receive_problem_report(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                        sender_verkey=unpacked.sender_verkey)


def test_connection_store_lookups_survive_a_restart(tmp_path: Path) -> None:
    alice, bob = _side(tmp_path / "a", "alice", 41003), _side(tmp_path / "b", "bob", 41004)
    _, received, _, request, b_key = _request(alice, bob)
    a_record, _, _ = _accept(alice, request, b_key, received.recipient_key)
    alice.keystore.close()
    bob.keystore.close()
    with Keystore.open(tmp_path / "a") as ks:
        store = ConnectionStore(ks)
        assert store.get(a_record.connection_id) == a_record
        assert store.by_their_did(request.did) == a_record
        assert store.by_my_verkey(a_record.my_verkey) == a_record  # type: ignore[arg-type]
        assert store.by_thread_id(request.id) == a_record
        assert store.by_thread_id(request.id, role="requester") is None
        assert store.by_label("bob") == [a_record]
        assert ks.get_record("connection", a_record.connection_id)["state"] == "response-sent"  # type: ignore[index]
        with pytest.raises(ConnectionNotFoundError):
            store.get("nope")
        # What a caller changes is not visible until saved.
        copy = store.get(a_record.connection_id)
        copy.state = "completed"
        assert store.get(a_record.connection_id).state == "response-sent"
        store.save(copy)
        assert store.get(a_record.connection_id).state == "completed"


# --- found in review F ----------------------------------------------------------------------------


def _side_at(path: Path, label: str, endpoint: str) -> Side:
    ks = Keystore.open(path)
    store = ConnectionStore(ks)
    oob = OutOfBandManager(ks, endpoint, label)
    return Side(ks, store, oob, DIDExchangeManager(ks, store, oob, endpoint=endpoint, label=label), endpoint)


def test_a_request_from_a_did_we_cannot_dial_is_refused_before_the_invitation_is_used(
        alice: Side, tmp_path: Path) -> None:
    """An Aries agent's DID names an https:// endpoint, which ZeroMQ cannot dial. The request was
    accepted (receipt ok), the single-use invitation burnt and a connection made, then the response
    failed to go out: the requester waited for its deadline and the inviter had to invite again.
    Now the request is refused at once, and the invitation still serves a requester we can answer."""
    aries = _side_at(tmp_path / "aries", "aries", "https://agent.example.org/didcomm")
    try:
        invitation, received, _, request, key = _request(alice, aries)
        with pytest.raises(ProtocolError, match="ZeroMQ endpoint"):
            _accept(alice, request, key, received.recipient_key)
        assert len(alice.store) == 0 and alice.keystore.keys("relationship") == []
        assert alice.oob.get(invitation.id).used_by == []  # type: ignore[union-attr]
    finally:
        aries.keystore.close()
    bob = _side(tmp_path / "bob2", "bob", 41005)
    try:
        _, request, key = bob.didx.create_request(received)
        record, _, _ = _accept(alice, request, key, received.recipient_key)
        assert record.state == "response-sent"
    finally:
        bob.keystore.close()


def test_a_response_from_a_did_we_cannot_dial_abandons_the_exchange(alice: Side, bob: Side, tmp_path: Path) -> None:
    _, received, b_record, request, b_key = _request(alice, bob)
    _, response, _ = _accept(alice, request, b_key, received.recipient_key)
    # The inviter answers with a DID of its own whose endpoint is https://, signed with the invitation key.
    other = KeyPair.generate()
    from zerocomm_spark.did.peer import create_peer_did

    response.did = create_peer_did(other.verkey, "https://agent.example.org/didcomm")
    response.did_doc_attach = signed_did_doc(response.did, alice.keystore.get(received.recipient_key))
    message, unpacked = _transmit(response, b_key.verkey, other, bob.keystore)
    with pytest.raises(ProtocolError, match="ZeroMQ endpoint"):
        bob.didx.receive_response(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                  sender_verkey=unpacked.sender_verkey)
    assert bob.store.get(b_record.connection_id).state == "abandoned"


def test_a_did_doc_attachment_without_an_id_is_refused(alice: Side, bob: Side) -> None:
    """A signed doc with no "id" was taken as being about the message's DID (the check defaulted to it):
    the signature then vouched for a document that names no DID at all."""
    _, received, b_record, request, b_key = _request(alice, bob)
    nameless = {k: v for k, v in request.did_doc_attach.json().items() if k != "id"}  # type: ignore[union-attr]
    request.did_doc_attach = Attachment.from_json(nameless)
    request.did_doc_attach.sign(b_key)
    with pytest.raises(ProtocolError, match="no 'id'"):
        _accept(alice, request, b_key, received.recipient_key)
    assert len(alice.store) == 0

    _, received, b_record, request, b_key = _request(alice, bob)
    _, response, a_key = _accept(alice, request, b_key, received.recipient_key)
    nameless = {k: v for k, v in response.did_doc_attach.json().items() if k != "id"}  # type: ignore[union-attr]
    response.did_doc_attach = Attachment.from_json(nameless)
    response.did_doc_attach.sign(alice.keystore.get(received.recipient_key))  # the invitation key: a valid signer
    _refused_and_abandoned(bob, b_record, response, b_key, a_key, ProtocolError)
    for bad_id in (None, 5, ""):
        doc = Attachment.from_json({"id": bad_id})
        doc.sign(b_key)
        with pytest.raises(ProtocolError, match="no 'id'"):
            verify_did_doc(request.did, doc, signer=None, required=False)


def test_a_problem_report_in_rfc_0023s_own_form_abandons_the_exchange(alice: Side, bob: Side) -> None:
    """RFC 0023's example problem report has top-level 'problem-code' and 'explain', no RFC 0035
    'description'; an agent written to it must still end our exchange at once, not by our deadline."""
    _, received, b_record, request, b_key = _request(alice, bob)
    a_record, _, a_key = _accept(alice, request, b_key, received.recipient_key)
    literal = {
        "@type": "https://didcomm.org/didexchange/1.0/problem_report",
        "@id": "5678876542345",
        "~thread": {"thid": request.id},
        "~l10n": {"locale": "en"},
        "problem-code": "request_not_accepted",
        "explain": "Unsupported DID method for provided DID.",
    }
    unpacked = unpack(pack(literal, [b_key.verkey], sender=a_key), bob.keystore.find)
    message = parse_message(unpacked.json())
    assert isinstance(message, DIDXProblemReport)
    assert (message.code, message.explanation) == ("request_not_accepted", "Unsupported DID method for provided DID.")
    record, error = bob.didx.receive_problem_report(message, recipient_verkey=unpacked.recipient_verkey,
                                                    sender_verkey=unpacked.sender_verkey)
    assert record.state == "abandoned" and "request_not_accepted" in str(error)
    # Ours carry both forms, so an agent reading either finds the code.
    ours = alice.didx.create_problem_report(a_record, ProblemCode.REQUEST_NOT_ACCEPTED, "not today").to_dict()
    assert ours["description"] == {"code": "request_not_accepted", "en": "not today"}
    assert (ours["problem-code"], ours["explain"]) == ("request_not_accepted", "not today")
    # Neither form: still a clear ProtocolError.
    with pytest.raises(ProtocolError, match="description"):
        parse_message({**{k: v for k, v in literal.items() if k != "problem-code"}, "@id": "x2"})


def test_a_request_reusing_the_thread_id_of_another_exchange_is_refused(alice: Side, bob: Side,
                                                                         tmp_path: Path) -> None:
    """Thread ids are the exchange ids of group status sections, which every group member sees in
    clear; a member that re-used one as its own request's @id made a second connection with the same
    thread id, and status sections of the first pair were then checked against its key (dropped)."""
    # bob accepted alice's invitation: bob holds a requester record on thread T.
    _, received, b_record, request, b_key = _request(alice, bob)
    a_record, response, a_key = _accept(alice, request, b_key, received.recipient_key)
    message, unpacked = _transmit(response, b_key.verkey, a_key, bob.keystore)
    bob.didx.receive_response(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                              sender_verkey=unpacked.sender_verkey)
    thread_id = b_record.thread_id
    assert thread_id is not None
    # mallory answers bob's own invitation with a request whose @id is T.
    mallory = _side(tmp_path / "mallory", "mallory", 41005)
    try:
        bob_invitation, _ = bob.oob.create_invitation(multi_use=True)
        to_bob = OutOfBandManager.parse_url(bob_invitation.to_url())
        _, forged, m_key = mallory.didx.create_request(to_bob)
        forged.id = thread_id
        forged.thread = Thread(thid=thread_id, pthid=bob_invitation.id)
        with pytest.raises(ProtocolError, match="thread id"):
            _accept(bob, forged, m_key, to_bob.recipient_key)
        assert [r.thread_id for r in bob.store.all()] == [thread_id]  # no second record on T
        assert bob.oob.get(bob_invitation.id).used_by == []  # nor a use of the invitation
        # An honest request (its own thread) still goes through.
        _, honest, h_key = mallory.didx.create_request(to_bob)
        record, _, _ = _accept(bob, honest, h_key, to_bob.recipient_key)
        assert record.thread_id == honest.id and len(bob.store) == 2
    finally:
        mallory.keystore.close()


def _mediated_did(key: KeyPair, endpoint: str) -> str:
    """A did:peer:2 whose DIDComm service goes through a mediator (routingKeys)."""
    from zerocomm_spark.did.peer import X25519_CODEC, _multikey, encode_peer_did_2
    from zerocomm_spark.keys.keypair import verkey_to_x25519

    return encode_peer_did_2(
        [("V", did_key(key.verkey)[len("did:key:"):]), ("E", _multikey(X25519_CODEC, bytes(verkey_to_x25519(key.verkey))))],
        [{"id": "#didcomm-0", "type": "did-communication", "recipientKeys": ["#key-1"],
          "routingKeys": [did_key(KeyPair.generate().verkey)], "serviceEndpoint": endpoint}])


def test_a_did_that_needs_a_mediator_is_refused_in_a_request_and_a_response(alice: Side, bob: Side) -> None:
    """Our answers go straight to the peer's endpoint, never wrapped in a forward for a mediator:
    a DID whose service names routingKeys could never be answered (and would use up the invitation)."""
    # A request from a mediated DID: refused before the single-use invitation is used.
    invitation, received, _, _, _ = _request(alice, bob)
    key = KeyPair.generate()
    did = _mediated_did(key, bob.endpoint)
    request = DIDXRequest(label="carol", did=did, did_doc_attach=signed_did_doc(did, key))
    request.thread = Thread(thid=request.id, pthid=invitation.id)
    with pytest.raises(ProtocolError, match="mediator"):
        _accept(alice, request, key, received.recipient_key)
    assert alice.oob.get(invitation.id).used_by == [] and len(alice.store) == 0

    # A response naming a mediated DID: refused, the exchange abandoned.
    invitation, received, b_record, request, b_key = _request(alice, bob)
    key = KeyPair.generate()
    did = _mediated_did(key, alice.endpoint)
    response = DIDXResponse(did=did, did_doc_attach=signed_did_doc(did, alice.keystore.get(received.recipient_key)),
                            thread=Thread(thid=request.id, pthid=invitation.id))
    message, unpacked = _transmit(response, b_key.verkey, key, bob.keystore)
    with pytest.raises(ProtocolError, match="mediator"):
        bob.didx.receive_response(message, recipient_verkey=unpacked.recipient_verkey,  # type: ignore[arg-type]
                                  sender_verkey=unpacked.sender_verkey)
    assert bob.store.get(b_record.connection_id).state == "abandoned"
