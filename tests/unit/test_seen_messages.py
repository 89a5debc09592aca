"""The handled-messages log: replay protection that survives a restart."""

from __future__ import annotations

from pathlib import Path

from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.seen_messages import SEEN_FILE, SeenMessages


def test_handled_messages_are_refused_after_a_reopen_and_failed_ones_are_not(tmp_path: Path) -> None:
    with Keystore.open(tmp_path / "id") as keystore:
        seen = SeenMessages.open(keystore.directory, keystore, capacity=100)
        done, failed = seen.digest("sender-key", "m-1"), seen.digest("sender-key", "m-2")
        assert seen.claim(done) and not seen.claim(done)  # a second copy while the first is handled
        seen.handled(done)
        assert seen.claim(failed)
        seen.release(failed)  # its handler failed: a corrected re-send must get through
        seen.close()
        again = SeenMessages.open(keystore.directory, keystore, capacity=100)
        assert again.digest("sender-key", "m-1") == done  # the key is kept in the keystore
        assert not again.claim(done)
        assert again.claim(failed)
        assert again.claim(again.digest("other-sender", "m-1"))  # keyed by sender too
        again.close()
    raw = (tmp_path / "id" / SEEN_FILE).read_bytes()
    assert len(raw) == 16 and b"m-1" not in raw and b"sender" not in raw  # names nothing


def test_the_log_keeps_the_newest_entries_and_survives_a_torn_write(tmp_path: Path) -> None:
    path = tmp_path / SEEN_FILE
    seen = SeenMessages(path, b"k" * 32, capacity=10)
    digests = [seen.digest("s", f"m-{i}") for i in range(25)]
    for d in digests:
        assert seen.claim(d)
        seen.handled(d)
    seen.close()
    assert path.stat().st_size < 20 * 16  # rewritten with the newest once it held twice the capacity
    with open(path, "ab") as f:
        f.write(b"\x01" * 7)  # a write cut short by a crash
    again = SeenMessages(path, b"k" * 32, capacity=10)
    assert [again.claim(d) for d in digests[-10:]] == [False] * 10  # the newest 10 are remembered
    assert all(again.claim(d) for d in digests[:10])  # the oldest are forgotten (bounded memory)
    assert path.stat().st_size % 16 == 0
    again.close()


def test_a_rewrite_of_the_log_keeps_out_messages_still_being_handled(tmp_path: Path) -> None:
    """A compaction while a handler runs must not log that message: if the handler then fails, a
    corrected re-send after a restart must still get through."""
    path = tmp_path / SEEN_FILE
    seen = SeenMessages(path, b"k" * 32, capacity=3)
    running = seen.digest("s", "running")
    for i in range(6):  # the 6th handled entry rewrites the log (2 x capacity) while "running" runs
        if i == 5:
            assert seen.claim(running)
        d = seen.digest("s", f"m-{i}")
        assert seen.claim(d)
        seen.handled(d)
    assert path.stat().st_size < 6 * 16  # it was rewritten
    seen.release(running)  # its handler failed
    seen.close()
    again = SeenMessages(path, b"k" * 32, capacity=3)
    assert again.claim(running)
    again.close()


