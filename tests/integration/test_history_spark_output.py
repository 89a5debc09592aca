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
