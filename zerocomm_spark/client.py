"""The client of a zerocomm agent's local API: what a notebook or a Spark task uses in a few lines.

```python
from zerocomm_spark.client import Client

with Client.connect(spawn=True) as zc:              # the agent on this host, started if none runs
    zc.publish("sensors", [b"21.5", b"21.7"])         # returns once the group acknowledged them
    table = zc.read(group="sensors", start=0)        # a pyarrow.Table from the agent's journal
```

Why it looks like this:

* The agent speaks ZeroMQ: a ROUTER on ``ipc://<socket_dir>/api.sock`` (the directory is mode 700,
  so only its owner can reach it) and optionally on ``tcp://`` with CURVE. Every message is
  multipart ``[json header][optional Arrow IPC stream]``: JSON for the small things, Arrow for bulk
  data, so a read lands in Spark without a per-row conversion.
* This module is the wire format's single definition; the agent imports it from here. It needs only
  pyzmq, pyarrow and the error hierarchy, so the protocol core never imports the agent layer.
* Every call has a deadline. The agent is told a slightly shorter one, so its own, more precise
  error (which member did not acknowledge) normally arrives before the client gives up.
* ZeroMQ sockets belong to one process: a Client re-creates its socket lazily after a fork or an
  unpickle, so it can be captured in a Spark closure and shipped to executors.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from zerocomm_spark import errors
from zerocomm_spark.errors import (
    AgentNotRunningError,
    AgentStartError,
    ApiError,
    ApiPermissionError,
    ApiTimeoutError,
    BadRequestError,
    ClientClosedError,
    ConfigurationError,
    RequestTooLargeError,
    ZeroCommError,
)
from zerocomm_spark.ipc_limits import DECODED_BYTES_FACTOR, check_decoded_size, input_errors
from zerocomm_spark.text import is_utf8_text

if TYPE_CHECKING:  # pyarrow costs ~0.4 s to import: only the calls that move Arrow data load it
    import pyarrow as pa

__all__ = [
    "Client",
    "PublishResult",
    "ReadResult",
    "PROTOCOL_VERSION",
    "SOCKET_NAME",
    "DEFAULT_IDENTITY_DIR",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MAX_DECODED_BYTES",
    "default_socket_dir",
    "find_config_file",
    "resolve_socket_dir",
    "table_to_ipc",
    "ipc_to_table",
    "publish_table",
]

PROTOCOL_VERSION = 1
SOCKET_NAME = "api.sock"
HEALTH_FILE = "health.json"
PID_FILE = "agent.pid"
_GONE_GRACE_MS = 2000  # how long a reply may still arrive once the local agent stopped listening
DEFAULT_IDENTITY_DIR = "~/.zerocomm/member"
USER_CONFIG_FILE = "~/.zerocomm/zerocomm.toml"
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
#: What a bulk frame may take once read (decompressed) unless the caller says otherwise.
DEFAULT_MAX_DECODED_BYTES = DECODED_BYTES_FACTOR * DEFAULT_MAX_REQUEST_BYTES
DEFAULT_TIMEOUT = 30.0
#: The agent answers this much before the client's deadline, so its own error arrives first.
SERVER_MARGIN = 0.25
#: Longest AF_UNIX path (sun_path is 108 bytes on Linux, 104 on macOS, NUL included).
MAX_IPC_PATH = 103
_DETAIL_LIMIT = 2000


# --- where the agent lives ---------------------------------------------------------------------


def find_config_file(config: str | os.PathLike[str] | None = None,
                     env: Mapping[str, str] | None = None) -> Path | None:
    """The configuration file in force: the one named, else $ZEROCOMM_CONFIG, else the user's, else none."""
    env = os.environ if env is None else env
    if config is not None:
        path = Path(config).expanduser()
        if not path.is_file():
            raise ConfigurationError(f"the configuration file {path} {_not_a_file(path)}",
                                     hint="Create it with `zerocomm --config PATH init`, or fix the path")
        return path
    named = env.get("ZEROCOMM_CONFIG")
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigurationError(f"ZEROCOMM_CONFIG names {path}, which {_not_a_file(path)}",
                                     hint="Create it with `zerocomm init`, or unset ZEROCOMM_CONFIG")
        return path
    user = Path(USER_CONFIG_FILE).expanduser()
    return user if user.is_file() else None


def _not_a_file(path: Path) -> str:
    """Why ``path`` is no configuration file: "does not exist" misleads about a directory given by mistake."""
    if path.is_dir():
        return "is a directory, not a TOML file"
    return "is not a regular file" if path.exists() else "does not exist"


def default_socket_dir(identity_dir: str | os.PathLike[str]) -> Path:
    """Where an agent serves its API when api.socket_dir is not set: ``<identity dir>/run``."""
    return Path(identity_dir).expanduser().absolute() / "run"


