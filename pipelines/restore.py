"""Restore what a member missed from one or more history providers, each message once, verified.

A member that joined late, or comes back after a crash or a long absence, has a gap: the group only
sends what is sent while a member is online, and publishers keep unacknowledged messages only
within their retention. Members that keep history (replicas, thesis figure 39) can fill it.

The exchange follows seed 003's announce / request-or-ignore relaying, so nothing arrives twice:

1. **announce**: each provider says which messages it offers, keys only (id, publisher, seq,
   Lamport time), no payloads;
2. **request or ignore**, per key and in the order announcements arrive: a key the member already
   has (its journal, its positions, its own table) is ignored (a position match only at the provider
   that announced that seq: seq is not covered by the origin proof); a key not seen before is requested
   from the provider that announced it first (state "known, payload unknown"); a key already
   requested elsewhere is ignored;
3. **payloads** come back only for what was requested. Each row's origin is verified (the
   publisher's signature, pipelines/origin.py; sealed payloads are opened with the history key
   first) and must match what that provider announced; a row of the wrong types (nulls included) is
   rejected like a forged one. A row that fails is rejected, never delivered, and its
   key is requested from the next provider that announced it (the fallback the seed's comments ask
   for); a key no provider could prove is reported missing. A provider that raises or answers
   something that is not a history table is treated the same way (its keys go to the next
   provider), never aborting the restore; a ConfigurationError (the caller's set-up) still raises.
4. Only then is anything **delivered**: every verified row once, in causal order
   (lamport_ts, publisher_did).

Providers are anything with ``announce``/``request``/``ignore`` (:class:`HistoryProvider`):
:class:`DeltaProvider` serves a Delta history table, :class:`ArrowProvider` rows held in memory.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from zerocomm_spark.errors import ApiTimeoutError, ConfigurationError, TamperedEnvelopeError
from zerocomm_spark.pipelines.origin import text_column, verify_rows
from zerocomm_spark.pipelines.schema import HISTORY_COLUMNS, KEY_COLUMNS, history_arrow_schema

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

    from zerocomm_spark.pipelines.history_key import HistoryKey

__all__ = [
    "ArrowProvider",
    "DeltaProvider",
    "DeltaSink",
    "Have",
    "HistoryProvider",
    "Rejection",
    "RestoreReport",
    "have_from_client",
    "have_from_journal",
    "have_from_table",
    "restore",
]

log = logging.getLogger("zerocomm_spark.pipelines.restore")


# --- what the member already has ---------------------------------------------------------------


@dataclass(frozen=True)
class Have:
    """What a member already holds of a group: message ids, and per publisher a seq below which it
    holds everything (``positions``: what its journal retained may no longer list every id)."""

    message_ids: frozenset[str] = frozenset()
    positions: Mapping[str, int] = field(default_factory=dict)

    def __contains__(self, key: tuple[str, str, int]) -> bool:
        message_id, publisher_did, seq = key
        return message_id in self.message_ids or seq <= self.positions.get(publisher_did, 0)

    def union(self, other: "Have") -> "Have":
        positions = dict(self.positions)
        for did, seq in other.positions.items():
            positions[did] = max(seq, positions.get(did, 0))
        return Have(self.message_ids | other.message_ids, positions)

    @classmethod
    def from_rows(cls, ids: Iterable[str], dids: Iterable[str] = (), seqs: Iterable[int] = ()) -> "Have":
        """Ids, and the contiguous-from-1 prefix of each publisher's seqs as its position."""
        by_did: dict[str, set[int]] = {}
        for row, (did, seq) in enumerate(zip(dids, seqs)):
            try:
                if isinstance(seq, bool):
                    raise TypeError
                number = operator.index(seq)  # ints (numpy's too); not None, floats or text
            except TypeError:
                # A position is only as good as its seqs: guessing one (or skipping it) could skip a message.
                raise ConfigurationError(
                    f"Have.from_rows: the seq of row {row} (publisher {did!r}) is "
                    f"{'null' if seq is None else type(seq).__name__}, not an int",
                    hint="Pass each row's seq as an int (the journal's or history table's seq column), or build "
                         "Have(message_ids=...) from ids alone") from None
            by_did.setdefault(did, set()).add(number)
        positions = {}
        for did, held in by_did.items():
            top = 0
            while top + 1 in held:
                top += 1
            if top:
                positions[did] = top
        return cls(frozenset(ids), positions)


