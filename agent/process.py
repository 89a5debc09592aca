"""The agent process: one member (identity, connections, groups, journal) behind a local API.

Why one long-running process: Spark tasks come and go, but group membership must not. The agent
holds the identity directory (the keystore's lock makes it the only one), keeps the member in its
groups, journals every delivered message before acknowledging it, and serves clients (the CLI,
notebooks, Spark tasks) over a Unix socket only its user can open.

Start order is chosen so that a failure leaves nothing half-made: run directory lock (refuses a second
agent on the same socket directory), identity (refuses a second agent on the same member), journal,
groups, API; close runs it backwards, with the API first so no new call starts while the rest shuts
down. The run lock comes first because it is what clients look at: while it is held, a client waits for
the agent that is starting instead of being told that none runs (a detached start even takes it before
the agent's process exists, and hands it over: ``run_lock_fd``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import zmq

from zerocomm_spark.agent.config import Config
from zerocomm_spark.agent.ingest import JournalIngest, abort_on_journal_failure
from zerocomm_spark.agent.logging import event
from zerocomm_spark.agent.metrics import Metrics
from zerocomm_spark.agent.runfiles import RunLock, read_health, read_pid, write_json_atomic
from zerocomm_spark.agent.server import ApiServer, prepare_socket_dir
from zerocomm_spark.client import HEALTH_FILE, PID_FILE
from zerocomm_spark.errors import AgentAlreadyRunningError, ConfigurationError, ZeroCommError
from zerocomm_spark.journal import Journal, journal_key
from zerocomm_spark.journal.files import os_error_fix
from zerocomm_spark.member import Agent

__all__ = ["AgentProcess", "VERSION"]

log = logging.getLogger(__name__)

VERSION = "0.1.0"
API_CURVE_SECRET = "api-curve-secret"


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OS error behind a journal failure (the exception itself, or its causes), if one is."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


#: Descriptors held back from the start and let go when the journal fails: a journal that failed for
#: want of descriptors (EMFILE) left none to write the health file with, and `agent status` then said
#: the agent "crashed or was killed" instead of what to fix.
_SPARE_FDS = 4


class AgentProcess:
    """Everything one agent runs; ``start()``, then ``run()`` until ``stop()``, then ``close()``."""

    def __init__(self, config: Config, *, run_lock_fd: int | None = None) -> None:
        self.config = config
        self._run_lock_fd = run_lock_fd  # the run lock its starter took and passed down (RunLock.adopt)
        self.metrics = Metrics()
        self.member: Agent | None = None
        self.journal: Journal | None = None
        self.ingest: JournalIngest | None = None
        self.groups: Any = None
        self.server: ApiServer | None = None
        self.run_files_lost = False  # stopped because its run directory went away (exit EX_TEMPFAIL)
        self.journal_lost = False  # stopped because its journal's files went away (exit EX_TEMPFAIL)
        self._lock: RunLock | None = None
        self._stop = threading.Event()
        self._closed = False
        self.started_at = time.time()
        self.stop_reason = ""
        self._spare_fds: list[int] = []
        self._spare_lock = threading.Lock()  # two threads may fail at once: no descriptor closed twice
        self._started = False

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "AgentProcess":
        """Open everything and serve; raises (having released what it opened) if any part fails."""
        cfg = self.config
        try:
            for _ in range(_SPARE_FDS):  # one at a time: those opened are released if a later one fails
                self._spare_fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            if self._run_lock_fd is not None:
                fd, self._run_lock_fd = self._run_lock_fd, None
                self._lock = RunLock(cfg.socket_dir).adopt(fd)
                prepare_socket_dir(cfg.socket_dir)  # as its starter made it: checked again, not trusted
            else:
                prepare_socket_dir(cfg.socket_dir)
                try:
                    self._lock = RunLock(cfg.socket_dir).acquire()
                except AgentAlreadyRunningError:
                    # The agent of this very identity, most often (a second `agent start`): say so, as when
                    # it was the identity that refused, not "give this agent its own api.socket_dir".
                    holder = read_pid(cfg.socket_dir)
                    if holder is not None and holder == self._identity_holder():
                        raise self._identity_taken(holder) from None
                    raise
            self._open_member()
            self._open_api()
            self.write_health("running")
        except BaseException:
            self.close()
            raise
        self._started = True
        event(log, logging.INFO, "agent started", label=self.member.label if self.member else None,
              identity_dir=str(cfg.identity_dir), api=self.server.ipc_endpoint if self.server else None,
              peer=self.member.endpoint if self.member else None)
        return self

    def _open_member(self) -> None:
        from zerocomm_spark.agent.groups import group_config

        cfg = self.config
        try:
            self.member = Agent.open(
                cfg.identity_dir, label=cfg.label, endpoint=cfg.get("peer", "endpoint"),
                passphrase=cfg.passphrase(), advertise=cfg.get("peer", "advertise") or None,
                max_frame_bytes=cfg.get("peer", "max_frame_bytes"), workers=cfg.get("peer", "workers"),
                group_config=group_config(cfg), prepare_groups=self._attach_journal,
                inbox=False)  # basic messages are served from messages(); no receive() would drain an inbox
        except AgentAlreadyRunningError:
            # It serves another socket directory (this one's lock is ours): the keystore lock names the holder.
            raise self._identity_taken(self._identity_holder()) from None
        self.groups = self.member.groups  # an agent process always runs its data plane

    def _identity_holder(self) -> int | None:
        """The pid the identity's keystore lock file names (advisory: its last holder)."""
        try:
            text = (self.config.identity_dir / "keystore.lock").read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return int(text) if text.isdigit() else None

    def _identity_taken(self, pid: int | None) -> AgentAlreadyRunningError:
        """The identity is served by the agent ``pid``. The health file here names its API only if it is
        that agent's (the one of this directory): otherwise it is a dead agent's, if any."""
        cfg = self.config
        health = read_health(cfg.socket_dir) or {}
        api = (health.get("endpoints") or {}).get("api") if pid is not None and health.get("pid") == pid else None
        who = f" (pid {pid}" + (f", API {api})" if api else ")") if pid else ""
        return AgentAlreadyRunningError(
            f"an agent is already running for the identity directory {cfg.identity_dir}{who}; "
            "one identity is served by one agent at a time",
            hint="Use the running agent (`zerocomm agent status`), stop it first (`zerocomm agent stop`), "
                 "or start this one with another --identity-dir")

    def _attach_journal(self, member: Agent, manager: Any) -> None:
        """Open the journal and hook it to the group manager before the manager starts.

        Before: the data plane may deliver, and then acknowledge, messages within milliseconds of
        the start of a restarted member that rejoins its groups.
        """
        cfg = self.config
        if self.journal is None:
            retention_bytes = cfg.get("journal", "retention_bytes") or None
            self.journal = Journal.open(
                cfg.journal_dir, key=journal_key(member.keystore), fsync=cfg.get("journal", "fsync"),
                fsync_interval_ms=cfg.get("journal", "fsync_interval_ms"),
                segment_bytes=cfg.get("journal", "segment_bytes"), retention_bytes=retention_bytes,
                retention_ms=cfg.retention_ms, dedup_window=cfg.get("journal", "dedup_window"),
                consumer_expiry_ms=cfg.consumer_expiry_ms)
            self.ingest = JournalIngest(self.journal, self.metrics, on_fatal=self._journal_failed)
        assert self.ingest is not None
        manager.on_messages(self.ingest.on_messages)  # one journal record per delivery batch, before the acks
        manager.on_superseded(self.ingest.on_superseded)  # seqs re-used for delivered ids, before the acks

    def _journal_failed(self, exc: BaseException) -> None:
        """The journal cannot take a delivery: say why in the health file, then exit at once (see ingest).

        `agent status` reads it once the process is gone: "its journal failed: File too large" tells the
        user what to fix before a restart, where "it crashed or was killed" sent them into a restart loop
        on a full disk. The file is updated from what is on disk, not from health(): this runs on the
        receiving thread, which may hold what the group calls in health() would wait for. The reason is
        the journal's own words (an OS error's text, or the type): never rows."""
        self._release_spare_fds()  # room for the health file, whatever the journal ran out of
        cause = _os_error_in(exc)
        fix = os_error_fix(cause)[:600] if cause is not None else None  # by the errno: descriptors are not disk space
        try:
            if self._lock is not None:
                reason = (exc.message if isinstance(exc, ZeroCommError) else str(exc) if isinstance(exc, OSError)
                          else type(exc).__name__)  # without the library's "reopen the journal" hint
                health = dict(read_health(self.config.socket_dir) or {}, pid=os.getpid(), state="failed",
                              failed_at=time.time(),
                              problem=f"its journal in {self.config.journal_dir} failed: {reason}"[:600])
                if fix is not None:
                    health["fix"] = fix
                write_json_atomic(self.config.socket_dir / HEALTH_FILE, health)
        except Exception:  # noqa: BLE001 - a full disk may refuse this too: the log still says it
            pass
        abort_on_journal_failure(exc, fix)

    def _open_api(self) -> None:
        from zerocomm_spark.agent.calls import build_registry
        from zerocomm_spark.client import ipc_to_table, table_to_ipc

        def warm_up() -> None:
            # Arrow loads parts of itself (and pandas) on first use, most of a second: pay it in the
            # background now rather than in a client's first call or the first delivery.
            try:
                ipc_to_table(table_to_ipc(pa.table({"payload": pa.array([b""], type=pa.binary())})))
            except Exception:  # noqa: BLE001 - only an optimisation
                pass

        threading.Thread(target=warm_up, name="zerocomm-warm-up", daemon=True).start()
        cfg = self.config
        assert self.member is not None
        secret = None
        if cfg.get("api", "tcp_endpoint"):
            keystore = self.member.keystore
            stored = keystore.get_secret(API_CURVE_SECRET)
            if stored is None:
                _, stored = zmq.curve_keypair()
                keystore.put_secret(API_CURVE_SECRET, stored)
            secret = bytes(stored)
        self.server = ApiServer(
            build_registry(self), cfg.socket_dir, tcp_endpoint=cfg.get("api", "tcp_endpoint"), curve_secret=secret,
            allowed_clients=cfg.get("api", "allowed_clients"), max_request_bytes=cfg.get("api", "max_request_bytes"),
            workers=cfg.get("api", "workers"), max_pending=cfg.get("api", "max_pending"),
            on_call=self.metrics.call).start()

    def run(self) -> None:
        """Heartbeat (rewrite the health file) until stop() is called."""
        interval = self.config.get("agent", "heartbeat_interval")
        beat = time.monotonic()
        # Short waits: a signal handler runs only between waits, and stop must not lag a heartbeat.
        while not self._stop.wait(0.1):
            if time.monotonic() - beat < interval:
                continue
            beat = time.monotonic()
            lost = self._run_files_lost()
            if lost:
                # Unreachable for good: no client finds the socket, and `agent status`/`stop` do not see
                # this process, while `agent start` is refused (it still holds the identity). Stopping
                # cleanly lets the agent be started again (a client with spawn=True does so itself).
                event(log, logging.ERROR, "the agent's run directory was removed or replaced; stopping so that "
                      "it can be started again", socket_dir=str(self.config.socket_dir), missing=lost)
                self.run_files_lost = True
                self.stop(f"its {lost} in {self.config.socket_dir} was removed or replaced")
                break
            if self.journal is not None and not self.journal.files_present():
                # A quiet group gives no append to fail: without this the agent ran on, reading files that
                # are gone, and `agent status` said all was well until the next message stopped it.
                event(log, logging.ERROR, "the journal's files were removed under the running agent; stopping so "
                      "that it can be started again with a new journal (publishers re-send what it did not "
                      "acknowledge)", journal_dir=str(self.config.journal_dir))
                self.journal_lost = True
                self.stop(f"its journal in {self.config.journal_dir} was removed")
                break
            try:
                if self._lock is not None and self._lock.keep_named():
                    event(log, logging.WARNING, "the pid file no longer named this agent (changed in place); "
                          "it names it again", pid_file=str(self.config.socket_dir / PID_FILE))
            except OSError as exc:
                log.warning("cannot check the pid file: %s", exc.strerror)
            try:
                self.write_health("running")
            except OSError as exc:
                log.warning("cannot write the health file: %s", exc.strerror)
        event(log, logging.INFO, "agent stopping", reason=self.stop_reason or None)

    def _run_files_lost(self) -> str:
        """What of the run directory this agent no longer finds there ("" when all is in place)."""
        if self._lock is not None and not self._lock.held_file_present():
            return "pid file"
        if self.server is not None and not self.server.socket_file_present():
            return "API socket"
        return ""

    def stop(self, reason: str = "") -> None:
        """Ask run() to return (safe from a signal handler or another thread)."""
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        """Stop serving and release everything, in reverse start order; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        timeout = self.config.get("agent", "stop_timeout")
        if self._lock is not None:
            try:
                self.write_health("stopping")
            except OSError:
                pass
        steps: list[tuple[str, Any]] = [
            ("long polls", lambda: self.ingest.end_waits() if self.ingest else None),
            # Running calls get half the stop timeout to finish and answer; the rest is for the parts below.
            ("api", lambda: self.server.close(timeout=max(1.0, timeout / 2)) if self.server else None),
            # The member closes its group manager first: no delivery reaches the journal after this.
            ("member", lambda: self.member.close() if self.member else None),
            # Own messages the group acked before it closed go into the journal before it closes.
            ("ingest", lambda: self.ingest.close(drain_timeout=max(1.0, timeout / 4)) if self.ingest else None),
            ("journal", lambda: self.journal.close() if self.journal else None),
            ("run files", lambda: self._lock.release() if self._lock else None),
            ("spare descriptors", self._release_spare_fds),
        ]
        for name, step in steps:
            began = time.monotonic()
            try:
                step()
                log.debug("closed the %s in %.3fs", name, time.monotonic() - began)
            except Exception as exc:  # noqa: BLE001 - close the rest anyway
                event(log, logging.WARNING, "closing a part of the agent failed", part=name,
                      error=type(exc).__name__, reason=str(exc)[:300])
        if self._started:  # one that never started logged why it did not; "stopped" would mislead
            event(log, logging.INFO, "agent stopped", reason=self.stop_reason or None)

    def _release_spare_fds(self) -> None:
        with self._spare_lock:
            spare, self._spare_fds = self._spare_fds, []
        for fd in spare:
            try:
                os.close(fd)
            except OSError:
                pass

    # --- health ---------------------------------------------------------------------------------

    def health(self, state: str = "running") -> dict[str, Any]:
        """What the health file and the `status` call say about this agent."""
        endpoints: dict[str, Any] = {}
        if self.server is not None:
            endpoints["api"] = self.server.ipc_endpoint
            if self.server.tcp_endpoint:
                endpoints["api_tcp"] = self.server.tcp_endpoint
                endpoints["api_public_key"] = self.server.public_key
        if self.member is not None and not self.member.closed:
            endpoints["peer"] = self.member.endpoint
        group_endpoint = None
        groups: list[str] = []
        did = None
        if self.groups is not None:
            try:
                did = self.groups.did
                group_endpoint = self.groups.dataplane.publish_endpoint
                groups = list(self.groups.groups())
            except Exception:  # noqa: BLE001 - health must never fail on a part that is closing
                pass
        if group_endpoint:
            endpoints["group"] = group_endpoint
        return {
            "pid": os.getpid(),
            "state": state,
            "label": self.member.label if self.member is not None else None,
            "did": did,
            "host": socket.gethostname(),
            "identity_dir": str(self.config.identity_dir),
            "socket_dir": str(self.config.socket_dir),
            "journal_dir": str(self.config.journal_dir),
            "endpoints": endpoints,
            "started_at": self.started_at,
            "groups": groups,
            "version": VERSION,
        }

    def write_health(self, state: str) -> None:
        if self._lock is None:
            raise ConfigurationError("the run directory is not held")
        self._lock.write_health(self.health(state))

    @property
    def run_dir(self) -> Path:
        return self.config.socket_dir
