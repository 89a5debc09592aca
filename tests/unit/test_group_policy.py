"""Group admission policies and tickets, the group store, and the membership protocol messages."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from zerocomm_spark.errors import ConfigurationError, MalformedGroupMessageError, SignatureError
from zerocomm_spark.group.policy import (
    AdmissionRequest,
    AllOf,
    AllowListPolicy,
    AnyOf,
    InvitationPolicy,
    OpenPolicy,
    Ticket,
    policy_from_dict,
)
from zerocomm_spark.group.store import GroupRecord, GroupStore, Positions
from zerocomm_spark.group.view import member_did_for
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.group.v1_0.messages import (
    Digest,
    DigestResponse,
    GroupProblemReport,
    JoinRequest,
    JoinResponse,
    Leave,
    Subscribe,
    SubscribeResponse,
    ViewUpdate,
)
from zerocomm_spark.protocols.message import Thread, b64url_encode, message_types

ALICE = "did:key:z6MkAlice"
BOB = "did:key:z6MkBob"


def _request(**kw: object) -> AdmissionRequest:
    base: dict[str, object] = dict(group="g", stage="join", member_did=BOB, label="bob", role="read_write")
    base.update(kw)
    return AdmissionRequest(**base)  # type: ignore[arg-type]


# --- policies ------------------------------------------------------------------------------------


def test_open_admits_everyone() -> None:
    assert OpenPolicy().decide(_request()).admitted


def test_allow_list_by_member_or_connection_did() -> None:
    policy = AllowListPolicy([ALICE, "did:peer:2.conn"])
    assert policy.decide(_request(member_did=ALICE)).admitted
    assert policy.decide(_request(connection_did="did:peer:2.conn")).admitted
    refused = policy.decide(_request(stage="subscribe"))
    assert not refused and BOB in refused.reason and "allow-list" in refused.reason
    with pytest.raises(ConfigurationError):
        AllowListPolicy(ALICE)  # a string is not a list of DIDs
    with pytest.raises(ConfigurationError):
        AllowListPolicy(["alice"])


def test_invitation_policy_at_the_acceptor_and_at_the_other_members() -> None:
    policy = InvitationPolicy()
    assert not policy.decide(_request(stage="join"))
    assert policy.decide(_request(stage="join", group_invitation=True))
    assert not policy.decide(_request(stage="join", vouched_by=ALICE))  # the acceptor checks its own invitations
    assert policy.decide(_request(stage="subscribe", vouched_by=ALICE))
    assert not policy.decide(_request(stage="subscribe"))


def test_combinations_and_round_trips() -> None:
    either = AnyOf([AllowListPolicy([ALICE]), InvitationPolicy()])
    assert either.decide(_request(member_did=ALICE))
    assert either.decide(_request(group_invitation=True))
    refused = either.decide(_request())
    assert not refused and "allow-list" in refused.reason and "invitation" in refused.reason
    both = AllOf([AllowListPolicy([BOB]), InvitationPolicy()])
    assert not both.decide(_request())
    assert both.decide(_request(group_invitation=True))
    for policy in (OpenPolicy(), AllowListPolicy([ALICE, BOB]), InvitationPolicy(), either, both):
        again = policy_from_dict(policy.to_dict())
        assert type(again) is type(policy) and again.to_dict() == policy.to_dict()
    for bad in ({"kind": "nope"}, "open", {"kind": "any-of"}, {"kind": "any-of", "policies": []}):
        with pytest.raises(ConfigurationError):
            policy_from_dict(bad)


# --- tickets -----------------------------------------------------------------------------------


def test_a_ticket_proves_who_admitted_whom() -> None:
    acceptor = KeyPair.generate()
    ticket = Ticket.issue("g", BOB, acceptor, nonce="request-1")
    again = Ticket.from_dict(ticket.to_dict())
    assert again.verify(group="g", member=BOB, nonce="request-1") == member_did_for(acceptor.verkey)
    assert again.verify(group="g", member=BOB) == member_did_for(acceptor.verkey)
    with pytest.raises(SignatureError):
        again.verify(group="g", member=ALICE)
    with pytest.raises(SignatureError):
        again.verify(group="h", member=BOB)
    with pytest.raises(SignatureError):
        again.verify(group="g", member=BOB, nonce="request-2")  # a replayed ticket
    with pytest.raises(SignatureError):
        replace(again, member=ALICE).verify(group="g", member=ALICE)  # edited
    impostor = KeyPair.generate()
    with pytest.raises(SignatureError):
        replace(again, by=member_did_for(impostor.verkey)).verify(group="g", member=BOB)
    with pytest.raises(SignatureError):
        replace(Ticket.issue("g", BOB, acceptor), issued_at=time.time() + 3600).verify(group="g", member=BOB)
    with pytest.raises(MalformedGroupMessageError):
        Ticket.from_dict({"group": "g"})


@pytest.mark.parametrize("issued_at", [float("nan"), float("inf"), float("-inf")])
def test_a_ticket_issued_at_no_time_never_passes_for_one_that_does_not_expire(issued_at: float) -> None:
    """NaN compared false both ways, so a ticket signed with issued_at NaN (JSON allows it) passed the
    age check and never expired; infinities are refused the same way."""
    acceptor = KeyPair.generate()
    forged = replace(Ticket.issue("g", BOB, acceptor), issued_at=issued_at)
    forged = replace(forged, signature=b64url_encode(acceptor.sign(forged._signed_part())))  # noqa: SLF001 - signed as sent
    with pytest.raises(SignatureError, match="expired"):
        forged.verify(group="g", member=BOB)
    with pytest.raises(MalformedGroupMessageError, match="finite"):
        Ticket.from_dict(json.loads(json.dumps(forged.to_dict())))


# --- store -------------------------------------------------------------------------------------


def test_the_store_keeps_identity_groups_positions_and_peers(tmp_path: Path) -> None:
    keystore = Keystore.open(tmp_path / "id")
    store = GroupStore(keystore)
    identity = store.identity()
    assert identity == store.identity()  # created once
    store.save_publish_endpoint("tcp://127.0.0.1:5555")
    record = GroupRecord(group="g", mode="multi", ordered=False, consistent_join=True, role="read_only",
                         status="active", group_verkey="v", invitation_url="u", invitation_id="i",
                         policy={"kind": "open"}, peers={ALICE: "c1"})
    store.save(record)
    store.save_positions("g", Positions(7, {ALICE: 3}))
    store.save_peer(ALICE, "c1")
    keystore.close()

    reopened = GroupStore(Keystore.open(tmp_path / "id"))
    again = reopened.identity()
    assert (again.member_verkey, again.curve_public, again.curve_secret) == (
        identity.member_verkey, identity.curve_public, identity.curve_secret)
    assert again.publish_endpoint == "tcp://127.0.0.1:5555"
    assert [r.to_dict() for r in reopened.groups()] == [record.to_dict()]
    assert reopened.positions("g") == Positions(7, {ALICE: 3})
    assert reopened.peer_connection(ALICE) == "c1" and reopened.peer_connection(BOB) is None
    reopened.delete("g")
    assert reopened.groups() == [] and reopened.positions("g") == Positions()
    assert b"curve" not in repr(again).encode() and again.curve_secret.decode() not in repr(again)


# --- messages ----------------------------------------------------------------------------------

_ENTRY = {"did": ALICE}
_SUM = "0" * 64


@pytest.mark.parametrize("message", [
    JoinRequest(group="g", member=_ENTRY),
    JoinResponse(group="g", settings={"mode": "shared"}, view=[_ENTRY], checksum=_SUM, acceptor=ALICE,
                 ticket={"by": ALICE}, thread=Thread(thid="r")),
    Subscribe(group="g", member=_ENTRY, settings={}, ticket={"by": ALICE}),
    Subscribe(group="g", member=_ENTRY, settings={}),
    SubscribeResponse(group="g", member=_ENTRY, checksum=_SUM, position=4, your_version=9, thread=Thread(thid="r")),
    Digest(group="g", state_hash=_SUM, versions={ALICE: 3}),
    DigestResponse(group="g", checksum=_SUM, entries=[_ENTRY], want=[BOB], thread=Thread(thid="r")),
    ViewUpdate(group="g", entries=[_ENTRY]),
    Leave(group="g", member=_ENTRY),
    GroupProblemReport(code="join-refused", explain="not on the list", thread=Thread(thid="r")),
], ids=lambda m: type(m).__name__)
def test_messages_round_trip(message: object) -> None:
    data = message.to_dict()  # type: ignore[attr-defined]
    assert data["@type"].startswith("https://didcomm.org/zerocomm-group/1.0/")
    assert type(message).from_dict(data) == message  # type: ignore[attr-defined]


@pytest.mark.parametrize("data", [
    {"@type": "https://didcomm.org/zerocomm-group/1.0/join-request", "@id": "1", "group": "g"},
    {"@type": "https://didcomm.org/zerocomm-group/1.0/join-request", "@id": "1", "group": 5, "member": {}},
    {"@type": "https://didcomm.org/zerocomm-group/1.0/digest", "@id": "1", "group": "g", "state_hash": "xyz",
     "versions": {}},
    {"@type": "https://didcomm.org/zerocomm-group/1.0/digest", "@id": "1", "group": "g", "state_hash": _SUM,
     "versions": {ALICE: -1}},
    {"@type": "https://didcomm.org/zerocomm-group/1.0/subscribe-response", "@id": "1", "group": "g",
     "member": {}, "checksum": _SUM},  # a reply without ~thread
    {"@type": "https://didcomm.org/zerocomm-group/1.0/digest-response", "@id": "1", "group": "g",
     "checksum": _SUM, "entries": [], "want": [1], "~thread": {"thid": "r"}},
])
def test_malformed_messages_are_refused(data: dict[str, object]) -> None:
    classes = {cls.message_type: cls for cls in (JoinRequest, Digest, SubscribeResponse, DigestResponse)}
    with pytest.raises(MalformedGroupMessageError, match="field"):
        classes[str(data["@type"])].from_dict(data)


def test_the_group_protocol_is_not_in_the_global_registry() -> None:
    """Only agents whose groups registered it parse (and disclose) it."""
    assert not any("zerocomm-group" in t for t in message_types())
