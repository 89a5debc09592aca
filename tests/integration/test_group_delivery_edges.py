"""Group delivery at its edges: a stale entry must not put a join flag back, unordered streams forget
who took skipped messages, a member behind the others counts what it lost at a publisher's restart,
and a listener cannot be registered twice. Agents in this process (real sockets,
real crypto)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_cli_support import wait_for
from zerocomm_spark import Agent
from zerocomm_spark.errors import ConfigurationError, ZeroCommError
from zerocomm_spark.group import datamessage as dm
from zerocomm_spark.group.dataplane import DataPlane, Delivered
from zerocomm_spark.group.manager import GroupConfig, GroupManager
from zerocomm_spark.group.view import ACTIVE, JOINING

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

CONFIG = GroupConfig(digest_interval_s=0.3, resume_timeout_s=3.0)


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[tuple[Agent, Agent]]:
    opened = [Agent.open(tmp_path / n, label=n, group_config=CONFIG) for n in ("alice", "bob")]
    yield opened[0], opened[1]
    for agent in opened:
        agent.close()


def _joining(agent: Agent, group: str, did: str) -> bool:
    return agent.groups.dataplane._group(group).outbox.members()[did].joining  # noqa: SLF001


def test_a_stale_joining_entry_does_not_put_the_join_flag_back_after_apply_cleared_it(
        pair: tuple[Agent, Agent]) -> None:
    """_on_subscribe (or _resume) reads the member's entry, then adds it to the data plane outside the
    lock; an _apply in between merges its active entry and clears the flag. Setting the flag from the
    entry read before left the member "joining" for good: it held no publish window ever after."""
    alice, bob = pair
    alice.groups.create("g")
    bob.groups.join("g", via=bob.accept(alice.invite(), timeout=10), timeout=30)
    bob_did = bob.groups.did
    g = alice.groups._group("g")  # noqa: SLF001
    wait_for(lambda: g.view.get(bob_did).status == ACTIVE and not _joining(alice, "g", bob_did), 10.0,
             "alice to see bob active")
    # The entry the racing subscribe read before the _apply that made bob active ran to its end.
    stale = dataclasses.replace(g.view.get(bob_did), status=JOINING)
    record = alice.groups._connection_for(bob_did)  # noqa: SLF001
    assert record is not None
    alice.groups._add_member(g, stale, record)  # noqa: SLF001 - the rest of the racing subscribe
    assert not _joining(alice, "g", bob_did)


def test_an_unordered_stream_forgets_who_took_a_message_its_publisher_no_longer_holds(
        tmp_path: Path) -> None:
    """One of bob's two listeners raises for "x": the other took it, which is recorded so the re-sent
    "x" goes only to the first. alice restarts and no longer holds "x": bob skips it. Unordered, the
    record stayed until bob left the group (a leak per skipped message)."""
    failing = {"on": True}

    def picky(message: Delivered) -> None:
        if failing["on"] and message.payload == b"x":
            raise OSError("disk full (injected)")

    def prepare(agent: Agent, manager: GroupManager) -> None:
        manager.on_message(lambda m: None)
        manager.on_message(picky)

    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG, prepare_groups=prepare)
    agents = [alice, bob]
    try:
        alice.groups.create("u", ordered=False)
        bob.groups.join("u", via=bob.accept(alice.invite(), timeout=10), timeout=30)
        alice_did = alice.groups.did
        alice.groups.publish("u", [b"x"])
        wait_for(lambda: bob.groups._taken.get(("u", alice_did)), 10.0, "bob's listener to fail on x")  # noqa: SLF001
        alice.close()
        alice = agents[0] = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
        alice.groups.wait_active("u", timeout=20)
        failing["on"] = False
        alice.groups.publish("u", [b"y"]).wait(20)  # past "x": bob skipped it
        wait_for(lambda: bob.groups.dataplane.positions("u").get(alice_did, 0) >= 2, 10.0, "bob past x")
        wait_for(lambda: not bob.groups._taken, 5.0, "bob to forget who took x")  # noqa: SLF001
    finally:
        for agent in agents:
            agent.close()


def test_messages_a_member_behind_the_others_never_got_count_as_lost_after_the_publishers_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """carol (running all along) misses alice's "three" and "four" (the network drops them); bob has
    them. alice restarts and continues after bob's position: carol skips the two, which no member can
    give her now. They were not counted in ``lost``, as if nothing had gone."""
    dropping = {"on": False}
    accept = DataPlane._accept_batch  # noqa: SLF001

    rows: dict[str, list[tuple[str, int, bytes]]] = {}

    def open_(name: str) -> Agent:
        def prepare(agent: Agent, manager: GroupManager) -> None:
            manager.on_messages(lambda ms: rows.setdefault(name, []).extend(
                (m.publisher_did, m.seq, m.payload) for m in ms))

        return Agent.open(tmp_path / name, label=name, group_config=CONFIG, prepare_groups=prepare)

    alice, bob, carol = agents = [open_("alice"), open_("bob"), open_("carol")]
    carol_plane = carol.groups.dataplane

    def lossy(self: DataPlane, g: Any, m: Any, batch: dm.DataBatch) -> None:
        if self is carol_plane and dropping["on"] and m.info.did == alice_did:
            return  # lost on the way (data and resend answers alike)
        accept(self, g, m, batch)

    monkeypatch.setattr(DataPlane, "_accept_batch", lossy)
    try:
        alice.groups.create("g")
        for member in (bob, carol):
            member.groups.join("g", via=member.accept(alice.invite(), timeout=10), timeout=30)
        alice_did = alice.groups.did

        def alices(name: str) -> list[bytes]:
            return [payload for did, _, payload in rows.get(name, []) if did == alice_did]

        alice.groups.publish("g", [b"one", b"two"]).wait(10)
        wait_for(lambda: len(alices("carol")) == 2, 10.0, "carol to get one and two")
        dropping["on"] = True
        alice.groups.publish("g", [b"three", b"four"])
        wait_for(lambda: len(alices("bob")) == 4, 10.0, "bob to get three and four")
        alice.close()
        dropping["on"] = False
        alice = agents[0] = open_("alice")
        alice.groups.wait_active("g", timeout=20)
        alice.groups.publish("g", [b"five", b"six"]).wait(20)
        wait_for(lambda: alices("carol")[-2:] == [b"five", b"six"], 10.0, "carol to get five and six")
        assert alices("carol") == [b"one", b"two", b"five", b"six"]
        assert carol.groups.stats()["lost"] == 2  # three and four: gone for carol, and said so
        assert bob.groups.stats()["lost"] == 0
    finally:
        for agent in agents:
            agent.close()


def test_a_listener_registered_twice_is_refused_and_unregisters_once(pair: tuple[Agent, Agent]) -> None:
    alice, _ = pair
    calls: list[Delivered] = []

    def listener(message: Delivered) -> None:
        calls.append(message)

    for register in (alice.groups.on_message, alice.groups.on_messages, alice.groups.on_superseded):
        remove = register(listener)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="registered already") as info:
            register(listener)  # type: ignore[arg-type]
        assert isinstance(info.value, ZeroCommError) and "unregister" in str(info.value).lower()
        remove()
        remove()  # a second call changes nothing
        register(listener)()  # free again once unregistered


def test_a_bound_method_registered_twice_is_refused_too(pair: tuple[Agent, Agent]) -> None:
    alice, _ = pair

    class Sink:
        def take(self, message: Delivered) -> None:
            pass

    sink = Sink()
    remove = alice.groups.on_message(sink.take)
    with pytest.raises(ConfigurationError, match="registered already"):
        alice.groups.on_message(sink.take)  # a new bound-method object, the same listener
    remove()
    alice.groups.on_message(Sink().take)()  # another object's method is another listener


def test_a_hole_filled_late_in_an_unordered_group_reaches_the_agents_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bob journals as the agent does (the agent's group config, its journal listener). In an unordered
    group he lost alice's "three" on the way and got "four" and "five" first; the repair brought
    "three" after them, and the journal took it as a duplicate (a seq below its publisher's last)
    while bob acknowledged it: gone for good from bob's journal (reviewer's finding). The agent now
    takes each publisher's messages in seq order whatever the group's ordering."""
    from zerocomm_spark.agent.config import load
    from zerocomm_spark.agent.groups import group_config
    from zerocomm_spark.agent.ingest import JournalIngest
    from zerocomm_spark.agent.metrics import Metrics
    from zerocomm_spark.journal import Journal

    agent_config = group_config(load(tmp_path / "none.toml", env={}, missing_ok=True))
    assert agent_config.fifo is True
    journal = Journal.open(tmp_path / "journal", key=bytes(range(32)))
    ingest = JournalIngest(journal, Metrics())
    delivered: list[bytes] = []

    def prepare(agent: Agent, manager: GroupManager) -> None:
        manager.on_messages(ingest.on_messages)
        manager.on_messages(lambda ms: delivered.extend(m.payload for m in ms))

    dropped: list[bool] = []
    accept = DataPlane._accept_batch  # noqa: SLF001

    def loses_three_once(self: DataPlane, g: Any, m: Any, batch: dm.DataBatch) -> None:
        if self is bob_plane and not dropped and any(msg.payload == b"three" for msg in batch.messages):
            dropped.append(True)
            batch = dataclasses.replace(batch, messages=tuple(msg for msg in batch.messages if msg.payload != b"three"))
            if not batch.messages:
                return
        accept(self, g, m, batch)

    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=dataclasses.replace(
        agent_config, digest_interval_s=0.3, resume_timeout_s=3.0, publish_bind=None), prepare_groups=prepare)
    bob_plane = bob.groups.dataplane
    try:
        alice.groups.create("u", ordered=False)
        bob.groups.join("u", via=bob.accept(alice.invite(), timeout=10), timeout=30)
        alice.groups.publish("u", [b"one", b"two"]).wait(10)
        monkeypatch.setattr(DataPlane, "_accept_batch", loses_three_once)
        alice.groups.publish("u", [b"three"])
        wait_for(lambda: dropped, 10.0, "bob to lose three")
        alice.groups.publish("u", [b"four", b"five"]).wait(20)  # acked by bob: three came back before
        assert delivered == [b"one", b"two", b"three", b"four", b"five"]  # in seq order, though unordered
        rows = journal.read(0)
        assert rows.column("payload").to_pylist() == delivered and rows.column("seq").to_pylist() == [1, 2, 3, 4, 5]
    finally:
        bob.close()
        alice.close()
        ingest.close()
        journal.close()
