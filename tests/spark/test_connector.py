"""format("zerocomm") end to end: real member agents (processes), real Spark (local mode and a
standalone cluster on loopback), real Delta. Nothing is mocked; every assertion can fail.

The members (alice, bob, carol) live for the module; each test forms its own group so counts are
its own. alice is the driver's member unless a test says otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timezone
from pathlib import Path

import pytest

from zerocomm_spark.connector import LagListener, progress_lag
from zerocomm_spark.connector.local_members import LocalMember, form_group, start_members
from zerocomm_spark.errors import AgentNotRunningError, AgentStartError, BackpressureError, PeerTimeoutError, ZeroCommError

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    base = tmp_path_factory.mktemp("members")
    started = start_members(base, ["alice", "bob", "carol"])
    yield {m.label: m for m in started}
    for member in started:
        member.remove()


@pytest.fixture
def group(members):
    name = f"g{uuid.uuid4().hex[:8]}"
    form_group([members["alice"], members["bob"], members["carol"]], name)
    return name


def publish(member: LocalMember, group: str, payloads: list[str], **kwargs) -> list[int]:
    return member.client().publish(group, [p.encode() for p in payloads], **kwargs).seqs


def source(spark, group: str, member: LocalMember, **options: str):
    reader = spark.readStream.format("zerocomm").option("group", group).option("agent", str(member.config))
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def delta(spark, path) -> object:
    return spark.read.format("delta").load(str(path))


def rows_in(query) -> int:
    """Messages a running query has processed so far (from its progress, without a Spark job)."""
    return sum(p["numInputRows"] for p in query.recentProgress)


# --- source ------------------------------------------------------------------------------------


def test_members_publish_and_a_stream_lands_in_delta_in_causal_order(spark, members, group, tmp_path):
    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    publish(bob, group, [f"bob-{i}" for i in range(300)])
    # carol publishes after bob's publish returned, i.e. after she delivered all of bob's messages:
    # her messages are causally after his, and their Lamport timestamps must say so.
    publish(carol, group, [f"carol-{i}" for i in range(200)])

    listener = LagListener()
    spark.streams.addListener(listener)
    out, ck = tmp_path / "delta", tmp_path / "ck"
    query = (source(spark, group, alice, startingOffsets="earliest", includeHeaders="true")
             .writeStream.format("delta").option("checkpointLocation", str(ck))
             .trigger(processingTime="500 milliseconds").start(str(out)))
    try:
        wait_for(lambda: rows_in(query) >= 500, 180, "the first 500 messages")
        # live: messages published while the query runs arrive too, with their headers
        publish(bob, group, [f"bob-{i}" for i in range(300, 400)], headers=[{"k": f"v{i}"} for i in range(100)])
        wait_for(lambda: rows_in(query) >= 600, 180, "the live messages")
        query.processAllAvailable()
        progress = query.lastProgress
    finally:
        query.stop()
        spark.streams.removeListener(listener)
    assert query.exception() is None

    rows = delta(spark, out).collect()
    assert len(rows) == 600 and len({r.message_id for r in rows}) == 600
    assert {r.group for r in rows} == {group}
    by_label: dict[str, list] = {}
    for r in rows:
        by_label.setdefault(r.publisher_label, []).append(r)
    assert sorted(by_label) == ["bob", "carol"]
    for label, count in (("bob", 400), ("carol", 200)):
        mine = sorted(by_label[label], key=lambda r: r.seq)
        assert [r.seq for r in mine] == list(range(1, count + 1))  # contiguous, from 1
        assert [r.payload.decode() for r in mine] == [f"{label}-{i}" for i in range(count)]  # publisher order
        assert all(r.sent_at <= r.received_at for r in mine)
        lamports = [r.lamport_ts for r in mine]
        assert lamports == sorted(lamports) and len(set(lamports)) == count
    assert {r.publisher_did for r in by_label["bob"]} == {bob.did(group)}
    headers = {r.payload.decode(): r.headers for r in by_label["bob"]}
    assert headers["bob-0"] is None and headers["bob-399"] == {"k": "v99"}
    # causality: every carol message sorts after the 300 bob messages it followed
    first_carol = min(r.lamport_ts for r in by_label["carol"])
    assert first_carol > max(r.lamport_ts for r in by_label["bob"] if r.seq <= 300)
    ordered = sorted(rows, key=lambda r: (r.lamport_ts, r.publisher_did))
    assert [r.payload.decode() for r in ordered][:300] == [f"bob-{i}" for i in range(300)]

    # lag: reported per publisher in the progress and by the listener; caught up at the end
    lag = progress_lag(progress)
    assert lag == {group: {bob.did(group): 0, carol.did(group): 0}}
    assert listener.lag(query.id) == lag and listener.max_lag() == 0
    source_progress = progress["sources"][0]
    assert json.loads(source_progress["latestOffset"])["version"] == 1

    # the journal may now prune below what the checkpoint passed: alice was told a commit point
    assert alice.client().latest(None)["committed_offset"] > 0


def test_two_queries_on_one_member_commit_their_own_points_and_keep_them_across_restarts(spark, tmp_path):
    # Members of their own: a query's point never passes another group's unconsumed rows, so on the
    # module's members (with every other test's groups) both points would stop at the same place.
    alice, bob = start_members(tmp_path / "own", ["alice", "bob"])
    group = "consumers"
    try:
        form_group([alice, bob], group)
        _two_queries(spark, alice, bob, group, tmp_path)
    finally:
        for member in (alice, bob):
            member.remove()


def _two_queries(spark, alice: LocalMember, bob: LocalMember, group: str, tmp_path: Path) -> None:
    publish(bob, group, [f"m{i}" for i in range(200)])

    def consumers() -> dict[str, int]:
        return {k: v for k, v in alice.client().latest(None)["consumers"].items() if k.startswith("spark-")}

    def run(name: str, until: Callable[[], bool], what: str, **options: str) -> None:
        # Spark commits a batch's offsets to the source when it starts the next batch, and starts one
        # only for new data: a tick now and then lets the last batch with the 200 messages commit.
        query = (source(spark, group, alice, startingOffsets="earliest", **options)
                 .writeStream.format("delta").option("checkpointLocation", str(tmp_path / f"ck-{name}"))
                 .trigger(processingTime="300 milliseconds").start(str(tmp_path / name)))

        def done_or_tick() -> bool:
            if until():
                return True
            if not query.isActive:  # a query that failed says why now, not after the whole wait
                raise AssertionError(f"the query stopped while waiting for {what}: {query.exception()}")
            publish(bob, group, ["tick"])
            return False

        try:
            wait_for(done_or_tick, 180, what, interval=1.0)
        finally:
            query.stop()
        assert query.exception() is None

    before = set(consumers())
    end = alice.client().latest(None)["next_offset"]
    run("fast", lambda: any(v >= end for k, v in consumers().items() if k not in before), "the fast query's commit")
    (fast_name,) = set(consumers()) - before
    # The slow query: 10 messages a batch, stopped right after its first commit. It is a consumer from
    # its start (registered while Spark plans batch 0), so wait until its point moves: Spark commits to
    # the source only after writing the next batch's offsets. A query stopped while Spark writes batch
    # 0's offsets can be refused on restart (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY, Spark's own):
    # stopping at the mere registration once ran into that.
    registered: dict[str, int] = {}

    def slow_committed() -> bool:
        for name, point in consumers().items():
            if name not in before and name != fast_name:
                if registered.setdefault(name, point) < point:
                    return True
        return False

    run("slow", slow_committed, "the slow query's first commit", maxMessagesPerTrigger="10")
    points = consumers()
    (slow_name,) = set(points) - before - {fast_name}
    assert points[slow_name] < points[fast_name]  # each query its own point
    assert alice.client().latest(None)["committed_offset"] <= points[slow_name]  # retention waits for the slower
    # restarted from its checkpoint, the slow query is still the same consumer and moves its point on
    run("slow", lambda: consumers().get(slow_name, 0) >= end, "the restarted slow query's commit")
    assert set(consumers()) - before == {slow_name, fast_name}
    for name in ("fast", "slow"):
        got = [r.payload.decode() for r in delta(spark, tmp_path / name).select("payload").collect()]
        assert sorted(p for p in got if p != "tick") == sorted(f"m{i}" for i in range(200)), name
    assert alice.client().release(slow_name)["released"] is True
    assert slow_name not in consumers()


def test_a_query_holds_journal_retention_back_from_its_start_not_its_first_commit(spark, members, group, tmp_path):
    """Spark commits a batch's offsets when it starts the next one, and only a commit made the query a
    consumer of the member's journal: a query whose first batch was running (or done, with nothing new
    after it) held nothing back, so retention could delete rows it was reading. It registers at its
    start offsets now."""
    alice, bob = members["alice"], members["bob"]

    def consumers() -> dict[str, int]:
        return {k: v for k, v in alice.client().latest(None)["consumers"].items() if k.startswith("spark-")}

    before = set(consumers())
    publish(bob, group, [f"m{i}" for i in range(5)])
    did = bob.did(group)
    wait_for(lambda: any(p["publisher_did"] == did and p["last_seq"] == 5
                         for p in alice.client().latest(group)["publishers"]), 30, "alice to journal bob's messages")
    first = alice.client().read(group=group, publisher=did, first_seq=1, last_seq=1, max_rows=1)
    first_offset = int(first.column("offset")[0].as_py())
    query = (source(spark, group, alice, startingOffsets="earliest").writeStream.format("noop")
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="300 milliseconds").start())
    try:
        wait_for(lambda: rows_in(query) >= 5, 120, "the first batch")
        time.sleep(1.0)  # a few idle triggers: nothing new, so no second batch and no commit of the first
        assert len(query.recentProgress) and sum(1 for p in query.recentProgress if p["numInputRows"]) == 1
        mine = {k: v for k, v in consumers().items() if k not in before}
        assert len(mine) == 1, consumers()
        (point,) = mine.values()
        assert point <= first_offset  # everything the query reads from is kept for it
    finally:
        query.stop()
    assert query.exception() is None


def test_member_link_reads_a_publishers_range_whether_its_rows_are_dense_or_sparse(members, group):
    from zerocomm_spark.connector.agent_link import MemberLink
    from zerocomm_spark.connector.options import AgentOptions

    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    for round_ in range(10):  # interleaved: bob 40 per round (dense), carol 2 per round (sparse)
        publish(bob, group, [f"b{round_ * 40 + i}" for i in range(40)])
        publish(carol, group, [f"c{round_ * 2 + i}" for i in range(2)])
    with MemberLink.connect(AgentOptions(where=str(alice.config))) as link:
        for member, first, last, prefix in ((bob, 7, 391, "b"), (carol, 2, 19, "c"), (bob, 1, 400, "b")):
            did = member.did(group)
            rows = [r for table in link.read_seqs(group, did, first, last) for r in table.to_pylist()]
            assert [r["seq"] for r in rows] == list(range(first, last + 1))
            assert [r["payload"].decode() for r in rows] == [f"{prefix}{i - 1}" for i in range(first, last + 1)]
            assert {r["publisher_did"] for r in rows} == {did} and {r["group"] for r in rows} == {group}


def test_a_sink_task_retried_through_another_member_is_not_data_loss_for_readers(members, group):
    """Attempt 1 of a task publishes through alice, attempt 2 (same ids) through bob, with new seqs of
    bob's: carol's journal drops bob's copies by id, and a reader of bob's seqs there must not take
    the hole for lost messages (failOnDataLoss killed every query of the group for good)."""
    import pyarrow as pa

    from zerocomm_spark.connector.batch_reader import ZeroCommBatchReader
    from zerocomm_spark.connector.options import SinkOptions, SourceOptions
    from zerocomm_spark.connector.schema import SinkColumns, source_schema
    from zerocomm_spark.connector.writer import publish_partition

    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=False)

    def rows():
        return iter([pa.record_batch({"payload": pa.array([f"p{i}" for i in range(3)])})])

    publish(bob, group, ["before"])
    for member in (alice, bob):  # the same task (query, batch, partition) on two hosts
        publish_partition(rows(), SinkOptions.parse({"group": group, "agent": str(member.config)}), columns,
                          "query-1234.7.0", 0)
    publish(bob, group, ["after"])
    did = bob.did(group)
    wait_for(lambda: carol.client().latest(group)["publishers"] and any(
        p["publisher_did"] == did and p["last_seq"] == 5 for p in carol.client().latest(group)["publishers"]),
        30, "carol to journal bob's seq 5")
    assert carol.client().superseded(group, did, 1, 5) == [(2, 4)]
    reader = ZeroCommBatchReader(SourceOptions.parse({"group": group, "agent": str(carol.config)}, mode="batch"),
                                 source_schema())
    got = [r for p in reader.partitions() for b in reader.read(p) for r in pa.Table.from_batches([b]).to_pylist()]
    payloads = sorted(r["payload"] for r in got)
    assert payloads == sorted([b"before", b"after", b"p0", b"p1", b"p2"])  # each row once, nothing lost


def test_a_publisher_resending_its_ids_under_new_seqs_after_a_restart_is_not_data_loss(members, group):
    """A sink task retried on the same host after its agent restarted (the agent's memory of what it
    published is gone): the same ids go out under new seqs of the same publisher, which members drop
    as seen before. Those seqs are recorded as superseded, so readers do not call them lost."""
    import pyarrow as pa

    from zerocomm_spark.connector.batch_reader import ZeroCommBatchReader
    from zerocomm_spark.connector.options import SourceOptions
    from zerocomm_spark.connector.schema import source_schema

    bob, carol = members["bob"], members["carol"]
    ids = ["task-row-0", "task-row-1", "task-row-2"]
    assert publish(bob, group, ["r0", "r1", "r2"], message_ids=ids) == [1, 2, 3]
    bob.stop()
    bob.start()
    wait_for(lambda: bob.client().info(group)["status"] == "active", 60, "bob back in the group")
    assert publish(bob, group, ["r0", "r1", "r2"], message_ids=ids) == [4, 5, 6]  # its memory is gone
    publish(bob, group, ["after"])
    did = bob.did(group)
    wait_for(lambda: any(p["publisher_did"] == did and p["last_seq"] == 7
                         for p in carol.client().latest(group)["publishers"]), 60, "carol to journal bob's seq 7")
    assert carol.client().superseded(group, did, 1, 7) == [(4, 6)]
    reader = ZeroCommBatchReader(SourceOptions.parse({"group": group, "agent": str(carol.config)}, mode="batch"),
                                 source_schema())
    got = [r["payload"] for p in reader.partitions() for b in reader.read(p)
           for r in pa.Table.from_batches([b]).to_pylist() if r["publisher_did"] == did]
    assert got == [b"r0", b"r1", b"r2", b"after"]


def test_the_initial_offset_is_decided_once_per_query(members, group):
    """Spark calls initialOffset() to plan batch 0 and again to run it: a second answer taken later
    (newer positions, another journal consumer) would run the batch from past its planned start."""
    from pyspark.sql.types import StructType

    from zerocomm_spark.connector.micro_batch_stream import ZeroCommMicroBatchStream
    from zerocomm_spark.connector.options import SourceOptions

    alice, bob = members["alice"], members["bob"]
    publish(bob, group, ["before"])
    options = SourceOptions.parse({"group": group, "agent": str(alice.config), "startingOffsets": "latest"},
                                  mode="stream")
    stream = ZeroCommMicroBatchStream(options, StructType())
    try:
        wait_for(lambda: bool(stream._ranges()), 30, "alice to know bob's stream")  # noqa: SLF001
        first = stream.initialOffset()
        publish(bob, group, ["in between"])
        wait_for(lambda: stream._ranges()[(group, bob.did(group))].next > 2, 30, "alice to have it")  # noqa: SLF001
        assert stream.initialOffset() == first
    finally:
        stream.stop()


def test_publishers_named_in_offsets_but_unknown_to_the_member(members):
    """carol published twice before alice joined: alice never holds her seqs 1 and 2. A stream on alice
    naming carol at -1 (latest) before alice has anything of hers started her at seq 1, and read her
    first messages' range [1, 3) as data loss; now she is introduced at her first retained seq once
    she appears. A batch read whose endingOffsets names a publisher alice does not know ignored it
    without a word; now it is refused, as Kafka refuses an unknown partition."""
    from pyspark.sql.types import StructType

    from zerocomm_spark.connector.batch_reader import ZeroCommBatchReader
    from zerocomm_spark.connector.micro_batch_stream import ZeroCommMicroBatchStream
    from zerocomm_spark.connector.options import SourceOptions
    from zerocomm_spark.connector.schema import source_schema
    from zerocomm_spark.errors import ConnectorOptionError

    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    name = f"late{uuid.uuid4().hex[:8]}"
    form_group([bob, carol], name)
    publish(carol, name, ["one", "two"])
    via = next((c["id"] for c in alice.client().connections() if c.get("label") == "bob"
                and c.get("state") in ("completed", "complete", "active")), None)
    if via is None:
        via = alice.client().accept(bob.client().invite(), timeout=60)["id"]
    alice.client().join(name, via=via, timeout=60)
    carol_did = carol.did(name)
    publish(bob, name, ["hello"])  # alice knows bob; carol not yet
    wait_for(lambda: (name, bob.did(name)) in _ranges_of(alice, name), 30, "alice to journal bob's message")

    options = SourceOptions.parse({"group": name, "agent": str(alice.config),
                                   "startingOffsets": json.dumps({name: {carol_did: -1}})}, mode="stream")
    stream = ZeroCommMicroBatchStream(options, StructType())
    try:
        start = stream.initialOffset()
        assert carol_did not in start["groups"][name]  # not seq 1
        publish(carol, name, ["three"])  # her seq 3: the first alice holds
        wait_for(lambda: (name, carol_did) in _ranges_of(alice, name), 30, "alice to journal carol's seq 3")
        end = stream.latestOffset(start, None)
        assert end["groups"][name][carol_did] == 3  # introduced at her first retained seq, read from the next batch
    finally:
        stream.stop()

    ending = json.dumps({name: {"did:peer:2.Ez6LSnotapublisher": 5}})
    reader = ZeroCommBatchReader(SourceOptions.parse({"group": name, "agent": str(alice.config),
                                                      "endingOffsets": ending}, mode="batch"), source_schema())
    with pytest.raises(ConnectorOptionError, match="endingOffsets names 1 publisher.*did:peer:2.Ez6LSnotapublisher"):
        reader.partitions()


def test_an_executors_member_not_in_the_group_fails_the_read_at_once_saying_so(members):
    """Partitions planned on the driver's member (alice, in the group) and read through an executor
    host's member that is not in it (carol; a host whose ZEROCOMM_CONFIG names another member): the
    task waited the whole readTimeoutMs, at each of Spark's retries, and then said the member was
    "behind or not in the group". It can never hold those messages: the read fails at once, naming the
    host's member, the group and what to do."""
    from dataclasses import replace

    from zerocomm_spark.connector.batch_reader import ZeroCommBatchReader
    from zerocomm_spark.connector.options import SourceOptions
    from zerocomm_spark.connector.schema import source_schema
    from zerocomm_spark.errors import GroupNotFoundError

    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    name = f"pair{uuid.uuid4().hex[:8]}"
    form_group([alice, bob], name)
    publish(bob, name, ["one", "two", "three"])
    wait_for(lambda: (name, bob.did(name)) in _ranges_of(alice, name), 30, "alice to journal bob's messages")
    reader = ZeroCommBatchReader(SourceOptions.parse({"group": name, "agent": str(alice.config),
                                                      "readTimeoutMs": "60000"}, mode="batch"), source_schema())
    (planned,) = reader.partitions()
    on_carol = replace(planned, agent=replace(planned.agent, where=str(carol.config)))
    started = time.monotonic()
    with pytest.raises(GroupNotFoundError) as info:
        list(reader.read(on_carol))
    assert time.monotonic() - started < 15  # not readTimeoutMs
    text = str(info.value)
    assert "carol" in text and repr(name) in text and os.uname().nodename in text, text
    assert "zerocomm group join" in text and "ZEROCOMM_CONFIG" in text, text
    # a member of the group reads the same partition
    assert sum(batch.num_rows for batch in reader.read(planned)) == 3


