"""The ZeroMQ data plane of one member: encrypted, reliable, ordered group messages.

Membership code (``manager.py``) drives this API; applications see ``publish`` and ``on_deliver``.

Why it is built this way (docs/groups.md, "Data plane"):

* **One IO thread owns every socket** (pyzmq sockets are not thread-safe): the XPUB, one SUB per
  (group, remote member) and an inproc wake-up PAIR. Other threads hand it work through deques and
  poke it through the PAIR; nothing from the network can reach those deques except through the
  sockets the IO thread reads.
* **CURVE everywhere.** The XPUB is a CURVE server; a ZAP authenticator on this plane's own context
  admits only current members' transport keys, and XPUB_MANUAL lets the IO thread accept each
  subscription only for topics that key may read (its groups' topics, its own multi-mode pair
  topic), so a member of one group cannot even see another group's ciphertext. SUBs are CURVE
  clients pinned to the member's server key: what arrives on a SUB comes from that member.
* **End-to-end encryption per batch.** A sender thread packs what is queued per group into one
  ``data-batch`` and pays the envelope crypto once per batch: ``shared`` one envelope wrapped for
  every member's group key; ``single`` one envelope per member on the common topic (receivers read
  the recipient kid from the protected header and skip others' envelopes without decrypting);
  ``multi`` one envelope per member on its own pair topic.
* **Publisher signatures.** Authcrypt with several recipients only authenticates the content key,
  which every recipient learns: in ``shared`` mode a member could re-encrypt a body of its own
  under the publisher's entry for another member. So every batch and hello carries a detached
  Ed25519 signature by the publisher's group key over its exact plaintext bytes (once per batch,
  in every mode, resend answers and heartbeats too; see datamessage.py), and receivers check it
  against the publisher's ``group_verkey`` before anything of it is delivered. A missing or wrong
  signature, or a batch signed for another member, drops the batch (``forged_batches``).
* **Reliability without silent loss.** XPUB_NODROP turns a full queue into backpressure. The
  publisher keeps messages until every member acked them (acks by DirectSend on
  ``ProtocolId.GROUP_DATA``), bounds unacked messages with a window in messages and bytes
  (``publish`` waits, with a deadline, then raises :class:`BackpressureError`), answers NACKs (RPC
  "resend seq a..b") with an envelope for that member only, split to fit one transport frame, from
  the member's ack on and within its budget of answer bytes (``_ResendBudget``: a member asking
  again and again for what it has not acked is slowed, one recovering a real gap is not), and
  sends a heartbeat (its last seq) to members whose acks stall, so a lost tail becomes a gap they
  NACK. Receivers deliver per-publisher FIFO (hold-back, gap NACKs) and drop duplicates by message id.
  A member alive but making no ack progress at all for ``ack_stall_s`` while owed messages
  (hostile, or its delivery callback stuck) stops holding the window until it catches up, so it
  cannot stall every publisher of the group (see the paragraph on callbacks below).
* **Batching.** A sender thread packs what is queued per group (``batch_max`` / ``linger_ms``); a
  publisher that fills whole batches packs them itself (caller runs), which spares the GIL hand-off.
* **Causality.** One Lamport clock per member: ticked on publish, observed before every delivery.
* **Liveness.** Keepalive pings over the peer transport mark members alive/inactive; inactive
  members do not hold the publish window, nor do stalled ones (alive, no ack progress for
  ``ack_stall_s``; logged at warning, ``stats()['ack_stalled']``) until they catch up.

Threads: IO, sender (batch + pack), receiver (decrypt, sequence, deliver, ack, NACK), maintenance
(keepalives, heartbeats, ack stalls), ZAP authenticator; transport workers run the GROUP_DATA handlers.
``on_deliver`` (or ``on_deliver_many``, one call per delivery batch, when given) and ``on_state`` run
on the receiver thread, one at a time, in order: a slow callback is backpressure on the publishers,
never loss, as long as it makes progress. A member that makes no progress at all for ``ack_stall_s``
(its ack does not advance while messages sent to it are unacked) stops holding the publishers'
window until it acks again; what it lacks is kept for it within the retention limits, as for an
inactive member, and the receipts of those messages still wait for its acks, or fail with
:class:`MessagesDroppedError` if retention drops them before it acks them. Each advance of its ack
restarts the clock, so a slow but progressing callback never stalls. Acknowledgements cover only
what a callback returned from. A callback that raises has not taken its messages: they count as
missing again (not acked, NACKed at ``nack_retry_ms`` pace) and are offered again when the
publisher re-sends them.
"""

from __future__ import annotations

import binascii
import hashlib
import itertools
import json
import logging
import operator
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from zerocomm_spark import envelope
from zerocomm_spark.deadlines import LISTENER_HANDSHAKE_MS, check_timeout
from zerocomm_spark.errors import (
    BackpressureError,
    ConfigurationError,
    DataPlaneClosedError,
    DeliveryDeferredError,
    DIDError,
    FrameTooLargeError,
    GroupAlreadyOpenError,
    GroupError,
    GroupNotOpenError,
    MalformedDataMessageError,
    MalformedGroupMessageError,
    NotAMemberError,
    PeerTimeoutError,
    ReadOnlyMemberError,
    TransportError,
    ZeroCommError,
)
from zerocomm_spark.group import datamessage as dm
from zerocomm_spark.group import topics
from zerocomm_spark.group.dedup import TTLCache
from zerocomm_spark.group.headers import check_headers
from zerocomm_spark.group.lamport import MAX_JUMP, LamportClock
from zerocomm_spark.group.outbox import Outbox, PublishReceipt
from zerocomm_spark.group.sequencing import PublisherStream
from zerocomm_spark.keys.keypair import KeyPair, verkey_to_x25519
from zerocomm_spark.text import is_utf8_text
from zerocomm_spark.transport.frames import ProtocolId
from zerocomm_spark.transport.peer import connectable

if TYPE_CHECKING:
    from zerocomm_spark.transport.peer import PeerInfo, PeerTransport

__all__ = [
    "MODES",
    "READ_ONLY",
    "READ_WRITE",
    "ROLES",
    "DataPlane",
    "DataPlaneConfig",
    "Delivered",
    "PublishReceipt",
    "RemoteMember",
]

log = logging.getLogger(__name__)

READ_WRITE = "read_write"
READ_ONLY = "read_only"
ROLES = (READ_WRITE, READ_ONLY)
MODES = ("single", "multi", "shared")
Mode = Literal["single", "multi", "shared"]
Role = Literal["read_write", "read_only"]

_DATA, _STATE = "data", "state"
# A SUB also subscribes to its pair topic in shared and single mode, where nothing is published on it:
# when its connection ends, the XPUB hands us an unsubscription of each of its topics without the
# key it came from (no metadata), and only this topic tells whose connection it was (_read_subscriptions).
_PRESENCE = "presence"
_SUB_MAX_MSG = 64 * 1024 * 1024  # a SUB refuses bigger frames: bounds memory per message
_LINGER_MS = 500
_START_TIMEOUT = 10.0
_CMD_TIMEOUT = 10.0
#: Void seqs (a restarted publisher's skipped reservation) reported to ``on_superseded`` per skip at
#: most: a bigger range stays a hole readers call lost, rather than one list this long per batch.
_VOID_MAX = 1 << 18
_REBIND_WAIT_S = 5.0  # how long a rebind of the publish endpoint retries before the IO thread goes on without it
# After a rebind, sends wait for the subscribers to subscribe again for at most resend_after_ms and at
# most this long: past it, a member not back yet gets what it missed by heartbeat and NACK, as before.
_REBIND_HOLD_MAX_S = 5.0
_ID_BYTES = 12  # bytes (96 bits, 24 hex digits) of a message id publish() makes when not given ids
_READ_BATCH = 128  # frames read per socket per IO turn, so one busy publisher starves nobody
# A resend answer is one transport frame (an RPC response, whose header is 6 bytes): room for that
# header and the envelope's, and for the batch's other fields (group, DIDs, ids, numbers) in its plaintext.
_RPC_HEAD = 16
_ANSWER_FRAME_SLACK = 1024
_ANSWER_PLAIN_SLACK = 8192
_RESEND_MSG_SLACK = 160  # a resent message's fields besides its payload, roughly (its budget estimate)
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class _KeySource(Protocol):
    def get(self, verkey: str) -> KeyPair: ...


# --- public value types ----------------------------------------------------------------------


@dataclass
class RemoteMember:
    """Another member of a group, as the membership flows learned it (join/subscribe).

    ``relationship_verkey`` is their key in our pairwise DIDComm relationship and
    ``my_relationship_verkey`` ours (held in our keystore); ``transport_key`` is their CURVE public
    key (Z85), which pins our SUB to their XPUB and admits their SUB to ours.
    """

    did: str
    group_verkey: str = field(repr=False)
    relationship_verkey: str = field(repr=False)
    my_relationship_verkey: str = field(repr=False)
    publish_endpoint: str
    transport_key: str = field(repr=False)
    peer_endpoint: str
    role: str = READ_WRITE


@dataclass(frozen=True)
class Delivered:
    """One message delivered to the application, in its publisher's order.

    ``(lamport_ts, publisher_did)`` orders messages of all publishers consistently with causality.
    """

    group: str
    message_id: str
    publisher_did: str
    seq: int
    lamport_ts: int
    sent_at: float
    received_at: float
    payload: bytes = field(repr=False)
    headers: dict[str, str] | None = field(default=None, hash=False)


_new = object.__new__
_SEQ_OF = operator.itemgetter(1)  # DataMessage.seq (a NamedTuple field)


def _HELD_SIZE(message: dm.DataMessage) -> int:  # noqa: N802 - a constant-like helper beside _SEQ_OF
    """A held message's bytes, about: its payload and ~128 for the other fields."""
    return len(message.payload) + 128


