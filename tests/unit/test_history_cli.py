"""`zerocomm history`: the journal listing keeps its old form beside the Delta actions; key files."""

from __future__ import annotations

import os

import pytest

from zerocomm_spark.agent.cli import _with_history_action, build_parser
from zerocomm_spark.errors import ConfigurationError, InsecurePermissionsError, ZeroCommError
from zerocomm_spark.pipelines.commands import origin_label, read_key_file
from zerocomm_spark.pipelines.history_key import HistoryKey


@pytest.mark.parametrize("argv, expected", [
    (["history", "g"], ["history", "show", "g"]),
    (["--json", "history", "g", "--all"], ["--json", "history", "show", "g", "--all"]),
    (["--config", "c.toml", "history", "--limit", "5", "g"], ["--config", "c.toml", "history", "show", "--limit", "5", "g"]),
    (["history", "ingest", "g", "--table", "t"], ["history", "ingest", "g", "--table", "t"]),
    (["--timeout", "9", "history", "vacuum", "--table", "t"], ["--timeout", "9", "history", "vacuum", "--table", "t"]),
    (["send", "history", "x"], ["send", "history", "x"]),  # "history" as a group name elsewhere is left alone
    (["history", "--help"], ["history", "--help"]),
])
def test_history_without_an_action_is_the_journal_listing(argv, expected):
    assert _with_history_action(argv) == expected


def test_every_history_action_parses():
    parser = build_parser()
    args = parser.parse_args(_with_history_action(["history", "g", "--limit", "3"]))
    assert (args.history_command, args.group, args.limit) == ("show", "g", 3)
    args = parser.parse_args(["history", "ingest", "a", "b", "--table", "/t", "--available-now", "--max-per-trigger", "9"])
    assert (args.groups, args.table, args.available_now, args.max_per_trigger) == (["a", "b"], "/t", True, 9)
    args = parser.parse_args(["history", "replay", "g", "--table", "/t", "--since-lamport", "7", "--verify"])
    assert (args.since_lamport, args.since_version, args.verify) == (7, None, True)
    with pytest.raises(SystemExit):  # one "since" at a time
        parser.parse_args(["history", "replay", "g", "--table", "/t", "--since-lamport", "7", "--since-version", "1"])
    args = parser.parse_args(["history", "vacuum", "--table", "/t", "--retain-hours", "0", "--dry-run"])
    assert (args.retain_hours, args.dry_run) == (0.0, True)
    assert parser.parse_args(["history", "compact", "--table", "/t"]).group is None


def test_key_files_must_be_owner_only_and_hold_a_key(tmp_path):
    key = HistoryKey.generate()
    raw, text = tmp_path / "raw.key", tmp_path / "hex.key"
    raw.write_bytes(key.secret)
    text.write_text(key.secret.hex() + "\n")
    for path in (raw, text):
        os.chmod(path, 0o600)
        assert read_key_file(path) == key
    os.chmod(text, 0o644)
    with pytest.raises(InsecurePermissionsError):
        read_key_file(text)
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    os.chmod(bad, 0o600)
    with pytest.raises(ConfigurationError):
        read_key_file(bad)
    with pytest.raises(ConfigurationError):
        read_key_file(tmp_path / "missing.key")


def test_compacts_date_filter_goes_into_sql_only_as_a_checked_date() -> None:
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.history import _where

    assert _where("o'k", "2026-01-31") == "`group` = 'o\\'k' AND `date` >= DATE '2026-01-31'"
    for bad in ("2026-01-31' OR TRUE --", "yesterday", 20260131):
        with pytest.raises(ConfigurationError, match="since_date"):
            _where(None, bad)  # type: ignore[arg-type]


def test_the_origin_column_tells_an_unsigned_row_from_a_forged_one() -> None:
    assert origin_label({"origin_ok": True, "origin_sig": b"s" * 64}) == "ok"
    assert origin_label({"origin_ok": False, "origin_sig": b"s" * 64}) == "FAILED"
    assert origin_label({"origin_ok": False, "origin_sig": None}) == "unsigned"  # sent without a signer
    assert origin_label({"origin_sig": None}) == ""  # not verified
    # Signed, but sealed with a history key we were not given: it cannot be checked, it did not fail.
    sealed = {"origin_ok": False, "origin_sig": b"s" * 64, "payload_key_id": "k1"}
    assert origin_label(sealed) == "sealed" and origin_label(sealed, "k2") == "sealed"
    assert origin_label(sealed, "k1") == "FAILED"  # still sealed under the key given: altered or moved


