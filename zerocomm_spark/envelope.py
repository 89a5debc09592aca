"""Aries RFC 0019 (DIDComm v1) encryption envelopes.

One content encryption key (CEK) encrypts the message once; the CEK is then wrapped for each
recipient's X25519 key (converted from its Ed25519 verkey). Authcrypt wraps it with ``crypto_box``
from the sender's key and hides the sender's verkey in a sealed box; anoncrypt wraps it in a sealed
box and names no sender.

Wire compatibility notes, taken from what interoperating agents actually emit:

* The protected header says ``"enc": "xchacha20poly1305_ietf"``, but RFC 0019's own pack algorithm
  (and the 12-byte ivs of its examples), ACA-Py and aries-staticagent all encrypt the body with
  ChaCha20-Poly1305 *IETF* and a 12-byte ``iv``. We emit exactly that, so Aries agents can read us
  (real XChaCha20 would not open in them); on unpack a 24-byte ``iv`` selects XChaCha20-Poly1305,
  so envelopes from an implementation that took the label literally open too.
* base64url is emitted padded, as the RFC examples and aries-staticagent do; unpadded input
  (which some agents send) is accepted.
* The AAD is the ``protected`` string exactly as transmitted, so re-encoding it is never needed.
"""

from __future__ import annotations

import binascii
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import nacl.bindings as _nacl
import nacl.exceptions

from zerocomm_spark.errors import (
    DIDError,
    EnvelopeError,
    MalformedEnvelopeError,
    NoRecipientKeyError,
    ProtocolError,
    TamperedEnvelopeError,
)
from zerocomm_spark.keys.keypair import KeyPair, verkey_bytes

__all__ = ["AUTHCRYPT", "ANONCRYPT", "Unpacked", "pack", "unpack"]

AUTHCRYPT = "Authcrypt"
ANONCRYPT = "Anoncrypt"
ENC = "xchacha20poly1305_ietf"
TYP = "JWM/1.0"

_CEK_BYTES = 32
_IV_BYTES = _nacl.crypto_aead_chacha20poly1305_ietf_NPUBBYTES  # 12: what Aries agents send
_XIV_BYTES = _nacl.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES  # 24: accepted on unpack
_TAG_BYTES = _nacl.crypto_aead_chacha20poly1305_ietf_ABYTES
_BOX_NONCE_BYTES = _nacl.crypto_box_NONCEBYTES
_WRAPPED_CEK_AUTH = _CEK_BYTES + _nacl.crypto_box_ZEROBYTES - _nacl.crypto_box_BOXZEROBYTES  # + MAC
_WRAPPED_CEK_ANON = _CEK_BYTES + _nacl.crypto_box_SEALBYTES

_aead_encrypt = _nacl.crypto_aead_chacha20poly1305_ietf_encrypt
_aead_decrypt = _nacl.crypto_aead_chacha20poly1305_ietf_decrypt
_xaead_decrypt = _nacl.crypto_aead_xchacha20poly1305_ietf_decrypt
_box = _nacl.crypto_box
_box_open = _nacl.crypto_box_open
_seal = _nacl.crypto_box_seal
_seal_open = _nacl.crypto_box_seal_open

# Standard <-> url-safe alphabets. '+' and '/' in the input map to an invalid byte so strict
# decoding rejects them: the url-safe form is the only spelling we take.
_TO_STD = bytes.maketrans(b"-_+/", b"+/!!")
_TO_URL = bytes.maketrans(b"+/", b"-_")
_PAD = (b"", b"===", b"==", b"=")

_CRYPTO_FAILURES = (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, nacl.exceptions.TypeError)


# --- encodings ---------------------------------------------------------------------------------


def _b64url(data: bytes | memoryview) -> str:
    """Padded base64url, as in RFC 0019's examples."""
    return binascii.b2a_base64(data, newline=False).translate(_TO_URL).decode("ascii")


