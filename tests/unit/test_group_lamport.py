"""Lamport clock: ticks are unique and increasing, observing never moves the clock back."""

from __future__ import annotations

import threading

import pytest

from zerocomm_spark.group.lamport import MAX_TIME, LamportClock


def test_tick_increments_and_reserves_blocks() -> None:
    c = LamportClock()
    assert c.tick() == 1
    assert c.tick() == 2
    assert c.tick(5) == 3  # reserves 3..7
    assert c.time == 7
    assert c.tick() == 8


def test_observe_moves_forward_only() -> None:
    c = LamportClock(start=10)
    assert c.observe(4) == 10
    assert c.observe(42) == 42
    assert c.tick() == 43  # a send after a receive is stamped after it


def test_send_after_receive_is_later_than_what_was_received() -> None:
    sender, receiver = LamportClock(), LamportClock()
    for _ in range(100):
        sender.tick()
    received = sender.tick()
    receiver.observe(received)
    assert receiver.tick() > received


def test_ticks_from_many_threads_are_unique() -> None:
    c = LamportClock()
    seen: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        mine = [c.tick() for _ in range(2000)]
        with lock:
            seen.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(1, 16001))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_rejects_bad_start(bad: object) -> None:
    with pytest.raises(ValueError):
        LamportClock(bad)  # type: ignore[arg-type]


def test_tick_needs_a_positive_count() -> None:
    with pytest.raises(ValueError):
        LamportClock().tick(0)


def test_the_clock_saturates_at_the_wire_limit_instead_of_overflowing_it() -> None:
    """A stamp past 2**63-1 would be refused by every receiver and stall the publisher's stream."""
    clock = LamportClock(MAX_TIME - 2)
    assert clock.tick(5) == MAX_TIME - 1
    assert clock.time == MAX_TIME
    assert clock.tick() == MAX_TIME
    assert clock.time == MAX_TIME


def test_a_reserving_clock_saves_a_limit_before_passing_the_last_one() -> None:
    saved: list[int] = []

    def reserve(now: int) -> int:
        saved.append(now + 10)
        return now + 10

    c = LamportClock(5, reserve=reserve)
    assert c.tick() == 6 and saved == [16]  # past the start: reserved before the stamp is used
    for _ in range(10):
        c.tick()
    assert c.time == 16 and saved == [16]  # within the reservation: nothing saved
    assert c.tick() == 17 and saved == [16, 27]
    c.observe(100)
    assert saved[-1] == 110 and c.time == 100
    # A restart from the last saved limit stamps after everything issued before.
    assert LamportClock(saved[-1]).tick() > c.time


def test_a_reservation_that_cannot_be_saved_does_not_stop_the_clock(caplog: pytest.LogCaptureFixture) -> None:
    def broken(now: int) -> int:
        raise OSError("disk full")

    c = LamportClock(reserve=broken)
    assert c.tick() == 1 and c.observe(7) == 7 and c.tick() == 8
    assert "reservation was not saved" in caplog.text
