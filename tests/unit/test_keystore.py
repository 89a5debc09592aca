"""The sealed keystore, with real Argon2id/SecretBox crypto, real files, locks and processes."""

from __future__ import annotations

import base64
import json
import os
import random
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import nacl.utils
import pytest

from zerocomm_spark.errors import (
    AgentAlreadyRunningError,
    IdentityPathError,
    InsecurePermissionsError,
    InvalidRecordError,
    KeyNotFoundError,
    KeystoreClosedError,
    KeystoreError,
    KeystoreLockedError,
)
from zerocomm_spark.keys import KeyPair, Keystore, b58encode, verify_signature
from zerocomm_spark.keys import keystore as keystore_module
from zerocomm_spark.keys.keystore import KEY_FILE, LOCK_FILE, LOG_FILE, SEALED_FILE, KeyInfo

PASSPHRASE = "correct horse battery staple"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "identity"


# --- restart -----------------------------------------------------------------------------------


def test_restart_keeps_identities_secrets_and_records(home: Path) -> None:
    with Keystore.open(home) as ks:
        a = ks.create_key("connection", ref="conn-1")
        b = ks.create_key("invitation", ref="inv-1")
        c = ks.create_key("connection")
        ks.put_secret("group/alpha", b"\x00\x01group-key\xff")
        ks.put_record("connection", "conn-1", {"their_did": "did:peer:2.x", "state": "completed", "n": [1, 2]})
        ks.put_record("connection", "conn-2", {"state": "invited"})
        signature = a.sign(b"hello")

    with Keystore.open(home) as ks:
        again = ks.get(a.verkey)
        assert again.seed == a.seed
        verify_signature(again.verkey, b"hello", signature)
        assert again.sign(b"later") == a.sign(b"later")
        assert bytes(ks.get(b.verkey).x25519_public()) == bytes(b.x25519_public())
        assert [k.verkey for k in ks.keys()] == [a.verkey, b.verkey, c.verkey]
        assert [k.verkey for k in ks.keys("connection")] == [a.verkey, c.verkey]
        info = ks.keys("invitation")[0]
        assert (info.purpose, info.ref) == ("invitation", "inv-1")
        assert info.created_at.tzinfo is not None
        assert ks.get_secret("group/alpha") == b"\x00\x01group-key\xff"
        assert ks.get_secret("missing") is None
        assert ks.get_record("connection", "conn-1") == {
            "their_did": "did:peer:2.x", "state": "completed", "n": [1, 2]}
        assert [r["state"] for r in ks.records("connection")] == ["completed", "invited"]
        assert ks.records("nothing") == []


def test_passphrase_restart_and_wrong_passphrase(home: Path) -> None:
    with Keystore.open(home, passphrase=PASSPHRASE) as ks:
        pair = ks.create_key("connection")
    assert not (home / KEY_FILE).exists(), "a passphrase keystore needs no key file"

    with Keystore.open(home, passphrase=PASSPHRASE.encode()) as ks:  # bytes work like str
        assert ks.get(pair.verkey).seed == pair.seed

    with pytest.raises(KeystoreLockedError) as wrong:
        Keystore.open(home, passphrase="Correct horse battery staple")
    assert "Correct horse" not in str(wrong.value)
    with pytest.raises(KeystoreLockedError, match="sealed with a passphrase"):
        Keystore.open(home)
    # A refused open must not keep the directory locked.
    Keystore.open(home, passphrase=PASSPHRASE).close()


def test_key_file_keystore_refuses_a_passphrase(home: Path) -> None:
    Keystore.open(home).close()
    with pytest.raises(KeystoreLockedError, match="key file"):
        Keystore.open(home, passphrase=PASSPHRASE)
    with pytest.raises(KeystoreError, match="empty"):
        Keystore.open(home, passphrase="")


def test_wrong_or_missing_key_file_is_refused(home: Path) -> None:
    with Keystore.open(home) as ks:
        ks.create_key("connection")
    key_file = home / KEY_FILE
    original = key_file.read_bytes()
    key_file.write_bytes(nacl.utils.random(32))
    with pytest.raises(KeystoreLockedError, match="wrong passphrase or key file"):
        Keystore.open(home)
    key_file.write_bytes(original[:16])
    with pytest.raises(KeystoreLockedError, match="damaged"):
        Keystore.open(home)
    key_file.unlink()
    with pytest.raises(KeystoreLockedError, match="missing"):
        Keystore.open(home)


# --- permissions -------------------------------------------------------------------------------


def test_files_are_private(home: Path) -> None:
    Keystore.open(home).close()
    assert mode_of(home) == 0o700
    assert mode_of(home / KEY_FILE) == 0o600
    assert mode_of(home / SEALED_FILE) == 0o600
    assert mode_of(home / LOG_FILE) == 0o600
    assert mode_of(home / LOCK_FILE) == 0o600


