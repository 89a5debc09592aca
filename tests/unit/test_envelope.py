"""RFC 0019 envelopes with real crypto: round trips, wire shape, and every way an envelope can be bad."""

from __future__ import annotations

import base64
import binascii
import json
import os
import random
from collections.abc import Callable
from typing import Any

import nacl.bindings as sodium
import pytest

from zerocomm_spark.envelope import ANONCRYPT, AUTHCRYPT, Unpacked, pack, unpack
from zerocomm_spark.errors import (
    DIDError,
    EnvelopeError,
    MalformedEnvelopeError,
    NoRecipientKeyError,
    ProtocolError,
    TamperedEnvelopeError,
)
from zerocomm_spark.keys.keypair import KeyPair

SECRET = b"the launch code is 0000 \xe2\x9c\x93"


# --- helpers -----------------------------------------------------------------------------------


def b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def b64e(data: bytes, pad: bool = True) -> str:
    text = base64.urlsafe_b64encode(data).decode("ascii")
    return text if pad else text.rstrip("=")


def flip(data: bytes, index: int = 0) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


def lookup_of(*keys: KeyPair) -> Callable[[str], KeyPair | None]:
    return {k.verkey: k for k in keys}.get


def split(envelope: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    outer = json.loads(envelope)
    return outer, json.loads(b64d(outer["protected"]))


def join(outer: dict[str, Any], header: dict[str, Any] | None = None) -> bytes:
    """Re-encode; with the compact spelling pack uses, an unchanged header comes back byte-identical."""
    outer = dict(outer)
    if header is not None:
        outer["protected"] = b64e(json.dumps(header, separators=(",", ":")).encode())
    return json.dumps(outer).encode()


def test_join_of_an_untouched_envelope_still_opens(alice: KeyPair, bob: KeyPair) -> None:
    """The control for the tamper tests below: only the tampering makes them fail."""
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    assert unpack(join(outer, header), lookup_of(bob)).message == SECRET


@pytest.fixture(scope="module")
def alice() -> KeyPair:
    return KeyPair.generate()


@pytest.fixture(scope="module")
def bob() -> KeyPair:
    return KeyPair.generate()


@pytest.fixture(scope="module")
def group() -> list[KeyPair]:
    return [KeyPair.generate() for _ in range(6)]


@pytest.fixture(params=[AUTHCRYPT, ANONCRYPT])
def alg(request: pytest.FixtureRequest) -> str:
    return request.param


def sender_for(alg: str, alice: KeyPair) -> KeyPair | None:
    return alice if alg == AUTHCRYPT else None


# --- round trips -------------------------------------------------------------------------------


def test_round_trip_one_recipient(alg: str, alice: KeyPair, bob: KeyPair) -> None:
    result = unpack(pack(SECRET, [bob.verkey], sender_for(alg, alice)), lookup_of(bob))
    assert result.message == SECRET
    assert result.recipient_verkey == bob.verkey
    assert result.sender_verkey == (alice.verkey if alg == AUTHCRYPT else None)


def test_every_recipient_of_many_can_read(alg: str, alice: KeyPair, group: list[KeyPair]) -> None:
    envelope = pack(SECRET, [k.verkey for k in group], sender_for(alg, alice))
    for member in group:
        result = unpack(envelope, lookup_of(member))
        assert (result.message, result.recipient_verkey) == (SECRET, member.verkey)
        assert result.sender_verkey == (alice.verkey if alg == AUTHCRYPT else None)


def test_recipient_among_many_is_found_by_kid(alice: KeyPair, group: list[KeyPair]) -> None:
    envelope = pack(SECRET, [k.verkey for k in group], alice)
    asked: list[str] = []
    me = group[3]

    def lookup(kid: str) -> KeyPair | None:
        asked.append(kid)
        return me if kid == me.verkey else None

    assert unpack(envelope, lookup).recipient_verkey == me.verkey
    assert asked == [k.verkey for k in group[:4]]  # stops at the first key we hold


def test_non_ascii_text_round_trips(alg: str, alice: KeyPair, bob: KeyPair) -> None:
    text = "Grüße, 世界 — ünïcödé 🔐"
    result = unpack(pack(text, [bob.verkey], sender_for(alg, alice)), lookup_of(bob))
    assert result.message.decode("utf-8") == text


def test_dict_round_trips_as_json(alg: str, alice: KeyPair, bob: KeyPair) -> None:
    message = {"@type": "https://didcomm.org/basicmessage/1.0/message", "@id": "1", "content": "héllo ✓"}
    result = unpack(pack(message, [bob.verkey], sender_for(alg, alice)), lookup_of(bob))
    assert result.json() == message
    assert result.message.isascii()  # non-ASCII travels as JSON escapes: ASCII-only agents read it


def test_empty_body_round_trips(alg: str, alice: KeyPair, bob: KeyPair) -> None:
    assert unpack(pack(b"", [bob.verkey], sender_for(alg, alice)), lookup_of(bob)).message == b""


def test_binary_body_round_trips(alice: KeyPair, bob: KeyPair) -> None:
    body = os.urandom(4096)
    assert unpack(pack(bytearray(body), [bob.verkey], alice), lookup_of(bob)).message == body


def test_str_envelope_is_accepted(alice: KeyPair, bob: KeyPair) -> None:
    assert unpack(pack(SECRET, [bob.verkey], alice).decode(), lookup_of(bob)).message == SECRET


def test_pretty_printed_envelope_takes_the_json_path(alice: KeyPair, bob: KeyPair) -> None:
    outer = json.loads(pack(SECRET, [bob.verkey], alice))
    assert unpack(json.dumps(outer, indent=2), lookup_of(bob)).message == SECRET
    reordered = {k: outer[k] for k in ("tag", "ciphertext", "iv", "protected")}
    assert unpack(json.dumps(reordered), lookup_of(bob)).message == SECRET


def test_json_escapes_in_values_read_as_json_reads_them(alice: KeyPair, bob: KeyPair) -> None:
    envelope = pack(SECRET, [bob.verkey], alice)
    escaped = envelope.replace(b'"protected":"e', b'"protected":"\\u0065', 1)
    assert escaped != envelope
    assert unpack(escaped, lookup_of(bob)).message == SECRET


def test_unpadded_base64url_is_accepted(alice: KeyPair, bob: KeyPair) -> None:
    outer = json.loads(pack(SECRET, [bob.verkey], alice))
    for name in ("iv", "ciphertext", "tag"):  # 'protected' is the AAD: its spelling is authenticated
        outer[name] = outer[name].rstrip("=")
    assert unpack(json.dumps(outer), lookup_of(bob)).message == SECRET


def hand_packed(body: bytes, recipient: KeyPair, sender: KeyPair, *, iv_bytes: int, pad: bool) -> bytes:
    """An authcrypt envelope built straight from libsodium, the way another implementation might."""
    cek = os.urandom(32)
    target = bytes(recipient.x25519_public())
    nonce = os.urandom(24)
    header = {
        "enc": "xchacha20poly1305_ietf",
        "typ": "JWM/1.0",
        "alg": "Authcrypt",
        "recipients": [
            {
                "encrypted_key": b64e(sodium.crypto_box(cek, nonce, target, bytes(sender.x25519_private())), pad),
                "header": {
                    "kid": recipient.verkey,
                    "sender": b64e(sodium.crypto_box_seal(sender.verkey.encode(), target), pad),
                    "iv": b64e(nonce, pad),
                },
            }
        ],
    }
    protected = b64e(json.dumps(header).encode(), pad)
    iv = os.urandom(iv_bytes)
    encrypt = (
        sodium.crypto_aead_xchacha20poly1305_ietf_encrypt
        if iv_bytes == 24
        else sodium.crypto_aead_chacha20poly1305_ietf_encrypt
    )
    sealed = encrypt(body, protected.encode(), iv, cek)
    outer = {"protected": protected, "iv": b64e(iv, pad), "ciphertext": b64e(sealed[:-16], pad), "tag": b64e(sealed[-16:], pad)}
    return json.dumps(outer).encode()


@pytest.mark.parametrize("iv_bytes", [12, 24])
@pytest.mark.parametrize("pad", [True, False])
def test_reads_other_implementations_spellings(alice: KeyPair, bob: KeyPair, iv_bytes: int, pad: bool) -> None:
    result = unpack(hand_packed(SECRET, bob, alice, iv_bytes=iv_bytes, pad=pad), lookup_of(bob))
    assert (result.message, result.sender_verkey) == (SECRET, alice.verkey)


# --- wire shape ---------------------------------------------------------------------------------


def test_authcrypt_wire_shape(alice: KeyPair, group: list[KeyPair]) -> None:
    envelope = pack(SECRET, [k.verkey for k in group[:2]], alice)
    outer, header = split(envelope)
    assert list(outer) == ["protected", "iv", "ciphertext", "tag"]
    assert {k: header[k] for k in ("enc", "typ", "alg")} == {
        "enc": "xchacha20poly1305_ietf",
        "typ": "JWM/1.0",
        "alg": "Authcrypt",
    }
    assert len(b64d(outer["iv"])) == 12  # ChaCha20-Poly1305 IETF, as RFC 0019's algorithm and agents use
    assert len(b64d(outer["tag"])) == 16
    assert len(b64d(outer["ciphertext"])) == len(SECRET)
    assert [r["header"]["kid"] for r in header["recipients"]] == [k.verkey for k in group[:2]]
    for entry in header["recipients"]:
        assert set(entry["header"]) == {"kid", "sender", "iv"}
        assert len(b64d(entry["encrypted_key"])) == 32 + 16
        assert len(b64d(entry["header"]["iv"])) == 24
        assert len(b64d(entry["header"]["sender"])) == len(alice.verkey) + 48
    for text in (outer["protected"], outer["iv"], outer["ciphertext"], outer["tag"]):
        assert "+" not in text and "/" not in text and len(text) % 4 == 0  # padded base64url


def test_anoncrypt_wire_shape(bob: KeyPair) -> None:
    _, header = split(pack(SECRET, [bob.verkey]))
    assert header["alg"] == "Anoncrypt"
    [entry] = header["recipients"]
    assert entry["header"] == {"kid": bob.verkey}
    assert len(b64d(entry["encrypted_key"])) == 32 + 48


def test_each_pack_uses_fresh_keys_and_nonces(alice: KeyPair, bob: KeyPair) -> None:
    first, second = (split(pack(SECRET, [bob.verkey], alice)) for _ in range(2))
    assert first[0]["iv"] != second[0]["iv"]
    assert first[0]["ciphertext"] != second[0]["ciphertext"]
    assert first[1]["recipients"][0]["encrypted_key"] != second[1]["recipients"][0]["encrypted_key"]


def test_duplicate_recipients_are_wrapped_once(alice: KeyPair, bob: KeyPair) -> None:
    _, header = split(pack(SECRET, [bob.verkey, bob.verkey], alice))
    assert len(header["recipients"]) == 1


def test_unpacked_repr_hides_the_plaintext(alice: KeyPair, bob: KeyPair) -> None:
    result = unpack(pack(SECRET, [bob.verkey], alice), lookup_of(bob))
    assert "launch" not in repr(result) and bob.verkey in repr(result)


def test_unpacked_is_frozen() -> None:
    result = Unpacked(b"{}", "vk", None)
    with pytest.raises(AttributeError):
        result.message = b"x"  # type: ignore[misc]


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff"])
def test_json_of_a_non_object_message_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        Unpacked(body, "vk", None).json()


# --- pack arguments -----------------------------------------------------------------------------


def test_pack_needs_a_recipient(alice: KeyPair) -> None:
    with pytest.raises(EnvelopeError):
        pack(SECRET, [], alice)


def test_pack_refuses_a_bare_verkey_string(bob: KeyPair) -> None:
    with pytest.raises(TypeError):
        pack(SECRET, bob.verkey)


def test_pack_refuses_an_invalid_verkey(alice: KeyPair) -> None:
    with pytest.raises(DIDError):
        pack(SECRET, ["not-base58-0OIl"], alice)
    with pytest.raises(DIDError):
        pack(SECRET, ["3mJr7AoUXx2Wqd"], alice)  # valid base58, wrong length


@pytest.mark.parametrize("suffix", ["\n", " ", '"', "\\", "é"])
def test_pack_refuses_verkeys_that_are_not_pure_base58(suffix: str, alice: KeyPair, bob: KeyPair) -> None:
    with pytest.raises(DIDError):
        pack(SECRET, [bob.verkey + suffix], alice)


def test_pack_refuses_verkey_bytes(alice: KeyPair, bob: KeyPair) -> None:
    with pytest.raises(DIDError):
        pack(SECRET, [bob.verkey.encode()], alice)  # type: ignore[list-item]


def test_header_is_exactly_what_json_would_write(alice: KeyPair, group: list[KeyPair]) -> None:
    for sender in (alice, None):
        outer, header = split(pack(SECRET, [k.verkey for k in group], sender))
        assert b64d(outer["protected"]) == json.dumps(header, separators=(",", ":")).encode()


def test_pack_refuses_other_message_types(bob: KeyPair) -> None:
    with pytest.raises(TypeError):
        pack(12345, [bob.verkey])  # type: ignore[arg-type]


# --- tampering ----------------------------------------------------------------------------------


def tamper_outer(name: str) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    def change(outer: dict[str, Any], header: dict[str, Any]) -> None:
        outer[name] = b64e(flip(b64d(outer[name])))

    return change


def tamper_entry(name: str) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    def change(outer: dict[str, Any], header: dict[str, Any]) -> None:
        entry = header["recipients"][0]
        if name == "encrypted_key":
            entry[name] = b64e(flip(b64d(entry[name]), 40))
        else:
            entry["header"][name] = b64e(flip(b64d(entry["header"][name]), 5))

    return change


def tamper_header_typ(outer: dict[str, Any], header: dict[str, Any]) -> None:
    header["typ"] = "JWM/1.1"  # still valid JSON, still our recipient: only the AAD differs


TAMPERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "ciphertext": tamper_outer("ciphertext"),
    "tag": tamper_outer("tag"),
    "iv": tamper_outer("iv"),
    "protected": tamper_header_typ,
    "encrypted_key": tamper_entry("encrypted_key"),
    "sender": tamper_entry("sender"),
    "header.iv": tamper_entry("iv"),
}


