"""format("zerocomm") throughput and latency, beside the same pipeline fed by Spark's rate source.

What it measures (one JSON document on stdout):

* ``source_rows_per_s``: messages already in a group, read by a streaming query
  (``trigger(availableNow=True)``) into a Delta table; rows over the sum of the micro-batches'
  durations, and ``..._wall`` over the query's whole run (start-up included).
* ``sink_rows_per_s``: a streaming query (file source -> ``format("zerocomm")``) publishing rows to
  the group through a member; a batch commits only once every member acknowledged its messages.
* ``latency_ms``: p50/p99 from a message's ``sent_at`` (publisher clock) to the Delta commit that made
  it visible (commit timestamp in the Delta log), with a publisher at a steady rate and a query on the
  default trigger.
* ``rate_pipeline``: the same Delta sink and row shape fed by ``rate-micro-batch`` (throughput, batches
  of the same size) and ``rate`` (latency, micro-batch duration): the Spark-side limit on this
  machine, measured right before each configuration so both see the same machine load.

Targets (issue 5): the source reaches at least half the rate pipeline's rows/s; p50 latency is at most
twice the rate pipeline's micro-batch duration. Each result says whether it met them.

    .venv/bin/python bench/spark_stream.py            # groups of 2, 4, 8; payloads 100 B and 1 KB
    .venv/bin/python bench/spark_stream.py --quick    # groups of 2; fewer messages
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1)))))
    return round(ordered[k], 1)


def commit_times(table: Path) -> dict[str, int]:
    """Data file name -> commit timestamp (ms) of the Delta version that added it."""
    out: dict[str, int] = {}
    for log in sorted((table / "_delta_log").glob("*.json")):
        adds, stamp = [], None
        for line in log.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                adds.append(Path(action["add"]["path"]).name)
            elif "commitInfo" in action:
                stamp = action["commitInfo"]["timestamp"]
        for name in adds:
            if stamp is not None:
                out[name] = stamp
    return out


def visible_latencies(spark: Any, table: Path, time_column: str) -> list[float]:
    """Per row: Delta commit time minus ``time_column`` (ms)."""
    if not (table / "_delta_log").exists():
        return []
    commits = commit_times(table)
    rows = (spark.read.format("delta").load(str(table))
            .selectExpr(f"unix_micros({time_column}) AS t", "_metadata.file_name AS f").collect())
    return [commits[r.f] - r.t / 1000.0 for r in rows if r.f in commits]


def batch_rate(progress: list[dict[str, Any]]) -> tuple[float, float]:
    """(rows per second over the batches' own durations, median batch duration ms)."""
    busy = [p for p in progress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in busy)
    ms = sum(p["durationMs"]["triggerExecution"] for p in busy)
    durations = [p["durationMs"]["triggerExecution"] for p in busy]
    return (rows / (ms / 1000.0) if ms else 0.0), (statistics.median(durations) if durations else 0.0)


# --- the rate pipeline (Spark-side limit) --------------------------------------------------------


def rate_rows(frame: Any, payload: int) -> Any:
    """The zerocomm source's row shape from a rate source, so the Delta write costs the same."""
    return frame.selectExpr(
        "'bench' AS group", "uuid() AS message_id", "'did:key:bench' AS publisher_did",
        "'bench' AS publisher_label", "value AS seq", "value AS lamport_ts", "timestamp AS sent_at",
        "current_timestamp() AS received_at", f"CAST(repeat('x', {payload}) AS BINARY) AS payload")


def rate_pipeline(spark: Any, work: Path, payload: int, messages: int, latency_s: float,
                  rate: int, tag: str) -> dict[str, Any]:
    out = work / f"rate-{tag}"
    frame = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", messages)
             .option("numPartitions", 2).load())
    query = (rate_rows(frame, payload).writeStream.format("delta")
             .option("checkpointLocation", str(work / f"rate-ck-{tag}"))
             .trigger(processingTime="0 seconds").start(str(out)))
    while len([p for p in query.recentProgress if p["numInputRows"]]) < 3:
        time.sleep(0.2)
    query.stop()
    throughput, _ = batch_rate(query.recentProgress)
    # latency: a steady rate, default trigger
    lat_out = work / f"rate-lat-{tag}"
    live = (rate_rows(spark.readStream.format("rate").option("rowsPerSecond", rate).option("numPartitions", 2)
                      .load(), payload)
            .writeStream.format("delta").option("checkpointLocation", str(work / f"rate-lat-ck-{tag}"))
            .start(str(lat_out)))
    time.sleep(latency_s)
    deadline = time.time() + 120  # a slow machine: wait for a few committed batches to measure
    while time.time() < deadline and len([p for p in live.recentProgress if p["numInputRows"]]) < 3:
        time.sleep(0.2)
    live.stop()
    _, batch_ms = batch_rate(live.recentProgress)
    lat = visible_latencies(spark, lat_out, "sent_at")
    return {"rows_per_s": round(throughput), "batch_ms_p50": round(batch_ms, 1),
            "latency_ms": {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)}}


