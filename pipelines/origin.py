"""Origin proofs: who published a history row, checkable long after the group forgot the message.

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
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import nacl.bindings
import nacl.exceptions

from zerocomm_spark.errors import ConfigurationError, DIDError

if TYPE_CHECKING:
    import pyarrow as pa

    from zerocomm_spark.keys.keypair import KeyPair

__all__ = [
    "ORIGIN_HEADER",
    "SCHEME",
    "OriginSigner",
    "origin_digest",
    "signature_from_header",
    "text_column",
    "verify_origin",
    "verify_rows",
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


def _binary_type(kind: pa.DataType) -> pa.DataType:
    """``kind`` with its text (also inside a map) as bytes: what a column that is not UTF-8 can be read as."""
    import pyarrow as pa

    if pa.types.is_string(kind):
        return pa.binary()
    if pa.types.is_large_string(kind):
        return pa.large_binary()
    if pa.types.is_map(kind):
        return pa.map_(_binary_type(kind.key_type), _binary_type(kind.item_type))
    return kind


def _decode(value: Any, errors: str) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors)
    if isinstance(value, list):  # a map's (key, value) pairs
        return [(_decode(k, errors), _decode(v, errors)) for k, v in value]
    return value


def text_column(column: pa.Array | pa.ChunkedArray, errors: str = "strict") -> tuple[list[Any], list[bool]]:
    """``column.to_pylist()``, and per value whether its text is not UTF-8.

    Spark and Delta do not check that strings are UTF-8, so a damaged or hostile table can hold such
    text, and one value would make ``to_pylist`` raise for the whole column (a whole replay or
    restore). Here it is None instead (``errors="strict"``), or decoded with that error handler
    (``"replace"``, for display), and flagged True."""
    try:
        values = column.to_pylist()
        return values, [False] * len(values)
    except UnicodeDecodeError:
        pass
    values, flags = [], []
    for raw in column.cast(_binary_type(column.type)).to_pylist():
        try:
            values.append(_decode(raw, "strict"))
            flags.append(False)
        except UnicodeDecodeError:
            values.append(None if errors == "strict" else _decode(raw, errors))
            flags.append(True)
    return values, flags


def _as_pairs(value: Any) -> list[tuple[str, str]] | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return list(value.items())
    return [tuple(kv) for kv in value]  # type: ignore[misc]


def verify_rows(table: pa.Table, *, payload: Sequence[bytes] | None = None, threads: int = 2,
                progress: Callable[[int], None] | None = None) -> list[bool]:
    """Check the origin of every row of a history-shaped Arrow table (one bool per row).

    Needs the columns group, publisher_did, message_id, headers, origin_sig and (unless the clear
    ``payload`` values are given, e.g. after decrypting) payload. Rows without a signature are
    False, and so are rows whose text is not UTF-8 (nobody signed it) and rows whose headers hold a
    ``zc-origin`` proof header: ingest moves the proof into ``origin_sig``, and the digest leaves
    that header out, so one in a history row was added after the publisher signed.
    libsodium runs without the GIL, so ``threads`` workers verify in parallel.
    """
    n = table.num_rows
    groups, bad_group = text_column(table.column("group"))
    dids, bad_did = text_column(table.column("publisher_did"))
    ids, bad_id = text_column(table.column("message_id"))
    sigs = table.column("origin_sig").to_pylist()
    if "headers" in table.column_names:
        heads, bad_head = text_column(table.column("headers"))
    else:
        heads, bad_head = [None] * n, [False] * n
    payloads = list(payload) if payload is not None else table.column("payload").to_pylist()
    if len(payloads) != n:
        raise ValueError(f"{len(payloads)} payloads for {n} rows")

    def one(i: int) -> bool:
        if bad_group[i] or bad_did[i] or bad_id[i] or bad_head[i]:
            return False
        pairs = _as_pairs(heads[i])
        if pairs is not None and any(kv[0] == ORIGIN_HEADER for kv in pairs):
            return False
        return verify_origin(groups[i], dids[i], ids[i], payloads[i], pairs, sigs[i])

    def check(lo: int, hi: int) -> list[bool]:
        out = [one(i) for i in range(lo, hi)]
        if progress is not None:
            progress(hi - lo)
        return out

    if n == 0:
        return []
    step = max(1024, -(-n // max(threads * 4, 1)))
    spans = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
    if threads <= 1 or len(spans) == 1:
        return [ok for lo, hi in spans for ok in check(lo, hi)]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerocomm-origin") as pool:
        return [ok for part in pool.map(lambda s: check(*s), spans) for ok in part]
