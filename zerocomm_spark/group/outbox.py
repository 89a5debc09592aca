"""Publisher side of reliability: the retransmission buffer, per-member acks, receipts, the window.

The publisher keeps every message until every current member has acked it, so any member can ask
for what it missed (NACK) and a member that went quiet can be pushed what it lacks. Two bounds keep
memory finite, each in messages and in payload bytes (a message may be up to max_message_bytes,
so a count alone could hold gigabytes):

* the *window*: at most ``window`` messages (``window_bytes`` bytes) may be unacked by the slowest
  *active* member; beyond it ``publish`` waits, with a deadline, and fails with
  :class:`BackpressureError`. Members marked inactive (keepalives failed) do not hold the window,
  so one dead member cannot stall a group; nor do members still checking their join (they ack
  nothing until it completes); nor do *stalled* members: alive, owed messages that were sent,
  and their ack has not advanced for ``ack_stall_s`` (``mark_ack_stalls``, called periodically),
  so one member that answers keepalives but never acks (hostile, or its delivery callback stuck)
  cannot stall every publisher for good (Kafka drops such a follower from the ISR the same way).
  A member that progresses, however slowly, never stalls. A stalled member holds the window again
  at its next ack, and so does a member back from inactive or done joining, however far behind:
  counting it from its ack would block every publisher until it had recovered all it lacks, and
  holding it out (an earlier version) let its lag grow while the others published, until retention
  dropped what it lacked. So it comes back with a *debt*: the window counts it from a window
  behind the newest message (in messages and bytes), the debt shrinking by half of each advance of
  its ack. The publishers go on at half its pace until it is within a window again, and nothing it
  lacks is dropped meanwhile (retention keeps what members holding the window lack). A publish
  from a delivery callback waits only past the retention limits, counted from the members' acks
  without debts: the acks it would wait for may wait on that very callback;
* the *retention* limit: messages owed only to members holding no window (inactive, stalled, or
  still checking their join) are dropped past ``retention_max`` messages (``retention_max_bytes``
  bytes); such a member learns the range is gone when it asks for it.

Receipts resolve when every *current* member has acked their last message; members added later do
not count (they were never owed earlier messages) and removed members stop counting. A member told
that messages are gone (retention dropped them before it acked them: ``note_gone``) skips them and
acks past them, so their receipts resolve with :class:`MessagesDroppedError` naming it, never as
delivered. (Dropped messages that still reach it on the data path are delivered and acked as usual.)

Seqs are reserved ahead (``reserve``, like the Lamport clock's): a publisher restarted after a crash
cannot know which seqs past its last saved position it used, so it continues after the reservation
and tells members the seqs between are ``void`` (it may never have used them): not lost.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from zerocomm_spark.deadlines import check_timeout
from zerocomm_spark.errors import BackpressureError, GroupError, MessagesDroppedError, PeerTimeoutError
from zerocomm_spark.group.datamessage import DataMessage
from zerocomm_spark.group.lamport import MAX_TIME

__all__ = ["MemberAckState", "Outbox", "PublishReceipt"]

log = logging.getLogger(__name__)

RETENTION_FULL_HINT = ("Members are not keeping up: retry later, give a longer timeout, or raise the retention "
                       "limits (retention_max, retention_max_bytes), which bound what a publisher keeps for members "
                       "behind; stats()['lag'] and the named members show who is behind")


@dataclass(slots=True)
class MemberAckState:
    """What the publisher knows about one member's progress on its stream."""

    acked: int  # highest seq the member delivered contiguously (or its base: not owed before)
    active: bool = True
    # When ``acked`` last advanced, or the clock last restarted: the member was added, came back
    # active, finished its join, or was caught up when more was sent (nothing was owed until then).
    last_progress: float = 0.0
    last_push: float = float("-inf")  # when we last pushed unacked messages to it
    joining: bool = False  # its join is being checked: it acks nothing yet, so it holds no window
    # Alive but its ack did not advance for ack_stall_s while owed: holds no window until it acks again.
    stalled: bool = False
    # Twice the messages the window lets the publishers run past ``acked`` beyond its size (``debt``):
    # set when the member holds the window again far behind (_hold_again_locked), less one for each
    # message it acks, so the window opens by one for every two; counted in halves, so a member
    # acking one message at a time opens it too.
    debt_halves: int = 0

    @property
    def holds_window(self) -> bool:
        return self.active and not self.joining and not self.stalled

    @property
    def debt(self) -> int:
        return self.debt_halves >> 1