def _ranges_of(member: LocalMember, group: str) -> set[tuple[str, str]]:
    return {(p["group"], p["publisher_did"]) for p in member.client().latest(group)["publishers"]}


def test_batch_read_and_offsets_options(spark, members, group):
    alice, bob = members["alice"], members["bob"]
    publish(bob, group, [f"m{i}" for i in range(30)])
    time.sleep(0.3)
    publish(bob, group, [f"m{i}" for i in range(30, 50)])
    did = bob.did(group)

    def read(**options: str):
        reader = spark.read.format("zerocomm").option("group", group).option("agent", str(alice.config))
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load()

    everything = read().select("seq", "sent_at").collect()
    assert sorted(r.seq for r in everything) == list(range(1, 51))
    window = json.dumps({group: {did: 11}})
    ending = json.dumps({group: {did: 21}})
    got = read(startingOffsets=window, endingOffsets=ending).collect()
    assert sorted(r.seq for r in got) == list(range(11, 21))
    # startingTimestamp: each publisher's first message sent at or after it (ms since the epoch)
    second = next(r.sent_at for r in everything if r.seq == 31).replace(tzinfo=timezone.utc)
    later = read(startingTimestamp=str(int(second.timestamp() * 1000))).collect()
    assert sorted(r.seq for r in later) == list(range(31, 51))


