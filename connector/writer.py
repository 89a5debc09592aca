"""The sink: df.writeStream / df.write .format("zerocomm") publishes rows to a group.

Why it is exactly-once: each row gets a message id derived from where it sits in the query (query
id, batch id, partition) and from what it is (a hash of its payload and headers, and how many equal
rows came before it in the partition) unless it brings its own. Not its row index: after a shuffle a
retried task reads its rows in another order, and an index id would name another row (dropped as a
duplicate, lost) while the moved row went out twice. A retried task or a micro-batch re-run after a
crash publishes the same ids again, and the member (and every receiver, and every journal)
drops ids it has seen, so nothing is delivered twice. A task returns only once the group acknowledged
all its messages, so a batch commits only when they are all delivered; otherwise the task fails
with :class:`~zerocomm_spark.errors.PublishNotAcknowledgedError` and Spark retries or fails the query.
A row that can never be a group message (a null payload or header value, ...) fails its task with a
:class:`~zerocomm_spark.errors.SinkRowError` naming it instead: a retry cannot get past it.

Each task publishes through the member on its own host (started on demand), in row order, so a
reader sees one task's rows in the order they had in the partition.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from zerocomm_spark.errors import (
    SINK_ROWS_BEFORE,
    AgentNotRunningError,
    BadRowError,
    ConnectorOptionError,
    PublishNotAcknowledgedError,
    SinkHeaderError,
    SinkNullPayloadError,
    SinkOriginClaimError,
    SinkPayloadTooLargeError,
    SinkRowError,
    StreamContextError,
    ZeroCommError,
)
from zerocomm_spark.group.datamessage import MAX_HEADER_LENGTH, MAX_ID_LENGTH
from zerocomm_spark.group.headers import header_problem, most_headers, repeated_key
from zerocomm_spark.group.origin import ORIGIN_HEADER

from zerocomm_spark.connector.agent_link import MemberLink
from zerocomm_spark.connector.options import SinkOptions
from zerocomm_spark.connector.schema import SinkColumns

__all__ = ["ZeroCommBatchWriter", "ZeroCommCommitMessage", "ZeroCommStreamWriter", "check_sink_at_start",
           "publish_budget", "derived_id", "message_id_prefix", "publish_partition"]

log = logging.getLogger("zerocomm_spark.connector")

QUERY_ID_PROPERTY = "sql.streaming.queryId"  # set by Spark on every task of a streaming query
BATCH_ID_PROPERTY = "streaming.sql.batchId"
_HEADERS = pa.map_(pa.string(), pa.string())


@dataclass
class ZeroCommCommitMessage(WriterCommitMessage):
    """What one task published; every message in it was acknowledged by the group."""

    partition: int
    messages: int
    duplicates: int
    first_seq: int | None
    last_seq: int | None
    publisher_label: str | None


def message_id_prefix(query_id: str, batch_id: int | str | None, partition: int) -> str:
    """The id prefix of a task's rows (see :func:`derived_id`). Same task, same prefix."""
    return f"{query_id}.{batch_id}.{partition}" if batch_id is not None else f"{query_id}.{partition}"


def derived_id(prefix: str, payload: bytes, headers: object, occurrence: int) -> str:
    """``<prefix>.<hash of payload and headers>.<n>``: the id of the n-th (from 0) row of a task with
    this content, whatever order the task reads its rows in."""
    return f"{prefix}.{_content_hash(payload, headers).hex()}.{occurrence}"


def _content_hash(payload: bytes, headers: object) -> bytes:
    """A row's payload and headers, hashed; null and empty headers are the same (the agent treats them so)."""
    digest = hashlib.blake2b(len(payload).to_bytes(8, "big") + payload, digest_size=16)
    pairs = sorted(dict(headers).items()) if headers else []  # type: ignore[call-overload]
    if pairs:
        digest.update(json.dumps(pairs, separators=(",", ":")).encode("utf-8"))
    return digest.digest()


