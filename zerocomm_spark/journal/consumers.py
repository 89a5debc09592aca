"""Named consumers' commit points: retention keeps what the slowest consumer has not consumed.

Why per consumer: two Spark queries (or a query and a CLI tail) reading one member move at their own
pace; with a single commit point the faster one would let retention drop rows the slower one still
needs. Each consumer commits its own point here and the journal prunes below the lowest of them.

Why consumers expire: a consumer that is gone without a ``release`` (a Spark query whose checkpoint
was deleted, a notebook closed mid-read) would otherwise hold retention back for good, and the
journal would grow until the disk is full. As Kafka forgets a group's offsets after
``offsets.retention.minutes``, a consumer that has not committed for ``expiry_s`` is forgotten (with
a warning naming it); if it comes back, its rows may be gone, which the reader reports as data loss.
What the forgotten consumers had consumed stays consumed: the highest of their points is kept as
``expired_floor``, the journal's commit point while no consumer is left (else the journal would
keep everything again, the opposite of why it forgot them).

Time is counted on the monotonic clock while the journal is open, so a machine suspended for a week,
or a wall clock set forward, does not forget every consumer at once; wall times are only saved, to
carry a consumer's age across restarts. After the journal opens every consumer has at least
``RESTART_GRACE_S`` (or the expiry, if shorter) to commit again, so an agent that was down for
longer than the expiry does not forget every query at its first retention pass.

``consumers.json`` holds ``{"consumers": {name: [offset, last commit in us since the epoch]},
"expired_floor": offset}`` behind a magic line (version 3) and a crc32, replaced atomically and fsynced on every
change (commits are rare: once per Spark micro-batch). A commit that does not move a point refreshes
its time in memory, and on disk at most every ``_REFRESH_S`` (or an eighth of the expiry). Files of
the first version (``{name: offset}``) load with their time set to the load, and of the second
(``{name: [offset, time]}``) with no floor. Names are not secret.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import zlib
from collections.abc import Mapping
from pathlib import Path

from zerocomm_spark.errors import ConfigurationError, JournalError
from zerocomm_spark.journal.files import write_atomic

__all__ = ["CONSUMERS_FILE", "ConsumerPoints", "check_consumer"]

CONSUMERS_FILE = "consumers.json"
_MAGIC_V1 = b"ZCJN\x01\n"  # {name: offset}
_MAGIC_V2 = b"ZCJN\x02\n"  # {name: [offset, last commit us]} (briefly, before expired_floor)
_MAGIC = b"ZCJN\x03\n"  # {"consumers": {name: [offset, last commit us]}, "expired_floor": offset}
_NAME = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}\Z")  # \Z: "$" also matches before a final newline
MAX_CONSUMERS = 10_000
#: After an open, a consumer is not forgotten for at least this long (or the expiry, if shorter).
RESTART_GRACE_S = 3600.0
_REFRESH_S = 3600.0  # a no-op commit's time is saved at most this often (or an eighth of the expiry)

log = logging.getLogger(__name__)


def check_consumer(name: object) -> str:
    """A consumer name: 1-200 characters of letters, digits and ``._:@/+=-``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"{name!r} is not a consumer name",
            hint="Name a consumer with 1-200 letters, digits or ._:@/+=- (for example spark-<query id>)")
    return name


def _wall_us() -> int:
    return time.time_ns() // 1000


def _mono() -> float:
    return time.monotonic()


