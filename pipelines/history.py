"""Persist a group's messages: a streaming query from format("zerocomm") into a Delta history table.

```python
from zerocomm_spark.pipelines.history import ingest, compact, vacuum
query = ingest(spark, ["sensors"], "/lake/history", "/lake/_checkpoints/history", agent="/tmp/zc/alice")
...
query.stop(); compact(spark, "/lake/history"); vacuum(spark, "/lake/history")
```

Why it is built this way:

* **Exactly once into Delta.** The source is replayable (offsets are per-publisher seqs in the
  member's journal), and every micro-batch is one ``foreachBatch`` append whose commit is tagged
  ``userMetadata = <query id>:<batch id>``, atomically with its rows. If the driver dies after the
  Delta commit but before Spark checkpointed the batch, the restarted query re-runs the same batch
  id; the writer finds that batch's tag in the table's log (pipelines/commit_tags.py) and skips
  it: nothing is missing, nothing is written twice. Only the first batch of a run (or one after a
  failure) is looked up: a batch that follows the one just written cannot be a replay. What
  the lookup does not cover is two *live* runs of one checkpoint (a zombie driver on another
  cluster; Spark refuses a second run within one) both writing the batch they overlap on:
  ``delta_txn=True`` adds Delta's ``txnAppId``/``txnVersion`` to every commit, which Delta checks
  atomically, at the price of a rebuild of the table's state per micro-batch in Delta 4.4 (about a
  second, growing with the table), which is why it is not the default. The query id is the one
  Spark keeps in the checkpoint: a *new* checkpoint gets a new id, so its batch 0 is never mistaken
  for an old one. (A new checkpoint reading from ``earliest`` again would append the same messages
  again: keep the checkpoint with the table, or start it at ``latest``.)
* **What history adds is computed in Spark SQL**: the partition date, ``ingested_at``, and the
  origin proof moved from the ``zc-origin`` header into ``origin_sig`` (pipelines/origin.py). Only
  sealing payloads with a history key needs Python (``mapInArrow``, whole Arrow batches at a time).
* **The table is made once, with its properties** (schema.py: change data feed, append-only,
  retention), partitioned by (group, date); OPTIMIZE (:func:`compact`) merges the small files that
  frequent micro-batches leave, VACUUM (:func:`vacuum`) deletes what OPTIMIZE replaced once it is
  older than the deleted-file retention.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerocomm_spark.errors import ConfigurationError, HistoryWriteConflictError, ZeroCommError
from zerocomm_spark.pipelines.commit_tags import catch_up_tag, commit_tag, last_tagged_batch
from zerocomm_spark.pipelines.origin import ORIGIN_HEADER, SCHEME
from zerocomm_spark.pipelines.schema import HISTORY_COLUMNS, PARTITION_COLUMNS, TABLE_PROPERTIES, history_schema

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery
    from pyspark.sql.types import DataType, StructType

    from zerocomm_spark.pipelines.history_key import HistoryKey

__all__ = ["IngestBatch", "HistoryWriter", "append_history", "append_new_rows", "append_new_rows_retrying", "compact",
           "ensure_table", "ingest", "require_history_table", "table_exists", "to_history", "vacuum"]

log = logging.getLogger("zerocomm_spark.pipelines.history")

_DAY_MICROS = 86_400_000_000


@dataclass(frozen=True)
class IngestBatch:
    """What one micro-batch did: ``committed`` False means the table already had it (a re-run batch)."""

    batch_id: int
    committed: bool
    rows: int
    version: int | None
    seconds: float


# --- the table ---------------------------------------------------------------------------------


def table_exists(spark: SparkSession, table_path: str) -> bool:
    """Whether a Delta table is there now (a local path is looked at directly: Delta caches a path's
    log per session, so a table another process made meanwhile could otherwise look absent)."""
    from delta.tables import DeltaTable

    path = str(table_path)
    local = path[len("file:"):] if path.startswith("file:") else path
    if "://" not in local:
        log_dir = Path(local) / "_delta_log"
        return log_dir.is_dir() and any(log_dir.glob("*.json"))
    return bool(DeltaTable.isDeltaTable(spark, path))


def ensure_table(spark: SparkSession, table_path: str, *, properties: Mapping[str, str] | None = None) -> None:
    """Create the history table (schema, partitioning, properties) unless it exists; check it if it does."""
    from delta.tables import DeltaTable

    path = str(table_path)
    if not table_exists(spark, path):
        builder = (DeltaTable.createIfNotExists(spark).location(path).addColumns(history_schema())
                   .partitionedBy(*PARTITION_COLUMNS))
        for key, value in {**TABLE_PROPERTIES, **(properties or {})}.items():
            builder = builder.property(key, value)
        builder.execute()
        return
    _check_history_columns(DeltaTable.forPath(spark, path).toDF().schema, path,
                           "Point history at an empty directory or an existing history table")


def _check_history_columns(schema: StructType, path: str, hint: str) -> None:
    """Every history column is there with its type (nullability aside): a column of another type (seq
    as text, say) would sort, filter and compare wrongly without an error."""
    types = {f.name: f.dataType for f in schema.fields}
    missing = [c for c in HISTORY_COLUMNS if c not in types]
    if missing:
        raise ConfigurationError(f"the Delta table at {path} is not a zerocomm history table (no {missing})",
                                 hint=hint)
    wrong = [f"{f.name} is {types[f.name].simpleString()}, not {f.dataType.simpleString()}"
             for f in history_schema().fields if not _same_type(types[f.name], f.dataType)]
    if wrong:
        raise ConfigurationError(f"the Delta table at {path} is not a zerocomm history table ({'; '.join(wrong)})",
                                 hint=hint)


def _same_type(have: DataType, want: DataType) -> bool:
    """Equal types, whether or not a map's values may be null."""
    from pyspark.sql.types import MapType

    if isinstance(have, MapType) and isinstance(want, MapType):
        return have.keyType == want.keyType and have.valueType == want.valueType
    return have == want


