"""format("zerocomm") with several executor processes: ``local-cluster[2,1,1024]``, two executor JVMs
with one core each and their own Python workers, as on a cluster, next to real member agents.

In plain local mode the driver is the only executor, so the source's partitions and the sink's tasks
all ran in one process; here they run in two, each reaching the host's agent itself (or starting it).
The session runs in a driver process of its own (cluster_driver.py: one SparkContext per process, and
the run's shared session is plain local mode); each test sends it functions to run.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from zerocomm_spark.connector.local_members import LocalMember, form_group, start_members
from zerocomm_spark.errors import ZeroCommError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_driver import ClusterDriver  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(420)]

EXECUTORS = 2


def _by_value() -> None:
    # The functions below run in the cluster driver: pickle them (and this module's helpers) by value.
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_by_value()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    driver = ClusterDriver(tmp_path_factory.mktemp("cluster"), executors=EXECUTORS)
    try:
        assert driver.executors == EXECUTORS, driver.tail()
        print(f"local-cluster[{EXECUTORS},1,1024] up in {driver.start_seconds}s")
        yield driver
    finally:
        driver.stop()


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    base = tmp_path_factory.mktemp("members")
    started = start_members(base, ["alice", "bob", "carol"])
    yield {m.label: m for m in started}
    for member in started:
        member.remove()


def new_group(members: dict[str, LocalMember], *labels: str) -> str:
    name = f"g{uuid.uuid4().hex[:8]}"
    form_group([members[label] for label in labels], name)
    return name


def publish(member: LocalMember, group: str, payloads: list[str]) -> None:
    member.client().publish(group, [p.encode() for p in payloads], timeout=60)


# --- run in the cluster driver ------------------------------------------------------------------


def _executor_jvm() -> int:
    """The pid of the executor JVM this Python worker belongs to (its nearest `java` ancestor)."""
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
        if stat[stat.index("(") + 1:stat.rindex(")")] == "java":
            return pid
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return -1


def _mark_task(marks: str) -> None:
    """Leave a file naming the executor JVM, stage, partition and attempt of the running task (once)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    name = (f"{_executor_jvm()}-{context.stageId()}-{context.partitionId()}-{context.attemptNumber()}"
            if context else "none")
    path = os.path.join(marks, name)
    if not os.path.exists(path):
        open(path, "a").close()


def _read_stream_to_parquet(spark, group: str, agent: str, out: str, ck: str, run: str, timeout: float,
                            **options: str) -> list[int]:
    """A streaming query over the group (availableNow) whose every batch appends its rows, with the
    executor that read them, to ``out`` (not idempotent: a re-run batch shows up twice)."""
    from pyspark.sql import functions as F

    reader = spark.readStream.format("zerocomm").option("group", group).option("agent", agent)
    for key, value in options.items():
        reader = reader.option(key, value)
    executor = F.udf(_executor_jvm, "bigint").asNondeterministic()

    def each_batch(frame, batch_id: int) -> None:
        (frame.withColumn("executor", executor()).withColumn("partition", F.spark_partition_id())
         .withColumn("batch", F.lit(batch_id)).withColumn("run", F.lit(run))
         .write.mode("append").parquet(out))

    query = (reader.load().writeStream.foreachBatch(each_batch).option("checkpointLocation", ck)
             .trigger(availableNow=True).start())
    try:
        if not query.awaitTermination(timeout):
            raise AssertionError(f"the query did not finish within {timeout}s")
    finally:
        query.stop()
    if query.exception() is not None:
        raise AssertionError(f"the query failed: {query.exception()}")
    return [p["numInputRows"] for p in query.recentProgress]


def _collect(spark, path: str) -> list[dict]:
    return [row.asDict() for row in spark.read.parquet(path).collect()]


def _flaky_identity(marks: str, fail_after: int) -> Callable[[str], str]:
    """The payload unchanged; the first attempt of every odd partition fails after ``fail_after`` rows."""
    seen = {"rows": 0}

    def identity(payload: str) -> str:
        from pyspark import TaskContext

        _mark_task(marks)
        context = TaskContext.get()
        if context is not None and context.attemptNumber() == 0 and context.partitionId() % 2 == 1:
            seen["rows"] += 1
            if seen["rows"] > fail_after:
                time.sleep(2.0)  # the sink publishes what it got before the task fails
                raise RuntimeError("injected failure of a sink task's first attempt")
        return payload

    return identity


