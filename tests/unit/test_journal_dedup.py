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
        recent = j._writer._recent  # noqa: SLF001
        assert state.id_key("g", "a") in recent and state.id_key("g", "c") not in recent
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
                               (good, 2, np.empty((4, 1), dtype=np.int64)),  # slots too small
                               (good, 2, np.empty(65, dtype=np.uint8)[1:].view(np.int64).reshape(4, 2))):  # misaligned
        with pytest.raises(ValueError):
            state._native_probe(offsets, data, 0, rows, state._KEY_BYTES, table, log2, 1, hashes, out)  # noqa: SLF001


def _random_ids(rng: np.random.Generator, n: int, longest: int) -> list[str]:
    alphabets = [(97, 123), (0x80, 0x800), (0x800, 0xD800), (0x10000, 0x10FFFF)]
    ids = []
    for _ in range(n):
        low, high = alphabets[int(rng.integers(0, len(alphabets)))]
        text = "".join(map(chr, rng.integers(low, high, int(rng.integers(0, longest + 1)))))
        ids.append(text.encode()[:longest].decode(errors="ignore"))  # at most ``longest`` UTF-8 bytes
    return ids


@pytest.mark.skipif(state._native_probe is None, reason="the native probe was not built (no C compiler)")  # noqa: SLF001
@pytest.mark.parametrize("log2_slots", [None, 4, 5, 6, 8])
def test_the_native_probe_answers_as_the_numpy_path_for_random_columns(log2_slots: int | None) -> None:
    """Randomised: ids of 0..200 bytes of any script, string and binary, sliced, with nulls (of empty
    or non-empty spans), one width or mixed, offsets not 4-byte aligned, remembered or not."""
    rng = np.random.default_rng(1000 + (log2_slots or 0))
    recent = RecentIds(int(rng.integers(50, 400)))
    if log2_slots is not None:
        _crowded(recent, log2_slots)
    pool: list[str] = []
    outcomes = set()
    for _ in range(150):
        ids = _random_ids(rng, int(rng.integers(0, 70)), int(rng.choice([8, 16, 128, 200])))
        if pool and rng.random() < 0.5:  # some remembered ids, some given twice
            ids += [pool[int(i)] for i in rng.integers(0, len(pool), int(rng.integers(1, 8)))]
        if rng.random() < 0.15:  # one width
            width = int(rng.integers(0, 129))
            ids = [c * width for c in rng.choice(["q", "r", "s"], int(rng.integers(1, 30)))]
        kind = pa.string() if rng.random() < 0.7 else pa.binary()
        values: list = [x if kind == pa.string() else x.encode() for x in ids]
        if rng.random() < 0.2:
            values = [None if rng.random() < 0.2 else x for x in values]
        column = pa.array(values, kind)
        if rng.random() < 0.2 and len(column):  # nulls over non-empty spans, offsets at an odd address
            _, offsets, data = column.buffers()
            odd = pa.py_buffer(b"\0" + offsets.to_pybytes()).slice(1)
            validity = pa.py_buffer(np.packbits(rng.random(len(column)) < 0.8, bitorder="little").tobytes())
            column = pa.Array.from_buffers(kind, len(column), [validity, odd, data])
        if len(column) and rng.random() < 0.5:
            start = int(rng.integers(0, len(column)))
            column = column.slice(start, int(rng.integers(0, len(column) - start + 1)))
        native, reference = recent.probe(column), recent.probe(column, native=False)
        assert native[0].dtype == reference[0].dtype and (native[0] == reference[0]).all()
        assert native[1].shape == reference[1].shape and (native[1] == reference[1]).all()
        assert native[2:] == reference[2:], column
        outcomes.add(native[2:])
        if len(column) and column.null_count == 0 and rng.random() < 0.6:
            recent.add_array(column)
            pool += [x.decode() if isinstance(x, bytes) else x for x in column.to_pylist()]
    assert {maybe for maybe, _ in outcomes} == {False, True}  # both answers were compared