def test_replay_json_says_what_the_origin_column_says(monkeypatch, capsys, tmp_path):
    """`history replay --verify --json` gave origin_ok false alike for a row nobody signed, a row sealed
    with a key not given and a forged one; the table tells them apart (ORIGIN), so the JSON does too."""
    import datetime as dt
    import json

    import zerocomm_spark.pipelines.commands as commands
    import zerocomm_spark.pipelines.replay as replay_mod
    from zerocomm_spark.agent.cli import main as zerocomm

    at = dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc)

    def row(seq, sig, ok, key_id=None):
        return {"group": "g", "message_id": f"m{seq}", "publisher_did": "did:key:z6Mkp", "publisher_label": "p",
                "seq": seq, "lamport_ts": seq, "sent_at": at, "received_at": at, "headers": None,
                "payload": b"x", "payload_key_id": key_id, "origin_sig": sig, "origin_ok": ok}

    rows = [row(1, b"s" * 64, True), row(2, None, False), row(3, b"s" * 64, False), row(4, b"s" * 64, False, "k9")]
    rows[0]["headers"] = [("kind", "q"), ("zc-origin", "1:x")]  # a map column, as Arrow gives it

    class Frame:
        def limit(self, n):
            return self

        def toArrow(self):
            class Table:
                def to_pylist(self):
                    return rows
            return Table()

    monkeypatch.setenv("HOME", str(tmp_path))  # no configuration of this host's
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(commands, "_spark", lambda: None)
    monkeypatch.setattr(replay_mod, "replay", lambda *a, **k: Frame())
    assert zerocomm(["--json", "history", "replay", "g", "--table", "/t", "--verify"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert [r["origin"] for r in out] == ["ok", "unsigned", "FAILED", "sealed"]
    assert [r["origin_ok"] for r in out] == [True, False, False, False]
    assert out[0]["headers"] == {"kind": "q", "zc-origin": "1:x"} and out[1]["headers"] is None  # an object
    rows = [{k: v for k, v in r.items() if k != "origin_ok"} for r in rows]  # not verified: no verdict
    assert zerocomm(["--json", "history", "replay", "g", "--table", "/t"]) == 0
    assert {json.loads(x)["origin"] for x in capsys.readouterr().out.splitlines() if x.strip()} == {None}


def _replay_finds_nothing(monkeypatch, tmp_path, *, held: list[str]) -> None:
    """`history replay` without Spark: its read returns no rows, and the table holds the groups ``held``."""
    import zerocomm_spark.pipelines.commands as commands
    import zerocomm_spark.pipelines.replay as replay_mod

    class Empty:
        def limit(self, n):
            return self

        def toArrow(self):
            class Table:
                def to_pylist(self):
                    return []
            return Table()

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(commands, "_spark", lambda: None)
    monkeypatch.setattr(replay_mod, "replay", lambda *a, **k: Empty())
    monkeypatch.setattr(commands, "groups_in", lambda spark, table: held)


def test_replay_of_a_group_the_table_does_not_hold_says_so(monkeypatch, capsys, tmp_path):
    """`history replay sensor --table T` (a misspelt group) printed "(no messages)" and exited 0, as
    for a group with nothing in the range asked; it exits 6 and names the groups the table holds."""
    import json

    from zerocomm_spark.agent.cli import main as zerocomm

    _replay_finds_nothing(monkeypatch, tmp_path, held=["sensors", "alerts"])
    assert zerocomm(["--json", "history", "replay", "sensor", "--table", "/t"]) == 6
    error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert error["type"] == "GroupNotFoundError" and "'sensor'" in error["message"]
    assert "'sensors'" in error["hint"] and "'alerts'" in error["hint"]
    assert zerocomm(["history", "replay", "sensors", "--table", "/t", "--since-lamport", "99"]) == 0
    assert "(no messages)" in capsys.readouterr().out  # a group it holds, nothing in the range: no error


def test_replay_of_a_table_with_no_rows_yet_is_no_messages_not_a_missing_group(monkeypatch, capsys, tmp_path):
    """A table no message was ingested into yet exited 6 ("holds no messages of group 'g'", "the groups
    it holds: none"): nothing to replay is not a failure, and no name can be checked against it."""
    from zerocomm_spark.agent.cli import main as zerocomm

    _replay_finds_nothing(monkeypatch, tmp_path, held=[])
    assert zerocomm(["history", "replay", "g", "--table", "/t"]) == 0
    said = capsys.readouterr()
    assert "the history table at /t holds no messages yet" in said.out and "error" not in said.err, said
    assert zerocomm(["--json", "history", "replay", "g", "--table", "/t"]) == 0
    said = capsys.readouterr()
    assert said.out == "" and "holds no messages yet" in said.err, said  # no line that is not a message


class _Java:
    """Just enough of a Java exception through Py4J: toString() and getCause()."""

    _target_id = "o1"

    def __init__(self, text, cause=None):
        self.text, self.cause = text, cause

    def toString(self):  # noqa: N802 - the Java name
        return self.text

    def getCause(self):  # noqa: N802 - the Java name
        return self.cause


def _java_error(*chain):
    from py4j.protocol import Py4JJavaError

    java = None
    for text in reversed(chain):
        java = _Java(text, java)
    return Py4JJavaError("An error occurred while calling o1.collectToPython.", java)


TABLE = "/data/history"
PART = "file:/data/history/group=g/date=2026-11-23/part-00000-c246.c000.snappy.parquet"
LOG = "file:///data/history/_delta_log/00000000000000000001.json"

# What Spark 4.2 and Delta 4.4 raise for a table whose files or log were removed or damaged.
DAMAGED = {
    "removed data file": (
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.FILE_NOT_EXIST] Encountered error while reading file "
        f"{PART}. File does not exist. SQLSTATE: 42K03",
        f"java.io.FileNotFoundException: File {PART} does not exist"),
    "checksum of a log file (compact)": (
        "org.apache.spark.SparkException: Exception thrown in awaitResult: ",
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file {LOG}.  "
        "SQLSTATE: KD001",
        f"org.apache.hadoop.fs.ChecksumException: Checksum error: {LOG} at 0 exp: -449427181 got: -1645589374"),
    "log file that is not JSON": (
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file {LOG}.  "
        "SQLSTATE: KD001",
        "org.apache.spark.SparkException: [MALFORMED_RECORD_IN_PARSING.WITHOUT_SUGGESTION] Malformed records are "
        "detected in record parsing: [null,null].",
        "com.fasterxml.jackson.core.JsonParseException: Unexpected character ('n' (code 110))"),
    "truncated data file": (
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file {PART}.",
        f"java.lang.RuntimeException: {PART} is not a Parquet file (length is too low: 11)"),
    "garbled data file": (
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file {PART}.",
        "java.io.IOException: can not read class org.apache.parquet.format.FileMetaData: don't know what type: 14",
        "shaded.parquet.org.apache.thrift.protocol.TProtocolException: don't know what type: 14"),
    "footer": (
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.CANNOT_READ_FILE_FOOTER] Encountered error while "
        f"reading file {PART}. Could not read footer.",),
    "removed first log file": (
        "org.apache.spark.sql.delta.DeltaFileNotFoundException: [DELTA_TRUNCATED_TRANSACTION_LOG] "
        "file:/data/history/_delta_log/00000000000000000000.json: Unable to reconstruct state at version 2",),
    "removed middle log file": (
        "org.apache.spark.sql.delta.DeltaIllegalStateException: [DELTA_VERSIONS_NOT_CONTIGUOUS] Versions (0, 2) are "
        "not contiguous. ",),
    "emptied log file": (
        "org.apache.spark.sql.delta.DeltaIllegalStateException: [DELTA_STATE_RECOVER_ERROR] The protocol of your "
        "Delta table could not be recovered while Reconstructing",),
    "log after a checkpoint": (
        "org.apache.spark.sql.delta.DeltaFileNotFoundException: [DELTA_LOG_FILE_NOT_FOUND] Unable to retrieve the "
        "delta log files to construct table version 12 starting from checkpoint version 10",),
    "file of the table without an error class": (
        "java.io.FileNotFoundException: File file:/data/history/_delta_log/00000000000000000003.json does not exist",),
}