def _unb64url(text: Any, what: str) -> bytes:
    """Strict base64url decode, padded or not; ``what`` names the field in errors, never its value."""
    raw = text.encode("ascii", "replace") if isinstance(text, str) else text
    if not isinstance(raw, bytes):
        raise MalformedEnvelopeError(f"the envelope field {what!r} must be a base64url string")
    data = raw.rstrip(b"=")
    padding = len(raw) - len(data)
    try:
        if padding and (padding > 2 or len(raw) & 3):
            raise ValueError("bad padding")
        return binascii.a2b_base64(data.translate(_TO_STD) + _PAD[len(data) & 3], strict_mode=True)
    except (binascii.Error, ValueError):
        raise MalformedEnvelopeError(f"the envelope field {what!r} is not valid base64url") from None


@lru_cache(maxsize=8192)
def _x25519(verkey: str) -> bytes:
    """X25519 public key of a verkey; cached because the same peers recur on every message."""
    # base58 text only: no whitespace the decoder would forgive, nothing JSON would have to escape
    if not (isinstance(verkey, str) and verkey.isascii() and verkey.isalnum()):
        raise DIDError("a verkey must be a base58 string")
    try:
        return _nacl.crypto_sign_ed25519_pk_to_curve25519(verkey_bytes(verkey))
    except _CRYPTO_FAILURES as exc:
        raise DIDError("the verkey is not a valid Ed25519 point") from exc


def _message_bytes(message: bytes | bytearray | memoryview | str | dict[str, Any]) -> bytes:
    if isinstance(message, bytes):
        return message
    if isinstance(message, str):
        return message.encode("utf-8")
    if isinstance(message, dict):
        # ASCII JSON (non-ASCII as \u escapes): agents that decode the body as ASCII still read it.
        return json.dumps(message, separators=(",", ":")).encode("ascii")
    if isinstance(message, (bytearray, memoryview)):
        return bytes(message)
    raise TypeError(f"pack() takes bytes, str or dict, not {type(message).__name__}")


# --- pack --------------------------------------------------------------------------------------

_HEADER = '{"enc":"%s","typ":"%s","alg":"%%s","recipients":[%%s]}' % (ENC, TYP)
_AUTH_ENTRY = '{"encrypted_key":"%s","header":{"kid":"%s","sender":"%s","iv":"%s"}}'
_ANON_ENTRY = '{"encrypted_key":"%s","header":{"kid":"%s"}}'


def pack(
    message: bytes | str | dict[str, Any],
    recipient_verkeys: Sequence[str],
    sender: KeyPair | None = None,
) -> bytes:
    """Encrypt ``message`` once for all ``recipient_verkeys``: authcrypt from ``sender``, else anoncrypt.

    Returns the JSON envelope as bytes, ready for the wire. A recipient listed twice is wrapped for once.
    """
    if isinstance(recipient_verkeys, str):
        raise TypeError("recipient_verkeys is a sequence of verkeys, not one verkey string")
    verkeys = list(dict.fromkeys(recipient_verkeys))
    if not verkeys:
        raise EnvelopeError("an envelope needs at least one recipient verkey", hint="Pass the recipients' verkeys.")
    body = _message_bytes(message)
    cek = os.urandom(_CEK_BYTES)

    # The header is formatted, not json.dumps'd: every value is a checked base58 verkey, base64url
    # or a constant, none of which JSON ever escapes, and json.dumps costs ~5 us per recipient.
    if sender is not None:
        sender_vk = sender.verkey.encode("ascii")
        sender_sk = bytes(sender.x25519_private())
        entries = []
        for vk in verkeys:
            target = _x25519(vk)
            nonce = os.urandom(_BOX_NONCE_BYTES)
            entries.append(
                _AUTH_ENTRY
                % (_b64url(_box(cek, nonce, target, sender_sk)), vk, _b64url(_seal(sender_vk, target)), _b64url(nonce))
            )
        alg = AUTHCRYPT
    else:
        entries = [_ANON_ENTRY % (_b64url(_seal(cek, _x25519(vk))), vk) for vk in verkeys]
        alg = ANONCRYPT
    header = (_HEADER % (alg, ",".join(entries))).encode("ascii")
    protected = binascii.b2a_base64(header, newline=False).translate(_TO_URL)
    iv = os.urandom(_IV_BYTES)
    sealed = memoryview(_aead_encrypt(body, protected, iv, cek))
    # Every value is base64url (no JSON escaping possible), so the envelope is joined directly.
    return b"".join(
        (
            b'{"protected":"',
            protected,
            b'","iv":"',
            _b64url(iv).encode("ascii"),
            b'","ciphertext":"',
            binascii.b2a_base64(sealed[:-_TAG_BYTES], newline=False).translate(_TO_URL),
            b'","tag":"',
            binascii.b2a_base64(sealed[-_TAG_BYTES:], newline=False).translate(_TO_URL),
            b'"}',
        )
    )