def have_from_client(client: Any, group: str, *, page: int = 50_000, timeout: float = 60.0) -> Have:
    """What the member behind a :class:`~zerocomm_spark.client.Client` journaled of ``group``."""
    ids: list[str] = []
    dids: list[str] = []
    seqs: list[int] = []
    start: int | None = None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiTimeoutError(f"reading {group!r}'s journal to learn what the member has took over {timeout}s",
                                  hint="Nothing was restored; retry with a longer timeout (have_from_client(..., "
                                       "timeout=...)) or a bigger page")
        result = client.fetch(group=group, start=start, max_rows=page, timeout=max(left, 1.0))
        table = result.table
        ids += table.column("message_id").to_pylist()
        dids += table.column("publisher_did").to_pylist()
        seqs += table.column("seq").to_pylist()
        if result.next_offset >= result.end_offset or start == result.next_offset:
            break
        start = result.next_offset
    return Have.from_rows(ids, dids, seqs)


def have_from_journal(journal: Any, group: str) -> Have:
    """What a :class:`~zerocomm_spark.journal.Journal` (opened in this process) holds of ``group``."""
    import pyarrow.compute as pc

    ids: list[str] = []
    dids: list[str] = []
    seqs: list[int] = []
    for batch in journal.read_batches(journal.earliest_offset(), journal.next_offset()):
        mine = batch.filter(pc.equal(batch.column("group"), group))
        ids += mine.column("message_id").to_pylist()
        dids += mine.column("publisher_did").to_pylist()
        seqs += mine.column("seq").to_pylist()
    return Have.from_rows(ids, dids, seqs)


def have_from_table(spark: SparkSession, table_path: str, group: str) -> Have:
    """What a Delta history table (the member's own) holds of ``group``."""
    from pyspark.sql import functions as F

    from zerocomm_spark.pipelines.history import require_history_table, table_exists

    if not table_exists(spark, str(table_path)):
        return Have()
    require_history_table(spark, str(table_path))
    keys = (spark.read.format("delta").load(str(table_path)).where(F.col("group") == group)
            .select("message_id", "publisher_did", "seq").toArrow())
    ids, bad_id = text_column(keys.column("message_id"))
    dids, bad_did = text_column(keys.column("publisher_did"))
    seqs = keys.column("seq").to_pylist()
    if not any(bad_id) and not any(bad_did):  # the usual table: no copies of its tens of millions of keys
        return Have.from_rows(ids, dids, seqs)
    # A row whose id or publisher is not UTF-8 text (a damaged table) names no message anyone announces.
    kept = [i for i in range(len(ids)) if not (bad_id[i] or bad_did[i])]
    return Have.from_rows([ids[i] for i in kept], [dids[i] for i in kept], [seqs[i] for i in kept])


# --- providers ---------------------------------------------------------------------------------


@runtime_checkable
class HistoryProvider(Protocol):
    """A member (or a table) that serves history: announce keys, then payloads on request."""

    name: str

    def announce(self, group: str, since_lamport: int | None = None) -> pa.Table:
        """The keys it offers (schema.KEY_COLUMNS), no payloads."""

    def request(self, group: str, message_ids: Sequence[str]) -> pa.Table:
        """History rows (schema.HISTORY_COLUMNS) for exactly these ids, as far as it has them."""

    def ignore(self, group: str, message_ids: Sequence[str]) -> None:
        """The announced keys the member will not request from it (flow control, accounting)."""


@dataclass
class ProviderStats:
    announced: int = 0
    requested: int = 0
    served: int = 0
    ignored: int = 0
    request_calls: int = 0


