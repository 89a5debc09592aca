"""Group membership details with three agents in this process (real sockets, real crypto):
invitation-based admission, discover-features, view repair of a missed status, the delivery API."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from zerocomm_spark import Agent
from zerocomm_spark.errors import GroupExistsError, GroupNotFoundError, JoinRefusedError, ReceiveTimeoutError
from zerocomm_spark.group.dataplane import DataPlaneConfig, Delivered
from zerocomm_spark.group.manager import GroupConfig
from zerocomm_spark.group.policy import AllowListPolicy, InvitationPolicy, Ticket
from zerocomm_spark.group import manager as manager_module
from zerocomm_spark.group.proof import connection_proof
from zerocomm_spark.group.view import ACTIVE, MemberEntry, member_did_for
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.protocols.group.v1_0.messages import GroupProblemReport, Subscribe, ViewUpdate
from zerocomm_spark.protocols.out_of_band.v1_1.messages import Invitation

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

CONFIG = GroupConfig(digest_interval_s=0.3)


def _eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout}s")


@pytest.fixture()
def agents(tmp_path: Path) -> Iterator[tuple[Agent, Agent, Agent]]:
    opened = [Agent.open(tmp_path / n, label=n, group_config=CONFIG) for n in ("alice", "bob", "carol")]
    yield opened[0], opened[1], opened[2]
    for agent in opened:
        agent.close()


def test_invitation_policy_admits_only_invited_joiners(agents: tuple[Agent, Agent, Agent]) -> None:
    alice, bob, carol = agents
    alice.groups.create("club", policy=InvitationPolicy())
    plain = carol.accept(alice.invite())  # a connection, but no invitation issued for the group
    with pytest.raises(JoinRefusedError, match="invitation issued for group 'club'"):
        carol.groups.join("club", via=plain)
    assert carol.groups.groups() == []
    invited = bob.accept(alice.groups.invite("club"))
    info = bob.groups.join("club", via=invited, policy=InvitationPolicy())
    assert {m.label for m in info.members} == {"alice", "bob"}
    # carol now gets an invitation from bob; alice admits her on bob's ticket
    info = carol.groups.join("club", via=carol.accept(bob.groups.invite("club")))
    assert {m.label for m in info.members} == {"alice", "bob", "carol"}
    assert info.policy == {"kind": "open"}  # carol's own default
    pids = {p.pid for p in alice.discover("bob")}
    assert "https://didcomm.org/zerocomm-group/1.0" in pids


def test_a_replayed_member_entry_cannot_take_over_that_members_pairing(agents: tuple[Agent, Agent, Agent]) -> None:
    """Entries are public (signed, but every member holds every entry): carol, once a member, replays
    bob's entry and ticket in a subscribe over a fresh connection. Without bob's proof for that
    connection she is refused; alice still reaches bob through bob's own key, and bob still acks."""
    alice, bob, carol = agents
    alice.groups.create("g", mode="single")
    bob.groups.join("g", via=bob.accept(alice.invite(), timeout=10), timeout=30)
    carol.groups.join("g", via=carol.accept(alice.invite(), timeout=10), timeout=30)
    bob_entry = carol.groups._groups["g"].view.get(bob.groups.did)  # noqa: SLF001 - what carol holds anyway
    alice_entry = carol.groups._groups["g"].view.get(alice.groups.did)  # noqa: SLF001
    bob_key = next(m for m in alice.groups.dataplane.members("g") if m.did == bob.groups.did).relationship_verkey
    fresh = carol.accept(alice_entry.invitation, timeout=10)
    forged = connection_proof(carol.groups._member_key, "g", bob.groups.did,  # noqa: SLF001 - carol's own key
                              carol._store.find(fresh.id).my_did)  # noqa: SLF001
    for proof in ("", forged):
        reply = carol.request(fresh.id, Subscribe(group="g", member=bob_entry.to_dict(), settings={
            "mode": "single", "ordered": True, "consistent_join": True}, ticket=bob_entry.ticket, proof=proof),
            timeout=10)
        assert isinstance(reply, GroupProblemReport) and "does not prove" in reply.explain, reply
    assert next(m for m in alice.groups.dataplane.members("g")
                if m.did == bob.groups.did).relationship_verkey == bob_key
    alice.groups.publish("g", [b"for bob"]).wait(10)  # acked by bob (and carol)


