"""Delivered group messages into the journal, before the publisher hears they arrived.

Why synchronous: the data plane calls ``on_messages`` on its receiver thread and acknowledges a
publisher's messages only after the callback returned (docs/groups.md, "Acks"). Appending inside the
callback therefore orders "journaled" before "acknowledged", which is what makes a ``kill -9`` lose
nothing that was acknowledged: the publisher keeps every unacknowledged message and re-sends it to
the restarted member, and the journal skips what it already holds (same publisher and seq, or a
recent message id), so nothing is journaled twice either.

If the journal cannot take a message (disk full, I/O error) the agent stops at once rather than
return from the callback: returning would let the message be acknowledged without being durable.
A row the journal refuses as invalid (it would be refused again after every restart) is the one
exception: it is skipped and counted, and the rows delivered with it are still journaled.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerocomm_spark.agent.logging import event
from zerocomm_spark.agent.metrics import Metrics
from zerocomm_spark.errors import InvalidJournalRowError, JournalClosedError, JournalTimeoutError, ZeroCommError
from zerocomm_spark.journal import Journal

__all__ = ["JournalIngest", "EXIT_JOURNAL_FAILED", "abort_on_journal_failure"]

log = logging.getLogger(__name__)

EXIT_JOURNAL_FAILED = 75  # EX_TEMPFAIL: a service manager restarts the agent; publishers re-send
_RETRIES = 3
_SKIPPED_OWN_MAX = 1 << 18  # own seqs recorded as skipped at once (as the data plane bounds a void range)


def _micros(seconds: float) -> int:
    return int(round(seconds * 1_000_000))


def _row(message: Any) -> dict[str, Any]:
    headers = getattr(message, "headers", None)
    return {
        "group": message.group,
        "message_id": message.message_id,
        "publisher_did": message.publisher_did,
        "seq": message.seq,
        "lamport_ts": message.lamport_ts,
        "sent_at": _micros(message.sent_at),
        "received_at": _micros(message.received_at),
        "headers": list(headers.items()) if headers else None,
        "payload": message.payload,
    }


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one ingest append did: rows journaled, rows the journal already had, rows refused."""

    appended: int
    duplicates: int
    rejected: frozenset[int] = frozenset()  # indexes into the rows given


class _Own:
    """Messages this member published, journaled once the group acknowledged them."""

    __slots__ = ("receipt", "rows", "done")

    def __init__(self, receipt: Any, rows: list[dict[str, Any]]) -> None:
        self.receipt = receipt
        self.rows = rows
        self.done = threading.Event()