def _derived_ids(prefix: str, payload: pa.ChunkedArray | pa.Array, headers: pa.ChunkedArray | pa.Array | None,
                 wanted: list[bool] | None, seen: dict[bytes, int]) -> pa.Array:
    """Derived ids for the rows where ``wanted`` (all when None), null elsewhere; ``seen`` counts
    the task's rows of each content so far (keyed by the raw digest: a task may hold millions)."""
    heads = headers.to_pylist() if headers is not None else None
    out: list[str | None] = []
    for i, data in enumerate(payload.to_pylist()):
        if wanted is not None and not wanted[i]:
            out.append(None)
            continue
        key = _content_hash(data, heads[i] if heads is not None else None)
        n = seen.get(key, 0)
        seen[key] = n + 1
        out.append(f"{prefix}.{key.hex()}.{n}")
    return pa.array(out, type=pa.string())


def _chunks(batches: Iterator[pa.RecordBatch], rows: int, size: int) -> Iterator[pa.Table]:
    """Re-cut the input into publish calls of at most ``rows`` messages and ``size`` payload bytes
    (a single bigger message still goes alone), keeping row order.

    By each row's own size: an input batch's average let a run of big rows (ten 1 MB rows among a
    thousand tiny ones) into one call past the limit, and past api.max_request_bytes at every retry.
    """
    pending: list[pa.RecordBatch] = []
    count = weight = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        lengths = pc.fill_null(pc.binary_length(batch.column("payload")), 0)
        ends = np.cumsum(lengths.to_numpy(zero_copy_only=False), dtype=np.int64)  # bytes up to each row
        at = 0
        while at < batch.num_rows:
            before = int(ends[at - 1]) if at else 0
            fits = int(np.searchsorted(ends, before + size - weight, side="right")) - at
            take = min(rows - count, batch.num_rows - at, fits)
            if take < 1:
                if pending:  # the next row does not fit: send what is waiting first
                    yield pa.Table.from_batches(pending)
                    pending, count, weight = [], 0, 0
                    continue
                take = 1  # bigger than the limit on its own: it goes alone
            pending.append(batch.slice(at, take))
            count += take
            weight += int(ends[at + take - 1]) - before
            at += take
            if count >= rows or weight >= size:
                yield pa.Table.from_batches(pending)
                pending, count, weight = [], 0, 0
    if pending:
        yield pa.Table.from_batches(pending)


#: How long start()/save() waits for the driver host's agent to say its request limit (it is not started for it).
_START_CHECK_S = 5.0


#: What a publish request keeps for what is not payload (message ids, headers, Arrow framing), at least.
_REQUEST_OVERHEAD = 64 * 1024


