"""The bodies of `zerocomm history ingest|replay|compact|vacuum` (parsed in zerocomm_spark.agent.cli).

Why here: they start Spark and Delta, which the agent layer must not load for its other commands;
the CLI imports this module only when one of these actions runs.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from zerocomm_spark.errors import ConfigurationError, GroupNotFoundError, InsecurePermissionsError, ZeroCommError
from zerocomm_spark.pipelines.history_key import KEY_BYTES, HistoryKey

__all__ = ["compact", "ingest", "read_key_file", "replay", "run", "vacuum"]

log = logging.getLogger(__name__)


def read_key_file(path: str | os.PathLike[str]) -> HistoryKey:
    """A history key from an owner-only file: 32 raw bytes, or 64 hex digits."""
    file = Path(path).expanduser()
    try:
        st = file.stat()
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"cannot read the history key file {file}: {exc.strerror}",
                                 hint="Check the path given with --history-key-file (an owner-only file holding the "
                                      "group's 32-byte history key, raw or as 64 hex digits)") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InsecurePermissionsError(f"the history key file {file} can be read by other users",
                                       hint="chmod 600 it (the key opens every sealed payload of the group)")
    text = data.strip()
    if len(data) == KEY_BYTES:
        return HistoryKey(data)
    try:
        return HistoryKey(bytes.fromhex(text.decode("ascii")))
    except (ValueError, UnicodeDecodeError):
        raise ConfigurationError(f"the history key file {file} holds neither 32 bytes nor 64 hex digits",
                                 hint="Give --history-key-file the file the group's history key was saved to") from None


def _since_time(text: str) -> Any:
    """--since-time as a replay start; a time that is not ISO 8601 names the flag (the library's error
    pointed at conf/zerocomm.toml, which has no such setting)."""
    from zerocomm_spark.pipelines.replay import Since

    try:
        return Since.timestamp(text)
    except ConfigurationError as exc:
        raise ConfigurationError(f"--since-time: {exc.message}",
                                 hint="Give an ISO 8601 time, e.g. 2026-11-28T09:30:00+00:00 (UTC without a "
                                      "zone), or --since-lamport N") from None


def _java_chain(exc: BaseException) -> list[str]:
    """The first line of each exception in a Py4J (or captured PySpark) error's Java cause chain."""
    java = getattr(exc, "java_exception", None) or getattr(exc, "_origin", None)
    texts: list[str] = []
    try:
        while java is not None and len(texts) < 12:
            text = str(java.toString()).strip()
            texts.append(text.splitlines()[0] if text else "")
            java = java.getCause()
    except Exception:  # noqa: BLE001 - only the message is at stake
        pass
    return texts


def _spark_reason(exc: BaseException) -> str:
    """Spark's or Delta's reason in one line (the error class and what it names, e.g. a file), without
    the JVM's stack; for a Py4J error, the first exception in its chain that names an error class."""
    texts = _java_chain(exc)
    firsts = [t.strip().splitlines()[0] for t in (texts or [str(exc)]) if t.strip()]
    named = [t for t in firsts if "[" in t and "]" in t]
    return ((named or firsts or [type(exc).__name__])[0])[:300]


# A line that opens an exception in Java's or Python's rendering of one: "Caused by: a.b.CException:
# msg", ": a.b.CException: msg" (a Py4JJavaError's Java part), "pkg.mod.SomeError: msg" (a traceback's last).
_EXCEPTION_LINE = re.compile(
    r"^(?:Caused by: |: )?((?:[A-Za-z_$][\w$]*\.)*[A-Za-z_$][\w$]*(?:Exception|Error))(?: \w+=\w+)?: (.*)$")
# Exceptions that only carry another one across a boundary (the JVM and the Python driver, a task and
# the driver, a streaming query and its caller): never the reason.
_WRAPPERS = ("An exception was raised by the Python Proxy", "An error occurred while calling",
             "Traceback (most recent call last):",
             "[FOREACH_BATCH_USER_FUNCTION_ERROR]", "Exception thrown in awaitResult", "Job aborted due to stage failure")
_WRAPPER_CLASSES = ("StreamingQueryException", "ForeachBatchUserFuncException", "Py4JJavaError", "Py4JException",
                    "ExecutionException", "InvocationTargetException", "UndeclaredThrowableException")
_SQLSTATE = re.compile(r"\s*SQLSTATE: \w+\.?\s*$")


