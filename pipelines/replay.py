"""Replay a group's history from Delta: in causal order, from a point, as it was, or as a stream.

```python
from zerocomm_spark.pipelines.replay import Since, replay
df = replay(spark, "/lake/history", "sensors")                          # everything, causal order
df = replay(spark, "/lake/history", "sensors", since=Since.lamport(1200))  # what came after
df = replay(spark, "/lake/history", "sensors", as_of=3)                  # the table at version 3
stream = replay(spark, "/lake/history", "sensors", stream=True)          # re-streamed
```

Why (lamport_ts, publisher_did): every member ticks its Lamport clock before publishing and
observes every timestamp it delivers, so a reply always carries a larger timestamp than the message
it answers, on any member's history; ties are concurrent messages, broken by DID the same way
everywhere. Sorting by it is the one order all members' histories agree on. ``seq`` comes last, for
a publisher whose clock restarted (a member restarted before it observed anything) or saturated:
its own messages then tie, and stay in the order it published them.

Three meanings of "since", kept apart so an int is never ambiguous:

* ``Since.version(v)``: rows *committed* at Delta version ``v`` or later (the change data feed),
  which is how an incremental consumer follows the table;
* ``Since.timestamp(t)`` (or a datetime): rows *sent* at or after ``t`` (partitions before ``t``'s
  date are pruned);
* ``Since.lamport(n)``: rows with ``lamport_ts >= n``: everything causally at or after a point.

``as_of`` (a version or a timestamp) time-travels: the table as it was then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

from zerocomm_spark.errors import ConfigurationError, TamperedEnvelopeError
from zerocomm_spark.pipelines.schema import HISTORY_COLUMNS

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, SparkSession

    from zerocomm_spark.pipelines.history_key import HistoryKey

__all__ = ["CAUSAL_ORDER", "Since", "causal_order", "open_payloads", "replay", "with_origin_check"]

#: seq last: a publisher's messages never tie on Lamport time unless its clock was reset (a member
#: restarted before it observed anything) or saturated; its own FIFO order then still holds.
CAUSAL_ORDER = ("lamport_ts", "publisher_did", "seq")
#: Delta versions, seqs and Lamport times are Spark longs: a larger int reached Spark as a Py4J or Delta error.
LONG_MAX = 2**63 - 1


@dataclass(frozen=True)
class Since:
    """Where a replay starts: a Delta version, a send time, or a Lamport time (see the module doc)."""

    kind: Literal["version", "timestamp", "lamport"]
    value: int | datetime

    @classmethod
    def version(cls, version: int) -> "Since":
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= LONG_MAX:
            raise ConfigurationError(f"a Delta version is an int from 0 to 2**63-1, not {version!r}")
        return cls("version", version)

    @classmethod
    def timestamp(cls, when: datetime | str) -> "Since":
        return cls("timestamp", _aware(when))

    @classmethod
    def lamport(cls, lamport_ts: int) -> "Since":
        if isinstance(lamport_ts, bool) or not isinstance(lamport_ts, int) or not 0 <= lamport_ts <= LONG_MAX:
            raise ConfigurationError(f"a Lamport time is an int from 0 to 2**63-1, not {lamport_ts!r}")
        return cls("lamport", lamport_ts)


def _aware(when: datetime | str) -> datetime:
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            raise ConfigurationError(f"{when!r} is not an ISO 8601 time") from None
    if not isinstance(when, datetime):
        raise ConfigurationError(f"a time is a datetime or an ISO 8601 string, not {type(when).__name__}")
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def _since(since: Since | datetime | str | None) -> Since | None:
    if since is None or isinstance(since, Since):
        return since
    if isinstance(since, (datetime, str)):
        return Since.timestamp(since)
    raise ConfigurationError(
        f"since={since!r} is ambiguous",
        hint="Say which: Since.version(v), Since.timestamp(t) (or a datetime), or Since.lamport(n)")


def causal_order(df: DataFrame) -> DataFrame:
    """``df`` sorted by (lamport_ts, publisher_did, seq): the order every member agrees on."""
    return df.orderBy(*CAUSAL_ORDER)


def _group_filter(group: str | None) -> Column | None:
    from pyspark.sql import functions as F

    return None if group is None else F.col("group") == F.lit(group)


def latest_version(spark: SparkSession, path: str) -> int:
    """The table's newest Delta version."""
    from delta.tables import DeltaTable

    return int(DeltaTable.forPath(spark, path).history(1).select("version").first()[0])