def test_a_batch_read_starting_after_its_end_is_refused_when_named_and_empty_when_resolved(spark, members, group):
    """startingOffsets {DID: 10} with endingOffsets {DID: 5} returned 0 rows for that publisher without
    a word: refused at load, naming the group, the publisher and both values. A startingTimestamp that
    starts the publisher past its end contradicts no option (no message before the end was sent since):
    that publisher's read is empty, with a warning (asserted in tests/unit/test_connector_reader.py)."""
    alice, bob = members["alice"], members["bob"]
    publish(bob, group, [f"m{i}" for i in range(6)])
    time.sleep(0.3)
    publish(bob, group, [f"m{i}" for i in range(6, 12)])
    did = bob.did(group)
    wait_for(lambda: alice.client().read(group=group).num_rows == 12, 30, "alice to receive")

    def read(**options: str):
        reader = spark.read.format("zerocomm").option("group", group).option("agent", str(alice.config))
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load()

    started = time.monotonic()
    with pytest.raises(Exception, match=f"publisher {did} in group '{group}': startingOffsets 10 is after "
                                        "endingOffsets 5"):
        read(startingOffsets=json.dumps({group: {did: 10}}), endingOffsets=json.dumps({group: {did: 5}}))
    seventh = next(r.sent_at for r in read().collect() if r.seq == 7).replace(tzinfo=timezone.utc)
    assert read(startingTimestamp=str(int(seventh.timestamp() * 1000)),
                endingOffsets=json.dumps({group: {did: 5}})).count() == 0
    assert read(startingTimestamp=str(int(seventh.timestamp() * 1000)),
                endingOffsets=json.dumps({group: {did: 9}})).count() == 2  # seqs 7 and 8: a read as before
    assert time.monotonic() - started < 90
    # A start at the end is an empty range (endingOffsets is exclusive), not an error.
    assert read(startingOffsets=json.dumps({group: {did: 5}}), endingOffsets=json.dumps({group: {did: 5}})).count() == 0
    assert read(startingOffsets=json.dumps({group: {did: 5}}), endingOffsets=json.dumps({group: {did: 10}})).count() == 5


def test_a_stream_whose_member_leaves_the_group_fails_saying_so_instead_of_stalling(spark, members, group):
    """The driver's member left a group a running query reads (`zerocomm group leave`, or removed): the
    query stayed active, reported no lag and never read the group's new messages, without a word, while
    starting the same query failed at once with GroupNotFoundError. It now fails the same way."""
    alice, bob = members["alice"], members["bob"]
    publish(bob, group, [f"before-{i}" for i in range(10)])
    query = (source(spark, group, alice, startingOffsets="earliest")
             .writeStream.format("memory").queryName(f"left_{group}")
             .trigger(processingTime="200 milliseconds").start())
    try:
        wait_for(lambda: rows_in(query) >= 10, 120, "the first messages")
        alice.client().leave(group)
        publish(bob, group, [f"after-{i}" for i in range(10)])  # alice never gets these
        wait_for(lambda: not query.isActive, 60, "the query to fail")
    finally:
        query.stop()
    text = str(query.exception())
    assert "GroupNotFoundError" in text and repr(group) in text and "no longer" in text, text[:3000]


