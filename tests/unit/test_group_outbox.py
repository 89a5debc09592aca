"""Publisher retransmission buffer: seqs, receipts, the window, retention, stalls."""

from __future__ import annotations

import threading
import time

import pytest

from zerocomm_spark.errors import BackpressureError, GroupError, MessagesDroppedError, PeerTimeoutError
from zerocomm_spark.group.lamport import LamportClock
from zerocomm_spark.group.outbox import Outbox, PublishReceipt


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def publish(box: Outbox, n: int, clock: LamportClock | None = None, timeout: float = 1.0):  # type: ignore[no-untyped-def]
    clock = clock or LamportClock()
    return box.append([b"p%d" % i for i in range(n)], [f"id{box.last_seq + i + 1}" for i in range(n)], None,
                      clock.tick, timeout)


def test_seqs_and_timestamps_are_assigned_in_order() -> None:
    box = Outbox("g", window=100, retention_max=1000)
    lc = LamportClock(start=41)
    r1 = publish(box, 3, lc)
    r2 = publish(box, 2, lc)
    assert r1.seqs == (1, 2, 3) and r2.seqs == (4, 5)
    assert r1.lamport_ts == (42, 43, 44) and r2.lamport_ts == (45, 46)
    assert r1.message_ids == ("id1", "id2", "id3")
    assert r1.done() and r2.done()  # no members: nobody to wait for


def test_first_seq_continues_a_previous_run() -> None:
    box = Outbox("g", window=10, retention_max=10, first_seq=501)
    assert publish(box, 2).seqs == (501, 502)


def test_seqs_are_reserved_ahead_with_one_save_per_block() -> None:
    """Saved before a seq past the last reservation is used, so a crash cannot hide a used seq."""
    saved: list[int] = []

    def reserve(seq: int) -> int:
        saved.append(seq + 10)
        return seq + 10

    box = Outbox("g", window=100, retention_max=1000, first_seq=5, reserve=reserve)
    assert saved == []  # nothing used yet
    assert publish(box, 3).seqs == (5, 6, 7) and saved == [17]
    for _ in range(3):
        publish(box, 3)
    assert box.last_seq == 16 and saved == [17]
    assert publish(box, 3).seqs == (17, 18, 19) and saved == [17, 29]


def test_a_reservation_not_saved_is_logged_and_publishing_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def reserve(seq: int) -> int:
        raise OSError("disk full")

    box = Outbox("g", window=100, retention_max=1000, reserve=reserve)
    assert publish(box, 2).seqs == (1, 2)
    assert "reservation was not saved (OSError)" in caplog.text


def test_continue_after_moves_an_unused_sequence_and_members_bases_with_it() -> None:
    box = Outbox("g", window=10, retention_max=10, first_seq=3)
    box.add_member("bob")
    assert box.continue_after(1) is True and box.last_seq == 2  # behind the start: nothing moves
    assert box.continue_after(7) is True and box.last_seq == 7
    assert box.base_of("bob") == 7  # not owed seqs that will never exist
    r = publish(box, 2)
    assert r.seqs == (8, 9) and not r.done()
    box.take_unsent(100)  # on the wire: a member acks only what it was sent
    box.ack("bob", 9)
    assert r.done()
    assert box.continue_after(9) is True  # at or behind what was published: nothing to do
    assert box.continue_after(20) is False and publish(box, 1).seqs == (10,)  # published seqs stand


def test_continue_after_refuses_once_published_even_if_everything_was_acked_and_freed() -> None:
    box = Outbox("g", window=10, retention_max=10)
    publish(box, 2)  # no members: acked and freed at once
    assert box.continue_after(5) is False and box.last_seq == 2


def test_receipt_resolves_when_every_current_member_acked() -> None:
    box = Outbox("g", window=100, retention_max=1000)
    box.add_member("bob")
    box.add_member("carol")
    r = publish(box, 3)
    box.take_unsent(100)
    assert not r.done()
    box.ack("bob", 3)
    assert not r.done()
    with pytest.raises(PeerTimeoutError) as err:
        r.wait(0.05)
    assert "carol" in str(err.value) and "bob" not in str(err.value)
    box.ack("carol", 2)
    assert not r.done()
    box.ack("carol", 3)
    r.wait(0)
    assert r.done()


def test_removing_the_laggard_resolves_and_late_joiners_are_not_owed_earlier_messages() -> None:
    box = Outbox("g", window=100, retention_max=1000)
    box.add_member("bob")
    r = publish(box, 2)
    assert box.add_member("dave") == 2  # dave's stream starts after seq 2
    box.remove_member("bob")
    assert r.done()
    r2 = publish(box, 1)
    box.take_unsent(100)
    assert not r2.done()
    box.ack("dave", 3)
    assert r2.done()


def test_re_adding_a_member_keeps_its_progress() -> None:
    box = Outbox("g", window=100, retention_max=1000)
    box.add_member("bob")
    publish(box, 5)
    box.take_unsent(100)
    box.ack("bob", 2)
    assert box.add_member("bob") == 2
    assert box.base_of("bob") == 2