def replay(spark: SparkSession, table: str, group: str | None = None, *,
           since: Since | datetime | str | None = None, as_of: int | datetime | str | None = None,
           until_lamport: int | None = None, history_key: HistoryKey | None = None, verify: bool = False,
           stream: bool = False, ordered: bool = True) -> DataFrame:
    """A group's history (every group's if None) from the Delta table at ``table``.

    Batch reads are sorted causally unless ``ordered=False``. ``stream=True`` returns a streaming
    DataFrame (readStream on Delta, from ``Since.version`` or the start) that Spark cannot sort
    as a whole: sort each micro-batch (``causal_order`` in ``foreachBatch``). ``history_key``
    opens sealed payloads; ``verify`` adds an ``origin_ok`` column (pipelines/origin.py).
    """
    from pyspark.sql import functions as F

    from zerocomm_spark.pipelines.history import require_history_table

    start = _since(since)
    path = str(table)
    if until_lamport is not None and (isinstance(until_lamport, bool) or not isinstance(until_lamport, int)
                                      or abs(until_lamport) > LONG_MAX):
        raise ConfigurationError(f"until_lamport is an int (a Lamport time, at most 2**63-1), not {until_lamport!r}")
    if isinstance(as_of, int) and not isinstance(as_of, bool) and as_of > LONG_MAX:
        raise ConfigurationError(f"as_of={as_of} is no Delta version (at most 2**63-1)",
                                 hint="Give a version between 0 and the newest (DESCRIBE HISTORY delta.`<table>`)")
    if (start is not None and start.kind == "version" and isinstance(as_of, int) and not isinstance(as_of, bool)
            and as_of < int(start.value)):
        raise ConfigurationError(f"as_of={as_of} is before since=Since.version({start.value}): nothing to replay",
                                 hint="as_of ends a Since.version replay; give a version at or after its start")
    require_history_table(spark, path)
    if stream:
        if as_of is not None:
            raise ConfigurationError("as_of time-travels a batch read; a stream starts from Since.version(v)")
        reader = spark.readStream.format("delta")
        if start is not None and start.kind == "version":
            newest = latest_version(spark, path)
            if start.value > newest:
                # Delta refuses to start a stream past the newest version (a follower that is caught up):
                # start at the newest, which exists, and keep only the commits from the one asked for.
                df = (reader.option("readChangeFeed", "true").option("startingVersion", str(newest)).load(path)
                      .where((F.col("_commit_version") >= F.lit(start.value)) & (F.col("_change_type") == "insert")))
            else:
                df = reader.option("startingVersion", str(start.value)).load(path)
        else:
            df = reader.load(path)
    elif start is not None and start.kind == "version":
        reader = (spark.read.format("delta").option("readChangeFeed", "true")
                  .option("startingVersion", str(start.value)))
        if as_of is not None:
            if isinstance(as_of, int) and not isinstance(as_of, bool):
                reader = reader.option("endingVersion", str(as_of))
            else:
                reader = reader.option("endingTimestamp", _aware(as_of).isoformat())
        if start.value > latest_version(spark, path):  # nothing since: Delta would refuse the start
            df = spark.read.format("delta").load(path).where(F.lit(False))
        else:
            df = _time_travel(reader, path, as_of) if as_of is not None else reader.load(path)
            _check_change_feed(df, path, int(start.value))
            df = df.where(F.col("_change_type") == "insert")
    else:
        reader = spark.read.format("delta")
        if as_of is not None:
            if isinstance(as_of, int) and not isinstance(as_of, bool):
                reader = reader.option("versionAsOf", str(as_of))
            else:
                reader = reader.option("timestampAsOf", _aware(as_of).isoformat())
        df = _time_travel(reader, path, as_of) if as_of is not None else reader.load(path)
    condition = _group_filter(group)
    if condition is not None:
        df = df.where(condition)
    if start is not None and start.kind == "timestamp":
        assert isinstance(start.value, datetime)
        moment = start.value.astimezone(timezone.utc)
        df = df.where((F.col("date") >= F.lit(date(moment.year, moment.month, moment.day)))
                      & (F.col("sent_at") >= F.lit(moment)))
    elif start is not None and start.kind == "lamport":
        df = df.where(F.col("lamport_ts") >= F.lit(start.value))
    if until_lamport is not None:
        df = df.where(F.col("lamport_ts") <= F.lit(until_lamport))
    df = df.select(*HISTORY_COLUMNS)
    if verify:
        df = with_origin_check(df, history_key)
    elif history_key is not None:
        df = open_payloads(df, history_key)
    if ordered and not stream:
        df = causal_order(df)
    return df


def _delta_reason(text: str, fallback: str) -> str:
    """The first line of Delta's message (error class, versions; never row data), for ours."""
    return text.strip().splitlines()[0][:300] if text.strip() else fallback