def _without_query_description(text: str) -> str:
    """A streaming query's error without the description Spark adds to it ("=== Streaming Query ===",
    its offsets and plan, up to the stack or the next cause)."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.strip() == "=== Streaming Query ===":
            skipping = True
        elif skipping and line.startswith(("\tat ", "Caused by: ")):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out)


def _query_reason(exc: BaseException, full_text: str | None = None) -> str:
    """Why a streaming query failed, in one line, from its StreamingQueryException (``query.exception()``):
    the first error Spark or Delta named (an error class, "[DELTA_...] ..."), else the first exception
    that is not a wrapper, and the root cause beneath it if it says more ("...; cause:
    ParentNotDirectoryException: Parent path is not a directory: ..."). Not the query's description
    (offsets, plan) and not a stack: a failure in ``foreachBatch`` arrives as a Python traceback that
    holds the Java error's whole stack, and the JVM's own failures as a chain of causes. ``full_text``:
    the JVM's rendering of the error with its causes (Utils.exceptionString), when there is one."""
    texts: list[str] = []
    seen: set[int] = set()
    node: Any = exc
    while node is not None and id(node) not in seen and len(texts) < 12:  # this exception and its causes
        seen.add(id(node))
        text = getattr(node, "_desc", None)
        if text is None:
            try:
                text = str(node)
            except Exception:  # noqa: BLE001 - only the message is at stake
                text = ""
        texts.append(_without_query_description(str(text)))
        node = getattr(node, "_cause", None) or node.__cause__
    if full_text:
        texts.append(_without_query_description(full_text))
    found: list[tuple[str, str]] = []
    for text in texts:
        for line in text.splitlines():
            match = _EXCEPTION_LINE.match(line.strip())
            if match is None:
                continue
            name = match.group(1).rsplit(".", 1)[-1].rsplit("$", 1)[-1]  # (Shell$ExitCodeException)
            message = _SQLSTATE.sub("", match.group(2)).strip()
            if name in _WRAPPER_CLASSES or message.startswith(_WRAPPERS) or not message:
                continue
            if (name, message) not in found:
                found.append((name, message))
    first_line = next((line.strip() for text in texts for line in text.splitlines() if line.strip()), "")
    if not found:
        return " ".join(first_line.split())[:300] or type(exc).__name__
    named = [f for f in found if f[1].startswith("[")]
    head = named[0] if named else found[0]
    reason = head[1] if head[1].startswith("[") else f"{head[0]}: {head[1]}"
    root = found[-1]
    if root != head and root[1] not in head[1]:
        reason = f"{reason[:300]}; cause: {root[0]}: {root[1][:200]}"
    return " ".join(reason.split())[:520]


# Spark's and Delta's error classes that mean a file of the table (data or _delta_log) is missing or
# its log cannot be put together (Delta 4.4 on Spark 4.2); a class matches its subclasses too.
_DAMAGE_CLASSES = ("FAILED_READ_FILE.FILE_NOT_EXIST", "FAILED_READ_FILE.CANNOT_READ_FILE_FOOTER",
                   "FAILED_READ_FILE.PARQUET_COLUMN_DATA_TYPE_MISMATCH", "PATH_NOT_FOUND", "DELTA_LOG_FILE_NOT_FOUND",
                   "DELTA_TRUNCATED_TRANSACTION_LOG", "DELTA_VERSIONS_NOT_CONTIGUOUS", "DELTA_STATE_RECOVER_ERROR",
                   "DELTA_MISSING_PART_FILES", "DELTA_CHECKPOINT_NON_EXIST_TABLE", "DELTA_FILE_NOT_FOUND",
                   "DELTA_FILE_OR_DIR_NOT_FOUND")
# Under FAILED_READ_FILE (whose NO_HINT subclass also covers network and permission failures): the
# causes that say the file read is damaged (a checksum, a log line that is not JSON, a data file that
# is no Parquet or is cut short).
_CORRUPT_CAUSES = ("ChecksumException", "MALFORMED_RECORD_IN_PARSING", "JsonParseException", "JsonEOFException",
                   "ParquetDecodingException", "TProtocolException", "java.io.EOFException", "is not a Parquet file",
                   "can not read class org.apache.parquet", "corrupt")
# Never the table's fault, whatever else the chain says: the table itself may be whole.
_NOT_DAMAGE = ("Permission denied", "AccessDenied", "Access Denied", "403 Forbidden", "No space left on device",
               "Disk quota exceeded", "Read-only file system", "OutOfMemoryError", "Too many open files")
# The error class opening an exception's message ("org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] ...").
_ERROR_CLASS = re.compile(r"^(?:[\w.$]+: )?\[([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\]")


def _table_damage(exc: BaseException, table: str) -> str | None:
    """Spark's reason when ``exc`` says a data or log file of ``table`` is missing or damaged; None when
    it says something else (the JVM or a Python worker dying, a disk full or a permission while
    writing, a concurrent commit), which must reach the user as Spark's own error."""
    chain = _java_chain(exc)
    if not chain and not hasattr(exc, "java_exception"):
        try:
            chain = [str(exc).strip()]
        except Exception:  # noqa: BLE001 - nothing to tell it by: not damage
            return None
    if not chain or any(word in text for text in chain for word in _NOT_DAMAGE):
        return None
    classes = [m.group(1) for m in map(_ERROR_CLASS.match, chain) if m]
    damaged = any(c == d or c.startswith(d + ".") for c in classes for d in _DAMAGE_CLASSES)
    cause = None
    read = next((i for i, t in enumerate(chain) if (m := _ERROR_CLASS.match(t))
                 and m.group(1).split(".")[0] == "FAILED_READ_FILE"), None)
    if not damaged and read is not None:
        # The causes of that failure, their paths left out (a table may be called "corrupt-copy").
        cause = next((t for t in chain[read + 1:]
                      if any(word.lower() in " ".join(w for w in t.lower().split() if "/" not in w)
                             for word in _CORRUPT_CAUSES)), None)
        damaged = cause is not None
    if not damaged:
        # A bare FileNotFoundException counts only for a file of this table (not, say, a shuffle file).
        where = table.rstrip("/") if "://" in table else os.path.abspath(os.path.expanduser(table))
        damaged = any(t.startswith(("java.io.FileNotFoundException", "org.apache.spark.sql.delta.DeltaFileNotFound"))
                      and where + "/" in t for t in chain)
    if not damaged:
        return None
    reason = _spark_reason(exc)
    return reason if cause is None or cause == reason else f"{reason[:300]}; {cause[:200]}"


# Delta's answers to a version or time the table does not have (--as-of, --since-version).
_NO_SUCH_VERSION = ("DELTA_VERSION_NOT_FOUND", "DELTA_TIMESTAMP_GREATER_THAN_COMMIT",
                    "DELTA_TIMESTAMP_EARLIER_THAN_COMMIT_RETENTION", "DELTA_CHANGE_DATA_FEED_NOT_ENABLED",
                    "DELTA_MISSING_CHANGE_DATA", "VersionNotFoundException")


def _spark_failure(exc: BaseException, table: str, action: str) -> ZeroCommError:
    """Any other failure of Spark's, said in one line (no Py4J traceback) without the damage hint: a
    version or time the table lacks is the user's to fix (exit 2); the rest is Spark's (exit 1)."""
    reason = _spark_reason(exc)
    chain = " ".join(_java_chain(exc)) or str(exc)
    if any(marker in chain for marker in _NO_SUCH_VERSION):
        return ConfigurationError(
            f"the history table at {table} has no such version or time ({reason})",
            hint="Give a version or time the table has: DESCRIBE HISTORY delta.`<table>` lists them "
                 "(--as-of, --since-version)")
    if action == "ingest":
        return ZeroCommError(f"starting the ingest into the history table at {table} failed in Spark ({reason})",
                             hint="Give --table a Delta table of group history, or a path with nothing there yet "
                                  f"(one is made), and a --checkpoint this user can write; {_spark_log_text()} "
                                  "has the details")
    doing = {"replay": "replaying", "compact": "compacting", "vacuum": "vacuuming"}.get(action, action)
    return ZeroCommError(f"{doing} the history table at {table} failed in Spark ({reason})",
                         hint=f"Spark's own error: {_spark_log_text()} has the details; the table's files "
                              "were read without a sign of damage")


@contextmanager
def _reading(table: str, action: str = "replay") -> Iterator[None]:
    """Spark's failures that say the history table's log or data files are damaged or were removed,
    as a ConfigurationError naming the table, not a Py4J traceback; any other failure of Spark's (the
    JVM gone, a Python worker's error, a full disk or a permission while compact or vacuum write, a
    concurrent commit) as one line saying Spark failed (see _spark_failure), never with the hint to
    put the table back from a copy, which could lose rows of a whole table. The full Java chain is
    logged at debug level."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    try:
        yield
    except (Py4JError, PySparkException) as exc:
        if isinstance(exc, (ValueError, TypeError)):  # PySpark refusing an argument (a --trigger): usage, as before
            raise
        ours = _zerocomm_error_in(exc)
        if ours is not None:  # the connector refusing an option in a Python worker: its own error and exit code
            raise ours from None
        chain = " <- ".join(_java_chain(exc)) or str(exc)
        log.debug("history %s of %s failed in Spark: %s", action, table, chain)
        _note_in_spark_log(f"history {action} of {table} failed in Spark: {chain}")  # the details its hint names
        reason = _table_damage(exc, table)
        if reason is None:
            raise _spark_failure(exc, table, action) from None
        if action == "replay":
            said = f"the history table at {table} could not be read: a file of it is damaged or missing ({reason})"
            then = ("give another history table (DESCRIBE HISTORY delta.`<table>` lists the versions it has)")
        else:
            doing = {"compact": "compacting", "vacuum": "vacuuming", "ingest": "ingesting into"}.get(action, action)
            said = f"{doing} the history table at {table} failed: a file of it is damaged or missing ({reason})"
            then = f"{action} it again once it is whole"
        raise ConfigurationError(said, hint="Its _delta_log or data files are damaged or were removed: put the "
                                            f"table back from a copy, or {then}") from None


_OUR_ERROR = re.compile(r"^zerocomm_spark\.errors\.([A-Za-z]+Error): (.+)$", re.MULTILINE)


def _zerocomm_error_in(exc: BaseException) -> ZeroCommError | None:
    """A ZeroComm error raised in a Python worker (a connector option refused while Spark made the data
    source) comes back inside Spark's error as the worker's traceback: the same error again, so its
    message (hint included) and exit code are the user's, not "Spark failed"."""
    from zerocomm_spark import errors

    try:
        texts = [str(getattr(exc, "_desc", None) or exc)]
    except Exception:  # noqa: BLE001 - a Py4J error whose JVM side cannot be read: its chain only
        texts = []
    texts += _java_chain(exc)
    found = [m for text in texts for m in _OUR_ERROR.finditer(text)]
    if not found:
        return None
    name, message = found[-1].group(1), found[-1].group(2).strip()
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ZeroCommError)):
        return None
    return cls(message, hint="")  # the message carries its hint already


