"""The calls of the local API, each checked for argument types before it runs (see server.py).

Why a thin layer: every call maps to one method of the member, its group manager or its journal;
what lives here is what the API adds: Arrow in and out, idempotent publishes by message id,
deadlines taken from the request, long polls for `tail`, and results as plain JSON.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from zerocomm_spark.agent.fdlimit import fd_usage
from zerocomm_spark.agent.server import CallRegistry, Param, Request, non_empty, non_negative, positive
from zerocomm_spark.client import PROTOCOL_VERSION, ipc_to_table, table_to_ipc
from zerocomm_spark.errors import (
    BadRequestError,
    BadRowError,
    DataLossError,
    GroupError,
    JournalClosedError,
    OffsetOutOfRangeError,
    PeerTimeoutError,
    ZeroCommError,
)
from zerocomm_spark.group.datamessage import MAX_ID_LENGTH
from zerocomm_spark.group.headers import header_problem, most_headers, repeated_key
from zerocomm_spark.group.origin import ORIGIN_HEADER
from zerocomm_spark.ipc_limits import DECODED_BYTES_FACTOR
from zerocomm_spark.journal import JOURNAL_SCHEMA
from zerocomm_spark.journal.schema import rows_within_bytes

if TYPE_CHECKING:
    from zerocomm_spark.agent.process import AgentProcess

__all__ = ["build_registry", "AgentCalls"]

log = logging.getLogger(__name__)

_PUBLISHED_MEMORY = 100_000  # message ids remembered for idempotent re-publishes
_MAX_ID = MAX_ID_LENGTH  # the data plane's (and the Spark sink checks it up front)
_SCAN_GATHER_ROWS = 4096  # records filtered together when scanning for one group's rows
_TAIL_CHUNK_MAX = 65_536  # rows read at once at most when scanning back for the last rows
_ANSWER_MARGIN_S = 0.25  # a wait that may run to the deadline stops this much short, so the answer arrives in time
_AT_LEAST_S = 0.001  # a call whose deadline passed still gets a timeout error from what it called, not a refused timeout
_PAYLOAD_TYPES = (pa.binary(), pa.large_binary(), pa.string(), pa.large_string())
_HEADERS_TYPE = pa.map_(pa.string(), pa.string())


def _empty() -> pa.Table:
    # Not JOURNAL_SCHEMA.empty_table(): that imports pandas (most of a second) on first use.
    return pa.Table.from_batches([], schema=JOURNAL_SCHEMA)


def _compact(table: pa.Table) -> pa.Table:
    """One chunk per column: a journal read has a chunk per record, and filtering or shipping
    thousands of tiny chunks costs far more than copying them together once."""
    return table.combine_chunks() if table.num_columns and table.column(0).num_chunks > 1 else table


def _plain(value: Any) -> Any:
    """JSON-ready copies of dataclasses, mappings and sequences (results of the core's calls)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.name not in ("payload",)}
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return _plain(value.to_dict())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _role(value: Any) -> str | None:
    return None if value in ("read_write", "read_only") else "must be read_write or read_only"


def _mode(value: Any) -> str | None:
    return None if value in ("single", "multi", "shared") else "must be single, multi or shared"


class _Sent:
    """A message this agent published in this run, by (group, message id): a re-publish of the id
    is answered from it (not sent again).

    ``proof`` is whether the copy the group keeps carries this agent's origin proof: the copy sent
    now if the journal kept it (``sign``), else an earlier one (the id published before this agent
    started, or by another member: the id rule dropped this copy, here as everywhere), whose proof
    this agent does not know (None). Until this member's journal took its own row (``journaled``
    set), which of the two it is is not known either: ``settled`` False.
    """

    __slots__ = ("seq", "receipt", "sign", "journaled", "proof", "settled", "dropped")

    def __init__(self, seq: int, receipt: Any, sign: bool, journaled: threading.Event | None) -> None:
        self.seq = seq
        self.receipt = receipt
        self.sign = sign
        self.journaled = journaled
        self.proof: bool | None = sign if journaled is None else None  # no journal: nothing to find out
        self.settled = journaled is None
        self.dropped = False


class AgentCalls:
    """The handlers; each takes the Request first, then its validated arguments."""

    def __init__(self, process: "AgentProcess") -> None:
        self.process = process
        # Memory only (the newest _PUBLISHED_MEMORY): after a restart the journal tells what was
        # published before (its id rule drops the copy sent again; see _settle).
        self._published: OrderedDict[tuple[str, str], _Sent] = OrderedDict()
        self._published_lock = threading.Lock()
        self._group_locks: dict[str, threading.Lock] = {}

    def _group_lock(self, group: str) -> threading.Lock:
        with self._published_lock:
            return self._group_locks.setdefault(group, threading.Lock())

    # --- helpers --------------------------------------------------------------------------------

    @property
    def member(self) -> Any:
        assert self.process.member is not None
        return self.process.member

    @property
    def journal(self) -> Any:
        assert self.process.journal is not None
        return self.process.journal

    @property
    def groups(self) -> Any:
        if self.process.groups is None:
            raise GroupError("this agent runs without group support", hint="Upgrade zerocomm-spark")
        return self.process.groups

    # --- agent ----------------------------------------------------------------------------------

    def status(self, req: Request) -> dict[str, Any]:
        out = self.process.health("stopping" if self.process.stopping else "running")
        out.update(protocol=PROTOCOL_VERSION, max_request_bytes=self.process.config.get("api", "max_request_bytes"),
                   max_read_rows=self.process.config.get("api", "max_read_rows"),
                   uptime_s=round(time.time() - self.process.started_at, 3), fds=fd_usage())
        if self.process.groups is not None:
            try:  # the largest payload a publish takes: a client can refuse a bigger row itself, naming it
                out["max_message_bytes"] = self.process.groups.dataplane.max_payload_bytes
            except ZeroCommError:
                pass
        if self.process.journal is not None:
            out["journal"] = {"next_offset": self.journal.next_offset,
                              "earliest_offset": self.journal.earliest_offset(),
                              "committed_offset": self.journal.committed_offset}
        return out

    def metrics(self, req: Request) -> dict[str, Any]:
        out = self.process.metrics.snapshot()
        out["basic_messages_in"] = len(self.member.messages())
        if self.process.groups is not None:
            try:
                stats = self.process.groups.stats()
            except ZeroCommError:
                stats = {}
            for name in ("messages_out", "bytes_out"):
                if name in stats:
                    out[name] = stats[name]
            out["lag"] = stats.get("lag", {})
            out["peers_alive"] = stats.get("peers_alive", {})
            out["unacked"] = stats.get("unacked", {})
            out["group"] = {k: v for k, v in stats.items() if k not in ("lag", "peers_alive", "unacked")}
        else:
            out.setdefault("lag", {})
            out.setdefault("peers_alive", {})
        out["journal"] = {"next_offset": self.journal.next_offset, "earliest_offset": self.journal.earliest_offset(),
                          "committed_offset": self.journal.committed_offset}
        out["transport"] = self.member.transport_stats()
        return out

    # --- connections ----------------------------------------------------------------------------

    def invite(self, req: Request, label: str | None, multi_use: bool, group: str | None) -> dict[str, Any]:
        if group is not None:
            url = self.groups.invite(group, multi_use=multi_use)
        else:
            url = self.member.invite(label, multi_use=multi_use)
        return {"url": url}

    def accept(self, req: Request, url: str) -> dict[str, Any]:
        connection = self.member.accept(url, timeout=max(req.remaining(), _AT_LEAST_S))
        return _plain(connection)

    def connections(self, req: Request, include_incomplete: bool) -> list[dict[str, Any]]:
        return _plain(self.member.connections(include_incomplete=include_incomplete))

    def send(self, req: Request, peer: str, message: str) -> dict[str, Any]:
        message_id = self.member.send(peer, message, timeout=max(req.remaining(), _AT_LEAST_S))
        self.process.metrics.add(basic_messages_out=1)
        return {"message_id": message_id}

    def messages(self, req: Request, peer: str | None) -> list[dict[str, Any]]:
        return _plain(self.member.messages(peer))

    def ping(self, req: Request, peer: str) -> dict[str, Any]:
        return {"rtt_s": self.member.ping(peer, timeout=max(req.remaining(), _AT_LEAST_S))}

    # --- groups ---------------------------------------------------------------------------------

    def groups_list(self, req: Request) -> list[dict[str, Any]]:
        out = []
        for name in self.groups.groups():
            try:
                info = self.groups.info(name)
            except ZeroCommError:
                continue  # left while we listed
            out.append({"group": info.group, "mode": info.mode, "ordered": info.ordered, "role": info.role,
                        "status": info.status, "member_count": len(info.members)})
        return out

    def create(self, req: Request, group: str, mode: str | None, ordered: bool | None,
               consistent_join: bool | None, role: str | None) -> dict[str, Any]:
        options = {k: v for k, v in (("mode", mode), ("ordered", ordered), ("consistent_join", consistent_join),
                                     ("role", role)) if v is not None}
        return _plain(self.groups.create(group, **options))

    def join(self, req: Request, group: str, via: str, role: str | None) -> dict[str, Any]:
        req.progress(phase="joining through " + via)
        info = self.groups.join(group, via, role=role or "read_write", timeout=max(req.remaining(), 0.1))
        req.progress(phase="joined", final=True)
        return _plain(info)

    def leave(self, req: Request, group: str) -> dict[str, Any]:
        self.groups.leave(group, timeout=max(min(req.remaining(), 10.0), 0.1))
        return {"group": group, "left": True}

    def info(self, req: Request, group: str) -> dict[str, Any]:
        return _plain(self.groups.info(group))

    def members(self, req: Request, group: str, include_left: bool = False) -> list[dict[str, Any]]:
        """``include_left``: members that left too (status "left"), so a reader of the history still
        has a label for what they published."""
        return _plain(self.groups.members(group, include_left=include_left))

    def switch_role(self, req: Request, group: str, role: str) -> dict[str, Any]:
        info = self.groups.switch_role(group, role, timeout=max(min(req.remaining(), 10.0), 0.1))
        return _plain(info if info is not None else self.groups.info(group))

    def publish(self, req: Request, group: str, sign: bool = False) -> dict[str, Any]:
        """A batch in, message ids and seqs out once every member acknowledged it.

        ``sign``: add an origin proof (group/origin.py, header zc-origin) to every row, signed with
        this member's member key, whose did:key is the publisher DID the group sees."""
        assert req.bulk is not None
        # A compressed frame may expand on reading: bound what it may take, as the request itself is.
        decoded_limit = DECODED_BYTES_FACTOR * self.process.config.get("api", "max_request_bytes")
        table = ipc_to_table(req.bulk, max_bytes=decoded_limit)
        payloads, ids, headers = _publish_rows(table)
        groups = self.groups
        if sign:  # every row, known ids too: a re-published id is signed alike (Ed25519 is deterministic)
            headers = _signed(groups.origin_signer(), group, payloads, ids, headers)
        seqs: list[int | None] = [None] * len(ids)
        known: list[_Sent] = []  # rows whose id this agent published before in this run: not sent again
        sent: list[_Sent] = []  # rows sent now
        waits: list[Any] = []
        limit = self.process.config.get("groups", "publish_timeout")
        ingest = self.process.ingest
        # One publish of a group at a time from the id check to the ids' recording: two calls with the
        # same new ids at once must not both find them new (each would send them under its own seqs).
        with self._group_lock(group):
            fresh: list[int] = []
            with self._published_lock:
                for i, mid in enumerate(ids):
                    entry = self._published.get((group, mid))
                    # A receipt that failed (the group closed under it) had its messages never acked:
                    # a retry with the same ids, as its error advises, publishes them anew.
                    if entry is None or entry.receipt.failed():
                        fresh.append(i)
                    else:
                        seqs[i] = entry.seq
                        waits.append(entry.receipt)
                        known.append(entry)
            if fresh:
                # One data-plane publish for the whole batch: headers go per message (a signed row has
                # its own), a mapping when every row has the same (None the most common).
                first = headers[fresh[0]]
                run_headers: Any = first if all(headers[i] == first for i in fresh) else [headers[i] for i in fresh]
                run_payloads, run_ids = [payloads[i] for i in fresh], [ids[i] for i in fresh]
                try:
                    receipt = groups.publish(group, run_payloads, message_ids=run_ids, headers=run_headers,
                                             timeout=min(req.remaining(), limit))
                except GroupError as exc:
                    if type(exc) is not GroupError:  # a subclass: not found, read-only, backpressure...
                        raise
                    # Still joining or resuming after a restart: wait (within the deadline) and retry.
                    groups.wait_active(group, timeout=max(req.remaining() - 0.5, 0.1))
                    receipt = groups.publish(group, run_payloads, message_ids=run_ids, headers=run_headers,
                                             timeout=min(req.remaining(), limit))
                journaled = None
                if ingest is not None:  # seqs are assigned and tracked in the same order (the group lock)
                    journaled = ingest.track_own(receipt, group, groups.did, run_payloads, run_ids, run_headers)
                with self._published_lock:
                    for i, seq in zip(fresh, receipt.seqs):
                        seqs[i] = seq
                        entry = _Sent(seq, receipt, sign, journaled)
                        self._published[(group, ids[i])] = entry
                        sent.append(entry)
                    while len(self._published) > _PUBLISHED_MEMORY:
                        self._published.popitem(last=False)
                waits.append(receipt)
                self.process.metrics.add(messages_published=len(fresh),
                                         bytes_published=sum(len(payloads[i]) for i in fresh))
        for receipt in {id(r): r for r in waits}.values():
            left = min(req.remaining(), limit)
            if left <= 0:
                raise PeerTimeoutError(f"the deadline passed before group {group!r} acknowledged the batch",
                                       hint="Publish the same rows again with the same message ids: "
                                            "members drop what they already have")
            receipt.wait(left)
        # Own messages are in this member's journal too before we answer (a reader on this member,
        # told "published", expects to read them); within the call's deadline, and said if not.
        # Journaled, they also tell whether the group kept them or an earlier copy (see _Sent).
        in_journal = self._settle(req, group, sent + known)
        # "signed": rows whose kept copy surely carries this agent's proof; "signed_unknown": rows whose
        # kept copy may be one published before this agent started (or not journaled here in time).
        signed = sum(1 for e in sent if e.proof) + sum(1 for e in known if e.proof)
        unknown = sum(1 for e in sent if e.proof is None) + sum(1 for e in known if e.proof is None)
        # Duplicates: rows the group had before, whether this agent knew (not sent again) or its
        # journal's id rule found out (sent again, dropped by every member as here).
        duplicates = len(known) + sum(1 for e in sent if e.dropped)
        return {"group": group, "message_ids": ids, "seqs": seqs, "duplicates": duplicates,
                "journaled": in_journal, "signed": signed, "signed_unknown": unknown}

    def _settle(self, req: Request, group: str, entries: list[_Sent]) -> bool:
        """Wait (within the call's deadline) until this member's journal took these own rows, and
        settle for each whether the journal kept it or dropped it as a duplicate of an earlier copy
        (its id rule records the dropped seq as superseded, durably, before the append returns): one
        look-up per call, not per row. False if some were not journaled in time (left unsettled)."""
        pending = [e for e in entries if not e.settled]
        if not pending:
            return True
        done = []
        waited: dict[int, bool] = {}
        for e in pending:
            assert e.journaled is not None
            ok = waited.get(id(e.journaled))
            if ok is None:
                ok = waited[id(e.journaled)] = e.journaled.wait(max(req.remaining() - _ANSWER_MARGIN_S, 0.0))
            if ok:
                done.append(e)
        if done:
            try:
                ranges = self.journal.superseded(group, self.groups.did, min(e.seq for e in done),
                                                 max(e.seq for e in done))
            except JournalClosedError:  # the agent stopping: the group has the rows; how they are kept is unknown
                return False
            starts = [a for a, _ in ranges]
            with self._published_lock:  # a concurrent re-publish of the same ids settles them alike
                for e in done:
                    at = bisect.bisect_right(starts, e.seq) - 1
                    e.dropped = at >= 0 and ranges[at][1] >= e.seq
                    e.proof = None if e.dropped else e.sign
                    e.settled = True
        return len(done) == len(pending)

    # --- the journal ----------------------------------------------------------------------------

    def latest(self, req: Request, group: str | None) -> dict[str, Any]:
        journal = self.journal
        positions = journal.latest()
        publishers = [
            {"group": p.group, "publisher_did": p.publisher_did, "last_seq": p.last_seq, "last_offset": p.last_offset}
            for p in positions.publishers.values() if group is None or p.group == group
        ]
        return {"next_offset": positions.next_offset, "earliest_offset": journal.earliest_offset(),
                "committed_offset": journal.committed_offset, "consumers": journal.consumers(),
                "publishers": publishers}

    def superseded(self, req: Request, group: str, publisher: str, first_seq: int, last_seq: int) -> dict[str, Any]:
        ranges = self.journal.superseded(group, publisher, first_seq, last_seq)
        return {"ranges": [[a, b] for a, b in ranges]}

    def read(self, req: Request, group: str | None, start: int | None, end: int | None, publisher: str | None,
             first_seq: int | None, last_seq: int | None, max_rows: int | None, wait: float | None,
             last: int | None) -> tuple[dict[str, Any], bytes]:
        journal = self.journal
        cap = self.process.config.get("api", "max_read_rows")
        limit = min(max_rows or cap, cap)
        max_bytes = self.process.config.get("api", "max_read_bytes")
        if publisher is not None or first_seq is not None or last_seq is not None:
            if group is None or publisher is None:
                raise BadRequestError("read: a seq range needs both 'group' and 'publisher'")
            first = 1 if first_seq is None else first_seq
            final = (1 << 62) if last_seq is None else last_seq
            table = _compact(journal.read_by_seq(group, publisher, first, final, max_rows=limit, max_bytes=max_bytes))
            next_seq = int(table.column("seq")[-1].as_py()) + 1 if table.num_rows else first
            return ({"rows": table.num_rows, "next_seq": next_seq, "next_offset": journal.next_offset,
                     "end_offset": journal.next_offset},
                    table_to_ipc(table))
        if last is not None:
            table, next_offset = self._tail(group, last, limit, max_bytes, req)
            return ({"rows": table.num_rows, "next_offset": next_offset, "end_offset": next_offset},
                    table_to_ipc(table))
        begin = journal.earliest_offset() if start is None else start
        if end is not None and end < begin:
            raise OffsetOutOfRangeError(f"read: end {end} is before start {begin}")
        if begin > journal.next_offset:  # at once: waiting would not bring this offset any sooner
            raise OffsetOutOfRangeError(f"read: offset {begin} is beyond the journal's end ({journal.next_offset})")
        if wait and begin >= journal.next_offset:
            assert self.process.ingest is not None
            self.process.ingest.wait_for(lambda: journal.next_offset > begin, min(wait, req.remaining()))
        table, next_offset = self._scan(group, begin, end, limit, max_bytes, req)
        return ({"rows": table.num_rows, "next_offset": next_offset, "end_offset": journal.next_offset},
                table_to_ipc(table))

    def _scan(self, group: str | None, begin: int, end: int | None, limit: int, max_bytes: int,
              req: Request) -> tuple[pa.Table, int]:
        """Up to ``limit`` rows (and ``max_bytes`` of payloads, one row at least) of ``group`` from
        ``begin``; the offset to continue from."""
        journal = self.journal
        stop = journal.next_offset if end is None else min(end, journal.next_offset)
        if begin >= stop:
            if begin > journal.next_offset:
                raise OffsetOutOfRangeError(f"read: offset {begin} is beyond the journal's end "
                                            f"({journal.next_offset})")
            return _empty(), begin
        pieces: list[pa.Table] = []
        rows = 0
        bytes_left = max_bytes
        position = begin
        pending: list[pa.RecordBatch] = []  # records gathered into one filter (records may be tiny)

        def page(batches: list[pa.RecordBatch]) -> bool:
            """Take rows of these records; True when the page is full. Moves ``position`` past them."""
            nonlocal rows, bytes_left, position
            table = _compact(pa.Table.from_batches(batches, schema=JOURNAL_SCHEMA))
            if group is not None:
                table = table.filter(pc.equal(table.column("group"), group))
            take = min(table.num_rows, limit - rows)
            fit, used = rows_within_bytes(table.column("payload"), take, bytes_left, at_least_one=rows == 0)
            if fit < table.num_rows:  # full: continue from the first row not taken
                position = int(table.column("offset")[fit].as_py())
                table = table.slice(0, fit)
            else:
                position = int(batches[-1].column(0)[-1].as_py()) + 1  # (offset is the first column)
            if table.num_rows:
                pieces.append(table)
            rows += table.num_rows
            bytes_left -= used
            return fit < take or rows >= limit or bytes_left <= 0

        records = journal.read_batches(begin, stop)
        try:
            gathered = 0
            for batch in records:  # read as the page fills: a full page stops the decryption too
                pending.append(batch)
                gathered += batch.num_rows
                if gathered >= _SCAN_GATHER_ROWS:
                    full = page(pending)
                    pending, gathered = [], 0
                    if full or req.remaining() < 1.0:
                        break
            else:
                if pending:
                    page(pending)
                    pending = []
        finally:
            records.close()
        return (_compact(pa.concat_tables(pieces)) if pieces else _empty()), position

    def _tail(self, group: str | None, count: int, limit: int, max_bytes: int, req: Request) -> tuple[pa.Table, int]:
        """The last ``count`` rows of ``group``, scanning back from the end; fewer if the call's deadline
        comes first (a rare group in a long journal), never an answer after it."""
        journal = self.journal
        want = min(count, limit)
        end = journal.next_offset
        earliest = journal.earliest_offset()
        pieces: list[pa.Table] = []
        rows = 0
        upto = end
        chunk = max(want * 4, 1024)
        while upto > earliest and rows < want:
            frm = max(earliest, upto - chunk)
            try:
                table = _compact(journal.read(frm, upto))
            except DataLossError:  # retention deleted the oldest rows since `earliest` was read
                moved = journal.earliest_offset()
                if moved <= frm:
                    raise
                earliest = moved  # the scan ends at what is left, as if it had started there
                continue
            if group is not None:
                table = table.filter(pc.equal(table.column("group"), group))
            pieces.insert(0, table)
            rows += table.num_rows
            upto = frm
            chunk = max(chunk, min(chunk * 2, _TAIL_CHUNK_MAX))  # a rare group: fewer, larger reads further back
            if req.remaining() < 1.0:
                break
        table = _compact(pa.concat_tables(pieces)) if pieces else _empty()
        if table.num_rows > want:
            table = table.slice(table.num_rows - want)
        if table.num_rows:  # the last rows that fit in max_bytes (the newest one at least)
            newest_first = table.take(pa.array(range(table.num_rows - 1, -1, -1)))
            fit, _ = rows_within_bytes(newest_first.column("payload"), table.num_rows, max_bytes, at_least_one=True)
            table = table.slice(table.num_rows - fit)
        return table, end

    def commit(self, req: Request, offset: int, consumer: str | None = None) -> dict[str, Any]:
        point = self.journal.commit(offset, consumer)
        return {"committed_offset": self.journal.committed_offset, "consumer": consumer, "consumer_offset": point}

    def release(self, req: Request, consumer: str) -> dict[str, Any]:
        return {"released": self.journal.release(consumer), "committed_offset": self.journal.committed_offset}


def _publish_rows(table: pa.Table) -> tuple[list[bytes], list[str], list[dict[str, str] | None]]:
    """Payloads, message ids (fresh ones where missing) and per-row headers. A batch this call cannot take
    is a BadRequestError; a row it cannot publish is a BadRowError (its data, not the call), row numbers
    counting from 0 within the batch."""
    allowed = {"payload", "message_id", "headers"}
    extra = [c for c in table.column_names if c not in allowed]
    if extra:
        raise BadRequestError(f"publish: unknown column(s) {', '.join(extra)}; a batch has payload "
                              "(binary or string) and optionally message_id (string) and headers (map<string,string>)")
    if "payload" not in table.column_names:
        raise BadRequestError("publish: the batch has no 'payload' column")
    if table.num_rows == 0:
        raise BadRequestError("publish: the batch is empty")
    payload = table.column("payload")
    if payload.type not in _PAYLOAD_TYPES:
        raise BadRequestError(f"publish: 'payload' must be binary or string, not {payload.type}")
    if payload.null_count:
        first = int(pc.index(pc.is_null(payload), True).as_py())
        raise BadRowError(f"publish: the payload of row {first} is null ('payload' has {payload.null_count} null "
                          "value(s))")
    if pa.types.is_string(payload.type) or pa.types.is_large_string(payload.type):
        payload = payload.cast(pa.large_binary() if pa.types.is_large_string(payload.type) else pa.binary())
    payloads: list[bytes] = payload.to_pylist()
    if "message_id" in table.column_names:
        column = table.column("message_id")
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or pa.types.is_null(column.type)):
            raise BadRequestError(f"publish: 'message_id' must be string, not {column.type}")
        given = column.to_pylist()
    else:
        given = [None] * table.num_rows
    ids: list[str] = []
    seen: set[str] = set()
    for i, mid in enumerate(given):
        if mid is None or mid == "":
            mid = uuid.uuid4().hex
        elif len(mid) > _MAX_ID:
            raise BadRowError(f"publish: message_id of row {i} is longer than {_MAX_ID} characters")
        if mid in seen:
            raise BadRowError(f"publish: message_id {mid[:64]!r} of row {i} appears twice in the batch")
        seen.add(mid)
        ids.append(mid)
    if "headers" in table.column_names:
        column = table.column("headers")
        if not (column.type == _HEADERS_TYPE or pa.types.is_null(column.type)
                or (pa.types.is_map(column.type) and pa.types.is_string(column.type.key_type)
                    and pa.types.is_string(column.type.item_type))):
            raise BadRequestError(f"publish: 'headers' must be map<string, string>, not {column.type}")
        headers = []
        for i, pairs in enumerate(column.to_pylist()):
            repeated = repeated_key(pairs)  # an Arrow map may repeat a key; dict() would keep the last
            if repeated is not None:
                raise BadRowError(f"publish: row {i} has {repeated.text}")
            head = None if pairs is None else dict(pairs)
            headers.append(head or None)
            _check_headers(i, headers[-1])
    else:
        headers = [None] * table.num_rows
    return payloads, ids, headers


