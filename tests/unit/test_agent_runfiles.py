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


_ADOPTER = ("import sys\nfrom pathlib import Path\nfrom zerocomm_spark.agent.runfiles import RunLock\n"
            "RunLock(Path(sys.argv[1])).adopt(int(sys.argv[2]))\nprint('adopted', flush=True)\nsys.stdin.read()\n")


def test_a_lock_handed_to_a_child_is_held_throughout_and_dies_with_the_child(tmp_path: Path) -> None:
    """A detached start locks the run directory before the agent's process exists and passes the lock
    down: held all along (clients wait for a starting agent), naming the child, and gone with the child
    however it dies (the starter keeps no copy)."""
    import signal
    import subprocess
    import sys

    (tmp_path / "agent.pid").write_text("999999\n")  # a stale file of a crashed agent: taken over
    lock = RunLock(tmp_path).acquire(name_self=False)
    assert held_by(tmp_path) == -1  # held, its pid not written yet: never the starter's pid
    assert lock.fd is not None
    child = subprocess.Popen([sys.executable, "-c", _ADOPTER, str(tmp_path), str(lock.fd)], pass_fds=(lock.fd,),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        lock.hand_over(child.pid)
        assert lock.fd is None and held_by(tmp_path) == child.pid
        assert child.stdout is not None and child.stdout.readline() == b"adopted\n"
        assert held_by(tmp_path) == child.pid
        assert (tmp_path / "agent.pid").read_text() == f"{child.pid}\n"
        with pytest.raises(AgentAlreadyRunningError, match=f"pid {child.pid}"):
            RunLock(tmp_path).acquire()
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert held_by(tmp_path) is None  # the child held the only copy
        RunLock(tmp_path).acquire().release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_adopting_a_lock_whose_pid_file_was_removed_meanwhile_is_refused(tmp_path: Path) -> None:
    """The run directory was removed between the starter's lock and the agent's adoption: the lock is on a
    file nobody finds, so the agent would be invisible to clients, `agent status` and `agent stop`."""
    from zerocomm_spark.errors import AgentStartError

    lock = RunLock(tmp_path).acquire(name_self=False)
    assert lock.fd is not None
    passed = os.dup(lock.fd)  # the child's copy: the same open file description
    lock.hand_over(12345)
    (tmp_path / "agent.pid").unlink()
    with pytest.raises(AgentStartError, match="removed or replaced"):
        RunLock(tmp_path).adopt(passed)
    with pytest.raises(OSError):
        os.fstat(passed)  # closed by the refusal: the lock went with it
    RunLock(tmp_path).acquire().release()


def test_a_lock_to_hand_down_is_never_on_a_standard_stream(tmp_path: Path) -> None:
    """`agent start --detach` with its stdin closed (`<&-`, a supervisor that closes it) opened the pid file
    as descriptor 0 and passed it down as --run-lock-fd 0: in the child, 0 became /dev/null, the starter's
    close let go of the lock, and the agent refused to start ("the pid file ... was removed or replaced")."""
    import subprocess
    import sys

    script = ("import os, sys\nos.close(0)\nfrom pathlib import Path\n"
              "from zerocomm_spark.agent.runfiles import RunLock, held_by\n"
              "lock = RunLock(Path(sys.argv[1])).acquire(name_self=False)\n"
              "print(lock.fd, held_by(Path(sys.argv[1])))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    fd, holder = done.stdout.split()
    assert int(fd) > 2 and holder == "-1"  # still the held pid file
