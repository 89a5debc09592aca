"""The journal directory's small files: the lock, the key check and the commit point.

``journal.lock``   flock held by the one Journal that writes the directory (pid inside, advisory).
``journal.meta``   a sealed known string: a wrong key fails here, at open, with a clear error, instead
                   of every record later looking corrupt.
``commit.offset``  the consumer's commit point (magic, u64, crc32), replaced atomically and fsynced.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

from zerocomm_spark.errors import JournalError, JournalKeyError, JournalLockedError
from zerocomm_spark.journal import crypto


def _libc(name: str, *argtypes: str) -> Callable[..., int] | None:
    """A Linux libc call Python's os module does not have (``argtypes``: ctypes type names), or None
    where there is none: the journal does without it, as each is advisory."""
    try:
        import ctypes

        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (ImportError, OSError, AttributeError):  # pragma: no cover - not Linux (or no glibc symbol)
        return None
    function.argtypes = [getattr(ctypes, t) for t in argtypes]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _libc("sync_file_range", "c_int", "c_int64", "c_int64", "c_uint")
_SYNC_FILE_RANGE_WRITE = 2
_fallocate = _libc("fallocate", "c_int", "c_int", "c_int64", "c_int64")  # os.posix_fallocate has no flags
_FALLOC_FL_KEEP_SIZE = 1

log = logging.getLogger(__name__)

LOCK_FILE = "journal.lock"
META_FILE = "journal.meta"
COMMIT_FILE = "commit.offset"


def os_error_fix(exc: OSError) -> str:
    """What to change before the journal can write again, by the error's errno: a roll that failed for
    want of file descriptors used to be met with "check permissions and free space", and the user
    checked the disk. A sentence in the imperative, without a final stop (callers add what follows)."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        system = (" (the whole system's file table is full, ENFILE: also close files elsewhere or raise "
                  "fs.file-max)") if exc.errno == errno.ENFILE else ""
        return ("The process ran out of file descriptors" + system + ": raise its open-file limit (`ulimit -n` "
                "in the shell that starts it, LimitNOFILE= in its systemd unit; `zerocomm agent status` shows the "
                "agent's `fds`, open of limit)")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ("Free space on the journal's file system (or raise the user's quota there), or keep less "
                "(journal.retention_bytes, journal.retention_age)")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "Check the journal directory's permissions: the user running it must create and write files there"
    return f"Fix what the OS reported ({exc.strerror or exc})"


_META_MAGIC = b"ZCJM\x01"
_META_TEXT = b"zerocomm-spark journal key check"
_COMMIT = struct.Struct("<5sQI")
_COMMIT_MAGIC = b"ZCJC\x01"


def write_atomic(path: Path, data: bytes, *, fsync: bool) -> None:
    """Replace ``path`` by ``data`` so that a crash leaves the old or the new file, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the disk, without
    waiting for it (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the next fdatasync
    finds little left to write. Advisory: False where unsupported or refused (the fdatasync that
    follows reports real I/O errors); it makes nothing durable by itself."""
    if _sync_file_range is None or nbytes <= 0:
        return False
    return _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


def preallocate(fd: int, offset: int, nbytes: int) -> bool:
    """Reserve the disk blocks of ``[offset, offset + nbytes)`` of ``fd`` without changing its size
    (``fallocate(FALLOC_FL_KEEP_SIZE)``), so the appends that fill them allocate nothing: measured on
    ext4, a 280 kB append's write(2) took ~90 us into reserved blocks against ~125 us without. The
    size stays the end of what was written, so readers, recovery and retention see no difference.
    Advisory: False where unsupported or refused (a full disk: the writes then report it)."""
    if _fallocate is None or nbytes <= 0:
        return False
    return _fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0


def release_preallocation(fd: int, size: int) -> None:
    """Give back the blocks :func:`preallocate` reserved past ``size``, the end of what was written
    (truncating to the file's own size frees blocks beyond it). Nothing is cut if the file is not
    exactly ``size`` long: then it holds what the caller does not know of, and recovery decides."""
    try:
        if os.fstat(fd).st_size == size:
            os.ftruncate(fd, size)
    except OSError:  # advisory, like the reservation
        pass


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temp_files(directory: Path) -> None:
    # Called with the lock held, so any temporary file is left over from a crash mid-write.
    for entry in directory.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            try:
                entry.unlink()
            except OSError:
                pass


def acquire_lock(directory: Path) -> int:
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise JournalError(f"cannot open the lock file {path}: {exc.strerror}") from None
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
            raise JournalLockedError(f"the journal {directory} is in use by another Journal{holder}") from None
        raise JournalError(f"cannot lock {path}: {exc.strerror}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return fd


def release_lock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def check_key(directory: Path, key: bytes, *, fsync: bool, probe: Callable[[], bool | None]) -> None:
    """Fail early on a wrong key; create the check on a journal's first open.

    ``probe`` tries the key on an existing record, for a journal whose check file was lost: a new
    check must never be written for a key that does not open the records already there.
    """
    path = directory / META_FILE
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        if probe() is False:
            raise JournalKeyError(f"the key given does not open the records of the journal in {directory}") from None
        write_atomic(path, _META_MAGIC + crypto.seal(_META_TEXT, _META_MAGIC, key), fsync=fsync)
        return
    if not blob.startswith(_META_MAGIC):
        raise JournalError(f"{path} is damaged or not a zerocomm journal")
    if crypto.open_sealed(blob[len(_META_MAGIC):], _META_MAGIC, key) == _META_TEXT:
        return
    # A wrong key, or a check file rotten or cut short: the seal cannot tell which. The records can:
    # a key that opens one is the journal's, so the check is what is damaged, and it is remade.
    opens = probe()
    if opens is True:
        log.warning("journal: the key check %s was damaged; the key opens the records, so it is written again", path)
        write_atomic(path, _META_MAGIC + crypto.seal(_META_TEXT, _META_MAGIC, key), fsync=fsync)
        return
    if opens is None:  # no intact record to try the key on
        raise JournalKeyError(f"the key given does not open the journal in {directory}, or its key check {path} "
                              "is damaged (the journal has no record to try the key on)")
    raise JournalKeyError(f"the key given does not open the journal in {directory}")


def read_commit(directory: Path) -> int:
    try:
        raw = (directory / COMMIT_FILE).read_bytes()
    except FileNotFoundError:
        return 0
    if len(raw) != _COMMIT.size:
        raise JournalError(f"{directory / COMMIT_FILE} is damaged (wrong size)")
    magic, offset, crc = _COMMIT.unpack(raw)
    if magic != _COMMIT_MAGIC or crc != zlib.crc32(raw[:13]) & 0xFFFFFFFF:
        raise JournalError(f"{directory / COMMIT_FILE} is damaged")
    return int(offset)


def write_commit(directory: Path, offset: int) -> None:
    head = _COMMIT_MAGIC + offset.to_bytes(8, "little")
    write_atomic(directory / COMMIT_FILE, head + (zlib.crc32(head) & 0xFFFFFFFF).to_bytes(4, "little"), fsync=True)