def query_failure_text(spark: Any, query: Any) -> str:
    """A failed streaming query's whole error, every cause with its stack (the JVM's rendering), for the
    log and for _query_reason; what pyspark kept of it where the JVM's cannot be had."""
    try:
        return str(spark.sparkContext._jvm.org.apache.spark.util.Utils.exceptionString(query._jsq.exception().get()))
    except Exception:  # noqa: BLE001 - only the text is at stake
        error = query.exception()
        return str(getattr(error, "_desc", error))


#: The file this command's Spark writes its own output to (the JVM's and its Python workers' stdout and
#: stderr), once _spark() started it; None while Spark has not been started by this command.
_spark_log: Path | None = None


@contextmanager
def _ctrl_c_sets(event: threading.Event) -> Iterator[None]:
    """Within: a first Ctrl-C sets ``event`` (the caller stops what it runs between two calls into the
    JVM), a second one raises KeyboardInterrupt as usual. A KeyboardInterrupt raised inside a Py4J call
    broke its connection mid-answer: Py4J logged ~40 lines of errors and tracebacks (user review)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _NotPy4J(logging.Filter):
    """Py4J's own log records (a call cut short: "Exception while sending command", with tracebacks)
    are not for the terminal of a command line: what failed comes back as the command's error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{os.sep}py4j{os.sep}" not in (record.pathname or "")


