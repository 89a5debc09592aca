"""Real member agents on this machine, as processes: for tests, benchmarks and notebook demos.

Why here and not in the tests: the Spark tests, ``bench/spark_stream.py`` and a notebook all need
"N members in a group on loopback" and must get it the same way a user would, through the
``zerocomm`` command (``init``, ``agent start --detach``) and the client, never by reaching into a
process. Each member gets its own identity directory and config file, so its environment (or the
connector's ``agent`` option) points Spark at exactly that member.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zerocomm_spark.errors import AgentStartError

__all__ = ["LocalMember", "form_group", "start_members"]


def _cli(config: Path | None, *args: str, flags: Sequence[str] = (), timeout: float = 90.0) -> dict[str, Any]:
    argv = [sys.executable, "-m", "zerocomm_spark.agent", "--json"]
    if config is not None:
        argv += ["--config", str(config)]
    argv += list(flags) + list(args)
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AgentStartError(f"`zerocomm {' '.join(args)}` failed (exit {done.returncode}): "
                              f"{(done.stdout.strip() or done.stderr.strip())[-800:]}")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except ValueError:
        result = {}
    return result


class LocalMember:
    """One member agent: its config file (what the connector's ``agent`` option takes) and a client."""

    def __init__(self, label: str, home: Path, socket_dir: Path) -> None:
        self.label = label
        self.home = home
        self.socket_dir = socket_dir
        self.config = home / "zerocomm.toml"
        self._client: Any = None

    @classmethod
    def create(cls, base: str | os.PathLike[str], label: str, *, settings: Mapping[str, str] | None = None,
               socket_root: str | os.PathLike[str] | None = None) -> "LocalMember":
        """Make the identity and config file (``zerocomm init``); the socket goes under a short path."""
        home = Path(base).absolute() / label
        root = Path(socket_root) if socket_root else Path(tempfile.mkdtemp(prefix="zc-", dir="/tmp"))
        member = cls(label, home, root / label)
        flags = ["--identity-dir", str(home / "id"), "--label", label, "--socket-dir", str(member.socket_dir)]
        for key, value in (settings or {}).items():
            flags += ["--set", f"{key}={value}"]
        home.mkdir(parents=True, exist_ok=True)
        _cli(member.config, "init", flags=flags)
        return member

    # --- the process ------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> dict[str, Any]:
        """``zerocomm agent start --detach``; returns the agent's health once it serves."""
        return _cli(self.config, "agent", "start", "--detach", "--timeout", str(timeout), timeout=timeout + 15)

    def stop(self, timeout: float = 20.0) -> None:
        self.close_client()
        try:
            _cli(self.config, "agent", "stop", "--force", "--timeout", str(timeout), timeout=timeout + 15)
        except AgentStartError:
            pass  # not running

    def pid(self) -> int | None:
        try:
            text = (self.socket_dir / "agent.pid").read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def running(self) -> bool:
        """Whether the agent process named by the pid file is alive (a kill -9 leaves the file behind)."""
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie (killed, not yet reaped) counts as gone
            with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
                return handle.read().split(")")[-1].split()[0] != "Z"
        except OSError:
            return True

    def kill(self) -> None:
        """SIGKILL the agent, like a crash: no goodbye to peers, the journal as it was on disk."""
        self.close_client()
        pid = self.pid()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)

    # --- talking to it ----------------------------------------------------------------------------

    def client(self, timeout: float = 30.0) -> Any:
        from zerocomm_spark.client import Client

        if self._client is None:
            self._client = Client.connect(str(self.config), timeout=timeout, call_timeout=timeout)
        return self._client

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @property
    def env(self) -> dict[str, str]:
        """The environment that makes a process (a Spark executor) use this member."""
        return {"ZEROCOMM_CONFIG": str(self.config)}

    def did(self, group: str) -> str:
        """This member's publisher DID in ``group`` (as the journal and the source's rows name it)."""
        for entry in self.client().members(group):
            if entry.get("label") == self.label:
                return str(entry["did"])
        raise LookupError(f"{self.label} is not listed in {group}")

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"LocalMember({self.label!r}, config={str(self.config)!r})"


def start_members(base: str | os.PathLike[str], labels: Iterable[str], *,
                  settings: Mapping[str, str] | None = None) -> list[LocalMember]:
    """Create and start several members in parallel (each ``init`` + ``agent start`` costs ~1 s)."""
    root = Path(tempfile.mkdtemp(prefix="zc-", dir="/tmp"))
    names = list(labels)

    def one(label: str) -> LocalMember:
        member = LocalMember.create(base, label, settings=settings, socket_root=root)
        member.start()
        return member

    with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:
        return list(pool.map(one, names))


def _connected(member: LocalMember, label: str) -> str | None:
    for conn in member.client().connections():
        if conn.get("label") == label and conn.get("state") in ("completed", "complete", "active"):
            return str(conn.get("id"))
    return None


def form_group(members: Sequence[LocalMember], group: str, *, mode: str | None = None,
               timeout: float = 60.0) -> None:
    """The first member creates ``group``; every other one connects to it (once) and joins through it."""
    first = members[0]
    first.client(timeout).create(group, mode=mode)
    for member in members[1:]:
        via = _connected(member, first.label)
        if via is None:
            url = first.client(timeout).invite()
            via = str(member.client(timeout).accept(url, timeout=timeout).get("id") or first.label)
        member.client(timeout).join(group, via=via, timeout=timeout)
