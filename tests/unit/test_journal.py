"""The journal's API on real files with real crypto: appends, idempotence, reads, retention, commits."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import nacl.utils
import pyarrow as pa
import pytest

from zerocomm_spark.errors import (
    ConfigurationError,
    DataLossError,
    InvalidJournalRowError,
    JournalClosedError,
    JournalError,
    JournalCorruptError,
    JournalKeyError,
    JournalLockedError,
    OffsetOutOfRangeError,
)
from zerocomm_spark.journal import APPEND_SCHEMA, JOURNAL_SCHEMA, AppendResult, Journal, journal_key, reader
from zerocomm_spark.journal import files as files_module
from zerocomm_spark.journal import writer as writer_module
from zerocomm_spark.keys.keystore import Keystore

pytestmark = pytest.mark.timeout(120)

T0 = 1_700_000_000_000_000  # microseconds since the epoch
GROUP = "group-alpha"
ALICE = "did:peer:2.Ez6LSalice"
BOB = "did:peer:2.Ez6LSbob"


def row(seq: int, publisher: str = ALICE, group: str = GROUP, *, size: int = 20, received_at: int | None = None,
        message_id: str | None = None, headers: dict[str, str] | None = None) -> dict:
    return {
        "group": group,
        "message_id": message_id or f"{group}/{publisher}/{seq}",
        "publisher_did": publisher,
        "seq": seq,
        "lamport_ts": seq * 10,
        "sent_at": T0 + seq,
        "received_at": T0 + 1_000 * seq if received_at is None else received_at,
        "headers": headers,
        "payload": f"payload {publisher} {seq} ".encode().ljust(size, b"."),
    }


def rows(first: int, last: int, publisher: str = ALICE, **kw) -> list[dict]:
    return [row(s, publisher, **kw) for s in range(first, last + 1)]


@pytest.fixture
def key() -> bytes:
    return nacl.utils.random(32)


@pytest.fixture
def jdir(tmp_path: Path) -> Path:
    return tmp_path / "journal"


def offsets(table: pa.Table) -> list[int]:
    return table.column("offset").to_pylist()


def seqs(table: pa.Table) -> list[int]:
    return table.column("seq").to_pylist()


# --- appending and reading ---------------------------------------------------------------------


def test_append_assigns_contiguous_offsets_and_reads_back_every_field(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key) as j:
        assert j.append(rows(1, 3)) == AppendResult(0, 2, 3, 0)
        assert j.append([row(4, headers={"content-type": "text/plain"})]) == AppendResult(3, 3, 1, 0)
        table = j.read(0)
    assert table.schema == JOURNAL_SCHEMA
    assert offsets(table) == [0, 1, 2, 3]
    first = table.slice(3, 1).to_pylist()[0]
    assert first["group"] == GROUP and first["publisher_did"] == ALICE and first["seq"] == 4
    assert first["message_id"] == f"{GROUP}/{ALICE}/4" and first["lamport_ts"] == 40
    assert first["sent_at"] == datetime(2023, 11, 14, 22, 13, 20, 4, tzinfo=timezone.utc)
    assert first["received_at"] == first["sent_at"] - timedelta(microseconds=4) + timedelta(microseconds=4000)
    assert first["headers"] == [("content-type", "text/plain")]
    assert first["payload"] == row(4)["payload"]
    assert table.column("headers").null_count == 3


def test_reads_are_exact_across_batch_and_segment_boundaries(jdir: Path, key: bytes) -> None:
    # Small segments: 60 appends of 7 rows spread over many segments and many records.
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        for a in range(60):
            j.append(rows(a * 7 + 1, a * 7 + 7, size=50))
        assert len(list(jdir.glob("*.zcj"))) > 5
        total = 420
        assert j.next_offset == total
        for start, end in [(0, total), (0, 1), (6, 8), (7, 14), (13, 300), (250, 251), (419, 420), (100, 100)]:
            table = j.read(start, end)
            assert offsets(table) == list(range(start, end)), (start, end)
            assert seqs(table) == list(range(start + 1, end + 1))
        batches = list(j.read_batches(5, 40))
        assert sum(b.num_rows for b in batches) == 35
        assert [o for b in batches for o in b.column("offset").to_pylist()] == list(range(5, 40))
        assert offsets(j.read(30, max_rows=11)) == list(range(30, 41))
        assert offsets(j.read(415, max_rows=100)) == list(range(415, 420))
        assert j.read(420).num_rows == 0
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:  # and the same after reopening
        assert offsets(j.read(0)) == list(range(420))
        assert seqs(j.read(133, 170)) == list(range(134, 171))


def test_read_range_errors(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key) as j:
        j.append(rows(1, 5))
        with pytest.raises(OffsetOutOfRangeError):
            j.read(-1)
        with pytest.raises(OffsetOutOfRangeError, match="beyond"):
            j.read(0, 6)
        with pytest.raises(OffsetOutOfRangeError):
            j.read(6)
        with pytest.raises(OffsetOutOfRangeError):
            j.read(3, 2)
        with pytest.raises(OffsetOutOfRangeError):
            j.read_batches(0, 10)
        assert j.read(5).num_rows == 0


def test_append_accepts_arrow_batches_tables_and_message_objects(jdir: Path, key: bytes) -> None:
    @dataclass
    class Delivered:
        group: str
        message_id: str
        publisher_did: str
        seq: int
        lamport_ts: int
        sent_at: datetime
        payload: bytes

    with Journal.open(jdir, key=key) as j:
        batch = pa.RecordBatch.from_pylist(rows(1, 3), schema=APPEND_SCHEMA)
        assert j.append(batch).appended == 3
        # A table with columns in another order, no received_at/headers, castable types.
        table = pa.table({
            "payload": pa.array([b"x", b"y"], pa.large_binary()),
            "seq": pa.array([4, 5], pa.int32()),
            "publisher_did": [ALICE, ALICE],
            "group": [GROUP, GROUP],
            "message_id": ["m4", "m5"],
            "lamport_ts": [1, 2],
            "sent_at": pa.array([T0 // 1000, T0 // 1000], pa.timestamp("ms", tz="UTC")),
        })
        before = datetime.now(timezone.utc)
        assert j.append(table) == AppendResult(3, 4, 2, 0)
        sent = datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=2)))
        assert j.append([Delivered(GROUP, "m6", ALICE, 6, 3, sent, b"z")]).appended == 1
        out = j.read(3).to_pylist()
    assert [r["payload"] for r in out] == [b"x", b"y", b"z"]
    assert out[0]["sent_at"] == datetime.fromtimestamp(T0 // 1_000_000, timezone.utc)
    assert before - timedelta(seconds=1) <= out[0]["received_at"] <= datetime.now(timezone.utc)
    assert out[2]["sent_at"] == sent
    assert out[2]["headers"] is None


@pytest.mark.parametrize("bad, match", [
    ({"sent_at": 1.5}, "sent_at must be int microseconds"),
    ({"sent_at": datetime(2024, 1, 1)}, "naive datetime"),
    ({"seq": "7"}, "seq must be an int"),
    ({"seq": -1}, "seq must be >= 0"),
    ({"payload": "text"}, "payload must be bytes"),
    ({"group": None}, "'group' has 1 null"),
    ({"headers": {"k": 1}}, "headers"),
])
def test_invalid_rows_are_refused_before_anything_is_written(jdir: Path, key: bytes, bad: dict, match: str) -> None:
    with Journal.open(jdir, key=key) as j:
        with pytest.raises(InvalidJournalRowError, match=match):
            j.append([row(1), {**row(2), **bad}])
        missing = row(3)
        del missing["lamport_ts"]
        with pytest.raises(InvalidJournalRowError, match="lamport_ts"):
            j.append([missing])
        with pytest.raises(InvalidJournalRowError, match="list of rows"):
            j.append(row(1))
        assert j.next_offset == 0
        assert j.append([]) == AppendResult(0, -1, 0, 0)


def test_rows_of_dicts_other_mappings_and_objects_mixed_convert_alike_and_say_which_row_is_wrong(
        jdir: Path, key: bytes) -> None:
    from collections import OrderedDict
    from types import SimpleNamespace

    with Journal.open(jdir, key=key) as j:
        second = row(2)
        del second["seq"]
        with pytest.raises(InvalidJournalRowError, match=r"row 1 has no 'seq'"):
            j.append([row(1), second])
        with pytest.raises(InvalidJournalRowError, match=r"row 1 is a int, not a dict"):
            j.append([row(1), 7])
        plain = row(1, received_at=5, headers={"k": "v"})
        ordered = OrderedDict(row(2, received_at=6))
        del ordered["headers"]  # an optional column may be left out
        obj = SimpleNamespace(**{k: v for k, v in row(3).items() if k not in ("headers", "received_at")})
        assert j.append([plain, ordered, obj]).appended == 3
        table = j.read(0)
        assert seqs(table) == [1, 2, 3]
        received = table.column("received_at").cast(pa.int64()).to_pylist()
        assert received[:2] == [5, 6] and received[2] > 10**15  # left out: the time it was appended
        assert table.column("headers").to_pylist() == [[("k", "v")], None, None]
        sparse = row(5)
        del sparse["headers"], sparse["received_at"]
        assert j.append([row(4, headers={"a": "b"}), sparse]).appended == 2  # plain dicts, one without either
        more = j.read(3)
        assert more.column("headers").to_pylist() == [[("a", "b")], None]
        assert more.column("received_at").cast(pa.int64()).to_pylist()[1] > 10**15


# --- idempotence -------------------------------------------------------------------------------


def test_duplicates_by_seq_and_by_message_id_are_skipped_and_counted(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key) as j:
        assert j.append(rows(1, 5)) == AppendResult(0, 4, 5, 0)
        # Overlap: 1..5 again are duplicates by seq; 6..8 are new.
        assert j.append(rows(1, 8)) == AppendResult(5, 7, 3, 5)
        # A new seq but an id already journaled: duplicate by message id.
        assert j.append([row(9, message_id=f"{GROUP}/{ALICE}/3")]) == AppendResult(8, 7, 0, 1)
        # Inside one append: the same id twice, a seq going backwards, two publishers interleaved.
        mixed = [row(10), row(1, BOB), row(10), row(2, BOB), row(9), row(11, message_id=f"{GROUP}/{BOB}/2")]
        assert j.append(mixed) == AppendResult(8, 10, 3, 3)
        table = j.read(0)
        assert list(zip(table.column("publisher_did").to_pylist(), seqs(table))) == (
            [(ALICE, s) for s in range(1, 9)] + [(ALICE, 10), (BOB, 1), (BOB, 2)])
        # The same seq in another group is another publisher stream.
        assert j.append([row(1, group="group-beta")]).appended == 1
        latest = j.latest()
    assert latest.next_offset == 12
    assert {k: (p.last_seq, p.last_offset) for k, p in latest.publishers.items()} == {
        (GROUP, ALICE): (10, 8), (GROUP, BOB): (2, 10), ("group-beta", ALICE): (1, 11)}


def test_last_seqs_and_recent_ids_survive_a_restart(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key, segment_bytes=2048) as j:
        for a in range(10):
            j.append(rows(a * 5 + 1, a * 5 + 5, size=40))
        j.append(rows(1, 3, BOB))
    with Journal.open(jdir, key=key, segment_bytes=2048) as j:
        assert j.append(rows(1, 50) + rows(1, 3, BOB)) == AppendResult(53, 52, 0, 53)
        assert j.append([row(99, message_id=f"{GROUP}/{ALICE}/50")]).duplicates == 1
        assert j.append(rows(51, 52) + rows(4, 4, BOB)) == AppendResult(53, 55, 3, 0)
        assert j.latest().publishers[(GROUP, BOB)].last_seq == 4


def test_message_ids_are_compared_exactly_whatever_their_characters(jdir: Path, key: bytes) -> None:
    # The id rule compares the ids' UTF-8 bytes: non-ASCII ids, ids that differ only by case or by a
    # combining accent are distinct; equal ones are duplicates, before and after a restart.
    odd = ["été/1", "ete/1", "e\u0301te/1", "ÉTÉ/1", " ", "😀", "a" * 300]
    with Journal.open(jdir, key=key, segment_bytes=2048) as j:
        first = j.append([row(s + 1, message_id=m) for s, m in enumerate(odd)])
        assert (first.appended, first.duplicates) == (len(odd), 0)
        again = j.append([row(100 + s, message_id=m) for s, m in enumerate(reversed(odd))])
        assert (again.appended, again.duplicates) == (0, len(odd))
    with Journal.open(jdir, key=key) as j:
        assert j.append([row(200, message_id="été/1"), row(201, message_id="été/2")]).duplicates == 1
        assert j.read(0).column("message_id").to_pylist() == [*odd, "été/2"]


def test_restart_after_a_kill_recovers_state_without_side_files(jdir: Path, key: bytes, tmp_path: Path) -> None:
    # Copying the files of an open journal is what kill -9 leaves: every returned append is in them.
    j = Journal.open(jdir, key=key, segment_bytes=4096)
    try:
        for a in range(20):
            j.append(rows(a * 4 + 1, a * 4 + 4, size=60))
        crashed = tmp_path / "crashed"
        shutil.copytree(jdir, crashed)
    finally:
        j.close()
    for side in crashed.glob("*.idx"):  # also lose every side index
        side.unlink()
    with Journal.open(crashed, key=key, segment_bytes=4096) as j2:
        assert j2.next_offset == 80
        assert j2.append(rows(1, 82)) == AppendResult(80, 81, 2, 80)
        assert seqs(j2.read_by_seq(GROUP, ALICE, 10, 12)) == [10, 11, 12]
    assert len(list(crashed.glob("*.idx"))) == len(list(crashed.glob("*.zcj")))  # rebuilt


def test_what_a_roll_saves_never_names_rows_written_after_it(jdir: Path, key: bytes, monkeypatch) -> None:
    # One append of ~2 MB becomes several records and rolls segments mid-append. What a roll saves
    # (side index, remembered ids) must not name rows written after it: a crash right there would
    # otherwise make their re-send look like a duplicate, and lose them.
    from zerocomm_spark.journal import index as index_module

    saved: list[tuple[int, list[str]]] = []
    real_write = index_module.write_recent_ids

    def write_and_read_back(directory, end_offset, ids, key_):  # the real write, then a real read
        real_write(directory, end_offset, ids, key_)
        end, stored = index_module.read_recent_ids(directory, key_)
        saved.append((end, stored.to_pylist()))

    monkeypatch.setattr(index_module, "write_recent_ids", write_and_read_back)
    with Journal.open(jdir, key=key, segment_bytes=600_000) as j:
        j.append(rows(1, 2000, size=1000))
        table = j.read(0)
    from zerocomm_spark.journal.state import id_key

    # What is remembered is the id rule's keys (ids scoped by group).
    keys_by_offset = [id_key(g, m).decode() for g, m in zip(table.column("group").to_pylist(),
                                                              table.column("message_id").to_pylist())]
    assert len(saved) >= 4  # at open, at each roll, at close
    assert any(remembered for _, remembered in saved)
    for end, remembered in saved:
        assert set(remembered) <= set(keys_by_offset[:end]), end
    sides = sorted(jdir.glob("*.idx"))
    assert len(sides) >= 3
    for side in sides:
        content = index_module.read_index(side, int(side.name[:20]), key)
        assert content is not None
        assert content.state[(GROUP, ALICE)] == (content.end_offset, content.end_offset - 1)


def test_concurrent_appenders_are_group_committed_without_loss_or_duplication(jdir: Path, key: bytes) -> None:
    publishers = [f"did:peer:2.Ez6LSpub{i}" for i in range(8)]
    errors: list[BaseException] = []

    def produce(publisher: str) -> None:
        try:
            for a in range(25):
                result = j.append(rows(a * 4 + 1, a * 4 + 4, publisher, size=30))
                assert result.appended == 4 and result.last_offset - result.first_offset == 3
                j.append(rows(a * 4 + 1, a * 4 + 2, publisher))  # re-send: all duplicates
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with Journal.open(jdir, key=key, segment_bytes=16384, fsync="always") as j:
        threads = [threading.Thread(target=produce, args=(p,)) for p in publishers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        table = j.read(0)
        stats = j.stats()
    assert stats.appends == 400 and stats.rows_appended == 800 and stats.duplicates == 400
    assert stats.writes < stats.appends  # appenders shared writes: group commit
    assert stats.fsyncs >= stats.writes  # "always": every write synced before its appends returned
    assert offsets(table) == list(range(800))
    for p in publishers:
        mine = table.filter(pa.compute.equal(table.column("publisher_did"), p))
        assert seqs(mine) == list(range(1, 101))  # per-publisher FIFO kept


def test_readers_see_exact_ranges_while_appends_and_rolls_go_on(jdir: Path, key: bytes) -> None:
    done = threading.Event()
    problems: list[str] = []

    def read_along() -> None:
        while not done.is_set():
            end = j.next_offset
            start = max(0, end - 37)
            table = j.read(start, end)
            if offsets(table) != list(range(start, end)) or seqs(table) != list(range(start + 1, end + 1)):
                problems.append(f"bad read of [{start}, {end})")
            latest = j.latest()
            if latest.next_offset < end:
                problems.append("latest went backwards")
            time.sleep(0.002)  # leave the writer some GIL: this checks correctness, not stress

    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        readers = [threading.Thread(target=read_along) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for a in range(100):
                j.append(rows(a * 3 + 1, a * 3 + 3, size=50))
        finally:
            done.set()
            for t in readers:
                t.join(30)
        assert not problems, problems[:3]
        assert offsets(j.read(0)) == list(range(300))


# --- read_by_seq, latest, timestamps -----------------------------------------------------------


def test_read_by_seq_reads_only_that_publishers_range(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        for a in range(30):
            j.append(rows(a * 3 + 1, a * 3 + 3, ALICE, size=40) + rows(a * 2 + 1, a * 2 + 2, BOB, size=40))
        got = j.read_by_seq(GROUP, ALICE, 20, 47)
        assert seqs(got) == list(range(20, 48))
        assert set(got.column("publisher_did").to_pylist()) == {ALICE}
        assert offsets(got) == sorted(offsets(got))
        assert seqs(j.read_by_seq(GROUP, BOB, 59, 100)) == [59, 60]
        assert j.read_by_seq(GROUP, BOB, 61, 100).num_rows == 0
        assert j.read_by_seq("other", BOB, 1, 100).num_rows == 0
        assert j.read_by_seq(GROUP, ALICE, 5, 4).num_rows == 0


def test_an_fsync_interval_its_wait_cannot_take_is_refused(jdir: Path, key: bytes) -> None:
    """fsync_interval_ms=2**53 opened, and the background thread died at its first wait (OverflowError):
    no interval fsync and no retention for the journal's whole life."""
    with pytest.raises(ConfigurationError, match="fsync_interval_ms must be at most"):
        Journal.open(jdir, key=key, fsync_interval_ms=2**53)
    Journal.open(jdir, key=key, fsync_interval_ms=86_400_000).close()