def _made_up(agent: Agent, n: int, voucher: KeyPair | None, *, forged: bool = False) -> list[dict[str, Any]]:
    """``n`` invented member entries (each signed by its own fresh key, as entries are), pointing at
    ``agent``'s endpoints, with a ticket from ``voucher`` (a bogus signature if ``forged``)."""
    me = agent.groups._own(agent.groups._groups["g"])  # noqa: SLF001
    out = []
    for _ in range(n):
        key = KeyPair.generate()
        did = member_did_for(key.verkey)
        ticket = None
        if voucher is not None:
            ticket = Ticket.issue("g", did, voucher).to_dict()
            if forged:
                ticket["signature"] = ticket["signature"][:-8] + "AAAAAAAA"
        out.append(MemberEntry(did=did, label="x" * 200, role="read_write", status=ACTIVE,
                               peer_endpoint=me.peer_endpoint, publish_endpoint=me.publish_endpoint,
                               group_verkey=key.verkey, transport_key=me.transport_key, invitation=me.invitation,
                               version=1, ticket=ticket, group="g").signed(key).to_dict())
    return out


def _three_in_g(agents: tuple[Agent, Agent, Agent]) -> tuple[str, str]:
    """alice creates g, bob and carol join through her; alice admits nobody else (so what is set
    aside stays aside: _introduce refuses it). Returns the connection ids bob and carol push over."""
    alice, bob, carol = agents
    alice.groups.create("g")
    via_bob = bob.accept(alice.invite(), timeout=10)
    bob.groups.join("g", via=via_bob, timeout=30)
    via_carol = carol.accept(alice.invite(), timeout=10)
    carol.groups.join("g", via=via_carol, timeout=30)
    alice.groups.set_policy("g", AllowListPolicy([bob.groups.did, carol.groups.did]))
    return via_bob.id, via_carol.id


def _key(agent: Agent) -> KeyPair:
    return agent.groups._member_key  # noqa: SLF001 - a member vouching with its own key


