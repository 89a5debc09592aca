"""Per-publisher receive state: FIFO delivery, hold-back, duplicates, gaps, baselines, skipped ranges."""

from __future__ import annotations

import random

import pytest

from zerocomm_spark.group.sequencing import Offer, PublisherStream


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stream(**kw: object) -> tuple[PublisherStream[str], FakeClock]:
    clock = FakeClock()
    kw.setdefault("next_seq", 1)
    return PublisherStream(clock=clock, **kw), clock  # type: ignore[arg-type]


def test_in_order_messages_are_delivered_at_once() -> None:
    s, _ = stream()
    assert s.offer(1, "m1") == (Offer.DELIVER, ["m1"])
    assert s.offer(2, "m2") == (Offer.DELIVER, ["m2"])
    assert s.delivered == 2 and s.gap_since is None


def test_early_messages_are_held_until_the_hole_is_filled() -> None:
    s, _ = stream()
    assert s.offer(3, "m3") == (Offer.HELD, [])
    assert s.offer(2, "m2") == (Offer.HELD, [])
    assert s.delivered == 0 and s.held_count == 2
    assert s.missing() == [(1, 1)]
    assert s.offer(1, "m1") == (Offer.DELIVER, ["m1", "m2", "m3"])
    assert s.delivered == 3 and s.held_count == 0


def test_duplicates_are_dropped_whether_delivered_or_held() -> None:
    s, _ = stream()
    s.offer(1, "a")
    s.offer(3, "c")
    assert s.offer(1, "a") == (Offer.DUPLICATE, [])
    assert s.offer(3, "c") == (Offer.DUPLICATE, [])
    assert s.duplicates == 2


def test_missing_ranges_and_announced_tail() -> None:
    s, _ = stream()
    for seq in (1, 2, 5, 6, 9):
        s.offer(seq, f"m{seq}")
    assert s.missing() == [(3, 4), (7, 8)]
    s.note_announced(12)  # the publisher says it sent up to 12: the tail is missing too
    assert s.missing() == [(3, 4), (7, 8), (10, 12)]
    assert s.missing(limit=4) == [(3, 4)]
    assert s.lag() == 12 - 2


def test_nacks_wait_for_the_gap_to_age_and_are_not_repeated_too_soon() -> None:
    s, clock = stream()
    s.offer(1, "a")
    s.offer(3, "c")
    assert s.due_nacks(0.1, 0.5) == []  # too young: reordering, not loss, is likely
    clock.now += 0.15
    assert s.due_nacks(0.1, 0.5) == [(2, 2)]
    clock.now += 0.1
    assert s.due_nacks(0.1, 0.5) == []  # asked already
    s.nack_answered()  # an answer came but did not fill it: ask again at once
    assert s.due_nacks(0.1, 0.5) == [(2, 2)]
    s.offer(2, "b")
    assert s.gap_since is None and s.due_nacks(0.0, 0.0) == []


def test_no_nack_goes_out_while_earlier_ones_are_unanswered_until_they_time_out() -> None:
    """A backlog's answers take longer than the retry interval to arrive and be handled: asking again
    meanwhile had the publisher send every range several times, the answers queued up in memory."""
    s, clock = stream()
    s.offer(1, "a")
    s.offer(9, "i")
    clock.now += 0.2
    ranges = s.due_nacks(0.1, 0.3, outstanding_for=5.0)
    assert ranges == [(2, 8)]
    s.nacks_sent(len(ranges))
    clock.now += 1.0  # well past the retry interval, the answer not handled yet
    assert s.due_nacks(0.1, 0.3, outstanding_for=5.0) == []
    s.nack_done()
    s.nack_answered()  # it came, capped at seq 4: what is left is asked at once
    for seq in (2, 3, 4):
        s.offer(seq, str(seq))
    assert s.due_nacks(0.1, 0.3, outstanding_for=5.0) == [(5, 8)]
    s.nacks_sent(1)
    clock.now += 5.0  # never answered (a lost request): after the timeout it is asked again
    assert s.due_nacks(0.1, 0.3, outstanding_for=5.0) == [(5, 8)]


def test_unknown_baseline_sets_messages_aside() -> None:
    s, _ = stream(next_seq=None)
    assert s.offer(11, "m11") == (Offer.NO_BASELINE, [])
    assert s.offer(12, "m12") == (Offer.NO_BASELINE, [])
    assert s.offer(12, "m12") == (Offer.DUPLICATE, [])
    assert s.waiting_count == 2 and not s.has_baseline
    assert s.set_baseline(10) == ["m11", "m12"]
    assert s.delivered == 12
    assert s.set_baseline(0) == []  # only the first baseline counts


def test_baseline_drops_what_was_before_membership_and_keeps_holes() -> None:
    s, _ = stream(next_seq=None)
    for seq in (3, 4, 6, 7):
        s.offer(seq, f"m{seq}")
    assert s.set_baseline(3) == ["m4"]  # 3 predates us, 5 is missing
    assert s.missing() == [(5, 5)]
    assert s.offer(5, "m5") == (Offer.DELIVER, ["m5", "m6", "m7"])