class ArrowProvider:
    """History rows held in memory (a pyarrow Table of the history schema) served as a provider."""

    def __init__(self, rows: pa.Table, name: str = "arrow") -> None:
        self.name = name
        self.rows = rows
        self.stats = ProviderStats()

    def announce(self, group: str, since_lamport: int | None = None) -> pa.Table:
        import pyarrow.compute as pc

        mask = pc.equal(self.rows.column("group"), group)
        if since_lamport is not None:
            mask = pc.and_(mask, pc.greater_equal(self.rows.column("lamport_ts"), since_lamport))
        keys = self.rows.filter(mask).select(list(KEY_COLUMNS))
        self.stats.announced += keys.num_rows
        return keys

    def request(self, group: str, message_ids: Sequence[str]) -> pa.Table:
        import pyarrow as pa
        import pyarrow.compute as pc

        self.stats.request_calls += 1
        self.stats.requested += len(message_ids)
        mask = pc.and_(pc.equal(self.rows.column("group"), group),
                       pc.is_in(self.rows.column("message_id"), value_set=pa.array(list(message_ids), pa.string())))
        out = self.rows.filter(mask)
        self.stats.served += out.num_rows
        return out

    def ignore(self, group: str, message_ids: Sequence[str]) -> None:
        self.stats.ignored += len(message_ids)


class DeltaProvider:
    """A Delta history table served as a provider: keys by a narrow scan, payloads by a join on ids."""

    def __init__(self, spark: SparkSession, table_path: str, name: str | None = None, *,
                 as_of: int | datetime | str | None = None) -> None:
        """``as_of``: serve the table as it was at this Delta version, or at this time (a datetime or
        an ISO 8601 string); one the table does not have is a ConfigurationError at first use."""
        from zerocomm_spark.pipelines.replay import LONG_MAX

        if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, (int, datetime, str))
                                  or (isinstance(as_of, int) and not 0 <= as_of <= LONG_MAX)):
            raise ConfigurationError(f"DeltaProvider's as_of is a Delta version (an int >= 0) or a time "
                                     f"(a datetime or an ISO 8601 string), not {as_of!r}")
        if isinstance(as_of, str):
            from zerocomm_spark.pipelines.replay import _aware

            _aware(as_of)  # a string that is no time is refused here, not at the provider's first use
        self.spark = spark
        self.table_path = str(table_path)
        self.name = name or self.table_path
        self.as_of = as_of
        self.stats = ProviderStats()
        self._checked = False  # the table is a history table (checked on first use)

    def _df(self) -> Any:
        if not self._checked:
            from zerocomm_spark.pipelines.history import require_history_table

            require_history_table(self.spark, self.table_path)
            self._checked = True
        from zerocomm_spark.pipelines.replay import _aware, _time_travel

        reader = self.spark.read.format("delta")
        if self.as_of is None:
            return reader.load(self.table_path)
        if isinstance(self.as_of, int):
            reader = reader.option("versionAsOf", str(self.as_of))
        else:
            reader = reader.option("timestampAsOf", _aware(self.as_of).isoformat())
        # A version or time the table lacks is the caller's set-up, not this provider failing to serve:
        # a ConfigurationError, which restore() raises instead of reporting the provider as failed.
        return _time_travel(reader, self.table_path, self.as_of)

    def announce(self, group: str, since_lamport: int | None = None) -> pa.Table:
        from pyspark.sql import functions as F

        df = self._df().where(F.col("group") == group)
        if since_lamport is not None:
            df = df.where(F.col("lamport_ts") >= since_lamport)
        keys = df.select(*KEY_COLUMNS).toArrow()
        self.stats.announced += keys.num_rows
        return keys

    def request(self, group: str, message_ids: Sequence[str]) -> pa.Table:
        import pyarrow as pa
        from pyspark.sql import functions as F

        self.stats.request_calls += 1
        self.stats.requested += len(message_ids)
        if not message_ids:
            return self._df().select(*HISTORY_COLUMNS).limit(0).toArrow()
        wanted = self.spark.createDataFrame(pa.table({"message_id": pa.array(list(message_ids), pa.string())}))
        rows = (self._df().where(F.col("group") == group).join(F.broadcast(wanted), "message_id", "left_semi")
                .select(*HISTORY_COLUMNS).toArrow())
        self.stats.served += rows.num_rows
        return rows

    def ignore(self, group: str, message_ids: Sequence[str]) -> None:
        self.stats.ignored += len(message_ids)


# --- the report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rejection:
    """A row a provider sent that was not delivered, and why."""

    provider: str
    message_id: str
    reason: str


NO_ORIGIN_PROOF = "no origin proof"  # a Rejection's reason for a row published unsigned


