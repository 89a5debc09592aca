"""The id rule's memory (RecentIds) and who commits an append: exactness whatever the filter says."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import nacl.utils
import numpy as np
import pyarrow as pa
import pytest

from zerocomm_spark.journal import Journal, state, writer
from zerocomm_spark.journal.state import RecentIds, id_hashes

pytestmark = pytest.mark.timeout(120)

ODD_IDS = ["été/1", "ete/1", "e\u0301te/1", "ÉTÉ/1", " ", "😀", "a" * 300, "", "x" * 128, "y" * 129,
           "z" * 8, "w" * 9, "a", "a\x00", "abcdefgh12345678", "abcdefgh12345679"]


def test_an_ids_hash_depends_on_the_id_alone_not_on_its_batch() -> None:
    column = pa.array(ODD_IDS)
    hashes = id_hashes(column)
    assert len(set(hashes.tolist())) == len(ODD_IDS)
    for i, one in enumerate(ODD_IDS):  # alone, in every slice, in a batch of equal-width ids
        assert id_hashes(pa.array([one]))[0] == hashes[i]
        assert (id_hashes(pa.array([one] * 3)) == hashes[i]).all()
        for j in range(i + 1, len(ODD_IDS) + 1):
            assert (id_hashes(column.slice(i, j - i)) == hashes[i:j]).all()
    # A slice that starts inside its data buffer, of one width, takes the general path and agrees.
    same_width = pa.array(["aaaa", "bbbb", "cccc", "dddd"])
    assert (id_hashes(same_width.slice(1, 2)) == id_hashes(pa.array(["bbbb", "cccc"]))).all()


def _ids(n: int) -> pa.Array:
    return pa.array([str(uuid.uuid4()) for _ in range(n)])


def _crowded(recent: RecentIds, log2_slots: int = 6) -> RecentIds:
    """Shrink the table so almost every lookup says "maybe": only the exact comparison decides."""
    recent._table = np.zeros(1 << log2_slots, dtype=np.uint8)  # noqa: SLF001
    recent._shift = np.uint64(64 - log2_slots)  # noqa: SLF001
    return recent


@pytest.mark.parametrize("crowded", [False, True])
def test_recent_ids_remember_exactly_the_last_window(crowded: bool) -> None:
    recent = RecentIds(1000)
    if crowded:
        _crowded(recent)
    chunks = [_ids(250) for _ in range(12)]
    for chunk in chunks:
        recent.add_array(chunk)
    remembered = {x.encode() for c in chunks[-4:] for x in c.to_pylist()}  # at least the last 1000
    forgotten = {x.encode() for c in chunks[:4] for x in c.to_pylist()}  # more than 2 x 1000 ago
    assert all(x in recent for x in remembered)
    assert not any(x in recent for x in forgotten)
    fresh = _ids(500)
    assert not any(x.encode() in recent for x in fresh.to_pylist())
    if crowded:  # the table lets nearly everything through: the exact comparison did the work
        assert recent.maybe_each(recent.slots(id_hashes(fresh))).mean() > 0.9
    assert len(recent.as_array()) == len(recent) >= 1000


def test_recent_ids_survive_generation_marks_wrapping_around() -> None:
    recent = RecentIds(2)  # a generation per two adds: 1,200 adds wrap the 8-bit marks twice
    ids = [f"id-{i}" for i in range(1200)]
    for i, one in enumerate(ids):
        recent.add_array(pa.array([one]))
        assert one.encode() in recent
        if i >= 1:
            assert ids[i - 1].encode() in recent  # the window (2) is always remembered
        if i >= 3:
            assert ids[i - 3].encode() not in recent  # and what left both generations is forgotten


def test_ids_marked_before_a_rotation_and_added_after_it_stay_remembered() -> None:
    """The writer marks an append's ids in the table right after the check (RecentIds.mark) and
    adds them once written; if another append of the same group rotated the generations meanwhile,
    the ids land in the new generation and must carry its mark, or the next rotation would retire
    them from the table while they are still in the window."""
    recent = RecentIds(4)
    late = pa.array(["late-1", "late-2"])
    hashes = id_hashes(late)
    slots = recent.slots(hashes)
    mark = recent.mark(slots)
    recent.add_array(pa.array(["a", "b", "c", "d"]))  # fills the generation: rotates
    assert recent.rotations != mark
    recent.add(hashes, late, slots, mark)  # into the new current generation
    recent.add_array(pa.array(["e", "f"]))  # current: late-1, late-2, e, f: rotates again
    assert b"late-1" in recent and b"late-2" in recent  # still within the window (previous generation)
    recent.add_array(pa.array(["g", "h", "i", "j"]))
    assert b"late-1" not in recent  # and forgotten once two generations on


def test_ids_marked_253_rotations_before_they_are_added_stay_remembered() -> None:
    """The table's 8-bit marks wrap around (reset to 2 after 254) every 253 rotations: an id marked
    that many rotations before it is added finds the same mark value, but the reset cleared it."""
    recent = RecentIds(1)  # a rotation per add
    for i in range(5):
        recent.add_array(pa.array([f"warm-{i}"]))  # mark 6: the reset brings it back after 253 more
    late = pa.array(["late"])
    hashes = id_hashes(late)
    slots = recent.slots(hashes)
    mark = recent.mark(slots)
    epoch = recent._epoch  # noqa: SLF001
    for i in range(253):
        recent.add_array(pa.array([f"between-{i}"]))
    assert recent._epoch == epoch  # noqa: SLF001 - the 8-bit mark came back to the same value
    recent.add(hashes, late, slots, mark)
    assert b"late" in recent


@pytest.fixture
def crowded_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    original = RecentIds.__init__

    def init(self: RecentIds, window: int) -> None:
        original(self, window)
        if window > 0:
            _crowded(self, 4)

    monkeypatch.setattr(RecentIds, "__init__", init)


def _rows(seqs: range, ids: list[str]) -> list[dict]:
    return [{"group": "g", "message_id": m, "publisher_did": "did:peer:2.Ez6LSalice", "seq": s, "lamport_ts": s,
             "sent_at": 0, "payload": f"p{s}".encode()} for s, m in zip(seqs, ids)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_the_id_rule_is_exact_when_the_filter_lets_everything_through(tmp_path: Path, crowded_tables: None,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      native: bool) -> None:
    if not native:  # the path of an install without a C compiler
        monkeypatch.setattr(state, "_native_probe", None)
    key = nacl.utils.random(32)
    ids = [f"msg-{i:05d}" for i in range(400)]
    with Journal.open(tmp_path / "j", key=key) as j:
        assert j.append(_rows(range(1, 201), ids[:200])).appended == 200
        # A re-publish under new seqs (a sink retrying), half old ids and half new: only the new go in.
        again = j.append(_rows(range(201, 401), ids[100:300]))
        assert (again.appended, again.duplicates) == (100, 100)
        # Within one append, an id given twice goes in once.
        twice = j.append(_rows(range(401, 405), ["dup-a", "dup-b", "dup-a", ids[350]]))
        assert (twice.appended, twice.duplicates) == (3, 1)
    with Journal.open(tmp_path / "j", key=key) as j:  # and after a restart, from the side file
        after = j.append(_rows(range(501, 512), [*ids[295:300], ids[350], *ids[395:400]]))
        assert (after.appended, after.duplicates) == (5, 6)  # 295..299 and 350 are in, 395..399 are new
        table = j.read(0)
    got = table.column("message_id").to_pylist()
    assert len(got) == len(set(got)) == 308


def test_a_lone_appender_commits_in_its_own_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    committers: list[str] = []
    original = writer.Writer._commit

    def commit(self: writer.Writer, group: list) -> None:
        committers.append(threading.current_thread().name)
        original(self, group)

    monkeypatch.setattr(writer.Writer, "_commit", commit)
    with Journal.open(tmp_path / "j", key=nacl.utils.random(32)) as j:
        for a in range(5):
            j.append(_rows(range(a * 10 + 1, a * 10 + 11), [f"m{a}-{i}" for i in range(10)]))
        assert j.read(0).num_rows == 50
    assert committers == [threading.current_thread().name] * 5  # no hand-off to the writer thread


def test_dedup_state_is_not_touched_by_rows_a_failed_write_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The ids of an append whose write failed must not be remembered: that is what lets the re-send in.
    key = nacl.utils.random(32)
    with Journal.open(tmp_path / "j", key=key) as j:
        j.append(_rows(range(1, 3), ["a", "b"]))
        monkeypatch.setattr(writer, "_writev_all", lambda fd, buffers: (_ for _ in ()).throw(OSError(28, "No space left")))
        with pytest.raises(Exception, match="No space left"):
            j.append(_rows(range(3, 5), ["c", "d"]))
        assert b"c" not in j._writer._recent  # noqa: SLF001
    monkeypatch.undo()
    with Journal.open(tmp_path / "j", key=key) as j:
        assert j.append(_rows(range(3, 5), ["c", "d"])).appended == 2
        assert j.read(0).column("message_id").to_pylist() == ["a", "b", "c", "d"]
    assert state.id_values(pa.array(["x"])) == [b"x"]


def test_many_remembered_ids_are_found_in_one_pass_even_with_equal_hashes() -> None:
    generation = state._Generation()  # noqa: SLF001
    generation.add(np.array([5, 5, 7], dtype=np.uint64), pa.array(["a", "b", "c"]))  # "a" and "b" collide
    found = generation.holds_each(np.array([5, 5, 7, 5, 9], dtype=np.uint64), pa.array(["b", "a", "c", "z", "a"]))
    assert found.tolist() == [True, True, True, False, False]  # "a" under another hash is not "a" here


@pytest.mark.parametrize("crowded", [False, True])
def test_a_large_re_sent_batch_is_recognised_row_by_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         crowded: bool) -> None:
    if crowded:
        original = RecentIds.__init__
        monkeypatch.setattr(RecentIds, "__init__", lambda self, window: (original(self, window), _crowded(self, 7))[0])
    ids = [f"resend-{i:05d}" for i in range(6000)]
    with Journal.open(tmp_path / "j", key=nacl.utils.random(32)) as j:
        assert j.append(_rows(range(1, 5001), ids[:5000])).appended == 5000
        # The publisher lost its state and re-sends everything under new seqs, with 1,000 new rows.
        mixed = [*ids[:5000:2], *ids[5000:], *ids[1:5000:2]]
        again = j.append(_rows(range(5001, 5001 + len(mixed)), mixed))
        assert (again.appended, again.duplicates) == (1000, 5000)
        got = j.read(0).column("message_id").to_pylist()
    assert got == [*ids[:5000], *ids[5000:]]


def test_hashing_ids_of_mixed_lengths_takes_bounded_memory() -> None:
    import tracemalloc

    ids = pa.array([f"id-{i}" * (1 + i % 7) for i in range(200_000)] + ["x" * 200])  # one id over 128 bytes
    tracemalloc.start()
    try:
        hashes = id_hashes(ids)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"  # padding every id to the longest took ~1 GiB
    assert hashes[5] == id_hashes(pa.array([ids[5].as_py()]))[0]


@pytest.mark.skipif(state._native_probe is None, reason="the native probe was not built (no C compiler)")  # noqa: SLF001
@pytest.mark.parametrize("log2_slots", [None, 4, 6])
def test_the_native_probe_answers_as_the_numpy_path(log2_slots: int | None) -> None:
    """Hashes, slots, "maybe remembered" and "distinct" from _idrule.c equal the numpy reference
    for ids of every length, sliced columns, remembered and re-given ids, small and crowded tables."""
    recent = RecentIds(500)
    if log2_slots is not None:
        _crowded(recent, log2_slots)
    rng = np.random.default_rng(7)
    mixed = pa.array(["".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(k))) for k in rng.integers(0, 129, 300)])
    cases = [_ids(1), _ids(700), pa.array(ODD_IDS[:9]), mixed, mixed.slice(37, 200), _ids(64).slice(3, 1),
             pa.array(["same", "other", "same"]), pa.array([""] * 3), pa.array([""]), pa.array(["x" * 128] * 2),
             pa.array(["a", "b"], pa.binary())]
    for rounds in range(2):
        for column in cases:
            native = recent.probe(column)
            reference = recent.probe(column, native=False)
            assert (native[0] == reference[0]).all() and native[0].dtype == reference[0].dtype
            assert (native[1] == reference[1]).all() and native[1].shape == reference[1].shape
            assert native[2:] == reference[2:], column
            if rounds == 0:
                recent.add_array(column)
    assert recent.probe(pa.array(["same", "same"]))[3] is False
    assert recent.probe(cases[-1])[2] is True  # remembered (added last)
    fresh = _ids(50)
    assert recent.probe(fresh)[2] == recent.probe(fresh, native=False)[2]
    # An id longer than the native hash takes: the numpy path answers (BLAKE2b for that id).
    long = pa.array(["y" * 129, "z"])
    assert (recent.probe(long)[0] == id_hashes(long)).all()



@pytest.mark.skipif(state._native_probe is None, reason="the native probe was not built (no C compiler)")  # noqa: SLF001
def test_the_native_probe_refuses_buffers_that_do_not_add_up() -> None:
    """It reads raw memory: offsets pointing outside the data, or outputs too small, are refused, not read."""
    recent = RecentIds(100)
    table = recent._table  # noqa: SLF001
    log2 = 64 - int(recent._shift)  # noqa: SLF001
    hashes, slots = np.empty(2, dtype=np.uint64), np.empty((4, 2), dtype=np.int64)
    data = b"abcdef"
    good = np.array([0, 3, 6], dtype=np.int32).tobytes()
    assert state._native_probe(good, data, 0, 2, state._KEY_BYTES, table, log2, 1, hashes, slots) == (False, True)  # noqa: SLF001
    for offsets, rows, out in ((np.array([0, 3, 7], dtype=np.int32).tobytes(), 2, slots),  # past the data
                               (np.array([0, 4, 3], dtype=np.int32).tobytes(), 2, slots),  # going backwards
                               (good, 3, slots),  # more rows than offsets
                               (good, 2, np.empty((4, 1), dtype=np.int64))):  # slots too small
        with pytest.raises(ValueError):
            state._native_probe(offsets, data, 0, rows, state._KEY_BYTES, table, log2, 1, hashes, out)  # noqa: SLF001