def resolve_socket_dir(config: str | os.PathLike[str] | None = None,
                       env: Mapping[str, str] | None = None) -> Path:
    """The socket directory an agent started with the same configuration and environment uses.

    Mirrors the agent's own resolution (file, then ZEROCOMM_<SECTION>_<KEY>) for the two settings
    it needs, so a client finds the agent without importing the agent layer.
    """
    env = os.environ if env is None else env
    path = find_config_file(config, env)
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigurationError(f"cannot read the configuration file {path}: {exc}") from None
    api = data.get("api") if isinstance(data.get("api"), dict) else {}
    identity = data.get("identity") if isinstance(data.get("identity"), dict) else {}
    in_file = {"socket_dir": api.get("socket_dir", ""), "dir": identity.get("dir", DEFAULT_IDENTITY_DIR)}
    # Only the value in force is checked, as the agent does: a bad one the environment overrides is no error.
    overrides = {"socket_dir": "ZEROCOMM_API_SOCKET_DIR", "dir": "ZEROCOMM_IDENTITY_DIR"}
    for name, value in in_file.items():
        if overrides[name] not in env and not isinstance(value, str):
            section = "api" if name == "socket_dir" else "identity"
            raise ConfigurationError(f"{section}.{name} in {path} must be a string, not {type(value).__name__}",
                                     hint=f"Fix it in {path}, or set {overrides[name]}")
    if path is not None:  # a relative path in the file is relative to the file, as the agent reads it
        in_file = {k: v if not isinstance(v, str) or not v or os.path.isabs(os.path.expanduser(v))
                   else str(path.parent.absolute() / v) for k, v in in_file.items()}
    socket_dir = env.get("ZEROCOMM_API_SOCKET_DIR", in_file["socket_dir"])
    identity_dir = env.get("ZEROCOMM_IDENTITY_DIR", in_file["dir"])
    if socket_dir:
        return Path(socket_dir).expanduser().absolute()
    return default_socket_dir(identity_dir or DEFAULT_IDENTITY_DIR)


def ipc_endpoint(socket_dir: str | os.PathLike[str]) -> str:
    path = Path(socket_dir).expanduser().absolute() / SOCKET_NAME
    if not is_utf8_text(str(path)):  # ZeroMQ endpoints are UTF-8: undecodable bytes in a path have none
        raise ConfigurationError(f"the API socket path {str(path)!r} is not UTF-8 text, which a ZeroMQ endpoint must be",
                                 hint="Set api.socket_dir (or identity.dir, whose run/ it defaults to) to a UTF-8 path")
    if len(str(path).encode()) > MAX_IPC_PATH:
        raise ConfigurationError(
            f"the API socket path {path} is longer than the {MAX_IPC_PATH} bytes a Unix socket allows",
            hint="Set api.socket_dir (or ZEROCOMM_API_SOCKET_DIR) to a shorter directory")
    return f"ipc://{path}"