@pytest.mark.parametrize("field", list(TAMPERS))
def test_tampered_field_is_refused(field: str, alice: KeyPair, bob: KeyPair) -> None:
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    TAMPERS[field](outer, header)
    rebuilt = join(outer, header if field in ("protected", "encrypted_key", "sender", "header.iv") else None)
    with pytest.raises(TamperedEnvelopeError) as caught:
        unpack(rebuilt, lookup_of(bob))
    assert_no_secrets(caught.value, alice, bob)


@pytest.mark.parametrize("field", ["ciphertext", "tag", "iv", "encrypted_key"])
def test_tampered_anoncrypt_field_is_refused(field: str, bob: KeyPair) -> None:
    outer, header = split(pack(SECRET, [bob.verkey]))
    TAMPERS[field](outer, header)
    with pytest.raises(TamperedEnvelopeError):
        unpack(join(outer, header if field == "encrypted_key" else None), lookup_of(bob))


def test_protected_header_is_authenticated_byte_for_byte(alice: KeyPair, bob: KeyPair) -> None:
    """Re-spelling the header (same JSON, other bytes) breaks the AAD: agents sign what they send."""
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    respelled = b64e(json.dumps(header).encode())  # json.dumps adds spaces the sender never sent
    assert respelled != outer["protected"] and json.loads(b64d(respelled)) == header
    outer["protected"] = respelled
    with pytest.raises(TamperedEnvelopeError):
        unpack(join(outer), lookup_of(bob))