def _signed(signer: Any, group: str, payloads: list[bytes], ids: list[str],
            headers: list[dict[str, str] | None]) -> list[dict[str, str] | None]:
    """Each row's headers with its origin proof added; a row that already claims an origin is refused
    (the agent signs what it publishes, never over someone else's claim)."""
    out: list[dict[str, str] | None] = []
    for i, (mid, payload, head) in enumerate(zip(ids, payloads, headers)):
        problem = header_problem(head, sign="sign")  # only what signing adds can be wrong: the rows were checked
        if problem is not None:
            fix = (f"Drop the {ORIGIN_HEADER} header from the row, or publish it without sign"
                   if problem.kind == "reserved"
                   else f"Keep at most {most_headers('sign')} headers in the row, or publish it without sign")
            raise BadRowError(f"publish: row {i} (message_id {mid[:64]!r}) has {problem.text}", hint=fix)
        out.append(signer.headers(group, mid, payload, head))
    return out


def _check_headers(row: int, headers: dict[str, str] | None) -> None:
    """What the data plane would refuse as a ConfigurationError (a hint about settings) is bad input here:
    the one rule and its words are the core's (group/headers.py), this names the row."""
    problem = header_problem(headers)
    if problem is not None:
        raise BadRowError(f"publish: row {row} has {problem.text}")