# --- zerocomm ------------------------------------------------------------------------------------


def publish_all(member: Any, group: str, payload: int, count: int, chunk: int = 2000) -> float:
    """Publish ``count`` messages; returns msgs/s as the member (group acks included) took them."""
    body = b"x" * payload
    began = time.perf_counter()
    done = 0
    while done < count:
        n = min(chunk, count - done)
        member.client().publish(group, [body] * n, timeout=120)
        done += n
    return count / (time.perf_counter() - began)


def zerocomm_source(spark: Any, work: Path, group: str, reader: Any, tag: str) -> dict[str, Any]:
    out = work / f"src-{tag}"
    began = time.perf_counter()
    query = (spark.readStream.format("zerocomm").option("group", group).option("agent", str(reader.config))
             .option("startingOffsets", "earliest").load()
             .writeStream.format("delta").option("checkpointLocation", str(work / f"src-ck-{tag}"))
             .trigger(availableNow=True).start(str(out)))
    query.awaitTermination()
    wall = time.perf_counter() - began
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    steady, _ = batch_rate(query.recentProgress)
    return {"rows": rows, "rows_per_s": round(steady), "rows_per_s_wall": round(rows / wall)}


def zerocomm_sink(spark: Any, work: Path, group: str, writer: Any, payload: int, messages: int,
                  tag: str) -> dict[str, Any]:
    src = work / f"sink-src-{tag}"
    (spark.range(0, messages, 1, 2).selectExpr(f"CAST(repeat('x', {payload}) AS BINARY) AS payload")
     .write.parquet(str(src)))
    began = time.perf_counter()
    query = (spark.readStream.schema("payload BINARY").parquet(str(src))
             .writeStream.format("zerocomm").option("group", group).option("agent", str(writer.config))
             .option("checkpointLocation", str(work / f"sink-ck-{tag}")).trigger(availableNow=True).start())
    query.awaitTermination()
    wall = time.perf_counter() - began
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    steady, _ = batch_rate(query.recentProgress)
    return {"rows": rows, "rows_per_s": round(steady), "rows_per_s_wall": round(rows / wall)}


