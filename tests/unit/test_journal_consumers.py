"""Named consumers' commit points: retention waits for the slowest consumer, points survive restarts."""

from __future__ import annotations

import errno
import logging
import os
import zlib
from pathlib import Path

import nacl.utils
import pytest

from zerocomm_spark.errors import ConfigurationError, JournalError
from zerocomm_spark.journal import Journal
from zerocomm_spark.journal import consumers
from zerocomm_spark.journal.consumers import CONSUMERS_FILE, ConsumerPoints
from zerocomm_spark.journal.files import write_atomic

GROUP, ALICE = "g", "did:key:z6MkAlice"


def _rows(first: int, last: int, size: int = 200) -> list[dict]:
    return [{"group": GROUP, "message_id": f"m{s}", "publisher_did": ALICE, "seq": s, "lamport_ts": s,
             "sent_at": 1_700_000_000_000_000 + s, "payload": bytes([s % 251]) * size} for s in range(first, last + 1)]


@pytest.fixture
def key() -> bytes:
    return nacl.utils.random(32)


def _fill(j: Journal, n: int = 300) -> None:
    _fill_from(j, 1, n)


def _fill_from(j: Journal, first: int, last: int) -> None:
    for start in range(first, last + 1, 10):
        j.append(_rows(start, start + 9))


def test_retention_keeps_what_the_slowest_named_consumer_still_needs(tmp_path: Path, key: bytes) -> None:
    jdir = tmp_path / "j"
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192) as j:
        _fill(j)
        assert j.commit(40, consumer="spark-slow") == 40
        assert j.commit(250, consumer="spark-fast") == 250
        assert j.committed_offset == 40
        assert j.earliest_offset() <= 40  # the slow query still reads from 40
        assert j.read(40, 41).num_rows == 1
        assert j.commit(10, consumer="spark-slow") == 40  # never backwards
        assert j.consumers() == {"spark-fast": 250, "spark-slow": 40}
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192) as j:
        assert j.consumers() == {"spark-fast": 250, "spark-slow": 40} and j.committed_offset == 40
        assert j.earliest_offset() <= 40
        assert j.release("spark-slow") is True and j.release("spark-slow") is False
        assert j.committed_offset == 250
        assert 40 < j.earliest_offset() <= 250  # the slow one is gone: retention moved on


def test_the_unnamed_point_counts_once_it_was_committed(tmp_path: Path, key: bytes) -> None:
    with Journal.open(tmp_path / "j", key=key) as j:
        _fill(j, 50)
        j.commit(30, consumer="a")
        assert j.committed_offset == 30  # the unnamed point was never used: it holds nothing back
        j.commit(20)
        assert j.committed_offset == 20
        j.commit(45, consumer="a")
        assert j.committed_offset == 20


def test_bad_names_and_a_damaged_file_are_clear_errors(tmp_path: Path, key: bytes) -> None:
    jdir = tmp_path / "j"
    with Journal.open(jdir, key=key) as j:
        _fill(j, 20)
        for bad in ("", "has space", "x" * 201, 7, "ok\n"):  # "ok\n": a name "$" would have let through
            with pytest.raises(ConfigurationError, match="consumer name"):
                j.commit(5, consumer=bad)  # type: ignore[arg-type]
        j.commit(5, consumer="ok")
    raw = bytearray((jdir / CONSUMERS_FILE).read_bytes())
    raw[8] ^= 0x01
    (jdir / CONSUMERS_FILE).write_bytes(bytes(raw))
    def open_files() -> list[str]:  # descriptors of this process on the journal's files
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return [n for n in names if n.startswith(str(jdir))]

    for _ in range(3):  # a supervisor retrying: no write descriptor is left behind per attempt
        with pytest.raises(JournalError, match="damaged"):
            Journal.open(jdir, key=key)
    assert open_files() == []


# --- consumers that are gone without a release expire ----------------------------------------------

HOUR = 3600.0