class PublishReceipt:
    """The promise of a ``publish`` call: resolves when every current member acked its messages."""

    __slots__ = ("_done", "_error", "_last", "_outbox", "lamport_ts", "message_ids", "sent_at", "seqs")

    def __init__(self, outbox: Outbox, message_ids: tuple[str, ...], seqs: tuple[int, ...],
                 lamport_ts: tuple[int, ...], sent_at: float = 0.0) -> None:
        self._outbox = outbox
        self.message_ids = message_ids
        self.seqs = seqs
        self.lamport_ts = lamport_ts
        self.sent_at = sent_at  # what the messages carry as sent_at (epoch seconds), as every member gets it
        self._last = seqs[-1] if seqs else 0
        self._done = False  # guarded by the outbox's condition: no Event per publish
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the receipt resolved (acked by all, or failed because the group closed)."""
        return self._done

    def failed(self) -> bool:
        """Whether it resolved with an error: its messages were never acked by every member."""
        return self._done and self._error is not None

    def wait(self, timeout: float = 30.0) -> None:
        """Return once every current member acked; PeerTimeoutError naming the laggards otherwise.

        Always bounded: a member that never acks (gone, or partitioned) must not hang the caller. So
        ``timeout`` is a finite number of seconds, at most ``deadlines.MAX_TIMEOUT``, as for
        every call that waits on peers; 0 (or less) only checks. None, NaN and inf are refused
        (InvalidTimeoutError, a ConfigurationError): to wait longer, wait again.
        """
        timeout = check_timeout(timeout, "wait()'s timeout", only_check=True)
        deadline = time.monotonic() + max(timeout, 0.0)
        cond = self._outbox._cond  # noqa: SLF001
        with cond:
            while not self._done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                cond.wait(min(remaining, 1.0))
            # Read under the same lock: a receipt resolving (perhaps with an error) after the wait
            # must not be mistaken for one every member acked.
            done = self._done
            missing = [] if done else self._outbox._laggards_locked(self._last)  # noqa: SLF001
        if not done:
            if not missing:  # every member acked: it resolves with the progress that did it
                return
            shown = ", ".join(sorted(missing)[:8]) + (" ..." if len(missing) > 8 else "")
            raise PeerTimeoutError(
                f"{len(missing)} member(s) did not ack seq {self._last} of group {self._outbox.group!r} "
                f"within {round(timeout, 2):g}s: {shown}",
                hint="They may be down or slow; see stats()['peers_alive'], stats()['unacked'] and "
                     "stats()['ack_stalled'] (alive but not acking), or wait again: the messages stay "
                     "buffered for them, within the retention limits for those holding no window")
        if self._error is not None:
            raise self._error

    def _resolve(self, error: BaseException | None = None) -> None:
        """Mark resolved; the caller holds the outbox's condition and notifies it."""
        self._error = error
        self._done = True

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"PublishReceipt({len(self.seqs)} message(s), seqs {self.seqs[:1]}..{self.seqs[-1:]}, {state})"


