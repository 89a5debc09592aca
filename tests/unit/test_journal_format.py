"""The journal on disk: record codec, crc and AEAD checks, torn tails, damage, and what is in clear."""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path

import nacl.utils
import pyarrow as pa
import pytest

from zerocomm_spark.errors import JournalCorruptError, JournalKeyError
from zerocomm_spark.journal import APPEND_SCHEMA, JOURNAL_SCHEMA, Journal, codec, crypto
from zerocomm_spark.journal.codec import RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES
from zerocomm_spark.journal.files import META_FILE
from zerocomm_spark.journal.segment import scan_segment

pytestmark = pytest.mark.timeout(120)

T0 = 1_700_000_000_000_000
GROUP = "group-alpha"
ALICE = "did:peer:2.Ez6LSalice"


def rows(first: int, last: int, *, size: int = 64, publisher: str = ALICE) -> list[dict]:
    return [{
        "group": GROUP, "message_id": f"msg-{publisher[-5:]}-{s:06d}", "publisher_did": publisher, "seq": s,
        "lamport_ts": s, "sent_at": T0 + s, "received_at": T0 + s,
        "headers": {"trace": f"t{s}"}, "payload": f"SECRET-PAYLOAD-{s:06d}|".encode().ljust(size, b"#"),
    } for s in range(first, last + 1)]


@pytest.fixture
def key() -> bytes:
    return nacl.utils.random(32)


@pytest.fixture
def jdir(tmp_path: Path) -> Path:
    return tmp_path / "journal"


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.zcj"))


def record_positions(path: Path) -> list[tuple[int, int, int]]:
    """(position, base offset, frame length) of each record, by walking the headers."""
    out, data, pos = [], path.read_bytes(), SEGMENT_HEADER_BYTES
    while pos < len(data):
        header = codec.parse_record_header(data[pos:pos + RECORD_HEADER_BYTES])
        assert header is not None
        out.append((pos, header.base_offset, header.frame_length))
        pos += header.frame_length
    return out


def seqs(table: pa.Table) -> list[int]:
    return table.column("seq").to_pylist()


def journal_with(jdir: Path, key: bytes, appends: int, per_append: int = 5, **kw) -> None:
    with Journal.open(jdir, key=key, **kw) as j:
        for a in range(appends):
            j.append(rows(a * per_append + 1, (a + 1) * per_append))


# --- codec ---------------------------------------------------------------------------------------


def _batch(first: int, last: int) -> pa.RecordBatch:
    data = pa.RecordBatch.from_pylist(rows(first, last), schema=APPEND_SCHEMA)
    offsets = pa.array(range(100, 100 + data.num_rows), pa.int64())
    return pa.RecordBatch.from_arrays([offsets, *data.columns], schema=JOURNAL_SCHEMA)


# Version 3 (written now) is AEGIS-256; version 2 is AES-256-GCM and version 1 XChaCha20-Poly1305, both
# still read. For v1, "fast" calls libsodium through pynacl's cffi handle, the other path is pynacl's
# public binding.
@pytest.mark.parametrize("version, fast_encrypt, fast_decrypt",
                         [(3, True, True), (2, True, True), (1, True, True), (1, False, True), (1, True, False)])