def test_max_messages_per_trigger_bounds_every_micro_batch(spark, members, group, tmp_path):
    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    publish(bob, group, [f"b{i}" for i in range(350)])
    publish(carol, group, [f"c{i}" for i in range(150)])
    seen: list[int] = []

    def batch(frame, batch_id):  # what each micro-batch really held
        seen.append(frame.count())

    query = (source(spark, group, alice, startingOffsets="earliest", maxMessagesPerTrigger="120")
             .writeStream.foreachBatch(batch).option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
    query.awaitTermination(240)
    assert query.exception() is None
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sum(sizes) == 500 and max(sizes) <= 120 and len(sizes) >= 5, sizes
    assert sum(seen) == 500 and max(seen) <= 120, seen
    # max-min fair: the first batches take from both publishers
    assert sizes[0] == 120


@contextmanager
def _keeping_little(alice: LocalMember, tmp_path: Path) -> Iterator[tuple[LocalMember, str, str]]:
    """dave keeps little (small segments; retention deletes whatever is committed and closed), in a new
    group with alice, holding alice's 3,000 messages of ~200 B: (dave, group, alice's DID)."""
    dave = LocalMember.create(tmp_path, "dave", settings={"journal.segment_bytes": "65536",
                                                        "journal.retention_bytes": "1"})
    dave.start()
    try:
        group = f"g{uuid.uuid4().hex[:8]}"
        form_group([alice, dave], group)
        for start in range(0, 3000, 500):
            publish(alice, group, [f"{i:06d}" + "x" * 200 for i in range(start, start + 500)])
        did = alice.did(group)
        wait_for(lambda: dave.client().latest(group)["publishers"][0]["last_seq"] == 3000, 60, "dave to have all")
        yield dave, group, did
    finally:
        dave.remove()


def test_messages_gone_by_retention_fail_or_are_skipped_as_failOnDataLoss_says(spark, members, tmp_path):
    alice = members["alice"]
    with _keeping_little(alice, tmp_path) as (dave, group, did):
        # a checkpoint passed the first 2000 messages: dave may prune them
        first_kept = dave.client().read(group=group, publisher=did, first_seq=2001, last_seq=2001)
        dave.client().commit(int(first_kept.column("offset")[0].as_py()))
        wait_for(lambda: dave.client().latest(None)["earliest_offset"] > 0, 30, "retention to delete segments")
        gone = json.dumps({group: {did: 1}})

        def read(fail: str):
            return (spark.read.format("zerocomm").option("group", group).option("agent", str(dave.config))
                    .option("startingOffsets", gone).option("failOnDataLoss", fail).load())

        with pytest.raises(Exception, match="StreamDataLossError") as info:
            read("true").collect()
        assert "messages 1.." in str(info.value) and "failOnDataLoss=false" in str(info.value)
        kept = read("false").select("seq").collect()
        seqs = sorted(r.seq for r in kept)
        assert seqs == list(range(seqs[0], 3001)) and 1 < seqs[0] <= 2001
        # "earliest" means the first retained message: no loss reported
        assert (spark.read.format("zerocomm").option("group", group).option("agent", str(dave.config))
                .load().count()) == len(seqs)


def test_retention_deleting_a_partitions_head_mid_read_is_data_loss_as_failOnDataLoss_says(members, tmp_path,
                                                                                           monkeypatch):
    """Retention (another consumer's commit) deletes the segment with a partition's first rows between
    the reader's look-up of its first row and its read by journal offset (the dense path): that read
    failed with the journal's bare DataLossError, so failOnDataLoss=false failed the query instead of
    skipping, and failOnDataLoss=true did not say which publisher's messages were lost."""
    from zerocomm_spark.connector.agent_link import MemberLink
    from zerocomm_spark.connector.options import AgentOptions
    from zerocomm_spark.connector.partition_reader import ZeroCommInputPartition, read_partition
    from zerocomm_spark.errors import StreamDataLossError

    alice = members["alice"]
    with _keeping_little(alice, tmp_path) as (dave, group, did):

        def offset_of(seq: int) -> int:
            row = dave.client().read(group=group, publisher=did, first_seq=seq, last_seq=seq)
            return int(row.column("offset")[0].as_py())

        scans = []
        real_call = MemberLink._call

        def retention_strikes(commit_at: int):
            def call(self, name, *args, **kwargs):
                if name == "call_bulk" and not scans:  # the dense read of the partition, by journal offset
                    scans.append(kwargs["start"])
                    dave.client().commit(offset_of(commit_at))
                    wait_for(lambda: dave.client().latest(None)["earliest_offset"] > kwargs["start"], 30,
                             "retention to delete the partition's first rows")
                return real_call(self, name, *args, **kwargs)
            return call

        def read(first: int, fail: bool) -> list[int]:
            part = ZeroCommInputPartition(group=group, publisher=did, first=first, end=3001, label="alice",
                                          agent=AgentOptions(where=str(dave.config)), include_headers=False,
                                          fail_on_data_loss=fail, read_timeout_s=30.0)
            return [s for batch in read_partition(part) for s in batch.column("seq").to_pylist()]

        monkeypatch.setattr(MemberLink, "_call", retention_strikes(1001))
        with pytest.raises(StreamDataLossError, match=f"messages 1\\.\\.[0-9]+ of publisher alice in group '{group}'"):
            read(1, fail=True)
        assert scans, "the read did not take the dense path"
        kept = dave.client().read(group=group, publisher=did, first_seq=1, last_seq=3000, max_rows=1)
        first_kept = int(kept.column("seq")[0].as_py())
        scans.clear()
        monkeypatch.setattr(MemberLink, "_call", retention_strikes(2001))
        seqs = read(first_kept, fail=False)  # skipped with a warning, not a failed read
        assert scans and seqs and seqs == list(range(seqs[0], 3001)) and first_kept < seqs[0] <= 2001


def test_a_first_batch_rerun_after_a_restart_reads_its_planned_range_and_reports_what_retention_took(
        spark, members, tmp_path):
    """Spark checkpoints the first batch's end but not its start: re-running it after a failure, it asks
    initialOffset() again. Resolved anew, "earliest" had moved past what retention deleted meanwhile,
    and the re-run batch read from there: 2000 planned messages skipped without a word although
    failOnDataLoss was true (with "latest", the messages of the first batch were skipped the same way)."""
    from pyspark.sql.functions import col, udf

    alice = members["alice"]
    with _keeping_little(alice, tmp_path) as (dave, group, did):
        marker = tmp_path / "fail-now"
        marker.write_text("the first run's batch fails")
        flag = str(marker)

        @udf("string")
        def unless_flagged(payload):
            import os as os_

            if os_.path.exists(flag):
                raise RuntimeError("the batch fails (test)")
            return payload

        out, ck = tmp_path / "out", tmp_path / "ck"

        def run(**options: str):
            frame = source(spark, group, dave, startingOffsets="earliest", **options)
            return (frame.select(unless_flagged(col("payload").cast("string")).alias("p"), "seq")
                    .writeStream.format("delta").option("checkpointLocation", str(ck))
                    .trigger(availableNow=True).start(str(out)))

        from pyspark.errors import StreamingQueryException

        query = run()
        with pytest.raises(StreamingQueryException, match="TASK_WRITE_FAILED"):
            query.awaitTermination(180)
        assert (ck / "offsets" / "0").exists() and not list((ck / "commits").glob("[0-9]*"))
        # meanwhile another consumer of dave's journal would let retention delete the first 2000 messages
        first_kept = dave.client().read(group=group, publisher=did, first_seq=2001, last_seq=2001)
        dave.client().commit(int(first_kept.column("offset")[0].as_py()))
        # but the query became a consumer when it started, at its start: retention keeps its rows
        (name,) = [k for k in dave.client().latest(None)["consumers"] if k.startswith("spark-")]
        time.sleep(2.5)  # retention runs every second and after every commit
        assert dave.client().latest(None)["earliest_offset"] == 0
        # until the query is released (an operator who took its checkpoint for gone): then they go
        assert dave.client().release(name)["released"] is True
        wait_for(lambda: dave.client().latest(None)["earliest_offset"] > 0, 30, "retention to delete segments")
        marker.unlink()
        query = run()
        with pytest.raises(StreamingQueryException) as info:
            query.awaitTermination(180)
        # the batch's task failed (Delta wraps it); the reason is in the trace it carries
        trace = f"{info.value} {getattr(info.value, '_stackTrace', '')}"
        assert "StreamDataLossError: messages 1.." in trace and f"of publisher alice in group '{group}'" in trace
        # failOnDataLoss=false: the same planned range, what is left of it read, the rest skipped
        query = run(failOnDataLoss="false")
        assert query.awaitTermination(180) and query.exception() is None
        seqs = sorted(r.seq for r in delta(spark, out).select("seq").collect())
        assert seqs == list(range(seqs[0], 3001)) and 1 < seqs[0] <= 2001


# --- sink --------------------------------------------------------------------------------------


def test_a_sink_batch_the_group_does_not_acknowledge_fails_clearly_and_commits_nothing(spark, members, group,
                                                                                      tmp_path):
    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    src, ck = tmp_path / "src", tmp_path / "sink-ck"
    spark.range(0, 50, 1, 1).selectExpr("CAST(id AS STRING) AS payload").write.parquet(str(src))

    def run():
        return (spark.readStream.schema("payload STRING").parquet(str(src))
                .writeStream.format("zerocomm").option("group", group).option("agent", str(bob.config))
                .option("publishTimeoutMs", "3000").option("checkpointLocation", str(ck))
                .trigger(availableNow=True).start())

    carol_pid = carol.pid()
    assert carol_pid is not None
    os.kill(carol_pid, signal.SIGSTOP)  # carol cannot acknowledge anything
    try:
        from pyspark.errors import StreamingQueryException

        query = run()
        with pytest.raises(StreamingQueryException, match=f"the group '{group}' did not acknowledge 50 message"):
            query.awaitTermination(180)
        assert not list((ck / "commits").glob("[0-9]*"))  # the batch did not commit
    finally:
        os.kill(carol_pid, signal.SIGCONT)
    # carol is back: the re-run batch delivers, and nothing twice (same deterministic ids)
    query = run()
    assert query.awaitTermination(180) and query.exception() is None
    wait_for(lambda: carol.client().read(group=group).num_rows >= 50, 60, "carol to catch up")
    time.sleep(1.0)
    for member in (alice, carol):
        ids = member.client().read(group=group).column("message_id").to_pylist()
        assert len(ids) == len(set(ids)) == 50, member.label


def test_a_df_write_the_group_does_not_acknowledge_does_not_promise_a_rerun_is_safe(spark, members, group):
    """df.write without a message_id column while carol cannot acknowledge: save() failed with
    PublishNotAcknowledgedError saying "Nothing is lost and nothing will be delivered twice: rerun the
    query". Its messages were sent all the same (alice has them; carol gets them once she is back), and a
    save() run again makes a new write id: following the advice delivered every row twice. The error
    now says so, and how to make a rerun safe; with a message_id column the rerun is safe and says so."""
    bob, carol = members["bob"], members["carol"]

    def save(frame):
        (frame.write.format("zerocomm").option("group", group).option("agent", str(bob.config))
         .option("publishTimeoutMs", "3000").mode("append").save())

    carol_pid = carol.pid()
    assert carol_pid is not None
    os.kill(carol_pid, signal.SIGSTOP)  # carol cannot acknowledge anything
    try:
        with pytest.raises(Exception) as derived:
            save(spark.range(0, 20, 1, 1).selectExpr("CAST(id AS STRING) AS payload"))
        with pytest.raises(Exception) as given:
            save(spark.range(20, 40, 1, 1).selectExpr("CAST(id AS STRING) AS payload",
                                                      "concat('row-', CAST(id AS STRING)) AS message_id"))
    finally:
        os.kill(carol_pid, signal.SIGCONT)
    text = str(derived.value)
    assert "PublishNotAcknowledgedError" in text and "did not acknowledge 20 message" in text, text[:3000]
    assert "nothing will be delivered twice" not in text, text[:3000]
    assert "delivered twice" in text and "message_id column" in text, text[:3000]
    text = str(given.value)  # the rows' own ids: the usual advice holds
    assert "PublishNotAcknowledgedError" in text and "nothing will be delivered twice" in text, text[:3000]


def test_a_row_bigger_than_a_group_message_is_refused_naming_it_and_the_limit(spark, members, group):
    """A payload past what one group message carries (4 MiB), well within api.max_request_bytes: the
    agent refused the publish call with FrameTooLargeError "exceeds max_message_bytes=4194304. ... raise
    DataPlaneConfig.max_message_bytes" (no agent setting), not saying which row. The sink refuses the
    row itself, naming it and the limit the agent reports; a row of exactly the limit is published."""
    bob, carol = members["bob"], members["carol"]
    limit = bob.client().status().get("max_message_bytes", 4 * 1024 * 1024)
    assert 0 < limit <= 4 * 1024 * 1024

    def write(sizes: list[int]) -> None:
        rows = ", ".join(f"({i}, {n})" for i, n in enumerate(sizes))
        (spark.sql(f"SELECT CAST(repeat('x', n) AS BINARY) AS payload FROM VALUES {rows} AS t(i, n) ORDER BY i")
         .coalesce(1).write.format("zerocomm").option("group", group).option("agent", str(bob.config))
         .mode("append").save())

    started = time.monotonic()
    with pytest.raises(Exception, match="SinkPayloadTooLargeError") as info:
        write([10, limit + 1, 10])
    assert (f"row 1 of partition 0 has a {limit + 1}-byte payload; a group message carries at most {limit} bytes"
            in str(info.value)), str(info.value)[-2000:]
    assert f"length(payload) <= {limit}" in str(info.value)
    assert time.monotonic() - started < 60
    write([limit])
    wait_for(lambda: carol.client().read(group=group).num_rows == 1, 30, "carol to receive the largest message")


def test_a_row_no_group_message_can_carry_is_a_data_error_naming_it_not_a_publish_to_retry(spark, members, group):
    """A null header value came back as PublishNotAcknowledgedError ("... rerun the query (or let Spark
    retry) ... Check that the group's members are up, or raise publishTimeoutMs"), as did a null payload
    and, with signOrigin, a row's own zc-origin header: data errors that fail the same way at every
    retry. Each is now its own SinkRowError naming the row (and the key) and what to do with it."""
    bob, carol = members["bob"], members["carol"]

    def refused(sql: str, sign: str = "false") -> str:
        started = time.monotonic()
        with pytest.raises(Exception) as info:
            (spark.sql(sql).write.format("zerocomm").option("group", group).option("agent", str(bob.config))
             .option("signOrigin", sign).mode("append").save())
        assert time.monotonic() - started < 60
        text = str(info.value)
        assert "PublishNotAcknowledgedError" not in text and "members are up" not in text, text[-3000:]
        return text

    text = refused("SELECT 'hv' AS payload, map('k', CAST(NULL AS STRING)) AS headers")
    assert "SinkHeaderError: row 0 of partition 0 has a null value for header 'k'" in text, text[-3000:]
    assert "map_filter" in text and "coalesce" in text
    text = refused("SELECT CAST(NULL AS STRING) AS payload")
    assert "SinkNullPayloadError: row 0 of partition 0 has a null payload" in text, text[-3000:]
    text = refused("SELECT 'forged' AS payload, map('zc-origin', '1:x') AS headers", sign="true")
    assert "SinkOriginClaimError: row 0 of partition 0 has a 'zc-origin' header" in text, text[-3000:]
    assert "signOrigin to false" in text
    (spark.sql("SELECT 'ok' AS payload, map_filter(map('k', CAST(NULL AS STRING), 'j', 'v'), (k, v) -> v IS NOT NULL) "
               "AS headers").write.format("zerocomm").option("group", group).option("agent", str(bob.config))
     .mode("append").save())  # what the error says to do
    wait_for(lambda: carol.client().read(group=group).num_rows == 1, 30, "carol to receive the fixed row")
    time.sleep(0.5)
    rows = carol.client().read(group=group)
    assert rows.column("payload").to_pylist() == [b"ok"] and dict(rows.column("headers")[0].as_py()) == {"j": "v"}


def test_the_agent_refusing_a_sinks_rows_is_a_data_error_not_a_publish_to_retry(members, group, monkeypatch):
    """Rows the sink's own checks let through but the agent refuses (BadRowError; it was wrapped by
    MemberLink in PublishNotAcknowledgedError with its advice to rerun and check the members): a
    SinkRowError with the agent's words, saying where its row numbers count from. A real agent, its
    checks in the sink turned off."""
    import pyarrow as pa

    from zerocomm_spark.connector import writer
    from zerocomm_spark.connector.options import SinkOptions
    from zerocomm_spark.connector.schema import SinkColumns
    from zerocomm_spark.errors import PublishNotAcknowledgedError, SinkRowError

    monkeypatch.setattr(writer, "_check_headers", lambda *args: None)
    rows = [pa.record_batch({"payload": pa.array(["a", "b"]),
                             "headers": pa.array([None, [("k", None)]], pa.map_(pa.string(), pa.string()))})]
    options = SinkOptions.parse({"group": group, "agent": str(members["alice"].config)})
    with pytest.raises(SinkRowError) as info:
        writer.publish_partition(iter(rows), options, SinkColumns(True, False, True), "q.0.0", 0)
    assert not isinstance(info.value, PublishNotAcknowledgedError)
    assert "refused a row of the publish call holding rows 0-1 of partition 0" in str(info.value), str(info.value)
    assert "publish: row 1 has a null value for header 'k'" in str(info.value)
    assert "its row i is partition row 0 + i" in str(info.value)
    assert "members are up" not in str(info.value) and "zerocomm --help" not in str(info.value)


def test_sink_task_with_empty_and_repeated_given_ids_delivers_each_id_once_across_retries(members, group):
    """A task's own rows, published twice (a retry): an empty id gets the derived id like a null one
    (not a random one, new at every attempt), and an id repeated within a chunk or across chunks is
    one message, counted as a duplicate - not a refused batch that fails the query for good."""
    import pyarrow as pa

    from zerocomm_spark.connector.options import SinkOptions
    from zerocomm_spark.connector.schema import SinkColumns
    from zerocomm_spark.connector.writer import derived_id, publish_partition

    alice, bob = members["alice"], members["bob"]
    columns = SinkColumns(payload_is_string=True, has_message_id=True, has_headers=False)
    given = ["a1", "", None, "x", "x", "y", "a1"]
    rows = [pa.record_batch({"payload": pa.array([f"p{i}" for i in range(len(given))]),
                             "message_id": pa.array(given, pa.string())})]
    # One chunk (the repeats of x and a1 dropped in the task), then a chunk per row (they meet in the
    # member; a1, x, y were also published by the first task already); each attempt once more.
    for size, first_dups in (("2000", 2), ("1", 5)):
        options = SinkOptions.parse({"group": group, "agent": str(alice.config), "publishBatchSize": size})
        for attempt in range(2):
            done = publish_partition(iter(rows), options, columns, f"q.{size}.0", 0)
            assert done.messages == len(given)
            assert done.duplicates == (first_dups if attempt == 0 else len(given)), (size, attempt, done)
    expected = {"a1", "x", "y"} | {derived_id(f"q.{size}.0", f"p{i}".encode(), None, 0)
                                    for size in ("2000", "1") for i in (1, 2)}
    wait_for(lambda: bob.client().read(group=group).num_rows >= len(expected), 30, "bob to receive")
    time.sleep(0.5)
    ids = bob.client().read(group=group).column("message_id").to_pylist()
    assert sorted(ids) == sorted(expected)


def test_a_query_writes_to_a_group_and_another_member_reads_it_back_in_order(spark, members, group, tmp_path):
    from zerocomm_spark.connector.writer import derived_id

    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    # batch write through bob, in 3 partitions; some rows bring their own ids
    frame = spark.range(0, 900, 1, 3).selectExpr(
        "CAST(id AS STRING) AS payload",
        "CASE WHEN id % 100 = 0 THEN concat('own-', CAST(id AS STRING)) END AS message_id",
        "map('row', CAST(id AS STRING)) AS headers")
    frame.write.format("zerocomm").option("group", group).option("agent", str(bob.config)).mode("append").save()
    # a streaming write through carol from a file source, exactly once per micro-batch
    src = tmp_path / "src"
    spark.range(1000, 1300, 1, 2).selectExpr("CAST(id AS STRING) AS payload").write.parquet(str(src))
    sink_ck = tmp_path / "sink-ck"

    def write_stream():
        q = (spark.readStream.schema("payload STRING").option("maxFilesPerTrigger", 1).parquet(str(src))
             .writeStream.format("zerocomm").option("group", group).option("agent", str(carol.config))
             .option("checkpointLocation", str(sink_ck)).trigger(availableNow=True).start())
        q.awaitTermination(120)
        assert q.exception() is None
        return q

    query = write_stream()
    assert sum(p["numInputRows"] for p in query.recentProgress) == 300

    # another member (alice) reads the group back
    def read_back():
        return (spark.read.format("zerocomm").option("group", group).option("agent", str(alice.config))
                .option("includeHeaders", "true").load().collect())

    wait_for(lambda: len(read_back()) >= 1200, 60, "alice to have all 1200 messages")
    rows = read_back()
    assert len(rows) == 1200 and len({r.message_id for r in rows}) == 1200
    mine = {label: sorted((r for r in rows if r.publisher_label == label), key=lambda r: r.seq)
            for label in ("bob", "carol")}
    assert len(mine["bob"]) == 900 and len(mine["carol"]) == 300
    # ids: deterministic per (write, partition, content, repeat) unless the row brought one
    own = {r.message_id for r in mine["bob"] if r.message_id.startswith("own-")}
    assert own == {f"own-{i}" for i in range(0, 900, 100)}
    for label in ("bob", "carol"):
        tasks: dict[str, list[int]] = {}
        for r in mine[label]:
            if r.message_id.startswith("own-"):
                continue
            prefix, _, n = r.message_id.rsplit(".", 2)
            assert r.message_id == derived_id(prefix, bytes(r.payload), r.headers, int(n))
            tasks.setdefault(prefix, []).append(int(r.payload))  # payloads grow with the row in each task
        # in order per publisher: within each task, seq order is row order
        for payloads in tasks.values():
            assert payloads == sorted(payloads)
    bob_payloads = [int(r.payload) for r in mine["bob"]]
    for part in range(3):
        chunk = [p for p in bob_payloads if part * 300 <= p < (part + 1) * 300]
        assert chunk == sorted(chunk) and len(chunk) == 300
    assert all(r.headers == {"row": r.payload.decode()} for r in mine["bob"])
    stream_ids = {r.message_id for r in mine["carol"]}
    assert all(i.startswith(str(query.id)) for i in stream_ids)  # <query id>.<batch>.<partition>.<hash>.<n>

    # a re-run micro-batch publishes the same ids: nothing is delivered twice
    commits = sorted((sink_ck / "commits").iterdir(), key=lambda p: p.name)
    last = [p for p in commits if p.name.isdigit()][-1]
    last.unlink()
    (sink_ck / "commits" / f".{last.name}.crc").unlink(missing_ok=True)
    rerun = write_stream()
    assert sum(p["numInputRows"] for p in rerun.recentProgress) > 0  # the batch really ran again
    # and a retried batch write with the same ids adds nothing either
    frame.where("message_id IS NOT NULL").write.format("zerocomm").option("group", group) \
        .option("agent", str(bob.config)).mode("append").save()
    time.sleep(1.0)
    again = read_back()
    assert len(again) == 1200 and len({r.message_id for r in again}) == 1200


# --- failures and restarts ---------------------------------------------------------------------

_DRIVER = textwrap.dedent("""
    import sys, time
    from zerocomm_spark.connector.session import local_spark
    group, agent, out, ck = sys.argv[1:5]
    spark = local_spark("zerocomm-killed-driver", master="local[2]")
    q = (spark.readStream.format("zerocomm").option("group", group).option("agent", agent)
         .option("startingOffsets", "earliest").option("maxMessagesPerTrigger", "100").load()
         .writeStream.format("delta").option("checkpointLocation", ck)
         .trigger(processingTime="200 milliseconds").start(out))
    print("started", flush=True)
    q.awaitTermination()
""")


class Publisher(threading.Thread):
    """Publishes ``total`` messages in small batches, retrying (same ids) while a member is down."""

    def __init__(self, member: LocalMember, group: str, total: int, batch: int = 50, pause: float = 0.05):
        super().__init__(daemon=True)
        self.member, self.group, self.total, self.batch, self.pause = member, group, total, batch, pause
        self.done = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.done < self.total:
                n = min(self.batch, self.total - self.done)
                ids = [f"{self.group}-{self.member.label}-{self.done + i}" for i in range(n)]
                payloads = [f"{self.member.label}-{self.done + i}".encode() for i in range(n)]
                for attempt in range(60):
                    try:
                        self.member.client().publish(self.group, payloads, message_ids=ids, timeout=10)
                        break
                    except (BackpressureError, PeerTimeoutError, TimeoutError, ZeroCommError):
                        if attempt == 59:
                            raise
                        time.sleep(0.5)
                self.done += n
                time.sleep(self.pause)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _committed_rows(table: Path) -> int:
    """Rows the Delta table's committed log adds (each add's numRecords statistic), read as files: no
    Spark job competes for the CPU with the process writing the table. 0 until the first commit."""
    total = 0
    for commit in (table / "_delta_log").glob("[0-9]*.json"):  # commits appear whole (written, then renamed)
        try:
            lines = commit.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            add = json.loads(line).get("add") if line.strip() else None
            if add:
                total += int(json.loads(add["stats"])["numRecords"])
    return total


def _exactly_once(spark, out, expected_ids: set[str]) -> None:
    frame = delta(spark, out)
    rows = frame.select("message_id").collect()
    ids = [r.message_id for r in rows]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} duplicates"
    assert set(ids) == expected_ids, f"missing {len(expected_ids - set(ids))}, unexpected {len(set(ids) - expected_ids)}"