def test_window_blocks_then_raises_backpressure_naming_the_slowest() -> None:
    box = Outbox("g", window=10, retention_max=100)
    box.add_member("fast")
    box.add_member("slow")
    publish(box, 8)
    box.take_unsent(100)
    box.ack("fast", 8)
    t = time.monotonic()
    with pytest.raises(BackpressureError) as err:
        publish(box, 5, timeout=0.2)
    assert time.monotonic() - t >= 0.19
    assert "slow" in str(err.value) and "fast" not in str(err.value)
    assert box.last_seq == 8  # nothing was appended
    assert box.backpressure_waits == 1


def test_window_opens_when_acks_arrive() -> None:
    box = Outbox("g", window=10, retention_max=100)
    box.add_member("bob")
    publish(box, 10)
    box.take_unsent(100)
    threading.Timer(0.1, box.ack, args=("bob", 6)).start()
    t = time.monotonic()
    r = publish(box, 5, timeout=5)
    assert 0.05 < time.monotonic() - t < 4
    assert r.seqs == (11, 12, 13, 14, 15)


def test_a_call_bigger_than_the_window_goes_through_when_nothing_is_in_flight() -> None:
    box = Outbox("g", window=4, retention_max=10)
    box.add_member("bob")
    assert publish(box, 7).seqs[-1] == 7


def test_inactive_members_do_not_hold_the_window_but_keep_their_messages() -> None:
    box = Outbox("g", window=5, retention_max=20)
    box.add_member("live")
    box.add_member("dead")
    publish(box, 5)
    box.take_unsent(100)
    box.ack("live", 5)
    box.set_active("dead", False)
    publish(box, 5, timeout=0.5)  # would block if "dead" held the window
    box.take_unsent(100)
    msgs, gone = box.get_range(1, None, 100)
    assert [m.seq for m in msgs] == list(range(1, 11)) and gone is None


def test_a_member_checking_its_join_holds_no_window_but_is_still_owed_and_pushed() -> None:
    """It acks nothing until its join completes: the others go on publishing, its receipts wait for
    it, and it is still pushed heartbeats (it learns of a tail it missed); then it holds the window."""
    box = Outbox("g", window=5, retention_max=20)
    box.add_member("live")
    box.add_member("joiner")
    box.set_joining("joiner", True)
    first = publish(box, 5)
    box.take_unsent(100)
    box.ack("live", 5)
    publish(box, 5, timeout=0.5)  # would block if the joiner held the window
    box.take_unsent(100)
    box.ack("live", 10)
    assert not first.done() and box.laggards(5) == ["joiner"]
    assert box.heartbeats_due(0.0) == [("joiner", 0)]
    box.set_joining("joiner", False)  # it holds the window at once: backpressure while it recovers, not loss
    assert box.members()["joiner"].holds_window
    with pytest.raises(BackpressureError):
        publish(box, 1, timeout=0.05)
    box.ack("joiner", 10)
    assert first.done()
    publish(box, 1, timeout=0.5)


def test_retention_limit_drops_only_what_inactive_members_lack() -> None:
    box = Outbox("g", window=5, retention_max=6)
    box.add_member("live")
    box.add_member("dead")
    box.set_active("dead", False)
    for _ in range(4):
        publish(box, 3)
        box.take_unsent(100)
        box.ack("live", box.last_seq)
    assert box.held() == 6
    assert box.retention_dropped == 6
    msgs, gone = box.get_range(1, None, 100)
    assert gone == (1, 6) and [m.seq for m in msgs] == list(range(7, 13))


def test_acked_messages_are_freed() -> None:
    box = Outbox("g", window=100, retention_max=100)
    box.add_member("bob")
    publish(box, 10)
    box.take_unsent(100)
    box.ack("bob", 7)
    assert box.held() == 3
    msgs, gone = box.get_range(5, 9, 100)
    assert gone == (5, 7) and [m.seq for m in msgs] == [8, 9]


def test_take_unsent_respects_counts_and_bytes_and_never_resends_unsent() -> None:
    box = Outbox("g", window=100, retention_max=100)
    box.add_member("bob")
    box.append([b"x" * 10] * 10, [f"i{i}" for i in range(10)], None, LamportClock().tick, 1)
    assert box.get_range(1, None, 100) == ([], None)  # nothing on the wire yet
    assert [m.seq for m in box.take_unsent(3)] == [1, 2, 3]
    assert [m.seq for m in box.take_unsent(100, max_bytes=25)] == [4, 5]
    assert box.unsent_count() == 5
    assert [m.seq for m in box.get_range(1, None, 100)[0]] == [1, 2, 3, 4, 5]
    assert [m.seq for m in box.get_range(2, None, 2)[0]] == [2, 3]


def test_stalled_members_are_reported_once_per_interval() -> None:
    clock = FakeClock()
    box = Outbox("g", window=100, retention_max=100, clock=clock)
    box.add_member("bob")
    box.add_member("carol")
    publish(box, 4)
    box.take_unsent(100)
    box.ack("carol", 4)
    assert box.heartbeats_due(1.0) == []
    clock.now += 1.5
    assert box.heartbeats_due(1.0) == [("bob", 0)]
    assert box.heartbeats_due(1.0) == []
    box.set_active("bob", False)
    clock.now += 5
    assert box.heartbeats_due(1.0) == []  # inactive: keepalives, not heartbeats, decide


def test_close_fails_pending_receipts_and_publishers() -> None:
    box = Outbox("g", window=100, retention_max=100)
    box.add_member("bob")
    r = publish(box, 1)
    box.close()
    with pytest.raises(GroupError):
        r.wait(1)
    with pytest.raises(GroupError):
        publish(box, 1)


