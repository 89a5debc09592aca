"""The journal's ciphers: AEGIS-256 for records (v3); AES-256-GCM and XChaCha20-Poly1305 for older
records; XChaCha20-Poly1305 for side files.

A record names its cipher in its header's version byte (codec.py), and that byte is authenticated
(it is part of the associated data), so a record can never be read under another cipher:

``3`` AEGIS-256 (the CFRG's AEGIS draft, libsodium's ``crypto_aead_aegis256`` through pynacl's cffi
    handle): AES-round based, 2-3x the speed of AES-256-GCM on a CPU with AES-NI (measured here:
    ~6 GB/s against ~2 GB/s in one thread), which is what lets an encrypted journal keep up with a
    plain file. 256-bit key = BLAKE2b-256 keyed by the journal key, personalised for v3 records (the
    journal key itself keys the side files), 256-bit nonce = the header's 24 random bytes followed by
    8 zero bytes (a nonce repeats only if 192 random bits do), 32-byte tag. Written by this version;
    opened in place where the caller owns the buffer.
``2`` AES-256-GCM, through ``cryptography`` (OpenSSL: AES-NI and carry-less multiply where the CPU has
    them, 3-4x the speed of XChaCha20-Poly1305 there; a constant-time software path elsewhere).
    Written by the previous version; read. Nonces: record key = BLAKE2b-256 keyed by the journal key over the
    header's first 12 random bytes, GCM nonce = the other 12, so a (key, nonce) pair repeats only
    if 192 random bits do, however many records the journal key ever seals.
``1`` XChaCha20-Poly1305 (IETF) with the header's 24 random bytes as nonce, through libsodium (pynacl):
    what the first versions wrote; still read, never written.

All three read from and write into Arrow buffers (64-byte aligned, reusable by Arrow's allocator)
with no extra copy: ``cryptography``'s ``encrypt_into``/``decrypt_into``, and libsodium through
pynacl's own cffi handle, decrypting in place (for v1, pynacl's public binding, which copies, is the
fallback if that handle is missing in another pynacl build; v3 needs the handle, which every pynacl
wheel since 1.6 has). All release the GIL, so records are sealed and opened on several cores at once.

Small side files (key check, index, recent ids) keep XChaCha20-Poly1305 with random 24-byte nonces
through pynacl's public binding (``seal``/``open_sealed``): their speed does not matter.
"""

from __future__ import annotations

import functools
import hashlib
import os

import pyarrow as pa

import nacl.bindings as _sodium_public  # first: importing it runs sodium_init(), which picks the SIMD code
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from zerocomm_spark.errors import JournalKeyError

KEY_BYTES = 32
NONCE_BYTES = 24  # the random field of every record header, whatever the cipher
TAG_BYTES = 16  # the tag of v1 and v2 records and of side files

#: Cipher ids: the record header's version byte.
XCHACHA20_POLY1305 = 1
AES_256_GCM = 2
AEGIS_256 = 3
CIPHERS = (XCHACHA20_POLY1305, AES_256_GCM, AEGIS_256)
#: The cipher new records are written with.
WRITE_CIPHER = AEGIS_256
#: Tag bytes at the end of a record body, by cipher.
_TAGS = {XCHACHA20_POLY1305: TAG_BYTES, AES_256_GCM: TAG_BYTES, AEGIS_256: 32}
NAMES = {XCHACHA20_POLY1305: "XChaCha20-Poly1305", AES_256_GCM: "AES-256-GCM", AEGIS_256: "AEGIS-256"}
_AEGIS_NONCE_PAD = bytes(8)

_RECORD_KEY_PERSON = b"zcj-record-v2"  # BLAKE2b personalisation: record keys are for nothing else
_AEGIS_KEY_PERSON = b"zcj-record-v3"

try:  # pynacl's cffi handle to its bundled libsodium (see module docstring)
    from nacl._sodium import ffi as _ffi  # type: ignore[import-not-found]
    from nacl._sodium import lib as _lib  # type: ignore[import-not-found]

    _ENCRYPT = _lib.crypto_aead_xchacha20poly1305_ietf_encrypt
    _DECRYPT = _lib.crypto_aead_xchacha20poly1305_ietf_decrypt
    FAST = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the pynacl build
    FAST = False
