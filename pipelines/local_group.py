"""A group of real members on this machine, for the main job, the notebook, tests and benchmarks.

Two ways to run the members, both real (identity, keystore, journal, data plane, local API):

* ``embedded`` (default): each member is an :class:`~zerocomm_spark.agent.process.AgentProcess`
  inside this Python process: seconds to start, and the publishing side can sign origin proofs with
  the member key it holds (pipelines/origin.py).
* ``agents``: each member is a detached agent process started through the ``zerocomm`` command
  (connector.local_members), exactly as a user runs one. The member key never leaves the agent, so
  :meth:`GroupMember.publish` asks the agent to sign (``publish`` with ``sign=True``).

Either way Spark reaches a member through its API socket (format("zerocomm")'s ``agent`` option),
and everything else goes through :class:`~zerocomm_spark.client.Client`, so the two modes differ
only in where the member runs.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from zerocomm_spark.errors import ConfigurationError, GroupError
from zerocomm_spark.pipelines.origin import OriginSigner

if TYPE_CHECKING:
    from zerocomm_spark.agent.process import AgentProcess
    from zerocomm_spark.client import Client, PublishResult
    from zerocomm_spark.connector.local_members import LocalMember

__all__ = ["GroupMember", "LocalGroup", "Mode"]

log = logging.getLogger("zerocomm_spark.pipelines.local_group")

Mode = Literal["embedded", "agents"]
MODES: tuple[str, ...] = ("embedded", "agents")


@dataclass
class GroupMember:
    """One member of a :class:`LocalGroup`."""

    label: str
    agent: str  # what format("zerocomm")'s agent option takes for this member
    client: Client
    did: str = ""
    signer: OriginSigner | None = None
    process: AgentProcess | None = field(default=None, repr=False)
    local: LocalMember | None = field(default=None, repr=False)

    def publish(self, group: str, payloads: Sequence[bytes], *, message_ids: Sequence[str] | None = None,
                headers: Sequence[Mapping[str, str] | None] | None = None, timeout: float = 60.0) -> PublishResult:
        """Publish through the member's API (returns once the group acknowledged), origin-signed: here
        with the member key when this process holds it (embedded), else by the agent (sign=True)."""
        ids = list(message_ids) if message_ids is not None else [uuid.uuid4().hex for _ in payloads]
        heads: list[Mapping[str, str] | None] = list(headers) if headers is not None else [None] * len(payloads)
        sign = self.signer is None  # the agent process holds the key: it signs
        if self.signer is not None:
            heads = [self.signer.headers(group, mid, p, h) for mid, p, h in zip(ids, payloads, heads)]
        if all(h is None for h in heads):
            return self.client.publish(group, list(payloads), message_ids=ids, timeout=timeout, sign=sign)
        return self.client.publish(group, list(payloads), message_ids=ids, headers=heads, timeout=timeout, sign=sign)


def _embedded(base: Path, socket_root: Path, label: str) -> GroupMember:
    from zerocomm_spark.agent import config as config_mod
    from zerocomm_spark.agent.process import AgentProcess
    from zerocomm_spark.client import Client

    home = base / label
    home.mkdir(parents=True, exist_ok=True)
    socket_dir = socket_root / label
    config_file = home / "zerocomm.toml"
    flags = [f"identity.dir={home / 'id'}", f"identity.label={label}", f"api.socket_dir={socket_dir}",
             "journal.fsync=never"]
    cfg = config_mod.load(str(config_file), env={}, flags=flags, missing_ok=True)
    config_file.write_text(config_mod.render_toml(cfg.values), encoding="utf-8")
    config_file.chmod(0o600)
    process = AgentProcess(cfg).start()
    client = Client.connect(str(socket_dir), timeout=30.0, call_timeout=60.0)
    return GroupMember(label=label, agent=str(socket_dir), client=client, process=process)


def _member_signer(process: AgentProcess) -> OriginSigner:
    """The member key, read from the member's own keystore: it is this process's member."""
    from zerocomm_spark.group.store import GroupStore

    member = process.member
    assert member is not None
    keystore = member.keystore
    verkey = GroupStore(keystore).identity().member_verkey
    return OriginSigner(keystore.get(verkey), member.groups.did)


class LocalGroup:
    """A group of members on loopback; ``start`` builds it, ``close`` stops every member."""

    def __init__(self, group: str, mode: Mode, base: Path, socket_root: Path, *, owns_base: bool) -> None:
        self.group = group
        self.mode = mode
        self.base = base
        self.socket_root = socket_root
        self.members: dict[str, GroupMember] = {}
        self._owns_base = owns_base
        self._closed = False

    @classmethod
    def start(cls, labels: Sequence[str], *, group: str = "demo", mode: Mode = "embedded",
              base_dir: str | Path | None = None, group_mode: str = "shared", timeout: float = 120.0) -> "LocalGroup":
        """Start a member per label; the first creates ``group`` and the others join through it."""
        if mode not in MODES:
            raise ConfigurationError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if len(set(labels)) != len(labels) or not labels:
            raise ConfigurationError(f"members need distinct labels, got {list(labels)}")
        owns = base_dir is None
        base = Path(tempfile.mkdtemp(prefix="zerocomm-group-")) if base_dir is None else Path(base_dir).absolute()
        base.mkdir(parents=True, exist_ok=True)
        # AF_UNIX paths are short (103 bytes): sockets go under /tmp whatever the base directory.
        socket_root = Path(tempfile.mkdtemp(prefix="zc-", dir="/tmp"))
        self = cls(group, mode, base, socket_root, owns_base=owns)
        try:
            for member in self._launch(list(labels)):
                self.members[member.label] = member
            first = self.members[labels[0]]
            first.client.create(group, mode=group_mode, timeout=timeout)
            for label in labels[1:]:
                self._join(self.members[label], first, timeout)
            for member in self.members.values():
                self._identify(member)
        except BaseException:
            self.close()
            raise
        return self

    def _launch(self, labels: list[str]) -> list[GroupMember]:
        if self.mode == "embedded":
            return [_embedded(self.base, self.socket_root, label) for label in labels]
        from zerocomm_spark.connector.local_members import LocalMember

        def one(label: str) -> GroupMember:
            local = LocalMember.create(self.base, label, socket_root=self.socket_root)
            local.start()
            return GroupMember(label=label, agent=str(local.config), client=local.client(60.0), local=local)

        with ThreadPoolExecutor(max_workers=min(4, len(labels))) as pool:
            return list(pool.map(one, labels))

    def _join(self, member: GroupMember, via: GroupMember, timeout: float, group: str | None = None) -> None:
        peer = next((str(c.get("id") or c.get("connection_id")) for c in member.client.connections(timeout=timeout)
                     if c.get("label") == via.label and c.get("state") == "completed"), None)
        if peer is None:  # one DID exchange per pair, whatever the number of groups
            conn = member.client.accept(via.client.invite(timeout=timeout), timeout=timeout)
            peer = str(conn.get("id") or conn.get("connection_id") or via.label)
        deadline = time.monotonic() + timeout
        while True:
            try:
                member.client.join(group or self.group, via=peer, timeout=max(deadline - time.monotonic(), 1.0))
                return
            except GroupError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)  # the acceptor may still be settling the previous join

    def _identify(self, member: GroupMember, group: str | None = None) -> None:
        for entry in member.client.members(group or self.group):
            if entry.get("is_self"):
                member.did = str(entry["did"])
        if member.process is not None:
            member.signer = _member_signer(member.process)

    def add_group(self, group: str, labels: Sequence[str] | None = None, *, group_mode: str = "shared",
                  timeout: float = 120.0) -> None:
        """Another group among the same members (the first label creates it), e.g. one per test."""
        names = list(labels) if labels is not None else list(self.members)
        first = self.members[names[0]]
        first.client.create(group, mode=group_mode, timeout=timeout)
        for label in names[1:]:
            self._join(self.members[label], first, timeout, group)

    def add_member(self, label: str, *, via: str | None = None, groups: Sequence[str] | None = None,
                   timeout: float = 120.0) -> GroupMember:
        """A member that joins now (a late joiner: it gets only what is published from now on)."""
        if label in self.members:
            raise ConfigurationError(f"{label!r} is already a member")
        member = self._launch([label])[0]
        self.members[label] = member
        acceptor = self.members[via] if via else next(iter(self.members.values()))
        joined = list(groups or [self.group])
        for group in joined:
            self._join(member, acceptor, timeout, group)
        self._identify(member, joined[0])
        return member

    def __getitem__(self, label: str) -> GroupMember:
        return self.members[label]

    def publish(self, label: str, payloads: Sequence[bytes], **kwargs: Any) -> PublishResult:
        return self.members[label].publish(self.group, payloads, **kwargs)

    def stop_member(self, label: str) -> None:
        """Stop one member (its identity and journal stay on disk)."""
        member = self.members.pop(label)
        _stop(member)

    def close(self) -> None:
        """Stop every member and remove what ``start`` created (the base directory if it made it)."""
        if self._closed:
            return
        self._closed = True
        for member in list(self.members.values()):
            _stop(member)
        self.members.clear()
        shutil.rmtree(self.socket_root, ignore_errors=True)
        if self._owns_base:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "LocalGroup":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _stop(member: GroupMember) -> None:
    try:
        member.client.close()
    except Exception:  # noqa: BLE001 - stopping must go on
        pass
    if member.process is not None:
        member.process.close()
    if member.local is not None:
        member.local.stop()