def test_a_failed_rewrite_never_leaves_the_log_writing_into_another_file(tmp_path: Path, monkeypatch) -> None:
    """The rewrite used to close the log, then open it again: if that open failed (EMFILE while
    another thread took the freed slot), the closed descriptor's number stayed in use, and the next
    handled message was appended to whatever file or socket got that number next (a keystore log,
    say, which then fails to open as altered). A rewrite must swap descriptors without a gap."""
    import os

    from zerocomm_spark import seen_messages

    path = tmp_path / SEEN_FILE
    seen = SeenMessages(path, b"k" * 32, capacity=2)
    real_open = os.open

    def no_reopen(file, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(file) == path:
            raise OSError(24, "Too many open files")
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(seen_messages.os, "open", no_reopen)
    digests = [seen.digest("s", f"m-{i}") for i in range(6)]
    for d in digests[:4]:  # the 4th handled entry rewrites the log (2 x capacity)
        assert seen.claim(d)
        seen.handled(d)
    monkeypatch.setattr(seen_messages.os, "open", real_open)
    bystander = tmp_path / "keystore.log"
    fd = os.open(bystander, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # may get a freed number
    try:
        for d in digests[4:]:
            assert seen.claim(d)
            seen.handled(d)
    finally:
        os.close(fd)
        seen.close()
    assert bystander.read_bytes() == b""
    again = SeenMessages(path, b"k" * 32, capacity=2)
    assert [again.claim(d) for d in digests[4:]] == [False, False]  # still remembered across a restart
    again.close()


def test_a_short_append_does_not_shift_every_later_entry(tmp_path: Path, monkeypatch) -> None:
    """write(2) on a full disk may write part of an entry and return its length. The entries are
    read back in 16-byte steps, so a partial one left in the file misreads every entry after it at
    the next open: replay protection lost for all of them, without a word."""
    import os

    from zerocomm_spark import seen_messages

    path = tmp_path / SEEN_FILE
    seen = SeenMessages(path, b"k" * 32, capacity=100)
    real_write = os.write
    short = [True]

    def write_part(fd, data):  # type: ignore[no-untyped-def]
        if short and len(data) == 16:
            short.clear()
            return real_write(fd, bytes(data)[:7])  # the disk filled up mid-entry
        return real_write(fd, data)

    monkeypatch.setattr(seen_messages.os, "write", write_part)
    digests = [seen.digest("s", f"m-{i}") for i in range(4)]
    for d in digests:
        assert seen.claim(d)
        seen.handled(d)
    seen.close()
    again = SeenMessages(path, b"k" * 32, capacity=100)
    assert [again.claim(d) for d in digests[1:]] == [False, False, False]  # the entries after it are intact
    again.close()


def test_a_link_planted_in_place_of_the_log_is_refused_and_never_written_through(tmp_path: Path) -> None:
    """The log was opened without O_NOFOLLOW: a symlink planted at seen-messages.log (or at the
    rewrite's temporary file) sent every handled message's entry into the file it points to."""
    import os

    import pytest

    from zerocomm_spark.errors import KeystoreError

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / SEEN_FILE
    path.symlink_to(victim)
    with pytest.raises(KeystoreError, match="symbolic link"):
        SeenMessages(path, b"k" * 32, capacity=2)
    assert victim.read_bytes() == b"precious"
    path.unlink()

    seen = SeenMessages(path, b"k" * 32, capacity=2)
    path.with_suffix(".tmp").symlink_to(victim)  # where the rewrite writes the compacted log
    digests = [seen.digest("s", f"m-{i}") for i in range(5)]
    for d in digests:  # the 4th handled entry rewrites the log
        assert seen.claim(d)
        seen.handled(d)
    seen.close()
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink() and not path.with_suffix(".tmp").exists()
    again = SeenMessages(path, b"k" * 32, capacity=2)
    assert [again.claim(d) for d in digests[3:]] == [False, False]
    again.close()
    os.remove(path)
    os.mkfifo(path)  # not a link, still not a file to keep entries in
    with pytest.raises(KeystoreError, match="not a regular file"):
        SeenMessages(path, b"k" * 32, capacity=2)


def test_a_log_of_another_user_is_refused(tmp_path: Path) -> None:
    """A seen-messages.log another user made (while the identity directory was open to them, before
    the keystore tightened it) was kept: its owner could empty it at will, and every envelope they
    had captured was accepted again after the next restart (replay)."""
    import os

    import pytest

    from zerocomm_spark.errors import InsecurePermissionsError

    if os.getuid() != 0:
        pytest.skip("making a file of another user needs root")
    path = tmp_path / SEEN_FILE
    path.touch(mode=0o666)
    os.chown(path, 65534, 65534)
    with pytest.raises(InsecurePermissionsError, match="uid 65534"):
        SeenMessages(path, b"k" * 32, capacity=2)