class Outbox:
    """Retransmission buffer of one (group, publisher); thread-safe."""

    def __init__(self, group: str, *, window: int, retention_max: int, first_seq: int = 1,
                 clock: Callable[[], float] = time.monotonic, reserve: Callable[[int], int] | None = None,
                 void: tuple[int, int] | None = None, window_bytes: int | None = None,
                 retention_max_bytes: int | None = None, ack_stall_s: float | None = None) -> None:
        """``reserve(seq)``, called (under the lock) before a seq past the last reservation is used,
        must save and return a limit at or past ``seq``; ``void`` is a seq range before ``first_seq``
        this publisher may never have used (it skipped them after a restart) and holds nothing of.
        ``ack_stall_s``: seconds without ack progress, while owed, after which ``mark_ack_stalls``
        releases a member from the window (None: never)."""
        if window < 1:
            raise ValueError("window must be at least 1")
        if retention_max < window:
            raise ValueError("retention_max must be at least the window")
        if window_bytes is not None and window_bytes < 1:
            raise ValueError("window_bytes must be at least 1")
        if retention_max_bytes is not None and retention_max_bytes < (window_bytes or 1):
            raise ValueError("retention_max_bytes must be at least window_bytes")
        if ack_stall_s is not None and (isinstance(ack_stall_s, bool) or not isinstance(ack_stall_s, (int, float))
                                        or not 0 < ack_stall_s < float("inf")):
            raise ValueError(f"ack_stall_s must be None or a positive number of seconds, got {ack_stall_s!r}")
        self.group = group
        self.ack_stall_s = ack_stall_s
        self.window = window
        self.retention_max = retention_max
        self.window_bytes = window_bytes  # None: no bound in bytes
        self.retention_max_bytes = retention_max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._messages: deque[DataMessage] = deque()  # contiguous seqs from _first_seq
        # Payload bytes published since the start: through each held message (beside _messages),
        # through _first_seq - 1 (freed) and through _last_seq, so in-flight bytes are a subtraction.
        self._ends: deque[int] = deque()
        self._freed_bytes = 0
        self._total_bytes = 0
        self._first_seq = first_seq  # seq of _messages[0] (or the next to publish when empty)
        self._last_seq = first_seq - 1  # highest seq published
        self._start_seq = first_seq - 1  # where the sequence started: _last_seq still equal = nothing published
        self._unsent_seq = first_seq  # first seq not yet handed to the sender
        self._reserve = reserve
        self._reserved = first_seq - 1  # seqs up to here may be used without saving a reservation first
        self.void = void
        self._members: dict[str, MemberAckState] = {}
        self._receipts: deque[PublishReceipt] = deque()
        self._closed: BaseException | None = None
        # min over members holding the window of ack + debt (None: none holds it): what the window counts from
        self._active_floor: int | None = None
        self._active_floor_bytes = 0  # payload bytes published through the active floor
        self._hold_floor: int | None = None  # the same without debts: what a publish from a callback counts from
        # member -> [first, last] seq ranges it was told are gone (retention dropped them before it
        # acked them): their receipts fail rather than resolve when it acks past them (pruned once
        # no pending receipt covers them)
        self._dropped: dict[str, list[list[int]]] = {}
        self.retention_dropped = 0
        self.backpressure_waits = 0
        self.ack_stalls = 0  # members released from the window by mark_ack_stalls, counted each time

    # --- members -----------------------------------------------------------------------------

    def add_member(self, did: str, base: int | None = None) -> int:
        """Owe ``did`` every message after ``base`` (default: from the next one). Returns the base.

        Re-adding a member keeps its progress: a restarted member still gets what it missed.
        """
        with self._lock:
            state = self._members.get(did)
            if state is not None:
                return state.acked
            if base is None:
                base = self._last_seq
            base = min(base, self._last_seq)
            if base < self._first_seq - 1:
                base = self._first_seq - 1  # older messages are gone already
            self._members[did] = MemberAckState(base, True, self._clock())
            self._recompute_floor_locked()
            return base

    def continue_after(self, seq: int) -> bool:
        """Start the sequence after ``seq`` if nothing was published yet (members' bases move with it).

        False if messages were published already (their seqs stand) and ``seq`` is past them.
        """
        with self._lock:
            if seq <= self._last_seq:
                return True
            if self._last_seq != self._start_seq:
                return False
            self._first_seq = self._unsent_seq = seq + 1
            self._last_seq = self._start_seq = seq
            for state in self._members.values():
                state.acked, state.debt_halves = max(state.acked, seq), 0
            self._recompute_floor_locked()
            return True

    def remove_member(self, did: str) -> None:
        with self._lock:
            self._dropped.pop(did, None)  # removed members stop counting
            if self._members.pop(did, None) is not None:
                self._progress_locked()

    def set_active(self, did: str, active: bool) -> None:
        """Inactive members stop holding the window (and may lose retention beyond its limit).

        A member coming back holds the window at once, however far behind, with a debt (see the
        module's docstring): the publishers go on at half its pace while it recovers what it missed,
        rather than wait for all of it, and lose it nothing. A stalled member stays stalled across
        this: only its acks re-admit it, so toggling its keepalives changes nothing."""
        with self._lock:
            state = self._members.get(did)
            if state is not None and state.active != active:
                state.active = active
                if active:
                    state.last_progress = self._clock()
                self._hold_again_locked(state)
                self._progress_locked()

    def set_joining(self, did: str, joining: bool) -> None:
        """A member checking its join acks nothing yet: like an inactive one, it holds no window and
        what only it lacks is kept within the retention limits (it is still pushed heartbeats)."""
        with self._lock:
            state = self._members.get(did)
            if state is not None and state.joining != joining:
                state.joining = joining
                if not joining:  # it acks from now on: its ack_stall_s starts now, not when it was added
                    state.last_progress = self._clock()
                self._hold_again_locked(state)
                self._progress_locked()

    def members(self) -> dict[str, MemberAckState]:
        with self._lock:
            return {did: MemberAckState(s.acked, s.active, s.last_progress, s.last_push, s.joining, s.stalled,
                                        s.debt_halves)
                    for did, s in self._members.items()}

    def stalled_members(self) -> list[str]:
        """Members released from the window by ``mark_ack_stalls`` and not re-admitted since."""
        with self._lock:
            return sorted(did for did, s in self._members.items() if s.stalled)

    def base_of(self, did: str) -> int | None:
        """The member's acked position (its stream starts after it), or None if not a member."""
        with self._lock:
            state = self._members.get(did)
            return None if state is None else state.acked

    # --- publishing --------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def sent_seq(self) -> int:
        """Highest seq handed to the sender (the wire), as far as the outbox knows."""
        return self._unsent_seq - 1

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight_locked()

    def _in_flight_locked(self) -> int:
        floor = self._active_floor
        return 0 if floor is None else self._last_seq - floor

    def _in_flight_bytes_locked(self) -> int:
        return 0 if self._active_floor is None else self._total_bytes - self._active_floor_bytes

    def _held_for_holders_locked(self) -> tuple[int, int]:
        """Messages and bytes the members holding the window have not acked, debts not counted."""
        floor = self._hold_floor
        if floor is None:
            return 0, 0
        return self._last_seq - floor, self._total_bytes - self._bytes_through_locked(floor)

    def held_bytes(self) -> int:
        """Payload bytes of the messages held."""
        with self._lock:
            return self._total_bytes - self._freed_bytes

    def _recompute_floor_locked(self) -> None:
        """The slowest active member's ack (with its debt, and without), cached: publish() reads it on
        every call."""
        floor = hold = None
        for s in self._members.values():
            if s.holds_window:
                acked = s.acked
                if hold is None or acked < hold:
                    hold = acked
                acked += s.debt_halves >> 1
                if floor is None or acked < floor:
                    floor = acked
        self._active_floor, self._hold_floor = floor, hold
        if floor is not None:
            self._active_floor_bytes = self._bytes_through_locked(floor)

    def _bytes_through_locked(self, seq: int) -> int:
        """Payload bytes published through ``seq`` (messages before _first_seq are no longer held)."""
        i, ends = seq - self._first_seq, self._ends
        return ends[i] if 0 <= i < len(ends) else self._freed_bytes if i < 0 else self._total_bytes

    def _within_window_locked(self, acked: int) -> bool:
        """Whether a member acked through ``acked`` lacks at most a window (messages and bytes)."""
        return self._last_seq - acked <= self.window and (
            self.window_bytes is None or self._total_bytes - self._bytes_through_locked(acked) <= self.window_bytes)

    def _hold_again_locked(self, state: MemberAckState) -> None:
        """``state`` holds the window again (back from inactive or stalled, or done joining): with the
        debt that counts it from a window behind the newest message, in messages and bytes, if it is
        further behind (none while it holds no window). Counted from its ack, it would block every
        publisher until it had recovered all it lacks; held out until it was within a window (an
        earlier version), one slower than the publishers never got back, and retention dropped what
        it lacked."""
        if not state.holds_window:  # still joining, inactive or stalled: what comes back first sets it
            state.debt_halves = 0
            return
        acked = state.acked
        at = max(acked, self._last_seq - self.window)
        need = None if self.window_bytes is None else self._total_bytes - self.window_bytes
        if need is not None and self._bytes_through_locked(at) < need:
            # The first message through which that many bytes were published (ends never decrease).
            at = min(self._last_seq, max(at, self._first_seq + bisect.bisect_left(self._ends, need)))
        state.debt_halves = 2 * (at - acked)

    def append(
        self,
        payloads: Sequence[bytes],
        message_ids: Sequence[str],
        headers: Mapping[str, str] | Sequence[Mapping[str, str] | None] | None,
        stamp: Callable[[int], int],
        timeout: float,
        *,
        in_callback: bool = False,
    ) -> PublishReceipt:
        """Assign seqs and timestamps to ``payloads`` once the window allows, buffer them, return a receipt.

        ``headers``: one mapping (or None) for every message, or a sequence of one per message.

        ``stamp(n)`` reserves n Lamport timestamps and returns the first; it is called under the
        outbox lock so seq order and timestamp order agree. ``in_callback`` (a publish from a delivery
        callback) waits only past the retention limits, not the window: two members publishing to
        each other from their callbacks would each wait for acks that only the other's callback
        returning lets it send.
        """
        # NaN or inf: the window wait would never end.
        timeout = check_timeout(timeout, "publish's timeout", only_check=True)
        n = len(payloads)
        nbytes = sum(map(len, payloads))
        deadline: float | None = None
        with self._cond:
            waited = False
            while True:
                if self._closed is not None:
                    raise self._closed
                full = self._full_locked(n, nbytes, in_callback)
                if full is None:
                    break
                if deadline is None:
                    deadline = self._clock() + max(timeout, 0.0)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    inflight, inflight_bytes, retention = full
                    # The retention limits count what is held: no debts. The window counts them: a member
                    # recovering from far behind is named with what it lacks, more than the window says.
                    debt = 0 if retention else 1
                    floor = min((s.acked + debt * s.debt for s in self._members.values() if s.holds_window),
                                default=self._last_seq)
                    slow = sorted(((d, s) for d, s in self._members.items()
                                   if s.holds_window and s.acked + debt * s.debt <= floor), key=lambda x: x[0])
                    shown = ", ".join(d + (f" (recovering, {self._last_seq - s.acked} behind)" if debt * s.debt else "")
                                      for d, s in slow[:8]) + (" ..." if len(slow) > 8 else "")
                    limit, limit_bytes = ((self.retention_max, self.retention_max_bytes) if retention
                                          else (self.window, self.window_bytes))
                    bound = (("retention limits (from a delivery callback)" if in_callback
                              else "retention limits" if retention else "window")
                             + f" ({limit} messages" + ("" if limit_bytes is None else f", {limit_bytes} bytes") + ")")
                    # Stalled members hold no window, so they are not why it waited; named apart, since
                    # their lag is what an operator sees growing.
                    stalled = sorted(d for d, s in self._members.items() if s.stalled)
                    also = "" if not stalled else (
                        f" ({len(stalled)} stalled member(s), holding no window until they ack again: "
                        + ", ".join(stalled[:8]) + (" ..." if len(stalled) > 8 else "") + ")")
                    raise BackpressureError(
                        f"publishing {n} message(s) ({nbytes} bytes) to group {self.group!r} waited {timeout:g}s: "
                        f"{inflight} message(s) ({inflight_bytes} bytes) count against the {bound}; "
                        f"slowest: {shown}{also}", hint=RETENTION_FULL_HINT if retention else None)
                if not waited:
                    waited = True
                    self.backpressure_waits += 1
                self._cond.wait(min(remaining, 0.5))
            if self._reserve is not None and self._last_seq + n > self._reserved:
                self._reserve_locked(self._last_seq + n)
            first_ts = stamp(n)
            now = time.time()
            first = self._last_seq + 1
            stamps = tuple(min(first_ts + i, MAX_TIME) for i in range(n))  # a saturated clock repeats MAX_TIME
            if headers is None or isinstance(headers, Mapping):
                msgs = [DataMessage(message_ids[i], first + i, stamps[i], now, payloads[i], headers)
                        for i in range(n)]
            else:
                msgs = [DataMessage(message_ids[i], first + i, stamps[i], now, payloads[i], headers[i])
                        for i in range(n)]
            self._messages.extend(msgs)
            ends, total = self._ends, self._total_bytes
            for p in payloads:
                total += len(p)
                ends.append(total)
            self._total_bytes = total
            self._last_seq += n
            receipt = PublishReceipt(self, tuple(message_ids), tuple(range(first, first + n)), stamps, now)
            if self._members and n:
                self._receipts.append(receipt)
            else:
                receipt._done = True  # noqa: SLF001 - nobody to wait for
            if not self._members or self._over_retention_locked():
                self._trim_locked()
            return receipt

    def _full_locked(self, n: int, nbytes: int, in_callback: bool) -> tuple[int, int, bool] | None:
        """None if ``n`` more messages (``nbytes``) may be published now; else what is in flight and
        whether the retention limits (not the window) are what is full. The window counts debts; the
        retention limits count what members holding the window lack, which bounds what is held (a
        debt member's ack can jump a range retention dropped, and must not open room for as much).
        One publish is let through whatever its size when nothing is in flight."""
        if not in_callback:
            inflight = self._in_flight_locked()
            # One publish of any size gets through only when no member holding the window lacks a message:
            # a debt can count one that does from the newest message.
            if inflight or (self._hold_floor is not None and self._hold_floor < self._last_seq):
                inflight_bytes = self._in_flight_bytes_locked()
                if inflight + n > self.window or (self.window_bytes is not None
                                                  and inflight_bytes + nbytes > self.window_bytes):
                    return inflight, inflight_bytes, False
            if self._hold_floor == self._active_floor:  # no debt counts: the window is the tighter bound
                return None
        held, held_bytes = self._held_for_holders_locked()
        if held and (held + n > self.retention_max or (self.retention_max_bytes is not None
                                                      and held_bytes + nbytes > self.retention_max_bytes)):
            return held, held_bytes, True
        return None

    def _reserve_locked(self, last: int) -> None:
        assert self._reserve is not None
        try:
            self._reserved = max(last, int(self._reserve(last)))
        except Exception as exc:  # noqa: BLE001 - publishing goes on; only a crash could repeat a seq
            self._reserved = last
            log.warning("group %r: the seq reservation was not saved (%s); after a crash this member could "
                        "reuse seqs members hold", self.group, type(exc).__name__)

    def empty_receipt(self) -> PublishReceipt:
        """A resolved receipt for a publish of nothing."""
        receipt = PublishReceipt(self, (), (), ())
        receipt._done = True  # noqa: SLF001
        return receipt

    def take_unsent(self, max_messages: int, max_bytes: int | None = None) -> list[DataMessage]:
        """The next messages to put on the wire, oldest first (each is taken once)."""
        with self._lock:
            start = self._unsent_seq - self._first_seq
            if start < 0:  # dropped before being sent (cannot happen with retention >= window)
                self._unsent_seq = self._first_seq
                start = 0
            end = min(len(self._messages), start + max_messages)
            out: list[DataMessage] = []
            size = 0
            for i in range(start, end):
                m = self._messages[i]
                size += len(m.payload)
                if out and max_bytes is not None and size > max_bytes:
                    break
                out.append(m)
            if out:
                # Members that had everything sent so far were owed nothing until now: their ack has
                # not stalled while the group was idle, so their clock (ack_stall_s, heartbeats) starts here.
                sent, now = self._unsent_seq - 1, None
                for state in self._members.values():
                    if state.acked >= sent:
                        now = self._clock() if now is None else now
                        state.last_progress = now
            self._unsent_seq += len(out)
            return out

    def untake(self, seq: int) -> None:
        """Put messages from ``seq`` on back to unsent (their batch could not be sent)."""
        with self._lock:
            self._unsent_seq = max(self._first_seq, min(self._unsent_seq, seq))

    def unsent_count(self) -> int:
        with self._lock:
            return self._last_seq - self._unsent_seq + 1

    # --- acks and retransmission ---------------------------------------------------------------

    def ack(self, did: str, seq: int) -> bool:
        """Record that ``did`` delivered up to ``seq``; returns whether it was progress.

        Capped at what was sent: a member cannot have delivered a message not yet put on the wire,
        so an ack past it (a buggy or lying member) must not resolve receipts or free messages early.
        """
        with self._lock:
            state = self._members.get(did)
            if state is None:
                return False
            seq = min(seq, self._unsent_seq - 1)
            if seq <= state.acked:
                return False
            advance, state.acked = seq - state.acked, seq
            state.last_progress = self._clock()
            if state.debt_halves:  # gone within a window; never counted past the newest message
                state.debt_halves = 0 if self._within_window_locked(seq) else max(
                    0, min(state.debt_halves - advance, 2 * (self._last_seq - seq)))
            if state.stalled:
                state.stalled = False
                self._hold_again_locked(state)
                log.info("group %r: member %s acks again (ack %d, %d behind) and holds the publish window again%s",
                         self.group, did, seq, self._last_seq - seq,
                         ", the publishers going on at half its pace until it is within a window" if state.debt else "")
            self._progress_locked()
            return True

    def get_range(self, first: int, last: int | None, max_messages: int,
                  max_bytes: int | None = None) -> tuple[list[DataMessage], tuple[int, int] | None]:
        """Messages ``first..last`` still held (bounded), and the leading range no longer held."""
        with self._lock:
            top = min(self._last_seq, self._unsent_seq - 1,  # never resend what was not sent yet
                      self._first_seq + len(self._messages) - 1)  # nor what is not held (closed)
            if last is None or last > top:
                last = top
            gone: tuple[int, int] | None = None
            if first < self._first_seq:
                gone_last = min(last, self._first_seq - 1)
                if first <= gone_last:
                    gone = (first, gone_last)
                first = self._first_seq
            out: list[DataMessage] = []
            size = 0
            for seq in range(first, min(last, first + max_messages - 1) + 1):
                m = self._messages[seq - self._first_seq]
                size += len(m.payload)
                if out and max_bytes is not None and size > max_bytes:
                    break
                out.append(m)
            return out, gone

    def note_gone(self, did: str, first: int, last: int) -> None:
        """``did`` was told ``first..last`` are gone: it skips those it lacks and acks past them.

        The receipts covering them then fail with MessagesDroppedError naming it instead of
        resolving as delivered. Seqs it had acked already are not counted.
        """
        with self._lock:
            state = self._members.get(did)
            if state is None or not self._receipts:
                return  # no pending receipt can cover them (each resolved once every member acked)
            first = max(first, state.acked + 1)
            if first > last:
                return
            # Merged with every range it overlaps or touches: the same seqs are reported again by each
            # answer covering them, and ranges left overlapping would count them twice in the error.
            kept: list[list[int]] = []
            for lo, hi in self._dropped.get(did, ()):
                if lo <= last + 1 and first <= hi + 1:
                    first, last = min(lo, first), max(hi, last)
                else:
                    kept.append([lo, hi])
            kept.append([first, last])
            self._dropped[did] = kept

    def heartbeats_due(self, after: float) -> list[tuple[str, int]]:
        """Active members lagging behind what was sent with no progress for ``after`` seconds.

        Marks them; the caller sends them a heartbeat with its last seq (a lost tail has no gap
        to NACK until the member learns the tail exists).
        """
        now = self._clock()
        sent = self._unsent_seq - 1
        out = []
        with self._lock:
            for did, s in self._members.items():
                if (s.active and s.acked < sent and now - s.last_progress >= after
                        and now - s.last_push >= after):
                    s.last_push = now
                    out.append((did, s.acked))
        return out

    def mark_ack_stalls(self) -> list[tuple[str, int, float]]:
        """Release from the window the members whose ack has not advanced for ``ack_stall_s`` while owed.

        Only members holding the window (active, not joining) stall, and only while they lag behind
        what was sent: nothing owed, nothing to ack. Waiting publishers are woken, and what only
        stalled members lack is kept within the retention limits (their receipts still wait for
        them, and fail with MessagesDroppedError if retention drops what they lack). Returns the
        newly stalled: (member, messages it has not acked, seconds since its ack last advanced).
        """
        after = self.ack_stall_s
        if after is None:
            return []
        with self._lock:
            now = self._clock()
            sent = self._unsent_seq - 1
            out = []
            for did, s in self._members.items():
                if s.holds_window and s.acked < sent and now - s.last_progress >= after:
                    s.stalled, s.debt_halves = True, 0
                    out.append((did, self._last_seq - s.acked, now - s.last_progress))
            if out:
                self.ack_stalls += len(out)
                self._progress_locked()
            return out

    def laggards(self, seq: int) -> list[str]:
        """Current members that have not acked ``seq``."""
        with self._lock:
            return self._laggards_locked(seq)

    def _laggards_locked(self, seq: int) -> list[str]:
        return [did for did, s in self._members.items() if s.acked < seq]

    def lag(self) -> dict[str, int]:
        """Unacked messages per member."""
        with self._lock:
            return {did: self._last_seq - s.acked for did, s in self._members.items()}

    def held(self) -> int:
        with self._lock:
            return len(self._messages)

    def close(self, error: BaseException | None = None) -> None:
        """Fail pending receipts and waiting publishers; the outbox keeps nothing."""
        err = error or GroupError(f"group {self.group!r} was closed before its messages were acked")
        with self._cond:
            self._closed = err
            receipts, self._receipts = list(self._receipts), deque()
            self._messages.clear()
            self._ends.clear()
            self._freed_bytes = self._total_bytes
            for r in receipts:
                r._resolve(err)  # noqa: SLF001
            self._cond.notify_all()

    # --- internals ---------------------------------------------------------------------------

    def _progress_locked(self) -> None:
        self._recompute_floor_locked()
        floor = min((s.acked for s in self._members.values()), default=self._last_seq)
        receipts = self._receipts
        dropped = self._dropped
        while receipts and receipts[0]._last <= floor:  # noqa: SLF001
            receipt = receipts.popleft()
            receipt._resolve(self._dropped_error_locked(receipt) if dropped else None)  # noqa: SLF001
        if dropped:
            if not receipts:
                dropped.clear()
            else:
                first_pending = receipts[0].seqs[0]
                for did in list(dropped):
                    ranges = [r for r in dropped[did] if r[1] >= first_pending]
                    if ranges:
                        dropped[did] = ranges
                    else:
                        del dropped[did]
        self._trim_locked()
        self._cond.notify_all()

    def _dropped_error_locked(self, receipt: PublishReceipt) -> MessagesDroppedError | None:
        """The error of a receipt some of whose messages retention dropped for a member, or None."""
        if not receipt.seqs:
            return None
        first, last = receipt.seqs[0], receipt._last  # noqa: SLF001
        lacking: dict[str, int] = {}
        for did, ranges in self._dropped.items():
            n = sum(max(0, min(hi, last) - max(lo, first) + 1) for lo, hi in ranges)
            if n:
                lacking[did] = n
        if not lacking:
            return None
        names = sorted(lacking)
        shown = ", ".join(f"{did} ({lacking[did]})" for did in names[:8]) + (" ..." if len(names) > 8 else "")
        limit = f"retention_max={self.retention_max}" + (
            "" if self.retention_max_bytes is None else f", retention_max_bytes={self.retention_max_bytes}")
        return MessagesDroppedError(
            f"messages of seqs {first}-{last} in group {self.group!r} were dropped ({limit}) before these "
            f"members acked them, and were not delivered to them: {shown}")

    def _over_retention_locked(self) -> bool:
        return len(self._messages) > self.retention_max or (
            self.retention_max_bytes is not None and self._total_bytes - self._freed_bytes > self.retention_max_bytes)

    def _trim_locked(self) -> None:
        """Free what every member acked; past the retention limits, what only members holding no window lack."""
        members = self._members.values()
        floor = min((s.acked for s in members), default=self._last_seq)
        floor = min(floor, self._unsent_seq - 1)  # keep what the sender has not taken yet
        msgs, ends = self._messages, self._ends
        while msgs and self._first_seq <= floor:
            msgs.popleft()
            self._freed_bytes = ends.popleft()
            self._first_seq += 1
        if self._over_retention_locked():
            active_floor = min((s.acked for s in members if s.holds_window), default=self._last_seq)
            active_floor = min(active_floor, self._unsent_seq - 1)
            while self._over_retention_locked() and self._first_seq <= active_floor:
                msgs.popleft()
                self._freed_bytes = ends.popleft()
                self._first_seq += 1
                self.retention_dropped += 1
        if not msgs:
            self._first_seq = self._last_seq + 1
