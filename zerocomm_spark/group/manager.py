"""ZeroComm groups of one agent: create, join, leave, roles, views that converge, and messages.

``agent.groups`` is a :class:`GroupManager`. It speaks the group membership protocol
(``protocols/group/v1_0``) over the agent's DIDComm connections and drives one
:class:`~zerocomm_spark.group.dataplane.DataPlane` (pub/sub sockets, encryption, reliability).

Why the flows are shaped this way (docs/groups.md; thesis 5.2, 7.2):

* **No privileged member.** Any active member accepts joiners; every member applies its own
  admission policy when a joiner subscribes to it; only a member changes its own entry.
* **Join** (thesis figure 20, made verifiable): join-request to the acceptor, who answers with its
  view, checksum and a signed ticket; DID exchange with every member not yet connected, in
  parallel, through the multi-use invitation each announced in its signed entry; a subscribe to
  each (exchanging transport keys and publish endpoints; the member applies its policy); the
  checksums of all views compared *before* this member admits anyone to its sockets, so an
  intruder put in a byzantine acceptor's view never gets a socket; probing (hello until acked, so
  no first message is lost to a slow connect); then the active status to the group.
* **Views converge** without a coordinator: status messages on the state topic (best effort),
  plus periodic digests to a random member with a pull of what differs, plus direct pushes for
  changes that must not be missed (role switch, leave). A member learning of a member it has no
  relationship with (two joins that raced) connects to it if its DID sorts first.
* **Restart** is rejoin with the same identity: the keystore holds the member key, transport key,
  group keys, views, relationships and stream positions; the member re-subscribes, continues its own
  sequence after the highest seq any member saw from it (if one is not reached, after every seq it
  may have used: its reservation), and asks every publisher for what it missed.
* Every wait has a deadline. Logs name DIDs, labels and error classes; never keys or payloads.
"""

from __future__ import annotations

import logging
import queue
import random
import shlex
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from zerocomm_spark.connections import ConnectionRecord, ConnectionStore
from zerocomm_spark.deadlines import check_timeout
from zerocomm_spark.errors import (
    AgentClosedError,
    ConfigurationError,
    ConnectionNotReadyError,
    DeliveryDeferredError,
    EnvelopeError,
    GroupError,
    GroupExistsError,
    GroupNotFoundError,
    InconsistentViewError,
    JoinRefusedError,
    MalformedGroupMessageError,
    PeerTimeoutError,
    ReceiveTimeoutError,
    SignatureError,
    ZeroCommError,
)
from zerocomm_spark.group.datamessage import MAX_SEQ
from zerocomm_spark.group.lamport import MAX_TIME, LamportClock
from zerocomm_spark.group.origin import OriginSigner
from zerocomm_spark.group.dataplane import MODES, ROLES, DataPlane, DataPlaneConfig, Delivered, PublishReceipt, RemoteMember
from zerocomm_spark.group.policy import AdmissionPolicy, AdmissionRequest, OpenPolicy, Ticket, policy_from_dict
from zerocomm_spark.group.proof import connection_proof, proves_connection
from zerocomm_spark.group.store import GROUP_KEY_PURPOSE, GroupRecord, GroupStore, Positions
from zerocomm_spark.group.topics import check_group
from zerocomm_spark.group.view import (
    ACTIVE,
    INACTIVE,
    JOINING,
    LEFT,
    GroupView,
    MemberEntry,
    StatusSection,
    member_did_for,
    next_version,
    open_status,
    parse_entries,
    seal_status,
)
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.group.v1_0.messages import (
    DESCRIPTOR,
    Digest,
    DigestResponse,
    GroupProblemReport,
    JoinRequest,
    JoinResponse,
    Leave,
    ProblemCode,
    Subscribe,
    SubscribeResponse,
    ViewUpdate,
)
from zerocomm_spark.protocols.message import AgentMessage, Thread
from zerocomm_spark.protocols.out_of_band.v1_1.manager import OutOfBandManager
from zerocomm_spark.transport.peer import PeerTransport

if TYPE_CHECKING:
    from zerocomm_spark.member import Agent

__all__ = ["GroupConfig", "GroupInfo", "GroupManager", "MemberInfo"]

log = logging.getLogger(__name__)

#: Entries heard of second-hand (not yet in the view) kept per group for _introduce, at most.
MAX_PENDING = 1024
#: ... and at most this many of them vouched for by any one member (so its vouching evicts its own).
MAX_PENDING_PER_VOUCHER = 64

_NO_PROOF = ("the request does not prove it comes from the entry's member over this connection (entries are "
             "public: anyone can send one)")

#: Positions of our stream that members report above this are not believed: continuing after one
#: would leave no usable seqs (every batch refused as malformed past 2**63-1), so a faulty or
#: hostile member could silence our stream for everyone.
MAX_REPORTED_POSITION = MAX_SEQ // 2

#: Lamport ticks each saved reservation of the clock covers: a restart moves the clock up to this far
#: ahead (timestamps need not be contiguous), and saving costs one keystore write per this many.
CLOCK_RESERVE = 1 << 20

#: Seqs each saved reservation of a group's sequence covers: one keystore write per this many
#: messages, and after a crash with a member unreachable the restart skips up to this many (void).
SEQ_RESERVE = 1 << 16

MEMBER_GOAL = "zerocomm.group.member"  # the multi-use invitation each member announces in its entry
JOIN_GOAL = "zerocomm.group.join"  # invitations issued for a group with invite(group)
# Runtime phases of a group at this member.
_JOINING, _RESUMING, _ACTIVE, _LEAVING = "joining", "resuming", "active", "leaving"


@dataclass(frozen=True)
class GroupConfig:
    """Timings and limits of group membership; the data plane has its own ``dataplane`` config."""

    publish_bind: str | None = None  # None: the agent's host, any port (the same port again after a restart)
    request_timeout_s: float = 10.0  # one membership request to one member
    resume_timeout_s: float = 5.0  # re-subscribing to one member after a restart
    consistency_wait_s: float = 3.0  # how long a joiner lets disagreeing views settle (racing joins)
    digest_interval_s: float = 2.0  # view repair: a digest to a random member this often
    pair_retry_s: float = 5.0  # a failed attempt to connect to a member found by repair is retried after this
    persist_interval_s: float = 0.5  # stream positions are written at most this often
    joining_ttl_s: float = 120.0  # a joiner that never announced itself active is dropped after this
    probe_timeout_s: float = 10.0
    push_timeout_s: float = 5.0  # direct pushes of a leave or role switch
    parallelism: int = 16  # concurrent DID exchanges and subscribes of one join
    history_max: int = 10_000  # messages(group) keeps this many per group (0: none)
    inbox_max: int = 100_000  # receive() buffers this many per group (0: none); on_message never drops
    # ... and at most this many payload bytes (the newest message always): drops the oldest as the counts do
    history_max_bytes: int = 64 * 1024 * 1024
    inbox_max_bytes: int = 256 * 1024 * 1024
    default_policy: Mapping[str, Any] = field(default_factory=lambda: OpenPolicy().to_dict())
    dataplane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    # Deliver every group's messages here in each publisher's seq order, an unordered group's too (held
    # back until a hole is filled). A journal needs it (the agent's): it keeps one publisher's seqs in
    # order and takes a seq at or below its last as a duplicate, so a hole filled late, after the seqs
    # above it, was dropped there - and acknowledged. What other members deliver does not change.
    fifo: bool = False

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "resume_timeout_s", "consistency_wait_s", "digest_interval_s",
                     "pair_retry_s", "persist_interval_s", "joining_ttl_s", "probe_timeout_s", "push_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigurationError(f"GroupConfig.{name} must be a positive number of seconds, got {value!r}")
        for name in ("parallelism", "history_max", "inbox_max", "history_max_bytes", "inbox_max_bytes"):
            value = getattr(self, name)
            least = 0 if name in ("history_max", "inbox_max") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigurationError(f"GroupConfig.{name} must be an integer of at least {least}, got {value!r}")
        if not isinstance(self.fifo, bool):
            raise ConfigurationError(f"GroupConfig.fifo must be True or False, got {self.fifo!r}")
        policy_from_dict(self.default_policy)


@dataclass(frozen=True)
class MemberInfo:
    """A member as this member sees it; ``status`` is active, inactive (keepalives fail), joining or left."""

    did: str
    label: str
    role: str
    status: str
    is_self: bool
    connected: bool  # this member has a pub/sub relationship with it
    publish_endpoint: str
    peer_endpoint: str
    version: int

    def __repr__(self) -> str:  # DIDs are long; who, what role and which state is what a reader wants
        me = ", self" if self.is_self else ""
        return f"MemberInfo({self.label!r}, {self.role}, {self.status}{me})"


@dataclass(frozen=True)
class GroupInfo:
    """A group's settings and its members, as this member sees them."""

    group: str
    mode: str
    ordered: bool
    consistent_join: bool
    role: str
    status: str
    did: str
    checksum: str
    policy: dict[str, Any]
    members: tuple[MemberInfo, ...]

    def __repr__(self) -> str:
        members = ", ".join(f"{m.label}({m.role}, {m.status})" for m in self.members)
        return (f"GroupInfo({self.group!r}, mode={self.mode}, ordered={self.ordered}, "
                f"consistent_join={self.consistent_join}, role={self.role}, status={self.status}, "
                f"members=[{members}])")


class _Pending:
    """Entries of members heard of only second-hand, by DID, in arrival order, grouped by the member
    whose ticket vouches for them (checked on the way in, see GroupManager._apply).

    At most ``per_voucher`` per voucher (its oldest out) and ``total`` in all: when full, the oldest
    of the voucher holding the most goes, so a voucher holding no more than its fair share
    (``total`` over the vouchers with entries here) loses none to another's vouching.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[MemberEntry, str]] = {}  # DID -> (entry, voucher)
        self._by: dict[str, dict[str, None]] = {}  # voucher -> its DIDs, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, did: str) -> MemberEntry | None:
        held = self._entries.get(did)
        return held[0] if held is not None else None

    def values(self) -> list[MemberEntry]:
        return [entry for entry, _ in self._entries.values()]

    def pop(self, did: str) -> MemberEntry | None:
        held = self._entries.pop(did, None)
        if held is None:
            return None
        entry, voucher = held
        bucket = self._by[voucher]
        del bucket[did]
        if not bucket:
            del self._by[voucher]
        return entry

    def put(self, entry: MemberEntry, voucher: str, *, per_voucher: int, total: int) -> None:
        self.pop(entry.did)
        while len(self._by.get(voucher, ())) >= per_voucher:
            self.pop(next(iter(self._by[voucher])))
        while self._entries and len(self._entries) >= total:
            fullest = max(self._by.values(), key=len)
            own = self._by.get(voucher)
            victim = own if own is not None and len(own) >= len(fullest) else fullest
            self.pop(next(iter(victim)))
        self._entries[entry.did] = (entry, voucher)
        self._by.setdefault(voucher, {})[entry.did] = None


@dataclass
class _Pair:
    """A member this member subscribed to during a join, resume or repair."""

    entry: MemberEntry
    record: ConnectionRecord
    checksum: str
    position: int
    your_version: int


class _Group:
    """What the manager keeps for one group at runtime."""

    def __init__(self, record: GroupRecord, view: GroupView, policy: AdmissionPolicy, group_key: KeyPair,
                 phase: str, history_max: int) -> None:
        self.record = record
        self.view = view
        self.policy = policy
        self.group_key = group_key
        self.phase = phase
        self.ready = threading.Event()
        self.history: deque[Delivered] = deque(maxlen=history_max)
        self.history_bytes = 0  # payload bytes in history and inbox
        self.inbox: deque[tuple[int, Delivered]] = deque()
        self.inbox_bytes = 0
        self.inbox_dropped = 0
        self.pair_after: dict[str, float] = {}  # repair: DID -> when to try connecting again
        # Members heard of only second-hand (repair): kept apart until a member we know vouches for them.
        self.pending = _Pending()
        self.repairing = False
        self.saved_positions: Positions | None = None

    @property
    def name(self) -> str:
        return self.record.group

    def settings(self) -> dict[str, Any]:
        return {"mode": self.record.mode, "ordered": self.record.ordered, "consistent_join": self.record.consistent_join}


def _take_next(g: _Group) -> Delivered:
    """The oldest message of the group's receive() buffer, taken out of it (caller holds the lock)."""
    message = g.inbox.popleft()[1]
    g.inbox_bytes -= len(message.payload)
    return message


