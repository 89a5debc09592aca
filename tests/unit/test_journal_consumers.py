"""Named consumers' commit points: retention waits for the slowest consumer, points survive restarts."""

from __future__ import annotations

import os
from pathlib import Path

import nacl.utils
import pytest

from zerocomm_spark.errors import ConfigurationError, JournalError
from zerocomm_spark.journal import Journal
from zerocomm_spark.journal.consumers import CONSUMERS_FILE

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