def _quiet_py4j() -> None:
    """Keep Py4J's records off the terminal. Py4J logs through the logging module's functions, which
    configure the root logger (a stderr handler, "ERROR:root:...") when it has no handler: so it gets
    one first, saying what Python's last-resort handler would (warnings and up, the message alone)."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        root.addHandler(handler)
    for handler in root.handlers:
        if not any(isinstance(f, _NotPy4J) for f in handler.filters):
            handler.addFilter(_NotPy4J())
    logging.getLogger("py4j").setLevel(logging.CRITICAL)


def _note_in_spark_log(text: str) -> None:
    """Add a failure's whole text to Spark's log file, which the error names as having the details:
    an error raised on the driver (Delta refusing a path) is not in what the JVM writes there."""
    if _spark_log is None:
        return
    try:
        with open(_spark_log, "a", encoding="utf-8", errors="backslashreplace") as f:
            f.write(f"\n{time.strftime('%Y-%m-%d %H:%M:%S')} zerocomm: {text}\n")
    except OSError:
        pass


def _spark_log_text() -> str:
    """Where Spark's own log is, for a hint."""
    return f"Spark's log ({_spark_log})" if _spark_log is not None else "Spark's log (the driver's output)"


@contextmanager
def _output_to(fd: int) -> Iterator[None]:
    """File descriptors 1 and 2 to ``fd`` while Spark starts, so the JVM (and the Python workers it forks
    later) inherit it as theirs; this process's own output goes back to the terminal afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _spark() -> Any:
    """The local Spark session. Started here, its JVM writes to a log file, not to the terminal: five
    lines of start-up notes and warnings ("Using incubator modules", the native-hadoop warning, the
    log4j profile) came before every command's own output, and Spark's warnings during a query after it."""
    global _spark_log
    from pyspark import SparkContext

    from zerocomm_spark.connector.session import local_spark

    if SparkContext._active_spark_context is not None:  # noqa: SLF001 - already started (a notebook, a test)
        return local_spark("zerocomm-history")
    _quiet_py4j()
    fd, name = tempfile.mkstemp(prefix="zerocomm-history-spark-", suffix=".log")
    _spark_log = Path(name)
    try:
        with _output_to(fd):
            return local_spark("zerocomm-history")
    except KeyboardInterrupt:
        _stop_starting_jvm()
        raise
    except ZeroCommError:
        raise
    except Exception as exc:  # noqa: BLE001 - the JVM did not start: its reason is in the log, say it
        reason = _start_failure(_spark_log.read_text(errors="replace")) or f"{type(exc).__name__}: {exc}"
        raise ZeroCommError(f"Spark did not start: {reason}",
                            hint=f"{_spark_log_text()} has its whole output; Spark needs Java 17 or later "
                                 "(JAVA_HOME, or java on the PATH)") from None
    finally:
        os.close(fd)


def _stop_starting_jvm() -> None:
    """Kill the Spark JVM this process launched, when a Ctrl-C stopped its start: the JVM ignores SIGINT
    (pyspark starts it so), and one interrupted before it watched its stdin was left running, orphaned,
    after the command exited (user review). Its launcher is a child of this process (spark-submit
    execs into the JVM)."""
    me = os.getpid()
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:  # no /proc: nothing to look through
        return
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            if int(stat[stat.rindex(b")") + 2:].split()[1]) != me:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if b"SparkSubmit" in command or b"spark-submit" in command or b"spark-class" in command:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


_LAUNCHER_PREFIX = re.compile(r"^\S*spark-(?:class|submit): line \d+: ")
_START_ERROR = re.compile(r"error|exception|no such file|not found|permission denied|cannot|unable", re.IGNORECASE)


def _start_failure(output: str) -> str | None:
    """The line of a JVM that did not start which says why: the first that reads like an error (the
    launcher's "java: No such file or directory", a Java exception), else the last; None if it said nothing."""
    lines = [_LAUNCHER_PREFIX.sub("", line.strip()) for line in output.splitlines() if line.strip()]
    said = (line for line in lines if _START_ERROR.search(line)  # not a warning ("Unable to load native-hadoop")
            and not line.startswith("WARNING:") and " WARN " not in line)
    return next(said, lines[-1] if lines else None)


def run(action: str, ctx: Any) -> int:
    """Run one history action. Spark's log file is removed after a success, and after an error that does
    not name it; an error that names it (Spark's own failure) leaves it for the user to read."""
    try:
        code = {"ingest": ingest, "replay": replay, "compact": compact, "vacuum": vacuum}[action](ctx)
    except ZeroCommError as exc:
        if _spark_log is not None and str(_spark_log) not in str(exc):
            _spark_log.unlink(missing_ok=True)
        raise
    except KeyboardInterrupt:  # the user stopped it: nothing in Spark's log is theirs to read
        if _spark_log is not None:
            _spark_log.unlink(missing_ok=True)
        sys.stderr.write("zerocomm: interrupted (Ctrl-C)\n")
        raise
    if _spark_log is not None and code == 0:
        _spark_log.unlink(missing_ok=True)
    return code


#: `history ingest`'s micro-batch interval without --trigger (None there: a --trigger given at all is known).
_DEFAULT_TRIGGER = "1 second"
# An interval as Spark's processing-time trigger takes it: "[interval] N unit [N unit ...]" (a
# fraction in seconds only); months and years it refuses.
_INTERVAL_TERM = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)\s+(week|day|hour|minute|second|millisecond|microsecond)s?",
                            re.IGNORECASE)
