"""`zerocomm agent stop` when the agent goes away on its own between the check and the signal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerocomm_spark.agent import config as cfgmod
from zerocomm_spark.agent import daemon
from zerocomm_spark.errors import AgentNotRunningError, ConfigurationError, InsecurePermissionsError


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


def _planted_pid_file(run_dir: Path, pid: int) -> int:
    """agent.pid naming ``pid``, locked as a running agent's is; returns the descriptor holding the lock."""
    import fcntl
    import os

    fd = os.open(run_dir / "agent.pid", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, f"{pid}\n".encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@pytest.mark.parametrize("how", ["directory of another user", "directory others may write", "pid file of another user"])
def test_stop_never_signals_a_pid_another_user_could_have_written(tmp_path: Path, how: str) -> None:
    """Another local user who can write the run directory (api.socket_dir in a shared place, made
    before the agent's user made it, or left group-writable) plants agent.pid naming any process of
    the victim and holds its lock: `zerocomm agent stop` sent that process SIGTERM (or SIGKILL with
    --force). Only a run directory and pid file the agent's user alone could have written are trusted."""
    import os

    from zerocomm_spark.errors import InsecurePermissionsError

    if how != "directory others may write" and os.getuid() != 0:
        pytest.skip("making a file of another user needs root")
    run_dir = tmp_path / "shared" / "run"
    run_dir.mkdir(parents=True, mode=0o700)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fd = _planted_pid_file(run_dir, victim.pid)
    try:
        if how == "directory of another user":
            os.chown(run_dir, 65534, 65534)
        elif how == "directory others may write":
            os.chmod(run_dir, 0o777)
        else:
            os.chown(run_dir / "agent.pid", 65534, 65534)
        config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}", f"api.socket_dir={run_dir}"])
        with pytest.raises(InsecurePermissionsError):
            daemon.stop_agent(config, timeout=0.3)
        assert victim.poll() is None  # not signalled
    finally:
        os.close(fd)
        victim.kill()
        victim.wait()


def test_stop_signals_the_agent_of_a_private_run_directory(tmp_path: Path) -> None:
    """The check above lets the real thing through: a run directory mode 700 and a pid file of this user."""
    import os

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    fd = _planted_pid_file(run_dir, agent.pid)
    try:
        config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}", f"api.socket_dir={run_dir}"])
        with pytest.raises(Exception):  # it dies but "holds" the lock we keep: a timeout after the SIGTERM
            daemon.stop_agent(config, timeout=0.3)
        assert agent.wait(5) == -15
    finally:
        os.close(fd)
        if agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.parametrize("whose", ["its owner's", "root's", "its owner's, named by a pid file of root"])
