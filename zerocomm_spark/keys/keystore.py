"""The sealed keystore: a member's key pairs, secrets and protocol records, encrypted at rest.

Everything a member must keep across restarts (its per-relationship key pairs, connection and
group records) lives in two files, both sealed with a key that comes from the user's passphrase
through Argon2id, or, without a passphrase, from a random key file ``keystore.key`` (mode 0600):

* ``keystore.sealed``, a snapshot: the whole state in one NaCl SecretBox, replaced atomically;
* ``keystore.log``, an append-only log of the changes since that snapshot, one record per change,
  each sealed on its own (XChaCha20-Poly1305 under a key derived from the keystore key, bound to
  the log's random id and the record's sequence number) and framed by its length.

A change is one appended record and one fdatasync before the call returns; changes that arrive
together from several threads share the write and the sync (group commit), and nothing waits for
the disk while holding the lock that readers take. When the log outgrows the snapshot it is
compacted: a new snapshot naming a new log is written and renamed into place, then the new, empty
log. A crash at any point leaves either the old snapshot with its log or the new snapshot with
its (possibly not yet renamed) log; a record cut short by a crash (a torn tail) was never
acknowledged and is dropped at the next open. A record that fails its MAC while a valid one
follows it, a log that belongs to no snapshot of this keystore, or a damaged snapshot is refused
with :class:`KeystoreLockedError`.

A keystore written by the single-file format (state version 1) opens as before and is converted on
open. (A converted keystore cannot be opened by that older code: it refuses the new state version
rather than silently missing the log.)

One identity directory belongs to one running agent: ``open`` takes an exclusive ``flock`` and a
second open, from this process or another, fails with :class:`AgentAlreadyRunningError`. Two agents
writing the same keystore would silently lose each other's keys.
"""

from __future__ import annotations

import base64
import copy
import errno
import fcntl
import hashlib
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

import nacl.bindings
import nacl.exceptions
import nacl.pwhash.argon2id as argon2id
import nacl.secret
import nacl.utils

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
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.paths import make_dirs, refuse_shared_directory, what_is

__all__ = ["KeyInfo", "Keystore"]

log = logging.getLogger(__name__)

SEALED_FILE = "keystore.sealed"
LOG_FILE = "keystore.log"
KEY_FILE = "keystore.key"
LOCK_FILE = "keystore.lock"

# Snapshot header: magic+format version, then the KDF id; for Argon2id also opslimit (u32), memlimit
# (u64) and the salt. The header is not encrypted but is bound to the box key: altering any field
# derives another key, so the SecretBox MAC fails.
_MAGIC = b"ZCKS\x01"
_KDF_KEYFILE = 0
_KDF_ARGON2ID = 1
_ARGON2_PARAMS = struct.Struct(">IQ")
_OPSLIMIT = argon2id.OPSLIMIT_MODERATE
_MEMLIMIT = argon2id.MEMLIMIT_MODERATE
_LEGACY_STATE_VERSION = 1  # the single-file format: no log; converted on open
_STATE_VERSION = 2  # the snapshot names its log ("log") and the log it replaced ("log_prev")
_TMP_SUFFIX = ".tmp"

# Log: magic and the log's random id, then records: u32 length of the sealed part, 24-byte nonce,
# XChaCha20-Poly1305 ciphertext and tag of one JSON change. The associated data is the log id and
# the record's sequence number, so records cannot be moved between logs or reordered unnoticed.
_LOG_MAGIC = b"ZCKL\x01"
_LOG_ID_BYTES = 16
_LOG_HEADER_BYTES = len(_LOG_MAGIC) + _LOG_ID_BYTES
_RECORD_LENGTH = struct.Struct(">I")
_RECORD_NONCE_BYTES = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES
_RECORD_TAG_BYTES = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_ABYTES
_RECORD_MAX_BYTES = 16 << 20
_SEQ = struct.Struct(">Q")
# Compact when the log is larger than this and than twice the snapshot.
_COMPACT_MIN_BYTES = 256 << 10

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