def test_record_codec_round_trip(key: bytes, version: int, fast_encrypt: bool, fast_decrypt: bool,
                                 monkeypatch) -> None:
    batch = _batch(1, 50)
    monkeypatch.setattr(crypto.encrypt, "__kwdefaults__", {"fast": fast_encrypt})
    frame = codec.encode_record(batch, 100, T0 + 1, T0 + 50, key, version=version)
    raw = frame.header + frame.body.to_pybytes()
    header = codec.parse_record_header(raw)
    assert header is not None and header == frame.record and header.version == version == raw[4]
    assert (header.base_offset, header.count, header.min_ts, header.max_ts) == (100, 50, T0 + 1, T0 + 50)
    assert header.frame_length == len(raw) and codec.crc_ok(header, raw[RECORD_HEADER_BYTES:])
    monkeypatch.setattr(crypto.decrypt_in_place, "__kwdefaults__", {"fast": fast_decrypt})
    body = pa.py_buffer(bytearray(raw[RECORD_HEADER_BYTES:]))
    assert codec.decrypt_record(header, body, key).equals(batch)
    # A read-only body (a slice of a multi-record read) works too.
    assert codec.decrypt_record(header, pa.py_buffer(raw).slice(RECORD_HEADER_BYTES), key).equals(batch)
    # Nonces are fresh per record: the same batch never encrypts to the same bytes.
    assert codec.encode_record(batch, 100, T0 + 1, T0 + 50, key, version=version).body != frame.body


def test_new_records_are_aegis_256_with_a_32_byte_tag(key: bytes) -> None:
    assert codec.RECORD_VERSION == crypto.AEGIS_256
    frame = codec.encode_record(_batch(1, 3), 100, T0, T0, key)
    assert frame.record.version == crypto.AEGIS_256
    assert frame.body.size == frame.record.body_length == _batch(1, 3).serialize().size + 32
    plain, aad = pa.py_buffer(b"x" * 64), b"aad"
    nonce, other = bytes(24), bytes([1]) + bytes(23)
    sealed = pa.py_buffer(crypto.encrypt_aegis(plain, aad, nonce, key).to_pybytes())  # read-only
    assert sealed.to_pybytes() != crypto.encrypt_aegis(plain, aad, other, key).to_pybytes()
    assert crypto.decrypt_aegis(sealed, aad, nonce, key).to_pybytes() == b"x" * 64  # into a new buffer
    assert sealed.to_pybytes()[:64] != b"x" * 64
    in_place = pa.py_buffer(bytearray(sealed.to_pybytes()))
    assert crypto.decrypt_aegis(in_place, aad, nonce, key).to_pybytes() == b"x" * 64
    assert in_place.to_pybytes()[:64] == b"x" * 64  # decrypted where it lay
    for wrong in ((sealed, aad, other, key), (sealed, b"other aad", nonce, key), (sealed, aad, nonce, bytes(32)),
                  (sealed.slice(0, 31), aad, nonce, key)):
        assert crypto.decrypt_aegis(*wrong) is None
    flipped = bytearray(sealed.to_pybytes())
    flipped[-1] ^= 1  # the tag's last byte
    assert crypto.decrypt_aegis(pa.py_buffer(bytes(flipped)), aad, nonce, key) is None


def test_aes_gcm_records_are_each_under_their_own_key(key: bytes) -> None:
    # The header's first 12 random bytes pick the record key: same GCM nonce, another key, other bytes.
    plain, aad = pa.py_buffer(b"x" * 64), b"aad"
    nonce = bytes(24)
    other = bytes([1]) + bytes(23)
    sealed = crypto.encrypt_gcm(plain, aad, nonce, key)
    assert sealed.to_pybytes() != crypto.encrypt_gcm(plain, aad, other, key).to_pybytes()
    assert crypto.decrypt_gcm(sealed, aad, nonce, key).to_pybytes() == b"x" * 64
    assert crypto.decrypt_gcm(sealed, aad, other, key) is None
    assert crypto.decrypt_gcm(sealed, b"other aad", nonce, key) is None


def _with_fixed_crc(frame: bytearray) -> bytearray:
    """``frame`` with its crc recomputed, as deliberate tampering would leave it."""
    frame[12:16] = b"\0\0\0\0"
    crc = zlib.crc32(bytes(frame[RECORD_HEADER_BYTES:]), zlib.crc32(bytes(frame[:RECORD_HEADER_BYTES])))
    frame[12:16] = crc.to_bytes(4, "little")
    return frame


