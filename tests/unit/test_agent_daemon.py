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
