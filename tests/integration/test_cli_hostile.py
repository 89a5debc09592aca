"""Hostile command lines: undecodable bytes, absurd numbers, odd paths. Each must end in one
`zerocomm: error:` (or one JSON error object under --json) with a documented exit code, never a
traceback and never a hang, whether an agent runs or not."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli_support import ZEROCOMM, Member

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Member, Member]]:
    """One member with its agent running and one without (same code paths, both answers)."""
    root = tmp_path_factory.mktemp("hostile")
    up, down = Member(root, "up"), Member(root, "down")
    up.init()
    down.init()
    up.start()
    up.ok("group", "create", "g")
    try:
        yield up, down
    finally:
        up.stop()


def raw(*args: str | bytes, stdin: bytes = b"", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run zerocomm with argv given as bytes where a str cannot say it (invalid UTF-8)."""
    argv = [os.fsencode(a) if isinstance(a, str) else a for a in (*ZEROCOMM, *args)]
    return subprocess.run(argv, input=stdin, capture_output=True, timeout=60,
                          env=None if env is None else {**os.environ, **env})


def refused(member: Member, *args: str | bytes, code: int, stdin: bytes = b"",
            env: dict[str, str] | None = None) -> dict[str, object]:
    """Both forms refused cleanly with ``code``: text on stderr, and under --json one valid UTF-8 JSON error."""
    text = raw("--config", str(member.config), *args, stdin=stdin, env=env)
    err = text.stderr.decode("utf-8", "replace")
    assert text.returncode == code, (args, text.returncode, err)
    assert "Traceback" not in err, err
    assert any(line.startswith("zerocomm") and "error: " in line for line in err.splitlines()), err  # after usage
    as_json = raw("--config", str(member.config), "--json", *args, stdin=stdin, env=env)
    assert as_json.returncode == code, (args, as_json.returncode, as_json.stderr)
    assert b"Traceback" not in as_json.stderr, as_json.stderr
    answer = json.loads(as_json.stdout.decode("utf-8").splitlines()[-1])  # strict UTF-8: valid JSON text
    assert answer["ok"] is False and answer["exit_code"] == code
    assert answer["error"]["message"] and answer["error"]["hint"]
    return answer["error"]


def test_a_timeout_too_long_to_wait_for_is_a_usage_error(members: tuple[Member, Member]) -> None:
    """--timeout 1e308 passed the finite check, then overflowed the client's lock wait: a traceback (exit 1)."""
    for member in members:
        for value in ("1e308", "1e300", "nan", "inf", "-1", "0", "1e400"):
            error = refused(member, "group", "list", "--timeout", value, code=2)
            assert "--timeout" in error["message"], error


def test_text_that_is_not_utf8_is_refused_before_anything_is_sent(members: tuple[Member, Member]) -> None:
    """Undecodable bytes in the message, its --id or stdin reached str.encode in publish_table: a
    UnicodeEncodeError reported as a ConfigurationError ("'utf-8' codec can't encode...", "check the
    named setting") although no setting was involved."""
    up, down = members
    for args in (("send", "g", b"hi\xff"), ("send", "g", "x", "--id", b"id\xff")):
        error = refused(up, *args, code=2)
        assert "UTF-8" in error["message"] and "codec" not in error["message"], error
        assert "setting" not in error["hint"], error
        refused(down, *args, code=3)  # no agent to send to: that comes first, and is said as cleanly
    for env in (None, {"PYTHONIOENCODING": "utf-8:strict"}):  # en_US.UTF-8 and the like decode stdin strictly
        error = refused(up, "send", "g", "-", stdin=b"fine\nbad \xff\xfe\n", code=2, env=env)
        assert "line 2" in error["message"] and "UTF-8" in error["message"], error
        assert "nor was line 1, read with it and not sent" in error["message"], error  # says the good one did not go
    assert up.run("history", "g").json_lines == []  # refused whole: not even the good first line went out
    empty = refused(up, "send", "g", "-", stdin=b"", code=2)  # the hint was "check the named setting"
    assert "stdin" in empty["message"] and "setting" not in empty["hint"], empty


