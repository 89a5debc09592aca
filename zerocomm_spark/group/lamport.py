"""Lamport logical clock of one member (thesis 7.3).

Every data message carries its publisher's timestamp. The clock ticks on every send and observes
every delivered message, so a message sent after another was delivered to its sender always
carries a larger timestamp: sorting by ``(lamport, publisher DID)`` is a total order consistent with
causality, with no clock synchronisation between members.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["MAX_JUMP", "MAX_TIME", "LamportClock"]

log = logging.getLogger(__name__)

#: The largest timestamp (the wire format's int64 limit): the clock stops there rather than stamp a
#: message no member would accept, which would stall its publisher's stream for good.
MAX_TIME = 2**63 - 1
#: How far past its own clock a member lets one received timestamp move it. A stamp further ahead
#: comes from a faulty or hostile publisher (an honest one would need ~10^12 more events than the
#: receiver has seen): the message is delivered, but observing all of it would let one message drag
#: every clock to MAX_TIME, where timestamps tie and stop telling causal order; capped, that takes
#: millions of such messages.
MAX_JUMP = 2**40


class LamportClock:
    """A thread-safe Lamport clock; publishers and the receive path share one per member.

    ``reserve`` makes it durable across restarts: before the clock passes the last value it returned,
    it is called (under the clock's lock) with the new time and must save, and return, a limit at
    or past it; a restarted member starts its clock at the last saved limit, so it stamps nothing
    at or below a timestamp it issued before (its new messages would sort before its old ones). A
    reservation covers many ticks, so saving is rare; one that fails is logged and the clock goes on.
    """

    __slots__ = ("_limit", "_lock", "_reserve", "_time")

    def __init__(self, start: int = 0, *, reserve: Callable[[int], int] | None = None) -> None:
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"a Lamport clock starts at a non-negative integer, got {start!r}")
        self._lock = threading.Lock()
        self._time = min(start, MAX_TIME)
        self._reserve = reserve
        self._limit = self._time

    def _advance_locked(self, new: int) -> None:
        if new > self._limit and self._reserve is not None:
            try:
                self._limit = max(new, int(self._reserve(new)))
            except Exception as exc:  # noqa: BLE001 - stamping goes on; only a restart could repeat a time
                self._limit = new
                log.warning("the Lamport clock's reservation was not saved (%s); after a restart this member "
                            "could stamp messages before ones it sent", type(exc).__name__)
        self._time = new

    @property
    def time(self) -> int:
        """The last timestamp issued or observed."""
        return self._time

    def tick(self, n: int = 1) -> int:
        """Reserve ``n`` consecutive timestamps for sends; returns the first.

        Reserving a block lets a publisher stamp a whole burst under one lock acquisition. At
        MAX_TIME the clock saturates: the stamps repeat MAX_TIME (still valid on the wire).
        """
        if n < 1:
            raise ValueError("tick() reserves at least one timestamp")
        with self._lock:
            first = min(self._time + 1, MAX_TIME)
            self._advance_locked(min(self._time + n, MAX_TIME))
            return first

    def observe(self, ts: int) -> int:
        """Account for a received timestamp; later sends are stamped after it. Returns the clock."""
        with self._lock:
            if ts > self._time:
                self._advance_locked(min(ts, MAX_TIME))
            return self._time