def test_read_by_seq_takes_bounds_past_int64(jdir: Path, key: bytes) -> None:
    """A seq range ending past 2**63-1 (the API takes any JSON integer: `read` with last_seq=2**64)
    reached pyarrow's compare as a Python int no int64 holds: a TypeError, the call's "the agent failed"."""
    with Journal.open(jdir, key=key) as j:
        j.append(rows(1, 3, ALICE))
        assert seqs(j.read_by_seq(GROUP, ALICE, 2, 2**64)) == [2, 3]
        assert seqs(j.read_by_seq(GROUP, ALICE, -2**70, 2**200)) == [1, 2, 3]
        assert j.read_by_seq(GROUP, ALICE, 2**64, 2**65).num_rows == 0


def test_offset_for_timestamp(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key, segment_bytes=2048) as j:
        for a in range(20):
            j.append(rows(a * 5 + 1, a * 5 + 5, size=40))  # received_at = T0 + 1000 * seq
        assert j.offset_for_timestamp(0) == 0
        assert j.offset_for_timestamp(T0 + 1000) == 0
        assert j.offset_for_timestamp(T0 + 1001) == 1
        assert j.offset_for_timestamp(T0 + 57_000) == 56
        assert j.offset_for_timestamp(T0 + 100_000) == 99
        assert j.offset_for_timestamp(T0 + 100_001) == 100  # nothing that recent: the end
        when = datetime.fromtimestamp(0, timezone.utc) + timedelta(microseconds=T0 + 33_000)
        assert j.offset_for_timestamp(when) == 32
        with pytest.raises(InvalidJournalRowError):
            j.offset_for_timestamp(1.5)  # type: ignore[arg-type]


