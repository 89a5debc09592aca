"""Asynchronous peer transport over ZeroMQ ROUTER/DEALER.

Why this shape:

* pyzmq sockets are not thread-safe, so one IO thread owns every socket (the bound ROUTER for
  inbound traffic and one lazily created DEALER per remote endpoint for outbound traffic). Other
  threads hand it work through a priority queue and poke it through an inproc PAIR, the only
  socket touched outside the IO thread, and only under a lock.
* Nothing is lock-step: requests are correlated by a u32 request id, so many may be in flight
  to one peer and answers may come back in any order.
* The IO thread never runs application code. It decodes, answers what it can (Ping, refusals) and
  queues the rest for a worker pool (senders take turns, each one's jobs by priority), so a slow
  handler never stalls the listener and no sender's flood holds up the others.
* Every wait has a deadline: requests and pings expire in the IO loop itself, sockets close with a
  bounded LINGER and close() joins threads with a timeout.
* A call that expires with nothing heard from its peer since it was written sets that peer's socket
  aside (new frames go on a new one; not with a configured identity, see _retire_silent): a down peer
  would otherwise be handed, when it came back, every frame ZeroMQ queued for it meanwhile, timed-out
  requests included. The old socket stays only to read the answers of the calls written on it (a
  slow live peer is silent too), then closes, dropping what it still queues: one-way frames too,
  which a live but overloaded peer then never gets (stats() counts what may have been dropped, see
  _close_retired). This keeps a timed-out request from running later only when no other call was
  waiting on that socket: while one is, the socket stays open and reconnecting, and a peer back by
  then still gets all it queued.
* close() drains before it stops: what was read before it is handled and answered while its deadline
  allows (what is left then is refused, so no caller waits for its own deadline), and what arrives
  during it is refused, not handled.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import queue
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import zmq

from zerocomm_spark.deadlines import LISTENER_HANDSHAKE_MS, MAX_TIMEOUT, check_timeout
from zerocomm_spark.errors import (
    ConfigurationError,
    FrameError,
    FrameTooLargeError,
    PeerTimeoutError,
    PeerUnreachableError,
    RemoteError,
    RemoteFrameTooLargeError,
    RemoteHandlerError,
    RemoteNotSupportedError,
    TransportError,
    TransportNotRunningError,
)
from zerocomm_spark.transport.frames import (
    MAX_U32,
    DirectSend,
    Error,
    ErrorCode,
    MessageType,
    Ping,
    Pong,
    RpcRequest,
    RpcResponse,
    decode,
    encode,
    refused_request,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_TIMEOUT",
    "DirectHandler",
    "PeerInfo",
    "PeerTransport",
    "RpcHandler",
    "connectable",
    "dialable",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
DEFAULT_PRIORITY = 128
_CONTROL_PRIORITY = 255  # pings, pongs and refusals jump the queue: they measure or unblock others
_LINGER_MS = 1000  # bounded so close() never hangs on an unreachable peer
_HWM = 10_000
_MAX_DEALERS = 768  # outbound sockets kept at once (one per remote endpoint); the oldest idle one closes
_EVICT_LINGER_MS = 500
#: An outbound socket with no call waiting and no frame either way for this long is closed (opened
#: again on the next frame): a peer that went away (restarted on another port, left) otherwise kept
#: a socket, a file descriptor and a reconnect attempt every few seconds until _MAX_DEALERS others
#: pushed it out, and ~800 such descriptors are most of a default 1024 limit.
_IDLE_S = 120.0
#: Set-aside outbound sockets kept open at once (each only until the calls written on it end, and
#: all it queues is delivered if its peer returns before then); past it a silent peer's socket is kept
#: in use, as before (its queued frames may still run if it returns).
_MAX_RETIRED = 64
_RETIRED_CHECK_S = 0.1  # how often set-aside sockets are checked for calls still written on them
#: A set-aside socket whose peer spoke after all (a live, slow peer) stays open this long after the last
#: frame read on it, so late answers to its expired calls are not refused by the peer's ROUTER.
_RETIRED_GRACE_S = 5.0
_MAX_BACKLOG = 10_000  # queued inbound jobs; beyond it the ROUTER is not read (TCP back-pressure)
#: Payload bytes of queued inbound jobs beyond which the ROUTER is not read either: counted in jobs
#: alone, large frames from anyone (the socket is unauthenticated) could queue 10,000 x 16 MiB.
_MAX_BACKLOG_BYTES = 256 * 1024 * 1024
_RECV_BATCH = 256  # messages read per socket per loop turn, so no socket starves the others
_MAX_POLL_MS = 250
_DEADLINE_SLACK = 1024  # deadline entries of answered calls kept at most beyond twice the live ones
_START_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """Who sent an inbound message, as far as the transport can tell.

    ``identity`` is the ZeroMQ routing id of the sender's DEALER (stable when the sender sets
    ``identity``); ``address`` is the TCP peer address when ZeroMQ reports one. Neither is
    authenticated: authenticity comes from the DIDComm envelope, not from the transport.
    """

    identity: bytes
    address: str | None = None


RpcHandler = Callable[[bytes, PeerInfo], bytes]
DirectHandler = Callable[[bytes, PeerInfo], None]


@dataclass(slots=True)
class _Pending:
    future: Future[Any]
    endpoint: str
    deadline: float
    what: str  # for error messages only, never the payload
    sent_at: float | None = None
    conn: int = 0  # the outbound socket it was written on (_conn), 0 until written
    token: int = 0  # its entry in the deadline heap (which holds no reference to it, nor to its future)


@dataclass(slots=True)
class _Outbound:
    frame: bytes
    endpoint: str | None = None  # DEALER target ...
    identity: bytes | None = None  # ... or ROUTER reply target
    pending: _Pending | None = None
    key: tuple[str, int, int] | None = None


@dataclass(slots=True)
class _Job:
    kind: MessageType
    protocol_id: int
    priority: int
    payload: bytes
    peer: PeerInfo
    request_id: int = 0
    head: bytes = b""


@dataclass(slots=True)
class _Handlers:
    rpc: RpcHandler | None = None
    direct: DirectHandler | None = None


@dataclass(slots=True)
class _Stats:
    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors_in: int = 0  # Error frames received
    errors_out: int = 0  # Error frames sent
    malformed_in: int = 0  # frames refused (parse, size, multipart, unsupported)
    handler_errors: int = 0
    timeouts: int = 0
    dropped_out: int = 0
    answers_undeliverable: int = 0  # answers whose caller's socket was gone (its call ended): not in dropped_out
    dealers_evicted: int = 0  # outbound sockets closed to stay under _MAX_DEALERS or idle for _IDLE_S
    dealers_reset: int = 0  # outbound sockets set aside when a call expired with the peer silent (_retire_silent)
    frames_maybe_dropped: int = 0  # written on set-aside sockets closed at LINGER 0 after their last read
    oneways_maybe_dropped: int = 0  # the DirectSend frames among them (_close_retired)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **delta: int) -> None:
        with self.lock:
            for name, value in delta.items():
                setattr(self, name, getattr(self, name) + value)


_RPC, _PING = 0, 1  # kinds in pending keys
#: What the ROUTER sends: answers to a caller's frame (an unroutable one means that caller is gone).
_ANSWERS = frozenset({MessageType.RPC_RESPONSE, MessageType.PONG, MessageType.ERROR})


_InboxItem = tuple[int, int, "_Job | None"]  # (-priority, seq, job); None is a worker's stop sentinel


class _Throttle:
    """Per-frame warnings are what a hostile peer controls: one line per bad frame let it write the
    log as fast as it sends (20,000 garbage frames: 20,000 lines). Each kind of line is written at
    most ``burst`` times a ``window``; then how many were left out (the counters in stats() count all),
    written with the next line of that kind or, when none comes, by flush() once the window is over."""

    def __init__(self, burst: int = 20, window: float = 10.0) -> None:
        self._burst, self._window = burst, window
        self._lock = threading.Lock()
        self._state: dict[str, tuple[float, int, int]] = {}  # kind -> (window start, written, left out)
        self._next_flush = 0.0

    def __call__(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            start, written, left_out = self._state.get(fmt, (now, 0, 0))
            if now - start >= self._window:
                if left_out:
                    log.warning("%d more warning(s) like the next one were not logged in the last %.0fs",
                                left_out, now - start)
                start, written, left_out = now, 0, 0
            if written < self._burst:
                written += 1
                allowed = True
            else:
                left_out += 1
                allowed = False
            self._state[fmt] = (start, written, left_out)
        if allowed:
            log.warning(fmt, *args)

    def flush(self, *, final: bool = False) -> None:
        """Write how many lines of each kind were left out in windows that are over (in all of them if
        ``final``): the count of a last burst was written only when a later line of its kind came, so
        never for the last one. Cheap enough for every IO loop turn: it looks at most once a second."""
        now = time.monotonic()
        left: list[tuple[int, str, float]] = []
        with self._lock:
            if not final and now < self._next_flush:
                return
            self._next_flush = now + 1.0
            for fmt, (start, _, left_out) in list(self._state.items()):
                if final or now - start >= self._window:
                    del self._state[fmt]  # the next line of this kind opens a new window
                    if left_out:
                        left.append((left_out, fmt, now - start))
        for left_out, fmt, elapsed in left:
            log.warning("%d more warning(s) like %r were not logged in the last %.0fs", left_out, fmt, elapsed)


class _FairInbox:
    """Inbound jobs for the workers: senders (ZeroMQ routing ids) take turns, and each sender's jobs
    go by priority. One queue ordered by priority alone let a single peer flooding requests (and
    priority is the sender's choice) keep every other peer's behind all of its own, up to _MAX_BACKLOG
    of them: well past their callers' deadlines. Stop sentinels come after every job.

    The get/put/qsize interface of the queue.PriorityQueue it replaces.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._by_peer: dict[bytes, list[_InboxItem]] = {}
        self._turns: collections.deque[bytes] = collections.deque()  # senders with jobs, next first
        self._sentinels: list[_InboxItem] = []
        self._jobs = 0

    def put(self, item: _InboxItem) -> None:
        with self._cond:
            job = item[2]
            if job is None:
                heapq.heappush(self._sentinels, item)
            else:
                heap = self._by_peer.get(job.peer.identity)
                if heap is None:
                    heap = self._by_peer[job.peer.identity] = []
                    self._turns.append(job.peer.identity)
                heapq.heappush(heap, item)
                self._jobs += 1
            self._cond.notify()

    def _take(self) -> _InboxItem:
        if self._turns:
            sender = self._turns.popleft()
            heap = self._by_peer[sender]
            item = heapq.heappop(heap)
            if heap:
                self._turns.append(sender)  # its next job waits for every other sender's turn
            else:
                del self._by_peer[sender]
            self._jobs -= 1
            return item
        if self._sentinels:
            return heapq.heappop(self._sentinels)
        raise queue.Empty

    def get(self, timeout: float) -> _InboxItem:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._turns and not self._sentinels:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise queue.Empty
                self._cond.wait(left)
            return self._take()

    def get_nowait(self) -> _InboxItem:
        with self._cond:
            return self._take()

    def qsize(self) -> int:
        with self._cond:
            return self._jobs + len(self._sentinels)


class PeerTransport:
    """One member's network endpoint: serves registered protocols and calls other members.

    ``max_frame_bytes`` bounds whole frames, header included, both ways; it should match on every
    member. ``identity`` is this transport's routing id at other members; when omitted each outbound
    connection gets its own random one, so no peer learns an id it could present to another peer
    (whose ROUTER would hand it our replies). Two live transports must not share a configured one.
    With a configured one, a call expiring on a silent peer does not set its socket aside (see
    _retire_silent): requests that timed out on a down peer may still run when it comes back.
    One DEALER is kept per remote endpoint, at most _MAX_DEALERS (the least recently used idle one
    is closed to make room).
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:*",
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        workers: int = 4,
        identity: bytes | None = None,
    ) -> None:
        if not isinstance(max_frame_bytes, int) or max_frame_bytes < 64:
            raise ConfigurationError(f"max_frame_bytes must be an integer >= 64, got {max_frame_bytes!r}")
        if not isinstance(workers, int) or workers < 1:
            raise ConfigurationError(f"workers must be a positive integer, got {workers!r}")
        if identity is not None and (not isinstance(identity, bytes) or not 1 <= len(identity) <= 255
                                     or identity[0] == 0):
            raise ConfigurationError("identity must be 1-255 bytes and must not start with a zero byte")
        self._bind = bind
        self._max_frame = max_frame_bytes
        # Frames between max_frame_bytes and this cap are read and refused with TooLarge; beyond
        # it ZeroMQ drops the connection before buffering. ZMQ_MAXMSGSIZE bounds each part of a
        # message only: a multipart message is bounded as a whole when read (_recv_message).
        self._hard_cap = max(2 * max_frame_bytes, max_frame_bytes + 65536)
        self._workers_n = workers
        self._identity = identity

        self._lock = threading.Lock()
        self._handlers: dict[int, _Handlers] = {}
        self._outbox: list[tuple[int, int, _Outbound]] = []
        self._pending: dict[tuple[str, int, int], _Pending] = {}
        # (deadline, token, key): no _Pending in it, so an answered call's future (and its response
        # payload) is not kept until the deadline passes; entries of resolved calls are skipped on pop
        # and swept out once they outnumber the live ones (_track).
        self._deadlines: list[tuple[float, int, tuple[str, int, int]]] = []
        self._seq = itertools.count()
        self._next_rid = secrets.randbelow(MAX_U32 + 1)
        self._wake_pending = False
        self._started = False
        self._closed = False
        self._io_failed = False
        self._outbox_closed = False  # the IO thread took its last batch (or died): nothing queued goes out
        self._declining = False  # close()'s deadline for handlers passed: inbound jobs are refused, not run
        self._stopping = threading.Event()
        self._close_deadline = 0.0
        self._close_done = threading.Event()  # set when close() has finished (threads joined, context ended)

        self._inbox = _FairInbox()
        self._warn = _Throttle()
        self._inbox_bytes = 0  # payload bytes of the jobs in _inbox (under _lock)
        self._stats = _Stats()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._wake_tx: zmq.Socket[bytes] | None = None
        self._wake_addr = f"inproc://zerocomm-wake-{os.getpid()}-{secrets.token_hex(4)}"
        self._io: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._endpoint: str | None = None
        self._used: dict[str, float] = {}  # per endpoint with a DEALER: its last frame either way
        self._next_sweep = 0.0
        # IO thread only. Each outbound socket's number (what _Pending.conn names), when a frame was
        # last read on it, and the set-aside ones (endpoint, when set aside): see _retire_silent.
        self._conn_ids = itertools.count(1)
        self._conn: dict[zmq.Socket[bytes], int] = {}
        self._heard: dict[int, float] = {}
        # Per outbound socket: frames written on it since the last frame read on it, and how many of
        # them were one-way (what a LINGER-0 close of a set-aside socket may drop: _close_retired).
        self._unread_out: dict[int, list[int]] = {}
        self._retired: dict[zmq.Socket[bytes], tuple[str, float]] = {}
        self._next_retired_check = 0.0

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> PeerTransport:
        """Bind and start the IO thread and the workers; returns self once the endpoint is known."""
        with self._lock:
            if self._closed:
                raise TransportNotRunningError("this transport was closed")
            if self._started:
                raise TransportError("start() was called twice", hint="Start a transport once.")
            self._started = True
        self._ctx = zmq.Context()
        self._io = threading.Thread(target=self._io_main, name="zerocomm-peer-io", daemon=True)
        self._io.start()
        if not self._ready.wait(_START_TIMEOUT) or self._start_error is not None:
            err = self._start_error
            self._closed = True
            self._stopping.set()
            self._io.join(_START_TIMEOUT)
            if not self._io.is_alive():
                self._ctx.term()
            self._close_done.set()  # a later close() has nothing to wait for
            raise ConfigurationError(f"cannot bind the peer transport to {self._bind!r}: {err}") from err
        wake = self._ctx.socket(zmq.PAIR)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(self._wake_addr)
        self._wake_tx = wake
        for i in range(self._workers_n):
            t = threading.Thread(target=self._worker_main, name=f"zerocomm-peer-worker-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        log.info("peer transport listening on %s as %s", self._endpoint,
                 _fmt_id(self._identity) if self._identity else "a random id per connection")
        return self

    @property
    def endpoint(self) -> str:
        """The address peers connect to: the bound one, with the real port when bound to ``*``."""
        if self._endpoint is None:
            raise TransportNotRunningError("the transport has no endpoint before start()")
        return self._endpoint

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame sent or accepted, header included (users size their answers by it)."""
        return self._max_frame

    @property
    def identity(self) -> bytes | None:
        """The configured routing id peers see as ``PeerInfo.identity``; None: random per connection."""
        return self._identity

    def close(self, timeout: float = 5.0) -> None:
        """Answer what was received, flush what is queued (bounded by LINGER), then fail pending calls.

        Inbound messages read before close() are still handled and their responses sent, until the
        deadline less the time kept for the last flush (min(LINGER, timeout/2)); requests still waiting
        then, and those arriving meanwhile, are refused with Error(Internal), so their callers fail fast
        (RemoteHandlerError) rather than time out; one-way messages left then are dropped. A handler
        still running at that point is abandoned, its response dropped (so is the response of a handler
        that closes the transport itself). Messages not yet read off the socket are not read. Handlers
        still running cannot send new requests: the transport refuses new work from the start of close().

        Requests queued before close() are written by the IO thread's last flush, not dropped: many
        are replies (an agent answers a peer with its own RpcRequest). Their answers are never read,
        so their futures fail once the IO thread is done (or close()'s deadline passed).

        Called on the IO thread (from a done callback), it returns at once and the rest goes on in a
        thread of its own: everything above needs the IO thread to keep reading and sending.
        """
        timeout = max(timeout, 0.0)
        deadline = time.monotonic() + timeout
        with self._lock:
            closing = self._closed
            self._closed = True  # under the lock: the IO thread queues no inbound job from now on
            if not closing:
                self._close_deadline = deadline
        if closing:  # another close() is under way: closed when it is (within this call's deadline)
            if threading.current_thread() not in (self._io, *self._workers):
                self._close_done.wait(max(0.0, deadline - time.monotonic()))
            return
        if not self._started:
            self._fail_pending()
            self._close_done.set()
            return
        if self._io is not None and threading.current_thread() is self._io:
            threading.Thread(target=self._close_started, args=(deadline, timeout), daemon=True,
                             name="zerocomm-peer-close").start()
            return
        self._close_started(deadline, timeout)

    def _close_started(self, deadline: float, timeout: float) -> None:
        """close() once it marked the transport closed (never on the IO thread)."""
        current = threading.current_thread()
        # Workers run what was queued before close(), then stop: sentinels sort after every job.
        for i in range(len(self._workers)):
            self._inbox.put((1, i, None))
        handlers_until = deadline - min(_LINGER_MS / 1000, timeout / 2)  # the rest is for the last flush
        for t in self._workers:
            if t is not current:
                t.join(max(handlers_until - time.monotonic(), 0.0))
        self._declining = True
        self._decline_queued()  # left by workers still busy (or by close() called from a worker)
        self._stopping.set()
        self._wake()
        io = self._io
        if io is not None and io is not current:
            io.join(max(deadline - time.monotonic(), 0.0))
        self._fail_pending()
        for t in self._workers:
            if t is not current:
                t.join(max(deadline - time.monotonic(), 0.0))
        with self._lock:
            if self._wake_tx is not None:
                self._wake_tx.close(linger=0)
                self._wake_tx = None
        stuck = [t.name for t in [io, *self._workers] if t is not None and t is not current and t.is_alive()]
        if stuck:
            # Terminating the context now would block until those threads let go of it.
            log.warning("peer transport closed with threads still running: %s", ", ".join(stuck))
        elif self._ctx is not None:
            self._ctx.term()
        self._close_done.set()
        log.info("peer transport %s closed", self._endpoint)

    def __enter__(self) -> PeerTransport:
        if not self._started:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- public API -------------------------------------------------------------------------

    def register(
        self, protocol_id: int, *, rpc: RpcHandler | None = None, direct: DirectHandler | None = None
    ) -> None:
        """Serve a protocol id; until then its requests are refused with NotSupported.

        Handlers run on the worker pool, possibly concurrently, so they must be thread-safe.
        Registering the same id again replaces the handlers given.
        """
        _check_u8("protocol_id", protocol_id)
        if rpc is None and direct is None:
            raise ConfigurationError("register() needs an rpc handler, a direct handler or both")
        with self._lock:
            current = self._handlers.get(protocol_id, _Handlers())
            updated = _Handlers(rpc or current.rpc, direct or current.direct)
            self._handlers = {**self._handlers, protocol_id: updated}  # copy-on-write for the IO thread

    def request_async(
        self,
        endpoint: str,
        protocol_id: int,
        payload: bytes,
        *,
        priority: int = DEFAULT_PRIORITY,
        timeout: float = 10.0,
    ) -> Future[bytes]:
        """Send an RpcRequest; the future resolves to the response payload or fails at the deadline."""
        _check_endpoint(endpoint)
        check_timeout(timeout)
        future: Future[bytes] = Future()
        with self._lock:
            self._check_running()
            rid = self._allocate_rid(endpoint)
        # Encoded outside the lock: the payload may be megabytes.
        frame = encode(RpcRequest(protocol_id, rid, priority, payload))
        self._check_size(frame)
        what = f"request {rid} (protocol {protocol_id}) to {endpoint}"
        pending = _Pending(future, endpoint, time.monotonic() + timeout, what)
        key = (endpoint, _RPC, rid)
        with self._lock:
            self._check_running()
            self._track(key, pending)
            self._enqueue_locked(priority, _Outbound(frame, endpoint=endpoint, pending=pending, key=key))
        return future

    def request(
        self,
        endpoint: str,
        protocol_id: int,
        payload: bytes,
        *,
        priority: int = DEFAULT_PRIORITY,
        timeout: float = 10.0,
    ) -> bytes:
        """Send an RpcRequest and wait for its response payload.

        Raises PeerTimeoutError at the deadline and a RemoteError subclass when the peer refuses.
        """
        future = self.request_async(endpoint, protocol_id, payload, priority=priority, timeout=timeout)
        return _wait(future, timeout, f"request to {endpoint}")

    def send(
        self, endpoint: str, protocol_id: int, payload: bytes, *, priority: int = DEFAULT_PRIORITY
    ) -> None:
        """Fire-and-forget DirectSend: returns once queued; delivery is best effort."""
        _check_endpoint(endpoint)
        frame = encode(DirectSend(protocol_id, priority, payload))
        self._check_size(frame)
        with self._lock:
            self._check_running()
            self._enqueue_locked(priority, _Outbound(frame, endpoint=endpoint))

    def ping(self, endpoint: str, timeout: float = 5.0) -> float:
        """Round-trip time in seconds, measured from the moment the Ping left this process."""
        return _wait(self.ping_async(endpoint, timeout), timeout, f"ping to {endpoint}")

    def ping_async(self, endpoint: str, timeout: float = 5.0) -> Future[float]:
        """ping() without waiting: the future resolves to the round-trip time or fails at the deadline
        (many pings at once need no thread each)."""
        _check_endpoint(endpoint)
        check_timeout(timeout)
        future: Future[float] = Future()
        with self._lock:
            self._check_running()
            nonce = secrets.randbits(32)
            while (endpoint, _PING, nonce) in self._pending:
                nonce = secrets.randbits(32)
            key = (endpoint, _PING, nonce)
            pending = _Pending(future, endpoint, time.monotonic() + timeout, f"ping to {endpoint}")
            self._track(key, pending)
            frame = encode(Ping(nonce))
            item = _Outbound(frame, endpoint=endpoint, pending=pending, key=key)
            self._enqueue_locked(_CONTROL_PRIORITY, item)
        return future

    def stats(self) -> dict[str, int]:
        """Counters for metrics: frames and bytes each way, refusals, timeouts, current backlog."""
        s = self._stats
        with s.lock:
            out = {
                "frames_in": s.frames_in,
                "frames_out": s.frames_out,
                "bytes_in": s.bytes_in,
                "bytes_out": s.bytes_out,
                "errors_in": s.errors_in,
                "errors_out": s.errors_out,
                "malformed_in": s.malformed_in,
                "handler_errors": s.handler_errors,
                "timeouts": s.timeouts,
                "dropped_out": s.dropped_out,
                "answers_undeliverable": s.answers_undeliverable,
                "dealers_evicted": s.dealers_evicted,
                "dealers_reset": s.dealers_reset,
                "frames_maybe_dropped": s.frames_maybe_dropped,
                "oneways_maybe_dropped": s.oneways_maybe_dropped,
            }
        with self._lock:
            out["pending"] = len(self._pending)
            out["outbox"] = len(self._outbox)
        out["inbox"] = self._inbox.qsize()
        return out

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._started else "new"
        return f"PeerTransport({self._endpoint or self._bind!r}, {state})"

    # --- caller-side helpers (hold self._lock) ----------------------------------------------

    def _check_running(self) -> None:
        if self._closed:
            raise TransportNotRunningError("the transport is closed")
        if not self._started:
            raise TransportNotRunningError("the transport is not started")
        if self._io_failed:
            raise TransportNotRunningError("the transport's IO thread failed; close it and start a new one")

    def _check_size(self, frame: bytes) -> None:
        if len(frame) > self._max_frame:
            raise FrameTooLargeError(f"a {len(frame)}-byte frame exceeds max_frame_bytes={self._max_frame}")

    def _allocate_rid(self, endpoint: str) -> int:
        rid = self._next_rid
        while (endpoint, _RPC, rid) in self._pending:  # only after 2**32 ids with one still pending
            rid = (rid + 1) & MAX_U32
        self._next_rid = (rid + 1) & MAX_U32
        return rid

    def _track(self, key: tuple[str, int, int], pending: _Pending) -> None:
        pending.token = next(self._seq)
        self._pending[key] = pending
        if len(self._deadlines) > 2 * len(self._pending) + _DEADLINE_SLACK:  # mostly answered calls
            self._deadlines = [e for e in self._deadlines if self._live(e)]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (pending.deadline, pending.token, key))

    def _live(self, entry: tuple[float, int, tuple[str, int, int]]) -> bool:
        pending = self._pending.get(entry[2])
        return pending is not None and pending.token == entry[1]

    def _enqueue_locked(self, priority: int, item: _Outbound) -> None:
        heapq.heappush(self._outbox, (-priority, next(self._seq), item))
        self._wake_locked()

    def _enqueue(self, priority: int, item: _Outbound) -> None:
        with self._lock:
            if self._outbox_closed:  # a late reply after the IO thread's last flush: nothing will send it
                self._stats.add(dropped_out=1)
                log.debug("closing: a reply finished after the last flush was dropped")
                return
            heapq.heappush(self._outbox, (-priority, next(self._seq), item))
            self._wake_locked()

    def _wake(self) -> None:
        with self._lock:
            self._wake_locked()

    def _wake_locked(self) -> None:
        # Coalesced: one outstanding wake-up is enough, the IO thread drains the whole outbox.
        if self._wake_pending or self._wake_tx is None or threading.current_thread() is self._io:
            return
        self._wake_pending = True
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            self._wake_pending = False  # the IO loop polls with a short timeout anyway

    # --- IO thread --------------------------------------------------------------------------

    def _io_main(self) -> None:
        assert self._ctx is not None
        ctx = self._ctx
        router: zmq.Socket[bytes] | None = None
        wake_rx: zmq.Socket[bytes] | None = None
        dealers: dict[str, zmq.Socket[bytes]] = {}
        try:
            router = ctx.socket(zmq.ROUTER)
            self._tune(router)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise instead of vanishing
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer with the same identity takes over
            router.setsockopt(zmq.HANDSHAKE_IVL, LISTENER_HANDSHAKE_MS)  # idle strangers hold no descriptor long
            router.bind(self._bind)
            self._endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            wake_rx = ctx.socket(zmq.PAIR)
            wake_rx.setsockopt(zmq.LINGER, 0)
            wake_rx.bind(self._wake_addr)
        except Exception as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            for s in (router, wake_rx):
                if s is not None:
                    s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        assert router is not None and wake_rx is not None

        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake_rx, zmq.POLLIN)
        by_socket: dict[zmq.Socket[bytes], str] = {}
        router_polled = True
        try:
            while not self._stopping.is_set():
                backlog_full = not self._closed and self._backlog_full()  # closing: refused
                if backlog_full == router_polled:  # stop/restart reading inbound under back-pressure
                    poller.modify(router, 0 if backlog_full else zmq.POLLIN)
                    router_polled = not backlog_full
                events = dict(poller.poll(self._poll_timeout_ms(backlog_full)))
                if wake_rx in events:
                    self._drain_wake(wake_rx)
                if router in events:
                    self._read_router(router)
                for sock in [s for s in events if s in by_socket]:
                    self._read_dealer(sock, by_socket[sock])
                self._flush(router, dealers, by_socket, poller)
                self._retire_silent(self._expire(), dealers, by_socket, poller)
                self._close_retired(by_socket, poller)
                self._close_idle(dealers, by_socket, poller)
                self._warn.flush()
            # Orderly stop: push out what was queued before close(), then let LINGER deliver it.
            self._flush(router, dealers, by_socket, poller, final=True)
            self._warn.flush(final=True)
        except Exception:  # noqa: BLE001 - a dead IO thread must not leave callers hanging
            log.exception("peer transport IO thread failed; closing the transport")
            self._fail_all(TransportError("the transport's IO thread failed"))
        finally:
            with self._lock:
                self._outbox_closed = True
            linger = int(max(0.0, min(_LINGER_MS / 1000, self._close_deadline - time.monotonic())) * 1000)
            for sock in [*dealers.values(), router]:
                sock.close(linger=linger)
            for sock, (_, since) in self._retired.items():
                # Set aside because its peer fell silent: unless it spoke since, what it queues are
                # requests that timed out, which a peer back within the linger would still run.
                live = self._heard.get(self._conn.get(sock, 0), float("-inf")) >= since
                sock.close(linger=linger if live else 0)
            wake_rx.close(linger=0)

    def _tune(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, self._hard_cap)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.setsockopt(zmq.RCVHWM, _HWM)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)  # ZMTP heartbeats notice half-open TCP connections
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)

    def _poll_timeout_ms(self, backlog_full: bool) -> int:
        limit = 20 if backlog_full else _MAX_POLL_MS
        with self._lock:
            if self._deadlines:
                until = (self._deadlines[0][0] - time.monotonic()) * 1000
                return max(0, min(limit, int(until) + 1))
        return limit

    def _drain_wake(self, wake_rx: zmq.Socket[bytes]) -> None:
        # Drain first, then clear the flag: a wake-up sent in between is drained here (its item is
        # already in the outbox, flushed in this turn) or still in the socket. The other order could
        # swallow one and leave the flag set with nothing to read: every later sender would then
        # wait out the poll timeout (250 ms per message).
        while True:
            try:
                wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._lock:
            self._wake_pending = False

    def _connect(
        self,
        endpoint: str,
        dealers: dict[str, zmq.Socket[bytes]],
        by_socket: dict[zmq.Socket[bytes], str],
        poller: zmq.Poller,
    ) -> zmq.Socket[bytes]:
        sock = dealers.pop(endpoint, None)
        if sock is not None:
            dealers[endpoint] = sock  # most recently used last: eviction takes the oldest
            self._used[endpoint] = time.monotonic()
            return sock
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            self._tune(sock)
            # Our own routing id per connection (unless one was configured): a peer that saw it must
            # not be able to present it to another peer, whose ROUTER would hand it our replies.
            sock.setsockopt(zmq.ROUTING_ID, self._identity or b"zc-" + secrets.token_hex(8).encode("ascii"))
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, 5000)
            sock.connect(endpoint)
        except Exception as exc:  # noqa: BLE001 - whatever connect() makes of a peer-chosen string
            sock.close(linger=0)
            raise zmq.ZMQError(msg=f"cannot connect to that endpoint ({type(exc).__name__})") from None
        if len(dealers) >= _MAX_DEALERS:
            self._evict_dealer(dealers, by_socket, poller)
        dealers[endpoint] = sock
        by_socket[sock] = endpoint
        self._conn[sock] = next(self._conn_ids)
        self._used[endpoint] = time.monotonic()
        poller.register(sock, zmq.POLLIN)
        return sock

    def _evict_dealer(self, dealers: dict[str, zmq.Socket[bytes]], by_socket: dict[zmq.Socket[bytes], str],
                      poller: zmq.Poller) -> None:
        """Close the least recently used outbound socket with no call waiting on it. Peers choose the
        endpoints we answer (DID exchange), so one socket per endpoint for ever would let anyone use
        up the context's sockets (1023) and cut us off from new peers."""
        with self._lock:
            busy = {key[0] for key in self._pending}
        for endpoint in dealers:
            if endpoint not in busy:
                self._drop_dealer(endpoint, dealers, by_socket, poller, _EVICT_LINGER_MS)
                self._stats.add(dealers_evicted=1)
                return

    def _drop_dealer(self, endpoint: str, dealers: dict[str, zmq.Socket[bytes]],
                     by_socket: dict[zmq.Socket[bytes], str], poller: zmq.Poller, linger: int) -> None:
        sock = dealers.pop(endpoint)
        by_socket.pop(sock, None)
        self._used.pop(endpoint, None)
        conn = self._conn.pop(sock, 0)
        self._heard.pop(conn, None)
        self._unread_out.pop(conn, None)
        poller.unregister(sock)
        sock.close(linger=linger)  # with linger, what it still queues (acks, answers) may yet go out

    def _close_idle(self, dealers: dict[str, zmq.Socket[bytes]], by_socket: dict[zmq.Socket[bytes], str],
                    poller: zmq.Poller) -> None:
        """At most once a second: close the outbound sockets idle for _IDLE_S with no call waiting."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, _IDLE_S / 2)
        with self._lock:
            busy = {key[0] for key in self._pending}
        for endpoint in [e for e, used in self._used.items() if now - used >= _IDLE_S and e not in busy]:
            self._drop_dealer(endpoint, dealers, by_socket, poller, _EVICT_LINGER_MS)
            self._stats.add(dealers_evicted=1)

    def _flush(
        self,
        router: zmq.Socket[bytes],
        dealers: dict[str, zmq.Socket[bytes]],
        by_socket: dict[zmq.Socket[bytes], str],
        poller: zmq.Poller,
        *,
        final: bool = False,
    ) -> None:
        with self._lock:
            batch = [heapq.heappop(self._outbox)[2] for _ in range(len(self._outbox))]  # priority order
            if final:
                self._outbox_closed = True  # from now on _enqueue drops: this is the last batch
        for item in batch:
            if item.pending is not None and item.pending.future.done():
                continue  # expired or cancelled while queued
            try:
                if item.identity is not None:
                    router.send_multipart([item.identity, item.frame], zmq.NOBLOCK)
                else:
                    assert item.endpoint is not None
                    sock = self._connect(item.endpoint, dealers, by_socket, poller)
                    sock.send(item.frame, zmq.NOBLOCK)
            except Exception as exc:  # noqa: BLE001 - one bad item is dropped, the IO thread goes on
                if (item.identity is not None and isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH
                        and item.frame[0] in _ANSWERS):
                    # The caller's socket is gone: its call ended (timed out, or its socket was set
                    # aside and closed, or it closed). Normal for a slow handler, not a fault here.
                    self._stats.add(answers_undeliverable=1)
                    log.debug("an answer (%d bytes) to %s was not delivered: its caller's socket is gone",
                              len(item.frame), _fmt_id(item.identity))
                    continue
                self._stats.add(dropped_out=1)
                target = item.endpoint or _fmt_id(item.identity or b"")
                reason = exc.strerror if isinstance(exc, zmq.ZMQError) else type(exc).__name__
                self._warn("dropped a %d-byte frame to %.200r: %s", len(item.frame), target, reason)
                if item.pending is not None and item.key is not None:
                    error = PeerUnreachableError(f"cannot send to {target[:200]}: {reason}")
                    self._resolve(item.key, item.pending, error)
                continue
            if item.identity is None:
                written = self._unread_out.setdefault(self._conn[sock], [0, 0])
                written[0] += 1
                if item.frame[0] == MessageType.DIRECT_SEND:
                    written[1] += 1
            if item.pending is not None:
                item.pending.sent_at = time.monotonic()
                if item.identity is None:
                    item.pending.conn = self._conn[sock]
            if item.frame[0] == MessageType.ERROR:
                self._stats.add(frames_out=1, bytes_out=len(item.frame), errors_out=1)
            else:
                self._stats.add(frames_out=1, bytes_out=len(item.frame))

    def _expire(self) -> list[_Pending]:
        """Fail the calls whose deadline passed; returns them (for _retire_silent)."""
        now = time.monotonic()
        expired: list[_Pending] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                entry = heapq.heappop(self._deadlines)
                if self._live(entry):
                    expired.append(self._pending.pop(entry[2]))
        for p in expired:
            if not p.future.done():
                self._stats.add(timeouts=1)  # counted first, so a woken caller already sees it
                _fail(p.future, PeerTimeoutError(f"no answer to {p.what} before the deadline"))
        return expired

    def _retire_silent(self, expired: list[_Pending], dealers: dict[str, zmq.Socket[bytes]],
                       by_socket: dict[zmq.Socket[bytes], str], poller: zmq.Poller) -> None:
        """A call expired and nothing was read from its peer since it was written: the peer may be
        down, and then ZeroMQ keeps every frame written to it (up to _HWM, each up to max_frame_bytes)
        and delivers them all when a peer listens there again: requests whose callers were told
        PeerTimeoutError would still run. So its socket is set aside: later frames go on a new one,
        and the old one is kept only to read answers to the calls written on it (a live peer whose
        handler is slow is silent too: its calls must not be cut, c062ecf/503881b), then closed with
        what it still queues (_close_retired).

        That holds for one call at a time. While another call written on the set-aside socket still
        waits, the socket stays open and keeps reconnecting: a peer that returns in that window gets
        every frame queued there, the timed-out requests included (a strict-xfail test pins it).
        Closing it at once would need proof its frames were never delivered, so that its calls could
        fail as not sent; the IO thread does not know whether the socket ever had a connection.

        Not ZMQ_IMMEDIATE, which would queue nothing for a down peer: with it libzmq discards the
        frames a socket received but the IO thread had not yet read when the connection drops, so a
        peer's last answers before it closed were lost (about 1 in 10 on loopback even with the IO
        thread idle; see f508682 for the same loss in the client).

        Not with a configured ``identity``: the set-aside socket and its replacement would share a
        routing id, and the peer's ROUTER (ROUTER_HANDOVER) gives it to whichever connects last. The
        set-aside one, its reconnect back-off grown while the peer was down, connects after the new one
        and takes the id: the new socket is cut off (its one-ways lost, its requests unanswered) for
        15-20 s, long after the old one closed. Such a transport keeps its socket, as before 93d3064
        (what it queued for a down peer is delivered when that peer returns)."""
        if self._identity is not None:
            return
        for p in expired:
            sock = dealers.get(p.endpoint)
            if sock is None or p.sent_at is None or self._conn.get(sock) != p.conn:
                continue  # never written, or on a socket already set aside or closed
            self._read_dealer(sock, p.endpoint)  # an answer that came after the poll is the peer speaking
            if self._heard.get(p.conn, float("-inf")) >= p.sent_at or dealers.get(p.endpoint) is not sock:
                continue  # a slow call, not a silent peer
            if len(self._retired) >= _MAX_RETIRED:
                self._warn("kept the socket to silent peer %.200r: %d others are set aside already",
                           p.endpoint, len(self._retired))
                continue
            dealers.pop(p.endpoint)
            self._used.pop(p.endpoint, None)
            self._retired[sock] = (p.endpoint, time.monotonic())
            self._next_retired_check = 0.0  # closed this turn if no other call was written on it
            self._stats.add(dealers_reset=1)
            log.debug("%s expired with %s silent: its socket is set aside", p.what, p.endpoint)

    def _close_retired(self, by_socket: dict[zmq.Socket[bytes], str], poller: zmq.Poller) -> None:
        """Close the set-aside sockets with no call written on them still waiting. What one still
        queues is dropped (LINGER 0) unless its peer spoke after it was set aside: then it is live, it
        is closed only once quiet for _RETIRED_GRACE_S, and one-way frames behind the calls may still
        go out within _EVICT_LINGER_MS.

        One-way frames on a socket closed with LINGER 0 may be lost: those to a down peer (the point),
        but also those to a live peer too busy to answer the expired call (its ROUTER not read under
        back-pressure). How many ZeroMQ still held is not known; the frames written on it after the
        last frame read on it (an estimate: at most that many unless an earlier frame was still queued)
        are counted in stats() (frames_maybe_dropped, oneways_maybe_dropped) and warned about when
        one-ways are among them."""
        now = time.monotonic()
        if not self._retired or now < self._next_retired_check:
            return
        self._next_retired_check = now + _RETIRED_CHECK_S
        with self._lock:
            waiting = {p.conn for p in self._pending.values()}
        for sock, (endpoint, since) in list(self._retired.items()):
            conn = self._conn[sock]
            if conn in waiting:
                continue
            heard = self._heard.get(conn, float("-inf"))
            live = heard >= since
            if live and now - heard < _RETIRED_GRACE_S:
                continue
            del self._retired[sock]
            by_socket.pop(sock, None)
            self._conn.pop(sock, None)
            self._heard.pop(conn, None)
            frames, oneways = self._unread_out.pop(conn, (0, 0))
            poller.unregister(sock)
            sock.close(linger=_EVICT_LINGER_MS if live else 0)
            if not live and frames:
                self._stats.add(frames_maybe_dropped=frames, oneways_maybe_dropped=oneways)
                # Warned only when the peer had answered on this socket: then it went silent with our
                # frames on the way, maybe live but overloaded. A socket never answered on is one to a
                # peer that is down (each silent expiry makes a new one): its frames were for nobody, and
                # a group member that stays down would have the warning every keepalive for as long.
                if oneways and heard > float("-inf"):
                    self._warn("closed the socket set aside for silent peer %.200r: %d one-way frame(s) written "
                               "on it since it last answered may not have been delivered", endpoint, oneways)
                elif oneways:
                    log.debug("closed a socket to %.200r that never answered: %d one-way frame(s) dropped",
                              endpoint, oneways)

    def _resolve(
        self, key: tuple[str, int, int], pending: _Pending, outcome: BaseException | None, value: Any = None
    ) -> None:
        with self._lock:
            if self._pending.get(key) is pending:
                del self._pending[key]
        if outcome is not None:
            _fail(pending.future, outcome)
        else:
            _succeed(pending.future, value)

    def _fail_pending(self) -> None:
        """At close: what is still pending was sent (or never will be); its answer will not be read."""
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
            self._deadlines.clear()
        for p in pending:
            _fail(p.future, TransportNotRunningError(f"transport closed while {p.what} was pending"))

    def _fail_all(self, exc: TransportError) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
            self._deadlines.clear()
            self._io_failed = True
        for p in pending:
            _fail(p.future, exc)

    def _refuse(
        self, identity: bytes, frame: bytes | memoryview, code: ErrorCode, reason: str, rid: int | None = None
    ) -> None:
        """Answer a frame we cannot serve, unless it is too short to name or is itself an Error."""
        self._stats.add(malformed_in=1)
        self._warn("refused a %d-byte frame from %s: %s", len(frame), _fmt_id(identity), reason)
        if len(frame) < 2 or frame[0] == MessageType.ERROR:  # never answer an Error: no ping-pong loops
            return
        reply = encode(Error(code, bytes(frame[:2]), rid))
        self._enqueue(_CONTROL_PRIORITY, _Outbound(reply, identity=identity))

    def _backlog_full(self) -> bool:
        return self._inbox.qsize() >= _MAX_BACKLOG or self._inbox_bytes >= _MAX_BACKLOG_BYTES

    def _take(self, job: _Job | None) -> None:
        """A job left the inbox: its bytes no longer count against the backlog."""
        if job is not None:
            with self._lock:
                self._inbox_bytes -= len(job.payload)

    def _recv_message(self, sock: zmq.Socket[bytes], envelope: int) -> tuple[list[zmq.Frame], int, int] | None:
        """One message read part by part: (its parts, its part count, its bytes), the first
        ``envelope`` parts (a ROUTER's routing id) not counted; None if nothing is waiting.

        Why not recv_multipart: a peer may send any number of parts, each under ZMQ_MAXMSGSIZE.
        Past the whole-message bound (the hard cap: one legitimate frame) the parts read are let go
        as they come and the rest only counted, so the message is dropped with one log line instead
        of being held whole a second time (libzmq itself delivers a message only once all its
        parts arrived; our parts are one frame, so any multipart message is refused).
        """
        first = sock.recv(zmq.NOBLOCK, copy=False)
        parts = [first]
        count, size = (0, 0) if envelope else (1, len(first.buffer))
        more = first.more
        while more:
            part = sock.recv(zmq.NOBLOCK, copy=False)  # a message's parts arrive together: never Again
            more = part.more
            if len(parts) < envelope:
                parts.append(part)
                continue
            count += 1
            size += len(part.buffer)
            if size <= self._hard_cap and len(parts) < envelope + 1:
                parts.append(part)  # the first frame: what a refusal answers about
            # later parts are dropped here and freed: never more than the bound and one part held
        return parts, count, size

    def _over_bound(self, count: int, size: int, source: str) -> bool:
        """A message past the whole-message bound: logged (sizes only) and dropped unanswered, as
        ZeroMQ drops a single frame past the hard cap."""
        if size <= self._hard_cap:
            return False
        self._stats.add(frames_in=1, bytes_in=size, malformed_in=1)
        self._warn("dropped a %d-part message of %d bytes from %s: over the %d-byte bound for a whole message "
                    "(ZMQ_MAXMSGSIZE only bounds each part; max_frame_bytes=%d)", count, size, source,
                    self._hard_cap, self._max_frame)
        return True

    def _read_router(self, router: zmq.Socket[bytes]) -> None:
        for _ in range(_RECV_BATCH):
            if self._backlog_full():  # a turn's batch could overshoot the byte budget by 256 frames
                return
            try:
                parts, count, size = self._recv_message(router, 1)
            except zmq.Again:
                return
            if self._over_bound(count, size, _fmt_id(parts[0].bytes)):
                continue
            try:
                self._on_inbound(parts, count, size)
            except Exception:  # noqa: BLE001 - one bad frame must not stop the listener
                self._stats.add(malformed_in=1)
                log.exception("failed to handle an inbound frame; listener continues")

    def _on_inbound(self, parts: list[zmq.Frame], count: int, size: int) -> None:
        identity = parts[0].bytes
        frames = parts[1:]
        self._stats.add(frames_in=1, bytes_in=size)
        if count != 1:
            first = frames[0].buffer if frames else memoryview(b"")
            if len(first) > self._max_frame:
                first = first[:2]
            reason = f"{count} ZeroMQ frames ({size} bytes) where one is expected"
            self._refuse(identity, first, ErrorCode.PARSING_ERROR, reason)
            return
        data = frames[0].buffer
        if len(data) > self._max_frame:
            rid = None
            if data[0] == MessageType.RPC_REQUEST and len(data) >= 6:
                rid = int.from_bytes(data[2:6], "big")
            reason = f"exceeds max_frame_bytes={self._max_frame}"
            self._refuse(identity, data, ErrorCode.TOO_LARGE, reason, rid)
            return
        try:
            msg = decode(data)
        except FrameError as exc:
            self._refuse(identity, data, ErrorCode.PARSING_ERROR, _reason(exc))
            return
        if isinstance(msg, Ping):
            self._enqueue(_CONTROL_PRIORITY, _Outbound(encode(Pong(msg.nonce)), identity=identity))
            return
        if isinstance(msg, Error):
            self._stats.add(errors_in=1)
            self._warn(
                "peer %s sent %s about a frame starting %s", _fmt_id(identity), msg.code.name, msg.head.hex()
            )
            return
        if isinstance(msg, RpcRequest):
            handlers = self._handlers.get(msg.protocol_id)
            if handlers is None or handlers.rpc is None:
                reason = f"no rpc handler for protocol {msg.protocol_id}"
                self._refuse(identity, data, ErrorCode.NOT_SUPPORTED, reason, msg.request_id)
                return
            peer = self._peer(identity, frames[0])
            head = bytes(data[:2])
            job = _Job(MessageType.RPC_REQUEST, msg.protocol_id, msg.priority, msg.payload, peer, msg.request_id, head)
        elif isinstance(msg, DirectSend):
            handlers = self._handlers.get(msg.protocol_id)
            if handlers is None or handlers.direct is None:
                reason = f"no direct handler for protocol {msg.protocol_id}"
                self._refuse(identity, data, ErrorCode.NOT_SUPPORTED, reason)
                return
            peer = self._peer(identity, frames[0])
            job = _Job(MessageType.DIRECT_SEND, msg.protocol_id, msg.priority, msg.payload, peer)
        else:  # Pong or RpcResponse: answers belong on our DEALERs, not on the ROUTER
            reason = f"unexpected {msg.TYPE.name} on the listening socket"
            self._refuse(identity, data, ErrorCode.NOT_SUPPORTED, reason)
            return
        with self._lock:  # close() sets _closed under it: no job is queued after the workers' sentinels
            queued = not self._closed
            if queued:
                self._inbox_bytes += len(job.payload)
                self._inbox.put((-job.priority, next(self._seq), job))
        if not queued:
            self._decline(job)

    @staticmethod
    def _peer(identity: bytes, frame: zmq.Frame) -> PeerInfo:
        try:
            address: str | None = frame.get("Peer-Address")
        except (zmq.ZMQError, AttributeError, TypeError):
            address = None
        return PeerInfo(identity, address)

    def _read_dealer(self, sock: zmq.Socket[bytes], endpoint: str) -> None:
        for _ in range(_RECV_BATCH):
            try:
                parts, count, size = self._recv_message(sock, 0)
            except zmq.Again:
                return
            now = time.monotonic()
            conn = self._conn.get(sock, 0)
            self._heard[conn] = now
            self._unread_out.pop(conn, None)
            if endpoint in self._used:  # not for a set-aside socket whose endpoint has no other
                self._used[endpoint] = now
            if self._over_bound(count, size, endpoint):
                continue
            try:
                self._on_reply(parts, endpoint, count, size)
            except Exception:  # noqa: BLE001 - keep serving the other replies
                self._stats.add(malformed_in=1)
                log.exception("failed to handle a reply from %s", endpoint)

    def _on_reply(self, parts: list[zmq.Frame], endpoint: str, count: int, size: int) -> None:
        self._stats.add(frames_in=1, bytes_in=size)
        if count != 1 or size > self._max_frame:
            self._stats.add(malformed_in=1)
            self._warn("ignored a reply from %s: %d ZeroMQ frames, %d bytes", endpoint, count, size)
            return
        try:
            msg = decode(parts[0].buffer)
        except FrameError as exc:
            self._stats.add(malformed_in=1)
            refused = refused_request(parts[0].buffer)
            if refused is not None and self._refused_with_unknown_code(endpoint, *refused):
                return
            self._warn("ignored an unparsable %d-byte reply from %s: %s", size, endpoint, _reason(exc))
            return
        now = time.monotonic()
        if isinstance(msg, RpcResponse):
            key = (endpoint, _RPC, msg.request_id)
            with self._lock:
                pending = self._pending.get(key)
            if pending is None:
                log.debug("late or unknown response %d from %s ignored", msg.request_id, endpoint)
                return
            self._resolve(key, pending, None, msg.payload)
        elif isinstance(msg, Pong):
            key = (endpoint, _PING, msg.nonce)
            with self._lock:
                pending = self._pending.get(key)
            if pending is None:
                self._stats.add(malformed_in=1)
                self._warn("Pong from %s carries a nonce no ping is waiting for", endpoint)
                return
            self._resolve(key, pending, None, now - (pending.sent_at or now))
        elif isinstance(msg, Error):
            self._stats.add(errors_in=1)
            with self._lock:
                key = (endpoint, _RPC, msg.request_id) if msg.request_id is not None else None
                pending = self._pending.get(key) if key is not None else None
            if key is None or pending is None:
                self._warn("peer %s refused a frame starting %s: %s", endpoint, msg.head.hex(), msg.code.name)
                return
            self._resolve(key, pending, _remote_error(msg.code, pending.what))
        else:
            self._stats.add(malformed_in=1)
            self._warn("ignored an unexpected %s from %s on an outbound socket", msg.TYPE.name, endpoint)

    def _refused_with_unknown_code(self, endpoint: str, code: int, request_id: int) -> bool:
        """An Error frame naming one of our requests with a code this version does not know (a newer
        peer's extension): the request was refused all the same, so its caller fails now with
        RemoteError instead of waiting for its deadline. False if no request of ours is waiting."""
        key = (endpoint, _RPC, request_id)
        with self._lock:
            pending = self._pending.get(key)
        if pending is None:
            return False
        self._stats.add(errors_in=1)
        self._warn("peer %s refused a request with unknown error code %d", endpoint, code)
        self._resolve(key, pending, RemoteError(f"the peer refused {pending.what} with error code {code}, "
                                                "which this version does not know"))
        return True

    # --- workers ----------------------------------------------------------------------------

    def _worker_main(self) -> None:
        while True:
            try:
                _, _, job = self._inbox.get(timeout=1.0)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            self._take(job)
            if job is None:
                return
            try:
                if self._declining:
                    self._decline(job)
                else:
                    self._run(job)
            except Exception:  # noqa: BLE001 - never lose a worker
                log.exception("peer transport worker failed")

    def _decline_queued(self) -> None:
        """At close()'s deadline for handlers: refuse the jobs still queued (workers' sentinels stay)."""
        sentinels: list[tuple[int, int, _Job | None]] = []
        declined = 0
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[2] is None:
                sentinels.append(item)
            else:
                self._take(item[2])
                self._decline(item[2])
                declined += 1
        for item in sentinels:
            self._inbox.put(item)
        if declined:
            log.warning("closing: %d received message(s) not handled before the deadline", declined)

    def _decline(self, job: _Job) -> None:
        """Closing: a request we will not handle gets Error(Internal) so its caller fails fast instead
        of waiting for its deadline; a one-way message expects no answer and is dropped."""
        log.debug("closing: not handling a %s (protocol %s) from %s", job.kind.name, job.protocol_id,
                  _fmt_id(job.peer.identity))
        if job.kind == MessageType.RPC_REQUEST:
            reply = encode(Error(ErrorCode.INTERNAL, job.head, job.request_id))
            self._enqueue(_CONTROL_PRIORITY, _Outbound(reply, identity=job.peer.identity))

    def _run(self, job: _Job) -> None:
        handlers = self._handlers.get(job.protocol_id, _Handlers())
        if job.kind == MessageType.DIRECT_SEND:
            try:
                assert handlers.direct is not None
                handlers.direct(job.payload, job.peer)
            except Exception:  # noqa: BLE001 - logged, the sender expects no answer
                self._stats.add(handler_errors=1)
                log.exception(
                    "direct handler for protocol %s failed on a message from %s",
                    job.protocol_id,
                    _fmt_id(job.peer.identity),
                )
            return
        try:
            assert handlers.rpc is not None
            result = handlers.rpc(job.payload, job.peer)
            if not isinstance(result, (bytes, bytearray, memoryview)):
                raise TypeError(f"rpc handler returned {type(result).__name__}, not bytes")
            reply = encode(RpcResponse(job.request_id, job.priority, bytes(result)))
            if len(reply) > self._max_frame:
                log.error("response to request %d is %d bytes, over max_frame_bytes", job.request_id, len(reply))
                reply = encode(Error(ErrorCode.TOO_LARGE, job.head, job.request_id))
        except Exception:  # noqa: BLE001 - the caller gets Error(Internal), details stay here
            self._stats.add(handler_errors=1)
            log.exception(
                "rpc handler for protocol %s failed on request %d from %s",
                job.protocol_id,
                job.request_id,
                _fmt_id(job.peer.identity),
            )
            reply = encode(Error(ErrorCode.INTERNAL, job.head, job.request_id))
        self._enqueue(job.priority, _Outbound(reply, identity=job.peer.identity))


# --- module helpers -------------------------------------------------------------------------


def _fmt_id(identity: bytes) -> str:
    try:
        text = identity.decode("ascii")
        if text.isprintable():
            return text
    except UnicodeDecodeError:
        pass
    return "0x" + identity.hex()


def _reason(exc: TransportError) -> str:
    """The message without the hint, for one-line logs."""
    return str(exc).removesuffix(f". {exc.hint}")


def _check_u8(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 255:
        raise ConfigurationError(f"{name} must be an integer 0-255, got {value!r}")


_SCHEMES = ("tcp://", "ipc://", "inproc://")


def dialable(endpoint: object) -> bool:
    """Whether the transport can dial ``endpoint``: a plain ZeroMQ tcp://, ipc:// or inproc:// address.

    Endpoints often come from peers (a DID document's service): check them with this on arrival, so
    a peer whose endpoint cannot be dialled is refused at once instead of never answered.
    """
    return (isinstance(endpoint, str) and endpoint.startswith(_SCHEMES) and len(endpoint) <= 1024
            and endpoint.isprintable())  # no control characters, no lone surrogates (connect() raised)


# HOST: a bracketed IPv6 address (with a zone, fe80::1%eth0), an unbracketed one (libzmq takes the
# last colon for the port), or a name or IPv4 address (a fully qualified name may end in a dot).
_TCP_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]{2,45}(?:%[A-Za-z0-9_.-]{1,64})?\]"
                           r"|[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f.]{0,15}){2,8}"
                           r"|[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?\.?):([0-9]{1,5})")
#: Bytes of an ipc:// path at most: a Unix socket's sun_path (108 bytes on Linux, 104 on macOS) less
#: its terminating NUL.
_IPC_PATH_MAX = 103 if sys.platform == "darwin" else 107


def connectable(endpoint: object) -> bool:
    """Whether a ZeroMQ socket's connect() takes ``endpoint``: tcp://HOST:PORT (a name, an IPv4 or a
    bracketed IPv6 address), ipc://PATH (up to the socket path limit) or inproc://NAME.

    Stricter than :func:`dialable`: the data plane connects a SUB to what a member announced, on its
    IO thread, and connect() raises ZMQError for ``tcp://x`` or ``tcp://127.0:=#1:5`` alike.
    """
    if not dialable(endpoint):
        return False
    assert isinstance(endpoint, str)
    if endpoint.startswith("ipc://"):
        return 0 < len(endpoint[6:].encode("utf-8")) <= _IPC_PATH_MAX
    if endpoint.startswith("inproc://"):
        return 0 < len(endpoint) - 9 <= 256
    match = _TCP_ENDPOINT.fullmatch(endpoint)
    return match is not None and 0 < int(match.group(1)) <= 65535


def _check_endpoint(endpoint: str) -> None:
    """Only plain ZeroMQ addresses pass, so nothing a peer chose can make the IO thread's connect()
    raise something unexpected."""
    if not dialable(endpoint):
        raise ConfigurationError(f"a peer endpoint looks like tcp://host:port, got {endpoint[:200]!r}"
                                 if isinstance(endpoint, str) else
                                 f"a peer endpoint looks like tcp://host:port, got {type(endpoint).__name__}")


def _wait(future: Future[Any], timeout: float, what: str) -> Any:
    # The IO thread enforces the deadline; the slack only guards against a wedged IO thread.
    try:
        return future.result(timeout=timeout + 2.0)
    except FutureTimeoutError:
        future.cancel()
        raise PeerTimeoutError(f"no answer to {what} within {timeout:g}s") from None


def _fail(future: Future[Any], exc: BaseException) -> bool:
    try:
        future.set_exception(exc)
        return True
    except InvalidStateError:  # already resolved or cancelled by the caller
        return False


def _succeed(future: Future[Any], value: Any) -> None:
    try:
        future.set_result(value)
    except InvalidStateError:
        pass


_REMOTE_ERRORS: dict[ErrorCode, type[RemoteError]] = {
    ErrorCode.NOT_SUPPORTED: RemoteNotSupportedError,
    ErrorCode.INTERNAL: RemoteHandlerError,
    ErrorCode.TOO_LARGE: RemoteFrameTooLargeError,
}


def _remote_error(code: ErrorCode, what: str) -> RemoteError:
    return _REMOTE_ERRORS.get(code, RemoteError)(f"the peer refused {what} with {code.name}")
