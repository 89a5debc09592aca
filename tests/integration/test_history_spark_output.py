"""`zerocomm history ingest|replay|compact|vacuum` start Spark: its JVM's own output goes to a log file.

Before, five lines of Spark's start-up notes ("Using incubator modules", the native-hadoop warning,
the log4j profile...) came before every such command's own output on the terminal.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from test_cli_support import ZEROCOMM

ROOT = Path(__file__).resolve().parents[2]


def _history(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    logs = tmp_path / "tmp"
    logs.mkdir(exist_ok=True)
    return subprocess.run([*ZEROCOMM, "history", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(logs), **(env or {})})


def test_spark_says_nothing_on_the_terminal_and_its_log_is_removed_when_it_has_nothing_to_tell(tmp_path):
    done = _history(tmp_path, "vacuum", "--table", str(tmp_path / "none"))
    assert done.returncode == 2, done.stderr
    # exactly the command's error and what to do: Spark ran (it is what found no table) but said nothing here
    assert done.stderr.splitlines() == [f"zerocomm: error: there is no Delta table at {tmp_path / 'none'}",
                                        "  what to do: Give the path of a history table (`zerocomm history ingest` "
                                        "makes one)"], done.stderr
    assert done.stdout == ""
    assert list((tmp_path / "tmp").glob("zerocomm-history-spark-*")) == []  # the error did not need it: removed


def test_a_jvm_that_cannot_start_is_one_error_naming_why_and_its_log(tmp_path):
    done = _history(tmp_path, "vacuum", "--table", str(tmp_path / "none"), env={"JAVA_HOME": str(tmp_path / "nojava")})
    assert done.returncode == 1, done.stderr
    logs = list((tmp_path / "tmp").glob("zerocomm-history-spark-*.log"))
    assert len(logs) == 1, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == f"zerocomm: error: Spark did not start: {tmp_path / 'nojava'}/bin/java: No such file or directory"
    assert len(lines) == 2 and str(logs[0]) in lines[1] and "Java 17" in lines[1], done.stderr
    assert "nojava/bin/java" in logs[0].read_text()  # the launcher's own words are kept there


def _processes_with(text: str, command: bytes = b"") -> list[int]:
    """Live processes whose environment holds ``text`` (the JVM's names its connection file under TMPDIR)
    and whose command line holds ``command``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if text.encode() not in f.read():
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            if command in line and b"launcher.Main" not in line:  # not spark-class's short-lived launcher
                found.append(int(entry))
    return found


def test_ctrl_c_while_spark_starts_leaves_no_jvm_and_no_log(tmp_path):
    """Ctrl-C in the first seconds of a history command left Spark's JVM running, orphaned (it ignores
    SIGINT), and the log file behind (user review)."""
    import signal
    import sys
    import time

    logs = tmp_path / "tmp"
    logs.mkdir()
    marker = str(logs)
    proc = subprocess.Popen([*ZEROCOMM, "history", "vacuum", "--table", str(tmp_path / "none")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": marker},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        jvm = b"org.apache.spark.deploy.SparkSubmit"  # the JVM itself, starting (before it watches its stdin)
        while not _processes_with(marker, jvm) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert _processes_with(marker, jvm), "Spark's JVM never started"
        time.sleep(1.0)  # into its start, where the review saw it left behind
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (out, err)
    assert err.splitlines()[-1:] == ["zerocomm: interrupted (Ctrl-C)"], err
    deadline = time.monotonic() + 15
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left running: {left}"
    assert list(logs.glob("zerocomm-history-spark-*")) == []
    assert sys.platform.startswith("linux")
