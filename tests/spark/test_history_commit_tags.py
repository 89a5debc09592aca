"""The history writer's idempotence, batch by batch, on real Delta tables (no streaming query needed).

What is at stake: the first batch of a run may be one an earlier run already committed (Spark re-runs
the last batch it had not checkpointed); it must be found in the table's log and skipped, and when
the log no longer reaches back that far only missing rows may be appended.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from pyspark.sql import functions as F

from zerocomm_spark.connector import source_schema
from zerocomm_spark.pipelines.commit_tags import commit_tag, last_tagged_batch, parse_tag
from zerocomm_spark.pipelines.history import HistoryWriter, IngestBatch, ensure_table

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


def source_rows(spark, ids: list[str]):
    """A DataFrame as format("zerocomm") gives it (with headers), one message per id."""
    sent = dt.datetime(2026, 11, 23, 12, 0, 0)
    rows = [{"group": "g", "message_id": mid, "publisher_did": "did:key:zAlice", "seq": i + 1,
             "lamport_ts": i + 1, "sent_at": sent, "received_at": sent, "headers": {}, "payload": mid.encode()}
            for i, mid in enumerate(ids)]
    schema = source_schema(include_headers=True)
    full = [{f.name: r.get(f.name) for f in schema.fields} for r in rows]
    return spark.createDataFrame(full, schema)


def checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory as Spark leaves it before batch 0 (its metadata names the query)."""
    ck = tmp_path / f"ck-{uuid.uuid4().hex[:6]}"
    ck.mkdir()
    (ck / "metadata").write_text(json.dumps({"id": str(uuid.uuid4())}) + "\n")
    return ck


def plan(ck: Path, batch_id: int, planned: dt.datetime) -> None:
    """Spark's offset log entry for a batch, as written when the batch is planned."""
    (ck / "offsets").mkdir(exist_ok=True)
    meta = {"batchWatermarkMs": 0, "batchTimestampMs": int(planned.timestamp() * 1000), "conf": {}}
    (ck / "offsets" / str(batch_id)).write_text("v1\n" + json.dumps(meta) + "\n{}\n")


def txn_actions(table: Path) -> list[dict]:
    """Delta's SetTransaction actions in the table's log."""
    found = []
    for path in sorted((table / "_delta_log").glob("*.json")):
        found += [json.loads(line)["txn"] for line in path.read_text().splitlines() if '"txn"' in line]
    return found


def table_ids(spark, table: Path) -> list[str]:
    return [r[0] for r in spark.read.format("delta").load(str(table)).select("message_id").collect()]


def test_tags_name_the_app_and_batch():
    assert parse_tag(commit_tag("zerocomm-history-q1", 7), "zerocomm-history-q1") == 7
    assert parse_tag("zerocomm-history-q1:7", "zerocomm-history-q") is None  # a prefix is not the app
    assert parse_tag("zerocomm-history-q1:x", "zerocomm-history-q1") is None
    assert parse_tag(None, "a") is None


def test_a_replayed_first_batch_is_skipped_and_the_next_written(spark, tmp_path):
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    seen: list[IngestBatch] = []
    first = HistoryWriter(str(table), str(ck), on_batch=seen.append)
    ensure_table(spark, str(table))
    first(source_rows(spark, ["a", "b"]), 0)
    first(source_rows(spark, ["c"]), 1)
    # Another query's commits on top do not hide ours.
    other = HistoryWriter(str(table), str(checkpoint(tmp_path)))
    other(source_rows(spark, ["x"]), 0)

    # A restart: a new writer (same checkpoint) is handed batch 1 again, then batch 2.
    again = HistoryWriter(str(table), str(ck), on_batch=seen.append)
    again(source_rows(spark, ["c"]), 1)
    again(source_rows(spark, ["d"]), 2)
    assert [(b.batch_id, b.committed, b.rows) for b in seen] == [(0, True, 2), (1, True, 1), (1, False, 0),
                                                                 (2, True, 1)]
    assert sorted(table_ids(spark, table)) == ["a", "b", "c", "d", "x"]
    assert last_tagged_batch(spark, str(table), first.app_id(spark)).batch == 2
    assert not txn_actions(table)  # Delta's own check (a state rebuild per commit) was not asked for


def test_delta_txn_puts_deltas_own_check_on_every_commit(spark, tmp_path):
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    ensure_table(spark, str(table))
    writer = HistoryWriter(str(table), str(ck), delta_txn=True)
    writer(source_rows(spark, ["a"]), 0)
    writer(source_rows(spark, ["b"]), 1)
    assert sorted(t["version"] for t in txn_actions(table) if t["appId"] == writer.app_id(spark)) == [0, 1]
    # A second live run that missed the lookup (it ran before the first committed) is stopped by Delta.
    from zerocomm_spark.pipelines.history import append_history, to_history

    append_history(to_history(source_rows(spark, ["b"])), str(table), app_id=writer.app_id(spark), version=1,
                   look=False, delta_txn=True)
    assert sorted(table_ids(spark, table)) == ["a", "b"]