@pytest.mark.parametrize("version", [3, 2, 1])
def test_record_codec_detects_every_kind_of_change(key: bytes, version: int) -> None:
    frame = codec.encode_record(_batch(1, 20), 100, T0, T0 + 20, key, version=version)
    raw = bytearray(frame.header + frame.body.to_pybytes())
    header = codec.parse_record_header(bytes(raw))
    body = bytes(raw[RECORD_HEADER_BYTES:])
    # A flipped body bit: crc and AEAD both fail.
    flipped = bytearray(body)
    flipped[len(flipped) // 2] ^= 0x01
    assert not codec.crc_ok(header, bytes(flipped))
    assert codec.decrypt_record(header, pa.py_buffer(flipped), key) is None
    # A header field changed and the crc recomputed (deliberate tampering): the AEAD still catches it.
    moved = bytearray(raw)
    moved[16:24] = (7).to_bytes(8, "little")  # base offset
    moved[12:16] = b"\0\0\0\0"
    crc = zlib.crc32(bytes(moved[RECORD_HEADER_BYTES:]), zlib.crc32(bytes(moved[:RECORD_HEADER_BYTES])))
    moved[12:16] = crc.to_bytes(4, "little")
    forged = codec.parse_record_header(bytes(moved))
    assert forged is not None and codec.crc_ok(forged, body)
    assert codec.decrypt_record(forged, pa.py_buffer(bytearray(body)), key) is None
    # The cipher byte changed (to each other version) and the crc recomputed: authentication fails.
    for other in {1, 2, 3} - {version}:
        swapped = bytearray(raw)
        swapped[4] = other
        swapped = _with_fixed_crc(swapped)
        downgraded = codec.parse_record_header(bytes(swapped))
        assert downgraded is not None and downgraded.version == other and codec.crc_ok(downgraded, body)
        assert codec.decrypt_record(downgraded, pa.py_buffer(bytearray(body)), key) is None
    # An unknown cipher byte is not a record header.
    unknown = bytearray(raw)
    unknown[4] = 4
    assert codec.parse_record_header(bytes(unknown)) is None
    # Another key: authentication fails, the crc holds.
    assert codec.decrypt_record(header, pa.py_buffer(bytearray(body)), nacl.utils.random(32)) is None
    # Garbage is not a record header.
    assert codec.parse_record_header(b"\0" * RECORD_HEADER_BYTES) is None
    assert codec.parse_record_header(bytes(raw[1:RECORD_HEADER_BYTES + 1])) is None


# --- what reaches the disk -----------------------------------------------------------------------


def test_payloads_ids_and_publishers_never_appear_in_clear_on_disk(jdir: Path, key: bytes) -> None:
    with Journal.open(jdir, key=key, segment_bytes=8192) as j:
        for a in range(20):
            j.append(rows(a * 10 + 1, a * 10 + 10, size=300))
        j.commit(50)
        assert j.read(0).num_rows == 200
    blob = b"".join(p.read_bytes() for p in jdir.iterdir() if p.is_file())
    assert len(segments(jdir)) > 3 and len(blob) > 60_000
    for needle in (b"SECRET-PAYLOAD", b"msg-alice", ALICE.encode(), GROUP.encode(), b"trace", b"#####", key):
        assert needle not in blob, needle
    # And the bytes really are the journal's: a reopen reads them back.
    with Journal.open(jdir, key=key) as j:
        assert j.read(199).column("payload")[0].as_py().startswith(b"SECRET-PAYLOAD-000200|")


# --- crash recovery ------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["cut-mid-body", "cut-mid-header", "garbage-tail", "zero-filled-tail",
                                    "half-written-frame"])