_INTERVAL = re.compile(rf"\s*(?:interval\s+)?{_INTERVAL_TERM.pattern}(?:\s+{_INTERVAL_TERM.pattern})*\s*",
                       re.IGNORECASE)
_UNIT_SECONDS = {"week": 604800.0, "day": 86400.0, "hour": 3600.0, "minute": 60.0, "second": 1.0,
                 "millisecond": 1e-3, "microsecond": 1e-6}


def interval_seconds(text: str) -> float | None:
    """Seconds in a trigger interval ("1 second", "500 milliseconds", "1 minute 30 seconds"), or None
    if Spark would refuse it: checked here so a bad --trigger is a usage error before Spark starts."""
    if not _INTERVAL.fullmatch(text):
        return None
    total = 0.0
    for sign, number, unit in _INTERVAL_TERM.findall(text):
        if "." in number and unit.lower() != "second":
            return None  # Spark: "cannot have fractional part"
        total += (-1 if sign == "-" else 1) * float(number) * _UNIT_SECONDS[unit.lower()]
    return total if total >= 0 else None


def _check_ingest_args(a: Any) -> None:
    """--trigger and --max-per-trigger, checked before Spark starts (~18 s): Spark refused them only
    once started, naming trigger='bogus' and its own option maxMessagesPerTrigger, and ignored a
    --trigger given with --available-now. Usage errors (exit 2) naming the flags."""
    trigger = a.trigger
    if a.available_now and trigger is not None:
        raise ConfigurationError(f"--trigger {trigger!r} and --available-now cannot go together: --available-now "
                                 "ingests what is there now in as many micro-batches as it takes, then stops",
                                 hint="Give one of them: --available-now to stop once done, --trigger INTERVAL to "
                                      "run until Ctrl-C")
    if not a.available_now and trigger is not None and interval_seconds(trigger) is None:
        raise ConfigurationError(f"--trigger {trigger!r} is not an interval",
                                 hint="Give an interval like '1 second', '500 milliseconds' or '1 minute 30 seconds' "
                                      "(weeks to microseconds, not months or years), or --available-now to ingest "
                                      "what is there now and stop")
    if a.max_per_trigger is not None and a.max_per_trigger < 1:
        raise ConfigurationError(f"--max-per-trigger must be 1 or more, not {a.max_per_trigger}",
                                 hint="Give the most messages a micro-batch may take, or leave it out (no limit)")