# Failures that say nothing about the table's files: a healthy table must not be replaced from a copy.
NOT_DAMAGE = {
    "disk full while compacting": (
        "org.apache.spark.SparkException: [TASK_WRITE_FAILED] Task failed while writing rows to file:/data/history.",
        "java.io.IOException: No space left on device"),
    "data file not readable by this user": (
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.FILE_NOT_EXIST] Encountered error while reading file "
        f"{PART}. File does not exist.",
        f"java.io.FileNotFoundException: {PART[5:]} (Permission denied)"),
    "object store refused": (
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file {PART}.",
        "java.nio.file.AccessDeniedException: s3a://b/data/history/x.parquet: getFileStatus on ...: 403 Forbidden"),
    "network while reading": (
        f"org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file {PART}.",
        "java.net.SocketTimeoutException: Read timed out"),
    "concurrent commit": (
        "io.delta.exceptions.ConcurrentAppendException: [DELTA_CONCURRENT_APPEND.WITHOUT_HINT] Transaction conflict "
        "detected. a concurrent WRITE added data to table delta.`/data/history` committed at version 4.",),
    "a shuffle file of Spark's": (
        "org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 failed",
        "java.io.FileNotFoundException: /tmp/blockmgr-1/0c/shuffle_0_0_0.data (No such file or directory)"),
    "memory": (
        "org.apache.spark.SparkException: Job aborted due to stage failure",
        "java.lang.OutOfMemoryError: Java heap space"),
}


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_a_damaged_or_removed_table_file_is_named_with_what_to_do(name):
    from zerocomm_spark.pipelines.commands import _reading

    for action, said in (("replay", "could not be read"), ("compact", "compacting the history table at /data/history "
                                                          "failed"), ("vacuum", "vacuuming the history table at "
                                                                      "/data/history failed")):
        with pytest.raises(ConfigurationError) as raised:
            with _reading(TABLE, action):
                raise _java_error(*DAMAGED[name])
        assert said in str(raised.value) and TABLE in str(raised.value)
        assert "damaged or missing" in str(raised.value) or action == "replay"
        assert "put the table back from a copy" in raised.value.hint