def test_forged_sender_is_refused(alice: KeyPair, bob: KeyPair) -> None:
    """Mallory re-seals her own verkey as sender: the CEK box then fails to open, nothing is credited to her."""
    mallory = KeyPair.generate()
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    target = bytes(bob.x25519_public())
    header["recipients"][0]["header"]["sender"] = b64e(sodium.crypto_box_seal(mallory.verkey.encode(), target))
    with pytest.raises(TamperedEnvelopeError):
        unpack(join(outer, header), lookup_of(bob))


def test_sender_that_is_not_a_verkey_is_refused(alice: KeyPair, bob: KeyPair) -> None:
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    target = bytes(bob.x25519_public())
    header["recipients"][0]["header"]["sender"] = b64e(sodium.crypto_box_seal(b"\xff\xfe not a key", target))
    with pytest.raises(TamperedEnvelopeError):
        unpack(join(outer, header), lookup_of(bob))


def test_alg_downgrade_is_refused(alice: KeyPair, bob: KeyPair) -> None:
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    header["alg"] = "Anoncrypt"
    with pytest.raises(MalformedEnvelopeError):  # an Anoncrypt entry must not carry a sender
        unpack(join(outer, header), lookup_of(bob))
    outer, header = split(pack(SECRET, [bob.verkey]))
    header["alg"] = "Authcrypt"
    with pytest.raises(MalformedEnvelopeError):  # an Authcrypt entry must carry one
        unpack(join(outer, header), lookup_of(bob))