def build_registry(process: "AgentProcess") -> CallRegistry:
    """Every call with its argument schema; the server checks arguments before calling a handler."""
    calls = AgentCalls(process)
    r = CallRegistry()
    text = Param(str)
    required_text = Param(str, required=True, check=non_empty)
    group = Param(str, required=True, check=non_empty)
    offset = Param(int, check=non_negative)
    r.add("status", calls.status)
    r.add("metrics", calls.metrics)
    r.add("invite", calls.invite, {"label": text, "multi_use": Param(bool, default=False), "group": text})
    r.add("accept", calls.accept, {"url": required_text})
    r.add("connections", calls.connections, {"include_incomplete": Param(bool, default=False)})
    r.add("send", calls.send, {"peer": required_text, "message": Param(str, required=True)})
    r.add("messages", calls.messages, {"peer": text})
    r.add("ping", calls.ping, {"peer": required_text})
    r.add("groups", calls.groups_list)
    r.add("create", calls.create, {"group": group, "mode": Param(str, check=_mode), "ordered": Param(bool),
                                   "consistent_join": Param(bool), "role": Param(str, check=_role)})
    r.add("join", calls.join, {"group": group, "via": required_text, "role": Param(str, check=_role)})
    r.add("leave", calls.leave, {"group": group})
    r.add("info", calls.info, {"group": group})
    r.add("members", calls.members, {"group": group, "include_left": Param(bool, default=False)})
    r.add("switch_role", calls.switch_role, {"group": group, "role": Param(str, required=True, check=_role)})
    r.add("publish", calls.publish, {"group": group, "sign": Param(bool, default=False)}, bulk="required")
    r.add("latest", calls.latest, {"group": text})
    r.add("read", calls.read, {"group": text, "start": offset, "end": offset, "publisher": text,
                               "first_seq": offset, "last_seq": offset, "max_rows": Param(int, check=positive),
                               "wait": Param(float, check=non_negative), "last": Param(int, check=positive)},
          parks=lambda args: bool(args.get("wait")))
    r.add("superseded", calls.superseded, {"group": group, "publisher": required_text,
                                           "first_seq": Param(int, required=True, check=non_negative),
                                           "last_seq": Param(int, required=True, check=non_negative)})
    r.add("commit", calls.commit, {"offset": Param(int, required=True, check=non_negative), "consumer": text})
    r.add("release", calls.release, {"consumer": required_text})
    return r
