"""Structured logs: one parseable object per line, levels honoured, secrets and payloads never written."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from zerocomm_spark.agent import logging as agent_logging


@pytest.fixture()
def restore_root():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def test_json_lines_with_fields_and_redaction(restore_root: None) -> None:
    stream = io.StringIO()
    agent_logging.configure("info", "json", stream=stream)
    log = logging.getLogger("zerocomm_spark.test")
    agent_logging.event(log, logging.INFO, "published", group="g", count=3, payload=b"secret text",
                        journal_key=b"k" * 32, passphrase="hunter2", client_key="abc")
    log.debug("hidden at info")
    lines = stream.getvalue().strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["msg"] == "published" and record["level"] == "info" and record["group"] == "g"
    assert record["count"] == 3
    for name in ("payload", "journal_key", "passphrase", "client_key"):
        assert record[name] == "[redacted]"
    assert "secret text" not in lines[0] and "hunter2" not in lines[0]


def test_kv_format_and_debug_level(restore_root: None) -> None:
    stream = io.StringIO()
    agent_logging.configure("debug", "kv", stream=stream)
    agent_logging.event(logging.getLogger("x"), logging.DEBUG, "two words", size=12, blob=b"\x00\x01")
    line = stream.getvalue().strip()
    assert 'msg="two words"' in line and "level=debug" in line and "size=12" in line
    assert '"<2 bytes>"' in line  # bytes are never written, only their size


def test_exceptions_are_logged_without_tracebacks(restore_root: None) -> None:
    stream = io.StringIO()
    agent_logging.configure("info", "json", stream=stream)
    try:
        raise ValueError("bad thing")
    except ValueError:
        logging.getLogger("x").exception("failed")
    record = json.loads(stream.getvalue())
    assert record["error"] == "ValueError" and record["error_detail"] == "bad thing"
    assert "Traceback" not in stream.getvalue()


def test_the_log_file_is_never_a_link_or_another_users_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """log.file in a directory others can write (a shared log directory): another user pre-made it as
    a link to a file of the agent's user (~/.bashrc) and the agent appended its lines there (peer
    labels and group names included), or as a file of their own, mode 666, and read every line."""
    import os

    from zerocomm_spark.errors import ConfigurationError

    victim = tmp_path / "bashrc"
    victim.write_text("# mine\n")
    shared = tmp_path / "logs"
    shared.mkdir()
    os.chmod(shared, 0o777)
    link = shared / "agent.log"
    link.symlink_to(victim)
    with pytest.raises(ConfigurationError, match="symbolic link in a directory other users may write"):
        os.close(agent_logging.open_log_file(link))
    assert victim.read_text() == "# mine\n"
    os.chmod(shared, 0o700)  # a link only this user could have made (or /dev/stderr, root's) is followed
    os.close(agent_logging.open_log_file(link))
    os.close(agent_logging.open_log_file(Path("/dev/null")))
    if os.getuid() == 0:
        theirs = tmp_path / "theirs.log"
        theirs.touch(mode=0o666)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ConfigurationError, match="uid 65534"):
            os.close(agent_logging.open_log_file(theirs))
    fd = agent_logging.open_log_file(tmp_path / "mine.log")  # its own file: created 600, as before
    os.close(fd)
    assert (tmp_path / "mine.log").stat().st_mode & 0o777 == 0o600
    os.close(agent_logging.open_log_file(tmp_path / "mine.log"))  # and opened again
