"""Delta history end to end: real members (embedded agent processes), real Spark, real Delta.

The module's members (historian, alice, bob) live for the whole module. The "story" group's history
is built once (two ingest runs around a late joiner) and several tests read it; the others make
their own groups and tables. Nothing is mocked; every wait has a deadline; each assertion can fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.errors import StreamingQueryException

from zerocomm_spark.errors import ConfigurationError, GroupNotFoundError, ZeroCommError
from zerocomm_spark.pipelines.history import IngestBatch, append_history, compact, ingest, vacuum
from zerocomm_spark.pipelines.history_key import HistoryKey
from zerocomm_spark.pipelines.local_group import LocalGroup
from zerocomm_spark.pipelines.origin import ORIGIN_HEADER
from zerocomm_spark.pipelines.replay import Since, causal_order, replay
from zerocomm_spark.pipelines.restore import DeltaProvider, DeltaSink, have_from_client, have_from_table, restore
from zerocomm_spark.pipelines.schema import HISTORY_COLUMNS, TABLE_PROPERTIES, history_schema

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 300.0  # one availableNow ingest on a loaded 2-core machine


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def ingest_all(spark, group: str, table: Path, checkpoint: Path, agent: str, **kwargs) -> list[IngestBatch]:
    """One availableNow run of the ingest query: everything the member has now, then stop."""
    batches: list[IngestBatch] = []
    query = ingest(spark, [group], str(table), str(checkpoint), agent=agent, trigger="available_now",
                   on_batch=batches.append, **kwargs)
    finished = query.awaitTermination(RUN_TIMEOUT)
    if not finished:
        query.stop()
    assert finished, f"the ingest run did not finish within {RUN_TIMEOUT}s"
    assert query.exception() is None, query.exception()
    return batches


def delta_rows(spark, table: Path, group: str | None = None) -> pa.Table:
    df = spark.read.format("delta").load(str(table))
    if group is not None:
        df = df.where(df["group"] == group)
    return df.toArrow()


def journal_ids(member, group: str) -> list[str]:
    return sorted(have_from_client(member.client, group).message_ids)


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    base = tmp_path_factory.mktemp("members")
    group = LocalGroup.start(["historian", "alice", "bob"], group="story", base_dir=base)
    yield group
    group.close()


@dataclass
class Story:
    table: Path
    phase_a: list[str]
    phase_b: list[str]
    replies: dict[str, str]  # reply id -> the id it answers
    v1: int
    v2: int
    between: datetime  # after phase A was sent, before phase B
    late: object


def publish(members: LocalGroup, label: str, group: str, texts: list[str],
            replies_to: list[str] | None = None, headers: dict[str, str] | None = None) -> list[str]:
    ids = [f"{label}-{uuid.uuid4().hex[:12]}" for _ in texts]
    heads = [dict(headers or {}) for _ in texts]
    for h, answer in zip(heads, replies_to or [None] * len(texts)):
        if answer:
            h["in_reply_to"] = answer
    members[label].publish(group, [t.encode() for t in texts], message_ids=ids, headers=heads)
    return ids


@pytest.fixture(scope="module")
def story(spark, members, tmp_path_factory) -> Story:
    """Phase A (questions, answers, answers to answers), ingest, a late joiner, phase B, ingest."""
    from delta.tables import DeltaTable

    work = tmp_path_factory.mktemp("story")
    table, checkpoint = work / "history", work / "ck"
    # publish() returns once every member acknowledged: bob has delivered alice's questions before he answers.
    questions = publish(members, "alice", "story", [f"question {i}" for i in range(30)], headers={"kind": "q"})
    answers = publish(members, "bob", "story", [f"answer {i}" for i in range(30)], replies_to=questions)
    thanks = publish(members, "alice", "story", [f"thanks {i}" for i in range(10)], replies_to=answers[:10])
    replies = {**dict(zip(answers, questions)), **dict(zip(thanks, answers[:10]))}
    wait_for(lambda: len(journal_ids(members["historian"], "story")) == 70, 60, "the historian's 70 messages")
    first = ingest_all(spark, "story", table, checkpoint, members["historian"].agent)
    assert sum(b.rows for b in first) == 70
    v1 = int(DeltaTable.forPath(spark, str(table)).history(1).first()["version"])
    time.sleep(1.1)  # phase B is sent strictly after this instant
    between = datetime.now(timezone.utc)
    late = members.add_member("late", groups=["story"])
    phase_b = (publish(members, "alice", "story", [f"later {i}" for i in range(20)])
               + publish(members, "bob", "story", [f"later too {i}" for i in range(20)]))
    wait_for(lambda: len(journal_ids(members["historian"], "story")) == 110, 60, "the historian's 110 messages")
    second = ingest_all(spark, "story", table, checkpoint, members["historian"].agent)
    assert sum(b.rows for b in second) == 40
    v2 = int(DeltaTable.forPath(spark, str(table)).history(1).first()["version"])
    return Story(table, questions + answers + thanks, phase_b, replies, v1, v2, between, late)


# --- persist -----------------------------------------------------------------------------------


def test_ingest_writes_each_message_once_partitioned_with_properties_and_proofs(spark, members, story):
    from delta.tables import DeltaTable

    rows = delta_rows(spark, story.table)
    ids = rows.column("message_id").to_pylist()
    assert sorted(ids) == sorted(story.phase_a + story.phase_b) and len(ids) == len(set(ids)) == 110
    assert ids and sorted(ids) == journal_ids(members["historian"], "story")  # exactly the member's journal
    detail = DeltaTable.forPath(spark, str(story.table)).detail().first()
    assert list(detail["partitionColumns"]) == ["group", "date"]
    props = detail["properties"]
    for key, value in TABLE_PROPERTIES.items():
        assert props.get(key) == value, key
    assert [f.name for f in spark.read.format("delta").load(str(story.table)).schema] == list(HISTORY_COLUMNS)
    # The proof left the headers for its own columns; application headers stayed.
    by_id = {r["message_id"]: r for r in rows.to_pylist()}
    assert all(r["origin_scheme"] == "ed25519-member/1" and len(r["origin_sig"]) == 64 for r in by_id.values())
    assert all(ORIGIN_HEADER not in dict(r["headers"] or []) for r in by_id.values())
    question = by_id[story.phase_a[0]]
    assert dict(question["headers"]) == {"kind": "q"} and question["payload"] == b"question 0"
    assert by_id[story.phase_b[0]]["headers"] is None
    assert {r["publisher_label"] for r in by_id.values()} == {"alice", "bob"}
    assert all(r["date"] == r["sent_at"].date() and r["ingested_at"] >= r["received_at"] for r in by_id.values())
    checked = replay(spark, str(story.table), "story", verify=True).select("origin_ok").toArrow()
    assert checked.column("origin_ok").to_pylist() == [True] * 110
    # The change data feed is on: the second run's rows are its version's inserts.
    changes = (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", story.v2)
               .load(str(story.table)).select("message_id", "_change_type").toArrow())
    assert sorted(changes.column("message_id").to_pylist()) == sorted(story.phase_b)
    assert set(changes.column("_change_type").to_pylist()) == {"insert"}


def test_sealed_history_keeps_payloads_unreadable_without_the_key(spark, members, story, tmp_path):
    key = HistoryKey.generate()
    ingest_all(spark, "story", tmp_path / "sealed", tmp_path / "ck", members["historian"].agent, history_key=key)
    stored = delta_rows(spark, tmp_path / "sealed").to_pylist()
    assert len(stored) == 110 and {r["payload_key_id"] for r in stored} == {key.key_id}
    clear = {r["message_id"]: r["payload"] for r in delta_rows(spark, story.table).to_pylist()}
    for r in stored:
        assert clear[r["message_id"]] not in r["payload"] and len(r["payload"]) == len(clear[r["message_id"]]) + 40
    # No payload text anywhere in the table's data files either.
    blob = b"".join(p.read_bytes() for p in (tmp_path / "sealed").rglob("*.parquet"))
    assert b"question" not in blob and b"answer" not in blob
    opened = replay(spark, str(tmp_path / "sealed"), "story", history_key=key, verify=True).toArrow().to_pylist()
    assert {r["message_id"]: r["payload"] for r in opened} == clear
    assert all(r["origin_ok"] and r["payload_key_id"] is None for r in opened)
    # Without the key the rows stay sealed, and their origin cannot be shown.
    blind = replay(spark, str(tmp_path / "sealed"), "story", verify=True).toArrow().to_pylist()
    assert not any(r["origin_ok"] for r in blind) and {r["payload_key_id"] for r in blind} == {key.key_id}


def test_ingest_failing_after_the_delta_commit_restarts_without_doubling(spark, members, story, tmp_path):
    """The crash window idempotence is for: Delta committed batch 0, Spark never checkpointed it."""
    table, checkpoint = tmp_path / "history", tmp_path / "ck"
    crashed: list[IngestBatch] = []

    def crash_after_commit(batch: IngestBatch) -> None:
        crashed.append(batch)
        raise RuntimeError("the driver dies right after Delta's commit")

    query = ingest(spark, ["story"], str(table), str(checkpoint), agent=members["historian"].agent,
                   trigger="available_now", max_messages_per_trigger=40, on_batch=crash_after_commit)
    with pytest.raises(StreamingQueryException, match="dies right after"):
        query.awaitTermination(RUN_TIMEOUT)
    assert [(b.batch_id, b.committed, b.rows) for b in crashed] == [(0, True, 40)]
    assert delta_rows(spark, table).num_rows == 40  # in Delta, not in the checkpoint

    resumed = ingest_all(spark, "story", table, checkpoint, members["historian"].agent, max_messages_per_trigger=40)
    assert (resumed[0].batch_id, resumed[0].committed, resumed[0].rows) == (0, False, 0)  # its commit is in the log: skipped
    assert [b.batch_id for b in resumed] == list(range(len(resumed))) and sum(b.rows for b in resumed) == 70
    ids = delta_rows(spark, table).column("message_id").to_pylist()
    assert len(ids) == len(set(ids)) == 110 and sorted(ids) == journal_ids(members["historian"], "story")


def test_ingest_of_a_group_the_member_is_not_in_fails_before_starting(spark, members, tmp_path):
    """The member is asked in ingest() itself: the error is ours and comes at once, not from awaitTermination."""
    table, name = tmp_path / "history", "ingest-" + uuid.uuid4().hex[:8]
    try:
        with pytest.raises(GroupNotFoundError, match="no-such-group") as info:
            ingest(spark, ["story", "no-such-group"], str(table), str(tmp_path / "ck"),
                   agent=members["historian"].agent, trigger="available_now", query_name=name)
    finally:
        for query in spark.streams.active:
            if query.name == name:  # started anyway: stop it, the test has failed
                query.stop()
    assert isinstance(info.value, ZeroCommError) and "group join" in info.value.hint  # says what to do next
    assert not table.exists()  # nothing made for a query that could not run


KILLED_INGEST = textwrap.dedent("""
    import sys
    from zerocomm_spark.connector.session import local_spark
    from zerocomm_spark.pipelines.history import ingest
    group, table, checkpoint, agent = sys.argv[1:5]
    spark = local_spark("zerocomm-killed-ingest")
    query = ingest(spark, [group], table, checkpoint, agent=agent, trigger="300 milliseconds",
                   max_messages_per_trigger=15)
    print("running", flush=True)
    query.awaitTermination()
