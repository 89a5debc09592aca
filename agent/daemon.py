"""Starting, stopping and inspecting agent processes: `zerocomm agent start|stop|status`.

Why a fresh interpreter for --detach (not fork): the caller may be a Spark task or a notebook with
threads and ZeroMQ contexts, which do not survive a fork. The child is started in its own session
(so a terminal's Ctrl-C or a closed notebook does not kill it), with its output in the agent's log
file, and reports through an inherited pipe: one JSON line, ready or the error it failed with. The
parent waits for that line with a deadline, so failures (a second agent on the same identity, a
port in use) surface in the command that started it, not only in a log.

The parent takes the run directory's lock before it starts the child, and passes it down (the
locked descriptor, which the child adopts: ``--run-lock-fd``): the agent's interpreter takes a second
to start, and a client coming meanwhile must find an agent starting (and wait for it), not none.

The agent outlives whoever started it (a Spark executor's Python worker, a notebook), so it takes
neither its starter's working directory (a Spark application's directory, deleted with the
application on YARN) nor the secrets in its starter's environment: it starts in ``/`` with every
path setting made absolute first, and with the environment of :func:`agent_environment`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import resource
import select
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerocomm_spark.agent.config import _NOT_SETTINGS, _PATH_SETTINGS, DEFAULTS, ENV_PREFIX, Config
from zerocomm_spark.agent.logging import open_log_file
from zerocomm_spark.agent.ingest import EXIT_JOURNAL_FAILED
from zerocomm_spark.agent.runfiles import RunLock, clear_left_by, held_by, pid_alive, read_health, serving_pid
from zerocomm_spark.client import Client, error_header, raise_for_error
from zerocomm_spark.errors import (
    AgentAlreadyRunningError,
    AgentNotRunningError,
    AgentStartError,
    ApiTimeoutError,
    ZeroCommError,
)

__all__ = ["agent_environment", "log_file_of", "require_identity", "run_foreground", "start_detached", "stop_agent",
           "agent_status"]
_KILL_WAIT_S = 5.0  # after `stop --force` sent SIGKILL: how long the process gets to be gone
_NAMING_WAIT_S = 5.0  # `stop` of a directory held by a starting agent whose pid is not written yet

#: The directory a detached agent runs in: one that always exists and that nobody removes.
AGENT_CWD = "/"
#: Secrets Spark (4.2) hands its processes in the environment, which a Python worker, and so an agent it
#: starts, inherits: the Python worker factory's and the py4j gateway's secrets, spark.authenticate's
#: secret, the launcher's, the RPC TLS passwords, Spark Connect's token and SparkR's worker secrets.
SPAWNER_SECRETS = frozenset({
    "PYTHON_WORKER_FACTORY_SECRET", "PYSPARK_GATEWAY_SECRET", "_SPARK_AUTH_SECRET", "_SPARK_LAUNCHER_SECRET",
    "_SPARK_SSL_RPC_KEY_PASSWORD", "_SPARK_SSL_RPC_KEY_STORE_PASSWORD", "_SPARK_SSL_RPC_PRIVATE_KEY_PASSWORD",
    "_SPARK_SSL_RPC_TRUST_STORE_PASSWORD", "SPARK_CONNECT_AUTHENTICATE_TOKEN", "SPARKR_WORKER_SECRET",
    "SPARKR_BACKEND_AUTH_SECRET",
})
#: And any other variable of Spark's namespaces that names a secret, token or password: the names
#: change between Spark versions (Spark Connect's token came with 4.0), and the agent reads none of them.
_SPAWNER_SECRET_NAME = re.compile(r"^(?:_?SPARK|PYSPARK|PYTHON_WORKER_).*(?:SECRET|TOKEN|PASSWORD)")
#: Credentials of whatever started it (an executor's cloud keys, Hadoop delegation tokens, a CI job's
#: tokens): the agent reads none of them (its settings are ZEROCOMM_* and its passphrase variable),
#: and a process that lives for days should not hold what its starter was given for an hour.
#: Passphrases (another member's keystore passphrase on a host that runs several, a GPG or SSH key's),
#: DB_PASS-style passwords and API or storage keys (OPENAI_API_KEY, AZURE_STORAGE_KEY) are credentials too.
_CREDENTIAL_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|PRIVATE_KEY|(?:^|_)PASS(?:$|_)"
                              r"|(?:^|_)(?:API_?|ACCESS_?|ACCOUNT_?)?KEY(?:$|_)|^KRB5CCNAME$", re.IGNORECASE)

#: The ZEROCOMM_* names of settings (ZEROCOMM_IDENTITY_PASSPHRASE_ENV holds a variable's name, not a
#: secret) and the package's other variables: kept whatever they look like.
_SETTING_VARIABLES = frozenset({f"{ENV_PREFIX}{section}_{key}".upper() for section, keys in DEFAULTS.items()
                                for key in keys} | _NOT_SETTINGS)


def _is_setting_variable(name: str) -> bool:
    return name.startswith(ENV_PREFIX) and name.upper() in _SETTING_VARIABLES


def log_file_of(config: Config) -> Path:
    return config.log_file or config.socket_dir / "agent.log"


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _absolute(path: str) -> str:
    """A path setting's value as a path that does not depend on the current directory, naming what it
    names now, so that it still does once the directory it was given in is gone: a relative one is
    joined to the current directory (as :meth:`Path.absolute` does; ``os.getcwd()`` has no links), and
    one through ``..`` (``--identity-dir ../x``) is resolved as the kernel would resolve it now up to
    its last ``..``. Nothing more is resolved: the last component is the one the checks look at (a
    socket directory or a log file that is a symbolic link, in a directory others may write, is
    refused, not followed), a --config file that is a link keeps naming the directory its relative
    settings are read against, as its starter read them, and a link that shortens the socket's path
    (a Unix socket's is at most 103 bytes) keeps shortening it. Absolute paths without ``..`` are left
    as they are; "" (the default) stays ""."""
    if not path:
        return path
    path = os.path.expanduser(path)
    parts = Path(path).parts
    if ".." not in parts:
        return path if os.path.isabs(path) else str(Path(path).absolute())
    last = len(parts) - 1 - parts[::-1].index("..")
    return os.path.join(os.path.realpath(os.path.join(*parts[:last + 1])), *parts[last + 1:])


def _settled(config: Config) -> Config:
    """``config`` with its file and every path setting made absolute by :func:`_absolute`."""
    values = {section: dict(keys) for section, keys in config.values.items()}
    for section, key in _PATH_SETTINGS:
        values[section][key] = _absolute(values[section][key])
    file = None if config.file is None else Path(_absolute(str(config.file)))
    return dataclasses.replace(config, values=values, file=file)


def _agent_pythonpath(value: str | None) -> str | None:
    """PYTHONPATH for the agent: none, unless zerocomm_spark itself is imported from one of its entries.

    An agent installed in the interpreter's environment (a venv, site-packages) needs none, and a
    Spark worker's entries (pyspark's archives, the application's files) are no business of a process
    that outlives the application. When the package does come from PYTHONPATH the agent cannot start
    without it: it is kept, every entry made absolute (the agent runs in /), as its dependencies may
    sit beside it.
    """
    if not value:
        return None
    import zerocomm_spark

    home = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(zerocomm_spark.__file__))))
    entries = [os.path.abspath(entry) for entry in value.split(os.pathsep)]  # "" is the current directory
    if not any(os.path.realpath(entry) == home for entry in entries):
        return None
    return os.pathsep.join(entries)


def agent_environment(config: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a detached agent starts with: its starter's ``environ``, without Spark's secrets
    (:data:`SPAWNER_SECRETS` and names like them), other credentials (names with SECRET, TOKEN,
    PASSWORD, CREDENTIAL, ...: cloud keys, Hadoop delegation tokens) and PYTHONPATH (unless the package comes from it:
    :func:`_agent_pythonpath`), with the relative paths in ZEROCOMM_* settings made absolute. The
    variable identity.passphrase_env names (the keystore's passphrase) is always kept; so are PATH,
    HOME, the locale, TMPDIR and the ZEROCOMM_* variables, but for a credential-like one that names no
    setting (ZEROCOMM_BOB_PASSPHRASE: another member's passphrase, not this agent's)."""
    passphrase = config.get("identity", "passphrase_env")
    env = {name: value for name, value in environ.items()
           if name == passphrase or not (name in SPAWNER_SECRETS or _SPAWNER_SECRET_NAME.match(name)
                                         or (_CREDENTIAL_NAME.search(name) and not _is_setting_variable(name)))}
    for section, key in _PATH_SETTINGS:
        origin = config.source.get(f"{section}.{key}", "")
        if origin.startswith("env ") and origin[4:] in env:
            env[origin[4:]] = _absolute(config.get(section, key))
    if env.get("ZEROCOMM_CONFIG"):
        env["ZEROCOMM_CONFIG"] = _absolute(env["ZEROCOMM_CONFIG"])
    pythonpath = _agent_pythonpath(environ.get("PYTHONPATH"))
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    if "PWD" in env:  # a shell's idea of the current directory: the agent's is AGENT_CWD
        env["PWD"] = AGENT_CWD
    return env


def _agent_settings(config: Config) -> list[str]:
    """``--config`` and ``--set`` arguments for the agent's own process: the file and flags in force,
    their paths absolute (a relative one means the starter's current directory, not the agent's)."""
    config = _settled(config)
    argv = [] if config.file is None else ["--config", str(config.file)]
    for override in config.overrides():
        argv += ["--set", override]
    return argv


def has_identity(directory: Path) -> bool:
    """Whether ``directory`` holds a member's identity (an agent opening it serves that member; one
    opening a directory without creates a new member there)."""
    from zerocomm_spark.keys.keystore import SEALED_FILE

    return (directory / SEALED_FILE).is_file()


def require_identity(config: Config) -> None:
    """Refuse to start an agent on demand for an identity directory that holds no identity.

    An agent that opens an empty directory creates a new member there: right for `zerocomm init`, wrong
    for --spawn, spawn=True or the connector's spawnAgent, where it came from a typo or a host never set
    up and went unnoticed (a new member in no group, its agent left running)."""
    from zerocomm_spark.errors import IdentityNotFoundError
    from zerocomm_spark.keys.keystore import SEALED_FILE

    directory = config.identity_dir
    if has_identity(directory):
        return
    origin = config.source.get("identity.dir", "default")
    where = {"default": "the default identity directory", "flag": "the identity directory given"}.get(
        origin, f"the identity directory ({origin.replace('env ', 'from ')})" if origin.startswith("env ")
        else f"the identity directory of {origin}")
    raise IdentityNotFoundError(
        f"{where}, {directory}, holds no identity (no {SEALED_FILE}); an agent started on demand serves an "
        "existing member and never creates one",
        hint=f"Create it with `zerocomm init --identity-dir {shlex.quote(str(directory))} --label NAME`, or "
             "point at an existing identity: --config or --identity-dir for the command, Client.connect(config=...)"
             ", or the connector's `agent` option (its zerocomm.toml or socket directory) or ZEROCOMM_CONFIG on "
             "each host")


def start_detached(config: Config, timeout: float | None = None, *, existing_identity: bool = False) -> dict[str, Any]:
    """Start an agent in the background and return its health once it serves; raise what stopped it.

    ``existing_identity``: a start on demand, which refuses to create the identity (:func:`require_identity`)."""
    from zerocomm_spark.agent.server import prepare_socket_dir

    config = _settled(config)  # the agent runs in AGENT_CWD: relative paths mean the starter's directory
    if existing_identity:
        require_identity(config)
    wait = timeout if timeout is not None else config.get("agent", "start_timeout")
    holder = held_by(config.socket_dir)
    if holder is not None:
        raise _already_running(config, holder)
    prepare_socket_dir(config.socket_dir)
    try:  # held from now on, by us and then by the child: see the module's docstring
        lock = RunLock(config.socket_dir).acquire(name_self=False)
    except AgentAlreadyRunningError:  # another start won the race since the check above
        raise _already_running(config, held_by(config.socket_dir)) from None
    child: subprocess.Popen[bytes] | None = None
    try:
        log_path = log_file_of(config)
        argv = [sys.executable, "-m", "zerocomm_spark.agent", *_agent_settings(config)]
        env = agent_environment(config, os.environ)
        log_fd = open_log_file(log_path)
        read_fd, write_fd = os.pipe()
        assert lock.fd is not None
        argv += ["agent", "start", "--ready-fd", str(write_fd), "--run-lock-fd", str(lock.fd)]
        try:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                     pass_fds=(write_fd, lock.fd), start_new_session=True, close_fds=True,
                                     cwd=AGENT_CWD, env=env)
        finally:
            os.close(write_fd)
            os.close(log_fd)
            if child is None:
                os.close(read_fd)
    finally:
        if child is None:  # nothing started: let go of the directory
            lock.release()
        else:  # the child's copy alone holds it now: gone when the child exits, at start-up or later
            lock.hand_over(child.pid)
    deadline = time.monotonic() + wait
    buffer = b""
    try:
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                _abandon(child, config.socket_dir)
                raise AgentStartError(f"the agent (pid {child.pid}) did not report ready within {wait:g}s and was "
                                      f"stopped; see {log_path}")
            ready, _, _ = select.select([read_fd], [], [], min(left, 0.5))
            if not ready:
                continue
            chunk = os.read(read_fd, 65536)
            if not chunk:
                code = child.wait(timeout=5.0)
                clear_left_by(config.socket_dir, child.pid)  # killed or crashed before it could
                raise AgentStartError(f"the agent exited (code {code}) before it was ready; the end of {log_path}:\n"
                                      f"{_tail(log_path)}")
            buffer += chunk
    except KeyboardInterrupt:  # Ctrl-C: whoever asked for this start gave up on it; it must not come up later
        _abandon(child, config.socket_dir)
        raise
    finally:
        os.close(read_fd)
    try:
        answer = json.loads(buffer.split(b"\n", 1)[0])
    except ValueError:
        raise AgentStartError(f"the agent reported something unreadable at start; see {log_path}") from None
    if not answer.get("ok"):
        try:
            child.wait(timeout=10.0)
        except subprocess.TimeoutExpired:  # still closing what it opened: its error is what matters
            pass
        raise_for_error(answer.get("error"))
    health: dict[str, Any] = answer.get("health") or {}
    health["log_file"] = str(log_path)
    return health