@pytest.mark.parametrize("name", sorted(NOT_DAMAGE))
def test_a_failure_that_is_not_damage_is_spark_s_own_error(name):
    """`_reading` turned every Py4J/PySpark error (a disk full while compacting, a permission, a
    concurrent commit, the JVM dying) into "the table could not be read" with the hint to put it back
    from a copy: replacing a healthy table from a copy can lose rows."""
    from zerocomm_spark.pipelines.commands import _reading

    error = _java_error(*NOT_DAMAGE[name])
    for action in ("replay", "compact", "vacuum"):
        with pytest.raises(ZeroCommError) as raised:  # one line, not a Py4J traceback (exit 1)
            with _reading(TABLE, action):
                raise error
        assert type(raised.value) is ZeroCommError, raised.value
        assert "failed in Spark" in str(raised.value) and TABLE in str(raised.value)
        assert "copy" not in raised.value.hint


def test_the_jvm_or_a_python_worker_failing_is_not_a_damaged_table():
    from py4j.protocol import Py4JNetworkError
    from pyspark.errors import PySparkException

    from zerocomm_spark.pipelines.commands import _reading

    for error in (Py4JNetworkError("Answer from Java side is empty"),
                  PySparkException(message="An exception was thrown from the Python worker: FileNotFoundError: "
                                           "[Errno 2] No such file or directory: '/data/history/_delta_log'")):
        with pytest.raises(ZeroCommError) as raised:
            with _reading(TABLE, "compact"):
                raise error
        assert type(raised.value) is ZeroCommError and "copy" not in raised.value.hint