def test_key_file_readable_by_others_is_refused(home: Path) -> None:
    Keystore.open(home).close()
    os.chmod(home / KEY_FILE, 0o644)
    with pytest.raises(InsecurePermissionsError, match="mode 644") as refused:
        Keystore.open(home)
    assert isinstance(refused.value, KeystoreError)
    assert mode_of(home / KEY_FILE) == 0o644, "the key file must not be silently 'fixed'"
    os.chmod(home / KEY_FILE, 0o600)
    Keystore.open(home).close()


def test_symlinked_key_file_is_refused(home: Path, tmp_path: Path) -> None:
    Keystore.open(home).close()
    elsewhere = tmp_path / "elsewhere.key"
    elsewhere.write_bytes((home / KEY_FILE).read_bytes())
    os.chmod(elsewhere, 0o600)
    (home / KEY_FILE).unlink()
    (home / KEY_FILE).symlink_to(elsewhere)
    with pytest.raises(InsecurePermissionsError, match="not a regular file"):
        Keystore.open(home)


def test_open_directory_we_own_is_tightened(home: Path) -> None:
    home.mkdir(mode=0o777)
    os.chmod(home, 0o777)
    Keystore.open(home).close()
    assert mode_of(home) == 0o700


def test_a_shared_sticky_directory_is_refused_not_made_private(tmp_path: Path) -> None:
    """identity.dir=/tmp (or /var/tmp, /dev/shm) for an agent run as root, who owns them: the directory
    was "tightened" to 700, its sticky bit dropped, locking every other user out of /tmp."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(IdentityPathError, match="shared directory") as info:
        Keystore.open(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert list(shared.iterdir()) == []  # nothing made there
    assert f"{shared}/zerocomm" in info.value.hint
    Keystore.open(shared / "zerocomm").close()  # what the hint says works
    assert mode_of(shared / "zerocomm") == 0o700 and stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_directory_of_another_user_is_refused_whatever_its_mode(home: Path) -> None:
    """Only a directory that was too open was checked for its owner: one of another user with mode
    700 was used (by root: an agent run as root on a user's identity directory), and that user,
    who may rename and delete entries there, could roll the keystore back or swap its files."""
    if os.getuid() != 0:
        pytest.skip("making a directory of another user needs root (and only root could use it)")
    home.mkdir(mode=0o700)
    os.chown(home, 65534, 65534)
    with pytest.raises(InsecurePermissionsError, match="uid 65534") as info:
        Keystore.open(home)
    assert list(home.iterdir()) == []  # nothing made there
    # The owner is the reason, not the mode (700: as private as it gets), and it says what to do.
    assert "mode" not in str(info.value) and "belongs to uid 65534" in str(info.value)
    assert "owner (uid 65534)" in info.value.hint and "identity directory of this user" in info.value.hint


def test_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    with pytest.raises(KeystoreError, match="not a directory"):
        Keystore.open(path)


# --- damage ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["ciphertext", "nonce", "truncated", "magic", "empty", "appended"])
def test_tampered_sealed_file_is_refused(home: Path, where: str) -> None:
    with Keystore.open(home) as ks:
        ks.create_key("connection")
    sealed = home / SEALED_FILE
    blob = bytearray(sealed.read_bytes())
    if where == "ciphertext":
        blob[-5] ^= 0x01
    elif where == "nonce":
        blob[10] ^= 0x80
    elif where == "truncated":
        blob = blob[: len(blob) // 2]
    elif where == "magic":
        blob[0:4] = b"XXXX"
    elif where == "empty":
        blob = bytearray()
    else:
        blob += b"\x00"
    sealed.write_bytes(bytes(blob))
    with pytest.raises(KeystoreLockedError):
        Keystore.open(home)


@pytest.mark.parametrize("field", ["salt", "opslimit", "memlimit_huge", "kdf"])
def test_tampered_passphrase_header_is_refused(home: Path, field: str) -> None:
    Keystore.open(home, passphrase=PASSPHRASE).close()
    sealed = home / SEALED_FILE
    blob = bytearray(sealed.read_bytes())
    magic = len(b"ZCKS\x01")
    if field == "salt":
        blob[magic + 1 + 12] ^= 0x01
    elif field == "opslimit":
        blob[magic + 1 : magic + 5] = (4).to_bytes(4, "big")
    elif field == "memlimit_huge":  # must be refused before Argon2id tries to allocate it
        blob[magic + 5 : magic + 13] = (1 << 40).to_bytes(8, "big")
    else:
        blob[magic] = 7
    sealed.write_bytes(bytes(blob))
    with pytest.raises(KeystoreLockedError):
        Keystore.open(home, passphrase=PASSPHRASE)


# --- exclusivity -------------------------------------------------------------------------------


def test_second_open_in_the_same_process_is_refused(home: Path) -> None:
    first = Keystore.open(home)
    with pytest.raises(AgentAlreadyRunningError, match=f"process {os.getpid()}"):
        Keystore.open(home)
    first.close()
    with Keystore.open(home) as second:
        assert not second.closed
    assert second.closed
    Keystore.open(home).close()


HOLD_OPEN = """
import sys
from zerocomm_spark.keys import Keystore
ks = Keystore.open(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
ks.close()
print("closed", flush=True)
sys.stdin.readline()
"""

TRY_OPEN = """
import sys
from zerocomm_spark.errors import AgentAlreadyRunningError
from zerocomm_spark.keys import Keystore
try:
    Keystore.open(sys.argv[1]).close()
except AgentAlreadyRunningError as exc:
    print(exc)
    sys.exit(3)
print("opened")
"""


def test_second_open_from_another_process_is_refused(home: Path) -> None:
    ks = Keystore.open(home)
    try:
        result = run_python(TRY_OPEN, str(home))
        assert result.returncode == 3, result.stderr
        assert f"process {os.getpid()}" in result.stdout
    finally:
        ks.close()
    result = run_python(TRY_OPEN, str(home))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "opened"


def test_open_is_refused_while_another_process_holds_it(home: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_OPEN), str(home)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(AgentAlreadyRunningError, match=f"process {holder.pid}"):
            Keystore.open(home)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "closed"
        Keystore.open(home).close()  # released by close(), while the holder still runs
    finally:
        holder.kill()
        holder.wait(timeout=10)


# --- nothing secret leaks ----------------------------------------------------------------------


def test_nothing_secret_in_repr_or_on_disk(home: Path) -> None:
    with Keystore.open(home, passphrase=PASSPHRASE) as ks:
        pair = ks.create_key("connection", ref="conn-1")
        group_key = nacl.utils.random(32)
        ks.put_secret("group/alpha", group_key)
        ks.put_record("connection", "conn-1", {"their_label": "Carol-the-auditor"})
        shown = [repr(ks), str(ks), repr(pair), str(pair), repr(ks.keys()), repr(ks.get(pair.verkey))]
        seed = pair.seed
    secret_forms = [
        seed, group_key, pair.ed25519_secret, bytes(pair.x25519_private()),
        b58encode(seed).encode(), base64.b64encode(seed), seed.hex().encode(),
        base64.b64encode(group_key), b58encode(group_key).encode(), PASSPHRASE.encode(),
    ]
    for text in shown:
        for form in secret_forms:
            assert form.decode("latin-1") not in text
    assert pair.verkey in repr(pair)  # the public part may show
    # Everything on disk is sealed: not even the verkey, labels or record ids are in clear.
    clear_forms = [*secret_forms, pair.verkey.encode(), b"Carol-the-auditor", b"conn-1", b"connection"]
    for path in home.iterdir():
        data = path.read_bytes()
        for form in clear_forms:
            assert form not in data, f"{path.name} holds a secret in clear"
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(pair)


def test_key_info_has_no_secret_field() -> None:
    assert set(KeyInfo.__dataclass_fields__) == {"verkey", "purpose", "ref", "created_at"}


# --- atomic, durable writes --------------------------------------------------------------------

CRASH = """
import os, sys
from zerocomm_spark.keys import Keystore
from zerocomm_spark.keys import keystore as module
point = sys.argv[2]
if point.startswith("compaction"):
    module._COMPACT_MIN_BYTES = 0  # every write compacts
ks = Keystore.open(sys.argv[1])
print(ks.create_key("connection").verkey, flush=True)
real_write, real_replace = os.write, os.replace
def half_a_record(fd, data):
    real_write(fd, bytes(data)[: len(data) // 2])
    os._exit(17)  # dies with half a record in the log, never synced or acknowledged
def die_at_replace(nth):
    calls = []
    def replace(src, dst):
        calls.append(dst)
        if len(calls) == nth:
            os._exit(17)
        return real_replace(src, dst)
    return replace
if point == "append":
    module.os.write = half_a_record
else:
    # after the record is synced: the snapshot's rename (1st) or the new log's (2nd)
    module.os.replace = die_at_replace(1 if point == "compaction-snapshot" else 2)
ks.create_key("connection")
print("not reached", flush=True)
"""


@pytest.mark.parametrize("point", ["append", "compaction-snapshot", "compaction-log"])
def test_crash_mid_write_leaves_a_consistent_keystore(home: Path, point: str) -> None:
    result = run_python(CRASH, str(home), point)
    assert result.returncode == 17, result.stderr
    survivor = result.stdout.split()[0]
    with Keystore.open(home) as ks:  # the dead process released the lock
        verkeys = [k.verkey for k in ks.keys()]
        # Cut mid-record: the record was never acknowledged and is dropped. Cut during compaction:
        # the record was synced to the log before, so it survives either way.
        assert verkeys[0] == survivor and len(verkeys) == (1 if point == "append" else 2)
        ks.get(survivor).sign(b"still usable")
        later = ks.create_key("connection")
    assert not [p.name for p in home.iterdir() if p.name.endswith(".tmp")], "stale temp files are removed"
    with Keystore.open(home) as ks:
        assert [k.verkey for k in ks.keys()] == [*verkeys, later.verkey]


def test_failed_write_changes_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ks = Keystore.open(home)
    try:
        kept = ks.create_key("connection")
        ks.put_record("group", "g1", {"epoch": 1})

        def disk_full(fd: int, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(keystore_module.os, "write", disk_full)
        with pytest.raises(KeystoreError, match="No space left"):
            ks.create_key("connection")
        with pytest.raises(KeystoreError):
            ks.put_record("group", "g1", {"epoch": 2})
        with pytest.raises(KeystoreError):
            ks.delete_key(kept.verkey)
        # Memory still matches disk: nothing half-applied.
        assert [k.verkey for k in ks.keys()] == [kept.verkey]
        assert ks.get_record("group", "g1") == {"epoch": 1}
        monkeypatch.undo()

        # Written, then the sync fails: the record is taken back out of the log.
        def sync_fails_once(fd: int) -> None:
            monkeypatch.undo()
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(keystore_module.os, "fdatasync", sync_fails_once)
        with pytest.raises(KeystoreError, match="Input/output error"):
            ks.put_record("group", "g1", {"epoch": 3})
        assert ks.get_record("group", "g1") == {"epoch": 1}
        added = ks.create_key("connection")
    finally:
        ks.close()
    assert not [p.name for p in home.iterdir() if p.name.endswith(".tmp")]
    with Keystore.open(home) as ks:
        assert [k.verkey for k in ks.keys()] == [kept.verkey, added.verkey]
        assert ks.get_record("group", "g1") == {"epoch": 1}


def test_every_write_reaches_the_disk_before_returning(home: Path) -> None:
    with Keystore.open(home) as ks:
        pair = ks.create_key("connection")
        # Read the files as another process would, while ks is still open (no close/flush needed).
        result = run_python(
            """
            import json, shutil, sys
            from pathlib import Path
            from zerocomm_spark.keys import Keystore
            home, copy = Path(sys.argv[1]), Path(sys.argv[2])
            copy.mkdir(mode=0o700)
            for name in ("keystore.sealed", "keystore.log", "keystore.key"):
                shutil.copy2(home / name, copy / name)
            with Keystore.open(copy) as ks:
                print(json.dumps([k.verkey for k in ks.keys()]))
            """,
            str(home), str(home.parent / "copy"),
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == [pair.verkey]


# --- the log: many changes, torn tails, tampering, old files ------------------------------------


def apply_at_random(ks: Keystore, rng: random.Random, model: dict[str, Any], steps: int) -> None:
    """Random changes to ``ks``, mirrored in ``model`` (what a reopen must show)."""
    for _ in range(steps):
        what = rng.randrange(7)
        if what == 0:
            model["keys"].append(ks.create_key("connection", ref=f"r{rng.randrange(9)}").verkey)
        elif what == 1 and model["keys"]:
            verkey = model["keys"].pop(rng.randrange(len(model["keys"])))
            ks.delete_key(verkey)
        elif what == 2:
            name, value = f"s{rng.randrange(5)}", rng.randbytes(rng.randrange(1, 40))
            ks.put_secret(name, value)
            model["secrets"][name] = value
        elif what == 3:
            name = f"s{rng.randrange(5)}"
            assert ks.delete_secret(name) is (model["secrets"].pop(name, None) is not None)
        elif what in (4, 5):
            kind, rid = f"k{rng.randrange(3)}", f"id{rng.randrange(12)}"
            record = {"n": rng.randrange(1000), "text": "x" * rng.randrange(300)}
            ks.put_record(kind, rid, record)
            model["records"].setdefault(kind, {})[rid] = record
        else:
            kind, rid = f"k{rng.randrange(3)}", f"id{rng.randrange(12)}"
            kind_records = model["records"].get(kind, {})
            assert ks.delete_record(kind, rid) is (kind_records.pop(rid, None) is not None)
            if not kind_records:
                model["records"].pop(kind, None)


def assert_matches(ks: Keystore, model: dict[str, Any]) -> None:
    assert [k.verkey for k in ks.keys()] == model["keys"]
    for name in (f"s{i}" for i in range(5)):
        assert ks.get_secret(name) == model["secrets"].get(name)
    for kind in (f"k{i}" for i in range(3)):
        assert ks.records(kind) == list(model["records"].get(kind, {}).values())


def new_model() -> dict[str, Any]:
    return {"keys": [], "secrets": {}, "records": {}}


@pytest.mark.parametrize("compact_at", [None, 2048])
def test_many_changes_then_reopen(home: Path, monkeypatch: pytest.MonkeyPatch, compact_at: int | None) -> None:
    if compact_at is not None:
        monkeypatch.setattr(keystore_module, "_COMPACT_MIN_BYTES", compact_at)
    rng, model = random.Random(7), new_model()
    with Keystore.open(home) as ks:
        apply_at_random(ks, rng, model, 300)
        assert_matches(ks, model)
    log_size = (home / LOG_FILE).stat().st_size
    if compact_at is None:
        assert log_size > 20_000, "300 changes, no compaction: all in the log"
    else:
        assert log_size < 3 * compact_at + 4096, "the log was compacted into the snapshot as it grew"
    for _ in range(2):  # reopen, change more, reopen
        with Keystore.open(home) as ks:
            assert_matches(ks, model)
            apply_at_random(ks, rng, model, 40)
    with Keystore.open(home) as ks:
        assert_matches(ks, model)


def log_records(home: Path) -> list[tuple[int, int]]:
    """(offset, length) of each record in the log, read from its framing."""
    data = (home / LOG_FILE).read_bytes()
    offset, out = len(b"ZCKL\x01") + 16, []
    while offset < len(data):
        length = int.from_bytes(data[offset : offset + 4], "big") + 4 + 24
        out.append((offset, length))
        offset += length
    return out


@pytest.mark.parametrize("tail", ["cut-in-length", "cut-in-nonce", "cut-in-body", "zeros", "garbage-length", "random"])
def test_torn_tail_is_dropped_and_the_log_repaired(home: Path, tail: str) -> None:
    with Keystore.open(home) as ks:
        first = ks.create_key("connection")
        ks.put_record("connection", "c1", {"state": "completed"})
        last = ks.create_key("connection")
    data = (home / LOG_FILE).read_bytes()
    offset, length = log_records(home)[-1]
    good = data[:offset]
    torn = {
        "cut-in-length": good + data[offset : offset + 2],
        "cut-in-nonce": good + data[offset : offset + 10],
        "cut-in-body": good + data[offset : offset + length - 5],
        "zeros": data + bytes(300),  # a filesystem that grew the file before the data landed
        "garbage-length": data + b"\xff\xff\xff\xff" + bytes(20),
        "random": data + nacl.utils.random(200),
    }[tail]
    (home / LOG_FILE).write_bytes(torn)
    kept = [first.verkey] if tail.startswith("cut") else [first.verkey, last.verkey]
    with Keystore.open(home) as ks:
        assert [k.verkey for k in ks.keys()] == kept
        assert ks.get_record("connection", "c1") == {"state": "completed"}
        added = ks.create_key("connection")  # appended after the repaired end, not after the garbage
    assert (home / LOG_FILE).read_bytes().startswith(good if tail.startswith("cut") else data)
    with Keystore.open(home) as ks:
        assert [k.verkey for k in ks.keys()] == [*kept, added.verkey]


@pytest.mark.parametrize("how", ["flip-first", "flip-middle", "swap", "drop-middle", "header-id", "magic", "foreign", "missing",
                                 "length-first-huge", "length-middle-past-end", "length-middle-short"])
def test_tampered_log_is_refused(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    with Keystore.open(home) as ks:
        monkeypatch.setattr(keystore_module, "_COMPACT_MIN_BYTES", 0)
        ks.put_record("connection", "c0", {"n": 0, "pad": "x" * 1000})  # compacts: the snapshot now names a log it replaced
        monkeypatch.undo()
        for i in range(1, 5):
            ks.put_record("connection", f"c{i}", {"n": i})
    data = bytearray((home / LOG_FILE).read_bytes())
    records = log_records(home)
    assert len(records) == 4
    (o0, _), (o1, l1), (o2, l2) = records[0], records[1], records[2]
    if how == "flip-first":
        data[o0 + 40] ^= 1
    elif how == "flip-middle":
        data[o1 + l1 - 3] ^= 0x80
    elif how == "swap":
        data[o1 : o2 + l2] = data[o2 : o2 + l2] + data[o1 : o1 + l1]
    elif how == "drop-middle":
        del data[o1 : o1 + l1]
    elif how == "header-id":
        data[7] ^= 1
    elif how.startswith("length-"):
        # A rotten length prefix breaks the framing of every record after it: the open took the rest
        # of the log for a torn tail and cut it off, losing acknowledged keys and records for good.
        at = {"length-first-huge": o0, "length-middle-past-end": o1 + 1, "length-middle-short": o1 + 3}[how]
        data[at] ^= {"length-first-huge": 0x40, "length-middle-past-end": 0x40, "length-middle-short": 0x04}[how]
    elif how == "magic":
        data[0:4] = b"XXXX"
    elif how == "foreign":  # another keystore's log, even with the same key file
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        (other / KEY_FILE).write_bytes((home / KEY_FILE).read_bytes())
        os.chmod(other / KEY_FILE, 0o600)
        with Keystore.open(other) as ks:
            ks.put_record("connection", "x", {"n": 1})
        data = bytearray((other / LOG_FILE).read_bytes())
    if how == "missing":
        (home / LOG_FILE).unlink()
    else:
        (home / LOG_FILE).write_bytes(bytes(data))
    for _ in range(2):  # a refused open releases the directory
        with pytest.raises(KeystoreLockedError) as refused:
            Keystore.open(home)
        assert "c1" not in str(refused.value) and "connection" not in str(refused.value)
    if how != "missing":  # refused, not repaired: nothing cut from the log
        assert (home / LOG_FILE).read_bytes() == bytes(data)


def test_missing_log_of_a_new_keystore_is_refused(home: Path) -> None:
    """A new keystore puts its empty log in place before the snapshot that names it: no crash leaves none."""
    with Keystore.open(home) as ks:
        ks.create_key("connection")
    (home / LOG_FILE).unlink()
    with pytest.raises(KeystoreLockedError, match="missing"):
        Keystore.open(home)


@pytest.mark.parametrize("passphrase", [None, PASSPHRASE])
def test_missing_snapshot_beside_a_log_with_changes_is_refused(home: Path, passphrase: str | None) -> None:
    """A lost keystore.sealed made the open create a new, empty keystore over the directory: its
    empty log replaced keystore.log and every key pair, secret and record there was gone for good."""
    with Keystore.open(home, passphrase) as ks:
        ks.put_secret("journal-key", b"k" * 32)
        ks.create_key("connection")
    log_before = (home / LOG_FILE).read_bytes()
    (home / SEALED_FILE).unlink()
    for _ in range(2):  # a refused open releases the directory
        with pytest.raises(KeystoreLockedError, match="missing"):
            Keystore.open(home, passphrase)
    assert (home / LOG_FILE).read_bytes() == log_before
    assert not (home / SEALED_FILE).exists()


def test_crash_while_creating_a_keystore_leaves_one_that_can_be_created_again(home: Path) -> None:
    """The empty log goes first, the snapshot after: a crash between leaves a log with no change,
    and the next open creates the keystore."""
    with Keystore.open(home) as ks:
        pass
    (home / SEALED_FILE).unlink()
    with Keystore.open(home) as ks:
        ks.put_secret("s", b"v")
    with Keystore.open(home) as ks:
        assert ks.get_secret("s") == b"v"


def write_single_file_keystore(home: Path, state: dict[str, Any], passphrase: bytes | None) -> None:
    """A keystore as the single-file format wrote it: keystore.sealed with a version 1 state, no log."""
    import nacl.pwhash.argon2id as argon2id
    import nacl.secret

    home.mkdir(mode=0o700)
    if passphrase is None:
        key = nacl.utils.random(32)
        (home / KEY_FILE).write_bytes(key)
        os.chmod(home / KEY_FILE, 0o600)
        header = b"ZCKS\x01\x00"
    else:
        salt = nacl.utils.random(argon2id.SALTBYTES)
        ops, mem = argon2id.OPSLIMIT_MIN, argon2id.MEMLIMIT_MIN
        key = argon2id.kdf(32, passphrase, salt, opslimit=ops, memlimit=mem)
        header = b"ZCKS\x01\x01" + ops.to_bytes(4, "big") + mem.to_bytes(8, "big") + salt
    blob = header + bytes(nacl.secret.SecretBox(key).encrypt(json.dumps(state).encode()))
    (home / SEALED_FILE).write_bytes(blob)
    os.chmod(home / SEALED_FILE, 0o600)


@pytest.mark.parametrize("passphrase", [None, b"old passphrase"])
def test_a_single_file_keystore_is_converted_on_open(home: Path, passphrase: bytes | None) -> None:
    pair = KeyPair.generate()
    state = {
        "version": 1,
        "keys": {pair.verkey: {"seed": base64.b64encode(pair.seed).decode(), "purpose": "connection",
                               "ref": "c1", "created_at": "2026-01-02T03:04:05+00:00"}},
        "secrets": {"g": base64.b64encode(b"group key").decode()},
        "records": {"connection": {"c1": {"state": "completed"}}},
    }
    write_single_file_keystore(home, state, passphrase)
    with Keystore.open(home, passphrase=passphrase) as ks:
        assert ks.get(pair.verkey).seed == pair.seed
        assert ks.get_secret("g") == b"group key"
        assert ks.get_record("connection", "c1") == {"state": "completed"}
        later = ks.create_key("connection")
    assert (home / LOG_FILE).exists()
    with Keystore.open(home, passphrase=passphrase) as ks:
        assert [k.verkey for k in ks.keys()] == [pair.verkey, later.verkey]
        assert ks.keys()[0].created_at.year == 2026


OPEN_AND_DIE_AT_REPLACE = """
import os, sys
from zerocomm_spark.keys import Keystore
from zerocomm_spark.keys import keystore as module
real_replace, calls = os.replace, []
def replace(src, dst):
    calls.append(dst)
    if len(calls) == int(sys.argv[2]):
        os._exit(17)
    return real_replace(src, dst)
module.os.replace = replace
Keystore.open(sys.argv[1]).close()
print("not reached", flush=True)
"""


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_crash_while_creating_leaves_nothing_half_made(home: Path, nth: int) -> None:
    """Key file, then the empty log, then the snapshot naming it: a crash at any rename, then a clean start."""
    result = run_python(OPEN_AND_DIE_AT_REPLACE, str(home), str(nth))
    assert result.returncode == 17, result.stderr
    with Keystore.open(home) as ks:
        pair = ks.create_key("connection")
    with Keystore.open(home) as ks:
        assert [k.verkey for k in ks.keys()] == [pair.verkey]


@pytest.mark.parametrize("nth", [1, 2])
def test_crash_while_converting_keeps_the_single_file_keystore(home: Path, nth: int) -> None:
    pair = KeyPair.generate()
    write_single_file_keystore(home, {
        "version": 1, "secrets": {}, "records": {},
        "keys": {pair.verkey: {"seed": base64.b64encode(pair.seed).decode(), "purpose": "connection",
                               "ref": None, "created_at": "2026-01-02T03:04:05+00:00"}},
    }, None)
    result = run_python(OPEN_AND_DIE_AT_REPLACE, str(home), str(nth))  # the new log (1st), the snapshot (2nd)
    assert result.returncode == 17, result.stderr
    with Keystore.open(home) as ks:
        assert ks.get(pair.verkey).seed == pair.seed


# --- group commit ---------------------------------------------------------------------------------


def test_concurrent_writers_share_a_write_and_a_sync(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one batch syncs, the changes that arrive queue up and go to disk together."""
    writers = 12
    with Keystore.open(home) as ks:
        real_sync = keystore_module._sync_data
        syncs: list[int] = []
        first_sync = threading.Event()
        queued_all = threading.Event()

        def sync(fd: int) -> None:
            syncs.append(fd)
            if len(syncs) == 1:
                first_sync.set()
                assert queued_all.wait(30), "the other writers never queued"
            real_sync(fd)

        monkeypatch.setattr(keystore_module, "_sync_data", sync)
        errors: list[BaseException] = []

        def put(n: int) -> None:
            try:
                ks.put_record("peer", f"p{n}", {"n": n})
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=put, args=(0,))]
        threads[0].start()
        assert first_sync.wait(30)  # writer 0 is inside its sync, holding no lock
        threads += [threading.Thread(target=put, args=(n,)) for n in range(1, writers)]
        for t in threads[1:]:
            t.start()
        deadline = time.monotonic() + 30
        while len(ks._queue) < writers - 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        queued_all.set()
        for t in threads:
            t.join(30)
        assert not errors
        assert len(syncs) == 2, "the 11 writers that queued behind the first were written with one sync"
        assert len(ks.records("peer")) == writers
    with Keystore.open(home) as ks:
        assert sorted(r["n"] for r in ks.records("peer")) == list(range(writers))


def test_reads_do_not_wait_for_the_disk(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Keystore.open(home) as ks:
        pair = ks.create_key("connection")
        ks.put_record("connection", "c1", {"state": "completed"})
        in_sync, release = threading.Event(), threading.Event()
        real_sync = keystore_module._sync_data

        def slow_sync(fd: int) -> None:
            in_sync.set()
            assert release.wait(30)
            real_sync(fd)

        monkeypatch.setattr(keystore_module, "_sync_data", slow_sync)
        writer = threading.Thread(target=ks.put_record, args=("connection", "c2", {"state": "invited"}))
        writer.start()
        try:
            assert in_sync.wait(30)
            # The write is in flight (synced it is not): reads answer, and do not see it yet.
            assert ks.find(pair.verkey) is pair
            assert ks.get_record("connection", "c1") == {"state": "completed"}
            assert ks.get_record("connection", "c2") is None
        finally:
            release.set()
            writer.join(30)
        assert ks.get_record("connection", "c2") == {"state": "invited"}


def test_concurrent_deletes_of_one_key_succeed_once(home: Path) -> None:
    with Keystore.open(home) as ks:
        pairs = [ks.create_key("connection") for _ in range(6)]
        outcomes: list[str] = []
        guard = threading.Lock()
        barrier = threading.Barrier(8)

        def delete(verkey: str) -> None:
            barrier.wait()
            try:
                ks.delete_key(verkey)
                result = "deleted"
            except KeyNotFoundError:
                result = "not found"
            with guard:
                outcomes.append(result)

        for pair in pairs:
            barrier.reset()
            threads = [threading.Thread(target=delete, args=(pair.verkey,)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        assert outcomes.count("deleted") == len(pairs) and outcomes.count("not found") == 7 * len(pairs)
        assert ks.keys() == []


# --- API behaviour -----------------------------------------------------------------------------


def test_get_find_and_delete_keys(home: Path) -> None:
    with Keystore.open(home) as ks:
        pair = ks.create_key("invitation", ref="inv-9")
        stranger = KeyPair.generate()
        assert ks.find(stranger.verkey) is None
        with pytest.raises(KeyNotFoundError, match=stranger.verkey):
            ks.get(stranger.verkey)
        assert ks.find(pair.verkey) is ks.get(pair.verkey)
        ks.delete_key(pair.verkey)
        assert ks.find(pair.verkey) is None
        with pytest.raises(KeyNotFoundError):
            ks.delete_key(pair.verkey)
    with Keystore.open(home) as ks:
        assert ks.keys() == []
        assert ks.find(pair.verkey) is None


def test_records_are_copies_and_must_be_json(home: Path) -> None:
    with Keystore.open(home) as ks:
        record = {"members": ["a"], "epoch": 1}
        ks.put_record("group", "g1", record)
        record["members"].append("mutated-after-put")
        fetched = ks.get_record("group", "g1")
        assert fetched == {"members": ["a"], "epoch": 1}
        assert fetched is not None
        fetched["epoch"] = 99
        assert ks.get_record("group", "g1") == {"members": ["a"], "epoch": 1}
        ks.put_record("group", "g1", {"epoch": 2})  # replace
        assert ks.records("group") == [{"epoch": 2}]
        assert ks.get_record("group", "nope") is None
        assert ks.delete_record("group", "g1") is True
        assert ks.delete_record("group", "g1") is False
        assert ks.records("group") == []
        for bad in ({"key": b"bytes"}, {"x": float("nan")}, {"s": {1, 2}}):
            with pytest.raises(InvalidRecordError):
                ks.put_record("group", "bad", bad)
        with pytest.raises(InvalidRecordError):
            ks.put_record("group", "", {})
        with pytest.raises(InvalidRecordError):
            ks.put_record("group", "x", ["not", "a", "dict"])  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            ks.put_secret("name", "not bytes")  # type: ignore[arg-type]
        with pytest.raises(InvalidRecordError):
            ks.create_key("")
        ks.put_secret("s", b"v")
        assert ks.delete_secret("s") is True
        assert ks.get_secret("s") is None
        assert ks.delete_secret("s") is False


def test_concurrent_writers_lose_nothing(home: Path) -> None:
    with Keystore.open(home) as ks:
        created: list[str] = []
        guard = threading.Lock()
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            try:
                for i in range(8):
                    verkey = ks.create_key("connection", ref=f"{n}-{i}").verkey
                    ks.put_record("connection", f"{n}-{i}", {"verkey": verkey})
                    with guard:
                        created.append(verkey)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    with Keystore.open(home) as ks:
        assert sorted(k.verkey for k in ks.keys()) == sorted(created)
        assert len(created) == 48
        assert sorted(r["verkey"] for r in ks.records("connection")) == sorted(created)


def test_closed_keystore_refuses_use(home: Path) -> None:
    ks = Keystore.open(home)
    pair = ks.create_key("connection")
    ks.close()
    ks.close()  # idempotent
    for call in (lambda: ks.get(pair.verkey), lambda: ks.create_key("x"), ks.keys,
                 lambda: ks.put_secret("a", b"b"), lambda: ks.records("k")):
        with pytest.raises(KeystoreClosedError):
            call()
    assert "closed" in repr(ks)