def test_rejects_a_retention_smaller_than_the_window() -> None:
    with pytest.raises(ValueError):
        Outbox("g", window=10, retention_max=5)


def _past_retention_while_inactive(member: str) -> tuple[Outbox, list[PublishReceipt]]:
    """``member`` inactive while 4 receipts of 3 messages went out (retention_max 6): seqs 1-6 are dropped
    before it acked them; "live" acked everything."""
    box = Outbox("g", window=5, retention_max=6)
    box.add_member("live")
    box.add_member(member)
    box.set_active(member, False)
    receipts = []
    for _ in range(4):
        receipts.append(publish(box, 3))
        box.take_unsent(100)
        box.ack("live", box.last_seq)
    return box, receipts


def test_a_receipt_whose_messages_retention_dropped_for_a_member_fails_instead_of_resolving() -> None:
    """A member marked inactive lost messages past retention_max: when it comes back it is told they
    are gone, skips them and acks past them. That ack must not resolve their receipt as delivered."""
    box, receipts = _past_retention_while_inactive("dead")
    assert box.retention_dropped == 6  # seqs 1-6 are gone for "dead"
    box.set_active("dead", True)
    msgs, gone = box.get_range(1, None, 100)  # its NACK: the answer says 1-6 are gone
    assert gone == (1, 6)
    box.note_gone("dead", *gone)
    box.ack("dead", box.last_seq)  # it skipped 1-6 and delivered 7-12
    assert all(r.done() for r in receipts)
    for r in receipts[:2]:  # seqs 1-3 and 4-6: never delivered to "dead"
        with pytest.raises(MessagesDroppedError, match="dead") as err:
            r.wait(0)
        assert "retention" in str(err.value) and "dead (3)" in str(err.value) and "live (" not in str(err.value)
    for r in receipts[2:]:
        r.wait(0)  # 7-9 and 10-12 were delivered by both
    later = publish(box, 2)  # what follows is not tainted by the old loss
    box.take_unsent(100)
    box.ack("live", box.last_seq)
    box.ack("dead", box.last_seq)
    later.wait(0)


def test_dropped_messages_that_still_reached_the_member_resolve_their_receipts() -> None:
    """Retention dropped the publisher's copy, but the first transmission was already on its way and
    arrived: the member acks without ever being told they are gone, and that is a real delivery."""
    box, receipts = _past_retention_while_inactive("slow")
    assert box.retention_dropped == 6
    box.note_gone("slow", 20, 30)  # nothing of the pending receipts' seqs
    box.ack("slow", box.last_seq)
    for r in receipts:
        r.wait(0)


def test_a_removed_member_no_longer_fails_receipts_for_what_retention_dropped() -> None:
    box, receipts = _past_retention_while_inactive("dead")
    box.note_gone("dead", 1, 6)
    box.remove_member("dead")  # removed members stop counting
    for r in receipts:
        r.wait(0)


def publish_bytes(box: Outbox, sizes: list[int], timeout: float = 1.0, **kwargs):  # type: ignore[no-untyped-def]
    return box.append([b"x" * n for n in sizes], [f"id{box.last_seq + i + 1}" for i in range(len(sizes))], None,
                      LamportClock().tick, timeout, **kwargs)


def test_window_bytes_block_then_raise_backpressure_and_open_with_acks() -> None:
    """Large messages: a count window of 100 would let 100 x max_message_bytes pile up."""
    box = Outbox("g", window=100, retention_max=1000, window_bytes=1000, retention_max_bytes=4000)
    box.add_member("bob")
    publish_bytes(box, [400, 400])
    assert box.held_bytes() == 800
    with pytest.raises(BackpressureError, match="1000 bytes") as err:
        publish_bytes(box, [400], timeout=0.2)
    assert "bob" in str(err.value)
    assert box.last_seq == 2 and box.held_bytes() == 800  # nothing was appended
    box.take_unsent(100)
    box.ack("bob", 1)  # frees 400 bytes
    assert publish_bytes(box, [400], timeout=0.2).seqs == (3,)
    assert box.held_bytes() == 800


def test_a_call_bigger_than_window_bytes_goes_through_when_nothing_is_in_flight() -> None:
    box = Outbox("g", window=100, retention_max=1000, window_bytes=100, retention_max_bytes=100)
    box.add_member("bob")
    assert publish_bytes(box, [300]).seqs == (1,)
    with pytest.raises(BackpressureError):
        publish_bytes(box, [1], timeout=0.05)


def test_retention_bytes_drop_only_what_inactive_members_lack() -> None:
    box = Outbox("g", window=100, retention_max=1000, window_bytes=1000, retention_max_bytes=2000)
    box.add_member("live")
    box.add_member("dead")
    box.set_active("dead", False)
    for _ in range(5):
        publish_bytes(box, [400, 400])
        box.take_unsent(100)
        box.ack("live", box.last_seq)
    assert box.held_bytes() <= 2000 and box.held() == 5
    assert box.retention_dropped == 5
    msgs, gone = box.get_range(1, None, 100)
    assert gone == (1, 5) and [m.seq for m in msgs] == list(range(6, 11))
    box.note_gone("dead", *gone)
    box.set_active("dead", True)
    box.ack("dead", box.last_seq)
    assert box.held_bytes() == 0


