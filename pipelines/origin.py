"""Origin proofs over history tables: who published a history row, checkable long after the group forgot it.

The scheme ``ed25519-member/1`` itself (what is signed, the ``zc-origin`` header, :class:`OriginSigner`,
:func:`verify_origin`) lives in the core, :mod:`zerocomm_spark.group.origin`, so an agent process can
sign what it publishes without Spark or pyarrow; its names are re-exported here, so imports from this
module keep working. What is here works on Arrow tables: :func:`verify_rows` (a whole history-shaped
table, in parallel) and :func:`text_column` (a text column that may hold text that is not UTF-8).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from zerocomm_spark.group.origin import (ORIGIN_HEADER, SCHEME, OriginSigner, origin_digest, signature_from_header,
                                         verify_origin)

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["ORIGIN_HEADER", "SCHEME", "OriginSigner", "origin_digest", "signature_from_header", "text_column",
           "verify_origin", "verify_rows"]


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