def _write_stream(spark, group: str, agent: str, src: str, ck: str, marks: str, timeout: float,
                  fail_after: int | None, batch_size: int) -> dict:
    """A streaming write of ``src``'s payloads to the group, 4 tasks a batch after a shuffle; with
    ``fail_after``, the first attempt of every odd task fails midway (after publishing some rows)."""
    from pyspark.sql import functions as F

    # small batches everywhere, so a sink task publishes rows long before its last one is computed
    small = ("spark.sql.execution.arrow.maxRecordsPerBatch", "spark.sql.execution.python.udf.maxRecordsPerBatch")
    for key in small:
        spark.conf.set(key, str(batch_size))
    frame = spark.readStream.schema("payload STRING").option("maxFilesPerTrigger", 2).parquet(src).repartition(4)
    if fail_after is not None:
        frame = frame.select(F.udf(_flaky_identity(marks, fail_after), "string")("payload").alias("payload"))
    else:
        frame = frame.select(F.udf(lambda p: (_mark_task(marks), p)[1], "string")("payload").alias("payload"))
    query = (frame.writeStream.format("zerocomm").option("group", group).option("agent", agent)
             .option("publishBatchSize", str(batch_size)).option("checkpointLocation", ck)
             .trigger(availableNow=True).start())
    try:
        if not query.awaitTermination(timeout):
            raise AssertionError(f"the query did not finish within {timeout}s")
    finally:
        query.stop()
        for key in small:
            spark.conf.unset(key)
    if query.exception() is not None:
        raise AssertionError(f"the query failed: {query.exception()}")
    return {"id": str(query.id), "rows": sum(p["numInputRows"] for p in query.recentProgress)}


def _write_batch(spark, group: str, agent: str, marks: str, count: int, partitions: int) -> None:
    from pyspark.sql import functions as F

    frame = spark.range(0, count, 1, partitions).selectExpr("CAST(id AS STRING) AS payload")
    (frame.select(F.udf(lambda p: (_mark_task(marks), p)[1], "string")("payload").alias("payload"))
     .write.format("zerocomm").option("group", group).option("agent", agent).option("spawnAgent", "true")
     .option("agentTimeoutMs", "60000").mode("append").save())


# --- checks in the test process -----------------------------------------------------------------


def journal(member: LocalMember, group: str, expected: int, timeout: float = 60.0) -> list[dict]:
    """The member's journaled rows of the group, once it holds ``expected`` of them (or the deadline)."""
    rows: list[dict] = []

    def enough() -> bool:
        nonlocal rows
        rows = member.client().read(group=group).to_pylist()
        return len(rows) >= expected

    try:
        wait_for(enough, timeout, f"{member.label} to hold {expected} messages")
    except AssertionError:
        pass  # the assertions on the rows say what is missing
    return rows


def marks_of(marks: Path) -> list[tuple[int, int, int, int]]:
    """(executor JVM, stage, partition, attempt) of every task that left a mark."""
    return [tuple(int(x) for x in p.name.split("-")) for p in marks.iterdir() if p.name != "none"]  # type: ignore


def publish_calls(member: LocalMember) -> int:
    return int(member.client().metrics()["api_calls"].get("publish", {}).get("count", 0))


# --- the source -------------------------------------------------------------------------------


