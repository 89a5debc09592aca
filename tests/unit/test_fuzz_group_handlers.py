"""Hostile but well-formed membership messages against a real group manager (real keystore, real
agents in this process): what the handlers do with them once the parsers let them through.

The rules under test: a handler answers with a ZeroCommError (or a problem report, or drops the
entry with a log line), never a raw ValueError/OverflowError/ZMQError; and nothing a peer sends can
leave state behind that later fails to persist (the keystore refuses NaN, so a NaN held in a view
made every later save of the group raise). Loops are seeded and bounded to a few seconds.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from test_fuzz_untrusted_input import _paths  # tests/unit is on sys.path (pytest's rootdir insertion)
from zerocomm_spark import Agent
from zerocomm_spark.envelope import pack
from zerocomm_spark.errors import MalformedGroupMessageError, ZeroCommError
from zerocomm_spark.group.manager import GroupConfig
from zerocomm_spark.group.policy import Ticket
from zerocomm_spark.group.proof import connection_proof
from zerocomm_spark.group.view import MemberEntry, parse_entries, seal_status
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.protocols.group.v1_0 import messages as gm

pytestmark = pytest.mark.timeout(120)

#: Values that pass "is it JSON" but not "is it sane": non-finite and out-of-range numbers, lone
#: surrogates, empty and huge strings, path-like names, wrong containers.
HOSTILE: tuple[Any, ...] = (float("nan"), float("inf"), float("-inf"), 10**400, 2**63, 2**63 - 1, -1, "\ud800",
                            "", "A" * 100_000, "../x", [], {}, "tcp://x", "tcp://127.0:=#1:5")


def inject(rng: random.Random, value: Any) -> Any:
    """``value`` with one or two of its leaves replaced by a hostile value."""
    out = copy.deepcopy(value)
    paths = [path for path in _paths(out) if path]  # not the root: a value inside it
    for _ in range(rng.randint(1, 2)):
        path = rng.choice(paths)
        try:  # the first change may have replaced a node the second path goes through
            parent = out
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = copy.deepcopy(rng.choice(HOSTILE))
        except (IndexError, KeyError, TypeError):
            pass
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """alice created group g and bob joined it; carol is connected to alice but in no group."""
    base = Path(tmp_path_factory.mktemp("agents"))
    config = GroupConfig(digest_interval_s=60.0)  # no background repair: the test drives everything
    agents = [Agent.open(base / n, label=n, group_config=config) for n in ("alice", "bob", "carol")]
    alice, bob, carol = agents
    try:
        alice.groups.create("g")
        via = bob.accept(alice.invite(), timeout=10)
        bob.groups.join("g", via=via, timeout=30)
        carol_via = carol.accept(alice.invite(), timeout=10)
        yield {"alice": alice, "bob": bob, "carol": carol, "bob_conn": via.id, "carol_conn": carol_via.id}
    finally:
        for agent in agents:
            agent.close()


def _bob_entry(pair: dict[str, Any], **changes: Any) -> MemberEntry:
    bob = pair["bob"]
    g = bob.groups._groups["g"]  # noqa: SLF001 - what bob announces, changed as a hostile bob would
    mine = bob.groups._own(g)  # noqa: SLF001
    return replace(mine, **changes).signed(bob.groups._member_key)  # noqa: SLF001


def _alice_saves(pair: dict[str, Any]) -> None:
    """Alice's group record still persists (a save after any change must not raise)."""
    alice = pair["alice"]
    alice.groups._save(alice.groups._groups["g"])  # noqa: SLF001
    alice.groups.set_policy("g", {"kind": "open"})


# --- NaN / Infinity in a member entry's ticket ----------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_member_entry_whose_ticket_holds_a_non_finite_number_is_refused(bad: float) -> None:
    key = KeyPair.generate()
    from zerocomm_spark.group.view import member_did_for

    entry = MemberEntry(did=member_did_for(key.verkey), label="x", role="read_write", status="active",
                        peer_endpoint="tcp://127.0.0.1:4000", publish_endpoint="tcp://127.0.0.1:5000",
                        group_verkey=KeyPair.generate().verkey, transport_key="T" * 40, invitation="x",
                        version=3, ticket={"by": "did:key:z6Mk", "x": [bad]}).signed(key)
    raw = json.loads(json.dumps(entry.to_dict()))  # as it comes off the wire: Python's json reads NaN
    with pytest.raises(MalformedGroupMessageError, match="ticket"):
        MemberEntry.from_dict(raw)
    assert parse_entries([raw], skip_invalid=True) == []