def test_gone_range_is_skipped_and_counted() -> None:
    s, _ = stream()
    s.offer(1, "a")
    s.offer(6, "f")
    s.offer(7, "g")
    assert s.skip(2, 4) == []  # 5 still missing: nothing released yet
    assert s.delivered == 4 and s.lost == 3
    assert s.offer(5, "e") == (Offer.DELIVER, ["e", "f", "g"])


def test_gone_range_releases_held_messages_and_ignores_ranges_ahead() -> None:
    s, _ = stream()
    s.offer(3, "c")
    s.offer(5, "e")
    assert s.skip(4, 9) == []  # does not cover the next expected seq (1): recover 1-2 first
    assert s.skip(1, 4) == ["c", "e"]
    assert s.lost == 3 and s.delivered == 5
    assert s.skip(1, 2, count_lost=False) == []


def test_skip_without_counting_for_already_delivered_seqs() -> None:
    s, _ = stream()
    assert s.skip(1, 10, count_lost=False) == []
    assert s.delivered == 10 and s.lost == 0


def test_unordered_stream_delivers_on_arrival_and_acks_contiguously() -> None:
    s, _ = stream(ordered=False)
    assert s.offer(3, "c") == (Offer.DELIVER, ["c"])
    assert s.delivered == 0  # the ack position stays contiguous
    assert s.offer(3, "c") == (Offer.DUPLICATE, [])
    assert s.offer(1, "a") == (Offer.DELIVER, ["a"])
    assert s.missing() == [(2, 2)]
    assert s.offer(2, "b") == (Offer.DELIVER, ["b"])
    assert s.delivered == 3


def test_seqs_a_consumer_did_not_take_are_missing_again_and_asked_for_at_retry_pace() -> None:
    """A delivery callback raised: those seqs are not acked, are NACKed as a gap (not at once: a
    consumer that keeps failing must not be fed in a loop) and are taken when re-sent."""
    s, clock = stream()
    s.offer(5, "e")  # held early
    assert s.offer_all(["a", "b", "c"], lambda x: "abc".index(x) + 1) == (["a", "b", "c"], 0)
    s.undeliver([2, 3])
    assert s.delivered == 1 and s.held_count == 1 and s.missing() == [(2, 4)]
    clock.now += 0.2
    assert s.due_nacks(0.1, 0.3) == []
    clock.now += 0.2
    assert s.due_nacks(0.1, 0.3) == [(2, 4)]
    s.nack_answered()  # the answer: re-delivered, and the consumer fails again
    assert s.offer_all(["b", "c"], lambda x: "abc".index(x) + 1) == (["b", "c"], 0)
    s.undeliver([2, 3])
    clock.now += 0.1
    assert s.due_nacks(0.1, 0.3) == []  # not at once, as after an answer that left a hole
    clock.now += 0.3
    assert s.due_nacks(0.1, 0.3) == [(2, 4)]
    assert s.offer(2, "b") == (Offer.DELIVER, ["b"])  # not a duplicate any more
    assert s.offer_all(["c", "d"], lambda x: "abcd".index(x) + 1) == (["c", "d", "e"], 0)
    assert s.delivered == 5 and s.gap_since is None


def test_unordered_undeliver_keeps_the_seqs_that_were_taken() -> None:
    s, _ = stream(ordered=False)
    for seq in (4, 1, 2, 3):
        s.offer(seq, str(seq))
    s.undeliver([2, 4])
    assert s.delivered == 1 and s.missing() == [(2, 2), (4, 4)]
    assert s.offer(3, "3") == (Offer.DUPLICATE, [])
    assert s.offer(4, "4") == (Offer.DELIVER, ["4"])
    assert s.offer(2, "2") == (Offer.DELIVER, ["2"])
    assert s.delivered == 4


@pytest.mark.parametrize("ordered", [True, False])
def test_received_upto_names_seqs_received_but_not_taken(ordered: bool) -> None:
    """A publisher that restarted without them skips them: received here (held back, or given back
    by a consumer that raised), they were used, so they are lost rather than void."""
    s, _ = stream(ordered=ordered)
    assert s.offer_all(["a", "b"], lambda x: "ab".index(x) + 1) == (["a", "b"], 0)
    assert s.received_upto(100) == 2
    s.offer(5, "e")  # early: held back (ordered) or delivered ahead (unordered)
    assert s.received_upto(100) == 5 and s.received_upto(4) == 2
    t, _ = stream(ordered=ordered)
    assert t.offer_all(["a", "b", "c"], lambda x: "abc".index(x) + 1) == (["a", "b", "c"], 0)
    t.undeliver([2, 3])
    assert t.delivered == 1 and t.received_upto(100) == 3
    assert t.skip(2, 3) == [] and t.lost == 2 and t.delivered == 3


