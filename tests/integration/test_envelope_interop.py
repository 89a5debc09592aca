"""Our RFC 0019 envelopes against an independent implementation: aries-staticagent 0.8.0 (PyPI).

aries-staticagent packs and unpacks with its own code (pynacl calls, its own base64 and JSON), so a
round trip through it checks our wire format, not just our self-consistency. Its unpack_message
decodes the body as ASCII, so non-ASCII content crosses as JSON with \\u escapes (what pack does for
dicts); raw UTF-8 bodies are checked through its lower-level key unwrapping instead.
"""

from __future__ import annotations

import json
import os

import nacl.bindings as sodium
import pytest

aries_crypto = pytest.importorskip("aries_staticagent.crypto")

from zerocomm_spark.envelope import pack, unpack  # noqa: E402
from zerocomm_spark.errors import NoRecipientKeyError, TamperedEnvelopeError  # noqa: E402
from zerocomm_spark.keys.keypair import KeyPair  # noqa: E402

NON_ASCII = {
    "@type": "https://didcomm.org/basicmessage/1.0/message",
    "@id": "8d4d6ef1-0b4e-4f0b-a0c7-4b5f0c9d1e2f",
    "content": "Grüße aus Zürich — 東京 — 🔐 ✓",
}


class TheirAgent:
    """An identity held by aries-staticagent: raw Ed25519 keys from its own keypair function."""

    def __init__(self) -> None:
        seed = os.urandom(32)
        self.verkey_raw, self.sigkey = aries_crypto.create_keypair(seed)
        self.verkey = aries_crypto.bytes_to_b58(self.verkey_raw)
        self.ours = KeyPair(seed)  # the same identity as our KeyPair, for our side of the test
        assert self.ours.verkey == self.verkey

    def unpack(self, envelope: bytes) -> tuple[str, str | None, str]:
        return aries_crypto.unpack_message(envelope, self.verkey_raw, self.sigkey)

    def pack(self, message: str, to: list[str], *, auth: bool) -> bytes:
        packed = aries_crypto.pack_message(
            message,
            [aries_crypto.b58_to_bytes(vk) for vk in to],
            self.verkey_raw if auth else None,
            self.sigkey if auth else None,
        )
        return json.dumps(packed).encode()


@pytest.fixture(scope="module")
def them() -> list[TheirAgent]:
    return [TheirAgent() for _ in range(4)]


@pytest.fixture(scope="module")
def us() -> list[KeyPair]:
    return [KeyPair.generate() for _ in range(4)]


@pytest.mark.parametrize("auth", [True, False], ids=["authcrypt", "anoncrypt"])
def test_our_pack_their_unpack_several_recipients(auth: bool, us: list[KeyPair], them: list[TheirAgent]) -> None:
    sender = us[0] if auth else None
    envelope = pack(NON_ASCII, [t.verkey for t in them], sender)
    for agent in them:
        message, sender_vk, recipient_vk = agent.unpack(envelope)
        assert json.loads(message) == NON_ASCII
        assert recipient_vk == agent.verkey
        assert sender_vk == (us[0].verkey if auth else None)


@pytest.mark.parametrize("auth", [True, False], ids=["authcrypt", "anoncrypt"])
def test_their_pack_our_unpack_several_recipients(auth: bool, us: list[KeyPair], them: list[TheirAgent]) -> None:
    text = json.dumps(NON_ASCII)  # their pack takes ASCII only: non-ASCII as JSON escapes
    envelope = them[0].pack(text, [k.verkey for k in us], auth=auth)
    for key in us:
        result = unpack(envelope, {key.verkey: key}.get)
        assert result.message == text.encode("ascii")
        assert result.json() == NON_ASCII
        assert result.recipient_verkey == key.verkey
        assert result.sender_verkey == (them[0].verkey if auth else None)


@pytest.mark.parametrize("auth", [True, False], ids=["authcrypt", "anoncrypt"])
def test_mixed_recipients_both_ways(auth: bool, us: list[KeyPair], them: list[TheirAgent]) -> None:
    """One envelope, recipients on both implementations: each side reads its own entry."""
    recipients = [us[1].verkey, them[1].verkey, us[2].verkey, them[2].verkey]
    envelope = pack("plain ASCII body", recipients, us[0] if auth else None)
    assert them[2].unpack(envelope)[0] == "plain ASCII body"
    assert unpack(envelope, {us[2].verkey: us[2]}.get).message == b"plain ASCII body"

    theirs = them[0].pack("from them", recipients, auth=auth)
    assert unpack(theirs, {us[1].verkey: us[1]}.get).message == b"from them"
    assert them[1].unpack(theirs)[0] == "from them"


@pytest.mark.parametrize("auth", [True, False], ids=["authcrypt", "anoncrypt"])
def test_raw_utf8_body_is_readable_by_their_key_unwrapping(auth: bool, us: list[KeyPair], them: list[TheirAgent]) -> None:
    body = NON_ASCII["content"].encode("utf-8")
    envelope = json.loads(pack(body, [t.verkey for t in them[:3]], us[0] if auth else None))
    header = json.loads(aries_crypto.b64_to_bytes(envelope["protected"], urlsafe=True))
    agent = them[2]
    cek, sender_vk, recipient_vk = aries_crypto.locate_pack_recipient_key(
        header["recipients"], agent.verkey_raw, agent.sigkey
    )
    assert (sender_vk, recipient_vk) == (us[0].verkey if auth else None, agent.verkey)
    opened = sodium.crypto_aead_chacha20poly1305_ietf_decrypt(
        aries_crypto.b64_to_bytes(envelope["ciphertext"], urlsafe=True)
        + aries_crypto.b64_to_bytes(envelope["tag"], urlsafe=True),
        envelope["protected"].encode("ascii"),
        aries_crypto.b64_to_bytes(envelope["iv"], urlsafe=True),
        cek,
    )
    assert opened == body


def test_same_identity_on_both_sides(them: list[TheirAgent]) -> None:
    """A key held by both stacks: their envelope to it opens with our KeyPair and vice versa."""
    agent = them[3]
    theirs = them[0].pack("hello", [agent.verkey], auth=True)
    assert unpack(theirs, {agent.verkey: agent.ours}.get).sender_verkey == them[0].verkey
    ours = pack("hello back", [them[0].verkey], agent.ours)
    assert them[0].unpack(ours)[:2] == ("hello back", agent.verkey)


def test_their_envelope_tampered_is_refused(us: list[KeyPair], them: list[TheirAgent]) -> None:
    envelope = json.loads(them[0].pack("pay 10", [us[0].verkey], auth=True))
    raw = aries_crypto.b64_to_bytes(envelope["ciphertext"], urlsafe=True)
    envelope["ciphertext"] = aries_crypto.bytes_to_b64(bytes([raw[0] ^ 1]) + raw[1:], urlsafe=True)
    with pytest.raises(TamperedEnvelopeError):
        unpack(json.dumps(envelope), {us[0].verkey: us[0]}.get)


def test_their_envelope_for_someone_else(us: list[KeyPair], them: list[TheirAgent]) -> None:
    envelope = them[0].pack("not for us", [them[1].verkey], auth=True)
    with pytest.raises(NoRecipientKeyError):
        unpack(envelope, {us[0].verkey: us[0]}.get)
