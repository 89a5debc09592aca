"""TTL cache of message ids: the relay cache of seed 003, used to drop duplicate deliveries.

Retransmissions, a publisher re-sending after a restart and an application retrying ``publish``
with the same message ids all reach receivers more than once; a receiver remembers each id for at
least ``ttl`` seconds and delivers it once.

The cache is checked for every delivered message, so it must cost well under a microsecond: instead
of a timestamp per key it keeps two generations of plain sets and rotates them every ``ttl``
seconds (a key is remembered for ``ttl`` to ``2 * ttl``). It is bounded in entries too, so a flood
of distinct ids cannot grow memory without limit: when the current generation holds half of
``max_entries`` it rotates early, and the oldest generation is forgotten first (counted in
``evicted``), the same order expiry would forget them in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable

__all__ = ["TTLCache"]


class TTLCache:
    """Remembers keys for at least ``ttl`` seconds, at most ``max_entries`` at once; thread-safe."""

    __slots__ = ("_clock", "_current", "_lock", "_max_gen", "_previous", "_rotate_at", "_ttl", "evicted")

    def __init__(self, ttl: float, max_entries: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be positive seconds, got {ttl!r}")
        if not isinstance(max_entries, int) or max_entries < 2:
            raise ValueError(f"max_entries must be an integer >= 2, got {max_entries!r}")
        self._ttl = float(ttl)
        self._max_gen = max_entries // 2
        self._clock = clock
        self._lock = threading.Lock()
        self._current: set[Hashable] = set()
        self._previous: set[Hashable] = set()
        self._rotate_at = clock() + self._ttl
        self.evicted = 0  # forgotten before their TTL because the cache was full

    def __len__(self) -> int:
        with self._lock:
            self._maybe_rotate(self._clock())
            return len(self._current) + len(self._previous)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            self._maybe_rotate(self._clock())
            return key in self._current or key in self._previous

    def check_and_add(self, key: Hashable) -> bool:
        """True if ``key`` was seen within the TTL (a duplicate); otherwise remember it, return False.

        A duplicate does not extend its key's lifetime: the TTL bounds how long after the first copy
        a late copy is still recognised, as in the relay cache's "forget k" transition.
        """
        now = self._clock()
        with self._lock:
            if now >= self._rotate_at:
                self._maybe_rotate(now)
            if key in self._current or key in self._previous:
                return True
            self._current.add(key)
            if len(self._current) >= self._max_gen:
                self._rotate(now, early=True)
            return False

    def check_and_add_many(self, keys: Iterable[Hashable]) -> list[bool]:
        """``check_and_add`` for a batch under one lock and one clock read: True marks a duplicate."""
        now = self._clock()
        out: list[bool] = []
        append = out.append
        with self._lock:
            if now >= self._rotate_at:
                self._maybe_rotate(now)
            current, previous = self._current, self._previous
            limit = self._max_gen
            for key in keys:
                if key in current or key in previous:
                    append(True)
                    continue
                current.add(key)
                append(False)
                if len(current) >= limit:
                    self._rotate(now, early=True)
                    current, previous = self._current, self._previous
        return out

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` (e.g. when its delivery failed and a copy must be accepted again)."""
        with self._lock:
            self._current.discard(key)
            self._previous.discard(key)

    def clear(self) -> None:
        with self._lock:
            self._current = set()
            self._previous = set()

    def _maybe_rotate(self, now: float) -> None:
        if now >= self._rotate_at + self._ttl:  # idle for two periods: everything expired
            self._previous = set()
            self._current = set()
            self._rotate_at = now + self._ttl
        elif now >= self._rotate_at:
            self._rotate(now, early=False)

    def _rotate(self, now: float, *, early: bool) -> None:
        if early:
            self.evicted += len(self._previous)
        self._previous = self._current
        self._current = set()
        self._rotate_at = now + self._ttl