def test_entries_heard_second_hand_are_bounded(agents: tuple[Agent, Agent, Agent],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A member pushing made-up entries by the thousand: those nobody else vouches for are not kept
    at all, the rest at most MAX_PENDING per group, oldest out."""
    alice, bob, _ = agents
    monkeypatch.setattr(manager_module, "MAX_PENDING", 50)
    via, _ = _three_in_g(agents)
    pending = alice.groups._groups["g"].pending  # noqa: SLF001
    bob.deliver(via, ViewUpdate(group="g", entries=_made_up(bob, 300, None)), timeout=30)
    assert len(pending) == 0
    for _ in range(3):
        bob.deliver(via, ViewUpdate(group="g", entries=_made_up(bob, 40, _key(bob))), timeout=30)
        assert len(pending) <= 50
    assert len(pending) == 50 and len(alice.groups._groups["g"].view) == 3  # noqa: SLF001


def test_a_forged_or_unknown_voucher_sets_nothing_aside(agents: tuple[Agent, Agent, Agent]) -> None:
    """carol claims bob vouched for her inventions (a ticket bob never signed), or vouches for them
    with a key no member has: none is kept, and bob's genuine one stays."""
    alice, bob, carol = agents
    via_bob, via_carol = _three_in_g(agents)
    pending = alice.groups._groups["g"].pending  # noqa: SLF001
    genuine = _made_up(bob, 1, _key(bob))
    bob.deliver(via_bob, ViewUpdate(group="g", entries=genuine), timeout=30)
    assert list(e.did for e in pending.values()) == [genuine[0]["did"]]
    stranger = KeyPair.generate()
    carol.deliver(via_carol, ViewUpdate(group="g", entries=_made_up(bob, 1100, _key(bob), forged=True)), timeout=60)
    carol.deliver(via_carol, ViewUpdate(group="g", entries=_made_up(carol, 1100, stranger)), timeout=60)
    assert list(e.did for e in pending.values()) == [genuine[0]["did"]]


def test_one_members_vouching_evicts_only_its_own(agents: tuple[Agent, Agent, Agent]) -> None:
    """bob vouches (with his own key) for inventions by the thousand: he holds at most
    MAX_PENDING_PER_VOUCHER of the places, oldest of his own out; what carol vouched for stays."""
    alice, bob, carol = agents
    via_bob, via_carol = _three_in_g(agents)
    per_voucher = manager_module.__dict__.get("MAX_PENDING_PER_VOUCHER", 64)
    pending = alice.groups._groups["g"].pending  # noqa: SLF001
    carols = _made_up(carol, 3, _key(carol))
    carol.deliver(via_carol, ViewUpdate(group="g", entries=carols), timeout=30)
    bobs = []
    for _ in range(3):
        bobs += _made_up(bob, 400, _key(bob))
        bob.deliver(via_bob, ViewUpdate(group="g", entries=bobs[-400:]), timeout=60)
    held = {e.did: e.ticket["by"] for e in pending.values()}
    assert {d for d, by in held.items() if by == carol.groups.did} == {e["did"] for e in carols}
    assert {d for d, by in held.items() if by == bob.groups.did} == {e["did"] for e in bobs[-per_voucher:]}


def test_tickets_are_checked_once_per_entry_and_boundedly_per_message(agents: tuple[Agent, Agent, Agent],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting an entry aside checks its ticket; the same entry again (repair repeats itself) is not
    checked again, and one message costs at most MAX_PENDING_PER_VOUCHER checks per voucher."""
    alice, bob, _ = agents
    via, _ = _three_in_g(agents)
    monkeypatch.setattr(alice.groups, "_introduce", lambda g: 0)  # only _apply checks tickets here
    per_voucher = manager_module.__dict__.get("MAX_PENDING_PER_VOUCHER", 64)
    checked = []
    verify = Ticket.verify

    def counting(self: Ticket, **kwargs: Any) -> str:
        checked.append(self.member)
        return verify(self, **kwargs)

    monkeypatch.setattr(Ticket, "verify", counting)
    few = _made_up(bob, 10, _key(bob))
    bob.deliver(via, ViewUpdate(group="g", entries=few), timeout=30)
    assert sorted(checked) == sorted(e["did"] for e in few)
    bob.deliver(via, ViewUpdate(group="g", entries=few), timeout=30)
    assert len(checked) == 10
    checked.clear()
    bob.deliver(via, ViewUpdate(group="g", entries=_made_up(bob, 500, _key(bob), forged=True)), timeout=60)
    assert len(checked) == per_voucher  # forged tickets use up the share of the voucher they name
    assert len(alice.groups._groups["g"].pending) == 10  # noqa: SLF001
    checked.clear()
    bob.deliver(via, ViewUpdate(group="g", entries=_made_up(bob, 500, _key(bob))), timeout=60)
    assert len(checked) == per_voucher
    assert len(alice.groups._groups["g"].pending) == per_voucher  # noqa: SLF001


def test_a_missed_status_is_repaired_by_digests(agents: tuple[Agent, Agent, Agent]) -> None:
    alice, bob, carol = agents
    alice.groups.create("g")
    bob.groups.join("g", via=bob.accept(alice.invite()))
    carol.groups.join("g", via=carol.accept(alice.invite()))
    everyone = (alice, bob, carol)
    _eventually(lambda: all(len([m for m in a.groups.members("g") if m.status == "active"]) == 3 for a in everyone),
                what="three active members everywhere")
    carol.groups.switch_role("g", "read_only")
    # bob misses carol's update: put his view back to carol's old entry, as if the status never came
    bob_group = bob.groups._groups["g"]  # noqa: SLF001 - simulating a lost message
    new = bob_group.view.get(carol.groups.did)
    old = alice.groups._groups["g"].view.get(carol.groups.did)  # noqa: SLF001
    assert new is not None and old is not None and new.role == "read_only"
    stale = type(new)(**{**new.to_dict(), "role": "read_write", "version": new.version - 1, "signature": ""})
    bob_group.view._entries[carol.groups.did] = stale  # noqa: SLF001 - unsigned on purpose: local tampering
    assert {m.label: m.role for m in bob.groups.members("g")}["carol"] == "read_write"
    _eventually(lambda: {m.label: m.role for m in bob.groups.members("g")}["carol"] == "read_only",
                what="bob repairing carol's role")
    assert bob.groups.info("g").checksum == alice.groups.info("g").checksum == carol.groups.info("g").checksum


def test_delivery_api_history_callback_and_receive(agents: tuple[Agent, Agent, Agent]) -> None:
    alice, bob, _ = agents
    info = alice.groups.create("news", mode="multi", ordered=True, consistent_join=False, role="read_write")
    assert (info.mode, info.ordered, info.consistent_join, info.status) == ("multi", True, False, "active")
    with pytest.raises(GroupExistsError):
        alice.groups.create("news")
    with pytest.raises(GroupNotFoundError):
        alice.groups.info("nope")
    bob.groups.join("news", via=bob.accept(alice.invite()), role="read_only")
    seen: list[Delivered] = []
    done = threading.Event()

    def on_message(message: Delivered) -> None:
        seen.append(message)
        if len(seen) == 30:
            done.set()

    remove = bob.groups.on_message(on_message)
    receipt = alice.groups.publish("news", [f"n{i}" for i in range(30)], headers={"kind": "test"})
    receipt.wait(10)
    assert done.wait(10)
    assert [m.payload for m in seen] == [f"n{i}".encode() for i in range(30)]
    assert all(m.headers == {"kind": "test"} and m.publisher_did == alice.groups.did for m in seen)
    assert [m.lamport_ts for m in seen] == sorted(m.lamport_ts for m in seen)
    assert [bob.groups.receive("news", 5).payload for _ in range(30)] == [m.payload for m in seen]
    assert [m.message_id for m in bob.groups.messages("news")] == list(receipt.message_ids)
    with pytest.raises(ReceiveTimeoutError):
        bob.groups.receive("news", timeout=0.2)
    remove()
    alice.groups.publish("news", ["after"]).wait(10)
    assert bob.groups.receive(timeout=5).payload == b"after"
    assert len(seen) == 30
    # what bob just got is what a restart would continue after
    assert bob.groups.dataplane.positions("news")[alice.groups.did] == receipt.seqs[-1] + 1


def test_batch_hook_gets_delivery_batches_and_holds_the_acks_until_it_returns(tmp_path: Path) -> None:
    prepared: list[str] = []
    gate = threading.Event()
    batches: list[list[Delivered]] = []

    def durable(batch: list[Delivered]) -> None:  # a journal-like consumer that is slow to commit
        batches.append(batch)
        assert gate.wait(20)

    def prepare(agent: Agent, manager: Any) -> None:
        prepared.append(agent.label)
        assert manager._dataplane is None  # noqa: SLF001 - it runs before the manager starts
        manager.on_messages(durable)

    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG, prepare_groups=prepare)
    try:
        alice.groups.create("journaled")
        bob.groups.join("journaled", via=bob.accept(alice.invite()))
        assert prepared == ["bob"]
        receipt = alice.groups.publish("journaled", [f"m{i}" for i in range(50)])
        _eventually(lambda: batches, what="a first delivery batch")
        time.sleep(1.0)
        assert not receipt.done(), "acknowledged before the batch consumer returned"
        gate.set()
        receipt.wait(15)
        _eventually(lambda: sum(len(b) for b in batches) == 50, what="all 50 messages in batches")
        flat = [m for b in batches for m in b]
        assert [m.payload for m in flat] == [f"m{i}".encode() for i in range(50)]
        assert len(batches) < 50  # batched, not one call per message
        assert all(len({m.publisher_did for m in b}) == 1 and len({m.group for m in b}) == 1 for b in batches)
    finally:
        gate.set()
        bob.close()
        alice.close()


def test_a_listener_that_raises_gets_the_messages_again_and_the_others_get_them_once(tmp_path: Path) -> None:
    """A listener that raises has not taken its messages: they are not acked, the publisher re-sends
    them and only the listeners that failed are called again (history and receive() hold them once)."""
    flaky_batches: list[list[Delivered]] = []
    steady: list[Delivered] = []
    singles: list[Delivered] = []
    failures: list[str] = []

    def flaky(batch: list[Delivered]) -> None:  # a journal whose first commit fails
        if not failures:
            failures.append("batch")
            raise OSError("disk full (injected)")
        flaky_batches.append(batch)

    def flaky_single(message: Delivered) -> None:  # fails once, at the sixth message
        if message.payload == b"m5" and "single" not in failures:
            failures.append("single")
            raise ValueError("injected")
        singles.append(message)

    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG)
    try:
        alice.groups.create("g")
        bob.groups.join("g", via=bob.accept(alice.invite()))
        bob.groups.on_messages(flaky)
        bob.groups.on_messages(steady.extend)
        bob.groups.on_message(flaky_single)
        sent = [f"m{i}".encode() for i in range(40)]
        receipt = alice.groups.publish("g", sent)
        receipt.wait(20)  # acked once every listener took every message
        assert failures == ["batch", "single"]
        assert [m.payload for b in flaky_batches for m in b] == sent
        assert [m.payload for m in steady] == sent
        assert [m.payload for m in singles] == sent
        assert [m.payload for m in bob.groups.messages("g")] == sent
        assert [bob.groups.receive("g", 5).payload for _ in sent] == sent
        with pytest.raises(ReceiveTimeoutError):
            bob.groups.receive("g", timeout=0.3)
        assert bob.groups.dataplane.positions("g")[alice.groups.did] == receipt.seqs[-1]
    finally:
        bob.close()
        alice.close()


def test_what_every_listener_took_before_one_raised_is_acked_not_sent_again(tmp_path: Path) -> None:
    """A per-message listener that raises at the sixth message of a batch has taken the first five,
    as has every other listener: those are acked, and only the rest is re-sent and offered again
    (deferring the whole batch re-fetched what everyone had)."""
    singles: list[Delivered] = []
    raised: list[bytes] = []

    def flaky_single(message: Delivered) -> None:
        if message.payload == b"m5" and not raised:
            raised.append(message.payload)
            raise ValueError("injected")
        singles.append(message)

    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG)
    try:
        alice.groups.create("g")
        bob.groups.join("g", via=bob.accept(alice.invite()))
        bob.groups.on_message(flaky_single)
        sent = [f"m{i}".encode() for i in range(10)]
        alice.groups.publish("g", sent).wait(20)  # one call: one envelope, one delivery batch
        assert raised == [b"m5"] and [m.payload for m in singles] == sent
        stats = bob.groups.dataplane.stats()
        assert stats["deliveries_deferred"] == 5, stats  # m5..m9, not the whole batch
        assert stats["messages_in"] == 10, stats
        assert stats["callback_errors"] == 1, stats  # the listener's one raise, counted through the manager
    finally:
        bob.close()
        alice.close()


def test_messages_that_arrive_while_joining_are_acked_only_after_the_listeners_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Until its join completes a member delivers nothing; what arrives meanwhile must not be acked
    either (acked, it would be lost if the listener then failed or the process died)."""
    joining, release = threading.Event(), threading.Event()
    got: list[Delivered] = []
    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG)
    check = bob.groups._check_consistency  # noqa: SLF001

    def held_check(*args: Any, **kwargs: Any) -> None:  # the join stops after alice admitted bob
        check(*args, **kwargs)
        joining.set()
        assert release.wait(30)

    monkeypatch.setattr(bob.groups, "_check_consistency", held_check)
    bob.groups.on_messages(got.extend)
    joined: list[Any] = []
    via = bob.accept(alice.invite())
    thread = threading.Thread(target=lambda: joined.append(bob.groups.join("g", via=via, timeout=60)))
    try:
        alice.groups.create("g")
        thread.start()
        assert joining.wait(30)
        sent = [f"j{i}".encode() for i in range(10)]
        receipt = alice.groups.publish("g", sent)
        deferred = lambda: bob.groups.dataplane.stats().get("deliveries_deferred", 0)  # noqa: E731
        _eventually(lambda: receipt.done() or deferred() >= len(sent), timeout=20, what="bob receiving them")
        time.sleep(0.5)  # an ack would be out by now (ack_interval_ms)
        assert not got and not receipt.done(), "acknowledged before a listener had the messages"
        release.set()
        thread.join(30)
        assert joined
        receipt.wait(20)
        assert [m.payload for m in got] == sent
    finally:
        release.set()
        if thread.is_alive():
            thread.join(30)
        bob.close()
        alice.close()


def test_a_member_still_joining_does_not_hold_the_publishers_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """carol takes (and acks) nothing until her join checks out, which may take seconds (a member slow
    to answer, views settling): meanwhile alice must go on publishing past her window, not wait for
    acks carol cannot send yet. carol still gets every message from her join point, once."""
    config = GroupConfig(digest_interval_s=0.3, dataplane=DataPlaneConfig(window=100, retention_max=10_000))
    joining, release = threading.Event(), threading.Event()
    got: list[Delivered] = []
    alice, bob, carol = (Agent.open(tmp_path / n, label=n, group_config=config) for n in ("alice", "bob", "carol"))
    check = carol.groups._check_consistency  # noqa: SLF001

    def held_check(*args: Any, **kwargs: Any) -> None:  # carol's join stops after the members admitted her
        check(*args, **kwargs)
        joining.set()
        assert release.wait(30)

    monkeypatch.setattr(carol.groups, "_check_consistency", held_check)
    carol.groups.on_messages(got.extend)
    joined: list[Any] = []
    try:
        alice.groups.create("g")
        bob.groups.join("g", via=bob.accept(alice.invite()))
        via = carol.accept(alice.invite())
        thread = threading.Thread(target=lambda: joined.append(carol.groups.join("g", via=via, timeout=60)))
        thread.start()
        assert joining.wait(30)
        sent = [f"w{i}".encode() for i in range(300)]  # three windows
        receipts = [alice.groups.publish("g", sent[i:i + 50], timeout=5) for i in range(0, len(sent), 50)]
        release.set()
        thread.join(30)
        assert joined
        for receipt in receipts:
            receipt.wait(20)  # carol acked them too, once she took them
        _eventually(lambda: len(got) >= len(sent), timeout=20, what="carol getting them")
        assert [m.payload for m in got] == sent
    finally:
        release.set()
        for agent in (carol, bob, alice):
            agent.close()


def test_a_member_still_joining_does_not_hold_the_window_of_a_publisher_that_restarted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """alice restarts while carol's join is still being checked: the resume adds every member back to
    the data plane, and carol (joining in alice's view, acking nothing yet) must not hold alice's
    window there any more than before the restart."""
    config = GroupConfig(digest_interval_s=0.3, dataplane=DataPlaneConfig(window=100, retention_max=10_000))
    joining, release = threading.Event(), threading.Event()
    alice, carol = (Agent.open(tmp_path / n, label=n, group_config=config) for n in ("alice", "carol"))
    agents = [alice, carol]
    check = carol.groups._check_consistency  # noqa: SLF001

    def held_check(*args: Any, **kwargs: Any) -> None:  # carol's join stops after alice admitted her
        check(*args, **kwargs)
        joining.set()
        assert release.wait(60)

    monkeypatch.setattr(carol.groups, "_check_consistency", held_check)
    got: list[Delivered] = []
    carol.groups.on_messages(got.extend)
    joined: list[Any] = []
    thread: threading.Thread | None = None
    try:
        alice.groups.create("g")
        via = carol.accept(alice.invite())
        thread = threading.Thread(target=lambda: joined.append(carol.groups.join("g", via=via, timeout=90)),
                                  daemon=True)
        thread.start()
        assert joining.wait(30)
        alice.close()
        alice = agents[0] = Agent.open(tmp_path / "alice", label="alice", group_config=config)
        alice.groups.wait_active("g", timeout=30)
        sent = [f"w{i}".encode() for i in range(300)]  # three windows: carol takes and acks nothing yet
        receipts = [alice.groups.publish("g", sent[i:i + 50], timeout=5) for i in range(0, len(sent), 50)]
        release.set()
        thread.join(60)
        assert joined
        for receipt in receipts:
            receipt.wait(30)  # carol acked them too, once she took them
        assert [m.payload for m in got if m.publisher_did == alice.groups.did] == sent
    finally:
        release.set()
        if thread is not None:
            thread.join(30)
        for agent in agents:
            agent.close()


def test_what_a_listener_failed_on_is_forgotten_once_its_ordered_stream_moved_past_it(tmp_path: Path) -> None:
    """The taken-by record of messages a listener raised for waits for their re-send; if they are
    skipped instead (lost, void), an ordered stream's next delivery shows they never come back, and
    the record goes (it stayed until the member left the group)."""
    from zerocomm_spark.errors import DeliveryDeferredError

    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    try:
        alice.groups.create("g")  # ordered
        failed: list[int] = []

        def flaky(message: Delivered) -> None:
            if message.seq == 5 and not failed:
                failed.append(message.seq)
                raise ValueError("injected")

        alice.groups.on_message(flaky)

        def delivered(seq: int) -> Delivered:
            return Delivered("g", f"m{seq}", "did:peer:2.publisher", seq, seq, 0.0, 0.0, b"x")

        with pytest.raises(DeliveryDeferredError):
            alice.groups._on_deliver_many([delivered(5), delivered(6)])  # noqa: SLF001 - the data plane's entry point
        assert alice.groups._taken  # noqa: SLF001 - waiting for the re-send of 5 and 6
        alice.groups._on_deliver_many([delivered(9)])  # noqa: SLF001 - 5..8 were skipped (lost), not re-sent
        assert not alice.groups._taken  # noqa: SLF001
    finally:
        alice.close()


def test_what_a_listener_failed_on_is_forgotten_once_its_publisher_left(tmp_path: Path) -> None:
    """The taken-by record of messages a listener raised for waits for their re-send; a publisher
    that left never re-sends them, so the record goes with it (it stayed until this member left the
    group: one batch more per departed publisher, for as long as the group lived here)."""
    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG)
    try:
        alice.groups.create("g")
        bob.groups.join("g", via=bob.accept(alice.invite()))
        bob_did = bob.groups.did

        def failing(messages: list[Delivered]) -> None:  # a journal that cannot take bob's messages
            raise OSError("disk full (injected)")

        alice.groups.on_messages(failing)
        bob.groups.publish("g", [b"x", b"y"])
        _eventually(lambda: any(key[1] == bob_did for key in alice.groups._taken),  # noqa: SLF001
                    what="alice's listener to fail on bob's messages")
        bob.groups.leave("g")
        _eventually(lambda: bob_did not in {m.did for m in alice.groups.dataplane.members("g")},
                    what="alice to drop bob")
        time.sleep(0.5)  # a delivery still in flight when bob went has returned by now
        assert not [key for key in alice.groups._taken if key[1] == bob_did]  # noqa: SLF001
    finally:
        bob.close()
        alice.close()