def test_the_cut_off_is_when_spark_planned_the_batch_not_a_file_time(spark, tmp_path):
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    ensure_table(spark, str(table))
    plan(ck, 0, dt.datetime.now() - dt.timedelta(seconds=30))
    HistoryWriter(str(table), str(ck))(source_rows(spark, ["a"]), 0)
    # The checkpoint was copied a day later (its files' times are new); batch 0 is re-run.
    later = (dt.datetime.now() + dt.timedelta(days=1)).timestamp()
    for path in [ck / "metadata", ck / "offsets" / "0"]:
        os.utime(path, (later, later))
    seen: list[IngestBatch] = []
    HistoryWriter(str(table), str(ck), on_batch=seen.append)(source_rows(spark, ["a"]), 0)
    assert [(b.batch_id, b.committed) for b in seen] == [(0, False)]
    assert table_ids(spark, table) == ["a"]


def test_a_failed_write_makes_the_same_writer_look_again(spark, tmp_path):
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    seen: list[IngestBatch] = []

    def fail_once(batch: IngestBatch) -> None:
        seen.append(batch)
        if len(seen) == 1:
            raise RuntimeError("the driver fails right after the commit")

    writer = HistoryWriter(str(table), str(ck), on_batch=fail_once)
    ensure_table(spark, str(table))
    with pytest.raises(RuntimeError):
        writer(source_rows(spark, ["a"]), 0)
    writer(source_rows(spark, ["a"]), 0)  # Spark re-runs batch 0 on the same writer
    writer(source_rows(spark, ["b"]), 1)
    assert [(b.batch_id, b.committed) for b in seen] == [(0, True), (0, False), (1, True)]
    assert sorted(table_ids(spark, table)) == ["a", "b"]


def test_a_query_newer_than_every_commit_stops_looking_early(spark, tmp_path):
    table = tmp_path / "t"
    ensure_table(spark, str(table))
    HistoryWriter(str(table), str(checkpoint(tmp_path)))(source_rows(spark, ["a"]), 0)
    future_ms = int((dt.datetime.now() + dt.timedelta(days=1)).timestamp() * 1000)
    found = last_tagged_batch(spark, str(table), "zerocomm-history-nobody", not_before_ms=future_ms)
    assert (found.batch, found.complete) == (None, True)


def test_when_the_log_was_cleaned_only_missing_rows_are_appended(spark, tmp_path):
    from zerocomm_spark.pipelines.history import append_new_rows, to_history

    table, ck = tmp_path / "t", checkpoint(tmp_path)
    ensure_table(spark, str(table))
    spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES ('delta.checkpointInterval' = '2')")
    writer = HistoryWriter(str(table), str(ck))
    writer(source_rows(spark, ["a"]), 0)
    writer(source_rows(spark, ["b", "c"]), 1)
    others = HistoryWriter(str(table), str(checkpoint(tmp_path)))
    for i in range(4):
        others(source_rows(spark, [f"o{i}"]), i)
    # Log retention removed every commit up to the last checkpoint, ours among them.
    log_dir = table / "_delta_log"
    last_checkpoint = json.loads((log_dir / "_last_checkpoint").read_text())["version"]
    for version in range(last_checkpoint):
        for suffix in (".json", ".crc"):
            (log_dir / f"{version:020d}{suffix}").unlink(missing_ok=True)
    found = last_tagged_batch(spark, str(table), writer.app_id(spark))
    assert (found.batch, found.complete) == (None, False)

    # Spark re-runs batch 1; the log can no longer tell.
    seen: list[IngestBatch] = []
    restarted = HistoryWriter(str(table), str(ck), on_batch=seen.append)
    restarted(source_rows(spark, ["b", "c"]), 1)
    assert [(b.batch_id, b.rows) for b in seen] == [(1, 0)]
    ids = table_ids(spark, table)
    assert sorted(ids) == ["a", "b", "c", "o0", "o1", "o2", "o3"]
    # The rule itself: of rows partly in the table, only the missing ones go in.
    append_new_rows(to_history(source_rows(spark, ["c", "d"])), str(table), {"userMetadata": "test:0"})
    ids = table_ids(spark, table)
    assert sorted(ids) == ["a", "b", "c", "d", "o0", "o1", "o2", "o3"]


