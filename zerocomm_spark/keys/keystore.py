"""The sealed keystore: a member's key pairs, secrets and protocol records, encrypted at rest.

Everything a member must keep across restarts (its per-relationship key pairs, connection and
group records) lives in one file, ``keystore.sealed``, encrypted with a NaCl SecretBox. The box key
comes from the user's passphrase through Argon2id, or, without a passphrase, from a random key file
``keystore.key`` (mode 0600) next to it. The whole state is decrypted once at open and kept in
memory; every change is written through before the call returns, by atomic replacement, so a crash
leaves either the old or the new file, never a torn one.

One identity directory belongs to one running agent: ``open`` takes an exclusive ``flock`` and a
second open, from this process or another, fails with :class:`AgentAlreadyRunningError`. Two agents
writing the same keystore would silently lose each other's keys.
"""

from __future__ import annotations

import base64
import copy
import errno
import fcntl
import json
import logging
import os
import stat
import struct
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TypeVar

import nacl.exceptions
import nacl.pwhash.argon2id as argon2id
import nacl.secret
import nacl.utils

from zerocomm_spark.errors import (
    AgentAlreadyRunningError,
    InsecurePermissionsError,
    InvalidRecordError,
    KeyNotFoundError,
    KeystoreClosedError,
    KeystoreError,
    KeystoreLockedError,
)
from zerocomm_spark.keys.keypair import KeyPair

__all__ = ["KeyInfo", "Keystore"]

log = logging.getLogger(__name__)

SEALED_FILE = "keystore.sealed"
KEY_FILE = "keystore.key"
LOCK_FILE = "keystore.lock"

# Header: magic+format version, then the KDF id; for Argon2id also opslimit (u32), memlimit (u64)
# and the salt. The header is not encrypted but is bound to the box key: altering any field derives
# another key, so the SecretBox MAC fails.
_MAGIC = b"ZCKS\x01"
_KDF_KEYFILE = 0
_KDF_ARGON2ID = 1
_ARGON2_PARAMS = struct.Struct(">IQ")
_OPSLIMIT = argon2id.OPSLIMIT_MODERATE
_MEMLIMIT = argon2id.MEMLIMIT_MODERATE
_STATE_VERSION = 1
_TMP_SUFFIX = ".tmp"

_T = TypeVar("_T")


@dataclass(frozen=True)
class KeyInfo:
    """What may be listed about a key pair: never its secret."""

    verkey: str
    purpose: str
    ref: str | None
    created_at: datetime