def require_history_table(spark: SparkSession, table_path: str) -> None:
    """Check that a history table is there (for readers: replay, providers, upkeep); a clear error if not."""
    from delta.tables import DeltaTable

    path = str(table_path)
    if not table_exists(spark, path):
        raise ConfigurationError(f"there is no Delta table at {path}",
                                 hint="Give the path of a history table (`zerocomm history ingest` makes one)")
    _check_history_columns(DeltaTable.forPath(spark, path).toDF().schema, path,
                           "Give the path of a history table (`zerocomm history ingest` makes one)")


# --- rows --------------------------------------------------------------------------------------


def to_history(df: DataFrame, *, history_key: HistoryKey | None = None) -> DataFrame:
    """Rows of format("zerocomm") (with or without headers) -> rows of the history table."""
    from pyspark.sql import functions as F

    cols = set(df.columns)
    if "headers" in cols:
        proof = F.col("headers").getItem(ORIGIN_HEADER)
        kept = F.map_filter("headers", lambda k, v: k != F.lit(ORIGIN_HEADER))
        # Most messages carry the proof alone: only the others pay for the (interpreted) map_filter.
        headers = (F.when(proof.isNull(), F.when(F.size("headers") > 0, F.col("headers")))
                   .when(F.size("headers") == 1, F.lit(None)).otherwise(kept))
    else:
        proof = F.lit(None).cast("string")
        headers = F.lit(None).cast("map<string,string>")
    decoded = F.try_to_binary(F.substring(proof, 3, 1 << 20), F.lit("base64"))
    sig = F.when(proof.startswith("1:") & (F.length(decoded) == 64), decoded)
    label = F.col("publisher_label") if "publisher_label" in cols else F.lit(None).cast("string")
    out = df.select(
        F.col("group"),
        F.date_from_unix_date(F.floor(F.unix_micros("sent_at") / _DAY_MICROS).cast("int")).alias("date"),
        F.col("message_id"), F.col("publisher_did"), label.alias("publisher_label"),
        F.col("seq").cast("long").alias("seq"), F.col("lamport_ts").cast("long").alias("lamport_ts"),
        F.col("sent_at"), F.col("received_at"), F.current_timestamp().alias("ingested_at"),
        headers.alias("headers"), F.col("payload"),
        (F.lit(history_key.key_id) if history_key is not None else F.lit(None)).cast("string").alias("payload_key_id"),
        F.when(sig.isNotNull(), F.lit(SCHEME)).alias("origin_scheme"),
        sig.alias("origin_sig"),
    )
    if history_key is None:
        return out
    return out.mapInArrow(_sealer(history_key), out.schema)


