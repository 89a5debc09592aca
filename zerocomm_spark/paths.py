"""Making the directories a file goes in, with the errors a person can act on."""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["make_dirs", "not_a_directory"]


def not_a_directory(path: Path) -> Path | None:
    """The nearest existing component of ``path`` (itself or a parent) that is not a directory, if any."""
    for part in (path, *path.parents):
        if os.path.lexists(part):
            return None if part.is_dir() else part
    return None


def make_dirs(path: Path, mode: int = 0o700) -> None:
    """``path.mkdir(parents=True, exist_ok=True)``, said right when a component is a file: mkdir then
    fails with "File exists", which hides the cause (a file where a directory must be)."""
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = not_a_directory(path)
        if blocker is None:
            raise
        raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)} ({blocker} is a file)",
                                 str(path)) from None