def test_torn_tail_is_truncated_and_every_complete_record_kept(jdir: Path, key: bytes, damage: str) -> None:
    journal_with(jdir, key, 12, segment_bytes=4096)
    last = segments(jdir)[-1]
    records = record_positions(last)
    assert len(records) >= 2
    pos, base, length = records[-1]
    data = last.read_bytes()
    if damage == "cut-mid-body":
        torn, kept_end = data[:pos + length - 7], base
    elif damage == "cut-mid-header":
        torn, kept_end = data[:pos + 30], base
    elif damage == "garbage-tail":
        torn, kept_end = data + os.urandom(500), base + 5
    elif damage == "zero-filled-tail":
        torn, kept_end = data + bytes(4096), base + 5
    else:  # a frame of a later append that the kill cut short
        torn, kept_end = data + data[pos:pos + length // 2], base + 5
    last.write_bytes(torn)
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        assert j.next_offset == kept_end
        assert seqs(j.read(0)) == list(range(1, kept_end + 1))
        result = j.append(rows(1, 70))  # the re-send fills exactly what was lost
        assert (result.first_offset, result.appended, result.duplicates) == (kept_end, 70 - kept_end, kept_end)
    assert last.stat().st_size > 0
    with Journal.open(jdir, key=key) as j:
        assert seqs(j.read(0)) == list(range(1, 71))


_CHILD_FILE_SIZE_LIMIT = """
import resource, sys
from zerocomm_spark.errors import JournalError
from zerocomm_spark.journal import Journal
j = Journal.open(sys.argv[1], key=bytes.fromhex(sys.argv[2]), fsync="never")
rows = lambda a, b, size: [{"group": "g", "message_id": f"m{s}", "publisher_did": "did:peer:2.x", "seq": s,
                            "lamport_ts": s, "sent_at": 1, "received_at": 1, "payload": bytes(size)}
                           for s in range(a, b + 1)]
j.append(rows(1, 10, 100))
size = sum(p.stat().st_size for p in j.directory.glob("*.zcj"))
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 300_000, resource.RLIM_INFINITY))
try:
    j.append(rows(11, 60, 20_000))  # ~1 MB in one record: the limit stops its write part-way
except JournalError as exc:
    print("append failed:", exc)
    try:
        j.append(rows(61, 61, 10))
    except JournalError as later:
        print("later append failed:", later)
        sys.exit(3)
sys.exit(0)
"""


def test_a_write_cut_off_part_way_fails_the_append_and_reopening_cuts_the_torn_record(
        jdir: Path, key: bytes) -> None:
    """A real write that stops part-way through a record (the process's file-size limit: a short write,
    then EFBIG): the append fails, the journal stops taking appends, and the next open truncates the
    part that reached the file, so the re-send fills exactly the gap."""
    import subprocess
    import sys
    import textwrap

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD_FILE_SIZE_LIMIT), str(jdir), key.hex()],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "File too large" in done.stdout and "later append failed" in done.stdout
    (segment,) = segments(jdir)
    cut_at = segment.stat().st_size
    with Journal.open(jdir, key=key) as j:
        assert j.next_offset == 10
        assert segment.stat().st_size < cut_at  # the part of the record that was written is gone
        again = [{"group": "g", "message_id": f"m{s}", "publisher_did": "did:peer:2.x", "seq": s, "lamport_ts": s,
                  "sent_at": 1, "received_at": 1, "payload": bytes(20_000)} for s in range(11, 61)]
        assert j.append(again).appended == 50
        assert seqs(j.read(0)) == list(range(1, 61))


def test_torn_segment_header_of_a_new_segment_is_rewritten(jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 4)
    (jdir / f"{20:020d}.zcj").write_bytes(b"ZCJS\x01")  # crash while creating the next segment
    with Journal.open(jdir, key=key) as j:
        assert j.next_offset == 20
        assert j.append(rows(21, 22)).first_offset == 20
        assert seqs(j.read(0)) == list(range(1, 23))


