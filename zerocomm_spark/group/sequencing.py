"""Receive state of one publisher's stream at one member: FIFO delivery, hold-back, gaps, duplicates.

Sequence numbers are per (group, publisher), from 1 and contiguous, so a receiver knows exactly
what it has and what it lacks: anything below ``next_seq`` is a duplicate, anything above it that
arrives early is held back (ordered streams) until the hole before it is filled by a
retransmission, and the holes themselves are the ranges to NACK. Unordered streams deliver on
arrival but track holes the same way, so acks (highest contiguous seq) mean the same thing.

A new subscriber does not know where its stream starts (the publisher may be at seq 10,000 when it
joins): until a baseline arrives (a hello, a resend answer, or a restored position) messages are
kept aside, bounded, and released once it is known.

Not thread-safe: one receive thread owns every stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Generic, TypeVar

__all__ = ["Offer", "PublisherStream"]

T = TypeVar("T")

_MAX_RANGES = 32  # ranges per NACK: enough to describe bursty loss without unbounded requests


class Offer(IntEnum):
    """What ``PublisherStream.offer`` did with a message."""

    DELIVER = 0  # returned for delivery now (possibly with held messages after it)
    HELD = 1  # early: kept until the hole before it is filled
    DUPLICATE = 2  # already delivered or already held
    OVERFLOW = 3  # early and the hold-back buffer is full: dropped, will be NACKed again
    NO_BASELINE = 4  # kept aside until the stream's start is known


class PublisherStream(Generic[T]):
    """Per-publisher receive state; items are whatever the caller delivers (opaque here)."""

    __slots__ = (
        "_aside",
        "_clock",
        "_gap_since",
        "_tail_since",
        "_held",
        "_held_bytes",
        "_size_of",
        "_last_nack",
        "_nack_out_at",
        "_nacks_out",
        "_returned",
        "announced",
        "duplicates",
        "highest",
        "hold_bytes_max",
        "hold_max",
        "lost",
        "next_seq",
        "ordered",
        "overflows",
    )

    def __init__(
        self,
        *,
        ordered: bool = True,
        hold_max: int = 100_000,
        next_seq: int | None = None,
        clock: Callable[[], float],
        hold_bytes_max: int | None = None,
        size_of: Callable[[T], int] | None = None,
    ) -> None:
        """``hold_bytes_max`` (with ``size_of``) bounds the bytes of items waiting, as ``hold_max``
        bounds their number: a publisher leaving a gap open must not make us hold 100,000 large
        messages. Past either bound a new early item is refused (OVERFLOW: not acked, so it is sent
        again once the gap is filled); one item alone is always taken."""
        if hold_max < 1:
            raise ValueError("hold_max must be at least 1")
        self.ordered = ordered
        self.hold_max = hold_max
        self.hold_bytes_max = hold_bytes_max
        self._size_of = size_of
        self._held_bytes = 0
        self.next_seq: int | None = next_seq  # first seq not yet delivered; None: baseline unknown
        self._held: dict[int, T | None] = {}  # ordered: early items; unordered: delivered markers (None)
        self._aside: dict[int, T] = {}  # received before the baseline was known
        self.highest = 0 if next_seq is None else next_seq - 1  # highest seq seen (or announced start)
        self.announced = 0  # highest seq the publisher said it has published
        self._clock = clock
        self._gap_since: float | None = None
        self._tail_since: float | None = None
        self._last_nack = float("-inf")
        self._nacks_out = 0  # resend requests sent and not answered yet (see nacks_sent)
        self._nack_out_at = float("-inf")
        self.duplicates = 0
        self.overflows = 0
        self.lost = 0  # seqs skipped because the publisher no longer had them
        self._returned = 0  # highest seq given back by undeliver (received, not taken)

    # --- state -------------------------------------------------------------------------------

    @property
    def delivered(self) -> int:
        """Highest seq delivered contiguously (0 before any, or before the baseline is known)."""
        return 0 if self.next_seq is None else self.next_seq - 1

    @property
    def has_baseline(self) -> bool:
        return self.next_seq is not None

    @property
    def held_count(self) -> int:
        return len(self._held) if self.ordered else 0

    @property
    def waiting_count(self) -> int:
        """Messages received but not delivered: held back or set aside before the baseline."""
        return (len(self._held) if self.ordered else 0) + len(self._aside)

    @property
    def held_bytes(self) -> int:
        """Bytes (by ``size_of``) of the items held back or set aside."""
        return self._held_bytes

    def _size(self, item: T) -> int:
        return self._size_of(item) if self._size_of is not None else 0

    def _too_big(self, item: T) -> bool:
        """Would holding ``item`` pass ``hold_bytes_max``? (Never when nothing is held.)"""
        if self.hold_bytes_max is None or self._held_bytes == 0:
            return False
        return self._held_bytes + self._size(item) > self.hold_bytes_max

    def lag(self) -> int:
        """How many seqs the publisher is known to have beyond what was delivered."""
        return max(0, max(self.highest, self.announced) - self.delivered)

    # --- input -------------------------------------------------------------------------------

    def offer(self, seq: int, item: T) -> tuple[Offer, list[T]]:
        """Take one received message; returns what happened and the items to deliver now, in order."""
        nxt = self.next_seq
        if nxt is None:
            if seq in self._aside:
                self.duplicates += 1
                return Offer.DUPLICATE, []
            if len(self._aside) >= self.hold_max or self._too_big(item):
                self.overflows += 1
                return Offer.OVERFLOW, []
            self._aside[seq] = item
            self._held_bytes += self._size(item)
            if seq > self.highest:
                self.highest = seq
            return Offer.NO_BASELINE, []
        if seq > self.highest:
            self.highest = seq
        if seq == nxt and not self._held:  # the fast path: in order, nothing waiting
            self.next_seq = nxt + 1
            self._update_gap()
            return Offer.DELIVER, [item]
        if seq < nxt or seq in self._held:
            self.duplicates += 1
            return Offer.DUPLICATE, []
        if self.ordered:
            if seq == nxt:
                out = [item]
                nxt += 1
                held = self._held
                while nxt in held:
                    released = held.pop(nxt)
                    self._held_bytes -= self._size(released)  # type: ignore[arg-type]
                    out.append(released)  # type: ignore[arg-type]
                    nxt += 1
                self.next_seq = nxt
                self._update_gap()
                return Offer.DELIVER, out
            if len(self._held) >= self.hold_max or self._too_big(item):
                self.overflows += 1
                self._update_gap()
                return Offer.OVERFLOW, []
            self._held[seq] = item
            self._held_bytes += self._size(item)
            self._update_gap()
            return Offer.HELD, []
        # Unordered: deliver now, remember the seq so a duplicate is recognised and acks stay contiguous.
        if seq != nxt and len(self._held) >= self.hold_max:
            self.overflows += 1
            self._update_gap()
            return Offer.OVERFLOW, []
        self._held[seq] = None
        held = self._held
        while nxt in held:
            del held[nxt]
            nxt += 1
        self.next_seq = nxt
        self._update_gap()
        return Offer.DELIVER, [item]

    def offer_all(self, items: Sequence[T], seq_of: Callable[[T], int]) -> tuple[list[T], int]:
        """Offer a batch (ascending seqs, as publishers send them); returns (deliverable, duplicates).

        The in-order run at the head of the batch, the common case, costs no per-item calls.
        """
        out: list[T] = []
        dups = 0
        nxt = self.next_seq
        start = 0
        if nxt is not None and not self._held:
            for it in items:
                if seq_of(it) != nxt:
                    break
                out.append(it)
                nxt += 1
                start += 1
            if start:
                self.next_seq = nxt
                if nxt - 1 > self.highest:
                    self.highest = nxt - 1
        for it in items[start:] if start else items:
            status, got = self.offer(seq_of(it), it)
            if got:
                out.extend(got)
            elif status is Offer.DUPLICATE:
                dups += 1
        if start:
            self._update_gap()
        return out, dups

    def set_baseline(self, base: int) -> list[T]:
        """The stream starts after ``base``; only the first baseline counts. Returns releasable items."""
        if self.next_seq is not None:
            return []
        self.next_seq = base + 1
        if self.highest < base:
            self.highest = base
        aside, self._aside = self._aside, {}
        self._held_bytes -= sum(self._size(item) for item in aside.values())  # offered again below
        out: list[T] = []
        for seq in sorted(aside):
            if seq <= base:
                continue  # before this member's membership: not owed, not a loss
            _, items = self.offer(seq, aside[seq])
            out.extend(items)
        self._update_gap()
        return out

    def undeliver(self, seqs: Sequence[int]) -> None:
        """The consumer did not take these just-delivered seqs (its callback raised): they count as
        missing again, so acks stop below them, they are NACKed as a gap and taken when re-sent.
        Ordered, everything from the lowest on goes back (it was delivered after it). The request
        waits ``retry_after`` like any repeated NACK: a consumer that keeps failing is offered the
        messages at that pace, never in a loop."""
        nxt = self.next_seq
        if nxt is None or not seqs:
            return
        low = min(seqs)
        self._returned = max(self._returned, max(seqs), nxt - 1)
        if self.ordered:
            if low >= nxt:
                return
            self.next_seq = low
        else:
            failed = set(seqs)
            held = self._held
            if low < nxt:
                for seq in range(low, nxt):  # delivered and taken: marked, as if they came early
                    if seq not in failed:
                        held[seq] = None
                self.next_seq = low
            for seq in failed:
                held.pop(seq, None)
        self._last_nack = self._clock()
        self._update_gap()

    def received_upto(self, limit: int) -> int:
        """The highest seq up to ``limit`` received here, delivered or not: held back (unordered:
        delivered early) or given back by :meth:`undeliver`; ``delivered`` if none is beyond it."""
        top = max(self.delivered, self._returned if self._returned <= limit else 0)
        return max(top, max((seq for seq in self._held if seq <= limit), default=0))

    def note_announced(self, last: int) -> None:
        """The publisher said it published up to ``last``: a tail we lack is a gap too."""
        if last > self.announced:
            self.announced = last
            self._update_gap()

    def lacks(self, seq: int) -> bool:
        """Whether ``seq`` is still wanted here: not delivered, not held back (nor received early)."""
        return self.next_seq is not None and seq >= self.next_seq and seq not in self._held

    def withdraw_announced(self) -> int | None:
        """Forget an announced tail past what arrived (the publisher had none of it when asked).

        Returns the withdrawn announcement, or None if there was no tail. Announced again, it is a
        gap again: asked for once per announcement, never at every tick.
        """
        top = max(self.highest, self.delivered)
        if self.announced <= top:
            return None
        withdrawn, self.announced = self.announced, top
        self._update_gap()
        return withdrawn

    def skip(self, first: int, last: int, *, count_lost: bool = True) -> list[T]:
        """The publisher no longer holds ``first..last``: give up on them and release what follows.

        Only a range that covers the next expected seq is skipped; an older hole before it must be
        recovered first (it is re-requested, and the gone range is reported again then).
        ``count_lost=False`` is for seqs known to be delivered already (before a restart).
        """
        nxt = self.next_seq
        if nxt is None or last < nxt or first > nxt:
            return []
        held = self._held
        inside = sorted(s for s in held if s <= last)  # received while waiting: deliver, in order
        out: list[T] = []
        for s in inside:
            value = held.pop(s)
            if self.ordered:
                self._held_bytes -= self._size(value)  # type: ignore[arg-type]
                out.append(value)  # type: ignore[arg-type]
        if count_lost:
            self.lost += (last - nxt + 1) - len(inside)
        nxt = last + 1
        while nxt in held:
            value = held.pop(nxt)
            if self.ordered:
                self._held_bytes -= self._size(value)  # type: ignore[arg-type]
                out.append(value)  # type: ignore[arg-type]
            nxt += 1
        self.next_seq = nxt
        if self.highest < last:
            self.highest = last
        self._update_gap()
        return out

    # --- gaps --------------------------------------------------------------------------------

    def _upper(self) -> int:
        return max(self.highest, self.announced)

    def _update_gap(self) -> None:
        # Two kinds of gap, timed apart: a *hole* (something above it arrived, so it is most likely
        # lost) and a *tail* (the publisher announced seqs that have not arrived yet, which are
        # often just still in flight on the data path).
        nxt = self.next_seq
        hole = nxt is not None and nxt <= self.highest
        tail = nxt is not None and self.announced > max(self.highest, nxt - 1)
        if hole:
            if self._gap_since is None:
                self._gap_since = self._clock()
        else:
            self._gap_since = None
        if tail:
            if self._tail_since is None:
                self._tail_since = self._clock()
        else:
            self._tail_since = None
        if not hole and not tail:
            self._last_nack = float("-inf")

    @property
    def gap_since(self) -> float | None:
        """When the current gap (hole or announced tail) was first noticed (None: no gap)."""
        times = [t for t in (self._gap_since, self._tail_since) if t is not None]
        return min(times) if times else None

    def missing(self, limit: int | None = None, *, upper: int | None = None) -> list[tuple[int, int]]:
        """The inclusive seq ranges lacking between the delivered position and the highest known
        (or ``upper``), at most ``limit`` seqs past the delivered position."""
        nxt = self.next_seq
        if nxt is None:
            return []
        if upper is None:
            upper = self._upper()
        if limit is not None:
            upper = min(upper, nxt + limit - 1)
        ranges: list[tuple[int, int]] = []
        held = self._held
        seq = nxt
        while seq <= upper and len(ranges) < _MAX_RANGES:
            if seq in held:
                seq += 1
                continue
            start = seq
            while seq <= upper and seq not in held:
                seq += 1
            ranges.append((start, seq - 1))
        return ranges

    def due_nacks(self, nack_after: float, retry_after: float, limit: int | None = None,
                  *, tail_after: float | None = None, outstanding_for: float | None = None) -> list[tuple[int, int]]:
        """Ranges to request now, and marks them requested.

        A hole is due ``nack_after`` seconds after it was noticed, an announced tail after
        ``tail_after`` (default: the same), and nothing is asked again within ``retry_after``, nor
        while requests (:meth:`nacks_sent`) are unanswered, for up to ``outstanding_for`` seconds:
        a backlog's answers take longer than ``retry_after`` to arrive and be handled, and asking
        again meanwhile had the publisher send each range several times (measured: 54,784
        messages resent for 16,000 missing, and the answers queued up here in memory).
        """
        now = self._clock()
        if now - self._last_nack < retry_after:
            return []
        if self._nacks_out and outstanding_for is not None and now - self._nack_out_at < outstanding_for:
            return []
        hole_due = self._gap_since is not None and now - self._gap_since >= nack_after
        tail_wait = nack_after if tail_after is None else tail_after
        tail_due = self._tail_since is not None and now - self._tail_since >= tail_wait
        if not hole_due and not tail_due:
            return []
        ranges = self.missing(limit, upper=None if tail_due else self.highest)
        if ranges:
            self._last_nack = now
        return ranges

    def nacks_sent(self, count: int) -> None:
        """``count`` resend requests went out: no more are due until they are done (or time out)."""
        self._nacks_out += count
        self._nack_out_at = self._clock()

    def nack_done(self) -> None:
        """One resend request ended: answered, failed or never sent."""
        self._nacks_out = max(0, self._nacks_out - 1)

    def nack_answered(self) -> None:
        """An answer arrived: if a hole remains (the answer was capped), ask again without waiting."""
        self._last_nack = float("-inf")
