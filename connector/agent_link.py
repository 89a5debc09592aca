"""The connector's only door to ZeroComm: the member agent on this host, through its client.

Why one small module: the source and the sink ask the member a handful of questions (which
publishers, up to which seq, give me seqs a..b, publish and wait for the group's acks, prune below
here). Keeping them here keeps the Spark classes free of wire details, and means the connector
never talks to another member's sockets: every process (driver or executor) uses the member on its
own host, found by the same rules as the ``zerocomm`` command (``agent`` option, else
$ZEROCOMM_CONFIG / ~/.zerocomm), started on demand.

Instances hold a ZeroMQ socket, so they are made inside the process that uses them (the driver's
planner, or a Python worker on an executor) and never pickled: partitions carry
:class:`~zerocomm_spark.connector.options.AgentOptions`, which is plain data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from zerocomm_spark.errors import (
    AgentNotRunningError,
    ApiError,
    ApiTimeoutError,
    BackpressureError,
    BadRowError,
    ClientClosedError,
    GroupNotFoundError,
    IdentityNotFoundError,
    OffsetOutOfRangeError,
    PeerTimeoutError,
    PublishNotAcknowledgedError,
    ZeroCommError,
)

from zerocomm_spark.connector.offsets import PublisherKey, SeqRange, ZeroCommOffset
from zerocomm_spark.connector.options import AgentOptions

__all__ = ["MemberLink"]

log = logging.getLogger("zerocomm_spark.connector")

# Rows per read call; the agent caps a read at api.max_read_rows (100 000 by default) anyway.
READ_PAGE = 50_000
# Read a publisher's range by journal offset when at least this share of the window is its rows.
DENSE_RATIO = 0.25
DENSE_MIN_ROWS = 64


class MemberLink:
    """A connected client of this host's member, with the questions the connector asks it."""

    def __init__(self, client: Any, agent: AgentOptions) -> None:
        self._client = client
        self.agent = agent

    @classmethod
    def connect(cls, agent: AgentOptions) -> "MemberLink":
        """Connect (starting the agent when asked to); errors say which agent and how to fix it."""
        return cls(cls._connect_client(agent), agent)

    @staticmethod
    def _connect_client(agent: AgentOptions) -> Any:
        from zerocomm_spark.client import Client

        try:
            return Client.connect(agent.where, spawn=agent.spawn, timeout=agent.timeout_s,
                                  call_timeout=agent.timeout_s)
        except IdentityNotFoundError as exc:  # spawnAgent on a host not set up: say which host
            raise IdentityNotFoundError(f"format(\"zerocomm\") on host {os.uname().nodename}: {exc.message}",
                                        hint=exc.hint) from None
        except AgentNotRunningError as exc:
            where = agent.where or "the configured location ($ZEROCOMM_CONFIG, ~/.zerocomm)"
            raise AgentNotRunningError(
                f"format(\"zerocomm\") found no member agent at {where} on host {os.uname().nodename}: "
                f"{str(exc).split('. ')[0]}",
                hint="Start it (`zerocomm agent start --detach`), set spawnAgent=true, or point the agent option "
                     "at its socket directory or zerocomm.toml") from None

    def _call(self, name: str, *args: Any, retry_timeouts: bool = True, **kwargs: Any) -> Any:
        """One client call; if the agent went away (crashed, restarted), reconnect once and retry.

        Every call the connector makes is idempotent (reads, positions, commit points, and publishes
        by message id), so one retry after a reconnect cannot duplicate anything. Reconnecting
        starts the agent again when spawnAgent is on, which is what lets a query ride over an agent
        restart.
        """
        retryable: tuple[type[BaseException], ...] = (AgentNotRunningError, ClientClosedError)
        if retry_timeouts:
            retryable += (ApiTimeoutError,)
        try:
            return getattr(self._client, name)(*args, **kwargs)
        except retryable as exc:
            log.warning("zerocomm connector: the agent did not answer %s (%s); reconnecting", name, describe(exc))
            self.close()
            self._client = self._connect_client(self.agent)
            return getattr(self._client, name)(*args, **kwargs)

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing must not mask the real error
            pass

    def __enter__(self) -> "MemberLink":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> None:
        raise TypeError("a MemberLink holds a ZeroMQ socket and is never pickled; ship AgentOptions instead")

    # --- identity and groups --------------------------------------------------------------------

    @property
    def label(self) -> str | None:
        agent = getattr(self._client, "agent", None) or {}
        value = agent.get("label")
        return value if isinstance(value, str) else None

    @property
    def max_request_bytes(self) -> int:
        """The largest request the agent takes (its api.max_request_bytes, as it said at connect)."""
        from zerocomm_spark.client import DEFAULT_MAX_REQUEST_BYTES

        limit = getattr(self._client, "max_request_bytes", None)
        return limit if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_REQUEST_BYTES

    @property
    def max_message_bytes(self) -> int | None:
        """The largest payload the agent publishes as one message (as it said at connect; None: not said)."""
        value = (getattr(self._client, "agent", None) or {}).get("max_message_bytes")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def check_groups(self, groups: Iterable[str], *, running: bool = False) -> None:
        """Fail early and clearly when this member is not in a group the query names; ``running``: a query
        that read the group(s) until now (the member left, or was removed, since)."""
        mine = self.group_names()
        missing = [g for g in groups if g not in mine]
        if missing and running:
            raise GroupNotFoundError(
                f"the member {self.label or ''} on host {os.uname().nodename} is no longer in group(s) "
                f"{', '.join(repr(g) for g in missing)} (its groups: {', '.join(sorted(mine)) or 'none'}): it left "
                "or was removed while the query read them, so their new messages can never reach it",
                hint="Join the group again on this member (`zerocomm group join GROUP --via PEER`) and restart the "
                     "query from its checkpoint, or drop the group from the group option (its positions stay in "
                     "the checkpoint)")
        if missing:
            listed = ", ".join(sorted(mine)) or "none"
            raise GroupNotFoundError(
                f"the member {self.label or ''} on host {os.uname().nodename} is not in group(s) "
                f"{', '.join(repr(g) for g in missing)} (its groups: {listed})",
                hint="Check the group option's spelling, or create/join the group on this member first "
                     "(`zerocomm group join GROUP --via PEER`)")

    def group_names(self) -> set[str]:
        names: set[str] = set()
        for entry in self._call("groups"):
            name = entry.get("group", entry.get("name")) if isinstance(entry, Mapping) else entry
            if isinstance(name, str):
                names.add(name)
        return names

    def labels(self, groups: Iterable[str]) -> dict[PublisherKey, str]:
        """Publisher DID -> label as this member's view of each group knows them."""
        out: dict[PublisherKey, str] = {}
        for group in groups:
            for member in self._call("members", group):
                if not isinstance(member, Mapping):
                    continue
                did, label = member.get("did"), member.get("label")
                if isinstance(did, str) and isinstance(label, str) and label:
                    out[(group, did)] = label
        return out

    # --- positions --------------------------------------------------------------------------------

    def last_seqs(self, groups: Iterable[str]) -> dict[PublisherKey, int]:
        """Per (group, publisher): the last seq this member has journaled."""
        wanted = set(groups)
        out: dict[PublisherKey, int] = {}
        for group in sorted(wanted):
            result = self._call("latest", group)
            for key, seq in _publisher_seqs(result, group).items():
                if key[0] in wanted:
                    out[key] = seq
        return out

    def first_row(self, group: str, publisher: str, at_least: int, last: int) -> pa.Table | None:
        """The publisher's first retained row with ``at_least <= seq <= last`` (None: there is none).

        Reads windows of growing size: the agent decrypts every record a seq range covers, so
        asking for ``[at_least, last]`` at once would cost the whole retained range for one row.
        """
        at, width = at_least, 1
        while at <= last:
            top = min(last, at + width - 1)
            table = self._call("read", group=group, publisher=publisher, first_seq=at, last_seq=top, max_rows=1)
            if table.num_rows:
                return table
            at, width = top + 1, width * 8
        return None

    def superseded(self, group: str, publisher: str, first: int, last: int) -> list[tuple[int, int]]:
        """The publisher's seqs in ``first..last`` that have no row by design (their ids came first
        from another publisher: a retried sink task on another host), as inclusive ranges."""
        ranges: list[tuple[int, int]] = self._call("superseded", group, publisher, first, last)
        return ranges

    def first_seq(self, group: str, publisher: str, at_least: int, last: int) -> int | None:
        """The first seq >= ``at_least`` this member still holds for the publisher (None: nothing)."""
        row = self.first_row(group, publisher, at_least, last)
        return None if row is None else int(row.column("seq")[0].as_py())

    def ranges(self, groups: Iterable[str], known_first: Mapping[PublisherKey, int] | None = None
               ) -> dict[PublisherKey, SeqRange]:
        """Per publisher: first retained and last journaled seq. ``known_first`` skips lookups for
        publishers whose start the caller already has (only new publishers cost a read)."""
        out: dict[PublisherKey, SeqRange] = {}
        for key, last in self.last_seqs(groups).items():
            if known_first is not None and key in known_first:
                out[key] = SeqRange(known_first[key], last)
                continue
            first = self.first_seq(key[0], key[1], 1, last)
            out[key] = SeqRange(first if first is not None else last + 1, last)
        return out

    def first_sent_at_or_after(self, key: PublisherKey, timestamp_ms: int, span: SeqRange) -> int:
        """The first seq the publisher sent at or after ``timestamp_ms`` (binary search over seqs).

        Assumes a publisher's ``sent_at`` grows with its seq (one clock per publisher); the journal
        API has no timestamp index per publisher, so this costs O(log n) one-row reads.
        """
        target = timestamp_ms * 1000
        lo, hi = span.first, span.last + 1  # answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            table = self.first_row(key[0], key[1], mid, span.last)
            if table is None:
                hi = mid
                continue
            seq = int(table.column("seq")[0].as_py())
            sent = table.column("sent_at").cast(pa.int64())[0].as_py()
            if sent >= target:
                hi = mid
            else:
                lo = seq + 1
        # lo may be a seq the member lacks (a gap between the last row before the time and the first at
        # or after it): start at the row that is there, as Kafka's offsetsForTimes names an existing
        # record, instead of reporting the gap, whose send times nobody knows, as lost.
        if lo <= span.last:
            table = self.first_row(key[0], key[1], lo, span.last)
            if table is not None:
                return int(table.column("seq")[0].as_py())
        return lo

    # --- reading ----------------------------------------------------------------------------------

    def read_seqs(self, group: str, publisher: str, first: int, last: int) -> Iterator[pa.Table]:
        """Journal rows of one publisher with ``first <= seq <= last``, page by page, in seq order.

        Stops at the first page that comes back empty: the caller decides whether the rest is late
        or gone. When the publisher's rows are dense in this member's journal, they are read by
        journal offset (a sequential scan, several times cheaper per row in the agent than its seq
        index) and only checked, contiguous, rows are taken from it; otherwise by seq.
        """
        at = first
        dense = self._read_dense(group, publisher, first, last)
        if dense is not None:
            if dense.num_rows:
                yield dense
                at = int(dense.column("seq")[-1].as_py()) + 1
        while at <= last:
            top = min(last, at + READ_PAGE - 1)
            table = self._call("read", group=group, publisher=publisher, first_seq=at, last_seq=top,
                               max_rows=READ_PAGE)
            if table.num_rows == 0:
                return
            yield table
            highest = int(pc.max(table.column("seq")).as_py())
            if highest < top and table.num_rows < READ_PAGE:
                # the page ended early: later seqs of it are missing (gone or not yet here)
                return
            at = highest + 1

    def _read_dense(self, group: str, publisher: str, first: int, last: int) -> pa.Table | None:
        """Rows ``first..`` of the publisher read by journal offset, when that is worth it and safe.

        None means "use the seq index". The offset window runs from the row of the first seq held
        to the row of the last seq held (<= ``last``); a publisher's rows sit in the journal in seq
        order, and the result is used only if its seqs are contiguous from the first one, so a
        surprise in the journal's layout costs a fallback, never a wrong answer.
        """
        if last - first + 1 < DENSE_MIN_ROWS:
            return None
        head = self.first_row(group, publisher, first, min(last, first + 7))
        if head is None:
            return None
        position = next((e for e in _publisher_entries(self._call("latest", group))
                         if e[0] == group and e[1] == publisher), None)
        if position is None or position[3] is None:
            return None
        if position[2] <= last:
            tail_seq, tail_offset = position[2], position[3]
        else:
            tail = self._call("read", group=group, publisher=publisher, first_seq=last, last_seq=last, max_rows=1)
            if tail.num_rows == 0:
                return None
            tail_seq, tail_offset = last, int(tail.column("offset")[0].as_py())
        head_seq, head_offset = int(head.column("seq")[0].as_py()), int(head.column("offset")[0].as_py())
        wanted = tail_seq - head_seq + 1
        span = tail_offset - head_offset + 1
        if wanted < DENSE_MIN_ROWS or span <= 0 or wanted / span < DENSE_RATIO:
            return None
        pieces: list[pa.Table] = []
        at = head_offset
        while at <= tail_offset:
            try:
                result, table = self._call("call_bulk", "read", group=group, start=at, end=tail_offset + 1,
                                           max_rows=READ_PAGE)
            except OffsetOutOfRangeError:
                # Retention deleted records of the window since it was planned (DataLossError): the seq
                # index reads what is left, and the partition reader reports the rest as failOnDataLoss
                # says - this bare error failed the read even with failOnDataLoss=false.
                return None
            if table is not None and table.num_rows:
                mask = pc.and_(pc.equal(table.column("publisher_did"), publisher),
                               pc.and_(pc.greater_equal(table.column("seq"), head_seq),
                                       pc.less_equal(table.column("seq"), tail_seq)))
                pieces.append(table.filter(mask))
            following = result.get("next_offset") if isinstance(result, Mapping) else None
            if not isinstance(following, int) or following <= at:
                return None
            at = following
        rows = pa.concat_tables(pieces) if pieces else None
        if rows is None or rows.num_rows != wanted:
            return None
        rows = rows.sort_by("seq")
        seqs = rows.column("seq")
        if int(seqs[0].as_py()) != head_seq or int(seqs[-1].as_py()) != tail_seq:
            return None
        return rows

    # --- commit point -----------------------------------------------------------------------------

    def commit(self, end: ZeroCommOffset, groups: Sequence[str], *, register: bool = False) -> int | None:
        """Tell the member that everything the query checkpointed may be pruned; never more.

        The point is this query's (``end.consumer``; the journal prunes below the lowest of all its
        consumers' points) and covers all of the journal's groups, so it is the lowest of: each
        subscribed publisher's first row not yet checkpointed, and, for every other group, its first row at or after the current commit point (this query never declares
        another group's messages consumed). Returns the commit point now asked for, or None.

        ``register`` (at a query's start, ``end`` its start offsets) commits the point even when it is
        0 if the journal does not know the consumer yet: until its first commit a query held nothing
        back, and retention could delete rows it was about to read. A point that would not move is
        committed again all the same (the journal forgets a consumer that stops committing).
        """
        result = self._call("latest", None)
        next_offset = _int_field(result, ("next_offset",))
        committed = _int_field(result, ("committed_offset", "committed")) or 0
        unknown = False
        if end.consumer is not None:  # where this query stands, not the slowest one
            own = (result.get("consumers") or {}).get(end.consumer) if isinstance(result, Mapping) else None
            unknown = not isinstance(own, int) or isinstance(own, bool)
            committed = 0 if unknown else own
        if next_offset is None:
            return None
        point = next_offset
        subscribed = set(groups)
        for entry in _publisher_entries(result):
            group, did, last, last_offset = entry
            if last_offset is not None and last_offset < committed:
                continue  # all of it is below the commit point already
            if group in subscribed:
                position = end.get((group, did), 1)  # a publisher the query has not started on: keep all
                if position > last:
                    continue
                row = self.first_row(group, did, position, last)
            else:
                row = self._first_row_at_or_after(group, did, last, committed)
            if row is not None:
                point = min(point, int(row.column("offset")[0].as_py()))
        if point <= committed and not (register and unknown):
            if end.consumer is not None and not unknown:  # moves nothing, but says the query is alive, so
                self._call("commit", committed, consumer=end.consumer)  # the journal does not expire it
            return None
        if end.consumer is not None:  # this query's own point: a slower query on the member keeps its rows
            self._call("commit", point, consumer=end.consumer)
        else:  # an offset checkpointed before queries were named
            self._call("commit", point)
        return point

    def _first_row_at_or_after(self, group: str, did: str, last: int, offset: int) -> pa.Table | None:
        """The publisher's first row whose journal offset is >= ``offset`` (binary search over seqs)."""
        lo, hi, found = 1, last, None
        while lo <= hi:
            mid = (lo + hi) // 2
            row = self.first_row(group, did, mid, hi)
            if row is None:
                hi = mid - 1
                continue
            if int(row.column("offset")[0].as_py()) >= offset:
                found, hi = row, mid - 1
            else:
                lo = int(row.column("seq")[0].as_py()) + 1
        return found

    # --- publishing -------------------------------------------------------------------------------

    def publish(self, group: str, table: pa.Table, timeout: float, *, sign: bool = False) -> Any:
        """Publish one batch; returns once the group acknowledged it, else PublishNotAcknowledgedError, or
        BadRowError as the agent raised it when it refuses a row's data (a retry fails the same way).
        ``sign``: the agent adds each row's origin proof (signOrigin)."""
        try:
            return self._call("publish", group, table, timeout=timeout, retry_timeouts=False, sign=sign)
        except (ApiTimeoutError, BackpressureError, PeerTimeoutError, TimeoutError) as exc:
            raise PublishNotAcknowledgedError(
                f"the group {group!r} did not acknowledge {table.num_rows} message(s) within {timeout:g}s "
                f"({type(exc).__name__}: {str(exc).split('. ')[0]})") from None
        except (GroupNotFoundError, BadRowError):
            raise  # BadRowError: the rows' data, which no rerun gets past (the sink names the rows)
        except ApiError as exc:
            raise PublishNotAcknowledgedError(
                f"publishing {table.num_rows} message(s) to group {group!r} failed: {exc}") from None

    def metrics(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("metrics")
        return result


def _int_field(result: Any, names: Sequence[str]) -> int | None:
    if not isinstance(result, Mapping):
        return None
    for name in names:
        value = result.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _publisher_entries(result: Any) -> list[tuple[str, str, int, int | None]]:
    """(group, publisher DID, last seq, last journal offset) from the agent's ``latest`` answer."""
    out: list[tuple[str, str, int, int | None]] = []
    publishers = result.get("publishers") if isinstance(result, Mapping) else None
    for entry in publishers if isinstance(publishers, list) else []:
        if not isinstance(entry, Mapping):
            continue
        group, did = entry.get("group"), entry.get("publisher_did")
        seq, offset = entry.get("last_seq"), entry.get("last_offset")
        if isinstance(group, str) and isinstance(did, str) and isinstance(seq, int):
            out.append((group, did, seq, offset if isinstance(offset, int) else None))
    return out


def _publisher_seqs(result: Any, group: str | None) -> dict[PublisherKey, int]:
    """(group, publisher) -> last journaled seq, optionally for one group only."""
    return {(g, did): seq for g, did, seq, _ in _publisher_entries(result) if group is None or g == group}


def describe(exc: BaseException) -> str:
    """A one-line reason for logs and errors (never a payload)."""
    if isinstance(exc, ZeroCommError):
        return f"{type(exc).__name__}: {str(exc).split('. ')[0]}"
    return f"{type(exc).__name__}: {exc}"
