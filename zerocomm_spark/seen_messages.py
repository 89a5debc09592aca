"""Which inbound DIDComm messages this agent has handled, kept across restarts: replay protection.

Why on disk: DIDComm v1 envelopes carry no time or counter, so a captured envelope stays valid; an
in-memory set of handled (sender, message id) pairs refuses it only until the process restarts.
Each handled message appends a 16-byte keyed hash (BLAKE2b under a key sealed in the keystore) to
``seen-messages.log`` in the identity directory: the file names no sender, id or content, and the
last ``capacity`` entries are loaded at open. An entry is written once the handler succeeded (a
message that failed may be re-sent corrected), with ``write(2)``: it survives a kill -9; a power
loss can cost the last entries, which reopens replay for those few messages only.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import stat
import threading
from collections import OrderedDict
from pathlib import Path

from zerocomm_spark.errors import InsecurePermissionsError, KeystoreError
from zerocomm_spark.keys.keystore import Keystore

__all__ = ["SeenMessages", "SEEN_FILE"]

log = logging.getLogger(__name__)

SEEN_FILE = "seen-messages.log"
_KEY_NAME = "seen-messages-key"
_DIGEST = 16


class SeenMessages:
    """A bounded set of handled messages: the newest ``capacity`` in memory, and in a log that is
    rewritten with only those once it holds twice as many."""

    def __init__(self, path: Path | None, key: bytes, capacity: int) -> None:
        """``path`` None: memory only (an agent without an identity directory of its own)."""
        self._path = path
        self._key = key
        self._capacity = capacity
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # handled (and logged)
        self._pending: set[bytes] = set()  # being handled now: refused meanwhile, not logged yet
        self._logged = 0  # entries in the log file
        self._fd = -1
        if path is not None:
            self._fd = _open_private(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
            try:
                self._load(path)
            except BaseException:
                os.close(self._fd)
                self._fd = -1
                raise

    @classmethod
    def open(cls, directory: Path, keystore: Keystore, capacity: int) -> "SeenMessages":
        key = keystore.get_secret(_KEY_NAME)
        if key is None:
            key = secrets.token_bytes(32)
            keystore.put_secret(_KEY_NAME, key)
        return cls(directory / SEEN_FILE, key, capacity)

    def _load(self, path: Path) -> None:
        """Read the log through the descriptor just opened (never by name again: no second lookup
        that a link planted meanwhile could redirect)."""
        chunks = []
        offset = 0
        while True:
            chunk = os.pread(self._fd, 1 << 20, offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        raw = b"".join(chunks)
        whole = len(raw) - len(raw) % _DIGEST  # a torn last entry (a crash mid-write) is dropped
        entries = [raw[i:i + _DIGEST] for i in range(0, whole, _DIGEST)]
        for digest in entries[-self._capacity:]:
            self._seen[digest] = None
        self._logged = len(entries)
        if whole != len(raw):
            os.ftruncate(self._fd, whole)

    def digest(self, sender: str, message_id: str) -> bytes:
        return hashlib.blake2b(f"{sender}\0{message_id}".encode("utf-8", "surrogatepass"), key=self._key,
                               digest_size=_DIGEST).digest()

    def claim(self, digest: bytes) -> bool:
        """Mark the message as being handled; False if it was handled (or is being handled) already."""
        with self._lock:
            if digest in self._seen or digest in self._pending:
                return False
            self._pending.add(digest)
            return True

    def release(self, digest: bytes) -> None:
        """The handler failed: a corrected re-send with the same id must get through."""
        with self._lock:
            self._pending.discard(digest)

    def handled(self, digest: bytes) -> None:
        """The handler succeeded: remember the message across restarts."""
        with self._lock:
            self._pending.discard(digest)
            self._seen[digest] = None
            while len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
            if self._fd < 0:
                return
            try:
                if os.write(self._fd, digest) != _DIGEST:  # a full disk: take the part back, or every
                    os.ftruncate(self._fd, self._logged * _DIGEST)  # later entry is misread at open
                    raise OSError(errno.ENOSPC, "the entry was cut short")
                self._logged += 1
                if self._logged >= 2 * self._capacity:
                    self._compact()
            except OSError as exc:  # replay protection degrades to memory; handling goes on
                log.warning("cannot record a handled message in %s: %s", self._path, exc.strerror)

    def _compact(self) -> None:
        """Rewrite the log with the handled entries in memory (under the lock; messages still being
        handled are not among them), replacing it atomically.

        The new file's descriptor becomes the log's: no open after the rename can fail and leave
        the closed descriptor's number in use (the next entry would go to whoever reused it)."""
        assert self._path is not None
        tmp = self._path.with_suffix(".tmp")
        try:  # a leftover of a crash mid-rewrite, or a planted link: removed, never written through
            tmp.unlink()
        except FileNotFoundError:
            pass
        # O_EXCL: a link made between the unlink and here fails the rewrite (an OSError: the caller
        # keeps the old log), it is never followed.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(b"".join(self._seen))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.replace(tmp, self._path)
        except BaseException:
            os.close(fd)
            raise
        old, self._fd = self._fd, fd
        os.close(old)
        self._logged = len(self._seen)

    def __len__(self) -> int:
        return len(self._seen)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _open_private(path: Path, flags: int) -> int:
    """Open a file of the identity directory as the keystore and journal open theirs: O_NOFOLLOW (a
    link planted in the directory must not redirect the writes), and only a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KeystoreError(
                f"{path} is a symbolic link; the agent follows no link in its identity directory (one planted "
                "there would redirect its writes)",
                hint="Remove the link (the agent then starts a new log: messages handled before may be accepted "
                     "once more), and check who else can write the identity directory") from None
        raise KeystoreError(f"cannot open {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise KeystoreError(f"{path} is not a regular file",
                            hint="Remove it (the agent then starts a new log), and check who else can write the "
                                 "identity directory")
    if st.st_uid != os.getuid():  # its owner could empty it at will: every captured envelope replayable
        os.close(fd)
        raise InsecurePermissionsError(f"{path} belongs to another user (uid {st.st_uid})",
                                       hint="Remove it (the agent then starts a new log), and check who else can "
                                            "write the identity directory")
    return fd