def test_an_invitation_of_the_joiners_own_with_a_group_invitations_id_does_not_admit_it(
        agents: tuple[Agent, Agent, Agent]) -> None:
    """InvitationPolicy admits a joiner whose connection answered an invitation the acceptor issued
    for the group. On a connection the acceptor made by accepting the *joiner's* invitation, the
    invitation id is the joiner's choice: carol, never invited, copies the id of a group invitation
    (bob's, seen in its URL and used up) into an invitation of her own that alice accepts."""
    alice, bob, carol = agents
    alice.groups.create("club", policy=InvitationPolicy())
    url = alice.groups.invite("club")
    bob.groups.join("club", via=bob.accept(url), policy=InvitationPolicy())
    issued = Invitation.from_url(url).id
    invitation, record = carol._oob.create_invitation()  # noqa: SLF001 - a hostile agent picks its own @id
    carol.keystore.delete_record("invitation", record.invitation_id)
    invitation.id = record.invitation_id = issued
    carol._oob._save(record)  # noqa: SLF001
    theirs = alice.accept(invitation.to_url())  # alice is the requester on this connection
    assert alice._store.find(theirs.id).invitation_id == issued  # noqa: SLF001
    mine = next(c for c in carol.connections() if c.their_did == theirs.my_did)
    with pytest.raises(JoinRefusedError, match="invitation issued for group 'club'"):
        carol.groups.join("club", via=mine, timeout=15)
    assert carol.groups.groups() == []
    assert {m.label for m in alice.groups.members("club")} == {"alice", "bob"}