@dataclass
class RestoreReport:
    """What a restore did, per provider and overall."""

    group: str
    offered: dict[str, int] = field(default_factory=dict)
    requested: dict[str, int] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    skipped_have: int = 0
    delivered: int = 0
    refetched: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    delivered_ids: list[str] = field(default_factory=list, repr=False)
    seconds: float = 0.0

    @property
    def advice(self) -> str | None:
        """What to do about rows refused for lacking an origin proof, if any were: sending is unsigned
        by default and restore requires proofs by default, so a history of unsigned messages restores
        nothing, and a count of rejections alone reads like an attack."""
        unsigned = sum(1 for r in self.rejected if r.reason == NO_ORIGIN_PROOF)
        if not unsigned:
            return None
        return (f"{unsigned} row(s) had no origin proof: their messages were published unsigned (zerocomm send "
                "without --sign, Client.publish without sign=True, the sink without signOrigin=true), or a "
                "provider removed the proofs. Publish with origin proofs; if you know these were sent unsigned, "
                "restore with require_origin=False to take such rows on the providers' word")

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly digest (no ids beyond the first few rejections)."""
        return {"group": self.group, "offered": self.offered, "requested": self.requested, "ignored": self.ignored,
                "received": self.received, "skipped_have": self.skipped_have, "delivered": self.delivered,
                "refetched": self.refetched, "rejected": len(self.rejected), "missing": len(self.missing),
                "rejections": [r.__dict__ for r in self.rejected[:10]], "advice": self.advice,
                "seconds": round(self.seconds, 3)}


# --- the exchange ------------------------------------------------------------------------------

_UNKNOWN, _REQUESTED, _DONE, _FAILED = 0, 1, 2, 3


def _bounded(call: Callable[[], Any], timeout: float | None, what: str) -> Any:
    """``call()``, or ApiTimeoutError once ``timeout`` seconds passed (the call is left to finish on
    a daemon thread: a provider that never answers cannot hold the restore, nor the interpreter's exit)."""
    if timeout is None:
        return call()
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="zerocomm-restore-provider", daemon=True).start()
    if not done.wait(timeout):
        raise ApiTimeoutError(f"{what} took over {timeout}s",
                              hint="Raise restore(..., provider_timeout=...) if this provider is only slow")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _route(chunk: Sequence[str], good_ids: set[str], offers: Mapping[str, list[int]], tried: Mapping[str, set[int]],
           given_up: Mapping[int, str], retry: list[list[str]], state: dict[str, int], report: RestoreReport) -> None:
    """Each key of ``chunk`` not in ``good_ids`` to the next provider that announced it and was neither
    tried for it nor given up on; a key no such provider is left for is missing."""
    for mid in chunk:
        if mid in good_ids:
            continue
        nxt = next((j for j in offers.get(mid, []) if j not in tried[mid] and j not in given_up), None)
        if nxt is None:
            state[mid] = _FAILED
            report.missing.append(mid)
        else:
            retry[nxt].append(mid)


def _failure(exc: BaseException) -> str:
    """What went wrong, for the report and the log: the type, and an OSError's reason; never other
    exceptions' text, which can quote the value that failed (a payload, say)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    if isinstance(exc, (ApiTimeoutError, TimeoutError)):
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"  # our own text: a name and a number
    return type(exc).__name__


def _malformed(mid: Any, did: Any, seq: Any, lamport: Any) -> bool:
    """A key whose fields do not have their types, or a seq below 1 (a broken or hostile provider; such a
    seq would otherwise match every member's position and pass for a message the member has)."""
    return not (isinstance(mid, str) and isinstance(did, str) and type(seq) is int and seq >= 1
                and type(lamport) is int)


def _bad_row(group: str, row_group: Any, payload: Any, key_id: Any, headers: Any, sig: Any) -> str | None:
    """Why a row's fields cannot be checked (wrong types, another group), or None."""
    if row_group != group:
        return "row of another group"
    if not isinstance(payload, bytes) or not (key_id is None or isinstance(key_id, str)) \
            or not (sig is None or isinstance(sig, bytes)):
        return "malformed row (payload, key id or origin proof of the wrong type)"
    if headers is not None:
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        try:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs):
                return "malformed row (a header name or value is not a string)"
        except (TypeError, ValueError):
            return "malformed row (headers are not name/value pairs)"
    return None


