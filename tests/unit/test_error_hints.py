"""The commands the errors' hints (and the connector's messages) tell a user to run exist.

A hint naming a command the CLI does not have sends a user who is already in trouble to a usage
error: IncompleteReadError said "check `zerocomm members GROUP`" (it is `zerocomm group members`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "zerocomm_spark" / "errors.py", ROOT / "zerocomm_spark" / "client.py",
           *sorted((ROOT / "connector").glob("*.py"))]
PLACEHOLDERS = {"GROUP": "sensors", "PEER": "bob", "URL": "https://example.invalid/x", "PATH": "/tmp/z.toml",
                "DIR": "/tmp/z"}


def _commands() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        # adjacent literals ("... `zerocomm group join GROUP "\n "--via PEER` ...") read as one string
        text = re.sub(r"""(["'])\s*\n\s*[fr]?\1""", "", path.read_text(encoding="utf-8"))
        for command in re.findall(r"`zerocomm ([^`{}]+)`", text):
            found.append((path.name, command.strip()))
    return found


def test_the_hints_name_commands():
    assert any(name == "errors.py" for name, _ in _commands())  # the pattern finds them


@pytest.mark.parametrize("where, command", _commands())
def test_every_command_a_hint_names_parses(where, command):
    argv = [PLACEHOLDERS.get(word, word) for word in command.split()]
    if argv == ["--help"]:
        return
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where} tells users to run `zerocomm {command}`, which the CLI refuses (exit {exc.code})")


def test_a_create_refused_for_a_name_in_use_gives_the_commands_too():
    """`zerocomm group create sensors` of a name in use said "Pick another name, or leave(group) first;
    groups() lists the names in use": Python calls only, where the other group errors name both."""
    from zerocomm_spark.errors import GroupExistsError

    hint = GroupExistsError("this member already has a group named 'sensors'").hint
    assert "`zerocomm group leave GROUP`" in hint and "`zerocomm group list`" in hint, hint