def test_a_table_named_corrupt_does_not_make_a_network_error_damage():
    from zerocomm_spark.pipelines.commands import _reading

    part = "file:/data/corrupt-copy/group=g/part-0.parquet"
    error = _java_error(f"org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading "
                        f"file {part}.", f"java.io.IOException: Stream closed reading {part}")
    with pytest.raises(ZeroCommError) as raised:
        with _reading("/data/corrupt-copy", "replay"):
            raise error
    assert type(raised.value) is ZeroCommError and "copy" not in raised.value.hint


@pytest.mark.parametrize("line", [
    "org.apache.spark.sql.delta.VersionNotFoundException: [DELTA_VERSION_NOT_FOUND] Cannot time travel Delta table "
    "to version 99. Available versions: [0, 5].",
    "org.apache.spark.sql.delta.DeltaErrors: [DELTA_TIMESTAMP_EARLIER_THAN_COMMIT_RETENTION] The provided timestamp "
    "(2020-01-01 00:00:00.0) is before the earliest version available to this table",
])
def test_a_version_or_time_the_table_lacks_is_a_usage_error_not_a_traceback(line):
    """`history replay --as-of 99` on a table at version 5 ended in a Py4J traceback (exit 1)."""
    from zerocomm_spark.pipelines.commands import _reading

    with pytest.raises(ConfigurationError, match="has no such version or time") as raised:
        with _reading(TABLE, "replay"):
            raise _java_error(line)
    assert "DESCRIBE HISTORY" in raised.value.hint


@pytest.mark.parametrize("argv, words", [
    (["--trigger", "bogus"], "--trigger 'bogus' is not an interval"),
    (["--trigger", "1.5 minutes"], "--trigger '1.5 minutes' is not an interval"),
    (["--trigger", "1 month"], "--trigger '1 month' is not an interval"),
    (["--max-per-trigger", "0"], "--max-per-trigger must be 1 or more, not 0"),
    (["--available-now", "--max-per-trigger", "-3"], "--max-per-trigger must be 1 or more, not -3"),
    (["--available-now", "--trigger", "bogus"], "--trigger 'bogus' and --available-now cannot go together"),
    (["--available-now", "--trigger", "5 seconds"], "--trigger '5 seconds' and --available-now cannot go together"),
    (["--available-now", "--trigger", "1 second"], "--trigger '1 second' and --available-now cannot go together"),
])
def test_ingest_trigger_options_are_usage_errors_before_spark_starts(monkeypatch, capsys, tmp_path, argv, words):
    """--trigger bogus and --max-per-trigger 0 were refused only once Spark had started (~18 s), naming
    trigger='bogus' and the connector's maxMessagesPerTrigger; with --available-now, --trigger bogus
    was accepted without a word (exit 0). Usage errors (exit 2) naming the flags; Spark never starts."""
    import json

    import zerocomm_spark.pipelines.commands as commands
    from zerocomm_spark.agent.cli import main as zerocomm

    def no_spark():
        raise AssertionError("Spark was started")

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(commands, "_spark", no_spark)
    assert zerocomm(["history", "ingest", "sensors", "--table", str(tmp_path / "t"), *argv]) == 2
    assert words in capsys.readouterr().err
    assert zerocomm(["--json", "history", "ingest", "sensors", "--table", str(tmp_path / "t"), *argv]) == 2
    error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert words in error["message"] and error["type"] == "ConfigurationError"


@pytest.mark.parametrize("trigger, seconds", [
    ("1 second", 1.0), ("500 milliseconds", 0.5), ("interval 2 minutes", 120.0), ("1.5 seconds", 1.5),
    ("1 hour 2 minutes", 3720.0), (" 1  Second ", 1.0), ("1 week", 604800.0), ("0 seconds", 0.0),
    ("1 minute -10 seconds", 50.0), ("10 microseconds", 1e-5),
])
def test_trigger_intervals_spark_takes_are_taken(trigger, seconds):
    """What Spark 4's processing-time trigger accepts (checked against its IntervalUtils) is accepted."""
    from zerocomm_spark.pipelines.commands import interval_seconds

    assert interval_seconds(trigger) == pytest.approx(seconds)