def publish_budget(options: SinkOptions, max_request_bytes: int, where: str) -> int:
    """Payload bytes per publish call that fit the agent's api.max_request_bytes with room for ids and
    headers: the default is fitted to it; a publishBatchBytes set past it is refused (every publish
    call of a full chunk would fail, at every retry)."""
    room = max(1, max_request_bytes - max(_REQUEST_OVERHEAD, max_request_bytes // 16))
    if options.publish_batch_bytes <= room:
        return options.publish_batch_bytes
    if not options.publish_batch_bytes_set:
        return room
    raise ConnectorOptionError(
        f"option publishBatchBytes is {options.publish_batch_bytes}, more than the {room} bytes of payload a request "
        f"to the agent {where} holds (its api.max_request_bytes is {max_request_bytes}, less room for message ids "
        "and headers): such publish calls can never succeed",
        hint=f"Set publishBatchBytes to at most {room} or leave it unset (it then fits the agent), or raise "
             "api.max_request_bytes in that agent's zerocomm.toml")


def check_sink_at_start(options: SinkOptions) -> None:
    """At start()/save() on the driver: check the options against the driver host's agent, so a
    query that could never publish fails before it runs. Tasks check their own host's agent too;
    a driver without a running agent is not a failure here (none is started for this)."""
    agent = replace(options.agent, spawn=False, timeout_s=min(options.agent.timeout_s, _START_CHECK_S))
    try:
        link = MemberLink.connect(agent)
    except ZeroCommError as exc:
        log.debug("zerocomm sink: no agent on the driver's host to check the options against (%s)", type(exc).__name__)
        return
    with link:
        publish_budget(options, link.max_request_bytes, f"on the driver's host {os.uname().nodename}")


def publish_partition(batches: Iterator[pa.RecordBatch], options: SinkOptions, columns: SinkColumns,
                      prefix: str, partition: int) -> ZeroCommCommitMessage:
    """Publish a task's rows in order through this host's member; return once the group has them all."""
    published = duplicates = 0
    first_seq: int | None = None
    last_seq: int | None = None
    row = 0
    seen: dict[bytes, int] = {}
    link: MemberLink | None = None
    rest = iter(batches)
    first = next((b for b in rest if b.num_rows), None)  # an empty partition connects to no agent
    try:
        chunks: Iterator[pa.Table] = iter(())
        if first is not None:
            link = MemberLink.connect(options.agent)
            budget = publish_budget(options, link.max_request_bytes, f"on host {os.uname().nodename}")
            chunks = _chunks(itertools.chain([first], rest), options.publish_batch_size, budget)
        for chunk in chunks:
            assert link is not None
            payload = chunk.column("payload")
            if columns.payload_is_string:
                payload = payload.cast(pa.binary())
            if payload.null_count:
                raise SinkNullPayloadError(
                    f"row {row + _first_null(payload)} of partition {partition} has a null payload; nothing from "
                    f"row {row} of the partition on was published")
            _check_payload_sizes(payload, link.max_message_bytes, row, partition)
            headers = chunk.column("headers") if columns.has_headers else None
            if columns.has_message_id:
                given = chunk.column("message_id").combine_chunks()
                _check_message_ids(given, row, partition)
                # A null or empty id gets the derived one: an empty id would be replaced by a random
                # one downstream, new at every retry (a row delivered twice).
                missing = pc.fill_null(pc.or_kleene(pc.is_null(given), pc.equal(given, "")), True)
                if pc.any(missing).as_py():
                    generated = _derived_ids(prefix, payload, headers, missing.to_pylist(), seen)
                    ids = pc.if_else(missing, generated, given)
                else:
                    ids = given
            else:
                ids = _derived_ids(prefix, payload, headers, None, seen)
            data = {"payload": payload, "message_id": ids}
            if columns.has_headers:
                data["headers"] = chunk.column("headers").cast(_HEADERS)
                _check_headers(data["headers"], row, partition, options.sign_origin)
            table = pa.table(data)
            repeated = 0
            if columns.has_message_id:
                # Given ids dedupe at-least-once input: a repeat within a chunk is dropped here (the
                # agent refuses a batch naming an id twice), as a repeat in a later chunk is by the
                # member - both counted as duplicates.
                table, repeated = _first_of_each_id(table)
            result = _publish(link, options, table, row, chunk.num_rows, repeated, partition)
            if len(result.message_ids) != table.num_rows:
                raise PublishNotAcknowledgedError(
                    f"the agent acknowledged {len(result.message_ids)} of {table.num_rows} messages")
            published += chunk.num_rows  # every row acknowledged, or a duplicate of one that was
            duplicates += repeated + int(getattr(result, "duplicates", 0) or 0)
            seqs = [s for s in result.seqs if isinstance(s, int)]
            if seqs:
                first_seq = min(seqs) if first_seq is None else min(first_seq, min(seqs))
                last_seq = max(seqs) if last_seq is None else max(last_seq, max(seqs))
            row += chunk.num_rows
        label = link.label if link is not None else None
    finally:
        if link is not None:
            link.close()
    return ZeroCommCommitMessage(partition=partition, messages=published, duplicates=duplicates,
                                 first_seq=first_seq, last_seq=last_seq, publisher_label=label)


def _check_payload_sizes(payload: pa.ChunkedArray | pa.Array, limit: int | None, row: int, partition: int) -> None:
    """Refuse a chunk holding a payload bigger than one group message carries, naming its row: the
    agent refused the whole publish call with "exceeds max_message_bytes" and a hint to raise a
    setting no agent has, and a task retry (or a re-run of the batch) failed the same way."""
    if limit is None or len(payload) == 0:
        return
    lengths = pc.binary_length(payload)
    largest = pc.max(lengths).as_py()
    if largest is None or largest <= limit:
        return
    at = int(pc.index(pc.greater(lengths, limit), True).as_py())
    size = lengths.take([at])[0].as_py()
    raise SinkPayloadTooLargeError(
        f"row {row + at} of partition {partition} has a {size}-byte payload; a group message carries at most "
        f"{limit} bytes (the agent on host {os.uname().nodename}); nothing from row {row} of the partition on "
        "was published",
        hint=SinkPayloadTooLargeError.hint.replace("LIMIT", str(limit)))


def _check_message_ids(given: pa.Array, row: int, partition: int) -> None:
    """Refuse a chunk holding a given message id longer than a group message's, naming its partition row:
    the agent refused it by its row in the publish call (counted after repeated ids were dropped)."""
    if len(given) == 0:
        return
    lengths = pc.utf8_length(given)
    longest = pc.max(lengths).as_py()
    if longest is None or longest <= MAX_ID_LENGTH:
        return
    at = int(pc.index(pc.greater(lengths, MAX_ID_LENGTH), True).as_py())
    raise SinkRowError(
        f"row {row + at} of partition {partition} has a {lengths[at].as_py()}-character message_id; a group message's "
        f"id has at most {MAX_ID_LENGTH}; nothing from row {row} of the partition on was published",
        hint="Shorten such ids (a hash keeps them unique: sha2(message_id, 256) is 64 characters), or leave them "
             "null to get a derived one; " + SINK_ROWS_BEFORE)


def _check_headers(headers: pa.ChunkedArray, row: int, partition: int, sign: bool) -> None:
    """Refuse a chunk holding a row whose headers the agent refuses (a null value, an empty key, too
    many entries, a key or value too long; with signOrigin a zc-origin entry of its own), naming the
    row and the key: the agent's refusal came back as PublishNotAcknowledgedError, advising a retry
    that fails the same way every time. A vectorised look per chunk finds the chunks that may hold
    such a row; for those the core's rule (group/headers.py, the agent's and the data plane's too)
    decides row by row, and says what is wrong."""
    most = most_headers(_SIGN if sign else None)
    at = row
    for chunk in headers.chunks:
        if _headers_may_be_refused(chunk, most, sign):  # only then row by row, to name the first such row
            for i, head in enumerate(chunk.to_pylist()):
                _check_row_headers(head, at + i, partition, sign, row)
        at += len(chunk)


_SIGN = "signOrigin"  # the option that asks the agent to sign, as the core's words name it


def _headers_may_be_refused(chunk: pa.MapArray, most: int, sign: bool = False) -> bool:
    """A vectorised look over the chunk's rows' entries (a superset: entries under a null row count too).
    A key repeated within a row is not looked for: Spark's maps cannot hold one (its default
    ``spark.sql.mapKeyDedupPolicy`` refuses them), and the agent refuses one, naming its row.

    A sliced MapArray's ``.keys``/``.items`` are the whole parent's, while its ``.offsets`` are absolute
    positions in them: the children are sliced to the chunk's span, or every chunk scanned the whole
    batch's entries, and one bad row sent every other chunk of the batch down the row-by-row path."""
    if len(chunk) == 0:
        return False
    offsets = chunk.offsets
    begin, end = offsets[0].as_py(), offsets[-1].as_py()
    keys, items = chunk.keys.slice(begin, end - begin), chunk.items.slice(begin, end - begin)
    key_lengths, value_lengths = pc.utf8_length(keys), pc.utf8_length(items)
    return bool(items.null_count or pc.any(pc.equal(key_lengths, 0)).as_py()
                or (pc.max(key_lengths).as_py() or 0) > MAX_HEADER_LENGTH
                or (pc.max(value_lengths).as_py() or 0) > MAX_HEADER_LENGTH
                or int(np.max(np.diff(offsets.to_numpy(zero_copy_only=False)))) > most
                or (sign and pc.any(pc.equal(keys, ORIGIN_HEADER)).as_py()))


def _check_row_headers(head: list[tuple[str, str | None]] | None, at: int, partition: int, sign: bool,
                       row: int) -> None:
    """The core's decision and words on one row's headers (as the agent takes them), with where the row
    is, what was published and a fix in Spark SQL."""
    problem = repeated_key(head) or header_problem(dict(head) if head else None, sign=_SIGN if sign else None)
    if problem is None:
        return
    message = (f"row {at} of partition {partition} has {problem.text}; nothing from row {row} of the partition "
               "on was published")
    if problem.kind == "reserved":
        raise SinkOriginClaimError(message)
    if problem.kind == "too-many":
        raise SinkHeaderError(message, hint=f"Keep at most {most_headers(_SIGN if sign else None)} entries in such "
                                            "rows' headers; " + SINK_ROWS_BEFORE)
    if problem.kind == "empty-key":
        raise SinkHeaderError(message, hint="Drop the entries with an empty key (map_filter(headers, (k, v) -> "
                                            "k != '')); " + SINK_ROWS_BEFORE)
    if problem.kind == "too-long":
        raise SinkHeaderError(message, hint="Shorten or drop such entries, or move the data into the payload; "
                                            + SINK_ROWS_BEFORE)
    raise SinkHeaderError(message)  # a null value (the class's hint); a map<string,string> holds nothing else


def _publish(link: MemberLink, options: SinkOptions, table: pa.Table, row: int, rows: int, repeated: int,
             partition: int) -> object:
    """One publish call, of partition rows ``row`` to ``row + rows - 1`` less ``repeated`` rows whose
    message id repeats an earlier one's. The agent refusing a row's data (BadRowError) is a SinkRowError:
    PublishNotAcknowledgedError's advice to rerun and check the members cannot help with it. Any other
    refusal (an agent of another version not taking an argument, a request too large) is not about the
    rows: it stays what MemberLink makes of it."""
    try:
        return link.publish(options.group, table, options.publish_timeout_s, sign=options.sign_origin)
    except BadRowError as exc:
        # The agent counts rows from 0 within this call, which holds only the first row of each id.
        if repeated:
            counted = (f"the agent numbers the call's rows from 0 at partition row {row}, counting only the first "
                       f"row of each message id ({repeated} row(s) repeating an earlier id were left out of the call)")
        else:
            counted = f"the agent numbers the call's rows from 0: its row i is partition row {row} + i"
        raise SinkRowError(f"the agent on host {os.uname().nodename} refused a row of the publish call holding rows "
                           f"{row}-{row + rows - 1} of partition {partition} (nothing from row {row} on was "
                           f"published): {exc.message}; {counted}",
                           hint=f"Fix or leave out that row; {SINK_ROWS_BEFORE}") from None


def _first_of_each_id(table: pa.Table) -> tuple[pa.Table, int]:
    """The rows whose message id did not occur earlier in ``table`` (order kept), and how many were dropped."""
    ids = table.column("message_id")
    if pc.count_distinct(ids).as_py() == table.num_rows:
        return table, 0
    firsts = (pa.table({"id": ids, "row": pa.array(range(table.num_rows), pa.int64())})
              .group_by("id", use_threads=False).aggregate([("row", "min")]).column("row_min"))
    keep = pc.sort_indices(firsts)
    return table.take(pc.take(firsts, keep)), table.num_rows - len(firsts)


def _first_null(column: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.index(pc.is_null(column), True).as_py())


def _check_commit(messages: list[WriterCommitMessage | None], what: str) -> tuple[int, int]:
    missing = sum(1 for m in messages if not isinstance(m, ZeroCommCommitMessage))
    if missing:
        raise PublishNotAcknowledgedError(f"{missing} task(s) of {what} reported no acknowledged messages; "
                                          "the batch is not committed")
    total = sum(m.messages for m in messages if isinstance(m, ZeroCommCommitMessage))
    dups = sum(m.duplicates for m in messages if isinstance(m, ZeroCommCommitMessage))
    return total, dups


class ZeroCommStreamWriter(DataSourceStreamArrowWriter):
    """Micro-batch sink. Ids come from the query id and batch id Spark sets on every task."""

    def __init__(self, options: SinkOptions, columns: SinkColumns) -> None:
        self.options = options
        self.columns = columns
        # Only a fallback: Spark always sets the query id on streaming tasks.
        self.fallback_id = uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ZeroCommCommitMessage:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context else 0
        query_id = context.getLocalProperty(QUERY_ID_PROPERTY) if context else None
        batch_id = context.getLocalProperty(BATCH_ID_PROPERTY) if context else None
        if not query_id:
            log.warning("zerocomm sink: no streaming query id on the task; ids are unique to this writer only")
            query_id = self.fallback_id
        if batch_id is None:
            raise StreamContextError(f"the streaming write task for partition {partition} has no "
                                     f"{BATCH_ID_PROPERTY} property; nothing was published")
        prefix = message_id_prefix(query_id, batch_id, partition)
        return publish_partition(iterator, self.options, self.columns, prefix, partition)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        total, dups = _check_commit(messages, f"batch {batchId}")
        log.info("zerocomm sink: batch %d delivered %d message(s) to %r (%d already delivered before)",
                 batchId, total, self.options.group, dups)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        done = sum(m.messages for m in messages if isinstance(m, ZeroCommCommitMessage))
        log.warning("zerocomm sink: batch %d aborted after %d acknowledged message(s); re-running it publishes the "
                    "same ids, so none is delivered twice", batchId, done)


#: What to do after a df.write whose rows bring no message_id failed with its messages perhaps sent: the
#: generic advice ("rerun: the same ids, nothing delivered twice") holds for a task Spark retries within
#: the save() and for streams, but a save() run again makes a new write id, so every row goes out again.
BATCH_RERUN_HINT = (
    "Some of this write's messages may already be delivered (to some members or all, as the group acknowledges "
    "them later): df.write run again publishes every row under new message ids, so those are delivered twice. "
    "Check that the group's members are up (or raise publishTimeoutMs) and, to make a rerun safe, give the "
    "DataFrame a message_id column (a key of each row: members drop ids they have seen), or write with "
    "writeStream and a checkpoint (a re-run batch publishes the same ids)")


_PROMISE_A_SAFE_RERUN = (PublishNotAcknowledgedError, AgentNotRunningError)


class ZeroCommBatchWriter(DataSourceArrowWriter):
    """df.write sink. One write id per save(), made on the driver and shipped to every task, so a
    retried task republishes the ids of the attempt it replaces."""

    def __init__(self, options: SinkOptions, columns: SinkColumns) -> None:
        self.options = options
        self.columns = columns
        self.write_id = uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ZeroCommCommitMessage:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context else 0
        prefix = message_id_prefix(self.write_id, None, partition)
        try:
            return publish_partition(iterator, self.options, self.columns, prefix, partition)
        except _PROMISE_A_SAFE_RERUN as exc:
            if self.columns.has_message_id:  # the rows' own ids: a rerun publishes the same ones
                raise
            # Their hints promise a rerun delivers nothing twice (PublishNotAcknowledgedError's always, an
            # agent gone mid-publish's too): true of Spark's retries of this task (same write id), not of
            # the save() the user runs again (a new one). Starting the agent is still the first step.
            if isinstance(exc, PublishNotAcknowledgedError):
                raise PublishNotAcknowledgedError(exc.message, hint=BATCH_RERUN_HINT) from None
            raise AgentNotRunningError(exc.message, hint=f"{exc.hint.rstrip('.')}. {BATCH_RERUN_HINT}") from None

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        total, dups = _check_commit(messages, "the write")
        log.info("zerocomm sink: delivered %d message(s) to %r (%d already delivered before)",
                 total, self.options.group, dups)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        done = sum(m.messages for m in messages if isinstance(m, ZeroCommCommitMessage))
        log.warning("zerocomm sink: write aborted after %d acknowledged message(s)%s", done,
                    "" if self.columns.has_message_id else
                    "; running it again publishes every row under new message ids (give the DataFrame a "
                    "message_id column to make a rerun safe)")