def _our_invitation(record: ConnectionRecord) -> str | None:
    """The invitation of ours the connection answered, if any. Where we accepted theirs (we are the
    requester), its invitation id is the peer's: whatever it chose, a copy of one of ours included."""
    return record.invitation_id if record.role == "responder" else None


def _problem(request: AgentMessage, code: str, explain: str) -> GroupProblemReport:
    return GroupProblemReport(code=code, explain=explain[:1000], thread=Thread(thid=request.id))


def _parse_settings(data: Mapping[str, Any]) -> tuple[str, bool, bool]:
    mode, ordered, consistent = data.get("mode"), data.get("ordered"), data.get("consistent_join")
    if mode not in MODES or not isinstance(ordered, bool) or not isinstance(consistent, bool):
        raise MalformedGroupMessageError("field 'settings' must name a mode and booleans 'ordered', 'consistent_join'")
    return mode, ordered, consistent


def _host(endpoint: str) -> str:
    try:
        return urlsplit(endpoint).hostname or "127.0.0.1"
    except ValueError:
        return "127.0.0.1"


class GroupManager:
    """The groups of one agent; get it as ``agent.groups``.

    Thread-safe. Membership calls (create, join, leave, switch_role) block until done or their
    deadline; delivery runs on the data plane's receiver thread, so ``on_message`` callbacks must
    be quick (a slow callback is backpressure on publishers, never loss).
    """

    def __init__(self, agent: "Agent", *, keystore: Keystore, transport: PeerTransport,
                 connections: ConnectionStore, config: GroupConfig | None = None) -> None:
        self._agent = agent
        self._keystore = keystore
        self._transport = transport
        self._connections = connections
        self.config = config or GroupConfig()
        if not isinstance(self.config, GroupConfig):
            raise ConfigurationError("config must be a GroupConfig")
        self._store = GroupStore(keystore)
        self._lock = threading.RLock()
        self._groups: dict[str, _Group] = {}
        self._reserved: set[str] = set()
        self._listeners: list[Callable[[Delivered], None]] = []
        self._batch_listeners: list[Callable[[list[Delivered]], None]] = []
        self._superseded_listeners: list[Callable[[str, str, list[int]], None]] = []
        # (group, publisher) -> {(seq, message id): the listeners that took it} for messages of a batch
        # a listener raised for: the publisher re-sends them, and they go only to the others then.
        self._taken: dict[tuple[str, str], dict[tuple[int, str], list[Any]]] = {}
        self._arrivals = 0
        self._inbox_cond = threading.Condition(self._lock)
        self._control: queue.Queue[Callable[[], None] | None] = queue.Queue()
        # Status blobs waiting for the control thread, the latest per (group, member it came from): a
        # status carries only its sender's latest entry, so an older one waiting adds nothing. One
        # queued task per pair, so a member flooding the state topic (tiny zstd frames that inflate
        # to 16 MiB, ~75 ms each to open) holds one place, not an unbounded backlog in front of the
        # others' statuses.
        self._status_waiting: dict[tuple[str, str], bytes] = {}
        self.status_superseded = 0  # status blobs replaced by a later one of their sender before handling
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        # Two pools, so a job that fans out and waits (resume, repair, pairing) never waits on a task
        # queued behind itself: jobs submit to _io, _io tasks submit nothing.
        self._io = ThreadPoolExecutor(max_workers=self.config.parallelism, thread_name_prefix="zerocomm-groups-io")
        self._jobs = ThreadPoolExecutor(max_workers=4, thread_name_prefix="zerocomm-groups-job")
        self._started = False
        self._closed = False
        identity = self._store.identity()
        self._identity = identity
        self._member_key = keystore.get(identity.member_verkey)
        self.did = member_did_for(identity.member_verkey)
        self._origin_signer: OriginSigner | None = None
        self._dataplane: DataPlane | None = None
        # Durable across restarts: it starts at the last reservation saved (lamport.py).
        self._clock = LamportClock(self._store.clock_reserved(), reserve=self._reserve_clock)

    def _reserve_clock(self, time_now: int) -> int:
        """Save a limit ahead of the Lamport clock (one keystore write per CLOCK_RESERVE ticks)."""
        limit = min(time_now + CLOCK_RESERVE, MAX_TIME)
        self._store.save_clock_reserved(limit)
        return limit

    def _seq_reserver(self, group: str) -> Callable[[int], int]:
        """Saves a limit ahead of our sequence in ``group`` before a seq past the last one is used, so
        a restart after a crash knows every seq it may have used (one write per SEQ_RESERVE seqs)."""
        def reserve(seq: int) -> int:
            limit = min(seq + SEQ_RESERVE, MAX_SEQ)
            self._store.save_seq_reserved(group, limit)
            return limit

        return reserve

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "GroupManager":
        """Start the data plane, serve the membership protocol and rejoin the groups kept from last time."""
        if self._started:
            return self
        self._started = True
        self._dataplane = self._start_dataplane()
        try:
            self._store.save_publish_endpoint(self._dataplane.publish_endpoint)
            self._agent.register_protocol(
                DESCRIPTOR,
                {JoinRequest: self._on_join_request, Subscribe: self._on_subscribe, Digest: self._on_digest,
                 ViewUpdate: self._on_view_update, Leave: self._on_leave},
                replies=(JoinResponse, SubscribeResponse, DigestResponse, GroupProblemReport),
            )
        except BaseException:
            self._dataplane.close()
            raise
        thread = threading.Thread(target=self._control_main, name="zerocomm-groups-control", daemon=True)
        thread.start()
        self._threads.append(thread)
        for record in self._store.groups():
            if record.status != ACTIVE:
                log.warning("group %r: the join did not finish before the restart; forgetting it", record.group)
                self._store.delete(record.group)
                continue
            try:
                g = self._load(record)
            except ZeroCommError as exc:
                log.error("group %r cannot be restored (%s); forgetting it", record.group, type(exc).__name__)
                continue
            with self._lock:
                self._groups[g.name] = g
            self._jobs.submit(self._resume, g)
        return self

    def _start_dataplane(self) -> DataPlane:
        config = self.config
        wildcard = f"tcp://{_host(self._agent.endpoint)}:*"
        saved = self._identity.publish_endpoint
        candidates = [config.publish_bind] if config.publish_bind else (
            [saved, wildcard] if saved and _host(saved) == _host(wildcard) else [wildcard])
        last: ZeroCommError | None = None
        for bind in candidates:
            assert bind is not None
            plane = DataPlane(member_did=self.did, keystore=self._keystore, transport=self._transport,
                              curve_keypair=(self._identity.curve_public, self._identity.curve_secret),
                              publish_bind=bind, on_deliver=self._on_deliver, on_state=self._on_state,
                              config=config.dataplane, on_deliver_many=self._on_deliver_many,
                              on_superseded=self._on_superseded, clock=self._clock)
            try:
                return plane.start()
            except ConfigurationError as exc:
                last = exc
                log.warning("cannot bind the group publish endpoint %s again; members will learn a new one", bind)
        assert last is not None
        raise last

    def close(self) -> None:
        """Persist positions, stop the data plane and the background work; groups are kept for a restart."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            groups = list(self._groups.values())
            self._inbox_cond.notify_all()
        self._closing.set()
        self._control.put(None)
        for g in groups:
            try:
                self._persist_positions(g, force=True)
            except ZeroCommError as exc:
                log.warning("group %r: positions not saved at close (%s)", g.name, type(exc).__name__)
        self._jobs.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._dataplane is not None:
            self._dataplane.close()
            for g in groups:  # closed: nothing more is published, so the reservation can be exact
                if g.phase == _ACTIVE:
                    try:
                        self._store.save_seq_reserved(g.name, self._dataplane.publish_position(g.name))
                    except ZeroCommError as exc:
                        log.warning("group %r: last seq not saved at close (%s)", g.name, type(exc).__name__)
        for thread in self._threads:
            thread.join(5.0)
        log.info("groups of %s closed", self.did)

    def __repr__(self) -> str:
        return f"GroupManager(did={self.did!r}, groups={sorted(self._groups)!r})"

    @property
    def dataplane(self) -> DataPlane:
        if self._dataplane is None:
            raise GroupError("the group manager is not started")
        return self._dataplane

    def origin_signer(self) -> OriginSigner:
        """Signs origin proofs (group/origin.py) with this member's member key, whose did:key is
        :attr:`did`, the publisher DID every member sees on what this member publishes. The key
        stays here: callers get signatures, never the key."""
        if self._origin_signer is None:
            self._origin_signer = OriginSigner(self._member_key, self.did)
        return self._origin_signer

    def _check_open(self) -> None:
        if self._closed or self._agent.closed:
            raise AgentClosedError("the agent (and its groups) is closed")

    # --- queries ---------------------------------------------------------------------------------

    def groups(self) -> list[str]:
        """The names of this member's groups."""
        with self._lock:
            return sorted(self._groups)

    def info(self, group: str) -> GroupInfo:
        """Mode, ordering, consistency setting, our role and status, and the members."""
        g = self._group(group, phases=None)
        with self._lock:
            record = g.record
            return GroupInfo(group=record.group, mode=record.mode, ordered=record.ordered,
                             consistent_join=record.consistent_join, role=record.role, status=g.phase,
                             did=self.did, checksum=g.view.checksum(), policy=dict(record.policy),
                             members=tuple(self._member_infos(g, include_left=False)))

    def members(self, group: str, *, include_left: bool = False) -> list[MemberInfo]:
        """Every member with its role and status (inactive: its keepalives stopped answering)."""
        g = self._group(group, phases=None)
        with self._lock:
            return self._member_infos(g, include_left=include_left)

    def _member_infos(self, g: _Group, *, include_left: bool) -> list[MemberInfo]:
        alive = self.dataplane.stats().get("peers_alive", {}) if self._dataplane is not None else {}
        out = []
        for e in g.view.entries():
            if e.status == LEFT and not include_left:
                continue
            status = e.status
            if status == ACTIVE and alive.get(e.did) is False:
                status = INACTIVE
            out.append(MemberInfo(did=e.did, label=e.label, role=e.role, status=status, is_self=e.did == self.did,
                                  connected=e.did in g.record.peers, publish_endpoint=e.publish_endpoint,
                                  peer_endpoint=e.peer_endpoint, version=e.version))
        return out

    def _group(self, group: str, phases: tuple[str, ...] | None = (_ACTIVE,)) -> _Group:
        self._check_open()
        with self._lock:
            g = self._groups.get(group)
        if g is None:
            raise GroupNotFoundError(f"this member is in no group named {group!r}")
        if phases is not None and g.phase not in phases:
            raise GroupError(f"group {group!r} is {g.phase} here",
                             hint="Wait for it to become active: wait_active(group, timeout)")
        return g

    def wait_active(self, group: str, timeout: float = 30.0) -> GroupInfo:
        """Wait until the group is active here (after a restart it first rejoins its members)."""
        g = self._group(group, phases=None)
        if not g.ready.wait(timeout):
            raise PeerTimeoutError(f"group {group!r} did not become active within {timeout:g}s")
        return self.info(group)

    # --- create ----------------------------------------------------------------------------------

    def create(self, group: str, mode: str = "shared", ordered: bool = True, consistent_join: bool = True,
               role: str = "read_write", *, policy: AdmissionPolicy | Mapping[str, Any] | None = None) -> GroupInfo:
        """Create a group with this member as its only member (no privileges: any member accepts joiners).

        ``mode``: ``shared`` (one envelope for all), ``single`` (one topic, an envelope per member) or
        ``multi`` (a topic per publisher-subscriber pair). ``policy`` decides who this member admits.
        """
        self._check_open()
        check_group(group)
        if mode not in MODES:
            raise ConfigurationError(f"mode is one of {', '.join(MODES)}, got {mode!r}")
        if role not in ROLES:
            raise ConfigurationError(f"role is read_write or read_only, got {role!r}")
        the_policy = policy_from_dict(policy if policy is not None else self.config.default_policy)
        self._reserve(group)
        try:
            key = self._keystore.create_key(GROUP_KEY_PURPOSE, ref=group)
            url, invitation_id = self._member_invitation(group)
            record = GroupRecord(group=group, mode=mode, ordered=bool(ordered), consistent_join=bool(consistent_join),
                                 role=role, status=ACTIVE, group_verkey=key.verkey, invitation_url=url,
                                 invitation_id=invitation_id, policy=the_policy.to_dict())
            record.ticket = Ticket.issue(group, self.did, self._member_key).to_dict()
            g = _Group(record, GroupView(group), the_policy, key, _ACTIVE, self.config.history_max)
            self._bump_own(g, status=ACTIVE)
            # A group of the same name we left before: members of it may hold our old stream (and
            # their journals its seqs), so the new one continues after it.
            self.dataplane.open_group(group, mode=mode, ordered=self._in_order(record), group_key=key,
                                      role=role,  # type: ignore[arg-type]
                                      first_seq=self._store.left_position(group) + 1,
                                      reserve=self._seq_reserver(group))
            self._save(g)
            g.ready.set()
            with self._lock:
                self._groups[group] = g
        finally:
            self._release(group)
        log.info("created group %r (%s mode, %s, consistent_join=%s) as %s", group, mode,
                 "ordered" if ordered else "unordered", consistent_join, role)
        return self.info(group)

    def _reserve(self, group: str, *, joining: bool = False) -> None:
        with self._lock:
            if joining and group in self._groups and group not in self._reserved:
                # "already has a group named ...; pick another name" fits a create, not a join: the name
                # is the group's own, and this member is in it.
                raise GroupExistsError(
                    f"this member is already a member of group {group!r}",
                    hint=f"Nothing to do: it is in the group (`zerocomm group info {shlex.quote(group)}`, info(group)). "
                         f"To join it again (another role, through another member), leave it first (`zerocomm group "
                         f"leave {shlex.quote(group)}`, leave(group)), then join")
            if group in self._groups or group in self._reserved:
                raise GroupExistsError(f"this member already has a group named {group!r}")
            self._reserved.add(group)

    def _release(self, group: str) -> None:
        with self._lock:
            self._reserved.discard(group)

    def _member_invitation(self, group: str) -> tuple[str, str]:
        url = self._agent.invite(goal_code=MEMBER_GOAL, goal=group, multi_use=True)
        return url, OutOfBandManager.parse_url(url).id

    def invite(self, group: str, *, multi_use: bool = False) -> str:
        """An invitation issued for ``group``: whoever connects through it may join via this member
        under an :class:`~zerocomm_spark.group.policy.InvitationPolicy`."""
        g = self._group(group)
        url = self._agent.invite(goal_code=JOIN_GOAL, goal=group, multi_use=multi_use)
        with self._lock:
            g.record.issued_invitations.append(OutOfBandManager.parse_url(url).id)
        self._save(g)
        return url

    def set_policy(self, group: str, policy: AdmissionPolicy | Mapping[str, Any]) -> None:
        """Change who this member admits to ``group`` from now on (members already in stay)."""
        g = self._group(group, phases=None)
        the_policy = policy_from_dict(policy)
        with self._lock:
            g.policy = the_policy
            g.record.policy = the_policy.to_dict()
        self._save(g)

    # --- own entry and persistence -----------------------------------------------------------------

    def _bump_own(self, g: _Group, *, status: str | None = None, role: str | None = None,
                  floor: int = 0) -> MemberEntry:
        """A new signed version of our entry in ``g``'s view (caller persists and announces)."""
        with self._lock:
            old = g.view.get(self.did)
            entry = MemberEntry(
                did=self.did, label=self._agent.label, role=role or g.record.role,
                status=status or (old.status if old else JOINING), peer_endpoint=self._agent.endpoint,
                publish_endpoint=self.dataplane.publish_endpoint, group_verkey=g.group_key.verkey,
                transport_key=self._identity.curve_public.decode("ascii"), invitation=g.record.invitation_url,
                version=next_version(max(old.version if old else 0, floor)), ticket=g.record.ticket, group=g.name,
            ).signed(self._member_key)
            g.view.merge(entry)
            return entry

    def _own(self, g: _Group) -> MemberEntry:
        with self._lock:
            entry = g.view.get(self.did)
        assert entry is not None
        return entry

    def _save(self, g: _Group) -> None:
        with self._lock:
            if g.phase == _LEAVING:
                return
            g.record.view = g.view.to_list()
            data = GroupRecord.from_dict(g.record.to_dict())
        self._store.save(data)

    def _persist_positions(self, g: _Group, *, force: bool = False) -> None:
        if g.phase != _ACTIVE or self._dataplane is None:
            return
        try:
            positions = Positions(self._dataplane.publish_position(g.name), self._dataplane.positions(g.name))
        except GroupError:
            return
        if force or positions != g.saved_positions:
            self._store.save_positions(g.name, positions)
            g.saved_positions = positions

    def _load(self, record: GroupRecord) -> _Group:
        view = GroupView(record.group, parse_entries(record.view, verify=False, skip_invalid=True))
        key = self._keystore.get(record.group_verkey)
        g = _Group(record, view, policy_from_dict(record.policy), key, _RESUMING, self.config.history_max)
        g.saved_positions = self._store.positions(record.group)
        return g

    # --- helpers: connections and data-plane members -----------------------------------------------

    def _record(self, connection_id: str) -> ConnectionRecord | None:
        record = self._connections.find(connection_id)
        return record if record is not None and record.completed else None

    def _connection_for(self, did: str) -> ConnectionRecord | None:
        connection_id = self._store.peer_connection(did)
        return self._record(connection_id) if connection_id else None

    @staticmethod
    def _remote(entry: MemberEntry, record: ConnectionRecord) -> RemoteMember:
        if record.their_verkey is None or record.my_verkey is None:
            raise ConnectionNotReadyError(f"connection {record.connection_id} has no keys")
        return RemoteMember(did=entry.did, group_verkey=entry.group_verkey, relationship_verkey=record.their_verkey,
                            my_relationship_verkey=record.my_verkey, publish_endpoint=entry.publish_endpoint,
                            transport_key=entry.transport_key, peer_endpoint=entry.peer_endpoint, role=entry.role)

    def _add_member(self, g: _Group, entry: MemberEntry, record: ConnectionRecord) -> None:
        """Add (or update) ``entry`` on the data plane. A member still checking its join acks nothing
        until it completes, so it holds no publish window meanwhile (``_apply`` clears that after).

        The flag follows the view as it is now, read and set under the lock: ``entry`` may have been
        read before an ``_apply`` that merged the member's active entry and cleared the flag, and
        setting it from ``entry`` put it back for good (the member never held a window again).
        """
        self.dataplane.add_member(g.name, self._remote(entry, record))
        self._sync_joining(g, entry.did)

    def _sync_joining(self, g: _Group, did: str) -> None:
        """Set the data plane's joining flag of ``did`` from the view (the lock makes read and set one step)."""
        with self._lock:
            current = g.view.get(did)
            self.dataplane.set_joining(g.name, did, current is not None and current.status == JOINING)

    def _pair_did(self, g: _Group, record: ConnectionRecord) -> str | None:
        """The member DID we have a relationship with over this connection, in this group."""
        with self._lock:
            for did, connection_id in g.record.peers.items():
                if connection_id == record.connection_id:
                    return did
        return None

    def _sections(self, g: _Group) -> list[StatusSection]:
        out = []
        with self._lock:
            peers = list(g.record.peers.values())
        for connection_id in peers:
            record = self._record(connection_id)
            if record is None or record.thread_id is None or record.their_verkey is None or record.my_verkey is None:
                continue
            out.append(StatusSection(record.thread_id, record.their_verkey, self._keystore.get(record.my_verkey)))
        return out

    def _announce(self, g: _Group) -> None:
        """Our entry to every member we have a relationship with: one status message on the state topic."""
        sections = self._sections(g)
        if not sections:
            return
        blob = seal_status(g.name, self.did, [self._own(g)], sections)
        try:
            self.dataplane.publish_state(g.name, blob, timeout=self.config.push_timeout_s)
        except ZeroCommError as exc:  # best effort: digests repair what a status missed
            log.warning("group %r: status not published (%s); repair will spread it", g.name, type(exc).__name__)

    def _push(self, g: _Group, make: Callable[[], AgentMessage], timeout: float) -> list[str]:
        """Deliver a message to every member we have a relationship with, in parallel; the DIDs that failed."""
        with self._lock:
            peers = dict(g.record.peers)
        futures = {did: self._io.submit(self._agent.deliver, cid, make(), timeout) for did, cid in peers.items()}
        wait(list(futures.values()), timeout=timeout + 1.0)
        failed = []
        for did, future in futures.items():
            if not future.done() or future.exception() is not None:
                failed.append(did)
                exc = future.exception() if future.done() else None
                log.info("group %r: %s did not take the update (%s)", g.name, did,
                         type(exc).__name__ if exc else "timeout")
        return failed

    # --- join ------------------------------------------------------------------------------------

    def join(self, group: str, via: Any, *, role: str = "read_write", timeout: float = 30.0,
             policy: AdmissionPolicy | Mapping[str, Any] | None = None) -> GroupInfo:
        """Join ``group`` through ``via`` (a connection, or its id, DID or label, to any member).

        Raises JoinRefusedError if the acceptor or a member refuses this member by its policy,
        InconsistentViewError if the members' views disagree and the group wants consistent joins,
        PeerTimeoutError at the deadline. Nothing is left behind on failure.
        """
        self._check_open()
        check_group(group)
        if role not in ROLES:
            raise ConfigurationError(f"role is read_write or read_only, got {role!r}")
        deadline = time.monotonic() + check_timeout(timeout)
        the_policy = policy_from_dict(policy if policy is not None else self.config.default_policy)
        connection = self._agent.connection(via)
        acceptor = self._record(connection.id)
        if acceptor is None:
            raise ConnectionNotReadyError(f"connection {connection.id} is {connection.state}")
        self._reserve(group, joining=True)
        accepted: dict[str, _Pair] = {}
        try:
            self._join(group, acceptor, role, the_policy, deadline, accepted)
            return self.info(group)
        except BaseException:
            with self._lock:
                g = self._groups.get(group)
            if g is not None and g.phase == _JOINING:
                self._abandon(g, accepted)
            raise
        finally:
            self._release(group)

    def _remaining(self, deadline: float, what: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeoutError(f"the join ran out of time before {what}")
        return left

    def _join(self, group: str, acceptor: ConnectionRecord, role: str, policy: AdmissionPolicy,
              deadline: float, accepted: dict[str, _Pair]) -> None:
        key = self._keystore.create_key(GROUP_KEY_PURPOSE, ref=group)
        url, invitation_id = self._member_invitation(group)
        record = GroupRecord(group=group, mode="shared", ordered=True, consistent_join=True, role=role,
                             status=JOINING, group_verkey=key.verkey, invitation_url=url,
                             invitation_id=invitation_id, policy=policy.to_dict())
        g = _Group(record, GroupView(group), policy, key, _JOINING, self.config.history_max)
        mine = self._bump_own(g, status=JOINING)
        who = acceptor.their_label or acceptor.connection_id
        request = JoinRequest(group=group, member=mine.to_dict(), proof=self._proof(group, acceptor))
        reply = self._agent.request(acceptor.connection_id, request,
                                    min(self._remaining(deadline, "the join request"), self.config.request_timeout_s))
        if isinstance(reply, GroupProblemReport):
            raise self._refusal(reply, who, group)
        if not isinstance(reply, JoinResponse) or reply.group != group:
            raise MalformedGroupMessageError(f"{who} answered the join request with something else")
        mode, ordered, consistent = _parse_settings(reply.settings)
        entries = parse_entries(reply.view, group=group, skip_invalid=True)
        acceptor_did = reply.acceptor
        ticket = Ticket.from_dict(reply.ticket)
        if ticket.verify(group=group, member=self.did, nonce=request.id) != acceptor_did:
            raise SignatureError(f"the ticket from {who} is not signed by the member it claims to be")
        with self._lock:
            record.mode, record.ordered, record.consistent_join = mode, ordered, consistent
            record.ticket = ticket.to_dict()  # as verified: extra fields the acceptor added (a NaN) failed our saves
            for entry in entries:
                if entry.did != self.did:
                    g.view.merge(entry)
            acceptor_entry = g.view.get(acceptor_did)
        self._bump_own(g, status=JOINING)  # now with the ticket
        if acceptor_entry is None or acceptor_entry.status != ACTIVE:
            raise MalformedGroupMessageError(f"{who} is not an active member in the view it sent")
        self._store.save_peer(acceptor_did, acceptor.connection_id)
        with self._lock:
            self._groups[group] = g
        # Members are admitted to our sockets before we subscribe to them, so their SUBs connect at
        # once; until the views are verified we publish nothing and take nothing (not acked: the
        # publishers re-send it once the group is active).
        left_at = self._store.left_position(group)
        self.dataplane.open_group(group, mode=mode, ordered=self._in_order(record), group_key=key,
                                  role=role,  # type: ignore[arg-type]
                                  first_seq=left_at + 1, reserve=self._seq_reserver(group))
        checksums = {acceptor_did: reply.checksum}
        self._subscribe_round(g, deadline, accepted, checksums, acceptor=(acceptor_did, acceptor))
        self._check_consistency(g, deadline, accepted, checksums)
        # A member that missed our last leave still holds our old stream: continue after it (nothing
        # is published before the join completes, so the sequence can still move).
        reported = self._reported(g, accepted)
        if reported > left_at and not self.dataplane.continue_after(group, reported):  # pragma: no cover - defensive
            log.warning("group %r: a member holds our stream up to seq %d; new messages may be taken for old ones",
                        group, reported)
        with self._lock:
            for did, pair in accepted.items():
                g.record.peers[did] = pair.record.connection_id
        self._probe(g, list(accepted), deadline)
        with self._lock:
            record.status = ACTIVE
        self._bump_own(g, status=ACTIVE)
        self._save(g)
        self._activate(g)
        self._announce(g)
        self._jobs.submit(self._repair_all, g)  # catch members whose joins raced ours
        log.info("joined group %r via %s (%d members)", group, who, len(accepted) + 1)

    def _refusal(self, report: GroupProblemReport, who: str, group: str) -> GroupError:
        if report.code in (ProblemCode.JOIN_REFUSED, ProblemCode.SUBSCRIBE_REFUSED):
            return JoinRefusedError(f"{who} refused this member in group {group!r}: {report.explain}")
        if report.code == ProblemCode.UNKNOWN_GROUP:
            return GroupNotFoundError(f"{who} is not an active member of group {group!r}: {report.explain}",
                                      hint="Join through another member, or check the group's name")
        return GroupError(f"{who} could not process the request for group {group!r} ({report.code}): {report.explain}")

    def _subscribe_round(self, g: _Group, deadline: float, accepted: dict[str, _Pair], checksums: dict[str, str],
                         acceptor: tuple[str, ConnectionRecord] | None = None) -> None:
        """Connect and subscribe to every active member of the view not yet accepted, in parallel."""
        with self._lock:
            targets = [e for e in g.view.members((ACTIVE,)) if e.did != self.did and e.did not in accepted]
        futures: dict[str, Future[_Pair]] = {}
        for entry in targets:
            record = acceptor[1] if acceptor is not None and entry.did == acceptor[0] else None
            futures[entry.did] = self._io.submit(self._subscribe_to, g, entry, deadline, record, admit=True)
        wait(list(futures.values()), timeout=max(deadline - time.monotonic(), 0) + 1.0)
        first_error: BaseException | None = None
        for did, future in futures.items():
            if not future.done():
                first_error = first_error or PeerTimeoutError(f"member {did} did not answer the subscribe in time")
                continue
            exc = future.exception()
            if exc is None:
                pair = future.result()
                accepted[did] = pair
                checksums[did] = pair.checksum
            elif isinstance(exc, (JoinRefusedError, SignatureError, EnvelopeError, MalformedGroupMessageError)):
                first_error = first_error or exc
            elif acceptor is not None and did == acceptor[0]:
                first_error = first_error or exc
            else:  # an unreachable member: joined without it; repair connects us when it is back
                log.warning("group %r: member %s unreachable during the join (%s); continuing without it",
                            g.name, did, type(exc).__name__)
                try:
                    self.dataplane.remove_member(g.name, did)
                except GroupError:
                    pass
        if first_error is not None:
            raise first_error

    def _subscribe_to(self, g: _Group, entry: MemberEntry, deadline: float,
                      record: ConnectionRecord | None = None, *, admit: bool = False) -> _Pair:
        """DID exchange if needed, then subscribe: the member admits us (or refuses) and tells us its keys.

        ``admit``: add the member to our data plane first (from its signed entry), so its SUB is
        let in as soon as it connects; the caller removes it again if the join fails.
        """
        if record is None:
            record = self._connection_for(entry.did)
        if record is None:
            connection = self._agent.accept(entry.invitation, timeout=self._remaining(deadline, "a DID exchange"))
            record = self._record(connection.id)
            if record is None:
                raise ConnectionNotReadyError(f"the DID exchange with {entry.label} did not complete")
        if admit:
            self.dataplane.add_member(g.name, self._remote(entry, record))
        request = Subscribe(group=g.name, member=self._own(g).to_dict(), settings=g.settings(), ticket=g.record.ticket,
                            proof=self._proof(g.name, record))
        timeout = min(self._remaining(deadline, "a subscribe"), self.config.request_timeout_s)
        reply = self._agent.request(record.connection_id, request, timeout)
        who = entry.label or entry.did
        if isinstance(reply, GroupProblemReport):
            raise self._refusal(reply, who, g.name)
        if not isinstance(reply, SubscribeResponse) or reply.group != g.name:
            raise MalformedGroupMessageError(f"{who} answered the subscribe with something else")
        theirs = MemberEntry.from_dict(reply.member).verify(g.name)
        if theirs.did != entry.did:
            raise SignatureError(f"the member reached through {who}'s invitation is someone else")
        self._store.save_peer(entry.did, record.connection_id)
        with self._lock:
            g.view.merge(theirs)
            current = g.view.get(entry.did) or theirs
        if admit and (current.publish_endpoint, current.transport_key, current.role, current.peer_endpoint) != (
                entry.publish_endpoint, entry.transport_key, entry.role, entry.peer_endpoint):
            self.dataplane.add_member(g.name, self._remote(current, record))  # newer than the view we were given
        return _Pair(current, record, reply.checksum, reply.position, reply.your_version)

    def _check_consistency(self, g: _Group, deadline: float, accepted: dict[str, _Pair],
                           checksums: dict[str, str]) -> None:
        """Refuse (or warn about) a join whose members disagree on who is in the group (thesis 7.2).

        Disagreement that resolves (another join becoming active meanwhile) is waited out for
        ``consistency_wait_s``; then, if the members agree among themselves on more than we know,
        we learn it and subscribe to the newcomers too.
        """
        settle_until = min(deadline, time.monotonic() + self.config.consistency_wait_s)
        while True:
            with self._lock:
                mine = g.view.checksum()
            bad = sorted(did for did, checksum in checksums.items() if checksum != mine)
            if not bad:
                return
            if time.monotonic() >= settle_until:
                break
            time.sleep(0.2)
            answers = self._digests(g, list(checksums), settle_until)
            for did, answer in answers.items():
                checksums[did] = answer.checksum
            agreed = set(checksums.values())
            if len(agreed) == 1 and agreed != {mine} and len(answers) == len(checksums):
                # Every member agrees on a view we lack (a racing join went active): learn it.
                for answer in answers.values():
                    self._apply(g, parse_entries(answer.entries, group=g.name, skip_invalid=True), source=None,
                                allow_new=True)
                self._subscribe_round(g, deadline, accepted, checksums)
        with self._lock:
            labels = {e.did: e.label for e in g.view.entries()}
            members = len(g.view.members((ACTIVE,)))
        detail = ", ".join(f"{labels.get(d) or d}" for d in bad)
        message = (f"the members' views of group {g.name!r} disagree: {detail} hold(s) a different view than the "
                   f"one this member was given ({members} members)")
        if g.record.consistent_join:
            raise InconsistentViewError(message)
        log.warning("%s; joining anyway (consistent_join is off)", message)

    def _digests(self, g: _Group, dids: Iterable[str], deadline: float) -> dict[str, DigestResponse]:
        with self._lock:
            digest = dict(state_hash=g.view.state_hash(), versions=g.view.versions())
            conns = {did: self._store.peer_connection(did) for did in dids}
        futures = {did: self._io.submit(self._agent.request, cid, Digest(group=g.name, **digest),
                                              max(min(deadline - time.monotonic(), self.config.request_timeout_s), 0.1))
                   for did, cid in conns.items() if cid}
        wait(list(futures.values()), timeout=max(deadline - time.monotonic(), 0.1) + 1.0)
        out = {}
        for did, future in futures.items():
            if future.done() and future.exception() is None and isinstance(future.result(), DigestResponse):
                out[did] = future.result()
        return out

    def _probe(self, g: _Group, dids: Sequence[str], deadline: float) -> None:
        """Hello until each member acked (its SUB is connected); a slow one is reported, not fatal."""
        timeout = max(min(deadline - time.monotonic(), self.config.probe_timeout_s), 0.5)
        futures = {did: self._io.submit(self.dataplane.probe, g.name, did, timeout) for did in dids}
        wait(list(futures.values()), timeout=timeout + 1.0)
        for did, future in futures.items():
            if not future.done() or future.exception() is not None:
                log.warning("group %r: probe of %s unanswered; its first messages arrive by retransmission",
                            g.name, did)

    def _reported(self, g: _Group, pairs: Mapping[str, _Pair]) -> int:
        """The highest position of our stream the members answering our subscribe hold (0 if none)."""
        top = 0
        for did, pair in pairs.items():
            if pair.position > MAX_REPORTED_POSITION:
                log.warning("group %r: %s reports our stream at seq %d; not believed", g.name, did, pair.position)
            else:
                top = max(top, pair.position)
        return top

    def _abandon(self, g: _Group, accepted: Mapping[str, _Pair]) -> None:
        """Undo a failed join: the members that accepted our subscribe drop us again."""
        with self._lock:
            self._groups.pop(g.name, None)
            g.phase = _LEAVING
        try:
            # Those members forget our stream now: what they held of it is kept here, as a leave
            # keeps our last seq, so the next join still continues after it.
            self._store.save_left_position(g.name, self._reported(g, accepted))
            left = self._bump_own(g, status=LEFT)
            timeout = self.config.push_timeout_s
            # In parallel: one after another, members that are down held a failed join N x the timeout.
            futures = {did: self._io.submit(self._agent.deliver, pair.record.connection_id,
                                            Leave(group=g.name, member=left.to_dict()), timeout)
                       for did, pair in accepted.items()}
            wait(list(futures.values()), timeout=timeout + 1.0)
            for did, future in futures.items():
                exc = future.exception(0) if future.done() else None
                if not future.done() or exc is not None:
                    log.info("group %r: %s not told of the withdrawn join (%s)", g.name, did,
                             type(exc).__name__ if exc else "timeout")
            try:
                self.dataplane.close_group(g.name)
            except GroupError:
                pass
        finally:
            self._store.delete(g.name)

    # --- resume after a restart --------------------------------------------------------------------

    def _resume(self, g: _Group) -> None:
        """Rejoin a group kept from before a restart, with the same identity."""
        try:
            with self._lock:
                if g.phase != _RESUMING:
                    return  # left before the resume started
                peers = dict(g.record.peers)
                stored = {did: g.view.get(did) for did in peers}
                self._bump_own(g, status=ACTIVE)
            deadline = time.monotonic() + self.config.resume_timeout_s
            futures = {}
            for did, connection_id in peers.items():
                record = self._record(connection_id)
                entry = stored.get(did)
                if record is not None and entry is not None:
                    futures[did] = self._io.submit(self._subscribe_to, g, entry, deadline, record)
            wait(list(futures.values()), timeout=self.config.resume_timeout_s + 1.0)
            fresh: dict[str, _Pair] = {}
            for did, future in futures.items():
                if future.done() and future.exception() is None:
                    fresh[did] = future.result()
                else:
                    exc = future.exception() if future.done() else None
                    log.info("group %r: %s not reached on resume (%s); keeping it", g.name, did,
                             type(exc).__name__ if exc else "timeout")
            saved = g.saved_positions or Positions()
            after = max(saved.publish, self._reported(g, fresh))
            reserved = self._store.seq_reserved(g.name)
            void = None
            if reserved > after and (len(fresh) < len(peers) or not peers):
                # The saved position lags (persist_interval_s) and a member not reached may hold seqs
                # past it: reusing them, its journal would drop our new messages as duplicates. So we
                # continue after every seq we may have used; those we cannot tell used are void. So too
                # with no member at all: our own journal (the agent's) holds what we published alone.
                void = (after + 1, reserved)
                after = reserved
                log.info("group %r: not every member reached; continuing after seq %d, %d seq(s) void",
                         g.name, after, void[1] - void[0] + 1)
            self.dataplane.open_group(g.name, mode=g.record.mode, ordered=self._in_order(g.record),  # type: ignore[arg-type]
                                      group_key=g.group_key, role=g.record.role, first_seq=after + 1,  # type: ignore[arg-type]
                                      reserve=self._seq_reserver(g.name), void=void)
            if saved.receive:
                self.dataplane.restore_positions(g.name, saved.receive)
            for did, connection_id in peers.items():
                record = self._record(connection_id)
                with self._lock:
                    entry = g.view.get(did)
                if record is None or entry is None or entry.status == LEFT:
                    with self._lock:
                        g.record.peers.pop(did, None)
                    continue
                self._add_member(g, entry, record)
            with self._lock:
                left = g.phase == _LEAVING
                if not left:
                    g.phase = _ACTIVE
            if left:  # left while resuming: the group opened above goes again, and stays gone
                self._drop_resumed(g)
                return
            self._save(g)
            g.ready.set()
            self._probe(g, list(fresh), time.monotonic() + self.config.probe_timeout_s)
            self._announce(g)
            self._repair_all(g)
            log.info("group %r resumed after a restart (%d of %d members reached)", g.name, len(fresh), len(peers))
        except Exception as exc:  # noqa: BLE001 - a group that cannot resume must not stop the others
            if g.phase == _LEAVING:
                self._drop_resumed(g)
            elif not self._closing.is_set():
                log.error("group %r could not resume: %s", g.name, type(exc).__name__, exc_info=exc)

    def _drop_resumed(self, g: _Group) -> None:
        """A leave came while ``g`` was resuming: close what the resume opened (the leave found it
        not open yet), keeping our last seq there past the leave as the leave does."""
        try:
            self._store.save_left_position(g.name, self.dataplane.publish_position(g.name))
            self.dataplane.close_group(g.name)
        except GroupError:
            pass
        log.info("group %r: left while resuming", g.name)

    # --- leave and role --------------------------------------------------------------------------

    def leave(self, group: str, timeout: float = 10.0) -> None:
        """Leave gracefully: every member drops us (subscriptions, transport key); our records go."""
        g = self._group(group, phases=(_ACTIVE, _RESUMING))
        entry = self._bump_own(g, status=LEFT)
        self._announce(g)
        failed = self._push(g, lambda: Leave(group=group, member=entry.to_dict()), min(timeout, self.config.push_timeout_s))
        with self._lock:
            g.phase = _LEAVING
            self._groups.pop(group, None)
            for key in [key for key in self._taken if key[0] == group]:
                del self._taken[key]
            self._inbox_cond.notify_all()
        # Our last seq is kept past the leave; a group still resuming is not open on the data plane
        # yet, so what was saved before the restart counts too (the resume records its own if it
        # opens the group after all: _drop_resumed).
        saved = g.saved_positions.publish if g.saved_positions is not None else 0
        try:
            saved = max(saved, self.dataplane.publish_position(group))
        except GroupError:  # not open yet: after a crash only the reservation covers every seq we used
            saved = max(saved, self._store.seq_reserved(group))
        self._store.save_left_position(group, saved)
        try:
            self.dataplane.close_group(group)
        except GroupError:
            pass
        self._store.delete(group)
        if failed:
            log.warning("left group %r; %d member(s) will learn it by repair", group, len(failed))
        else:
            log.info("left group %r", group)

    def switch_role(self, group: str, role: str, timeout: float = 10.0) -> GroupInfo:
        """Become read_only or read_write without leaving; returns once the members took it (or timeout)."""
        if role not in ROLES:
            raise ConfigurationError(f"role is read_write or read_only, got {role!r}")
        g = self._group(group)
        with self._lock:
            if g.record.role == role:
                return self.info(group)
            g.record.role = role
        if role == "read_only":  # stop publishing first
            self.dataplane.set_role(group, self.did, role)  # type: ignore[arg-type]
        entry = self._bump_own(g, role=role)
        self._save(g)
        self._announce(g)
        self._push(g, lambda: ViewUpdate(group=group, entries=[entry.to_dict()]), min(timeout, self.config.push_timeout_s))
        if role == "read_write":  # publish only once the members accept our data
            self.dataplane.set_role(group, self.did, role)  # type: ignore[arg-type]
        log.info("group %r: this member is now %s", group, role)
        return self.info(group)

    # --- applying what others tell us ---------------------------------------------------------------

    def _apply(self, g: _Group, entries: Iterable[MemberEntry], source: str | None, *,
               allow_new: bool = False) -> int:
        """Merge verified entries and bring the data plane in line; returns how many changed.

        ``source`` (a DID) limits the entries to that member's own (status messages and leaves are
        self-announcements); None accepts any signed entry (repair). Members not in our view yet are
        only set aside (``pending``) unless ``allow_new``: second-hand news of a new member is
        checked by :meth:`_introduce` first, so a byzantine member cannot spread an intruder.
        """
        listed = [e for e in entries if e.did != self.did and (source is None or e.did == source) and e.group == g.name]
        vouched = {} if allow_new else self._to_set_aside(g, listed)
        changes: list[tuple[MemberEntry | None, MemberEntry]] = []
        with self._lock:
            for entry in listed:
                old = g.view.get(entry.did)
                if old is None and not allow_new:
                    checked = vouched.get(entry.did)
                    if checked is None or checked[0] is not entry:
                        continue
                    voucher = g.view.get(checked[1])
                    held = g.pending.get(entry.did)
                    if (voucher is not None and voucher.status != LEFT
                            and (held is None or held.content_key() < entry.content_key())):
                        g.pending.put(entry, checked[1], per_voucher=MAX_PENDING_PER_VOUCHER, total=MAX_PENDING)
                    continue
                g.pending.pop(entry.did)
                if g.view.merge(entry) is not None:
                    changes.append((old, entry))
        for old, new in changes:
            with self._lock:
                connection_id = g.record.peers.get(new.did)
            if connection_id is None:
                continue
            try:
                if new.status == LEFT:
                    with self._lock:
                        g.record.peers.pop(new.did, None)
                        self._taken.pop((g.name, new.did), None)  # its re-sends never come now
                    self.dataplane.remove_member(g.name, new.did)
                    log.info("group %r: %s (%s) left", g.name, new.label, new.did)
                else:
                    if old is None or (old.role, old.publish_endpoint, old.transport_key, old.peer_endpoint,
                                       old.group_verkey) != (new.role, new.publish_endpoint, new.transport_key,
                                                             new.peer_endpoint, new.group_verkey):
                        record = self._record(connection_id)
                        if record is not None and g.phase in (_ACTIVE, _RESUMING):
                            self._add_member(g, new, record)
                    if old is not None and old.status == JOINING and new.status != JOINING:
                        self._sync_joining(g, new.did)  # its join checked out: it acks now
            except GroupError as exc:
                log.info("group %r: data plane not updated for %s (%s)", g.name, new.did, type(exc).__name__)
        if changes:
            self._save(g)
        return len(changes)

    def _to_set_aside(self, g: _Group, entries: Sequence[MemberEntry]) -> dict[str, tuple[MemberEntry, str]]:
        """Of ``entries``, those about members not in our view that ``pending`` should take: DID ->
        (entry, voucher). Only what _introduce could ever admit: active, with a genuine ticket from
        another member in our view. The tickets are checked outside the lock and only for entries
        that would be kept (at most MAX_PENDING_PER_VOUCHER per voucher, the last ones, and
        MAX_PENDING in all per call), not for one already held with the same ticket (repair
        repeats itself): a member pushing made-up entries by the thousand costs a bounded number
        of checks and, vouching for them itself, can only evict what it vouched for.
        """
        candidates: dict[str, tuple[MemberEntry, str]] = {}
        with self._lock:
            for entry in entries:
                by = entry.ticket.get("by") if entry.ticket else None
                if entry.did in g.view or entry.status != ACTIVE or not isinstance(by, str) or by == entry.did:
                    continue
                voucher = g.view.get(by)
                if voucher is None or voucher.status == LEFT:
                    continue
                best = candidates.get(entry.did)
                held = g.pending.get(entry.did)
                if best is not None or held is not None:
                    key = entry.content_key()
                    if (best is not None and best[0].content_key() >= key) or (
                            held is not None and held.content_key() >= key):
                        continue  # nothing newer: in particular, what is held already is not checked again
                    candidates.pop(entry.did, None)  # re-inserted: its place is its last arrival
                candidates[entry.did] = (entry, by)
            held_tickets = {did: held.ticket for did in candidates if (held := g.pending.get(did)) is not None}
        kept: dict[str, tuple[MemberEntry, str]] = {}
        tried: dict[str, int] = {}  # per voucher named; a forged ticket uses up that voucher's share too
        considered = 0
        for did, (entry, by) in reversed(candidates.items()):  # the later ones would evict the earlier
            if considered >= MAX_PENDING:
                break
            if tried.get(by, 0) >= MAX_PENDING_PER_VOUCHER:
                continue
            tried[by] = tried.get(by, 0) + 1
            considered += 1
            if held_tickets.get(did) != entry.ticket:
                try:
                    Ticket.from_dict(entry.ticket).verify(group=g.name, member=did)
                except (MalformedGroupMessageError, SignatureError):
                    continue
            kept[did] = (entry, by)
        return kept

    # --- inbound membership requests (transport worker threads) --------------------------------------

    def _active_group(self, request: AgentMessage, group: str) -> _Group | GroupProblemReport:
        with self._lock:
            g = self._groups.get(group)
        if g is None or self._closed:
            return _problem(request, ProblemCode.UNKNOWN_GROUP, "it is in no group of that name")
        if g.phase != _ACTIVE:
            return _problem(request, ProblemCode.NOT_READY, f"the group is {g.phase} here; retry shortly")
        return g

    def _proof(self, group: str, record: ConnectionRecord) -> str:
        """This member's proof that what it sends over ``record`` for ``group`` comes from it (group/proof.py)."""
        if not record.my_did:
            raise ConnectionNotReadyError("the connection has no DID of ours yet; finish the DID exchange first")
        return connection_proof(self._member_key, group, self.did, record.my_did)

    def _on_join_request(self, request: JoinRequest, record: ConnectionRecord) -> AgentMessage:
        g = self._active_group(request, request.group)
        if isinstance(g, GroupProblemReport):
            return g
        try:
            entry = MemberEntry.from_dict(request.member).verify(request.group)
        except (MalformedGroupMessageError, SignatureError) as exc:
            return _problem(request, ProblemCode.INVALID, f"the joiner's entry is invalid ({type(exc).__name__})")
        if entry.did == self.did:
            return _problem(request, ProblemCode.INVALID, "the joiner claims this member's DID")
        if not proves_connection(request.proof, g.name, entry.did, record.their_did):
            return _problem(request, ProblemCode.INVALID, _NO_PROOF)
        with self._lock:
            invitation_id = _our_invitation(record)
            admission = AdmissionRequest(group=g.name, stage="join", member_did=entry.did, label=entry.label,
                                         role=entry.role, connection_did=record.their_did,
                                         invitation_id=invitation_id,
                                         group_invitation=invitation_id in g.record.issued_invitations)
            decision = g.policy.decide(admission)
        if not decision:
            log.info("group %r: refused the join of %s (%s)", g.name, entry.did, decision.reason)
            return _problem(request, ProblemCode.JOIN_REFUSED, decision.reason)
        ticket = Ticket.issue(g.name, entry.did, self._member_key, nonce=request.id)
        with self._lock:
            view, checksum = g.view.to_list(), g.view.checksum()
        log.info("group %r: accepted the join request of %s (%s)", g.name, entry.label, entry.did)
        return JoinResponse(group=g.name, settings=g.settings(), view=view, checksum=checksum, acceptor=self.did,
                            ticket=ticket.to_dict(), thread=Thread(thid=request.id))

    def _vouched(self, g: _Group, ticket: Mapping[str, Any] | None, member: str) -> str | None:
        """The current member that vouches for ``member`` with this ticket, if it is genuine."""
        if ticket is None:
            return None
        try:
            by = Ticket.from_dict(ticket).verify(group=g.name, member=member)
        except (MalformedGroupMessageError, SignatureError):
            return None
        with self._lock:
            voucher = g.view.get(by)
            subject = g.view.get(member)
        if voucher is None or voucher.status != ACTIVE:
            return None
        if by == member and (subject is None or subject.status != ACTIVE):
            return None  # a founder's own ticket counts only for a member we already know as active
        return by

    def _on_subscribe(self, request: Subscribe, record: ConnectionRecord) -> AgentMessage:
        g = self._active_group(request, request.group)
        if isinstance(g, GroupProblemReport):
            return g
        try:
            entry = MemberEntry.from_dict(request.member).verify(request.group)
            mode, ordered, _ = _parse_settings(request.settings)
        except (MalformedGroupMessageError, SignatureError) as exc:
            return _problem(request, ProblemCode.INVALID, f"the subscriber's entry is invalid ({type(exc).__name__})")
        if entry.did == self.did or entry.status == LEFT:
            return _problem(request, ProblemCode.INVALID, "the subscriber's entry names this member or has left")
        if not proves_connection(request.proof, g.name, entry.did, record.their_did):
            log.warning("group %r: refused a subscribe as %s without that member's proof for the connection",
                        g.name, entry.did)
            return _problem(request, ProblemCode.INVALID, _NO_PROOF)
        if (mode, ordered) != (g.record.mode, g.record.ordered):
            return _problem(request, ProblemCode.INVALID,
                            f"the group here is {g.record.mode} and {'ordered' if g.record.ordered else 'unordered'}")
        with self._lock:
            known = g.record.peers.get(entry.did) == record.connection_id
        if not known:
            invitation_id = _our_invitation(record)
            with self._lock:  # our member invitation is in every view: it proves nothing
                group_invitation = invitation_id is not None and invitation_id in g.record.issued_invitations
            admission = AdmissionRequest(group=g.name, stage="subscribe", member_did=entry.did, label=entry.label,
                                         role=entry.role, connection_did=record.their_did,
                                         invitation_id=invitation_id, group_invitation=group_invitation,
                                         vouched_by=self._vouched(g, request.ticket, entry.did))
            with self._lock:
                decision = g.policy.decide(admission)
            if not decision:
                log.info("group %r: refused the subscribe of %s (%s)", g.name, entry.did, decision.reason)
                return _problem(request, ProblemCode.SUBSCRIBE_REFUSED, decision.reason)
        with self._lock:
            g.pending.pop(entry.did)
            g.view.merge(entry)
            current = g.view.get(entry.did) or entry
            g.record.peers[entry.did] = record.connection_id
        try:
            self._add_member(g, current, record)
            position = self.dataplane.stream_position(g.name, entry.did)
        except ZeroCommError as exc:
            with self._lock:
                if not known:
                    g.record.peers.pop(entry.did, None)
            log.warning("group %r: could not add %s (%s)", g.name, entry.did, type(exc).__name__)
            return _problem(request, ProblemCode.NOT_READY, "this member could not add the subscriber; retry")
        self._store.save_peer(entry.did, record.connection_id)
        self._save(g)
        log.info("group %r: %s %s (%s)", g.name, "re-subscribed" if known else "subscribed", entry.label, entry.did)
        with self._lock:
            checksum = g.view.checksum()
        return SubscribeResponse(group=g.name, member=self._own(g).to_dict(), checksum=checksum, position=position,
                                 your_version=current.version, thread=Thread(thid=request.id))

    def _on_digest(self, request: Digest, record: ConnectionRecord) -> AgentMessage:
        with self._lock:
            g = self._groups.get(request.group)
        if g is None or g.phase not in (_ACTIVE, _RESUMING):
            return _problem(request, ProblemCode.UNKNOWN_GROUP, "it is in no group of that name")
        if self._pair_did(g, record) is None:
            return _problem(request, ProblemCode.NOT_A_MEMBER, "no relationship with the sender in this group")
        with self._lock:
            checksum = g.view.checksum()
            if request.state_hash == g.view.state_hash():
                return DigestResponse(group=g.name, checksum=checksum, thread=Thread(thid=request.id))
            entries = [e.to_dict() for e in g.view.newer_than(request.versions)]
            want = g.view.wanted_from(request.versions)
        return DigestResponse(group=g.name, checksum=checksum, entries=entries, want=want,
                              thread=Thread(thid=request.id))

    def _on_view_update(self, message: ViewUpdate, record: ConnectionRecord) -> None:
        with self._lock:
            g = self._groups.get(message.group)
        if g is None:
            raise GroupNotFoundError("the view update is for a group this member is not in")
        if self._pair_did(g, record) is None:
            raise MalformedGroupMessageError("a view update from a member with no relationship in this group")
        self._apply(g, parse_entries(message.entries, group=g.name, skip_invalid=True), source=None)

    def _on_leave(self, message: Leave, record: ConnectionRecord) -> None:
        with self._lock:
            g = self._groups.get(message.group)
        if g is None:
            return  # nothing to drop
        entry = MemberEntry.from_dict(message.member).verify(g.name)
        # The status on the state topic may have been applied first and dropped the relationship.
        sender = self._pair_did(g, record) or (
            entry.did if self._store.peer_connection(entry.did) == record.connection_id else None)
        if sender is None or entry.did != sender or entry.status != LEFT:
            raise MalformedGroupMessageError("a leave must be the sender's own entry with status 'left'")
        self._apply(g, [entry], source=sender)

    # --- state topic and delivery (data plane receiver thread) ----------------------------------------

    def _on_state(self, group: str, blob: bytes, did: str) -> None:
        key = (group, did)
        with self._lock:
            queued = key in self._status_waiting
            if queued:
                self.status_superseded += 1
            self._status_waiting[key] = blob
        if not queued:
            self._control.put(lambda: self._handle_waiting_status(key))

    def _handle_waiting_status(self, key: tuple[str, str]) -> None:
        with self._lock:
            blob = self._status_waiting.pop(key, None)
        if blob is not None:
            self._handle_status(key[0], blob)

    def _handle_status(self, group: str, blob: bytes) -> None:
        with self._lock:
            g = self._groups.get(group)
            peers = dict(g.record.peers) if g is not None else {}
        if g is None:
            return
        mine: dict[str, str] = {}
        by_exchange: dict[str, str] = {}
        for did, connection_id in peers.items():
            record = self._record(connection_id)
            if record is not None and record.thread_id and record.their_verkey:
                mine[record.thread_id] = record.their_verkey
                by_exchange[record.thread_id] = did
        try:
            opened = open_status(group, blob, mine, self._keystore.find)
        except (ZeroCommError, ValueError) as exc:
            log.info("group %r: dropped a status message (%s)", group, type(exc).__name__)
            return
        if opened is None:
            return
        sender = by_exchange.get(opened.exchange_id)
        if sender is None or opened.sender_did != sender:
            log.info("group %r: dropped a status section whose sender does not match its exchange", group)
            return
        self._apply(g, opened.entries, source=sender)

    def _on_deliver(self, message: Delivered) -> None:
        self._on_deliver_many([message])

    def _in_order(self, record: GroupRecord) -> bool:
        """Whether this member delivers the group's messages in each publisher's seq order (see GroupConfig.fifo)."""
        return bool(record.ordered) or self.config.fifo

    def _on_superseded(self, group: str, publisher_did: str, seqs: list[int]) -> None:
        with self._lock:
            listeners = list(self._superseded_listeners)
        for callback in listeners:  # errors go to the data plane, which logs them
            callback(group, publisher_did, seqs)

    def on_superseded(self, callback: Callable[[str, str, list[int]], None]) -> Callable[[], None]:
        """Call ``callback(group, publisher, seqs)`` for new seqs whose message ids this member had
        delivered already (a publisher re-sending under new seqs), and for seqs a publisher restarted
        after a crash skipped as void (never used, as far as it can tell), before they are acknowledged:
        a journal records them, so a reader walking the publisher's seqs does not call them lost."""
        return self._listen(self._superseded_listeners, callback, "on_superseded")

    def _on_deliver_many(self, messages: list[Delivered]) -> None:
        """One delivery batch (one group, one publisher, in seq order) from the data plane.

        Raises DeliveryDeferredError, so that the data plane acks none of it and the publisher re-sends
        it, while the group is joining (nothing is delivered before the views check out) or when a
        listener raised; a re-sent message goes only to the listeners that have not taken it.
        """
        group, key = messages[0].group, (messages[0].group, messages[0].publisher_did)
        with self._lock:
            g = self._groups.get(group)
            if g is not None and g.phase == _JOINING:
                raise DeliveryDeferredError(f"group {group!r} is still joining here")
            taken = self._taken.get(key, {})
            for message in messages:
                if (message.seq, message.message_id) not in taken:
                    self._hand_over(g, message)
            listeners = list(self._listeners)
            batch_listeners = list(self._batch_listeners)
        now_taken, raised = self._notify_all(listeners, batch_listeners, messages, taken)
        done = len(messages)  # how many, from the first, every listener has taken: those are acked
        if now_taken is not None:
            everyone = [*listeners, *batch_listeners]
            done = 0
            for message in messages:
                have = now_taken[(message.seq, message.message_id)]
                if not all(any(c is listener for c in have) for listener in everyone):
                    break
                done += 1
        ordered = g is not None and self._in_order(g.record)
        # Read only when there is a record to prune (rarely: a listener raised), outside our lock (the
        # data plane's lock comes first): a copy of every publisher's position per batch otherwise.
        passed = self._passed(group, key[1]) if not ordered and (now_taken is not None or key in self._taken) else 0
        with self._lock:
            mine = self._taken.get(key)
            publisher = g.view.get(key[1]) if g is not None else None
            if now_taken is not None and g is not None and self._groups.get(group) is g and (
                    publisher is None or publisher.status != LEFT):  # else nothing is re-sent: nothing to wait for
                mine = self._taken.setdefault(key, {})
                mine.update(now_taken)
            if mine:
                for message in messages[:done]:
                    mine.pop((message.seq, message.message_id), None)
                # Nothing older comes back: ordered, what comes is in order; either way, nothing at or
                # below the delivered position (taken by all, or skipped: the publisher lost it).
                floor = messages[0].seq - 1 if ordered else passed
                for stale in [k for k in mine if k[0] <= floor]:
                    del mine[stale]
                if not mine:
                    self._taken.pop(key, None)
        if now_taken is not None:
            raise DeliveryDeferredError(f"a listener did not take {len(messages) - done} message(s) of group {group!r}",
                                        taken=done, raised=raised)

    def _passed(self, group: str, publisher: str) -> int:
        """The publisher's seq up to which this member is done (0 if unknown): never re-sent to us."""
        try:
            return self.dataplane.positions(group).get(publisher, 0)
        except GroupError:
            return 0

    def _prune_taken(self, g: _Group) -> None:
        """Forget who took seqs the stream has passed. Unordered streams clean up only here and at
        a delivery: a skipped message (its publisher lost it) is never re-sent to clear its record."""
        with self._lock:
            publishers = [did for group, did in self._taken if group == g.name]
        if not publishers:
            return
        try:
            positions = self.dataplane.positions(g.name)
        except GroupError:
            return
        with self._lock:
            for did in publishers:
                mine = self._taken.get((g.name, did))
                if mine is None:
                    continue
                floor = positions.get(did, 0)
                for stale in [k for k in mine if k[0] <= floor]:
                    del mine[stale]
                if not mine:
                    del self._taken[(g.name, did)]

    @staticmethod
    def _notify_all(listeners: list[Callable[[Delivered], None]],
                    batch_listeners: list[Callable[[list[Delivered]], None]], messages: list[Delivered],
                    taken: Mapping[tuple[int, str], list[Any]]) -> tuple[dict[tuple[int, str], list[Any]] | None, int]:
        """Call each listener with the messages it has not taken yet (``taken``: a re-sent batch).

        Returns (None, 0) if every call returned; else, per message, the listeners that have it now,
        and how many listeners raised. One listener's failure does not stop the others; a per-message
        listener that raised is not called again for the rest of the batch (delivery is FIFO).
        """
        def pending(callback: Any) -> list[Delivered]:
            if not taken:
                return messages
            return [m for m in messages if not any(c is callback for c in taken.get((m.seq, m.message_id), ()))]

        returned: list[tuple[Any, list[Delivered]]] = []
        failed: dict[int, int] = {}  # id of a listener that raised -> index of the message (0: a batch listener)
        for batch_callback in batch_listeners:
            batch = pending(batch_callback)
            if not batch:
                continue
            try:
                batch_callback(batch)
                returned.append((batch_callback, batch))
            except Exception as exc:  # noqa: BLE001 - one listener's bug must not starve the others
                failed[id(batch_callback)] = 0
                log.error("an on_messages callback raised %s for messages of group %r; they are offered again "
                          "when re-sent", type(exc).__name__, messages[0].group)
                log.debug("on_messages traceback", exc_info=exc)
        if listeners:
            for i, message in enumerate(messages):
                had = taken.get((message.seq, message.message_id), ()) if taken else ()
                for callback in listeners:
                    if id(callback) in failed or any(c is callback for c in had):
                        continue
                    try:
                        callback(message)
                    except Exception as exc:  # noqa: BLE001 - one listener's bug must not starve the others
                        failed[id(callback)] = i
                        # The class only: an application's exception text may quote the payload.
                        log.error("an on_message callback raised %s for a message of group %r; it is offered "
                                  "again when re-sent", type(exc).__name__, message.group)
                        log.debug("on_message traceback", exc_info=exc)
        if not failed:
            return None, 0
        now = {(m.seq, m.message_id): list(taken.get((m.seq, m.message_id), ())) for m in messages}
        for batch_callback, batch in returned:
            for m in batch:
                now[(m.seq, m.message_id)].append(batch_callback)
        for callback in listeners:
            for m in messages[:failed.get(id(callback), len(messages))]:
                have = now[(m.seq, m.message_id)]
                if not any(c is callback for c in have):
                    have.append(callback)
        return now, len(failed)

    def _hand_over(self, g: _Group | None, message: Delivered) -> None:
        """Into the history and the receive() buffer (caller holds the lock)."""
        if g is None:
            return
        size = len(message.payload)
        history = g.history
        if history.maxlen:
            if len(history) == history.maxlen:
                g.history_bytes -= len(history[0].payload)  # the append below drops it
            history.append(message)
            g.history_bytes += size
            while len(history) > 1 and g.history_bytes > self.config.history_max_bytes:
                g.history_bytes -= len(history.popleft().payload)
        self._arrivals += 1
        if not self.config.inbox_max:
            return  # nothing is kept for receive()
        g.inbox.append((self._arrivals, message))
        g.inbox_bytes += size
        while len(g.inbox) > self.config.inbox_max or (len(g.inbox) > 1 and g.inbox_bytes > self.config.inbox_max_bytes):
            g.inbox_bytes -= len(g.inbox.popleft()[1].payload)
            g.inbox_dropped += 1
        self._inbox_cond.notify_all()

    def _activate(self, g: _Group) -> None:
        """The join checked out: the group goes active. What arrived meanwhile was not taken (nor
        acked): the publishers re-send it and it is delivered then, in order."""
        with self._lock:
            g.phase = _ACTIVE
        g.ready.set()

    # --- messaging -------------------------------------------------------------------------------

    def publish(self, group: str, payloads: Sequence[bytes | str], *, message_ids: Sequence[str] | None = None,
                headers: Mapping[str, str] | Sequence[Mapping[str, str] | None] | None = None,
                timeout: float = 30.0) -> PublishReceipt:
        """Publish ``payloads`` (in order) to every member; the receipt resolves when all acked.

        ``headers``: one mapping for every message, or a sequence of one (or None) per message.

        str payloads are sent as UTF-8. Raises ReadOnlyMemberError for a read-only member and
        BackpressureError if members lag a full window behind until ``timeout``.
        """
        g = self._group(group)
        if isinstance(payloads, (bytes, bytearray, str)):
            raise ConfigurationError("publish() takes a list of payloads; wrap a single payload in a list")
        data = [p.encode("utf-8") if isinstance(p, str) else p for p in payloads]
        return self.dataplane.publish(g.name, data, message_ids=message_ids, headers=headers, timeout=timeout)

    def messages(self, group: str) -> list[Delivered]:
        """The last messages delivered in ``group`` (up to ``history_max``), in delivery order."""
        g = self._group(group, phases=None)
        with self._lock:
            return list(g.history)

    def receive(self, group: str | None = None, timeout: float | None = 10.0) -> Delivered:
        """The next message not yet received (of ``group``, or of any group); waits up to ``timeout``
        seconds (0 or less: only looks; None: until one comes or the groups close, as Agent.receive)."""
        self._check_open()
        # NaN never passed the deadline check below (it waited forever) and inf overflowed the wait.
        deadline = None if timeout is None else time.monotonic() + check_timeout(timeout, only_check=True)
        with self._inbox_cond:
            while True:
                if self._closed:
                    raise AgentClosedError("the groups were closed while waiting for a message")
                if group is not None:
                    g = self._groups.get(group)
                    if g is None:
                        raise GroupNotFoundError(f"this member is in no group named {group!r}")
                    if g.inbox:
                        return _take_next(g)
                else:
                    heads = [g for g in self._groups.values() if g.inbox]
                    if heads:
                        return _take_next(min(heads, key=lambda x: x.inbox[0][0]))
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ReceiveTimeoutError(f"no group message within {timeout:g}s")
                self._inbox_cond.wait(left)

    def on_message(self, callback: Callable[[Delivered], None]) -> Callable[[], None]:
        """Call ``callback`` for every delivered message, before it counts as delivered (restart-safe).

        Runs on the delivery thread in publisher order; returns a function that unregisters it. If it
        raises, that message and the rest of its batch are not acked: the publisher re-sends them
        and they are offered again (only to the listeners that did not take them). A callable
        registered already (and not unregistered) is refused with ConfigurationError.
        """
        return self._listen(self._listeners, callback, "on_message")

    def on_messages(self, callback: Callable[[list[Delivered]], None]) -> Callable[[], None]:
        """Call ``callback`` with each delivery batch, before any of it counts as delivered.

        The batch form of :meth:`on_message` for durable consumers: one journal commit per batch
        instead of per message. Batches hold one publisher's messages of one group, in delivery
        order. If it raises, the batch is not acked: the publisher re-sends it and it is offered
        again, at ``nack_retry_ms`` pace while it keeps raising. Returns a function that unregisters it.
        """
        return self._listen(self._batch_listeners, callback, "on_messages")

    def _listen(self, listeners: list[Any], callback: Any, name: str) -> Callable[[], None]:
        """Register ``callback`` once. A second registration is refused: who took a re-sent message
        is tracked per listener, so two registrations would count as one (one's failure hidden by
        the other's success, the same message offered twice), and one unregister removes one."""
        if not callable(callback):
            raise ConfigurationError(f"{name} takes a callable")
        with self._lock:
            if callback in listeners:  # equality, as unregistering uses: a bound method made anew matches
                raise ConfigurationError(
                    f"this {name} callback ({getattr(callback, '__qualname__', type(callback).__name__)}) is "
                    "registered already",
                    hint="Unregister it first (call the function its registration returned), or register "
                         "a distinct callable if it must run twice")
            listeners.append(callback)

        def remove() -> None:
            with self._lock:
                if callback in listeners:
                    listeners.remove(callback)

        return remove

    def stats(self) -> dict[str, Any]:
        """Data-plane counters plus, per group, the receive buffer's drops, and the status messages a
        later one of their sender replaced before they were handled (``status_superseded``)."""
        out = self.dataplane.stats()
        with self._lock:
            out["inbox_dropped"] = {name: g.inbox_dropped for name, g in self._groups.items()}
            out["status_superseded"] = self.status_superseded
        return out

    # --- repair ----------------------------------------------------------------------------------

    def repair(self, group: str) -> int:
        """Run a repair round now against every member; returns how many entries changed here."""
        return self._repair_all(self._group(group))

    def _repair_all(self, g: _Group) -> int:
        with self._lock:
            dids = list(g.record.peers)
        futures = [self._io.submit(self._repair_with, g, did) for did in dids]
        wait(futures, timeout=self.config.request_timeout_s + 2.0)
        changed = sum(f.result() for f in futures if f.done() and f.exception() is None)
        changed += self._introduce(g)
        self._pair_missing(g)
        return changed

    def _introduce(self, g: _Group) -> int:
        """Admit into our view members heard of second-hand, if a member we know vouches for them.

        A member that joined while we did (so neither had the other in its view) carries its
        acceptor's ticket; an intruder a byzantine member slipped into its own view does not carry
        one from anyone but itself. Our policy decides as if it subscribed to us.
        """
        with self._lock:
            pending = list(g.pending.values())
        admitted = []
        for entry in pending:
            if entry.status != ACTIVE:
                continue
            voucher = self._vouched(g, entry.ticket, entry.did)
            if voucher is None or voucher == entry.did:
                continue
            with self._lock:
                decision = g.policy.decide(AdmissionRequest(group=g.name, stage="subscribe", member_did=entry.did,
                                                            label=entry.label, role=entry.role, vouched_by=voucher))
            if decision:
                admitted.append(entry)
            else:
                log.info("group %r: not introducing %s (%s)", g.name, entry.did, decision.reason)
        if admitted:
            log.info("group %r: introduced %d member(s) heard of by repair", g.name, len(admitted))
        return self._apply(g, admitted, source=None, allow_new=True) if admitted else 0

    def _repair_with(self, g: _Group, did: str) -> int:
        """Digest to one member; merge what it has newer, push what it wants."""
        with self._lock:
            connection_id = g.record.peers.get(did)
            digest = Digest(group=g.name, state_hash=g.view.state_hash(), versions=g.view.versions())
        if connection_id is None or g.phase != _ACTIVE:
            return 0
        try:
            answer = self._agent.request(connection_id, digest, self.config.request_timeout_s)
            if not isinstance(answer, DigestResponse):
                return 0
            changed = (self._apply(g, parse_entries(answer.entries, group=g.name, skip_invalid=True), source=None)
                       if answer.entries else 0)
            if answer.want:
                with self._lock:
                    wanted = [e.to_dict() for d in answer.want if (e := g.view.get(d)) is not None]
                if wanted:
                    self._agent.deliver(connection_id, ViewUpdate(group=g.name, entries=wanted),
                                        self.config.request_timeout_s)
            return changed
        except (ZeroCommError, ValueError) as exc:
            log.debug("group %r: repair with %s failed (%s)", g.name, did, type(exc).__name__)
            return 0

    def _pair_missing(self, g: _Group) -> None:
        """Connect to active members we have no relationship with (joins that raced), if our DID sorts first."""
        if g.phase != _ACTIVE or self._closing.is_set():
            return
        now = time.monotonic()
        with self._lock:
            missing = [e for e in g.view.members((ACTIVE,))
                       if e.did != self.did and e.did not in g.record.peers and self.did < e.did
                       and g.pair_after.get(e.did, 0.0) <= now]
            for e in missing:
                g.pair_after[e.did] = now + self.config.pair_retry_s
        for entry in missing:
            try:
                self._jobs.submit(self._pair_with, g, entry)
            except RuntimeError:  # shutting down
                return

    def _pair_with(self, g: _Group, entry: MemberEntry) -> None:
        try:
            pair = self._subscribe_to(g, entry, time.monotonic() + 2 * self.config.request_timeout_s, admit=True)
            with self._lock:
                g.record.peers[entry.did] = pair.record.connection_id
            self._save(g)
            self._probe(g, [entry.did], time.monotonic() + self.config.probe_timeout_s)
            log.info("group %r: connected to %s (%s), found by repair", g.name, entry.label, entry.did)
        except ZeroCommError as exc:
            log.info("group %r: connecting to %s failed (%s); will retry", g.name, entry.did, type(exc).__name__)
            with self._lock:
                paired = entry.did in g.record.peers
            if not paired:
                try:
                    self.dataplane.remove_member(g.name, entry.did)
                except GroupError:
                    pass

    # --- background: status handling, periodic repair, positions, pruning ---------------------------------

    def _control_main(self) -> None:
        next_repair = time.monotonic() + self.config.digest_interval_s
        next_persist = time.monotonic() + self.config.persist_interval_s
        tick = min(self.config.persist_interval_s, self.config.digest_interval_s, 0.5)
        while not self._closing.is_set():
            try:
                task = self._control.get(timeout=tick)
            except queue.Empty:
                task = None
            if self._closing.is_set():
                return
            try:
                if task is not None:
                    task()
                now = time.monotonic()
                if now >= next_persist:
                    next_persist = now + self.config.persist_interval_s
                    for g in self._active_groups():
                        self._persist_positions(g)
                        self._prune_taken(g)
                if now >= next_repair:
                    next_repair = now + self.config.digest_interval_s * random.uniform(0.75, 1.25)
                    for g in self._active_groups():
                        self._prune(g)
                        self._schedule_repair(g)
            except Exception as exc:  # noqa: BLE001 - the loop must survive one bad item
                if not self._closing.is_set():
                    log.error("group background work failed: %s", type(exc).__name__, exc_info=exc)

    def _active_groups(self) -> list[_Group]:
        with self._lock:
            return [g for g in self._groups.values() if g.phase == _ACTIVE]

    def _schedule_repair(self, g: _Group) -> None:
        with self._lock:
            if g.repairing or not g.record.peers:
                peers: list[str] = []
            else:
                peers = list(g.record.peers)
                g.repairing = True
        if not peers:
            self._pair_missing(g)
            return

        def run() -> None:
            try:
                self._repair_with(g, random.choice(peers))
                if g.pending:
                    self._introduce(g)
                self._pair_missing(g)
            finally:
                g.repairing = False

        try:
            self._jobs.submit(run)
        except RuntimeError:
            g.repairing = False

    def _prune(self, g: _Group) -> None:
        """Drop joiners that never announced themselves active (crashed or refused mid-join)."""
        cutoff = time.time_ns() // 1_000_000 - int(self.config.joining_ttl_s * 1000)
        with self._lock:
            stale = [e.did for e in g.view.members((JOINING,)) if e.version < cutoff]
            for did in stale:
                g.view.remove(did)
            paired = [did for did in stale if g.record.peers.pop(did, None) is not None]
        for did in paired:
            try:
                self.dataplane.remove_member(g.name, did)
            except GroupError:
                pass
        if stale:
            log.info("group %r: dropped %d joiner(s) that never became active", g.name, len(stale))
            self._save(g)