@pytest.mark.parametrize("trigger", ["bogus", "1second", "1s", "500 ms", "1 min", "10", "1 second 2", "1.5 minutes",
                                     "1 month", "2 years", "-1 second", "every second", "1 hours,", ""])
def test_trigger_intervals_spark_refuses_are_refused(trigger):
    from zerocomm_spark.pipelines.commands import interval_seconds

    assert interval_seconds(trigger) is None


@pytest.mark.parametrize("flags, words, hint", [
    (["--since-time", "garbage"], "--since-time: 'garbage' is not an ISO 8601 time", "ISO 8601"),
    (["--history-key-file", "/nonexistent/key"], "cannot read the history key file /nonexistent/key",
     "--history-key-file"),
])
def test_replay_errors_of_its_own_flags_name_the_flag_not_a_setting(monkeypatch, capsys, tmp_path, flags, words,
                                                                     hint):
    """--since-time garbage and a missing --history-key-file said "Check the named setting against
    conf/zerocomm.toml and the README": neither is a setting. Usage errors (exit 2) naming the flag."""
    import json

    from zerocomm_spark.agent.cli import main as zerocomm

    _replay_finds_nothing(monkeypatch, tmp_path, held=["g"])
    assert zerocomm(["--json", "history", "replay", "g", "--table", "/t", *flags]) == 2
    error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert words in error["message"] and hint in error["hint"], error
    assert "conf/zerocomm.toml" not in error["hint"], error


def test_ingest_needs_the_agent_running_or_spawn_before_spark_starts(monkeypatch, capsys, tmp_path):
    """`history ingest` with no agent running started one through the connector's spawnAgent default,
    without a word, and left it running after the command (found by a user review); every other
    command exits 3 and says how to start it unless --spawn is given. Now ingest does the same,
    before Spark starts."""
    import zerocomm_spark.pipelines.commands as commands
    from zerocomm_spark.agent.cli import main as zerocomm

    def no_spark():
        raise AssertionError("Spark was started")

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(commands, "_spark", no_spark)
    assert zerocomm(["history", "ingest", "sensors", "--table", str(tmp_path / "t"), "--available-now"]) == 3
    err = capsys.readouterr().err
    assert "no agent is running" in err and "zerocomm agent start --detach" in err  # (and to init first: none here)


def test_ingest_with_the_agent_running_asks_it_first_and_says_how_payloads_are_kept(monkeypatch, capsys, tmp_path):
    """The agent is asked for before Spark starts (the check above); the summary says the payloads
    went into the table in clear, since the group's messages are end-to-end encrypted."""
    import zerocomm_spark.pipelines.commands as commands
    import zerocomm_spark.pipelines.history as history
    from zerocomm_spark.agent import cli
    from zerocomm_spark.agent.cli import main as zerocomm

    order: list[str] = []

    class Stopped:
        isActive = False

        def exception(self):
            return None

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    class Member:
        def groups(self):
            order.append("agent")
            return [{"group": "sensors"}]

    monkeypatch.setattr(cli.Ctx, "client", lambda self: Member())
    monkeypatch.setattr(commands, "_spark", lambda: order.append("spark"))
    monkeypatch.setattr(history, "ingest", lambda *a, **kw: Stopped())
    monkeypatch.setattr(history, "release_checkpointed", lambda *a, **kw: None)
    assert zerocomm(["history", "ingest", "sensors", "--table", str(tmp_path / "t"), "--available-now"]) == 0
    assert order == ["agent", "spark"]
    assert "payloads in clear (--history-key-file seals them)" in capsys.readouterr().out