def test_root_acts_on_the_agent_of_another_user_only_for_a_process_of_that_user(tmp_path: Path, whose: str) -> None:
    """Root could no longer `agent stop` or `agent status` a user's agent: the run directory had to be
    root's own, and the refusal told the administrator the lock was planted. Root trusts a run
    directory of user U that others cannot write, with a pid file of U naming a process of U; a pid
    naming any other process (root's here) is still never signalled."""
    import os

    from zerocomm_spark.agent.runfiles import held_by
    from zerocomm_spark.errors import InsecurePermissionsError

    if os.getuid() != 0:
        pytest.skip("acting on a run directory of another user needs root")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    agent = subprocess.Popen(["sleep", "60"], user=None if whose == "root's" else 65534)
    fd = _planted_pid_file(run_dir, agent.pid)
    try:
        if "pid file of root" not in whose:
            os.chown(run_dir / "agent.pid", 65534, 65534)
        os.chown(run_dir, 65534, 65534)
        config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}", f"api.socket_dir={run_dir}"])
        if whose == "its owner's":
            assert held_by(run_dir) == agent.pid
            assert daemon.agent_status(config, timeout=0.5)["pid"] == agent.pid
            with pytest.raises(Exception):  # it dies but "holds" the lock we keep: a timeout after the SIGTERM
                daemon.stop_agent(config, timeout=0.3)
            assert agent.wait(5) == -15
        else:
            why = "belongs to uid 0, not to the owner" if "pid file of root" in whose else \
                f"names pid {agent.pid}, a process of uid 0"
            with pytest.raises(InsecurePermissionsError, match=why) as info:
                held_by(run_dir)
            assert "planted" not in f"{info.value} {info.value.hint}"
            with pytest.raises(InsecurePermissionsError):
                daemon.stop_agent(config, timeout=0.3)
            assert agent.poll() is None  # not signalled
    finally:
        os.close(fd)
        if agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_agent_process_is_not_dumpable() -> None:
    """A core_pattern pipe (systemd-coredump, apport) ignores the core limit: the agent also makes itself
    non-dumpable, so its keys reach no core file and no other process's ptrace."""
    code = ("import ctypes, resource; from zerocomm_spark.agent.daemon import _no_core_dumps; _no_core_dumps(); "
            "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0), *resource.getrlimit(resource.RLIMIT_CORE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["0", "0", "0"], out


def test_the_agent_environment_drops_sparks_secrets_and_keeps_what_the_agent_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent started by a Spark executor's Python worker carried Spark's secrets for its whole life."""
    monkeypatch.chdir(tmp_path)
    spark = {name: "s3cret" for name in daemon.SPAWNER_SECRETS}
    spark.update({"SPARK_SOMEDAY_TOKEN": "s3cret", "PYSPARK_NEW_PASSWORD": "s3cret"})  # names Spark may add
    # an executor's (or a CI job's) other credentials: the agent reads none of them
    spark.update({"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s3cret", "AWS_SESSION_TOKEN": "s3cret",
                  "HADOOP_TOKEN_FILE_LOCATION": "/yarn/container_tokens", "AZURE_CLIENT_SECRET": "s3cret",
                  "GOOGLE_APPLICATION_CREDENTIALS": "/keys/sa.json", "KRB5CCNAME": "FILE:/tmp/krb5cc_0",
                  "GITHUB_TOKEN": "s3cret", "DB_password": "s3cret"})
    kept = {"PATH": "/usr/bin:/bin", "HOME": "/home/me", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": "/tmp",
            "ZEROCOMM_LOG_LEVEL": "debug", "ZEROCOMM_JARS": "/jars", "SPARK_HOME": "/opt/spark",
            "SPARK_AUTH_SOCKET_TIMEOUT": "15", "SPARK_PASSPHRASE_FOR_ZC": "the passphrase",
            "AWS_REGION": "eu-west-1", "SSH_AUTH_SOCK": "/run/ssh"}
    environ = {**spark, **kept, "ZEROCOMM_IDENTITY_DIR": "id", "ZEROCOMM_API_SOCKET_DIR": "~/run",
               "ZEROCOMM_LOG_FILE": "logs/../agent.log", "PWD": str(tmp_path),
               "PYTHONPATH": f"pyspark.zip{os.pathsep}{tmp_path / 'app'}"}
    # a passphrase variable whose name looks like Spark's is still the keystore's passphrase
    config = cfgmod.load(None, env=environ, flags=["identity.passphrase_env=SPARK_PASSPHRASE_FOR_ZC"])
    env = daemon.agent_environment(config, environ)
    assert not set(spark) & set(env)
    assert {name: env.get(name) for name in kept} == kept
    assert env["ZEROCOMM_IDENTITY_DIR"] == str(tmp_path / "id")
    assert env["ZEROCOMM_API_SOCKET_DIR"] == os.path.expanduser("~/run")
    assert env["ZEROCOMM_LOG_FILE"] == str(tmp_path / "agent.log")
    assert "PYTHONPATH" not in env  # the package is installed: Spark's and the application's entries are not the agent's
    assert env["PWD"] == "/"


def test_the_agent_environment_drops_other_passphrases_and_api_keys(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host that runs two members, alice's agent started with bob's keystore passphrase in its
    environment (ZC_BOB_PASSPHRASE, even ZEROCOMM_BOB_PASSPHRASE), and with DB_PASS, OPENAI_API_KEY and
    AZURE_STORAGE_KEY: only names with SECRET, TOKEN, PASSWORD, ... were dropped."""
    monkeypatch.chdir(tmp_path)
    foreign = {"ZC_BOB_PASSPHRASE": "bob's passphrase", "ZEROCOMM_BOB_PASSPHRASE": "bob's passphrase",
               "GPG_PASSPHRASE": "s3cret", "DB_PASS": "s3cret", "SMTP_PASS_FILE": "/run/pass",
               "OPENAI_API_KEY": "s3cret", "STRIPE_APIKEY": "s3cret", "AZURE_STORAGE_KEY": "s3cret",
               "AZURE_STORAGE_ACCOUNT_KEY": "s3cret", "MINIO_ACCESS_KEY": "s3cret", "AWS_ACCESS_KEY_ID": "AKIA",
               "zc_alice_passphrase_old": "s3cret"}
    kept = {"ZC_ALICE_PASSPHRASE": "alice's passphrase", "PATH": "/usr/bin", "HOME": "/home/me",
            "SSH_AUTH_SOCK": "/run/ssh", "AWS_REGION": "eu-west-1", "PASSAGE": "not a credential",
            "KEYBOARD": "us", "ZEROCOMM_IDENTITY_PASSPHRASE_ENV": "ZC_ALICE_PASSPHRASE",
            "ZEROCOMM_LOG_LEVEL": "debug", "ZEROCOMM_JARS": "/jars"}
    environ = {**foreign, **kept}
    config = cfgmod.load(None, env=environ, flags=[f"identity.dir={tmp_path / 'alice'}"])
    assert config.get("identity", "passphrase_env") == "ZC_ALICE_PASSPHRASE"
    env = daemon.agent_environment(config, environ)
    assert not set(foreign) & set(env)
    assert {name: env.get(name) for name in kept} == kept


def test_the_agent_keeps_pythonpath_only_when_the_package_comes_from_it(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import zerocomm_spark

    monkeypatch.chdir(tmp_path)
    root = Path(zerocomm_spark.__file__).resolve().parents[1]
    relative = os.path.relpath(root, tmp_path)
    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    env = daemon.agent_environment(config, {"PYTHONPATH": f"app.zip{os.pathsep}{relative}"})
    assert env["PYTHONPATH"] == f"{tmp_path / 'app.zip'}{os.pathsep}{root}"  # all of it, made absolute
    assert "PYTHONPATH" not in daemon.agent_environment(config, {"PYTHONPATH": "app.zip"})


def test_a_detached_agent_starts_in_root_with_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent kept its starter's working directory (a Spark application's, removed when it ends) and
    got the relative paths of flags, environment and --config to resolve against it."""
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "zc.toml").write_text('[identity]\ndir = "member"\n')
    monkeypatch.chdir(work)
    environ = {"ZEROCOMM_JOURNAL_DIR": "../journal", "PYTHON_WORKER_FACTORY_SECRET": "s3cret", "PATH": "/bin"}
    monkeypatch.setattr(os, "environ", environ)
    config = cfgmod.load("../zc.toml", env=environ, flags=["api.socket_dir=../run", "log.file=agent.log"])
    started: dict = {}

    def popen(argv: list[str], **kwargs: object) -> None:
        started.update(kwargs, argv=argv)
        raise OSError("stop here")

    monkeypatch.setattr(daemon.subprocess, "Popen", popen)
    with pytest.raises(OSError, match="stop here"):
        daemon.start_detached(config, timeout=1)
    argv = started["argv"]
    assert started["cwd"] == "/"
    assert argv[argv.index("--config") + 1] == str(tmp_path / "zc.toml")
    assert f"api.socket_dir={tmp_path / 'run'}" in argv and f"log.file={work / 'agent.log'}" in argv
    assert started["env"] == {"ZEROCOMM_JOURNAL_DIR": str(tmp_path / "journal"), "PATH": "/bin"}


def _no_popen(monkeypatch: pytest.MonkeyPatch) -> dict:
    started: dict = {}

    def popen(argv: list[str], **kwargs: object) -> None:
        started.update(kwargs, argv=argv)
        raise OSError("stop here")

    monkeypatch.setattr(daemon.subprocess, "Popen", popen)
    return started


def test_a_detached_start_does_not_follow_a_log_file_link_in_a_shared_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started from a directory others may write (/tmp), `--set log.file=agent.log` where another user
    had planted agent.log -> ~/.bashrc: the paths were made absolute with realpath, which followed the
    link, so the check that refuses such a link saw ~/.bashrc and the agent appended its log to it."""
    shared, victim = tmp_path / "shared", tmp_path / "bashrc"
    shared.mkdir()
    shared.chmod(0o1777)
    victim.write_text("# mine\n")
    (shared / "agent.log").symlink_to(victim)
    monkeypatch.chdir(shared)
    started = _no_popen(monkeypatch)
    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}", "log.file=agent.log"])
    with pytest.raises(ConfigurationError, match="symbolic link"):
        daemon.start_detached(config, timeout=1)
    assert not started and victim.read_text() == "# mine\n"