def test_a_publish_from_a_delivery_callback_waits_only_past_retention() -> None:
    """Two members replying to each other from their callbacks: each waits for acks the other can send only
    once its own callback returns, so a callback's publish must not wait for the window."""
    box = Outbox("g", window=4, retention_max=8, window_bytes=400, retention_max_bytes=800)
    box.add_member("bob")
    publish(box, 4)  # the window is full
    t = time.monotonic()
    assert publish_bytes(box, [10, 10], timeout=5, in_callback=True).seqs == (5, 6)
    assert time.monotonic() - t < 1
    with pytest.raises(BackpressureError):
        publish_bytes(box, [10], timeout=0.05)  # others still wait for the window
    with pytest.raises(BackpressureError,
                       match=r"retention limits \(from a delivery callback\) \(8 messages, 800 bytes\)"):
        publish_bytes(box, [10] * 3, timeout=0.05, in_callback=True)  # past retention_max it waits too
    with pytest.raises(BackpressureError):
        publish_bytes(box, [800], timeout=0.05, in_callback=True)  # and past retention_max_bytes


def test_the_receipt_carries_the_send_time_its_messages_travel_with() -> None:
    """The agent journals its own messages from the receipt; it stamped them with a time of its own,
    taken before a publish that may wait for the window, so the publisher's journal and every other
    member's disagreed on a message's sent_at (by the wait, seconds under backpressure)."""
    box = Outbox("g", window=1, retention_max=10)
    box.add_member("bob")
    publish(box, 1)
    first = box.take_unsent(10)  # on the wire: bob can ack it
    threading.Timer(0.3, lambda: box.ack("bob", 1)).start()
    before = time.time()
    receipt = publish(box, 1, timeout=5.0)  # waits for the window
    sent = first + box.take_unsent(10)
    assert [m.seq for m in sent] == [1, 2]
    assert receipt.sent_at == sent[1].sent_at
    assert receipt.sent_at >= before + 0.25


def _in_thread(fn, seconds: float = 3.0) -> BaseException | None:  # type: ignore[no-untyped-def]
    """Run ``fn`` in a daemon thread; the exception it raised, or a failure if it is still running."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)
        else:
            out.append(None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still waiting after {seconds}s: a NaN timeout is no deadline")
    return out[0]


def test_a_nan_timeout_is_refused_rather_than_waited_on_forever() -> None:
    """NaN compares false both ways: `remaining <= 0` never held and the wait spun without end."""
    box = Outbox("g", window=2, retention_max=10)
    box.add_member("bob")
    r = publish(box, 2)
    err = _in_thread(lambda: r.wait(float("nan")))
    assert isinstance(err, ValueError) and "timeout" in str(err)
    err = _in_thread(lambda: publish(box, 1, timeout=float("nan")))  # the window is full
    assert isinstance(err, ValueError) and "timeout" in str(err)
    assert box.last_seq == 2  # nothing was published


def test_a_receipt_resolved_with_an_error_at_its_deadline_is_not_reported_as_delivered() -> None:
    """The deadline passed; before the laggards were read the receipt resolved, as dropped for a
    member: wait() must raise that error (or time out), never return as if every member had it."""
    box, receipts = _past_retention_while_inactive("dead")
    box.set_active("dead", True)
    box.note_gone("dead", 1, 6)
    laggards = box.laggards

    def resolve_then_read(seq: int) -> list[str]:
        box.ack("dead", box.last_seq)  # resolves receipts[0] with MessagesDroppedError
        return laggards(seq)

    box.laggards = resolve_then_read  # type: ignore[method-assign]
    with pytest.raises((MessagesDroppedError, PeerTimeoutError)):
        receipts[0].wait(0)
    box.ack("dead", box.last_seq)  # (a no-op if the laggards were read)
    assert receipts[0].done()
    with pytest.raises(MessagesDroppedError):
        receipts[0].wait(0)


def test_an_ack_past_what_was_sent_counts_only_up_to_what_was_sent() -> None:
    """A member cannot have delivered what was never put on the wire: a buggy or lying member acking
    seqs still queued for the sender must not resolve their receipts, free them or open the window."""
    box = Outbox("g", window=4, retention_max=10)
    box.add_member("bob")
    first = publish(box, 2)
    box.take_unsent(100)  # seqs 1-2 are on the wire
    second = publish(box, 2)  # seqs 3-4 still wait for the sender
    assert box.ack("bob", 4) is True  # progress: up to seq 2
    assert first.done() and not second.done()
    assert box.base_of("bob") == 2 and box.held() == 2
    assert box.ack("bob", 4) is False  # nothing sent past seq 2 yet: no progress
    assert [m.seq for m in box.take_unsent(100)] == [3, 4]  # nothing was freed before it was sent
    box.ack("bob", 4)
    assert second.done() and box.held() == 0


def test_gone_ranges_reported_again_and_overlapping_are_counted_once() -> None:
    """A member is told a range is gone once per answer that covers it: two holes reported apart and
    then a wider answer covering both must count each dropped seq once in the receipt's error."""
    box = Outbox("g", window=20, retention_max=20)
    box.add_member("live")
    box.add_member("dead")
    receipt = publish(box, 12)
    box.take_unsent(100)
    box.ack("live", 12)
    box.note_gone("dead", 3, 4)
    box.note_gone("dead", 7, 8)
    box.note_gone("dead", 2, 9)  # covers both: one range 2-9, eight seqs
    box.note_gone("dead", 8, 10)  # overlaps its end
    box.note_gone("dead", 12, 12)
    box.note_gone("dead", 11, 11)  # adjacent on both sides: 2-12
    box.ack("dead", 12)
    with pytest.raises(MessagesDroppedError, match="dead") as err:
        receipt.wait(0)
    assert "dead (11)" in str(err.value), str(err.value)


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, None, "5"])
def test_a_receipt_wait_without_a_finite_deadline_is_refused(timeout: object) -> None:
    """Every wait has a deadline: wait(inf) waited forever on a member that never acks (and a timeout
    beyond threading's limit overflows). Refused like NaN, as the transport and agent calls refuse it."""
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.transport.peer import MAX_TIMEOUT

    box = Outbox("g", window=2, retention_max=10)
    box.add_member("bob")
    r = publish(box, 1)
    err = _in_thread(lambda: r.wait(timeout))  # type: ignore[arg-type]
    assert isinstance(err, ConfigurationError) and "finite" in str(err), err
    assert not r.done()
    box.take_unsent(10)
    box.ack("bob", 1)
    r.wait(MAX_TIMEOUT)  # the longest deadline there is: returns at once, resolved
    r.wait(0)


