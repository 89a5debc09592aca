"""The main job: a local group of members feeding Spark and Delta, end to end on one machine.

``bash scripts/main.sh`` (``python -m zerocomm_spark.pipelines.main --help`` for the options):

1. starts a group of real members (a *historian* and N publishers; ``embedded`` agents in this
   process by default, ``--mode agents`` for agent processes started through ``zerocomm``);
2. starts the history ingest: a Spark streaming query from format("zerocomm") on the historian's
   member into a Delta history table (pipelines/history.py), exactly once, origin proofs kept;
3. has every publisher publish a paced stream of signed messages, some of them replies to
   messages it received from the others (so causality can be checked afterwards);
4. waits (with a deadline) until Delta holds every message, stops the query;
5. replays the group from Delta in causal order (pipelines/replay.py), verifies every origin,
   checks that nothing is missing or doubled and that every reply comes after what it answers;
6. prints a short summary: messages, publishers, rates, latencies (exit status 1 if a check failed).

A job that cannot go on (a member or Spark failing, a publisher or the ingest query failing, the
--timeout deadline, which bounds publishing, the wait for Delta, the replay and the checks, and is
checked after each start-up step) ends with one line
saying what failed and what to do, exit 1 (2 for an option out of range or a --work-dir that
cannot be a directory, before anything starts). Spark's log (the JVM's and its
workers' stderr) and the failure's traceback go to the job's log file, which that line names.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from zerocomm_spark.deadlines import MAX_TIMEOUT
from zerocomm_spark.paths import what_is

__all__ = ["JobConfig", "build_parser", "main", "run"]

log = logging.getLogger("zerocomm_spark.pipelines.main")

PUBLISHER_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")
REPLY_HEADER = "in_reply_to"


@dataclass(frozen=True)
class JobConfig:
    """The main job's settings (the command line's options)."""

    mode: str = "embedded"
    publishers: int = 3
    messages: int = 300  # per publisher
    rate: float = 60.0  # messages per second per publisher
    reply_fraction: float = 0.2
    payload_bytes: int = 64
    group: str = "demo"
    work_dir: str | None = None
    table: str | None = None
    encrypt: bool = False
    trigger: str = "1 second"
    timeout: float = 300.0
    keep: bool = False
    as_json: bool = False


def build_parser() -> argparse.ArgumentParser:
    d = JobConfig()
    p = argparse.ArgumentParser(
        prog="scripts/main.sh",
        description="Start a local ZeroComm group, publish a stream of signed messages, ingest it into a Delta "
                    "history table with Spark, replay it in causal order and print a summary. Exit status 1 if a "
                    "check failed (a message missing or doubled, a reply before what it answers, a bad origin).")
    p.add_argument("--mode", choices=("embedded", "agents"), default=d.mode,
                   help="members inside this process (default), or agent processes started through `zerocomm`")
    p.add_argument("--publishers", type=int, default=d.publishers, help="publishing members, 1-10 (default %(default)s)")
    p.add_argument("--messages", type=int, default=d.messages, help="messages per publisher (default %(default)s)")
    p.add_argument("--rate", type=float, default=d.rate,
                   help="messages per second per publisher (default %(default)s)")
    p.add_argument("--reply-fraction", type=float, default=d.reply_fraction,
                   help="share of messages that reply to one received from another publisher (default %(default)s)")
    p.add_argument("--payload-bytes", type=int, default=d.payload_bytes, help="payload size (default %(default)s)")
    p.add_argument("--group", default=d.group, help="the group's name (default %(default)s)")
    p.add_argument("--work-dir", default=None,
                   help="where members, table and checkpoint live (default: a temporary directory, removed)")
    p.add_argument("--table", default=None, help="the Delta history table (default: WORK_DIR/history)")
    p.add_argument("--encrypt", action="store_true", help="store payloads sealed with a fresh group history key")
    p.add_argument("--trigger", default=d.trigger, help="the ingest query's trigger interval (default %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help="deadline of the whole job in seconds (default %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory (table, members)")
    p.add_argument("--json", dest="as_json", action="store_true", help="print the summary as one JSON document")
    return p


class JobDeadlineError(Exception):
    """The job's deadline (--timeout) passed: in which phase, and what the job had done by then."""

    def __init__(self, timeout: float, phase: str, done: str) -> None:
        self.timeout, self.phase, self.done = timeout, phase, done
        super().__init__(f"the job's deadline (--timeout {timeout:g}s) passed while {phase}; {done}")


