"""The run directory's lock: one agent per run directory, and no false "already running"."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from zerocomm_spark.agent import runfiles
from zerocomm_spark.agent.runfiles import RunLock, held_by
from zerocomm_spark.errors import AgentAlreadyRunningError


def test_a_second_agent_is_refused_while_the_first_holds_the_directory(tmp_path: Path) -> None:
    first = RunLock(tmp_path).acquire()
    try:
        assert held_by(tmp_path) == os.getpid()
        with pytest.raises(AgentAlreadyRunningError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    finally:
        first.release()
    assert held_by(tmp_path) is None and not (tmp_path / "agent.pid").exists()


def test_a_probe_holding_the_lock_for_a_moment_does_not_refuse_a_start(tmp_path: Path) -> None:
    """`agent status` (held_by) takes a shared lock for a moment; a start landing then must wait it out."""
    RunLock(tmp_path).acquire().release()
    fd = os.open(tmp_path / "agent.pid", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # the probe, frozen mid-probe
    timer = threading.Timer(0.1, lambda: os.close(fd))
    timer.start()
    try:
        started = time.monotonic()
        lock = RunLock(tmp_path).acquire()
        assert 0.05 < time.monotonic() - started < 2
        lock.release()
    finally:
        timer.join()


def test_a_lock_won_on_an_unlinked_pid_file_is_dropped_and_taken_on_the_file_at_the_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopping agent unlinks agent.pid, then unlocks it: a starter that opened the old file in
    between wins a lock nobody can see (status says no agent; a third agent starts too)."""
    real_open = os.open
    opened: list[int] = []

    def open_then_lose_the_file(path, flags, mode=0o777):  # type: ignore[no-untyped-def]
        fd = real_open(path, flags, mode)
        if not opened and str(path).endswith("agent.pid"):
            os.unlink(path)  # the stopping agent, between our open and our flock
        opened.append(fd)
        return fd

    monkeypatch.setattr(runfiles.os, "open", open_then_lose_the_file)
    lock = RunLock(tmp_path).acquire()
    monkeypatch.setattr(runfiles.os, "open", real_open)
    try:
        assert len(opened) == 2  # the first file was given up, the second one is held
        assert held_by(tmp_path) == os.getpid()
        with pytest.raises(AgentAlreadyRunningError):
            RunLock(tmp_path).acquire()
    finally:
        lock.release()


def test_a_held_pid_file_that_was_removed_or_replaced_is_lost_but_an_unreadable_path_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    lock = RunLock(run).acquire()
    try:
        assert lock.held_file_present()
        real_stat = os.stat

        def denied(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(path).endswith("agent.pid"):
                raise PermissionError(errno.EACCES, "Permission denied")
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(runfiles.os, "stat", denied)
        assert lock.held_file_present()  # cannot tell: not a reason to stop the agent
        monkeypatch.undo()
        (run / "agent.pid").unlink()
        (run / "agent.pid").write_text("999999\n")  # an agent started in its place wrote its own
        assert not lock.held_file_present()
    finally:
        lock.release()
    assert (run / "agent.pid").read_text() == "999999\n"  # the other agent's file is left alone
