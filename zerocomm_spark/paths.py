"""Making the directories a file goes in, with the errors a person can act on."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from zerocomm_spark.errors import ZeroCommError

__all__ = ["make_dirs", "not_a_directory", "refuse_shared_directory", "what_is"]


def not_a_directory(path: Path) -> Path | None:
    """The nearest existing component of ``path`` (itself or a parent) that is not a directory, if any."""
    for part in (path, *path.parents):
        if os.path.lexists(part):
            return None if part.is_dir() else part
    return None


def what_is(path: Path) -> str:
    """What is at ``path`` where a directory must be, for an error: "is a file", "is a broken symbolic
    link", "is a FIFO", ... (a dangling symlink or a FIFO called "a file" sent the user looking wrong)."""
    try:
        st = os.lstat(path)
    except OSError:
        return "is not a directory"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link to a directory that does not exist" if not os.path.exists(path) else \
            "is a symbolic link to something that is not a directory"
    kind = ("a file" if stat.S_ISREG(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or
            stat.S_ISBLK(st.st_mode) else None)
    return f"is {kind}, not a directory" if kind else "is not a directory"


def make_dirs(path: Path, mode: int = 0o700) -> None:
    """``path.mkdir(parents=True, exist_ok=True)``, said right when a component is a file: mkdir then
    fails with "File exists", which hides the cause (a file where a directory must be)."""
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = not_a_directory(path)
        if blocker is None:
            raise
        raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)} ({blocker} {what_is(blocker)})",
                                 str(path)) from None


def refuse_shared_directory(what: str, path: Path, st: os.stat_result, error: type[ZeroCommError], hint: str) -> None:
    """Raise ``error`` (with ``hint``) if ``path`` (``what``: "the journal directory", ...) is a shared
    sticky directory (/tmp, /var/tmp, /dev/shm, which an agent run as root owns): the chmod to 700 that
    tightens a directory of ours would drop its sticky bit and lock every other user out of it."""
    if st.st_mode & stat.S_ISVTX:
        raise error(f"{what} {path} is a shared directory (mode {stat.S_IMODE(st.st_mode):o}, sticky, like /tmp): "
                    "making it private (mode 700) would lock every other user out of it", hint=hint)
