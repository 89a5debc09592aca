"""The agent's run directory: pid file (held locked while the agent lives) and health file.

Why a lock and not just a pid: a pid outlives its process (kill -9 leaves the file, and the number
is reused), but an ``flock`` dies with its holder. So "is an agent running here?" is answered by
trying the lock, and the pid is only trusted while someone holds it. The health file is rewritten
atomically on every heartbeat so readers never see half of it; its ``heartbeat_at`` tells a hung
agent from a live one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

from zerocomm_spark.client import HEALTH_FILE, PID_FILE, SOCKET_NAME
from zerocomm_spark.errors import (
    AgentAlreadyRunningError,
    AgentStartError,
    ConfigurationError,
    InsecurePermissionsError,
)

__all__ = ["RunLock", "clear_left_by", "identity_in_use", "read_health", "read_pid", "held_by", "pid_alive",
           "serving_pid", "still_at", "write_json_atomic"]


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_health(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / HEALTH_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_pid(run_dir: Path) -> int | None:
    try:
        text = (run_dir / PID_FILE).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
        return stat_line.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def held_by(run_dir: Path) -> int | None:
    """The pid of the agent holding this run directory's lock, or None if no agent holds it.

    The pid is what ``agent stop`` signals, so it is taken only from a pid file that the agent's user
    alone could have written (see :func:`_check_holder`), read through the descriptor that was locked.
    """
    path = run_dir / PID_FILE
    try:  # O_NONBLOCK: a FIFO planted in place of the file must not hang the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                pid_file = os.fstat(fd)
                text = ""
                if stat.S_ISREG(pid_file.st_mode):
                    try:
                        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                    except OSError:
                        pass
                pid = int(text) if text.isdigit() else -1
                _check_holder(run_dir, pid_file, pid)
                return pid
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def serving_pid(run_dir: Path, timeout: float = 2.0) -> int | None:
    """The pid of the process listening on the run directory's API socket, as the kernel says it
    (SO_PEERCRED: the process that listened), or None when nothing listens there or it cannot be told.

    A second opinion on the pid file, whose text anyone with write access to it could have changed in
    place (the lock stays held, so held_by still trusts it): ``agent stop`` signals the agent that
    serves, not whatever pid the text names. The connect is closed at once; nothing is sent.
    """
    if not hasattr(socket, "SO_PEERCRED"):  # pragma: no cover - not Linux
        return None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(str(run_dir / SOCKET_NAME))
        pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    finally:
        probe.close()
    return pid if pid > 0 else None


def _process_uid(pid: int) -> int | None:
    """The real uid of process ``pid`` (the first field of the Uid: line in /proc), None if unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("Uid:"):
                fields = line.split()
                return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    except OSError:
        return None
    return None


def _check_holder(run_dir: Path, pid_file: os.stat_result, pid: int) -> None:
    """Refuse a held pid file that another user could have written (InsecurePermissionsError).

    Another user who can write the run directory (one made in a shared place before this user made
    it, or left group-writable) could plant a locked agent.pid naming any process of ours, which
    ``agent stop`` would then signal. An agent serves only from a plain directory of its user, mode
    700 (prepare_socket_dir), with a pid file of its own: anything else was not made by our agent.

    Root may act on another user's agent (stop or status it): it trusts a run directory of user U
    that others cannot write, with a pid file of U, naming a process that runs as U - so it never
    signals a process of another user (root's own included) because of a file U could have written.
    """
    uid = os.getuid()
    try:
        st = os.lstat(run_dir)
    except OSError as exc:
        raise InsecurePermissionsError(f"cannot check the run directory {run_dir}: {exc.strerror}") from None
    owner = st.st_uid
    if not stat.S_ISDIR(st.st_mode):
        problem = f"the run directory {run_dir} is not a plain directory"
    elif owner != uid and uid != 0:
        problem = f"the run directory {run_dir} belongs to uid {owner}, not to this user (uid {uid})"
    elif stat.S_IMODE(st.st_mode) & 0o022:
        problem = (f"the run directory {run_dir} has mode {stat.S_IMODE(st.st_mode):o}: users other than "
                   f"its owner may write it")
    elif not stat.S_ISREG(pid_file.st_mode):
        problem = f"the pid file {run_dir / PID_FILE} is not a regular file"
    elif pid_file.st_uid != owner:
        problem = (f"the pid file {run_dir / PID_FILE} belongs to uid {pid_file.st_uid}, not to the owner of "
                   f"its run directory (uid {owner})")
    elif owner != uid and pid > 0 and (running := _process_uid(pid)) != owner:
        problem = (f"the pid file {run_dir / PID_FILE} of uid {owner} names pid {pid}, "
                   + ("which is not running" if running is None else f"a process of uid {running}, not of uid {owner}"))
    else:
        return
    raise InsecurePermissionsError(
        f"{problem}, so the pid file is not trusted (the pid it names is never signalled)",
        hint="An agent keeps its run directory mode 700 and its pid file owned by its own user: run zerocomm as "
             "that user (or as root), and if the directory's mode or owners were changed, stop the agent as its "
             "user and make the directory private again (chmod 700)")


