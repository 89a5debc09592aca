"""A member that comes back to a group must continue its sequence after anything a member still
holds of its old stream, or that member takes new messages for old ones (dropped as duplicates,
and acked); and its Lamport clock after every stamp it issued, or its new messages sort before its
old ones (the clock started again at 0 after a restart: the test at the end). Two agents in this process (real sockets, real crypto); see test_rejoin.py for the
agent-process version with the CLI journal."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_cli_support import wait_for
from zerocomm_spark import Agent
from zerocomm_spark.errors import JoinRefusedError
from zerocomm_spark.group import manager as manager_module
from zerocomm_spark.group.datamessage import MAX_SEQ
from zerocomm_spark.group.manager import GroupConfig, GroupManager
from zerocomm_spark.group.policy import AllowListPolicy, OpenPolicy
from zerocomm_spark.group.store import LEFT_KIND

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

CONFIG = GroupConfig(digest_interval_s=0.3, resume_timeout_s=3.0)


class _Pair:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.alice = Agent.open(root / "alice", label="alice", group_config=CONFIG)
        self.bob = Agent.open(root / "bob", label="bob", group_config=CONFIG)

    def reopen_bob(self) -> Agent:
        self.bob.close()
        self.bob = Agent.open(self.root / "bob", label="bob", group_config=CONFIG)
        return self.bob

    def close(self) -> None:
        for agent in (self.alice, self.bob):
            agent.close()


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[_Pair]:
    p = _Pair(tmp_path)
    yield p
    p.close()


def _payloads(agent: Agent, group: str, publisher: str) -> list[tuple[int, bytes]]:
    return [(m.seq, m.payload) for m in agent.groups.messages(group) if m.publisher_did == publisher]


def _leave_unheard(bob: Agent, group: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bob leaves, but alice never hears of it (down then, or the messages lost), and bob's identity
    keeps no record of its last seq there (a store from before such records were kept): alice still
    holds bob's old stream, and only her subscribe answer can tell bob where it stands."""
    gm = bob.groups
    with monkeypatch.context() as patch:
        patch.setattr(gm, "_push", lambda g, make, timeout: list(g.record.peers))
        patch.setattr(gm, "_announce", lambda g: None)
        gm.leave(group)
    gm._keystore.delete_record(LEFT_KIND, group)  # noqa: SLF001