class Clock:
    """Both clocks the consumer points read, moved by hand: wall (saved) and monotonic (ages)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.wall_us = 1_800_000_000 * 1_000_000
        self.mono = 1_000.0
        monkeypatch.setattr(consumers, "_wall_us", lambda: self.wall_us)
        monkeypatch.setattr(consumers, "_mono", lambda: self.mono)

    def advance(self, seconds: float, *, wall: bool = True, mono: bool = True) -> None:
        if wall:
            self.wall_us += int(seconds * 1e6)
        if mono:
            self.mono += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


def test_a_consumer_that_stopped_committing_is_forgotten_and_retention_moves_on(
        tmp_path: Path, key: bytes, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    jdir = tmp_path / "j"
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192, consumer_expiry_ms=1000) as j:
        _fill(j)
        j.commit(40, consumer="spark-deleted-query")
        j.commit(250, consumer="spark-live")
        assert j.earliest_offset() <= 40
        clock.advance(2 * HOUR)  # past the expiry and the grace after the open
        j.commit(260, consumer="spark-live")  # the live query commits at the new time
        with caplog.at_level(logging.WARNING, logger="zerocomm_spark.journal.journal"):
            j.enforce_retention()
        assert j.consumers() == {"spark-live": 260}
        assert 40 < j.earliest_offset() <= 260  # nothing waits for the deleted query any more
        assert "'spark-deleted-query'" in caplog.text and "offset 40" in caplog.text
        j.commit(40, consumer="spark-deleted-query")  # it comes back: a consumer again, at its point
        assert j.consumers()["spark-deleted-query"] == 40
    with Journal.open(jdir, key=key, consumer_expiry_ms=1000) as j:  # the forgetting was saved
        assert set(j.consumers()) == {"spark-live", "spark-deleted-query"}


def test_when_the_last_consumer_expires_what_it_consumed_stays_consumed(
        tmp_path: Path, key: bytes, clock: Clock) -> None:
    """Else a member with one query, deleted without a release, would keep everything for good."""
    jdir = tmp_path / "j"
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192, consumer_expiry_ms=1000) as j:
        _fill(j)
        j.commit(90, consumer="only-query")
        clock.advance(2 * HOUR)
        _fill_from(j, 301, 600)  # more rows come while nobody reads
        j.enforce_retention()
        assert j.consumers() == {} and j.committed_offset == 90
        assert 40 < j.earliest_offset() <= 90
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192, consumer_expiry_ms=1000) as j:
        assert j.committed_offset == 90  # saved
        j.commit(70, consumer="new")  # a new consumer bounds retention as ever
        assert j.committed_offset == 70


def test_releasing_the_last_consumer_keeps_what_it_consumed_consumed(tmp_path: Path, key: bytes) -> None:
    with Journal.open(tmp_path / "j", key=key, segment_bytes=4096, retention_bytes=8192) as j:
        _fill(j)
        j.commit(90, consumer="q")
        assert j.release("q") is True
        assert j.committed_offset == 90 and 40 < j.earliest_offset() <= 90


def test_without_an_expiry_consumers_are_kept_for_good(tmp_path: Path, key: bytes, clock: Clock) -> None:
    with Journal.open(tmp_path / "j", key=key, segment_bytes=4096, retention_bytes=8192) as j:
        _fill(j, 50)
        j.commit(20, consumer="q")
        clock.advance(1000 * 24 * HOUR)
        j.enforce_retention()
        assert j.consumers() == {"q": 20}


def test_an_expiry_of_zero_is_refused(tmp_path: Path, key: bytes) -> None:
    with pytest.raises(ConfigurationError, match="consumer_expiry_ms"):
        Journal.open(tmp_path / "j", key=key, consumer_expiry_ms=0)


def test_expiry_counts_from_the_last_commit_even_one_that_moves_nothing(tmp_path: Path, clock: Clock) -> None:
    points = ConsumerPoints(tmp_path, {}, fsync=False, expiry_s=10 * HOUR)
    clock.advance(HOUR)
    points.commit("q", 100)
    clock.advance(8 * HOUR)
    points.commit("q", 100)  # an idle query: its point stays, it is alive
    clock.advance(3 * HOUR)
    assert points.expire() == []
    clock.advance(7 * HOUR)
    assert points.expire() == [("q", 100)]
    assert points.points() == {} and points.expired_floor == 100


def test_a_restart_gives_every_consumer_time_to_commit_again(tmp_path: Path, clock: Clock) -> None:
    points = ConsumerPoints(tmp_path, {}, fsync=False, expiry_s=24 * HOUR)
    points.commit("q", 7)
    points.commit("idle", 3)
    clock.advance(2 * HOUR)
    points.commit("idle", 3)  # a no-op commit: its time is saved once an hour at most
    saved_idle = clock.wall_us
    clock.advance(30 * 24 * HOUR)  # the agent is down for a month, then starts again
    reopened = ConsumerPoints.load(tmp_path, fsync=False, expiry_s=24 * HOUR)
    assert reopened.last_commits()["idle"] == saved_idle
    clock.advance(HOUR / 2)
    assert reopened.expire() == []  # within the grace: the queries may reconnect
    reopened.commit("q", 9)
    clock.advance(HOUR / 2)
    assert reopened.expire() == [("idle", 3)]
    assert reopened.points() == {"q": 9}


def test_a_suspended_machine_or_a_clock_set_forward_forgets_nobody(tmp_path: Path, clock: Clock) -> None:
    points = ConsumerPoints(tmp_path, {}, fsync=False, expiry_s=24 * HOUR)
    clock.advance(2 * HOUR)
    points.commit("q", 5)
    clock.advance(8 * 24 * HOUR, mono=False)  # the wall clock jumps a week; the monotonic clock does not
    assert points.expire() == []
    clock.advance(25 * HOUR)
    assert points.expire() == [("q", 5)]


def test_an_expiry_shorter_than_the_grace_is_the_grace(tmp_path: Path, clock: Clock) -> None:
    points = ConsumerPoints(tmp_path, {}, fsync=False, expiry_s=1.0)
    points.commit("q", 1)
    clock.advance(0.999)
    assert points.expire() == []
    clock.advance(0.001)
    assert points.expire() == [("q", 1)]


def test_a_commit_time_in_the_future_is_taken_as_now(tmp_path: Path, clock: Clock) -> None:
    """A clock that was set back must not keep a consumer for as long as it jumped."""
    points = ConsumerPoints(tmp_path, {}, fsync=False)
    clock.advance(1000 * 24 * HOUR)
    points.commit("q", 1)
    clock.wall_us -= int(1000 * 24 * HOUR * 1e6)  # set back
    reopened = ConsumerPoints.load(tmp_path, fsync=False, expiry_s=HOUR)
    assert reopened.last_commits()["q"] == clock.wall_us
    clock.advance(2 * HOUR)
    assert reopened.expire() == [("q", 1)]


def test_a_first_version_file_loads_with_its_points_and_the_load_as_their_time(tmp_path: Path, clock: Clock) -> None:
    body = b'{"a":5,"b":9}'
    (tmp_path / CONSUMERS_FILE).write_bytes(b"ZCJN\x01\n" + body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little"))
    points = ConsumerPoints.load(tmp_path, fsync=False, expiry_s=HOUR)
    assert points.points() == {"a": 5, "b": 9}
    assert set(points.last_commits().values()) == {clock.wall_us}
    points.commit("a", 6)  # saved in the current format
    assert ConsumerPoints.load(tmp_path, fsync=False).points() == {"a": 6, "b": 9}
    assert (tmp_path / CONSUMERS_FILE).read_bytes().startswith(b"ZCJN\x03\n")


def test_a_second_version_file_loads_with_its_points_and_times(tmp_path: Path, clock: Clock) -> None:
    body = b'{"a":[5,1700000000000000],"b":[9,1700000001000000]}'
    (tmp_path / CONSUMERS_FILE).write_bytes(b"ZCJN\x02\n" + body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little"))
    points = ConsumerPoints.load(tmp_path, fsync=False, expiry_s=HOUR)
    assert points.points() == {"a": 5, "b": 9} and points.expired_floor == 0
    assert points.last_commits() == {"a": 1700000000000000, "b": 1700000001000000}
    points.commit("a", 6)
    assert (tmp_path / CONSUMERS_FILE).read_bytes().startswith(b"ZCJN\x03\n")
    assert ConsumerPoints.load(tmp_path, fsync=False).points() == {"a": 6, "b": 9}
    body = b'{"consumers":{"a":[5,1700000000000000]},"expired_floor":3}'  # the third's body under magic 2
    (tmp_path / CONSUMERS_FILE).write_bytes(b"ZCJN\x02\n" + body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little"))
    points = ConsumerPoints.load(tmp_path, fsync=False)
    assert points.points() == {"a": 5} and points.expired_floor == 3


@pytest.mark.parametrize("body", [b'{"consumers":{"a":[5]},"expired_floor":0}',
                                  b'{"consumers":{"a":[5,true]},"expired_floor":0}',
                                  b'{"consumers":{"a":[5.5,1]},"expired_floor":0}',
                                  b'{"consumers":{"a":"5"},"expired_floor":0}',
                                  b'{"consumers":{"a":[5,1]}}', b'{"consumers":{},"expired_floor":"x"}', b'[1]'])
def test_a_damaged_entry_is_a_clear_error(tmp_path: Path, body: bytes) -> None:
    (tmp_path / CONSUMERS_FILE).write_bytes(b"ZCJN\x03\n" + body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little"))
    with pytest.raises(JournalError, match="damaged"):
        ConsumerPoints.load(tmp_path, fsync=False)


def test_a_failed_save_never_stops_the_journal_nor_fails_a_commit_that_moves_nothing(
        tmp_path: Path, key: bytes, monkeypatch: pytest.MonkeyPatch, clock: Clock,
        caplog: pytest.LogCaptureFixture) -> None:
    with Journal.open(tmp_path / "j", key=key, consumer_expiry_ms=1000) as j:
        _fill(j, 20)
        j.commit(5, consumer="gone")
        j.commit(6, consumer="alive")
        clock.advance(2 * HOUR)

        def full_disk(*args: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(consumers, "write_atomic", full_disk)
        with caplog.at_level(logging.WARNING):
            assert j.commit(6, consumer="alive") == 6  # refreshing its time could not be saved: still fine
            j.enforce_retention()
        assert "No space left on device" in caplog.text
        assert j.consumers() == {"gone": 5, "alive": 6}  # kept until it can be saved
        j.append(_rows(21, 30))  # the journal goes on
        monkeypatch.setattr(consumers, "write_atomic", write_atomic)
        j.enforce_retention()
        assert j.consumers() == {"alive": 6}