def check_socket_dir(socket_dir: Path) -> None:
    """Refuse clearly, before ZeroMQ would wait silently, when this user cannot use the directory."""
    try:
        st = socket_dir.stat()
    except PermissionError:
        raise ApiPermissionError(f"this user (uid {os.getuid()}) cannot open the agent's socket directory "
                                 f"{socket_dir}: a directory on the way is not accessible") from None
    except FileNotFoundError:
        raise AgentNotRunningError(f"no agent socket directory at {socket_dir}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"the agent's socket directory {socket_dir} is not a directory")
    uid = os.getuid()
    if st.st_uid != uid and uid != 0:
        raise ApiPermissionError(f"the agent's socket directory {socket_dir} belongs to uid {st.st_uid}, "
                                 f"not to this user (uid {uid})")
    if not os.access(socket_dir, os.R_OK | os.W_OK | os.X_OK):
        raise ApiPermissionError(f"this user (uid {uid}) may not open the agent's socket directory {socket_dir}")
    sock = socket_dir / SOCKET_NAME
    try:
        sst = sock.stat()
    except PermissionError:
        raise ApiPermissionError(f"this user (uid {uid}) cannot open the agent's socket {sock}") from None
    except FileNotFoundError:
        raise AgentNotRunningError(f"no agent socket at {sock}") from None
    if not stat.S_ISSOCK(sst.st_mode):
        raise AgentNotRunningError(f"{sock} is not a socket")
    # Only a socket someone listens on is a risk: with none (or a stale one) there is no agent, and
    # one started (spawn=True, --spawn) makes the directory private and its own socket there.
    problem: ApiPermissionError | None = None
    if stat.S_IMODE(st.st_mode) & 0o022:
        # Whoever may write it may have put their own listener at api.sock (an agent keeps it mode 700).
        problem = ApiPermissionError(
            f"the agent's socket directory {socket_dir} has mode {stat.S_IMODE(st.st_mode):o}, so other users could "
            "replace its socket; not connecting",
            hint="Make it private (chmod 700) or remove it and start the agent again: it creates its directory mode 700")
    elif sst.st_uid != st.st_uid:
        problem = ApiPermissionError(f"the socket {sock} belongs to uid {sst.st_uid}, not to the owner of its directory "
                                     f"(uid {st.st_uid}): not the agent's; not connecting",
                                     hint="Remove it and start the agent again")
    elif not os.access(sock, os.R_OK | os.W_OK):
        raise ApiPermissionError(f"this user (uid {uid}) may not open the agent's socket {sock}")
    try:
        listening = _listening(sock)  # a connect closed at once: nothing is sent to whoever listens
    except ApiPermissionError:
        if problem is not None:
            raise problem from None
        raise
    if listening is False:
        raise AgentNotRunningError(f"no agent listens on {sock} (a stale socket: the agent stopped or crashed)")
    if problem is not None:
        raise problem


#: A TCP client whose key the agent refused: the generic hint spoke of the local socket's user.
_CURVE_REFUSED_HINT = ("List this client's CURVE public key in the agent's api.allowed_clients (and restart it), "
                       "or check that server_key is the agent's `api key` (`zerocomm agent status`) and that "
                       "public_key and secret_key are one pair from `zerocomm keygen`")


def _run_lock_held(socket_dir: Path) -> bool:
    """Whether a process holds the agent's run lock (its pid file): an agent starting up holds it before
    it listens, one stopping until it exits. Only used to decide to wait, never to signal anyone."""
    try:  # O_NONBLOCK: a FIFO planted in place of the file must not hang the open
        fd = os.open(socket_dir / PID_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _listening(sock: Path) -> bool | None:
    """Whether a process accepts connections on the Unix socket (None: cannot tell). A connect that is
    refused is the crisp sign of a dead agent that ZeroMQ, which retries silently, never gives."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(str(sock))
    except PermissionError:
        raise ApiPermissionError(f"this user (uid {os.getuid()}) may not connect to the agent's socket {sock}") from None
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return None
    finally:
        probe.close()
    return True


# --- the wire ----------------------------------------------------------------------------------


def encode_header(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")


def decode_header(frame: bytes) -> dict[str, Any]:
    try:
        header = json.loads(frame)
    except (ValueError, UnicodeDecodeError):
        raise BadRequestError("the first frame is not a JSON object (expected [json header][arrow ipc]?)") from None
    except RecursionError:  # "[[[[..." a few thousand deep: refused like any other bad header
        raise BadRequestError("the JSON header nests too deeply; send a flat object of call arguments") from None
    if not isinstance(header, dict):
        raise BadRequestError(f"the header is JSON {type(header).__name__}, not an object")
    return header


def error_header(request_id: Any, exc: BaseException) -> dict[str, Any]:
    """The reply describing ``exc``: class name, message without hint, and hint, never a traceback."""
    if isinstance(exc, ZeroCommError):
        name, message, hint = type(exc).__name__, exc.message, exc.hint
    else:
        name, message, hint = "ApiError", "the agent failed while handling the call (see its log)", ApiError.hint
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False,
            "error": {"type": name, "message": message[:_DETAIL_LIMIT], "hint": (hint or "")[:_DETAIL_LIMIT]}}


def raise_for_error(error: Any) -> None:
    """Raise the ZeroComm error an error reply names (ApiError if it names none we know)."""
    if not isinstance(error, dict):
        raise ApiError("the agent answered with a malformed error")
    name, message, hint = error.get("type"), error.get("message"), error.get("hint")
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, ZeroCommError)):
        cls = ApiError
    text = message if isinstance(message, str) and message else "no detail"
    try:
        exc = cls(text, hint=hint if isinstance(hint, str) else None)
    except TypeError:  # a subclass with its own constructor
        exc = ApiError(f"{name}: {text}", hint=hint if isinstance(hint, str) else None)
    raise exc


def table_to_ipc(data: pa.Table | pa.RecordBatch) -> bytes:
    """Arrow IPC stream bytes: the bulk frame of requests and replies."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        if isinstance(data, pa.RecordBatch):
            writer.write_batch(data)
        else:
            writer.write_table(data)
    return sink.getvalue().to_pybytes()


def ipc_to_table(frame: bytes | memoryview | pa.Buffer, *,
                 max_bytes: int | None = DEFAULT_MAX_DECODED_BYTES) -> pa.Table:
    """Parse untrusted Arrow IPC stream bytes; anything else is a BadRequestError, not a crash.

    ``max_bytes`` bounds what the stream takes once read: a frame whose compressed batches would
    decompress past it is refused before anything is decompressed (see
    :func:`zerocomm_spark.ipc_limits.check_decoded_size`). ``None``: no bound.
    """
    import pyarrow as pa

    try:
        source = pa.py_buffer(frame) if not isinstance(frame, pa.Buffer) else frame
        if max_bytes is not None:
            check_decoded_size(source, max_bytes)
        reader = pa.ipc.open_stream(source)
        table = reader.read_all()
        table.validate(full=True)
    except input_errors() as exc:
        raise BadRequestError(f"the bulk frame is not an Arrow IPC stream: {str(exc)[:200]}") from None
    return table


def _binary_array(values: Sequence[bytes | None], as_string: bool = False) -> "pa.Array":
    """A binary (or string) array built from buffers: ``pa.array(list)`` would import pandas (most of a second)."""
    import array

    import pyarrow as pa

    offsets = array.array("i", [0])
    validity = bytearray((len(values) + 7) // 8)
    total = 0
    for i, v in enumerate(values):
        if v is not None:
            total += len(v)
            validity[i // 8] |= 1 << (i % 8)
        offsets.append(total)
    if total >= 2**31:
        return pa.array(values, type=pa.string() if as_string else pa.binary())
    nulls = sum(v is None for v in values)
    buffers = [pa.py_buffer(bytes(validity)) if nulls else None, pa.py_buffer(offsets.tobytes()),
               pa.py_buffer(b"".join(v for v in values if v is not None))]
    return pa.Array.from_buffers(pa.string() if as_string else pa.binary(), len(values), buffers, null_count=nulls)


def publish_table(data: pa.Table | pa.RecordBatch | Iterable[bytes | str],
                  message_ids: Sequence[str | None] | None = None,
                  headers: Sequence[Mapping[str, str] | None] | None = None) -> pa.Table:
    """What publish() sends: a table with ``payload`` (binary or string) and optional ``message_id``, ``headers``."""
    import pyarrow as pa

    if isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, pa.Table):
        table = data
    else:
        if isinstance(data, (bytes, str, bytearray)):
            raise TypeError("publish() takes a list of messages (or a pyarrow Table); wrap a single one in a list")
        payloads = [bytes(p) if isinstance(p, (bytearray, memoryview)) else p for p in data]
        for i, p in enumerate(payloads):
            if not isinstance(p, (bytes, str)):
                raise TypeError(f"message {i} is a {type(p).__name__}; messages are bytes or str")
        try:
            payloads = [p.encode("utf-8") if isinstance(p, str) else p for p in payloads]
        except UnicodeEncodeError:  # a lone surrogate (undecodable input) has no UTF-8 form: say which
            i = next(i for i, p in enumerate(payloads) if isinstance(p, str) and not is_utf8_text(p))
            raise BadRequestError(f"message {i} is not UTF-8 text: it holds a lone surrogate (undecodable bytes)",
                                  hint="Send UTF-8 text, or bytes for binary data") from None
        table = pa.Table.from_arrays([_binary_array(payloads)], names=["payload"])
    if message_ids is not None:
        if len(message_ids) != table.num_rows:
            raise ValueError(f"{len(message_ids)} message ids for {table.num_rows} messages")
        if "message_id" in table.column_names:
            raise ValueError("the table already has a message_id column; pass ids one way only")
        for mid in message_ids:
            if mid is not None and not isinstance(mid, str):
                raise TypeError(f"message ids are str (or None), not {type(mid).__name__}")
            if mid is not None and not is_utf8_text(mid):
                raise BadRequestError("a message id is not UTF-8 text: it holds a lone surrogate (undecodable bytes)",
                                      hint="Use UTF-8 text for message ids, or leave them out to get fresh ones")
        ids = [None if m is None else m.encode("utf-8") for m in message_ids]
        table = table.append_column("message_id", _binary_array(ids, as_string=True))
    if headers is not None:
        if len(headers) != table.num_rows:
            raise ValueError(f"{len(headers)} header maps for {table.num_rows} messages")
        if "headers" in table.column_names:
            raise ValueError("the table already has a headers column; pass headers one way only")
        rows = [None if h is None else list(dict(h).items()) for h in headers]
        table = table.append_column("headers", pa.array(rows, type=pa.map_(pa.string(), pa.string())))
    if "payload" not in table.column_names:
        raise ValueError(f"publish() needs a 'payload' column; the table has {table.column_names}")
    return table


# --- the client --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    """What the group acknowledged: message ids and this publisher's sequence numbers, in input order."""

    group: str
    message_ids: list[str]
    seqs: list[int]
    #: Rows the group already had under their message id, so not delivered again: ids this agent
    #: published before (not sent again), or, found by its journal, published before it started (or
    #: by another member).
    duplicates: int = 0
    #: False if this member's own journal did not hold the rows yet when the call answered (a slow
    #: disk): the group has them; a read on this member shows them once its journal catches up.
    journaled: bool = True
    #: Rows whose message, as the group keeps it, surely carries the agent's origin proof: with
    #: ``sign=True``, fewer than all when some ids were published before without it (a duplicate is
    #: not delivered again, nor re-signed).
    signed: int = 0
    #: Rows whose proof is not known: duplicates of messages published before the agent (re)started,
    #: which it no longer remembers (the copy the group keeps may or may not be signed), and rows not
    #: in this member's journal yet (``journaled`` False). Never counted in ``signed``.
    signed_unknown: int = 0

    def __len__(self) -> int:
        return len(self.message_ids)


@dataclass(frozen=True)
class ReadResult:
    """A page of journal rows; read again from ``next_offset`` (``end_offset``: the journal's end then)."""

    table: pa.Table
    next_offset: int
    end_offset: int
    next_seq: int | None = None


def _timeout(value: float | None, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigurationError(f"timeout must be a positive number of seconds, got {value!r}")
    return float(value)


class Client:
    """A connection to one agent's API; cheap to create, safe to pickle (it reconnects lazily)."""

    def __init__(self, endpoint: str, *, socket_dir: Path | None = None, timeout: float = DEFAULT_TIMEOUT,
                 server_key: str | bytes | None = None, public_key: str | bytes | None = None,
                 secret_key: str | bytes | None = None) -> None:
        """Use :meth:`Client.connect`, which also checks that an agent answers."""
        self.endpoint = endpoint
        self.socket_dir = socket_dir
        self.timeout = _timeout(timeout, DEFAULT_TIMEOUT)
        self._curve = None
        if endpoint.startswith("tcp://"):
            if not (server_key and public_key and secret_key):
                raise ConfigurationError(
                    "a tcp:// agent endpoint needs CURVE keys: server_key (the agent's api public key, see "
                    "`zerocomm agent status`), public_key and secret_key (this client's, listed in the agent's "
                    "api.allowed_clients)")
            self._curve = tuple(k.encode("ascii") if isinstance(k, str) else bytes(k)
                                for k in (server_key, public_key, secret_key))
        elif not endpoint.startswith("ipc://"):
            raise ConfigurationError(f"an agent endpoint is ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
        self.max_request_bytes = DEFAULT_MAX_REQUEST_BYTES
        self.agent: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._pid = os.getpid()
        self._closed = False

    # --- connecting ----------------------------------------------------------------------------

    @classmethod
    def connect(cls, where: str | os.PathLike[str] | None = None, *, spawn: bool = False,
                timeout: float = 10.0, config: str | os.PathLike[str] | None = None,
                call_timeout: float = DEFAULT_TIMEOUT, server_key: str | bytes | None = None,
                public_key: str | bytes | None = None, secret_key: str | bytes | None = None) -> "Client":
        """A client of the agent at ``where``, checked to answer within ``timeout`` seconds.

        ``where`` is a socket directory, an ``ipc://`` or ``tcp://`` endpoint, or a ``.toml``
        configuration file; None means the configuration in force on this host (``config``,
        $ZEROCOMM_CONFIG, ~/.zerocomm/zerocomm.toml, defaults). With ``spawn`` an agent for that
        configuration is started when none answers, and waited for until the deadline. Without
        ``spawn``, no agent there is an AgentNotRunningError at once, but an agent that holds its
        run directory and does not serve yet (starting, or stopping) is waited for until ``timeout``.
        """
        deadline = time.monotonic() + _timeout(timeout, 10.0)
        config_path: str | os.PathLike[str] | None = config
        socket_dir: Path | None = None
        if where is None:
            socket_dir = resolve_socket_dir(config)
            endpoint = ipc_endpoint(socket_dir)
        else:
            text = os.fspath(where)
            if text.startswith(("ipc://", "tcp://")):
                endpoint = text
                if text.startswith("ipc://"):
                    socket_dir = Path(text[len("ipc://"):]).parent
            elif text.endswith(".toml"):
                config_path = text
                socket_dir = resolve_socket_dir(text)
                endpoint = ipc_endpoint(socket_dir)
            else:
                path = Path(text).expanduser().absolute()
                socket_dir = path.parent if path.name == SOCKET_NAME else path
                endpoint = ipc_endpoint(socket_dir)
        if spawn and not endpoint.startswith("ipc://"):
            raise ConfigurationError("spawn=True starts an agent on this host; it needs a local (ipc) agent")
        client = cls(endpoint, socket_dir=socket_dir, timeout=call_timeout, server_key=server_key,
                     public_key=public_key, secret_key=secret_key)
        try:
            client._hello(deadline, spawn=spawn, config=config_path)
        except BaseException:
            client.close()
            raise
        return client

    def _hello(self, deadline: float, *, spawn: bool, config: str | os.PathLike[str] | None) -> None:
        spawned = False
        while True:
            try:
                if self.socket_dir is not None:
                    check_socket_dir(self.socket_dir)
                info = self.call("status", timeout=max(min(deadline - time.monotonic(), 5.0), 0.05))
                break
            except (AgentNotRunningError, ApiTimeoutError) as exc:
                if spawn and not spawned:
                    if self.socket_dir is not None:
                        _check_spawn_target(self.socket_dir, config, self.endpoint)
                    _spawn_agent(config, deadline)
                    spawned = True
                    continue
                if spawned and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                if self.socket_dir is not None and _run_lock_held(self.socket_dir):
                    # An agent holds its run directory but does not listen yet (it is starting: one a
                    # connector spawned a moment ago, say), or listens and does not answer (stopping,
                    # hung, overloaded). Failing now would call a starting agent dead, and "start one"
                    # would send the user to a start that is refused as already running.
                    if time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                    raise AgentNotRunningError(
                        f"an agent holds {self.socket_dir} but did not serve on {self.endpoint} within the "
                        "deadline: it is starting or stopping, or hung",
                        hint="See its log; `zerocomm agent status` tells whether it is alive, "
                             "`zerocomm agent stop --force` stops a hung one") from None
                if isinstance(exc, ApiTimeoutError):
                    raise AgentNotRunningError(f"no agent answered on {self.endpoint} within the deadline") from None
                raise
        self.agent = info
        limit = info.get("max_request_bytes")
        if isinstance(limit, int) and limit > 0:
            self.max_request_bytes = limit

    def close(self) -> None:
        """Release this process's socket; the Client can be connected again only by a new connect()."""
        with self._lock:
            self._closed = True
            self._drop_socket()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Sockets and contexts stay in the process that made them; the copy reconnects lazily.
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_sock", "_monitor", "_pid")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._sock = None
        self._monitor = None
        self._pid = os.getpid()

    def __repr__(self) -> str:
        who = self.agent.get("label") if self.agent else None
        return f"Client(endpoint={self.endpoint!r}, agent={who!r}{', closed' if self._closed else ''})"

    # --- the socket ----------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket[bytes]:
        if self._closed:
            raise ClientClosedError("the client is closed")
        if self._pid != os.getpid():  # forked: the parent's socket is not ours to use or close
            self._sock = None
            self._monitor = None
            self._pid = os.getpid()
        if self._sock is None:
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if not self.endpoint.startswith("ipc://"):
                # Queue nothing for a remote agent that is not there yet. Not for a local one: with
                # IMMEDIATE a reply already received but not yet read is dropped when the agent
                # disconnects (a stopping agent's last answers); a dead local agent is told by a
                # refused connect before each call instead.
                sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RCVHWM, 0)
            if self._curve is not None:
                server, public, secret = self._curve
                sock.curve_serverkey = server
                sock.curve_publickey = public
                sock.curve_secretkey = secret
                self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        if self._pid != os.getpid():
            self._sock = self._monitor = None
            return
        if self._sock is not None:
            if self._monitor is not None:
                try:
                    self._sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)
            self._sock = None

    def _local_agent_gone(self) -> bool:
        if self.socket_dir is None or not self.endpoint.startswith("ipc://"):
            return False
        try:
            return _listening(self.socket_dir / SOCKET_NAME) is False
        except ApiPermissionError:
            return False

    def _auth_failed(self) -> bool:
        if self._monitor is None:
            return False
        failed = False
        while self._monitor.poll(0):
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
                failed = True
            except zmq.Again:
                break
        return failed

    # --- calls ---------------------------------------------------------------------------------

    def call(self, name: str, *, timeout: float | None = None, bulk: bytes | None = None,
             progress: Callable[[dict[str, Any]], None] | None = None,
             **args: Any) -> Any:
        """Call ``name`` on the agent; returns its JSON result, or (result, table) when it sends bulk data."""
        result, table = self.call_bulk(name, timeout=timeout, bulk=bulk, progress=progress, **args)
        return result if table is None else (result, table)

    @contextlib.contextmanager
    def _turn(self, name: str, deadline: float, wait: float) -> Iterator[None]:
        """The socket for one call at a time; waiting behind another thread's call (a long poll)
        counts against this call's deadline, so it cannot hang past it."""
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise ApiTimeoutError(f"another call on this client was still in progress when the {name} call's "
                                  f"deadline of {wait:g}s passed; {name} was not sent",
                                  hint="Use one Client per thread for concurrent calls, or a longer timeout")
        try:
            yield
        finally:
            self._lock.release()

    def call_bulk(self, name: str, *, timeout: float | None = None, bulk: bytes | None = None,
                  progress: Callable[[dict[str, Any]], None] | None = None,
                  **args: Any) -> tuple[Any, pa.Table | None]:
        """Like :meth:`call`, always returning (result, table or None)."""
        wait = _timeout(timeout, self.timeout)
        args = {k: v for k, v in args.items() if v is not None}
        rid = uuid.uuid4().hex
        header = {"v": PROTOCOL_VERSION, "id": rid, "call": name, "args": args,
                  "timeout": max(wait - SERVER_MARGIN, wait * 0.8), "progress": progress is not None}
        try:
            frames = [encode_header(header)]
        except (TypeError, ValueError) as exc:
            raise BadRequestError(f"the arguments of {name} are not JSON-serializable: {exc}") from None
        if bulk is not None:
            frames.append(bulk)
        size = sum(len(f) for f in frames)
        if size > self.max_request_bytes:
            raise RequestTooLargeError(f"the {name} request is {size} bytes; the agent takes at most "
                                       f"{self.max_request_bytes}")
        deadline = time.monotonic() + wait
        with self._turn(name, deadline, wait):
            sock = self._socket()
            if self._local_agent_gone():  # a refused connect: no agent is there to take the call
                self._drop_socket()
                raise AgentNotRunningError(f"no agent listens on {self.endpoint}")
            while True:  # short send attempts, so a dead local agent is reported at once, not at the deadline
                try:
                    sock.setsockopt(zmq.SNDTIMEO, max(int(min(wait, 0.25) * 1000), 1))
                    sock.send_multipart(frames, copy=len(frames[-1]) < 65536)
                    break
                except zmq.Again:
                    refused = self._auth_failed()
                    if refused or time.monotonic() >= deadline or self._local_agent_gone():
                        self._drop_socket()
                    if refused:
                        raise ApiPermissionError(f"the agent at {self.endpoint} refused this client's CURVE key",
                                                 hint=_CURVE_REFUSED_HINT) from None
                    if self._sock is None:
                        if time.monotonic() < deadline:
                            raise AgentNotRunningError(f"no agent listens on {self.endpoint}") from None
                        raise ApiTimeoutError(f"no agent accepted the {name} call on {self.endpoint} "
                                              f"within {wait:g}s") from None
                except zmq.ZMQError as exc:
                    self._drop_socket()
                    raise ApiError(f"cannot send to the agent at {self.endpoint}: {exc.strerror}") from None
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(min(left, 0.5) * 1000) + 1, zmq.POLLIN):
                    if self._auth_failed():
                        self._drop_socket()
                        raise ApiPermissionError(f"the agent at {self.endpoint} refused this client's CURVE key",
                                                 hint=_CURVE_REFUSED_HINT)
                    if self._local_agent_gone():
                        # A stopping agent's last replies can still be on their way (a large one takes a
                        # while through the socket it no longer listens on): a short grace before giving up.
                        if not sock.poll(_GONE_GRACE_MS, zmq.POLLIN):
                            self._drop_socket()
                            raise AgentNotRunningError(
                                f"the agent at {self.endpoint} stopped before it answered {name}",
                                hint="The outcome is unknown: start the agent again and retry (a publish with the "
                                     "same message ids delivers nothing twice)")
                    elif time.monotonic() < deadline:
                        continue
                    else:
                        # A reply may still come; drop the socket so it cannot be mistaken for the next one's.
                        self._drop_socket()
                        raise ApiTimeoutError(f"the agent at {self.endpoint} did not answer {name} within {wait:g}s")
                reply = sock.recv_multipart()
                try:
                    head = decode_header(reply[0])
                except BadRequestError:
                    continue
                if head.get("id") != rid:
                    continue  # a late answer to a call that timed out
                if "progress" in head and "ok" not in head:
                    if progress is not None:
                        try:
                            progress(head["progress"])
                        except Exception:  # noqa: BLE001 - a display must not break the call
                            pass
                    continue
                break
        if not head.get("ok"):
            raise_for_error(head.get("error"))
        # The agent's replies are uncompressed and may be larger than any request: bound only expansion.
        table = (ipc_to_table(reply[1], max_bytes=max(DEFAULT_MAX_DECODED_BYTES, len(reply[1])))
                 if len(reply) > 1 else None)
        return head.get("result"), table

    # --- typed calls: identity and connections -------------------------------------------------

    def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The agent's label, pid, endpoints, groups and limits."""
        result: dict[str, Any] = self.call("status", timeout=timeout)
        return result

    def invite(self, *, label: str | None = None, multi_use: bool = False, group: str | None = None,
               timeout: float | None = None) -> str:
        """An invitation URL another member accepts (``zerocomm connect URL``)."""
        return str(self.call("invite", label=label, multi_use=multi_use, group=group, timeout=timeout)["url"])

    def accept(self, url: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Connect to the member that made the invitation (DID exchange); returns the connection."""
        result: dict[str, Any] = self.call("accept", url=url, timeout=timeout)
        return result

    def connections(self, *, include_incomplete: bool = False, timeout: float | None = None) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("connections", include_incomplete=include_incomplete, timeout=timeout)
        return result

    def send(self, peer: str, message: str, *, timeout: float | None = None) -> str:
        """A DIDComm basic message to one connection; returns its id once the peer's agent has it."""
        return str(self.call("send", peer=peer, message=message, timeout=timeout)["message_id"])

    def messages(self, peer: str | None = None, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Basic messages the agent received since it started, oldest first."""
        result: list[dict[str, Any]] = self.call("messages", peer=peer, timeout=timeout)
        return result

    # --- typed calls: groups -------------------------------------------------------------------

    def groups(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("groups", timeout=timeout)
        return result

    def create(self, group: str, *, mode: str | None = None, ordered: bool | None = None,
               consistent_join: bool | None = None, role: str | None = None,
               timeout: float | None = None) -> dict[str, Any]:
        """Create a group with this member as its first member."""
        result: dict[str, Any] = self.call("create", group=group, mode=mode, ordered=ordered,
                                           consistent_join=consistent_join, role=role, timeout=timeout)
        return result

    def join(self, group: str, via: str, *, role: str | None = None, timeout: float | None = None,
             progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Join ``group`` through a member we are connected to (connection id, label or DID)."""
        result: dict[str, Any] = self.call("join", group=group, via=via, role=role, timeout=timeout,
                                           progress=progress)
        return result

    def leave(self, group: str, *, timeout: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.call("leave", group=group, timeout=timeout)
        return result

    def info(self, group: str, *, timeout: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.call("info", group=group, timeout=timeout)
        return result

    def members(self, group: str, *, include_left: bool = False, timeout: float | None = None) -> list[dict[str, Any]]:
        """The group's members; ``include_left`` adds those that left (status "left"), whose labels name
        what they published before."""
        args: dict[str, Any] = {"include_left": True} if include_left else {}
        result: list[dict[str, Any]] = self.call("members", group=group, timeout=timeout, **args)
        return result

    def switch_role(self, group: str, role: str, *, timeout: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.call("switch_role", group=group, role=role, timeout=timeout)
        return result

    def publish(self, group: str, data: pa.Table | pa.RecordBatch | Iterable[bytes | str], *,
                message_ids: Sequence[str | None] | None = None,
                headers: Sequence[Mapping[str, str] | None] | None = None,
                timeout: float | None = None, sign: bool = False) -> PublishResult:
        """Publish a batch; returns once every member acknowledged it (or raises, with a deadline).

        Rows without a message id get a fresh one. Publishing again with the same ids is safe:
        members and journals drop duplicates, so retry a failed publish with the ids it returned
        or that you chose. A row the agent cannot publish (a null payload or header value, a header the
        group cannot carry, a message id too long or given twice) refuses the batch with BadRowError (a
        BadRequestError) naming the row, counted from 0 in this batch; nothing of it is published.

        ``sign=True`` has the agent add an origin proof to every row (header ``zc-origin``, scheme
        ``ed25519-member/1``, zerocomm_spark/group/origin.py), signed with its member key, so history
        can prove later who published each row; a row that already has a ``zc-origin`` header is
        then refused (BadRowError). An agent older than this option refuses the argument.
        The result's ``signed`` counts the rows the group keeps with the proof: a duplicate keeps
        how it went out first, and one first published before the agent's last start counts in
        ``signed_unknown`` instead (the agent keeps the ids it published in memory only).
        """
        if not isinstance(sign, bool):
            raise TypeError(f"sign is a bool, not {type(sign).__name__}")
        table = publish_table(data, message_ids, headers)
        result = self.call("publish", group=group, timeout=timeout, bulk=table_to_ipc(table),
                           sign=True if sign else None)  # left out when False: older agents take the call
        ids, duplicates = list(result["message_ids"]), int(result.get("duplicates", 0))
        # An agent older than the count (one still running after an upgrade) signed what it sent new;
        # whether its duplicates went out with a proof it cannot say. One older than "signed_unknown"
        # counted as signed a row sent again after its restart, which the group had already (unsigned).
        if "signed" in result:
            signed, unknown = int(result["signed"]), int(result.get("signed_unknown", 0))
        else:  # it signed what it sent new; how its duplicates went out it does not say
            signed, unknown = (len(ids) - duplicates, duplicates) if sign else (0, 0)
        return PublishResult(group=group, message_ids=ids, seqs=list(result["seqs"]), duplicates=duplicates,
                             journaled=bool(result.get("journaled", True)), signed=signed, signed_unknown=unknown)

    # --- typed calls: the journal --------------------------------------------------------------

    def latest(self, group: str | None = None, *, timeout: float | None = None) -> dict[str, Any]:
        """Journal offsets: next offset, earliest readable, commit point, and per-publisher last seqs."""
        result: dict[str, Any] = self.call("latest", group=group, timeout=timeout)
        return result

    def superseded(self, group: str, publisher: str, first_seq: int, last_seq: int, *,
                   timeout: float | None = None) -> list[tuple[int, int]]:
        """Seqs of ``publisher`` in ``first_seq..last_seq`` with no row because their message ids
        came first from another publisher (a sink task retried on another host): not lost."""
        result: dict[str, Any] = self.call("superseded", group=group, publisher=publisher, first_seq=first_seq,
                                           last_seq=last_seq, timeout=timeout)
        return [(int(a), int(b)) for a, b in result["ranges"]]

    def read(self, *, group: str | None = None, start: int | None = None, end: int | None = None,
             publisher: str | None = None, first_seq: int | None = None, last_seq: int | None = None,
             max_rows: int | None = None, wait: float | None = None, timeout: float | None = None) -> pa.Table:
        """Journal rows as a pyarrow Table: by offset range [start, end) or by a publisher's seq range.

        At most ``max_rows`` (and the agent's api.max_read_rows) come back; :meth:`fetch` also says
        where to continue. ``wait``: when nothing is there yet, wait that long for new rows.
        """
        return self.fetch(group=group, start=start, end=end, publisher=publisher, first_seq=first_seq,
                          last_seq=last_seq, max_rows=max_rows, wait=wait, timeout=timeout).table

    def fetch(self, *, group: str | None = None, start: int | None = None, end: int | None = None,
              publisher: str | None = None, first_seq: int | None = None, last_seq: int | None = None,
              max_rows: int | None = None, wait: float | None = None, last: int | None = None,
              timeout: float | None = None) -> "ReadResult":
        """One page of journal rows and the offset to read from next (a long poll with ``wait``).

        ``last=N``: the group's N most recent rows. ``start=None``: from the earliest retained row.
        """
        if wait is not None and timeout is None:
            timeout = max(self.timeout, wait + 5.0)
        result, table = self.call_bulk("read", group=group, start=start, end=end, publisher=publisher,
                                       first_seq=first_seq, last_seq=last_seq, max_rows=max_rows, wait=wait,
                                       last=last, timeout=timeout)
        if table is None or not isinstance(result, dict):
            raise ApiError("the agent answered read without rows (an incompatible agent version?)")
        return ReadResult(table=table, next_offset=int(result.get("next_offset", 0)),
                          end_offset=int(result.get("end_offset", result.get("next_offset", 0))),
                          next_seq=result.get("next_seq"))

    def commit(self, offset: int, *, consumer: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """``consumer`` (or the journal's one unnamed consumer) consumed everything below ``offset``.

        Retention drops only what every named consumer committed: name yours when several read
        one member (the Spark source names each query).
        """
        params: dict[str, Any] = {"offset": offset}
        if consumer is not None:
            params["consumer"] = consumer
        result: dict[str, Any] = self.call("commit", timeout=timeout, **params)
        return result

    def release(self, consumer: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Forget a consumer that is gone for good, so its commit point no longer holds retention back."""
        result: dict[str, Any] = self.call("release", consumer=consumer, timeout=timeout)
        return result

    def metrics(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Messages in and out, bytes, lag per publisher, peers alive, API calls, and the peer transport's
        counters under ``transport`` (timeouts, drops, backlogs: see ``PeerTransport.stats``)."""
        result: dict[str, Any] = self.call("metrics", timeout=timeout)
        return result


# --- spawning an agent on demand ---------------------------------------------------------------


def _check_spawn_target(socket_dir: Path, config: str | os.PathLike[str] | None, endpoint: str) -> None:
    """Refuse to spawn for a socket directory the configuration in force does not serve: the agent
    started would be another member (the default identity, maybe created on the spot), serving
    elsewhere and left running. Starting one from the directory alone is no better: the identity's
    own configuration (its joiner policy, its journal limits) would be silently replaced by defaults."""
    wanted = socket_dir.expanduser().absolute()
    if resolve_socket_dir(config).expanduser().absolute() != wanted:
        raise AgentNotRunningError(
            f"no agent answers on {endpoint}, and spawn=True cannot start one there: the configuration in force "
            "serves another socket directory",
            hint="Connect with the agent's configuration file instead (Client.connect('.../zerocomm.toml', "
                 "spawn=True), or the connector's agent=<file.toml>), or start that agent yourself") from None


def _spawn_agent(config: str | os.PathLike[str] | None, deadline: float) -> None:
    """Start a detached agent for this configuration; another one winning the race is fine."""
    argv = [sys.executable, "-m", "zerocomm_spark.agent", "--json"]
    if config is not None:
        argv += ["--config", os.fspath(config)]
    argv += ["agent", "start", "--detach", "--existing-identity",  # a spawn never creates a member
             "--timeout", f"{max(deadline - time.monotonic(), 1.0):.3f}"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=max(deadline - time.monotonic(), 1.0) + 5.0)
    except subprocess.TimeoutExpired:
        raise AgentStartError("the agent started on demand did not report within the deadline") from None
    if done.returncode in (0, 5):  # 5: already running (another client spawned it first)
        return
    detail = done.stdout.strip() or done.stderr.strip()
    error = None
    try:
        answer = json.loads(detail.splitlines()[-1]) if detail else {}
        error = answer.get("error") if isinstance(answer, dict) else None
    except ValueError:
        pass
    if isinstance(error, dict):
        raise_for_error(error)
    raise AgentStartError(f"starting an agent on demand failed (exit {done.returncode}): {detail[-500:]}")
