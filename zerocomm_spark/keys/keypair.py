"""Ed25519 key pairs and their X25519 twins, as DIDComm v1 uses them.

A DIDComm v1 verkey is an Ed25519 public key in base58; encryption uses the same key converted to
X25519. Secrets stay inside this object: its repr and str show only the public verkey.
"""

from __future__ import annotations

import base58
import nacl.bindings
import nacl.exceptions
import nacl.signing
from nacl.public import PrivateKey, PublicKey

from zerocomm_spark.errors import DIDError, SignatureError


def b58encode(data: bytes) -> str:
    return base58.b58encode(data).decode("ascii")


# base58 decoding takes time quadratic in the length; every key is 32 bytes (+ a 2-byte multicodec
# prefix), at most 47 characters. Longer text from a peer (a JWS kid, a publicKeyBase58) is refused
# before it is decoded: 200k characters cost half a minute of CPU.
MAX_BASE58_CHARS = 128


def b58decode(text: str) -> bytes:
    if len(text) > MAX_BASE58_CHARS:
        raise DIDError(f"a key of {len(text)} characters is too long for base58 (keys take at most {MAX_BASE58_CHARS})")
    try:
        return base58.b58decode(text)
    except ValueError as exc:
        raise DIDError("a verkey is not valid base58") from exc


def verkey_bytes(verkey: str) -> bytes:
    """The 32 raw bytes of a base58 Ed25519 verkey, checked for length."""
    raw = b58decode(verkey)
    if len(raw) != 32:
        raise DIDError(f"a verkey must decode to 32 bytes, got {len(raw)}")
    return raw


def verkey_to_x25519(verkey: str) -> PublicKey:
    """The X25519 public key DIDComm v1 derives from an Ed25519 verkey."""
    try:
        return PublicKey(nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(verkey_bytes(verkey)))
    except nacl.exceptions.RuntimeError as exc:
        raise DIDError("the verkey is not a valid Ed25519 point") from exc


def verify_signature(verkey: str, message: bytes, signature: bytes) -> None:
    """Raise SignatureError unless ``signature`` is ``verkey``'s signature over ``message``."""
    try:
        nacl.signing.VerifyKey(verkey_bytes(verkey)).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, ValueError, nacl.exceptions.ValueError) as exc:
        raise SignatureError("signature verification failed") from exc


class KeyPair:
    """An Ed25519 signing key with its verkey and derived X25519 keys."""

    __slots__ = ("_signing", "verkey", "_x_private", "_x_public", "_x_raw")

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError("an Ed25519 seed is 32 bytes")
        self._signing = nacl.signing.SigningKey(seed)
        self.verkey: str = b58encode(bytes(self._signing.verify_key))
        self._x_private: PrivateKey | None = None
        self._x_public: PublicKey | None = None
        self._x_raw: tuple[bytes, bytes] | None = None

    @classmethod
    def generate(cls) -> "KeyPair":
        return cls(bytes(nacl.signing.SigningKey.generate()))

    @property
    def seed(self) -> bytes:
        """The 32-byte secret seed; only the keystore should ever read it."""
        return bytes(self._signing)

    @property
    def verkey_bytes(self) -> bytes:
        return bytes(self._signing.verify_key)

    @property
    def ed25519_secret(self) -> bytes:
        """The 64-byte libsodium secret key (seed || public key)."""
        return self._signing._signing_key  # noqa: SLF001 - libsodium layout, needed for conversions

    def x25519_private(self) -> PrivateKey:
        if self._x_private is None:
            self._x_private = self._signing.to_curve25519_private_key()
        return self._x_private

    def x25519_public(self) -> PublicKey:
        if self._x_public is None:
            self._x_public = self.x25519_private().public_key
        return self._x_public

    def x25519_raw(self) -> tuple[bytes, bytes]:
        """(public, secret) X25519 keys as raw bytes, converted once: every unpack for this key needs them."""
        raw = self._x_raw
        if raw is None:
            raw = self._x_raw = (bytes(self.x25519_public()), bytes(self.x25519_private()))
        return raw

    def sign(self, message: bytes) -> bytes:
        """The detached 64-byte Ed25519 signature."""
        return self._signing.sign(message).signature

    def __repr__(self) -> str:
        return f"KeyPair(verkey={self.verkey!r})"

    __str__ = __repr__

    def __reduce__(self):  # never pickle a secret by accident
        raise TypeError("KeyPair holds a secret and cannot be pickled; keep it in the keystore")
