"""The agent's local API server: ZeroMQ ROUTERs on a Unix socket (and optionally TCP with CURVE).

Why this shape:

* One IO thread owns every socket (pyzmq sockets are not thread-safe). It parses and validates each
  request (size, JSON header, call name, argument types) and answers bad input at once, so a
  broken client costs the agent nothing and the agent keeps serving.
* Calls run on a bounded worker pool, because some wait for the network (a publish returns once the
  group acknowledged). Workers hand replies back through a queue and an inproc wake-up socket.
  Beyond ``workers + max_pending`` calls in progress, new ones are refused as busy, not queued
  without bound.
* A client that does not read its replies has at most a few (``_REPLY_HWM``) kept for it; further
  ones are dropped, so its unread answers cannot fill the agent's memory.
* Two size limits: ``max_request_bytes`` (a clear RequestTooLargeError reply) and ZeroMQ's
  MAXMSGSIZE at several times that, past which a frame is dropped unread instead of being buffered.
  A call that reads an Arrow bulk frame bounds what its compressed batches may decompress to (4x
  ``max_request_bytes``, checked before anything is decompressed: zerocomm_spark/ipc_limits.py).
* The Unix socket's directory is mode 700: only the agent's user can reach it. TCP is served only
  with CURVE, and a ZAP authenticator admits only the client keys listed in the configuration.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import stat
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85

from zerocomm_spark.agent.logging import event
from zerocomm_spark.agent.runfiles import still_at
from zerocomm_spark.client import (
    PROTOCOL_VERSION,
    SOCKET_NAME,
    decode_header,
    encode_header,
    error_header,
    ipc_endpoint,
)
from zerocomm_spark.deadlines import LISTENER_HANDSHAKE_MS
from zerocomm_spark.errors import (
    AgentBusyError,
    AgentNotRunningError,
    BadRequestError,
    ConfigurationError,
    InsecurePermissionsError,
    RequestTooLargeError,
    UnknownCallError,
    ZeroCommError,
)
from zerocomm_spark.text import is_utf8_text

__all__ = ["ApiServer", "Call", "CallRegistry", "Param", "Request", "prepare_socket_dir"]

log = logging.getLogger(__name__)

MAX_TIMEOUT = 24 * 3600.0
DEFAULT_CALL_TIMEOUT = 30.0
_HARD_LIMIT_FACTOR = 4
_PROGRESS_INTERVAL = 0.1
_ID_LIMIT = 128
_REPLY_HWM = 16  # replies the agent keeps queued for one client connection that does not read
_ZAP_DOMAIN = "zerocomm-api"

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               list: "a list", dict: "an object"}


@dataclass(frozen=True)
class Param:
    """One argument of a call: its JSON type, whether it is required, and a check of its value."""

    kind: type
    required: bool = False
    default: Any = None
    check: Callable[[Any], str | None] | None = None  # returns what is wrong, or None
    items: type | None = None  # element type of a list

    def validate(self, call: str, name: str, value: Any) -> Any:
        if value is None:
            if self.required:
                raise BadRequestError(f"{call}: the argument {name!r} is required")
            return self.default
        ok = isinstance(value, self.kind) and not (self.kind is not bool and isinstance(value, bool))
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                ok, value = True, float(value)
            except OverflowError:  # JSON takes integers of hundreds of digits; no float holds them
                raise BadRequestError(f"{call}: {name!r} must be a finite number, not an integer of "
                                      f"{value.bit_length()} bits") from None
        if not ok:
            raise BadRequestError(f"{call}: {name!r} must be {_TYPE_NAMES.get(self.kind, self.kind.__name__)}, "
                                  f"not {_json_type(value)}")
        if self.kind is str and not is_utf8_text(value):
            # JSON spells lone surrogates; no UTF-8 holds one, so journal reads (Arrow) and topics raised.
            raise BadRequestError(f"{call}: {name!r} holds a lone surrogate (\\ud800-\\udfff); send UTF-8 text")
        if self.kind is float and not math.isfinite(value):
            # Python's json reads NaN and Infinity: a NaN wait never ends (every comparison is false).
            raise BadRequestError(f"{call}: {name!r} must be a finite number, not {value!r}")
        if self.items is not None:
            for i, item in enumerate(value):
                if not isinstance(item, self.items) or isinstance(item, bool) and self.items is not bool:
                    raise BadRequestError(f"{call}: {name}[{i}] must be {_TYPE_NAMES.get(self.items, 'valid')}, "
                                          f"not {_json_type(item)}")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise BadRequestError(f"{call}: {name!r} {problem}")
        return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)


def non_negative(value: Any) -> str | None:
    return "must be >= 0" if value < 0 else None


def positive(value: Any) -> str | None:
    return "must be > 0" if value <= 0 else None


def non_empty(value: Any) -> str | None:
    return "must not be empty" if not value else None


@dataclass
class Request:
    """One call in progress, as a handler sees it."""

    id: str
    call: str
    args: dict[str, Any] = field(repr=False)  # send's text: a payload, as is the bulk frame's content
    bulk: bytes | None = field(repr=False)
    timeout: float
    started: float = field(default_factory=time.monotonic)
    client: str = ""
    _progress: Callable[[dict[str, Any]], None] | None = None

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def progress(self, **info: Any) -> None:
        """Tell the client how a long call is going (shown as a progress display by the CLI)."""
        if self._progress is not None:
            self._progress(info)


Handler = Callable[..., Any]


@dataclass(frozen=True)
class Call:
    name: str
    handler: Handler
    params: Mapping[str, Param]
    bulk: str = "none"  # none | optional | required
    doc: str = ""
    # Whether a call with these arguments may park (a long poll): it runs on workers of its own, so
    # parked calls never hold the workers every other call needs.
    parks: Callable[[Mapping[str, Any]], bool] | None = None


class CallRegistry:
    """The calls an agent serves, with their argument schemas (checked before a handler runs)."""

    def __init__(self) -> None:
        self._calls: dict[str, Call] = {}

    def add(self, name: str, handler: Handler, params: Mapping[str, Param] | None = None, *,
            bulk: str = "none", doc: str = "", parks: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        self._calls[name] = Call(name, handler, dict(params or {}), bulk, doc, parks)

    def get(self, name: str) -> Call | None:
        return self._calls.get(name)

    def names(self) -> list[str]:
        return sorted(self._calls)

    def parse(self, header: dict[str, Any], bulk: bytes | None) -> tuple[Call, dict[str, Any], float]:
        """The call, its validated arguments and timeout, or BadRequestError naming the problem."""
        version = header.get("v", PROTOCOL_VERSION)
        if version != PROTOCOL_VERSION:
            raise BadRequestError(f"protocol version {version!r} is not served (this agent speaks {PROTOCOL_VERSION})",
                                  hint="Use a client of the same zerocomm-spark version as the agent")
        name = header.get("call")
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"the header's 'call' must be a non-empty string, not {_json_type(name)}")
        call = self._calls.get(name)
        if call is None:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise UnknownCallError(f"unknown call {shown!r}; this agent serves: {', '.join(self.names())}")
        args = header.get("args", {})
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise BadRequestError(f"{name}: 'args' must be an object, not {_json_type(args)}")
        unknown = sorted(set(args) - set(call.params))
        if unknown:
            raise BadRequestError(f"{name}: unknown argument(s) {', '.join(map(repr, unknown))}; "
                                  f"it takes {', '.join(call.params) or 'none'}")
        values = {pname: param.validate(name, pname, args.get(pname)) for pname, param in call.params.items()}
        if call.bulk == "required" and bulk is None:
            raise BadRequestError(f"{name} needs an Arrow IPC frame after the JSON header")
        if call.bulk == "none" and bulk is not None:
            raise BadRequestError(f"{name} takes no bulk frame; send the JSON header alone")
        timeout = header.get("timeout", DEFAULT_CALL_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
            raise BadRequestError(f"'timeout' must be a number of seconds in (0, {MAX_TIMEOUT:g}], not {timeout!r}")
        return call, values, float(timeout)


def prepare_socket_dir(directory: Path) -> None:
    """Create the socket directory mode 700, or refuse one another user could enter."""
    from zerocomm_spark.paths import make_dirs, refuse_shared_directory

    try:
        make_dirs(directory)
        st = directory.lstat()
    except OSError as exc:
        raise ConfigurationError(f"cannot create the API socket directory {directory}: {exc.strerror}",
                                 hint="Set api.socket_dir (--socket-dir) to a directory this user can create, "
                                      "or leave it unset (<identity.dir>/run)") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise InsecurePermissionsError(f"the API socket directory {directory} is not a plain directory")
    if st.st_uid != os.getuid():
        raise InsecurePermissionsError(f"the API socket directory {directory} belongs to uid {st.st_uid}, "
                                       f"not to the agent's user (uid {os.getuid()})")
    refuse_shared_directory(
        "the API socket directory", directory, st, ConfigurationError,
        hint=f"Set api.socket_dir (--socket-dir) to a directory of the agent's own, such as {directory}/zerocomm; "
             "it is created mode 700")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(directory, 0o700)
        log.info("tightened the API socket directory %s to mode 700", directory)


def _client_key(text: str) -> bytes:
    """An api.allowed_clients entry as ZAP compares it, or a ConfigurationError: a malformed entry
    matched no client, and every client was told only that its key was refused."""
    try:
        raw = text.encode("ascii")
        valid = len(raw) == 40 and len(z85.decode(raw)) == 32
    except (UnicodeEncodeError, ValueError, KeyError):
        valid = False
    if not valid:
        shown = text[:8] + ("..." if len(text) > 8 else "")
        raise ConfigurationError(f"the api.allowed_clients entry {shown!r} is not a CURVE public key "
                                 "(40 Z85 characters)",
                                 hint="List the public_key that `zerocomm keygen` printed for each client (never "
                                      "its secret_key), comma-separated in the environment or a flag")
    return raw


_REFUSED_LOG_INTERVAL_S = 10.0  # refused TCP clients: one warning per interval at most


class _Allowed:
    """ZAP credentials provider: only the listed client keys get in.

    Refusals are logged at most once per ``_REFUSED_LOG_INTERVAL_S`` with the count since the last
    warning: anyone who reaches the TCP endpoint can be refused as fast as they can connect, and a
    line each would let them fill the agent's disk.
    """

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys
        self._last_warning = -math.inf
        self._suppressed = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self.keys
        if not allowed:
            with self._lock:
                now = time.monotonic()
                if now - self._last_warning < _REFUSED_LOG_INTERVAL_S:
                    self._suppressed += 1
                    return False
                suppressed, self._suppressed, self._last_warning = self._suppressed, 0, now
            event(log, logging.WARNING, "refused a TCP API client: its CURVE key is not in api.allowed_clients",
                  client_key_prefix=key[:8].decode("ascii", "replace"), refused_since_last_warning=suppressed)
        return allowed


class ApiServer:
    """Serves a CallRegistry on ipc:// (and tcp:// with CURVE); start() binds, close() stops."""

    def __init__(self, registry: CallRegistry, socket_dir: Path, *, tcp_endpoint: str = "",
                 curve_secret: bytes | None = None, allowed_clients: list[str] | None = None,
                 max_request_bytes: int = 64 << 20, workers: int = 16, max_pending: int = 256,
                 on_call: Callable[[str, bool, float], None] | None = None) -> None:
        self.registry = registry
        self.socket_dir = socket_dir
        self.tcp_endpoint_config = tcp_endpoint
        self.max_request_bytes = max_request_bytes
        self.max_pending = max_pending
        self._curve_secret = curve_secret
        self._allowed_config = list(allowed_clients or [])
        self._allowed: set[bytes] = set()
        self._on_call = on_call
        self._ctx = zmq.Context()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._routers: dict[str, zmq.Socket[bytes]] = {}
        self._replies: queue.Queue[tuple[str, list[bytes]]] = queue.Queue()
        self._wake_lock = threading.Lock()
        self._wake_tx: zmq.Socket[bytes] | None = None
        self._wake_addr = f"inproc://zerocomm-api-wake-{uuid.uuid4().hex}"
        self._workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zerocomm-api")
        # Long polls (a read with wait) park for up to their wait: on the same workers, as many of them
        # as there are workers (16 `zerocomm tail`-style followers) left every other call - status,
        # publish, commit - queued behind them until a poll ended. They have workers of their own.
        self._park_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zerocomm-api-poll")
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._draining = False  # close() began: running calls finish, new ones are refused
        self._close_deadline = 0.0
        self._thread: threading.Thread | None = None
        self.ipc_endpoint = ""
        self._ipc_file: tuple[int, int] | None = None  # (device, inode) of the socket file bound
        self.tcp_endpoint = ""
        self.public_key = ""
        self.stats = {"calls": 0, "errors": 0, "refused": 0}

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "ApiServer":
        prepare_socket_dir(self.socket_dir)
        endpoint = ipc_endpoint(self.socket_dir)
        hard_limit = self.max_request_bytes * _HARD_LIMIT_FACTOR + (1 << 20)
        ipc = self._ctx.socket(zmq.ROUTER)
        self._tune(ipc, hard_limit)
        path = self.socket_dir / SOCKET_NAME
        old_umask = os.umask(0o177)  # the socket file is created 600, never briefly open to others
        try:
            ipc.bind(endpoint)
        except zmq.ZMQError as exc:
            ipc.close(linger=0)
            raise ConfigurationError(f"cannot bind the API socket {path}: {exc.strerror}") from None
        finally:
            os.umask(old_umask)
        self._routers["ipc"] = ipc
        try:
            os.chmod(path, 0o600)
            st = path.stat()
            self._ipc_file = (st.st_dev, st.st_ino)
            self.ipc_endpoint = endpoint
            if self.tcp_endpoint_config:
                self._start_tcp(hard_limit)
            wake_rx = self._ctx.socket(zmq.PAIR)
            wake_rx.bind(self._wake_addr)
            self._wake_tx = self._ctx.socket(zmq.PAIR)
            self._wake_tx.connect(self._wake_addr)
            self._thread = threading.Thread(target=self._io_main, args=(wake_rx,), name="zerocomm-api-io",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self._abandon_start()
            raise
        event(log, logging.INFO, "local API serving", endpoint=self.ipc_endpoint, tcp=self.tcp_endpoint or None)
        return self

    def socket_file_present(self) -> bool:
        """Whether the ipc socket file this server bound is still at its path. Removed (a tmp cleaner
        took the socket directory) or replaced, no local client can reach this server any more: ZeroMQ
        keeps listening on the unlinked file and does not notice."""
        return self._ipc_file is None or still_at(self.socket_dir / SOCKET_NAME, self._ipc_file)

    def _abandon_start(self) -> None:
        """Undo a start that failed half-way: no socket file for clients to find stale, no ZAP thread."""
        self._stop.set()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        try:
            (self.socket_dir / SOCKET_NAME).unlink()
        except OSError:
            pass
        self._routers.clear()
        self._wake_tx = None
        self._pool.shutdown(wait=False)
        self._park_pool.shutdown(wait=False)
        self._ctx.destroy(linger=0)

    def _start_tcp(self, hard_limit: int) -> None:
        if self._curve_secret is None:
            raise ConfigurationError("api.tcp_endpoint is set but the agent has no API CURVE key")
        self._allowed = {_client_key(k) for k in self._allowed_config}
        if not self._allowed:
            raise ConfigurationError("api.tcp_endpoint is set but api.allowed_clients is empty, so no client could "
                                     "connect", hint="List the Z85 public keys of remote clients in "
                                                     "api.allowed_clients (make one with `zerocomm keygen`)")
        self._auth = zmq.auth.thread.ThreadAuthenticator(self._ctx, log=logging.getLogger("zmq.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=_ZAP_DOMAIN, credentials_provider=_Allowed(self._allowed))
        tcp = self._ctx.socket(zmq.ROUTER)
        self._tune(tcp, hard_limit)
        tcp.curve_server = True
        tcp.curve_secretkey = self._curve_secret
        tcp.zap_domain = _ZAP_DOMAIN.encode()
        tcp.setsockopt(zmq.HANDSHAKE_IVL, LISTENER_HANDSHAKE_MS)  # idle strangers hold no descriptor long
        try:
            tcp.bind(self.tcp_endpoint_config)
        except zmq.ZMQError as exc:
            tcp.close(linger=0)
            raise ConfigurationError(f"cannot bind api.tcp_endpoint {self.tcp_endpoint_config}: {exc.strerror}") from None
        self.tcp_endpoint = tcp.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.public_key = zmq.curve_public(self._curve_secret).decode("ascii")
        self._routers["tcp"] = tcp

    @staticmethod
    def _tune(sock: zmq.Socket[bytes], hard_limit: int) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, hard_limit)
        # Replies queued for one client, each up to a read's page (api.max_read_bytes): a client that
        # sends calls and does not read the answers must not make the agent hold thousands of them.
        # A Client reads everything into its own queue (RCVHWM 0) and makes one call at a time, so it
        # never has more than a call's progress and its answer waiting here; a ROUTER drops the rest.
        sock.setsockopt(zmq.SNDHWM, _REPLY_HWM)
        sock.setsockopt(zmq.RCVHWM, 10_000)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting calls, let running ones finish for ``timeout`` seconds, close the sockets.

        The reading thread keeps running meanwhile, so a call that finishes in time gets its reply
        (a publish the group acknowledged is reported as such, not as "outcome unknown"); calls
        that arrive meanwhile are refused with AgentNotRunningError.
        """
        if self._stop.is_set():
            return
        deadline = time.monotonic() + timeout
        self._close_deadline = deadline
        with self._count_lock:  # with the check in _on_request: no call starts after this
            self._draining = True
        while time.monotonic() < deadline:
            with self._count_lock:
                if self._in_flight == 0:
                    break
            time.sleep(0.01)
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(max(0.5, deadline - time.monotonic()))  # its last act: flush the replies
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._park_pool.shutdown(wait=False, cancel_futures=True)
        with self._wake_lock:
            if self._wake_tx is not None:
                self._wake_tx.close(linger=0)
                self._wake_tx = None
        if self._auth is not None:
            self._auth.stop()
        try:
            (self.socket_dir / SOCKET_NAME).unlink()
        except OSError:
            pass
        self._ctx.destroy(linger=0)

    # --- the IO thread --------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx is not None:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def _io_main(self, wake_rx: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(wake_rx, zmq.POLLIN)
        by_socket = {}
        for name, sock in self._routers.items():
            poller.register(sock, zmq.POLLIN)
            by_socket[sock] = name
        try:
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(500))
                except zmq.ZMQError:
                    break
                if wake_rx in ready:
                    while True:
                        try:
                            wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self._flush_replies()
                for sock, name in by_socket.items():
                    if sock in ready:
                        self._read(sock, name)
                self._flush_replies()  # refusals made while reading go out now, not at the next wake
            self._flush_replies()
        finally:
            wake_rx.close(linger=0)
            # The last replies were only queued by the flush above: let them go out within close()'s time.
            linger = int(max(0.0, min(2.0, self._close_deadline - time.monotonic())) * 1000)
            for sock in self._routers.values():
                sock.close(linger=linger)

    def _flush_replies(self) -> None:
        while True:
            try:
                where, frames = self._replies.get_nowait()
            except queue.Empty:
                return
            sock = self._routers.get(where)
            if sock is None:
                continue
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=len(frames[-1]) < 65536)
            except zmq.ZMQError:  # the client went away or does not read: nothing to do
                log.debug("dropped a reply to a client that is gone")

    def _read(self, sock: zmq.Socket[bytes], where: str) -> None:
        for _ in range(256):  # bounded, so replies are flushed between bursts of requests
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.warning("API socket read failed: %s", exc.strerror)
                return
            try:
                self._on_request(where, [f.bytes if len(f) < 65536 else f.buffer for f in frames])
            except Exception as exc:  # noqa: BLE001 - an input nothing above foresaw fails its call, not the server
                log.error("an API request could not be handled (%s); the agent serves on", type(exc).__name__)
                if frames:
                    self._replies.put((where, [frames[0].bytes, encode_header(error_header(None, exc))]))

    def _reply(self, where: str, identity: bytes, header: dict[str, Any], bulk: bytes | None = None) -> None:
        frames = [identity, encode_header(header)]
        if bulk is not None:
            frames.append(bulk)
        self._replies.put((where, frames))

    def _refuse(self, where: str, identity: bytes, request_id: Any, exc: ZeroCommError) -> None:
        self.stats["refused"] += 1
        event(log, logging.INFO, "refused an API request", error=type(exc).__name__, reason=str(exc)[:300])
        self._replies.put((where, [identity, encode_header(error_header(request_id, exc))]))

    def _on_request(self, where: str, frames: list[Any]) -> None:
        identity = bytes(frames[0])
        body = frames[1:]
        request_id: Any = None
        try:
            if not body:
                raise BadRequestError("an empty request; send [json header][optional arrow ipc]")
            size = sum(len(f) for f in body)
            head_frame = bytes(body[0]) if len(body[0]) <= 1 << 20 else None
            header = decode_header(head_frame) if head_frame is not None else None
            if isinstance(header, dict):
                rid = header.get("id")
                if isinstance(rid, (str, int)) and not isinstance(rid, bool) and len(str(rid)) <= _ID_LIMIT:
                    request_id = rid
            if size > self.max_request_bytes:
                raise RequestTooLargeError(f"the request is {size} bytes; this agent takes at most "
                                           f"{self.max_request_bytes} (api.max_request_bytes)")
            if header is None:
                raise BadRequestError("the JSON header is larger than 1 MiB")
            if len(body) > 2:
                raise BadRequestError(f"a request has 1 or 2 frames ([json header][arrow ipc]), not {len(body)}")
            if request_id is None:
                raise BadRequestError(f"the header's 'id' must be a string or integer of at most {_ID_LIMIT} "
                                      "characters (it pairs the reply with the request)")
            bulk = body[1] if len(body) == 2 else None
            call, args, timeout = self.registry.parse(header, bulk)
            want_progress = header.get("progress") is True
        except ZeroCommError as exc:
            self._refuse(where, identity, request_id, exc)
            return
        with self._count_lock:
            stopping = self._draining
            if stopping or self._in_flight >= self._workers + self.max_pending:
                busy = True
            else:
                busy = False
                self._in_flight += 1
        if stopping:
            self._refuse(where, identity, request_id, AgentNotRunningError(
                f"the agent is stopping; {call.name} was not started"))
            return
        if busy:
            self._refuse(where, identity, request_id, AgentBusyError(
                f"{self._in_flight} calls are in progress; {call.name} was not started"))
            return
        request = Request(id=str(request_id), call=call.name, args=args, bulk=bulk, timeout=timeout, client=where)
        if want_progress:
            request._progress = self._progress_sender(where, identity, request_id)
        pool = self._park_pool if call.parks is not None and call.parks(args) else self._pool
        try:
            pool.submit(self._run, where, identity, request_id, call, request)
        except RuntimeError:  # shutting down
            with self._count_lock:
                self._in_flight -= 1

    def _progress_sender(self, where: str, identity: bytes, request_id: Any) -> Callable[[dict[str, Any]], None]:
        last = [0.0]

        def send(info: dict[str, Any]) -> None:
            now = time.monotonic()
            if now - last[0] < _PROGRESS_INTERVAL and not info.get("final"):
                return
            last[0] = now
            self._reply(where, identity, {"v": PROTOCOL_VERSION, "id": request_id, "progress": info})
            self._wake()

        return send

    def _run(self, where: str, identity: bytes, request_id: Any, call: Call, request: Request) -> None:
        ok = False
        try:
            result = call.handler(request, **request.args)
            bulk = None
            if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], (bytes, bytearray, memoryview)):
                result, bulk = result
            self._reply(where, identity, {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result},
                        bulk)
            ok = True
        except ZeroCommError as exc:
            event(log, logging.INFO, "API call failed", call=call.name, error=type(exc).__name__)
            self._reply(where, identity, error_header(request_id, exc))
        except Exception as exc:  # noqa: BLE001 - a handler bug must not stop the server
            log.error("API call %s crashed", call.name, exc_info=exc)
            self._reply(where, identity, error_header(request_id, exc))
        finally:
            with self._count_lock:
                self._in_flight -= 1
            self.stats["calls"] += 1
            if not ok:
                self.stats["errors"] += 1
            if self._on_call is not None:
                try:
                    self._on_call(call.name, ok, time.monotonic() - request.started)
                except Exception:  # noqa: BLE001
                    pass
            self._wake()
