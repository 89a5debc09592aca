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

GROUP, ALICE = "g", "did:key:z6MkAlice"


def _rows(first: int, last: int, size: int = 200) -> list[dict]:
    return [{"group": GROUP, "message_id": f"m{s}", "publisher_did": ALICE, "seq": s, "lamport_ts": s,
             "sent_at": 1_700_000_000_000_000 + s, "payload": bytes([s % 251]) * size} for s in range(first, last + 1)]


@pytest.fixture
def key() -> bytes:
    return nacl.utils.random(32)


def _fill(j: Journal, n: int = 300) -> None:
    for first in range(1, n + 1, 10):
        j.append(_rows(first, first + 9))


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

HOUR_US = 3600 * 1_000_000


def test_a_consumer_that_stopped_committing_is_forgotten_and_retention_moves_on(
        tmp_path: Path, key: bytes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    jdir = tmp_path / "j"
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192, consumer_expiry_ms=1000) as j:
        _fill(j)
        j.commit(40, consumer="spark-deleted-query")
        j.commit(250, consumer="spark-live")
        assert j.earliest_offset() <= 40
        later = consumers._now_us() + 2 * HOUR_US  # past the expiry and the grace after the open
        monkeypatch.setattr(consumers, "_now_us", lambda: later)
        j.commit(260, consumer="spark-live")  # the live query commits at the new time
        with caplog.at_level(logging.WARNING, logger="zerocomm_spark.journal.journal"):
            j.enforce_retention()
        assert j.consumers() == {"spark-live": 260}
        assert 40 < j.earliest_offset() <= 260  # nothing waits for the deleted query any more
        assert "'spark-deleted-query'" in caplog.text and "offset 40" in caplog.text
        j.commit(40, consumer="spark-deleted-query")  # it comes back: a consumer again, at its point
        assert j.consumers()["spark-deleted-query"] == 40
    monkeypatch.undo()
    with Journal.open(jdir, key=key, consumer_expiry_ms=1000) as j:  # the forgetting was saved
        assert set(j.consumers()) == {"spark-live", "spark-deleted-query"}


def test_without_an_expiry_consumers_are_kept_for_good(
        tmp_path: Path, key: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    with Journal.open(tmp_path / "j", key=key, segment_bytes=4096, retention_bytes=8192) as j:
        _fill(j, 50)
        j.commit(20, consumer="q")
        later = consumers._now_us() + 1000 * 24 * HOUR_US
        monkeypatch.setattr(consumers, "_now_us", lambda: later)
        j.enforce_retention()
        assert j.consumers() == {"q": 20}


def test_expiry_counts_from_the_last_commit_even_one_that_moves_nothing(tmp_path: Path) -> None:
    points = ConsumerPoints(tmp_path, {}, fsync=False, expiry_us=10 * HOUR_US, opened_us=0)
    points.commit("q", 100, now_us=HOUR_US)
    points.commit("q", 100, now_us=9 * HOUR_US)  # an idle query: its point stays, it is alive
    assert points.expire(now_us=12 * HOUR_US) == []
    assert points.expire(now_us=19 * HOUR_US) == [("q", 100)]
    assert points.points() == {}


def test_a_restart_gives_every_consumer_time_to_commit_again(tmp_path: Path) -> None:
    start = 1_000 * HOUR_US
    points = ConsumerPoints(tmp_path, {}, fsync=False, expiry_us=24 * HOUR_US, opened_us=start)
    points.commit("q", 7, now_us=start)
    points.commit("idle", 3, now_us=start)
    points.commit("idle", 3, now_us=start + 2 * HOUR_US)  # a no-op commit: saved once an hour at most
    # The agent is down for a month, then starts again.
    reopened = ConsumerPoints.load(tmp_path, fsync=False, expiry_us=24 * HOUR_US)
    restart = start + 30 * 24 * HOUR_US
    reopened.opened_us = restart
    assert reopened.last_commits() == {"q": start, "idle": start + 2 * HOUR_US}
    assert reopened.expire(now_us=restart + HOUR_US // 2) == []  # within the grace: the queries may reconnect
    reopened.commit("q", 9, now_us=restart + HOUR_US // 2)
    assert reopened.expire(now_us=restart + HOUR_US) == [("idle", 3)]
    assert reopened.points() == {"q": 9}


def test_an_expiry_shorter_than_the_grace_is_the_grace(tmp_path: Path) -> None:
    points = ConsumerPoints(tmp_path, {}, fsync=False, expiry_us=1_000_000, opened_us=0)
    points.commit("q", 1, now_us=0)
    assert points.expire(now_us=999_999) == []
    assert points.expire(now_us=1_000_000) == [("q", 1)]


def test_a_commit_time_in_the_future_is_taken_as_now(tmp_path: Path) -> None:
    """A clock that was set back must not keep a consumer for as long as it jumped."""
    points = ConsumerPoints(tmp_path, {}, fsync=False)
    points.commit("q", 1, now_us=consumers._now_us() + 1000 * 24 * HOUR_US)
    reopened = ConsumerPoints.load(tmp_path, fsync=False, expiry_us=HOUR_US)
    assert reopened.last_commits()["q"] <= consumers._now_us()
    assert reopened.expire(now_us=consumers._now_us() + 2 * HOUR_US) == [("q", 1)]


def test_a_first_version_file_loads_with_its_points_and_the_load_as_their_time(tmp_path: Path) -> None:
    body = b'{"a":5,"b":9}'
    (tmp_path / CONSUMERS_FILE).write_bytes(b"ZCJN\x01\n" + body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little"))
    before = consumers._now_us()
    points = ConsumerPoints.load(tmp_path, fsync=False, expiry_us=HOUR_US)
    assert points.points() == {"a": 5, "b": 9}
    assert all(before <= t <= consumers._now_us() for t in points.last_commits().values())
    points.commit("a", 6)  # saved in the current format
    assert ConsumerPoints.load(tmp_path, fsync=False).points() == {"a": 6, "b": 9}
    assert (tmp_path / CONSUMERS_FILE).read_bytes().startswith(b"ZCJN\x02\n")


@pytest.mark.parametrize("body", [b'{"a":[5]}', b'{"a":[5,true]}', b'{"a":[5.5,1]}', b'{"a":"5"}', b'[1]'])
def test_a_damaged_entry_is_a_clear_error(tmp_path: Path, body: bytes) -> None:
    (tmp_path / CONSUMERS_FILE).write_bytes(b"ZCJN\x02\n" + body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little"))
    with pytest.raises(JournalError, match="damaged"):
        ConsumerPoints.load(tmp_path, fsync=False)


def test_a_failed_save_while_expiring_does_not_stop_the_journal(
        tmp_path: Path, key: bytes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with Journal.open(tmp_path / "j", key=key, consumer_expiry_ms=1000) as j:
        _fill(j, 20)
        j.commit(5, consumer="gone")
        later = consumers._now_us() + 2 * HOUR_US
        monkeypatch.setattr(consumers, "_now_us", lambda: later)

        def full_disk(*args: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(consumers, "write_atomic", full_disk)
        with caplog.at_level(logging.WARNING, logger="zerocomm_spark.journal.journal"):
            j.enforce_retention()
        assert "No space left on device" in caplog.text
        assert j.consumers() == {"gone": 5}  # kept until it can be saved
        j.append(_rows(21, 30))  # the journal goes on
        monkeypatch.undo()
        monkeypatch.setattr(consumers, "_now_us", lambda: later)
        j.enforce_retention()
        assert j.consumers() == {}