def _empty_state() -> dict[str, Any]:
    return {"version": _STATE_VERSION, "keys": {}, "secrets": {}, "records": {}}


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRecordError(f"the {what} must be a non-empty string")
    return value


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` so that a crash at any point leaves the old or the new content."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{nacl.utils.random(6).hex()}{_TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _check_private(path: Path, *, what: str, tighten: bool = False) -> None:
    """Refuse a file others can use, since it would let them read or swap our secrets.

    With ``tighten``, a file we own that is merely too open is chmod-ed to 600 instead.
    """
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise InsecurePermissionsError(f"the {what} {path} is not a regular file")
    if st.st_uid != os.getuid():
        raise InsecurePermissionsError(f"the {what} {path} is owned by another user (uid {st.st_uid})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        if tighten:
            os.chmod(path, 0o600)
            return
        raise InsecurePermissionsError(
            f"the {what} {path} has mode {stat.S_IMODE(st.st_mode):o}, so other users could read it "
            "(expected 600)"
        )


def _prepare_directory(directory: Path) -> None:
    if (directory.exists() or directory.is_symlink()) and not directory.is_dir():
        raise KeystoreError(f"the identity path {directory} is not a directory")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError as exc:
        raise KeystoreError(f"cannot create the identity directory {directory}: {exc.strerror}") from exc
    if stat.S_IMODE(st.st_mode) & 0o077:
        if st.st_uid != os.getuid():
            raise InsecurePermissionsError(
                f"the identity directory {directory} has mode {stat.S_IMODE(st.st_mode):o} "
                f"and belongs to another user (uid {st.st_uid})"
            )
        # Ours, only too open (umask, or made by hand): tighten it rather than refuse.
        os.chmod(directory, 0o700)
        log.info("tightened the identity directory %s to mode 700", directory)


class Keystore:
    """A member's sealed key pairs, secrets and records, exclusive to one process."""

    def __init__(self, directory: Path, box: nacl.secret.SecretBox, header: bytes,
                 state: dict[str, Any], lock_fd: int) -> None:
        """Use :meth:`Keystore.open`; this only wires an already unsealed state."""
        self._directory = directory
        self._box = box
        self._header = header
        self._state = state
        self._lock_fd: int | None = lock_fd
        self._mutex = threading.RLock()
        self._pairs: dict[str, KeyPair] = {}

    # --- opening and closing -------------------------------------------------------------------

    @classmethod
    def open(cls, directory: Path | str, passphrase: str | bytes | None = None) -> "Keystore":
        """Open (or create) the keystore of an identity directory and lock it for this process.

        With a passphrase the box key is derived with Argon2id; without, a random key file is used.
        A keystore keeps the sealing it was created with.
        """
        directory = Path(directory).expanduser().absolute()
        secret = cls._passphrase_bytes(passphrase)
        _prepare_directory(directory)
        lock_fd = cls._acquire_lock(directory)
        try:
            cls._remove_stale_temp_files(directory)
            sealed = directory / SEALED_FILE
            if sealed.exists():
                box, header, state = cls._unseal(directory, sealed, secret)
                store = cls(directory, box, header, state, lock_fd)
            else:
                box, header = cls._new_box(directory, secret)
                store = cls(directory, box, header, _empty_state(), lock_fd)
                store._persist(store._state)
                log.info("created a keystore in %s (%s)", directory,
                         "passphrase" if secret is not None else "key file")
            return store
        except BaseException:
            os.close(lock_fd)
            raise

    @staticmethod
    def _passphrase_bytes(passphrase: str | bytes | None) -> bytes | None:
        if passphrase is None:
            return None
        if isinstance(passphrase, str):
            passphrase = passphrase.encode("utf-8")
        if not isinstance(passphrase, (bytes, bytearray)):
            raise KeystoreError("the passphrase must be a str, bytes or None")
        if not passphrase:
            raise KeystoreError("the passphrase is empty; pass None to seal with a key file instead")
        return bytes(passphrase)

    @staticmethod
    def _acquire_lock(directory: Path) -> int:
        path = directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise KeystoreError(f"cannot open the lock file {path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = ""
            try:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                holder = f" (process {pid})" if pid.isdigit() else ""
            except OSError:
                pass
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise AgentAlreadyRunningError(
                    f"the identity directory {directory} is in use by another agent{holder}"
                ) from None
            raise KeystoreError(f"cannot lock {path}: {exc.strerror}") from exc
        try:  # who holds it, for the message above; advisory only
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        return fd

    @staticmethod
    def _remove_stale_temp_files(directory: Path) -> None:
        # We hold the lock, so any temporary file is left over from a crash mid-write.
        for entry in directory.iterdir():
            if entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX):
                try:
                    entry.unlink()
                except OSError:
                    pass

    @staticmethod
    def _read_key_file(directory: Path, *, create: bool) -> bytes:
        path = directory / KEY_FILE
        if not path.exists() and not path.is_symlink():
            if not create:
                raise KeystoreLockedError(f"the key file {path} that seals this keystore is missing")
            key = nacl.utils.random(nacl.secret.SecretBox.KEY_SIZE)
            _write_atomic(path, key)
            return key
        _check_private(path, what="key file")
        key = path.read_bytes()
        if len(key) != nacl.secret.SecretBox.KEY_SIZE:
            raise KeystoreLockedError(f"the key file {path} is damaged (wrong length)")
        return key

    @staticmethod
    def _derive(secret: bytes, salt: bytes, opslimit: int, memlimit: int) -> bytes:
        try:
            return argon2id.kdf(nacl.secret.SecretBox.KEY_SIZE, secret, salt,
                                opslimit=opslimit, memlimit=memlimit)
        except (nacl.exceptions.RuntimeError, MemoryError) as exc:
            raise KeystoreError("deriving the keystore key from the passphrase failed (out of memory?)") from exc

    @classmethod
    def _new_box(cls, directory: Path, secret: bytes | None) -> tuple[nacl.secret.SecretBox, bytes]:
        if secret is None:
            return nacl.secret.SecretBox(cls._read_key_file(directory, create=True)), _MAGIC + bytes([_KDF_KEYFILE])
        salt = nacl.utils.random(argon2id.SALTBYTES)
        header = _MAGIC + bytes([_KDF_ARGON2ID]) + _ARGON2_PARAMS.pack(_OPSLIMIT, _MEMLIMIT) + salt
        return nacl.secret.SecretBox(cls._derive(secret, salt, _OPSLIMIT, _MEMLIMIT)), header

    @classmethod
    def _unseal(cls, directory: Path, sealed: Path,
                secret: bytes | None) -> tuple[nacl.secret.SecretBox, bytes, dict[str, Any]]:
        try:
            _check_private(sealed, what="sealed keystore", tighten=True)
            blob = sealed.read_bytes()
        except OSError as exc:
            raise KeystoreError(f"cannot read {sealed}: {exc.strerror}") from exc
        damaged = f"{sealed} is damaged or not a zerocomm keystore"
        if not blob.startswith(_MAGIC) or len(blob) < len(_MAGIC) + 1:
            raise KeystoreLockedError(damaged)
        kdf = blob[len(_MAGIC)]
        offset = len(_MAGIC) + 1
        if kdf == _KDF_KEYFILE:
            if secret is not None:
                raise KeystoreLockedError(f"{sealed} is sealed with its key file, not a passphrase; open it without one")
            box = nacl.secret.SecretBox(cls._read_key_file(directory, create=False))
        elif kdf == _KDF_ARGON2ID:
            if secret is None:
                raise KeystoreLockedError(f"{sealed} is sealed with a passphrase; give it to open the keystore")
            end = offset + _ARGON2_PARAMS.size + argon2id.SALTBYTES
            if len(blob) < end:
                raise KeystoreLockedError(damaged)
            opslimit, memlimit = _ARGON2_PARAMS.unpack_from(blob, offset)
            # Bounded, so a tampered header cannot make us burn minutes or gigabytes.
            if not (argon2id.OPSLIMIT_MIN <= opslimit <= argon2id.OPSLIMIT_SENSITIVE
                    and argon2id.MEMLIMIT_MIN <= memlimit <= argon2id.MEMLIMIT_SENSITIVE):
                raise KeystoreLockedError(damaged)
            salt = blob[offset + _ARGON2_PARAMS.size:end]
            box = nacl.secret.SecretBox(cls._derive(secret, salt, opslimit, memlimit))
            offset = end
        else:
            raise KeystoreLockedError(damaged)
        header = blob[:offset]
        try:
            plaintext = box.decrypt(blob[offset:])
        except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, ValueError):
            raise KeystoreLockedError(
                f"cannot unseal {sealed}: wrong passphrase or key file, or the file was altered"
            ) from None
        try:
            state = json.loads(plaintext)
            if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
                raise ValueError("unknown state version")
            for part in ("keys", "secrets", "records"):
                if not isinstance(state.get(part), dict):
                    raise ValueError(f"missing {part}")
        except ValueError:
            raise KeystoreLockedError(f"{sealed} decrypted but its content is not a keystore state") from None
        return box, header, state

    def close(self) -> None:
        """Release the directory for another agent; further use raises KeystoreClosedError."""
        with self._mutex:
            if self._lock_fd is None:
                return
            fd, self._lock_fd = self._lock_fd, None
            self._pairs.clear()
            self._state = _empty_state()
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    @property
    def closed(self) -> bool:
        return self._lock_fd is None

    @property
    def directory(self) -> Path:
        return self._directory

    def __enter__(self) -> "Keystore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._lock_fd is None:
            return f"Keystore(directory={str(self._directory)!r}, closed)"
        return f"Keystore(directory={str(self._directory)!r}, keys={len(self._state['keys'])})"

    __str__ = __repr__

    def __reduce__(self):  # never pickle the unsealed state by accident
        raise TypeError("a Keystore holds secrets and an exclusive lock; it cannot be pickled")

    # --- persistence ---------------------------------------------------------------------------

    def _persist(self, state: dict[str, Any]) -> None:
        plaintext = json.dumps(state, separators=(",", ":"), allow_nan=False).encode("utf-8")
        blob = self._header + bytes(self._box.encrypt(plaintext))
        try:
            _write_atomic(self._directory / SEALED_FILE, blob)
        except OSError as exc:
            raise KeystoreError(f"cannot write the keystore in {self._directory}: {exc.strerror}") from exc

    def _read(self, fn: Callable[[dict[str, Any]], _T]) -> _T:
        with self._mutex:
            if self._lock_fd is None:
                raise KeystoreClosedError("the keystore is closed")
            return fn(self._state)

    def _commit(self, mutate: Callable[[dict[str, Any]], _T]) -> _T:
        """Apply ``mutate`` to a copy, write it durably, then adopt it: a failed write changes nothing."""
        with self._mutex:
            if self._lock_fd is None:
                raise KeystoreClosedError("the keystore is closed")
            new_state = copy.deepcopy(self._state)
            result = mutate(new_state)
            self._persist(new_state)
            self._state = new_state
            return result

    # --- key pairs -----------------------------------------------------------------------------

    def create_key(self, purpose: str, ref: str | None = None) -> KeyPair:
        """A fresh key pair (one per relationship or invitation), on disk before it is handed out."""
        _check_name("key purpose", purpose)
        if ref is not None:
            _check_name("key ref", ref)
        pair = KeyPair.generate()
        entry = {
            "seed": base64.b64encode(pair.seed).decode("ascii"),
            "purpose": purpose,
            "ref": ref,
            "created_at": datetime.now(timezone.utc).isoformat(),
        }

        def add(state: dict[str, Any]) -> None:
            state["keys"][pair.verkey] = entry

        with self._mutex:
            self._commit(add)
            self._pairs[pair.verkey] = pair
        return pair

    def find(self, verkey: str) -> KeyPair | None:
        """The key pair for ``verkey`` or None: for callers that expect foreign keys (unpack lookup)."""

        def lookup(state: dict[str, Any]) -> KeyPair | None:
            pair = self._pairs.get(verkey)
            if pair is None:
                entry = state["keys"].get(verkey)
                if entry is None:
                    return None
                pair = KeyPair(base64.b64decode(entry["seed"]))
                self._pairs[verkey] = pair
            return pair

        return self._read(lookup)

    def get(self, verkey: str) -> KeyPair:
        pair = self.find(verkey)
        if pair is None:
            raise KeyNotFoundError(f"no key pair for verkey {verkey}")
        return pair

    def keys(self, purpose: str | None = None) -> list[KeyInfo]:
        """Public facts about the key pairs, oldest first, optionally of one purpose."""

        def listing(state: dict[str, Any]) -> list[KeyInfo]:
            return [
                KeyInfo(verkey, entry["purpose"], entry["ref"], datetime.fromisoformat(entry["created_at"]))
                for verkey, entry in state["keys"].items()
                if purpose is None or entry["purpose"] == purpose
            ]

        return self._read(listing)

    def delete_key(self, verkey: str) -> None:
        """Forget a key pair for good (a relationship ended); raises KeyNotFoundError if unknown."""

        def remove(state: dict[str, Any]) -> None:
            if state["keys"].pop(verkey, None) is None:
                raise KeyNotFoundError(f"no key pair for verkey {verkey}")

        with self._mutex:
            self._commit(remove)
            self._pairs.pop(verkey, None)

    # --- secrets -------------------------------------------------------------------------------

    def put_secret(self, name: str, value: bytes) -> None:
        """Keep a named secret (e.g. a group key) sealed with the key pairs."""
        _check_name("secret name", name)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidRecordError("a secret value must be bytes")
        encoded = base64.b64encode(bytes(value)).decode("ascii")

        def put(state: dict[str, Any]) -> None:
            state["secrets"][name] = encoded

        self._commit(put)

    def get_secret(self, name: str) -> bytes | None:
        def get(state: dict[str, Any]) -> bytes | None:
            encoded = state["secrets"].get(name)
            return None if encoded is None else base64.b64decode(encoded)

        return self._read(get)

    def delete_secret(self, name: str) -> bool:
        """Forget a named secret; False if there was none."""

        if self._read(lambda state: name not in state["secrets"]):
            return False
        return self._commit(lambda state: state["secrets"].pop(name, None) is not None)

    # --- records -------------------------------------------------------------------------------

    def put_record(self, kind: str, record_id: str, record: dict[str, Any]) -> None:
        """Store (or replace) a JSON record, e.g. a connection, under ``kind`` and ``record_id``."""
        _check_name("record kind", kind)
        _check_name("record id", record_id)
        if not isinstance(record, dict):
            raise InvalidRecordError(f"a {kind} record must be a dict, not {type(record).__name__}")
        try:
            # Round trip: stores exactly what a restart would read back, detached from the caller.
            stored = json.loads(json.dumps(record, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise InvalidRecordError(f"the {kind} record {record_id!r} is not JSON-serializable") from exc

        def put(state: dict[str, Any]) -> None:
            state["records"].setdefault(kind, {})[record_id] = stored

        self._commit(put)

    def get_record(self, kind: str, record_id: str) -> dict[str, Any] | None:
        def get(state: dict[str, Any]) -> dict[str, Any] | None:
            record = state["records"].get(kind, {}).get(record_id)
            return None if record is None else copy.deepcopy(record)

        return self._read(get)

    def records(self, kind: str) -> list[dict[str, Any]]:
        """All records of one kind, in the order they were first stored."""
        return self._read(lambda state: copy.deepcopy(list(state["records"].get(kind, {}).values())))

    def delete_record(self, kind: str, record_id: str) -> bool:
        """Remove a record; False if there was none (deleting twice is not an error)."""
        if self._read(lambda state: record_id not in state["records"].get(kind, {})):
            return False

        def remove(state: dict[str, Any]) -> bool:
            records = state["records"].get(kind, {})
            found = records.pop(record_id, None) is not None
            if not records:
                state["records"].pop(kind, None)
            return found

        return self._commit(remove)
