"""RFC 0434 out-of-band 1.1: invitation messages, URLs and the invitation records of the manager."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from zerocomm_spark.did.peer import did_key, verkey_from_did_key
from zerocomm_spark.errors import InvitationError, ProtocolError, ReplayError
from zerocomm_spark.keys import KeyPair, b58encode
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.message import b64url_encode
from zerocomm_spark.protocols.out_of_band.v1_1.manager import OutOfBandManager
from zerocomm_spark.protocols.out_of_band.v1_1.messages import DIDEXCHANGE_1_0, INVITATION, Invitation, Service

ENDPOINT = "tcp://127.0.0.1:45678"


@pytest.fixture
def keystore(tmp_path: Path) -> Iterator[Keystore]:
    with Keystore.open(tmp_path / "id") as ks:
        yield ks


@pytest.fixture
def oob(keystore: Keystore) -> OutOfBandManager:
    return OutOfBandManager(keystore, ENDPOINT, "alice")


def _invitation() -> Invitation:
    key = did_key("H3C2AVvLMv6gmMNam3uVAjZpfkcJCwDwnZn6z3wXmqPV")
    return Invitation(services=[Service(recipient_keys=[key], service_endpoint=ENDPOINT)],
                      label="alice", goal_code="aries.rel.build")


def _url_for(data: object) -> str:
    return "https://x.invalid/?oob=" + b64url_encode(json.dumps(data).encode())


def test_invitation_round_trips_through_dict_and_url() -> None:
    invitation = _invitation()
    data = invitation.to_dict()
    assert data["@type"] == "https://didcomm.org/out-of-band/1.1/invitation"
    assert data["handshake_protocols"] == ["https://didcomm.org/didexchange/1.0"]
    assert data["services"][0]["recipientKeys"][0].startswith("did:key:z6Mk")
    assert data["services"][0]["serviceEndpoint"] == ENDPOINT
    assert Invitation.from_dict(data) == invitation

    url = invitation.to_url()
    assert url.startswith("https://zerocomm.invalid/?oob=")
    assert Invitation.from_url(url) == invitation
    # The oob value is unpadded base64url of the JSON, as RFC 0434 shows.
    encoded = parse_qs(urlsplit(url).query)["oob"][0]
    assert "=" not in encoded
    assert json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))) == data


def test_url_with_a_query_already_and_padded_or_bare_values() -> None:
    invitation = _invitation()
    assert "?a=1&oob=" in invitation.to_url("https://example.org/join?a=1")
    padded = base64.urlsafe_b64encode(invitation.to_json().encode()).decode()
    assert Invitation.from_url("https://example.org/?oob=" + padded) == invitation
    assert Invitation.from_url(padded) == invitation  # the bare value, e.g. pasted from a QR code


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("", "empty"),
        ("https://example.org/?x=1", "no 'oob'"),
        ("https://example.org/?c_i=abc", "RFC 0160"),
        ("https://example.org/?oob=%%%", "base64url"),
        ("https://example.org/?oob=" + b64url_encode(b"not json"), "base64url-encoded JSON"),
        ("x" * 70_000, "longer than"),
        # a word pasted in place of the URL said "the 'oob' parameter is not base64url-encoded JSON",
        # a parameter it does not have
        ("garbage", "not an invitation URL"),
        ("AAAA", "not an invitation URL"),
    ],
)
def test_malformed_urls_raise_invitation_error(url: str, words: str) -> None:
    with pytest.raises(InvitationError, match=words):
        Invitation.from_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://[bad?oob=" + b64url_encode(b"{}"),  # urlsplit: "Invalid IPv6 URL" (a ValueError)
        "https://example.org/?oob=" + b64url_encode(b"[" * 20_000),  # json: RecursionError
        b64url_encode(b'{"a":' * 8_000),
    ],
)
def test_hostile_urls_raise_invitation_error_only(url: str) -> None:
    with pytest.raises(InvitationError):
        Invitation.from_url(url)


def test_service_did_with_a_non_string_type_is_an_invitation_error() -> None:
    """A did:peer:2 service whose type is a list (DID Core allows it) must not crash parse_url."""
    key = "Vz" + b58encode(b"\xed\x01" + KeyPair.generate().verkey_bytes)
    service = b64url_encode(json.dumps({"t": ["did-communication"], "s": ENDPOINT}).encode())
    data = _invitation().to_dict()
    data["services"] = [f"did:peer:2.{key}.S{service}"]
    with pytest.raises(InvitationError, match="no usable service"):
        OutOfBandManager.parse_url(_url_for(data))


def test_an_oob_value_in_standard_base64_keeps_its_plus_signs() -> None:
    """Some agents encode the oob value in standard base64 ('+', '/'), which we accept; a query
    parser that reads '+' as a space broke every such URL."""
    import base64

    for label in ("".join(chr(33 + (i * 7 + j) % 94) for j in range(8)) for i in range(200)):  # one with a '+'
        data = Invitation(services=_invitation().services, label=label).to_dict()
        encoded = base64.b64encode(json.dumps(data).encode()).decode()
        if "+" in encoded:
            break
    else:  # pragma: no cover - 200 labels without one '+' in their encoding
        pytest.fail("no label gave a '+' in its standard base64")
    assert Invitation.from_url("https://x.invalid/?oob=" + encoded).label == label


def test_truncated_url_is_refused() -> None:
    url = _invitation().to_url()
    with pytest.raises(InvitationError):
        Invitation.from_url(url[: len(url) // 2])


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("services"), "'services'"),
        (lambda d: d.update({"services": []}), "'services'"),
        (lambda d: d["services"][0].update({"recipientKeys": ["H3C2AVvLMv6gmMNam3uVAjZpfkcJCwDwnZn6z3wXmqPV"]}),
         "'services[0].recipientKeys[0]'"),
        (lambda d: d["services"][0].pop("serviceEndpoint"), "'serviceEndpoint'"),
        (lambda d: d.pop("handshake_protocols"), "'handshake_protocols'"),
        (lambda d: d.update({"label": 42}), "'label'"),
        (lambda d: d.update({"@type": "https://didcomm.org/out-of-band/2.0/invitation"}), "'@type'"),
        (lambda d: d.update({"@type": "https://didcomm.org/out-of-band/1.1/request"}), "'@type'"),
    ],
)
def test_invalid_invitations_name_the_field(mutate, field: str) -> None:
    data = _invitation().to_dict()
    mutate(data)
    with pytest.raises(InvitationError) as info:
        Invitation.from_url(_url_for(data))
    assert field in str(info.value)
    assert isinstance(info.value, ProtocolError)


def test_parse_url_needs_didexchange_and_a_zeromq_service() -> None:
    data = _invitation().to_dict()
    data["handshake_protocols"] = ["https://didcomm.org/connections/1.0"]
    with pytest.raises(InvitationError, match="handshake protocol"):
        OutOfBandManager.parse_url(_url_for(data))
    data = _invitation().to_dict()
    data["services"][0]["serviceEndpoint"] = "https://agent.example.org"
    with pytest.raises(InvitationError, match="no usable service"):
        OutOfBandManager.parse_url(_url_for(data))


def test_created_invitation_has_a_fresh_key_and_is_remembered(oob: OutOfBandManager, keystore: Keystore) -> None:
    first, record = oob.create_invitation(goal_code="aries.rel.build")
    second, _ = oob.create_invitation(label="other")
    key1 = verkey_from_did_key(first.services[0].recipient_keys[0])  # type: ignore[union-attr]
    key2 = verkey_from_did_key(second.services[0].recipient_keys[0])  # type: ignore[union-attr]
    assert key1 != key2
    assert {k.verkey for k in keystore.keys("invitation")} == {key1, key2}
    assert first.label == "alice" and second.label == "other"
    assert first.handshake_protocols == [DIDEXCHANGE_1_0]
    assert record.verkey == key1 and not record.multi_use and record.state == "await-response"
    assert oob.record_for_key(key1).invitation_id == first.id  # type: ignore[union-attr]
    assert oob.record_for_key("H3C2AVvLMv6gmMNam3uVAjZpfkcJCwDwnZn6z3wXmqPV") is None

    received = OutOfBandManager.parse_url(first.to_url())
    assert received.recipient_key == key1 and received.endpoint == ENDPOINT and received.id == first.id


def test_single_use_invitation_is_consumed_once(oob: OutOfBandManager) -> None:
    invitation, _ = oob.create_invitation()
    record = oob.consume(invitation.id, "thread-1")
    assert record.state == "done" and record.used_by == ["thread-1"]
    with pytest.raises(ReplayError, match="already processed"):
        oob.consume(invitation.id, "thread-1")
    with pytest.raises(ReplayError, match="already used"):
        oob.consume(invitation.id, "thread-2")
    with pytest.raises(InvitationError):
        oob.consume("no-such-invitation", "thread-3")


def test_multi_use_invitation_takes_many_threads_but_no_replay(oob: OutOfBandManager) -> None:
    invitation, _ = oob.create_invitation(multi_use=True)
    oob.consume(invitation.id, "t1")
    oob.consume(invitation.id, "t2")
    with pytest.raises(ReplayError):
        oob.consume(invitation.id, "t1")


def test_invitation_records_survive_a_restart(tmp_path: Path) -> None:
    with Keystore.open(tmp_path / "id") as ks:
        invitation, _ = OutOfBandManager(ks, ENDPOINT, "a").create_invitation()
        OutOfBandManager(ks, ENDPOINT, "a").consume(invitation.id, "t1")
    with Keystore.open(tmp_path / "id") as ks:
        oob = OutOfBandManager(ks, ENDPOINT, "a")
        assert oob.get(invitation.id).used_by == ["t1"]  # type: ignore[union-attr]
        with pytest.raises(ReplayError):
            oob.consume(invitation.id, "t2")


# --- found in review F ----------------------------------------------------------------------------


@pytest.mark.parametrize("handshakes", [
    ["https://didcomm.org/didexchange/1.1"],
    ["did:sov:BzCbsNYhMrjHiqZDTUASHg;spec/didexchange/1.1"],
    ["https://didcomm.org/connections/1.0", "https://didcomm.org/didexchange/1.1"],
])
def test_an_invitation_offering_a_later_didexchange_1_x_is_accepted(handshakes: list[str]) -> None:
    """RFC 0003 semver: a didexchange/1.1 responder (ACA-Py, Credo) takes our 1.0 request, and ACA-Py
    lets an inviter offer 1.1 alone; such an invitation was refused as offering nothing we speak."""
    data = _invitation().to_dict()
    data["handshake_protocols"] = handshakes
    received = OutOfBandManager.parse_url(_url_for(data))
    assert received.endpoint == ENDPOINT


@pytest.mark.parametrize("handshake", ["https://didcomm.org/didexchange/2.0", "https://didcomm.org/didexchange/1.",
                                       "https://didcomm.org/didexchange/1.1/request",
                                       "https://didcomm.org/didexchange"])
def test_other_major_versions_of_didexchange_are_still_refused(handshake: str) -> None:
    data = _invitation().to_dict()
    data["handshake_protocols"] = [handshake]
    with pytest.raises(InvitationError, match="handshake protocol"):
        OutOfBandManager.parse_url(_url_for(data))


@pytest.mark.parametrize("message_type", ["https://didcomm.org/out-of-band/1.0/invitation",
                                          "https://didcomm.org/out-of-band/1.2/invitation",
                                          "did:sov:BzCbsNYhMrjHiqZDTUASHg;spec/out-of-band/1.0/invitation"])
def test_invitations_of_another_minor_version_are_accepted(message_type: str) -> None:
    """RFC 0003: a recipient processes another minor version of a message it knows (older agents
    still write out-of-band/1.0 invitations; the fields we use are the same)."""
    data = _invitation().to_dict()
    data["@type"] = message_type
    invitation = Invitation.from_url(_url_for(data))
    assert invitation.label == "alice" and invitation.to_dict()["@type"] == INVITATION


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:45678\x1b[2J", "tcp://" + "a" * 2000])
def test_a_service_endpoint_the_transport_cannot_dial_is_refused_with_the_invitation(endpoint: str) -> None:
    """The invitation's check was a copy of the transport's that looked at the scheme only: such an
    invitation was taken, and accept() then failed in the transport with a ConfigurationError
    quoting the peer's text, as if the user had configured something wrong."""
    data = _invitation().to_dict()
    data["services"][0]["serviceEndpoint"] = endpoint
    with pytest.raises(InvitationError, match="no usable service"):
        OutOfBandManager.parse_url(_url_for(data))