def identity_in_use(identity_dir: Path) -> bool:
    """Whether the process last named in the identity's keystore lock file still runs: an agent
    opening its member, or serving it from another run directory (one that took the identity before
    its run directory, as agents did before they took the run lock first).

    Read, never probed: a probe holding that lock for a moment would make the agent's own
    non-blocking lock fail as "already running". A dead holder's pid stays in the file; a reused
    pid only makes a waiter wait until its deadline.
    """
    try:
        text = (identity_dir / "keystore.lock").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return text.isdigit() and int(text) != os.getpid() and pid_alive(int(text))


def clear_left_by(run_dir: Path, pid: int) -> None:
    """Remove the pid file the agent ``pid`` left when it died at start-up (its starter saw it exit), as
    the agent would have on a clean exit: only if nobody holds it and it still names ``pid``, unlinked
    while held, as :meth:`RunLock.release` does, so that no start racing this one holds a lost file."""
    path = run_dir / PID_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.pread(fd, 32, 0).decode("ascii", "replace").strip() == str(pid) and _same_file(fd, path):
            path.unlink()
    except OSError:  # held (an agent started since), or unreadable: not ours to remove
        pass
    finally:
        os.close(fd)


_BUSY_RETRY_S = 0.5  # how long a start retries a held lock (a probe holds it for microseconds)


def still_at(path: Path, ident: tuple[int, int]) -> bool:
    """Whether the file ``ident`` (device, inode) is still the one at ``path``: False once it was
    removed or replaced; True when the path cannot be looked at now (a permission, an NFS hiccup),
    which is not taken for a lost file."""
    try:
        there = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        return exc.errno not in (errno.ENOENT, errno.ENOTDIR)
    return (there.st_dev, there.st_ino) == ident


def _name_pid(fd: int, pid: int) -> None:
    """Write ``pid`` to the pid file held through ``fd``, which is empty or names ``pid`` already (a
    starter and the agent it handed the lock to both write it): written, then cut to its length, so a
    reader sees the pid or nothing, never a mix."""
    data = f"{pid}\n".encode("ascii")
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