def test_corrupt_record_in_the_middle_names_file_and_position_and_the_rest_stays_readable(
        jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 24, segment_bytes=4096)
    files = segments(jdir)
    assert len(files) >= 3
    victim = files[1]  # a closed segment: found when read
    pos, base, length = record_positions(victim)[1]
    data = bytearray(victim.read_bytes())
    data[pos + RECORD_HEADER_BYTES + 10] ^= 0xFF
    victim.write_bytes(bytes(data))
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        with pytest.raises(JournalCorruptError) as caught:
            j.read(base, base + 1)
        message = str(caught.value)
        assert str(victim) in message and f"position {pos}" in message and "checksum" in message
        assert seqs(j.read(0, base)) == list(range(1, base + 1))  # before it
        assert seqs(j.read(base + 5)) == list(range(base + 6, 121))  # after it
        with pytest.raises(JournalCorruptError):
            list(j.read_batches(0))  # a read across it fails when it reaches it
        assert j.append(rows(121, 125)).first_offset == 120  # and the journal keeps working


def test_damaged_header_in_the_active_segment_is_skipped_not_truncated(jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 6)
    (only,) = segments(jdir)
    pos, base, _ = record_positions(only)[2]
    data = bytearray(only.read_bytes())
    data[pos:pos + 4] = b"XXXX"  # the header of a record in the middle
    only.write_bytes(bytes(data))
    with Journal.open(jdir, key=key) as j:
        assert j.next_offset == 30  # the records after it were not cut off
        assert seqs(j.read(base + 5)) == list(range(base + 6, 31))
        with pytest.raises(JournalCorruptError, match=f"{only.name} is damaged at position {pos}"):
            j.read(base, base + 5)
        assert j.append(rows(1, 35)).appended == 5


def test_tampered_record_with_a_fixed_crc_is_reported_as_altered(jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 10, segment_bytes=4096)
    victim = segments(jdir)[0]
    pos, base, length = record_positions(victim)[0]
    data = bytearray(victim.read_bytes())
    data[pos + RECORD_HEADER_BYTES + 3] ^= 0x40
    data[pos:pos + length] = _with_fixed_crc(bytearray(data[pos:pos + length]))
    victim.write_bytes(bytes(data))
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        with pytest.raises(JournalCorruptError, match="fails authentication although its checksum holds"):
            j.read(base, base + 1)
        assert j.read(base + 5).num_rows == 50 - base - 5


def test_a_record_whose_cipher_byte_was_changed_is_reported_as_altered(jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 10, segment_bytes=4096)
    victim = segments(jdir)[0]
    pos, base, length = record_positions(victim)[0]
    data = bytearray(victim.read_bytes())
    assert data[pos + 4] == crypto.AEGIS_256
    frame = bytearray(data[pos:pos + length])
    frame[4] = crypto.AES_256_GCM  # read it as an older cipher
    data[pos:pos + length] = _with_fixed_crc(frame)
    victim.write_bytes(bytes(data))
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        with pytest.raises(JournalCorruptError, match="fails authentication although its checksum holds"):
            j.read(base, base + 1)
        assert j.read(base + 5).num_rows == 50 - base - 5


def record_versions(directory: Path) -> list[int]:
    out = []
    for path in segments(directory):
        data = path.read_bytes()
        out += [data[pos + 4] for pos, _, _ in record_positions(path)]
    return out