def test_a_restore_delivery_retried_after_a_failure_is_not_written_twice(spark, tmp_path, monkeypatch):
    from zerocomm_spark.pipelines import history
    from zerocomm_spark.pipelines.restore import DeltaSink
    from zerocomm_spark.pipelines.schema import HISTORY_COLUMNS

    real_write = history._write

    def commit_then_fail(*args, **kwargs):
        real_write(*args, **kwargs)
        raise ConnectionError("the driver lost its connection right after the commit")

    def rows_of(ids: list[str]):
        return history.to_history(source_rows(spark, ids)).select(*HISTORY_COLUMNS).toArrow()

    sink = DeltaSink(spark, str(tmp_path / "restored"))
    monkeypatch.setattr(history, "_write", commit_then_fail)
    with pytest.raises(ConnectionError):
        sink(rows_of(["a", "b"]))
    monkeypatch.setattr(history, "_write", real_write)
    sink(rows_of(["a", "b"]))  # the caller retries the delivery: nothing is written twice
    sink(rows_of(["c"]))
    # A failed delivery followed by a different one (the caller moved on): that one is not lost.
    monkeypatch.setattr(history, "_write", commit_then_fail)
    with pytest.raises(ConnectionError):
        sink(rows_of(["d"]))
    monkeypatch.setattr(history, "_write", real_write)
    sink(rows_of(["e"]))
    ids = table_ids(spark, tmp_path / "restored")
    assert sorted(ids) == ["a", "b", "c", "d", "e"]


def test_a_writer_used_on_its_own_creates_the_table_on_first_use(spark, tmp_path):
    table = tmp_path / "fresh"
    HistoryWriter(str(table), str(checkpoint(tmp_path)))(source_rows(spark, ["a", "b"]), 0)
    assert sorted(table_ids(spark, table)) == ["a", "b"]


def test_replay_since_a_version_past_the_latest_is_empty(spark, tmp_path):
    from zerocomm_spark.pipelines.replay import Since, replay

    table = tmp_path / "t"
    ensure_table(spark, str(table))
    HistoryWriter(str(table), str(checkpoint(tmp_path)))(source_rows(spark, ["a", "b"]), 0)
    assert replay(spark, str(table), "g", since=Since.version(1)).count() == 2
    assert replay(spark, str(table), "g", since=Since.version(2)).count() == 0
    assert replay(spark, str(table), "g", since=Since.version(99)).count() == 0


def _restored_rows(spark, ids: list[str]):
    from zerocomm_spark.pipelines import history
    from zerocomm_spark.pipelines.schema import HISTORY_COLUMNS

    return history.to_history(source_rows(spark, ids)).select(*HISTORY_COLUMNS).toArrow()


def test_restoring_again_into_the_same_table_appends_only_rows_it_lacks(spark, tmp_path):
    from zerocomm_spark.pipelines.restore import DeltaSink

    table = tmp_path / "restored"
    DeltaSink(spark, str(table))(_restored_rows(spark, ["a", "b"]))
    DeltaSink(spark, str(table))(_restored_rows(spark, ["a", "b", "c"]))  # a second run, a new sink
    assert sorted(table_ids(spark, table)) == ["a", "b", "c"]


def test_a_sink_without_the_key_refuses_a_table_holding_sealed_rows(spark, tmp_path):
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.history_key import HistoryKey
    from zerocomm_spark.pipelines.restore import DeltaSink

    table, key = tmp_path / "sealed", HistoryKey.generate()
    DeltaSink(spark, str(table), history_key=key)(_restored_rows(spark, ["a"]))
    with pytest.raises(ConfigurationError, match="history_key"):
        DeltaSink(spark, str(table))(_restored_rows(spark, ["b"]))
    DeltaSink(spark, str(table), history_key=key)(_restored_rows(spark, ["b"]))
    held = spark.read.format("delta").load(str(table)).select("message_id", "payload_key_id").collect()
    assert sorted((r[0], r[1]) for r in held) == [("a", key.key_id), ("b", key.key_id)]


def test_ingest_without_the_key_refuses_a_table_holding_sealed_rows_of_its_groups(spark, tmp_path):
    """An ingest run once with --history-key-file and once without wrote the second run's payloads in
    clear beside the sealed ones, silently (user review). Refused before the query starts, as the
    restore sink refuses; a group without sealed rows there goes on (here to the member check)."""
    from zerocomm_spark.errors import ConfigurationError, ZeroCommError
    from zerocomm_spark.pipelines.history import ingest
    from zerocomm_spark.pipelines.history_key import HistoryKey
    from zerocomm_spark.pipelines.restore import DeltaSink

    table, key = tmp_path / "sealed", HistoryKey.generate()
    DeltaSink(spark, str(table), history_key=key)(_restored_rows(spark, ["a"]))  # group "g", sealed
    nowhere = str(tmp_path / "no-agent")
    with pytest.raises(ConfigurationError, match="holds sealed rows of 'g': refusing to ingest") as refused:
        ingest(spark, ["g", "h"], str(table), str(tmp_path / "ck"), agent=nowhere)
    assert "--history-key-file" in str(refused.value)
    with pytest.raises(ZeroCommError) as other:  # not sealed there: past the check, to the (missing) member
        ingest(spark, ["h"], str(table), str(tmp_path / "ck2"), agent=nowhere)
    assert "refusing" not in str(other.value)
    assert not (tmp_path / "ck").exists()  # nothing started


# --- restarts from a checkpoint behind the table, readers, bad input ----------------------------