_AEGIS_ENCRYPT = getattr(_lib, "crypto_aead_aegis256_encrypt", None) if FAST else None
_AEGIS_DECRYPT = getattr(_lib, "crypto_aead_aegis256_decrypt", None) if FAST else None


def tag_bytes(cipher: int) -> int:
    """Bytes of tag that end a record body under ``cipher`` (a known cipher id)."""
    return _TAGS[cipher]


def check_key(key: object) -> bytes:
    """The key as bytes, or JournalKeyError (which never shows the key)."""
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise JournalKeyError("the journal key must be exactly 32 bytes")
    return bytes(key)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _bytes_view(buffer: pa.Buffer) -> memoryview:
    # Arrow buffers export signed bytes ("b"); cryptography takes unsigned ones ("B") only.
    return memoryview(buffer).cast("B")


def _record_aead(nonce: bytes, key: bytes) -> AESGCM:
    """The AES-256-GCM instance for one v2 record (its key derived from the header's random bytes)."""
    return AESGCM(hashlib.blake2b(nonce[:12], digest_size=32, key=key, person=_RECORD_KEY_PERSON).digest())


# --- records, v3: AEGIS-256 ----------------------------------------------------------------------


def _aegis() -> None:
    if _AEGIS_DECRYPT is None:  # pragma: no cover - every supported pynacl has it
        raise RuntimeError("this pynacl build lacks AEGIS-256: install pynacl >= 1.6 (pip install -U pynacl)")


@functools.lru_cache(maxsize=8)
def _aegis_key(key: bytes) -> bytes:
    """The v3 record key of a journal key (derived once: records and side files never share a key)."""
    return hashlib.blake2b(b"", digest_size=32, key=key, person=_AEGIS_KEY_PERSON).digest()


def encrypt_aegis(plaintext: pa.Buffer, aad: bytes, nonce: bytes, key: bytes) -> pa.Buffer:
    """Ciphertext || tag of ``plaintext`` in a fresh Arrow buffer (a v3 record body)."""
    _aegis()
    size = plaintext.size
    out = pa.allocate_buffer(size + 32)
    rc = _AEGIS_ENCRYPT(_ffi.from_buffer(out, require_writable=True), _ffi.NULL, _ffi.from_buffer(plaintext), size,
                        aad, len(aad), _ffi.NULL, nonce + _AEGIS_NONCE_PAD, _aegis_key(key))
    if rc != 0:  # pragma: no cover - libsodium only fails on absurd sizes
        raise MemoryError("record encryption failed")
    return out


def decrypt_aegis(body: pa.Buffer, aad: bytes, nonce: bytes, key: bytes) -> pa.Buffer | None:
    """The plaintext of a v3 body, or None if authentication fails. A mutable ``body`` is decrypted in
    place (the result is a slice of it; on failure libsodium wipes it); a read-only one into a new buffer."""
    _aegis()
    size = body.size - 32
    if size < 0:
        return None
    out = body if body.is_mutable else pa.allocate_buffer(max(size, 1))
    rc = _AEGIS_DECRYPT(_ffi.from_buffer(out, require_writable=True), _ffi.NULL, _ffi.NULL, _ffi.from_buffer(body),
                        body.size, aad, len(aad), nonce + _AEGIS_NONCE_PAD, _aegis_key(key))
    return out.slice(0, size) if rc == 0 else None


# --- records, v2: AES-256-GCM ----------------------------------------------------------------------


def encrypt_gcm(plaintext: pa.Buffer, aad: bytes, nonce: bytes, key: bytes) -> pa.Buffer:
    """Ciphertext || tag of ``plaintext`` in a fresh Arrow buffer (a v2 record body)."""
    out = pa.allocate_buffer(plaintext.size + TAG_BYTES)
    _record_aead(nonce, key).encrypt_into(nonce[12:], _bytes_view(plaintext), aad, _bytes_view(out))
    return out