def _above_std_streams(fd: int) -> int:
    """``fd``, moved above 0-2 if it is one of them (its starter ran with stdin, stdout or stderr closed):
    a lock handed down to the agent (``--run-lock-fd``) keeps its number in the child, where 0-2 are
    replaced by /dev/null and the log file, which would close the child's copy of the lock."""
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _same_file(fd: int, path: Path) -> bool:
    """Is ``fd`` still the file at ``path`` (not unlinked or replaced since it was opened)?"""
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class RunLock:
    """The exclusive hold of a run directory by one agent process, for its whole life."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._fd: int | None = None

    def acquire(self, *, name_self: bool = True) -> "RunLock":
        """Hold the run directory, or raise AgentAlreadyRunningError.

        ``name_self=False`` is for a starter that hands the lock to the agent it launches
        (:meth:`hand_over`): the pid file is left empty until it names that agent, never the starter,
        which `agent stop` would otherwise signal.

        Two races are closed here. A probe (``held_by``: ``agent status``, a client deciding whether
        to spawn) holds a shared lock for a moment, so a refusal is only final after ~0.5 s of
        retries. And a stopping agent unlinks the pid file before unlocking it, so a lock won on
        a file that is no longer the one at the path is worthless: it is dropped and tried again on
        the new file (otherwise two agents could each hold "the" lock, one of them invisible).
        """
        path = self.run_dir / PID_FILE
        deadline = time.monotonic() + _BUSY_RETRY_S
        while True:
            try:
                fd = _above_std_streams(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
            except OSError as exc:
                raise ConfigurationError(f"cannot open the pid file {path}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                pid = read_pid(self.run_dir)
                raise AgentAlreadyRunningError(
                    f"another agent (pid {pid if pid is not None else 'unknown'}) already serves the API socket "
                    f"directory {self.run_dir}",
                    hint="Stop it with `zerocomm agent stop`, or give this agent its own api.socket_dir") from None
            if _same_file(fd, path):
                break
            os.close(fd)  # won the lock of an unlinked pid file: try the one at the path now
        os.ftruncate(fd, 0)
        if name_self:
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    @property
    def fd(self) -> int | None:
        """The locked descriptor of the pid file (None once released or handed over)."""
        return self._fd

    def hand_over(self, pid: int) -> None:
        """Name ``pid`` in the pid file and close this process's copy of the lock without unlocking it.

        For a starter that launched the agent ``pid`` with this descriptor (which adopts it, see
        :meth:`adopt`): an flock belongs to the open file description, which parent and child share,
        so the lock stays held by the child alone and goes when the child exits, however it exits.
        An unlock here (or :meth:`release`) would drop the child's lock too.
        """
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            _name_pid(fd, pid)
        except OSError:  # the child names itself too (adopt): this write only makes it known sooner
            pass
        finally:
            os.close(fd)

    def adopt(self, fd: int) -> "RunLock":
        """Hold the run directory through ``fd``, the pid file its starter locked and passed down
        (``agent start --detach``), so that it was held from before this process existed: a client
        coming meanwhile waited for a starting agent instead of being told that none runs.

        Raises AgentAlreadyRunningError if another process holds that file's lock, AgentStartError if
        the pid file was removed or replaced since the starter locked it, ConfigurationError if ``fd``
        is no open file. ``fd`` is closed on failure.
        """
        path = self.run_dir / PID_FILE
        try:
            os.set_inheritable(fd, False)  # nothing this process starts gets the lock
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # already ours (inherited): a no-op
        except OSError as exc:
            _close_quietly(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                pid = read_pid(self.run_dir)
                raise AgentAlreadyRunningError(
                    f"another agent (pid {pid if pid is not None else 'unknown'}) already serves the API socket "
                    f"directory {self.run_dir}",
                    hint="Stop it with `zerocomm agent stop`, or give this agent its own api.socket_dir") from None
            raise ConfigurationError(f"cannot take over the run lock passed as descriptor {fd}: {exc.strerror}",
                                     hint="--run-lock-fd is for `zerocomm agent start --detach` only; start the "
                                          "agent without it") from None
        if not _same_file(fd, path):
            _close_quietly(fd)
            raise AgentStartError(f"the pid file {path} was removed or replaced while the agent started",
                                  hint="Start the agent again; if this repeats, something removes its run directory")
        _name_pid(fd, os.getpid())
        self._fd = fd
        return self

    def held_file_present(self) -> bool:
        """Whether the pid file this lock holds is still the one at its path (not removed with the
        run directory, nor replaced): otherwise `agent status`/`stop` and clients cannot find this agent.
        A path that cannot be looked at now (a permission, an NFS hiccup) is not taken for a lost one."""
        if self._fd is None:
            return True
        here = os.fstat(self._fd)
        return still_at(self.run_dir / PID_FILE, (here.st_dev, here.st_ino))

    def keep_named(self) -> bool:
        """Name this process in the pid file again if its text was changed in place (the file and the
        lock are still ours, so nothing else repairs it, and `agent stop` and clients read that text).
        Returns whether it had to. An agent handed its lock names itself on adopt, so its text is ours."""
        if self._fd is None:
            return False
        mine = f"{os.getpid()}\n".encode("ascii")
        if os.pread(self._fd, 64, 0) == mine:
            return False
        _name_pid(self._fd, os.getpid())
        return True

    def write_health(self, health: dict[str, Any]) -> None:
        health = dict(health, heartbeat_at=time.time())
        write_json_atomic(self.run_dir / HEALTH_FILE, health)

    def release(self) -> None:
        """Remove the health and pid files and drop the lock (the pid file goes first, while still held)."""
        if self._fd is None:
            return
        # Only while the pid file there is still ours: an agent that stopped because its run directory
        # was removed must not delete the files of the agent started in its place meanwhile.
        if _same_file(self._fd, self.run_dir / PID_FILE):
            for name in (HEALTH_FILE, PID_FILE):
                try:
                    (self.run_dir / name).unlink()
                except OSError:
                    pass
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