def test_a_checkpoint_put_back_behind_the_table_writes_nothing_twice_and_loses_nothing(spark, tmp_path):
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    ensure_table(spark, str(table))
    first = HistoryWriter(str(table), str(ck))
    for batch_id, ids in enumerate([["a"], ["b"], ["c"]]):
        first(source_rows(spark, ids), batch_id)
    # The checkpoint is put back from a copy taken after batch 0: Spark re-runs batches 1 and 2 (the
    # same ones: their offsets were in the copy), then goes on.
    seen: list[IngestBatch] = []
    again = HistoryWriter(str(table), str(ck), on_batch=seen.append)
    again(source_rows(spark, ["b"]), 1)
    again(source_rows(spark, ["c"]), 2)
    again(source_rows(spark, ["d"]), 3)
    assert sorted(table_ids(spark, table)) == ["a", "b", "c", "d"]
    assert [(b.batch_id, b.rows) for b in seen] == [(1, 0), (2, 0), (3, 1)]
    # A copy without those offsets: Spark plans the batches anew, over other ranges than the table's
    # batches of the same ids; and the writer is restarted while it catches up.
    ck2 = checkpoint(tmp_path)
    second = HistoryWriter(str(table), str(ck2))
    for batch_id, ids in enumerate([["p"], ["q"], ["r"]]):
        second(source_rows(spark, ids), batch_id)
    HistoryWriter(str(table), str(ck2))(source_rows(spark, ["q", "r", "s"]), 1)
    restarted = HistoryWriter(str(table), str(ck2))
    restarted(source_rows(spark, ["t"]), 2)
    restarted(source_rows(spark, ["u"]), 3)
    ids = table_ids(spark, table)
    assert sorted(ids) == ["a", "b", "c", "d", "p", "q", "r", "s", "t", "u"], ids
    assert last_tagged_batch(spark, str(table), second.app_id(spark)).batch == 3


def test_a_put_back_checkpoint_finds_the_table_ahead_past_other_writers_older_commits(spark, tmp_path):
    """The lookup walked back only to an hour before the re-run batch's plan time. A checkpoint put
    back from an older copy plans that batch anew, hours after the table got it; with another
    writer's commit (another query, a compact()) on top that is more than an hour older than the new
    plan, the walk stopped there, never saw the query's own newer batches and wrote them again. It
    now walks back to the plan of the batch before, which the put-back copy keeps."""
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    ensure_table(spark, str(table))
    start = dt.datetime.now()
    first = HistoryWriter(str(table), str(ck))
    for batch_id, ids in enumerate([["p"], ["q"], ["r"]]):
        plan(ck, batch_id, start + dt.timedelta(seconds=batch_id))
        first(source_rows(spark, ids), batch_id)
    HistoryWriter(str(table), str(checkpoint(tmp_path)))(source_rows(spark, ["other"]), 0)  # another writer
    # Three hours later the checkpoint is put back from a copy taken after batch 0: batches 1 and 2
    # are planned anew, now, over the same rows (and the other writer's commit is hours old).
    later = start + dt.timedelta(hours=3)
    for batch_id in (1, 2):
        plan(ck, batch_id, later)
    again = HistoryWriter(str(table), str(ck))
    again(source_rows(spark, ["q", "r"]), 1)
    again(source_rows(spark, ["s"]), 2)
    ids = table_ids(spark, table)
    assert sorted(ids) == ["other", "p", "q", "r", "s"], ids


def test_a_catch_up_that_appended_nothing_still_tells_a_restart_the_checkpoint_is_behind(spark, tmp_path):
    """A catch-up batch whose rows the table all holds still commits its tag: a driver dying right
    after it must not make the restart take its re-planned batch for one the table holds."""
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    ensure_table(spark, str(table))
    first = HistoryWriter(str(table), str(ck))
    for batch_id, ids in enumerate([["p"], ["q"], ["r"]]):
        first(source_rows(spark, ids), batch_id)
    # The checkpoint is put back from a copy without the offsets of batches 1 and 2. Spark plans
    # batch 1 anew over a message the table holds (nothing to append), checkpoints it, and dies.
    HistoryWriter(str(table), str(ck))(source_rows(spark, ["q"]), 1)
    found = last_tagged_batch(spark, str(table), first.app_id(spark))
    assert (found.batch, found.behind) == (2, True)
    # The restarted query plans batch 2 anew, over more than the table's batch 2 held.
    seen: list[IngestBatch] = []
    HistoryWriter(str(table), str(ck), on_batch=seen.append)(source_rows(spark, ["r", "s"]), 2)
    assert [(b.batch_id, b.rows) for b in seen] == [(2, 1)]
    ids = table_ids(spark, table)
    assert sorted(ids) == ["p", "q", "r", "s"], ids