def test_the_receive_buffer_and_history_of_a_group_are_bounded_in_bytes_too(tmp_path: Path) -> None:
    """receive() and messages() buffered 100,000 and 10,000 delivered messages per group whatever their
    size, and the agent process reads neither (its journal takes every message): a member publishing
    large payloads, or plain heavy traffic, held gigabytes in a long-lived agent. Both are bounded in
    payload bytes now, dropping the oldest (counted in inbox_dropped) as the count bound does."""
    config = GroupConfig(digest_interval_s=0.3, inbox_max_bytes=10_000, history_max_bytes=5_000)
    with Agent.open(tmp_path / "a", label="a", group_config=CONFIG) as alice, \
            Agent.open(tmp_path / "b", label="b", group_config=config) as bob:
        alice.groups.create("big")
        bob.groups.join("big", via=bob.accept(alice.invite()), timeout=30)
        alice.groups.publish("big", [bytes([65 + i]) * 2_000 for i in range(8)]).wait(10)
        _eventually(lambda: len(bob.groups.messages("big")) == 2 and bob.groups.stats()["inbox_dropped"]["big"] == 3,
                    what="the oldest dropped past the byte bounds")
        assert [m.payload[:1] for m in bob.groups.messages("big")] == [b"G", b"H"]
        assert [bob.groups.receive("big", 5).payload[:1] for _ in range(5)] == [b"D", b"E", b"F", b"G", b"H"]
        # One message larger than the bound is still kept alone.
        alice.groups.publish("big", [b"Z" * 20_000]).wait(10)
        assert bob.groups.receive("big", 5).payload == b"Z" * 20_000
        assert [len(m.payload) for m in bob.groups.messages("big")] == [20_000]