def decrypt_gcm(body: pa.Buffer, aad: bytes, nonce: bytes, key: bytes) -> pa.Buffer | None:
    """The plaintext of a v2 record body in a fresh Arrow buffer, or None if authentication fails."""
    size = body.size - TAG_BYTES
    if size < 0:
        return None
    out = pa.allocate_buffer(size)
    try:
        _record_aead(nonce, key).decrypt_into(nonce[12:], _bytes_view(body), aad, _bytes_view(out))
    except InvalidTag:
        return None
    return out


# --- records, v1: XChaCha20-Poly1305 (read only, and tests) ----------------------------------------


def encrypt(plaintext: pa.Buffer, aad: bytes, nonce: bytes, key: bytes, *, fast: bool = FAST) -> pa.Buffer:
    """Ciphertext || tag of ``plaintext`` in a fresh Arrow buffer (a v1 record body)."""
    size = plaintext.size
    if fast:
        out = pa.allocate_buffer(size + TAG_BYTES)
        rc = _ENCRYPT(_ffi.from_buffer(out, require_writable=True), _ffi.NULL,
                      _ffi.from_buffer(plaintext), size, aad, len(aad), _ffi.NULL, nonce, key)
        if rc != 0:  # pragma: no cover - libsodium only fails on absurd sizes
            raise MemoryError("record encryption failed")
        return out
    return pa.py_buffer(_sodium_public.crypto_aead_xchacha20poly1305_ietf_encrypt(
        plaintext.to_pybytes(), aad, nonce, key))


def decrypt_in_place(buffer: pa.Buffer, aad: bytes, nonce: bytes, key: bytes, *, fast: bool = FAST) -> pa.Buffer | None:
    """The plaintext of a v1 body (a slice of ``buffer``, which is overwritten), or None if authentication fails."""
    size = buffer.size
    if size < TAG_BYTES:
        return None
    if fast:
        rc = _DECRYPT(_ffi.from_buffer(buffer, require_writable=True), _ffi.NULL, _ffi.NULL,
                      _ffi.from_buffer(buffer), size, aad, len(aad), nonce, key)
        return buffer.slice(0, size - TAG_BYTES) if rc == 0 else None
    from nacl.exceptions import CryptoError

    try:
        return pa.py_buffer(_sodium_public.crypto_aead_xchacha20poly1305_ietf_decrypt(
            buffer.to_pybytes(), aad, nonce, key))
    except CryptoError:
        return None


# --- records, by cipher id -------------------------------------------------------------------------


def encrypt_record(cipher: int, plaintext: pa.Buffer, aad: bytes, nonce: bytes, key: bytes) -> pa.Buffer:
    if cipher == AEGIS_256:
        return encrypt_aegis(plaintext, aad, nonce, key)
    if cipher == AES_256_GCM:
        return encrypt_gcm(plaintext, aad, nonce, key)
    if cipher == XCHACHA20_POLY1305:
        return encrypt(plaintext, aad, nonce, key)
    raise ValueError(f"unknown record cipher {cipher}")


def decrypt_record(cipher: int, body: pa.Buffer, aad: bytes, nonce: bytes, key: bytes) -> pa.Buffer | None:
    """The plaintext, or None if authentication fails. ``body`` may be overwritten (v1 and v3 decrypt a
    mutable body in place)."""
    if cipher == AEGIS_256:
        return decrypt_aegis(body, aad, nonce, key)
    if cipher == AES_256_GCM:
        return decrypt_gcm(body, aad, nonce, key)
    if cipher == XCHACHA20_POLY1305:
        return decrypt_in_place(body, aad, nonce, key)
    return None


# --- side files ------------------------------------------------------------------------------------


def seal(plaintext: bytes, aad: bytes, key: bytes) -> bytes:
    """nonce || ciphertext for small side files (index, key check); speed does not matter there."""
    nonce = new_nonce()
    return nonce + _sodium_public.crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, aad, nonce, key)


def open_sealed(blob: bytes, aad: bytes, key: bytes) -> bytes | None:
    from nacl.exceptions import CryptoError

    if len(blob) < NONCE_BYTES + TAG_BYTES:
        return None
    try:
        return _sodium_public.crypto_aead_xchacha20poly1305_ietf_decrypt(
            blob[NONCE_BYTES:], aad, blob[:NONCE_BYTES], key)
    except CryptoError:
        return None