class IngestQueryFailedError(Exception):
    """The ingest streaming query stopped with an error (the table or its checkpoint could not be
    written, a micro-batch failed...): Spark's reason in one line, the phase, what the job had done."""

    def __init__(self, reason: str, phase: str, done: str, table: str, checkpoint: str) -> None:
        self.reason, self.phase, self.done, self.table, self.checkpoint = reason, phase, done, table, checkpoint
        super().__init__(f"the ingest query failed while {phase}: {reason} ({done})")


class PublishFailedError(Exception):
    """A publisher could not publish (its member's agent gone, a publish nobody acknowledged...)."""

    def __init__(self, errors: Sequence[str], done: str) -> None:
        self.errors, self.done = list(errors), done
        super().__init__(f"publishing failed: {'; '.join(self.errors)} ({done})")


@dataclass
class _Published:
    ids: list[str] = field(default_factory=list)
    replies: dict[str, str] = field(default_factory=dict)  # reply id -> the id it answers
    errors: list[str] = field(default_factory=list)


def _publisher(member: Any, group: str, cfg: JobConfig, out: _Published, lock: threading.Lock,
               deadline: float, seed: int, stop: threading.Event | None = None) -> None:
    """Publish ``cfg.messages`` at ``cfg.rate`` per second, a chunk every 200 ms.

    A publish returns once every member acknowledged it (tens of ms), so up to four chunks are in
    flight at once: the pace is the rate asked for, not one round trip per chunk. Stops early when
    ``stop`` is set (another publisher failed) or at the deadline, which the job reports itself: only
    other failures go to ``out.errors``.
    """
    from concurrent.futures import Future, ThreadPoolExecutor, wait

    stop = stop or threading.Event()

    rng = random.Random(seed)
    chunk = max(1, int(cfg.rate / 5))
    sent = 0
    began = time.monotonic()
    heard: list[str] = []
    pending: list[tuple[Future[Any], list[str], list[dict[str, str] | None]]] = []

    def settle(block: bool) -> None:
        while pending and (block or pending[0][0].done() or len(pending) >= 4):
            future, ids, headers = pending[0]
            until = time.monotonic() + max(deadline - time.monotonic(), 1.0)
            while not future.done():  # in slices: a publisher stops as soon as the job fails
                if stop.is_set():
                    raise InterruptedError("stopped: the job is failing")
                if time.monotonic() >= until:
                    raise TimeoutError(f"{member.label}'s publish did not return within the job's deadline")
                wait([future], timeout=0.2)
            pending.pop(0)
            future.result()
            with lock:
                out.ids.extend(ids)
                for mid, h in zip(ids, headers):
                    if h:
                        out.replies[mid] = h[REPLY_HEADER]

    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"publish-{member.label}")
    try:
        while sent < cfg.messages:
            if stop.is_set() or time.monotonic() > deadline:
                return
            n = min(chunk, cfg.messages - sent)
            if cfg.reply_fraction > 0:
                # What this member delivered from the others: a reply to one is causally after it.
                recent = member.client.fetch(group=group, last=64).table
                heard = [mid for mid, did in zip(recent.column("message_id").to_pylist(),
                                                 recent.column("publisher_did").to_pylist()) if did != member.did]
            ids, payloads, headers = [], [], []
            for i in range(sent, sent + n):
                mid = f"{member.label}-{i}-{uuid.uuid4().hex[:8]}"
                text = f"{member.label} #{i}".encode()
                payloads.append(text + b"." * max(cfg.payload_bytes - len(text), 0))
                ids.append(mid)
                answer = rng.choice(heard) if heard and rng.random() < cfg.reply_fraction else None
                headers.append({REPLY_HEADER: answer} if answer else None)
            future = pool.submit(member.publish, group, payloads, message_ids=ids, headers=headers,
                                 timeout=max(min(deadline - time.monotonic(), 120.0), 1.0))
            pending.append((future, ids, headers))
            settle(block=False)
            sent += n
            pause = began + sent / cfg.rate - time.monotonic()
            if pause > 0:
                stop.wait(pause)
        settle(block=True)
    except Exception as exc:  # noqa: BLE001 - reported by the job, which fails
        if stop.is_set() or (isinstance(exc, TimeoutError) and time.monotonic() >= deadline - 1.0):
            return  # the job is failing already, or its deadline passed: it says so itself
        log.warning("%s could not publish", member.label, exc_info=True, extra={"file_only": True})
        with lock:
            out.errors.append(f"{member.label}: {type(exc).__name__}: {str(exc)[:300]}")
        stop.set()
    finally:
        # What is still in flight when the job fails would only fail too: not waited for here.
        pool.shutdown(wait=not stop.is_set(), cancel_futures=True)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": round(at(0.50), 4), "p95": round(at(0.95), 4), "max": round(ordered[-1], 4)}


