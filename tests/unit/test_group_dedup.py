"""TTL cache of message ids: duplicates are recognised for at least the TTL, memory is bounded."""

from __future__ import annotations

import pytest

from zerocomm_spark.group.dedup import TTLCache


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_second_copy_is_a_duplicate() -> None:
    c = TTLCache(60, 100)
    assert c.check_and_add(("pub", "m1")) is False
    assert c.check_and_add(("pub", "m1")) is True
    assert c.check_and_add(("other", "m1")) is False  # keys are (publisher, id)
    assert ("pub", "m1") in c
    assert len(c) == 2


def test_remembered_for_at_least_the_ttl_and_forgotten_after_twice_it() -> None:
    clock = FakeClock()
    c = TTLCache(10, 1000, clock=clock)
    assert not c.check_and_add("a")
    clock.now += 9.9
    assert c.check_and_add("a")  # still within the TTL
    clock.now += 0.2  # rotation: "a" moves to the old generation, still remembered
    assert "a" in c
    clock.now += 9.7  # 19.8 s after first sight: within 2 * ttl, may still be known
    clock.now += 10.5  # past 2 * ttl: forgotten
    assert "a" not in c
    assert not c.check_and_add("a")


def test_long_idle_forgets_everything() -> None:
    clock = FakeClock()
    c = TTLCache(5, 1000, clock=clock)
    for i in range(10):
        c.check_and_add(i)
    clock.now += 100
    assert len(c) == 0


def test_size_is_bounded_and_oldest_are_evicted_first() -> None:
    c = TTLCache(3600, 100)
    for i in range(1000):
        assert c.check_and_add(i) is False
    assert len(c) <= 100
    assert c.evicted > 0
    assert 999 in c  # the newest are kept
    assert 0 not in c


def test_bulk_check_matches_single_checks() -> None:
    c = TTLCache(60, 1000)
    c.check_and_add("x")
    assert c.check_and_add_many(["a", "x", "b", "a"]) == [False, True, False, True]
    assert c.check_and_add("b") is True


def test_discard_allows_a_key_again() -> None:
    c = TTLCache(60, 10)
    c.check_and_add("k")
    c.discard("k")
    assert c.check_and_add("k") is False


@pytest.mark.parametrize(("ttl", "size"), [(0, 10), (-1, 10), (10, 1), (10, 2.5)])
def test_rejects_bad_limits(ttl: float, size: int) -> None:
    with pytest.raises(ValueError):
        TTLCache(ttl, size)  # type: ignore[arg-type]