def test_a_detached_start_refuses_a_socket_directory_link_given_relative(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--set api.socket_dir=runlink` (a link to a directory): the foreground start, status and stop
    refuse a run directory that is a link, but the detached start resolved it first and started an agent
    that the same command line could then neither see nor stop."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "runlink").symlink_to(real)
    monkeypatch.chdir(tmp_path / "work")
    started = _no_popen(monkeypatch)
    for socket_dir in ("runlink", "../work/runlink"):
        config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}", f"api.socket_dir={socket_dir}"])
        with pytest.raises(InsecurePermissionsError, match="not a plain directory"):
            daemon.start_detached(config, timeout=1)
    assert not started


def test_a_config_file_given_through_a_link_is_read_as_its_starter_read_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--config zc.toml`, a link to ../shared/zc.toml saying `dir = "member"`: the starter read the
    identity as ./member (relative to the link's directory), the agent got the link resolved and read it
    as ../shared/member, so it served (and created) another member than the one the command named."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "zc.toml").write_text('[identity]\ndir = "member"\n')
    work = tmp_path / "work"
    work.mkdir()
    (work / "zc.toml").symlink_to("../shared/zc.toml")
    (tmp_path / "up").symlink_to("shared")
    monkeypatch.chdir(work)
    started = _no_popen(monkeypatch)
    for given, expected, member in (("zc.toml", work / "zc.toml", work / "member"),
                                    ("../work/zc.toml", work / "zc.toml", work / "member"),
                                    ("../up/zc.toml", tmp_path / "up" / "zc.toml", tmp_path / "shared" / "member")):
        config = cfgmod.load(given, env={})
        with pytest.raises(OSError, match="stop here"):
            daemon.start_detached(config, timeout=1)
        argv = started["argv"]
        assert argv[argv.index("--config") + 1] == str(expected)
        # the agent reads the identity the starter named ("../work/member" is work/member)
        assert config.identity_dir.resolve() == member
        assert cfgmod.load(argv[argv.index("--config") + 1], env={}).identity_dir.resolve() == member


def test_absolute_resolves_only_what_the_last_parent_step_needs(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a" / "b")
    monkeypatch.chdir(tmp_path / "a")
    assert daemon._absolute("") == ""
    assert daemon._absolute(".") == daemon._absolute("./") == str(tmp_path / "a")
    assert daemon._absolute("x/./y/") == str(tmp_path / "a" / "x" / "y")
    assert daemon._absolute("../link") == str(tmp_path / "link")  # after the last "..": kept as given
    assert daemon._absolute("../link/f") == str(tmp_path / "link" / "f")
    assert daemon._absolute("../link/..") == str(tmp_path / "a")  # up to it: as the kernel resolves it
    assert daemon._absolute("../link/../c/link") == str(tmp_path / "a" / "c" / "link")
    assert daemon._absolute(f"{tmp_path}/link/../x") == str(tmp_path / "a" / "x")
    assert daemon._absolute("/abs/link") == "/abs/link"
    assert daemon._absolute("~/x") == os.path.expanduser("~/x")


def test_a_link_that_shortens_the_socket_path_keeps_shortening_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--set api.socket_dir=zc/run` with zc a short link to a deep directory (what one does for the
    103 bytes a Unix socket's path may take): resolving the link made the agent's socket path too long,
    and the detached start failed where the foreground one (and the same start before) served."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (tmp_path / "zc").symlink_to(deep)
    monkeypatch.chdir(tmp_path)
    started = _no_popen(monkeypatch)
    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}", "api.socket_dir=zc/run"])
    with pytest.raises(OSError, match="stop here"):
        daemon.start_detached(config, timeout=1)
    assert f"api.socket_dir={tmp_path / 'zc' / 'run'}" in started["argv"]


def test_a_detached_start_holds_the_run_directory_before_the_agent_process_exists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent took its run lock a second after it was launched (its interpreter's start-up), so
    clients that came meanwhile were told that no agent runs. The starter holds it when it launches the
    agent, passes it down (--run-lock-fd), and lets go of it if the launch fails."""
    from zerocomm_spark.agent.runfiles import RunLock, held_by

    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    run = tmp_path / "id" / "run"
    seen: dict = {}

    def popen(argv: list[str], **kwargs: object) -> None:
        fd = int(argv[argv.index("--run-lock-fd") + 1])
        seen.update(holder=held_by(run), passed=fd in kwargs["pass_fds"],  # type: ignore[operator]
                    same=os.path.samestat(os.fstat(fd), os.stat(run / "agent.pid")))
        raise OSError("stop here")

    monkeypatch.setattr(daemon.subprocess, "Popen", popen)
    with pytest.raises(OSError, match="stop here"):
        daemon.start_detached(config, timeout=1)
    assert seen == {"holder": -1, "passed": True, "same": True}  # held, and no pid named but the agent's
    assert held_by(run) is None
    RunLock(run).acquire().release()


def test_status_of_an_agent_that_holds_its_directory_but_does_not_serve_says_what_to_do(tmp_path: Path) -> None:
    """`agent status` waited for it, then said "`zerocomm agent status` tells whether it is alive"."""
    from zerocomm_spark.agent.runfiles import RunLock

    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    run = tmp_path / "id" / "run"
    run.mkdir(parents=True, mode=0o700)
    lock = RunLock(run).acquire()  # an agent starting: it holds the directory, no socket yet
    try:
        status = daemon.agent_status(config, timeout=0.5)
    finally:
        lock.release()
    assert status["responding"] is False and status["pid"] == os.getpid()
    problem = status["problem"]
    assert f"pid {os.getpid()}" in problem and str(run / "agent.log") in problem, problem
    assert "zerocomm agent stop" in problem and "agent status" not in problem, problem


@pytest.mark.parametrize("failure", ["deadline", "no answer", "lock let go meanwhile"])
def test_status_of_an_agent_that_does_not_answer_never_says_to_start_one(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          failure: str) -> None:
    """A hung agent's status said "no agent answered ... Start one with `zerocomm agent start --detach`"
    (a start then refused as already running), and --json said "state": "running" beside
    "responding": false. Every way the client says it got no answer, with the agent alive, gives the
    advice for a hung agent; the state says it does not respond."""
    from zerocomm_spark.errors import ApiTimeoutError

    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    (tmp_path / "id" / "run").mkdir(parents=True, mode=0o700)
    me = os.getpid()
    answers = iter([me, None if failure == "lock let go meanwhile" else me])
    monkeypatch.setattr(daemon, "held_by", lambda run_dir: next(answers))
    monkeypatch.setattr(daemon, "read_health", lambda run_dir: {"state": "running", "pid": me, "heartbeat_at": 0})

    def connect(*args: object, **kwargs: object) -> None:
        if failure == "deadline":
            raise ApiTimeoutError("the agent at ipc://x did not answer status within 0.5s")
        raise AgentNotRunningError("no agent answered on ipc://x/api.sock within the deadline")

    monkeypatch.setattr(daemon.Client, "connect", connect)
    status = daemon.agent_status(config, timeout=0.5)
    assert status["responding"] is False and status["state"] == "not responding", status
    problem = status["problem"]
    assert f"pid {me}" in problem and "zerocomm agent stop" in problem, problem
    assert "agent start" not in problem and "outcome is unknown" not in problem, problem


@pytest.mark.parametrize("state", ["starting", "stopping"])
def test_status_of_an_agent_not_answering_keeps_what_its_health_file_says_it_is_doing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str) -> None:
    """"not responding" replaced a health file's "starting" or "stopping" too, and the problem then
    guessed "starting, stopping or hung" where the agent had said which."""
    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    (tmp_path / "id" / "run").mkdir(parents=True, mode=0o700)
    me = os.getpid()
    monkeypatch.setattr(daemon, "held_by", lambda run_dir: me)
    monkeypatch.setattr(daemon, "read_health", lambda run_dir: {"state": state, "pid": me, "heartbeat_at": 0})

    def connect(*args: object, **kwargs: object) -> None:
        raise AgentNotRunningError("no agent answered on ipc://x/api.sock within the deadline")

    monkeypatch.setattr(daemon.Client, "connect", connect)
    status = daemon.agent_status(config, timeout=0.5)
    assert status["responding"] is False and status["state"] == state, status
    assert f"it is {state}." in status["problem"] and "or hung" not in status["problem"], status
    # a health file left by another pid says nothing of this one
    monkeypatch.setattr(daemon, "read_health", lambda run_dir: {"state": state, "pid": me + 1, "heartbeat_at": 0})
    assert daemon.agent_status(config, timeout=0.5)["state"] == "not responding"


def test_stop_while_a_detached_start_has_not_named_its_agent_yet_stops_it(tmp_path: Path) -> None:
    """A detached start holds the run directory, its pid file empty, from its lock to the launch of the agent
    (and, if the starter dies in between, until the agent names itself): a stop then said "its pid file is
    unreadable" (exit 3, "not running") and the agent came up. It waits for the pid and stops that."""
    import threading

    from zerocomm_spark.agent.runfiles import RunLock, held_by

    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'id'}"])
    run = tmp_path / "id" / "run"
    run.mkdir(parents=True, mode=0o700)
    lock = RunLock(run).acquire(name_self=False)
    assert lock.fd is not None and held_by(run) == -1
    children: list[subprocess.Popen] = []

    def launch() -> None:  # the starter's launch, 0.3 s after its lock
        threading.Event().wait(0.3)
        assert lock.fd is not None
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.fd,)))
        lock.hand_over(children[0].pid)

    starter = threading.Thread(target=launch)
    starter.start()
    try:
        stopped = daemon.stop_agent(config, timeout=10)
        starter.join(10)
        assert stopped["stopped"] is True and stopped["pid"] == children[0].pid and stopped["forced"] is False
        assert children[0].wait(10) == -15 and held_by(run) is None
    finally:
        starter.join(10)
        lock.release()
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(10)


def test_a_second_foreground_start_of_a_running_identity_says_the_identity_is_served(tmp_path: Path) -> None:
    """Since the agent takes its run lock before its identity, a second `agent start` (foreground) of a
    running member was refused by the lock: "another agent already serves the API socket directory ...
    give this agent its own api.socket_dir", advice that only leads to the identity's refusal. It was,
    and is again, "already running for the identity directory" with the running agent's pid and API."""
    from zerocomm_spark.agent.process import AgentProcess
    from zerocomm_spark.agent.runfiles import RunLock, write_json_atomic
    from zerocomm_spark.errors import AgentAlreadyRunningError

    identity = tmp_path / "id"
    config = cfgmod.load(None, env={}, flags=[f"identity.dir={identity}"])
    run = identity / "run"
    run.mkdir(parents=True, mode=0o700)
    (identity / "keystore.lock").write_text(f"{os.getpid()}\n")  # the running agent: this process
    lock = RunLock(run).acquire()
    write_json_atomic(run / "health.json", {"pid": os.getpid(), "endpoints": {"api": "ipc:///there/api.sock"}})
    try:
        with pytest.raises(AgentAlreadyRunningError) as refused:
            AgentProcess(config).start()
    finally:
        lock.release()
    message = str(refused.value)
    assert f"already running for the identity directory {identity} (pid {os.getpid()}, API ipc:///there/api.sock)" \
        in message, message
    assert "another --identity-dir" in (refused.value.hint or "")


def test_status_for_a_directory_without_an_identity_says_to_init_not_to_start(tmp_path: Path) -> None:
    """Status for a directory holding no identity (a typo, a host never set up) said "Start it with
    `zerocomm agent start --detach`", and that start quietly made a new member there, labelled after
    the directory, in no group. It now says the directory holds no identity and how to make one."""
    from zerocomm_spark.keys.keystore import SEALED_FILE

    config = cfgmod.load(None, env={}, flags=[f"identity.dir={tmp_path / 'typo'}"])
    with pytest.raises(AgentNotRunningError) as caught:
        daemon.agent_status(config, timeout=0.5)
    assert "holds no identity yet" in caught.value.hint and "zerocomm init --identity-dir" in caught.value.hint
    (tmp_path / "typo").mkdir()
    (tmp_path / "typo" / SEALED_FILE).write_bytes(b"x")  # only its presence is looked at
    with pytest.raises(AgentNotRunningError) as caught:
        daemon.agent_status(config, timeout=0.5)
    assert caught.value.hint == "Start it with `zerocomm agent start --detach`"