def _already_running(config: Config, pid: int | None) -> AgentAlreadyRunningError:
    who = f"pid {pid}" if pid is not None and pid > 0 else "its pid not written yet: starting"
    return AgentAlreadyRunningError(f"an agent is already running for {config.identity_dir} ({who})",
                                    hint="Use it, or stop it first with `zerocomm agent stop`")


def _abandon(child: subprocess.Popen[bytes], run_dir: Path) -> None:
    """Stop a child that missed its start deadline: reported as failed, it must not come up later
    and hold the identity (the next start would be refused as "already running"). Stopped before its
    interpreter started, it leaves the pid file its starter wrote for it: removed here."""
    child.terminate()  # graceful: it stops right after its start completes
    try:
        child.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        child.kill()  # a kill -9 loses nothing acknowledged
        try:
            child.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return
    clear_left_by(run_dir, child.pid)


def _report(fd: int | None, answer: dict[str, Any]) -> None:
    if fd is None:
        return
    try:
        os.write(fd, (json.dumps(answer, default=str) + "\n").encode("utf-8"))
    except OSError:
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


_PR_SET_DUMPABLE = 4  # linux/prctl.h


def _no_core_dumps() -> None:
    """The agent holds the member's keys in memory: a crash must not write them to a core file (which
    lands wherever the system's core pattern says, often outside the identity directory), and other
    processes of the user must not read its memory. The core limit covers a core_pattern file; a
    core_pattern pipe (systemd-coredump, apport) ignores it, so the process is also made
    non-dumpable (as ssh-agent does), which also refuses ptrace and /proc/<pid>/mem to other processes."""
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (OSError, ValueError):  # pragma: no cover - a platform without the limit: nothing to lower
        pass
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the core limit is what there is
            pass


