"""A member that leaves a group and joins it again, as real agent processes: its new messages continue
its sequence, so no member's journal takes them for ones it already holds (they were dropped, and
acknowledged, as duplicates: lost without a trace)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli_support import Member, running, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[list[Member]]:
    with running(tmp_path, "alice", "bob") as members:
        yield members


def _bob_rows(member: Member) -> list[tuple[int, str]]:
    return [(r["seq"], r["payload"]) for r in member.run("history", "g").json_lines if r["publisher_label"] == "bob"]


def _rejoin(alice: Member, bob: Member) -> None:
    bob.ok("group", "join", "g", "--via", "alice")
    wait_for(lambda: sorted(x["label"] for x in alice.ok("group", "members", "g") if x["status"] == "active")
             == ["alice", "bob"], 20, "alice to see bob active again")


def test_a_rejoining_member_continues_its_sequence(pair: list[Member]) -> None:
    alice, bob = pair
    alice.ok("group", "create", "g", "--mode", "shared")
    bob.ok("connect", alice.ok("invite")["url"])
    _rejoin(alice, bob)
    assert bob.ok("send", "g", "one")["seqs"] == [1]
    assert bob.ok("send", "g", "-", input="two\nthree\n")["seqs"] == [2, 3]

    # Leave and join again in the same agent process.
    assert bob.ok("group", "leave", "g")["left"] is True
    wait_for(lambda: [x["label"] for x in alice.ok("group", "members", "g")] == ["alice"], 20, "alice to drop bob")
    _rejoin(alice, bob)
    assert bob.ok("send", "g", "four")["seqs"] == [4]

    # Leave, restart the agent (a new process, the group's records gone), join again.
    assert bob.ok("group", "leave", "g")["left"] is True
    wait_for(lambda: [x["label"] for x in alice.ok("group", "members", "g")] == ["alice"], 20, "alice to drop bob")
    bob.stop()
    bob.start()
    _rejoin(alice, bob)
    sent = bob.ok("send", "g", "five")
    assert sent["seqs"] == [5] and sent["journaled"] is True

    expected = [(1, "one"), (2, "two"), (3, "three"), (4, "four"), (5, "five")]
    for m in (alice, bob):
        wait_for(lambda m=m: _bob_rows(m) == expected, 20, f"{m.name}'s history to hold all of bob's messages")