def test_a_jvm_that_did_not_start_is_said_by_its_error_line_not_its_last():
    from zerocomm_spark.pipelines.commands import _start_failure

    launcher = ("/venv/pyspark/bin/spark-class: line 71: /opt/jdk/bin/java: No such file or directory\n"
                "/venv/pyspark/bin/spark-class: line 97: CMD: bad array subscript\n")
    assert _start_failure(launcher) == "/opt/jdk/bin/java: No such file or directory"
    java = ("WARNING: Using incubator modules: jdk.incubator.vector\n"
            "26/11/29 15:44:09 WARN NativeCodeLoader: Unable to load native-hadoop library for your platform\n"
            "Exception in thread \"main\" java.lang.UnsupportedClassVersionError: org/apache/spark/deploy/SparkSubmit\n"
            "\tat java.base/java.lang.ClassLoader.defineClass1(Native Method)\n")
    assert _start_failure(java).startswith("Exception in thread \"main\" java.lang.UnsupportedClassVersionError")
    assert _start_failure("something odd\nthe last words\n") == "the last words"
    assert _start_failure("\n \n") is None


def test_ingest_of_a_group_the_member_is_not_in_says_so_before_spark_starts(monkeypatch, capsys, tmp_path):
    """A misspelt group was refused only by the query's own check, after Spark had started (47 s under
    load, user review). The member is asked first: exit 6, its groups named, Spark never started."""
    import zerocomm_spark.pipelines.commands as commands
    from zerocomm_spark.agent import cli
    from zerocomm_spark.agent.cli import main as zerocomm

    class Member:
        def groups(self):
            return [{"group": "sensors"}, {"group": "alerts"}]

    def no_spark():
        raise AssertionError("Spark was started")

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(cli.Ctx, "client", lambda self: Member())
    monkeypatch.setattr(commands, "_spark", no_spark)
    argv = ["history", "ingest", "sensors", "snesors", "--table", str(tmp_path / "t"), "--available-now"]
    assert zerocomm(argv) == 6
    err = capsys.readouterr().err
    assert "in no group named 'snesors'" in err and "'alerts', 'sensors'" in err, err


def test_an_error_that_names_sparks_log_for_the_details_finds_them_there(monkeypatch, tmp_path):
    """"Spark's log (...) has the details" named a file of start-up notes only: Delta's refusal is raised
    on the driver, not written by the JVM (user review). The whole Java chain is added to that file."""
    import zerocomm_spark.pipelines.commands as commands

    spark_log = tmp_path / "spark.log"
    spark_log.write_text("WARNING: Using incubator modules: jdk.incubator.vector\n")
    monkeypatch.setattr(commands, "_spark_log", spark_log)
    error = _java_error("org.apache.spark.sql.delta.DeltaAnalysisException: [DELTA_MISSING_DELTA_TABLE] x is not a "
                        "Delta table.", "java.io.IOException: the cause")
    with pytest.raises(ZeroCommError) as raised:
        with commands._reading(TABLE, "vacuum"):  # noqa: SLF001
            raise error
    assert str(spark_log) in str(raised.value)
    text = spark_log.read_text()
    assert "history vacuum of" in text and "DELTA_MISSING_DELTA_TABLE" in text and "the cause" in text, text


def test_a_first_ctrl_c_stops_the_ingest_between_jvm_calls_and_py4j_says_nothing(monkeypatch, capsys):
    """Ctrl-C of a running ingest raised KeyboardInterrupt inside a Py4J call: Py4J logged ~40 lines of
    errors and tracebacks on the terminal (through logging's root functions: "ERROR:root:..."), though
    the ingest then stopped well (user review). A first Ctrl-C now only asks the loop to stop; a second
    one raises as usual; Py4J's records stay off the terminal, the command's own warnings do not."""
    import logging
    import signal
    import threading

    import zerocomm_spark.pipelines.commands as commands

    stop = threading.Event()
    with commands._ctrl_c_sets(stop):  # noqa: SLF001
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    commands._quiet_py4j()  # noqa: SLF001
    try:
        py4j = logging.LogRecord("root", logging.ERROR, "/venv/site-packages/py4j/java_gateway.py", 1060,
                                 "Exception while sending command.", None, None)
        root.handle(py4j)
        logging.getLogger("zerocomm_spark.pipelines.commands").warning("could not tell the agent's journal")
        err = capsys.readouterr().err
        assert "Exception while sending command" not in err and "could not tell the agent's journal" in err, err
    finally:
        for handler in root.handlers:
            handler.close()