def run_foreground(config: Config, *, ready_fd: int | None = None, run_lock_fd: int | None = None,
                   on_ready: Any = None) -> int:
    """Run the agent in this process until SIGTERM or SIGINT; returns the exit code, raises if it cannot start.

    ``run_lock_fd``: the run directory's lock, taken by :func:`start_detached` and passed down."""
    from zerocomm_spark.agent import logging as agent_logging
    from zerocomm_spark.agent.process import AgentProcess

    if run_lock_fd is None:  # started by hand over a running agent: the refusal alone, before any log line
        holder = held_by(config.socket_dir)
        if holder is not None:
            raise _already_running(config, holder)
    agent_logging.configure(config.get("log", "level"), config.get("log", "format"), config.log_file)
    _no_core_dumps()
    from zerocomm_spark.agent.fdlimit import raise_fd_limit

    raise_fd_limit()  # before any socket: connections from the network must not exhaust 1024 descriptors
    import logging

    log = logging.getLogger("zerocomm_spark.agent")
    for warning in config.warnings:
        log.warning(warning)
    process = AgentProcess(config, run_lock_fd=run_lock_fd)
    signals = {"count": 0}

    def on_signal(signum: int, frame: Any) -> None:
        signals["count"] += 1
        if signals["count"] > 1:  # a second Ctrl-C: the user does not want to wait
            os._exit(130)
        process.stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            process.start()
        except Exception as exc:
            if isinstance(exc, ZeroCommError):
                log.error("the agent did not start: %s", exc)
            else:
                log.critical("the agent did not start", exc_info=exc)
            _report(ready_fd, {"ok": False, "error": error_header(None, exc)["error"]})
            raise
        health = process.health()
        _report(ready_fd, {"ok": True, "health": health})
        if on_ready is not None:
            on_ready(health)
        try:
            process.run()
        finally:
            process.close()
        # Stopped because its run directory was removed: not a requested stop, so a service manager
        # (Restart=on-failure) starts it again, as after a journal failure.
        return EXIT_JOURNAL_FAILED if process.run_files_lost or process.journal_lost else 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_agent(config: Config, timeout: float | None = None, *, force: bool = False) -> dict[str, Any]:
    """SIGTERM the agent holding this configuration's run directory and wait until it let go."""
    wait = timeout if timeout is not None else config.get("agent", "stop_timeout")
    pid = held_by(config.socket_dir)
    # A detached start holds the directory a moment before the pid file names the agent it launches (the
    # launch; until the agent names itself, if its starter died in between): wait for the name.
    named_by = time.monotonic() + min(wait, _NAMING_WAIT_S)
    while pid is not None and pid <= 0 and time.monotonic() < named_by:
        time.sleep(0.05)
        pid = held_by(config.socket_dir)
    if pid is None:
        raise AgentNotRunningError(f"no agent is running for {config.identity_dir} (nothing holds {config.socket_dir})",
                                   hint="Nothing to stop; `zerocomm agent status` shows the same")
    if pid <= 0:
        raise AgentNotRunningError(f"an agent holds {config.socket_dir} but its pid file is unreadable",
                                   hint="Find it with `fuser` on the pid file and stop it by hand")
    serving = serving_pid(config.socket_dir)
    if serving is not None and serving != pid and held_by(config.socket_dir) is not None:
        # The pid file's text was changed in place (the lock, and so held_by, still trusts it): the
        # kernel's word on who serves the agent's socket decides, so no stranger is signalled.
        pid = serving
    started = time.monotonic()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:  # it exited since we looked (another stop, a crash): nothing left to stop
        raise AgentNotRunningError(f"the agent for {config.identity_dir} (pid {pid}) exited before it was signalled",
                                   hint="Nothing to stop; `zerocomm agent status` shows the same") from None
    deadline = started + wait
    while time.monotonic() < deadline:
        if held_by(config.socket_dir) is None and not pid_alive(pid):
            return {"stopped": True, "pid": pid, "seconds": round(time.monotonic() - started, 3), "forced": False}
        time.sleep(0.05)
    if force:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        killed = time.monotonic() + _KILL_WAIT_S  # SIGKILL is not instant either (a process stuck in the kernel)
        while time.monotonic() < killed:
            if held_by(config.socket_dir) is None and not pid_alive(pid):
                return {"stopped": True, "pid": pid, "seconds": round(time.monotonic() - started, 3), "forced": True}
            time.sleep(0.05)
        raise ApiTimeoutError(f"the agent (pid {pid}) was killed but had not exited {_KILL_WAIT_S:g}s later",
                              hint="It may be stuck in the kernel (a hung disk or mount); check `ps -o stat -p PID`")
    raise ApiTimeoutError(f"the agent (pid {pid}) did not stop within {wait:g}s",
                          hint="Wait longer (--timeout), or use `zerocomm agent stop --force` to kill it")