class ConsumerPoints:
    """The commit point of each named consumer of one journal directory; thread-safe.

    ``expiry_s`` (None: never) is how long a consumer may go without a commit before :meth:`expire`
    forgets it; the journal's open is the object's creation (see RESTART_GRACE_S).
    """

    def __init__(self, directory: Path, points: Mapping[str, int], *, fsync: bool,
                 seen: Mapping[str, int] | None = None, expiry_s: float | None = None,
                 expired_floor: int = 0) -> None:
        self.directory = directory
        self._points = dict(points)
        wall, mono = _wall_us(), _mono()
        self.opened = mono
        # Last commit per consumer, wall clock (saved) and monotonic (what ages it): a loaded one is as
        # old as its saved time says, never from the future (a clock set back must not keep it for good).
        self._seen = {k: min((seen or {}).get(k, wall), wall) for k in self._points}
        self._alive = {k: mono - (wall - t) / 1e6 for k, t in self._seen.items()}
        self._saved = {k: mono for k in self._points}  # when each one's time was last saved
        self.expired_floor = expired_floor
        self.expiry_s = expiry_s
        self._fsync = fsync
        self._lock = threading.Lock()

    @classmethod
    def load(cls, directory: Path, *, fsync: bool = True, expiry_s: float | None = None) -> "ConsumerPoints":
        path = directory / CONSUMERS_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls(directory, {}, fsync=fsync, expiry_s=expiry_s)
        body = raw[len(_MAGIC):-4]
        if not raw.startswith((_MAGIC, _MAGIC_V2, _MAGIC_V1)) or len(raw) < len(_MAGIC) + 4 or \
                int.from_bytes(raw[-4:], "little") != zlib.crc32(body) & 0xFFFFFFFF:
            raise JournalError(f"{path} is damaged",
                               hint="Delete it to forget the consumers' commit points (retention then waits for "
                                    "their next commits)")
        seen: dict[str, int] = {}
        floor = 0
        try:
            data = json.loads(body)
            if raw.startswith(_MAGIC_V1):
                points = {check_consumer(k): _whole(v) for k, v in data.items()}
            else:
                # Version 2 briefly held the version 3 body too (before it had its own magic): tell by shape.
                flat = raw.startswith(_MAGIC_V2) and "expired_floor" not in data
                entries = data if flat else data["consumers"]
                points = {}
                for k, (offset, at) in entries.items():
                    points[check_consumer(k)] = _whole(offset)
                    seen[k] = _whole(at)
                floor = 0 if flat else _whole(data["expired_floor"])
        except (ValueError, TypeError, AttributeError, KeyError, ConfigurationError):
            raise JournalError(f"{path} is damaged (not a map of consumer -> [offset, time])") from None
        return cls(directory, points, fsync=fsync, seen=seen, expiry_s=expiry_s, expired_floor=floor)

    def _save(self, points: dict[str, int], seen: dict[str, int], floor: int) -> None:
        body = json.dumps({"consumers": {k: [v, seen[k]] for k, v in points.items()}, "expired_floor": floor},
                          sort_keys=True, separators=(",", ":")).encode("utf-8")
        write_atomic(self.directory / CONSUMERS_FILE,
                     _MAGIC + body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little"), fsync=self._fsync)

    def points(self) -> dict[str, int]:
        with self._lock:
            return dict(self._points)

    def last_commits(self) -> dict[str, int]:
        """When each consumer last committed (us since the epoch; the load's time for an old file)."""
        with self._lock:
            return dict(self._seen)

    def lowest(self) -> int | None:
        """The lowest commit point of any consumer, or None with no consumers."""
        with self._lock:
            return min(self._points.values()) if self._points else None

    def clamp(self, end: int) -> None:
        """Points beyond the journal's end (lost unsynced rows) come back to the end."""
        with self._lock:
            if any(v > end for v in self._points.values()) or self.expired_floor > end:
                self._points = {k: min(v, end) for k, v in self._points.items()}
                self.expired_floor = min(self.expired_floor, end)
                self._save(self._points, self._seen, self.expired_floor)

    def commit(self, name: str, offset: int) -> int:
        """Move ``name``'s point forward to ``offset`` (never back); returns its point now.

        Any commit, even one that moves nothing, says the consumer is alive (see :meth:`expire`).
        """
        check_consumer(name)
        wall, mono = _wall_us(), _mono()
        with self._lock:
            current = self._points.get(name)
            if current is not None and offset <= current:
                self._seen[name], self._alive[name] = wall, mono
                refresh = _REFRESH_S if self.expiry_s is None else min(_REFRESH_S, self.expiry_s / 8)
                if mono - self._saved.get(name, mono) >= refresh:
                    try:
                        self._save(self._points, self._seen, self.expired_floor)
                        self._saved[name] = mono
                    except OSError as exc:  # only the saved age is at stake: the point itself is unchanged
                        log.warning("journal %s: could not save when consumer %r last committed (%s)",
                                    self.directory.name, name, exc.strerror)
                return current
            if current is None and len(self._points) >= MAX_CONSUMERS:
                raise JournalError(
                    f"the journal already tracks {MAX_CONSUMERS} consumers",
                    hint="Release consumers that are gone (Client.release) before adding more")
            points = dict(self._points)
            points[name] = offset
            seen = dict(self._seen)
            seen[name] = wall
            self._save(points, seen, self.expired_floor)
            self._points, self._seen = points, seen
            self._alive[name] = self._saved[name] = mono
            return offset

    def release(self, name: str) -> bool:
        """Forget ``name`` (a query that is gone for good); True if it was known."""
        check_consumer(name)
        with self._lock:
            if name not in self._points:
                return False
            self._forget([name], max(self.expired_floor, self._points[name]))  # what it consumed stays consumed
            return True

    def expire(self) -> list[tuple[str, int]]:
        """Forget the consumers that have not committed for ``expiry_s``; returns (name, point) of each.

        Never within ``RESTART_GRACE_S`` (or the expiry, if shorter) of the journal's open. What they
        had consumed stays consumed: the highest of their points is kept as ``expired_floor``.
        """
        if self.expiry_s is None:
            return []
        now = _mono()
        if now < self.opened + min(RESTART_GRACE_S, self.expiry_s):
            return []
        with self._lock:
            gone = [(k, v) for k, v in self._points.items() if self._alive[k] + self.expiry_s <= now]
            if gone:
                self._forget([k for k, _ in gone], max(self.expired_floor, *(v for _, v in gone)))
            return gone

    def _forget(self, names: list[str], floor: int) -> None:
        """Drop ``names`` (lock held); saved first, so a failed save forgets nothing."""
        points = {k: v for k, v in self._points.items() if k not in names}
        seen = {k: v for k, v in self._seen.items() if k not in names}
        self._save(points, seen, floor)
        self._points, self._seen, self.expired_floor = points, seen, floor
        for k in names:
            self._alive.pop(k, None)
            self._saved.pop(k, None)


def _whole(value: object) -> int:
    """An int from the file (bool and float are damage: json gives them for true or 1.5)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("not an int")
    return value