def test_settings_with_undecodable_bytes_are_refused_before_init_writes_anything(tmp_path: Path) -> None:
    """`init --label $'\\xff'` created the identity, then failed writing the config file half-way
    ('utf-8' codec can't encode...), leaving an empty file that later commands read as "all defaults"."""
    fresh = Member(tmp_path, "fresh")
    error = refused(fresh, "init", "--identity-dir", str(fresh.identity), "--label", b"al\xffce", code=2)
    assert "identity.label" in error["message"] and "UTF-8" in error["message"], error
    assert not fresh.config.exists() and not fresh.identity.exists()
    # A path is bytes on Linux and may hold them, but not in the UTF-8 TOML file init writes: said
    # before the identity is created (init made it, then failed writing the file).
    bad_dir = os.fsencode(tmp_path) + b"/id\xff"
    error = refused(fresh, "init", "--identity-dir", bad_dir, code=2)
    assert "identity.dir" in error["message"] and "UTF-8" in error["message"], error
    assert not fresh.config.exists() and not os.path.exists(bad_dir)
    fresh.init()
    assert raw("--config", str(fresh.config), "--identity-dir", bad_dir, "config").returncode == 0  # only read
    for args in (("--socket-dir", os.fsencode(tmp_path) + b"/s\xff", "group", "list"),  # a ZeroMQ endpoint: UTF-8
                 ("--identity-dir", bad_dir, "group", "list"),  # its run/ is the socket directory
                 ("--set", b"identity.label=\xff", "config")):
        error = refused(fresh, *args, code=2)
        assert "UTF-8" in error["message"] and "codec" not in error["message"], error


def test_negative_counts_are_usage_errors(members: tuple[Member, Member]) -> None:
    """`tail -n -1` printed nothing and `history --limit -1` the last message, both exit 0: a typo
    taken for a request. Counts are whole numbers >= 0; a huge one is just "all"."""
    for member in members:
        for args in (("tail", "g", "-n", "-1", "--no-follow"), ("history", "g", "--limit", "-5"),
                     ("tail", "g", "-n", str(-2**70), "--no-follow"), ("history", "g", "--limit", "x")):
            error = refused(member, *args, code=2)
            assert "-n" in error["message"] or "--limit" in error["message"], error
    up = members[0]
    assert up.run("tail", "g", "-n", str(2**70), "--no-follow").code == 0


def test_history_of_a_group_the_member_is_not_in_says_so(members: tuple[Member, Member]) -> None:
    """`history nosuch` (a misspelt name) printed nothing and exited 0, and `tail ""` waited forever
    on a name no group can have. The member's own empty group is still an empty history."""
    up, down = members
    error = refused(up, "history", "nosuch", code=6)
    assert "'nosuch'" in error["message"] and "'g'" in error["hint"], error
    refused(up, "history", "nosuch", "--all", code=6)
    assert up.run("history", "g").code == 0  # in the group, nothing sent yet: no error
    assert up.run("history", "g", "--limit", "0").code == 0  # 0: all, as for history replay
    for name in ("", "a:b", "x" * 300, "a\x01b"):
        for args in (("history", name), ("tail", name, "--no-follow")):
            refused(up, *args, code=2)
            refused(down, *args, code=2)  # checked before looking for an agent


def test_a_file_where_a_directory_must_be_is_said_as_such(tmp_path: Path) -> None:
    """A parent path that is a file said "File exists" (mkdir's error for it), and an identity
    directory that is a file was a keystore problem ("check the permissions and the passphrase", exit
    1); a taken --endpoint was told to "check the named setting against conf/zerocomm.toml"."""
    afile = tmp_path / "afile"
    afile.write_text("")
    fresh = Member(tmp_path, "fresh")
    error = refused(fresh, "init", "--identity-dir", str(afile), code=2)
    assert f"{afile} is a file" in error["message"] and "--identity-dir" in error["hint"], error
    assert "passphrase" not in error["hint"] and not fresh.config.exists()
    error = refused(fresh, "init", "--identity-dir", str(afile / "id"), code=2)
    assert "Not a directory" in error["message"] and "--identity-dir" in error["hint"], error
    error = raw("--config", str(afile / "x.toml"), "--json", "init", "--identity-dir", str(tmp_path / "id"))
    said = json.loads(error.stdout.decode().splitlines()[-1])["error"]
    assert error.returncode == 2 and f"{afile} is a file" in said["message"], said
    assert "File exists" not in said["message"] and "--config" in said["hint"], said
    assert not (tmp_path / "id").exists()  # refused before the identity was made
    fresh.init()
    error = refused(fresh, "--set", f"log.file={afile / 'agent.log'}", "agent", "start", "--detach", code=2)
    assert "Not a directory" in error["message"] and f"{afile} is a file" in error["message"], error
    assert "File exists" not in error["message"] and "log.file" in error["hint"], error
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        error = refused(fresh, "--endpoint", f"tcp://127.0.0.1:{port}", "agent", "start", "--detach", code=2)
    assert "cannot bind" in error["message"] and "--endpoint" in error["hint"], error
    assert "conf/zerocomm.toml" not in error["hint"], error