@pytest.mark.parametrize("old_version", [crypto.XCHACHA20_POLY1305, crypto.AES_256_GCM])
def test_records_of_older_versions_stay_readable_beside_aegis_ones(jdir: Path, key: bytes, monkeypatch,
                                                                   old_version: int) -> None:
    # A journal written by an earlier version: every record is of the older cipher.
    with monkeypatch.context() as patched:
        patched.setattr(codec.encode_record, "__kwdefaults__", {"version": old_version})
        journal_with(jdir, key, 12, segment_bytes=4096)
    old = record_versions(jdir)
    assert set(old) == {old_version}
    with Journal.open(jdir, key=key) as j:  # the upgraded journal appends AEGIS records (here: to the same segment)
        assert seqs(j.read(0)) == list(range(1, 61))
        result = j.append(rows(1, 70))  # old rows still count as duplicates
        assert (result.first_offset, result.appended, result.duplicates) == (60, 10, 60)
        j.append(rows(71, 100))
    versions = record_versions(jdir)
    assert versions[:len(old)] == old and set(versions[len(old):]) == {crypto.AEGIS_256}
    mixed = [{path.read_bytes()[pos + 4] for pos, _, _ in record_positions(path)} for path in segments(jdir)]
    assert {old_version, crypto.AEGIS_256} in mixed  # the segment that was active holds both
    # Without side files every segment is decrypted again at open: both versions, ids and seqs included.
    for side in [*jdir.glob("*.idx"), jdir / "recent.ids"]:
        side.unlink()
    with Journal.open(jdir, key=key) as j:
        table = j.read(0)
        assert seqs(table) == list(range(1, 101))
        assert table.column("payload")[0].as_py().startswith(b"SECRET-PAYLOAD-000001|")
        assert j.append([dict(rows(101, 101)[0], message_id=rows(3, 3)[0]["message_id"])]).duplicates == 1
        assert j.read_by_seq(GROUP, ALICE, 58, 63).column("seq").to_pylist() == list(range(58, 64))


@pytest.mark.parametrize("read_threads", [1, 2])
def test_a_read_yields_every_batch_before_a_corrupt_record_then_raises(jdir: Path, key: bytes,
                                                                       read_threads: int) -> None:
    # Many small adjacent records: the pool reads them several per task (one preadv).
    journal_with(jdir, key, 30, per_append=2)
    (only,) = segments(jdir)
    pos, base, _ = record_positions(only)[17]
    data = bytearray(only.read_bytes())
    data[pos + RECORD_HEADER_BYTES + 5] ^= 0x01
    only.write_bytes(bytes(data))
    with Journal.open(jdir, key=key, read_threads=read_threads) as j:
        got: list[int] = []
        with pytest.raises(JournalCorruptError, match=f"position {pos}"):
            for batch in j.read_batches(0):
                got += batch.column("offset").to_pylist()
        assert got == list(range(base))
        assert j.read(base + 2).column("offset").to_pylist() == list(range(base + 2, 60))
        assert [b.num_rows for b in j.read_batches(3, 9)] == [1, 2, 2, 1]  # partial records at both ends


def test_a_missing_segment_is_a_damaged_range_not_a_failed_open(jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 24, segment_bytes=4096)
    files = segments(jdir)
    lost = files[1]
    lost_base, next_base = int(lost.name[:20]), int(files[2].name[:20])
    lost.unlink()
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        with pytest.raises(JournalCorruptError, match=f"offsets {lost_base}..{next_base - 1} are unreadable"):
            j.read(lost_base, lost_base + 1)
        assert j.read(0, lost_base).num_rows == lost_base
        assert j.read(next_base).num_rows == 120 - next_base


def test_lost_key_check_file_does_not_let_a_wrong_key_in(jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 3)
    (jdir / META_FILE).unlink()
    with pytest.raises(JournalKeyError):
        Journal.open(jdir, key=nacl.utils.random(32))
    assert not (jdir / META_FILE).exists()
    with Journal.open(jdir, key=key) as j:  # the right key re-creates the check
        assert j.read(0).num_rows == 15
    with pytest.raises(JournalKeyError):
        Journal.open(jdir, key=nacl.utils.random(32))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_key_check_file_is_not_reported_as_a_wrong_key(jdir: Path, key: bytes, damage: str) -> None:
    # A rotten or cut journal.meta made the right key fail as "the key given does not open the
    # journal" (JournalKeyError): the operator was told to look for another key that does not exist.
    journal_with(jdir, key, 3)
    meta = jdir / META_FILE
    blob = bytearray(meta.read_bytes())
    if damage == "flip":
        blob[-3] ^= 0x10
    else:
        del blob[-7:]
    meta.write_bytes(bytes(blob))
    with pytest.raises(JournalKeyError):  # a wrong key is still refused, and nothing is rewritten
        Journal.open(jdir, key=nacl.utils.random(32))
    assert meta.read_bytes() == bytes(blob)
    with Journal.open(jdir, key=key) as j:  # the right key opens the records: the check is remade
        assert j.read(0).num_rows == 15
    with pytest.raises(JournalKeyError):
        Journal.open(jdir, key=nacl.utils.random(32))
    with Journal.open(jdir, key=key) as j:
        assert j.read(0).num_rows == 15