# --- commit point and retention ----------------------------------------------------------------


def _fill(j: Journal, appends: int, first_seq: int = 1, **kw) -> None:
    for a in range(appends):
        s = first_seq + a * 10
        j.append(rows(s, s + 9, size=200, **kw))


def test_commit_is_durable_and_monotonic(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key) as j:
        _fill(j, 3)
        assert j.committed_offset == 0
        assert j.commit(12) == 12
        assert j.commit(5) == 12  # never backwards
        with pytest.raises(OffsetOutOfRangeError):
            j.commit(31)
    with Journal.open(jdir, key=key) as j:
        assert j.committed_offset == 12


def test_size_retention_deletes_only_segments_below_the_commit_point(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192) as j:
        _fill(j, 30)  # ~70 KB: far over the retention budget
        assert j.earliest_offset() == 0  # nothing committed: nothing deleted
        assert j.read(0, 5).num_rows == 5
        j.commit(120)
        earliest = j.earliest_offset()
        assert 0 < earliest <= 120  # only whole segments below the commit point went
        remaining = sorted(jdir.glob("*.zcj"))
        assert int(remaining[0].name[:20]) == earliest
        assert len(list(jdir.glob("*.idx"))) <= len(remaining)
        with pytest.raises(DataLossError, match="deleted by retention"):
            j.read(earliest - 1)
        with pytest.raises(DataLossError):
            list(j.read_batches(0, earliest + 1))
        assert offsets(j.read(earliest, 200)) == list(range(earliest, 200))
        assert j.read_by_seq(GROUP, ALICE, 1, 300).column("seq")[0].as_py() == earliest + 1
        j.commit(300)
        assert sum(p.stat().st_size for p in jdir.glob("*.zcj")) <= 8192 + 4096
        # Retention forgets rows, not publishers: a late re-send is still a duplicate.
        assert j.append(rows(1, 10, size=200)).duplicates == 10
        assert j.latest().publishers[(GROUP, ALICE)].last_seq == 300
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192) as j:
        assert j.earliest_offset() > 120
        assert j.append(rows(1, 300, size=200)).appended == 0


def test_age_retention(jdir: Path, key: bytes) -> None:
    now = int(datetime.now(timezone.utc).timestamp() * 1e6)
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_ms=60_000) as j:
        _fill(j, 10, received_at=now - 3_600_000_000)  # an hour old
        _fill(j, 10, first_seq=101, received_at=now)  # fresh
        assert j.enforce_retention() == 0  # not committed yet
        j.commit(j.next_offset)
        assert j.earliest_offset() > 0
        table = j.read(j.earliest_offset())
        old = pa.compute.less(table.column("received_at"), pa.scalar(now - 60_000_000, pa.timestamp("us", "UTC")))
        # Only segments wholly older than the limit went; fresh rows are all kept.
        assert seqs(table)[-100:] == list(range(101, 201))
        assert j.read(j.earliest_offset()).num_rows < 200
        assert pa.compute.sum(old).as_py() < 100


@pytest.mark.parametrize("read_threads", [1, 4])
def test_read_by_seq_racing_retention_returns_the_rows_left(jdir: Path, key: bytes, monkeypatch,  # noqa: ANN001
                                                            read_threads: int) -> None:
    """Retention deleting a segment between read_by_seq's plan and its reading: the rows it took are
    absent from the answer, as the docstring says, not a DataLossError (a read from seq 1, the API's
    default, always starts in the oldest segment: the one retention deletes)."""
    from zerocomm_spark.journal import journal as journal_module

    with Journal.open(jdir, key=key, segment_bytes=4096, read_threads=read_threads) as j:
        _fill(j, 30)
        j.commit(200)
        real = journal_module.iter_pieces

        def racing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if j.retention_bytes is None:  # once: retention runs after the plan was made
                j.retention_bytes = 8192
                assert j.enforce_retention() > 0
            return real(*args, **kwargs)

        monkeypatch.setattr(journal_module, "iter_pieces", racing)
        table = j.read_by_seq(GROUP, ALICE, 1, 300)
        assert seqs(table) == list(range(j.earliest_offset() + 1, 301))
        assert seqs(j.read_by_seq(GROUP, ALICE, 1, 300, max_rows=5)) == list(range(j.earliest_offset() + 1,
                                                                                  j.earliest_offset() + 6))


def test_offset_for_timestamp_racing_retention_searches_again(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    from zerocomm_spark.journal import journal as journal_module

    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        _fill(j, 30)
        j.commit(200)
        real = journal_module.open_segment

        def racing(path: Path) -> int:
            if j.retention_bytes is None:  # retention deletes the segment found, before it is opened
                j.retention_bytes = 8192
                assert j.enforce_retention() > 0
            return real(path)

        monkeypatch.setattr(journal_module, "open_segment", racing)
        assert j.offset_for_timestamp(T0) == j.earliest_offset() > 0


def test_a_commit_point_past_the_end_is_clamped_on_disk_too(jdir: Path, key: bytes) -> None:
    """A commit point beyond the end (rows consumed, then lost to a power loss under "interval") is
    brought back to the end at open - and saved so: otherwise the next open took it back once new
    rows had passed it, and retention deleted those rows before any consumer read them."""
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        _fill(j, 1)
        j.commit(10)
    files_module.write_commit(jdir, 200)  # what a power loss after commit(200) leaves: offsets 10..199 lost
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        assert j.committed_offset == 10
        _fill(j, 30, first_seq=11)  # new rows at offsets 10..309, consumed by nobody
    assert files_module.read_commit(jdir) == 10
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=8192) as j:
        assert j.committed_offset == 10
        assert j.earliest_offset() <= 10  # nothing past the real commit point went
        assert offsets(j.read(10, 310)) == list(range(10, 310))