def agent_status(config: Config, timeout: float = 5.0) -> dict[str, Any]:
    """The running agent's health (from its API when it answers, else from its health file)."""
    pid = held_by(config.socket_dir)
    health = read_health(config.socket_dir)
    if pid is None:
        detail, failed = "", False
        if health and isinstance(health.get("pid"), int) and health.get("state") == "failed" and health.get("problem"):
            # It said why it stopped (a journal that could not take a message): fix that before a restart.
            at = health.get("failed_at")
            ago = f" {time.time() - float(at):.0f}s ago" if isinstance(at, (int, float)) else ""
            failed = True
            fix = health.get("fix")  # what the agent said to fix, by the failure's errno
            fix = (f"{fix.rstrip('.')} before starting it again" if isinstance(fix, str) and fix
                   else "Fix that first (free space, permissions)")
            detail = (f"; the agent (pid {health['pid']}) stopped{ago} because {health['problem'].rstrip('.')}. "
                      f"{fix}, or it stops again; its log {log_file_of(config)} says more")
        elif health and isinstance(health.get("pid"), int):
            detail = (f"; a health file from pid {health['pid']} remains (last heartbeat "
                      f"{time.time() - float(health.get('heartbeat_at', 0)):.0f}s ago): it crashed or was killed "
                      f"(the end of its log {log_file_of(config)} may say why)")
        hint = "Start it with `zerocomm agent start --detach`"
        if failed:  # it stopped on a failure: the fix comes first
            hint = "Once that is fixed, start it with `zerocomm agent start --detach`"
        if not has_identity(config.identity_dir):
            # `agent start` would quietly make a new member here, labelled after the directory: right only
            # if that is what the user wants, not when the directory is a typo or a host never set up.
            hint = (f"{config.identity_dir} holds no identity yet: create one with `zerocomm init "
                    f"--identity-dir {shlex.quote(str(config.identity_dir))} --label NAME`, then start it with "
                    "`zerocomm agent start --detach` (or give --config/--identity-dir of an existing member)")
        raise AgentNotRunningError(f"no agent is running for {config.identity_dir}{detail}", hint=hint)
    out: dict[str, Any] = dict(health or {})
    out["pid"] = pid
    try:
        with Client.connect(config.socket_dir, timeout=timeout, call_timeout=timeout) as client:
            out.update(client.status(timeout=timeout))
        out["responding"] = True
    except ZeroCommError as exc:
        out["responding"] = False
        # The health file's "running" is what the agent last wrote, not what it is now; its "starting"
        # or "stopping" (this agent's own) is still the best word for why it does not answer.
        said = out.get("state") if (health or {}).get("pid") == pid else None
        out["state"] = said if said in ("starting", "stopping") else "not responding"
        out["problem"] = str(exc)
        holder = held_by(config.socket_dir)
        if holder is None and pid > 0 and pid_alive(pid):
            holder = pid  # it held the directory a moment ago and lives: the same agent, not answering
        if isinstance(exc, (AgentNotRunningError, TimeoutError)) and holder is not None:
            # Whatever the client called it ("no agent answered", a call's deadline), an agent that holds
            # the directory is not one to start (that start is refused as already running); and the
            # client's own hints send the user to `agent status`, which is this.
            out["problem"] = (
                f"the agent (pid {holder if holder > 0 else 'unknown'}) holds {config.socket_dir} but did not serve "
                f"its API within {timeout:g}s: "
                f"{'it is ' + out['state'] if out['state'] != 'not responding' else 'it is starting, stopping or hung'}. "
                f"See its log {log_file_of(config)}, "
                "or stop it with `zerocomm agent stop` (`--force` if it does not stop)")
    beat = out.get("heartbeat_at")
    if isinstance(beat, (int, float)):
        out["heartbeat_age_s"] = round(time.time() - beat, 3)
    out["log_file"] = str(log_file_of(config))
    return out
