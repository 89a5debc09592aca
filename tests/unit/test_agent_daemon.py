"""`zerocomm agent stop` when the agent goes away on its own between the check and the signal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zerocomm_spark.agent import config as cfgmod
from zerocomm_spark.agent import daemon
from zerocomm_spark.errors import AgentNotRunningError


def test_stop_of_an_agent_that_exits_meanwhile_is_a_clear_error(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stops at once (a service manager and a person): the second one saw the pid, then the agent
    exited before its SIGTERM. That was a ProcessLookupError traceback, not a ZeroComm error."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    monkeypatch.setattr(daemon, "held_by", lambda run_dir: gone.pid)
    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    with pytest.raises(AgentNotRunningError, match="exited before"):
        daemon.stop_agent(config, timeout=2)


def _stubborn(monkeypatch: pytest.MonkeyPatch) -> subprocess.Popen:
    """A process that ignores SIGTERM, standing in for a hung agent (reaped as soon as it dies)."""
    import threading

    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                             " print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    threading.Thread(target=proc.wait, daemon=True).start()
    monkeypatch.setattr(daemon, "held_by", lambda run_dir: proc.pid if proc.poll() is None else None)
    return proc


def test_a_forced_stop_reports_stopped_only_once_the_agent_is_gone(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _stubborn(monkeypatch)
    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    stopped = daemon.stop_agent(config, timeout=0.3, force=True)
    assert stopped["forced"] is True and stopped["pid"] == proc.pid
    assert proc.wait(5) == -9


def test_a_forced_stop_of_a_process_that_does_not_die_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL waits for a process stuck in the kernel; "stopped" then would be a lie."""
    from zerocomm_spark.errors import ApiTimeoutError

    proc = _stubborn(monkeypatch)
    monkeypatch.setattr(daemon, "held_by", lambda run_dir: proc.pid)  # as if it never let go
    monkeypatch.setattr(daemon, "_KILL_WAIT_S", 0.3)
    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    with pytest.raises(ApiTimeoutError, match="killed but had not exited"):
        daemon.stop_agent(config, timeout=0.3, force=True)
