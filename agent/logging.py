"""Structured logs for the agent: one JSON object (or key=value line) per event, with levels.

Why: an agent runs unattended beside Spark executors, so its log is read by machines (log
shippers, grep, jq) more than by people. Fields are passed as ``extra={"fields": {...}}`` or through
:func:`event`. Keys, passphrases and payloads must never reach a log: fields whose name suggests a
secret are replaced by ``"[redacted]"`` as a last line of defence, and no code here formats a value
it was not handed explicitly.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["configure", "event", "open_log_file", "JsonFormatter", "KeyValueFormatter"]

_SECRET_WORDS = ("secret", "passphrase", "password", "payload", "seed", "private", "token")
_SECRET_NAMES = {"key", "secret_key", "curve_secret", "journal_key"}
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_configured_handler: logging.Handler | None = None
_lock = threading.Lock()


def _redact(fields: dict[str, Any]) -> dict[str, Any]:
    clean: dict[str, Any] = {}
    for name, value in fields.items():
        lowered = name.lower()
        if (lowered in _SECRET_NAMES or lowered.endswith("_key") or lowered.endswith("key")
                or any(word in lowered for word in _SECRET_WORDS)):
            clean[name] = "[redacted]"
        elif isinstance(value, (bytes, bytearray, memoryview)):
            clean[name] = f"<{len(value)} bytes>"  # sizes are useful, contents are not ours to log
        else:
            clean[name] = value
    return clean


def _base(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
        "pid": record.process,
        "thread": record.threadName,
    }
    fields = getattr(record, "fields", None)
    if isinstance(fields, dict):
        for name, value in _redact(fields).items():
            out.setdefault(name, value)
    if record.exc_info and record.exc_info[0] is not None:
        # The class and message only: tracebacks can quote locals' reprs (payload bytes) in some tools.
        exc = record.exc_info[1]
        out["error"] = type(exc).__name__
        out["error_detail"] = str(exc)[:500]
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, pid, thread, then the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_base(record), default=str, separators=(",", ":"))


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=... msg="..." field=value``: greppable and still structured."""

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for name, value in _base(record).items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            if not text or any(c in text for c in ' ="\n'):
                text = json.dumps(text)
            parts.append(f"{name}={text}")
        return " ".join(parts)


def open_log_file(path: Path) -> int:
    """An append-only descriptor on the agent's log file (mode 600), its directory made if needed;
    a path that cannot be used is a ConfigurationError naming it, not a traceback."""
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.paths import make_dirs

    hint = ("Set log.file (--set log.file=PATH) to a file this user can write, or to \"\" for the "
            "default (stderr in the foreground, <api.socket_dir>/agent.log in the background)")
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    try:
        make_dirs(path.parent)  # (a file in the way: "Not a directory", not mkdir's "File exists")
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            # A link: followed only where no other user could have made or swapped it (/dev/stderr, a
            # directory of ours); in a directory others may write it may lead to ~/.bashrc.
            if not _only_owner_writes(path.parent):
                raise ConfigurationError(
                    f"the agent's log file {path} is a symbolic link in a directory other users may write: "
                    "not followed", hint=hint) from None
            fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise ConfigurationError(f"cannot open the agent's log file {path}: {exc.strerror or exc}",
                                 hint=hint) from None
    st = os.fstat(fd)
    if not stat.S_ISCHR(st.st_mode) and st.st_uid != os.getuid():  # (/dev/null is root's, and fine)
        os.close(fd)
        raise ConfigurationError(f"the agent's log file {path} belongs to uid {st.st_uid}, not to this user "
                                 f"(uid {os.getuid()}): its owner would read every line", hint=hint)
    return fd


def _only_owner_writes(directory: Path) -> bool:
    """Whether only the directory's owner, this user or root, may add or replace entries in it."""
    try:
        st = os.stat(directory)
    except OSError:
        return False
    return st.st_uid in (os.getuid(), 0) and not stat.S_IMODE(st.st_mode) & 0o022


def configure(level: str = "info", fmt: str = "json", file: Path | None = None,
              stream: TextIO | None = None) -> logging.Handler:
    """Route every logger of the process through one structured handler (idempotent)."""
    global _configured_handler
    if fmt not in ("json", "kv"):
        raise ValueError(f"log format must be json or kv, not {fmt!r}")
    handler: logging.Handler
    if file is not None:
        fd = open_log_file(file)
        handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1, encoding="utf-8"))
    else:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    with _lock:
        if _configured_handler is not None:
            root.removeHandler(_configured_handler)
            _configured_handler.close()
        root.addHandler(handler)
        _configured_handler = handler
    root.setLevel(_LEVELS.get(level, logging.INFO))
    # Libraries that chat at INFO would drown the agent's own events.
    for noisy in ("asyncio", "zmq.auth", "py4j"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return handler


def event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` with structured fields (redacted if they look secret)."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"fields": fields})