def _hold_append(monkeypatch, tmp_path, message_id: str, tagged) -> tuple[str, str]:
    """Hold the first attempt of the history append whose userMetadata ``tagged`` accepts inside its
    Delta transaction (a UDF in a Python worker, at row ``message_id``) until a file says another
    commit landed: returns (the file it makes when held there, the file that releases it)."""
    from pyspark.sql.types import BooleanType

    from zerocomm_spark.pipelines import history

    reading, committed = str(tmp_path / "append-is-held"), str(tmp_path / "other-committed")

    def gate(mid):
        import os
        import time

        if mid == message_id and not os.path.exists(committed):
            open(reading, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(committed) and time.monotonic() < deadline:
                time.sleep(0.05)
        return True

    held_back = F.udf(gate, BooleanType())
    real_write = history._write

    def write(df, table_path, options, **kwargs):
        if tagged(str(options.get("userMetadata", ""))):
            df = df.where(held_back(F.col("message_id")))
        real_write(df, table_path, options, **kwargs)

    monkeypatch.setattr(history, "_write", write)
    return reading, committed


def _commit_while_held(held: tuple[str, str], run, other_commit, what) -> None:
    """Run ``run`` (which makes the held append) in a thread; once it is held, make ``other_commit``
    into the same partition, release it and wait for ``run`` to end."""
    reading, committed = held
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not os.path.exists(reading) and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.1)
    assert os.path.exists(reading), what()
    try:
        other_commit()
    finally:
        open(committed, "w").close()
    thread.join(180)
    assert not thread.is_alive()


def test_two_writers_appending_the_same_missing_rows_at_once_cannot_both_commit(spark, tmp_path, monkeypatch):
    """append_new_rows reads the table inside its Delta transaction: the one committing second
    conflicts (it read partitions the other wrote) instead of appending the same rows again."""
    from delta.exceptions import ConcurrentAppendException

    from zerocomm_spark.pipelines import history

    table = tmp_path / "t"
    ensure_table(spark, str(table))
    HistoryWriter(str(table), str(checkpoint(tmp_path)))(source_rows(spark, ["a"]), 0)
    held = _hold_append(monkeypatch, tmp_path, "n", lambda tag: tag == "first:0")
    failed: list[BaseException] = []

    def first() -> None:
        try:
            history.append_new_rows(history.to_history(source_rows(spark, ["a", "n"])), str(table),
                                    {"userMetadata": "first:0"})
        except BaseException as exc:  # noqa: BLE001 - looked at below
            failed.append(exc)

    _commit_while_held(held, first, lambda: history.append_new_rows(
        history.to_history(source_rows(spark, ["a", "n"])), str(table), {"userMetadata": "second:0"}),
        lambda: "the first writer never reached its append")
    assert len(failed) == 1 and isinstance(failed[0], ConcurrentAppendException), failed
    assert sorted(table_ids(spark, table)) == ["a", "n"]


def test_replay_with_the_key_leaves_a_row_that_does_not_open_sealed_instead_of_failing(spark, tmp_path):
    import pyarrow as pa

    from zerocomm_spark.pipelines.history_key import HistoryKey
    from zerocomm_spark.pipelines.replay import replay
    from zerocomm_spark.pipelines.schema import history_schema

    key, table = HistoryKey.generate(), tmp_path / "sealed"
    HistoryWriter(str(table), str(checkpoint(tmp_path)), history_key=key)(source_rows(spark, ["a", "b"]), 0)
    # A provider moved a's ciphertext to another row (the associated data no longer matches).
    moved = spark.read.format("delta").load(str(table)).where("message_id = 'a'").toArrow().to_pylist()
    moved[0]["message_id"] = "moved"
    stored = spark.read.format("delta").load(str(table)).limit(0).toArrow().schema
    (spark.createDataFrame(pa.Table.from_pylist(moved, schema=stored), schema=history_schema())
     .write.format("delta").mode("append").save(str(table)))
    rows = {r["message_id"]: r for r in replay(spark, str(table), "g", history_key=key).toArrow().to_pylist()}
    assert rows["a"]["payload"] == b"a" and rows["a"]["payload_key_id"] is None
    assert rows["b"]["payload"] == b"b" and rows["b"]["payload_key_id"] is None
    assert rows["moved"]["payload_key_id"] == key.key_id  # left sealed: not opened, not a failed job
    checked = {r["message_id"]: r["origin_ok"]
               for r in replay(spark, str(table), "g", history_key=key, verify=True).toArrow().to_pylist()}
    assert checked["moved"] is False


def test_a_stream_replay_from_the_version_after_the_newest_starts_and_follows(spark, tmp_path):
    from delta.tables import DeltaTable

    from zerocomm_spark.pipelines.replay import Since, replay

    table, ck = tmp_path / "t", checkpoint(tmp_path)
    writer = HistoryWriter(str(table), str(ck))
    writer(source_rows(spark, ["a"]), 0)
    newest = int(DeltaTable.forPath(spark, str(table)).history(1).first()["version"])
    seen: list[str] = []

    def run(since: int, stream_ck: Path) -> None:
        query = (replay(spark, str(table), "g", stream=True, since=Since.version(since)).writeStream
                 .foreachBatch(lambda df, _: seen.extend(r[0] for r in df.select("message_id").collect()))
                 .option("checkpointLocation", str(stream_ck)).trigger(availableNow=True).start())
        assert query.awaitTermination(300)
        assert query.exception() is None, query.exception()

    run(newest + 1, tmp_path / "follower")  # caught up: nothing yet, and no failure
    assert seen == []
    writer(source_rows(spark, ["b"]), 1)
    run(newest + 1, tmp_path / "follower")  # the follower resumes from its checkpoint
    assert seen == ["b"]
    writer(source_rows(spark, ["c"]), 2)
    writer(source_rows(spark, ["d"]), 3)
    seen.clear()
    run(newest + 3, tmp_path / "later")  # once that version exists, the stream starts exactly there
    assert seen == ["d"]