# --- unpack ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A decrypted, authenticated message and who it was between.

    ``sender_verkey`` is None for anoncrypt. The plaintext is kept out of the repr.
    """

    message: bytes = field(repr=False)
    recipient_verkey: str
    sender_verkey: str | None

    def json(self) -> dict[str, Any]:
        """The message as a DIDComm JSON object."""
        try:
            value = json.loads(self.message)
        except (ValueError, RecursionError):
            raise ProtocolError("the decrypted message is not JSON") from None
        if not isinstance(value, dict):
            raise ProtocolError("the decrypted message is not a JSON object")
        return value


def _load_json(data: bytes | str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, TypeError, RecursionError):
        raise MalformedEnvelopeError(f"the {what} is not valid JSON (truncated or not an RFC 0019 envelope)") from None
    if not isinstance(value, dict):
        raise MalformedEnvelopeError(f"the {what} is not a JSON object")
    return value


_Fields = tuple[bytes, bytes, bytes, bytes]  # protected, iv, ciphertext, tag: still base64url


def _split_compact(envelope: bytes) -> _Fields | None:
    """Fast path for the compact layout ``pack`` (and most agents) emit; None means "parse as JSON".

    Spares a full JSON scan and copy of the (large) ciphertext. Envelopes with escapes fall back,
    and every value cut here is strictly base64url-decoded later, so what this accepts reads exactly
    as json.loads would read it.
    """
    if not envelope.startswith(b'{"protected":"') or b"\\" in envelope:
        return None
    values = []
    start = 14
    for separator in (b'","iv":"', b'","ciphertext":"', b'","tag":"', b'"}'):
        end = envelope.find(b'"', start)
        if end < 0 or not envelope.startswith(separator, end):
            return None
        values.append(envelope[start:end])
        start = end + len(separator)
    if start != len(envelope):
        return None
    return values[0], values[1], values[2], values[3]


def _split_json(envelope: bytes) -> _Fields:
    outer = _load_json(envelope, "envelope")
    values = []
    for name in ("protected", "iv", "ciphertext", "tag"):
        value = outer.get(name)
        if not isinstance(value, str):
            raise MalformedEnvelopeError(f"the envelope has no {name!r} field")
        try:
            values.append(value.encode("ascii"))
        except UnicodeEncodeError:
            raise MalformedEnvelopeError(f"the envelope field {name!r} is not valid base64url") from None
    return values[0], values[1], values[2], values[3]


def _tampered(what: str) -> TamperedEnvelopeError:
    return TamperedEnvelopeError(f"{what} failed to authenticate")


def unpack(envelope: bytes | str, lookup: Callable[[str], KeyPair | None]) -> Unpacked:
    """Decrypt an RFC 0019 envelope with the first recipient key ``lookup`` returns.

    ``lookup(kid)`` gets each recipient verkey in order and returns our KeyPair for it, or None.
    Nothing is returned unless the CEK unwrap and the body's AEAD tag both verify.
    """
    if isinstance(envelope, str):
        envelope = envelope.encode("utf-8", "replace")  # a lone surrogate becomes '?': malformed, not a crash
    elif isinstance(envelope, (bytearray, memoryview)):
        envelope = bytes(envelope)
    elif not isinstance(envelope, bytes):
        raise TypeError(f"unpack() takes bytes or str, not {type(envelope).__name__}")
    fields = _split_compact(envelope) or _split_json(envelope)
    protected, iv_text, ciphertext_text, tag_text = fields

    if not protected:
        raise MalformedEnvelopeError("the envelope's 'protected' header is empty")
    header = _load_json(_unb64url(protected, "protected"), "protected header")
    if header.get("enc") != ENC:
        raise MalformedEnvelopeError(f"unsupported content encryption (enc must be {ENC!r})")
    alg = header.get("alg")
    if alg != AUTHCRYPT and alg != ANONCRYPT:
        raise MalformedEnvelopeError(f"unsupported alg (must be {AUTHCRYPT!r} or {ANONCRYPT!r})")
    recipients = header.get("recipients")
    if not isinstance(recipients, list) or not recipients:
        raise MalformedEnvelopeError("the protected header lists no recipients")

    entry, entry_header, keypair = _find_recipient(recipients, lookup)
    sender_verkey, cek = _unwrap_cek(alg, entry, entry_header, keypair)

    iv = _unb64url(iv_text, "iv")
    tag = _unb64url(tag_text, "tag")
    if len(tag) != _TAG_BYTES:
        raise _tampered("the message tag")
    if len(iv) == _IV_BYTES:
        decrypt = _aead_decrypt
    elif len(iv) == _XIV_BYTES:
        decrypt = _xaead_decrypt
    else:
        raise _tampered("the message iv")
    ciphertext = _unb64url(ciphertext_text, "ciphertext")
    try:
        message = decrypt(ciphertext + tag, protected, iv, cek)
    except _CRYPTO_FAILURES:
        raise _tampered("the message body or protected header") from None
    return Unpacked(message, keypair.verkey, sender_verkey)


def _find_recipient(
    recipients: list[Any], lookup: Callable[[str], KeyPair | None]
) -> tuple[dict[str, Any], dict[str, Any], KeyPair]:
    """Our entry: the first whose kid ``lookup`` resolves to a key pair with that very verkey."""
    for entry in recipients:
        entry_header = entry.get("header") if isinstance(entry, dict) else None
        kid = entry_header.get("kid") if isinstance(entry_header, dict) else None
        if not isinstance(kid, str):
            raise MalformedEnvelopeError("a recipient entry has no header.kid")
        keypair = lookup(kid)
        if keypair is not None and keypair.verkey == kid:
            return entry, entry_header, keypair
    raise NoRecipientKeyError(f"none of the envelope's {len(recipients)} recipient key(s) is held here")


def _unwrap_cek(
    alg: str, entry: dict[str, Any], entry_header: dict[str, Any], keypair: KeyPair
) -> tuple[str | None, bytes]:
    """Recover the CEK (and, for authcrypt, the sender verkey) from our recipient entry."""
    encrypted_key = _unb64url(entry.get("encrypted_key"), "encrypted_key")
    my_sk = bytes(keypair.x25519_private())
    my_pk = bytes(keypair.x25519_public())
    enc_sender = entry_header.get("sender")
    nonce_text = entry_header.get("iv")

    if alg == ANONCRYPT:
        if enc_sender is not None or nonce_text is not None:
            raise MalformedEnvelopeError("an Anoncrypt recipient entry carries sender fields")
        if len(encrypted_key) != _WRAPPED_CEK_ANON:
            raise _tampered("the recipient's encrypted_key")
        try:
            return None, _seal_open(encrypted_key, my_pk, my_sk)
        except _CRYPTO_FAILURES:
            raise _tampered("the recipient's encrypted_key") from None

    if enc_sender is None or nonce_text is None:
        raise MalformedEnvelopeError("an Authcrypt recipient entry lacks header.sender or header.iv")
    sealed_sender = _unb64url(enc_sender, "sender")
    nonce = _unb64url(nonce_text, "header.iv")
    try:
        sender_verkey = _seal_open(sealed_sender, my_pk, my_sk).decode("ascii")
        sender_pk = _x25519(sender_verkey)
    except (*_CRYPTO_FAILURES, UnicodeDecodeError, DIDError):
        raise _tampered("the recipient's sender field") from None
    if len(nonce) != _BOX_NONCE_BYTES or len(encrypted_key) != _WRAPPED_CEK_AUTH:
        raise _tampered("the recipient's encrypted_key or iv")
    try:
        return sender_verkey, _box_open(encrypted_key, nonce, sender_pk, my_sk)
    except _CRYPTO_FAILURES:
        raise _tampered("the recipient's encrypted_key or iv") from None