""")


def test_ingest_process_killed_mid_stream_restarts_with_nothing_missing_or_doubled(spark, members, tmp_path):
    members.add_group("killed", ["historian", "alice"])
    table, checkpoint = tmp_path / "history", tmp_path / "ck"
    published: list[str] = []
    stop = threading.Event()

    def keep_publishing() -> None:
        for round_ in range(30):
            if stop.is_set():
                return
            published.extend(publish(members, "alice", "killed", [f"tick {round_}.{i}" for i in range(10)]))
            time.sleep(0.2)

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = (tmp_path / "ingest.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_INGEST, "killed", str(table), str(checkpoint),
                             members["historian"].agent], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    publisher = threading.Thread(target=keep_publishing, daemon=True)
    publisher.start()
    try:
        def written() -> int:  # commits in the log, read as files: the other process writes them
            return sum('"operation":"WRITE"' in p.read_text() for p in (table / "_delta_log").glob("*.json"))

        wait_for(lambda: written() >= 2 or proc.poll() is not None, 400, "two micro-batches in Delta", 1.0)
        assert proc.poll() is None, (tmp_path / "ingest.log").read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the ingest process, its JVM and Python workers: like a power cut
        proc.wait(30)
        log.close()
    publisher.join(120)
    assert not publisher.is_alive() and len(published) == 300
    wait_for(lambda: len(journal_ids(members["historian"], "killed")) == 300, 60, "the historian's 300 messages")
    before = delta_rows(spark, table).num_rows
    assert 0 < before < 300  # it really died mid-stream

    ingest_all(spark, "killed", table, checkpoint, members["historian"].agent)
    ids = delta_rows(spark, table).column("message_id").to_pylist()
    doubled = [i for i, n in Counter(ids).items() if n > 1]
    assert doubled == [] and sorted(ids) == sorted(published)


# --- replay ------------------------------------------------------------------------------------


def test_replay_orders_causally_and_starts_where_asked(spark, story):
    table = str(story.table)
    rows = replay(spark, table, "story").toArrow()
    ids = rows.column("message_id").to_pylist()
    keys = list(zip(rows.column("lamport_ts").to_pylist(), rows.column("publisher_did").to_pylist()))
    assert keys == sorted(keys) and len(ids) == 110
    position = {mid: i for i, mid in enumerate(ids)}
    for reply, original in story.replies.items():
        assert position[original] < position[reply], "a reply came before what it answers"
    lamport = dict(zip(ids, rows.column("lamport_ts").to_pylist()))
    assert all(lamport[reply] > lamport[original] for reply, original in story.replies.items())

    # since a Lamport time: exactly the rows at or after it
    cut = lamport[story.phase_b[0]]
    after = replay(spark, table, "story", since=Since.lamport(cut)).toArrow().column("message_id").to_pylist()
    assert after == [m for m in ids if lamport[m] >= cut] and set(story.phase_b) <= set(after)
    # since a Delta version: what the second run committed
    since_v2 = replay(spark, table, "story", since=Since.version(story.v2)).toArrow().column("message_id").to_pylist()
    assert sorted(since_v2) == sorted(story.phase_b)
    # since a time: what was sent after it (a datetime is read as a time)
    since_t = replay(spark, table, "story", since=story.between).toArrow().column("message_id").to_pylist()
    assert sorted(since_t) == sorted(story.phase_b)
    # time travel: the table as the first run left it
    as_v1 = replay(spark, table, "story", as_of=story.v1).toArrow().column("message_id").to_pylist()
    assert sorted(as_v1) == sorted(story.phase_a)
    for beyond in (10_000, datetime(2100, 1, 1, tzinfo=timezone.utc)):  # Delta's AnalysisException before
        with pytest.raises(ConfigurationError, match="no version as of"):
            replay(spark, table, "story", as_of=beyond)
    assert replay(spark, table, "nobody").count() == 0
    with pytest.raises(ConfigurationError):
        replay(spark, table, "story", since=3)  # which 3? a version, a Lamport time?


def test_replay_as_a_stream_sorted_per_micro_batch(spark, story, tmp_path):
    seen: list[list[str]] = []

    def each(df, batch_id: int) -> None:
        seen.append(causal_order(df).toArrow().column("message_id").to_pylist())

    stream = replay(spark, str(story.table), "story", stream=True, since=Since.version(0))
    assert stream.isStreaming
    query = (stream.writeStream.foreachBatch(each).option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(RUN_TIMEOUT) and query.exception() is None
    streamed = [m for batch in seen for m in batch]
    assert sorted(streamed) == sorted(story.phase_a + story.phase_b) and len(streamed) == 110


# --- restore -----------------------------------------------------------------------------------


def test_restore_from_two_providers_delivers_every_missed_message_once_and_rejects_forgeries(
        spark, members, story, tmp_path):
    late = story.late
    have = have_from_client(late.client, "story")
    assert set(have.message_ids) == set(story.phase_b)  # it joined late: phase A never reached it

    # Provider "bob": bob's own history, from his member, served by a byzantine host that dropped
    # five rows, altered one message, and slipped in one of bob's messages under alice's name.
    ingest_all(spark, "story", tmp_path / "bob_raw", tmp_path / "ck", members["bob"].agent)
    raw = delta_rows(spark, tmp_path / "bob_raw")
    rows = raw.to_pylist()
    assert len(rows) == 110
    alice_a = [r for r in rows if r["message_id"] in set(story.phase_a) and r["publisher_label"] == "alice"]
    dropped = {r["message_id"] for r in alice_a[:5]}
    altered = alice_a[5]["message_id"]
    served = [dict(r) for r in rows if r["message_id"] not in dropped]
    for r in served:
        if r["message_id"] == altered:
            r["payload"] = b"alice never said this"
    impostor = dict(next(r for r in rows if r["publisher_label"] == "bob"))
    impostor.update(message_id="impostor-1", publisher_did=members["alice"].did, publisher_label="alice",
                    seq=999, payload=b"pay bob")
    impostor["origin_sig"] = members["bob"].signer.sign("story", "impostor-1", b"pay bob")
    tampered = spark.createDataFrame(pa.Table.from_pylist(served + [impostor], schema=raw.schema)
                                     .select(list(HISTORY_COLUMNS)), schema=history_schema())
    from zerocomm_spark.pipelines.history import ensure_table

    ensure_table(spark, str(tmp_path / "bob"))
    append_history(tampered, str(tmp_path / "bob"), app_id="byzantine", version=0)

    bob = DeltaProvider(spark, str(tmp_path / "bob"), "bob")
    historian = DeltaProvider(spark, str(story.table), "historian", as_of=story.v1)  # phase A only
    mine = tmp_path / "late_history"
    report = restore("story", [bob, historian], have=have, deliver=DeltaSink(spark, str(mine)))

    restored = delta_rows(spark, mine).column("message_id").to_pylist()
    assert sorted(restored) == sorted(story.phase_a) and len(restored) == len(set(restored)) == 70
    assert report.delivered == 70 and sorted(report.delivered_ids) == sorted(story.phase_a)
    rejected = {(r.provider, r.message_id) for r in report.rejected}
    assert rejected == {("bob", altered), ("bob", "impostor-1")}
    assert report.missing == ["impostor-1"]  # nobody can prove it: it never existed
    # Announce, then request or ignore: bob was asked for what he announced first, the historian only
    # for what bob did not have and for the one message bob could not prove.
    assert bob.stats.requested == 70 - 5 + 1 and historian.stats.requested == 5 + 1 and report.refetched == 1
    assert report.ignored == {"bob": 40, "historian": 70 - 5} and report.skipped_have == 40
    payloads = dict(zip(restored, delta_rows(spark, mine).column("payload").to_pylist()))
    assert payloads[altered].startswith(b"question")  # the genuine one, from the historian
    # The late member's journal and its restored history together are the whole group's history.
    assert set(restored) | set(have.message_ids) == set(story.phase_a + story.phase_b)
    # Restoring again finds nothing missing: what it restored is now what it has.
    again = restore("story", [bob, historian], have=have.union(have_from_table(spark, str(mine), "story")))
    assert again.delivered == 0 and again.requested.get("historian", 0) == 0
    assert again.requested == {"bob": 1}  # only the impostor, which still fails
    assert replay(spark, str(mine), "story", verify=True).where("NOT origin_ok").count() == 0


# --- upkeep and the command line ---------------------------------------------------------------


def test_compact_vacuum_and_the_history_commands(spark, members, story, tmp_path, capsys):
    import json

    from zerocomm_spark.agent.cli import main as zerocomm

    config = str(members["historian"].process.config.identity_dir.parent / "zerocomm.toml")
    table = tmp_path / "cli"
    assert zerocomm(["--config", config, "--json", "history", "ingest", "story", "--table", str(table),
                     "--available-now"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert lines[-1]["rows"] == 110 and sum(x.get("rows", 0) for x in lines[:-1]) == 110
    # Spark tells the source a batch is checkpointed only when the next one starts: the run's last
    # batch stayed held in the journal (its consumer at the batch's start) until the next run. The
    # command tells the journal itself once the run is done: the query's consumer has it all.
    offsets = sorted((p for p in (table / "_checkpoints" / "ingest" / "offsets").iterdir() if p.name.isdigit()),
                     key=lambda p: int(p.name))
    consumer = json.loads(offsets[-1].read_text().splitlines()[2])["consumer"]
    latest = members["historian"].client.latest(None)
    # past every row of the group (rows of the member's other groups, which this module's other tests
    # publish after these, keep the point at their first: the query never declares them consumed)
    story_last = max(p["last_offset"] for p in latest["publishers"] if p["group"] == "story")
    assert latest["consumers"][consumer] > story_last, (consumer, story_last, latest)
    # A table Delta refuses (its path is a file) is said in one line naming it (it was a Py4J traceback).
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("not a table\n")
    assert zerocomm(["--config", config, "--json", "history", "ingest", "story", "--table", str(not_a_dir),
                     "--checkpoint", str(tmp_path / "ck-failing"), "--available-now"]) == 1
    failed = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert failed["message"].startswith(f"starting the ingest into the history table at {not_a_dir} failed"), failed
    assert "\n" not in failed["message"] and "=== Streaming Query ===" not in failed["message"], failed
    assert "Traceback" not in failed["message"] and "\tat " not in failed["message"], failed
    # An option the connector refuses (in the Python worker Spark makes the source in) is that error
    # again, with its own message and exit code (2, a usage error), not "Spark failed" blaming --table.
    assert zerocomm(["--config", config, "--json", "history", "ingest", "story", "--table", str(tmp_path / "t2"),
                     "--starting-offsets", "bogus", "--available-now"]) == 2
    refused = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert refused["type"] == "ConnectorOptionError" and "startingOffsets" in refused["message"], refused
    assert "Traceback" not in refused["message"] and "--table" not in refused["hint"], refused
    assert zerocomm(["--config", config, "--json", "history", "replay", "story", "--table", str(table),
                     "--since-lamport", "0", "--limit", "0", "--verify"]) == 0
    replayed = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert len(replayed) == 110 and all(r["origin_ok"] for r in replayed)
    assert zerocomm(["--config", config, "--json", "history", "replay", "stroy", "--table", str(table)]) == 6
    misspelt = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]  # not "(no messages)", exit 0
    assert misspelt["type"] == "GroupNotFoundError" and "'story'" in misspelt["hint"]
    assert [r["lamport_ts"] for r in replayed] == sorted(r["lamport_ts"] for r in replayed)
    assert zerocomm(["--config", config, "history", "story", "--limit", "3"]) == 0  # the journal listing still works
    assert "OFFSET" in capsys.readouterr().out

    from delta.tables import DeltaTable

    def active_files() -> int:
        return int(DeltaTable.forPath(spark, str(story.table)).detail().first()["numFiles"])

    before = replay(spark, str(story.table), "story").toArrow()
    partitions = len(set(before.column("date").to_pylist()))
    files_before = len(list(story.table.rglob("*.parquet")))
    active_before = active_files()
    assert active_before >= 2  # one file per run and partition at least
    metrics = compact(spark, str(story.table))
    assert active_files() == partitions  # one file per (group, date) now
    assert metrics["numFilesRemoved"] - metrics["numFilesAdded"] == active_before - partitions
    assert replay(spark, str(story.table), "story").toArrow().equals(before)  # same rows, same order
    assert vacuum(spark, str(story.table), dry_run=True) == 0  # within the 7-day retention nothing may go
    assert len(list(story.table.rglob("*.parquet"))) == files_before + metrics["numFilesAdded"]
    assert zerocomm(["--json", "history", "vacuum", "--table", str(story.table), "--retain-hours", "0"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["files"] == metrics["numFilesRemoved"]
    assert replay(spark, str(story.table), "story").toArrow().equals(before)
    assert zerocomm(["--json", "history", "compact", "--table", str(story.table), "--group", "story"]) == 0
    capsys.readouterr()
    # a group the table does not hold: said, exit 6 (it was "0 files into 0", exit 0, like a compacted one)
    assert zerocomm(["--json", "history", "compact", "--table", str(story.table), "--group", "stroy"]) == 6
    misspelt = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert misspelt["type"] == "GroupNotFoundError" and "'stroy'" in misspelt["message"], misspelt
    assert "'story'" in misspelt["hint"], misspelt
