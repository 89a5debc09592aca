"""What a path error says when something other than a directory is in the way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zerocomm_spark.paths import make_dirs


@pytest.mark.parametrize("make, said", [
    (lambda p: p.write_text("x"), "is a file, not a directory"),
    (lambda p: os.symlink(p.parent / "nowhere", p), "is a symbolic link to a directory that does not exist"),
    (lambda p: os.mkfifo(p), "is a FIFO, not a directory"),
])
def test_what_is_in_the_way_of_a_directory_is_named_as_what_it_is(tmp_path: Path, make, said: str) -> None:
    """mkdir's "File exists" hid the cause; then a dangling symlink or a FIFO was called "a file"."""
    blocker = tmp_path / "in-the-way"
    make(blocker)
    with pytest.raises(NotADirectoryError) as info:
        make_dirs(blocker / "sub" / "dir")
    assert info.value.strerror == f"Not a directory ({blocker} {said})"


def test_directories_are_made_private_and_an_existing_one_is_fine(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    make_dirs(target)
    make_dirs(target)
    assert target.is_dir() and (target.stat().st_mode & 0o777) == 0o700