def _answer_room(max_frame_bytes: int) -> int:
    """Plaintext bytes a resend answer may take for its messages: the envelope carries it in base64."""
    return max(0, (max_frame_bytes - _ANSWER_FRAME_SLACK) * 3 // 4 - _ANSWER_PLAIN_SLACK)


def _answer_bytes(payload: int, messages: int) -> int:
    """About the envelope bytes of a resend answer holding ``messages`` whose payloads total ``payload``
    bytes: each payload is base64 in the batch, the batch base64 in the envelope."""
    return ((payload + messages * _RESEND_MSG_SLACK) * 4 // 3 + _ANSWER_PLAIN_SLACK) * 4 // 3 + _ANSWER_FRAME_SLACK


def _delivered(group: str, message_id: str, publisher_did: str, seq: int, lamport_ts: int, sent_at: float,
               received_at: float, payload: bytes, headers: dict[str, str] | None) -> Delivered:
    """Build a Delivered without the frozen-dataclass __init__ (one setattr per field): this runs
    once per delivered message and is several times cheaper; the result is an ordinary Delivered."""
    d = _new(Delivered)
    d.__dict__.update(group=group, message_id=message_id, publisher_did=publisher_did, seq=seq,
                      lamport_ts=lamport_ts, sent_at=sent_at, received_at=received_at, payload=payload,
                      headers=headers)
    return d


@dataclass(frozen=True)
class DataPlaneConfig:
    """Tuning of a data plane; the defaults favour throughput with bounded memory.

    Windows and buffers count messages (the ``*_bytes`` limits their payload bytes); HWMs count
    envelopes (batches).
    """

    batch_max: int = 512  # messages per envelope
    batch_max_bytes: int = 1024 * 1024  # payload bytes per envelope (before base64)
    linger_ms: float = 1.0  # how long the sender waits for a batch to fill
    window: int = 16_384  # unacked messages per group before publish() waits
    window_bytes: int = 256 * 1024 * 1024  # and their payload bytes (large messages must not hold gigabytes)
    retention_max: int = 200_000  # messages kept for inactive members
    retention_max_bytes: int = 512 * 1024 * 1024  # and their payload bytes
    max_message_bytes: int = 4 * 1024 * 1024
    sndhwm: int = 2_000
    rcvhwm: int = 2_000
    recv_queue_max: int = 64  # envelopes decoded-but-undelivered before SUBs stop being read (and heartbeats,
    # resend answers over the peer transport, each kind, before they are dropped)
    # Of those heartbeats and answers, each kind, how many one member may hold, whatever its groups (None:
    # recv_queue_max // 4, at least 1), so a member flooding heartbeats or slow to answer (buggy or hostile)
    # cannot crowd out the others'. recv_queue_max: no isolation.
    recv_queue_share: int | None = None
    ack_interval_ms: float = 50.0
    ack_every: int = 2_048
    nack_after_ms: float = 100.0
    nack_retry_ms: float = 300.0
    resend_after_ms: float = 1_000.0  # heartbeat to a member whose acks stalled (tail loss, lost acks)
    resend_max: int = 2_048  # messages per resend envelope
    # Resend answers one member may draw from us per group (bytes of envelopes): a token bucket of
    # resend_burst_bytes (None: 4 of the largest answers, ~30 MB by default; never less than one, so any
    # answer fits), refilled at resend_rate_bytes a second (None: half the largest answer, ~3.7 MB).
    # Seqs a member is resent for the first time are paid back when it acks them, so recovering a real
    # gap is not slowed; asking again for what it was sent (and has not acked) is what the rate bounds.
    resend_burst_bytes: int | None = None
    resend_rate_bytes: int | None = None
    request_timeout_s: float = 5.0
    keepalive_ms: float = 2_000.0
    dead_after_ms: float = 10_000.0
    probe_interval_ms: float = 50.0
    hold_max: int = 100_000  # held-back messages per publisher
    hold_bytes_max: int = 256 * 1024 * 1024  # and their payload bytes (a publisher's gap must not hold gigabytes)
    dedup_ttl_s: float = 600.0
    dedup_max: int = 200_000
    # A member alive (answering keepalives) whose ack has not advanced for this long while it lags
    # behind what was sent (a hostile member, or its delivery callback stuck) stops holding the
    # window ("stalled", logged at warning, stats()['ack_stalled']) until it acks again (then, like a
    # member back from inactive, the publishers go on at half its pace until it is within a window:
    # outbox.py); what it lacks is kept within the retention limits, as for an inactive member, and its
    # receipts still wait for its acks. Each advance of its ack restarts the clock, so a slow but
    # progressing member never stalls. None: never released (one such member stalls every publisher).
    ack_stall_s: float | None = 30.0

    def __post_init__(self) -> None:
        for name in ("batch_max", "batch_max_bytes", "window", "window_bytes", "retention_max", "retention_max_bytes",
                     "max_message_bytes", "sndhwm", "rcvhwm", "recv_queue_max", "ack_every", "resend_max", "hold_max",
                     "hold_bytes_max", "dedup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"DataPlaneConfig.{name} must be a positive integer, got {value!r}")
        for name in ("ack_interval_ms", "nack_after_ms", "nack_retry_ms", "resend_after_ms", "request_timeout_s",
                     "keepalive_ms", "dead_after_ms", "probe_interval_ms", "dedup_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigurationError(f"DataPlaneConfig.{name} must be a positive number, got {value!r}")
        stall = self.ack_stall_s
        if stall is not None and (not isinstance(stall, (int, float)) or isinstance(stall, bool)
                                  or not 0 < stall < float("inf")):
            raise ConfigurationError(f"DataPlaneConfig.ack_stall_s must be None or a positive number of seconds, "
                                     f"got {stall!r}")
        if stall is not None and stall * 1000 <= 2 * self.ack_interval_ms:  # (ack_interval_ms checked above)
            # A healthy member acks every ack_interval_ms: shorter, it would stall between two acks.
            raise ConfigurationError(
                f"DataPlaneConfig.ack_stall_s ({stall:g} s) must be more than twice ack_interval_ms "
                f"({self.ack_interval_ms:g} ms): healthy members would stall between acks")
        if not isinstance(self.linger_ms, (int, float)) or self.linger_ms < 0:
            raise ConfigurationError(f"DataPlaneConfig.linger_ms must be >= 0, got {self.linger_ms!r}")
        for name in ("resend_burst_bytes", "resend_rate_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigurationError(f"DataPlaneConfig.{name} must be None or a positive integer, got {value!r}")
        share = self.recv_queue_share
        if share is not None and (not isinstance(share, int) or isinstance(share, bool)
                                  or not 1 <= share <= self.recv_queue_max):
            raise ConfigurationError("DataPlaneConfig.recv_queue_share must be None or a whole number from 1 to "
                                     f"recv_queue_max ({self.recv_queue_max}), got {share!r}")
        if self.retention_max < self.window:
            raise ConfigurationError("DataPlaneConfig.retention_max must be at least the window")
        if self.retention_max_bytes < self.window_bytes:
            raise ConfigurationError("DataPlaneConfig.retention_max_bytes must be at least window_bytes")


# --- internal state --------------------------------------------------------------------------


@dataclass(slots=True)
class _Member:
    info: RemoteMember
    my_key: KeyPair  # our relationship key pair with this member
    base: int  # our stream to it starts after this seq
    pair_topic: bytes | None  # multi mode: our pair topic to it


@dataclass(slots=True)
class _Sub:
    group: str
    did: str
    endpoint: str
    server_key: bytes
    topics: dict[bytes, str]
    sock: Any = None
    monitor: Any = None  # handshake events: a refused CURVE handshake is never retried by libzmq
    got_any: bool = False
    next_resub: float = 0.0
    resub_ivl: float = 0.2
    reconnect_at: float | None = None
    reconnect_ivl: float = 0.1
    down_until: float = 0.0  # test hook: closed until then


class _Group:
    """Everything a data plane keeps for one open group."""

    def __init__(self, name: str, mode: str, ordered: bool, group_key: KeyPair, role: str,
                 outbox: Outbox) -> None:
        self.name = name
        self.mode = mode
        self.ordered = ordered
        self.group_key = group_key
        self.role = role
        self.outbox = outbox
        self.members: dict[str, _Member] = {}
        self.data_topic = topics.data_topic(name)
        self.state_topic = topics.state_topic(name)
        # receive side: owned by the receiver thread, read by others under DataPlane._rx_lock
        self.streams: dict[str, PublisherStream[dm.DataMessage]] = {}
        self.positions: dict[str, int] = {}
        self.acks_sent: dict[str, tuple[int, float]] = {}
        self.ack_needed: set[str] = set()
        self.sync_at: dict[str, float] = {}
        self.pending_restore: dict[str, int] = {}
        # Publishers whose stream position here came from restore_positions (a restart of ours) and
        # which have sent no base since: it may lag what we delivered (and acked) before the restart.
        self.restored: set[str] = set()
        self.wire_seq = outbox.last_seq  # highest seq handed to ZeroMQ (set by the IO thread)
        self.pack_lock = threading.Lock()
        self.pack_failed_logged = 0.0  # monotonic time of the last "packing failed" log line (rate limit)
        self.resend_budgets: dict[str, _ResendBudget] = {}  # member -> what it may still draw in resends
        self.closed = False


class _ResendBudget:
    """Resend answer bytes one member may still draw from us in one group (a token bucket).

    Answer bytes for seqs it is resent for the first time (past ``first_sent``) are owed back to it
    when it acks them (``owed``: (last seq, bytes)), so an honest member recovering a gap gets its
    bytes back as it delivers; re-asking for what it was sent and did not ack is paid from the rate.
    """

    __slots__ = ("lock", "tokens", "at", "first_sent", "owed", "throttled_log", "throttled_since")

    OWED_MAX = 1024  # answers awaiting their ack; past it the oldest is not paid back

    def __init__(self, tokens: float, now: float) -> None:
        self.lock = threading.Lock()
        self.tokens = tokens
        self.at = now
        self.first_sent = 0  # highest seq resent to it so far
        self.owed: deque[tuple[int, int]] = deque()
        self.throttled_log = float("-inf")  # monotonic time of the last warning
        self.throttled_since = 0  # throttled answers not logged since

    def refill(self, now: float, burst: int, rate: int) -> None:
        if now > self.at:
            self.tokens = min(float(burst), self.tokens + (now - self.at) * rate)
        self.at = now

    def acked(self, seq: int, burst: int) -> None:
        back = 0
        owed = self.owed
        while owed and owed[0][0] <= seq:
            back += owed.popleft()[1]
        if back:
            self.tokens = min(float(burst), self.tokens + back)


class _Stats:
    """Counters; the hot paths add once per batch, so one lock is cheap enough."""

    NAMES = (
        "messages_out", "bytes_out", "envelopes_out", "messages_in", "bytes_in", "envelopes_in",
        "retransmits", "heartbeats", "nacks_sent", "nacks_served", "nack_failures", "duplicates_dropped",
        "rejected_non_member", "rejected_read_only", "rejected_malformed", "not_for_me", "wrong_topic",
        "lost", "subscriptions_accepted", "subscriptions_refused", "callback_errors", "probes_sent",
        "backpressure_stalls", "publish_resets", "forged_batches", "deliveries_deferred", "receive_queue_full",
        "implausible_announcements", "receive_share_full", "resend_throttled", "resend_bytes_throttled",
        "ack_stalls",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = dict.fromkeys(self.NAMES, 0)

    def add(self, **delta: int) -> None:
        with self.lock:
            values = self.values
            for name, value in delta.items():
                values[name] += value


class _QuietZapLog:
    """The ZAP authenticator logs client keys at debug level; we log no keys at all."""

    def debug(self, *args: Any, **kwargs: Any) -> None:
        pass

    info = debug

    def warning(self, *args: Any, **kwargs: Any) -> None:
        log.warning("ZAP authenticator: refused a malformed authentication request")

    error = warning
    exception = warning


class _CurveAllowList:
    """ZAP credentials provider: admits exactly the transport keys of current members."""

    def __init__(self) -> None:
        self.keys: frozenset[bytes] = frozenset()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


# --- helpers ---------------------------------------------------------------------------------

_PROTECTED_PREFIX = b'{"protected":"'
_URL_TO_STD = bytes.maketrans(b"-_", b"+/")


def _recipient_kids(env: bytes) -> list[str] | None:
    """The recipient verkeys of an RFC 0019 envelope, read from its protected header only.

    This is what lets a single-mode receiver skip envelopes for other members without any
    decryption. None if the envelope is malformed.
    """
    try:
        if env.startswith(_PROTECTED_PREFIX):  # our own layout: no need to parse the ciphertext
            end = env.index(b'"', len(_PROTECTED_PREFIX))
            protected = env[len(_PROTECTED_PREFIX):end]
        else:
            outer = json.loads(env)
            protected = outer["protected"].encode("ascii")
        raw = protected.rstrip(b"=").translate(_URL_TO_STD)
        header = json.loads(binascii.a2b_base64(raw + b"=" * (-len(raw) % 4)))
        return [r["header"]["kid"] for r in header["recipients"]]
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error, UnicodeError, RecursionError):
        return None  # RecursionError: a deeply nested header (json raises it, not ValueError)


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ConfigurationError(f"a role is 'read_write' or 'read_only', got {role!r}")
    return role


def _z85_key(key: bytes | str, what: str) -> bytes:
    raw = key.encode("ascii") if isinstance(key, str) else bytes(key)
    if len(raw) != 40:
        raise ConfigurationError(f"{what} must be a 40-character Z85 CURVE key")
    return raw


# --- the data plane --------------------------------------------------------------------------


class DataPlane:
    """The group data plane of one member: one XPUB, SUBs to the other members, reliability.

    Create, ``start()``, ``open_group``, ``add_member`` for each other member (both sides add each
    other), ``probe`` each new member before relying on its first message, then ``publish``.
    One data plane per PeerTransport: it registers the ``GROUP_DATA`` handlers.
    """

    def __init__(
        self,
        *,
        member_did: str,
        keystore: _KeySource,
        transport: PeerTransport,
        curve_keypair: tuple[bytes, bytes],
        publish_bind: str = "tcp://127.0.0.1:*",
        on_deliver: Callable[[Delivered], None],
        on_state: Callable[[str, bytes, str], None] | None = None,
        config: DataPlaneConfig = DataPlaneConfig(),  # noqa: B008 - frozen, shared safely
        on_deliver_many: Callable[[list[Delivered]], None] | None = None,
        on_superseded: Callable[[str, str, list[int]], None] | None = None,
        clock: LamportClock | None = None,
    ) -> None:
        self.member_did = topics.check_did(member_did)
        if not callable(on_deliver):
            raise ConfigurationError("on_deliver must be a callable taking a Delivered")
        if on_deliver_many is not None and not callable(on_deliver_many):
            raise ConfigurationError("on_deliver_many must be a callable taking a list of Delivered, or None")
        if on_state is not None and not callable(on_state):
            raise ConfigurationError("on_state must be a callable taking (group, blob, member DID) or None")
        if not isinstance(config, DataPlaneConfig):
            raise ConfigurationError("config must be a DataPlaneConfig")
        self._keystore = keystore
        self._transport = transport
        self._curve_public = _z85_key(curve_keypair[0], "the CURVE public key")
        self._curve_secret = _z85_key(curve_keypair[1], "the CURVE secret key")
        self._bind = publish_bind
        self._on_deliver = on_deliver
        self._on_deliver_many = on_deliver_many
        # (group, publisher, seqs): new seqs whose message ids were delivered before - a publisher
        # re-sending under new seqs (a retried sink task after its agent restarted) - and void seqs
        # a publisher restarted after a crash skipped. Called before they are acked, so a journal can
        # record that those seqs have no row by design.
        self._on_superseded = on_superseded
        self._on_state = on_state
        self.config = config
        self._answer_room = _answer_room(transport.max_frame_bytes)
        self._resend_room = max(1, min(config.batch_max_bytes * 4, self._answer_room * 3 // 4))  # payload bytes
        # The largest resend answer (an envelope): the budget's unit. One message may be larger than a
        # batch's worth (a small batch_max_bytes): its answer counts, or the bucket went that far below
        # zero (-7 MB against a 64 KB/s refill) and the member's next resends waited minutes.
        answer = min(transport.max_frame_bytes - _RPC_HEAD,
                     max(_answer_bytes(self._resend_room, 0), _answer_bytes(self.max_payload_bytes, 1)))
        self._resend_burst = max(config.resend_burst_bytes or 4 * answer, answer)
        self._resend_rate = config.resend_rate_bytes or max(1, answer // 2)

        self._lock = threading.RLock()  # groups, members, key maps, ACL
        self._groups: dict[str, _Group] = {}
        # Last seq published in each group closed here: a rejoin continues after it, since a member
        # that missed the leave keeps its stream and would drop reused seqs as duplicates (and ack them).
        self._closed_seqs: dict[str, int] = {}
        self._rel_keys: dict[str, KeyPair] = {}  # our relationship verkey -> key pair
        self._clock = clock if clock is not None else LamportClock()  # durable if the caller reserves (lamport.py)
        self._jump_logged = 0.0  # monotonic time of the last "stamp too far ahead" warning (rate limit)
        self._id_key = os.urandom(32)  # message ids this plane makes (publish): see there
        self._id_calls = itertools.count()
        self._dedup = TTLCache(config.dedup_ttl_s, config.dedup_max)
        self._stats = _Stats()
        self._allow = _CurveAllowList()
        self._acl: dict[str, frozenset[bytes]] = {}  # z85 user id -> topics it may subscribe to
        # A member's pair topic in a group -> that member's topics in the group (see _PRESENCE).
        self._presence: dict[bytes, frozenset[bytes]] = {}

        self._started = False
        self._closed = False
        self._stopping = threading.Event()
        self._ctx: zmq.Context[Any] | None = None
        self._auth: ThreadAuthenticator | None = None
        self._endpoint: str | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._threads: list[threading.Thread] = []

        # IO thread mailboxes
        self._io_lock = threading.Lock()
        self._wake_addr = f"inproc://zerocomm-dataplane-{os.getpid()}-{secrets.token_hex(6)}"
        self._wake_tx: zmq.Socket[Any] | None = None
        self._wake_pending = False
        self._cmds: deque[tuple[Any, ...]] = deque()
        self._out_ctrl: deque[tuple[list[bytes], Future[None] | None]] = deque()
        self._out_data: deque[tuple[list[bytes], _Group | None, int]] = deque()  # frames, group, its last seq
        self._io_thread: threading.Thread | None = None

        # sender
        self._send_event = threading.Event()
        # receiver
        self._rx_ident: int | None = None  # the receiver thread: delivery callbacks run on it
        self._rx: deque[tuple[Any, ...]] = deque()
        # Items in _rx that came over the peer transport, by kind ("batch": heartbeats, "answer"):
        # each kind is bounded by recv_queue_max, as the SUBs are, and one cannot crowd out the other.
        self._rx_peer: dict[str, int] = {"batch": 0, "answer": 0}
        # The same by kind and member DID (the authenticated sender), so no member holds more than
        # _rx_share of a kind and one member's flood cannot crowd out the others'. Answers count from
        # their request on (queued or awaited). Only members holding some are kept: memory stays bounded.
        self._rx_share = (config.recv_queue_share if config.recv_queue_share is not None
                          else max(1, config.recv_queue_max // 4))
        self._rx_from: dict[str, dict[str, int]] = {"batch": {}, "answer": {}}
        # Resend requests sent whose answers are not queued yet: requests stop while queued and
        # awaited answers fill recv_queue_max, so no answer crosses the network only to be dropped.
        self._answers_out = 0
        self._rx_cond = threading.Condition(threading.Lock())
        self._rx_lock = threading.RLock()
        # liveness and probes
        self._last_heard: dict[str, float] = {}
        self._alive: dict[str, bool] = {}
        self._ping_sent: dict[str, float] = {}
        self._pinging: set[str] = set()
        # (did, answered) of finished keepalive pings, appended by the transport's IO thread (a done
        # callback, which must not take our locks), handled by the maintenance thread.
        self._pongs: deque[tuple[str, bool]] = deque()
        self._probes: dict[str, tuple[str, str, threading.Event]] = {}
        self._forged_logged: dict[tuple[str, str], tuple[float, int]] = {}  # (group, did) -> (last log, since)
        self._unbacked_logged: dict[tuple[str, str], tuple[float, int]] = {}  # the same, for announcements

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> DataPlane:
        """Bind the XPUB, start the threads and serve GROUP_DATA on the transport; returns self."""
        with self._lock:
            if self._closed:
                raise DataPlaneClosedError("this data plane was closed")
            if self._started:
                raise GroupError("start() was called twice", hint="Start a data plane once.")
            self._started = True
        self._ctx = zmq.Context()
        self._auth = ThreadAuthenticator(self._ctx, log=_QuietZapLog())
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self._allow)
        self._io_thread = threading.Thread(target=self._io_main, name="zerocomm-group-io", daemon=True)
        self._io_thread.start()
        if not self._ready.wait(_START_TIMEOUT) or self._start_error is not None:
            err = self._start_error
            self._stopping.set()
            self._closed = True
            self._io_thread.join(_START_TIMEOUT)
            self._auth.stop()
            self._ctx.term()
            raise ConfigurationError(f"cannot bind the group publish socket to {self._bind!r}: {err}") from err
        wake = self._ctx.socket(zmq.PAIR)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._wake_addr)
        self._wake_tx = wake
        for target, name in ((self._sender_main, "zerocomm-group-send"), (self._receiver_main, "zerocomm-group-recv"),
                             (self._maintenance_main, "zerocomm-group-maint")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self._transport.register(ProtocolId.GROUP_DATA, rpc=self._on_rpc, direct=self._on_direct)
        log.info("group data plane of %s publishing on %s", self.member_did, self._endpoint)
        return self

    @property
    def publish_endpoint(self) -> str:
        """Where other members connect their SUB (announce it in subscribe messages)."""
        if self._endpoint is None:
            raise DataPlaneClosedError("the data plane has no publish endpoint before start()")
        return self._endpoint

    @property
    def curve_public_key(self) -> str:
        """This plane's CURVE public key (Z85), the ``transport_key`` others need."""
        return self._curve_public.decode("ascii")

    @property
    def lamport_time(self) -> int:
        return self._clock.time

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (bounded by ``timeout``), stop every thread, fail pending receipts."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            groups = list(self._groups.values())
        if not self._started:
            return
        # Let the sender hand over what was published, then stop.
        while time.monotonic() < deadline and any(g.outbox.unsent_count() for g in groups):
            self._send_event.set()
            time.sleep(0.005)
        self._stopping.set()
        self._send_event.set()
        with self._rx_cond:
            self._rx_cond.notify_all()
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.05))
        self._wake()
        if self._io_thread is not None:
            self._io_thread.join(max(deadline - time.monotonic(), 0.1))
        closed = DataPlaneClosedError("the data plane was closed before the messages were acked")
        for g in groups:
            g.outbox.close(closed)
        for _, _, event in list(self._probes.values()):
            event.set()
        with self._io_lock:
            if self._wake_tx is not None:
                self._wake_tx.close(linger=0)
                self._wake_tx = None
        stuck = [t.name for t in [*self._threads, self._io_thread] if t is not None and t.is_alive()]
        if self._auth is not None:
            self._auth.stop()
        if stuck:
            log.warning("group data plane closed with threads still running: %s", ", ".join(stuck))
        elif self._ctx is not None:
            self._ctx.term()
        log.info("group data plane of %s closed", self.member_did)

    def __enter__(self) -> DataPlane:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- groups and members ------------------------------------------------------------------

    def open_group(self, group: str, *, mode: Mode, ordered: bool, group_key: KeyPair, role: Role,
                   first_seq: int = 1, reserve: Callable[[int], int] | None = None,
                   void: tuple[int, int] | None = None) -> None:
        """Start publishing and receiving for ``group``.

        ``group_key`` is this member's group key (shared-mode envelopes are authcrypted with it);
        ``ordered`` selects per-publisher FIFO delivery (hold-back) over delivery on arrival;
        ``first_seq`` lets a restarted member continue its own sequence (persist it: store.py).
        A group closed on this plane continues after its last seq whatever ``first_seq`` says.
        ``reserve`` saves seqs ahead before they are used and ``void`` names seqs a restarted member
        skipped, which it may never have used (outbox.py).
        """
        topics.check_group(group)
        if mode not in MODES:
            raise ConfigurationError(f"a group mode is one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(group_key, KeyPair):
            raise ConfigurationError("group_key must be a KeyPair (the member's group key from the keystore)")
        _check_role(role)
        if not isinstance(first_seq, int) or first_seq < 1:
            raise ConfigurationError(f"first_seq must be a positive integer, got {first_seq!r}")
        self._check_running()
        with self._lock:
            if group in self._groups:
                raise GroupAlreadyOpenError(f"group {group!r} is already open on this data plane")
            first_seq = max(first_seq, self._closed_seqs.get(group, 0) + 1)
            cfg = self.config
            outbox = Outbox(group, window=cfg.window, retention_max=cfg.retention_max, first_seq=first_seq,
                            window_bytes=cfg.window_bytes, retention_max_bytes=cfg.retention_max_bytes,
                            reserve=reserve, void=void, ack_stall_s=cfg.ack_stall_s)
            self._groups[group] = _Group(group, mode, bool(ordered), group_key, role, outbox)
            self._update_access_locked()
        if void is not None and 0 <= void[1] - void[0] < _VOID_MAX:  # our own journal lacks them too
            self._superseded(group, self.member_did, list(range(void[0], void[1] + 1)))
        log.info("opened group %r (%s mode, %s) as %s", group, mode, "ordered" if ordered else "unordered", role)

    def close_group(self, group: str) -> None:
        """Stop the group's SUBs, forget its members and fail its pending receipts."""
        self._check_running()
        with self._lock:
            g = self._groups.pop(group, None)
            if g is None:
                raise GroupNotOpenError(f"group {group!r} is not open on this data plane")
            g.closed = True
            self._closed_seqs[group] = max(self._closed_seqs.get(group, 0), g.outbox.last_seq)
            dids = list(g.members)
            self._update_access_locked()
        for did in dids:
            self._io_call("sub_remove", group, did)
        g.outbox.close(GroupError(f"group {group!r} was closed before its messages were acked",
                                  hint="Nothing more will be acked for it; reopen the group to publish again."))
        log.info("closed group %r", group)

    def add_member(self, group: str, member: RemoteMember) -> None:
        """Admit ``member``: authorise its CURVE key, connect a SUB to it, owe it our next messages.

        Adding a DID that is already a member updates its endpoints, keys and role in place and keeps
        its progress (a restarted member announces new endpoints this way and still gets what it
        missed). Call ``probe`` afterwards before relying on the member receiving the first message.
        """
        self._check_running()
        if not isinstance(member, RemoteMember):
            raise ConfigurationError("add_member takes a RemoteMember")
        topics.check_did(member.did)
        if member.did == self.member_did:
            raise ConfigurationError("a member does not add itself; its own role is set by open_group/set_role")
        _check_role(member.role)
        server_key = _z85_key(member.transport_key, "the member's transport_key")
        for name in ("group_verkey", "relationship_verkey"):
            try:  # checked now: an unusable key would fail every batch sealed for this member (or, shared, for all)
                verkey_to_x25519(getattr(member, name))
            except (DIDError, ValueError, TypeError):
                raise MalformedGroupMessageError(f"the member's {name} is not a base58 Ed25519 public key") from None
        for ep in (member.publish_endpoint, member.peer_endpoint):
            if not connectable(ep):  # checked before anything changes: the IO thread's connect() would raise
                shown = ep[:200] if isinstance(ep, str) else type(ep).__name__
                raise ConfigurationError(f"a member endpoint looks like tcp://host:port, got {shown!r}")
        my_key = self._keystore.get(member.my_relationship_verkey)
        info = replace(member, transport_key=server_key.decode("ascii"))
        with self._lock:
            g = self._group(group)
            old = g.members.get(member.did)
            base = g.outbox.add_member(member.did)
            pair = topics.pair_topic(group, self.member_did, member.did) if g.mode == "multi" else None
            g.members[member.did] = _Member(info, my_key, base if old is None else old.base, pair)
            self._rel_keys[my_key.verkey] = my_key
            self._update_access_locked()
            self._last_heard.setdefault(member.did, time.monotonic())
            self._alive.setdefault(member.did, True)
            resubscribe = old is None or (old.info.publish_endpoint, old.info.transport_key) != (
                info.publish_endpoint, info.transport_key)
        if resubscribe:
            sub_topics = {g.state_topic: _STATE}
            if g.mode == "multi":
                sub_topics[topics.pair_topic(group, member.did, self.member_did)] = _DATA
            else:
                sub_topics[g.data_topic] = _DATA
                sub_topics[topics.pair_topic(group, member.did, self.member_did)] = _PRESENCE
            if old is not None:
                self._io_call("sub_remove", group, member.did)
            self._io_call("sub_add", _Sub(group, member.did, member.publish_endpoint, server_key, sub_topics))
        restore = None
        with self._rx_lock:
            if member.did in g.pending_restore:
                restore = g.pending_restore.pop(member.did)
        if restore is not None:
            self._request_resend(g, g.members[member.did], restore + 1, None)
        log.info("group %r: %s member %s", group, "updated" if old else "added", member.did)

    def remove_member(self, group: str, did: str) -> None:
        """Forget ``did``: close our SUB to it, drop its CURVE key and acks, cut its subscriptions.

        Its existing connection to our XPUB is cut by re-binding the XPUB on the same endpoint (ZAP
        only runs at connect): the other members reconnect by themselves, and what is published
        meanwhile waits for them to subscribe again (for a bounded time, see ``_rebind``).
        """
        self._check_running()
        with self._lock:
            g = self._group(group)
            m = g.members.pop(did, None)
            if m is None:
                raise NotAMemberError(f"{did} is not a member of group {group!r} here")
            g.outbox.remove_member(did)
            g.resend_budgets.pop(did, None)
            self._update_access_locked()
            still_member = any(did in other.members for other in self._groups.values())
            if not still_member:
                self._last_heard.pop(did, None)
                self._alive.pop(did, None)
            if not any(x.my_key.verkey == m.my_key.verkey for o in self._groups.values() for x in o.members.values()):
                self._rel_keys.pop(m.my_key.verkey, None)
        with self._rx_lock:
            g.streams.pop(did, None)
            g.restored.discard(did)
            g.positions.pop(did, None)
            g.acks_sent.pop(did, None)
            g.ack_needed.discard(did)
            g.sync_at.pop(did, None)
        self._io_call("sub_remove", group, did)
        self._io_call("rebind")
        log.info("group %r: removed member %s", group, did)

    def set_joining(self, group: str, did: str, joining: bool) -> None:
        """Whether member ``did`` is still checking its join. It takes and acks nothing until then,
        which may take seconds: meanwhile it does not hold the publish window (what it lacks is kept
        for it within the retention limits, as for an inactive member), so the publishers do not
        wait on its join. Its receipts still wait for its acks."""
        with self._lock:
            if did not in self._group(group).members:
                raise NotAMemberError(f"{did} is not a member of group {group!r} here")
            outbox = self._group(group).outbox
        outbox.set_joining(did, joining)

    def set_role(self, group: str, did: str, role: Role) -> None:
        """Switch a member's role (or this member's own, with ``did`` = our DID).

        Read-only members cannot publish; data from a publisher we see as read-only is dropped.
        """
        _check_role(role)
        with self._lock:
            g = self._group(group)
            if did == self.member_did:
                g.role = role
                return
            m = g.members.get(did)
            if m is None:
                raise NotAMemberError(f"{did} is not a member of group {group!r} here")
            m.info = replace(m.info, role=role)

    def members(self, group: str) -> list[RemoteMember]:
        """Copies of the group's other members as this data plane knows them."""
        with self._lock:
            return [replace(m.info) for m in self._group(group).members.values()]

    def role(self, group: str) -> str:
        """This member's own role in ``group``."""
        return self._group(group).role

    # --- publishing ----------------------------------------------------------------------------

    @property
    def max_payload_bytes(self) -> int:
        """The largest payload :meth:`publish` takes (without headers): max_message_bytes, and what fits
        a resend answer within the transport's max_frame_bytes."""
        return min(self.config.max_message_bytes, 3 * (self._answer_room // 4))

    def publish(
        self,
        group: str,
        payloads: Sequence[bytes],
        *,
        message_ids: Sequence[str] | None = None,
        headers: Mapping[str, str] | Sequence[Mapping[str, str] | None] | None = None,
        timeout: float = 30.0,
    ) -> PublishReceipt:
        """Queue ``payloads`` for every member, in order; returns once they are buffered.

        Seqs and Lamport timestamps are assigned now (see the receipt). If the group's window of
        unacked messages (``window``, ``window_bytes``) is full this waits up to ``timeout`` (finite
        seconds, like the receipt's ``wait``: NaN and inf are refused) and then raises
        BackpressureError, having sent nothing. Called from a delivery callback it waits only
        past ``retention_max``/``retention_max_bytes``: the acks it would wait for may wait on this
        very callback (two members replying to each other). Passing ``message_ids`` makes a retry
        after a crash idempotent: receivers drop ids they already delivered. ``headers``: a mapping
        applies to every message of the call; a sequence gives each message its own (None for none),
        e.g. a per-message origin proof; every message carries its headers on the wire either way.
        A payload (with its headers) must fit a resend answer, one transport frame.
        """
        self._check_running()
        g = self._group(group)
        if g.role != READ_WRITE:
            raise ReadOnlyMemberError(f"this member is read-only in group {group!r}")
        if isinstance(payloads, (bytes, bytearray, memoryview, str)):
            raise TypeError("publish() takes a sequence of payloads: wrap a single payload in a list")
        payloads = [p if type(p) is bytes else self._as_bytes(p) for p in payloads]
        each: list[dict[str, str] | None] | None = None  # per-message headers
        if headers is None or isinstance(headers, Mapping):
            hdrs = check_headers(headers)  # the one rule (group/headers.py): the agent's and the sink's too
        else:
            if isinstance(headers, (str, bytes)):
                raise ConfigurationError("headers are a mapping, or a sequence of one mapping (or None) per payload")
            each = [check_headers(h) for h in headers]
            if len(each) != len(payloads):
                raise ConfigurationError(f"{len(each)} header mappings for {len(payloads)} payloads")
            hdrs = None
        limit = self.config.max_message_bytes
        # A lost message is resent in an RPC answer, one transport frame: one that cannot fit would be lost for good.
        room = self._answer_room - (len(json.dumps(hdrs, separators=(",", ":"))) if hdrs else 0)
        for i, p in enumerate(payloads):
            if each is not None:
                hdrs = each[i]
                room = self._answer_room - (len(json.dumps(hdrs, separators=(",", ":"))) if hdrs else 0)
            if len(p) > limit:
                raise FrameTooLargeError(f"a {len(p)}-byte payload exceeds max_message_bytes={limit}",
                                         hint=f"Split the payload into messages of at most {limit} bytes (an "
                                              "agent's limit; DataPlaneConfig.max_message_bytes where the data "
                                              "plane is built by hand)")
            if 4 * ((len(p) + 2) // 3) > room:
                raise FrameTooLargeError(
                    f"a {len(p)}-byte payload{' with these headers' if hdrs else ''} would not fit a resend answer "
                    f"within the transport's max_frame_bytes={self._transport.max_frame_bytes}",
                    hint="Split the payload, or raise max_frame_bytes of the peer transport on every member")
        if message_ids is None:
            # 96 bits each that only this plane can compute: SHAKE-256 of a secret key and a call number.
            # Not a prefix and a counter: ids are seen by every member, and the journal's id rule spans
            # publishers (a Spark task retried on another host re-publishes its ids through another
            # member), so a member that can predict another's next ids can publish them first and have
            # its messages dropped as duplicates. Not os.urandom per call either: it releases the GIL,
            # and taking it back from the busy IO threads cost ~20 us a call (measured), doubling
            # publish()'s cost for one message.
            pool = hashlib.shake_256(self._id_key + next(self._id_calls).to_bytes(8, "big")).hexdigest(
                _ID_BYTES * len(payloads))
            step = 2 * _ID_BYTES
            ids = [pool[i:i + step] for i in range(0, len(pool), step)]
        else:
            ids = list(message_ids)
            if len(ids) != len(payloads):
                raise ConfigurationError("message_ids must have one id per payload")
            for mid in ids:
                if not isinstance(mid, str) or not mid or len(mid) > dm.MAX_ID_LENGTH:
                    raise ConfigurationError(f"a message id is a non-empty string of at most {dm.MAX_ID_LENGTH} chars")
                if not is_utf8_text(mid):  # receivers refuse it (no member could journal it): never sent
                    raise ConfigurationError("a message id holds a lone surrogate (\\ud800-\\udfff), not text")
            if len(set(ids)) != len(ids):
                raise ConfigurationError("message_ids must be unique within one publish() call")
        if not payloads:
            return g.outbox.empty_receipt()
        try:
            receipt = g.outbox.append(payloads, ids, hdrs if each is None else each, self._clock.tick, timeout,
                                      in_callback=threading.get_ident() == self._rx_ident)
        except BackpressureError:
            self._stats.add(backpressure_stalls=1)
            raise
        # Caller runs: a publisher that fills whole batches packs them itself (if no one else is),
        # instead of handing them to the sender thread and fighting it for the GIL.
        batch_max = self.config.batch_max
        while g.outbox.unsent_count() >= batch_max and self._pack_next(g, blocking=False):
            pass
        if not self._send_event.is_set():
            self._send_event.set()
        return receipt

    @staticmethod
    def _as_bytes(p: Any) -> bytes:
        if isinstance(p, (bytearray, memoryview)):
            return bytes(p)
        raise TypeError(f"payloads are bytes, got {type(p).__name__}")

    def publish_state(self, group: str, blob: bytes, *, timeout: float = 10.0) -> None:
        """Publish an opaque state blob on the group's state topic; others get ``on_state(group, blob, did)``
        (``did``: the member whose subscription it came in on, so a flood is charged to its sender).

        Returns once ZeroMQ accepted it; BackpressureError if the XPUB stayed full until ``timeout``
        (the blob is then withdrawn, not sent later). Best effort beyond that: membership repairs
        missed status by digests.
        """
        self._check_running()
        g = self._group(group)
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError("a state blob is bytes")
        timeout = check_timeout(timeout)
        fut: Future[None] = Future()
        self._io_send_ctrl([g.state_topic, bytes(blob)], fut)
        try:
            fut.result(timeout)
        except FutureTimeoutError:
            fut.cancel()
            raise BackpressureError(f"the state message for group {group!r} was not accepted within {timeout:g}s") from None
        except CancelledError:  # the IO thread ended (close()) with the message still queued
            raise DataPlaneClosedError(f"the data plane closed before the state message for group {group!r} "
                                       "was sent") from None

    def probe(self, group: str, did: str, timeout: float = 10.0) -> float:
        """Send hellos through the data path until ``did`` acks one; returns the seconds it took.

        A member's SUB connects asynchronously, so messages published right after ``add_member`` may
        reach it before it is subscribed; once a probe succeeds its SUB is proven connected and
        subscribed, and the hello told it where our stream starts. Raises PeerTimeoutError.
        """
        self._check_running()
        start = time.monotonic()
        deadline = start + check_timeout(timeout)
        nonce = secrets.token_hex(12)
        event = threading.Event()
        self._probes[nonce] = (group, did, event)
        interval = self.config.probe_interval_ms / 1000
        try:
            while True:
                with self._lock:
                    g = self._group(group)
                    m = g.members.get(did)
                    if m is None:
                        raise NotAMemberError(f"{did} is not a member of group {group!r} here")
                hello = dm.Hello(group, self.member_did, did, nonce, g.outbox.base_of(did) or 0, g.wire_seq)
                topic, env = self._pack_for(g, m, dm.encode(hello, signer=g.group_key))
                self._io_send_ctrl([topic, env], None)
                self._stats.add(probes_sent=1)
                remaining = deadline - time.monotonic()
                if event.wait(min(interval, max(remaining, 0))):
                    if self._closed:
                        raise DataPlaneClosedError("the data plane closed during a probe")
                    return time.monotonic() - start
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(f"{did} did not answer the probe of group {group!r} within {timeout:g}s",
                                           hint="Check that it added this member (subscribe) and is running")
                interval = min(interval * 1.5, 0.5)
        finally:
            self._probes.pop(nonce, None)

    def _pack_for(self, g: _Group, m: _Member, plaintext: bytes) -> tuple[bytes, bytes]:
        """Topic and envelope of a message for one member, in the group's mode."""
        if g.mode == "shared":
            return g.data_topic, envelope.pack(plaintext, [m.info.group_verkey], sender=g.group_key)
        env = envelope.pack(plaintext, [m.info.relationship_verkey], sender=m.my_key)
        return (m.pair_topic if g.mode == "multi" else g.data_topic), env  # type: ignore[return-value]

    # --- positions and stats -------------------------------------------------------------------

    def positions(self, group: str) -> dict[str, int]:
        """Last seq delivered (and returned from ``on_deliver``) per publisher: persist it to restart."""
        g = self._group(group)
        with self._rx_lock:
            return dict(g.positions)

    def stream_position(self, group: str, did: str) -> int:
        """How far ``did``'s stream is known here: the highest seq delivered, held back (waiting for
        a hole before it), or announced by it (0 if none). A publisher that starts its sequence anew
        (after a leave it kept no record of, or a crash) must continue after this, not after the
        delivered position: a new message filling the hole would release the old ones held after it
        and the new ones of the same seqs would be dropped as duplicates (and acked)."""
        g = self._group(group)
        with self._rx_lock:
            position = g.positions.get(did, 0)
            stream = g.streams.get(did)
            if stream is not None:
                position = max(position, stream.delivered, stream.highest, stream.announced)
            return position

    def publish_position(self, group: str) -> int:
        """Highest seq this member published in ``group``: reopen with ``first_seq`` = it + 1."""
        return self._group(group).outbox.last_seq

    def continue_after(self, group: str, seq: int) -> bool:
        """Before anything is published in ``group``: start this member's sequence after ``seq`` (the
        highest seq another member reports of a stream of ours from before a leave). False if messages
        were published already: their seqs stand."""
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ConfigurationError(f"a seq is a non-negative integer, got {seq!r}")
        return self._group(group).outbox.continue_after(seq)

    def restore_positions(self, group: str, positions: Mapping[str, int], timeout: float = 10.0) -> None:
        """After a restart: continue each publisher's stream after the given seq, fetching what was missed.

        Publishers not yet added are remembered and asked once ``add_member`` adds them.
        """
        self._check_running()
        timeout = check_timeout(timeout)
        g = self._group(group)
        clean = {}
        for did, pos in positions.items():
            if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
                raise ConfigurationError(f"a position is a non-negative seq, got {pos!r}")
            clean[did] = pos
        done = threading.Event()
        self._rx_put(("restore", g.name, clean, done))
        if not done.wait(timeout):
            raise PeerTimeoutError(f"restoring positions of group {group!r} did not finish within {timeout:g}s")

    def stats(self) -> dict[str, Any]:
        """Counters for metrics, so operators can tell slow from lossy from hostile.

        Traffic: ``messages_out/in``, ``bytes_out/in`` (payload bytes), ``envelopes_out/in``.
        Recovery: ``retransmits`` (messages resent), ``nacks_sent``, ``nacks_served``, ``heartbeats``,
        ``duplicates_dropped``, ``lost`` (skipped because the publisher no longer held them),
        ``deliveries_deferred`` (delivered messages a callback did not take: not acked, taken when re-sent).
        Drops by reason: ``rejected_non_member``, ``rejected_read_only``, ``rejected_malformed``,
        ``receive_queue_full`` (heartbeats and resend answers dropped while ``recv_queue_max`` of them
        waited for the receiver, or their member's share of that: the publisher repeats heartbeats,
        missing seqs are asked again), of which ``receive_share_full`` (heartbeats dropped because
        their member already had ``recv_queue_share`` waiting: one member flooding, whose excess is
        dropped so the others' still get through),
        ``resend_throttled`` (resend answers we cut short or refused because their member asked for more
        than its budget, ``resend_burst_bytes``/``resend_rate_bytes``) and ``resend_bytes_throttled`` (the
        payload bytes held back: the member asks for them again later),
        ``implausible_announcements`` (resend answers without the seqs their publisher announced, nor
        saying them gone: the announcement is ignored until made again),
        ``not_for_me`` (single mode, skipped unread), ``wrong_topic``, ``subscriptions_refused``,
        ``forged_batches`` (batches or hellos without a valid signature by their publisher's group
        key, or signed for another member).
        Flow: ``backpressure_waits``, ``backpressure_stalls`` (BackpressureError raised),
        ``publish_resets`` (XPUB re-bound after ``dead_after`` without progress), ``retention_dropped``,
        ``ack_stalls`` (times a member alive but with no ack progress for ``ack_stall_s`` was released
        from the publish window). Per group: ``lag`` {publisher: seqs not yet delivered}, ``unacked``
        {member: our messages it has not acked}, ``ack_stalled`` [members stalled now: they hold no
        window until they catch up, so their ``unacked`` may grow up to the retention limits],
        ``held`` (messages buffered), ``held_bytes`` (their payload bytes). ``peers_alive``
        {did: bool} from keepalives.
        """
        with self._stats.lock:
            out: dict[str, Any] = dict(self._stats.values)
        with self._lock:
            groups = list(self._groups.values())
            out["peers_alive"] = dict(self._alive)
        lag: dict[str, dict[str, int]] = {}
        with self._rx_lock:
            for g in groups:
                lag[g.name] = {did: s.lag() for did, s in g.streams.items()}
                out["lost"] += sum(s.lost for s in g.streams.values())
        out["lag"] = lag
        out["unacked"] = {g.name: g.outbox.lag() for g in groups}
        out["ack_stalled"] = {g.name: g.outbox.stalled_members() for g in groups}
        out["backpressure_waits"] = sum(g.outbox.backpressure_waits for g in groups)
        out["retention_dropped"] = sum(g.outbox.retention_dropped for g in groups)
        out["held"] = {g.name: g.outbox.held() for g in groups}
        out["held_bytes"] = {g.name: g.outbox.held_bytes() for g in groups}
        return out

    # --- internals: access -----------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._closed:
            raise DataPlaneClosedError("the data plane is closed")
        if not self._started:
            raise DataPlaneClosedError("the data plane is not started", hint="Call start() first.")

    def _group(self, group: str) -> _Group:
        g = self._groups.get(group)
        if g is None:
            raise GroupNotOpenError(f"group {group!r} is not open on this data plane")
        return g

    def _update_access_locked(self) -> None:
        """Recompute the ZAP allow-list and the per-key topic ACL from the current groups."""
        acl: dict[str, set[bytes]] = {}
        presence: dict[bytes, frozenset[bytes]] = {}
        for g in self._groups.values():
            for m in g.members.values():
                allowed = acl.setdefault(m.info.transport_key, set())
                if g.mode == "multi":
                    assert m.pair_topic is not None
                    pair = m.pair_topic
                    mine = frozenset((g.state_topic, pair))
                else:  # its pair topic carries nothing: it only tells its connection's end (_PRESENCE)
                    pair = topics.pair_topic(g.name, self.member_did, m.info.did)
                    mine = frozenset((g.state_topic, g.data_topic, pair))
                allowed |= mine
                presence[pair] = mine
        self._presence = presence  # first: the IO thread reads both without the lock
        self._acl = {k: frozenset(v) for k, v in acl.items()}
        self._allow.keys = frozenset(k.encode("ascii") for k in acl)

    # --- internals: IO thread ------------------------------------------------------------------

    def _wake(self) -> None:
        with self._io_lock:
            if self._wake_pending or self._wake_tx is None:
                return
            self._wake_pending = True
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                self._wake_pending = False

    def _io_send_ctrl(self, frames: list[bytes], fut: Future[None] | None) -> None:
        self._out_ctrl.append((frames, fut))
        self._wake()

    def _io_send_data(self, entries: list[tuple[list[bytes], _Group | None, int]]) -> None:
        self._out_data.extend(entries)
        self._wake()

    def _io_call(self, *cmd: Any) -> None:
        """Run a socket command on the IO thread and wait for it (bounded)."""
        if self._closed or self._io_thread is None or not self._io_thread.is_alive():
            return
        fut: Future[None] = Future()
        self._cmds.append((fut, *cmd))
        self._wake()
        try:
            fut.result(_CMD_TIMEOUT)
        except FutureTimeoutError:
            raise GroupError(f"the data plane's IO thread did not run {cmd[0]} within {_CMD_TIMEOUT:g}s") from None

    def _make_xpub(self) -> zmq.Socket[Any]:
        assert self._ctx is not None
        xpub = self._ctx.socket(zmq.XPUB)
        xpub.setsockopt(zmq.LINGER, _LINGER_MS)
        xpub.setsockopt(zmq.SNDHWM, self.config.sndhwm)
        xpub.setsockopt(zmq.XPUB_NODROP, 1)
        xpub.setsockopt(zmq.XPUB_MANUAL, 1)
        xpub.setsockopt(zmq.MAXMSGSIZE, 4096)  # inbound traffic on an XPUB is subscriptions only
        xpub.curve_server = True
        xpub.curve_secretkey = self._curve_secret
        xpub.curve_publickey = self._curve_public
        xpub.setsockopt(zmq.HEARTBEAT_IVL, 5000)
        xpub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
        xpub.setsockopt(zmq.HANDSHAKE_IVL, LISTENER_HANDSHAKE_MS)  # idle strangers hold no descriptor long
        return xpub

    def _open_sub(self, sub: _Sub) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.config.rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, _SUB_MAX_MSG)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
            sock.curve_serverkey = sub.server_key
            sock.curve_publickey = self._curve_public
            sock.curve_secretkey = self._curve_secret
            sock.connect(sub.endpoint)
            for t in sub.topics:
                sock.setsockopt(zmq.SUBSCRIBE, t)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        sub.sock = sock
        sub.monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        sub.got_any = False
        sub.resub_ivl = 0.2
        sub.next_resub = time.monotonic() + sub.resub_ivl
        sub.reconnect_at = None

    @staticmethod
    def _close_sub(sub: _Sub) -> None:
        if sub.sock is None:
            return
        try:
            sub.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        if sub.monitor is not None:
            sub.monitor.close(linger=0)
        sub.sock.close(linger=0)
        sub.sock = sub.monitor = None

    def _on_monitor(self, sub: _Sub) -> None:
        """A refused handshake (the publisher has not admitted us yet) ends the connection for good
        in libzmq; reconnect with backoff until it admits us."""
        while True:
            try:
                event = parse_monitor_message(sub.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError, KeyError):
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                sub.reconnect_ivl = 0.1
            elif sub.reconnect_at is None:
                sub.reconnect_at = time.monotonic() + sub.reconnect_ivl
                sub.reconnect_ivl = min(sub.reconnect_ivl * 2, 2.0)

    def _io_main(self) -> None:
        try:
            xpub = self._make_xpub()
            try:
                xpub.bind(self._bind)
            except zmq.ZMQError:
                xpub.close(linger=0)
                raise
            self._endpoint = xpub.getsockopt_string(zmq.LAST_ENDPOINT)
            assert self._ctx is not None
            wake_rx = self._ctx.socket(zmq.PAIR)
            wake_rx.setsockopt(zmq.LINGER, 0)
            wake_rx.bind(self._wake_addr)
        except Exception as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        subs: dict[tuple[str, str], _Sub] = {}
        by_sock: dict[Any, _Sub] = {}
        by_monitor: dict[Any, _Sub] = {}
        # subscribed: (key, topic) subscriptions accepted on this XPUB; awaited: those of the XPUB a
        # rebind closed that are not back yet, which hold every send until hold_until (_rebind).
        # owners: pair topic -> (key, its topics in that group) of the connection that subscribed it.
        state: dict[str, Any] = {"xpub": xpub, "dirty": True, "blocked_since": None, "subscribed": set(),
                                 "awaited": set(), "hold_until": None, "owners": {}}
        full = zmq.Poller()
        base = zmq.Poller()
        try:
            while not self._stopping.is_set():
                if state["dirty"]:
                    full, base = zmq.Poller(), zmq.Poller()
                    for p in (full, base):
                        p.register(wake_rx, zmq.POLLIN)
                        p.register(state["xpub"], zmq.POLLIN)
                    for s in by_sock:
                        full.register(s, zmq.POLLIN)
                    for p in (full, base):
                        for mon in by_monitor:
                            p.register(mon, zmq.POLLIN)
                    state["dirty"] = False
                throttled = len(self._rx) >= self.config.recv_queue_max
                blocked = state["blocked_since"] is not None
                timeout = 2 if blocked else (5 if throttled else 100)
                if state["hold_until"] is not None:  # its deadline is seen on time
                    timeout = min(timeout, max(1, int((state["hold_until"] - time.monotonic()) * 1000) + 1))
                events = dict((base if throttled else full).poll(timeout))
                if wake_rx in events:
                    # Drain first, then clear the flag: a wake-up sent in between is either drained
                    # here (its work is already queued and handled below) or still in the socket.
                    # The other order could swallow one and leave the flag set with nothing to read,
                    # so every later sender would wait out the poll timeout.
                    while True:
                        try:
                            wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    with self._io_lock:
                        self._wake_pending = False
                for sock in events:
                    sub = by_monitor.get(sock)
                    if sub is not None and sub.monitor is sock:
                        self._on_monitor(sub)
                while self._cmds:
                    self._run_cmd(self._cmds.popleft(), subs, by_sock, by_monitor, state)
                xp = state["xpub"]
                if xp in events:
                    self._read_subscriptions(xp, state)
                if not throttled:
                    items: list[tuple[Any, ...]] = []
                    for sock in events:
                        sub = by_sock.get(sock)
                        if sub is not None:
                            self._read_sub(sub, items)
                    if items:
                        with self._rx_cond:
                            self._rx.extend(items)
                            self._rx_cond.notify()
                self._flush(state)
                self._io_timers(subs, by_sock, by_monitor, state)
            state["hold_until"] = None  # closing: no subscriber is waited for
            self._flush(state)  # what close() let the sender hand over
        except Exception:  # noqa: BLE001 - a dead IO thread must be loud
            log.exception("group data plane IO thread failed")
        finally:
            for sub in subs.values():
                self._close_sub(sub)
            state["xpub"].close(linger=_LINGER_MS)
            wake_rx.close(linger=0)
            for frames, fut in list(self._out_ctrl):
                if fut is not None and not fut.done():
                    fut.cancel()

    def _run_cmd(self, cmd: tuple[Any, ...], subs: dict[tuple[str, str], _Sub], by_sock: dict[Any, _Sub],
                 by_monitor: dict[Any, _Sub], state: dict[str, Any]) -> None:
        fut, op, *args = cmd

        def drop(sub: _Sub) -> None:
            by_sock.pop(sub.sock, None)
            by_monitor.pop(sub.monitor, None)
            self._close_sub(sub)
            state["dirty"] = True

        try:
            if op == "sub_add":
                sub: _Sub = args[0]
                old = subs.pop((sub.group, sub.did), None)
                if old is not None:
                    drop(old)
                self._open_sub(sub)
                subs[(sub.group, sub.did)] = sub
                by_sock[sub.sock] = sub
                by_monitor[sub.monitor] = sub
                state["dirty"] = True
            elif op == "sub_remove":
                old = subs.pop((args[0], args[1]), None)
                if old is not None:
                    drop(old)
            elif op == "sub_kill":  # test hook: the SUB dies and comes back after a pause
                sub = subs.get((args[0], args[1]))
                if sub is not None and sub.sock is not None:
                    drop(sub)
                    sub.down_until = time.monotonic() + args[2]
            elif op == "rebind":
                self._rebind(state)
            fut.set_result(None)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            fut.set_exception(exc)

    def _rebind(self, state: dict[str, Any], *, wait: float | None = None) -> None:
        """Close and re-bind the XPUB on the same endpoint: every connection re-authenticates.

        The members still admitted reconnect and subscribe again within a few hundred ms; what the
        XPUB sent meanwhile would reach none of them (a PUB drops what no one subscribed to) and come
        only by heartbeat and NACK, seconds later. So sends are held until the subscriptions the
        closed XPUB had, of members still admitted and active, are back, or for at most
        ``resend_after_ms`` (and ``_REBIND_HOLD_MAX_S``): a member that does not come back cannot
        hold the others for longer. Those of connections that ended before are not waited for
        (``_read_subscriptions``, ``_PRESENCE``).

        If the endpoint cannot be bound again within ``wait`` (default ``_REBIND_WAIT_S``; another process took the port), the
        IO thread keeps an unbound XPUB and retries every second (``_io_timers``) rather than die:
        publishes go unacknowledged meanwhile and are re-sent once members reconnect.
        """
        assert self._endpoint is not None
        # Lingering, the old socket still writes out what it queued (up to sndhwm envelopes per
        # member, all published before the rebind: the leaver's share was addressed to it) before
        # it drops each connection; without, a busy member gets that only by NACK. The listener goes
        # at once; a member that does not read is cut after _LINGER_MS as before.
        state["xpub"].close(linger=_LINGER_MS)
        # What blocked was the old socket's queues: the new one has none. Kept, a hold below would
        # let dead_after run out on the old socket's account and cut every member off again.
        state["blocked_since"] = None
        # Awaited: what the closed XPUB had, and what an earlier rebind still waited for.
        state["awaited"] |= state["subscribed"]
        state["subscribed"] = set()
        state["owners"] = {}
        state["hold_until"] = None
        deadline = time.monotonic() + (_REBIND_WAIT_S if wait is None else wait)
        while True:
            xpub = self._make_xpub()
            try:
                xpub.bind(self._endpoint)
                break
            except zmq.ZMQError as exc:
                if time.monotonic() > deadline:
                    state["xpub"], state["dirty"] = xpub, True  # unbound: polled, never reached
                    if state.get("rebind_at") is None:
                        log.error("cannot bind the group publish endpoint %s again (%s); retrying every second",
                                  self._endpoint, exc.strerror)
                    state["rebind_at"] = time.monotonic() + 1.0
                    return
                xpub.close(linger=0)
                time.sleep(0.01)
        if state.get("rebind_at") is not None:
            log.warning("group publish endpoint %s bound again", self._endpoint)
        state["rebind_at"] = None
        state["xpub"] = xpub
        state["dirty"] = True
        with self._lock:  # the leaver's key is out of the ACL already: it is not waited for
            acl = self._acl
            active = {m.info.transport_key for g in self._groups.values() for did, m in g.members.items()
                      if self._alive.get(did, True)}
        state["awaited"] = {(key, topic) for key, topic in state["awaited"]
                            if key in active and topic in acl.get(key, ())}
        if state["awaited"]:
            state["hold_until"] = time.monotonic() + min(self.config.resend_after_ms / 1000, _REBIND_HOLD_MAX_S)

    def _read_subscriptions(self, xpub: zmq.Socket[Any], state: dict[str, Any]) -> None:
        accepted = refused = 0
        subscribed, awaited, owners = state["subscribed"], state["awaited"], state["owners"]
        for _ in range(_READ_BATCH):
            try:
                frame = xpub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            data = frame.bytes
            if not data or data[0] > 1:
                continue
            try:
                user = frame.get("User-Id")
            except (zmq.ZMQError, KeyError, TypeError):
                user = None
            topic = data[1:]
            if data[0] == 0:
                # An unsubscription (libzmq drops the pipe's subscription itself). A connection that
                # ended hands us one per topic it had, with no key: its pair topic says whose it was
                # (_PRESENCE), and its subscriptions are then no longer waited for by a rebind.
                if user is not None:
                    gone = [(user, topic)]
                else:
                    owner = owners.pop(topic, None)
                    gone = [(owner[0], t) for t in owner[1]] if owner is not None else []
                for entry in gone:
                    subscribed.discard(entry)
                    awaited.discard(entry)
                continue
            if user is not None and topic in self._acl.get(user, ()):
                xpub.setsockopt(zmq.SUBSCRIBE, topic)  # applies to the pipe this came from
                accepted += 1
                subscribed.add((user, topic))
                awaited.discard((user, topic))
                mine = self._presence.get(topic)
                if mine is not None:
                    owners[topic] = (user, mine)
            else:
                refused += 1
        if accepted or refused:
            self._stats.add(subscriptions_accepted=accepted, subscriptions_refused=refused)

    def _read_sub(self, sub: _Sub, items: list[tuple[Any, ...]]) -> None:
        sock = sub.sock
        wrong = 0
        for _ in range(_READ_BATCH):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            sub.got_any = True
            kind = sub.topics.get(parts[0]) if len(parts) == 2 else None  # the whole first frame
            if kind is None or kind is _PRESENCE:
                wrong += 1
                continue
            items.append(("sub", sub.group, sub.did, kind, parts[1]))
        if wrong:
            self._stats.add(wrong_topic=wrong)

    def _flush(self, state: dict[str, Any]) -> None:
        if state["hold_until"] is not None:  # a rebind waits for the subscribers to be back
            if state["awaited"] and time.monotonic() < state["hold_until"]:
                return
            if state["awaited"]:
                log.info("%d subscription(s) to the group publish endpoint not back after re-binding it; sending "
                         "without them (those members get what they miss by NACK)", len(state["awaited"]))
            state["awaited"] = set()
            state["hold_until"] = None
        xpub = state["xpub"]
        ctrl, data = self._out_ctrl, self._out_data
        sent = 0
        try:
            while ctrl:
                frames, fut = ctrl[0]
                if fut is not None and fut.done():
                    ctrl.popleft()
                    continue
                xpub.send_multipart(frames, zmq.NOBLOCK)
                ctrl.popleft()
                sent += 1
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_result(None)
            while data:
                frames, g, last = data[0]
                xpub.send_multipart(frames, zmq.NOBLOCK)
                data.popleft()
                sent += 1
                if g is not None and last > g.wire_seq:
                    g.wire_seq = last  # what we may announce: handed to ZeroMQ, not just queued
        except zmq.Again:  # XPUB_NODROP: a member's queue is full; wait, never drop
            if sent or state["blocked_since"] is None:
                state["blocked_since"] = time.monotonic()  # time since the last progress
            return
        state["blocked_since"] = None

    def _io_timers(self, subs: dict[tuple[str, str], _Sub], by_sock: dict[Any, _Sub],
                   by_monitor: dict[Any, _Sub], state: dict[str, Any]) -> None:
        now = time.monotonic()
        blocked = state["blocked_since"]
        if blocked is not None and now - blocked > self.config.dead_after_ms / 1000:
            # Nothing left the XPUB for dead_after: a subscriber that no longer reads (a frozen
            # process keeps its TCP connection) holds every member hostage under XPUB_NODROP.
            # Cut all connections; live members reconnect and NACK what they missed.
            log.warning("group publish socket made no progress for %.1fs; reconnecting all subscribers",
                        now - blocked)
            self._rebind(state)
            state["blocked_since"] = None
            self._stats.add(publish_resets=1)
        elif state.get("rebind_at") is not None and now >= state["rebind_at"]:
            self._rebind(state, wait=0.0)  # a rebind that failed: one attempt a second, off the hot path
        for sub in subs.values():
            if sub.sock is None:
                if now >= sub.down_until:
                    self._open_sub(sub)
                    by_sock[sub.sock] = sub
                    by_monitor[sub.monitor] = sub
                    state["dirty"] = True
                continue
            if sub.reconnect_at is not None and now >= sub.reconnect_at:
                sub.reconnect_at = None
                try:
                    sub.sock.disconnect(sub.endpoint)
                except zmq.ZMQError:
                    pass  # the refused connection is already gone
                sub.sock.connect(sub.endpoint)
            if not sub.got_any and now >= sub.next_resub:
                # A publisher accepts a subscription only for groups it admitted us to; until we hear
                # from it, repeat the subscription so an admission after our connect takes effect.
                for t in sub.topics:
                    sub.sock.setsockopt(zmq.SUBSCRIBE, t)
                sub.resub_ivl = min(sub.resub_ivl * 2, 5.0)
                sub.next_resub = now + sub.resub_ivl

    # --- internals: sender -----------------------------------------------------------------------

    def _sender_main(self) -> None:
        cfg = self.config
        linger = cfg.linger_ms / 1000
        while True:
            self._send_event.wait(0.1)
            self._send_event.clear()
            groups = list(self._groups.values())
            if linger and not self._stopping.is_set():
                pending = sum(g.outbox.unsent_count() for g in groups)
                if 0 < pending < cfg.batch_max:
                    time.sleep(linger)  # let the batch fill: crypto is paid per batch
            progress = True
            while progress:
                progress = False
                for g in groups:
                    if not g.closed and self._pack_next(g, blocking=True):
                        progress = True
            if self._stopping.is_set():
                return

    def _pack_next(self, g: _Group, *, blocking: bool) -> bool:
        """Take the next batch of ``g`` and hand its envelopes to the IO thread; False if none.

        The group's pack lock keeps batches on the wire in seq order whichever thread packs them.
        """
        if not g.pack_lock.acquire(blocking=blocking):
            return False
        try:
            msgs = g.outbox.take_unsent(self.config.batch_max, self.config.batch_max_bytes)
            if not msgs:
                return False
            try:
                self._send_batch(g, msgs)
            except Exception:  # noqa: BLE001 - the batch goes back to unsent and is tried again later
                g.outbox.untake(msgs[0].seq)
                now = time.monotonic()
                if now - g.pack_failed_logged >= 10.0:
                    g.pack_failed_logged = now
                    log.exception("packing a batch of group %r failed; it stays queued and is retried", g.name)
                return False  # no progress: the sender retries at its next wake-up, not in a busy loop
            return True
        finally:
            g.pack_lock.release()

    def _send_batch(self, g: _Group, msgs: list[dm.DataMessage]) -> None:
        last = msgs[-1].seq
        with self._lock:
            members = [m for m in g.members.values() if m.base < last]
        if not members:
            return
        # Signed once per batch, whatever the mode and the number of members.
        plaintext = dm.encode(dm.DataBatch(g.name, self.member_did, ()), encoded_messages=dm.encode_messages(msgs),
                              signer=g.group_key)
        if g.mode == "shared":
            env = envelope.pack(plaintext, [m.info.group_verkey for m in members], sender=g.group_key)
            frames = [[g.data_topic, env]]
        elif g.mode == "single":
            frames = [[g.data_topic, envelope.pack(plaintext, [m.info.relationship_verkey], sender=m.my_key)]
                      for m in members]
        else:
            frames = [[m.pair_topic, envelope.pack(plaintext, [m.info.relationship_verkey], sender=m.my_key)]
                      for m in members]
        entries: list[tuple[list[bytes], _Group | None, int]] = [(f, None, 0) for f in frames]  # type: ignore[misc]
        entries[-1] = (entries[-1][0], g, last)
        self._io_send_data(entries)
        self._stats.add(messages_out=len(msgs), bytes_out=sum(len(m.payload) for m in msgs),
                        envelopes_out=len(frames))

    # --- internals: receiver ---------------------------------------------------------------------

    def _rx_put(self, item: tuple[Any, ...]) -> None:
        with self._rx_cond:
            self._rx.append(item)
            self._rx_cond.notify()

    def _rx_put_peer(self, item: tuple[Any, ...]) -> bool:
        """Queue what arrived over the peer transport, unless ``recv_queue_max`` of its kind wait
        already: transport workers are not throttled like the SUBs, so a flood (or answers piling
        up behind a slow callback) would otherwise grow the queue without bound. A heartbeat is
        dropped too while its member has its share (``_rx_share``) waiting, so one member's flood
        leaves room for the others'; answers keep to their share when they are asked for
        (``_rx_tick``). False if dropped."""
        kind, did = item[0], item[2]
        counts = self._rx_from[kind]
        with self._rx_cond:
            held = counts.get(did, 0)
            if kind == "batch" and held >= self._rx_share:
                share_full = True
            elif self._rx_peer[kind] >= self.config.recv_queue_max:
                share_full = False
            else:
                self._rx_peer[kind] += 1
                if kind == "batch":  # an answer holds its place from its request on
                    counts[did] = held + 1
                self._rx.append(item)
                self._rx_cond.notify()
                return True
            if kind == "answer":  # its place is given up: the request is over
                self._uncount(counts, did)
        if share_full:
            self._stats.add(receive_queue_full=1, receive_share_full=1)
        else:
            self._stats.add(receive_queue_full=1)
        return False

    @staticmethod
    def _uncount(counts: dict[str, int], did: str) -> None:
        """One item of ``did`` less in a per-member count (hold ``_rx_cond``); dropped at zero."""
        held = counts.get(did, 0) - 1
        if held > 0:
            counts[did] = held
        else:
            counts.pop(did, None)

    def _receiver_main(self) -> None:
        self._rx_ident = threading.get_ident()
        cfg = self.config
        tick = min(cfg.ack_interval_ms, cfg.nack_after_ms) / 2000
        next_tick = time.monotonic() + tick
        rx = self._rx
        while not self._stopping.is_set():
            with self._rx_cond:
                if not rx:
                    self._rx_cond.wait(max(next_tick - time.monotonic(), 0.001))
                item = rx.popleft() if rx else None
                if item is not None and item[0] in self._rx_peer:
                    self._rx_peer[item[0]] -= 1
                    self._uncount(self._rx_from[item[0]], item[2])
            if item is not None:  # one envelope at a time, so acks and NACKs are never starved
                try:
                    self._handle_rx(item)
                except Exception:  # noqa: BLE001 - one bad item must not stop delivery
                    log.exception("group receive path failed on one item; continuing")
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + tick
                try:
                    self._rx_tick()
                except Exception:  # noqa: BLE001
                    log.exception("group receive timers failed; continuing")

    def _handle_rx(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "sub":
            _, group, did, topic_kind, body = item
            g = self._groups.get(group)
            m = g.members.get(did) if g is not None else None
            if m is None:
                return  # removed meanwhile
            self._heard(did)
            if topic_kind == _STATE:
                if self._on_state is not None:
                    try:
                        self._on_state(group, body, did)
                    except Exception:  # noqa: BLE001
                        self._stats.add(callback_errors=1)
                        log.exception("on_state raised for group %r", group)
                return
            self._on_data_envelope(g, m, body)
        elif kind == "batch":
            _, group, did, batch = item
            g = self._groups.get(group)
            m = g.members.get(did) if g is not None else None
            if m is not None:
                self._accept_batch(g, m, batch)
        elif kind == "answer":
            self._on_resend_answer(*item[1:])
        elif kind == "restore":
            _, group, positions, done = item
            try:
                g = self._groups.get(group)
                if g is not None:
                    self._apply_restore(g, positions)
            finally:
                done.set()

    def _on_data_envelope(self, g: _Group, m: _Member, body: bytes) -> None:
        kids = _recipient_kids(body)
        if kids is None:
            self._stats.add(rejected_malformed=1)
            return
        key = g.group_key if g.mode == "shared" else m.my_key
        if key.verkey not in kids:
            self._stats.add(not_for_me=1)  # single mode: another member's envelope, never decrypted
            return
        try:
            opened = envelope.unpack(body, lambda kid: key if kid == key.verkey else None)
        except ZeroCommError:  # malformed, tampered or undecodable: dropped and counted
            self._stats.add(rejected_malformed=1)
            return
        expected = m.info.group_verkey if g.mode == "shared" else m.info.relationship_verkey
        if opened.sender_verkey != expected:
            self._stats.add(rejected_non_member=1)
            return
        try:
            msg = dm.decode(opened.message)
        except MalformedDataMessageError:
            self._stats.add(rejected_malformed=1)
            return
        self._stats.add(envelopes_in=1)
        if isinstance(msg, dm.DataBatch):
            if not self._authentic(g, m, msg):
                return
            if msg.group != g.name or msg.publisher != m.info.did:
                self._stats.add(rejected_non_member=1)
                return
            self._accept_batch(g, m, msg)
        elif isinstance(msg, dm.Hello):
            if not self._authentic(g, m, msg):
                return
            if msg.group != g.name or msg.publisher != m.info.did or msg.subscriber != self.member_did:
                self._stats.add(rejected_non_member=1)
                return
            self._on_hello(g, m, msg)
        else:
            self._stats.add(rejected_malformed=1)

    def _authentic(self, g: _Group, m: _Member, msg: dm.DataBatch | dm.Hello) -> bool:
        """The publisher's signature check, before anything of ``msg`` is used.

        ``msg`` must carry a valid signature by ``m``'s group key over its exact bytes; a batch with
        per-member fields (resend answer, heartbeat) must name this member, so a signed answer meant
        for another member cannot be replayed here. Anything else is dropped and counted.
        """
        if not dm.verify(msg, m.info.group_verkey):
            reason = "no publisher signature" if msg.signature is None else "a bad publisher signature"
        elif isinstance(msg, dm.DataBatch) and (
                msg.member != self.member_did if msg.member is not None
                else (msg.base is not None or msg.last is not None or msg.gone is not None
                      or msg.void is not None)):
            reason = "a batch signed for another member"
        else:
            return True
        self._stats.add(forged_batches=1)
        now = time.monotonic()
        key = (g.name, m.info.did)
        last, suppressed = self._forged_logged.get(key, (float("-inf"), 0))
        if now - last >= 10.0:
            self._forged_logged[key] = (now, 0)
            log.warning("group %r: dropped a %s claiming to come from %s: %s%s", g.name,
                        "batch" if isinstance(msg, dm.DataBatch) else "hello", m.info.did, reason,
                        f" ({suppressed} more since the last warning)" if suppressed else "")
        else:
            self._forged_logged[key] = (last, suppressed + 1)
        return False

    def _stream(self, g: _Group, did: str) -> PublisherStream[dm.DataMessage]:
        stream = g.streams.get(did)
        if stream is None:
            stream = PublisherStream(ordered=g.ordered, hold_max=self.config.hold_max, clock=time.monotonic,
                                     hold_bytes_max=self.config.hold_bytes_max, size_of=_HELD_SIZE)
            g.streams[did] = stream
        return stream

    def _accept_batch(self, g: _Group, m: _Member, batch: dm.DataBatch) -> None:
        did = m.info.did
        if m.info.role != READ_WRITE:
            if batch.messages:
                self._stats.add(rejected_read_only=len(batch.messages))
            return
        out: list[dm.DataMessage] = []
        dups = 0
        void: list[int] = []
        with self._rx_lock:
            stream = self._stream(g, did)
            if batch.base is not None:
                restored = did in g.restored
                g.restored.discard(did)  # from this base on, our position is what the publisher acked
                if not stream.has_baseline:
                    out.extend(stream.set_baseline(batch.base))
                elif batch.base > stream.delivered:
                    # We restarted from an older position than we had acked (those were delivered), or
                    # the publisher restarted after seqs it may never have used (void): neither is lost.
                    # But seqs we received and did not take (a listener raised, or held behind a hole)
                    # were used and never acked: the restarted publisher no longer has them. Lost.
                    seen = stream.received_upto(batch.base)
                    if seen > stream.delivered:
                        before = stream.lost
                        out.extend(stream.skip(stream.delivered + 1, seen))
                        if stream.lost > before:
                            log.warning("group %r: %d message(s) of %s received but not taken here are no longer "
                                        "held by it (it restarted) and were skipped", g.name, stream.lost - before, did)
                    voided: tuple[int, int] | None = None
                    if batch.void is not None:
                        first, last = max(batch.void[0], stream.delivered + 1), min(batch.void[1], batch.base)
                        if first <= last:
                            voided = (first, last)
                        if 0 <= last - first < _VOID_MAX:
                            void = list(range(first, last + 1))
                    if restored:  # what lies between may have been delivered before our restart
                        out.extend(stream.skip(stream.delivered + 1, batch.base, count_lost=False))
                    else:
                        # Our position is exact, so the publisher counts acks we never sent: it restarted
                        # after a member ahead of us reported those seqs. We never got them and nobody
                        # holds them for us now: lost, but for the void ones (maybe never used).
                        before = stream.lost
                        if voided is not None:
                            out.extend(stream.skip(stream.delivered + 1, voided[0] - 1))
                            out.extend(stream.skip(stream.delivered + 1, voided[1], count_lost=False))
                        out.extend(stream.skip(stream.delivered + 1, batch.base))
                        if stream.lost > before:
                            log.warning("group %r: %d message(s) of %s not delivered here are no longer held by it "
                                        "(it restarted) and were skipped (counted as lost)", g.name,
                                        stream.lost - before, did)
            if batch.last is not None:
                stream.note_announced(batch.last)
            if batch.gone is not None:
                before = stream.lost
                out.extend(stream.skip(*batch.gone))
                if stream.lost > before:
                    log.warning("group %r: %d message(s) of %s are no longer held by it and were skipped",
                                g.name, stream.lost - before, did)
            delivered, dups = stream.offer_all(batch.messages, _SEQ_OF)
            out.extend(delivered)
            if not batch.messages:  # a publisher's heartbeat: it is waiting for our ack
                g.ack_needed.add(did)
            if dups:
                g.ack_needed.add(did)
        if void:  # before the ack that covers them: a journal records them, readers do not call them lost
            self._stats.add(callback_errors=self._superseded(g.name, did, void))
        self._deliver(g, did, out)
        if dups:
            self._stats.add(duplicates_dropped=dups)

    def _deliver(self, g: _Group, did: str, msgs: list[dm.DataMessage]) -> None:
        untaken: list[Delivered] = []  # a callback raised: not acked, taken when re-sent
        if msgs:
            now = time.time()
            # Keyed by group too: message ids are the publisher's per group (a re-used id in another
            # group is another message, which must be delivered and acked as such).
            dup_flags = self._dedup.check_and_add_many([(g.name, did, m.id) for m in msgs])
            callback = self._on_deliver
            many = self._on_deliver_many
            group = g.name
            dup_ids = errors = nbytes = 0
            # Observing the batch's highest timestamp before the first callback keeps the Lamport
            # property (anything published from a callback is stamped after what it saw).
            top = max(m.lamport for m in msgs)
            limit = self._clock.time + MAX_JUMP
            if top > limit:  # a faulty or hostile stamp: delivered, but it moves our clock by MAX_JUMP at most
                now_mono = time.monotonic()
                if now_mono - self._jump_logged >= 10.0:
                    self._jump_logged = now_mono
                    log.warning("group %r: %s stamped a message more than 2**40 past this member's Lamport clock "
                                "(a faulty or hostile publisher); the clock moves by 2**40 only", g.name, did)
                top = limit
            self._clock.observe(top)
            fresh: list[Delivered] = []
            superseded: list[int] = []
            for msg, dup in zip(msgs, dup_flags):
                if dup:
                    dup_ids += 1
                    superseded.append(msg.seq)
                    continue
                nbytes += len(msg.payload)
                headers = msg.headers
                fresh.append(_delivered(group, msg.id, did, msg.seq, msg.lamport, msg.sent_at, now, msg.payload,
                                        dict(headers) if headers else None))
            if superseded:
                errors += self._superseded(group, did, superseded)
            failure: Exception | None = None
            if many is not None and fresh:
                try:  # one call per delivery batch: a durable consumer commits the batch at once
                    many(fresh)
                except Exception as exc:  # noqa: BLE001 - not taken: not acked, offered again when re-sent
                    taken = exc.taken if isinstance(exc, DeliveryDeferredError) else 0  # a prefix all took
                    untaken, failure = fresh[min(max(taken, 0), len(fresh) - 1):], exc
            else:
                for i, delivered in enumerate(fresh):
                    try:
                        callback(delivered)
                    except Exception as exc:  # noqa: BLE001 - later ones wait too: delivery is FIFO
                        untaken, failure = fresh[i:], exc
                        break
            if failure is not None:
                if isinstance(failure, DeliveryDeferredError):  # the manager logged its listener's failure
                    errors += failure.raised  # listener calls that raised: 0 while a join is checked
                    log.debug("seqs %d-%d of %s in group %r not taken yet (%s)", untaken[0].seq, untaken[-1].seq,
                              did, group, failure)
                else:  # the class only: an application's exception text may quote the payload
                    errors += 1
                    log.error("on_deliver raised %s for seqs %d-%d of %s in group %r; they are taken again when "
                              "re-sent", type(failure).__name__, untaken[0].seq, untaken[-1].seq, did, group)
                    log.debug("on_deliver traceback", exc_info=failure)
                for delivered in untaken:
                    self._dedup.discard((group, did, delivered.message_id))
                nbytes -= sum(len(d.payload) for d in untaken)
            self._stats.add(messages_in=len(fresh) - len(untaken), bytes_in=nbytes, duplicates_dropped=dup_ids,
                            callback_errors=errors, deliveries_deferred=len(untaken))
        with self._rx_lock:
            stream = g.streams.get(did)
            if stream is None or not stream.has_baseline:
                return
            if untaken:
                stream.undeliver([d.seq for d in untaken])
            g.positions[did] = stream.delivered
            sent, _ = g.acks_sent.get(did, (0, 0.0))
            due = stream.delivered - sent >= self.config.ack_every
        if due:
            self._send_ack(g, did)

    def _superseded(self, group: str, did: str, seqs: list[int]) -> int:
        """Tell ``on_superseded`` of seqs of ``did`` that have no message here by design; 1 if it raised."""
        if self._on_superseded is None:
            return 0
        try:
            self._on_superseded(group, did, seqs)
        except Exception:  # noqa: BLE001 - the application's bug must not stop the stream
            log.exception("on_superseded raised for %d seq(s) of %s in group %r", len(seqs), did, group)
            return 1
        return 0

    def _on_hello(self, g: _Group, m: _Member, hello: dm.Hello) -> None:
        did = m.info.did
        with self._rx_lock:
            stream = self._stream(g, did)
            out = stream.set_baseline(hello.base)
            stream.note_announced(hello.last)
        self._deliver(g, did, out)
        self._send_ack(g, did, nonce=hello.nonce)

    def _send_ack(self, g: _Group, did: str, nonce: str | None = None) -> None:
        with self._rx_lock:
            stream = g.streams.get(did)
            seq = stream.delivered if stream is not None else 0
            g.acks_sent[did] = (seq, time.monotonic())
            g.ack_needed.discard(did)
        m = g.members.get(did)
        if m is None:
            return
        body = dm.encode(dm.Ack(g.name, did, self.member_did, seq, nonce))
        env = envelope.pack(body, [m.info.relationship_verkey], sender=m.my_key)
        try:
            self._transport.send(m.info.peer_endpoint, ProtocolId.GROUP_DATA, env, priority=200)
        except TransportError as exc:
            log.debug("ack to %s not sent: %s", did, type(exc).__name__)

    def _rx_tick(self) -> None:
        cfg = self.config
        now = time.monotonic()
        ack_ivl = cfg.ack_interval_ms / 1000
        nack_after = cfg.nack_after_ms / 1000
        retry = cfg.nack_retry_ms / 1000
        # An announced tail is usually still in flight on the data path: wait longer before asking.
        tail = max(nack_after, cfg.resend_after_ms / 1000)
        acks: list[tuple[_Group, str]] = []
        nacks: list[tuple[_Group, str, int, int | None]] = []
        share = self._rx_share
        with self._rx_cond:
            room = cfg.recv_queue_max - self._rx_peer["answer"] - self._answers_out
            # Answers each member holds (queued or awaited): a member that answers slowly or not at
            # all, in however many groups, keeps to its share, and the room left goes to the others.
            held = dict(self._rx_from["answer"])
        for g in list(self._groups.values()):
            with self._rx_lock:
                for did, stream in g.streams.items():
                    m = g.members.get(did)
                    if m is None or m.info.role != READ_WRITE:
                        continue
                    if stream.has_baseline:
                        sent, at = g.acks_sent.get(did, (0, float("-inf")))
                        if (stream.delivered > sent or did in g.ack_needed) and now - at >= ack_ivl:
                            acks.append((g, did))
                        mine = share - held.get(did, 0)
                        if room <= 0 or mine <= 0:  # answers enough on their way or waiting: ask at a later tick
                            continue
                        due = stream.due_nacks(nack_after, retry, cfg.resend_max, tail_after=tail,
                                               outstanding_for=cfg.request_timeout_s)[:min(8, room, mine)]
                        room -= len(due)
                        if due:
                            held[did] = held.get(did, 0) + len(due)
                            stream.nacks_sent(len(due))
                        for first, last in due:
                            nacks.append((g, did, first, last))
                    elif (stream.waiting_count and now - g.sync_at.get(did, float("-inf")) >= retry and room > 0
                          and held.get(did, 0) < share):
                        g.sync_at[did] = now  # data but no baseline: ask where our stream starts
                        room -= 1
                        held[did] = held.get(did, 0) + 1
                        nacks.append((g, did, 1, None))
        for g, did in acks:
            self._send_ack(g, did)
        for g, did, first, last in nacks:
            m = g.members.get(did)
            if m is not None:
                self._request_resend(g, m, first, last)

    def _request_resend(self, g: _Group, m: _Member, first: int, last: int | None) -> None:
        body = dm.encode(dm.ResendRequest(g.name, m.info.did, self.member_did, first, last))
        env = envelope.pack(body, [m.info.relationship_verkey], sender=m.my_key)
        answers = self._rx_from["answer"]
        did = m.info.did
        with self._rx_cond:
            self._answers_out += 1  # before the request: its answer may come back at once
            answers[did] = answers.get(did, 0) + 1
        try:
            fut = self._transport.request_async(m.info.peer_endpoint, ProtocolId.GROUP_DATA, env,
                                                timeout=self.config.request_timeout_s)
        except BaseException as exc:
            # Whatever failed, no answer is coming: give the member its share back (else its gaps
            # are never asked for again) and let the timers ask again.
            with self._rx_cond:
                self._answers_out -= 1
                self._uncount(answers, did)
            self._nack_done(g.name, m.info.did)
            if not isinstance(exc, Exception):
                raise
            self._stats.add(nack_failures=1)
            if isinstance(exc, TransportError):
                log.debug("resend request to %s not sent: %s", m.info.did, type(exc).__name__)
            else:  # one request's failure must not stop the others of this tick
                log.warning("resend request to %s not sent: %s", m.info.did, type(exc).__name__, exc_info=True)
            return
        self._stats.add(nacks_sent=1)
        group = g.name
        fut.add_done_callback(lambda f: self._queue_answer(group, did, f, first, last))

    def _queue_answer(self, group: str, did: str, fut: Future[bytes], first: int, last: int | None) -> None:
        with self._rx_cond:
            self._answers_out -= 1
        if not self._rx_put_peer(("answer", group, did, fut, first, last)):  # a safety net: room was kept
            # Not taken: the request is over, and what it asked for is asked again at nack_retry_ms pace.
            self._nack_done(group, did)

    def _nack_done(self, group: str, did: str) -> None:
        g = self._groups.get(group)
        if g is not None:
            with self._rx_lock:
                stream = g.streams.get(did)
                if stream is not None:
                    stream.nack_done()

    def _on_resend_answer(self, group: str, did: str, fut: Future[bytes], first: int, last: int | None) -> None:
        self._nack_done(group, did)  # whatever the answer holds: the next request may go out
        try:
            data = fut.result(0)
        except Exception as exc:  # noqa: BLE001 - a failed NACK is retried by the timers
            self._stats.add(nack_failures=1)
            log.debug("resend request to %s failed: %s", did, type(exc).__name__)
            return
        g = self._groups.get(group)
        m = g.members.get(did) if g is not None else None
        if m is None or not data:
            return  # not (yet) a member on its side: the timers ask again
        key = m.my_key
        try:
            opened = envelope.unpack(data, lambda kid: key if kid == key.verkey else None)
            if opened.sender_verkey != m.info.relationship_verkey:
                self._stats.add(rejected_non_member=1)
                return
            batch = dm.decode(opened.message)
        except ZeroCommError:
            self._stats.add(rejected_malformed=1)
            return
        if not isinstance(batch, dm.DataBatch) or batch.group != group or batch.publisher != did:
            self._stats.add(rejected_malformed=1)
            return
        if not self._authentic(g, m, batch):
            return
        self._accept_batch(g, m, batch)
        with self._rx_lock:
            stream = g.streams.get(did)
            if stream is None:
                return
            if last is None or batch.messages or batch.gone is not None or not stream.lacks(first):
                stream.nack_answered()  # if a hole remains (the answer was capped), ask again without waiting
                return
            # Asked for seqs it announced, it sent none and said none are gone: an honest publisher
            # has them or says they are gone. Asking again at every tick would go on forever.
            withdrawn = stream.withdraw_announced()
        self._unbacked(g, did, first, withdrawn)

    def _unbacked(self, g: _Group, did: str, first: int, withdrawn: int | None) -> None:
        """Count and log (rate-limited, numbers only) a publisher whose answer did not back its claims."""
        self._stats.add(implausible_announcements=1)
        now = time.monotonic()
        key = (g.name, did)
        last_log, suppressed = self._unbacked_logged.get(key, (float("-inf"), 0))
        if now - last_log < 10.0:
            self._unbacked_logged[key] = (last_log, suppressed + 1)
            return
        self._unbacked_logged[key] = (now, 0)
        claim = (f"announced seqs up to {withdrawn}" if withdrawn is not None
                 else "sent seqs after a hole it keeps open")
        log.warning("group %r: %s %s but, asked for seq %d on, sent none of them and none were gone (a faulty "
                    "or hostile publisher); %s%s", g.name, did, claim, first,
                    "the announcement is ignored until it announces again" if withdrawn is not None
                    else "the hole is asked for again at nack_retry_ms pace",
                    f" ({suppressed} more since the last warning)" if suppressed else "")

    def _apply_restore(self, g: _Group, positions: Mapping[str, int]) -> None:
        for did, pos in positions.items():
            out: list[dm.DataMessage] = []
            with self._rx_lock:
                stream = self._stream(g, did)
                if not stream.has_baseline:
                    out = stream.set_baseline(pos)
                elif stream.delivered < pos:
                    out = stream.skip(stream.delivered + 1, pos, count_lost=False)
                g.restored.add(did)
                g.positions[did] = stream.delivered
                m = g.members.get(did)
                if m is None:
                    g.pending_restore[did] = pos
            self._deliver(g, did, out)
            if m is not None:
                self._request_resend(g, m, pos + 1, None)

    # --- internals: GROUP_DATA handlers (transport worker threads) -------------------------------

    def _open_peer_message(self, payload: bytes) -> tuple[_Group, _Member, dm.ControlMessage] | None:
        """Decrypt a GROUP_DATA envelope and check it comes from the member it names."""
        kids = _recipient_kids(payload)
        if kids is None:
            self._stats.add(rejected_malformed=1)
            return None
        keys = self._rel_keys
        try:
            opened = envelope.unpack(payload, keys.get)
            msg = dm.decode(opened.message)
        except ZeroCommError:  # EnvelopeError, MalformedDataMessageError, a bad sender key
            self._stats.add(rejected_malformed=1)
            return None
        if isinstance(msg, (dm.Ack, dm.ResendRequest)):
            did, me = msg.member, msg.publisher
        elif isinstance(msg, dm.DataBatch):
            did, me = msg.publisher, self.member_did
        else:
            self._stats.add(rejected_malformed=1)
            return None
        g = self._groups.get(msg.group)
        m = g.members.get(did) if g is not None else None
        if (m is None or me != self.member_did or opened.sender_verkey != m.info.relationship_verkey
                or opened.recipient_verkey != m.my_key.verkey):
            self._stats.add(rejected_non_member=1)
            return None
        return g, m, msg

    def _on_direct(self, payload: bytes, peer: PeerInfo) -> None:
        if self._closed:
            return
        opened = self._open_peer_message(payload)
        if opened is None:
            return
        g, m, msg = opened
        self._heard(m.info.did)
        if isinstance(msg, dm.Ack):
            if g.outbox.ack(m.info.did, msg.seq):
                budget = g.resend_budgets.get(m.info.did)
                acked = g.outbox.base_of(m.info.did)
                if budget is not None and acked is not None:
                    with budget.lock:
                        budget.acked(acked, self._resend_burst)
            if msg.nonce is not None:
                probe = self._probes.get(msg.nonce)
                if probe is not None and probe[0] == g.name and probe[1] == m.info.did:
                    probe[2].set()
        elif isinstance(msg, dm.DataBatch):  # a publisher's heartbeat: it waits for our ack
            if self._authentic(g, m, msg):
                # Dropped when too many wait: the publisher sends another while our acks stall.
                self._rx_put_peer(("batch", g.name, m.info.did, msg))
        else:
            self._stats.add(rejected_malformed=1)

    def _on_rpc(self, payload: bytes, peer: PeerInfo) -> bytes:
        if self._closed:
            return b""
        opened = self._open_peer_message(payload)
        if opened is None:
            return b""
        g, m, msg = opened
        if not isinstance(msg, dm.ResendRequest):
            self._stats.add(rejected_malformed=1)
            return b""
        self._heard(m.info.did)
        env = self._resend_envelope(g, m, msg.first, msg.last)
        self._stats.add(nacks_served=1)
        return env or b""

    def _resend_envelope(self, g: _Group, m: _Member, first: int, last: int | None) -> bytes | None:
        """A data-batch for one member with what it asks for, its base and what is gone.

        Bounded to one transport frame (the RPC response): a bigger answer is refused and the member
        never catches up. What does not fit, it asks for next.

        Answered from the member's ack on (it delivered everything up to it), and within what it may
        still draw (``_ResendBudget``): a ~1 KB request can ask for a whole frame again and again, so
        without a bound one member drew ~50 MB/s of answers from us. Past its budget an answer is
        shortened, or refused (None: the member asks again at ``nack_retry_ms`` pace), never to less
        than one message once its bucket is full again, so an honest member always fills its gaps.
        """
        did = m.info.did
        base = g.outbox.base_of(did)
        if base is None:
            return None
        first = max(first, base + 1)
        cfg = self.config
        frame = self._transport.max_frame_bytes - _RPC_HEAD
        budget = g.resend_budgets.get(did)
        if budget is None:
            budget = g.resend_budgets.setdefault(did, _ResendBudget(float(self._resend_burst), time.monotonic()))
        with budget.lock:  # taken up front (an estimate), so concurrent requests cannot overdraw it
            budget.refill(time.monotonic(), self._resend_burst, self._resend_rate)
            msgs, gone = g.outbox.get_range(first, last, cfg.resend_max, self._resend_room)
            cut = self._within_budget(budget, msgs)
            if cut is not None:
                self._resend_throttled(g, did, budget, len(msgs) - len(cut[0]), cut[1])
                msgs = cut[0]
                if not msgs:
                    return None  # the member asks again at nack_retry_ms pace
            total = sum(len(x.payload) for x in msgs)
            taken = _answer_bytes(total, len(msgs)) if msgs else 0
            budget.tokens -= taken  # reserved (concurrent requests see it); settled, not below empty, below
            seen = budget.first_sent
            if msgs and msgs[-1].seq > seen:
                # The share of this answer new to the member is paid back when it acks it.
                new = sum(len(x.payload) for x in msgs if x.seq > seen)
                budget.first_sent = msgs[-1].seq
                if len(budget.owed) >= _ResendBudget.OWED_MAX:
                    budget.owed.popleft()
                budget.owed.append((msgs[-1].seq, taken * new // total if total else taken))
        planned = msgs[-1].seq if msgs else None
        if gone is not None and last is None:
            # An open-ended request (a member that does not know where its stream starts yet, or just
            # restored its position) may cover seqs it holds back: called gone, their receipts would
            # fail naming it though it delivers them. It learns its base and what follows here, then
            # asks for its actual holes, and that answer says what is gone.
            gone = None
        if gone is not None:  # it skips them and acks past them: their receipts must not say delivered
            g.outbox.note_gone(did, *gone)
        while True:
            batch = dm.DataBatch(g.name, self.member_did, tuple(msgs), base=base, last=g.wire_seq, gone=gone,
                                 member=did, void=g.outbox.void)
            env = envelope.pack(dm.encode(batch, signer=g.group_key), [m.info.relationship_verkey], sender=m.my_key)
            if len(env) <= frame or not msgs:
                break
            # Ids and headers were not counted: keep the share that fits and pack again.
            keep = min(len(msgs) - 1, len(msgs) * frame // len(env))
            if keep < 1:  # publish() refuses payloads this large: only outsized ids or DIDs get here
                log.error("group %r: seq %d is too large to resend within max_frame_bytes=%d; %s cannot get it",
                          g.name, msgs[0].seq, self._transport.max_frame_bytes, did)
            msgs = msgs[:keep]
        with budget.lock:
            # What it took, not the estimate; never below empty: an answer past the estimate (large
            # headers or ids) must not leave the member waiting longer than an empty bucket's refill.
            budget.tokens = max(0.0, budget.tokens - (len(env) - taken))
            if planned is not None and budget.first_sent == planned and (not msgs or msgs[-1].seq < planned):
                budget.first_sent = max(seen, msgs[-1].seq if msgs else seen)  # cut to fit: not sent yet
        self._stats.add(retransmits=len(msgs))
        return env

    def _within_budget(self, budget: _ResendBudget,
                       msgs: list[dm.DataMessage]) -> tuple[list[dm.DataMessage], int] | None:
        """The messages an answer may carry within ``budget`` and the payload bytes left out, or None: all.

        The envelope is estimated from the payloads (base64, plus room for each message's fields); a
        full bucket always allows one message, so none waits forever however large."""
        if not msgs:
            return None
        room = budget.tokens
        full = budget.tokens >= self._resend_burst
        size = 0
        for i, x in enumerate(msgs):
            size += len(x.payload)
            if _answer_bytes(size, i + 1) > room and not (full and i == 0):
                return msgs[:i], sum(len(y.payload) for y in msgs[i:])
        return None

    def _resend_throttled(self, g: _Group, did: str, budget: _ResendBudget, messages: int, nbytes: int) -> None:
        """Count, and log at most every 10 s per member (numbers only), a resend answer cut to its budget."""
        self._stats.add(resend_throttled=1, resend_bytes_throttled=nbytes)
        now = time.monotonic()
        if now - budget.throttled_log < 10.0:
            budget.throttled_since += 1
            return
        since, budget.throttled_log, budget.throttled_since = budget.throttled_since, now, 0
        log.warning("group %r: %s asked for more resends than its budget (%d bytes, %d a second): %d message(s), "
                    "%d payload bytes held back; it asks again later%s", g.name, did, self._resend_burst,
                    self._resend_rate, messages, nbytes, f" ({since} more since the last warning)" if since else "")

    # --- internals: maintenance ------------------------------------------------------------------

    def _heard(self, did: str) -> None:
        self._last_heard[did] = time.monotonic()
        if self._alive.get(did) is False:
            self._set_alive(did, True)

    def _set_alive(self, did: str, alive: bool) -> None:
        with self._lock:
            if did not in self._alive or self._alive[did] == alive:
                return
            self._alive[did] = alive
            groups = [g for g in self._groups.values() if did in g.members]
        for g in groups:
            g.outbox.set_active(did, alive)
        log.info("member %s is %s", did, "active again" if alive else "inactive (no keepalive answer)")

    def _maintenance_main(self) -> None:
        cfg = self.config
        tick = min(cfg.keepalive_ms, cfg.resend_after_ms, 250.0) / 4000
        while not self._stopping.wait(tick):
            try:
                self._keepalives()
                self._heartbeat_stalled()
                self._release_ack_stalls()
            except Exception:  # noqa: BLE001
                log.exception("group maintenance failed; continuing")

    def _keepalives(self) -> None:
        cfg = self.config
        now = time.monotonic()
        with self._lock:
            targets = {did: m.info.peer_endpoint for g in self._groups.values() for did, m in g.members.items()}
        while self._pongs:
            did, answered = self._pongs.popleft()
            if answered:
                self._heard(did)
            self._pinging.discard(did)
        # Pings are not waited for here: four threads blocking on them (the earlier design) put a live
        # member's ping in line behind those of members that went away, each waiting out its timeout,
        # and with a dozen gone it answered only after dead_after: a live member marked inactive.
        timeout = min(cfg.dead_after_ms / 2000, 5.0)
        for did, endpoint in targets.items():
            if did not in self._pinging and now - self._ping_sent.get(did, float("-inf")) >= cfg.keepalive_ms / 1000:
                self._ping_sent[did] = now
                self._pinging.add(did)
                try:
                    pinged = self._transport.ping_async(endpoint, timeout=timeout)
                except ZeroCommError:  # the transport is closing
                    self._pinging.discard(did)
                    continue
                pinged.add_done_callback(
                    lambda f, did=did: self._pongs.append((did, not f.cancelled() and f.exception() is None)))
        dead_after = cfg.dead_after_ms / 1000
        for did in targets:
            heard = self._last_heard.get(did)
            if heard is not None and self._alive.get(did, True) and now - heard >= dead_after:
                self._set_alive(did, False)

    def _heartbeat_stalled(self) -> None:
        after = self.config.resend_after_ms / 1000
        for g in list(self._groups.values()):
            for did, _acked in g.outbox.heartbeats_due(after):
                m = g.members.get(did)
                if m is None:
                    continue
                # A heartbeat, not the data: it tells the member our last seq, so a lost tail
                # becomes a gap it NACKs precisely, and makes it ack again if only its ack was lost.
                base = g.outbox.base_of(did)
                if base is None:
                    continue
                beat = dm.DataBatch(g.name, self.member_did, (), base=base, last=g.wire_seq, member=did,
                                    void=g.outbox.void)
                env = envelope.pack(dm.encode(beat, signer=g.group_key), [m.info.relationship_verkey], sender=m.my_key)
                try:
                    self._transport.send(m.info.peer_endpoint, ProtocolId.GROUP_DATA, env)
                    self._stats.add(heartbeats=1)
                except TransportError as exc:
                    log.debug("heartbeat to %s not sent: %s", did, type(exc).__name__)

    def _release_ack_stalls(self) -> None:
        """Release from the publish window members alive but with no ack progress for ack_stall_s."""
        stall = self.config.ack_stall_s
        if stall is None:
            return
        for g in list(self._groups.values()):
            stalled = g.outbox.mark_ack_stalls()
            if not stalled:
                continue
            self._stats.add(ack_stalls=len(stalled))
            for did, owed, idle in stalled:
                log.warning("group %r: member %s answers keepalives but its ack has not advanced for %.1fs "
                            "(ack_stall_s=%g) with %d of our message(s) unacked: it no longer holds the publish "
                            "window until it catches up. What it lacks is kept within the retention limits; "
                            "its receipts wait for it. Check that member: its delivery callback may be stuck, "
                            "or it withholds acks", g.name, did, idle, stall, owed)

    # --- test hooks ----------------------------------------------------------------------------

    def _kill_subscription(self, group: str, did: str, down_for: float) -> None:
        """Close our SUB to ``did`` as a crash would and reopen it after ``down_for`` seconds (tests)."""
        self._io_call("sub_kill", group, did, down_for)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._started else "new"
        return f"DataPlane({self.member_did!r}, {self._endpoint or self._bind!r}, {state})"