def zerocomm_latency(spark: Any, work: Path, group: str, reader: Any, publisher: Any, payload: int,
                     seconds: float, rate: int, tag: str) -> dict[str, Any]:
    out = work / f"lat-{tag}"
    query = (spark.readStream.format("zerocomm").option("group", group).option("agent", str(reader.config))
             .load().writeStream.format("delta").option("checkpointLocation", str(work / f"lat-ck-{tag}"))
             .start(str(out)))
    while query.lastProgress is None:  # the first (empty) batch ran: the query is up
        time.sleep(0.1)
    stop = threading.Event()
    body = b"x" * payload
    tick = 0.1
    per_tick = max(1, int(rate * tick))
    published = [0]

    def run() -> None:
        next_at = time.perf_counter()
        while not stop.is_set():
            publisher.client().publish(group, [body] * per_tick, timeout=60)
            published[0] += per_tick
            next_at += tick
            time.sleep(max(0.0, next_at - time.perf_counter()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join(60)
    deadline = time.time() + 120
    while time.time() < deadline and sum(p["numInputRows"] for p in query.recentProgress) < published[0]:
        time.sleep(0.5)
    query.stop()
    _, batch_ms = batch_rate(query.recentProgress)
    lat = visible_latencies(spark, out, "sent_at")
    return {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat), "batch_ms_p50": round(batch_ms, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="2,4,8", help="group sizes (default 2,4,8)")
    parser.add_argument("--payloads", default="100,1024", help="payload bytes (default 100,1024)")
    parser.add_argument("--messages", type=int, default=5000, help="messages per throughput run")
    parser.add_argument("--latency-seconds", type=float, default=15.0)
    parser.add_argument("--latency-rate", type=int, default=200, help="messages/s during the latency run")
    parser.add_argument("--quick", action="store_true", help="groups of 2, 2000 messages, 8 s latency runs")
    args = parser.parse_args()
    if args.quick:
        args.members, args.messages, args.latency_seconds = "2", 2000, 8.0
    sizes = [int(x) for x in args.members.split(",")]
    payloads = [int(x) for x in args.payloads.split(",")]

    from zerocomm_spark.connector.local_members import form_group, start_members
    from zerocomm_spark.connector.session import local_spark

    work = Path(tempfile.mkdtemp(prefix="zc-bench-"))
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_start": os.getloadavg()},
        "messages_per_run": args.messages, "latency_seconds": args.latency_seconds,
        "latency_rate_msgs_per_s": args.latency_rate,
    }
    spark = local_spark("zerocomm-bench", master="local[2]")
    report["machine"]["spark"] = spark.version
    spark.range(10).count()  # warm the JVM and the Python workers once
    rate_pipeline(spark, work, payloads[0], 500, 3.0, args.latency_rate, "warm-up")  # and streaming + Delta
    try:
        results = []
        for n in sizes:
            members = start_members(work / f"members-{n}", [f"m{n}-{i}" for i in range(n)])
            try:
                for payload in payloads:
                    tag = f"{n}-{payload}"
                    group = f"bench-{tag}"
                    form_group(members, group)
                    reader, publisher = members[0], members[1]
                    # first use of the connector in this session: imports in the Python workers
                    (spark.read.format("zerocomm").option("group", group).option("agent", str(reader.config))
                     .load().count())
                    # the Spark-side limit, measured right before, under the same machine load
                    rate = rate_pipeline(spark, work, payload, args.messages, args.latency_seconds,
                                         args.latency_rate, tag)
                    entry: dict[str, Any] = {"members": n, "payload_bytes": payload}
                    entry["publish_msgs_per_s"] = round(publish_all(publisher, group, payload, args.messages))
                    entry["source"] = zerocomm_source(spark, work, group, reader, tag)
                    entry["sink"] = zerocomm_sink(spark, work, group, publisher, payload, args.messages, tag)
                    entry["latency_ms"] = zerocomm_latency(spark, work, group, reader, publisher, payload,
                                                           args.latency_seconds, args.latency_rate, tag)
                    entry["rate_pipeline"] = rate
                    entry["loadavg_1m"] = round(os.getloadavg()[0], 1)
                    ratio = entry["source"]["rows_per_s"] / rate["rows_per_s"] if rate["rows_per_s"] else None
                    p50 = entry["latency_ms"]["p50"]
                    entry["targets"] = {
                        "source_vs_rate": round(ratio, 3) if ratio is not None else None,
                        "source_at_least_half_of_rate": bool(ratio is not None and ratio >= 0.5),
                        "p50_vs_rate_batch_ms": (round(p50 / rate["batch_ms_p50"], 3)
                                                 if p50 is not None and rate["batch_ms_p50"] else None),
                        "p50_at_most_twice_rate_batch": bool(p50 is not None and rate["batch_ms_p50"]
                                                             and p50 <= 2 * rate["batch_ms_p50"]),
                    }
                    results.append(entry)
                    print(json.dumps(entry), file=sys.stderr, flush=True)
            finally:
                for member in members:
                    member.remove()
        report["zerocomm"] = results
    finally:
        report["machine"]["loadavg_end"] = os.getloadavg()
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