def test_damaged_key_check_file_of_an_empty_journal_says_it_may_be_damaged(jdir: Path, key: bytes) -> None:
    Journal.open(jdir, key=key).close()  # no record to try the key on
    meta = jdir / META_FILE
    blob = bytearray(meta.read_bytes())
    blob[-3] ^= 0x10
    meta.write_bytes(bytes(blob))
    with pytest.raises(JournalKeyError, match=r"or its key check \S+ is damaged"):
        Journal.open(jdir, key=key)


def test_scan_indexes_records_from_headers(jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 7)
    (only,) = segments(jdir)
    result = scan_segment(only, 0, verify_crc=True)
    assert result.tail_damage_at is None and not result.segment.damaged
    assert [e.base_offset for e in result.segment.records] == [0, 5, 10, 15, 20, 25, 30]
    assert result.segment.end_offset == 35 and result.segment.size == only.stat().st_size


def test_reopen_after_kill_without_side_files_or_clean_close(jdir: Path, key: bytes, tmp_path: Path) -> None:
    j = Journal.open(jdir, key=key, segment_bytes=4096)
    try:
        for a in range(30):
            j.append(rows(a * 5 + 1, a * 5 + 5))
        snapshot = tmp_path / "after-kill"
        shutil.copytree(jdir, snapshot)
    finally:
        j.close()
    with Journal.open(snapshot, key=key, segment_bytes=4096) as j:
        assert seqs(j.read(0)) == list(range(1, 151))
        assert j.append(rows(140, 155)).appended == 5


def test_remembered_ids_never_block_the_resend_of_rows_that_were_lost(jdir: Path, key: bytes) -> None:
    # Power loss under fsync="interval" can drop a tail that the saved id list (written at close)
    # still names. Those rows must be appendable again, not "duplicates".
    journal_with(jdir, key, 10)
    (only,) = segments(jdir)
    pos, base, _ = record_positions(only)[-2]
    with open(only, "r+b") as f:
        f.truncate(pos)  # the last two records are gone
    assert base == 40
    with Journal.open(jdir, key=key) as j:
        assert j.next_offset == 40
        result = j.append(rows(1, 50))
        assert (result.appended, result.duplicates) == (10, 40)
        assert seqs(j.read(0)) == list(range(1, 51))


def test_ids_are_remembered_even_without_any_saved_list(jdir: Path, key: bytes) -> None:
    journal_with(jdir, key, 20, segment_bytes=4096)
    for side in jdir.glob("*.idx"):
        side.unlink()
    (jdir / "recent.ids").unlink()
    with Journal.open(jdir, key=key, segment_bytes=4096) as j:
        # A new seq under an id journaled long ago, in an early segment: still a duplicate.
        assert j.append([{**rows(101, 101)[0], "message_id": rows(3, 3)[0]["message_id"]}]).duplicates == 1
        # Seq 101 was used (superseded): another message under it is a duplicate too; the next seq is new.
        assert j.append(rows(101, 101)).duplicates == 1
        assert j.append(rows(102, 102)).appended == 1
    assert (jdir / "recent.ids").exists()


def test_only_exact_segment_names_are_segments() -> None:
    """A stray file whose name ends in a newline must not pass for a segment of the same base offset."""
    from zerocomm_spark.journal.segment import parse_segment_name

    assert parse_segment_name(f"{7:020d}.zcj") == 7
    assert parse_segment_name(f"{7:020d}.zcj\n") is None
