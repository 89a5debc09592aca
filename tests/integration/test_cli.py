"""A three-member group created, joined, messaged and left entirely from the command line: three
agent processes on 127.0.0.1, each with its own config file and identity directory, driven only by
`zerocomm` commands (with --json where the test reads the answer, and once without to see tables)."""

from __future__ import annotations

import json
import os
import stat
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli_support import ZEROCOMM, Member, running, start_all, wait_for, zerocomm

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture()
def trio(tmp_path: Path) -> Iterator[list[Member]]:
    with running(tmp_path, "alice", "bob", "carol") as members:
        yield members


def test_three_members_from_the_command_line(trio: list[Member]) -> None:
    alice, bob, carol = trio
    assert alice.ok("agent", "status")["responding"] is True

    # alice creates the group; bob connects to alice, carol to bob, and each joins through its contact.
    created = alice.ok("group", "create", "g", "--mode", "shared")
    assert created["group"] == "g" and created["mode"] == "shared"
    bob.ok("connect", alice.ok("invite")["url"])
    bob.ok("group", "join", "g", "--via", "alice")
    carol.ok("connect", "-", input=bob.ok("invite")["url"] + "\n")  # from stdin: not visible in ps
    joined = carol.ok("group", "join", "g", "--via", "bob")
    assert sorted(m["label"] for m in joined["members"]) == ["alice", "bob", "carol"]
    for m in trio:
        wait_for(lambda m=m: sorted(x["label"] for x in m.ok("group", "members", "g")
                                    if x["status"] == "active") == ["alice", "bob", "carol"],
                 20, f"{m.name} to see three active members")

    # Each one sends; `send` returns only once every member acknowledged, so history is complete.
    sent = {}
    for m in trio:
        result = m.ok("send", "g", f"hello from {m.name}")
        assert result["seqs"] == [1] and len(result["message_ids"]) == 1
        assert result["journaled"] is True  # in the sender's own journal too: its history shows it at once
        sent[m.name] = result["message_ids"][0]
    bulk = alice.ok("send", "g", "-", input="line one\nline two\nline three\n")
    assert bulk["seqs"] == [2, 3, 4]
    for m in trio:
        rows = m.run("history", "g").json_lines
        assert sorted(r["message_id"] for r in rows) == sorted([*sent.values(), *bulk["message_ids"]]), m.name
        by_label = {r["message_id"]: (r["publisher_label"], r["payload"]) for r in rows}
        for name, mid in sent.items():
            assert by_label[mid] == (name, f"hello from {name}")
        alice_rows = [r for r in rows if r["publisher_label"] == "alice"]
        assert [r["seq"] for r in alice_rows] == [1, 2, 3, 4]  # publisher order
        assert [r["offset"] for r in rows] == list(range(len(rows)))
    # Re-sending a message id publishes nothing new.
    again = bob.ok("send", "g", "hello from bob", "--id", sent["bob"])
    assert again["duplicates"] == 1 and again["seqs"] == [1]
    assert len(carol.run("history", "g").json_lines) == 6

    # tail: the last lines at once, then it follows new messages like tail -f.
    tail = subprocess.Popen([*ZEROCOMM, "--config", str(carol.config), "--json", "tail", "g", "-n", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = [json.loads(tail.stdout.readline()) for _ in range(2)]
        assert [r["payload"] for r in first] == ["line two", "line three"]
        bob.ok("send", "g", "live one")
        live = json.loads(tail.stdout.readline())
        assert live["payload"] == "live one" and live["publisher_label"] == "bob"
    finally:
        tail.terminate()
        tail.wait(10)

    # Human output: aligned tables with headers.
    table = alice.run("group", "members", "g", json_out=False)
    assert table.code == 0
    header, *lines = table.stdout.splitlines()
    assert header.split()[:3] == ["LABEL", "ROLE", "STATUS"] and len(lines) == 3
    assert all(line.index("read_write") == header.index("ROLE") for line in lines)
    history = alice.run("history", "g", json_out=False)
    assert "hello from carol" in history.stdout and history.stdout.splitlines()[0].startswith("OFFSET")

    metrics = alice.ok("metrics")
    assert metrics["messages_in"] >= 3 and metrics["api_calls"]["publish"]["count"] >= 2
    assert set(metrics["peers_alive"].values()) == {True}

    # carol leaves; the others drop her, and she no longer has the group.
    assert carol.ok("group", "leave", "g")["left"] is True
    for m in (alice, bob):
        wait_for(lambda m=m: sorted(x["label"] for x in m.ok("group", "members", "g")) == ["alice", "bob"],
                 20, f"{m.name} to drop carol")
    gone = carol.run("group", "info", "g")
    assert gone.code == 6 and gone.json["error"]["type"] == "GroupNotFoundError"
    assert alice.ok("send", "g", "after carol left")["seqs"] == [5]
    # What carol published before she left is still hers by label in the history, not a shortened DID.
    after = {r["payload"]: r["publisher_label"] for r in bob.run("history", "g").json_lines}
    assert after["hello from carol"] == "carol" and after["after carol left"] == "alice", after


def test_exit_codes_and_errors_that_say_what_to_do(tmp_path: Path) -> None:
    lonely = Member(tmp_path, "lonely")
    lonely.init()
    # no agent running: exit 3 with the command that fixes it
    result = lonely.run("group", "list", json_out=False)
    assert result.code == 3
    assert "no agent is running" in result.stderr and "zerocomm agent start --detach" in result.stderr
    # a send with no agent to send it: nothing went out, so no "may be out ... send it with --id"
    unsent = lonely.run("send", "g", "hello", json_out=False)
    assert unsent.code == 3 and "no agent is running" in unsent.stderr, unsent
    assert "--id" not in unsent.stderr and "may have it" not in unsent.stderr, unsent.stderr
    assert lonely.run("agent", "status").code == 3
    assert lonely.run("agent", "stop").code == 3
    # usage: argparse (2), and a malformed setting names itself (2)
    assert lonely.run("group", "join", "g").code == 2
    bad = lonely.run("--set", "journal.fsync=sometimes", "agent", "status")
    assert bad.code == 2 and "journal.fsync" in bad.json["error"]["message"]
    unknown = zerocomm("--set", "jornal.fsync=always", "config")
    assert unknown.code == 2 and "did you mean 'journal'" in unknown.stderr
    # --help documents the exit codes
    helptext = zerocomm("--help").stdout
    for line in ("3    no agent is running", "4    a deadline passed", "5    an agent already runs"):
        assert line in helptext
    # the config command shows where each setting comes from
    shown = lonely.run("--log-level", "debug", "config").json
    assert shown["values"]["log"]["level"] == "debug" and shown["source"]["log.level"] == "flag"
    assert shown["source"]["identity.dir"] == str(lonely.config)
    # --spawn starts the agent on demand
    spawned = lonely.run("--spawn", "group", "list")
    try:
        assert spawned.code == 0 and spawned.json == []
        assert lonely.ok("agent", "status")["label"] == "lonely"
        missing = lonely.run("group", "members", "nope")
        assert missing.code == 6 and "GroupNotFoundError" == missing.json["error"]["type"]
        assert missing.json["error"]["hint"]
    finally:
        lonely.stop()
    started = time.monotonic()
    assert lonely.run("agent", "status").code == 3
    assert time.monotonic() - started < 10


def test_a_zerocomm_variable_that_names_no_setting_is_a_warning_the_user_sees(tmp_path: Path) -> None:
    solo = Member(tmp_path, "solo")
    solo.init()
    typo = zerocomm("--config", str(solo.config), "config", env={**os.environ, "ZEROCOMM_JOURNAL_FSYNK": "always"})
    assert typo.code == 0 and "warning" in typo.stderr and "ZEROCOMM_JOURNAL_FSYNK" in typo.stderr
    assert typo.stdout.count("env ZEROCOMM_") == 0  # ignored: no setting comes from it


def test_what_to_do_next_fits_the_situation(tmp_path: Path) -> None:
    solo = Member(tmp_path, "solo")
    solo.init()
    # the stop command printed by `agent start` works as printed (same --config)
    started = solo.run("agent", "start", "--detach", json_out=False)
    try:
        assert started.code == 0, started.stderr
        assert f"zerocomm --config {solo.config} agent stop" in started.stdout
        # a read-only member is told the command that makes it a publisher
        solo.ok("group", "create", "g", "--role", "read_only")
        refused = solo.run("send", "g", "x")
        assert refused.code == 1 and refused.json["error"]["type"] == "ReadOnlyMemberError"
        assert "zerocomm group role" in refused.json["error"]["hint"]
        # an agent that runs but does not answer is a deadline (4), not a missing agent to start (3)
        pid = solo.pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            hung = solo.run("group", "list", "--timeout", "2")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert hung.code == 4, hung.stdout + hung.stderr
        assert f"pid {pid}" in hung.json["error"]["message"] and "agent status" in hung.json["error"]["hint"]
    finally:
        solo.stop()


def test_joining_a_group_it_is_in_says_it_is_a_member(tmp_path: Path) -> None:
    """`group join sensors --via alice` by a member of sensors said "this member already has a group
    named 'sensors'. Pick another name, or leave(group) first", advice for a create."""
    with running(tmp_path, "alice", "bob") as (alice, bob):
        alice.ok("group", "create", "sensors")
        bob.ok("connect", alice.ok("invite")["url"])
        bob.ok("group", "join", "sensors", "--via", "alice")
        again = bob.run("group", "join", "sensors", "--via", "alice")
        assert again.code == 1 and again.json["error"]["type"] == "GroupExistsError", again
        error = again.json["error"]
        assert "already a member of group 'sensors'" in error["message"], error
        assert "Pick another name" not in error["hint"] and "Nothing to do" in error["hint"], error
        assert "zerocomm group leave sensors" in error["hint"], error
        refused = alice.run("group", "create", "sensors")  # a create keeps its own advice
        assert refused.code == 1 and "already has a group named 'sensors'" in refused.json["error"]["message"]


def test_joining_a_group_the_acceptor_is_not_in_names_the_acceptor_not_the_joiner(tmp_path: Path) -> None:
    """`group join nosuch --via alice` said "alice is not an active member of group 'nosuch': this member
    is in no group of that name": alice's words about herself, read by bob as being about bob."""
    with running(tmp_path, "alice", "bob") as (alice, bob):
        bob.ok("connect", alice.ok("invite")["url"])
        refused = bob.run("group", "join", "nosuch", "--via", "alice")
        assert refused.code == 6 and refused.json["error"]["type"] == "GroupNotFoundError", refused
        message = refused.json["error"]["message"]
        assert message == "alice is not an active member of group 'nosuch': it is in no group of that name", message


def test_joiner_policy_from_the_configuration(tmp_path: Path) -> None:
    """groups.joiner_policy=invitation: only joiners who came through an invitation for the group get in."""
    owner = Member(tmp_path, "owner", "groups.joiner_policy=invitation")
    guest = Member(tmp_path, "guest")
    try:
        start_all([owner, guest])
        assert owner.ok("group", "create", "club")["policy"]["kind"] == "invitation"
        plain = guest.ok("connect", owner.ok("invite")["url"])
        refused = guest.run("group", "join", "club", "--via", plain["id"])
        assert refused.code == 1 and refused.json["error"]["type"] == "JoinRefusedError"
        assert "invitation issued for group 'club'" in refused.json["error"]["message"]
        invited = guest.ok("connect", owner.ok("invite", "--group", "club")["url"])
        joined = guest.ok("group", "join", "club", "--via", invited["id"])
        assert sorted(m["label"] for m in joined["members"]) == ["guest", "owner"]
    finally:
        for m in (owner, guest):
            m.stop()


def test_what_peers_write_cannot_drive_the_terminal(tmp_path: Path) -> None:
    """Labels and basic messages come from peers; tables printed them raw, so a peer's escape
    sequences (clear the screen, set the window title, fake lines) reached the reader's terminal."""
    clear, title = "\x1b[2J\x1b[H", "\x1b]0;owned\x07"
    with running(tmp_path, "reader", "evil") as (reader, evil):
        evil.ok("connect", reader.ok("invite")["url"])
        evil.ok("message", "reader", f"hi{clear}you have 0 new messages{title}")
        wait_for(lambda: reader.ok("inbox"), 20, "the message to arrive")
        evil.ok("message", "reader", "-", input="from stdin\nsecond line\n")  # all of it, less the last newline
        wait_for(lambda: len(reader.ok("inbox")) == 2, 20, "the second message to arrive")
        assert reader.ok("inbox")[1]["content"] == "from stdin\nsecond line"
        shown = reader.run("inbox", json_out=False)
        assert shown.code == 0, shown.stderr
        assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout, shown.stdout
        assert "hi\\x1b[2J\\x1b[Hyou have 0 new messages\\x1b]0;owned\\x07" in shown.stdout  # shown, escaped
        assert reader.ok("inbox")[0]["content"].startswith(f"hi{clear}")  # --json keeps the text as sent


def test_tail_follows_the_group_across_an_agent_restart(tmp_path: Path) -> None:
    """tail is for watching a group for hours: an agent restart (an upgrade, a config change) ended it
    with "no agent"; it waits for the agent to come back and goes on from the same journal offset."""
    with running(tmp_path, "solo") as (solo,):
        solo.ok("group", "create", "g")
        solo.ok("send", "g", "before")
        tail = subprocess.Popen([*ZEROCOMM, "--config", str(solo.config), "--json", "tail", "g", "-n", "5"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert json.loads(tail.stdout.readline())["payload"] == "before"
            solo.ok("agent", "stop", "--timeout", "15", timeout=30)
            time.sleep(1.0)  # tail finds no agent meanwhile
            assert tail.poll() is None, tail.stderr.read()
            solo.start()
            solo.ok("send", "g", "after")
            line = tail.stdout.readline()  # pytest-timeout bounds this; the agent is back within seconds
            assert line and json.loads(line)["payload"] == "after", tail.stderr.read() if tail.poll() is not None else line
        finally:
            tail.terminate()
            tail.wait(10)


def test_send_from_stdin_goes_in_chunks_a_request_can_carry(tmp_path: Path) -> None:
    """`send -` of a file larger than one API request (api.max_request_bytes) failed whole with
    RequestTooLargeError; it publishes the lines in chunks, in order, and reports them all."""
    lines = [f"{i:06d} " + "x" * 93 for i in range(30_000)]  # 3 MB of lines against a 2 MB request limit
    solo = Member(tmp_path, "solo", "api.max_request_bytes=2000000")
    try:
        start_all([solo])
        solo.ok("group", "create", "g")
        sent = solo.ok("send", "g", "-", input="\n".join(lines) + "\n", timeout=120)
        assert sent["seqs"] == list(range(1, 30_001)) and len(set(sent["message_ids"])) == 30_000
        rows = solo.run("history", "g", "--all", timeout=120).json_lines
        assert [r["payload"] for r in rows] == lines
    finally:
        solo.stop()


def test_a_config_file_with_relative_paths_names_one_agent_from_any_directory(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative identity.dir in a file is relative to the file (the agent's reading): the Python
    client, given that file, looked for the agent's socket relative to its own current directory
    instead, and found no agent (or, with spawn=True, would start one for another identity)."""
    from zerocomm_spark.client import Client

    home = tmp_path / "conf"
    home.mkdir()
    config = home / "z.toml"
    config.write_text('[identity]\ndir = "member"\nlabel = "rel"\n')
    made = subprocess.run([*ZEROCOMM, "--config", "conf/z.toml", "--json", "init"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stdout + made.stderr
    assert json.loads(made.stdout)["identity_dir"] == str(home / "member")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    started = subprocess.run([*ZEROCOMM, "--config", str(config), "--json", "agent", "start", "--detach"],
                             cwd=elsewhere, capture_output=True, text=True, timeout=60)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        monkeypatch.chdir(elsewhere)
        for where in ({"where": str(config)}, {"config": str(config)}):
            with Client.connect(**where, timeout=10) as client:  # type: ignore[arg-type]
                assert client.status()["label"] == "rel"
    finally:
        subprocess.run([*ZEROCOMM, "--config", str(config), "agent", "stop", "--timeout", "15"],
                       capture_output=True, timeout=30)


def test_init_writes_the_paths_it_was_given_as_they_were_meant(tmp_path: Path) -> None:
    """init copies flags and ZEROCOMM_* settings into the file it writes; a relative path there is
    read relative to the file, so `--set journal.dir=j` typed in one directory named another
    directory's j once written (init reported one socket directory, the agent then used another)."""
    work = tmp_path / "work"
    work.mkdir()
    config = tmp_path / "conf" / "z.toml"
    env = {**os.environ, "ZEROCOMM_API_SOCKET_DIR": "sock"}
    made = subprocess.run([*ZEROCOMM, "--config", str(config), "--json", "--identity-dir", str(tmp_path / "id"),
                           "--set", "journal.dir=j", "--set", "log.file=logs/agent.log", "init"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stdout + made.stderr
    assert json.loads(made.stdout)["socket_dir"] == str(work / "sock")
    shown = zerocomm("--config", str(config), "--json", "config")
    assert shown.code == 0, shown.stderr
    assert shown.json["journal_dir"] == str(work / "j")
    assert shown.json["socket_dir"] == str(work / "sock")
    assert shown.json["values"]["log"]["file"] == str(work / "logs" / "agent.log")
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


def test_init_never_writes_its_file_through_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("# keep me\n")
    config = tmp_path / "z.toml"
    config.symlink_to(victim)
    made = zerocomm("--config", str(config), "--json", "--identity-dir", str(tmp_path / "id"), "init", "--force")
    assert made.code == 2 and "cannot be written" in made.json["error"]["message"], made.stdout
    assert victim.read_text() == "# keep me\n"


def test_send_from_stdin_fits_its_chunks_to_the_agents_request_limit(tmp_path: Path) -> None:
    """`send -` cut stdin into chunks of about a million characters whatever the agent takes: with a
    smaller api.max_request_bytes (or text that is not ASCII: bytes, not characters, fill a request)
    the first chunk was refused whole with RequestTooLargeError."""
    lines = [f"{i:05d} " + "é" * 500 + "x" * 494 for i in range(2_000)]  # 1,500 bytes a line, 3 MB in all
    solo = Member(tmp_path, "solo", "api.max_request_bytes=300000")
    try:
        start_all([solo])
        solo.ok("group", "create", "g")
        sent = solo.run("send", "g", "-", input="\n".join(lines) + "\n", timeout=120)
        assert sent.code == 0, sent.stdout + sent.stderr
        assert sent.json["seqs"] == list(range(1, 2_001))
        rows = solo.run("history", "g", "--all", timeout=120).json_lines
        assert [r["payload"] for r in rows] == lines
    finally:
        solo.stop()


def test_the_start_command_init_prints_works_as_printed(tmp_path: Path) -> None:
    """`init --config PATH` prints the command that starts the agent; a PATH with a space (or a quote)
    was printed bare, so pasted into a shell it named another file (the stop command a detached
    start prints was quoted already)."""
    import shlex

    root = tmp_path / "it's my dir"
    root.mkdir()
    member = Member(root, "spaced")
    made = member.run("init", "--identity-dir", str(member.identity), "--label", "spaced", json_out=False)
    assert made.code == 0, made.stderr
    line = next(x for x in made.stdout.splitlines() if x.startswith("next: "))
    argv = shlex.split(line[len("next: "):])  # what a shell makes of it
    assert argv[:3] == ["zerocomm", "--config", str(member.config)], argv
    try:
        started = zerocomm(*argv[1:], "--json")
        assert started.code == 0, started.stdout + started.stderr
        assert member.ok("agent", "status")["label"] == "spaced"
        # init again while that agent runs: it reported the identity when the agent was stopped, but
        # refused with exit 5 ("in use by another agent... stop the other agent") while it ran
        again = member.run("init", "--identity-dir", str(member.identity))
        assert again.code == 0, again.stdout + again.stderr
        assert again.json["label"] == "spaced" and again.json["created"] is False and again.json["agent_running"]
        assert again.json["peer_endpoint"] == member.ok("agent", "status")["endpoints"]["peer"]
        # ...but not with credentials that do not open the keystore (it is sealed with its key file):
        # the running agent must not stand in for checking them
        wrong = zerocomm("--config", str(member.config), "--json", "--set", "identity.passphrase_env=ZC_TEST_PW",
                         "init", "--identity-dir", str(member.identity), env={**os.environ, "ZC_TEST_PW": "wrong"})
        assert wrong.code != 0 and "key file" in wrong.stdout, wrong.stdout + wrong.stderr
    finally:
        member.stop()


def test_the_passphrase_variable_named_by_a_flag_is_not_a_misspelt_setting(tmp_path: Path) -> None:
    """identity.passphrase_env set by --set (not the file or the environment) still had every command
    warn that the ZEROCOMM_* variable it names "names no setting"."""
    env = {**os.environ, "ZEROCOMM_PW": "correct horse"}
    shown = zerocomm("--identity-dir", str(tmp_path / "id"), "--set", "identity.passphrase_env=ZEROCOMM_PW",
                     "--json", "config", env=env)
    assert shown.code == 0, shown.stderr
    assert "ZEROCOMM_PW" not in shown.stderr and shown.json["warnings"] == [], shown.stderr
    assert "correct horse" not in shown.stdout + shown.stderr


def test_json_history_and_tail_carry_every_payload_exactly(tmp_path: Path) -> None:
    """A script reading `history --json` or `tail --json` gets each payload as it was sent: text with
    newlines and control characters as JSON-escaped text (it was a lossy "<N bytes: ...>" marker), any
    payload's bytes in payload_base64, and no raw control character a terminal would act on."""
    import base64

    from zerocomm_spark.client import Client

    payloads = [b"two\nlines", "tab\tand \x1b[31mred\x1b[0m and \x9b6n".encode(), b"\x00\xff binary", "plain é".encode()]
    solo = Member(tmp_path, "solo")
    try:
        start_all([solo])
        solo.ok("group", "create", "g")
        with Client.connect(config=str(solo.config), timeout=10) as client:
            client.publish("g", payloads, timeout=30)
        for command in (("history", "g", "--all"), ("tail", "g", "--no-follow")):
            done = solo.run(*command, timeout=60)
            assert done.code == 0, done.stdout + done.stderr
            rows = done.json_lines
            assert [base64.b64decode(r["payload_base64"]) for r in rows] == payloads
            assert [r["payload"] for r in rows[:2]] + [rows[3]["payload"]] == [
                payloads[0].decode(), payloads[1].decode(), payloads[3].decode()]
            assert rows[2]["payload"].startswith("<")  # not UTF-8: the marker, the bytes in payload_base64
            assert not any(c in done.stdout for c in "\x1b\x9b\x00")  # escaped in the JSON text, never raw
    finally:
        solo.stop()


def test_tables_show_text_as_text_one_line_per_message_and_send_strips_crlf(tmp_path: Path) -> None:
    """`history` and `tail` tables showed UTF-8 text with a newline as hex (`<10 bytes: 6d756c...>`),
    which the README keeps for payloads that are not UTF-8; and `printf 'e3\\r\\n' | send g -` stored
    "e3\\r". Text is shown with its control characters escaped (one line per row), hex stays for
    binary; a CRLF line ending is stripped as an ending."""
    from zerocomm_spark.client import Client

    solo = Member(tmp_path, "solo")
    try:
        start_all([solo])
        solo.ok("group", "create", "g")
        with Client.connect(config=str(solo.config), timeout=10) as client:
            client.publish("g", [b"multi\nline", b"\xff\x00 binary"], timeout=30)
        sent = solo.ok("send", "g", "-", input="e3\r\nsplit\rhalf\r\n")
        assert [r["payload"] for r in solo.run("history", "g").json_lines][2:] == ["e3", "split\rhalf"]
        again = solo.ok("send", "g", "-", "--id-prefix", sent["id_prefix"], input="e3\r\nsplit\rhalf\n")
        assert again["duplicates"] == 2  # the same ids whichever line ending: nothing sent twice
        for command in (("history", "g"), ("tail", "g", "--no-follow")):
            shown = solo.run(*command, json_out=False, timeout=60)
            assert shown.code == 0, shown.stderr
            lines = shown.stdout.splitlines()
            assert len(lines) == 4 + (command[0] == "history"), shown.stdout  # a header, then one line each
            assert lines[-4].endswith("multi\\nline") and "bytes" not in lines[-4], shown.stdout
            assert "<9 bytes: ff0020" in lines[-3] and lines[-2].endswith("e3"), shown.stdout
            assert lines[-1].endswith("split\\rhalf"), shown.stdout
    finally:
        solo.stop()


def test_the_start_command_a_missing_agent_is_told_names_this_agent(tmp_path: Path) -> None:
    """A member with its own --config was told "Start it with `zerocomm agent start --detach`" by
    `agent status` and every other command: pasted as printed, that starts the default
    configuration's agent (or fails, that one running), not the one asked about."""
    solo = Member(tmp_path, "solo")
    solo.init()
    expected = f"zerocomm --config {solo.config} agent start --detach"
    try:
        for command in (("agent", "status"), ("group", "list")):
            missing = solo.run(*command)
            assert missing.code == 3 and expected in missing.json["error"]["hint"], missing.json
        pasted = subprocess.run([*ZEROCOMM, *expected.split()[1:]], capture_output=True, text=True, timeout=60)
        assert pasted.returncode == 0, pasted.stderr
        assert solo.ok("agent", "status")["label"] == "solo"
    finally:
        solo.stop()


def test_tail_of_a_group_the_member_does_not_know_says_so(tmp_path: Path) -> None:
    """`tail` of a misspelt group printed nothing and exited 0 (--no-follow), or followed it silently
    forever; `history` said the member is in no such group. Both say it now, exit 6, and name the
    groups it is in; a group the member is in (even with nothing journaled yet) is still tailed."""
    solo = Member(tmp_path, "solo")
    try:
        start_all([solo])
        solo.ok("group", "create", "sensors")
        solo.ok("send", "sensors", "hello")
        for command in (("tail", "sensor", "--no-follow"), ("tail", "sensor"), ("tail", "sensor", "-n", "0")):
            started = time.monotonic()
            typo = solo.run(*command, timeout=30)
            assert typo.code == 6, (command, typo.stdout, typo.stderr)
            assert typo.json["error"]["type"] == "GroupNotFoundError" and "'sensors'" in typo.json["error"]["hint"]
            assert time.monotonic() - started < 20
        human = solo.run("tail", "sensor", json_out=False, timeout=30)
        assert human.code == 6 and "Traceback" not in human.stderr and "sensors" in human.stderr
        assert [r["payload"] for r in solo.run("tail", "sensors", "--no-follow").json_lines] == ["hello"]
        solo.ok("group", "create", "quiet")
        assert solo.run("tail", "quiet", "--no-follow").code == 0  # a group with nothing journaled yet
    finally:
        solo.stop()


def test_a_second_init_that_would_make_another_member_says_how(tmp_path: Path) -> None:
    """A user adding a second member on one machine runs init again. `init --label bob` on alice's
    file said "found the identity 'alice'", exit 0 (no bob, the label dropped); `init --identity-dir
    D --label bob` made bob but kept alice's file, so the printed `zerocomm agent start` started
    alice. Both are refused before anything is made, with the command that makes a second member;
    init again as it was first run still succeeds and changes nothing."""
    config = tmp_path / "zerocomm.toml"
    first = tmp_path / "alice"
    made = zerocomm("--config", str(config), "--json", "init", "--identity-dir", str(first), "--label", "alice")
    assert made.code == 0 and made.json["created"] is True, made.stderr
    before = config.read_text()
    again = zerocomm("--config", str(config), "--json", "init", "--identity-dir", str(first), "--label", "alice")
    assert again.code == 0 and again.json["created"] is False and again.json["label"] == "alice", again.stderr
    relabel = zerocomm("--config", str(config), "--json", "init", "--label", "bob")
    assert relabel.code == 2, relabel.stdout + relabel.stderr
    assert "'alice'" in relabel.json["error"]["message"] and "--identity-dir" in relabel.json["error"]["hint"]
    other = tmp_path / "bob"
    elsewhere = zerocomm("--config", str(config), "init", "--identity-dir", str(other), "--label", "bob")
    assert elsewhere.code == 2 and "Traceback" not in elsewhere.stderr, elsewhere.stdout + elsewhere.stderr
    assert str(first) in elsewhere.stderr and "--config PATH" in elsewhere.stderr
    assert not other.exists() and config.read_text() == before
    own = zerocomm("--config", str(tmp_path / "bob.toml"), "--json", "init", "--identity-dir", str(other),
                   "--label", "bob")
    assert own.code == 0 and own.json["label"] == "bob", own.stderr


def test_json_history_and_tail_give_headers_as_an_object(tmp_path: Path) -> None:
    """headers is map<string,string>; `history --json` and `tail --json` printed it as Arrow's list of
    [key, value] pairs, so a script's `row["headers"]["zc-origin"]` failed. It is a JSON object now
    (null for a message without headers)."""
    solo = Member(tmp_path, "solo")
    try:
        start_all([solo])
        solo.ok("group", "create", "g")
        solo.ok("send", "g", "plain")
        solo.ok("send", "g", "signed", "--sign")
        for command in (("history", "g"), ("tail", "g", "--no-follow")):
            rows = solo.run(*command).json_lines
            assert [r["payload"] for r in rows] == ["plain", "signed"], command
            assert rows[0]["headers"] is None
            assert isinstance(rows[1]["headers"], dict) and list(rows[1]["headers"]) == ["zc-origin"], rows[1]
    finally:
        solo.stop()


def test_a_send_a_member_did_not_acknowledge_says_the_id_to_send_again_with(tmp_path: Path) -> None:
    """`send` while a member's agent is down timed out (exit 4) naming neither the message's id nor
    a command: the hint said stats()['lag'] and "wait again". Sent again as it was typed, the text
    went out a second time under a new id. The error now names the id, and sending with --id that id
    once the member is back delivers it to everyone once."""
    with running(tmp_path, "alice", "bob") as (alice, bob):
        alice.ok("group", "create", "g")
        bob.ok("connect", alice.ok("invite")["url"])
        bob.ok("group", "join", "g", "--via", "alice")
        bob.stop()
        down = alice.run("send", "g", "are you there?", "--timeout", "3", timeout=60)
        assert down.code == 4, down.stdout + down.stderr
        error = down.json["error"]
        assert "message id " in error["message"], error
        mid = error["message"].rsplit("message id ", 1)[1].rstrip(")")
        assert f"--id {mid}" in error["hint"] and "zerocomm group members g" in error["hint"], error
        bob.start()
        again = alice.ok("send", "g", "are you there?", "--id", mid, timeout=60)
        assert again["message_ids"] == [mid] and again["duplicates"] == 1
        for m in (alice, bob):
            rows = wait_for(lambda m=m: [r for r in m.run("history", "g").json_lines
                                         if r["payload"] == "are you there?"], 20, f"{m.name}'s journal")
            assert [r["message_id"] for r in rows] == [mid], m.name
        # An agent that does not answer in time (the outcome unknown) names the id to send again with too.
        pid = alice.pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            hung = alice.run("send", "g", "still there?", "--timeout", "2", timeout=60)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert hung.code == 4 and hung.json["error"]["type"] == "ApiTimeoutError", hung.stdout + hung.stderr
        later = hung.json["error"]["message"].rsplit("message id ", 1)[1].rstrip(")")
        assert f"--id {later}" in hung.json["error"]["hint"]
        retried = alice.ok("send", "g", "still there?", "--id", later, timeout=60)
        assert retried["message_ids"] == [later]


def test_init_again_with_the_identity_dir_written_differently_is_the_same_member(tmp_path: Path) -> None:
    """A script or service manager runs `init --identity-dir D` at every start. The check that the
    kept file names this identity compared paths as written: D through a symlink, or as `D/../D`,
    was refused (exit 2) as "another member" although it is the very identity the file names."""
    config = tmp_path / "zerocomm.toml"
    real = tmp_path / "real"
    link = tmp_path / "link"
    made = zerocomm("--config", str(config), "--json", "init", "--identity-dir", str(real), "--label", "alice")
    assert made.code == 0 and made.json["created"] is True, made.stderr
    link.symlink_to(real, target_is_directory=True)
    before = config.read_text()
    for written in (str(link), f"{real}/../{real.name}", f"{real}/"):
        again = zerocomm("--config", str(config), "--json", "init", "--identity-dir", written, "--label", "alice")
        assert again.code == 0, (written, again.stdout + again.stderr)
        assert again.json["created"] is False and again.json["label"] == "alice", again.stdout
    assert config.read_text() == before
    other = zerocomm("--config", str(config), "init", "--identity-dir", str(tmp_path / "bob"), "--label", "bob")
    assert other.code == 2 and not (tmp_path / "bob").exists(), other.stdout + other.stderr  # still refused


def test_init_writes_the_file_zerocomm_config_names(tmp_path: Path) -> None:
    """With ZEROCOMM_CONFIG naming a file not made yet (first setup, as the READMEs advise for
    executors), `zerocomm init` refused: "ZEROCOMM_CONFIG names ..., which does not exist. Create it
    with `zerocomm init`" (exit 2). init writes that file; other commands keep the clear error."""
    config = tmp_path / "x" / "zc.toml"
    env = {**os.environ, "ZEROCOMM_CONFIG": str(config)}
    made = zerocomm("--json", "init", "--identity-dir", str(tmp_path / "x" / "id"), "--label", "bob", env=env)
    assert made.code == 0, made.stdout + made.stderr
    assert made.json["config_file"] == str(config) and made.json["config_written"] is True
    shown = zerocomm("--json", "config", env=env)
    assert shown.code == 0, shown.stderr
    assert shown.json["file"] == str(config) and shown.json["identity_dir"] == str(tmp_path / "x" / "id")
    assert shown.json["values"]["identity"]["label"] == "bob"
    missing = {**os.environ, "ZEROCOMM_CONFIG": str(tmp_path / "y" / "zc.toml")}
    refused = zerocomm("config", env=missing)
    assert refused.code == 2 and "ZEROCOMM_CONFIG names" in refused.stderr and "does not exist" in refused.stderr
    assert "zerocomm init" in refused.stderr


def test_a_line_too_large_for_one_message_is_named_and_the_lines_before_it_go_out(tmp_path: Path) -> None:
    """`send -` with one line over the agent's largest message refused its whole chunk: "a N-byte
    payload exceeds max_message_bytes (the first 1 line(s) ... acknowledged); line 2 may be out (the
    outcome is unknown)", and the --skip it named hit the same line again. The line is checked against
    the agent's limit before its chunk goes: the lines before it go out, the error names it (split or
    remove it), and the resume it names, on the edited input, sends the rest once. A line the agent
    refuses for a limit it did not give (an origin proof's room) is named too."""
    solo = Member(tmp_path, "solo", "peer.max_frame_bytes=200000")
    try:
        start_all([solo])
        solo.ok("group", "create", "g")
        largest = solo.ok("agent", "status")["max_message_bytes"]
        big = "x" * (largest + 1)
        sent = solo.run("send", "g", "-", input=f"small1\n{big}\nsmall3\n")
        assert sent.code == 1, sent.stdout + sent.stderr
        error = sent.json["error"]
        assert error["type"] == "FrameTooLargeError" and f"line 2 of stdin is {largest + 1} bytes" in error["message"]
        assert "the first 1 line(s) of stdin were sent and acknowledged" in error["message"], error
        assert "may be out" not in error["message"], error
        assert "Split line 2" in error["hint"] and "remove it" in error["hint"] and "edited input" in error["hint"]
        prefix = error["hint"].split("--id-prefix ", 1)[1].split()[0]
        assert f"--id-prefix {prefix} --skip 1" in error["hint"], error
        assert [r["payload"] for r in solo.run("history", "g").json_lines] == ["small1"]
        rest = solo.ok("send", "g", "-", "--id-prefix", prefix, "--skip", "1", input="small1\nsmall3\n")
        assert rest["seqs"] == [2]
        assert [r["payload"] for r in solo.run("history", "g").json_lines] == ["small1", "small3"]
        # --sign: a proof header takes room the status's limit does not count; the agent refuses the chunk
        edge = "y" * largest
        signed = solo.run("send", "g", "-", "--sign", input=f"a\n{edge}\nb\n")
        assert signed.code == 1, signed.stdout + signed.stderr
        error = signed.json["error"]
        assert error["type"] == "FrameTooLargeError", error
        assert f"line 2 of stdin, {largest} bytes, the largest of lines 1..3" in error["message"], error
        assert "none of them was sent" in error["message"] and "Split line 2" in error["hint"], error
        assert len(solo.run("history", "g").json_lines) == 2
    finally:
        solo.stop()


def _interrupted(send: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C to a running `send -`: its output, once it exited as an interrupted command does (130)."""
    send.send_signal(signal.SIGINT)
    out, err = send.communicate(timeout=30)
    assert send.returncode == 130, out + err
    return out, err


def _pair_in_group(alice: Member, bob: Member) -> None:
    """Start both; alice creates group g and bob joins it through her; alice sees bob active."""
    start_all([alice, bob])
    alice.ok("group", "create", "g")
    bob.ok("connect", alice.ok("invite")["url"])
    bob.ok("group", "join", "g", "--via", "alice")
    wait_for(lambda: [m["status"] for m in alice.ok("group", "members", "g")] == ["active"] * 2, 20,
             "alice to see bob active")


def test_a_send_from_stdin_that_stops_part_way_says_how_to_send_the_rest_exactly_once(tmp_path: Path) -> None:
    """`send -` whose chunk a member did not acknowledge in time said how many lines had been
    acknowledged but named no message ids: the lines had fresh random ids, so sending the input again
    delivered every line that had gone out a second time. Each line's id now comes from a prefix, its
    number and its text; the error names the prefix and the lines to skip, and the command it says,
    run on the same input, delivers the rest, every line once (the chunk in flight included)."""
    lines = [f"line {i:04d} " + "x" * 30 for i in range(1, 301)]
    alice = Member(tmp_path, "alice", "api.max_request_bytes=20000")  # chunks of ~100 lines
    bob = Member(tmp_path, "bob")
    try:
        _pair_in_group(alice, bob)
        # stdin fed by hand: the first chunk goes out and is acknowledged while bob is up; bob stops;
        # the next chunk cannot be acknowledged.
        send = subprocess.Popen([*ZEROCOMM, "--config", str(alice.config), "--json", "--timeout", "3", "send", "g",
                                 "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert send.stdin is not None
            send.stdin.write("\n".join(lines[:150]) + "\n")
            send.stdin.flush()
            # alice journals her own rows once every member acknowledged them; all 150 go out once stdin
            # pauses (a chunk of ~100, then the rest: lines read do not wait for more to come)
            first = wait_for(lambda: (lambda n: n if n == 150 else 0)(len(alice.run("history", "g", "--all").json_lines)),
                             30, "the lines written so far to be acknowledged")
            bob.stop()
            out, err = send.communicate("\n".join(lines[150:]) + "\n", timeout=60)
        finally:
            if send.poll() is None:
                send.kill()
        assert send.returncode == 4, out + err
        error = json.loads(out.strip().splitlines()[-1])["error"]
        assert f"the first {first} line(s) of stdin were sent and acknowledged" in error["message"], error
        assert f"lines {first + 1}.." in error["message"] and "may be out" in error["message"], error
        prefix = error["hint"].split("--id-prefix ", 1)[1].split()[0]
        assert f"--id-prefix {prefix} --skip {first}" in error["hint"] and "zerocomm group members g" in error["hint"]
        bob.start()
        rest = alice.ok("send", "g", "-", "--id-prefix", prefix, "--skip", str(first), input="\n".join(lines) + "\n",
                        timeout=120)
        assert len(rest["message_ids"]) == 300 - first and rest["id_prefix"] == prefix
        assert rest["duplicates"] >= 1  # the chunk in flight had gone out: not sent again
        # The whole input again with that prefix: every line is a duplicate, nothing new goes out.
        again = alice.ok("send", "g", "-", "--id-prefix", prefix, input="\n".join(lines) + "\n", timeout=120)
        assert again["duplicates"] == 300
        for m in (alice, bob):
            rows = wait_for(lambda m=m: (lambda r: r if len(r) >= 300 else None)(
                m.run("history", "g", "--all").json_lines), 30, f"{m.name}'s journal to hold every line")
            assert [r["payload"] for r in rows] == lines, m.name  # each line once, in order
            assert {r["message_id"].rsplit("-", 2)[0] for r in rows} == {prefix}
        # Without a prefix every run has its own: the same input sent twice on purpose is sent twice.
        twice = [alice.ok("send", "g", "-", input="again\n")["message_ids"][0] for _ in range(2)]
        assert twice[0] != twice[1]
        refused = alice.run("send", "g", "one text", "--skip", "3")
        assert refused.code == 2 and "go with -" in refused.json["error"]["message"]
    finally:
        alice.stop()
        bob.stop()


# Linux system call numbers: read, and the polls a client's wait for the agent's answer is in.
_READ = {"x86_64": "0", "aarch64": "63"}
_POLLS = {"x86_64": {"7", "271"}, "aarch64": {"73"}}


def _main_thread_in(pid: int) -> list[str]:
    """The system call the process's main thread waits in and its arguments ([] if not in one)."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return []
    return [] if not fields or fields[0] == "running" else fields


def _blocked_reading_stdin(pid: int) -> bool:
    import platform

    return _main_thread_in(pid)[:2] == [_READ.get(platform.machine()), "0x0"]


def _waiting_for_the_agent(pid: int) -> bool:
    import platform

    fields = _main_thread_in(pid)
    return bool(fields) and fields[0] in _POLLS.get(platform.machine(), set())


def _syscalls_seen() -> bool:
    import platform

    return Path(f"/proc/{os.getpid()}/syscall").exists() and platform.machine() in _READ


def _interrupted_waiting_for_stdin(solo: Member, first: list[str]) -> tuple[str, str]:
    """Start ``solo``'s one group 'g', run `--json send g -` with lines ``first`` on its stdin (one
    chunk goes out, the next waits for lines), and Ctrl-C it once that chunk is acknowledged and it
    is back to reading stdin (the one place a send waits that long for its input): (stdout, stderr)."""
    start_all([solo])
    solo.ok("group", "create", "g")
    send = subprocess.Popen([*ZEROCOMM, "--config", str(solo.config), "--json", "send", "g", "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert send.stdin is not None
        send.stdin.write("\n".join(first) + "\n")
        send.stdin.flush()
        wait_for(lambda: solo.run("history", "g", "--all").json_lines, 30, "the first chunk to be acknowledged")
        wait_for(lambda: _blocked_reading_stdin(send.pid), 30, "the send to wait for more lines")
        return _interrupted(send)
    finally:
        if send.poll() is None:
            send.kill()


def test_a_send_from_stdin_interrupted_with_ctrl_c_says_how_to_send_the_rest(tmp_path: Path) -> None:
    """`send -` stopped with Ctrl-C exited 130 saying nothing, though a long send is most often stopped
    that way: without the prefix, the same input sent again gave the acknowledged lines new ids and
    delivered them twice. It now says on stderr how many lines were acknowledged and the --id-prefix
    and --skip that send the rest exactly once, and those options do. With --json it printed nothing on
    stdout, so a script had nothing to parse: it prints the error document (exit_code 130) with what
    was acknowledged and the options that send the rest."""
    if not _syscalls_seen():
        pytest.skip("needs /proc/PID/syscall (x86_64 or aarch64 Linux) to see the sender wait for stdin")
    lines = [f"line {i:04d} " + "x" * 30 for i in range(1, 301)]
    solo = Member(tmp_path, "solo", "api.max_request_bytes=20000")  # chunks of ~100 lines
    try:
        out, err = _interrupted_waiting_for_stdin(solo, lines[:150])
        assert "Traceback" not in err, err
        acked_rows = solo.run("history", "g", "--all").json_lines
        acked = len(acked_rows)
        # Every line written before stdin paused went out (the last ~50 used to wait for more lines, unsent).
        assert acked == 150
        assert f"interrupted (Ctrl-C) (the first {acked} line(s) of stdin were sent and acknowledged)" in err, err
        assert "may be out" not in err, err  # nothing was in flight: it waited for stdin
        prefix = err.split("--id-prefix ", 1)[1].split()[0]
        assert f"--id-prefix {prefix} --skip {acked}" in err, err
        said = json.loads(out)  # one document, nothing else on stdout
        assert said["ok"] is False and said["exit_code"] == 130 and said["group"] == "g", said
        assert said["error"]["type"] == "KeyboardInterrupt", said
        assert said["error"]["message"] == (f"interrupted (Ctrl-C) (the first {acked} line(s) of stdin were sent and "
                                            "acknowledged)"), said
        assert said["acknowledged_lines"] == said["acknowledged_by_this_run"] == acked, said
        assert said["message_ids"] == [r["message_id"] for r in acked_rows] and len(said["seqs"]) == acked, said
        assert said["in_flight_lines"] is None, said  # it waited for stdin: nothing was out
        assert said["id_prefix"] == prefix, said
        assert said["resume_options"] == ["--id-prefix", prefix, "--skip", str(acked)], said
        assert f"--id-prefix {prefix} --skip {acked}" in said["error"]["hint"], said
        assert said["error"]["message"] in err, err  # stderr says it as before
        rest = solo.ok("send", "g", "-", "--id-prefix", prefix, "--skip", str(acked), input="\n".join(lines) + "\n",
                       timeout=120)
        assert len(rest["message_ids"]) == 300 - acked and rest["duplicates"] == 0
        rows = solo.run("history", "g", "--all", timeout=60).json_lines
        assert [r["payload"] for r in rows] == lines  # each line once, in order
        assert {r["message_id"].rsplit("-", 2)[0] for r in rows} == {prefix}
    finally:
        solo.stop()


def test_a_send_from_stdin_interrupted_while_a_chunk_is_out_says_it_may_be_out(tmp_path: Path) -> None:
    """Ctrl-C while a chunk waited for a member's acknowledgement exited 130 saying nothing: the lines
    in flight may be out to some members. It says so, with the options that send the rest, and those
    options deliver every line once (the chunk in flight dropped by the member that has it)."""
    if not _syscalls_seen():
        pytest.skip("needs /proc/PID/syscall (x86_64 or aarch64 Linux) to see where the sender waits")
    lines = [f"line {i:04d} " + "x" * 30 for i in range(1, 301)]
    alice = Member(tmp_path, "alice", "api.max_request_bytes=20000")  # chunks of ~100 lines
    bob = Member(tmp_path, "bob")
    try:
        _pair_in_group(alice, bob)
        send = subprocess.Popen([*ZEROCOMM, "--config", str(alice.config), "--timeout", "60", "send", "g", "-"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert send.stdin is not None
            send.stdin.write("\n".join(lines[:150]) + "\n")
            send.stdin.flush()
            wait_for(lambda: _blocked_reading_stdin(send.pid), 30, "the first chunk to be acknowledged")
            bob.stop()  # the next chunk cannot be acknowledged: its publish waits (up to --timeout 60)
            send.stdin.write("\n".join(lines[150:]) + "\n")
            send.stdin.flush()
            wait_for(lambda: _waiting_for_the_agent(send.pid), 30, "the second chunk's publish to wait")
            out, err = _interrupted(send)
        finally:
            if send.poll() is None:
                send.kill()
        first = int(err.split("the first ", 1)[1].split()[0])
        assert f"interrupted (Ctrl-C) (the first {first} line(s) of stdin were sent and acknowledged)" in err, err
        assert f"lines {first + 1}.." in err and "may be out" in err, err
        prefix = err.split("--id-prefix ", 1)[1].split()[0]
        assert f"--id-prefix {prefix} --skip {first}" in err, err
        bob.start()
        rest = alice.ok("send", "g", "-", "--id-prefix", prefix, "--skip", str(first), input="\n".join(lines) + "\n",
                        timeout=120)
        assert len(rest["message_ids"]) == 300 - first
        for m in (alice, bob):
            rows = wait_for(lambda m=m: (lambda r: r if len(r) >= 300 else None)(
                m.run("history", "g", "--all").json_lines), 30, f"{m.name}'s journal to hold every line")
            assert [r["payload"] for r in rows] == lines, m.name  # each line once, in order
    finally:
        alice.stop()
        bob.stop()


def test_a_single_send_interrupted_with_ctrl_c_names_its_message_id_and_how_to_send_it_exactly_once(
        tmp_path: Path) -> None:
    """Ctrl-C while `send GROUP TEXT` waited for a member's acknowledgement exited 130 saying nothing:
    not whether the message went out, nor its id, so the user could not tell whether sending it again
    would deliver it twice. It says on stderr (and with --json in a document on stdout) the message id,
    that its outcome is unknown, and the --id that sends it exactly once; that command does."""
    if not _syscalls_seen():
        pytest.skip("needs /proc/PID/syscall (x86_64 or aarch64 Linux) to see where the sender waits")
    alice = Member(tmp_path, "alice")
    bob = Member(tmp_path, "bob")

    def interrupted_send(*flags: str) -> tuple[str, str]:
        send = subprocess.Popen([*ZEROCOMM, "--config", str(alice.config), "--timeout", "60", *flags, "send", "g",
                                 "hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Waiting for the agent's answer (bob cannot acknowledge), past the quick connect's waits.
            wait_for(lambda: _waiting_for_the_agent(send.pid), 30, "the publish to wait")
            time.sleep(1.0)
            wait_for(lambda: _waiting_for_the_agent(send.pid), 30, "the publish to wait")
            return _interrupted(send)
        finally:
            if send.poll() is None:
                send.kill()

    try:
        _pair_in_group(alice, bob)
        bob.stop()  # the message cannot be acknowledged: the send waits (up to --timeout 60)
        out, err = interrupted_send()
        assert "Traceback" not in err and not out, out + err
        mid = err.split("while sending message id ", 1)[1].split()[0]
        assert f"interrupted (Ctrl-C) while sending message id {mid} to 'g': its outcome is unknown" in err, err
        assert f"run the same command with --id {mid}: a member drops an id it already has" in err, err
        out, err = interrupted_send("--json")
        said = json.loads(out)
        assert said["ok"] is False and said["exit_code"] == 130 and said["outcome"] == "unknown", said
        other = said["message_id"]
        assert other != mid and said["resume_options"] == ["--id", other] and said["error"]["message"] in err, said
        bob.start()
        for each in (mid, other):
            assert alice.ok("send", "g", "hello", "--id", each, timeout=60)["message_ids"] == [each]
        for m in (alice, bob):
            rows = wait_for(lambda m=m: (lambda r: r if len(r) >= 2 else None)(
                m.run("history", "g", "--all").json_lines), 30, f"{m.name}'s journal to hold both messages")
            time.sleep(1.0)
            rows = m.run("history", "g", "--all").json_lines
            assert sorted(r["message_id"] for r in rows) == sorted([mid, other]), m.name  # each once
    finally:
        alice.stop()
        bob.stop()