def test_a_publish_waiting_for_the_window_without_a_finite_deadline_is_refused() -> None:
    from zerocomm_spark.errors import ConfigurationError

    box = Outbox("g", window=1, retention_max=10)
    box.add_member("bob")
    publish(box, 1)  # the window is full
    err = _in_thread(lambda: publish(box, 1, timeout=float("inf")))
    assert isinstance(err, ConfigurationError) and "finite" in str(err), err
    assert box.last_seq == 1


# --- members alive but not acking (ack_stall_s) -------------------------------------------------------


def _stall_box(clock: FakeClock, ack_stall_s: float | None = 5.0, **kwargs) -> Outbox:  # type: ignore[no-untyped-def]
    """"live" acks everything; "stuck" answers keepalives (stays active) but never acks."""
    kwargs = {"window": 5, "retention_max": 100, **kwargs}
    box = Outbox("g", clock=clock, ack_stall_s=ack_stall_s, **kwargs)
    box.add_member("live")
    box.add_member("stuck")
    return box


def _send(box: Outbox, n: int, acker: str | None = "live") -> PublishReceipt:
    receipt = publish(box, n, timeout=0)  # timeout 0: never waits on the fake clock
    box.take_unsent(1000)
    if acker is not None:
        box.ack(acker, box.last_seq)
    return receipt


def _back_from_inactive(behind: int, per_send: int, **kwargs) -> Outbox:  # type: ignore[no-untyped-def]
    """A _stall_box whose "stuck" was inactive while ``behind`` messages were sent (``per_send`` a
    call, each acked by "live"), and is active again: it holds the window with its debt."""
    box = _stall_box(FakeClock(), ack_stall_s=None, **kwargs)
    box.set_active("stuck", False)
    for _ in range(behind // per_send):
        _send(box, per_send)
    box.set_active("stuck", True)
    return box


def test_a_member_without_ack_progress_for_ack_stall_s_stops_holding_the_window() -> None:
    """It used to hold every publisher's window for as long as it answered keepalives."""
    clock = FakeClock()
    box = _stall_box(clock)
    first = _send(box, 5)
    with pytest.raises(BackpressureError, match="slowest: stuck"):
        publish(box, 1, timeout=0)
    clock.now += 4.9
    assert box.mark_ack_stalls() == []  # not yet
    clock.now += 0.2
    [(did, owed, idle)] = box.mark_ack_stalls()
    assert (did, owed) == ("stuck", 5) and idle == pytest.approx(5.1)
    state = box.members()["stuck"]
    assert state.stalled and state.active and not state.holds_window
    assert box.stalled_members() == ["stuck"] and box.ack_stalls == 1
    assert box.mark_ack_stalls() == []  # reported once per stall
    _send(box, 5)  # the window no longer waits for it
    assert not first.done() and box.laggards(5) == ["stuck"]  # its receipts still wait for its acks
    assert [d for d, _ in box.heartbeats_due(0.0)] == ["stuck"]  # and it is still sent heartbeats
    msgs, gone = box.get_range(1, None, 100)  # and its resends: everything is kept for it
    assert [m.seq for m in msgs] == list(range(1, 11)) and gone is None


def test_a_publisher_waiting_on_the_window_is_woken_when_the_member_stalls() -> None:
    clock = FakeClock()
    box = _stall_box(clock)
    _send(box, 5)
    done: list[PublishReceipt] = []
    waiter = threading.Thread(target=lambda: done.append(publish(box, 3, timeout=60)), daemon=True)
    waiter.start()  # waits (the fake clock stands still: only a notify ends its wait)
    time.sleep(0.1)
    assert not done
    clock.now += 6
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]
    waiter.join(5)
    assert done and done[0].seqs == (6, 7, 8)


def test_a_slow_member_that_progresses_never_stalls() -> None:
    clock = FakeClock()
    box = _stall_box(clock, window=100)
    _send(box, 20)
    for seq in range(1, 11):  # one ack every 4 s: 40 s in all, each under ack_stall_s
        clock.now += 4
        assert box.mark_ack_stalls() == []
        box.ack("stuck", seq)
    assert box.stalled_members() == [] and box.members()["stuck"].holds_window