def test_source_partitions_spread_over_both_executors_exactly_once_and_a_restart_continues(cluster, members,
                                                                                           tmp_path):
    alice, bob, carol = members["alice"], members["bob"], members["carol"]
    group = new_group(members, "alice", "bob", "carol")
    publish(bob, group, [f"bob-{i}" for i in range(600)])
    publish(carol, group, [f"carol-{i}" for i in range(400)])  # after bob's: causally after them
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    options = {"startingOffsets": "earliest", "maxMessagesPerTrigger": "250", "maxMessagesPerPartition": "50"}

    batches = cluster.call(_read_stream_to_parquet, group, str(alice.config), out, ck, "first", 240,
                           timeout=300, **options)
    assert sum(batches) == 1000 and len(batches) >= 4, batches

    # Restart from the checkpoint: the last batch re-runs (its commit is gone, as after a crash
    # between writing and committing it), then the messages published meanwhile follow.
    commits = sorted((p for p in (tmp_path / "ck" / "commits").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    rerun = int(commits[-1].name)
    commits[-1].unlink()
    (commits[-1].parent / f".{commits[-1].name}.crc").unlink(missing_ok=True)
    publish(bob, group, [f"bob-{i}" for i in range(600, 800)])
    publish(carol, group, [f"carol-{i}" for i in range(400, 500)])
    cluster.call(_read_stream_to_parquet, group, str(alice.config), out, ck, "second", 240, timeout=300, **options)

    rows = cluster.call(_collect, out, timeout=120)
    first = [r for r in rows if r["run"] == "first"]
    second = [r for r in rows if r["run"] == "second"]
    # the re-run batch read exactly the range it had planned, no more, no less
    assert sorted(r["message_id"] for r in second if r["batch"] == rerun) == \
        sorted(r["message_id"] for r in first if r["batch"] == rerun)
    assert all(r["batch"] >= rerun for r in second)
    kept = first + [r for r in second if r["batch"] != rerun]
    ids = Counter(r["message_id"] for r in kept)
    assert len(ids) == 1300 and max(ids.values()) == 1, f"{sum(ids.values()) - len(ids)} duplicates"

    # columns and order: per publisher, seqs contiguous from 1 in publishing order; Lamport clocks grow
    assert {r["group"] for r in kept} == {group}
    by_label: dict[str, list[dict]] = {}
    for r in kept:
        by_label.setdefault(r["publisher_label"], []).append(r)
    assert sorted(by_label) == ["bob", "carol"]
    for member, count in ((bob, 800), (carol, 500)):
        mine = sorted(by_label[member.label], key=lambda r: r["seq"])
        assert [r["seq"] for r in mine] == list(range(1, count + 1))
        assert [bytes(r["payload"]).decode() for r in mine] == [f"{member.label}-{i}" for i in range(count)]
        assert {r["publisher_did"] for r in mine} == {member.did(group)}
        lamports = [r["lamport_ts"] for r in mine]
        assert lamports == sorted(lamports) and len(set(lamports)) == count
        assert all(r["sent_at"] <= r["received_at"] for r in mine)
    bob_first = max(r["lamport_ts"] for r in by_label["bob"] if r["seq"] <= 600)
    assert min(r["lamport_ts"] for r in by_label["carol"]) > bob_first  # causality across publishers

    # several partitions a batch, read on both executor processes (none on the driver)
    executors = {r["executor"] for r in rows}
    assert len(executors) == EXECUTORS and -1 not in executors, executors
    per_batch: dict[tuple[str, int], list[int]] = {}
    for r in rows:
        per_batch.setdefault((r["run"], r["batch"]), []).append(r["partition"])
    # a batch's partitions: one per 50 messages of a publisher (maxMessagesPerPartition)
    assert all(len(set(parts)) >= min(len(parts) // 50, 5) for parts in per_batch.values()), per_batch
    spread = {(r["run"], r["batch"]) for r in rows
              if len({x["executor"] for x in rows if (x["run"], x["batch"]) == (r["run"], r["batch"])}) == 2}
    assert spread, "no batch had partitions read on both executors"


# --- the sink ---------------------------------------------------------------------------------


def test_sink_tasks_on_both_executors_publish_every_row_once_through_retries_and_a_rerun(cluster, members,
                                                                                         tmp_path):
    from zerocomm_spark.connector.writer import derived_id

    alice, bob = members["alice"], members["bob"]
    group = new_group(members, "alice", "bob")
    src, ck, marks = tmp_path / "src", tmp_path / "ck", tmp_path / "marks"
    marks.mkdir()
    # 4 kB payloads: the JVM hands a Python worker its input through a 64 kB buffer, and the first
    # attempts must have rows to publish before they fail
    cluster.call(lambda spark, path: spark.range(0, 1200, 1, 4)
                 .selectExpr("concat(CAST(id AS STRING), ':', repeat('x', 4000)) AS payload")
                 .write.parquet(path), str(src), timeout=120)
    calls_before = publish_calls(bob)
    batch_size = 20
    result = cluster.call(_write_stream, group, str(bob.config), str(src), str(ck), str(marks), 240,
                          fail_after=120, batch_size=batch_size, timeout=300)
    assert result["rows"] == 1200
    calls = publish_calls(bob) - calls_before

    rows = journal(alice, group, 1200)
    payloads = Counter(bytes(r["payload"]).decode().split(":")[0] for r in rows)
    assert len(rows) == 1200 and payloads == Counter(str(i) for i in range(1200)), \
        f"{len(rows)} rows, {sum(n - 1 for n in payloads.values())} duplicates, {1200 - len(payloads)} missing"
    # ids as the sink documents them: <query id>.<batch id>.<partition>.<hash>.<n>
    tasks: Counter[str] = Counter()
    for r in rows:
        prefix, _, n = r["message_id"].rsplit(".", 2)
        assert prefix.startswith(result["id"] + ".")
        assert r["message_id"] == derived_id(prefix, bytes(r["payload"]), r.get("headers"), int(n))
        tasks[prefix] += 1
    assert len(tasks) >= 8  # 4 tasks in each of at least 2 batches
    # the tasks ran on both executors, and every odd task failed once and was retried
    ran = marks_of(marks)
    assert len({executor for executor, *_ in ran}) == EXECUTORS, ran
    retried = {(stage, part) for _, stage, part, attempt in ran if attempt > 0}
    assert retried and all(part % 2 == 1 for _, part in retried), ran
    # the first attempts published before failing: the retries published their ids again (the
    # member dropped them), more calls than one clean attempt of every task makes
    clean = sum(math.ceil(n / batch_size) for n in tasks.values())
    assert calls > clean, (calls, clean)

    # a re-run micro-batch (its commit gone, as after a crash before committing) publishes the same ids
    commits = sorted((p for p in (ck / "commits").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    commits[-1].unlink()
    (commits[-1].parent / f".{commits[-1].name}.crc").unlink(missing_ok=True)
    calls_before = publish_calls(bob)
    again = cluster.call(_write_stream, group, str(bob.config), str(src), str(ck), str(marks), 240,
                         fail_after=None, batch_size=batch_size, timeout=300)
    assert again["rows"] > 0 and publish_calls(bob) > calls_before  # the batch really ran again
    time.sleep(1.0)
    rows = journal(alice, group, 1200)
    assert len(rows) == 1200 and len({r["message_id"] for r in rows}) == 1200


# --- spawning the agent on demand from the executors --------------------------------------------


def _agent_processes(member: LocalMember) -> list[int]:
    """Pids of running agent processes serving ``member``'s configuration (not the CLI starting one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "zerocomm_spark.agent" in words and str(member.config) in words and "--ready-fd" in words:
            found.append(int(entry.name))
    return found


def test_executors_racing_to_spawn_the_agent_start_one(cluster, members, tmp_path):
    alice = members["alice"]
    (dave,) = start_members(tmp_path / "own", ["dave"])
    try:
        group = f"g{uuid.uuid4().hex[:8]}"
        form_group([alice, dave], group)
        dave.stop()
        wait_for(lambda: not dave.running() and not _agent_processes(dave), 30, "dave's agent to stop")
        marks = tmp_path / "marks"
        marks.mkdir()
        # 6 tasks on 2 one-core executors: the first two start together, each finding no agent
        cluster.call(_write_batch, group, str(dave.config), str(marks), 600, 6, timeout=240)
        ran = marks_of(marks)
        assert len({executor for executor, *_ in ran}) == EXECUTORS, ran
        assert all(attempt == 0 for *_, attempt in ran), ran  # no task failed on the race
        assert dave.running()
        wait_for(lambda: len(_agent_processes(dave)) == 1, 10, "one agent process for dave")
        assert _agent_processes(dave) == [dave.pid()]
        log = (dave.socket_dir / "agent.log").read_text(errors="replace")
        assert log.count('"msg":"agent started"') == 2  # the first start, and one on demand
        rows = journal(alice, group, 600)
        assert sorted(int(bytes(r["payload"])) for r in rows) == list(range(600))
        assert {r["publisher_did"] for r in rows} == {dave.did(group)}
    finally:
        dave.remove()
        shutil.rmtree(tmp_path / "own", ignore_errors=True)



# --- an agent killed under a running query: executors and driver race to start it again ----------


def _kept() -> dict:
    return sys.modules["__main__"].KEPT  # the cluster driver's


def _start_stream_to_delta(spark, group: str, agent: str, out: str, ck: str, **options: str) -> str:
    from pyspark.sql import functions as F

    reader = spark.readStream.format("zerocomm").option("group", group).option("agent", agent)
    for key, value in options.items():
        reader = reader.option(key, value)
    query = (reader.load().withColumn("executor", F.udf(_executor_jvm, "bigint").asNondeterministic()())
             .writeStream.format("delta").option("checkpointLocation", ck)
             .trigger(processingTime="300 milliseconds").start(out))
    _kept()[str(query.id)] = query
    return str(query.id)


def _query_state(spark, query_id: str, stop: bool = False) -> dict:
    query = _kept()[query_id]
    if stop:
        query.stop()
    failure = query.exception()
    return {"active": query.isActive, "rows": sum(p["numInputRows"] for p in query.recentProgress),
            "failure": str(failure)[:1500] if failure is not None else None}


def _drain_to_delta(spark, group: str, agent: str, out: str, ck: str, timeout: float) -> list[dict]:
    """Run the query on from its checkpoint until it has everything (availableNow); the table's rows."""
    from pyspark.sql import functions as F

    query = (spark.readStream.format("zerocomm").option("group", group).option("agent", agent)
             .option("startingOffsets", "earliest").load()
             .withColumn("executor", F.udf(_executor_jvm, "bigint").asNondeterministic()())
             .writeStream.format("delta").option("checkpointLocation", ck).trigger(availableNow=True).start(out))
    try:
        if not query.awaitTermination(timeout):
            raise AssertionError(f"the drain did not finish within {timeout}s")
    finally:
        query.stop()
    if query.exception() is not None:
        raise AssertionError(f"the drain failed: {query.exception()}")
    return [r.asDict() for r in spark.read.format("delta").load(out).select("message_id", "executor").collect()]


class Publisher(threading.Thread):
    """Publishes messages ``first`` to ``total - 1`` (ids fixed) in small batches, retrying (same ids)
    while a member is down."""

    def __init__(self, member: LocalMember, group: str, first: int, total: int, batch: int = 50):
        super().__init__(daemon=True)
        self.member, self.group, self.total, self.batch = member, group, total, batch
        self.done = first
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.done < self.total:
                ids = [f"{self.group}-{i}" for i in range(self.done, min(self.done + self.batch, self.total))]
                for attempt in range(60):
                    try:
                        self.member.client().publish(self.group, [i.encode() for i in ids], message_ids=ids,
                                                     timeout=10)
                        break
                    except ZeroCommError:
                        if attempt == 59:
                            raise
                        time.sleep(0.5)
                self.done += len(ids)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_an_agent_killed_under_a_query_is_started_again_once_and_the_stream_stays_exactly_once(cluster, tmp_path):
    ann, ben = start_members(tmp_path / "own", ["ann", "ben"])
    group = "killed"
    out, ck = str(tmp_path / "delta"), str(tmp_path / "ck")
    try:
        form_group([ann, ben], group)
        ids = [f"{group}-{i}" for i in range(300)]
        ben.client().publish(group, [i.encode() for i in ids], message_ids=ids, timeout=60)
        query = cluster.call(_start_stream_to_delta, group, str(ann.config), out, ck, startingOffsets="earliest",
                             maxMessagesPerTrigger="150", maxMessagesPerPartition="40", agentTimeoutMs="20000")
        publisher = Publisher(ben, group, first=300, total=450)
        try:
            wait_for(lambda: cluster.call(_query_state, query)["rows"] >= 150, 120, "the first messages",
                     interval=1.0)
            old = ann.pid()
            ann.kill()  # kill -9, mid-stream: the driver's planner and both executors' readers lose it
            publisher.start()  # ben's publishes wait for ann's acks: retried (same ids) until it is back
            publisher.join(240)
            assert publisher.error is None and publisher.done == 450
            wait_for(lambda: not (s := cluster.call(_query_state, query))["active"] or s["rows"] >= 450, 240,
                     "the query to ride over the crash or fail", interval=1.0)
        finally:
            state = cluster.call(_query_state, query, stop=True)
        print("query after the agent was killed:", "failed: " + state["failure"] if state["failure"] else
              f"rode over it ({state['rows']} rows)")
        # started again on demand (by whichever of the driver and the executors got there first): once
        wait_for(lambda: ann.running(), 60, "ann's agent to run again")
        assert ann.pid() != old
        wait_for(lambda: len(_agent_processes(ann)) == 1, 10, "one agent process for ann")
        assert _agent_processes(ann) == [ann.pid()]
        rows = cluster.call(_drain_to_delta, group, str(ann.config), out, ck, 180, timeout=240)
        ids = Counter(r["message_id"] for r in rows)
        assert set(ids) == {f"{group}-{i}" for i in range(450)} and max(ids.values()) == 1, \
            f"{sum(ids.values()) - len(ids)} duplicates, {450 - len(ids)} missing"
        assert len({r["executor"] for r in rows}) == EXECUTORS and -1 not in {r["executor"] for r in rows}
    finally:
        for member in (ann, ben):
            member.remove()