@pytest.mark.parametrize("accept, usable", [
    (None, True),  # no preference given
    (["didcomm/aip1"], True),
    (["didcomm/v2", "didcomm/aip2;env=rfc19"], True),
    (["didcomm/aip2; env=rfc19"], True),
    (["didcomm/v2"], False),
    (["didcomm/aip2;env=rfc587"], False),
])
def test_an_invitation_that_accepts_no_rfc0019_envelope_is_refused_before_any_request(
        accept: list[str] | None, usable: bool) -> None:
    """RFC 0434 `accept` names the envelopes the inviter takes: one that takes only DIDComm v2 (or
    RFC 0587) was answered with an RFC 0019 envelope anyway, which it cannot open."""
    data = _invitation().to_dict()
    data.pop("accept")
    if accept is not None:
        data["accept"] = accept
    if usable:
        assert OutOfBandManager.parse_url(_url_for(data)).invitation.label == "alice"
    else:
        with pytest.raises(InvitationError, match="accepts only .*RFC 0019"):
            OutOfBandManager.parse_url(_url_for(data))


def test_an_invitation_without_accept_is_written_back_without_one() -> None:
    data = _invitation().to_dict()
    assert data["accept"] == ["didcomm/aip1", "didcomm/aip2;env=rfc19"]  # ours say what we take
    data.pop("accept")
    parsed = Invitation.from_url(_url_for(data))
    assert parsed.accept == [] and "accept" not in parsed.to_dict()  # not "accept": [] (which would mean none)


