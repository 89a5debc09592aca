"""Helpers for the agent and CLI tests (no tests here): members as real agent processes driven
through the `zerocomm` command, each with its own config file and identity directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ZEROCOMM = [sys.executable, "-m", "zerocomm_spark.agent"]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        assert lines, f"no output (exit {self.code}); stderr: {self.stderr}"
        return json.loads(lines[-1])

    @property
    def json_lines(self) -> list[Any]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]


def zerocomm(*args: str, timeout: float = 60.0, input: str | None = None,
             env: dict[str, str] | None = None) -> Result:
    done = subprocess.run([*ZEROCOMM, *args], capture_output=True, text=True, timeout=timeout, input=input,
                          env=env)
    return Result(done.returncode, done.stdout, done.stderr)


def _threads_left(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


class Member:
    """One member: `zerocomm --config <dir>/zerocomm.toml ...`, its agent started detached."""

    def __init__(self, root: Path, name: str, *settings: str) -> None:
        self.name = name
        self.home = root / name
        self.config = root / f"{name}.toml"
        self.identity = self.home / "id"
        self.settings = settings

    def run(self, *args: str, timeout: float = 60.0, input: str | None = None, json_out: bool = True) -> Result:
        extra = ["--json"] if json_out else []
        return zerocomm("--config", str(self.config), *extra, *args, timeout=timeout, input=input)

    def ok(self, *args: str, timeout: float = 60.0, input: str | None = None) -> Any:
        result = self.run(*args, timeout=timeout, input=input)
        assert result.code == 0, f"{self.name}: zerocomm {' '.join(args)} -> {result.code}\n{result.stdout}\n{result.stderr}"
        return result.json

    def init(self) -> Any:
        sets = [a for s in self.settings for a in ("--set", s)]
        return self.ok("init", "--identity-dir", str(self.identity), "--label", self.name, *sets)

    def start(self) -> Any:
        return self.ok("agent", "start", "--detach")

    @property
    def run_dir(self) -> Path:
        return self.identity / "run"

    def pid(self) -> int | None:
        try:
            return int((self.run_dir / "agent.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        pid = self.pid()
        if pid is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait_gone(self, pid: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return
            if state == "Z" and _threads_left(pid) <= 1:
                # The leader of a killed process is a zombie before its other threads are gone, and
                # their shared descriptors (the run directory's lock) close with the last of them.
                return
            time.sleep(0.02)
        raise AssertionError(f"process {pid} did not exit")

    def stop(self) -> None:
        """Stop gracefully if running, else make sure nothing is left behind."""
        if self.pid() is None:
            return
        result = self.run("agent", "stop", "--timeout", "15", timeout=30)
        if result.code not in (0, 3):
            self.kill()

    def log(self) -> str:
        try:
            return (self.run_dir / "agent.log").read_text()
        except OSError:
            return ""


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def start_all(members: list[Member]) -> None:
    """init and start every member, the agent starts in parallel (each is a few hundred ms of Python)."""
    procs = [subprocess.Popen([*ZEROCOMM, "--config", str(m.config), "--json", "init", "--identity-dir",
                               str(m.identity), "--label", m.name, *[a for s in m.settings for a in ("--set", s)]],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for m in members]
    for m, p in zip(members, procs):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"init {m.name}: {out}{err}"
    procs = [subprocess.Popen([*ZEROCOMM, "--config", str(m.config), "--json", "agent", "start", "--detach"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for m in members]
    for m, p in zip(members, procs):
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, f"start {m.name}: {out}{err}"


@contextmanager
def running(root: Path, *names: str) -> Iterator[list[Member]]:
    """Members ``names`` under ``root`` with their agents started; stopped at the end whatever happened."""
    members = [Member(root, name) for name in names]
    try:
        start_all(members)
        yield members
    finally:
        for m in members:
            m.stop()


@contextmanager
def in_group(root: Path) -> Iterator[tuple[Member, Member]]:
    """alice and bob started under ``root``, in group 'g' (alice created it, bob joined through her);
    both stopped at the end whatever happened."""
    with running(root, "alice", "bob") as (alice, bob):
        alice.ok("group", "create", "g")
        bob.ok("connect", alice.ok("invite")["url"])
        bob.ok("group", "join", "g", "--via", "alice")
        yield alice, bob