def test_readers_of_a_missing_or_foreign_table_say_so(spark, tmp_path):
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.history import compact, vacuum
    from zerocomm_spark.pipelines.replay import Since, replay
    from zerocomm_spark.pipelines.restore import DeltaProvider, have_from_table

    missing, foreign = str(tmp_path / "missing"), str(tmp_path / "foreign")
    spark.range(3).write.format("delta").save(foreign)
    for path, what in ((missing, "no Delta table"), (foreign, "not a zerocomm history table")):
        with pytest.raises(ConfigurationError, match=what):
            replay(spark, path, "g")
        with pytest.raises(ConfigurationError, match=what):
            replay(spark, path, "g", since=Since.version(0))
        with pytest.raises(ConfigurationError, match=what):
            replay(spark, path, "g", stream=True)
        with pytest.raises(ConfigurationError, match=what):
            DeltaProvider(spark, path, "p").announce("g")
        with pytest.raises(ConfigurationError, match=what):
            compact(spark, path)
        with pytest.raises(ConfigurationError, match=what):
            vacuum(spark, path)
    with pytest.raises(ConfigurationError, match="not a zerocomm history table"):
        have_from_table(spark, foreign, "g")
    assert have_from_table(spark, missing, "g").message_ids == frozenset()  # a member's own table may not exist yet


def test_bad_options_are_configuration_errors(spark, tmp_path):
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.history import ingest, vacuum
    from zerocomm_spark.pipelines.replay import Since, replay
    from zerocomm_spark.pipelines.restore import DeltaProvider, restore

    table = tmp_path / "t"
    writer = HistoryWriter(str(table), str(checkpoint(tmp_path)))
    writer(source_rows(spark, ["a"]), 0)
    writer(source_rows(spark, ["b"]), 1)
    with pytest.raises(ConfigurationError, match="trigger"):
        ingest(spark, ["g"], str(table), str(tmp_path / "ck"), agent=str(tmp_path / "agent"), trigger="every second")
    with pytest.raises(ConfigurationError, match="request_chunk"):
        restore("g", [DeltaProvider(spark, str(table), "p")], request_chunk=0, require_origin=False)
    with pytest.raises(ConfigurationError, match="until_lamport"):
        replay(spark, str(table), "g", until_lamport="10")
    with pytest.raises(ConfigurationError, match="as_of"):
        replay(spark, str(table), "g", since=Since.version(2), as_of=1)
    with pytest.raises(ConfigurationError, match="retention_hours"):
        vacuum(spark, str(table), retention_hours=-1)


def test_replay_and_restore_keep_a_publishers_order_when_its_lamport_times_tie(spark, tmp_path):
    """A publisher restarted before it observed anything stamps Lamport times it used before."""
    from zerocomm_spark.pipelines.replay import replay
    from zerocomm_spark.pipelines.restore import ArrowProvider, restore

    sent = dt.datetime(2026, 11, 23, 12, 0, 0)
    schema = source_schema(include_headers=True)

    def rows(specs):  # (id, seq, lamport, payload size)
        return spark.createDataFrame([{f.name: {"group": "g", "message_id": mid, "publisher_did": "did:key:zAlice",
                                                "seq": seq, "lamport_ts": lamport, "sent_at": sent,
                                                "received_at": sent, "headers": {},
                                                "payload": b"x" * size}.get(f.name) for f in schema.fields}
                                      for mid, seq, lamport, size in specs], schema)

    table = tmp_path / "t"
    writer = HistoryWriter(str(table), str(checkpoint(tmp_path)))
    writer(rows([("first", 1, 1, 10)]), 0)
    writer(rows([("after-restart", 2, 1, 100_000)]), 1)  # a bigger file: Spark reads it first
    ordered = [r[0] for r in replay(spark, str(table), "g").select("message_id").collect()]
    assert ordered == ["first", "after-restart"]
    held = spark.read.format("delta").load(str(table)).orderBy(F.desc("seq")).toArrow()
    delivered: list = []
    restore("g", [ArrowProvider(held, "p")], require_origin=False, deliver=delivered.append)
    assert delivered[0].column("message_id").to_pylist() == ["first", "after-restart"]