def _sealer(key: HistoryKey) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def seal(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        for batch in batches:
            if batch.num_rows == 0:
                yield batch
                continue
            sealed = key.seal_column(batch.column("group").to_pylist(), batch.column("publisher_did").to_pylist(),
                                     batch.column("message_id").to_pylist(), batch.column("payload").to_pylist())
            index = batch.schema.get_field_index("payload")
            arrays = list(batch.columns)
            arrays[index] = sealed
            yield pa.RecordBatch.from_arrays(arrays, schema=batch.schema)

    return seal


_WRITERS = "spark.sql.maxConcurrentOutputFileWriters"
_SKIP_EMPTY = "spark.databricks.delta.skipRecordingEmptyCommits"


def _write(df: DataFrame, table_path: str, options: Mapping[str, str], *, record_empty: bool = False) -> None:
    """One Delta append of history rows.

    A micro-batch spans a few (group, date) partitions, so each task writes them side by side
    instead of sorting its rows by partition first (Spark's default for partitioned writes); the
    session setting is restored after. ``record_empty``: commit (with its tag) even without rows,
    which Delta otherwise leaves out of the log.
    """
    spark = df.sparkSession
    previous = spark.conf.get(_WRITERS, "0")
    if previous == "0":
        spark.conf.set(_WRITERS, "16")
    skip_empty = spark.conf.get(_SKIP_EMPTY, None) if record_empty else None
    if record_empty:
        spark.conf.set(_SKIP_EMPTY, "false")
    try:
        writer = df.select(*HISTORY_COLUMNS).write.format("delta").mode("append")
        for key, value in options.items():
            writer = writer.option(key, value)
        writer.save(str(table_path))
    finally:
        if previous == "0":
            spark.conf.set(_WRITERS, previous)
        if record_empty:
            if skip_empty is None:
                spark.conf.unset(_SKIP_EMPTY)
            else:
                spark.conf.set(_SKIP_EMPTY, skip_empty)


def append_history(df: DataFrame, table_path: str, *, app_id: str, version: int, look: bool = True,
                   not_before_ms: int = 0, delta_txn: bool = False) -> bool:
    """Append history rows as the commit tagged (app_id, version), unless the table already holds it.

    Returns whether rows were written. ``look`` False skips the lookup, for a caller that knows this
    cannot be a repeat (the write right after its own previous one succeeded). ``not_before_ms``: no
    commit of this (app_id, version) can be older (when it was planned). When the table's log no
    longer reaches back that far (log retention), only rows whose (group, date, message_id) the
    table lacks are appended. ``delta_txn`` also passes Delta's ``txnAppId``/``txnVersion``, which
    Delta checks atomically with the commit (two live writers of one app cannot both commit a
    version) at the price of a rebuild of the table's state per commit.
    """
    return _append_history(df, table_path, app_id=app_id, version=version, look=look, not_before_ms=not_before_ms,
                           delta_txn=delta_txn)[0]


def _append_history(df: DataFrame, table_path: str, *, app_id: str, version: int, look: bool, not_before_ms: int,
                    delta_txn: bool, planned_ms: int | None = None) -> tuple[bool, int | None]:
    """append_history, and the newest batch of ``app_id`` the table holds when that is past ``version``.

    A table ahead of the batch being written means the checkpoint is behind the table (it was put
    back from an older copy): Spark re-plans batches the table already has, under the same ids but
    not necessarily over the same messages, so batch ids say nothing about which rows the table
    holds. Such a batch, up to and including the table's newest one, appends only the rows the table
    lacks, tagged as a catch-up (an empty commit if it lacks none: a restart meanwhile must still
    see the table ahead, or it would skip its re-planned batch of the table's newest id) and without
    Delta's txn options (which would drop the write of a lower version). ``planned_ms``: when Spark
    planned this batch (None or 0 if unknown), to tell a re-run of it from a batch planned anew under
    its id (a table commit of the batch older than the plan).
    """
    tag = commit_tag(app_id, version)
    options = {"userMetadata": tag}
    if delta_txn:
        options.update(txnAppId=app_id, txnVersion=str(int(version)))
    if not look:
        _write(df, str(table_path), options)
        return True, None
    found = last_tagged_batch(df.sparkSession, str(table_path), app_id, not_before_ms=not_before_ms)
    if found.batch is not None and (found.batch > version or (found.behind and found.batch == version)):
        log.warning("the history table %s holds batch %d of %s, and batch %d is being written: the checkpoint is "
                    "behind the table; appending only rows the table lacks until it catches up", table_path,
                    found.batch, app_id, version)
        append_new_rows_retrying(df, str(table_path), {"userMetadata": catch_up_tag(app_id, found.batch)},
                                 record_empty=True)
        return True, found.batch
    if found.batch is not None and found.batch == version:
        if not planned_ms or found.committed_ms is None or found.committed_ms >= planned_ms:
            # Committed by a run of this very plan (Spark re-runs a batch it did not record as done), by
            # the caller's own earlier call (append_history: it plans nothing), or the plan is unknown.
            return False, None
        # Committed before this plan of the batch: a checkpoint put back from a copy taken between two
        # batches (without this one's offsets file) plans it anew under the same id, over other and more
        # messages than the table's commit of it. Only the rows the table lacks, without Delta's txn
        # options (which would drop the write of a version it recorded).
        log.warning("the history table %s holds a commit of batch %d of %s from before Spark planned it this time: "
                    "appending only the rows the table lacks", table_path, version, app_id)
        append_new_rows_retrying(df, str(table_path), {"userMetadata": tag})
        return True, None
    if found.complete:
        _write(df, str(table_path), options)
    else:
        append_new_rows_retrying(df, str(table_path), options)
    return True, None


def append_new_rows(df: DataFrame, table_path: str, options: Mapping[str, str], *,
                    record_empty: bool = False) -> None:
    """Append only the rows whose (group, date, message_id) the table lacks (Delta writer ``options``).

    For when a commit log cannot tell whether rows were written: the batch is evaluated once
    (persisted), and the table is read only in the batch's (group, date) partitions. That read runs
    inside the append's Delta transaction (the anti-join is lazy), so a concurrent commit into those
    partitions fails this one (ConcurrentAppendException) rather than both appending the same rows.
    ``record_empty``: commit even when the table holds every row, for a tag that records progress.
    """
    from pyspark.sql import functions as F

    spark = df.sparkSession
    rows = df.persist()
    try:
        keys = rows.select("group", "date").distinct().collect()
        held = spark.read.format("delta").load(table_path)
        if keys:
            held = held.where(F.col("group").isin(sorted({k["group"] for k in keys}))
                              & F.col("date").isin(sorted({k["date"] for k in keys})))
        else:
            held = held.limit(0)
        _write(rows.join(held.select("group", "date", "message_id"), ["group", "date", "message_id"], "left_anti"),
               table_path, options, record_empty=record_empty)
    finally:
        rows.unpersist()


#: How many times an append of only the rows a table lacks is tried when concurrent commits into the
#: partitions it read make Delta refuse it (nothing was written then).
CONFLICT_ATTEMPTS = 8


def _concurrent_commit_errors() -> tuple[type[BaseException], ...]:
    """Delta's refusals of a commit that read what a concurrent commit changed (nothing was written)."""
    from delta.exceptions import ConcurrentAppendException, ConcurrentDeleteReadException

    return ConcurrentAppendException, ConcurrentDeleteReadException


def append_new_rows_retrying(df: DataFrame, table_path: str, options: Mapping[str, str], *,
                             record_empty: bool = False) -> None:
    """:func:`append_new_rows`, read again when a commit into the partitions it read (an ingest, a
    restore's sink, compact) made Delta refuse it: up to CONFLICT_ATTEMPTS times, backing off, then a
    HistoryWriteConflictError. Never writes a row twice: each attempt appends only what the table lacks then."""
    for attempt in range(CONFLICT_ATTEMPTS):
        try:
            append_new_rows(df, table_path, options, record_empty=record_empty)
            return
        except _concurrent_commit_errors() as exc:
            if attempt + 1 == CONFLICT_ATTEMPTS:
                raise HistoryWriteConflictError(
                    f"appending to the history table at {table_path} conflicted with other commits into the "
                    f"same partitions {CONFLICT_ATTEMPTS} times ({type(exc).__name__}); nothing was written") from None
            log.info("appending to %s conflicted with a concurrent commit (%s); reading the table again",
                     table_path, type(exc).__name__)
            time.sleep(min(0.2 * 2 ** attempt, 5.0))


def _our_commit(spark: SparkSession, table_path: str, tag: str) -> tuple[int | None, int]:
    """The version and row count of the commit tagged ``tag`` among the newest 16 (for on_batch: under
    more concurrent commits than that, a committed batch reports ``committed`` False)."""
    from delta.tables import DeltaTable

    for row in (DeltaTable.forPath(spark, table_path).history(16)
                .select("version", "userMetadata", "operationMetrics").collect()):
        if row["userMetadata"] == tag:
            return int(row["version"]), int((row["operationMetrics"] or {}).get("numOutputRows", 0))
    return None, 0


# --- the streaming query -----------------------------------------------------------------------


def _local_path(path: str) -> Path | None:
    """The local file a checkpoint path names (plain or file:), or None for an object store's."""
    local = path[len("file:"):] if path.startswith("file:") else path
    return None if "://" in local else Path(local)


def _read_text(spark: SparkSession, path: str) -> str:
    local = _local_path(path)
    if local is not None:
        return local.read_text(encoding="utf-8")
    return "\n".join(r[0] for r in spark.read.text(path).collect())  # an object store: let Hadoop read it


def _read_checkpoint_id(spark: SparkSession, checkpoint: str) -> str:
    """The streaming query's id, which Spark writes into ``<checkpoint>/metadata`` before batch 0."""
    meta = checkpoint.rstrip("/") + "/metadata"
    query_id = json.loads(_read_text(spark, meta).splitlines()[0]).get("id")
    if not isinstance(query_id, str) or not query_id:
        raise ConfigurationError(f"the checkpoint metadata {meta} names no query id")
    return query_id


def _batch_planned_ms(spark: SparkSession, checkpoint: str, batch_id: int) -> int:
    """When Spark planned this batch (``batchTimestampMs`` in ``<checkpoint>/offsets/<id>``, kept
    when the batch is re-run): no commit of it, or of a later batch, can be older. 0 (look at the
    whole log) if unknown.

    Taken from the file's content, not its modification time, so a copied checkpoint keeps it.
    """
    path = f"{checkpoint.rstrip('/')}/offsets/{int(batch_id)}"
    try:
        lines = _read_text(spark, path).splitlines()
        planned = json.loads(lines[1]).get("batchTimestampMs")
    except Exception as exc:  # noqa: BLE001 - only makes the lookup walk further back
        log.debug("no plan time for batch %d in %s (%s); the lookup reads the whole log", batch_id, path,
                  type(exc).__name__)
        return 0
    return int(planned) if isinstance(planned, int) and planned > 0 else 0


class HistoryWriter:
    """The ``foreachBatch`` function of the ingest query: idempotent appends to the history table.

    Each batch's commit is tagged with (query, batch id) (pipelines/commit_tags.py). A batch that
    follows the one this writer just wrote cannot be a replay and is appended straight away; any
    other (the first of a run, or after a failure) is first looked up in the table's log, and
    skipped if its commit is there. If the log no longer reaches back to the query's commits (it
    was cleaned while the query was down), only rows the table lacks are appended; so are batches
    up to the query's newest one in the table when the checkpoint is behind it (put back from an
    older copy). Also usable on its own with any streaming DataFrame of format("zerocomm")'s schema: the table
    is made (:func:`ensure_table`) on first use if it is not there.
    """

    def __init__(self, table_path: str, checkpoint: str, *, history_key: HistoryKey | None = None,
                 on_batch: Callable[[IngestBatch], None] | None = None, delta_txn: bool = False) -> None:
        self.delta_txn = delta_txn
        self.table_path = str(table_path)
        self.checkpoint = str(checkpoint)
        self.history_key = history_key
        self.on_batch = on_batch
        self._app_id: str | None = None
        self._last_written: int | None = None  # the batch this writer last wrote, to the end
        self._behind_until = -1  # the checkpoint is behind the table up to this batch: append only missing rows
        self._table_ready = False  # ensure_table ran (a writer used on its own makes its table)

    def app_id(self, spark: SparkSession) -> str:
        if self._app_id is None:
            self._app_id = "zerocomm-history-" + _read_checkpoint_id(spark, self.checkpoint)
        return self._app_id

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        spark = df.sparkSession
        began = time.monotonic()
        app_id = self.app_id(spark)
        if not self._table_ready:
            ensure_table(spark, self.table_path)
            self._table_ready = True
        tag = commit_tag(app_id, batch_id)
        follows = self._last_written is not None and batch_id == self._last_written + 1
        self._last_written = None  # until this batch is written to the end: a failure makes the next one look
        rows = to_history(df, history_key=self.history_key)
        if batch_id <= self._behind_until:  # catching up with a table ahead of the checkpoint
            tag = catch_up_tag(app_id, self._behind_until)
            append_new_rows_retrying(rows, self.table_path, {"userMetadata": tag}, record_empty=True)
            committed = True
        else:
            # How far back the lookup must go: no commit of this batch, or of any later one, is older
            # than the plan of the batch before it, whichever run planned that one (batches are
            # planned in order; a checkpoint put back from an older copy keeps its last batch's file,
            # while the batch that follows is planned anew, later than the table's commits of it).
            planned_ms = 0 if follows else _batch_planned_ms(spark, self.checkpoint, max(batch_id - 1, 0))
            this_plan = 0 if follows else _batch_planned_ms(spark, self.checkpoint, batch_id)
            committed, ahead = _append_history(rows, self.table_path, app_id=app_id, version=batch_id,
                                               look=not follows, not_before_ms=planned_ms, delta_txn=self.delta_txn,
                                               planned_ms=this_plan)
            if ahead is not None:
                self._behind_until = ahead
                tag = catch_up_tag(app_id, ahead)
        self._last_written = batch_id
        wrote = time.monotonic()
        log.debug("history batch %d %s in %.3fs", batch_id, "written" if committed else "skipped", wrote - began)
        if self.on_batch is not None:
            # Delta's guard may still skip a looked-up write: committed is whether our commit is there.
            version, count = _our_commit(spark, self.table_path, tag) if committed else (None, 0)
            self.on_batch(IngestBatch(batch_id, version is not None, count, version, time.monotonic() - began))


def _source_options(groups: Sequence[str], *, agent: str | None, starting_offsets: str,
                    max_messages_per_trigger: int | None, source_options: Mapping[str, str] | None) -> dict[str, str]:
    options = {"group": ",".join(groups), "includeHeaders": "true", "startingOffsets": starting_offsets}
    if agent is not None:
        options["agent"] = str(agent)
    if max_messages_per_trigger is not None:
        options["maxMessagesPerTrigger"] = str(max_messages_per_trigger)
    options.update(source_options or {})
    return options


def _source(spark: SparkSession, options: Mapping[str, str]) -> DataFrame:
    from zerocomm_spark.connector import register

    register(spark)
    reader = spark.readStream.format("zerocomm")
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _check_member(options: Mapping[str, str]) -> None:
    """Ask the member (one call, on this driver as the source will) whether it is in every group: a
    group it is not in would otherwise fail the query only once running, at awaitTermination."""
    from zerocomm_spark.connector.agent_link import MemberLink
    from zerocomm_spark.connector.options import SourceOptions

    parsed = SourceOptions.parse(options, mode="stream")
    with MemberLink.connect(parsed.agent) as link:
        link.check_groups(parsed.groups)


def _last_committed_batch(checkpoint: str) -> int | None:
    """The newest batch id in ``<checkpoint>/commits`` (a local checkpoint), or None."""
    local = _local_path(checkpoint)
    if local is None:
        return None
    try:
        names = [p.name for p in (local / "commits").iterdir()]
    except OSError:
        return None
    ids = [int(name) for name in names if name.isdigit()]
    return max(ids) if ids else None


def release_checkpointed(spark: SparkSession, groups: str | Sequence[str], checkpoint: str, *,
                         agent: str | None = None) -> int | None:
    """Tell the member's journal that everything an ingest run checkpointed was consumed.

    Spark tells a source that a micro-batch is checkpointed only when it starts the next one, so the
    last batch of a run that stopped (``trigger="available_now"`` or ``"once"``, or ``stop()``) stays
    held by the journal's retention until the next run (or ``journal.consumer_expiry``): call this
    once the query stopped. It commits what the checkpoint's commit log says is done, as Spark's
    next batch would, never more. Returns the journal offset committed, or None (nothing to move, a
    checkpoint on an object store, which this does not list, or a query with several zerocomm
    sources, whose groups the checkpoint does not say).
    """
    from zerocomm_spark.connector.agent_link import MemberLink
    from zerocomm_spark.connector.offsets import ZeroCommOffset
    from zerocomm_spark.connector.options import SourceOptions

    batch = _last_committed_batch(checkpoint)
    if batch is None:
        return None
    lines = _read_text(spark, f"{checkpoint.rstrip('/')}/offsets/{batch}").splitlines()
    ends: list[ZeroCommOffset] = []
    for line in lines[2:]:  # "v1", the batch's metadata, then one offset per source (ingest reads one)
        try:
            end = ZeroCommOffset.from_json(line)
        except ZeroCommError:  # another source's offset (or "-", a source that has none yet)
            continue
        ends.append(end)
    # Several zerocomm sources: which groups each reads is not in the checkpoint. One checkpointed
    # before queries were named: the next run commits it.
    if len(ends) != 1 or ends[0].consumer is None:
        return None
    names = [groups] if isinstance(groups, str) else list(groups)
    parsed = SourceOptions.parse(_source_options(names, agent=agent, starting_offsets="earliest",
                                                 max_messages_per_trigger=None, source_options=None), mode="stream")
    with MemberLink.connect(parsed.agent) as link:
        return link.commit(ends[0], parsed.groups)


def ingest(spark: SparkSession, groups: str | Sequence[str], table_path: str, checkpoint: str, *,
           agent: str | None = None, starting_offsets: str = "earliest", max_messages_per_trigger: int | None = None,
           trigger: str = "1 second", history_key: HistoryKey | None = None, query_name: str | None = None,
           on_batch: Callable[[IngestBatch], None] | None = None, delta_txn: bool = False,
           source_options: Mapping[str, str] | None = None) -> StreamingQuery:
    """Start the streaming query that persists ``groups`` into the history table; returns it running.

    ``agent`` is the member to read through (format("zerocomm")'s agent option: socket directory,
    ipc:// endpoint or zerocomm.toml). ``trigger`` is a processing-time interval ("1 second"),
    ``"available_now"`` (everything there now, then stop; then call :func:`release_checkpointed`, or
    the run's last batch stays held in the member's journal until the next run) or ``"once"``.
    ``history_key`` stores payloads sealed instead of in clear. ``on_batch`` hears what each micro-batch did. ``delta_txn``
    adds Delta's own idempotence check to every commit (guards against two live runs of one
    checkpoint; costs a state rebuild per micro-batch). The member is asked before the query starts:
    a group it is not in raises GroupNotFoundError here, not later from the running query.
    """
    names = [groups] if isinstance(groups, str) else list(groups)
    if not names:
        raise ConfigurationError("ingest needs at least one group")
    table = str(table_path)
    options = _source_options(names, agent=agent, starting_offsets=starting_offsets,
                              max_messages_per_trigger=max_messages_per_trigger, source_options=source_options)
    stream = _source(spark, options)
    writer = HistoryWriter(table, str(checkpoint), history_key=history_key, on_batch=on_batch, delta_txn=delta_txn)
    query = stream.writeStream.foreachBatch(writer).option("checkpointLocation", str(checkpoint))
    if query_name:
        query = query.queryName(query_name)
    if trigger == "available_now":
        query = query.trigger(availableNow=True)
    elif trigger == "once":
        query = query.trigger(once=True)
    elif trigger:
        from pyspark.errors import IllegalArgumentException

        try:
            query = query.trigger(processingTime=trigger)
        except IllegalArgumentException:
            raise ConfigurationError(f"trigger={trigger!r} is not an interval",
                                     hint='Give an interval like "1 second" or "500 milliseconds", or '
                                          '"available_now" or "once"') from None
    sealed = sealed_groups(spark, table, names) if history_key is None and table_exists(spark, table) else []
    if sealed:
        raise ConfigurationError(
            f"the history table at {table} holds sealed rows of {', '.join(map(repr, sealed))}: refusing to ingest "
            "their payloads there in clear",
            hint="Give the groups' history key (ingest(..., history_key=key), or --history-key-file FILE), or another "
                 "--table")
    _check_member(options)
    ensure_table(spark, table)
    return query.start()


def sealed_groups(spark: SparkSession, table_path: str, groups: Sequence[str]) -> list[str]:
    """Those of ``groups`` the history table holds rows of with payloads sealed under a history key: a
    writer without the key must not add payloads in clear beside them (one forgotten flag would leave
    part of a table meant to be encrypted in clear)."""
    from pyspark.sql import functions as F

    held = (spark.read.format("delta").load(str(table_path))
            .where(F.col("group").isin(sorted(set(groups))) & F.col("payload_key_id").isNotNull()))
    return sorted(r[0] for r in held.select("group").distinct().collect())


# --- upkeep ------------------------------------------------------------------------------------


def _where(group: str | None, since_date: str | None) -> str | None:
    parts = []
    if group is not None:
        parts.append("`group` = '" + group.replace("\\", "\\\\").replace("'", "\\'") + "'")
    if since_date is not None:
        try:  # into SQL as a checked date, never as the text given
            day = date.fromisoformat(since_date) if isinstance(since_date, str) else None
        except ValueError:
            day = None
        if day is None:
            raise ConfigurationError(f"since_date is a date like 2026-01-31, not {since_date!r}")
        parts.append(f"`date` >= DATE '{day.isoformat()}'")
    return " AND ".join(parts) or None


def compact(spark: SparkSession, table_path: str, *, group: str | None = None, since_date: str | None = None,
            zorder_by_lamport: bool = False) -> dict[str, Any]:
    """OPTIMIZE: merge the small files micro-batches leave (per group and date); returns Delta's metrics.

    ``zorder_by_lamport`` also clusters rows by Lamport time, which speeds up ``since=lamport``
    replays on large partitions at the cost of rewriting them.
    """
    from delta.tables import DeltaTable

    require_history_table(spark, str(table_path))
    builder = DeltaTable.forPath(spark, str(table_path)).optimize()
    where = _where(group, since_date)
    if where:
        builder = builder.where(where)
    result = builder.executeZOrderBy("lamport_ts") if zorder_by_lamport else builder.executeCompaction()
    row = result.first()
    metrics = row["metrics"].asDict(recursive=True) if row is not None and row["metrics"] is not None else {}
    keep = ("numFilesAdded", "numFilesRemoved", "totalConsideredFiles", "totalFilesSkipped", "numBatches")
    return {k: metrics[k] for k in keep if k in metrics}


#: A century: any retention beyond it keeps every file, and Delta counts it in milliseconds (a long).
_MAX_RETENTION_HOURS = 876_000


def vacuum(spark: SparkSession, table_path: str, *, retention_hours: float | None = None,
           dry_run: bool = False) -> int:
    """VACUUM: delete data files no version within the retention needs; returns how many (would) go.

    The default retention is the table's ``delta.deletedFileRetentionDuration`` (7 days): time
    travel within it keeps working. A shorter ``retention_hours`` breaks time travel to older
    versions and is refused by Delta's safety check, which this lifts only for that call.
    """
    require_history_table(spark, str(table_path))
    if retention_hours is not None and (isinstance(retention_hours, bool)
                                        or not isinstance(retention_hours, (int, float))
                                        or not 0 <= retention_hours <= _MAX_RETENTION_HOURS):
        # inf (or a number past a long of milliseconds) reached VACUUM's SQL as a syntax error
        raise ConfigurationError(f"retention_hours is a number of hours from 0 to {_MAX_RETENTION_HOURS}, "
                                 f"not {retention_hours!r}",
                                 hint="Leave it out to keep the table's own retention (7 days)")
    table = str(table_path).replace("`", "``")
    retain = "" if retention_hours is None else f" RETAIN {float(retention_hours)} HOURS"
    check = "spark.databricks.delta.retentionDurationCheck.enabled"
    # Delta lists the table with this many tasks (10 000 by default): minutes of empty tasks on a laptop.
    listing = "spark.sql.sources.parallelPartitionDiscovery.parallelism"
    saved = {name: spark.conf.get(name, None) for name in (check, listing)}
    if retention_hours is not None and retention_hours < 168:
        spark.conf.set(check, "false")
    spark.conf.set(listing, str(max(spark.sparkContext.defaultParallelism * 4, 8)))
    try:
        files = spark.sql(f"VACUUM delta.`{table}`{retain} DRY RUN").count()
        if not dry_run and files:
            spark.sql(f"VACUUM delta.`{table}`{retain}").collect()
    finally:
        for name, value in saved.items():
            if value is None:
                spark.conf.unset(name)
            else:
                spark.conf.set(name, value)
    return int(files)