def _conform(rows: pa.Table) -> tuple[pa.Table, str | None]:
    """The provider's rows with the history table's column types, or why they cannot have them.

    Providers type columns differently (Delta's toArrow, a hand-made table, all-null headers); what
    is delivered must have one schema, or merging it (and appending it to Delta) would fail for all."""
    import pyarrow as pa

    schema = history_arrow_schema()
    columns = []
    for f in schema:
        if f.name not in rows.column_names:
            return rows, f"malformed answer (no {f.name} column)"
        column = rows.column(f.name)
        if column.type != f.type:
            try:
                column = column.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                return rows, f"malformed answer ({f.name} is {column.type}, not {f.type})"
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema), None


def _ids_of(rows: pa.Table, n: int) -> list[Any]:
    return text_column(rows.column("message_id"))[0] if "message_id" in rows.column_names else [None] * n


def _times_ok(rows: pa.Table) -> list[bool]:
    """Per row: the NOT NULL times are there, and ``date`` is sent_at's UTC date (as ingest makes it).

    None of them is covered by the origin proof, and one null would make Delta refuse the whole append."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ok = pc.equal(rows.column("date"), pc.cast(rows.column("sent_at"), pa.date32()))  # sent_at is UTC here
    for name in ("received_at", "ingested_at"):
        ok = pc.and_kleene(ok, pc.is_valid(rows.column(name)))
    return pc.fill_null(ok, False).to_pylist()


def _check_rows(rows: pa.Table, provider: str, asked: Mapping[str, tuple[str, int, int]],
                key: HistoryKey | None, require_origin: bool,
                threads: int, group: str) -> tuple[pa.Table, list[Rejection]]:
    """Open, match against the announcement, verify origin; returns the good rows (clear payloads).

    A row whose fields have the wrong types (nulls included) is rejected like any other bad row:
    one broken row never aborts the restore."""
    import pyarrow as pa

    rejections: list[Rejection] = []
    n = rows.num_rows
    rows, malformed = _conform(rows)
    if malformed is not None:  # the whole answer: its keys go to the next provider that announced them
        return (history_arrow_schema().empty_table(),
                [Rejection(provider, mid if isinstance(mid, str) else None, malformed) for mid in _ids_of(rows, n)])
    times_ok = _times_ok(rows)
    # Text that is not UTF-8 (None here, and flagged) rejects its row, not the whole answer.
    texts = {name: text_column(rows.column(name)) for name in ("message_id", "publisher_did", "group",
                                                                "payload_key_id", "headers", "publisher_label",
                                                                "origin_scheme")}
    unreadable = [any(flags[i] for _, flags in texts.values()) for i in range(n)]
    ids = texts["message_id"][0]
    dids = texts["publisher_did"][0]
    seqs = rows.column("seq").to_pylist()
    lamports = rows.column("lamport_ts").to_pylist()
    groups = texts["group"][0]
    payloads = rows.column("payload").to_pylist()
    key_ids = texts["payload_key_id"][0]
    heads = texts["headers"][0]
    sigs = rows.column("origin_sig").to_pylist()
    ok = [True] * n
    seen: set[str] = set()
    clear: list[bytes] = [b""] * n
    for i in range(n):
        mid = ids[i]
        # First: an id that is not UTF-8 reads as None, which no request names; say what is wrong with it.
        if unreadable[i]:
            ok[i] = False
            if mid is not None:
                seen.add(mid)  # a second row of this id is still one sent twice
            rejections.append(Rejection(provider, mid, "malformed row (text that is not UTF-8)"))
            continue
        if mid not in asked or mid in seen:
            ok[i] = False
            rejections.append(Rejection(provider, mid, "not requested from this provider (or sent twice)"))
            continue
        seen.add(mid)
        if asked[mid] != (dids[i], seqs[i], lamports[i]):
            ok[i] = False
            rejections.append(Rejection(provider, mid, "differs from what the provider announced"))
            continue
        bad = _bad_row(group, groups[i], payloads[i], key_ids[i], heads[i], sigs[i])
        if bad is None and not times_ok[i]:
            bad = "malformed row (a time or the date is missing, or the date is not sent_at's UTC date)"
        if bad is not None:
            ok[i] = False
            rejections.append(Rejection(provider, mid, bad))
            continue
        if key_ids[i] is None:
            clear[i] = payloads[i]
        elif key is None or key_ids[i] != key.key_id:
            ok[i] = False
            rejections.append(Rejection(provider, mid, f"payload sealed with history key {key_ids[i]}, not given"))
        else:
            try:
                clear[i] = key.open(payloads[i], groups[i], dids[i], mid)
            except (TamperedEnvelopeError, TypeError, ValueError):
                ok[i] = False
                rejections.append(Rejection(provider, mid, "sealed payload does not open (altered or moved)"))
    if require_origin:
        live = [i for i in range(n) if ok[i]]
        verified = verify_rows(rows.take(pa.array(live, pa.int64())), payload=[clear[i] for i in live],
                               threads=threads)
        for i, good_origin in zip(live, verified):
            if not good_origin:
                ok[i] = False
                reason = NO_ORIGIN_PROOF if sigs[i] is None else "origin proof does not verify (forged or altered)"
                rejections.append(Rejection(provider, ids[i], reason))
    good = rows.filter(pa.array(ok, type=pa.bool_()))
    good = good.set_column(good.schema.get_field_index("payload"), pa.field("payload", pa.binary(), nullable=False),
                           pa.array([clear[i] for i in range(n) if ok[i]], type=pa.binary()))
    good = good.set_column(good.schema.get_field_index("payload_key_id"), pa.field("payload_key_id", pa.string()),
                           pa.nulls(good.num_rows, pa.string()))
    return good, rejections


def restore(group: str, providers: Sequence[HistoryProvider], *, have: Have | None = None,
            deliver: Callable[[pa.Table], None] | None = None, history_key: HistoryKey | None = None,
            since_lamport: int | None = None, require_origin: bool = True, verify_threads: int = 2,
            request_chunk: int = 50_000, provider_timeout: float | None = 600.0) -> RestoreReport:
    """Fill a member's gap in ``group`` from ``providers``; see the module doc for the exchange.

    ``have``: what the member already holds (have_from_client / have_from_journal /
    have_from_table). ``deliver`` receives the verified rows once, in causal order, with clear
    payloads, as one Arrow table (nothing is delivered before every row was verified).
    ``require_origin=False`` accepts rows without (or with a bad) origin proof: only for history
    from a trusted provider written before publishers signed. ``provider_timeout`` (seconds) bounds
    each announce, request and ignore call: a provider that has not answered by then is given up on like one
    that failed (its keys go to the next provider that announced them), and is asked nothing more: its
    other keys go there too, so a hung provider costs one deadline. The default, 10 minutes, is
    far beyond a Delta scan of a large table but still a deadline; None waits as long as it takes.
    """
    import pyarrow as pa

    if not providers:
        raise ConfigurationError("restore needs at least one history provider")
    for name, value in (("request_chunk", request_chunk), ("verify_threads", verify_threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"restore's {name} is an int >= 1, not {value!r}")
    if provider_timeout is not None and (isinstance(provider_timeout, bool)
                                         or not isinstance(provider_timeout, (int, float))
                                         or not provider_timeout > 0):
        raise ConfigurationError(f"restore's provider_timeout is a number of seconds > 0 (or None), "
                                 f"not {provider_timeout!r}")
    if since_lamport is not None:
        from zerocomm_spark.pipelines.replay import Since

        Since.lamport(since_lamport)  # an int from 0 to 2**63-1, or a ConfigurationError saying so
    names = [p.name for p in providers]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"history providers need distinct names, got {names}")
    began = time.monotonic()
    have = have if have is not None else Have()
    report = RestoreReport(group=group)
    state: dict[str, int] = {}
    announced: dict[tuple[int, str], tuple[str, int, int]] = {}  # (provider, id) -> its (publisher, seq, lamport)
    held_at: set[str] = set()  # ids some provider announced at a position the member holds
    offers: dict[str, list[int]] = {}  # id -> providers that announced it, in order
    plan: list[list[str]] = [[] for _ in providers]
    # Providers that did not answer a call in time: it may still be running on its thread, so they are
    # asked nothing more (another call would wait out the deadline again, and pile up calls).
    given_up: dict[int, str] = {}

    # 1-2. announce, then request or ignore, key by key, in announcement order.
    for index, provider in enumerate(providers):
        try:
            keys = _bounded(partial(provider.announce, group, since_lamport), provider_timeout,
                            f"{provider.name}'s announce")
            ids, _ = text_column(keys.column("message_id"))  # text that is not UTF-8: None, a malformed key
            dids, _ = text_column(keys.column("publisher_did"))
            seqs = keys.column("seq").to_pylist()
            lamports = keys.column("lamport_ts").to_pylist()
            if not len(ids) == len(dids) == len(seqs) == len(lamports):
                raise ValueError("key columns of different lengths")
        except ConfigurationError:
            raise  # the caller's set-up (a missing or foreign table), not a provider failing to serve
        except Exception as exc:  # one provider failing (or announcing garbage) never aborts the restore
            report.offered[provider.name] = 0
            report.ignored[provider.name] = 0
            report.rejected.append(Rejection(provider.name, None, f"announce failed ({_failure(exc)})"))
            continue
        report.offered[provider.name] = len(ids)
        ignore: list[str] = []
        for mid, did, seq, lamport in zip(ids, dids, seqs, lamports):
            if _malformed(mid, did, seq, lamport):
                report.rejected.append(Rejection(provider.name, mid, "malformed announcement"))
                continue
            if mid in have.message_ids:
                if mid not in state:
                    state[mid] = _DONE
                    report.skipped_have += 1
                ignore.append(mid)
                continue
            if (mid, did, seq) in have:
                # seq is not covered by the origin proof: a position match only says this provider's
                # copy is not needed; another provider may still announce it where the member lacks it.
                held_at.add(mid)
                ignore.append(mid)
                continue
            if (index, mid) in announced:
                continue  # announced twice by the same provider: the first counts
            announced[(index, mid)] = (did, seq, lamport)
            offers.setdefault(mid, []).append(index)
            if state.get(mid, _UNKNOWN) == _UNKNOWN:
                state[mid] = _REQUESTED
                plan[index].append(mid)
            else:
                ignore.append(mid)
        report.ignored[provider.name] = len(ignore)
        if ignore:
            try:
                _bounded(partial(provider.ignore, group, ignore), provider_timeout,
                         f"{provider.name}'s ignore of {len(ignore)} key(s)")
            except ConfigurationError:
                raise
            except Exception as exc:  # flow control only: nothing the restore does depends on it
                log.warning("history provider %s failed to take %d ignore(s): %s", provider.name, len(ignore),
                            _failure(exc))
                if isinstance(exc, ApiTimeoutError):  # still busy with it: asked nothing more (below)
                    given_up[index] = (f"not requested: the provider did not take its ignores within "
                                       f"{provider_timeout}s")
    for mid in held_at:
        if mid not in state:  # every provider announced it at a position the member holds
            state[mid] = _DONE
            report.skipped_have += 1

    # 3. payloads for what was requested; a failed key goes to the next provider that offered it.
    accepted: list[pa.Table] = []
    tried: dict[str, set[int]] = {}
    round_plan = plan
    first_round = True
    while any(round_plan):
        retry: list[list[str]] = [[] for _ in providers]
        for index, wanted in enumerate(round_plan):
            if not wanted:
                continue
            provider = providers[index]
            for lo in range(0, len(wanted), request_chunk):
                chunk = wanted[lo:lo + request_chunk]
                for mid in chunk:
                    tried.setdefault(mid, set()).add(index)
                if index in given_up:  # not asked: straight to the next provider that announced them
                    report.rejected.extend(Rejection(provider.name, mid, given_up[index]) for mid in chunk)
                    _route(chunk, set(), offers, tried, given_up, retry, state, report)
                    continue
                report.requested[provider.name] = report.requested.get(provider.name, 0) + len(chunk)
                if not first_round:
                    report.refetched += len(chunk)
                asked = {mid: announced[(index, mid)] for mid in chunk}
                try:
                    rows = _bounded(partial(provider.request, group, chunk), provider_timeout,
                                    f"{provider.name}'s answer to a request for {len(chunk)} key(s)")
                    if not isinstance(rows, pa.Table):
                        raise TypeError(f"answered {type(rows).__name__}, not an Arrow table")
                except ConfigurationError:
                    raise
                except Exception as exc:  # its keys go to the next provider that announced them
                    reason = f"provider failed ({_failure(exc)})"
                    if isinstance(exc, ApiTimeoutError):
                        given_up[index] = (f"not requested: the provider did not answer an earlier request within "
                                           f"{provider_timeout}s")
                    good, rejections = history_arrow_schema().empty_table(), [
                        Rejection(provider.name, mid, reason) for mid in chunk]
                else:
                    report.received[provider.name] = report.received.get(provider.name, 0) + rows.num_rows
                    good, rejections = _check_rows(rows, provider.name, asked, history_key, require_origin,
                                                   verify_threads, group)
                report.rejected.extend(rejections)
                good_ids = set(good.column("message_id").to_pylist())
                for mid in good_ids:
                    state[mid] = _DONE
                accepted.append(good)
                _route(chunk, good_ids, offers, tried, given_up, retry, state, report)
        round_plan = retry
        first_round = False

    # 4. deliver: every verified row once, in causal order, after everything was checked.
    if accepted:
        # providers may type a column differently (e.g. headers all null at one): unify, do not fail
        table = pa.concat_tables([t.select(list(HISTORY_COLUMNS)) for t in accepted if t.num_rows]
                                 or [accepted[0].select(list(HISTORY_COLUMNS))], promote_options="permissive")
    else:
        table = None
    if table is not None and table.num_rows:
        table = table.sort_by([("lamport_ts", "ascending"), ("publisher_did", "ascending"), ("seq", "ascending")])
        report.delivered = table.num_rows
        report.delivered_ids = table.column("message_id").to_pylist()
        if deliver is not None:
            deliver(table)
    report.seconds = time.monotonic() - began
    if report.rejected:
        log.warning("restore of %r rejected %d row(s) (first: %s from %s)", group, len(report.rejected),
                    report.rejected[0].reason, report.rejected[0].provider)
    return report


# --- where restored rows go --------------------------------------------------------------------


class DeltaSink:
    """Deliver restored rows into a (the member's own) history table, sealed again if a key is given.

    Each delivery is one append tagged (this sink, delivery number) of only the rows whose
    (group, date, message_id) the table lacks: a restore run again (or a delivery retried after a
    failure whose commit may have landed anyway) writes nothing twice, and a different delivery
    after a failure is not lost. A commit into the same partitions meanwhile (the member's ingest
    running, compact) is not a failure: the sink reads the table again and appends what it still
    lacks (up to 8 times). Without ``history_key``, rows in clear are refused if the table
    already holds sealed rows of their groups (pass the group's key to keep the table sealed).
    """

    def __init__(self, spark: SparkSession, table_path: str, *, history_key: HistoryKey | None = None) -> None:
        self.spark = spark
        self.table_path = str(table_path)
        self.history_key = history_key
        self.app_id = "zerocomm-restore-" + uuid.uuid4().hex
        self._version = 0

    def __call__(self, rows: pa.Table) -> None:
        import pyarrow as pa

        from zerocomm_spark.pipelines.commit_tags import commit_tag
        from zerocomm_spark.pipelines.history import append_new_rows_retrying, ensure_table, sealed_groups
        from zerocomm_spark.pipelines.schema import history_schema

        ensure_table(self.spark, self.table_path)
        if self.history_key is None and rows.column("payload_key_id").null_count:
            groups = sorted(set(rows.column("group").to_pylist()))
            if sealed_groups(self.spark, self.table_path, groups):
                raise ConfigurationError(
                    f"the history table at {self.table_path} holds sealed rows of {', '.join(map(repr, groups))}: "
                    "refusing to write restored payloads there in clear",
                    hint="Pass the group's key: DeltaSink(spark, table, history_key=key)")
        if self.history_key is not None:
            sealed = self.history_key.seal_column(rows.column("group").to_pylist(),
                                                  rows.column("publisher_did").to_pylist(),
                                                  rows.column("message_id").to_pylist(),
                                                  rows.column("payload").to_pylist())
            rows = rows.set_column(rows.schema.get_field_index("payload"), rows.schema.field("payload"), sealed)
            rows = rows.set_column(rows.schema.get_field_index("payload_key_id"),
                                   rows.schema.field("payload_key_id"),
                                   pa.array([self.history_key.key_id] * rows.num_rows, pa.string()))
        df = self.spark.createDataFrame(rows.select(list(HISTORY_COLUMNS)), schema=history_schema())
        # The append reads the partitions it writes to (only rows the table lacks): a commit into one of
        # them meanwhile (the member's ingest, compact) makes Delta refuse it; it then reads again.
        append_new_rows_retrying(df, self.table_path, {"userMetadata": commit_tag(self.app_id, self._version)})
        self._version += 1
