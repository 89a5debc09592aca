"""Named consumers' commit points: retention keeps what the slowest consumer has not consumed.

Why per consumer: two Spark queries (or a query and a CLI tail) reading one member move at their own
pace; with a single commit point the faster one would let retention drop rows the slower one still
needs. Each consumer commits its own point here and the journal prunes below the lowest of them.

``consumers.json`` holds ``{name: offset}`` behind a magic line and a crc32, replaced atomically and
fsynced on every change (commits are rare: once per Spark micro-batch). Names are not secret.
"""

from __future__ import annotations

import json
import re
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path

from zerocomm_spark.errors import ConfigurationError, JournalError
from zerocomm_spark.journal.files import write_atomic

__all__ = ["CONSUMERS_FILE", "ConsumerPoints", "check_consumer"]

CONSUMERS_FILE = "consumers.json"
_MAGIC = b"ZCJN\x01\n"
_NAME = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}\Z")  # \Z: "$" also matches before a final newline
MAX_CONSUMERS = 10_000


def check_consumer(name: object) -> str:
    """A consumer name: 1-200 characters of letters, digits and ``._:@/+=-``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"{name!r} is not a consumer name",
            hint="Name a consumer with 1-200 letters, digits or ._:@/+=- (for example spark-<query id>)")
    return name


class ConsumerPoints:
    """The commit point of each named consumer of one journal directory; thread-safe."""

    def __init__(self, directory: Path, points: Mapping[str, int], *, fsync: bool) -> None:
        self.directory = directory
        self._points = dict(points)
        self._fsync = fsync
        self._lock = threading.Lock()

    @classmethod
    def load(cls, directory: Path, *, fsync: bool = True) -> "ConsumerPoints":
        path = directory / CONSUMERS_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(directory, {}, fsync=fsync)
        body = raw[len(_MAGIC):-4]
        if not raw.startswith(_MAGIC) or len(raw) < len(_MAGIC) + 4 or \
                int.from_bytes(raw[-4:], "little") != zlib.crc32(body) & 0xFFFFFFFF:
            raise JournalError(f"{path} is damaged",
                               hint="Delete it to forget the consumers' commit points (retention then waits for "
                                    "their next commits)")
        try:
            data = json.loads(body)
            points = {check_consumer(k): int(v) for k, v in data.items()}
        except (ValueError, TypeError, AttributeError, ConfigurationError):
            raise JournalError(f"{path} is damaged (not a map of consumer -> offset)") from None
        return cls(directory, points, fsync=fsync)

    def _save(self, points: dict[str, int]) -> None:
        body = json.dumps(points, sort_keys=True, separators=(",", ":")).encode("utf-8")
        write_atomic(self.directory / CONSUMERS_FILE,
                     _MAGIC + body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little"), fsync=self._fsync)

    def points(self) -> dict[str, int]:
        with self._lock:
            return dict(self._points)

    def lowest(self) -> int | None:
        """The lowest commit point of any consumer, or None with no consumers."""
        with self._lock:
            return min(self._points.values()) if self._points else None

    def clamp(self, end: int) -> None:
        """Points beyond the journal's end (lost unsynced rows) come back to the end."""
        with self._lock:
            if any(v > end for v in self._points.values()):
                self._points = {k: min(v, end) for k, v in self._points.items()}
                self._save(self._points)

    def commit(self, name: str, offset: int) -> int:
        """Move ``name``'s point forward to ``offset`` (never back); returns its point now."""
        check_consumer(name)
        with self._lock:
            current = self._points.get(name)
            if current is not None and offset <= current:
                return current
            if current is None and len(self._points) >= MAX_CONSUMERS:
                raise JournalError(
                    f"the journal already tracks {MAX_CONSUMERS} consumers",
                    hint="Release consumers that are gone (Client.release) before adding more")
            points = dict(self._points)
            points[name] = offset
            self._save(points)
            self._points = points
            return offset

    def release(self, name: str) -> bool:
        """Forget ``name`` (a query that is gone for good); True if it was known."""
        check_consumer(name)
        with self._lock:
            if name not in self._points:
                return False
            points = {k: v for k, v in self._points.items() if k != name}
            self._save(points)
            self._points = points
            return True