def test_a_rejoiner_continues_after_the_position_a_member_reports(pair: _Pair,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    alice, bob = pair.alice, pair.bob
    alice.groups.create("g")
    via = bob.accept(alice.invite(), timeout=10)
    bob.groups.join("g", via=via, timeout=30)
    bob.groups.publish("g", [b"one", b"two", b"three"]).wait(10)
    bob_did = bob.groups.did
    wait_for(lambda: len(_payloads(alice, "g", bob_did)) == 3, 10.0, "alice to get bob's messages")

    _leave_unheard(bob, "g", monkeypatch)
    bob = pair.reopen_bob()  # a new process: nothing of the old sequence is left in memory
    assert bob.groups.did == bob_did
    assert alice.groups.dataplane.positions("g").get(bob_did) == 3  # alice still holds the old stream

    bob.groups.join("g", via=via.id, timeout=30)
    receipt = bob.groups.publish("g", [b"four"])
    assert receipt.seqs == (4,)  # after the position alice reported, not 1 again
    receipt.wait(10)
    wait_for(lambda: _payloads(alice, "g", bob_did)[-1:] == [(4, b"four")], 10.0, "alice to get bob's new message")


def test_a_rejoiner_continues_after_messages_a_member_holds_back(pair: _Pair,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """alice got bob's seq 1 and 3 but not 2 (held back, ordered): she reports 1 delivered, yet holds
    3. A sequence continuing at 2 fills her hole with a new message, releases the old 3 after it and
    drops bob's new 3 as a duplicate (acked: bob's receipt resolves, the message is lost)."""
    alice, bob = pair.alice, pair.bob
    alice.groups.create("g")
    via = bob.accept(alice.invite(), timeout=10)
    bob.groups.join("g", via=via, timeout=30)
    bob_did = bob.groups.did
    plane = alice.groups.dataplane
    accept = plane._accept_batch  # noqa: SLF001

    def lose_seq_2(g: Any, m: Any, batch: Any) -> None:
        if not (batch.messages and batch.messages[0].seq == 2):
            accept(g, m, batch)

    monkeypatch.setattr(plane, "_accept_batch", lose_seq_2)
    bob.groups.publish("g", [b"one"]).wait(10)
    bob.groups.publish("g", [b"two"])
    time.sleep(0.3)  # its own batch
    bob.groups.publish("g", [b"three"])

    def held() -> bool:
        with plane._rx_lock:  # noqa: SLF001
            stream = plane._groups["g"].streams.get(bob_did)  # noqa: SLF001
            return stream is not None and stream.delivered == 1 and stream.held_count == 1

    wait_for(held, 10.0, "alice to hold bob's seq 3 back")

    _leave_unheard(bob, "g", monkeypatch)
    bob = pair.reopen_bob()
    monkeypatch.setattr(plane, "_accept_batch", accept)
    bob.groups.join("g", via=via.id, timeout=30)
    first = bob.groups.publish("g", [b"four"])
    second = bob.groups.publish("g", [b"five"])
    assert first.seqs[0] > 3, first.seqs
    second.wait(10)
    wait_for(lambda: [p for _, p in _payloads(alice, "g", bob_did)] == [b"one", b"three", b"four", b"five"],
             10.0, "alice to get bob's new messages after the old ones")


def test_a_leave_while_resuming_stays_left(pair: _Pair) -> None:
    """bob restarts while alice is down, so his resume waits for her; he leaves meanwhile. The
    resume finishing must not bring the group back (at the next restart, or as an open data-plane
    group that refuses a new join), and the leave must remember bob's last seq there."""
    alice, bob = pair.alice, pair.bob
    alice.groups.create("g")
    via = bob.accept(alice.invite(), timeout=10)
    bob.groups.join("g", via=via, timeout=30)
    bob.groups.publish("g", [b"one", b"two"]).wait(10)
    bob_did = bob.groups.did
    bob.close()
    alice.close()  # bob's resume waits resume_timeout_s for her

    bob = pair.bob = Agent.open(pair.root / "bob", label="bob", group_config=CONFIG)
    assert bob.groups.groups() == ["g"]
    bob.groups.leave("g", timeout=1.0)
    assert bob.groups.groups() == []
    time.sleep(CONFIG.resume_timeout_s + 2.0)  # the resume ends meanwhile
    assert bob.groups.groups() == []
    assert bob.groups._store.get("g") is None  # noqa: SLF001
    assert "g" not in bob.groups.dataplane._groups  # noqa: SLF001
    assert bob.groups._store.left_position("g") == 2  # noqa: SLF001

    bob = pair.reopen_bob()
    assert bob.groups.groups() == []  # not resumed again
    pair.alice = Agent.open(pair.root / "alice", label="alice", group_config=CONFIG)
    pair.alice.groups.wait_active("g", 20)
    bob.groups.join("g", via=via.id, timeout=30)
    receipt = bob.groups.publish("g", [b"three"])
    assert receipt.seqs == (3,)
    receipt.wait(10)
    assert bob.groups.did == bob_did


def test_a_failed_rejoin_keeps_the_position_members_reported(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """bob's first join again fails (carol, who joined after he left, refuses him) after alice
    reported bob's old stream; the failed join tells alice to drop bob, so she forgets it. bob must
    remember it himself, or his next join starts at seq 1 again, below what journals hold."""
    alice, bob, carol = (Agent.open(tmp_path / n, label=n, group_config=CONFIG) for n in ("alice", "bob", "carol"))
    agents = [alice, bob, carol]
    try:
        alice.groups.create("g")
        via = bob.accept(alice.invite(), timeout=10)
        bob.groups.join("g", via=via, timeout=30)
        bob.groups.publish("g", [b"one", b"two", b"three"]).wait(10)
        bob_did = bob.groups.did
        _leave_unheard(bob, "g", monkeypatch)
        carol.groups.join("g", via=carol.accept(alice.invite(), timeout=10), timeout=30)  # bob is not there
        bob.close()
        bob = agents[1] = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG)

        carol.groups.set_policy("g", AllowListPolicy([alice.groups.did]))
        with pytest.raises(JoinRefusedError):
            bob.groups.join("g", via=via.id, timeout=30)
        assert bob.groups.groups() == []
        wait_for(lambda: bob_did not in alice.groups.dataplane.positions("g"), 10.0, "alice to drop bob")

        carol.groups.set_policy("g", OpenPolicy())
        bob.groups.join("g", via=via.id, timeout=30)
        receipt = bob.groups.publish("g", [b"four"])
        assert receipt.seqs == (4,)
        receipt.wait(10)
    finally:
        for agent in agents:
            agent.close()


def test_a_failed_join_tells_the_members_that_accepted_it_in_parallel(tmp_path: Path) -> None:
    """alice and carol accept bob's subscribe, dave refuses it: the withdrawn join is pushed to both
    at once (one after another, members slow to answer held the failed join N x the push timeout)."""
    names = ("alice", "bob", "carol", "dave")
    alice, bob, carol, dave = agents = [Agent.open(tmp_path / n, label=n, group_config=CONFIG) for n in names]
    try:
        alice.groups.create("g")
        for member in (carol, dave):
            member.groups.join("g", via=member.accept(alice.invite(), timeout=10), timeout=30)
        dave.groups.set_policy("g", AllowListPolicy([alice.groups.did, carol.groups.did]))
        via = bob.accept(alice.invite(), timeout=10)
        real = bob.deliver
        told: list[float] = []

        def slow(connection: Any, message: Any, timeout: float) -> Any:
            if type(message).__name__ == "Leave":
                time.sleep(2.0)  # a member slow to take it
                told.append(time.monotonic())
            return real(connection, message, timeout)

        bob.groups._agent.deliver = slow  # type: ignore[method-assign]  # noqa: SLF001
        with pytest.raises(JoinRefusedError):
            bob.groups.join("g", via=via, timeout=30)
        assert len(told) == 2 and told[1] - told[0] < 1.0
    finally:
        for agent in agents:
            agent.close()


def test_a_position_past_any_usable_seq_does_not_break_the_joiners_stream(
        pair: _Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A faulty or hostile member answers the subscribe with position 2**63-1: continuing after it
    would give the joiner seqs no member accepts (every batch dropped as malformed, forever)."""
    alice, bob = pair.alice, pair.bob
    alice.groups.create("g")
    monkeypatch.setattr(alice.groups.dataplane, "stream_position", lambda group, did: MAX_SEQ)
    bob.groups.join("g", via=bob.accept(alice.invite(), timeout=10), timeout=30)
    receipt = bob.groups.publish("g", [b"hello"])
    receipt.wait(10)
    wait_for(lambda: _payloads(alice, "g", bob.groups.did) == [(receipt.seqs[0], b"hello")],
             10.0, "alice to get bob's message")


def test_leave_keeps_to_its_timeout_when_a_member_is_down(pair: _Pair) -> None:
    alice, bob = pair.alice, pair.bob
    alice.groups.create("g")
    via = bob.accept(alice.invite(), timeout=10)
    bob.groups.join("g", via, timeout=20)
    alice.close()  # down: neither the status nor the leave reaches her
    started = time.monotonic()
    bob.groups.leave("g", timeout=1.0)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("reserve", [None, 2])
def test_a_restarted_member_stamps_its_new_messages_after_its_old_ones(tmp_path: Path, reserve: int | None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """No other member publishes meanwhile, so nothing moves bob's clock but his own saved state. The
    clock is never saved at close, only its reservations ahead of time: a close is what a kill -9
    leaves. With a tiny reservation the clock runs past several of them before each restart."""
    if reserve is not None:
        monkeypatch.setattr(manager_module, "CLOCK_RESERVE", reserve)
    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG)
    try:
        alice.groups.create("g")
        via = bob.accept(alice.invite(), timeout=10)
        bob.groups.join("g", via=via, timeout=30)
        bob_did = bob.groups.did
        bob.groups.publish("g", [b"one", b"two", b"three"]).wait(10)

        def bobs() -> list[tuple[int, int, bytes]]:
            return [(m.lamport_ts, m.seq, m.payload) for m in alice.groups.messages("g") if m.publisher_did == bob_did]

        wait_for(lambda: len(bobs()) == 3, 10.0, "alice to get bob's messages")
        for round_ in range(2):
            bob.close()
            bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG)
            bob.groups.wait_active("g", timeout=20)
            bob.groups.publish("g", [f"after restart {round_}".encode()]).wait(10)
            wait_for(lambda n=4 + round_: len(bobs()) == n, 10.0, "alice to get bob's new message")
            stamps = [ts for ts, _, _ in sorted(bobs(), key=lambda r: r[1])]
            assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps), stamps
    finally:
        alice.close()
        bob.close()


def test_a_publisher_restarted_after_a_crash_does_not_reuse_seqs_an_unreached_member_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """alice's last messages reached only bob (carol was down) and her saved position lags them (a
    long persist_interval_s). She is killed, and restarts while bob is down: carol reports only what
    she got, so continuing after that reused the seqs bob holds, and bob dropped alice's new messages
    as duplicates (and acked them). She skips the seqs she may have used instead; members lacking them
    record them as void, not lost (carol's three and four died with alice: she cannot tell them apart)."""
    lagging = dataclasses.replace(CONFIG, persist_interval_s=3600.0)
    rows: dict[str, list[tuple[str, int, bytes]]] = {}  # member -> (publisher, seq, payload), every run
    void: dict[str, set[tuple[str, int]]] = {}  # member -> (publisher, seq) it was told have no message

    def open_(name: str, config: GroupConfig = CONFIG) -> Agent:
        def prepare(agent: Agent, manager: GroupManager) -> None:
            manager.on_messages(lambda ms: rows.setdefault(name, []).extend(
                (m.publisher_did, m.seq, m.payload) for m in ms))
            manager.on_superseded(lambda group, publisher, seqs: void.setdefault(name, set()).update(
                (publisher, s) for s in seqs))

        return Agent.open(tmp_path / name, label=name, group_config=config, prepare_groups=prepare)

    def alices(name: str) -> list[tuple[int, bytes]]:
        return [(seq, payload) for did, seq, payload in rows.get(name, []) if did == alice_did]

    alice, bob, carol = agents = [open_("alice", lagging), open_("bob"), open_("carol")]
    try:
        alice.groups.create("g")
        for member in (bob, carol):
            member.groups.join("g", via=member.accept(alice.invite(), timeout=10), timeout=30)
        alice_did = alice.groups.did
        alice.groups.publish("g", [b"one", b"two"]).wait(10)
        carol.close()  # down: alice's next messages reach bob only
        alice.groups.publish("g", [b"three", b"four"])
        wait_for(lambda: len(alices("bob")) == 4, 10.0, "bob to get alice's last messages")
        assert alice.groups._store.positions("g").publish < 4  # noqa: SLF001 - the saved position lags
        with monkeypatch.context() as patch:  # killed: nothing is written on the way down
            patch.setattr(alice.keystore, "put_record", lambda *args, **kwargs: None)
            alice.close()
        bob.close()

        carol = agents[2] = open_("carol")
        carol.groups.wait_active("g", timeout=20)
        alice = agents[0] = open_("alice", lagging)
        alice.groups.wait_active("g", timeout=20)  # carol reached, bob not
        receipt = alice.groups.publish("g", [b"five", b"six"])
        wait_for(lambda: [p for _, p in alices("carol")][-2:] == [b"five", b"six"], 20.0,
                 "carol to get alice's new messages")
        bob = agents[1] = open_("bob")
        bob.groups.wait_active("g", timeout=20)
        wait_for(lambda: len(alices("bob")) == 6, 20.0, "bob to get alice's new messages too")
        receipt.wait(10)  # acked by both, none of it dropped

        assert [p for _, p in alices("bob")] == [b"one", b"two", b"three", b"four", b"five", b"six"]
        first, last = receipt.seqs[0], receipt.seqs[-1]
        assert first > 4
        for name in ("bob", "carol"):
            seqs = [seq for seq, _ in alices(name)]
            assert seqs == sorted(seqs) and seqs[-2:] == [first, last], (name, seqs)
            skipped = {seq for did, seq in void.get(name, set()) if did == alice_did}
            assert not skipped & set(seqs), name  # what a member holds stays held
            # Every seq up to alice's last is a row or void: nothing a reader would call lost.
            assert set(seqs) | skipped == set(range(1, last + 1)), name
        for member in (bob, carol):
            assert member.groups.stats()["lost"] == 0
    finally:
        for agent in agents:
            agent.close()


def test_messages_a_member_received_but_did_not_take_are_lost_not_void_when_their_publisher_crashed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bob's journal fails on alice's "three" and "four" (not acked: she keeps them to re-send), then
    alice is killed and restarts while bob, still running, cannot be reached: she skips the seqs she
    may have used as void. bob had those two, though: they are not void (his other listener holds
    them as rows, and a reader must not take a row's seq for one never used) but lost, and counted."""
    lagging = dataclasses.replace(CONFIG, persist_interval_s=3600.0)
    rows: dict[str, list[tuple[str, int, bytes]]] = {"steady": [], "journal": []}
    void: set[tuple[str, int]] = set()
    failing = {"on": True}

    def journal(messages: list[Any]) -> None:
        if failing["on"] and any(m.payload in (b"three", b"four") for m in messages):
            raise OSError("disk full (injected)")
        rows["journal"].extend((m.publisher_did, m.seq, m.payload) for m in messages)

    def prepare(agent: Agent, manager: GroupManager) -> None:
        manager.on_messages(lambda ms: rows["steady"].extend((m.publisher_did, m.seq, m.payload) for m in ms))
        manager.on_messages(journal)
        manager.on_superseded(lambda group, publisher, seqs: void.update((publisher, s) for s in seqs))

    alice = Agent.open(tmp_path / "alice", label="alice", group_config=lagging)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG, prepare_groups=prepare)
    agents = [alice, bob]
    try:
        alice.groups.create("g")
        bob.groups.join("g", via=bob.accept(alice.invite(), timeout=10), timeout=30)
        alice_did, bob_did = alice.groups.did, bob.groups.did
        alice.groups.publish("g", [b"one", b"two"]).wait(10)
        alice.groups.publish("g", [b"three", b"four"])
        wait_for(lambda: bob.groups.stats()["deliveries_deferred"] >= 2, 10.0, "bob's journal to fail on them")
        assert alice.groups._store.positions("g").publish < 4  # noqa: SLF001 - the saved position lags
        with monkeypatch.context() as patch:  # killed: nothing is written on the way down
            patch.setattr(alice.keystore, "put_record", lambda *args, **kwargs: None)
            alice.close()
        subscribe = GroupManager._subscribe_to  # noqa: SLF001

        def bob_unreachable(self: GroupManager, g: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
            if entry.did == bob_did:
                raise TimeoutError("bob is unreachable (injected)")
            return subscribe(self, g, entry, *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(GroupManager, "_subscribe_to", bob_unreachable)
            alice = agents[0] = Agent.open(tmp_path / "alice", label="alice", group_config=lagging)
            alice.groups.wait_active("g", timeout=20)  # bob not reached: she continues after her reservation
        failing["on"] = False
        receipt = alice.groups.publish("g", [b"five", b"six"])
        receipt.wait(20)

        def alices(name: str) -> list[tuple[int, bytes]]:
            return [(seq, payload) for did, seq, payload in rows[name] if did == alice_did]

        wait_for(lambda: [p for _, p in alices("journal")][-2:] == [b"five", b"six"], 10.0, "bob's journal to get them")
        assert [p for _, p in alices("steady")] == [b"one", b"two", b"three", b"four", b"five", b"six"]
        assert [p for _, p in alices("journal")] == [b"one", b"two", b"five", b"six"]
        skipped = {seq for did, seq in void if did == alice_did}
        assert receipt.seqs[0] - 1 in skipped  # the reservation was skipped as void
        assert not skipped & {seq for seq, _ in alices("steady")}  # a seq bob holds a row of is not void
        assert bob.groups.stats()["lost"] == 2  # three and four: received, never acked, gone with alice
    finally:
        for agent in agents:
            agent.close()


def test_a_member_alone_in_its_group_restarted_after_a_crash_does_not_reuse_its_seqs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """alice publishes alone in her group (no member joined yet), and her saved position lags her last
    messages (persist_interval_s). Killed and restarted, she had no member to ask where her stream
    stood and continued after the saved position: her new messages took the seqs of her last ones,
    and her own journal (the agent journals what she publishes) dropped them as duplicates while the
    publish said they were journaled (reviewer's finding). She continues after her reservation now."""
    lagging = dataclasses.replace(CONFIG, persist_interval_s=3600.0)
    void: set[int] = set()

    def open_alice() -> Agent:
        def prepare(agent: Agent, manager: GroupManager) -> None:
            manager.on_superseded(lambda group, publisher, seqs: void.update(seqs))

        return Agent.open(tmp_path / "alice", label="alice", group_config=lagging, prepare_groups=prepare)

    alice = open_alice()
    try:
        alice.groups.create("g")
        before = alice.groups.publish("g", [b"one", b"two", b"three", b"four"])
        before.wait(10)  # no member: acked by all at once
        assert before.seqs == (1, 2, 3, 4)
        assert alice.groups._store.positions("g").publish < 4  # noqa: SLF001 - the saved position lags
        with monkeypatch.context() as patch:  # killed: nothing is written on the way down
            patch.setattr(alice.keystore, "put_record", lambda *args, **kwargs: None)
            alice.close()
        alice = open_alice()
        alice.groups.wait_active("g", timeout=20)
        after = alice.groups.publish("g", [b"five", b"six"])
        after.wait(10)
        assert after.seqs[0] > 4, after.seqs  # none of the seqs she used before the crash
        # Every seq between is void (maybe never used), as members would be told: nothing a reader calls lost.
        assert set(range(5, after.seqs[0])) <= void, (after.seqs, sorted(void))
    finally:
        alice.close()