class JournalIngest:
    """The group manager's ``on_message`` hook: one durable append per delivered message.

    It also journals this member's own messages, once every member acknowledged them, so the
    journal (and `history`, `tail`, a Spark query on this member) holds the whole group. Not at
    publish time: after a crash a publisher may reuse the seqs of messages nobody received, and
    the journal would then drop the new messages as duplicates of the old ones.
    """

    def __init__(self, journal: Journal, metrics: Metrics,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.journal = journal
        self.metrics = metrics
        self._on_fatal = on_fatal or abort_on_journal_failure
        self._cond = threading.Condition()
        self._closing = False
        self._waits_ended = False
        self._own: list[_Own] = []  # in seq order per group: a receipt resolves after all earlier ones
        self._own_cond = threading.Condition()
        self._own_stop = False  # close(): journal what is acked by then (until the drain deadline), then end
        self._own_last: dict[tuple[str, str], int] = {}  # (group, own DID) -> last own seq journaled or skipped
        self._drain_until = 0.0
        self._own_thread = threading.Thread(target=self._own_main, name="zerocomm-journal-own", daemon=True)
        self._own_thread.start()

    def track_own(self, receipt: Any, group: str, publisher: str, payloads: list[bytes], ids: list[str],
                  headers: Mapping[str, str] | Sequence[Mapping[str, str] | None] | None) -> threading.Event:
        """Journal these just-published messages when ``receipt`` resolves; the event is set then.

        ``headers``: one mapping for every message, or a sequence of one (or None) per message.

        Their ``sent_at`` is the receipt's: the time the data plane stamped on them, which every
        other member journals too. Callers publish and track under one lock per group, so entries
        are queued in seq order.
        """
        sent = _micros(receipt.sent_at)
        if headers is None or isinstance(headers, Mapping):
            pairs = [list(headers.items()) if headers else None] * len(ids)
        else:
            pairs = [list(h.items()) if h else None for h in headers]
        rows = [{"group": group, "message_id": mid, "publisher_did": publisher, "seq": seq, "lamport_ts": ts,
                 "sent_at": sent, "headers": head, "payload": payload}
                for mid, seq, ts, payload, head in zip(ids, receipt.seqs, receipt.lamport_ts, payloads, pairs)]
        entry = _Own(receipt, rows)
        with self._own_cond:
            self._own.append(entry)
            self._own_cond.notify_all()
        return entry.done

    def _take_own(self) -> list[_Own]:
        """The resolved entries that may go now: per group, only a prefix (they hold consecutive seqs)."""
        with self._own_cond:
            blocked: set[str] = set()
            take: list[_Own] = []
            for e in self._own:
                group = e.rows[0]["group"]
                if group in blocked:
                    continue
                if e.receipt.done():
                    take.append(e)
                else:
                    blocked.add(group)
            for e in take:
                self._own.remove(e)
            return take

    def _own_main(self) -> None:
        while not self._own_stop:
            take = self._take_own()
            if not take:
                with self._own_cond:
                    if not self._own_stop:
                        self._own_cond.wait(0.02)
                continue
            self._journal_own(take)
        # Stopping gracefully: what the group acked before it stopped is journaled before the journal
        # closes (a client told "published" reads it after a restart too), within the drain deadline.
        while time.monotonic() < self._drain_until:
            take = self._take_own()
            if not take:
                break
            self._journal_own(take)

    def _journal_own(self, take: list[_Own]) -> None:
        rows: list[dict[str, Any]] = []
        for e in take:
            try:
                e.receipt.wait(0)
            except Exception:  # noqa: BLE001 - not acknowledged (group left or closed): not journaled
                continue
            rows.extend(e.rows)
        if rows:
            self._skip_own_gaps(rows)
            result = self._append(rows)
            self.metrics.add(own_journaled=result.appended)
            for i, row in enumerate(rows):
                if i not in result.rejected:
                    self.metrics.journaled(row["group"], row["publisher_did"], row["seq"])
            with self._cond:
                self._cond.notify_all()
        for e in take:
            e.done.set()

    def _skip_own_gaps(self, rows: list[dict[str, Any]]) -> None:
        """Record the own seqs before and between ``rows`` that this journal will never hold, like void ones.

        Own messages are journaled in seq order, and only those the group acknowledged: seqs of a
        receipt that failed (a leave, or a stop while members lacked them) and seqs a restarted
        member continued after (the old process assigned them but never journaled them here) get
        no row here, ever. Unrecorded, they were a hole in this member's own stream that a reader
        walking its seqs (a Spark query with failOnDataLoss) took for lost messages, though their
        publish never returned success: a retried publish (same ids) delivers them under new seqs.
        Seqs left by an earlier run of this member are also logged (a warning): if the group had
        acknowledged them and nobody publishes them again, this member's journal lacks them.
        """
        by_key: dict[tuple[str, str], list[int]] = {}
        for row in rows:  # per group in seq order (see _take_own)
            by_key.setdefault((row["group"], row["publisher_did"]), []).append(row["seq"])
        for key, seqs in by_key.items():
            last = self._own_last.get(key)
            earlier_run = last is None
            if last is None:
                known = self.journal.latest().publishers.get(key)
                last = known.last_seq if known is not None else 0
            group, did = key
            for seq in seqs:
                if seq > last + 1:
                    self._record_own_gap(group, did, last + 1, seq - 1, earlier_run)
                earlier_run = False  # only the first gap of this run can be the earlier run's
                last = max(last, seq)
            self._own_last[key] = last

    def _record_own_gap(self, group: str, did: str, first: int, last: int, earlier_run: bool) -> None:
        held, at = [], first  # the ranges not recorded yet
        for a, b in self.journal.superseded(group, did, first, last):
            held.append((at, a - 1))
            at = max(at, b + 1)
        held.append((at, last))
        seqs = [s for a, b in held for s in range(a, b + 1)]
        if len(seqs) > _SKIPPED_OWN_MAX:
            event(log, logging.WARNING, "too many own seqs without a row to record as skipped",
                  group=group, first=first, last=last)
            return
        if not seqs:
            return
        if earlier_run:
            event(log, logging.WARNING, "own seqs published by the previous run of this member were never journaled "
                  "here; recorded as superseded (a publish retried with the same ids delivers them under new seqs)",
                  group=group, first=seqs[0], last=seqs[-1], count=len(seqs))
        self.on_superseded(group, did, seqs)

    def on_message(self, message: Any) -> None:
        """Append one delivered message (a ``Delivered``); returns only once the journal has it."""
        self.on_messages([message])

    def on_messages(self, messages: Any) -> None:
        """Append delivered messages in one journal record (group commit); returns once it has them.

        One record per delivery batch is what makes the journal fast to write and to read; used
        when the group manager offers a batch hook, else ``on_message`` calls it per message.
        """
        rows = [_row(m) for m in messages]
        if not rows:
            return
        result = self._append(rows)
        if result.duplicates:
            self.metrics.add(journal_duplicates=result.duplicates)
        if result.appended:
            self.metrics.add(messages_in=result.appended,
                             bytes_in=sum(len(r["payload"]) for i, r in enumerate(rows) if i not in result.rejected))
        for i, r in enumerate(rows):
            if i not in result.rejected:
                self.metrics.journaled(r["group"], r["publisher_did"], r["seq"])
        with self._cond:
            self._cond.notify_all()

    def on_superseded(self, group: str, publisher_did: str, seqs: list[int]) -> None:
        """Seqs the member dropped for a message id it had delivered before: recorded in the journal
        (before they are acked) so a reader walking the publisher's seqs does not call them lost."""
        try:
            self.journal.add_superseded(group, publisher_did, seqs)
        except Exception as exc:  # noqa: BLE001 - like a failed append: nothing is acked that is not durable
            if not (isinstance(exc, JournalClosedError) and self._closing):  # closing: the process is exiting
                self._on_fatal(exc)
            self._block_forever()

    def _append(self, rows: list[dict[str, Any]]) -> _Outcome:
        last: BaseException | None = None
        for attempt in range(_RETRIES):
            try:
                result = self.journal.append(rows)
                return _Outcome(result.appended, result.duplicates)
            except JournalTimeoutError as exc:  # outcome unknown: appending again is safe (dedup)
                last = exc
                event(log, logging.WARNING, "journal append timed out; retrying", attempt=attempt + 1)
            except InvalidJournalRowError as exc:
                if len(rows) > 1:  # refused whole: journal the rows that fit, one by one, in order
                    return self._append_each(rows)
                # Data that can never fit the journal (it would fail again after every restart, a crash
                # loop): say so loudly and go on. The data plane validates messages, so this is a bug.
                event(log, logging.ERROR, "a delivered message cannot be journaled; it was skipped",
                      group=rows[0].get("group"), seq=rows[0].get("seq"), reason=str(exc)[:300])
                self.metrics.add(journal_rejected=1)
                return _Outcome(0, 0, frozenset((0,)))
            except JournalClosedError as exc:
                if self._closing:
                    # Shutting down: do not return (that would acknowledge); the process is exiting.
                    self._block_forever()
                last = exc
                break
            except Exception as exc:  # noqa: BLE001 - any failure to persist is fatal, see the module doc
                last = exc
                break
        assert last is not None
        self._on_fatal(last)
        self._block_forever()
        raise AssertionError("unreachable")

    def _append_each(self, rows: list[dict[str, Any]]) -> _Outcome:
        """One append per row (a rare path: a batch holding a row the journal refuses), so that
        returning, which acknowledges them all, acknowledges nothing that was not journaled."""
        appended = duplicates = 0
        rejected: set[int] = set()
        for i, row in enumerate(rows):
            outcome = self._append([row])
            appended += outcome.appended
            duplicates += outcome.duplicates
            if outcome.rejected:
                rejected.add(i)
        return _Outcome(appended, duplicates, frozenset(rejected))

    def _block_forever(self) -> None:
        while True:
            time.sleep(3600)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` (checked after every append) or ``timeout``: long polls use it."""
        if not timeout > 0:  # also NaN, which no comparison below would ever end
            return predicate()
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or self._closing or self._waits_ended:
                    return predicate()
                self._cond.wait(min(left, 1.0))
        return True

    def end_waits(self) -> None:
        """Answer every long poll now (the agent is stopping): a parked read would otherwise hold the
        stop for the rest of its wait, or lose its answer when the API closes first."""
        with self._cond:
            self._waits_ended = True
            self._cond.notify_all()

    def close(self, drain_timeout: float = 5.0) -> None:
        """Stop taking deliveries and journal this member's own messages the group acked already.

        Call it after the group manager closed (no ack comes later), before the journal closes; the
        drain is bounded by ``drain_timeout`` seconds, and what it leaves is counted in the log."""
        self._closing = True
        with self._cond:
            self._cond.notify_all()
        with self._own_cond:
            self._drain_until = time.monotonic() + max(drain_timeout, 0.0)
            self._own_stop = True
            self._own_cond.notify_all()
        self._own_thread.join(max(drain_timeout, 0.0) + 2.0)
        with self._own_cond:
            left = sum(len(e.rows) for e in self._own if e.receipt.done() and _acked(e.receipt))
        if left or self._own_thread.is_alive():
            # The other members journaled them (they acked them); only this member's history lacks them.
            event(log, logging.WARNING, "own messages acked by the group were not journaled here before the stop "
                  "deadline; the other members have them (raise agent.stop_timeout to give the journal more time)",
                  messages=left if left else "unknown (a journal append was still running)", drain_timeout=drain_timeout)


def _acked(receipt: Any) -> bool:
    try:
        receipt.wait(0)
    except Exception:  # noqa: BLE001 - failed (group left or closed): never journaled, not lost here
        return False
    return True


def abort_on_journal_failure(exc: BaseException, fix: str | None = None) -> None:
    # Logged as the class and message only (never the rows), then a hard exit: see the module doc. The
    # message without the library's hint ("reopen the journal"): the agent's own advice is ``fix``.
    reason = exc.message if isinstance(exc, ZeroCommError) else str(exc)
    log.critical("the journal failed (%s: %s); stopping the agent without acknowledging the message%s",
                 type(exc).__name__, reason[:600], f". {fix}, then start it again" if fix else "")
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(EXIT_JOURNAL_FAILED)