def test_a_view_update_with_a_nan_ticket_does_not_wedge_the_group_record(pair: dict[str, Any]) -> None:
    """Before: alice merged bob's re-signed entry (ticket holding NaN) into her view, the save then
    raised InvalidRecordError (the keystore writes allow_nan=False) and so did every later save of
    the group (invite, set_policy, new members) for as long as she held that entry."""
    bob, alice = pair["bob"], pair["alice"]
    good = _bob_entry(pair)
    evil = replace(good, ticket={**(good.ticket or {}), "x": float("nan")},
                   version=good.version + 1).signed(bob.groups._member_key)  # noqa: SLF001
    bob.deliver(pair["bob_conn"], gm.ViewUpdate(group="g", entries=[evil.to_dict()]), timeout=10)
    held = alice.groups._groups["g"].view.get(bob.groups.did)  # noqa: SLF001
    assert held is not None and "x" not in (held.ticket or {})
    _alice_saves(pair)
    alice.groups.invite("g")  # saves the group record too


def test_a_join_response_ticket_is_stored_as_parsed_not_as_sent() -> None:
    """The joiner kept the acceptor's ticket dict as sent (extra fields and all) in its record and
    its own entry; an extra NaN field failed the join's save."""
    key = KeyPair.generate()
    ticket = Ticket.issue("g", "did:key:zMember", key, nonce="n").to_dict()
    parsed = Ticket.from_dict({**ticket, "extra": float("nan")})
    assert parsed.to_dict() == ticket


# --- numbers at type limits in tickets -------------------------------------------------------------


@pytest.mark.parametrize("issued_at", [10**400, -(10**400), 2**1024], ids=["1e400", "-1e400", "2^1024"])
def test_a_ticket_issued_at_an_integer_beyond_a_float_is_malformed_not_an_overflow(issued_at: int) -> None:
    ticket = {"group": "g", "member": "did:key:zA", "by": "did:key:zB", "signature": "AA", "issued_at": issued_at}
    with pytest.raises(MalformedGroupMessageError, match="issued_at"):
        Ticket.from_dict(ticket)


def test_a_subscribe_with_a_ticket_issued_at_beyond_a_float_is_refused_cleanly(pair: dict[str, Any]) -> None:
    """carol (connected, not a member) subscribes presenting a ticket whose issued_at is 10**400:
    checking whether it vouches for her raised OverflowError out of the handler."""
    carol, alice = pair["carol"], pair["alice"]
    entry = _carol_entry(pair)
    ticket = {"group": "g", "member": entry.did, "by": alice.groups.did, "signature": "AA", "issued_at": 10**400,
              "nonce": ""}
    reply = carol.request(pair["carol_conn"], gm.Subscribe(
        group="g", member=entry.to_dict(), settings={"mode": "shared", "ordered": True, "consistent_join": True},
        ticket=ticket, proof=_carol_proof(pair)), timeout=10)
    assert isinstance(reply, (gm.GroupProblemReport, gm.SubscribeResponse))


def _carol_entry(pair: dict[str, Any]) -> MemberEntry:
    carol, alice = pair["carol"], pair["alice"]
    mine = alice.groups._own(alice.groups._groups["g"])  # noqa: SLF001 - endpoints that parse
    key = carol.groups._member_key  # noqa: SLF001
    return replace(mine, did=carol.groups.did, label="carol", version=1, ticket=None,
                   group_verkey=KeyPair.generate().verkey).signed(key)


def _carol_proof(pair: dict[str, Any]) -> str:
    carol = pair["carol"]
    record = carol._store.find(pair["carol_conn"])  # noqa: SLF001
    return connection_proof(carol.groups._member_key, "g", carol.groups.did, record.my_did)  # noqa: SLF001


# --- endpoints a member announces ----------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://x", "tcp://127.0:=#1:5", "tcp://h:70000", "ipc://", "t#p://h:1",
                                      "tcp://\ud800:1", "tcp://" + "a" * 2000 + ":1"])
def test_a_member_entry_with_an_endpoint_no_socket_can_connect_to_is_refused(endpoint: str) -> None:
    from zerocomm_spark.group.view import member_did_for

    key = KeyPair.generate()
    for field in ("publish_endpoint", "peer_endpoint"):
        entry = MemberEntry(did=member_did_for(key.verkey), label="x", role="read_write", status="active",
                            peer_endpoint="tcp://127.0.0.1:4000", publish_endpoint="tcp://[::1]:5000",
                            group_verkey=KeyPair.generate().verkey, transport_key="T" * 40, invitation="x",
                            version=3, ticket=None)
        raw = {**entry.to_dict(), field: endpoint}
        with pytest.raises(MalformedGroupMessageError, match=field):
            MemberEntry.from_dict(raw)