@pytest.mark.timeout(480)
def test_killed_query_restarts_from_its_checkpoint_exactly_once(spark, members, group, tmp_path):
    alice, bob = members["alice"], members["bob"]
    out, ck = tmp_path / "delta", tmp_path / "ck"
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    publisher = Publisher(bob, group, total=1200)
    publisher.start()
    driver = subprocess.Popen([sys.executable, str(script), group, str(alice.config), str(out), str(ck)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=str(ROOT),
                              start_new_session=True)
    try:
        # Polled from the table's log files, not with a Spark job a poll: those took CPU from the
        # driver being waited for. The count that matters (before) is Spark's own, below.
        wait_for(lambda: _committed_rows(out) >= 200, 200, "the killed driver's query to write some batches",
                 interval=0.5)
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its Python workers, mid-stream
        driver.wait(30)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    before = delta(spark, out).count()
    publisher.join(120)
    assert publisher.error is None and publisher.done == 1200
    assert before < 1200  # it really was killed in the middle

    query = (source(spark, group, alice, startingOffsets="earliest")
             .writeStream.format("delta").option("checkpointLocation", str(ck))
             .trigger(availableNow=True).start(str(out)))
    query.awaitTermination(240)
    assert query.exception() is None
    _exactly_once(spark, out, {f"{group}-bob-{i}" for i in range(1200)})


@pytest.mark.timeout(480)
def test_killed_agent_mid_stream_then_restart_exactly_once(spark, members, group, tmp_path):
    bob, carol = members["bob"], members["carol"]
    out, ck = tmp_path / "delta", tmp_path / "ck"
    publisher = Publisher(bob, group, total=500, pause=0.05)
    publisher.start()

    def start_query():
        return (source(spark, group, carol, startingOffsets="earliest", agentTimeoutMs="10000",
                       readTimeoutMs="60000")
                .writeStream.format("delta").option("checkpointLocation", str(ck))
                .trigger(processingTime="300 milliseconds").start(str(out)))

    query = start_query()
    try:
        wait_for(lambda: rows_in(query) >= 100, 180, "the query to deliver some messages")
        carol.kill()  # kill -9 the reading member's agent, mid-stream
        publisher.join(180)
        assert publisher.error is None and publisher.done == 500
        # The connector starts the agent again on demand (spawnAgent defaults to true), so the
        # query may ride over the crash; if it failed instead, it must have failed, not hung.
        if query.isActive:
            wait_for(lambda: not query.isActive or rows_in(query) >= 500, 180,
                     "the query to catch up or fail")
    finally:
        query.stop()
    failure = query.exception()
    print("query after the agent crash:", "failed: " + str(failure)[:500] if failure else "rode over it")

    def caught_up() -> bool:
        # The connector's on-demand spawn may be starting an agent still, or one whose start the
        # stopped query interrupted may be going away: start it here whenever none holds the identity.
        try:
            publishers = carol.client().latest(group)["publishers"]
        except AgentNotRunningError:
            carol.close_client()
            if not carol.running():
                try:
                    carol.start()
                except AgentStartError as exc:  # another start got there first: it runs
                    if "already running" not in str(exc):
                        raise
            return False
        return bool(publishers) and max(p["last_seq"] for p in publishers) >= 500

    wait_for(caught_up, 120, "the restarted member to catch up with the group")
    drain = (source(spark, group, carol, startingOffsets="earliest")
             .writeStream.format("delta").option("checkpointLocation", str(ck))
             .trigger(availableNow=True).start(str(out)))
    drain.awaitTermination(180)
    assert drain.exception() is None
    _exactly_once(spark, out, {f"{group}-bob-{i}" for i in range(500)})


@pytest.mark.timeout(300)
def test_a_reading_members_socket_directory_removed_mid_stream_is_ridden_over_exactly_once(spark, tmp_path):
    """A tmp cleaner removes the agent's socket directory while a query reads: the agent ran on,
    unreachable for good (ZeroMQ listens on the unlinked socket), `agent status`/`stop` did not see it
    and `agent start` (the connector's spawnAgent too) was refused as "already running": the query
    failed with "no agent socket ... Start it", and nothing could start it. The agent now notices at
    its next heartbeat and stops cleanly, so it can be started again (here by the connector)."""
    alice, bob = start_members(tmp_path / "own", ["alice", "bob"], settings={"agent.heartbeat_interval": "0.5"})
    group = "swept"
    old_pid = alice.pid()
    out, ck = tmp_path / "delta", tmp_path / "ck"
    try:
        form_group([alice, bob], group)
        ids = [f"m{i}" for i in range(400)]
        bob.client().publish(group, [i.encode() for i in ids[:200]], message_ids=ids[:200])
        query = (source(spark, group, alice, startingOffsets="earliest", agentTimeoutMs="20000")
                 .writeStream.format("delta").option("checkpointLocation", str(ck))
                 .trigger(processingTime="300 milliseconds").start(str(out)))
        try:
            wait_for(lambda: rows_in(query) >= 200, 120, "the first 200 messages")
            import shutil

            alice.close_client()
            shutil.rmtree(alice.socket_dir)
            bob.client().publish(group, [i.encode() for i in ids[200:]], message_ids=ids[200:])
            wait_for(lambda: not query.isActive or rows_in(query) >= 400, 90, "the query to ride over or fail")
        finally:
            query.stop()
        assert query.exception() is None, str(query.exception())[:2000]
        wait_for(lambda: not os.path.exists(f"/proc/{old_pid}"), 30, "the unreachable agent to stop")
        assert alice.running() and alice.pid() != old_pid  # started again, on demand, and findable
        _exactly_once(spark, out, set(ids))
    finally:
        if old_pid is not None and os.path.exists(f"/proc/{old_pid}"):
            os.kill(old_pid, signal.SIGKILL)  # the unreachable agent: nothing else can stop it
        for member in (alice, bob):
            member.remove()


# --- clear errors, no hangs --------------------------------------------------------------------


@pytest.mark.parametrize("options, words", [
    ({"maxMessagePerTrigger": "5"}, "Did you mean 'maxMessagesPerTrigger'"),
    ({"group": None}, "option group is missing"),
    ({"startingOffsets": "yesterday"}, "startingOffsets is 'yesterday'"),
    ({"failOnDataLoss": "perhaps"}, "failOnDataLoss is 'perhaps', not a boolean"),
    ({"publishTimeoutMs": "10"}, "applies to writes only"),
    ({"agentTimeoutMs": str(10**14)}, "agentTimeoutMs is 100000000000000; it must be at most"),
    # These said "option group: a group name is a non-empty string, got str".
    ({"group": "sensors,"}, "option group is 'sensors,': the comma-separated list has an empty name \\(name 2 of 2, "
                            "after 'sensors'\\)"),
    ({"group": '["a", ""]'}, "the JSON list has an empty name \\(name 2 of 2, after 'a'\\)"),
])
def test_bad_options_fail_at_load_naming_the_option(spark, options, words):
    reader = spark.readStream.format("zerocomm")
    settings = {"group": "sensors", **options}
    for key, value in settings.items():
        if value is not None:
            reader = reader.option(key, value)
    started = time.monotonic()
    with pytest.raises(Exception, match=words):
        reader.load()
    assert time.monotonic() - started < 60


def test_a_path_given_to_load_is_refused_naming_the_group_option(spark):
    """spark.readStream.format("zerocomm").load("sensors") ignored "sensors" without a word."""
    started = time.monotonic()
    for reader in (spark.readStream, spark.read):
        with pytest.raises(Exception, match="take no path, but load\\(\\) was given 'sensors'") as info:
            reader.format("zerocomm").option("group", "g").load("sensors")
        assert 'option(\"group\", ...)' in str(info.value) or '.option("group", ...)' in str(info.value)
    assert time.monotonic() - started < 60


def _fails_fast(spark, frame, words: list[str], tmp_path, timeout: float = 90) -> None:
    started = time.monotonic()
    query = frame.writeStream.format("noop").option("checkpointLocation", str(tmp_path / uuid.uuid4().hex)).start()
    try:
        with pytest.raises(Exception) as info:
            query.awaitTermination(timeout)
            raise AssertionError("the query did not fail")
    finally:
        query.stop()
    text = str(info.value)
    for word in words:
        assert word in text, text[:2000]
    assert time.monotonic() - started < timeout


def test_unknown_group_and_unreachable_agent_fail_at_start(spark, members, tmp_path):
    alice = members["alice"]
    unknown = source(spark, "no-such-group", alice)
    _fails_fast(spark, unknown, ["GroupNotFoundError", "no-such-group"], tmp_path)

    nowhere = tmp_path / "nowhere"
    nowhere.mkdir()
    dead = (spark.readStream.format("zerocomm").option("group", "g").option("agent", str(nowhere))
            .option("spawnAgent", "false").option("agentTimeoutMs", "2000").load())
    _fails_fast(spark, dead, ["AgentNotRunningError", str(nowhere)], tmp_path)
    started = time.monotonic()
    with pytest.raises(Exception, match="AgentNotRunningError"):
        (spark.read.format("zerocomm").option("group", "g").option("agent", str(nowhere))
         .option("spawnAgent", "false").option("agentTimeoutMs", "2000").load().collect())
    assert time.monotonic() - started < 60


def test_sink_refuses_bad_input_at_start(spark, members, tmp_path):
    bob = members["bob"]
    frame = spark.readStream.format("rate").load()
    writer = frame.writeStream.format("zerocomm").option("group", "g").option("agent", str(bob.config))
    query = writer.option("checkpointLocation", str(tmp_path / "ck")).start()
    with pytest.raises(Exception, match="no payload column \\(found 'value': rename it to payload\\)"):
        query.awaitTermination(90)
    query.stop()
    with pytest.raises(Exception, match="cannot overwrite"):
        (spark.range(3).selectExpr("CAST(id AS STRING) AS payload").write.format("zerocomm")
         .option("group", "g").mode("overwrite").save())


def test_a_publish_batch_bytes_no_request_can_carry_is_refused_at_start(spark, members, tmp_path):
    """publishBatchBytes past the agent's api.max_request_bytes (64 MiB here) can never be published:
    every task failed at every retry. start() and save() refuse it, naming the option and the limit."""
    bob = members["bob"]
    too_big = str(64 * 1024 * 1024 + 1)
    started = time.monotonic()
    frame = spark.readStream.format("rate").load().selectExpr("CAST(value AS STRING) AS payload")
    writer = (frame.writeStream.format("zerocomm").option("group", "g").option("agent", str(bob.config))
              .option("publishBatchBytes", too_big).option("checkpointLocation", str(tmp_path / "ck")))
    words = f"publishBatchBytes is {too_big}, more than the {64 * 1024 * 1024 * 15 // 16} bytes"
    try:
        query = writer.start()
    except Exception as exc:  # noqa: BLE001 - refused by start() itself
        assert words in str(exc)
    else:
        try:
            with pytest.raises(Exception, match=words):
                query.awaitTermination(90)
        finally:
            query.stop()
    with pytest.raises(Exception, match=words):
        (spark.range(3).selectExpr("CAST(id AS STRING) AS payload").write.format("zerocomm")
         .option("group", "g").option("agent", str(bob.config)).option("publishBatchBytes", too_big)
         .mode("append").save())
    assert time.monotonic() - started < 90


# --- several executor processes, each with its own member ---------------------------------------

_CLUSTER_APP = textwrap.dedent("""
    import json, sys
    from pyspark.sql import SparkSession
    from zerocomm_spark.connector.session import delta_jars
    master, group, out, ck = sys.argv[1:5]
    spark = (SparkSession.builder.master(master).appName("zerocomm-two-executors")
             .config("spark.jars", ",".join(delta_jars()))
             .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
             .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
             .config("spark.pyspark.python", sys.executable).config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.ui.enabled", "false")
             .config("spark.executor.cores", "1").config("spark.cores.max", "2")
             .config("spark.executor.memory", "600m").config("spark.sql.shuffle.partitions", "2")
             .config("spark.databricks.delta.snapshotPartitions", "2")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    import time
    began = time.time()
    deadline = time.time() + 120
    while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 3 and time.time() < deadline:
        time.sleep(0.2)
    print("executors up", round(time.time() - began, 1), file=sys.stderr, flush=True)
    # no register() call: format("zerocomm") comes from Spark's own lookup of pyspark_* modules
    (spark.range(0, 400, 1, 4).selectExpr("CAST(id AS STRING) AS payload")
     .write.format("zerocomm").option("group", group).mode("append").save())
    print("written", round(time.time() - began, 1), file=sys.stderr, flush=True)
    time.sleep(1.0)
    rows = (spark.read.format("zerocomm").option("group", group).option("minPartitions", "4").load()
            .select("publisher_label", "seq", "payload").collect())
    print("read", round(time.time() - began, 1), file=sys.stderr, flush=True)
    q = (spark.readStream.format("zerocomm").option("group", group).option("startingOffsets", "earliest")
         .option("minPartitions", "4").load()
         .writeStream.format("delta").option("checkpointLocation", ck).trigger(availableNow=True).start(out))
    q.awaitTermination(120)
    print("streamed", round(time.time() - began, 1), file=sys.stderr, flush=True)
    print(json.dumps({"labels": sorted({r.publisher_label for r in rows}), "count": len(rows),
                      "executors": spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1}))
    spark.stop()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(600)
def test_two_executor_processes_each_use_their_own_member(spark, members, tmp_path):
    import pyspark

    alice, bob = members["alice"], members["bob"]
    workers = start_members(tmp_path / "workers", ["exec1", "exec2"])
    group = f"g{uuid.uuid4().hex[:8]}"
    form_group([alice, bob, *workers], group)
    spark_class = str(Path(pyspark.__file__).parent / "bin" / "spark-class")
    port = _free_port()
    base_env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
                "SPARK_HOME": str(Path(pyspark.__file__).parent)}
    procs = [subprocess.Popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(_free_port())],
                              env=base_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)]
    try:
        for worker in workers:
            # each worker (a "host") has its own member: its executors inherit ZEROCOMM_CONFIG
            procs.append(subprocess.Popen(
                [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1",
                 "--memory", "1g", "--webui-port", str(_free_port()), "--work-dir", str(tmp_path / worker.label),
                 f"spark://127.0.0.1:{port}"],
                env={**base_env, **worker.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))
        before = {w.label: w.client().metrics()["api_calls"].get("read", {}).get("count", 0) for w in workers}
        # Spark finds format("zerocomm") by itself when pyspark_zerocomm is importable (an installed wheel)
        shim = tmp_path / "site"
        shim.mkdir()
        (shim / "pyspark_zerocomm").symlink_to(ROOT / "connector" / "pyspark_zerocomm")
        app = tmp_path / "app.py"
        app.write_text(_CLUSTER_APP)
        env = {**base_env, **alice.env, "PYTHONPATH": str(shim)}
        done = subprocess.run([sys.executable, str(app), f"spark://127.0.0.1:{port}", group,
                               str(tmp_path / "delta"), str(tmp_path / "ck")],
                              env=env, capture_output=True, text=True, timeout=540, cwd=str(ROOT))
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for worker in workers:
            try:
                worker.client().leave(group, timeout=10)
            except ZeroCommError:
                pass
    after = {w.label: w.client().metrics()["api_calls"].get("read", {}).get("count", 0) for w in workers}
    for worker in workers:
        worker.remove()
    assert result["executors"] == 2
    # every executor published through the member of its own host: two publishers, no driver's
    assert result["labels"] == ["exec1", "exec2"]
    # the table the cluster's query wrote, read by this run's (warm) session: in the app, whose JVMs
    # had never read Delta, the count took 17-32 s of a loaded 2-core machine
    assert result["count"] == 400 and delta(spark, tmp_path / "delta").count() == 400
    # and reads ran on both executors, each against its own member
    assert all(after[label] > before[label] for label in before), (before, after)