def test_a_member_owed_nothing_never_stalls() -> None:
    clock = FakeClock()
    box = _stall_box(clock)
    clock.now += 100
    assert box.mark_ack_stalls() == []  # added, nothing published
    publish(box, 3, timeout=0)
    clock.now += 100
    assert box.mark_ack_stalls() == []  # published but not sent yet: nothing it could ack
    box.take_unsent(100)
    box.ack("live", 3)
    box.ack("stuck", 3)
    clock.now += 100  # the group is idle: every member has everything
    assert box.mark_ack_stalls() == []
    _send(box, 2)  # owed from now on: its clock starts at the send, not at its last ack 100 s ago
    assert box.mark_ack_stalls() == []
    clock.now += 4.9
    assert box.mark_ack_stalls() == []
    clock.now += 0.2
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]


def test_a_member_just_added_or_done_joining_gets_ack_stall_s_from_then() -> None:
    clock = FakeClock()
    box = _stall_box(clock)
    _send(box, 2)  # held for stuck
    box.add_member("joiner", base=0)  # owed 1-2 (e.g. a restarted member's saved base)
    assert box.mark_ack_stalls() == []  # just added: its clock starts now
    box.set_joining("joiner", True)
    clock.now += 60
    # checking its join: it holds no window, so there is nothing to release it from
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]
    box.set_joining("joiner", False)
    assert box.mark_ack_stalls() == []  # its clock starts when its join completes
    clock.now += 5
    assert [d for d, *_ in box.mark_ack_stalls()] == ["joiner"]


def test_a_stalled_member_holds_the_window_again_at_its_next_ack_with_a_debt() -> None:
    """Counted from its ack it would block every publisher at once (more than a window in flight on
    its account alone); held out until within a window (the previous rule), one slower than the
    publishers never got back. It comes back counted from a window behind the newest message."""
    clock = FakeClock()
    box = _stall_box(clock, window=10)
    _send(box, 10)
    clock.now += 5
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]
    _send(box, 10)  # live is at 20
    box.set_active("stuck", False)  # keepalives toggling do not re-admit it
    box.set_active("stuck", True)
    assert box.members()["stuck"].stalled
    assert box.ack("stuck", 5)  # progress, 15 behind the newest (20): it holds the window again
    state = box.members()["stuck"]
    assert not state.stalled and state.holds_window and box.stalled_members() == []
    assert state.debt == 5  # counted from 10: a full window behind the newest
    with pytest.raises(BackpressureError, match="slowest: stuck"):
        publish(box, 1, timeout=0)  # it slows the publishers from here
    box.ack("stuck", 7)  # 2 more: the debt shrinks by 1, the window opens by 1
    assert box.members()["stuck"].debt == 4
    publish(box, 1, timeout=0)
    with pytest.raises(BackpressureError, match="slowest: stuck"):
        publish(box, 1, timeout=0)


def test_a_stalled_member_ahead_of_the_slowest_holder_is_not_what_the_publishers_wait_for() -> None:
    """Publishes from delivery callbacks may take the members holding the window up to the retention
    limits behind: a stalled member level with them holds the window again without being the one the
    publishers wait for."""
    clock = FakeClock()
    box = _stall_box(clock, window=5)
    _send(box, 3)
    clock.now += 5
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]
    box.append([b"x"] * 20, [f"cb{i}" for i in range(20)], None, LamportClock().tick, 0, in_callback=True)
    box.take_unsent(100)
    box.ack("live", 10)  # 13 behind the newest
    box.ack("stuck", 10)  # level with live
    assert box.members()["stuck"].holds_window
    with pytest.raises(BackpressureError) as err:
        publish(box, 1, timeout=0)
    assert "slowest: live" in str(err.value) and "stuck" not in str(err.value)


def test_a_stalled_member_slower_than_the_publishers_loses_nothing() -> None:
    """Under the previous rule it held no window until within one of the newest message, which a
    member slower than the publishers never was: retention dropped what it lacked (here 597 of the
    610 published). Held again at its first ack, it slows the publishers to half its pace, and it catches up."""
    clock = FakeClock()
    box = _stall_box(clock, window=4, retention_max=12)
    receipts = [_send(box, 1)]
    clock.now += 5
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]
    receipts += [_send(box, 1) for _ in range(9)]  # nothing waits for it: 10 behind, more than a window
    published = 0
    for i in range(600):
        try:
            receipts.append(publish(box, 1, timeout=0))
            published += 1
        except BackpressureError:
            pass  # the window is full: a publisher waits for "stuck"
        box.take_unsent(100)
        box.ack("live", box.last_seq)
        if i % 3 == 0:  # "stuck" delivers one message every third round
            box.ack("stuck", box.members()["stuck"].acked + 1)
        clock.now += 0.1
    state = box.members()["stuck"]
    assert box.retention_dropped == 0 and box.stalled_members() == [] and state.holds_window
    assert state.debt == 0 and box.last_seq - state.acked <= box.window  # caught up to within a window
    assert published > 150  # the publishers went on meanwhile, at its pace
    box.ack("stuck", box.last_seq)
    for receipt in receipts:
        receipt.wait(0)  # every one delivered to both: none failed as dropped