def test_overlapping_retention_passes_never_leave_a_hole_a_kill_could_keep(jdir: Path, key: bytes, monkeypatch,  # noqa: ANN001
                                                                            tmp_path: Path) -> None:
    """Retention runs after commits, rolls and every second, from different threads. Two passes at
    once unlinked out of order: a kill -9 while the first was still unlinking kept a segment whose
    neighbours were gone - a hole. After the restart the journal started at that segment, reads
    from there failed at the hole, and the positions of the publishers whose rows it had held came
    from that old segment's side file: their re-sends were journaled again."""
    import pathlib

    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        _fill(j, 20)  # ALICE's seqs 1..200, over many segments
        _fill(j, 2, publisher=BOB)  # BOB's only rows, after them
        _fill(j, 10, first_seq=201)
        j.commit(j.next_offset)
        real_unlink = pathlib.Path.unlink
        first_started, killed = threading.Event(), threading.Event()
        snapshot = tmp_path / "after-kill"

        def unlink(self: Path, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            if threading.current_thread().name == "first" and not first_started.is_set():
                first_started.set()  # the first pass starts unlinking...
                assert killed.wait(10)  # ...and the process is killed before it goes on
            real_unlink(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "unlink", unlink)
        j.retention_bytes = sum(p.stat().st_size for p in jdir.glob("*.zcj")) - 1  # one segment too many
        first = threading.Thread(target=j.enforce_retention, name="first")
        first.start()
        assert first_started.wait(10)
        j.retention_bytes = 0  # a second pass (a commit, a roll): everything committed may go
        second = threading.Thread(target=j.enforce_retention, name="second")
        second.start()
        second.join(1)
        shutil.copytree(jdir, snapshot)  # kill -9 now: the directory as it is
        killed.set()
        first.join(10)
        second.join(10)
    with Journal.open(snapshot, key=key, segment_bytes=4096) as j:
        assert offsets(j.read(j.earliest_offset())) == list(range(j.earliest_offset(), j.next_offset))
        assert j.latest().publishers[(GROUP, BOB)].last_seq == 20
        assert j.append(rows(1, 20, publisher=BOB)).appended == 0


# --- lifecycle, keys, configuration ------------------------------------------------------------


def test_one_journal_per_directory_and_closed_journal_refuses_use(jdir: Path, key: bytes) -> None:
    j = Journal.open(jdir, key=key)
    with pytest.raises(JournalLockedError):
        Journal.open(jdir, key=key)
    j.append(rows(1, 2))
    j.close()
    j.close()  # idempotent
    for call in (lambda: j.append(rows(3, 3)), lambda: j.read(0), lambda: j.latest(), lambda: j.commit(1)):
        with pytest.raises(JournalClosedError):
            call()
    with Journal.open(jdir, key=key) as again:
        assert again.next_offset == 2


def test_wrong_or_malformed_key(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key) as j:
        j.append(rows(1, 1))
    with pytest.raises(JournalKeyError) as caught:
        Journal.open(jdir, key=nacl.utils.random(32))
    assert key.hex() not in str(caught.value)
    with pytest.raises(JournalKeyError, match="32 bytes"):
        Journal.open(jdir, key=b"short")
    with Journal.open(jdir, key=key) as j:  # the lock was released by the failed opens
        assert j.next_offset == 1
        assert key.hex() not in repr(j) and str(key) not in repr(j)
        with pytest.raises(TypeError):
            import pickle

            pickle.dumps(j)


@pytest.mark.parametrize("kwargs", [{"fsync": "sometimes"}, {"segment_bytes": 10}, {"retention_ms": -1},
                                    {"timeout": 0}, {"read_threads": 0}])
def test_bad_configuration(jdir: Path, key: bytes, kwargs: dict) -> None:
    with pytest.raises(ConfigurationError):
        Journal.open(jdir, key=key, **kwargs)


@pytest.mark.parametrize("policy", ["always", "interval", "never"])
def test_every_fsync_policy_round_trips_and_leaks_no_descriptor(jdir: Path, key: bytes, policy: str) -> None:
    before = len(os.listdir("/proc/self/fd"))
    with Journal.open(jdir, key=key, fsync=policy, fsync_interval_ms=5, segment_bytes=2048) as j:
        _fill(j, 30)  # a roll per append or so
        j.sync()
        assert len(list(jdir.glob("*.zcj"))) >= 10
        assert len(os.listdir("/proc/self/fd")) < before + 8
    assert len(os.listdir("/proc/self/fd")) == before
    with Journal.open(jdir, key=key, fsync=policy) as j:
        assert seqs(j.read(0)) == list(range(1, 301))


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.mark.parametrize("policy", ["always", "interval", "never"])
def test_blocks_reserved_ahead_of_the_writes_never_show_in_sizes_and_are_given_back(jdir: Path, key: bytes,
                                                                                    policy: str) -> None:
    segment_bytes = 4 << 20
    with Journal.open(jdir, key=key, segment_bytes=segment_bytes, fsync=policy) as j:
        _fill(j, 3)
        (active,) = jdir.glob("*.zcj")
        assert active.stat().st_size < 16 << 10  # the size is what was written: readers, recovery, retention
        probe = os.open(jdir / "probe", os.O_WRONLY | os.O_CREAT, 0o600)
        try:  # (a file system may take the call and allocate nothing: the blocks say)
            reserving = files_module.preallocate(probe, 0, 1 << 20) and os.fstat(probe).st_blocks * 512 >= 1 << 20
        finally:
            os.close(probe)
        if reserving:  # the segment's blocks are held up to its size
            assert _allocated(active) >= segment_bytes - 4096
        seq = 1_000
        while len(list(jdir.glob("*.zcj"))) < 2:  # a roll (records of ~500 kB)
            j.append(rows(seq, seq + 9, size=50_000))
            seq += 10
        first = min(jdir.glob("*.zcj"))
        if policy == "interval":
            j.sync()  # given back once the syncer has the rolled segment on disk
        # Given back ("never": kept, less than the one record that did not fit)
        slack = (1 << 20) if policy == "never" else (64 << 10)
        assert _allocated(first) < first.stat().st_size + slack
    for segment in jdir.glob("*.zcj"):  # the active one gives it back at close
        assert _allocated(segment) < segment.stat().st_size + (1 << 20 if policy == "never" else 64 << 10)
    last = max(jdir.glob("*.zcj"))
    assert _allocated(last) < last.stat().st_size + (64 << 10)
    with Journal.open(jdir, key=key) as j:
        assert j.read(0).num_rows == j.latest().next_offset


def test_the_key_lives_in_the_keystore(tmp_path: Path, jdir: Path) -> None:
    with Keystore.open(tmp_path / "identity") as ks:
        key = journal_key(ks)
        assert len(key) == 32 and journal_key(ks) == key
    with Keystore.open(tmp_path / "identity") as ks, Journal.open(jdir, key=journal_key(ks)) as j:
        j.append(rows(1, 1))


def test_dedup_window_zero_keeps_only_the_seq_rule(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key, dedup_window=0) as j:
        assert j.append(rows(1, 5)).appended == 5
        assert j.append(rows(1, 5)).duplicates == 5  # the seq rule still holds
        reused = [row(6, message_id=f"{GROUP}/{ALICE}/1"), row(7, message_id=f"{GROUP}/{ALICE}/1")]
        assert j.append(reused).appended == 2  # ids are not checked
    with Journal.open(jdir, key=key) as j:  # and with the rule on again, it applies from now on
        assert j.append([row(8, message_id=f"{GROUP}/{ALICE}/1")]).duplicates == 1


def test_a_write_failure_stops_the_journal_and_a_reopen_recovers(jdir: Path, key: bytes) -> None:
    # A real failure, no mock: a child process whose files may not grow past 150 kB (RLIMIT_FSIZE).
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, resource.RLIM_INFINITY))
        from zerocomm_spark.errors import JournalClosedError, JournalError
        from zerocomm_spark.journal import Journal
        j = Journal.open({str(jdir)!r}, key=bytes.fromhex({key.hex()!r}))
        acked = 0
        try:
            for a in range(100):
                j.append([dict(group="g", message_id=f"m{{s}}", publisher_did="p", seq=s, lamport_ts=s,
                               sent_at=0, payload=b"x" * 1000) for s in range(a * 10 + 1, a * 10 + 11)])
                acked = a * 10 + 10
        except JournalError as exc:
            assert "File too large" in str(exc), exc
        try:
            j.append([dict(group="g", message_id="late", publisher_did="p", seq=10_000, lamport_ts=0,
                           sent_at=0, payload=b"")])
            sys.exit("append after a failure should raise")
        except JournalClosedError:
            pass
        j.close()
        print(acked)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    acked = int(done.stdout.split()[-1])
    assert 0 < acked < 1000
    with Journal.open(jdir, key=key) as j:  # every acknowledged row is there; the torn tail is gone
        table = j.read(0)
        assert table.column("seq").to_pylist()[:acked] == list(range(1, acked + 1))
        assert j.append([dict(group="g", message_id="after", publisher_did="p", seq=5000, lamport_ts=0, sent_at=0,
                              payload=b"")]).appended == 1


# Run in a child: it opens a journal of 1 kB segments, takes every descriptor its lowered open-file
# limit leaves, and appends until a roll needs one more. Prints the error's message, hint and cause.
EMFILE_AT_ROLL = """
import errno, json, os, resource, sys
from zerocomm_spark.errors import JournalClosedError, JournalError
from zerocomm_spark.journal import Journal

def rows(first, last):
    return [dict(group="g", message_id=f"m{s}", publisher_did="p", seq=s, lamport_ts=s, sent_at=0,
                 payload=b"x" * 200) for s in range(first, last + 1)]

j = Journal.open(sys.argv[1], key=bytes.fromhex(sys.argv[2]), segment_bytes=1024)
j.append(rows(1, 2))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 200), hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError as exc:
    assert exc.errno == errno.EMFILE, exc
acked = 2
try:
    for seq in range(3, 200):
        j.append(rows(seq, seq))
        acked = seq
    sys.exit("no roll failed")
except JournalError as exc:
    failure = exc
try:
    j.append(rows(500, 500))
    sys.exit("an append after the failure should raise")
except JournalClosedError as exc:
    closed = exc
for fd in held:
    os.close(fd)
j.close()
print(json.dumps({"type": type(failure).__name__, "message": failure.message, "hint": failure.hint,
                  "cause": getattr(failure.__cause__, "errno", None), "acked": acked,
                  "closed_cause": getattr(closed.__cause__, "hint", None)}))
"""


def test_a_roll_out_of_file_descriptors_stops_the_journal_and_says_to_raise_the_open_file_limit(
        jdir: Path, key: bytes) -> None:
    """A segment roll that failed with EMFILE (the side index and the next segment each need a
    descriptor) stopped the journal, rightly, but its hint said to check the directory's permissions
    and free space: the user checked the disk. The hint now follows the errno. A real EMFILE: the
    child lowers RLIMIT_NOFILE and holds every descriptor left."""
    import errno
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EMFILE_AT_ROLL, str(jdir), key.hex()], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["type"] == "JournalError" and "Too many open files" in said["message"], said
    assert said["cause"] == errno.EMFILE, said  # kept for an owner that says what to fix (the agent)
    hint = said["hint"]
    assert "ran out of file descriptors" in hint and "ulimit -n" in hint and "LimitNOFILE" in hint, hint
    assert "`fds`" in hint and "reopen the journal" in hint, hint
    assert "free space" not in hint and "permissions" not in hint, hint
    assert said["closed_cause"] == hint, said  # later appends' JournalClosedError carries the failure
    with Journal.open(jdir, key=key) as j:  # every acknowledged row is there, and it takes more
        assert j.read(0).column("seq").to_pylist() == list(range(1, said["acked"] + 1))
        assert j.append([dict(group="g", message_id="after", publisher_did="p", seq=1000, lamport_ts=0,
                              sent_at=0, payload=b"")]).appended == 1