def test_a_view_update_announcing_an_unconnectable_publish_endpoint_is_skipped(pair: dict[str, Any]) -> None:
    """bob re-signs his entry with publish_endpoint 'tcp://127.0:=#1:5' (it has '://', the only
    check): alice dropped her SUB to bob's old endpoint, then connect() raised ZMQError out of the
    handler, and bob's stream stopped reaching her. Now the entry is skipped and nothing changes."""
    bob, alice = pair["bob"], pair["alice"]
    before = alice.groups._groups["g"].view.get(bob.groups.did)  # noqa: SLF001
    good = _bob_entry(pair)
    evil = replace(good, publish_endpoint="tcp://127.0:=#1:5", version=good.version + 1).signed(
        bob.groups._member_key)  # noqa: SLF001
    bob.deliver(pair["bob_conn"], gm.ViewUpdate(group="g", entries=[evil.to_dict()]), timeout=10)
    held = alice.groups._groups["g"].view.get(bob.groups.did)  # noqa: SLF001
    assert held is not None and held.publish_endpoint == before.publish_endpoint
    member = next(m for m in alice.groups.dataplane.members("g") if m.did == bob.groups.did)
    assert member.publish_endpoint == before.publish_endpoint


# --- seeded fuzzing of every membership handler ------------------------------------------------------


def _handle(agent: Agent, sender: Agent, connection_id: str, message: dict[str, Any]) -> None:
    """``message`` authcrypted by ``sender`` over the connection and handled as alice's transport would."""
    record = sender._store.find(connection_id)  # noqa: SLF001
    envelope = pack(json.dumps(message).encode(), [record.their_verkey],
                    sender=sender._keystore.get(record.my_verkey))  # noqa: SLF001
    agent._handle(envelope)  # noqa: SLF001


@pytest.mark.parametrize("seed", range(2))
def test_membership_handlers_fed_hostile_values_answer_with_project_errors(pair: dict[str, Any], seed: int) -> None:
    rng = random.Random(seed)
    alice, bob, carol = pair["alice"], pair["bob"], pair["carol"]
    settings = {"mode": "shared", "ordered": True, "consistent_join": True}
    bob_key, carol_key = bob.groups._member_key, carol.groups._member_key  # noqa: SLF001
    base = _bob_entry(pair)
    bob_proof = connection_proof(bob_key, "g", bob.groups.did, bob._store.find(pair["bob_conn"]).my_did)  # noqa: SLF001
    carol_entry, carol_proof = _carol_entry(pair), _carol_proof(pair)
    ticket = Ticket.issue("g", carol.groups.did, alice.groups._member_key).to_dict()  # noqa: SLF001 - a real one
    bob_ticket = base.ticket or {}
    version = base.version + 1_000_000 * (seed + 1)

    def signed(data: Any, key: KeyPair) -> Any:
        """Re-signed if it still parses and names the key's owner: the handler then goes deep."""
        try:
            entry = MemberEntry.from_dict(data)
            return entry.signed(key).to_dict()
        except ZeroCommError:
            return data

    for number in range(400):
        version += 10
        entry = inject(rng, {**base.to_dict(), "version": version}) if rng.random() < 0.8 else {
            **base.to_dict(), "version": version}
        bob_body = signed(entry, bob_key)
        carol_body = signed(inject(rng, carol_entry.to_dict()), carol_key)
        choices: list[tuple[Agent, str, type[Any], dict[str, Any]]] = [
            (bob, "bob_conn", gm.ViewUpdate, {"group": "g", "entries": [bob_body]}),
            (bob, "bob_conn", gm.Subscribe, {"group": "g", "member": bob_body, "settings": settings,
                                             "ticket": inject(rng, bob_ticket), "proof": bob_proof}),
            (bob, "bob_conn", gm.Digest, inject(rng, {"group": "g", "state_hash": "0" * 64,
                                                      "versions": {alice.groups.did: 1, bob.groups.did: 2}})),
            (carol, "carol_conn", gm.Subscribe, {"group": "g", "member": carol_body, "settings": settings,
                                                 "ticket": inject(rng, ticket), "proof": carol_proof}),
            (carol, "carol_conn", gm.JoinRequest, {"group": "g", "member": carol_body, "proof": carol_proof}),
            (carol, "carol_conn", gm.ViewUpdate, {"group": "g", "entries": [carol_body]}),
        ]
        sender, conn, kind, body = rng.choice(choices)
        if rng.random() < 0.3:
            body = inject(rng, body)
        message = {"@type": kind.message_type, "@id": f"fuzz-{seed}-{number}", **body}
        try:
            _handle(alice, sender, pair[conn], message)
        except ZeroCommError:
            pass
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {number}: {kind.__name__} raised {type(exc).__name__}: {exc!s:.200} "
                        f"on {json.dumps(body, default=str)[:400]}")
        if rng.random() < 0.15:  # the same entries on the state topic, as a status section
            try:
                status = [MemberEntry.from_dict(bob_body)]
            except ZeroCommError:
                status = []
            if status:
                blob = seal_status("g", bob.groups.did, status, bob.groups._sections(bob.groups._groups["g"]))  # noqa: SLF001
                try:
                    alice.groups._handle_status("g", blob)  # noqa: SLF001 - what the control thread runs
                except Exception as exc:  # noqa: BLE001
                    pytest.fail(f"case {number}: a status raised {type(exc).__name__}: {exc!s:.200}")
        try:
            alice.groups._save(alice.groups._groups["g"])  # noqa: SLF001
        except ZeroCommError as exc:
            pytest.fail(f"case {number}: after {kind.__name__} the group record no longer saves: {exc!s:.200}")
    info = alice.groups.info("g")
    assert bob.groups.did in {m.did for m in info.members}


