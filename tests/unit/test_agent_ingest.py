"""JournalIngest: what returning from the delivery hook (which acknowledges) may mean."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import pytest

from zerocomm_spark.agent.ingest import JournalIngest
from zerocomm_spark.agent.metrics import Metrics
from zerocomm_spark.journal import Journal

GROUP = "g1"
PUBLISHER = "did:peer:2.Ez6LSpublisher"


@dataclass
class Delivered:
    seq: int
    payload: bytes
    headers: dict = field(default_factory=dict)
    group: str = GROUP
    publisher_did: str = PUBLISHER
    lamport_ts: int = 0
    sent_at: float = field(default_factory=time.time)
    received_at: float = field(default_factory=time.time)

    @property
    def message_id(self) -> str:
        return f"m-{self.seq}"


@pytest.fixture
def ingest(tmp_path):
    journal = Journal.open(tmp_path / "journal", key=bytes(range(32)), fsync="never")
    fatal: list[BaseException] = []
    ingest = JournalIngest(journal, Metrics(), on_fatal=fatal.append)
    yield ingest
    ingest.close()
    journal.close()
    assert not fatal


def test_a_refused_row_does_not_take_the_rows_delivered_with_it(ingest):
    """The hook's return acknowledges the whole batch: every row that fits must be journaled."""
    batch = [Delivered(1, b"one"), Delivered(2, b"two", headers={"bad": 5}), Delivered(3, b"three")]
    ingest.on_messages(batch)
    rows = ingest.journal.read(0).to_pylist()
    assert [(r["seq"], r["payload"]) for r in rows] == [(1, b"one"), (3, b"three")]
    snapshot = ingest.metrics.snapshot()
    assert snapshot["journal_rejected"] == 1
    assert snapshot["messages_in"] == 2
    assert snapshot["bytes_in"] == len(b"one") + len(b"three")
    ingest.on_messages([Delivered(3, b"three"), Delivered(4, b"four")])  # a re-send: the seq rule holds
    assert [r["seq"] for r in ingest.journal.read(0).to_pylist()] == [1, 3, 4]
    assert ingest.metrics.snapshot()["journal_duplicates"] == 1


def test_a_refused_lone_row_is_not_reported_journaled(ingest):
    ingest.on_messages([Delivered(7, b"x", headers={"bad": 5})])
    snapshot = ingest.metrics.snapshot()
    assert snapshot["journal_rejected"] == 1
    assert snapshot["messages_in"] == 0
    assert snapshot["journaled_seq"] == {}
    assert ingest.journal.read(0).num_rows == 0


@pytest.mark.timeout(30)
def test_a_wait_with_a_nan_timeout_ends_at_once(ingest):
    """A NaN timeout made every comparison false: the long poll never reached its deadline and spun."""
    done: list[bool] = []
    waiter = threading.Thread(target=lambda: done.append(ingest.wait_for(lambda: False, float("nan"))), daemon=True)
    began = time.monotonic()
    waiter.start()
    waiter.join(5.0)
    ingest.end_waits()  # frees the old code's spinning waiter, so the fixture can close
    assert done == [False] and time.monotonic() - began < 5.0


@dataclass
class Receipt:
    seqs: tuple
    lamport_ts: tuple
    sent_at: float

    def done(self) -> bool:
        return True

    def wait(self, timeout: float = 0) -> None:
        return None


def test_own_messages_are_journaled_with_the_send_time_members_receive(ingest):
    """The publisher's journal row had the agent's clock before the publish call, not the sent_at
    the data plane stamped and every other member journals for that message."""
    receipt = Receipt(seqs=(1, 2), lamport_ts=(5, 6), sent_at=1_800_000_000.123456)
    done = ingest.track_own(receipt, GROUP, PUBLISHER, [b"a", b"b"], ["m-1", "m-2"], None)
    assert done.wait(10)
    rows = ingest.journal.read(0).to_pylist()
    assert [r["seq"] for r in rows] == [1, 2]
    assert {r["sent_at"].timestamp() for r in rows} == {1_800_000_000.123456}