def test_hold_back_is_bounded() -> None:
    s, _ = stream(hold_max=3)
    for seq in (5, 6, 7):
        assert s.offer(seq, "x")[0] is Offer.HELD
    assert s.offer(8, "x") == (Offer.OVERFLOW, [])
    assert s.overflows == 1
    assert s.offer(1, "a")[0] is Offer.DELIVER  # the next expected is always accepted


def test_offer_all_matches_offer_one_by_one() -> None:
    a, _ = stream()
    seqs = [1, 2, 3, 5, 4, 4, 9, 6, 7, 8, 2]
    items = [(s, f"m{s}") for s in seqs]
    one: list[str] = []
    dups = 0
    for seq, item in items:
        status, got = a.offer(seq, item)
        one.extend(got)
        dups += status is Offer.DUPLICATE
    c, _ = stream()
    got_all, dups_all = c.offer_all(items, lambda it: it[0])
    assert [it[1] for it in got_all] == one == [f"m{i}" for i in range(1, 10)]
    assert dups_all == dups == 2


@pytest.mark.parametrize("ordered", [True, False])
def test_any_arrival_order_with_duplicates_delivers_each_once(ordered: bool) -> None:
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(1, 60)
        arrivals = list(range(1, n + 1)) + [rng.randint(1, n) for _ in range(n // 3)]
        rng.shuffle(arrivals)
        s, _ = stream(ordered=ordered)
        out: list[int] = []
        for seq in arrivals:
            out.extend(s.offer(seq, seq)[1])
        if ordered:
            assert out == list(range(1, n + 1))
        else:
            assert sorted(out) == list(range(1, n + 1))
        assert s.delivered == n and s.missing() == []


def test_an_announced_tail_waits_longer_than_a_hole() -> None:
    s, clock = stream()
    s.offer(1, "a")
    s.note_announced(4)  # 2..4 announced but maybe still in flight
    clock.now += 0.2
    assert s.due_nacks(0.1, 0.0, tail_after=1.0) == []
    s.offer(3, "c")  # now 2 is a hole: something above it arrived
    clock.now += 0.15
    assert s.due_nacks(0.1, 0.0, tail_after=1.0) == [(2, 2)]  # the hole only, not the tail
    clock.now += 1.0
    assert s.due_nacks(0.1, 0.0, tail_after=1.0) == [(2, 2), (4, 4)]


def test_hold_back_is_bounded_by_bytes_too() -> None:
    """A publisher (a hostile member) that leaves seq 1 out and sends large messages after it:
    counting messages alone let 100,000 of them (gigabytes) wait in memory."""
    s, _ = stream(hold_bytes_max=1000, size_of=len)
    for seq in (2, 3, 4):
        assert s.offer(seq, "x" * 300)[0] is Offer.HELD
    assert s.held_bytes == 900
    assert s.offer(5, "x" * 300) == (Offer.OVERFLOW, [])  # not acked: sent again after the gap fills
    assert s.offer(6, "y")[0] is Offer.HELD  # a small one still fits
    status, out = s.offer(1, "a")
    assert status is Offer.DELIVER and out == ["a", "x" * 300, "x" * 300, "x" * 300]
    assert s.held_bytes == 1  # seq 6 waits for 5
    assert s.offer(5, "x" * 300)[1] == ["x" * 300, "y"] and s.held_bytes == 0
    lone, _ = stream(hold_bytes_max=10, size_of=len)
    assert lone.offer(3, "z" * 50)[0] is Offer.HELD  # one item alone is always taken


def test_held_bytes_follow_baselines_and_skips() -> None:
    s, _ = stream(next_seq=None, hold_bytes_max=10_000, size_of=len)
    for seq in (3, 4, 9):
        s.offer(seq, "m" * 100)  # before the baseline: set aside
    assert s.held_bytes == 300
    assert s.set_baseline(2) == ["m" * 100, "m" * 100]  # 3, 4 released; 9 held (5..8 missing)
    assert s.held_bytes == 100
    assert s.skip(5, 8) == ["m" * 100] and s.held_bytes == 0


def test_an_announced_tail_the_publisher_did_not_back_is_withdrawn_until_announced_again() -> None:
    s, clock = stream()
    s.offer(1, "m1")
    s.offer(3, "m3")  # held: seq 2 is a hole, backed by what arrived
    s.note_announced(2**63 - 1)
    assert s.lacks(2) and not s.lacks(3) and not s.lacks(1)
    assert s.withdraw_announced() == 2**63 - 1
    assert s.announced == 3 and s.lag() == 2 and s.missing() == [(2, 2)]  # the hole stays
    assert s.withdraw_announced() is None  # nothing announced past what arrived
    s.offer(2, "m2")
    assert s.gap_since is None and s.lag() == 0
    s.note_announced(2**63 - 1)  # announced again: a gap again
    clock.now += 10
    assert s.due_nacks(0.1, 0.3, 100) == [(4, 103)]
