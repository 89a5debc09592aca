"""The common options go before or after the command name, as the README says, and add up."""

from __future__ import annotations

import json

import pytest

from zerocomm_spark.agent.cli import build_parser


def test_set_before_and_after_the_command_name_adds_up():
    """`zerocomm --set journal.fsync=always config --set log.level=debug` dropped journal.fsync=always:
    argparse copies a subcommand's own namespace over the top one, so the later --set list replaced
    the earlier one, silently."""
    parse = build_parser().parse_args
    assert parse(["--set", "a.b=1", "config", "--set", "c.d=2"]).settings == ["a.b=1", "c.d=2"]
    assert parse(["--set", "a.b=1", "group", "--set", "c.d=2", "list", "--set", "e.f=3"]).settings == [
        "a.b=1", "c.d=2", "e.f=3"]
    assert parse(["--set", "a.b=1", "history", "sensors", "--set", "c.d=2"]).settings == ["a.b=1", "c.d=2"]
    assert parse(["--set", "a.b=1", "--set", "a.b=2", "config"]).settings == ["a.b=1", "a.b=2"]
    assert parse(["config", "--set", "x.y=1"]).settings == ["x.y=1"]
    assert getattr(parse(["config"]), "settings", None) is None


@pytest.mark.parametrize("argv", [
    ["group", "--json", "list"],
    ["agent", "--json", "status"],
    ["group", "--config", "/tmp/z.toml", "members", "sensors"],
    ["agent", "--timeout", "5", "stop"],
    ["history", "--json", "replay", "sensors", "--table", "/tmp/t"],
    ["history", "--json", "sensors"],
])
def test_common_options_between_agent_or_group_and_its_action(argv):
    """`zerocomm agent --json status` was "unrecognized arguments: --json" and `zerocomm group --config
    PATH list` an "invalid choice" of PATH as the action, while history's took them there."""
    args = build_parser().parse_args(argv)
    assert args.func is not None


def test_the_option_nearest_the_action_wins():
    args = build_parser().parse_args(["--config", "/a.toml", "group", "--config", "/b.toml", "list",
                                      "--timeout", "3"])
    assert args.config == "/b.toml" and args.timeout == 3.0
    args = build_parser().parse_args(["--json", "group", "list"])
    assert args.json is True


@pytest.mark.parametrize("argv", [
    ["group", "create", ""], ["group", "join", " ", "--via", "alice"], ["group", "join", "g", "--via", ""],
    ["send", "", "hi"], ["group", "leave", ""], ["history", "ingest", "", "--table", "/nonexistent/t"],
])
def test_an_empty_group_or_peer_name_is_a_usage_error_said_as_such(argv, capsys):
    """`zerocomm group create "$G"` with G unset reached the agent, which answered with the API's
    words ("create: 'group' must not be empty") and advice about a Client method's signature."""
    from zerocomm_spark.agent.cli import main as zerocomm

    assert zerocomm(["--json", *argv]) == 2
    error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert "is empty (an unset shell variable?)" in error["message"], error


def test_no_agent_and_no_identity_says_to_init_first_not_to_add_spawn(monkeypatch, capsys, tmp_path):
    """On a machine never set up, `zerocomm send g hi` said "start it ..., or add --spawn", and --spawn
    then failed with "holds no identity" (found by a user review): --spawn starts only an existing
    member. It now says to create the identity first; with one, the hint names --spawn as before."""
    from zerocomm_spark.agent.cli import main as zerocomm

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    assert zerocomm(["send", "g", "hi"]) == 3
    err = capsys.readouterr().err
    assert "holds no identity yet" in err and "zerocomm init --label NAME" in err, err
    assert "--spawn" not in err and "zerocomm agent start --detach" in err, err
    assert zerocomm(["--json", "group", "list"]) == 3
    error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert error["type"] == "AgentNotRunningError" and "zerocomm init" in error["hint"], error