def test_a_provider_row_with_a_null_time_does_not_abort_a_restore_into_delta(spark, tmp_path):
    import pyarrow as pa

    from zerocomm_spark.pipelines.restore import ArrowProvider, DeltaSink, restore

    honest = _restored_rows(spark, ["a", "b", "c"])
    broken = honest.to_pylist()
    broken[1]["sent_at"] = None  # not covered by the origin proof; NOT NULL in the table
    loose = pa.schema([f.with_nullable(True) for f in honest.schema])
    report = restore("g", [ArrowProvider(pa.Table.from_pylist(broken, schema=loose), "hostile"),
                           ArrowProvider(honest, "honest")],
                     require_origin=False, deliver=DeltaSink(spark, str(tmp_path / "mine")))
    assert [(r.provider, r.message_id) for r in report.rejected] == [("hostile", "b")]
    assert sorted(table_ids(spark, tmp_path / "mine")) == ["a", "b", "c"]


def test_a_since_version_replay_as_of_a_time_the_table_lacks_is_a_configuration_error(spark, tmp_path):
    """as_of ends a Since.version replay (Delta's endingTimestamp): a time after the newest commit or
    before the first one raised Delta's AnalysisException there, while the same as_of without since
    was already a ConfigurationError saying which versions the table has."""
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.replay import Since, replay

    table = tmp_path / "t"
    HistoryWriter(str(table), str(checkpoint(tmp_path)))(source_rows(spark, ["a"]), 0)
    for beyond in (dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc), dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)):
        with pytest.raises(ConfigurationError, match="no version as of"):
            replay(spark, str(table), "g", since=Since.version(0), as_of=beyond)
    assert [r[0] for r in replay(spark, str(table), "g", since=Since.version(0), as_of=10_000)
            .select("message_id").collect()] == ["a"]  # a version past the newest ends at the newest


def test_a_provider_as_of_a_version_or_time_the_table_lacks_is_a_configuration_error(spark, tmp_path):
    """DeltaProvider(as_of=...) at a version (or time) the table does not have failed inside
    announce: restore reported the provider as failed ("announce failed (AnalysisException)") and
    went on, instead of telling the caller that its as_of was wrong."""
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.restore import DeltaProvider, restore

    table = tmp_path / "t"
    writer = HistoryWriter(str(table), str(checkpoint(tmp_path)))
    writer(source_rows(spark, ["a"]), 0)
    writer(source_rows(spark, ["b"]), 1)
    for missing in (99, dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)):
        with pytest.raises(ConfigurationError, match="no version as of"):
            restore("g", [DeltaProvider(spark, str(table), "p", as_of=missing)], require_origin=False)
    with pytest.raises(ConfigurationError, match="as_of"):
        DeltaProvider(spark, str(table), "p", as_of=-1)
    first = DeltaProvider(spark, str(table), "p", as_of=1)  # version 0 made the table, 1 holds "a"
    assert first.announce("g").column("message_id").to_pylist() == ["a"]
    newest = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").where("version = 2").first()["timestamp"]  # UTC
    at_newest = DeltaProvider(spark, str(table), "p", as_of=newest.isoformat())  # a time: an ISO string
    assert sorted(at_newest.announce("g").column("message_id").to_pylist()) == ["a", "b"]


def test_a_since_version_replay_before_the_change_data_feed_is_a_configuration_error(spark, tmp_path):
    """A table whose change data feed was enabled after it was made: Since.version before that left
    replay() returning a DataFrame whose first action raised Delta's DELTA_MISSING_CHANGE_DATA."""
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.replay import Since, replay

    table = tmp_path / "t"
    ensure_table(spark, str(table), properties={"delta.enableChangeDataFeed": "false"})
    writer = HistoryWriter(str(table), str(checkpoint(tmp_path)))
    writer(source_rows(spark, ["a"]), 0)  # version 1
    spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')")  # 2
    writer(source_rows(spark, ["b"]), 1)  # version 3
    for start in (0, 1):
        with pytest.raises(ConfigurationError, match=f"no change data feed from version {start}"):
            replay(spark, str(table), "g", since=Since.version(start))
        with pytest.raises(ConfigurationError, match="DESCRIBE HISTORY"):
            replay(spark, str(table), "g", since=Since.version(start), as_of=3)
    assert [r[0] for r in replay(spark, str(table), "g", since=Since.version(2)).select("message_id").collect()] \
        == ["b"]


