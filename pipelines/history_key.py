"""The group history key: payloads at rest in Delta readable only by the group's members.

Why a key of its own: a history table lives on shared storage (an object store, a lake) that more
people can read than the group has members. With a history key the ``payload`` column holds
XChaCha20-Poly1305 ciphertext instead of clear bytes; everything Spark needs to plan, prune and
order (group, date, ids, publisher, seq, Lamport time) stays in clear, and so do the application
``headers`` (routing metadata by design: what must stay secret belongs in the payload).

* Each payload is sealed on its own (``nonce(24) || ciphertext || tag(16)``), so rows stay
  independent: any subset can be restored, compacted or deleted. Nonces are random (192 bits:
  no counter to keep across processes and restarts).
* The associated data is ``group, publisher_did, message_id``: a provider cannot move a ciphertext
  to another row without the decryption failing.
* ``key_id`` (8 bytes of a keyed BLAKE2b of the key, hex) is stored per row, so a table can hold
  rows of several keys after a rotation and a reader knows which one it needs.
* The caller supplies the key and keeps it sealed: :func:`seal_history_key` packs it in an RFC 0019
  anoncrypt envelope for the members' verkeys, :func:`open_history_key` opens it with a member's
  keystore. The key never appears in reprs, logs or exceptions.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import nacl.bindings
import nacl.exceptions

from zerocomm_spark.errors import ConfigurationError, TamperedEnvelopeError

if TYPE_CHECKING:
    import pyarrow as pa

    from zerocomm_spark.keys.keypair import KeyPair

__all__ = ["HistoryKey", "open_history_key", "seal_history_key"]

KEY_BYTES = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_KEYBYTES  # 32
NONCE_BYTES = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES  # 24
TAG_BYTES = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_ABYTES  # 16
_encrypt = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_encrypt
_decrypt = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_decrypt


def _aad(group: str, publisher_did: str, message_id: str) -> bytes:
    return b"\x00".join((b"zerocomm-history/1", group.encode("utf-8"), publisher_did.encode("utf-8"),
                         message_id.encode("utf-8")))


class HistoryKey:
    """A 32-byte XChaCha20-Poly1305 key for history payloads; picklable (Spark ships it to workers)."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ConfigurationError(f"a history key is {KEY_BYTES} bytes",
                                     hint="Make one with HistoryKey.generate() and keep it sealed (seal_history_key)")
        self._key = bytes(key)
        self.key_id = hashlib.blake2b(self._key, digest_size=8, person=b"zc-hist-kid").hexdigest()

    @classmethod
    def generate(cls) -> "HistoryKey":
        return cls(os.urandom(KEY_BYTES))

    def __repr__(self) -> str:
        return f"HistoryKey(key_id={self.key_id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HistoryKey) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.key_id)

    def __getstate__(self) -> bytes:
        return self._key

    def __setstate__(self, state: bytes) -> None:
        self.__init__(state)  # type: ignore[misc]

    @property
    def secret(self) -> bytes:
        """The raw key, for sealing it (seal_history_key) or putting it in a keystore; never log it."""
        return self._key

    # --- one value --------------------------------------------------------------------------------

    def seal(self, payload: bytes, group: str, publisher_did: str, message_id: str,
             nonce: bytes | None = None) -> bytes:
        """``nonce || ciphertext || tag`` of one payload, bound to its row."""
        n = os.urandom(NONCE_BYTES) if nonce is None else nonce
        return n + _encrypt(payload, _aad(group, publisher_did, message_id), n, self._key)

    def open(self, sealed: bytes, group: str, publisher_did: str, message_id: str) -> bytes:
        """The clear payload; TamperedEnvelopeError if it was altered, moved or sealed with another key."""
        if len(sealed) < NONCE_BYTES + TAG_BYTES:
            raise TamperedEnvelopeError("a history payload is shorter than a sealed value")
        try:
            return _decrypt(sealed[NONCE_BYTES:], _aad(group, publisher_did, message_id), sealed[:NONCE_BYTES],
                            self._key)
        except nacl.exceptions.CryptoError:
            raise TamperedEnvelopeError("a history payload does not open with this key for its row",
                                        hint="It was altered or moved to another row, or sealed with another "
                                             "history key (compare payload_key_id with key.key_id)") from None

    # --- Arrow columns ----------------------------------------------------------------------------

    def seal_column(self, groups: Sequence[str], dids: Sequence[str], ids: Sequence[str],
                    payloads: Sequence[bytes]) -> pa.Array:
        """Seal a whole column at once: one urandom call for every nonce, one binary array out."""
        import pyarrow as pa

        n = len(payloads)
        nonces = os.urandom(NONCE_BYTES * n)
        key = self._key
        out = [b""] * n
        for i in range(n):
            nonce = nonces[i * NONCE_BYTES:(i + 1) * NONCE_BYTES]
            out[i] = nonce + _encrypt(payloads[i], _aad(groups[i], dids[i], ids[i]), nonce, key)
        return pa.array(out, type=pa.binary())

    def open_column(self, groups: Sequence[str], dids: Sequence[str], ids: Sequence[str],
                    sealed: Sequence[bytes], on_error: Callable[[int], bytes | None] | None = None) -> list[bytes | None]:
        """Open a column; a value that does not open raises, or goes to ``on_error(row)`` if given."""
        out: list[bytes | None] = []
        for i, value in enumerate(sealed):
            try:
                out.append(self.open(value, groups[i], dids[i], ids[i]))
            except TamperedEnvelopeError:
                if on_error is None:
                    raise
                out.append(on_error(i))
        return out


def seal_history_key(key: HistoryKey, recipient_verkeys: Sequence[str]) -> bytes:
    """The key in an RFC 0019 anoncrypt envelope for these verkeys (e.g. the members' group keys)."""
    from zerocomm_spark.envelope import pack

    if not recipient_verkeys:
        raise ConfigurationError("seal_history_key needs at least one recipient verkey")
    return pack(key.secret, list(recipient_verkeys))


def open_history_key(sealed: bytes, lookup: Callable[[str], KeyPair | None]) -> HistoryKey:
    """Open a sealed history key with a member's keys (``keystore.find``)."""
    from zerocomm_spark.envelope import unpack

    return HistoryKey(unpack(sealed, lookup).message)