def test_a_member_back_from_inactive_far_behind_slows_the_publishers_to_half_its_pace() -> None:
    """Counted from its ack, the publishers waited until it had recovered all but a window of what it
    missed; held out, it lost what retention dropped. With the debt they go on at half its pace."""
    box = _back_from_inactive(20, 5, window=5)  # live acks each; 20 messages "stuck" lacks
    assert box.members()["stuck"].holds_window and box.members()["stuck"].debt == 15
    with pytest.raises(BackpressureError, match="slowest: stuck"):
        publish(box, 1, timeout=0)
    for acked in range(2, 16, 2):  # each 2 it delivers open the window by 1
        box.ack("stuck", acked)
        _send(box, 1)
        with pytest.raises(BackpressureError, match="slowest: stuck"):
            publish(box, 1, timeout=0)
    state = box.members()["stuck"]
    assert (state.acked, state.debt, box.last_seq) == (14, 8, 27)
    box.ack("stuck", 22)  # within a window of the newest: the debt is gone
    assert box.members()["stuck"].debt == 0
    with pytest.raises(BackpressureError, match="slowest: stuck"):
        publish(box, 1, timeout=0)  # 5 in flight on its account: a full window
    box.ack("stuck", 27)
    publish(box, 5, timeout=0)
    with pytest.raises(BackpressureError):
        publish(box, 1, timeout=0)  # a window from its ack, never more: the debt did not overshoot


def test_the_debt_counts_the_window_in_bytes_too() -> None:
    clock = FakeClock()
    box = Outbox("g", clock=clock, window=100, retention_max=1000, window_bytes=1000, retention_max_bytes=10_000)
    box.add_member("live")
    box.add_member("back")
    box.set_active("back", False)
    for _ in range(8):
        publish_bytes(box, [400], timeout=0)
        box.take_unsent(100)
        box.ack("live", box.last_seq)
    box.set_active("back", True)  # 3,200 bytes behind: counted from 2 messages (800 bytes) behind
    assert box.members()["back"].debt == 6
    with pytest.raises(BackpressureError, match="slowest: back"):
        publish_bytes(box, [400], timeout=0)
    publish_bytes(box, [200], timeout=0)  # 1,000 bytes in flight on its account


def test_a_member_recovering_one_message_at_a_time_opens_the_window_too() -> None:
    """A slow member acks one message at a time; the debt shrank by ceil(1/2) = 1 for each, so the
    window did not open at all until it had recovered all but a window (found in review)."""
    box = _back_from_inactive(100, 10, window=10, retention_max=1000)  # 100 it lacks
    assert box.members()["stuck"].debt == 90
    published = 0
    for seq in range(1, 41):
        box.ack("stuck", seq)
        while True:
            try:
                _send(box, 1)
            except BackpressureError:
                break
            published += 1
    assert published == 20  # one for every two it delivered


def test_one_publish_larger_than_the_window_waits_while_a_recovering_member_lacks_messages() -> None:
    """Nothing in flight lets one publish of any size through; a debt counted up to the newest message
    showed nothing in flight while the member still lacked 12, and 900 went through a window of 5
    (found in review)."""
    box = _back_from_inactive(40, 5, window=5, retention_max=1000)  # 40 behind
    box.ack("stuck", 28)  # the debt now counts it from the newest message (40)
    assert box.in_flight() == 0
    with pytest.raises(BackpressureError):
        publish(box, 900, timeout=0)
    publish(box, 5, timeout=0)  # a window's worth is fine


def test_backpressure_names_a_recovering_member_with_what_it_lacks() -> None:
    """The window counts it from a window behind the newest message; the error says how far behind it is."""
    box = _back_from_inactive(100, 5, window=5)
    with pytest.raises(BackpressureError,
                       match=r"5 message\(s\) \(10 bytes\) count against the window \(5 messages\); "
                             r"slowest: stuck \(recovering, 100 behind\)\."):
        publish(box, 1, timeout=0)


def test_a_member_that_stops_holding_the_window_keeps_no_debt() -> None:
    box = _back_from_inactive(20, 5, window=5)
    assert box.members()["stuck"].debt == 15
    box.set_active("stuck", False)
    assert box.members()["stuck"].debt == 0
    box.set_active("stuck", True)
    box.set_joining("stuck", True)
    assert box.members()["stuck"].debt == 0
    box.set_joining("stuck", False)
    assert box.members()["stuck"].debt == 15


def test_a_debt_never_lets_more_than_the_retention_limits_be_held() -> None:
    """A member back from far behind acks past what retention dropped in one step; halving that
    step off its debt must not open the window for as many new messages (12 held became 17 here
    before the publishes counted the retention limits too)."""
    box = _back_from_inactive(40, 5, window=5, retention_max=12)  # retention keeps the 12 it lacks last: 29-40
    assert box.retention_dropped == 28
    msgs, gone = box.get_range(1, None, 100)
    assert gone == (1, 28)
    box.note_gone("stuck", 1, 28)
    box.ack("stuck", 28)  # it skips what is gone
    with pytest.raises(BackpressureError,
                       match=r"count against the retention limits \(12 messages\); slowest: stuck\. "
                             r".*raise the retention limits"):
        publish(box, 1, timeout=0)
    assert box.held() == 12
    box.ack("stuck", 32)  # 4 delivered: room for 4, the window counting from its ack with what is left of the debt
    publish(box, 4, timeout=0)
    with pytest.raises(BackpressureError, match="slowest: stuck"):
        publish(box, 1, timeout=0)
    assert box.held() == 12