def ingest(ctx: Any) -> int:
    """Run the ingest query until Ctrl-C (or, with --available-now, until it has what is there now)."""
    from zerocomm_spark.pipelines.history import IngestBatch
    from zerocomm_spark.pipelines.history import ingest as start
    from zerocomm_spark.pipelines.history import release_checkpointed

    a = ctx.args
    _check_ingest_args(a)
    key = read_key_file(a.history_key_file) if a.history_key_file else None
    table = str(Path(a.table).expanduser().absolute()) if "://" not in a.table else a.table
    checkpoint = a.checkpoint or table.rstrip("/") + "/_checkpoints/ingest"
    total = [0]

    def on_batch(batch: IngestBatch) -> None:
        total[0] += batch.rows
        ctx.out({"batch": batch.batch_id, "committed": batch.committed, "rows": batch.rows, "version": batch.version,
                 "seconds": round(batch.seconds, 3)},
                f"batch {batch.batch_id}: {batch.rows} rows" + (f" -> version {batch.version}" if batch.committed
                                                                 else " (already in Delta, skipped)"))

    # The member's agent must run when the command starts, as for every command that talks to it (exit 3
    # and how to start it), or --spawn starts it: before Spark starts. The connector's default
    # (spawnAgent) started one without a word and left it running after the command. Once running, the
    # query still starts the agent again if it stops (spawnAgent), so a long ingest rides over a crash.
    client = ctx.client()
    # Asked here, before Spark starts (~1 min under load): the query's own check came only after that.
    names = sorted(g.get("group", "") for g in client.groups())
    missing = [g for g in a.groups if g not in names]
    if missing:
        raise GroupNotFoundError(
            f"this member is in no group named {', '.join(map(repr, missing))}: nothing to ingest from it",
            hint="Check the name; the groups it is in: " + (", ".join(map(repr, names)) or "none")
                 + " (`zerocomm group list`)")
    spark = _spark()
    with _reading(table, "ingest"):  # a table Spark or Delta refuses at start: one line, not a Py4J traceback
        query = start(spark, a.groups, table, checkpoint, agent=str(ctx.config.socket_dir),
                      starting_offsets=a.starting_offsets, max_messages_per_trigger=a.max_per_trigger,
                      trigger="available_now" if a.available_now else (a.trigger or _DEFAULT_TRIGGER), history_key=key,
                      on_batch=on_batch, delta_txn=a.delta_txn)
    with _ctrl_c_sets(stop := threading.Event()):  # not raised inside a Py4J call: ~40 lines of its errors
        while query.isActive and not stop.is_set():
            query.awaitTermination(1.0)
    if stop.is_set():
        query.stop()
    if query.exception() is not None:
        # One line (Spark's reason and its root cause), not the first 1,000 characters of a traceback
        # and the query's description; Spark logged the whole error in its log. Spark's failure: exit 1.
        full = query_failure_text(spark, query)
        log.debug("the ingest query failed: %s", full)
        _note_in_spark_log(f"the ingest query failed: {full}")
        raise ZeroCommError(f"the ingest query failed: {_query_reason(query.exception(), full)}",
                            hint=f"{_spark_log_text()} has the whole error; restarting with the same --checkpoint "
                                 "resumes where it stopped, without writing anything twice")
    try:  # the run's last batch: Spark would tell the source only when starting the next one
        release_checkpointed(spark, a.groups, checkpoint, agent=str(ctx.config.socket_dir))
    except (ZeroCommError, OSError, ValueError) as exc:  # the next run commits it: retention only waits longer
        log.warning("could not tell the agent's journal that the run's last batch is in Delta (%s); the next run "
                    "does", exc.message if isinstance(exc, ZeroCommError) else f"{type(exc).__name__}: {exc}")
    # Said every run: the group's messages are end-to-end encrypted, and the table holds them as they
    # were delivered unless a history key seals them (main.sh's summary says the same).
    sealing = "sealed with the history key" if key is not None else "in clear (--history-key-file seals them)"
    ctx.out({"table": table, "rows": total[0], "checkpoint": checkpoint,
             "payloads": "sealed" if key is not None else "clear"},
            f"ingested {total[0]} rows into {table} (checkpoint {checkpoint}; payloads {sealing})")
    return 0