def test_a_member_that_keeps_no_buffers_still_delivers_to_its_listeners(tmp_path: Path) -> None:
    """history_max=0 and inbox_max=0 keep nothing for messages() and receive() (the agent process: its
    journal listens), and count nothing as dropped."""
    from zerocomm_spark.agent.config import load
    from zerocomm_spark.agent.groups import group_config

    agent_config = group_config(load(tmp_path / "none.toml", env={}, missing_ok=True))
    assert (agent_config.history_max, agent_config.inbox_max) == (0, 0)
    config = GroupConfig(digest_interval_s=0.3, history_max=0, inbox_max=0)
    with Agent.open(tmp_path / "a", label="a", group_config=CONFIG) as alice, \
            Agent.open(tmp_path / "b", label="b", group_config=config) as bob:
        alice.groups.create("quiet")
        seen: list[bytes] = []
        bob.groups.on_message(lambda m: seen.append(m.payload))
        bob.groups.join("quiet", via=bob.accept(alice.invite()), timeout=30)
        alice.groups.publish("quiet", [b"one", b"two"]).wait(10)
        _eventually(lambda: seen == [b"one", b"two"], what="delivery to the listener")
        assert bob.groups.messages("quiet") == [] and bob.groups.stats()["inbox_dropped"]["quiet"] == 0
        with pytest.raises(ReceiveTimeoutError):
            bob.groups.receive("quiet", timeout=0.2)