@pytest.mark.parametrize(("code", "said", "not_said"), [
    ("ENFILE", "ran out of file descriptors", "free space"),
    ("ENOSPC", "Free space on the journal's file system", "descriptors"),
    ("EDQUOT", "quota", "descriptors"),
    ("EACCES", "permissions", "free space"),
    ("EPERM", "permissions", "free space"),
    ("EIO", "Fix what the OS reported (Input/output error)", "free space"),
])
def test_the_hint_of_a_write_failure_follows_its_errno(code: str, said: str, not_said: str) -> None:
    import errno

    number = getattr(errno, code)
    fix = files_module.os_error_fix(OSError(number, os.strerror(number)))
    assert said in fix and not_said not in fix, fix


def test_a_journal_whose_directory_was_removed_refuses_appends_instead_of_writing_them_nowhere(
        jdir: Path, key: bytes, caplog) -> None:
    # Before, appends to the unlinked active segment succeeded: acknowledged, then gone at the next open.
    import shutil

    from zerocomm_spark.errors import JournalClosedError, JournalError

    with Journal.open(jdir, key=key) as j:
        assert j.append(rows(1, 5)).appended == 5
        shutil.rmtree(jdir)
        with caplog.at_level("ERROR", logger="zerocomm_spark.journal.writer"):
            with pytest.raises(JournalError, match="was removed while the journal was open") as raised:
                j.append(rows(6, 10))
        assert "restart the agent" in str(raised.value)
        assert "was removed while the journal was open" in caplog.text  # the log says why, not just the type
        with pytest.raises(JournalClosedError):  # stopped, as after any write failure
            j.append(rows(11, 12))
    with Journal.open(jdir, key=key) as j:  # a new, empty journal: nothing claims rows 6-10 were kept
        assert j.latest().next_offset == 0


def test_reads_decrypt_runs_of_consecutive_records_per_task_and_keep_holes_apart() -> None:
    from zerocomm_spark.journal import reader
    from zerocomm_spark.journal.codec import RecordHeader
    from zerocomm_spark.journal.segment import Damage, RecordEntry

    def piece(path: str, base: int, body: int) -> reader.Piece:
        header = RecordHeader(body, 0, base, 1, 0, 0, bytes(24))
        return reader.Piece(Path(path), RecordEntry(0, header), 0, 1)

    mib = 1 << 20
    a = [piece("a", i, mib // 2) for i in range(5)]  # 2.5 MiB in one file
    hole = reader.Hole(Path("a"), Damage(5, 6, 0))
    b = [piece("b", 6 + i, mib) for i in range(3)]
    runs = list(reader._runs([*a, hole, *b]))  # noqa: SLF001
    assert [len(r) if isinstance(r, list) else "hole" for r in runs] == [4, 1, "hole", 2, 1]
    assert [p for r in runs if isinstance(r, list) for p in r] == [*a, *b]  # order kept, nothing lost


def test_the_reading_thread_reads_runs_itself_while_the_pool_is_busy_and_order_is_kept(
        jdir: Path, key: bytes, monkeypatch) -> None:
    from zerocomm_spark.journal import reader

    monkeypatch.setattr(reader, "RUN_BYTES", 1)  # one record per run: many runs
    real = reader._load_run  # noqa: SLF001
    who: list[tuple[str, int]] = []

    def load(fds, run, key):  # noqa: ANN001, ANN202
        pool = threading.current_thread().name.startswith("zerocomm-journal-read")
        if pool:
            time.sleep(0.02)  # a busy pool thread: the caller should not just wait for it
        who.append(("pool" if pool else "caller", run[0].entry.base_offset))
        return real(fds, run, key)

    with Journal.open(jdir, key=key, read_threads=2) as j:
        for a in range(30):
            j.append(rows(a * 3 + 1, a * 3 + 3))
        monkeypatch.setattr(reader, "_load_run", load)
        got = [offsets(pa.Table.from_batches([b])) for b in j.read_batches(0)]
        assert [o for batch in got for o in batch] == list(range(90))  # every row once, in order
        assert {w for w, _ in who} == {"pool", "caller"}  # both read
        assert sorted(base for _, base in who) == list(range(0, 90, 3))  # each record read once
        partial = [o for b in j.read_batches(10, 50) for o in offsets(pa.Table.from_batches([b]))]
        assert partial == list(range(10, 50))


# Found in review: errors, timeouts and a closed pool while the reading thread reads ahead itself.


def _corrupt_body(path: Path, entry) -> None:  # flip one body byte: crc and authentication fail
    with open(path, "r+b") as f:
        f.seek(entry.position + reader.RECORD_HEADER_BYTES + 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _slow_pool_reads(monkeypatch, seconds: float, after=None) -> None:  # noqa: ANN001
    """One record per run; a run read by a thread named ``pool...`` takes ``seconds`` longer, then
    ``after(fds)`` looks at the read's descriptors."""
    monkeypatch.setattr(reader, "RUN_BYTES", 1)
    real = reader._load_run  # noqa: SLF001

    def load(fds, run, k):  # noqa: ANN001, ANN202
        if threading.current_thread().name.startswith("pool"):
            time.sleep(seconds)
            if after is not None:
                after(fds)
        return real(fds, run, k)

    monkeypatch.setattr(reader, "_load_run", load)


def _journal_of_records(jdir: Path, key: bytes, records: int) -> Journal:
    j = Journal.open(jdir, key=key)
    for a in range(records):
        j.append(rows(a * 3 + 1, a * 3 + 3))
    return j


def test_a_damaged_record_read_inline_raises_only_where_the_consumer_reaches_it(jdir: Path, key: bytes,
                                                                                monkeypatch) -> None:
    with _journal_of_records(jdir, key, 3) as j:
        plan = j._plan(0, 9)  # noqa: SLF001
        _corrupt_body(plan[1].path, plan[1].entry)  # the second record (offsets 3..5)
        _slow_pool_reads(monkeypatch, 0.3)  # the head run is still being read when the caller looks at it
        with ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
            got = []
            with pytest.raises(JournalCorruptError):
                for b in reader.iter_pieces(plan, key, pool, 1, 10.0):
                    got.extend(offsets(pa.Table.from_batches([b])))
            assert got == [0, 1, 2]  # the rows before the damaged record all came out


def test_a_large_append_is_encrypted_by_read_threads_threads(jdir: Path, key: bytes, monkeypatch) -> None:
    from zerocomm_spark.journal import codec

    real = codec.encode_record
    who: list[str] = []

    def enc(*a, **kw):
        who.append(threading.current_thread().name)
        time.sleep(0.05)
        return real(*a, **kw)

    monkeypatch.setattr(codec, "encode_record", enc)
    with Journal.open(jdir, key=key, read_threads=2) as j:
        j.append(rows(1, 64, size=200_000))  # ~12.8 MB: 13 records
        n = len(who)
        caller = sum(1 for w in who if not w.startswith("zerocomm-journal-read"))
        assert n == 13 and caller >= n // 2 - 1, (n, caller)  # read_threads=2: the caller shares the work


def test_a_head_run_that_times_out_is_waited_for_before_its_descriptors_close(jdir: Path, key: bytes,
                                                                             monkeypatch) -> None:
    from zerocomm_spark.errors import JournalTimeoutError

    used_after_close: list[bool] = []  # per late task: had the reader already closed its descriptors?
    with _journal_of_records(jdir, key, 2) as j:
        plan = j._plan(0, 6)  # noqa: SLF001
        _slow_pool_reads(monkeypatch, 0.5, lambda fds: used_after_close.append(not fds._fds))  # noqa: SLF001
        before = len(os.listdir("/proc/self/fd"))
        with ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
            with pytest.raises(JournalTimeoutError):
                list(reader.iter_pieces(plan, key, pool, 1, 0.1))
        assert used_after_close == [False]  # the late task still had its descriptors
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/fd")) != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/fd")) == before  # and they were closed once it ended


def test_a_pool_shut_down_during_a_read_raises_journal_closed(jdir: Path, key: bytes, monkeypatch) -> None:
    with _journal_of_records(jdir, key, 5) as j:
        plan = j._plan(0, 15)  # noqa: SLF001
        _slow_pool_reads(monkeypatch, 0.3)
        pool = ThreadPoolExecutor(1, thread_name_prefix="pool")
        it = reader.iter_pieces(plan, key, pool, 3, 5.0)
        next(it)
        pool.shutdown(wait=False, cancel_futures=True)  # what Journal.close() does
        with pytest.raises(JournalClosedError):  # not concurrent.futures.CancelledError
            list(it)


# --- who writes: an appender in its own thread, or the writer thread ----------------------------


def test_ctrl_c_during_an_append_written_inline_comes_after_the_write(jdir: Path, key: bytes, monkeypatch) -> None:
    import signal

    from zerocomm_spark.journal import writer

    slow = writer._writev_all  # noqa: SLF001

    def slow_writev(fd: int, buffers: list) -> None:
        time.sleep(0.4)  # a slow disk: the Ctrl-C arrives in the middle of the write
        slow(fd, buffers)

    with Journal.open(jdir, key=key) as j:
        monkeypatch.setattr(writer, "_writev_all", slow_writev)
        threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            j.append(rows(1, 3))
        monkeypatch.undo()
        assert seqs(j.read(0)) == [1, 2, 3]  # the append was written whole before the interrupt surfaced
        assert j.append(rows(4, 5)).appended == 2  # and the journal goes on


def test_an_appender_interrupted_before_it_writes_leaves_its_append_to_the_writer_thread(
        jdir: Path, key: bytes, monkeypatch) -> None:
    from zerocomm_spark.journal import writer

    real = writer.Writer._commit_inline  # noqa: SLF001
    calls = []

    def interrupted(self: writer.Writer) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(writer.Writer, "_commit_inline", interrupted)
    with Journal.open(jdir, key=key) as j:
        with pytest.raises(KeyboardInterrupt):
            j.append(rows(1, 2))
        deadline = time.monotonic() + 10
        while j.latest().next_offset < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seqs(j.read(0)) == [1, 2]  # the writer thread took it over
        assert j.append(rows(3, 4), timeout=5).appended == 2  # nothing is left waiting on a gone committer


def test_close_never_pulls_files_from_under_a_write_still_under_way(jdir: Path, key: bytes, monkeypatch) -> None:
    from zerocomm_spark.errors import JournalTimeoutError
    from zerocomm_spark.journal import writer

    real_writev, real_sync = writer._writev_all, writer.Writer.sync  # noqa: SLF001
    gate, entered, failing = threading.Event(), threading.Event(), threading.Event()

    def held_writev(fd: int, buffers: list) -> None:
        if threading.current_thread().name == "appender":
            entered.set()
            gate.wait(20)
        real_writev(fd, buffers)

    def sync(self: writer.Writer, *, force: bool = False) -> None:
        if failing.is_set() and not force:
            raise OSError(5, "Input/output error")  # the background fsync fails: the journal stops
        real_sync(self, force=force)

    monkeypatch.setattr(writer, "_writev_all", held_writev)
    monkeypatch.setattr(writer.Writer, "sync", sync)
    j = Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=20)
    segment = j._writer._active.path  # noqa: SLF001
    outcome: list[object] = []
    appender = threading.Thread(target=lambda: outcome.append(j.append(rows(1, 1))), name="appender")
    appender.start()
    assert entered.wait(10)
    failing.set()
    deadline = time.monotonic() + 10
    while j._writer.failure is None and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)
    with pytest.raises(JournalTimeoutError):
        j.close(timeout=0.5)  # the appender is still writing: close must not close its descriptor
    with pytest.raises(JournalLockedError):
        Journal.open(jdir, key=key)  # and the directory stays locked while it does
    before = segment.stat().st_size
    gate.set()
    appender.join(10)
    assert segment.stat().st_size > before  # the write landed in the segment, not in a reused descriptor