def _check_change_feed(df: DataFrame, path: str, start: int) -> None:
    """Plan a change-data-feed read now: a start before the table recorded its change data fails
    only at planning, otherwise the user's first action, as Delta's AnalysisException. Planning
    lists the range's files from the log; no data is read."""
    from pyspark.errors import AnalysisException

    jdf = getattr(df, "_jdf", None)
    if jdf is None:  # Spark Connect: no plan to ask for here; Delta says it at the first action
        return
    try:
        jdf.queryExecution().executedPlan()
    except AnalysisException as exc:
        text = str(exc)
        if not any(mark in text for mark in ("DELTA_MISSING_CHANGE_DATA", "DELTA_VERSION_NOT_FOUND",
                                             "DELTA_CHANGE_DATA_FILE_NOT_FOUND", "change data was not recorded")):
            raise
        raise ConfigurationError(
            f"the history table at {path} has no change data feed from version {start} on "
            f"({_delta_reason(text, type(exc).__name__)})",
            hint="Start Since.version at or after the version its change data feed was enabled at and still "
                 "keeps (DESCRIBE HISTORY delta.`<table>` shows both), or replay without since, or with "
                 "Since.timestamp or Since.lamport, which read the table itself") from None


def _time_travel(reader: Any, path: str, as_of: int | datetime | str) -> DataFrame:
    """The table as of ``as_of``; a version or time the table does not have is a ConfigurationError
    saying which it has, not Delta's AnalysisException."""
    from pyspark.errors import AnalysisException

    try:
        return reader.load(path)
    except AnalysisException as exc:
        text = str(exc)
        if not any(mark in text for mark in ("DELTA_TIMESTAMP", "DELTA_VERSION", "time travel", "Cannot time travel",
                                             "DELTA_CANNOT_TIME_TRAVEL")):
            raise
        first = _delta_reason(text, type(exc).__name__)
        raise ConfigurationError(
            f"the history table at {path} has no version as of {as_of!r} ({first})",
            hint="Give a version between 0 and the newest, or a time between the first and the newest commit "
                 "(DESCRIBE HISTORY delta.`<table>` lists them; vacuum removes old versions' files)") from None


# --- payloads and origins, a whole Arrow batch at a time ----------------------------------------


def _opener(key: HistoryKey | None, check: bool) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        from zerocomm_spark.pipelines.origin import text_column, verify_rows

        for batch in batches:
            n = batch.num_rows
            names = batch.schema.names
            # Text that is not UTF-8 (a damaged or hostile table) fails its row, not the whole replay.
            groups, bad_group = text_column(batch.column("group"))
            dids, bad_did = text_column(batch.column("publisher_did"))
            ids, bad_id = text_column(batch.column("message_id"))
            payloads = batch.column("payload").to_pylist()
            key_ids, _ = text_column(batch.column("payload_key_id"), "replace")  # then no key's id: left sealed
            opened: list[bytes | None] = list(payloads)
            clear_ids: list[str | None] = list(key_ids)
            # A null payload (NOT NULL in the table) is no message: not the empty one its signature may cover.
            failed = [payloads[i] is None or bad_group[i] or bad_did[i] or bad_id[i] for i in range(n)]
            for i in range(n):
                if key_ids[i] is None:
                    continue
                if key is None or key_ids[i] != key.key_id:
                    failed[i] = True  # sealed with a key we do not have: left sealed
                    continue
                try:
                    opened[i] = key.open(payloads[i], groups[i], dids[i], ids[i])
                    clear_ids[i] = None
                except (TamperedEnvelopeError, TypeError, ValueError):
                    failed[i] = True  # altered or moved to another row: left sealed, never a failed job
            arrays = list(batch.columns)
            arrays[names.index("payload")] = pa.array(opened, type=pa.binary())
            arrays[names.index("payload_key_id")] = pa.array(clear_ids, type=pa.string())
            fields = list(batch.schema)
            if check:
                table = pa.Table.from_batches([batch])
                ok = verify_rows(table, payload=[b"" if p is None else p for p in opened], threads=1)
                arrays.append(pa.array([good and not bad for good, bad in zip(ok, failed)], type=pa.bool_()))
                fields.append(pa.field("origin_ok", pa.bool_(), nullable=False))
            yield pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))

    return run


def open_payloads(df: DataFrame, key: HistoryKey) -> DataFrame:
    """Sealed payloads (of this key) in clear; rows of other keys, and rows whose payload does not open
    with it (altered, or moved from another row), stay sealed (``payload_key_id`` set)."""
    return df.mapInArrow(_opener(key, False), df.schema)


def with_origin_check(df: DataFrame, key: HistoryKey | None = None) -> DataFrame:
    """Add ``origin_ok``: the row's origin proof verifies (after opening its payload, if sealed)."""
    from pyspark.sql.types import BooleanType, StructField, StructType

    schema = StructType(list(df.schema.fields) + [StructField("origin_ok", BooleanType(), False)])
    return df.mapInArrow(_opener(key, True), schema)
