"""The sealed keystore, with real Argon2id/SecretBox crypto, real files, locks and processes."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import nacl.utils
import pytest

from zerocomm_spark.errors import (
    AgentAlreadyRunningError,
    InsecurePermissionsError,
    InvalidRecordError,
    KeyNotFoundError,
    KeystoreClosedError,
    KeystoreError,
    KeystoreLockedError,
)
from zerocomm_spark.keys import KeyPair, Keystore, b58encode, verify_signature
from zerocomm_spark.keys import keystore as keystore_module
from zerocomm_spark.keys.keystore import KEY_FILE, LOCK_FILE, SEALED_FILE, KeyInfo

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

CRASH_MID_WRITE = """
import os, sys
from zerocomm_spark.keys import Keystore
from zerocomm_spark.keys import keystore as module
ks = Keystore.open(sys.argv[1])
print(ks.create_key("connection").verkey, flush=True)
real_fsync = os.fsync
def crash_after_temp_file_is_written(fd):
    real_fsync(fd)
    if not os.path.isdir(f"/proc/self/fd/{fd}"):
        os._exit(17)  # the process dies with a complete temp file, before the rename
module.os.fsync = crash_after_temp_file_is_written
ks.create_key("connection")
print("not reached", flush=True)
"""


def test_crash_mid_write_leaves_the_previous_state(home: Path) -> None:
    result = run_python(CRASH_MID_WRITE, str(home))
    assert result.returncode == 17, result.stderr
    survivor = result.stdout.split()[0]
    leftovers = [p.name for p in home.iterdir() if p.name.endswith(".tmp")]
    assert leftovers, "the crash should have left the half-done temp file behind"
    with Keystore.open(home) as ks:  # the dead process released the lock
        assert [k.verkey for k in ks.keys()] == [survivor]
        ks.get(survivor).sign(b"still usable")
    assert not [p.name for p in home.iterdir() if p.name.endswith(".tmp")], "stale temp files are removed"


def test_failed_write_changes_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ks = Keystore.open(home)
    try:
        kept = ks.create_key("connection")
        ks.put_record("group", "g1", {"epoch": 1})

        def disk_full(src: object, dst: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(keystore_module.os, "replace", disk_full)
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
        # Read the file as another process would, while ks is still open (no close/flush needed).
        result = run_python(
            """
            import json, sys
            from pathlib import Path
            import nacl.secret
            home = Path(sys.argv[1])
            blob = (home / "keystore.sealed").read_bytes()
            box = nacl.secret.SecretBox((home / "keystore.key").read_bytes())
            print(json.dumps(sorted(json.loads(box.decrypt(blob[6:]))["keys"])))
            """,
            str(home),
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == [pair.verkey]


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