def _sync_data(fd: int) -> None:
    """fdatasync where there is one (it also persists the size an append changed), else fsync."""
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - macOS
        os.fsync(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{nacl.utils.random(6).hex()}{_TMP_SUFFIX}")


def _write_temp(path: Path, data: bytes) -> Path:
    """``data`` in a new private temporary file beside ``path``, on disk; the caller renames it."""
    tmp = _temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` so that a crash at any point leaves the old or the new content."""
    tmp = _write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(path.parent)


def _frames_to_end(data: bytes, start: int) -> list[int]:
    """Positions at or after ``start``, in order, from which length-prefixed log records follow one
    another exactly to the end of ``data``."""
    n = len(data)
    overhead = _RECORD_LENGTH.size + _RECORD_NONCE_BYTES
    reaches = bytearray(n + 1)
    reaches[n] = 1
    for p in range(n - overhead - _RECORD_TAG_BYTES, start - 1, -1):
        (length,) = _RECORD_LENGTH.unpack_from(data, p)
        end = p + overhead + length
        if _RECORD_TAG_BYTES <= length <= _RECORD_MAX_BYTES and end <= n and reaches[end]:
            reaches[p] = 1
    return [p for p in range(max(start, 0), n) if reaches[p]]


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
    # A path that is or goes through a file is a mistake in the path given, not a keystore's trouble.
    if (directory.exists() or directory.is_symlink()) and not directory.is_dir():
        raise IdentityPathError(f"the identity path {directory} {what_is(directory)}")
    try:
        make_dirs(directory)
        st = directory.stat()
    except NotADirectoryError as exc:
        raise IdentityPathError(f"cannot create the identity directory {directory}: {exc.strerror}") from None
    except OSError as exc:
        raise KeystoreError(f"cannot create the identity directory {directory}: {exc.strerror}") from exc
    if st.st_uid != os.getuid():  # whatever its mode: its owner may rename and delete our files there
        raise InsecurePermissionsError(
            f"the identity directory {directory} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
            "its owner could rename, replace or remove the keystore's files there",
            hint=f"Run zerocomm as the directory's owner (uid {st.st_uid}), or give an identity directory of this "
                 "user (identity.dir, --identity-dir)")
    # A shared /tmp: the keystore's files would also sit beside whatever others put there.
    refuse_shared_directory(
        "the identity path", directory, st, IdentityPathError,
        hint=f"Give identity.dir (--identity-dir) a directory of this member's own, such as {directory}/zerocomm; "
             "it is created mode 700")
    if stat.S_IMODE(st.st_mode) & 0o077:
        # Ours, only too open (umask, or made by hand): tighten it rather than refuse.
        os.chmod(directory, 0o700)
        log.info("tightened the identity directory %s to mode 700", directory)


# --- changes: what a log record holds ---------------------------------------------------------
#
# A change is a JSON list: [part, name..., value] sets, [part, name...] (no value) removes.
#   ["k", verkey, entry] / ["k", verkey]        key pairs
#   ["s", name, base64] / ["s", name]           secrets
#   ["r", kind, id, record] / ["r", kind, id]   records (a kind with no record left disappears)


def _path_of(change: list[Any]) -> tuple[str, ...]:
    return tuple(change[:3]) if change[0] == "r" else tuple(change[:2])


def _apply(state: dict[str, Any], change: list[Any]) -> None:
    part = change[0]
    if part == "k" or part == "s":
        table = state["keys" if part == "k" else "secrets"]
        if len(change) == 3:
            table[change[1]] = change[2]
        else:
            table.pop(change[1], None)
    elif part == "r":
        records = state["records"]
        if len(change) == 4:
            records.setdefault(change[1], {})[change[2]] = change[3]
        else:
            kind = records.get(change[1], {})
            kind.pop(change[2], None)
            if not kind:
                records.pop(change[1], None)
    else:
        raise ValueError("unknown change")


def _present(state: dict[str, Any], path: tuple[str, ...]) -> bool:
    if path[0] == "r":
        return path[2] in state["records"].get(path[1], {})
    return path[1] in state["keys" if path[0] == "k" else "secrets"]


def _valid_change(change: object) -> bool:
    if not isinstance(change, list) or not change:
        return False
    part, size = change[0], len(change)
    if part == "r":
        names, value = change[1:3], change[3] if size == 4 else None
        return size in (3, 4) and all(isinstance(x, str) for x in names) and (size == 3 or isinstance(value, dict))
    if part not in ("k", "s") or size not in (2, 3) or not isinstance(change[1], str):
        return False
    return size == 2 or isinstance(change[2], dict if part == "k" else str)


class _Pending:
    """One change waiting for the log: the thread that writes its batch fills in done and error."""

    __slots__ = ("change", "done", "error")

    def __init__(self, change: list[Any]) -> None:
        self.change = change
        self.done = False
        self.error: tuple[type[KeystoreError], str] | None = None  # raised afresh in each waiting thread


@dataclass
class _Sealing:
    """What a keystore is sealed with: the snapshot's SecretBox and header, and the log's key."""

    box: nacl.secret.SecretBox
    header: bytes
    log_key: bytes

    @classmethod
    def from_key(cls, key: bytes, header: bytes) -> "_Sealing":
        log_key = hashlib.blake2b(b"zerocomm keystore log", key=key, digest_size=32, person=b"zc-keystore-log").digest()
        return cls(nacl.secret.SecretBox(key), header, log_key)

    def __repr__(self) -> str:  # never show the keys
        return "_Sealing(...)"


class Keystore:
    """A member's sealed key pairs, secrets and records, exclusive to one process."""

    def __init__(self, directory: Path, sealing: _Sealing, state: dict[str, Any], lock_fd: int) -> None:
        """Use :meth:`Keystore.open`; this only wires an already unsealed state."""
        self._directory = directory
        self._sealing = sealing
        self._state = state  # durable changes only: what readers see
        self._lock_fd: int | None = lock_fd
        self._mutex = threading.RLock()
        self._changed = threading.Condition(self._mutex)
        self._pairs: dict[str, KeyPair] = {}
        # Log (owned by the thread that is writing, or by open/close)
        self._log_fd: int | None = None
        self._log_id = b""
        self._log_seq = 0
        self._log_size = 0
        self._snapshot_size = 0
        # Group commit, under _mutex
        self._queue: list[_Pending] = []
        self._pending_paths: dict[tuple[str, ...], tuple[_Pending, bool]] = {}  # latest queued change per path
        self._writing = False
        self._broken: str | None = None

    # --- opening and closing -------------------------------------------------------------------

    @classmethod
    def check_passphrase(cls, directory: Path | str, passphrase: str | bytes | None = None) -> None:
        """Unseal the keystore's snapshot to check the passphrase (or key file), without the lock:
        for a command that must not take the directory from its running agent but must not accept
        a wrong passphrase either. Raises KeystoreLockedError as open() would; keeps nothing."""
        directory = Path(directory).expanduser().absolute()
        cls._unseal(directory, directory / SEALED_FILE, cls._passphrase_bytes(passphrase))

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
        store: Keystore | None = None
        try:
            cls._remove_stale_temp_files(directory)
            sealed = directory / SEALED_FILE
            try:
                if sealed.exists():
                    sealing, state, log_ids, snapshot_size = cls._unseal(directory, sealed, secret)
                    store = cls(directory, sealing, state, lock_fd)
                    store._snapshot_size = snapshot_size
                    if log_ids is None:
                        log.info("converting the keystore in %s to a snapshot and a log", directory)
                        store._compact(previous=None)
                    else:
                        store._open_log(*log_ids)
                else:
                    cls._refuse_orphan_log(directory, sealed)
                    store = cls(directory, cls._new_sealing(directory, secret), _empty_state(), lock_fd)
                    store._compact(previous=None)
                    log.info("created a keystore in %s (%s)", directory,
                             "passphrase" if secret is not None else "key file")
            except OSError as exc:
                raise KeystoreError(f"cannot open the keystore in {directory}: {exc.strerror}") from exc
            return store
        except BaseException:
            if store is not None and store._log_fd is not None:
                os.close(store._log_fd)
            os.close(lock_fd)
            raise

    @staticmethod
    def _refuse_orphan_log(directory: Path, sealed: Path) -> None:
        """No snapshot: a new keystore, unless a log holds changes. A new keystore puts its empty log in
        place before the snapshot, so a crash between leaves a log with no change; one with changes
        belongs to a snapshot that was lost, and creating a keystore would replace it (and with it
        every key pair, secret and record it holds) by a new empty log."""
        path = directory / LOG_FILE
        try:
            st = path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size > _LOG_HEADER_BYTES:
            raise KeystoreLockedError(
                f"the keystore snapshot {sealed} is missing, but the log {path} holds changes of a keystore",
                hint=f"Put back {sealed.name} from a backup of this identity directory; to start a new identity "
                     "instead, move the directory's keystore files away first")

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
                _unlink_quietly(entry)

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
    def _new_sealing(cls, directory: Path, secret: bytes | None) -> _Sealing:
        if secret is None:
            return _Sealing.from_key(cls._read_key_file(directory, create=True), _MAGIC + bytes([_KDF_KEYFILE]))
        salt = nacl.utils.random(argon2id.SALTBYTES)
        header = _MAGIC + bytes([_KDF_ARGON2ID]) + _ARGON2_PARAMS.pack(_OPSLIMIT, _MEMLIMIT) + salt
        return _Sealing.from_key(cls._derive(secret, salt, _OPSLIMIT, _MEMLIMIT), header)

    @classmethod
    def _unseal(
        cls, directory: Path, sealed: Path, secret: bytes | None
    ) -> tuple[_Sealing, dict[str, Any], tuple[bytes, bytes | None] | None, int]:
        """The snapshot: its sealing, state, (log id, previous log id) (None: single-file format) and size."""
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
            key = cls._read_key_file(directory, create=False)
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
            key = cls._derive(secret, salt, opslimit, memlimit)
            offset = end
        else:
            raise KeystoreLockedError(damaged)
        sealing = _Sealing.from_key(key, blob[:offset])
        try:
            plaintext = sealing.box.decrypt(blob[offset:])
        except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, ValueError):
            raise KeystoreLockedError(
                f"cannot unseal {sealed}: wrong passphrase or key file, or the file was altered"
            ) from None
        try:
            state = json.loads(plaintext)
            if not isinstance(state, dict) or state.get("version") not in (_LEGACY_STATE_VERSION, _STATE_VERSION):
                raise ValueError("unknown state version")
            for part in ("keys", "secrets", "records"):
                if not isinstance(state.get(part), dict):
                    raise ValueError(f"missing {part}")
            log_ids = None
            if state["version"] == _STATE_VERSION:
                previous = state.pop("log_prev", None)
                log_ids = (bytes.fromhex(state.pop("log")), None if previous is None else bytes.fromhex(previous))
                if len(log_ids[0]) != _LOG_ID_BYTES:
                    raise ValueError("bad log id")
            state["version"] = _STATE_VERSION
        except (ValueError, TypeError, KeyError):
            raise KeystoreLockedError(f"{sealed} decrypted but its content is not a keystore state") from None
        return sealing, state, log_ids, len(blob)

    def close(self) -> None:
        """Release the directory for another agent; further use raises KeystoreClosedError."""
        with self._changed:
            while self._writing:  # let a write in flight finish: its callers are told how it went
                self._changed.wait()
            if self._lock_fd is None:
                return
            fd, self._lock_fd = self._lock_fd, None
            self._fail_queue((KeystoreClosedError, "the keystore was closed before the change was written"))
            self._pairs.clear()
            self._state = _empty_state()
            try:
                if self._log_fd is not None:
                    os.close(self._log_fd)
                    self._log_fd = None
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

    # --- the log -------------------------------------------------------------------------------

    def _aad(self, seq: int) -> bytes:
        return self._log_id + _SEQ.pack(seq)

    def _seal_change(self, seq: int, change: list[Any]) -> bytes:
        plaintext = json.dumps(change, separators=(",", ":"), allow_nan=False).encode("utf-8")
        nonce = nacl.utils.random(_RECORD_NONCE_BYTES)
        sealed = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_encrypt(
            plaintext, self._aad(seq), nonce, self._sealing.log_key
        )
        return _RECORD_LENGTH.pack(len(sealed)) + nonce + sealed

    def _open_change(self, data: bytes, offset: int, seq: int) -> tuple[list[Any], int] | None:
        """The change recorded at ``offset`` and the offset after it; None if it is cut short or fails its MAC."""
        if offset + _RECORD_LENGTH.size > len(data):
            return None
        (length,) = _RECORD_LENGTH.unpack_from(data, offset)
        start = offset + _RECORD_LENGTH.size + _RECORD_NONCE_BYTES
        end = start + length
        if not _RECORD_TAG_BYTES <= length <= _RECORD_MAX_BYTES or end > len(data):
            return None
        try:
            plaintext = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_decrypt(
                data[start:end], self._aad(seq), data[start - _RECORD_NONCE_BYTES : start], self._sealing.log_key
            )
        except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
            return None
        try:
            change = json.loads(plaintext)
        except ValueError:
            change = None
        if not _valid_change(change):
            raise KeystoreLockedError(f"{self._directory / LOG_FILE} holds an authentic record that is not a change")
        return change, end

    def _verifies_after(self, data: bytes, offset: int, seq: int) -> bool:
        """Whether the record at ``offset``, which failed as record ``seq``, or any after it is authentic.

        A crash leaves a tail that never authenticates; an authentic record there, under any
        nearby sequence number, means records were altered, dropped or reordered.
        """
        frames = []
        damaged_at = offset
        while offset + _RECORD_LENGTH.size <= len(data) and len(frames) < 64:
            (length,) = _RECORD_LENGTH.unpack_from(data, offset)
            if not _RECORD_TAG_BYTES <= length <= _RECORD_MAX_BYTES:
                break
            frames.append(offset)
            offset += _RECORD_LENGTH.size + _RECORD_NONCE_BYTES + length
        for candidate in range(seq, seq + len(frames) + 64):
            if any(self._open_change(data, frame, candidate) is not None for frame in frames):
                return True
        # A rotten length prefix breaks the framing from ``offset`` on, so the walk above misses the
        # records after it. Honest records after the damage still frame the rest of the log exactly to
        # its end: try the positions from which a chain of frames reaches it (a crash's tail has none
        # that authenticates).
        for frame in _frames_to_end(data, damaged_at + 1)[:64]:
            for candidate in range(seq + 1, seq + 66):
                if self._open_change(data, frame, candidate) is not None:
                    return True
        return False

    def _open_log(self, log_id: bytes, previous: bytes | None) -> None:
        """Replay the snapshot's log onto the state, dropping a torn tail; refuse a foreign or altered log."""
        path = self._directory / LOG_FILE
        if not path.exists() and not path.is_symlink():
            raise KeystoreLockedError(f"the keystore log {path} is missing (the snapshot names one)")
        _check_private(path, what="keystore log", tighten=True)
        data = path.read_bytes()
        if not data.startswith(_LOG_MAGIC) or len(data) < _LOG_HEADER_BYTES:
            raise KeystoreLockedError(f"{path} is damaged or not a zerocomm keystore log")
        found = data[len(_LOG_MAGIC) : _LOG_HEADER_BYTES]
        if found != log_id:
            if previous is not None and found == previous:
                # A crash during compaction, after the new snapshot: everything in this log is in it.
                log.info("replacing the keystore log %s that the snapshot already holds", path)
                self._log_id = log_id
                self._create_log()
                return
            raise KeystoreLockedError(f"{path} does not belong to this keystore's snapshot (replaced or altered)")
        self._log_id = log_id
        offset, seq = _LOG_HEADER_BYTES, 0
        while offset < len(data):
            opened = self._open_change(data, offset, seq)
            if opened is None:
                if self._verifies_after(data, offset, seq):
                    raise KeystoreLockedError(f"{path} was altered: record {seq} fails to authenticate")
                log.warning("dropping a torn tail of %d bytes from %s (a write cut short)", len(data) - offset, path)
                break
            change, offset = opened
            _apply(self._state, change)
            seq += 1
        self._log_seq, self._log_size = seq, offset
        self._log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        if offset < len(data):
            os.ftruncate(self._log_fd, offset)
            _sync_data(self._log_fd)
        if self._log_size > max(_COMPACT_MIN_BYTES, 2 * self._snapshot_size):
            self._compact(previous=self._log_id)

    def _create_log(self) -> None:
        """A new, empty log with the current id, atomically in place."""
        _write_atomic(self._directory / LOG_FILE, _LOG_MAGIC + self._log_id)
        self._log_fd = os.open(self._directory / LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._log_seq, self._log_size = 0, _LOG_HEADER_BYTES

    def _compact(self, *, previous: bytes | None) -> None:
        """Write the state as a new snapshot naming a new, empty log, and put that log in place.

        Runs with no other write in flight (at open, or by the thread that is writing). With no
        ``previous`` log (a new or converted keystore) the empty log goes first: until the snapshot
        names it, nothing reads it. Otherwise the snapshot goes first: a crash before its rename
        leaves the old snapshot and log; after it, the old log is the new snapshot's "log_prev",
        which open recognises and replaces. A failure before that rename changes nothing; after
        it, the keystore refuses writes until it is opened again, since the old log is no longer
        the snapshot's.
        """
        new_id = nacl.utils.random(_LOG_ID_BYTES)
        with self._mutex:
            state = dict(self._state, log=new_id.hex(), log_prev=None if previous is None else previous.hex())
            plaintext = json.dumps(state, separators=(",", ":"), allow_nan=False).encode("utf-8")
        blob = self._sealing.header + bytes(self._sealing.box.encrypt(plaintext))
        log_path = self._directory / LOG_FILE
        if previous is None:
            _write_atomic(log_path, _LOG_MAGIC + new_id)
            _write_atomic(self._directory / SEALED_FILE, blob)
        else:
            new_log = _write_temp(log_path, _LOG_MAGIC + new_id)
            try:
                new_snapshot = _write_temp(self._directory / SEALED_FILE, blob)
                try:
                    os.replace(new_snapshot, self._directory / SEALED_FILE)
                except BaseException:
                    _unlink_quietly(new_snapshot)
                    raise
            except BaseException:
                _unlink_quietly(new_log)
                raise
            try:
                os.replace(new_log, log_path)
                _fsync_dir(self._directory)
            except OSError as exc:
                self._broken = exc.strerror or str(exc)
                raise
        try:
            new_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            self._broken = exc.strerror or str(exc)
            raise
        old_fd, self._log_fd = self._log_fd, new_fd
        if old_fd is not None:
            os.close(old_fd)
        self._log_id, self._log_seq, self._log_size = new_id, 0, _LOG_HEADER_BYTES
        self._snapshot_size = len(blob)

    def _append(self, batch: list[_Pending]) -> None:
        """Seal and append a batch of changes, then sync: one write, one fdatasync (the thread writing)."""
        assert self._log_fd is not None
        seq = self._log_seq
        frames = []
        for pending in batch:
            frames.append(self._seal_change(seq, pending.change))
            seq += 1
        data = b"".join(frames)
        try:
            _write_all(self._log_fd, data)
            _sync_data(self._log_fd)
        except BaseException:
            try:  # take back whatever part reached the file: a failed change must not reappear on open
                os.ftruncate(self._log_fd, self._log_size)
                _sync_data(self._log_fd)
            except OSError as exc:
                self._broken = exc.strerror or str(exc)
            raise
        self._log_seq, self._log_size = seq, self._log_size + len(data)

    # --- reading and changing ------------------------------------------------------------------

    def _read(self, fn: Callable[[dict[str, Any]], _T]) -> _T:
        with self._mutex:
            if self._lock_fd is None:
                raise KeystoreClosedError("the keystore is closed")
            return fn(self._state)

    def _exists(self, path: tuple[str, ...]) -> bool:
        """Whether ``path`` is set once every queued change is written (under _mutex)."""
        queued = self._pending_paths.get(path)
        return queued[1] if queued is not None else _present(self._state, path)

    def _change(self, build: Callable[[], tuple[list[Any] | None, _T]]) -> _T:
        """Queue the change ``build`` returns (None: nothing to change) and return once it is on disk.

        ``build`` runs under the lock and checks the change against the state with every queued
        change applied. The first thread to find no write in flight takes the whole queue, writes
        and syncs it without the lock, then applies it to the state readers see; the others wait.
        A failed write fails its whole batch and everything queued behind it, which was checked
        against it: none of them changes anything, in memory or on disk.
        """
        with self._changed:
            if self._lock_fd is None:
                raise KeystoreClosedError("the keystore is closed")
            if self._broken is not None:
                raise KeystoreError(f"an earlier write to the keystore in {self._directory} failed "
                                    f"({self._broken}); close and open it again")
            change, result = build()
            if change is None:
                return result
            pending = _Pending(change)
            self._queue.append(pending)
            self._pending_paths[_path_of(change)] = (pending, len(change) > len(_path_of(change)))
            while not pending.done and self._writing:
                self._changed.wait()
            if pending.done:
                if pending.error is not None:
                    raise pending.error[0](pending.error[1])
                return result
            batch, self._queue = self._queue, []
            self._writing = True
        compact = False
        try:
            try:
                self._append(batch)
            except BaseException as exc:
                reason = exc.strerror if isinstance(exc, OSError) else type(exc).__name__
                error = (KeystoreError, f"cannot write the keystore in {self._directory}: {reason}")
                with self._changed:
                    for queued in batch:
                        queued.done, queued.error = True, error
                    self._fail_queue(error)
                if isinstance(exc, OSError):
                    raise error[0](error[1]) from exc
                raise
            with self._changed:
                for queued in batch:
                    _apply(self._state, queued.change)
                    path = _path_of(queued.change)
                    if self._pending_paths.get(path, (None,))[0] is queued:
                        del self._pending_paths[path]
                    queued.done = True
                self._changed.notify_all()  # the batch is done; compaction, if due, need not hold it up
                compact = self._log_size > max(_COMPACT_MIN_BYTES, 2 * self._snapshot_size)
            if compact:
                try:
                    self._compact(previous=self._log_id)
                except OSError as exc:  # before the snapshot's rename the log stays valid: tried again later
                    log.warning("compacting the keystore in %s failed: %s", self._directory, exc.strerror)
        finally:
            with self._changed:
                self._writing = False
                self._changed.notify_all()
        return result

    def _fail_queue(self, error: tuple[type[KeystoreError], str]) -> None:
        """Fail every queued change (under _mutex): they were checked against changes that will not happen."""
        for queued in self._queue:
            queued.done, queued.error = True, error
        self._queue = []
        self._pending_paths.clear()
        self._changed.notify_all()

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
        def add() -> tuple[list[Any], None]:
            self._pairs[pair.verkey] = pair  # find() hands it out only once the key is in the state
            return ["k", pair.verkey, entry], None

        try:
            self._change(add)
        except BaseException:
            with self._mutex:
                self._pairs.pop(pair.verkey, None)
            raise
        return pair

    def find(self, verkey: str) -> KeyPair | None:
        """The key pair for ``verkey`` or None: for callers that expect foreign keys (unpack lookup)."""
        with self._mutex:
            if self._lock_fd is None:
                raise KeystoreClosedError("the keystore is closed")
            entry = self._state["keys"].get(verkey)
            if entry is None:
                return None
            pair = self._pairs.get(verkey)
            if pair is None:
                pair = self._pairs[verkey] = KeyPair(base64.b64decode(entry["seed"]))
            return pair

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

        def remove() -> tuple[list[Any], None]:
            if not self._exists(("k", verkey)):
                raise KeyNotFoundError(f"no key pair for verkey {verkey}")
            return ["k", verkey], None

        self._change(remove)
        with self._mutex:
            if verkey not in self._state["keys"]:
                self._pairs.pop(verkey, None)

    # --- secrets -------------------------------------------------------------------------------

    def put_secret(self, name: str, value: bytes) -> None:
        """Keep a named secret (e.g. a group key) sealed with the key pairs."""
        _check_name("secret name", name)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidRecordError("a secret value must be bytes")
        encoded = base64.b64encode(bytes(value)).decode("ascii")
        self._change(lambda: (["s", name, encoded], None))

    def get_secret(self, name: str) -> bytes | None:
        def get(state: dict[str, Any]) -> bytes | None:
            encoded = state["secrets"].get(name)
            return None if encoded is None else base64.b64decode(encoded)

        return self._read(get)

    def delete_secret(self, name: str) -> bool:
        """Forget a named secret; False if there was none."""
        return self._change(lambda: (["s", name], True) if self._exists(("s", name)) else (None, False))

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
        self._change(lambda: (["r", kind, record_id, stored], None))

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
        return self._change(
            lambda: (["r", kind, record_id], True) if self._exists(("r", kind, record_id)) else (None, False)
        )