def _warm_up(spark: Any, scratch: Path, table: str, agent: str, group: str) -> None:
    """Pay Spark's first-use costs before the clock runs (Python workers importing the connector, the
    history table's first Delta snapshot), so the first micro-batch's latency is the pipeline's, not
    the JVM's and the workers' warm-up."""
    import pyarrow as pa

    from zerocomm_spark.pipelines.history import ensure_table

    spark.range(4).mapInArrow(lambda batches: (b for b in batches), "id long").count()
    spark.createDataFrame(pa.table({"x": [1]})).write.format("delta").mode("overwrite").save(str(scratch))
    spark.read.format("zerocomm").option("group", group).option("agent", agent).load().count()
    ensure_table(spark, table)
    spark.read.format("delta").load(table).count()


def _within_deadline(spark: Any, deadline: float, timeout: float, phase: str, done: Any, work: Any) -> Any:
    """``work()`` (Spark actions: the replay, the checks' reads) on a thread of its own, waited for until
    the job's deadline; then its Spark jobs are cancelled and JobDeadlineError says so (``done()``: what
    the job had done). A read of a table whose storage hangs never returns on its own."""
    job_group = f"zerocomm-main-{uuid.uuid4().hex[:12]}"
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            spark.sparkContext.setJobGroup(job_group, phase, interruptOnCancel=True)
            box["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - raised again on the job's thread
            box["error"] = exc

    worker = threading.Thread(target=body, name=f"main-{phase.split()[0]}", daemon=True)
    worker.start()
    worker.join(max(deadline - time.monotonic(), 0.0))
    if worker.is_alive():
        log.warning("the deadline passed while %s: cancelling its Spark jobs", phase, extra={"file_only": True})
        # Its running jobs and those it would submit next (the replay is several jobs in a row: a cancel
        # between two of them hit nothing, and the next ran on after the job had failed).
        until = time.monotonic() + 5.0
        _cancel_group(spark, job_group)
        while worker.is_alive() and time.monotonic() < until:
            worker.join(0.5)  # (a task stuck in a read the cancel cannot interrupt is left behind: a daemon)
            _cancel_group(spark, job_group)
        raise JobDeadlineError(timeout, phase, done())
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _cancel_group(spark: Any, job_group: str) -> None:
    """Cancel the group's running jobs and any it submits later (Spark 4's cancelJobGroupAndFutureJobs;
    cancelJobGroup, which cancels only the running ones, where that is missing)."""
    try:
        spark.sparkContext._jsc.sc().cancelJobGroupAndFutureJobs(job_group)
    except Exception:  # noqa: BLE001 - an older Spark: the running jobs at least
        spark.sparkContext.cancelJobGroup(job_group)


_STOP_TIMEOUT = "spark.sql.streaming.stopTimeout"


def _stop_query(spark: Any, query: Any, within: float) -> None:
    """Stop the query, waiting at most ``within`` seconds for its thread (Spark's stopTimeout; its default
    waits as long as a micro-batch takes, which a hung write makes forever). The session's own setting
    is put back: a notebook's or a caller's later stop() must not inherit this job's bound."""
    previous = spark.conf.get(_STOP_TIMEOUT, None)
    spark.conf.set(_STOP_TIMEOUT, f"{max(int(within * 1000), 1000)}ms")
    try:
        query.stop()
    finally:
        if previous is None:
            spark.conf.unset(_STOP_TIMEOUT)
        else:
            spark.conf.set(_STOP_TIMEOUT, previous)


def _wait_ready(query: Any, deadline: float) -> None:
    """Until the query's source is up (it has asked the member where the group stands)."""
    while time.monotonic() < deadline and query.isActive and query.status.get("message", "").startswith("Initializing"):
        time.sleep(0.2)


def _say(cfg: JobConfig, text: str) -> None:
    if not cfg.as_json:
        print(text, flush=True)


def run(cfg: JobConfig) -> dict[str, Any]:
    """Run the whole story once; returns the summary (``ok`` False if a check failed)."""
    from pyspark.sql import functions as F

    from zerocomm_spark.connector.session import local_spark
    from zerocomm_spark.pipelines.history import ingest, table_exists
    from zerocomm_spark.pipelines.history_key import HistoryKey
    from zerocomm_spark.pipelines.local_group import LocalGroup
    from zerocomm_spark.pipelines.replay import Since, latest_version, replay

    if not 1 <= cfg.publishers <= len(PUBLISHER_NAMES):
        raise SystemExit(f"--publishers must be 1-{len(PUBLISHER_NAMES)}")
    if cfg.messages < 1 or cfg.rate <= 0 or cfg.payload_bytes < 0 or not 0 <= cfg.reply_fraction <= 1:
        raise SystemExit("--messages >= 1, --rate > 0, --payload-bytes >= 0 and 0 <= --reply-fraction <= 1")
    deadline = time.monotonic() + cfg.timeout
    job_began = time.monotonic()
    work = Path(cfg.work_dir).absolute() if cfg.work_dir else Path(tempfile.mkdtemp(prefix="zerocomm-main-"))
    work.mkdir(parents=True, exist_ok=True)
    table = cfg.table or str(work / "history")
    run_id = uuid.uuid4().hex[:8]
    checkpoint = str(work / "checkpoints" / f"history-{run_id}")
    labels = ["historian", *PUBLISHER_NAMES[:cfg.publishers]]
    key = HistoryKey.generate() if cfg.encrypt else None
    summary: dict[str, Any] = {"mode": cfg.mode, "group": cfg.group, "table": table, "encrypted": cfg.encrypt}
    group = None
    query = None
    stop = threading.Event()  # set when the job fails: publishers still running stop
    threads: list[threading.Thread] = []

    def check_deadline(phase: str, done: str) -> None:
        if time.monotonic() >= deadline:
            raise JobDeadlineError(cfg.timeout, phase, done)

    def check_query(phase: str, done: Any) -> None:
        """The ingest query stopped (only ever with an error while the job needs it): the job fails
        at once, with Spark's reason in one line; the whole error goes to the job's log."""
        from zerocomm_spark.pipelines.commands import _query_reason, query_failure_text

        if query is None or query.isActive:
            return
        stop.set()  # publishers still running stop
        error = query.exception()
        if error is None:
            reason = "it stopped without an error (something else stopped it)"
        else:
            full = query_failure_text(spark, query)  # the JVM's whole error: every cause, with its stack
            reason = _query_reason(error, full)
            log.error("the ingest query failed:\n%s", full, extra={"file_only": True})
        raise IngestQueryFailedError(reason, phase, done(), table, checkpoint) from None

    try:
        _say(cfg, f"starting {len(labels)} members ({cfg.mode}): {', '.join(labels)}")
        t0 = time.monotonic()
        # Each run's members are new ones: a --work-dir used again holds the last run's, already in the group.
        group = LocalGroup.start(labels, group=cfg.group, mode=cfg.mode,  # type: ignore[arg-type]
                                 base_dir=work / "members" / f"run-{run_id}",
                                 timeout=max(min(deadline - time.monotonic(), 180.0), 10.0))
        summary["members_start_s"] = round(time.monotonic() - t0, 2)
        started = f"{len(labels)} members started in {summary['members_start_s']}s"
        check_deadline("starting the members", f"{started}, nothing published yet")
        _say(cfg, "starting Spark with Delta")
        t0 = time.monotonic()
        spark = local_spark("zerocomm-main")
        summary["spark_start_s"] = round(time.monotonic() - t0, 2)
        started += f", Spark in {summary['spark_start_s']}s"
        check_deadline("starting Spark", f"{started}, nothing published yet")

        batches: dict[int, dict[str, Any]] = {}  # from Spark's own progress reports: no extra Delta reads

        def ingested() -> int:
            for p in query.recentProgress if query is not None else []:
                batches[int(p["batchId"])] = {"id": int(p["batchId"]), "rows": int(p["numInputRows"]),
                                              "seconds": round(p["durationMs"].get("triggerExecution", 0) / 1000, 2)}
            return sum(b["rows"] for b in batches.values())

        # A table reused from an earlier run (--table) holds that run's rows of the group too: only
        # this run's commits (after the version it starts from) are replayed and checked.
        since = Since.version(latest_version(spark, table) + 1) if table_exists(spark, table) else None
        # A scratch table of this run's own: two runs in one --work-dir overwrote one table at once (a
        # Delta conflict failed one of them).
        scratch = work / f"warm-up-{run_id}"
        try:
            _warm_up(spark, scratch, table, group["historian"].agent, cfg.group)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        query = ingest(spark, [cfg.group], table, checkpoint, agent=group["historian"].agent, trigger=cfg.trigger,
                       history_key=key, query_name="zerocomm_history_main")
        _wait_ready(query, deadline)
        check_query("starting the ingest query", lambda: f"{started}, nothing published yet")
        check_deadline("starting the ingest query", f"{started}, nothing published yet")
        total = cfg.publishers * cfg.messages
        _say(cfg, f"publishing {total} messages ({cfg.publishers} x {cfg.messages} at {cfg.rate:g}/s each, "
                  f"{cfg.reply_fraction:.0%} replies) while Spark ingests them into {table}")
        published = _Published()
        lock = threading.Lock()
        threads = [threading.Thread(target=_publisher, name=f"publish-{label}", daemon=True,
                                    args=(group[label], cfg.group, cfg, published, lock, deadline, n, stop))
                   for n, label in enumerate(labels[1:])]
        t_pub = time.monotonic()
        for t in threads:
            t.start()

        def so_far() -> str:
            with lock:
                return (f"{started}; {len(published.ids)} of {total} messages published (acknowledged), "
                        f"{ingested()} rows in Delta")

        # Until every publisher is done, one fails or the ingest query does (the others stop: the job
        # fails at once), or the deadline.
        while any(t.is_alive() for t in threads) and not stop.is_set() and time.monotonic() < deadline:
            check_query("publishing", so_far)
            stop.wait(0.1)
        publish_s = time.monotonic() - t_pub
        if published.errors:
            raise PublishFailedError(published.errors, so_far())
        if any(t.is_alive() for t in threads) or len(published.ids) < total:
            raise JobDeadlineError(cfg.timeout, "publishing", so_far())
        while ingested() < len(published.ids):
            check_query("waiting for Delta to hold every message", so_far)
            check_deadline("waiting for Delta to hold every message", so_far())
            time.sleep(0.25)
        ingest_s = time.monotonic() - t_pub
        check_query("waiting for Delta to hold every message", so_far)
        try:
            _stop_query(spark, query, max(deadline - time.monotonic(), 1.0))
        except Exception:
            check_deadline("stopping the ingest query", so_far())  # Spark's stopTimeout, at the deadline
            raise
        check_deadline("stopping the ingest query", so_far())
        total_in = ingested()
        _say(cfg, f"ingested {total_in} rows in {len(batches)} micro-batches; replaying in causal order")
        done = (f"{started}; {len(published.ids)} of {total} messages published (acknowledged), {total_in} rows "
                f"ingested into Delta")
        check_deadline("replaying the group from Delta", f"{done}, nothing replayed yet")

        t0 = time.monotonic()
        # This run's rows are its publishers' (new members, new DIDs): a run going on at the same time
        # in this --work-dir (or on this --table) commits rows of a group of the same name meanwhile.
        ours = [group[label].did for label in labels[1:]]
        rows = _within_deadline(
            spark, deadline, cfg.timeout, "replaying the group from Delta",
            lambda: f"{done}, the replay not finished after {time.monotonic() - t0:.1f}s",
            lambda: replay(spark, table, cfg.group, since=since, verify=True, history_key=key).where(
                F.col("publisher_did").isin(ours)).select(
                "message_id", "publisher_label", "publisher_did", "lamport_ts", "sent_at", "received_at",
                "ingested_at", "headers", "origin_ok").toArrow())
        replay_s = time.monotonic() - t0
        done += f", {rows.num_rows} rows replayed in {replay_s:.1f}s"
        check_deadline("checking what was replayed", f"{done}, nothing checked yet")
        ids = rows.column("message_id").to_pylist()
        position = {mid: i for i, mid in enumerate(ids)}
        replies_ok = sum(1 for reply, original in published.replies.items()
                         if reply in position and original in position and position[original] < position[reply])
        sent_at = rows.column("sent_at").to_pylist()
        received_at = rows.column("received_at").to_pylist()
        ingested_at = rows.column("ingested_at").to_pylist()
        labels_col = rows.column("publisher_label").to_pylist()
        per_publisher: dict[str, int] = {}
        for label in labels_col:
            per_publisher[str(label)] = per_publisher.get(str(label), 0) + 1
        deliver_lat = [(r - s).total_seconds() for s, r in zip(sent_at, received_at)]
        delta_lat = [(i - s).total_seconds() for s, i in zip(sent_at, ingested_at)]
        span = (max(sent_at) - min(sent_at)).total_seconds() if sent_at else 0.0
        origin_ok = sum(rows.column("origin_ok").to_pylist())
        from delta.tables import DeltaTable

        t1 = time.monotonic()
        version = _within_deadline(
            spark, deadline, cfg.timeout, "checking what was replayed",
            lambda: f"{done}, reading the table's newest version not finished after {time.monotonic() - t1:.1f}s",
            lambda: DeltaTable.forPath(spark, table).history(1).select("version").first()[0])
        summary.update({
            "publishers": cfg.publishers, "published": len(published.ids), "replies": len(published.replies),
            "ingested": total_in, "rows": rows.num_rows, "distinct": len(position),
            "missing": len(set(published.ids) - set(position)), "unexpected": len(set(position) - set(published.ids)),
            "per_publisher": per_publisher, "micro_batches": len(batches), "delta_version": int(version),
            "batches": [batches[i] for i in sorted(batches)],
            "publish_s": round(publish_s, 2), "publish_rate": round(len(published.ids) / max(publish_s, 1e-9), 1),
            "send_span_s": round(span, 2), "ingest_s": round(ingest_s, 2),
            "replay_s": round(replay_s, 2), "replay_rows_per_s": round(rows.num_rows / max(replay_s, 1e-9), 1),
            "replies_after_original": replies_ok, "origin_verified": origin_ok,
            "latency_deliver_s": _percentiles(deliver_lat), "latency_to_delta_s": _percentiles(delta_lat),
        })
        summary["ok"] = bool(
            summary["missing"] == 0 and summary["unexpected"] == 0 and rows.num_rows == len(published.ids)
            and len(position) == rows.num_rows and replies_ok == len(published.replies)
            and origin_ok == rows.num_rows)
    finally:
        stop.set()
        # Each step on its own: a JVM gone (isActive raising) or a member that will not close must not
        # skip the rest (the members' agent processes, the work directory) nor replace the job's error.
        if query is not None:
            try:
                if query.isActive:
                    _stop_query(spark, query, 30.0)
            except Exception:  # noqa: BLE001 - the job is failing already, or its summary is made
                log.warning("the ingest query did not stop", exc_info=True, extra={"file_only": True})
        until = time.monotonic() + 5.0
        for t in threads:  # stopping: each at most a slice of a wait away
            t.join(max(until - time.monotonic(), 0.0))
        if group is not None:
            try:
                group.close()
            except Exception:  # noqa: BLE001 - as above
                log.warning("the members did not all close", exc_info=True, extra={"file_only": True})
        summary["total_s"] = round(time.monotonic() - job_began, 2)
        if not cfg.keep and not cfg.work_dir:
            shutil.rmtree(work, ignore_errors=True)
            # the summary names the table: say it went with the work directory (a --table elsewhere stays)
            summary["table_removed"] = "://" not in str(table) and Path(table).absolute().is_relative_to(
                Path(work).absolute()) and not Path(table).exists()
    return summary


def render(summary: dict[str, Any]) -> str:
    """The human summary: a few aligned lines."""
    s = summary
    lat, dl = s["latency_deliver_s"], s["latency_to_delta_s"]
    per = ", ".join(f"{k} {v}" for k, v in sorted(s["per_publisher"].items()))
    origin = (f"{s['origin_verified']}/{s['rows']} rows verified (publisher signatures, ed25519-member/1, "
              + ("signed in this process" if s["mode"] == "embedded" else "signed by each publisher's agent") + ")")
    lines = [
        f"group       {s['group']!r}: {s['publishers']} publishers + historian ({s['mode']} members, "
        f"started in {s['members_start_s']}s; Spark in {s['spark_start_s']}s)",
        f"published   {s['published']} messages in {s['publish_s']}s ({s['publish_rate']} msg/s), "
        f"{s['replies']} of them replies",
        f"ingested    {s['rows']} rows ({s['distinct']} distinct, {s['missing']} missing) into Delta version "
        f"{s['delta_version']} in {s['micro_batches']} micro-batches, "
        f"{'sealed with a history key' if s['encrypted'] else 'payloads in clear'}",
        f"replayed    {s['rows']} rows in causal order in {s['replay_s']}s ({s['replay_rows_per_s']} rows/s); "
        f"replies after what they answer: {s['replies_after_original']}/{s['replies']}",
        f"origin      {origin}",
        f"latency     publish->member p50 {lat['p50'] * 1000:.0f} ms, p95 {lat['p95'] * 1000:.0f} ms; "
        f"publish->Delta p50 {dl['p50']:.2f} s, p95 {dl['p95']:.2f} s",
        f"publishers  {per}",
        f"table       {s['table']}"
        + (" (removed with the temporary work directory: --keep or --work-dir DIR keeps it)"
           if s.get("table_removed") else ""),
        *([f"log         {s['log']}"] if s.get("log") else []),
        f"result      {'OK' if s['ok'] else 'FAILED'} in {s['total_s']}s",
    ]
    return "\n".join(lines)


def _check_options(parser: argparse.ArgumentParser, cfg: JobConfig) -> None:
    """Out-of-range options are usage errors (exit 2, argparse's message), before anything starts: a
    --timeout of nan or inf ended in a traceback from the client's deadline check."""
    import math

    if not 1 <= cfg.publishers <= len(PUBLISHER_NAMES):
        parser.error(f"--publishers must be 1-{len(PUBLISHER_NAMES)}, not {cfg.publishers}")
    if cfg.messages < 1:
        parser.error(f"--messages must be at least 1, not {cfg.messages}")
    if not (math.isfinite(cfg.rate) and cfg.rate > 0):
        parser.error(f"--rate must be a number of messages per second above 0, not {cfg.rate}")
    if cfg.payload_bytes < 0:
        parser.error(f"--payload-bytes must be 0 or more, not {cfg.payload_bytes}")
    if not 0 <= cfg.reply_fraction <= 1:  # (nan fails this too)
        parser.error(f"--reply-fraction must be from 0 to 1, not {cfg.reply_fraction}")
    # Finite is not enough: the job waits for its publishers with Thread.join and Future.result, whose
    # lock waits overflow past threading.TIMEOUT_MAX (--timeout 1e10 ended in an OverflowError traceback).
    if not (math.isfinite(cfg.timeout) and 0 < cfg.timeout <= MAX_TIMEOUT):
        parser.error(f"--timeout must be a number of seconds above 0 (at most {MAX_TIMEOUT:g}), not {cfg.timeout}")
    if cfg.trigger.strip().lower() in ("once", "available_now", "availablenow", "available-now"):
        # The ingest query must run while the members publish: one that ends by itself was then taken
        # for a failed query ("it stopped without an error").
        parser.error(f"--trigger is an interval for the ingest query that runs while the members publish "
                     f"(like '1 second'), not {cfg.trigger!r}")
    from zerocomm_spark.pipelines.commands import interval_seconds

    if interval_seconds(cfg.trigger) is None:  # Spark refused it only once members and Spark had started (~50 s)
        parser.error(f"--trigger {cfg.trigger!r} is not an interval: give one like '1 second', '500 milliseconds' "
                     f"or '1 minute 30 seconds' (weeks to microseconds, not months or years)")


def _failure(exc: BaseException, log_file: Path | None = None) -> dict[str, str] | None:
    """What a user is told when the job cannot run (a member, the table's path, Spark), a publisher
    fails or the deadline passes: the error in one line and what to do, not a traceback of Python and
    Java frames. None for anything else (a bug keeps its traceback)."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    from zerocomm_spark.errors import ZeroCommError

    details = f"the job's log ({log_file}) has the details" if log_file else "Spark's log above has the details"
    if isinstance(exc, JobDeadlineError) and exc.phase.startswith(("replaying", "checking")):
        # Publishing less does not help a read of the table that does not end.
        return {"type": "DeadlineError", "message": str(exc), "phase": exc.phase,
                "hint": f"Raise --timeout (it was {exc.timeout:g}s) if the table is large; a read that never "
                        f"ends means the table's storage does not answer (a hung mount?): check it; {details}"}
    if isinstance(exc, JobDeadlineError):
        return {"type": "DeadlineError", "message": str(exc), "phase": exc.phase,
                "hint": f"Raise --timeout (it was {exc.timeout:g}s), or publish less (--messages, --publishers, "
                        f"--rate){', or a shorter --trigger' if exc.phase.startswith('waiting for Delta') else ''}; "
                        f"{details}"}
    if isinstance(exc, IngestQueryFailedError):
        return {"type": "IngestQueryError", "message": str(exc), "phase": exc.phase, "reason": exc.reason,
                "hint": f"Check that the table ({exc.table}) and the query's checkpoint ({exc.checkpoint}) can be "
                        "written and that nothing else moves, removes or writes them while the job runs, then run "
                        f"the job again (it starts a new checkpoint and appends to the table); {details}"}
    if isinstance(exc, PublishFailedError):
        return {"type": "PublishError", "message": str(exc),
                "hint": "Check that every member is still running (with --mode agents: its agent process, "
                        f"started from --work-dir's members/); {details}"}
    if isinstance(exc, ZeroCommError):
        return {"type": type(exc).__name__, "message": exc.message, "hint": exc.hint or ""}
    if isinstance(exc, (Py4JError, PySparkException)):
        from zerocomm_spark.pipelines.commands import _spark_reason

        return {"type": "SparkError", "message": f"Spark failed: {_spark_reason(exc)}",
                "hint": f"Check that --table and --work-dir name places this user can write; {details}"}
    if isinstance(exc, OSError):
        return {"type": type(exc).__name__, "message": str(exc),
                "hint": "Check that --table and --work-dir name places this user can write"}
    return None


def _log_path(cfg: JobConfig) -> Path:
    """The job's log file: under --work-dir (logs/), else in the temporary directory (the temporary
    work directory is removed at the end, the log of a failed run is not)."""
    name = f"main-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    if cfg.work_dir:
        return Path(cfg.work_dir).absolute() / "logs" / name
    return Path(tempfile.gettempdir()) / f"zerocomm-{name}"


def _make_log_dir(parser: argparse.ArgumentParser, cfg: JobConfig, log_file: Path) -> None:
    """The log file's directory, made before anything starts: a --work-dir that names a file (or a
    path under one, or one this user cannot write) ended in a NotADirectoryError traceback. It is a
    usage error (exit 2) naming the option, as an out-of-range option is."""
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if not cfg.work_dir:  # the system's temporary directory: not an option of the job's
            raise SystemExit(f"{parser.prog}: error: cannot create the job's log in {log_file.parent}: "
                             f"{exc.strerror or exc}; set TMPDIR to a directory this user can write") from None
        blocker = next((p for p in (log_file.parent, *log_file.parent.parents) if p.exists()), None)
        why = (f"{blocker} {what_is(blocker)}" if blocker is not None and not blocker.is_dir()
               else f"{exc.strerror or exc} ({exc.filename or log_file.parent})")
        parser.error(f"--work-dir {cfg.work_dir} cannot be used: {why}; name a directory this user can write "
                     "(it is created if missing)")


def _redirect_stderr(log_file: Path) -> TextIO:
    """Send this process's file descriptor 2 to ``log_file``: Spark's JVM (started after this) and its
    Python workers inherit it, so their log (a stopped query's ~1,400 lines among it) goes there, not
    to the terminal. ``sys.stderr`` keeps writing to the terminal; returns it."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    return sys.stderr


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)