# --- group names --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["\ud800", "x\udfffy"])
def test_creating_a_group_whose_name_holds_a_lone_surrogate_is_refused_up_front(pair: dict[str, Any],
                                                                                name: str) -> None:
    """check_group let it through; create() then made a group key and an invitation and raised
    UnicodeEncodeError when the name became a topic. Now it is InvalidGroupNameError, nothing made."""
    from zerocomm_spark.errors import InvalidGroupNameError
    from zerocomm_spark.group.topics import check_group

    alice = pair["alice"]
    keys = len(alice._keystore.keys())  # noqa: SLF001
    with pytest.raises(InvalidGroupNameError, match="lone surrogate"):
        check_group(name)
    with pytest.raises(InvalidGroupNameError, match="lone surrogate"):
        alice.groups.create(name)
    assert name not in alice.groups.groups()
    assert len(alice._keystore.keys()) == keys  # noqa: SLF001 - no group key made for it


# --- the in-process API's waits -------------------------------------------------------------------


@pytest.mark.parametrize("forever", [float("nan"), float("inf"), 1e308])
def test_receive_refuses_a_timeout_that_never_passes(pair: dict[str, Any], forever: float) -> None:
    """NaN waited forever (no comparison with it holds) and inf raised OverflowError from the wait."""
    from zerocomm_spark.errors import InvalidTimeoutError, ReceiveTimeoutError

    with pytest.raises(InvalidTimeoutError, match="every wait has a deadline"):
        pair["alice"].groups.receive("g", timeout=forever)
    with pytest.raises(ReceiveTimeoutError):
        pair["alice"].groups.receive("g", timeout=0)  # 0 only looks


# --- endpoints a member may announce ---------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:7000", "tcp://localhost:1", "tcp://node-7.cluster.example.com:65535",
    "tcp://node-7.cluster.example.com.:7000",  # a fully qualified name's trailing dot
    "tcp://[::1]:7000", "tcp://[2001:db8::1]:7000", "tcp://[fe80::1%eth0]:7000",  # with a zone
    "tcp://::1:7000", "tcp://0.0.0.0:7000", "ipc:///tmp/" + "x" * 96, "inproc://plane",
])
def test_every_endpoint_zeromq_connects_to_is_connectable(endpoint: str) -> None:
    """Stricter than libzmq, an endpoint check refuses members whose announcements peers cannot use:
    one too strict refuses a real member everywhere (its joins fail remotely, a stored view drops it)."""
    import zmq

    from zerocomm_spark.transport.peer import connectable

    sock = zmq.Context.instance().socket(zmq.SUB)
    try:
        sock.connect(endpoint)  # what the data plane's IO thread does with it
    finally:
        sock.close(0)
    assert connectable(endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://x", "tcp://127.0:=#1:5", "tcp://h:70000", "tcp://h:0", "tcp://:5",
                                      "udp://h:5", "tcp://h:5\n", "ipc:///tmp/" + "x" * 200, "tcp://h\ud800:5"])
def test_an_endpoint_no_socket_can_use_is_not_connectable(endpoint: str) -> None:
    from zerocomm_spark.transport.peer import connectable

    assert not connectable(endpoint)


def test_an_agent_refuses_to_advertise_an_endpoint_its_peers_would_refuse(tmp_path: Path) -> None:
    """Peers check every member entry with connectable(): an agent advertising what they refuse
    started fine and then failed every join on the remote side."""
    from zerocomm_spark.errors import ConfigurationError

    for bad in ("tcp://x", "tcp://host:0", "tcp://*:7000"):
        with pytest.raises(ConfigurationError, match="advertise"):
            Agent.open(tmp_path / "a", advertise=bad)
    Agent.open(tmp_path / "a", advertise="tcp://[fe80::1%eth0]:7000").close()