def replay(ctx: Any) -> int:
    """Print the group's history in causal order (or as JSON lines with --json)."""
    from zerocomm_spark.agent.output import (emit_json, format_payload, format_time, json_headers, json_payload,
                                             render_table)
    from zerocomm_spark.pipelines.replay import Since
    from zerocomm_spark.pipelines.replay import replay as read

    a = ctx.args
    since = (Since.version(a.since_version) if a.since_version is not None
             else Since.lamport(a.since_lamport) if a.since_lamport is not None
             else _since_time(a.since_time) if a.since_time else None)
    as_of: int | str | None = None
    if a.as_of is not None:
        as_of = int(a.as_of) if a.as_of.isdigit() else a.as_of
    key = read_key_file(a.history_key_file) if a.history_key_file else None
    spark = _spark()
    with _reading(a.table, "replay"):
        df = read(spark, a.table, a.group, since=since, as_of=as_of, history_key=key, verify=a.verify)
        if a.limit and a.limit > 0:
            df = df.limit(a.limit)
        rows = _readable_rows(df.toArrow())
        held = groups_in(spark, a.table) if not rows else None
        if key is not None:
            _check_key_fits(spark, a, key, rows)
    if held == []:
        # A table with no rows yet (made by an ingest that has had no messages): nothing to replay is
        # not a failure, and no group name can be checked against it. Exit 0, saying so; with --json
        # no lines (one per message, as always), the note on stderr where it cannot break a reader.
        said = f"the history table at {a.table} holds no messages yet (of any group)"
        if ctx.json:
            sys.stderr.write(f"zerocomm: note: {said}\n")
        else:
            print(f"(no messages: {said}; `zerocomm history ingest GROUP --table PATH` adds them)", flush=True)
        return 0
    if held is not None and a.group not in held:
        # a misspelt group printed "(no messages)", exit 0, as a group that has none would
        raise GroupNotFoundError(
            f"the history table at {a.table} holds no messages of group {a.group!r}",
            hint="Check the name; the groups it holds: " + ", ".join(repr(g) for g in held)
                 + " (`zerocomm history ingest GROUP --table PATH` adds a group)")
    key_id = key.key_id if key is not None else None
    if ctx.json:
        for r in rows:
            emit_json({"group": r["group"], "message_id": r["message_id"], "publisher_did": r["publisher_did"],
                       "publisher_label": r["publisher_label"], "seq": r["seq"], "lamport_ts": r["lamport_ts"],
                       "sent_at": r["sent_at"], "received_at": r["received_at"], "headers": json_headers(r["headers"]),
                       **(json_payload(r["payload"]) if r["payload_key_id"] is None
                          else {"payload": None, "payload_base64": None}),
                       "sealed": r["payload_key_id"] is not None, "origin_ok": r.get("origin_ok"),
                       "origin": origin_label(r, key_id) or None})
        return 0
    shaped = [{"lamport": r["lamport_ts"], "time": format_time(r["sent_at"]),
               "from": r["publisher_label"] or (r["publisher_did"] or "")[-12:] or None, "seq": r["seq"],
               "origin": origin_label(r, key_id),
               "message": "(sealed)" if r["payload_key_id"] else format_payload(r["payload"], 200)} for r in rows]
    columns = [("lamport", "LAMPORT"), ("time", "SENT"), ("from", "FROM"), ("seq", "SEQ")]
    if a.verify:
        columns.append(("origin", "ORIGIN"))
    print(render_table(shaped, columns + [("message", "MESSAGE")], empty="(no messages)"), flush=True)
    return 0


