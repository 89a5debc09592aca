"""Lamport logical clock of one member (thesis 7.3).

Every data message carries its publisher's timestamp. The clock ticks on every send and observes
every delivered message, so a message sent after another was delivered to its sender always
carries a larger timestamp: sorting by ``(lamport, publisher DID)`` is a total order consistent with
causality, with no clock synchronisation between members.
"""

from __future__ import annotations

import threading

__all__ = ["LamportClock"]


class LamportClock:
    """A thread-safe Lamport clock; publishers and the receive path share one per member."""

    __slots__ = ("_lock", "_time")

    def __init__(self, start: int = 0) -> None:
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"a Lamport clock starts at a non-negative integer, got {start!r}")
        self._lock = threading.Lock()
        self._time = start

    @property
    def time(self) -> int:
        """The last timestamp issued or observed."""
        return self._time

    def tick(self, n: int = 1) -> int:
        """Reserve ``n`` consecutive timestamps for sends; returns the first.

        Reserving a block lets a publisher stamp a whole burst under one lock acquisition.
        """
        if n < 1:
            raise ValueError("tick() reserves at least one timestamp")
        with self._lock:
            first = self._time + 1
            self._time += n
            return first

    def observe(self, ts: int) -> int:
        """Account for a received timestamp; later sends are stamped after it. Returns the clock."""
        with self._lock:
            if ts > self._time:
                self._time = ts
            return self._time
