"""Origin proofs (scheme core): who published a message, checkable long after the group forgot it.

Why a proof of its own: the data plane's Ed25519 signature (zerocomm_spark.group.datamessage,
``data-signed``) covers a whole *batch* of the wire, and stays inside the data plane: a member's
journal, the Spark source and therefore a history table see single messages without it. A history
row that is read back months later, by a member that was never online with the publisher, from a
provider it does not trust, needs a proof that travels *with the row*. So the publisher signs each
message with its **member key**, whose did:key *is* the ``publisher_did`` every row already carries:
the proof is self-certifying (no view, no key server; it still verifies after the publisher left),
and a provider can neither change a payload nor pass off a row of its own as someone else's.

Scheme ``ed25519-member/1``::

    digest  = "zerocomm-origin/1" || lp(group) || lp(publisher_did) || lp(message_id)
              || lp(sha256(payload)) || lp(headers without the proof header, sorted, each lp(k) lp(v))
    lp(x)   = 4-byte big-endian length || x
    header  zc-origin = "1:" + base64(Ed25519 signature of digest by the member key)

The proof rides in the message's headers (the one per-message field every layer already carries:
data plane -> journal -> format("zerocomm") with includeHeaders=true); history ingest moves it into
the ``origin_sig`` column. What it does not cover: ``seq``, ``lamport_ts`` and ``sent_at``, which the
data plane assigns after the application signed. A provider could therefore misreport a message's
position, not its content or author. Closing that needs the data plane to sign per-message proofs
(a Merkle root per batch, a path per message) and the journal to carry them; see the history README
section.

Who signs: a member whose process holds the member key, with :class:`OriginSigner`
(pipelines/local_group.py, embedded members); an agent process on request, since its key never
leaves it (the API's ``publish`` with ``sign``: ``Client.publish(..., sign=True)``, ``zerocomm send
--sign``, the sink option ``signOrigin``), with :meth:`GroupManager.origin_signer
<zerocomm_spark.group.manager.GroupManager.origin_signer>`.

This module is the core of the scheme (no Spark, no pyarrow); the Arrow-level checks over history
tables live in ``zerocomm_spark.pipelines.origin``, which re-exports these names.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING

import nacl.bindings
import nacl.exceptions

from zerocomm_spark.errors import ConfigurationError, DIDError

if TYPE_CHECKING:
    from zerocomm_spark.keys.keypair import KeyPair

__all__ = [
    "ORIGIN_HEADER",
    "SCHEME",
    "OriginSigner",
    "origin_digest",
    "signature_from_header",
    "verify_origin",
]

#: The header the proof travels in, and the scheme history rows name in ``origin_scheme``.
ORIGIN_HEADER = "zc-origin"
SCHEME = "ed25519-member/1"
_DOMAIN = b"zerocomm-origin/1"
_PREFIX = "1:"
_SIG_BYTES = nacl.bindings.crypto_sign_BYTES
_pack_len = struct.Struct(">I").pack
_BAD = (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError,
        nacl.exceptions.CryptoError, ValueError, TypeError)


def _lp(data: bytes) -> bytes:
    return _pack_len(len(data)) + data


def origin_digest(group: str, publisher_did: str, message_id: str, payload: bytes,
                  headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None) -> bytes:
    """The exact bytes a publisher signs for one message (length-prefixed, so fields cannot slide)."""
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or ())
    kept = sorted((k, v) for k, v in pairs if k != ORIGIN_HEADER)
    parts = [_DOMAIN, _lp(group.encode("utf-8")), _lp(publisher_did.encode("utf-8")),
             _lp(message_id.encode("utf-8")), _lp(hashlib.sha256(payload).digest()), _pack_len(len(kept))]
    for key, value in kept:
        parts.append(_lp(key.encode("utf-8")))
        parts.append(_lp(value.encode("utf-8")))
    return b"".join(parts)


def signature_from_header(value: str | None) -> bytes | None:
    """The 64-byte signature in a ``zc-origin`` header value, or None if absent or malformed."""
    if not value or not value.startswith(_PREFIX):
        return None
    try:
        raw = base64.b64decode(value[len(_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == _SIG_BYTES else None


@lru_cache(maxsize=4096)
def _public_key(publisher_did: str) -> bytes | None:
    """A member DID is the did:key of its member key: the verifier needs nothing but the row."""
    from zerocomm_spark.did.peer import verkey_from_did_key
    from zerocomm_spark.keys.keypair import verkey_bytes

    try:
        return verkey_bytes(verkey_from_did_key(publisher_did))
    except (DIDError, ValueError, TypeError):
        return None


class OriginSigner:
    """Signs the messages one member publishes, so history can prove later that it published them.

    ``key`` is the member key (``did:key`` of its verkey == the member's DID in its groups).
    """

    def __init__(self, key: KeyPair, publisher_did: str | None = None) -> None:
        from zerocomm_spark.did.peer import did_key

        did = did_key(key.verkey)
        if publisher_did is not None and publisher_did != did:
            raise ConfigurationError(
                "the origin key does not belong to this publisher: its did:key differs from the member DID",
                hint="Sign with the member key (keystore purpose 'group-member'), whose did:key is agent.groups.did")
        self._key = key
        self.publisher_did = did

    def __repr__(self) -> str:
        return f"OriginSigner({self.publisher_did!r})"

    def sign(self, group: str, message_id: str, payload: bytes,
             headers: Mapping[str, str] | None = None) -> bytes:
        """The 64-byte signature over one message."""
        return self._key.sign(origin_digest(group, self.publisher_did, message_id, payload, headers))

    def headers(self, group: str, message_id: str, payload: bytes,
                headers: Mapping[str, str] | None = None) -> dict[str, str]:
        """``headers`` plus the ``zc-origin`` proof: what to publish with the message."""
        signature = self.sign(group, message_id, payload, headers)
        out = dict(headers or {})
        out[ORIGIN_HEADER] = _PREFIX + base64.b64encode(signature).decode("ascii")
        return out


def verify_origin(group: str, publisher_did: str, message_id: str, payload: bytes,
                  headers: Mapping[str, str] | Iterable[tuple[str, str]] | None, signature: bytes | None) -> bool:
    """True iff ``signature`` is ``publisher_did``'s member key's signature over this message.

    Never raises on a malformed row (a null payload or header value, a non-string id): it is False."""
    if signature is None or len(signature) != _SIG_BYTES:
        return False
    public = _public_key(publisher_did)
    if public is None:
        return False
    try:
        digest = origin_digest(group, publisher_did, message_id, payload, headers)
    except (AttributeError, TypeError, ValueError):  # a malformed row (null or mistyped field) is not proven
        return False
    try:
        nacl.bindings.crypto_sign_open(bytes(signature) + digest, public)
    except _BAD:
        return False
    return True
