"""What the zerocomm command prints: aligned tables, safe payload text, a progress line, exit codes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from zerocomm_spark import errors
from zerocomm_spark.agent.cli import EXIT_CODES, build_parser, exit_code_for
from zerocomm_spark.agent.output import (
    Progress,
    emit_json,
    format_payload,
    json_payload,
    render_pairs,
    render_table,
    short_did,
)


def test_tables_are_aligned_under_their_headers() -> None:
    text = render_table([{"a": "x", "b": 1}, {"a": "longer value", "b": None}], [("a", "NAME"), ("b", "N")])
    header, first, second = text.splitlines()
    assert header.index("N", 4) == first.index("1") == second.index("-")
    assert render_table([], [("a", "A")]) == "(none)"


def test_payloads_are_shown_safely() -> None:
    assert format_payload("héllo".encode()) == "héllo"
    assert format_payload(b"\x00\x01\xff") == "<3 bytes: 0001ff>"  # never raw bytes to a terminal
    assert format_payload(b"\x1b[2J") == "\\x1b[2J"  # nor escape sequences: escaped, as Python writes them
    assert format_payload(b"x" * 50, 10) == "xxxxxxx..."
    # text that is UTF-8 stays text, one line: it was hex ("<10 bytes: 6d756c74690a6c696e65>")
    assert format_payload(b"multi\nline") == "multi\\nline"
    assert format_payload("tab\there\r\n\u2028é".encode()) == "tab\there\\r\\n\\u2028é"
    # where escapes are shown a backslash is doubled: a newline and a backslash-n differ there
    assert format_payload(b"a\\nb\nc") == "a\\\\nb\\nc"
    assert format_payload(b"C:\\dir") == "C:\\dir"  # text with nothing to escape is shown as it is
    # only what is shown is escaped: a long text is cut first, then escaped (the same as cut after)
    assert format_payload(b"ab\ncd" * 100_000, 12) == "ab\\ncdab\\..."
    did = "did:peer:2." + "a" * 100
    assert short_did(did).startswith("did:peer") and len(short_did(did)) <= 27


def test_json_payloads_are_exact_and_json_lines_carry_no_raw_controls() -> None:
    text = "a\nb\x1b[2J\x7f\x9bé"
    shaped = json_payload(text.encode())
    assert shaped == {"payload": text, "payload_base64": "YQpiG1sySn/Cm8Op"}
    assert json_payload(b"\xff\x00") == {"payload": "<2 bytes: ff00>", "payload_base64": "/wA="}
    assert json_payload(None) == {"payload": None, "payload_base64": None}
    out = io.StringIO()
    emit_json(shaped, out)
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    assert not any(c in line for c in ("\x1b", "\x7f", "\x9b"))  # escaped: \u001b, \u007f, \u009b
    assert json.loads(line) == shaped and "é" in line  # other text stays readable


def test_text_from_peers_reaches_no_terminal_raw(capsys) -> None:  # type: ignore[no-untyped-def]
    """Labels, basic messages and error texts come from peers: their escape sequences are shown escaped."""
    label = "mallory\x1b]0;title\x07\u202e"
    table = render_table([{"label": label, "n": 1}, {"label": "bob", "n": 2}], [("label", "LABEL"), ("n", "N")])
    pairs = render_pairs([("label", label), ("héllo", "wörld")])
    for text in (table, pairs):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
        assert "mallory\\x1b]0;title\\x07\\u202e" in text
    assert "wörld" in pairs  # printable text, accents included, is left alone
    header, first, second = table.splitlines()
    assert header.index("N") == first.rindex("1") == second.rindex("2")  # aligned on what is printed
    from zerocomm_spark.agent.cli import _report_error

    _report_error(errors.ApiError("a peer said \x1b[2Jno", hint="line one\nline two"), False)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[2Jno" in err and "line one\nline two" in err


def test_progress_shows_phase_and_fraction_only_on_terminals() -> None:
    quiet = Progress("joining g", stream=io.StringIO())
    assert quiet.enabled is False  # a StringIO is no terminal: scripts see nothing
    progress = Progress("joining g", stream=io.StringIO(), enabled=True)
    progress.update({"phase": "subscribing", "done": 5, "total": 10})
    line = progress.line(0)
    assert "joining g" in line and "subscribing" in line and "5/10" in line and "#" * 10 + "." * 10 in line


@pytest.mark.parametrize(("exc", "code"), [
    (errors.AgentNotRunningError("x"), 3),
    (errors.ApiTimeoutError("x"), 4),
    (errors.PeerTimeoutError("x"), 4),
    (errors.AgentAlreadyRunningError("x"), 5),
    (errors.GroupNotFoundError("x"), 6),
    (errors.ConnectionNotFoundError("x"), 6),
    (errors.ApiPermissionError("x"), 7),
    (errors.ConfigurationError("x"), 2),
    (errors.UnknownCallError("x"), 2),
    (errors.InvalidGroupNameError("x"), 2),  # a wrong argument, like any usage error
    (errors.JoinRefusedError("x"), 1),
])
def test_exit_codes(exc: BaseException, code: int) -> None:
    assert exit_code_for(exc) == code
    assert code in EXIT_CODES


def test_every_command_takes_json_and_the_common_options() -> None:
    parser = build_parser()
    for argv in (["agent", "status", "--json"], ["--json", "group", "members", "g"], ["send", "g", "m", "--json"],
                 ["tail", "g", "--config", "x.toml", "--timeout", "3"], ["history", "g", "--set", "log.level=debug"]):
        args = parser.parse_args(argv)
        assert callable(args.func)
    assert parser.parse_args(["agent", "status", "--json"]).json is True
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["group", "join", "g"])  # --via is required
    assert info.value.code == 2


def test_an_endless_timeout_flag_is_a_usage_error(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from zerocomm_spark.agent.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    code = main(["--identity-dir", str(tmp_path / "id"), "--json", "--timeout", "inf", "group", "list"])
    out = capsys.readouterr().out
    assert code == 2 and "--timeout" in json.loads(out)["error"]["message"]


def test_send_from_stdin_with_one_id_is_a_usage_error(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """One --id for many lines: the first line would go out and the rest be dropped as its duplicates."""
    import io

    from zerocomm_spark.agent.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    code = main(["--identity-dir", str(tmp_path / "id"), "--json", "send", "g", "-", "--id", "x-1"])
    out = capsys.readouterr().out
    assert code == 2 and "--id" in json.loads(out)["error"]["message"]


def test_a_usage_error_under_json_is_json_on_stdout(capsys) -> None:  # type: ignore[no-untyped-def]
    """A script that asked for --json got nothing on stdout for a usage error (argparse's text went to
    stderr only); it now gets the same error object as every other failure, exit code 2."""
    from zerocomm_spark.agent.cli import main

    code = main(["--json", "group", "join", "g"])  # --via is required
    captured = capsys.readouterr()
    answer = json.loads(captured.out)
    assert code == 2 and answer["ok"] is False and answer["exit_code"] == 2
    assert "--via" in answer["error"]["message"] and "--via" in captured.err
    with pytest.raises(SystemExit) as info:  # without --json: argparse as before
        main(["group", "join", "g"])
    assert info.value.code == 2


def test_paths_that_cannot_be_written_are_clear_errors_not_tracebacks(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """A log.file or --config that cannot be written (a directory, a missing or read-only parent)
    ended in a Python traceback, with nothing on stdout under --json."""
    import subprocess
    import sys

    from zerocomm_spark.agent.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    identity = ["--identity-dir", str(tmp_path / "id")]
    not_a_file = f"log.file={tmp_path}"  # a directory
    code = main(["--json", *identity, "--set", not_a_file, "agent", "start", "--detach"])
    answer = json.loads(capsys.readouterr().out)
    assert code == 2 and answer["error"]["type"] == "ConfigurationError", answer
    assert f"cannot open the agent's log file {tmp_path}" in answer["error"]["message"]
    assert "log.file" in answer["error"]["hint"]
    # the same in the foreground (a process of its own: a foreground start ends with os._exit)
    done = subprocess.run([sys.executable, "-m", "zerocomm_spark.agent", "--json", *identity, "--set", not_a_file,
                           "agent", "start"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["error"]["type"] == "ConfigurationError"
    # init: the identity is made, then the configuration file cannot be written
    blocker = tmp_path / "plain-file"
    blocker.write_text("")
    code = main(["--json", *identity, "--config", str(blocker / "zerocomm.toml"), "init"])
    answer = json.loads(capsys.readouterr().out)
    assert code == 2 and "cannot be written" in answer["error"]["message"], answer
    assert "--config" in answer["error"]["hint"]


def test_tail_names_publishers_through_the_agent_it_follows_after_a_restart(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """tail looked labels up through the client it started with; after following the agent across a
    restart that client was closed, so every publisher first seen after it showed as a bare DID."""
    import types

    import pyarrow as pa

    from zerocomm_spark.agent import cli
    from zerocomm_spark.client import ReadResult

    carol = "did:example:" + "c" * 60

    class Old:
        closed = False

        def latest(self) -> dict[str, int]:
            return {"next_offset": 0}

        def groups(self) -> list[dict[str, str]]:  # tail first checks the member knows the group
            return [{"group": "g"}]

        def members(self, group: str, timeout: float, include_left: bool = False) -> list[dict[str, str]]:
            if self.closed:
                raise errors.ClientClosedError("the client is closed")
            return []

        def fetch(self, **kwargs: object) -> ReadResult:
            raise errors.AgentNotRunningError("the agent stopped")

    class New:
        fetched = 0

        def members(self, group: str, timeout: float, include_left: bool = False) -> list[dict[str, str]]:
            return [{"did": carol, "label": "carol"}]

        def fetch(self, **kwargs: object) -> ReadResult:
            self.fetched += 1
            if self.fetched > 1:
                raise KeyboardInterrupt  # ends the test's tail
            row = {"offset": 0, "group": "g", "message_id": "m1", "publisher_did": carol, "seq": 1, "lamport_ts": 1,
                   "sent_at": 0, "received_at": 0, "headers": None, "payload": b"hi"}
            return ReadResult(table=pa.Table.from_pylist([row]), next_offset=1, end_offset=1)

    old, new = Old(), New()
    ctx = types.SimpleNamespace(args=types.SimpleNamespace(group="g", lines=0, no_follow=False), json=True,
                                _client=old, client=lambda: old)

    def restarted(ctx_: object, client: Old) -> New:
        client.closed = True
        return new

    monkeypatch.setattr(cli, "_wait_for_restart", restarted)
    with pytest.raises(KeyboardInterrupt):
        cli.cmd_tail(ctx)  # type: ignore[arg-type]
    assert json.loads(capsys.readouterr().out)["publisher_label"] == "carol"


def test_the_stop_command_printed_by_a_detached_start_stops_that_agent(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """The printed command must work pasted as is: a --config path with a space split into two
    arguments, and an agent started with --identity-dir (no file) was told `zerocomm agent stop`,
    which addresses the default identity's agent instead."""
    import shlex

    from zerocomm_spark.agent import cli, daemon

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    config = tmp_path / "my conf" / "z.toml"
    identity = tmp_path / "their id"
    config.parent.mkdir()
    config.write_text("[journal]\nfsync = \"always\"\n")
    monkeypatch.setattr(daemon, "start_detached", lambda cfg, timeout=None, **how: {"label": "x", "pid": 1})
    assert cli.main(["--config", str(config), "--identity-dir", str(identity), "agent", "start", "--detach"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stop it with: "))
    argv = shlex.split(line.removeprefix("stop it with: "))
    assert argv[0] == "zerocomm" and argv[-2:] == ["agent", "stop"]
    stopping = cli.Ctx(build_parser().parse_args(argv[1:]))
    assert stopping.config_path == str(config) and stopping.config.identity_dir == identity


@pytest.mark.parametrize("raised, code", [(PermissionError(13, "Permission denied", "/srv/x"), 7),
                                          (TimeoutError("timed out"), 4),
                                          (FileNotFoundError(2, "No such file or directory", "/srv/y"), 1)])
def test_a_local_os_error_exits_with_the_documented_code(raised: OSError, code: int, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                         capsys) -> None:
    """A local PermissionError or TimeoutError (an OSError) was said like any other error, exit 1:
    their documented codes are 7 (permission denied) and 4 (a deadline passed)."""
    from zerocomm_spark.agent import cli

    def failing(ctx: object) -> int:
        raise raised

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(cli, "cmd_config", failing)
    assert cli.main(["--identity-dir", str(tmp_path / "id"), "--json", "config"]) == code
    answer = json.loads(capsys.readouterr().out)
    assert answer["exit_code"] == code and type(raised).__name__ in answer["error"]["message"]


def test_the_help_examples_show_what_the_commands_do() -> None:
    """`zerocomm --help` showed `connect 'tcp://...?oob=...'` (an invitation is an https://...?oob= URL)
    and tail "like tail -f" (it follows across agent restarts: tail -F, as the README says)."""
    from zerocomm_spark.protocols.out_of_band.v1_1.messages import DEFAULT_URL_BASE

    parser = build_parser()
    text = parser.format_help()
    scheme = DEFAULT_URL_BASE.split("//")[0]
    assert scheme == "https:" and f"zerocomm connect '{scheme}//...?oob=...'" in text
    assert "tail -f" not in text and "like tail -F" in text
    tail = parser._subparsers._group_actions[0].choices["tail"]  # noqa: SLF001
    assert "tail -f" not in tail.format_help() and "tail -F" in tail.format_help()


def test_not_found_hints_name_the_command_too() -> None:
    """The CLI prints an error's hint as "what to do"; for a missing group or connection it named only
    the Python calls (join(group, via=connection), agent.accept(url)), as ReadOnlyMemberError's does not."""
    from zerocomm_spark import errors

    assert "zerocomm group join" in errors.GroupNotFoundError("x").hint
    assert "zerocomm group list" in errors.GroupNotFoundError("x").hint
    assert "zerocomm connect" in errors.ConnectionNotFoundError("x").hint
    assert "zerocomm connections" in errors.ConnectionNotFoundError("x").hint


def test_an_errors_message_is_its_text_without_the_hint() -> None:
    exc = errors.ConfigurationError("bad value", hint="Fix it")
    assert str(exc) == "bad value. Fix it" and exc.message == "bad value" and exc.hint == "Fix it"
    assert errors.ZeroCommError("plain").message == "plain"
    assert errors.ConfigurationError("uses the class hint").message == "uses the class hint"


def test_json_output_escapes_lone_surrogates() -> None:
    """A string from argv or the environment with undecodable bytes (surrogateescape) was written raw:
    bytes that are not UTF-8, so the line was not JSON a strict parser takes."""
    out = io.BytesIO()
    stream = io.TextIOWrapper(out, encoding="utf-8", errors="surrogateescape")
    emit_json({"warning": "ignored ZEROCOMM_X\udcff"}, stream)
    stream.flush()
    assert json.loads(out.getvalue().decode("utf-8")) == {"warning": "ignored ZEROCOMM_X\udcff"}


@pytest.mark.parametrize(("argv", "stdin", "message"), [
    (["connect", "-"], "\n  \n", "stdin holds no invitation URL"),
    (["message", "bob", "-"], "", "stdin holds no message text"),
    (["message", "bob", "-"], "bad \udcff\n", "not UTF-8 text"),
    (["message", "bob", "-"], "x" * ((1 << 20) + 1), "more than 1048576 characters"),
])
def test_text_from_stdin_that_cannot_be_sent_is_refused_before_the_agent_is_asked(  # type: ignore[no-untyped-def]
        tmp_path, monkeypatch, capsys, argv, stdin, message) -> None:
    from zerocomm_spark.agent.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(["--identity-dir", str(tmp_path / "id"), "--json", *argv])  # no agent runs: it would be exit 3
    error = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and message in error["message"], error


def test_send_from_stdin_line_ids_are_the_same_for_the_same_prefix_line_and_text() -> None:
    """`send -` makes each line's id, so that the same input sent again with the same prefix drops
    what went out (the resume an interrupted send names); a changed line, another group or another
    line number is another message."""
    from zerocomm_spark.agent.cli import line_id

    one = line_id("p1", "g", 7, "hello")
    assert one == line_id("p1", "g", 7, "hello") and one.startswith("p1-7-")
    assert len({one, line_id("p1", "g", 7, "hello!"), line_id("p1", "h", 7, "hello"), line_id("p1", "g", 8, "hello"),
                line_id("p2", "g", 7, "hello")}) == 5


def test_send_id_prefix_and_skip_are_checked(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import io

    from zerocomm_spark.agent.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr("sys.stdin", io.StringIO("one\n"))
    for bad in ("a b", "", "x" * 65, "a;rm"):
        code = main(["--identity-dir", str(tmp_path / "id"), "--json", "send", "g", "-", "--id-prefix", bad])
        assert code == 2 and "id prefix" in json.loads(capsys.readouterr().out)["error"]["message"], bad
    code = main(["--identity-dir", str(tmp_path / "id"), "--json", "send", "g", "text", "--id-prefix", "p"])
    assert code == 2 and "go with -" in json.loads(capsys.readouterr().out)["error"]["message"]


def _send_failing_with(raised: Exception, argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str], stdin: str | None = None) -> tuple[int, dict]:
    """`zerocomm --json ARGV` against a client whose publish raises ``raised``: exit code and error document."""
    from zerocomm_spark.agent import cli

    class Fake:
        max_request_bytes = 1 << 20

        def publish(self, *args: object, **kwargs: object) -> None:
            raise raised

    fake = Fake()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(cli.Ctx, "client", lambda self: fake)
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = cli.main(["--identity-dir", str(tmp_path / "id"), "--json", *argv])
    return code, json.loads(capsys.readouterr().out)["error"]


@pytest.mark.parametrize("raised", [
    errors.AgentNotRunningError("the agent at ipc:///run/api.sock stopped before it answered publish",
                                hint="The outcome is unknown: start the agent again and retry"),
    errors.GroupError("group 'g' was closed before its messages were acked"),
    errors.MessagesDroppedError("messages of seqs 1-3 in group 'g' were dropped before these members acked them"),
])
def test_a_send_from_stdin_whose_first_chunk_may_be_out_names_its_prefix(raised, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                          capsys) -> None:
    """An error raised after the chunk was handed to the group (the agent stopped before it answered,
    the group closed before every member acked, retention dropped it for some members) was taken
    for a refusal that sent nothing: with no chunk acknowledged before, the error named no prefix,
    so the same command run again gave every line a new id and members that had the chunk got it twice."""
    code, error = _send_failing_with(raised, ["send", "g", "-", "--id-prefix", "p1"], tmp_path, monkeypatch, capsys,
                                     stdin="one\ntwo\nthree\n")
    assert code != 0
    assert "lines 1..3 may be out" in error["message"], error
    assert "--id-prefix p1" in error["hint"] and "--skip" not in error["hint"], error


@pytest.mark.parametrize("raised", [errors.BackpressureError("members are slow"),
                                    errors.GroupNotFoundError("no group 'g'"),
                                    errors.AgentBusyError("busy")])
def test_a_send_from_stdin_refused_before_anything_went_out_is_the_same_command_again(  # type: ignore[no-untyped-def]
        raised, tmp_path, monkeypatch, capsys) -> None:
    code, error = _send_failing_with(raised, ["send", "g", "-"], tmp_path, monkeypatch, capsys,
                                     stdin="one\ntwo\nthree\n")
    assert code != 0 and "may be out" not in error["message"] and "--id-prefix" not in error["hint"], error


def test_a_send_from_stdin_interrupted_during_a_chunk_says_it_may_be_out_and_how_to_resume(  # type: ignore[no-untyped-def]
        tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C while a chunk was being published exited 130 saying nothing; it says on stderr how many
    lines were acknowledged, that the chunk in flight may be out, and the options that resume."""
    from zerocomm_spark.agent import cli
    from zerocomm_spark.client import PublishResult

    class Interrupted:
        max_request_bytes = 600  # chunks of two lines

        def __init__(self) -> None:
            self.calls = 0

        def publish(self, group, lines, *, message_ids, **kwargs):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.calls == 2:
                raise KeyboardInterrupt  # as the client's wait for the agent's answer is interrupted
            return PublishResult(group, list(message_ids), list(range(1, len(lines) + 1)))

    fake = Interrupted()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(cli.Ctx, "client", lambda self: fake)
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"line {i} {'x' * 60}\n" for i in range(1, 7))))
    code = cli.main(["--identity-dir", str(tmp_path / "id"), "--json", "send", "g", "-", "--id-prefix", "p1",
                     "--skip", "1"])
    said = capsys.readouterr()
    assert code == 130 and fake.calls == 2, said
    document = json.loads(said.out)  # --json: the same facts for a script, on stdout
    assert (document["ok"], document["exit_code"], document["acknowledged_lines"], document["in_flight_lines"],
            document["resume_options"]) == (False, 130, 3, [4, 5], ["--id-prefix", "p1", "--skip", "3"]), document
    assert "interrupted (Ctrl-C) (the first 3 line(s) of stdin were sent and acknowledged, 2 by this run)" in said.err
    assert "lines 4..5 may be out (the outcome is unknown)" in said.err, said.err
    assert "--id-prefix p1 --skip 3 (in place of yours)" in said.err, said.err
    # The first chunk in flight, none acknowledged: the run's own prefix, nothing to skip.
    monkeypatch.setattr("sys.stdin", io.StringIO("only\n"))
    fake.calls = 1
    assert cli.main(["--identity-dir", str(tmp_path / "id"), "send", "g", "-"]) == 130
    err = capsys.readouterr().err
    assert "line 1 may be out" in err and "--id-prefix " in err and "--skip" not in err, err

    class Waiting(io.StringIO):  # Ctrl-C while waiting for the first line: nothing went out
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

    monkeypatch.setattr("sys.stdin", Waiting())
    assert cli.main(["--identity-dir", str(tmp_path / "id"), "send", "g", "-"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "No line of stdin was sent" in err and "--id-prefix" not in err, err


@pytest.mark.parametrize("raised", [
    errors.AgentNotRunningError("the agent at ipc:///run/api.sock stopped before it answered publish",
                                hint="The outcome is unknown: start the agent again and retry"),
    errors.GroupError("group 'g' was closed before its messages were acked"),
    errors.PeerTimeoutError("1 member(s) did not ack seq 3 of group 'g' within 3s: bob"),
])
def test_a_send_that_may_be_out_names_its_id_quoted_for_the_shell(raised, tmp_path, monkeypatch,  # type: ignore[no-untyped-def]
                                                                  capsys) -> None:
    """`send GROUP TEXT` that ended once the message may be out (the agent gone before it answered, the
    group closed before every member acked) named no id, so the same command again was a second
    message for members that had it; and the id the hint printed into a command was not quoted."""
    import shlex

    mid = "order 7; $(id)"
    code, error = _send_failing_with(raised, ["send", "g", "hello", "--id", mid], tmp_path, monkeypatch, capsys)
    assert code != 0 and f"(message id {mid})" in error["message"], error
    assert f"--id {shlex.quote(mid)}:" in error["hint"], error


def test_send_from_stdin_strips_a_crlf_line_ending_before_the_line_is_sent_or_hashed(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`printf 'e3\\r\\n' | zerocomm send g -` published "e3\\r": a CRLF ending is an ending. The id's
    hash is of the text sent, so a resume of a CRLF file gives the same ids as its first run."""
    from zerocomm_spark.agent.cli import _line_text, _stdin_chunks, line_id

    assert [_line_text(x) for x in ("e3\r\n", "e3\n", "e3", "a\rb\n", "e3\r\r\n", "\r\n")] == [
        "e3", "e3", "e3", "a\rb", "e3\r", ""]
    monkeypatch.setattr("sys.stdin", io.StringIO("e1\r\ne2\r\ne3\r"))
    chunks = list(_stdin_chunks(lambda: 1 << 20, "g", "p", 1))
    assert chunks == [(["e2", "e3\r"], [line_id("p", "g", 2, "e2"), line_id("p", "g", 3, "e3\r")])]


def test_send_from_a_paused_stdin_sends_the_lines_read_before_more_come(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A real pipe that stays open: its first lines form a chunk once stdin pauses, not at 10,000 lines
    or EOF; lines and their numbers are what `for line in sys.stdin` gives, a line cut across writes
    included (--skip counts lines, never pauses)."""
    import os
    import threading

    from zerocomm_spark.agent.cli import _stdin_chunks, line_id

    read_fd, write_fd = os.pipe()
    stdin = open(read_fd, encoding="utf-8", closefd=True)  # noqa: SIM115 - closed below
    monkeypatch.setattr("sys.stdin", stdin)
    chunks = _stdin_chunks(lambda: 1 << 20, "g", "p", 1)
    os.write(write_fd, "skipped\nfirst\nsec".encode())
    got: list = []
    reader = threading.Thread(target=lambda: got.append(next(chunks)), daemon=True)
    reader.start()
    reader.join(10)
    try:
        assert got == [(["first"], [line_id("p", "g", 2, "first")])]  # out while stdin is still open
        os.write(write_fd, "ond\r\nthird".encode())
        os.close(write_fd)
        write_fd = -1
        assert list(chunks) == [(["second", "third"], [line_id("p", "g", 3, "second"), line_id("p", "g", 4, "third")])]
    finally:
        if write_fd >= 0:  # failed: end stdin, so a reader still blocked in it returns
            os.close(write_fd)
        reader.join(10)
        stdin.close()
