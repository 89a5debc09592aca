"""The README's main job, run as a user runs it (its own process, its own Spark), with small settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900)]


def test_help_lists_the_options():
    done = subprocess.run([sys.executable, "-m", "zerocomm_spark.pipelines.main", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for option in ("--mode", "--publishers", "--messages", "--rate", "--encrypt", "--json", "--timeout"):
        assert option in done.stdout


def test_main_job_runs_the_whole_story_and_every_check_passes(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--publishers", "2", "--messages", "40",
         "--rate", "40", "--reply-fraction", "0.3", "--encrypt", "--json", "--timeout", "600",
         "--work-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no summary (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    summary = json.loads(lines[-1])
    assert done.returncode == 0 and summary["ok"] is True, summary
    assert summary["published"] == summary["rows"] == summary["distinct"] == summary["ingested"] == 80
    assert summary["missing"] == 0 and summary["unexpected"] == 0
    assert summary["per_publisher"] == {"alice": 40, "bob": 40}
    assert summary["replies"] > 0 and summary["replies_after_original"] == summary["replies"]
    assert summary["origin_verified"] == 80 and summary["encrypted"] is True
    assert 0 <= summary["latency_deliver_s"]["p50"] <= summary["latency_deliver_s"]["p95"]
    assert summary["latency_to_delta_s"]["p50"] > 0 and summary["replay_rows_per_s"] > 0
    assert (tmp_path / "history" / "_delta_log").is_dir()  # the table is where it said


def test_main_job_run_again_on_the_same_table_checks_only_its_own_run(tmp_path):
    """(Not the whole story's table: that run seals its payloads with --encrypt, and an ingest without
    the key is refused there.)"""
    table = tmp_path / "shared-history"
    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--publishers", "1", "--messages", "5",
             "--rate", "50", "--reply-fraction", "0", "--json", "--timeout", "600", "--table", str(table),
             "--work-dir", str(tmp_path / f"run-{run}")],
            cwd=ROOT, capture_output=True, text=True, timeout=800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert lines, f"no summary (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        summary = json.loads(lines[-1])
        assert done.returncode == 0 and summary["ok"] is True, (run, summary)
        assert summary["rows"] == summary["published"] == 5 and summary["unexpected"] == 0
        assert summary["table"] == str(table)


def test_options_out_of_range_are_usage_errors_before_anything_starts():
    """--timeout nan ended in a traceback from the client's deadline check; --publishers 0 exited 1,
    the status the README gives to a failed check. Both are usage errors (2) with a one-line reason."""
    for argv, said in ((["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"),
                       (["--timeout", "1e10"], "--timeout"),  # finite, but past what a thread's join can wait
                       (["--publishers", "0"], "--publishers"), (["--rate", "nan"], "--rate"),
                       (["--messages", "0"], "--messages"),
                       (["--trigger", "available_now"], "--trigger"), (["--trigger", "once"], "--trigger"),
                       # refused by Spark only once the members and Spark had started (~50 s), exit 1
                       (["--trigger", "soon"], "--trigger 'soon' is not an interval"),
                       (["--trigger", "1 month"], "--trigger '1 month' is not an interval")):
        done = subprocess.run([sys.executable, "-m", "zerocomm_spark.pipelines.main", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (argv, done.stdout, done.stderr[-2000:])
        assert said in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr[-2000:])


def test_a_work_dir_that_is_a_file_is_a_usage_error_before_anything_starts(tmp_path):
    """--work-dir naming a file (or a path under one) ended in a NotADirectoryError traceback from
    making the log's directory; it is one line naming the option and the file, exit 2 (a usage
    error, as an option out of range), before any member or Spark starts."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    for work, extra in ((blocker, []), (blocker / "sub", []), (blocker, ["--json"])):
        done = subprocess.run([sys.executable, "-m", "zerocomm_spark.pipelines.main", "--work-dir", str(work), *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (work, done.stdout[-2000:], done.stderr[-2000:])
        assert "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"error: --work-dir {work} cannot be used: {blocker} is a file" in done.stderr, done.stderr[-2000:]
        assert blocker.read_text() == "not a directory\n"


def test_a_table_path_that_cannot_be_written_is_one_error_line(tmp_path):
    """--table under a file (or /proc): 180 lines of Python and Java traceback. Now one line naming
    Spark's reason and the path, and what to check, exit 1 (and an error document with --json)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    table = blocker / "history"
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--publishers", "1", "--messages", "2",
             "--timeout", "300", "--table", str(table), "--work-dir", str(tmp_path / f"work{len(extra)}"), *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert done.returncode == 1, (done.stdout[-2000:], done.stderr[-4000:])
        assert "Traceback" not in done.stderr and "\tat " not in done.stderr, done.stderr[-4000:]
        if extra:
            error = json.loads(done.stdout.splitlines()[-1])
            assert error["ok"] is False and error["exit_code"] == 1 and "--table" in error["error"]["hint"]
        else:
            assert "error: Spark failed" in done.stderr and "--table" in done.stderr, done.stderr[-2000:]


def test_main_job_run_again_and_twice_at_once_in_one_work_dir_each_check_their_own(tmp_path):
    """`--work-dir DIR` keeps the members and the table; running the job again on it failed at once:
    the last run's historian already has the group ("this member already has a group named 'demo'").
    A run again makes its own members, appends to the same table and checks its own run.

    Runs in one --work-dir have members of their own (f98fbb9), but two at once still failed: both
    overwrote one warm-up table (a Delta conflict ended one run, exit 1), and each replayed the other's
    rows of the group 'demo' as its own ("unexpected": 20, check failed). Each has its own scratch table
    now and checks the rows of its own publishers."""
    argv = [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--publishers", "1", "--messages", "20",
            "--rate", "10", "--reply-fraction", "0", "--json", "--timeout", "600", "--work-dir", str(tmp_path)]
    first = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=800)  # makes the table
    assert first.returncode == 0, first.stderr[-4000:]
    runs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=800)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"no summary (exit {run.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
        summary = json.loads(lines[-1])
        assert run.returncode == 0 and summary["ok"] is True, summary
        assert summary["rows"] == summary["published"] == 20 and summary["unexpected"] == 0, summary
        assert summary["table"] == str(tmp_path / "history"), summary  # the first run's table, appended to
    assert not list(tmp_path.glob("warm-up*"))  # scratch, removed


def _spark_noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if "Traceback" in line or line.startswith("\tat ") or " WARN " in line or " ERROR " in line]


def test_the_deadline_is_one_line_naming_the_phase_and_what_to_raise(tmp_path):
    """--timeout too short ended in a traceback ('publishing failed: alice: TimeoutError...'), or, hit
    while Spark was ingesting, in ~1,400 lines of Spark's stop noise and a summary that did not say the
    deadline was the cause. Now one line: the deadline, the phase, what was done, raise --timeout; exit
    1, an error document with --json, Spark's log in the job's log file."""
    for extra in ([], ["--json"]):
        work = tmp_path / f"work{len(extra)}"
        done = subprocess.run(
            [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--publishers", "1", "--messages", "2",
             "--timeout", "0.01", "--work-dir", str(work), *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert done.returncode == 1, (done.stdout[-2000:], done.stderr[-4000:])
        assert not _spark_noise(done.stderr), done.stderr[-4000:]
        logs = list((work / "logs").glob("main-*.log"))
        assert len(logs) == 1 and "the main job failed" in logs[0].read_text()  # the details are kept
        if extra:
            error = json.loads(done.stdout.splitlines()[-1])
            assert error["ok"] is False and error["exit_code"] == 1 and error["error"]["type"] == "DeadlineError"
            assert error["error"]["phase"] == "starting the members" and "--timeout" in error["error"]["hint"]
            assert error["log"] == str(logs[0])
        else:
            assert len(done.stderr.strip().splitlines()) == 2, done.stderr  # the error and what to do
            assert "deadline (--timeout 0.01s) passed while starting the members" in done.stderr
            assert "members started in" in done.stderr and "Raise --timeout" in done.stderr


def test_a_publisher_agent_killed_mid_run_is_one_error_line(tmp_path):
    """--mode agents, a publisher's agent killed with -9 while it publishes: a RuntimeError traceback
    (after waiting for the other publishers' unacknowledged publishes). Now the job stops at once and
    says in one line who failed and what to check, without Spark's noise from stopping its query."""
    import os
    import re
    import signal
    import time

    job = subprocess.Popen(
        [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--mode", "agents", "--publishers", "2",
         "--messages", "100000", "--rate", "20", "--timeout", "600", "--work-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None
        for line in job.stdout:
            if line.startswith("publishing"):
                break
        time.sleep(2)
        config = next((tmp_path / "members").glob("run-*/alice/zerocomm.toml")).read_text()
        socket_dir = re.search(r'socket_dir\s*=\s*"([^"]+)"', config).group(1)
        os.kill(int((Path(socket_dir) / "agent.pid").read_text()), signal.SIGKILL)
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 1, (out[-2000:], err[-4000:])
    assert not _spark_noise(err), err[-4000:]
    assert "error: publishing failed: alice: " in err and "still running" in err, err[-2000:]
    logs = list((tmp_path / "logs").glob("main-*.log"))
    assert len(logs) == 1 and "alice could not publish" in logs[0].read_text()


def _wait_for(what, found, seconds):
    """Poll ``found()`` until it gives something, for at most ``seconds``."""
    import time

    until = time.monotonic() + seconds
    while time.monotonic() < until:
        value = found()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {seconds}s")


def _nothing_secret(printed: str) -> None:
    """What a failing job prints names paths and counts, never a payload ("alice #12....") or a key."""
    import re

    assert " #" not in printed and "..." not in printed, printed[-2000:]
    assert not re.search(r"[0-9a-fA-F]{32}|[A-Za-z0-9+/]{43}=", printed), printed[-2000:]  # hex, base64 keys


def test_an_ingest_query_that_fails_mid_run_is_one_error_line(tmp_path):
    """The ingest query failing while members publish (the table's directory replaced by a file: Delta
    cannot write its log; the checkpoint's offsets log replaced by a file: the query cannot record its
    next batch) went unnoticed until every message was published or the deadline passed, then ended in
    a RuntimeError traceback with the query's whole description. Now the job stops at once and says
    in one line that the ingest query failed, Spark's reason (not its stack), what was done and what
    to check; the query's whole error goes to the job's log."""
    import signal

    for broken, extra in (("table", []), ("checkpoint", ["--json", "--encrypt"])):
        work = tmp_path / broken
        job = subprocess.Popen(
            [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--publishers", "2", "--messages", "100000",
             "--rate", "20", "--timeout", "300", "--work-dir", str(work), *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Mid-run: the query has committed a micro-batch of what the members publish.
            checkpoint = _wait_for("committed micro-batch", lambda: [
                c.parent.parent for c in (work / "checkpoints").glob("history-*/commits/[0-9]*")], 280)[0]
            if broken == "table":
                (work / "history").rename(work / "history-moved")
                (work / "history").write_text("not a table\n")
            else:
                (checkpoint / "offsets").rename(checkpoint / "offsets-moved")
                (checkpoint / "offsets").write_text("not a directory\n")
            out, err = job.communicate(timeout=400)
        finally:
            if job.poll() is None:
                job.send_signal(signal.SIGKILL)
                job.communicate()
        assert job.returncode == 1, (broken, out[-2000:], err[-4000:])
        assert not _spark_noise(err), err[-4000:]
        _nothing_secret(out + err)
        logs = list((work / "logs").glob("main-*.log"))
        assert len(logs) == 1
        logged = logs[0].read_text()
        assert "the ingest query failed:" in logged and "the main job failed" in logged  # the whole error is kept
        if broken == "table":
            lines = err.strip().splitlines()
            assert len(lines) == 2, err  # the error and what to do
            assert "error: the ingest query failed while publishing: [DELTA_CANNOT_CREATE_LOG_PATH]" in lines[0]
            assert "Parent path is not a directory" in lines[0] and str(work / "history") in lines[0]
            assert "messages published (acknowledged)" in lines[0] and "rows in Delta" in lines[0]
            assert lines[1].startswith("  what to do: Check that the table") and str(logs[0]) in lines[1]
        else:
            assert err == "", err[-4000:]
            error = json.loads(out.splitlines()[-1])
            assert error["ok"] is False and error["exit_code"] == 1 and error["log"] == str(logs[0])
            assert error["error"]["type"] == "IngestQueryError" and error["error"]["phase"] == "publishing"
            reason = error["error"]["reason"]
            # Hadoop's words depend on the step its write of the next offsets was at ("parent is not a dir",
            # chmod's "Not a directory", "rename destination parent ... is a file"): the path is always named.
            assert str(checkpoint / "offsets") in reason and "Exception: " in reason, reason
            assert "\n" not in reason and "\tat " not in error["error"]["message"]
            assert "=== Streaming Query ===" not in out and str(checkpoint) in error["error"]["hint"]


def _committed_files(table: Path) -> list[Path]:
    """The data files the table's Delta log holds (added by a commit: written to the end)."""
    from urllib.parse import unquote

    files = []
    for commit in sorted((table / "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            if line.strip() and "add" in (entry := json.loads(line)):
                files.append(table / unquote(entry["add"]["path"]))
    return files


def test_a_replay_that_hangs_ends_at_the_deadline_in_one_line(tmp_path):
    """The replay and the checks after it had no deadline: a read of the table that never returns (a
    hung file system; here a data file of the table replaced by a named pipe no one writes to) held
    the job past --timeout for ever. Now the deadline covers them: Spark's jobs are cancelled and the
    job ends in the one deadline line naming the phase, soon after the deadline."""
    import os
    import time

    timeout = 150
    job = subprocess.Popen(
        [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--publishers", "1", "--messages", "200",
         "--rate", "5", "--reply-fraction", "0", "--timeout", str(timeout), "--work-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    began = time.monotonic()
    fifo = None
    try:
        assert job.stdout is not None
        for line in job.stdout:
            if line.startswith("publishing"):
                break
        # A data file of a micro-batch committed while the member publishes (40 s of it, time for a
        # loaded machine's first micro-batch; one still being written would not do): nothing reads
        # it back until the replay.
        data = _wait_for("committed data file", lambda: _committed_files(tmp_path / "history"), 36)[0]
        data.rename(data.with_name(data.name + ".moved"))
        os.mkfifo(data)
        fifo = data
        out, err = job.communicate(timeout=timeout + 120)
        ended = time.monotonic() - began
    finally:
        if fifo is not None:  # a reader still blocked on the pipe gets its end
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 1, err[-4000:]
    assert "replaying in causal order" in out, out  # the members published, Delta holds it all
    assert ended < timeout + 45, ended  # the deadline, with what stopping takes; not for ever
    assert not _spark_noise(err), err[-4000:]
    _nothing_secret(out + err)
    lines = err.strip().splitlines()
    assert len(lines) == 2, (out[-3000:], err)  # the error and what to do
    assert f"deadline (--timeout {timeout}s) passed while replaying the group from Delta" in lines[0]
    assert "rows ingested into Delta, the replay not finished after" in lines[0] and "Raise --timeout" in lines[1]
    logs = list((tmp_path / "logs").glob("main-*.log"))
    assert len(logs) == 1 and "cancelling its Spark jobs" in logs[0].read_text()


def test_the_deadline_cancels_the_spark_work_it_waits_for(spark):
    """The helper the replay and the checks wait through: at the deadline it cancels their Spark jobs
    (not just stops waiting) and raises the deadline error naming the phase; Spark goes on working."""
    import time

    from zerocomm_spark.pipelines.main import JobDeadlineError, _within_deadline

    def slow(batches):
        for batch in batches:
            time.sleep(120)
            yield batch

    began = time.monotonic()
    with pytest.raises(JobDeadlineError) as raised:
        _within_deadline(spark, time.monotonic() + 3, 3, "checking what was replayed", lambda: "10 rows replayed",
                         lambda: spark.range(1).mapInArrow(slow, "id long").count())
    assert time.monotonic() - began < 3 + 10
    assert raised.value.phase == "checking what was replayed" and "10 rows replayed" in str(raised.value)
    tracker = spark.sparkContext.statusTracker()
    _wait_for("cancelled job", lambda: not tracker.getActiveJobsIds(), 30)
    assert spark.range(5).count() == 5

    # Work whose next job comes after the deadline (the replay is several jobs in a row, planned on the
    # driver in between): cancelling only the running jobs hit nothing, and that job ran on afterwards.
    def then_a_job() -> int:
        time.sleep(4.5)
        return spark.range(1).mapInArrow(slow, "id long").count()

    with pytest.raises(JobDeadlineError):
        _within_deadline(spark, time.monotonic() + 3, 3, "replaying the group from Delta", lambda: "", then_a_job)
    time.sleep(1.0)
    assert not tracker.getActiveJobsIds()  # it was cancelled as it came, not left running for 120 s
    assert spark.range(5).count() == 5


def test_stopping_the_query_leaves_the_sessions_stop_timeout_as_it_was(spark):
    """The job bounds its query's stop with spark.sql.streaming.stopTimeout, a setting of the whole
    session: left set, a notebook's (or a test's) later stop() of another query threw a TimeoutException
    after that bound instead of waiting for its batch."""
    from zerocomm_spark.pipelines.main import _STOP_TIMEOUT, _stop_query

    before = spark.conf.get(_STOP_TIMEOUT, None)
    query = spark.readStream.format("rate").load().writeStream.format("noop").start()
    _stop_query(spark, query, 20.0)
    assert not query.isActive and spark.conf.get(_STOP_TIMEOUT, None) == before
    spark.conf.set(_STOP_TIMEOUT, "45s")
    try:
        query = spark.readStream.format("rate").load().writeStream.format("noop").start()
        _stop_query(spark, query, 20.0)
        assert spark.conf.get(_STOP_TIMEOUT) == "45s"
    finally:
        if before is None:
            spark.conf.unset(_STOP_TIMEOUT)
        else:
            spark.conf.set(_STOP_TIMEOUT, before)


def test_a_run_without_a_work_dir_says_its_table_went_with_the_temporary_directory(tmp_path):
    """Without --work-dir or --keep the summary's `table` line named a path the job had just removed
    (the temporary work directory goes at the end), so a user who went to look found nothing. It now
    says the table was removed and which options keep it."""
    import os

    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "zerocomm_spark.pipelines.main", "--publishers", "1", "--messages", "5",
         "--rate", "50", "--reply-fraction", "0", "--timeout", "600"],
        cwd=ROOT, capture_output=True, text=True, timeout=800, env=env)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    line = next(line for line in done.stdout.splitlines() if line.startswith("table "))
    path = line.split()[1]
    assert not Path(path).exists() and path.startswith(str(tmp_path)), line
    assert "removed" in line and "--keep" in line and "--work-dir" in line, line