def _check_key_fits(spark: Any, a: Any, key: HistoryKey, rows: list[dict[str, Any]]) -> None:
    """A --history-key-file whose key sealed none of the group's rows, while rows sealed with another
    key are being replayed, is the wrong key: said before anything is printed (every row was listed as
    "(sealed)", exit 0). A group whose key changed keeps rows of the old key: those stay sealed."""
    from pyspark.sql import functions as F

    others = sorted({r["payload_key_id"] for r in rows if r["payload_key_id"] not in (None, key.key_id)})
    if not others:
        return
    ours = (spark.read.format("delta").load(a.table)
            .where((F.col("group") == a.group) & (F.col("payload_key_id") == key.key_id)).limit(1).count())
    if ours:
        return
    sealed = sum(1 for r in rows if r["payload_key_id"] is not None)
    raise ConfigurationError(
        f"the history key in {a.history_key_file} (id {key.key_id}) sealed none of group {a.group!r}'s rows in "
        f"{a.table}; the {sealed} sealed row(s) to replay are sealed with {', '.join(others)}",
        hint="Give --history-key-file the group's history key (the one its ingest was given), or leave it out "
             "to list sealed rows as (sealed)")


def _holds_group(spark: Any, table: str, group: str) -> bool:
    """Whether the table has a row of ``group``: one partition looked at (the table is partitioned by
    group), not every file as listing the groups does - a compacted group is the nightly case."""
    from pyspark.sql import functions as F

    return bool(spark.read.format("delta").load(table).where(F.col("group") == group).limit(1).count())


def groups_in(spark: Any, table: str) -> list[str]:
    """The groups the history table's current version holds rows of (it is append-only: every group
    ever ingested)."""
    rows = spark.read.format("delta").load(table).select("group").distinct().collect()
    return sorted(str(r["group"]) for r in rows if r["group"] is not None)


def _readable_rows(table: Any) -> list[dict[str, Any]]:
    """The rows as dicts; text that is not UTF-8 (a damaged or hostile table) shown with U+FFFD in
    place of the bad bytes instead of failing the listing (with --verify such a row is FAILED)."""
    from zerocomm_spark.pipelines.origin import text_column

    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        pass
    columns = {name: text_column(table.column(name), "replace")[0] for name in table.column_names}
    return [{name: values[i] for name, values in columns.items()} for i in range(table.num_rows)]


def origin_label(row: Mapping[str, Any], key_id: str | None = None) -> str:
    """The ORIGIN column: "unsigned" for a row nobody signed (sent through the command line or an
    agent without a signer), and "sealed" for a signed row whose payload is sealed with a history key
    other than ``key_id`` (the one given, if any): neither is a signature that fails ("FAILED"). A row
    still sealed under the given key was altered or moved: FAILED."""
    if "origin_ok" not in row:
        return ""
    if row["origin_ok"]:
        return "ok"
    if row.get("origin_sig") is None:
        return "unsigned"
    sealed_with = row.get("payload_key_id")
    return "sealed" if sealed_with is not None and sealed_with != key_id else "FAILED"


def compact(ctx: Any) -> int:
    from zerocomm_spark.pipelines.history import compact as optimize

    began = time.monotonic()
    spark = _spark()
    group = ctx.args.group
    held: list[str] | None = None
    with _reading(ctx.args.table, "compact"):
        metrics = optimize(spark, ctx.args.table, group=group)
        if group is not None and not metrics.get("numFilesRemoved") and not _holds_group(spark, ctx.args.table, group):
            held = groups_in(spark, ctx.args.table)  # nothing done and none of its rows: a misspelt group
    if held and group not in held:  # "0 files into 0", exit 0, as for a group already compacted
        raise GroupNotFoundError(
            f"the history table at {ctx.args.table} holds no messages of group {group!r}; nothing was compacted",
            hint="Check the name; the groups it holds: " + ", ".join(repr(g) for g in held)
                 + " (without --group every group is compacted)")
    metrics["seconds"] = round(time.monotonic() - began, 3)
    ctx.out(metrics, f"compacted {ctx.args.table}: {metrics.get('numFilesRemoved', 0)} files into "
                     f"{metrics.get('numFilesAdded', 0)}")
    return 0


def vacuum(ctx: Any) -> int:
    from zerocomm_spark.pipelines.history import vacuum as clean

    a = ctx.args
    spark = _spark()
    with _reading(a.table, "vacuum"):
        files = clean(spark, a.table, retention_hours=a.retain_hours, dry_run=a.dry_run)
    ctx.out({"table": a.table, "files": files, "dry_run": a.dry_run},
            f"{'would delete' if a.dry_run else 'deleted'} {files} files no retained version of {a.table} needs")
    return 0