def test_a_publish_from_a_callback_counts_what_is_held_not_the_debts() -> None:
    """The retention limits bound what is kept, and a member with a debt lacks more than the window
    counts for it."""
    box = _back_from_inactive(10, 5, window=5, retention_max=12)  # debt 5: the window counts it from 5
    box.append([b"x"] * 2, ["cb1", "cb2"], None, LamportClock().tick, 0, in_callback=True)  # 12 held for it
    box.take_unsent(100)
    with pytest.raises(BackpressureError, match="retention limits"):
        box.append([b"x"], ["cb3"], None, LamportClock().tick, 0, in_callback=True)
    assert box.held() == 12


def test_a_stalled_member_that_recovers_while_the_others_publish_is_re_admitted_and_loses_nothing() -> None:
    """Re-admitted only once its ack reached the others' (the first version of the rule), a member
    recovering at half the publishers' pace never did while they published: it held no window, so
    nothing slowed them, its lag grew and retention dropped what it lacked (16 of 30 here). Within a
    window it holds the window again and slows them to its pace instead."""
    clock = FakeClock()
    box = _stall_box(clock, window=4, retention_max=8)
    receipts = [_send(box, 1)]
    clock.now += 5
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]
    for i in range(60):
        try:
            receipts.append(publish(box, 1, timeout=0))
        except BackpressureError:
            pass  # the window is full: it waits for "stuck", as a publisher would
        box.take_unsent(100)
        box.ack("live", box.last_seq)
        if i % 2:  # "stuck" delivers one message every other round
            box.ack("stuck", box.members()["stuck"].acked + 1)
        clock.now += 0.1
    assert box.retention_dropped == 0 and box.stalled_members() == []
    box.ack("stuck", box.last_seq)
    for receipt in receipts:
        receipt.wait(0)  # every one delivered to both: none failed as dropped


def test_a_member_back_from_inactive_holds_the_window_at_once_however_far_behind() -> None:
    """Backpressure while it recovers what it missed, not loss: held out until it was within a
    window (a version of this session), a returning member slower than the group never got back
    and lost what retention dropped."""
    box = _back_from_inactive(20, 5, window=5)  # live acks each; 20 messages "stuck" lacks
    assert box.members()["stuck"].holds_window and box.stalled_members() == []
    with pytest.raises(BackpressureError, match="slowest: stuck"):
        publish(box, 1, timeout=0)
    box.ack("stuck", 16)
    publish(box, 1, timeout=0)


def test_removing_or_re_adding_a_stalled_member() -> None:
    clock = FakeClock()
    box = _stall_box(clock)
    _send(box, 5)
    clock.now += 5
    box.mark_ack_stalls()
    assert box.add_member("stuck") == 0 and box.members()["stuck"].stalled  # re-adding keeps its state
    receipt = _send(box, 5)
    box.remove_member("stuck")
    assert box.stalled_members() == [] and receipt.done()
    box.add_member("stuck")  # a new member: owed only what follows, and holding the window
    assert box.members()["stuck"].holds_window


def test_backpressure_names_stalled_members_apart_from_the_slowest() -> None:
    clock = FakeClock()
    box = _stall_box(clock)
    box.add_member("slow")
    _send(box, 5)
    clock.now += 5
    box.ack("slow", 1)  # progress: slow, not stalled
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]
    with pytest.raises(BackpressureError) as err:
        publish(box, 5, timeout=0)
    text = str(err.value)
    assert "slowest: slow" in text and "stalled member(s)" in text and "stuck" in text.split("slowest:")[1]


def test_ack_stall_s_none_never_releases_a_member() -> None:
    clock = FakeClock()
    box = _stall_box(clock, ack_stall_s=None)
    _send(box, 5)
    clock.now += 1e6
    assert box.mark_ack_stalls() == [] and box.stalled_members() == []
    with pytest.raises(BackpressureError, match="slowest: stuck"):
        publish(box, 1, timeout=0)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_ack_stall_s_must_be_a_positive_number_or_none(value: object) -> None:
    with pytest.raises(ValueError, match="ack_stall_s"):
        Outbox("g", window=5, retention_max=5, ack_stall_s=value)  # type: ignore[arg-type]


def test_what_retention_drops_for_a_stalled_member_fails_its_receipts() -> None:
    """A stalled member, like an inactive one, loses what it lacks past the retention limits; the
    receipts of what it never got fail with MessagesDroppedError naming it, never resolve."""
    clock = FakeClock()
    box = _stall_box(clock, retention_max=6)
    receipts = [_send(box, 3)]
    clock.now += 5
    assert [d for d, *_ in box.mark_ack_stalls()] == ["stuck"]
    for _ in range(3):
        receipts.append(_send(box, 3))
    assert box.retention_dropped == 6 and box.held() == 6
    msgs, gone = box.get_range(1, None, 100)  # its NACK: the answer says 1-6 are gone
    assert gone == (1, 6) and [m.seq for m in msgs] == list(range(7, 13))
    box.note_gone("stuck", *gone)
    box.ack("stuck", box.last_seq)  # it skipped 1-6 and delivered 7-12: caught up
    assert not box.members()["stuck"].stalled
    for r in receipts[:2]:
        with pytest.raises(MessagesDroppedError, match=r"stuck \(3\)"):
            r.wait(0)
    for r in receipts[2:]:
        r.wait(0)