class LateReceipt(Receipt):
    """A receipt the group acknowledges at a moment the test picks."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.acked = False

    def done(self) -> bool:
        return self.acked


def test_own_messages_acked_just_before_a_stop_are_journaled_before_the_journal_closes(tmp_path):
    """The own-message thread ended as soon as close() was called: messages the group had acked but
    the thread had not picked up yet (it looks every 20 ms) were never journaled, though the
    publisher was (or would have been) told they were published."""
    for attempt in range(5):
        journal = Journal.open(tmp_path / f"journal-{attempt}", key=bytes(range(32)), fsync="never")
        ingest = JournalIngest(journal, Metrics(), on_fatal=lambda exc: None)
        receipt = LateReceipt(seqs=(1, 2), lamport_ts=(5, 6), sent_at=1_800_000_000.0)
        done = ingest.track_own(receipt, GROUP, PUBLISHER, [b"a", b"b"], ["m-1", "m-2"], None)
        time.sleep(0.05)  # the thread has looked: nothing acked yet
        receipt.acked = True  # the last ack arrives as the agent stops
        ingest.close()
        try:
            assert done.is_set()
            assert [r["seq"] for r in journal.read(0).to_pylist()] == [1, 2]
        finally:
            journal.close()


class FailedReceipt(Receipt):
    """A receipt that failed: the group closed (a leave) before every member acked it."""

    def wait(self, timeout: float = 0) -> None:
        raise RuntimeError("group closed")


def _own(ingest, seqs, receipt_type=Receipt):
    receipt = receipt_type(seqs=tuple(seqs), lamport_ts=tuple(seqs), sent_at=1_800_000_000.0)
    return ingest.track_own(receipt, GROUP, PUBLISHER, [b"x"] * len(seqs), [f"m-{s}" for s in seqs], None)


def test_own_seqs_that_will_never_be_journaled_are_recorded_not_left_as_a_hole(tmp_path):
    """Own messages are journaled only once the group acked them. Seqs of a receipt that failed, and
    seqs a restarted publisher continued after (a member held them, the old process never saw them
    acked), had no row and no record: a reader walking the publisher's own seqs on its member (a
    Spark query, failOnDataLoss) took the hole for lost messages."""
    journal = Journal.open(tmp_path / "journal", key=bytes(range(32)), fsync="never")
    ingest = JournalIngest(journal, Metrics(), on_fatal=lambda exc: None)
    try:
        assert _own(ingest, [1, 2]).wait(10)
        assert _own(ingest, [3, 4], FailedReceipt).wait(10)  # not acked: no rows
        assert _own(ingest, [5, 6]).wait(10)
        assert [r["seq"] for r in journal.read(0).to_pylist()] == [1, 2, 5, 6]
        assert journal.superseded(GROUP, PUBLISHER, 1, 6) == [(3, 4)]
    finally:
        ingest.close()
    # A restart: the data plane recorded seqs 9..10 void; the new process continues at 12.
    ingest = JournalIngest(journal, Metrics(), on_fatal=lambda exc: None)
    try:
        journal.add_superseded(GROUP, PUBLISHER, [9, 10])
        assert _own(ingest, [12]).wait(10)
        assert [r["seq"] for r in journal.read(0).to_pylist()] == [1, 2, 5, 6, 12]
        assert journal.superseded(GROUP, PUBLISHER, 1, 12) == [(3, 4), (7, 11)]
        assert _own(ingest, [13]).wait(10)  # no gap: nothing more recorded
        assert journal.superseded(GROUP, PUBLISHER, 1, 13) == [(3, 4), (7, 11)]
    finally:
        ingest.close()
        journal.close()


def test_own_seqs_of_failed_receipts_between_rows_taken_together_are_recorded_too(tmp_path):
    """Receipts resolving together are journaled in one pass: only the gap before the pass's first own
    row was recorded, so a failed receipt between two good ones of that pass left an unrecorded hole."""
    journal = Journal.open(tmp_path / "journal", key=bytes(range(32)), fsync="never")
    ingest = JournalIngest(journal, Metrics(), on_fatal=lambda exc: None)
    try:
        receipts = []
        for seqs, kind in (((1, 2), LateReceipt), ((3, 4), FailedReceipt), ((5, 6), LateReceipt),
                           ((7, 8), FailedReceipt), ((9, 10), LateReceipt)):
            receipt = kind(seqs=seqs, lamport_ts=seqs, sent_at=1_800_000_000.0)
            receipts.append((receipt, ingest.track_own(receipt, GROUP, PUBLISHER, [b"x"] * 2,
                                                       [f"m-{s}" for s in seqs], None)))
        time.sleep(0.05)  # the thread has looked: the first is not acked, so nothing is taken
        for receipt, _ in receipts[::-1]:  # the first last: every other one is resolved by then
            receipt.acked = True
        assert all(done.wait(10) for _, done in receipts)
        assert [r["seq"] for r in journal.read(0).to_pylist()] == [1, 2, 5, 6, 9, 10]
        assert journal.superseded(GROUP, PUBLISHER, 1, 10) == [(3, 4), (7, 8)]
    finally:
        ingest.close()
        journal.close()


def test_own_seqs_an_earlier_run_never_journaled_are_recorded_with_a_warning(tmp_path, caplog):
    journal = Journal.open(tmp_path / "journal", key=bytes(range(32)), fsync="never")
    try:
        ingest = JournalIngest(journal, Metrics(), on_fatal=lambda exc: None)
        assert _own(ingest, [1, 2]).wait(10)
        ingest.close()
        ingest = JournalIngest(journal, Metrics(), on_fatal=lambda exc: None)  # a restart: it continues at 6
        with caplog.at_level(logging.WARNING):
            assert _own(ingest, [6]).wait(10)
        ingest.close()
        assert journal.superseded(GROUP, PUBLISHER, 1, 6) == [(3, 5)]
        assert "previous run of this member were never journaled" in caplog.text
    finally:
        journal.close()


@pytest.mark.parametrize("bad", [{"message_id": "m-\ud800"}, {"headers": {"k": "v\udc00"}}])
def test_a_row_holding_a_lone_surrogate_is_refused_not_fatal(ingest, bad):
    """Arrow raised UnicodeEncodeError for it, which the ingest took for a failing disk (the agent
    exited, and the publisher's re-send after the restart did it again)."""

    @dataclass
    class Odd(Delivered):
        message_id: str = "m-ok"

    row = Odd(5, b"x", **bad)
    ingest.on_messages([Delivered(4, b"before"), row])
    assert [r["seq"] for r in ingest.journal.read(0).to_pylist()] == [4]
    assert ingest.metrics.snapshot()["journal_rejected"] == 1