@pytest.mark.parametrize("name", ["iv", "tag"])
def test_wrong_length_iv_or_tag_is_refused(name: str, alice: KeyPair, bob: KeyPair) -> None:
    outer, _ = split(pack(SECRET, [bob.verkey], alice))
    outer[name] = b64e(b64d(outer[name])[:-1])
    with pytest.raises(TamperedEnvelopeError):
        unpack(join(outer), lookup_of(bob))


def test_wrong_length_encrypted_key_is_refused(alice: KeyPair, bob: KeyPair) -> None:
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    header["recipients"][0]["encrypted_key"] = b64e(b64d(header["recipients"][0]["encrypted_key"])[:20])
    with pytest.raises(TamperedEnvelopeError):
        unpack(join(outer, header), lookup_of(bob))


def test_every_single_byte_flip_in_the_ciphertext_is_caught(alice: KeyPair, bob: KeyPair) -> None:
    outer, _ = split(pack(b"0123456789abcdef", [bob.verkey], alice))
    raw = b64d(outer["ciphertext"])
    for index in range(len(raw)):
        outer["ciphertext"] = b64e(flip(raw, index))
        with pytest.raises(TamperedEnvelopeError):
            unpack(join(outer), lookup_of(bob))


# --- malformed and foreign input -----------------------------------------------------------------