@pytest.mark.skipif(state._native_probe is None, reason="the native probe was not built (no C compiler)")  # noqa: SLF001
@pytest.mark.parametrize("array_offset", [2**63 - 1, 2**63 - 2, 2**63 - 4])
def test_the_native_probe_refuses_a_row_offset_past_the_end_of_the_offsets(array_offset: int) -> None:
    """array_offset + n + 1 overflowed: an offset near 2**63 passed the size check and the probe read
    the bytes before the buffer as offsets (and answered)."""
    recent = RecentIds(100)
    table = recent._table  # noqa: SLF001
    log2 = 64 - int(recent._shift)  # noqa: SLF001
    hashes, slots = np.empty(3, dtype=np.uint64), np.empty((4, 3), dtype=np.int64)
    before_and_good = memoryview(np.array([0, 0, 0, 0, 0, 3, 6], dtype=np.int32).tobytes())[16:]
    with pytest.raises(ValueError):
        state._native_probe(before_and_good, b"abcdef", array_offset, 3, state._KEY_BYTES, table, log2, 1,  # noqa: SLF001
                            hashes, slots)


_RACE = """
import threading, numpy as np, pyarrow as pa
from zerocomm_spark.journal.state import RecentIds
n = 200_000
raw = bytearray((np.arange(n + 1, dtype=np.int32) * 4).tobytes())
offsets = np.frombuffer(raw, dtype=np.int32)
column = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(raw), pa.py_buffer(b"abcd" * n)])
recent, stop = RecentIds(1000), threading.Event()
def rewrite():
    while not stop.is_set():
        offsets[n // 2] = 2**31 - 1
        offsets[n // 2] = 2 * n
thread = threading.Thread(target=rewrite)
thread.start()
try:
    for _ in range(40):
        try:
            recent.probe(column)
        except (ValueError, IndexError):
            pass
finally:
    stop.set()
    thread.join()
"""


@pytest.mark.skipif(state._native_probe is None, reason="the native probe was not built (no C compiler)")  # noqa: SLF001
def test_offsets_rewritten_by_another_thread_during_the_native_probe_are_not_followed() -> None:
    """The probe checks the offsets, then releases the GIL: a thread writing the column's offsets
    buffer (a bytearray here) meanwhile made it read 2 GiB past the data (a segfault). A caller's
    race may give a wrong answer, as on the numpy path, never a crash."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, timeout=100)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_null_over_a_long_span_is_hashed_by_its_bytes_as_a_short_one_is() -> None:
    """Arrow lets a null entry span bytes; the vectorised hash reads them, and so must the BLAKE2b of
    a long id (it hashed ``None``: a TypeError)."""
    data = b"s" * 5 + b"L" * 200
    offsets = pa.py_buffer(np.array([0, 5, 205], dtype=np.int32).tobytes())
    for null_at in (0, 1):
        validity = pa.py_buffer(bytes([0b11 ^ (1 << null_at)]))
        column = pa.Array.from_buffers(pa.string(), 2, [validity, offsets, pa.py_buffer(data)], null_count=1)
        assert (id_hashes(column) == id_hashes(pa.array(["sssss", "L" * 200]))).all()


def test_a_message_id_used_again_in_another_group_is_another_message(tmp_path: Path) -> None:
    """Message ids are unique per group: "order-1" in group B is not a duplicate of "order-1" in group A.
    The id rule was global, so B's row was dropped as a duplicate (and its seq recorded as superseded)
    while the member acknowledged it (found by review). Within a group the rule holds as before, across
    publishers too (a retried sink task publishing through another member), and after a restart."""
    key = nacl.utils.random(32)

    def row(group: str, publisher: str, seq: int, mid: str = "order-1") -> dict:
        return {"group": group, "message_id": mid, "publisher_did": publisher, "seq": seq, "lamport_ts": seq,
                "sent_at": 0, "payload": f"{group} {publisher} {seq}".encode()}

    with Journal.open(tmp_path / "j", key=key) as j:
        assert j.append([row("A", "did:a", 1)]).appended == 1
        assert j.append([row("B", "did:a", 1)]).appended == 1
        both = j.append([row("C", "did:a", 1), row("D", "did:b", 1)])  # one append, two groups
        assert (both.appended, both.duplicates) == (2, 0)
        again = j.append([row("A", "did:b", 1)])  # the same id in the same group: a duplicate, whoever sends it
        assert (again.appended, again.duplicates) == (0, 1)
        assert j.superseded("B", "did:a", 1, 1) == []
    with Journal.open(tmp_path / "j", key=key) as j:  # the rule's memory comes back scoped the same way
        assert j.append([row("A", "did:c", 1)]).duplicates == 1
        assert j.append([row("E", "did:a", 1)]).appended == 1
        table = j.read(0)
    assert table.column("group").to_pylist() == ["A", "B", "C", "D", "E"]