def test_a_restore_delivered_while_the_ingest_appends_to_the_same_partition_is_not_lost(spark, tmp_path,
                                                                                         monkeypatch):
    """A member back from a crash restarts its ingest and restores its gap into the same table: the
    sink reads the partitions it appends to (to append only rows the table lacks), so an ingest
    commit into one of them meanwhile made Delta refuse the sink's commit, and restore() ended in
    Delta's ConcurrentAppendException after the whole exchange, nothing delivered. The sink reads
    again and appends what the table still lacks."""
    from zerocomm_spark.pipelines.restore import ArrowProvider, DeltaSink, restore

    table = tmp_path / "t"
    ingest = HistoryWriter(str(table), str(checkpoint(tmp_path)))
    ingest(source_rows(spark, ["a"]), 0)
    held = _hold_append(monkeypatch, tmp_path, "r2", lambda tag: tag.startswith("zerocomm-restore-"))
    outcome: list = []

    def run_restore() -> None:
        try:
            outcome.append(restore("g", [ArrowProvider(_restored_rows(spark, ["r1", "r2"]), "p")],
                                   require_origin=False, deliver=DeltaSink(spark, str(table))))
        except BaseException as exc:  # noqa: BLE001 - looked at below
            outcome.append(exc)

    _commit_while_held(held, run_restore, lambda: ingest(source_rows(spark, ["b"]), 1),  # the same partition
                       lambda: f"the sink never reached its append: {outcome}")
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert outcome[0].delivered == 2
    assert sorted(table_ids(spark, table)) == ["a", "b", "r1", "r2"]


def test_vacuum_with_an_endless_retention_is_a_configuration_error(spark, tmp_path):
    """retention_hours=inf (--retain-hours inf) passed the check (only nan and negatives were refused)
    and reached Spark as 'RETAIN inf HOURS': a PARSE_SYNTAX_ERROR from VACUUM's SQL, not a usage error."""
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.history import vacuum

    table = tmp_path / "t"
    HistoryWriter(str(table), str(checkpoint(tmp_path)))(source_rows(spark, ["a"]), 0)
    for hours in (float("inf"), 1e400, 10**400):
        with pytest.raises(ConfigurationError, match="retention_hours"):
            vacuum(spark, str(table), retention_hours=hours)
    assert vacuum(spark, str(table), retention_hours=24 * 365, dry_run=True) == 0


def test_an_ingest_catching_up_while_another_writer_commits_to_the_same_partition_does_not_fail(spark, tmp_path,
                                                                                              monkeypatch):
    """An ingest whose checkpoint is behind the table appends only rows the table lacks, reading the
    partitions it writes to: a commit into one of them meanwhile (a restore's sink, compact) made Delta
    refuse the batch and the streaming query failed with ConcurrentAppendException. It reads again."""
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    first = HistoryWriter(str(table), str(ck))
    first(source_rows(spark, ["a"]), 0)
    first(source_rows(spark, ["b"]), 1)
    held = _hold_append(monkeypatch, tmp_path, "n", lambda tag: tag.endswith(":behind"))
    failed: list[BaseException] = []
    again = HistoryWriter(str(table), str(ck))  # the checkpoint put back: batch 0 again, re-planned

    def catch_up() -> None:
        try:
            again(source_rows(spark, ["a", "n"]), 0)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            failed.append(exc)

    _commit_while_held(held, catch_up,
                       lambda: HistoryWriter(str(table), str(checkpoint(tmp_path)))(source_rows(spark, ["x"]), 0),
                       lambda: f"the catch-up never reached its append: {failed}")  # the same partition
    assert failed == []
    assert sorted(table_ids(spark, table)) == ["a", "b", "n", "x"]


def test_a_checkpoint_put_back_one_batch_behind_the_table_loses_nothing_of_the_batch_planned_anew(spark, tmp_path):
    """The copy was taken between batches 1 and 2 (commits/1 there, offsets/2 not yet), and the live
    query then wrote batch 2 ("r"). Put back, Spark plans batch 2 anew, over more messages ("r", "s"):
    the table's commit of batch 2 made the writer take it for a re-run and skip it, and "s" was never
    written (reviewer's finding). A commit older than this plan of the batch is not a re-run of it."""
    table, ck = tmp_path / "t", checkpoint(tmp_path)
    ensure_table(spark, str(table))
    first = HistoryWriter(str(table), str(ck))
    for batch_id, ids in enumerate([["p"], ["q"], ["r"]]):
        plan(ck, batch_id, dt.datetime.now())
        first(source_rows(spark, ids), batch_id)
    time.sleep(0.05)
    seen: list[IngestBatch] = []
    again = HistoryWriter(str(table), str(ck), on_batch=seen.append)
    plan(ck, 2, dt.datetime.now())  # planned anew after the put-back: later than the table's commit of it
    again(source_rows(spark, ["r", "s"]), 2)
    plan(ck, 3, dt.datetime.now())
    again(source_rows(spark, ["t"]), 3)
    ids = table_ids(spark, table)
    assert sorted(ids) == ["p", "q", "r", "s", "t"], ids
    assert [(b.batch_id, b.committed, b.rows) for b in seen] == [(2, True, 1), (3, True, 1)]
    # A re-run of the same plan (the driver died after the commit, before Spark recorded the batch): skipped.
    rerun: list[IngestBatch] = []
    HistoryWriter(str(table), str(ck), on_batch=rerun.append)(source_rows(spark, ["t"]), 3)
    assert [(b.batch_id, b.committed) for b in rerun] == [(3, False)]
    assert sorted(table_ids(spark, table)) == ["p", "q", "r", "s", "t"]