def test_truncated_envelopes_are_refused(alice: KeyPair, bob: KeyPair) -> None:
    envelope = pack(SECRET, [bob.verkey], alice)
    for cut in sorted({0, 1, 14, 20, len(envelope) // 3, len(envelope) // 2, len(envelope) - 30, len(envelope) - 2, len(envelope) - 1}):
        with pytest.raises(MalformedEnvelopeError):
            unpack(envelope[:cut], lookup_of(bob))


def test_truncated_ciphertext_inside_valid_json_is_refused(alice: KeyPair, bob: KeyPair) -> None:
    outer, _ = split(pack(SECRET, [bob.verkey], alice))
    outer["ciphertext"] = b64e(b64d(outer["ciphertext"])[:-3])
    with pytest.raises(TamperedEnvelopeError):
        unpack(join(outer), lookup_of(bob))


@pytest.mark.parametrize(
    "foreign",
    [
        b"",
        b"hello",
        b"\x00\xff\x10binary",
        b"[]",
        b'"a string"',
        b"null",
        b'{"@type": "https://didcomm.org/trust_ping/2.0/ping"}',
        b'{"payload": "eyJ0eXAiOiJKV1QifQ", "signatures": []}',  # a JWS
        b'{"protected": 5, "iv": "", "ciphertext": "", "tag": ""}',
        b'{"protected": "", "iv": "", "ciphertext": "", "tag": ""}',
        b'{"protected": "!!!!", "iv": "AAAA", "ciphertext": "", "tag": "AAAA"}',
        b'{"protected": "e30", "iv": "AAAA", "ciphertext": "", "tag": "AAAA"}',  # protected = {}
        b'{"protected":"\xc3\xa9","iv":"","ciphertext":"","tag":""}',
        b"[" * 100_000,
    ],
)
def test_foreign_input_is_malformed(foreign: bytes, bob: KeyPair) -> None:
    with pytest.raises(MalformedEnvelopeError):
        unpack(foreign, lookup_of(bob))


@pytest.mark.parametrize("foreign", ["", "\ud800", '{"protected": "\ud800"}', "{}"])
def test_foreign_text_is_malformed(foreign: str, bob: KeyPair) -> None:
    with pytest.raises(MalformedEnvelopeError):
        unpack(foreign, lookup_of(bob))


def test_didcomm_v2_style_jwe_is_malformed(bob: KeyPair) -> None:
    jwe = {
        "protected": b64e(json.dumps({"typ": "application/didcomm-encrypted+json", "alg": "ECDH-ES+A256KW", "enc": "A256GCM"}).encode()),
        "recipients": [{"header": {"kid": bob.verkey}, "encrypted_key": b64e(os.urandom(40))}],
        "iv": b64e(os.urandom(12)),
        "ciphertext": b64e(os.urandom(30)),
        "tag": b64e(os.urandom(16)),
    }
    with pytest.raises(MalformedEnvelopeError):
        unpack(json.dumps(jwe), lookup_of(bob))


@pytest.mark.parametrize("name", ["protected", "iv", "ciphertext", "tag"])
def test_missing_outer_field_is_malformed(name: str, alice: KeyPair, bob: KeyPair) -> None:
    outer, _ = split(pack(SECRET, [bob.verkey], alice))
    del outer[name]
    with pytest.raises(MalformedEnvelopeError):
        unpack(join(outer), lookup_of(bob))


@pytest.mark.parametrize("name", ["iv", "ciphertext", "tag"])
def test_non_base64url_field_is_malformed(name: str, alice: KeyPair, bob: KeyPair) -> None:
    outer, _ = split(pack(SECRET, [bob.verkey], alice))
    for bad in ("@@@@", outer[name].replace("-", "+").replace("_", "/") + "+/", "A", "é"):
        if bad == outer[name]:
            continue
        outer[name] = bad
        with pytest.raises(MalformedEnvelopeError):
            unpack(join(outer), lookup_of(bob))


def test_excess_or_misplaced_padding_is_malformed(alice: KeyPair, bob: KeyPair) -> None:
    outer, _ = split(pack(SECRET, [bob.verkey], alice))
    iv = outer["iv"].rstrip("=")  # 12 bytes: 16 characters, no padding needed
    for bad in (iv + "====", iv + "=", iv[:-2] + "=" + iv[-1] + "="):
        outer["iv"] = bad
        with pytest.raises(MalformedEnvelopeError):
            unpack(join(outer), lookup_of(bob))


@pytest.mark.parametrize("length", range(0, 40))
def test_base64url_decoding_matches_the_reference(length: int) -> None:
    from zerocomm_spark.envelope import _unb64url

    data = os.urandom(length)
    assert _unb64url(b64e(data), "x") == data
    assert _unb64url(b64e(data, pad=False).encode(), "x") == data
    if length % 3:
        with pytest.raises(MalformedEnvelopeError):
            _unb64url(b64e(data, pad=False) + "===", "x")


@pytest.mark.parametrize("name", ["protected", "iv", "ciphertext", "tag"])
def test_standard_alphabet_of_the_same_length_is_malformed(name: str, alice: KeyPair, bob: KeyPair) -> None:
    # '+' or '/' in place of one character: the length (and padding) stay valid, only the alphabet is wrong.
    outer, _ = split(pack(SECRET, [bob.verkey], alice))
    for char in "+/":
        bad = dict(outer, **{name: char + outer[name][1:]})
        with pytest.raises(MalformedEnvelopeError):
            unpack(join(bad), lookup_of(bob))


def _load_envelope_without_pybase64(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A separate copy of the envelope module, imported as if pybase64 were not installed."""
    import importlib.util
    import sys

    from zerocomm_spark import envelope

    monkeypatch.setitem(sys.modules, "pybase64", None)  # makes `import pybase64` raise ImportError
    spec = importlib.util.spec_from_file_location("_envelope_without_pybase64", envelope.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module._pybase64 is None
    return module


_STRICT_CASES = [
    b"", b"AAAA", b"AA-_", b"AA==", b"AB==", b"AAA=", b"AAAAAA==", b"AA+A", b"AA/A", b"AA=A", b"=AAA",
    b"AA==AAAA", b"AAA=AAAA", b" AAA", b"AA\nA", b"AA.A", b"\xc3\xa9AA", b"AAAAAAA=", b"AAAA\x00AAA",
]


def test_both_base64url_decoders_are_equally_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerocomm_spark import envelope

    fallback = _load_envelope_without_pybase64(monkeypatch)
    rng = random.Random(19)
    alphabet = b"AB-_+/=. \n"
    cases = _STRICT_CASES + [bytes(rng.choice(alphabet) for _ in range(4 * rng.randrange(1, 4))) for _ in range(3000)]

    def outcome(decode: Callable[[bytes], bytes], text: bytes) -> bytes | None:
        try:
            return decode(text)
        except binascii.Error:
            return None

    for text in cases:
        if text.endswith(b"==="):
            continue  # never reaches the decoder: _unb64url and the fast path refuse it first
        assert outcome(envelope._decode_url, text) == outcome(fallback._decode_url, text), text
    data = os.urandom(100)
    assert envelope._encode_url(data) == fallback._encode_url(data) == base64.urlsafe_b64encode(data)


def test_the_binascii_fallback_round_trips(monkeypatch: pytest.MonkeyPatch, alice: KeyPair, bob: KeyPair) -> None:
    fallback = _load_envelope_without_pybase64(monkeypatch)
    for sender in (alice, None):
        opened = fallback.unpack(pack(SECRET, [bob.verkey], sender), lookup_of(bob))
        assert opened.message == SECRET
        assert unpack(fallback.pack(SECRET, [bob.verkey], sender), lookup_of(bob)).message == SECRET


SMALL_ORDER_VERKEY = "4uQeVj5tqViQh7yWWGStvkEG1Zmhx6uasJtWCJziofM"  # 0x01 || 0^31: the Ed25519 identity point


def test_pack_refuses_a_small_order_verkey(alice: KeyPair) -> None:
    with pytest.raises(DIDError):
        pack(SECRET, [SMALL_ORDER_VERKEY], alice)


def test_sender_that_is_a_small_order_point_is_refused(alice: KeyPair, bob: KeyPair) -> None:
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    target = bytes(bob.x25519_public())
    header["recipients"][0]["header"]["sender"] = b64e(sodium.crypto_box_seal(SMALL_ORDER_VERKEY.encode(), target))
    with pytest.raises(TamperedEnvelopeError):
        unpack(join(outer, header), lookup_of(bob))


def header_changes() -> dict[str, Callable[[dict[str, Any]], None]]:
    def entry(h: dict[str, Any]) -> dict[str, Any]:
        return h["recipients"][0]

    return {
        "no enc": lambda h: h.pop("enc"),
        "other enc": lambda h: h.update(enc="A256GCM"),
        "no alg": lambda h: h.pop("alg"),
        "ECDH-1PU alg": lambda h: h.update(alg="ECDH-1PU+A256KW"),
        "lowercase alg": lambda h: h.update(alg="authcrypt"),
        "no recipients": lambda h: h.pop("recipients"),
        "empty recipients": lambda h: h.update(recipients=[]),
        "recipients not a list": lambda h: h.update(recipients={"kid": "x"}),
        "recipient not an object": lambda h: h.update(recipients=["x"]),
        "no header": lambda h: entry(h).pop("header"),
        "no kid": lambda h: entry(h)["header"].pop("kid"),
        "kid not a string": lambda h: entry(h)["header"].update(kid=7),
        "no encrypted_key": lambda h: entry(h).pop("encrypted_key"),
        "no sender": lambda h: entry(h)["header"].pop("sender"),
        "no header iv": lambda h: entry(h)["header"].pop("iv"),
        "sender not base64": lambda h: entry(h)["header"].update(sender="?!"),
    }


@pytest.mark.parametrize("change", list(header_changes()))
def test_broken_protected_header_is_malformed(change: str, alice: KeyPair, bob: KeyPair) -> None:
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    header_changes()[change](header)
    with pytest.raises(MalformedEnvelopeError) as caught:
        unpack(join(outer, header), lookup_of(bob))
    assert_no_secrets(caught.value, alice, bob)


# --- addressing ---------------------------------------------------------------------------------


def test_message_for_someone_else(alg: str, alice: KeyPair, group: list[KeyPair]) -> None:
    envelope = pack(SECRET, [k.verkey for k in group[:3]], sender_for(alg, alice))
    stranger = KeyPair.generate()
    with pytest.raises(NoRecipientKeyError) as caught:
        unpack(envelope, lookup_of(stranger))
    assert_no_secrets(caught.value, alice, *group[:3])


def test_lookup_answering_with_another_key_is_not_trusted(alice: KeyPair, bob: KeyPair) -> None:
    envelope = pack(SECRET, [bob.verkey], alice)
    wrong = KeyPair.generate()
    with pytest.raises(NoRecipientKeyError):
        unpack(envelope, lambda kid: wrong)


def test_sender_alone_cannot_read_authcrypt(alice: KeyPair, bob: KeyPair) -> None:
    with pytest.raises(NoRecipientKeyError):
        unpack(pack(SECRET, [bob.verkey], alice), lookup_of(alice))


def test_errors_are_one_family() -> None:
    for error in (MalformedEnvelopeError, NoRecipientKeyError, TamperedEnvelopeError):
        assert issubclass(error, EnvelopeError)


def assert_no_secrets(error: Exception, *keys: KeyPair) -> None:
    text = str(error) + repr(error.args)
    assert "launch" not in text and SECRET.hex() not in text
    for key in keys:
        assert key.verkey not in text
        assert key.seed.hex() not in text and b64e(key.seed) not in text
        assert binascii.hexlify(bytes(key.x25519_private())).decode() not in text


# --- the compact fast path ------------------------------------------------------------------------
#
# unpack reads envelopes in pack's own layout without JSON-parsing or decoding the whole protected
# header (zerocomm_spark.envelope._unpack_compact); these check that it agrees with the reference
# path (the full JSON parse) on every recipient position, both algs and odd verkey lengths, and
# that whatever it cannot open ends with the reference path's own error.

from zerocomm_spark import envelope as envelope_module  # noqa: E402

# An Ed25519 seed whose verkey is 42 base58 characters (most are 44, some 43): the sealed sender
# field, and so every entry, is 4 characters shorter.
SHORT_VERKEY_SEED = bytes.fromhex("20780d2b44e3aba5598786296ad245f9865f08f2652dda3a62900cb352144f1c")


def fast(envelope: bytes, lookup: Callable[[str], KeyPair | None]) -> Unpacked | None:
    fields = envelope_module._split_compact(envelope)
    assert fields is not None
    return envelope_module._unpack_compact(fields, lookup)


def reference(envelope: bytes, lookup: Callable[[str], KeyPair | None]) -> Unpacked:
    fields = envelope_module._split_compact(envelope) or envelope_module._split_json(envelope)
    return envelope_module._unpack_reference(fields, lookup)


def outcome(call: Callable[[], Unpacked]) -> object:
    try:
        return call()
    except EnvelopeError as exc:
        return type(exc)


@pytest.fixture(scope="module")
def crowd() -> list[KeyPair]:
    return [KeyPair.generate() for _ in range(64)] + [KeyPair(SHORT_VERKEY_SEED)]


def test_short_verkey_seed_is_short() -> None:
    assert len(KeyPair(SHORT_VERKEY_SEED).verkey) == 42


@pytest.mark.parametrize("count", [1, 2, 8, 64])
def test_fast_path_opens_every_position_like_the_reference(alg: str, count: int, crowd: list[KeyPair]) -> None:
    recipients = crowd[-count:]  # includes the 42-character verkey
    for sender in ([crowd[0], crowd[-1]] if alg == AUTHCRYPT else [None]):  # a 44/43- and a 42-character sender
        body = os.urandom(300)
        envelope = pack(body, [k.verkey for k in recipients], sender)
        for me in recipients:
            opened = fast(envelope, lookup_of(me))
            assert opened is not None, "pack's own layout must take the fast path"
            assert opened == reference(envelope, lookup_of(me)) == unpack(envelope, lookup_of(me))
            assert (opened.message, opened.recipient_verkey) == (body, me.verkey)


def test_fast_path_asks_lookup_in_order_and_stops(crowd: list[KeyPair], alice: KeyPair) -> None:
    recipients = crowd[:20]
    envelope = pack(SECRET, [k.verkey for k in recipients], alice)
    for _ in range(2):  # the second time through remembered windows
        asked: list[str] = []

        def lookup(kid: str) -> KeyPair | None:
            asked.append(kid)
            return recipients[13] if kid == recipients[13].verkey else None

        assert fast(envelope, lookup) is not None
        assert asked == [k.verkey for k in recipients[:14]]


def test_fast_path_is_not_fooled_by_a_remembered_recipient_list(crowd: list[KeyPair], alice: KeyPair) -> None:
    """Same shape, same first recipient, other recipients after it: the remembered walk must not be trusted."""
    by_length: dict[int, list[KeyPair]] = {}
    for key in crowd:
        by_length.setdefault(len(key.verkey), []).append(key)
    first, *rest = max(by_length.values(), key=len)  # most verkeys are 44 characters: 13 of them, surely
    one = pack(SECRET, [first.verkey, *(k.verkey for k in rest[:6])], alice)
    other = pack(SECRET, [first.verkey, *(k.verkey for k in rest[6:12])], alice)
    assert len(one) == len(other)
    for me in rest[:6]:
        assert fast(one, lookup_of(me)).recipient_verkey == me.verkey
    for me in rest[6:12]:
        assert fast(other, lookup_of(me)).recipient_verkey == me.verkey
    for me in rest[:6]:
        assert fast(other, lookup_of(me)) is None  # not for me: the fast path declines...
        with pytest.raises(NoRecipientKeyError):  # ...and the reference path says why
            unpack(other, lookup_of(me))


def test_fast_path_declines_what_is_not_for_us(alg: str, crowd: list[KeyPair], alice: KeyPair) -> None:
    envelope = pack(SECRET, [k.verkey for k in crowd[:8]], sender_for(alg, alice))
    stranger = KeyPair.generate()
    assert fast(envelope, lookup_of(stranger)) is None
    with pytest.raises(NoRecipientKeyError):
        unpack(envelope, lookup_of(stranger))


def test_other_spellings_take_the_reference_path(alice: KeyPair, bob: KeyPair) -> None:
    outer, header = split(pack(SECRET, [bob.verkey], alice))
    spaced = dict(outer, protected=b64e(json.dumps(header).encode()))  # JSON with spaces, as other agents write
    variants = [spaced]
    if outer["protected"].endswith("="):  # (a header of a multiple of 3 bytes has no padding to drop)
        variants.append(dict(outer, protected=outer["protected"].rstrip("=")))
    for variant in variants:
        envelope = json.dumps(variant, separators=(",", ":")).encode()
        assert envelope_module._split_compact(envelope) is not None
        assert fast(envelope, lookup_of(bob)) is None
        # Not authentic any more (the AAD is the protected text), but the reference path reads it.
        with pytest.raises(TamperedEnvelopeError):
            unpack(envelope, lookup_of(bob))


def mutations(protected: str, rng: random.Random) -> list[str]:
    """Changes to the header text anywhere, by someone without the CEK."""
    raw = bytearray(b64d(protected))
    out = []
    for _ in range(60):
        changed = bytearray(raw)
        i = rng.randrange(len(changed))
        kind = rng.randrange(4)
        if kind == 0:
            changed[i] = rng.choice(b'"{}[],:\\ ax0=')
        elif kind == 1:
            changed[i] ^= 1 << rng.randrange(7)
        elif kind == 2:
            del changed[i]
        else:
            changed[i:i] = bytes([rng.choice(b'"a,')])
        if changed != raw:
            out.append(b64e(bytes(changed)))
    return out


@pytest.mark.parametrize("position", [0, 5, 11])
def test_a_changed_header_fails_exactly_as_the_reference_says(alg: str, position: int, crowd: list[KeyPair], alice: KeyPair) -> None:
    recipients = crowd[:12]
    me = recipients[position]
    envelope = pack(SECRET, [k.verkey for k in recipients], sender_for(alg, alice))
    outer = json.loads(envelope)
    rng = random.Random(position)
    for protected in mutations(outer["protected"], rng):
        changed = json.dumps(dict(outer, protected=protected), separators=(",", ":")).encode()
        got = outcome(lambda: unpack(changed, lookup_of(me)))
        assert got == outcome(lambda: reference(changed, lookup_of(me)))
        assert got in (MalformedEnvelopeError, TamperedEnvelopeError, NoRecipientKeyError)


def test_changed_body_fields_end_as_the_reference_says(crowd: list[KeyPair], alice: KeyPair) -> None:
    envelope = pack(SECRET, [k.verkey for k in crowd[:8]], alice)
    me = crowd[6]
    outer = json.loads(envelope)
    for name, bad, expected in [
        ("iv", outer["iv"][:-4], TamperedEnvelopeError),
        ("tag", outer["tag"] + "====", MalformedEnvelopeError),
        ("tag", outer["tag"][:-3], MalformedEnvelopeError),
        ("tag", outer["tag"][:-4] + "+/==", MalformedEnvelopeError),
        ("tag", outer["tag"].rstrip("="), Unpacked),  # unpadded is fine
        ("ciphertext", outer["ciphertext"] + "====", MalformedEnvelopeError),
        ("ciphertext", b64e(flip(b64d(outer["ciphertext"]), 3)), TamperedEnvelopeError),
    ]:
        changed = json.dumps(dict(outer, **{name: bad}), separators=(",", ":")).encode()
        got = outcome(lambda: unpack(changed, lookup_of(me)))
        assert got == outcome(lambda: reference(changed, lookup_of(me)))
        assert (type(got) if isinstance(got, Unpacked) else got) is expected, (name, bad)


def test_kid_windows_hold_no_per_message_bytes(alg: str, crowd: list[KeyPair], alice: KeyPair,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh envelope for the same recipients reads from what the last one left: nothing random is in a window."""
    recipients = crowd[:16]
    me = recipients[-1]
    sender = sender_for(alg, alice)
    windows: dict[bytes, str] = {}
    monkeypatch.setitem(envelope_module._kid_windows, alg, windows)
    monkeypatch.setattr(envelope_module, "_recipient_lists", {})
    assert fast(pack(SECRET, [k.verkey for k in recipients], sender), lookup_of(me)) is not None
    assert sorted(windows.values()) == sorted(k.verkey for k in recipients[1:])
    seen = dict(windows)
    for _ in range(3):
        envelope_module._recipient_lists.clear()  # the per-window memory alone must do
        body = os.urandom(50)
        assert fast(pack(body, [k.verkey for k in recipients], sender), lookup_of(me)).message == body
        assert windows == seen, "a kid window of a fresh envelope was new"