def _setup_logging(log_file: Path, terminal: TextIO) -> logging.Handler:
    """Everything (INFO and up, with tracebacks) to the log file; to the terminal only this package's
    warnings, not what Spark and py4j log while a failing job stops its query."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    to_file = logging.FileHandler(log_file, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(to_file)
    console = logging.StreamHandler(terminal)
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    console.addFilter(logging.Filter("zerocomm_spark"))
    console.addFilter(_NotFileOnly())
    root.addHandler(console)
    return to_file


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run the job, print the summary; 0 if every check passed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = JobConfig(**vars(args))
    _check_options(parser, cfg)
    log_file = _log_path(cfg)
    _make_log_dir(parser, cfg, log_file)
    to_file = _setup_logging(log_file, _redirect_stderr(log_file))
    keep_log = True
    try:
        summary = run(cfg)
        keep_log = bool(cfg.work_dir or cfg.keep or not summary.get("ok"))
        if keep_log:
            summary["log"] = str(log_file)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        error = _failure(exc, log_file)
        log.error("the main job failed", exc_info=True, extra={"file_only": True})
        if error is None:
            raise
        if cfg.as_json:
            print(json.dumps({"ok": False, "error": error, "exit_code": 1, "log": str(log_file)}), flush=True)
        else:
            print(f"{parser.prog}: error: {error['message']}\n  what to do: {error['hint']}", file=sys.stderr,
                  flush=True)
        return 1
    finally:
        if not keep_log:  # a run that passed with a temporary work directory leaves nothing behind
            logging.getLogger().removeHandler(to_file)  # (a closed FileHandler reopens on the next record)
            to_file.close()
            log_file.unlink(missing_ok=True)
    if cfg.as_json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    else:
        print(render(summary), flush=True)
    return 0 if summary.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
