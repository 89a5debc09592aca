"""Structured logs: one parseable object per line, levels honoured, secrets and payloads never written."""

from __future__ import annotations

import io
import json
import logging

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
