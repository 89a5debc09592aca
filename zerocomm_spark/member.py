"""The agent a notebook (or a service) holds: identities, connections and DIDComm messaging in one object.

How the pieces fit:

* One sealed keystore per identity directory holds every key pair and record, so ``Agent.open`` on
  the same directory after a restart knows the same peers; the bound endpoint is persisted too and
  rebound, because peers stored it inside our DIDs.
* Every DIDComm message to a peer is an RFC 0019 envelope (authcrypt from our relationship key;
  the DID-exchange request is authcrypted from our new key to the invitation key) sent as an RPC on
  ``ProtocolId.DIDCOMM``. The RPC answer is a small JSON *receipt* saying whether the peer's agent
  accepted the message, so ``send`` returns only once the message arrived, and refusals (replay,
  unknown type, not for me) come back as the matching ZeroComm error instead of a timeout.
* Replies that are protocol messages (DID-exchange response, disclose, ping response) travel back as
  their own RPCs from an outbox thread, never from inside the handler, so two agents answering each
  other cannot deadlock their worker pools.
* Inbound handling never raises into the transport: whatever arrives is turned into a receipt and a
  log line naming the error class, never the payload or a key.
* Other protocols plug in with ``register_protocol`` (handlers that may answer) and ``request``
  (send and wait for the threaded answer); the group manager, ``agent.groups``, is built that way.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from zerocomm_spark import errors
from zerocomm_spark.connections import Connection, ConnectionRecord, ConnectionStore
from zerocomm_spark.deadlines import check_timeout
from zerocomm_spark.envelope import pack, unpack
from zerocomm_spark.errors import (
    AgentClosedError,
    ConfigurationError,
    ConnectionNotFoundError,
    ConnectionNotReadyError,
    InboxFullError,
    OwnInvitationError,
    PeerTimeoutError,
    ProtocolError,
    ReceiveTimeoutError,
    ReplayError,
    ZeroCommError,
)
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.basic_message.v1_0.messages import BasicMessage
from zerocomm_spark.protocols.did_exchange.v1_0.manager import DIDExchangeManager
from zerocomm_spark.protocols.did_exchange.v1_0.messages import (
    DIDXComplete,
    DIDXProblemReport,
    DIDXRequest,
    DIDXResponse,
)
from zerocomm_spark.protocols.discover_features.v1_0.manager import DiscoverFeaturesManager
from zerocomm_spark.protocols.discover_features.v1_0.messages import Disclose, Query
from zerocomm_spark.protocols.message import (
    MAX_TYPE_LENGTH,
    AgentMessage,
    ProtocolDescriptor,
    Thread,
    major_type,
    normalize_type,
    parse_message,
    utc_now,
)
from zerocomm_spark.protocols.out_of_band.v1_1.manager import OutOfBandManager
from zerocomm_spark.protocols.out_of_band.v1_1.messages import Invitation
from zerocomm_spark.protocols.trust_ping.v1_0.messages import Ping, PingResponse
from zerocomm_spark.seen_messages import SeenMessages
from zerocomm_spark.transport.frames import ProtocolId
from zerocomm_spark.transport.peer import DEFAULT_MAX_FRAME_BYTES, MAX_TIMEOUT, PeerInfo, PeerTransport, connectable

if TYPE_CHECKING:
    from zerocomm_spark.group.manager import GroupConfig, GroupManager

__all__ = ["Agent", "Connection", "ProtocolHandler", "ReceivedMessage", "DEFAULT_ENDPOINT"]

# A protocol handler gets the message and the (completed, authenticated) connection it came on;
# what it returns, if anything, is sent back to that peer from the outbox.
ProtocolHandler = Callable[[Any, ConnectionRecord], AgentMessage | None]

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"
SETTINGS_KIND = "agent"
SETTINGS_ID = "settings"
OUTBOX_TIMEOUT = 5.0  # replies sent from the outbox; bounds how long close() can wait for them
MAX_HISTORY = 10_000
MAX_HISTORY_CHARS = 64 * 1024 * 1024  # messages() keeps the newest within this many content characters too
# Basic messages waiting for receive(): past either bound a new one is refused (InboxFullError, in the
# sender's receipt), never dropped. A peer's messages are up to a frame (16 MiB) each.
MAX_INBOX = 10_000
MAX_INBOX_CHARS = 256 * 1024 * 1024
MAX_SEEN = 50_000
# Requests given up on (their deadline passed) whose answer may still come: remembered this long, this
# many, so a late answer is dropped quietly instead of refused (the peer logged the refusal as a warning).
LATE_ANSWER_S = 300.0
MAX_LATE = 1024
_DETAIL_LIMIT = 500
_INVITATION_USED_HINT = ("Ask the inviter for a fresh invitation URL (or a multi-use one); "
                         "this one cannot be accepted again")

# A receipt may name only errors a peer can legitimately report about our message; anything else
# (a keystore failure on their side, say) is reported as a plain ProtocolError.
_REMOTE_ERROR_ROOTS = (errors.ProtocolError, errors.EnvelopeError, errors.DIDError, errors.SignatureError,
                       errors.AgentClosedError)


@dataclass(frozen=True)
class ReceivedMessage:
    """A basic message a peer sent us."""

    id: str
    connection_id: str
    label: str | None
    their_did: str | None
    content: str
    sent_time: str
    received_time: str = field(default_factory=utc_now)

    def __repr__(self) -> str:  # their DID is long; who and what is what a reader wants
        return f"ReceivedMessage(label={self.label!r}, content={self.content!r}, sent_time={self.sent_time!r})"


@dataclass(frozen=True)
class _Inbound:
    recipient_verkey: str
    sender_verkey: str | None
    connection: ConnectionRecord | None


_CLOSED = object()


def _reason(exc: ZeroCommError) -> str:
    """The message without its hint: receipts carry it, the receiving side adds its own hint."""
    text = str(exc)
    return text.removesuffix(f". {exc.hint}") if exc.hint else text


def _receipt_ok() -> bytes:
    return b'{"ok":true}'


#: Errors about the peer's message itself: their text goes back in the receipt. Anything else is
#: this member's own trouble (its keystore, journal, configuration, a local path in the text) and
#: stays in its log; the peer learns only that handling failed here.
_PEER_FACING = (errors.DIDError, errors.SignatureError, errors.EnvelopeError, ProtocolError, errors.GroupError)


def _receipt_error(exc: BaseException) -> bytes:
    if isinstance(exc, _PEER_FACING):
        name, detail = type(exc).__name__, _reason(exc)
    else:
        name, detail = "RemoteHandlerError", "the agent failed while handling the message"
    return json.dumps({"ok": False, "error": name, "detail": detail[:_DETAIL_LIMIT]}).encode("utf-8")


def _raise_for_receipt(reply: bytes) -> None:
    try:
        receipt = json.loads(reply)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: "[[[[..." from a hostile peer
        receipt = None
    if not isinstance(receipt, dict) or not isinstance(receipt.get("ok"), bool):
        raise ProtocolError("the peer answered with something that is not a ZeroComm receipt")
    if receipt["ok"]:
        return
    name, detail = receipt.get("error"), receipt.get("detail")
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, _REMOTE_ERROR_ROOTS)):
        cls = errors.RemoteHandlerError if name == "RemoteHandlerError" else ProtocolError
    text = detail[:_DETAIL_LIMIT] if isinstance(detail, str) else "no detail"
    raise cls(f"the peer refused the message: {text}")


def _host(endpoint: str) -> str:
    try:
        return urlsplit(endpoint).hostname or ""
    except ValueError:
        return ""


class Agent:
    """A DIDComm agent on a ZeroMQ endpoint; open one per identity directory with ``Agent.open``."""

    def __init__(self, keystore: Keystore, transport: PeerTransport, label: str, path: Path,
                 endpoint: str | None = None, group_config: "GroupConfig | None" = None,
                 prepare_groups: "Callable[[Agent, GroupManager], None] | None" = None, inbox: bool = True) -> None:
        """Use :meth:`Agent.open`; this wires already opened parts together."""
        self._keystore = keystore
        self._transport = transport
        self._label = label
        self._path = path
        self._endpoint = endpoint or transport.endpoint
        self._lock = threading.RLock()
        self._closed = False
        self._store = ConnectionStore(keystore)
        self._oob = OutOfBandManager(keystore, self._endpoint, label)
        self._didx = DIDExchangeManager(keystore, self._store, self._oob, endpoint=self._endpoint, label=label)
        self._features = DiscoverFeaturesManager()
        # (kind, thread id, connection id the answer must come on; None for the DID exchange, whose
        # response the exchange manager ties to our request by its recipient key) -> the waiter
        self._waiters: dict[tuple[str, str, str | None], Future[Any]] = {}
        self._given_up: OrderedDict[tuple[str, str, str | None], float] = OrderedDict()  # -> when (monotonic)
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._inbox_enabled = inbox
        self._inbox_count = 0  # basic messages queued for receive(), and their content characters
        self._inbox_chars = 0
        self._history: deque[ReceivedMessage] = deque()
        self._history_chars = 0
        self._seen = SeenMessages.open(keystore.directory, keystore, MAX_SEEN)  # replay protection
        self._outbox = ThreadPoolExecutor(max_workers=4, thread_name_prefix="zerocomm-outbox")
        self._protocol_types: dict[str, type[AgentMessage]] = {}  # @type -> class, of register_protocol()
        # (protocol, major version, name) -> class: another minor version of those is the same message (RFC 0003)
        self._protocol_majors: dict[tuple[str, str, str], type[AgentMessage]] = {}
        self._groups: GroupManager | None = None
        self._group_config = group_config
        self._prepare_groups = prepare_groups
        self._groups_lock = threading.Lock()
        self._handlers: dict[type[AgentMessage], Callable[[Any, _Inbound], None]] = {
            DIDXRequest: self._on_request,
            DIDXResponse: self._on_response,
            DIDXComplete: self._on_complete,
            DIDXProblemReport: self._on_problem_report,
            BasicMessage: self._on_basic_message,
            Ping: self._on_ping,
            PingResponse: self._on_ping_response,
            Query: self._on_query,
            Disclose: self._on_disclose,
            Invitation: self._on_invitation,
        }

    # --- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, label: str | None = None, endpoint: str = DEFAULT_ENDPOINT,
             passphrase: str | bytes | None = None, advertise: str | None = None,
             max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, workers: int = 4,
             group_config: "GroupConfig | None" = None,
             prepare_groups: "Callable[[Agent, GroupManager], None] | None" = None,
             inbox: bool = True) -> "Agent":
        """Open (or create) the agent of an identity directory and start serving its endpoint.

        On a restart with a wildcard ``endpoint`` (the default) the port bound last time is bound
        again, because peers know us by DIDs that contain it. ``advertise`` is the address peers
        dial when it differs from the bound one (binding ``tcp://0.0.0.0:*`` on a cluster node).
        ``group_config`` tunes ``agent.groups``; an identity with groups rejoins them here.
        ``prepare_groups(agent, manager)`` runs once, before the group manager starts (and so before
        its first delivery): the place to register a durable ``on_messages`` consumer. ``inbox=False``
        is for an owner that reads basic messages with :meth:`messages` only (the agent process): none
        is then kept for :meth:`receive`, which would otherwise hold them until received.
        """
        directory = Path(path).expanduser().absolute()
        if label is not None and (not isinstance(label, str) or not label.strip()):
            raise ConfigurationError("label must be a non-empty string")
        # Checked as every peer checks it in our member entries: one they refuse fails every join remotely.
        if advertise is not None and (not connectable(advertise) or "*" in advertise):
            raise ConfigurationError(f"advertise must be a concrete endpoint like tcp://host:port, got {advertise!r}",
                                     hint="Use tcp://HOST:PORT with a name or address peers can reach; bracket an "
                                          "IPv6 address: tcp://[2001:db8::1]:7000")
        keystore = Keystore.open(directory, passphrase)
        transport: PeerTransport | None = None
        try:
            settings = keystore.get_record(SETTINGS_KIND, SETTINGS_ID) or {}
            saved = settings.get("endpoint") if isinstance(settings.get("endpoint"), str) else None
            rebind = saved is not None and "*" in endpoint and _host(saved) == _host(endpoint)
            bind = saved if saved is not None and rebind else endpoint
            if saved is not None and not rebind and bind != saved:
                log.warning("binding %s instead of %s: peers connected before cannot reach this agent "
                            "until they reconnect", bind, saved)
            transport = PeerTransport(bind, max_frame_bytes=max_frame_bytes, workers=workers)
            try:
                transport.start()
            except ConfigurationError as exc:
                if not rebind:
                    raise ConfigurationError(
                        exc.message, hint="Free that address, or bind another: peer.endpoint (--endpoint, "
                                          "ZEROCOMM_PEER_ENDPOINT; endpoint= in Python); port * picks a free one, "
                                          "as in tcp://127.0.0.1:*") from None
                raise ConfigurationError(
                    f"cannot bind {saved} again, the endpoint this agent's peers know it by (is the port "
                    "taken?)", hint="Free it (another process holds it), or bind another with peer.endpoint "
                                    "(--endpoint; endpoint= in Python) and reconnect with new invitations"
                ) from None
            if advertise is None and rebind and isinstance(settings.get("advertise"), str):
                advertise = settings["advertise"]
            public = advertise or transport.endpoint
            the_label = label or settings.get("label") or directory.name
            wanted = {"label": the_label, "endpoint": transport.endpoint, "advertise": public}
            if settings != wanted:
                keystore.put_record(SETTINGS_KIND, SETTINGS_ID, wanted)
            agent = cls(keystore, transport, the_label, directory, public, group_config, prepare_groups, inbox)
            transport.register(ProtocolId.DIDCOMM, rpc=agent._on_rpc, direct=agent._on_direct)
        except BaseException:
            if transport is not None:
                transport.close(timeout=2.0)
            keystore.close()
            raise
        try:
            from zerocomm_spark.group.store import GroupStore

            if GroupStore(keystore).groups():  # a restarted member rejoins its groups with its identity
                agent.groups  # noqa: B018 - starts the group manager
        except BaseException:
            agent.close()
            raise
        log.info("agent %r serving %s with %d connection(s)", agent._label, agent._endpoint, len(agent._store))
        return agent

    def close(self) -> None:
        """Stop serving and release the identity directory; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiters = list(self._waiters.values())
            self._waiters.clear()
        for future in waiters:
            _resolve(future, error=AgentClosedError("the agent was closed while waiting"))
        with self._groups_lock:
            groups, self._groups = self._groups, None
        if groups is not None:
            try:
                groups.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                log.exception("closing the group manager failed")
        self._inbox.put(_CLOSED)
        self._outbox.shutdown(wait=True, cancel_futures=True)
        self._transport.close(timeout=5.0)
        self._seen.close()
        self._keystore.close()
        log.info("agent %r closed", self._label)

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def label(self) -> str:
        return self._label

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint peers dial (it is inside our invitations and DIDs)."""
        return self._endpoint

    @property
    def path(self) -> Path:
        return self._path

    def transport_stats(self) -> dict[str, int]:
        """The peer transport's counters (``PeerTransport.stats``), for the agent's ``metrics``: DIDComm
        and the data plane's acks, resends and keepalives travel on it, so its timeouts and drops are
        where a slow or lossy peer shows first."""
        return self._transport.stats()

    @property
    def keystore(self) -> Keystore:
        """The identity's sealed keystore, for components of this process (the journal key lives there)."""
        return self._keystore

    @property
    def groups(self) -> "GroupManager":
        """ZeroComm groups of this agent (created on first use, closed with the agent)."""
        self._check_open()
        with self._groups_lock:
            if self._groups is None:
                from zerocomm_spark.group.manager import GroupManager

                manager = GroupManager(self, keystore=self._keystore, transport=self._transport,
                                       connections=self._store, config=self._group_config)
                if self._prepare_groups is not None:
                    self._prepare_groups(self, manager)
                manager.start()
                self._groups = manager
            return self._groups

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._store)} connection(s)"
        return f"Agent(label={self._label!r}, endpoint={self._endpoint!r}, {state})"

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosedError(f"the agent {self._label!r} is closed")

    # --- connections ----------------------------------------------------------------------------

    def invite(self, label: str | None = None, *, goal_code: str | None = None, goal: str | None = None,
               multi_use: bool = False) -> str:
        """An RFC 0434 invitation URL with a fresh key; single-use unless ``multi_use``."""
        self._check_open()
        invitation, _ = self._oob.create_invitation(label=label, goal_code=goal_code, goal=goal,
                                                    multi_use=multi_use)
        return invitation.to_url()

    def accept(self, url: str, timeout: float = 10.0, *, label: str | None = None) -> Connection:
        """Run the DID exchange for an invitation URL to completion (request, response, complete)."""
        self._check_open()
        deadline = _deadline(timeout)
        received = OutOfBandManager.parse_url(url)
        if self._keystore.find(received.recipient_key) is not None:
            # The inviter's own URL pasted into its own terminal made a connection to itself, silently.
            raise OwnInvitationError(f"this invitation was made by this member ({self._label!r}) itself")
        record, request, key = self._didx.create_request(received, label=label or self._label)
        waiter = self._waiter("didx", request.id)
        try:
            envelope = pack(request.to_dict(), [received.recipient_key], sender=key)
            try:
                self._deliver(received.endpoint, envelope, _remaining(deadline, "the DID-exchange request"))
            except ReplayError as exc:
                # The request is new (new thread, new key): what it repeats is the use of the invitation,
                # so "the duplicate was ignored" would be the wrong advice.
                raise ReplayError(_reason(exc), hint=_INVITATION_USED_HINT) from None
            record = self._await(waiter, deadline, "the DID-exchange response")
            complete = self._didx.create_complete(record)
            self._deliver_to(record, complete, _remaining(deadline, "the DID-exchange complete"))
            record = self._didx.mark_completed(record)
        except BaseException as exc:
            current = self._store.find(record.connection_id) if not self._keystore.closed else None
            if current is not None and current.state not in ("completed", "abandoned"):
                self._didx.abandon(current, f"{type(exc).__name__} during the exchange")
            raise
        finally:
            self._drop_waiter("didx", request.id)
        log.info("connection %s completed (requester)", record.connection_id)
        return record.view()

    def connections(self, *, include_incomplete: bool = False) -> list[Connection]:
        """Our connections, oldest first; completed ones unless ``include_incomplete``."""
        self._check_open()
        return [r.view() for r in self._store.all() if include_incomplete or r.completed]

    def connection(self, peer: str | Connection) -> Connection:
        """The connection ``peer`` names: a connection id, their DID or their label."""
        self._check_open()
        return self._resolve(peer, require_completed=False).view()

    def _resolve(self, peer: str | Connection, *, require_completed: bool = True) -> ConnectionRecord:
        if isinstance(peer, Connection):
            peer = peer.id
        if not isinstance(peer, str) or not peer:
            raise ConnectionNotFoundError("a peer is named by a connection id, their DID or their label")
        record = self._store.find(peer) or self._store.by_their_did(peer)
        if record is None:
            named = self._store.by_label(peer)
            usable = [r for r in named if r.completed] or named
            if len(usable) > 1:
                raise ConnectionNotFoundError(
                    f"{len(usable)} connections are labelled {peer!r}; name one by its id: "
                    + ", ".join(r.connection_id for r in usable),
                    hint="Name the connection by its id or their DID (agent.connections(), or `zerocomm "
                         "connections`, lists each with its label and when it was made)")
            record = usable[0] if usable else None
        if record is None:
            raise ConnectionNotFoundError(f"no connection with the id, DID or label {peer!r}")
        if require_completed and not record.completed:
            raise ConnectionNotReadyError(f"connection {record.connection_id} is {record.state}")
        return record

    # --- messaging ------------------------------------------------------------------------------

    def send(self, peer: str | Connection, message: str, timeout: float = 10.0) -> str:
        """Send a basic message; returns its id once the peer's agent confirmed it arrived."""
        self._check_open()
        if not isinstance(message, str):
            raise ConfigurationError(f"a basic message is a str, got {type(message).__name__}")
        record = self._resolve(peer)
        outgoing = BasicMessage(content=message)
        self._deliver_to(record, outgoing, timeout)
        return outgoing.id

    def messages(self, peer: str | Connection | None = None) -> list[ReceivedMessage]:
        """Every basic message received since open (oldest first), optionally from one peer."""
        self._check_open()
        with self._lock:
            history = list(self._history)
        if peer is None:
            return history
        connection_id = self._resolve(peer, require_completed=False).connection_id
        return [m for m in history if m.connection_id == connection_id]

    def receive(self, timeout: float | None = 10.0) -> ReceivedMessage:
        """The next basic message not yet received; waits up to ``timeout`` seconds (None: forever)."""
        self._check_open()
        if not self._inbox_enabled:
            raise ConfigurationError("this agent keeps no inbox for receive() (opened with inbox=False)",
                                     hint="Read its basic messages with agent.messages()")
        if timeout is not None:
            if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0:
                raise ConfigurationError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
            if timeout > MAX_TIMEOUT:  # as long as forever (queue.get overflows on inf): None; close() still wakes it
                timeout = None
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise ReceiveTimeoutError(f"no message within {timeout:g}s") from None
        if item is _CLOSED:
            self._inbox.put(_CLOSED)  # wake any other waiting reader too
            raise AgentClosedError("the agent was closed while waiting for a message")
        message: ReceivedMessage = item
        with self._lock:
            self._inbox_count -= 1
            self._inbox_chars -= len(message.content)
        return message

    def discover(self, peer: str | Connection, query: str = "*", timeout: float = 10.0) -> list[ProtocolDescriptor]:
        """The protocols (and roles) the peer speaks that match ``query`` (``*`` wildcards)."""
        self._check_open()
        deadline = _deadline(timeout)
        record = self._resolve(peer)
        request = self._features.create_query(query)
        waiter = self._waiter("discover", request.id, record.connection_id)
        try:
            self._deliver_to(record, request, _remaining(deadline, "the discover-features query"))
            protocols: list[ProtocolDescriptor] = self._await(waiter, deadline, "the discover-features answer")
            return protocols
        finally:
            self._drop_waiter("discover", request.id, record.connection_id)

    def ping(self, peer: str | Connection, timeout: float = 10.0) -> float:
        """Round-trip seconds of an RFC 0048 trust ping: proves both agents and their keys work."""
        self._check_open()
        deadline = _deadline(timeout)
        record = self._resolve(peer)
        request = Ping(response_requested=True)
        waiter = self._waiter("ping", request.id, record.connection_id)
        started = time.monotonic()
        try:
            self._deliver_to(record, request, _remaining(deadline, "the trust ping"))
            self._await(waiter, deadline, "the trust ping response")
            return time.monotonic() - started
        finally:
            self._drop_waiter("ping", request.id, record.connection_id)

    # --- extension point: other DIDComm protocols ------------------------------------------------

    def register_protocol(self, descriptor: ProtocolDescriptor,
                          handlers: dict[type[AgentMessage], ProtocolHandler],
                          replies: tuple[type[AgentMessage], ...] = ()) -> None:
        """Serve another protocol on this agent's connections.

        ``handlers`` answer requests: each gets the message and its connection (completed, and the
        envelope authcrypted by that peer) and may return a reply, which is sent from the outbox so
        a handler never blocks on another peer. Messages of a ``replies`` type settle the pending
        :meth:`request` they are threaded to. The protocol is disclosed by discover-features.
        """
        self._check_open()
        with self._lock:
            for message_type, handler in handlers.items():
                self._handlers[message_type] = self._protocol_handler(handler)
                self._add_protocol_type(message_type)
            for message_type in replies:
                self._handlers[message_type] = self._on_reply
                self._add_protocol_type(message_type)
            protocols = [p for p in self._features.protocols if p.pid != descriptor.pid]
            self._features = DiscoverFeaturesManager([*protocols, descriptor])

    def _add_protocol_type(self, message_type: type[AgentMessage]) -> None:
        self._protocol_types[message_type.message_type] = message_type
        parts = major_type(message_type.message_type)
        if parts is not None:
            self._protocol_majors[parts] = message_type

    def _protocol_handler(self, handler: ProtocolHandler) -> Callable[[Any, _Inbound], None]:
        def run(message: AgentMessage, context: _Inbound) -> None:
            record = self._connected(context)
            reply = handler(message, record)
            if reply is not None:
                self._post_to(record, reply, f"a {type(reply).__name__}")

        return run

    def request(self, peer: str | Connection, message: AgentMessage, timeout: float = 10.0) -> AgentMessage:
        """Send ``message`` and return the peer's answer: the reply-type message threaded to it.

        Raises the peer's refusal (from its receipt) or PeerTimeoutError at the deadline.
        """
        self._check_open()
        deadline = _deadline(timeout)
        record = self._resolve(peer)
        waiter = self._waiter("request", message.id, record.connection_id)
        try:
            self._deliver_to(record, message, _remaining(deadline, f"the {type(message).__name__}"))
            answer: AgentMessage = self._await(waiter, deadline, f"answer to the {type(message).__name__}")
            return answer
        finally:
            self._drop_waiter("request", message.id, record.connection_id)

    def deliver(self, peer: str | Connection, message: AgentMessage, timeout: float = 10.0) -> None:
        """Send a protocol message; returns once the peer's agent handled it without error."""
        self._check_open()
        self._deliver_to(self._resolve(peer), message, timeout)

    def _on_reply(self, message: AgentMessage, context: _Inbound) -> None:
        record = self._connected(context)
        if not self._settle("request", message.thid, message, connection_id=record.connection_id):
            if self._late("request", message.thid, record.connection_id):
                log.debug("a %s came after its request's deadline: dropped", type(message).__name__)
                return
            raise ProtocolError(f"the {type(message).__name__} answers no request of ours on this connection")

    # --- outbound plumbing ----------------------------------------------------------------------

    def _pack_for(self, record: ConnectionRecord, message: AgentMessage) -> tuple[str, bytes]:
        """(their endpoint, the message authcrypted from our key for this relationship to theirs)."""
        if record.their_verkey is None or record.my_verkey is None or record.their_endpoint is None:
            raise ConnectionNotReadyError(f"connection {record.connection_id} has no keys or endpoint yet")
        envelope = pack(message.to_dict(), [record.their_verkey], sender=self._keystore.get(record.my_verkey))
        return record.their_endpoint, envelope

    def _deliver_to(self, record: ConnectionRecord, message: AgentMessage, timeout: float) -> None:
        self._deliver(*self._pack_for(record, message), timeout)

    def _post_to(self, record: ConnectionRecord, message: AgentMessage, what: str,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        endpoint, envelope = self._pack_for(record, message)
        self._post(endpoint, envelope, what, on_error)

    def _deliver(self, endpoint: str, envelope: bytes, timeout: float) -> None:
        """RPC the envelope and raise the peer's refusal as the matching error."""
        reply = self._transport.request(endpoint, ProtocolId.DIDCOMM, envelope, timeout=timeout)
        _raise_for_receipt(reply)

    def _post(self, endpoint: str, envelope: bytes, what: str,
              on_error: Callable[[BaseException], None] | None = None) -> None:
        """Deliver without waiting: handlers must not block a transport worker on another peer.

        Nothing waits on the answer either (it was a thread per message: a few peers that never
        answer kept the outbox's threads busy for OUTBOX_TIMEOUT each, and every reply of this
        agent queued behind them); only a failure is handed to the outbox's threads, for on_error.
        """

        def failed(exc: BaseException) -> None:
            log.warning("delivering %s failed: %s", what, type(exc).__name__)
            if on_error is not None:
                try:
                    on_error(exc)
                except Exception:  # noqa: BLE001
                    log.exception("cleanup after a failed delivery of %s failed", what)

        def report(error: BaseException) -> None:  # on the outbox's threads, never the caller's or the IO thread
            try:
                self._outbox.submit(failed, error)
            except RuntimeError:  # the agent is closing
                log.info("dropped the failure report of %s: the agent is closing", what)

        def check(reply: bytes) -> None:  # on the outbox's threads: the receipt is the peer's JSON
            try:
                _raise_for_receipt(reply)
            except Exception as exc:  # noqa: BLE001 - reported through the log and on_error
                failed(exc)

        def settle(future: Future[bytes]) -> None:  # runs in the transport's IO thread: no parsing here
            if future.cancelled():  # the transport is closing
                return
            error = future.exception()
            if error is not None:
                report(error)
                return
            try:
                self._outbox.submit(check, future.result())
            except RuntimeError:  # the agent is closing
                pass

        try:
            future = self._transport.request_async(endpoint, ProtocolId.DIDCOMM, envelope, timeout=OUTBOX_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a refused endpoint or a closed transport
            report(exc)
            return
        future.add_done_callback(settle)

    def _waiter(self, kind: str, thid: str, connection_id: str | None = None) -> Future[Any]:
        """A waiter for the answer threaded to ``thid``; with ``connection_id``, only an answer that
        came on that connection settles it (a thread id is no secret: any peer may learn or pick one)."""
        future: Future[Any] = Future()
        with self._lock:
            self._check_open()
            self._waiters[(kind, thid, connection_id)] = future
        return future

    def _drop_waiter(self, kind: str, thid: str, connection_id: str | None = None) -> None:
        key = (kind, thid, connection_id)
        with self._lock:
            future = self._waiters.pop(key, None)
            if future is not None and not future.done():  # given up on: its answer may still come
                now = time.monotonic()
                self._given_up[key] = now
                while self._given_up and (len(self._given_up) > MAX_LATE
                                          or next(iter(self._given_up.values())) < now - LATE_ANSWER_S):
                    self._given_up.popitem(last=False)

    def _late(self, kind: str, thid: str | None, connection_id: str | None) -> bool:
        """Whether ``thid`` names a request of ours given up on lately (on that connection)."""
        with self._lock:
            when = self._given_up.pop((kind, thid or "", connection_id), None)
        return when is not None and time.monotonic() - when < LATE_ANSWER_S

    def _settle(self, kind: str, thid: str, value: Any = None, error: BaseException | None = None, *,
                connection_id: str | None = None) -> bool:
        with self._lock:
            future = self._waiters.get((kind, thid, connection_id))
        return future is not None and _resolve(future, value, error)

    @staticmethod
    def _await(future: Future[Any], deadline: float, what: str) -> Any:
        try:
            return future.result(timeout=_remaining(deadline, what))
        except FutureTimeoutError:
            raise PeerTimeoutError(f"no {what} before the deadline") from None

    # --- inbound --------------------------------------------------------------------------------

    def _on_rpc(self, payload: bytes, peer: PeerInfo) -> bytes:
        try:
            self._handle(payload)
        except Exception as exc:  # noqa: BLE001 - bad input never stops the agent
            self._log_refusal(exc)
            return _receipt_error(exc)
        return _receipt_ok()

    def _on_direct(self, payload: bytes, peer: PeerInfo) -> None:
        try:
            self._handle(payload)
        except Exception as exc:  # noqa: BLE001
            self._log_refusal(exc)

    @staticmethod
    def _log_refusal(exc: BaseException) -> None:
        if isinstance(exc, ZeroCommError):
            log.info("refused an inbound message: %s", type(exc).__name__)
        else:
            log.error("failed on an inbound message: %s", type(exc).__name__, exc_info=exc)

    def _handle(self, payload: bytes) -> None:
        if self._closed:
            raise AgentClosedError("the agent is closing")
        unpacked = unpack(payload, self._keystore.find)
        message = self._parse(unpacked.json())
        if message.timing is not None and message.timing.expired():
            raise ProtocolError("the message expired (~timing.expires_time is past)")
        handler = self._handlers.get(type(message))
        if handler is None:
            raise errors.UnknownMessageTypeError(f"no handler for {message.message_type}")
        seen = self._seen.digest(unpacked.sender_verkey or unpacked.recipient_verkey, message.id)
        if not self._seen.claim(seen):  # also after a restart: handled messages are kept on disk
            raise ReplayError(f"message {message.id} was already received")
        context = _Inbound(unpacked.recipient_verkey, unpacked.sender_verkey,
                           self._store.by_my_verkey(unpacked.recipient_verkey))
        try:
            handler(message, context)
        except BaseException:
            self._seen.release(seen)  # not processed: a corrected resend with the same id must get through
            raise
        self._seen.handled(seen)
        log.debug("handled %s", message.message_type)

    def _parse(self, data: Any) -> AgentMessage:
        """Core protocols from the global registry; those added by register_protocol from this agent's table."""
        kind = data.get("@type") if isinstance(data, dict) else None
        registered = None
        if isinstance(kind, str):
            registered = self._protocol_types.get(normalize_type(kind))
            if registered is None and len(kind) <= MAX_TYPE_LENGTH:  # another minor version: ours too (RFC 0003)
                parts = major_type(kind)
                registered = self._protocol_majors.get(parts) if parts is not None else None
        return registered.from_dict(data) if registered is not None else parse_message(data)

    def _connected(self, context: _Inbound) -> ConnectionRecord:
        """The connection the message arrived on, authenticated by the envelope's sender key."""
        record = context.connection
        if record is None:
            raise ConnectionNotFoundError("the message arrived on no connection of ours")
        if context.sender_verkey is None or context.sender_verkey != record.their_verkey:
            raise ProtocolError("the message was not authcrypted by the connection's peer")
        if record.state == "response-sent":
            # Their first message on the connection proves our response arrived: implied complete.
            record = self._didx.mark_completed(record)
        if not record.completed:
            raise ConnectionNotReadyError(f"connection {record.connection_id} is {record.state}")
        return record

    def _on_request(self, request: DIDXRequest, context: _Inbound) -> None:
        record, response, _ = self._didx.receive_request(request, recipient_verkey=context.recipient_verkey,
                                                         sender_verkey=context.sender_verkey)

        def abandon(exc: BaseException) -> None:
            current = self._store.find(record.connection_id)
            if current is not None and current.state == "response-sent":
                self._didx.abandon(current, f"response not delivered: {type(exc).__name__}")

        self._post_to(record, response, "a DID-exchange response", on_error=abandon)

    def _on_response(self, response: DIDXResponse, context: _Inbound) -> None:
        try:
            record = self._didx.receive_response(response, recipient_verkey=context.recipient_verkey,
                                                 sender_verkey=context.sender_verkey)
        except ReplayError:
            raise
        except ZeroCommError as exc:
            self._settle("didx", response.thid, error=exc)
            raise
        self._settle("didx", response.thid, record)

    def _on_complete(self, complete: DIDXComplete, context: _Inbound) -> None:
        record = self._didx.receive_complete(complete, recipient_verkey=context.recipient_verkey,
                                             sender_verkey=context.sender_verkey)
        log.info("connection %s completed (responder)", record.connection_id)

    def _on_problem_report(self, report: DIDXProblemReport, context: _Inbound) -> None:
        _, error = self._didx.receive_problem_report(report, recipient_verkey=context.recipient_verkey,
                                                     sender_verkey=context.sender_verkey)
        self._settle("didx", report.thid, error=error)

    def _on_basic_message(self, message: BasicMessage, context: _Inbound) -> None:
        record = self._connected(context)
        received = ReceivedMessage(id=message.id, connection_id=record.connection_id, label=record.their_label,
                                   their_did=record.their_did, content=message.content,
                                   sent_time=message.sent_time)
        size = len(received.content)
        with self._lock:
            if self._inbox_enabled:
                if self._inbox_count >= MAX_INBOX or (self._inbox_count and self._inbox_chars + size > MAX_INBOX_CHARS):
                    raise InboxFullError(f"{self._inbox_count} basic messages wait to be received here; "
                                         "this one was not taken")
                self._inbox_count += 1
                self._inbox_chars += size
                self._inbox.put(received)
            history = self._history
            history.append(received)
            self._history_chars += size
            while len(history) > 1 and (len(history) > MAX_HISTORY or self._history_chars > MAX_HISTORY_CHARS):
                self._history_chars -= len(history.popleft().content)

    def _on_ping(self, ping: Ping, context: _Inbound) -> None:
        record = self._connected(context)
        if ping.response_requested:
            answer = PingResponse(thread=Thread(thid=ping.thid))  # the ping's thread: its @id unless it has one
            self._post_to(record, answer, "a trust-ping response")

    def _on_ping_response(self, response: PingResponse, context: _Inbound) -> None:
        record = self._connected(context)
        if not self._settle("ping", response.thid, True, connection_id=record.connection_id):
            if self._late("ping", response.thid, record.connection_id):
                return  # it came after the ping's deadline
            raise ProtocolError("the ping response answers no ping of ours on this connection")

    def _on_query(self, query: Query, context: _Inbound) -> None:
        record = self._connected(context)
        answer = self._features.disclose(query)
        self._post_to(record, answer, "a discover-features disclose")

    def _on_disclose(self, disclose: Disclose, context: _Inbound) -> None:
        record = self._connected(context)
        if not self._settle("discover", disclose.thid, list(disclose.protocols), connection_id=record.connection_id):
            if self._late("discover", disclose.thid, record.connection_id):
                return  # it came after the query's deadline
            raise ProtocolError("the disclose answers no query of ours on this connection")

    def _on_invitation(self, invitation: Invitation, context: _Inbound) -> None:
        raise ProtocolError("an invitation travels out of band; pass its URL to agent.accept(url)")


def _resolve(future: Future[Any], value: Any = None, error: BaseException | None = None) -> bool:
    """Settle a waiter once; a second answer (duplicate, or close() racing a reply) is dropped."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except InvalidStateError:
        return False
    return True


def _deadline(timeout: float) -> float:
    # Finite and bounded like the transport's own calls: an infinite one would reach the transport.
    return time.monotonic() + check_timeout(timeout)


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerTimeoutError(f"no time left for {what}")
    return left