def test_queued_appenders_and_a_close_are_woken_not_left_to_the_writer_poll(
        jdir: Path, key: bytes, monkeypatch) -> None:
    """Routine commits notify only threads that wait for something (queue space, a committer to
    finish, work handed over): with the idle writer's safety-net poll pushed beyond every deadline
    here, a wake-up that went missing would show as a timeout or a close that hangs."""
    from zerocomm_spark.journal import writer

    monkeypatch.setattr(writer, "_IDLE_POLL_S", 120.0)
    monkeypatch.setattr(writer, "MAX_QUEUED_BYTES", 1)  # one append queued at a time: the rest wait for space
    errors: list[BaseException] = []

    def produce(publisher: str) -> None:
        try:
            for a in range(30):
                assert j.append(rows(a * 2 + 1, a * 2 + 2, publisher), timeout=30).appended == 2
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    j = Journal.open(jdir, key=key)
    threads = [threading.Thread(target=produce, args=(f"did:peer:2.Ez6LSwake{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert offsets(j.read(0)) == list(range(240))
    monkeypatch.setattr(writer, "MAX_QUEUED_BYTES", 256 << 20)

    real_writev = writer._writev_all  # noqa: SLF001
    gate, entered = threading.Event(), threading.Event()

    def held_writev(fd: int, buffers: list) -> None:
        if threading.current_thread().name == "appender":
            entered.set()
            gate.wait(20)
        real_writev(fd, buffers)

    monkeypatch.setattr(writer, "_writev_all", held_writev)

    # An append queued behind an appender writing its own: handed to the writer thread, which must
    # be told (nobody else waits on anything here).
    appender = threading.Thread(target=lambda: j.append(rows(1, 1, "did:peer:2.Ez6LSfirst")), name="appender")
    appender.start()
    assert entered.wait(10)
    second = threading.Thread(target=lambda: outcome.append(j.append(rows(1, 1, "did:peer:2.Ez6LSsecond"),
                                                                     timeout=30)))
    outcome: list[AppendResult] = []
    second.start()
    deadline = time.monotonic() + 10
    while not j._writer._queue and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)
    gate.set()
    appender.join(30)
    second.join(60)
    assert [r.first_offset for r in outcome] == [241]
    gate.clear()
    entered.clear()

    # A close while an appender thread writes its own append: the writer thread, idle, must hear
    # that the appender is done (it may only stop then) without waiting out its poll.
    appender = threading.Thread(target=lambda: j.append(rows(1, 1, "did:peer:2.Ez6LSlast")), name="appender")
    appender.start()
    assert entered.wait(10)
    closer = threading.Thread(target=lambda: j.close(timeout=60))
    closer.start()
    time.sleep(0.2)
    gate.set()
    started = time.monotonic()
    closer.join(60)
    appender.join(10)
    assert not closer.is_alive() and j.closed
    assert time.monotonic() - started < 30  # not the 120 s poll
    with Journal.open(jdir, key=key) as again:
        assert again.latest().next_offset == 243


def test_sync_under_never_also_syncs_segments_rolled_since(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    """Journal.sync() is the promise "on stable storage now": under "never" a roll closes the old
    segment unsynced, so sync() must still fsync it, not only the segment being written."""
    synced: list[str] = []
    real = os.fdatasync

    def spy(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    with Journal.open(jdir, key=key, segment_bytes=4096, fsync="never") as j:
        j.append(rows(1, 10, size=200))
        j.append(rows(11, 20, size=200))  # does not fit: rolls
        j.append(rows(21, 30, size=200))  # rolls again
        segments = sorted(p.name for p in jdir.glob("*.zcj"))
        assert len(segments) == 3
        monkeypatch.setattr(os, "fdatasync", spy)
        j.sync()
        assert set(segments) <= set(synced)
        synced.clear()
        j.sync()  # nothing new: the rolled segments are not synced again
        assert not set(segments[:-1]) & set(synced)


def test_a_whole_last_record_that_fails_its_checksum_is_damage_not_a_torn_tail(jdir: Path, key: bytes) -> None:
    """A complete last record below a commit point (a consumer read it: it was written in full) that
    fails its crc is rot or tampering. Truncating it dropped acknowledged rows and gave their offsets
    to new rows. Above every commit point it may be a write a power loss cut short: truncated."""
    with Journal.open(jdir, key=key, fsync="always") as j:
        for first in range(1, 6):
            j.append(rows(first, first))
        last = j._segments[-1].records[-1]  # noqa: SLF001
        path = j._segments[-1].path  # noqa: SLF001
        j.commit(5, consumer="spark")
    _corrupt_body(path, last)
    with Journal.open(jdir, key=key) as j:
        assert j.next_offset == 5  # nothing truncated, no offset handed out twice
        assert seqs(j.read(0, 4)) == [1, 2, 3, 4]
        with pytest.raises(JournalCorruptError, match="damaged|position"):
            j.read(4, 5)
        assert j.append(rows(6, 6)).first_offset == 5
    cut = path.stat().st_size - 7  # and a record cut short is still a torn tail, truncated
    with open(path, "r+b") as f:
        f.truncate(cut)
    with Journal.open(jdir, key=key) as j:
        assert j.next_offset == 5 and seqs(j.read(0, 4)) == [1, 2, 3, 4]
        j.append(rows(7, 7))
        last = j._segments[-1].records[-1]  # noqa: SLF001 - offset 5, beyond every commit point
    _corrupt_body(path, last)  # whole, but nobody read it: maybe a power loss's torn write
    with Journal.open(jdir, key=key) as j:
        assert j.next_offset == 5  # truncated: its offset goes to the re-sent row
        assert j.append(rows(7, 7)).first_offset == 5


def test_a_publisher_whose_rows_retention_deleted_is_remembered_after_a_kill(jdir: Path, key: bytes) -> None:
    """Once retention has deleted every closed segment, a kill -9 left no record of a publisher whose
    rows were all in them: its late re-send (seq below its last) was journaled a second time."""
    import signal
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, signal
        from zerocomm_spark.journal import Journal
        def row(seq, pub):
            return dict(group={GROUP!r}, message_id=f"{{pub}}/{{seq}}", publisher_did=pub, seq=seq, lamport_ts=seq,
                        sent_at=0, payload=b"x" * 20)
        j = Journal.open({str(jdir)!r}, key=bytes.fromhex({key.hex()!r}), segment_bytes=4096, retention_bytes=1,
                         dedup_window=0)
        j.append([row(s, "did:old") for s in range(1, 11)])
        for s in range(1, 200):  # later traffic rolls many segments; retention deletes all closed ones
            j.append([row(s, "did:bob")])
        j.commit(j.next_offset)
        assert j.append([row(5, "did:old")]).duplicates == 1
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=1, dedup_window=0) as j:
        assert j.earliest_offset() > 10  # old's rows are gone from the disk...
        assert (GROUP, "did:old") in j.latest().publishers  # ...but not from memory
        late = dict(row(5, publisher="did:old"), message_id="did:old/5")
        assert j.append([late]).duplicates == 1


@pytest.mark.parametrize(("field_at", "bit", "victim"), [
    (24, 20, -1),  # the row count of a closed segment's last record: it ran into the next segment
    (24, 1, 3),  # the row count of a middle record
    (8, 11, 0),  # the body length of the first record: the scan jumped into good records
])
def test_a_flipped_bit_in_a_closed_segments_record_header_costs_that_record_only(
        jdir: Path, key: bytes, field_at: int, bit: int, victim: int) -> None:
    """Closed segments are scanned trusting their headers; a header that does not add up is rechecked
    record by record, so one flipped bit neither stops the journal opening nor spoils its neighbours."""
    import struct

    with Journal.open(jdir, key=key, segment_bytes=8192) as j:
        for s in range(1, 61):
            j.append(rows(s, s, size=100))  # one record per append, a few records per segment
        first = j._segments[0]  # noqa: SLF001
        assert len(j._segments) > 2 and len(first.records) > 4  # noqa: SLF001
        entry = first.records[victim]
        end = j.next_offset
    with open(first.path, "r+b") as f:
        f.seek(entry.position + field_at)
        value, = struct.unpack("<I", f.read(4))
        f.seek(entry.position + field_at)
        f.write(struct.pack("<I", value ^ (1 << bit)))
    with Journal.open(jdir, key=key, segment_bytes=8192) as j:
        bad = []
        for offset in range(end):
            try:
                j.read(offset, offset + 1)
            except JournalCorruptError:
                bad.append(offset)
        assert bad == [entry.base_offset]


def test_new_seqs_dropped_by_the_id_rule_are_remembered_as_superseded(jdir: Path, key: bytes) -> None:
    """A sink task retried on another host republishes its ids under another publisher with new seqs:
    those seqs have no row, and a reader walking the publisher's seqs must not take them for lost."""
    bob = "did:peer:2.Ez6LSbob"
    with Journal.open(jdir, key=key, fsync="always") as j:
        j.append([row(s, message_id=f"task-row-{s}") for s in (1, 2)])  # the first attempt, via alice
        retried = [row(s, bob, message_id=f"task-row-{s - 1}") for s in (2, 3)] + [row(4, bob, message_id="new")]
        j.append([row(1, bob, message_id="bob-1")])
        result = j.append(retried)
        assert (result.appended, result.duplicates) == (1, 2)
        assert j.superseded(GROUP, bob, 1, 10) == [(2, 3)]
        assert j.append([row(3, bob, message_id="task-row-2")]).duplicates == 1  # a re-send: the seq rule
        assert j.superseded(GROUP, bob, 1, 10) == [(2, 3)] and j.superseded(GROUP, ALICE, 1, 10) == []
    with Journal.open(jdir, key=key) as j:
        assert j.superseded(GROUP, bob, 3, 3) == [(3, 3)]
        assert seqs(j.read_by_seq(GROUP, bob, 1, 10)) == [1, 4]


def test_retention_still_deletes_when_the_disk_is_too_full_to_save_positions(jdir: Path, key: bytes,
                                                                            monkeypatch) -> None:  # noqa: ANN001
    """A full disk is what retention is there to fix: failing to save the base positions must not
    stop it (it stopped retention, then the journal)."""
    import errno

    from zerocomm_spark.journal import index as index_module

    real = index_module.write_index

    def full(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - only the retention's file fails
        if path.name == index_module.BASE_STATE_FILE:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=1) as j:
        _fill(j, 60)
        monkeypatch.setattr(index_module, "write_index", full)
        before = len(list(jdir.glob("*.zcj")))
        j.commit(j.next_offset)
        assert len(list(jdir.glob("*.zcj"))) < before
        assert j.append(rows(10_000, 10_000)).appended == 1


def test_a_segment_retention_cannot_delete_stays_and_the_journal_goes_on(jdir: Path, key: bytes,
                                                                        monkeypatch) -> None:  # noqa: ANN001
    """A failed unlink (permissions changed under the agent) is a failed clean-up, not a failed write:
    it raised out of commit(), and from the background pass it stopped the journal."""
    real = Path.unlink

    def refuse(self: Path, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if self.suffix == ".zcj":
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=1) as j:
        _fill(j, 60)
        before = sorted(jdir.glob("*.zcj"))
        monkeypatch.setattr(Path, "unlink", refuse)
        j.commit(j.next_offset)
        assert sorted(jdir.glob("*.zcj")) == before  # still there: retried after a reopen
        assert j.earliest_offset() > 0  # but no longer part of the journal
        assert j.append(rows(10_000, 10_000)).appended == 1
        monkeypatch.setattr(Path, "unlink", real)
    with Journal.open(jdir, key=key, segment_bytes=4096, retention_bytes=1) as j:
        j.enforce_retention()
        assert len(list(jdir.glob("*.zcj"))) < len(before)


@pytest.mark.skipif(files_module._sync_file_range is None, reason="sync_file_range is Linux-only")
def test_start_writeback_asks_the_kernel_and_never_raises(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 65536)
        assert files_module.start_writeback(fd, 0, 65536)
        assert not files_module.start_writeback(fd, 0, 0)  # nothing to start
    finally:
        os.close(fd)
    assert not files_module.start_writeback(fd, 0, 65536)  # a closed descriptor: refused, not raised


@pytest.mark.parametrize("policy", ["interval", "always", "never"])
def test_interval_starts_writeback_of_each_range_once_as_appends_go(jdir: Path, key: bytes, monkeypatch,  # noqa: ANN001
                                                                    policy: str) -> None:
    """Under "interval" the syncer starts the disk writing of what was appended (every
    WRITEBACK_BYTES) instead of leaving it all to the next fdatasync; each range once, in order,
    within what was written. The other policies sync inline or never, and start nothing."""
    started: list[tuple[str, int, int]] = []
    real = files_module.start_writeback

    def spy(fd: int, offset: int, nbytes: int) -> bool:
        started.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(files_module, "start_writeback", spy)
    monkeypatch.setattr(writer_module, "WRITEBACK_BYTES", 4096)
    with Journal.open(jdir, key=key, fsync=policy, fsync_interval_ms=60_000, segment_bytes=64 << 10) as j:
        for first in range(1, 400, 20):
            j.append(rows(first, first + 19, size=200))  # ~5 kB per append: a wake-up each
        deadline = time.monotonic() + 10
        while policy == "interval" and sum(n for _, _, n in started) < j.stats().bytes_written // 2:
            assert time.monotonic() < deadline, (started, j.stats())
            time.sleep(0.01)
        sizes = {p.name: p.stat().st_size for p in jdir.glob("*.zcj")}
    stats = j.stats()  # closed: the syncer has stopped
    if policy != "interval":
        assert not started and stats.writebacks == 0
        return
    assert stats.writebacks == len(started) > 0
    assert len({name for name, _, _ in started}) >= 2  # the roll moved it on to the next segment
    ends: dict[str, int] = {}
    for name, offset, nbytes in started:
        assert offset == ends.get(name, 32) and nbytes > 0  # each range once, in order, from the header on
        ends[name] = offset + nbytes
        assert ends[name] <= sizes[name]


def test_an_explicit_sync_racing_rolls_and_the_syncer_syncs_its_own_descriptor(jdir: Path, key: bytes,
                                                                              monkeypatch) -> None:  # noqa: ANN001
    """Journal.sync() takes the active segment's descriptor, then syncs outside the lock; rolls may
    retire that descriptor meanwhile (and, but for the sync in progress, close it: the number could
    go to the next segment's file). The sync must still sync the file it meant, and not fail."""
    real = os.fdatasync
    entered, release = threading.Event(), threading.Event()
    seen: list[tuple[str, str]] = []

    def spy(fd: int) -> None:
        if threading.current_thread().name == "explicit-sync" and not entered.is_set():
            before = os.readlink(f"/proc/self/fd/{fd}")
            entered.set()
            assert release.wait(30)
            try:
                after = os.readlink(f"/proc/self/fd/{fd}")
            except OSError as exc:
                after = f"closed: {exc.strerror}"
            seen.append((before, after))
        real(fd)

    errors: list[BaseException] = []
    with Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=60_000, segment_bytes=4096) as j:
        j.append(rows(1, 10, size=200))
        monkeypatch.setattr(os, "fdatasync", spy)

        def explicit() -> None:
            try:
                j.sync()
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        syncer = threading.Thread(target=explicit, name="explicit-sync")
        syncer.start()
        assert entered.wait(30)
        for first in range(11, 41, 10):  # a roll per append: the descriptor is retired meanwhile (more
            j.append(rows(first, first + 9, size=200))  # rolls would wait for this sync: the overflow)
        release.set()
        syncer.join(30)
        assert not errors, errors
        assert len(seen) == 1 and seen[0][0] == seen[0][1], seen  # the same file before and after


def test_an_explicit_sync_that_fails_stops_the_journal(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    """After a failed fdatasync the kernel may have dropped the pages it could not write: carrying
    on would acknowledge data that is not there, so Journal.sync() stops the journal as a failed
    write does, and says so."""
    j = Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=60_000)
    try:
        j.append(rows(1, 5))
        monkeypatch.setattr(os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
        with pytest.raises(JournalError, match="Input/output error"):
            j.sync()
        with pytest.raises(JournalClosedError, match="stopped after a write failure"):
            j.append(rows(6, 7))
        monkeypatch.undo()
    finally:
        j.close()
    with Journal.open(jdir, key=key) as again:  # reopening recovers what is on disk
        assert again.read(0).num_rows == 5


def test_a_sync_after_the_syncer_failed_raises_instead_of_promising(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    """Linux reports a writeback error once: after the syncer's fdatasync failed (and stopped the
    journal), a later fdatasync returns 0 although the pages are gone. sync() must not say "safe"."""
    j = Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=20)
    try:
        j.append(rows(1, 5))
        monkeypatch.setattr(os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
        j.append(rows(6, 10))
        deadline = time.monotonic() + 10
        while j._writer.failure is None:  # noqa: SLF001
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monkeypatch.undo()  # the retry would "succeed"
        with pytest.raises(JournalError, match="Input/output error"):
            j.sync()
    finally:
        j.close()


def test_an_explicit_sync_waits_for_the_syncers_round_in_flight(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    """The syncer's round takes the rolled segments' descriptors and syncs them outside the lock;
    an explicit sync starting meanwhile must not return before they are on disk."""
    real = os.fdatasync
    entered = threading.Event()
    events: list[str] = []

    def slow(fd: int) -> None:
        if threading.current_thread().name == "zerocomm-journal-syncer" and not entered.is_set():
            entered.set()
            time.sleep(0.5)
            real(fd)
            events.append("syncer synced a rolled segment")
            return
        real(fd)

    with Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=50, segment_bytes=4096) as j:
        j.append(rows(1, 10, size=200))
        monkeypatch.setattr(os, "fdatasync", slow)
        j.append(rows(11, 20, size=200))  # rolls: a retired descriptor for the syncer
        assert entered.wait(10)
        j.sync()
        events.append("explicit sync returned")
    assert events == ["syncer synced a rolled segment", "explicit sync returned"]


def test_a_sync_out_of_descriptors_fails_alone_and_loses_nothing(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    """sync() needs a descriptor of its own (a dup): without one it says so and leaves the rolled
    segments' descriptors for the next sync, and the journal keeps working."""
    before = len(os.listdir("/proc/self/fd"))
    with Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=60_000, segment_bytes=4096) as j:
        j.append(rows(1, 10, size=200))
        j.append(rows(11, 20, size=200))  # rolls
        real_dup = os.dup
        monkeypatch.setattr(os, "dup", lambda fd: (_ for _ in ()).throw(OSError(24, "Too many open files")))
        with pytest.raises(JournalError, match="Too many open files"):
            j.sync()
        monkeypatch.setattr(os, "dup", real_dup)
        assert j.append(rows(21, 30, size=200)).appended == 10  # not stopped
        retired = list(j._writer._retired)  # noqa: SLF001
        assert retired  # still there for the next sync
        j.sync()
        assert not j._writer._retired  # noqa: SLF001
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_sync_that_comes_after_close_raises_closed(jdir: Path, key: bytes) -> None:
    """Under "never" close() does not sync: a sync racing it (past Journal.sync's open check) must
    not return as if it had synced the segment close() just closed."""
    j = Journal.open(jdir, key=key, fsync="never")
    j.append(rows(1, 5))
    writer = j._writer  # noqa: SLF001
    j.close()
    with pytest.raises(JournalClosedError):
        writer.sync(force=True)


def test_a_slow_writeback_request_never_holds_appends_or_rolls_back(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    """sync_file_range can wait on a congested device: the syncer makes the call on a descriptor of
    its own, outside the lock that a roll (on the append path) takes."""
    inside, release = threading.Event(), threading.Event()

    def stuck(fd: int, offset: int, nbytes: int) -> bool:
        inside.set()
        release.wait(10)
        return True

    monkeypatch.setattr(files_module, "start_writeback", stuck)
    monkeypatch.setattr(writer_module, "WRITEBACK_BYTES", 1024)
    with Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=60_000, segment_bytes=4096) as j:
        j.append(rows(1, 10, size=200))  # ~2.5 kB: wakes the syncer, which gets stuck
        assert inside.wait(10)
        started = time.monotonic()
        for first in range(11, 61, 10):
            j.append(rows(first, first + 9, size=200))  # rolls
        took = time.monotonic() - started
        release.set()
    assert took < 2, took


def test_a_writeback_without_a_spare_descriptor_is_skipped_not_fatal(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    real_dup = os.dup
    refused = threading.Event()

    def dup(fd: int) -> int:
        if threading.current_thread().name == "zerocomm-journal-syncer":
            refused.set()
            raise OSError(24, "Too many open files")
        return real_dup(fd)

    monkeypatch.setattr(os, "dup", dup)
    monkeypatch.setattr(writer_module, "WRITEBACK_BYTES", 1024)
    with Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=60_000) as j:
        j.append(rows(1, 10, size=200))
        assert refused.wait(10)
        assert j.append(rows(11, 20, size=200)).appended == 10  # still running
        assert j._writer.failure is None  # noqa: SLF001


@pytest.mark.parametrize("policy", ["always", "interval"])
def test_open_makes_what_recovery_found_durable_before_anything_is_acknowledged(jdir: Path, key: bytes,
                                                                                 monkeypatch, policy: str) -> None:  # noqa: ANN001
    """A kill -9 between a write and its fdatasync leaves the record in the page cache only; the
    reopened journal turns its re-send into duplicates and acknowledges it without writing, so
    what recovery found must be synced at open (else a power loss then loses acknowledged rows)."""
    with Journal.open(jdir, key=key, fsync=policy) as j:
        j.append(rows(1, 5))
    synced: list[str] = []
    real = os.fdatasync

    def spy(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", spy)
    with Journal.open(jdir, key=key, fsync=policy) as j:
        assert sorted(p.name for p in jdir.glob("*.zcj"))[-1] in synced  # before any append
        assert j.append(rows(1, 5)).duplicates == 5


def test_a_sync_waits_for_the_descriptors_a_roll_is_syncing(jdir: Path, key: bytes, monkeypatch) -> None:  # noqa: ANN001
    """When rolls outpace the syncer, a roll syncs the oldest retired segments itself; a sync()
    meanwhile no longer sees them in the retired list and must still wait for them."""
    real = os.fdatasync
    lock = threading.Lock()
    durable: dict[str, int] = {}

    def slow(fd: int) -> None:
        path, size = os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size
        if threading.current_thread().name == "roller":
            time.sleep(0.5)
        real(fd)
        with lock:
            durable[path] = max(durable.get(path, 0), size)

    monkeypatch.setattr(os, "fdatasync", slow)
    with Journal.open(jdir, key=key, fsync="interval", fsync_interval_ms=600_000, segment_bytes=1024) as j:
        for s in range(1, 6):
            j.append(rows(s, s, size=700))  # a segment each: 4 retired, unsynced
        roller = threading.Thread(target=lambda: j.append(rows(6, 6, size=700)), name="roller")
        roller.start()  # its roll syncs the oldest retired segment itself
        time.sleep(0.2)
        j.sync()
        with lock:
            behind = {p.name for p in sorted(jdir.glob("*.zcj"))[:-2] if p.stat().st_size > durable.get(str(p), 0)}
        roller.join(10)
    assert not behind


def test_segments_awaiting_a_sync_under_never_are_forgotten_once_retention_deleted_them(jdir: Path, key: bytes) -> None:
    """Under "never" rolled segments wait for an explicit sync(); a journal nobody syncs must not
    remember every segment it ever rolled, only those still on disk."""
    with Journal.open(jdir, key=key, segment_bytes=4096, fsync="never", retention_bytes=3 * 4096) as j:
        for first in range(1, 1500, 10):  # 150 appends
            j.append(rows(first, first + 9, size=200))  # each append rolls: one segment per append
            j.commit(j.next_offset)  # read by every consumer: retention may take it
            j.enforce_retention()
        remembered = j._writer._unsynced  # noqa: SLF001
        on_disk = sorted(jdir.glob("*.zcj"))
        assert len(on_disk) <= 4
        assert len(remembered) <= 100  # bounded by what is on disk plus a margin, not by the 150 rolls
        j.sync()  # what is left still gets its fsync without errors


def test_a_late_re_send_of_a_superseded_seq_is_not_journaled_once_its_id_left_the_window(jdir: Path,
                                                                                      key: bytes) -> None:
    """A new seq dropped by the id rule did not count as the publisher's: a re-send of it after its
    id had left the dedup window passed both rules and was journaled (the id twice), in this run or
    after a reopen."""
    bob = "did:peer:2.Ez6LSbob"
    with Journal.open(jdir, key=key, dedup_window=4) as j:
        j.append([row(1, message_id="task-row-1")])  # the first attempt, via alice
        assert j.append([row(1, bob, message_id="bob-1"), row(2, bob, message_id="task-row-1")]).appended == 1
        assert j.superseded(GROUP, bob, 1, 10) == [(2, 2)]
        for s in range(2, 12):  # task-row-1 leaves the window
            j.append([row(s)])
        assert j.append([row(2, bob, message_id="task-row-1")]).duplicates == 1  # the late re-send
        assert j.append([row(2, bob, message_id="task-row-1"), row(3, bob, message_id="bob-3")]).appended == 1
        assert seqs(j.read_by_seq(GROUP, bob, 1, 10)) == [1, 3]
        # The last seq a publisher used, superseded: the same holds.
        assert j.append([row(4, bob, message_id="task-row-1")]).appended == 1  # out of the window: a new row
        assert j.append([row(5, bob, message_id="bob-3")]).duplicates == 1  # bob-3 is recent: superseded
        for s in range(12, 22):
            j.append([row(s)])
        assert j.append([row(5, bob, message_id="bob-3")]).duplicates == 1
    with Journal.open(jdir, key=key, dedup_window=4) as j:
        assert j.append([row(5, bob, message_id="bob-3")]).duplicates == 1
        assert j.append([row(2, bob, message_id="task-row-1"), row(6, bob, message_id="bob-6")]).appended == 1
        assert seqs(j.read_by_seq(GROUP, bob, 1, 10)) == [1, 3, 4, 6]


def test_a_shared_sticky_journal_directory_is_refused_not_made_private(tmp_path: Path) -> None:
    """journal.dir=/tmp for an agent run as root, who owns it: /tmp was "tightened" to 700 (its sticky
    bit dropped), locking every other user out of it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(ConfigurationError, match="shared directory") as info:
        Journal.open(shared, key=nacl.utils.random(32))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert list(shared.iterdir()) == []
    assert "journal.dir" in info.value.hint


def test_a_journal_directory_of_another_user_is_refused_and_one_of_ours_is_made_private(tmp_path: Path) -> None:
    """Its owner could delete or roll back segments and commit points, and read counts, times and names."""
    from zerocomm_spark.errors import InsecurePermissionsError

    key = nacl.utils.random(32)
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    Journal.open(loose, key=key).close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    if os.getuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(InsecurePermissionsError, match="belongs to another user"):
        Journal.open(theirs, key=key)
    assert list(theirs.iterdir()) == []  # nothing was made there