def _mediated_did(key: KeyPair, endpoint: str = ENDPOINT) -> str:
    """A did:peer:2 whose DIDComm service goes through a mediator (routingKeys)."""
    from zerocomm_spark.did.peer import X25519_CODEC, _multikey, encode_peer_did_2
    from zerocomm_spark.keys.keypair import verkey_to_x25519

    mediator = did_key(KeyPair.generate().verkey)
    return encode_peer_did_2(
        [("V", did_key(key.verkey)[len("did:key:"):]), ("E", _multikey(X25519_CODEC, bytes(verkey_to_x25519(key.verkey))))],
        [{"id": "#didcomm-0", "type": "did-communication", "recipientKeys": ["#key-1"], "routingKeys": [mediator],
          "serviceEndpoint": endpoint}])


def test_a_service_did_that_needs_a_mediator_is_refused_like_an_inline_one() -> None:
    """An envelope sent straight to a mediator's endpoint, not wrapped in a forward for it, is never
    delivered: the request would wait for its deadline. Inline services with routingKeys were refused;
    the same service given as a DID was taken."""
    data = _invitation().to_dict()
    data["services"] = [_mediated_did(KeyPair.generate())]
    with pytest.raises(InvitationError, match="mediator"):
        OutOfBandManager.parse_url(_url_for(data))
