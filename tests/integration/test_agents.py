"""Three agents, each in its own process, on loopback: invitations, DID exchange, messages both ways,
discover features, hostile input, and a restart of every process from the same identity directory.

The agents run tests/integration/agent_driver.py and are driven through their stdin/stdout with
their own Python API. The hostile peer is this test process: a raw ZeroMQ DEALER for broken frames
and a PeerTransport plus real keys and envelopes for broken DIDComm.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from zerocomm_spark.connections import ConnectionStore
from zerocomm_spark.envelope import pack, unpack
from zerocomm_spark.errors import ConfigurationError, ConnectionNotFoundError, PeerTimeoutError, RemoteFrameTooLargeError
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.protocols.basic_message.v1_0.messages import BasicMessage
from zerocomm_spark.protocols.did_exchange.v1_0.manager import DIDExchangeManager
from zerocomm_spark.protocols.did_exchange.v1_0.messages import DIDXResponse
from zerocomm_spark.protocols.message import parse_message
from zerocomm_spark.protocols.out_of_band.v1_1.manager import OutOfBandManager
from zerocomm_spark.transport.frames import Error, ErrorCode, ProtocolId, decode
from zerocomm_spark.transport.peer import PeerInfo, PeerTransport

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

DRIVER = Path(__file__).with_name("agent_driver.py")
MAX_FRAME = 256 * 1024
CALL_TIMEOUT = 20.0
NAMES = ("alice", "bob", "carol")


class AgentCallError(Exception):
    def __init__(self, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.error = error
        self.message = message


class AgentProcess:
    """One agent in a child process, called like the API it wraps."""

    def __init__(self, path: Path, log: Path) -> None:
        self.path = path
        self._log = log.open("a")
        self.proc = subprocess.Popen([sys.executable, "-u", str(DRIVER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def start(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = CALL_TIMEOUT) -> Any:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"agent process {self.path.name} gave no answer in {timeout}s") from None
        if line is None:
            raise AssertionError(f"agent process {self.path.name} exited with {self.proc.wait(5)}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise AgentCallError(answer["error"], answer["message"])
        return answer["result"]

    def call(self, op: str, **args: Any) -> Any:
        self.start(op, **args)
        return self.result()

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("exit")
                self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self._log.close()


def _spawn(root: Path, labels: dict[str, str | None]) -> dict[str, AgentProcess]:
    procs = {name: AgentProcess(root / name, root / f"{name}.log") for name in labels}
    for name, proc in procs.items():  # all start in parallel, then we collect
        args: dict[str, Any] = {"path": str(proc.path), "max_frame_bytes": MAX_FRAME}
        if labels[name] is not None:
            args["label"] = labels[name]
        proc.start("open", **args)
    for proc in procs.values():
        proc.info = proc.result()  # type: ignore[attr-defined]
    return procs


def _connect(inviter: AgentProcess, invitee: AgentProcess) -> dict[str, Any]:
    url = inviter.call("invite")
    assert url.startswith("https://zerocomm.invalid/?oob=")
    return invitee.call("accept", url=url, timeout=10)


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.agents = _spawn(root, {n: n for n in NAMES})
        self.links: dict[tuple[str, str], dict[str, Any]] = {}

    def __getitem__(self, name: str) -> AgentProcess:
        return self.agents[name]

    def stop(self) -> None:
        for proc in self.agents.values():
            proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("agents"))
    try:
        # A triangle, each pair through its own invitation.
        for inviter, invitee in (("alice", "bob"), ("bob", "carol"), ("carol", "alice")):
            c.links[(inviter, invitee)] = _connect(c[inviter], c[invitee])
        yield c
    finally:
        c.stop()


def _by_label(connections: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {conn["label"]: conn for conn in connections}


def test_everyone_is_connected_with_completed_exchanges(cluster: Cluster) -> None:
    for name in NAMES:
        conns = _by_label(cluster[name].call("connections"))
        assert set(conns) == set(NAMES) - {name}
        assert all(c["state"] == "completed" for c in conns.values())
        assert all(c["their_did"].startswith("did:peer:2.") for c in conns.values())
    # Both sides of one link agree on each other's DIDs.
    bob_side = cluster.links[("alice", "bob")]
    alice_side = _by_label(cluster["alice"].call("connections"))["bob"]
    assert bob_side["role"] == "requester" and alice_side["role"] == "responder"
    assert alice_side["their_did"] == bob_side["my_did"] and bob_side["their_did"] == alice_side["my_did"]


def test_messages_flow_both_ways(cluster: Cluster) -> None:
    alice, bob, carol = cluster["alice"], cluster["bob"], cluster["carol"]
    sent = bob.call("send", peer="alice", message="hello alice, bob here")
    got = alice.call("receive", timeout=5)
    assert got["id"] == sent and got["content"] == "hello alice, bob here" and got["label"] == "bob"

    alice_to_bob = _by_label(alice.call("connections"))["bob"]
    alice.call("send", peer=alice_to_bob["their_did"], message="hi bob ✓")  # by DID this time
    got = bob.call("receive", timeout=5)
    assert got["content"] == "hi bob ✓" and got["label"] == "alice"

    carol.call("send", peer="alice", message="one")
    carol.call("send", peer="alice", message="two")
    assert [alice.call("receive", timeout=5)["content"] for _ in range(2)] == ["one", "two"]
    assert [m["content"] for m in alice.call("messages", peer="carol")] == ["one", "two"]
    assert len(alice.call("messages")) == 3

    with pytest.raises(AgentCallError) as info:
        alice.call("send", peer="nobody", message="x")
    assert info.value.error == "ConnectionNotFoundError"
    with pytest.raises(AgentCallError) as info:
        alice.call("receive", timeout=0.2)
    assert info.value.error == "ReceiveTimeoutError"


def test_discover_features_and_ping(cluster: Cluster) -> None:
    everything = cluster["bob"].call("discover", peer="carol", query="*", timeout=5)
    pids = {p["pid"] for p in everything}
    assert "https://didcomm.org/didexchange/1.0" in pids and "https://didcomm.org/basicmessage/1.0" in pids
    assert len(pids) == 5
    some = cluster["carol"].call("discover", peer="alice", query="https://didcomm.org/d*", timeout=5)
    assert sorted(p["pid"] for p in some) == ["https://didcomm.org/didexchange/1.0",
                                              "https://didcomm.org/discover-features/1.0"]
    assert cluster["alice"].call("discover", peer="bob", query="https://example.org/*", timeout=5) == []
    rtt = cluster["alice"].call("ping", peer="carol", timeout=5)
    assert 0 < rtt < 5


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[PeerTransport, "queue.Queue[bytes]"]]:
    """A transport that can send frames bigger than the agents accept, and records what it is sent."""
    inbound: queue.Queue[bytes] = queue.Queue()

    def on_rpc(payload: bytes, peer: PeerInfo) -> bytes:
        inbound.put(payload)
        return b'{"ok":true}'

    transport = PeerTransport(max_frame_bytes=4 * MAX_FRAME)
    transport.register(ProtocolId.DIDCOMM, rpc=on_rpc)
    with transport:
        yield transport, inbound


def _receipt(reply: bytes) -> dict[str, Any]:
    receipt = json.loads(reply)
    assert isinstance(receipt, dict) and isinstance(receipt["ok"], bool)
    return receipt


def _raw_frames(endpoint: str, unanswered: list[bytes], frames: list[bytes]) -> list[Error]:
    """From a bare DEALER, send ``unanswered`` then each of ``frames``, collecting the agent's Error
    answers (deadline 5 s each); an answer to ``unanswered`` would show up in place of the first."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    answers = []
    try:
        for frame in unanswered:
            sock.send(frame)
        for frame in frames:
            sock.send(frame)
            assert sock.poll(5000), "the agent did not answer a broken frame"
            reply = decode(sock.recv())
            assert isinstance(reply, Error) and reply.head == frame[:2]
            answers.append(reply)
    finally:
        sock.close()
    return answers


def test_bad_input_gets_clear_errors_and_the_agent_keeps_serving(
        cluster: Cluster, hostile: tuple[PeerTransport, "queue.Queue[bytes]"], tmp_path: Path) -> None:
    alice, bob, carol = cluster["alice"], cluster["bob"], cluster["carol"]
    client, inbound = hostile
    endpoint = alice.info["endpoint"]  # type: ignore[attr-defined]
    before = len(alice.call("connections", include_incomplete=True))

    # 1. Garbage and truncated wire frames: answered with a ParsingError Error frame.
    # (Frames under 2 bytes name nothing to refuse, so the transport drops them without an answer.)
    errors = _raw_frames(endpoint, [b"", b"\x03"], [b"\xffnot a frame", b"\x03\x00\x01", b"\x03" + b"\x00" * 5])
    assert [e.code for e in errors] == [ErrorCode.PARSING_ERROR] * 3

    # 2. Garbage and truncated envelopes inside valid RPC frames.
    invitation = OutOfBandManager.parse_url(alice.call("invite"))
    good = pack(BasicMessage(content="x").to_dict(), [invitation.recipient_key])
    for payload, error in ((b"\x00garbage", "MalformedEnvelopeError"),
                           (good[: len(good) // 2], "MalformedEnvelopeError"),
                           (good.replace(b'"tag":"', b'"tag":"AAAA', 1), "TamperedEnvelopeError")):
        receipt = _receipt(client.request(endpoint, ProtocolId.DIDCOMM, payload, timeout=5))
        assert receipt == {"ok": False, "error": error, "detail": receipt["detail"]}
    client.send(endpoint, ProtocolId.DIDCOMM, b"junk as a DirectSend")  # no answer expected; must not hurt

    # 3. An envelope for someone else.
    stranger = pack(BasicMessage(content="x").to_dict(), [KeyPair.generate().verkey], sender=KeyPair.generate())
    assert _receipt(client.request(endpoint, ProtocolId.DIDCOMM, stranger, timeout=5))["error"] == "NoRecipientKeyError"

    # 4. An unknown message type, properly encrypted to one of alice's keys.
    unknown = pack({"@type": "https://didcomm.org/no-such-protocol/1.0/thing", "@id": "u-1"},
                   [invitation.recipient_key], sender=KeyPair.generate())
    receipt = _receipt(client.request(endpoint, ProtocolId.DIDCOMM, unknown, timeout=5))
    assert receipt["error"] == "UnknownMessageTypeError" and "no-such-protocol" in receipt["detail"]
    # A valid type that needs a connection, from nobody alice knows.
    orphan = pack(BasicMessage(content="x").to_dict(), [invitation.recipient_key], sender=KeyPair.generate())
    receipt = _receipt(client.request(endpoint, ProtocolId.DIDCOMM, orphan, timeout=5))
    assert receipt["error"] == "ConnectionNotFoundError"

    # 5. An oversized frame.
    with pytest.raises(RemoteFrameTooLargeError):
        client.request(endpoint, ProtocolId.DIDCOMM, b"x" * (MAX_FRAME + 1024), timeout=5)

    # 6. A DID-exchange request, then the same request replayed, then a second use of the invitation.
    with Keystore.open(tmp_path / "mallory") as keystore:
        store = ConnectionStore(keystore)
        oob = OutOfBandManager(keystore, client.endpoint, "mallory")
        didx = DIDExchangeManager(keystore, store, oob, endpoint=client.endpoint, label="mallory")
        record, request, key = didx.create_request(invitation)
        envelope = pack(request.to_dict(), [invitation.recipient_key], sender=key)
        assert _receipt(client.request(endpoint, ProtocolId.DIDCOMM, envelope, timeout=5)) == {"ok": True}
        # The genuine response arrives, signed with the invitation key.
        unpacked = unpack(inbound.get(timeout=5), keystore.find)
        response = parse_message(unpacked.json())
        assert isinstance(response, DIDXResponse) and response.thid == request.id
        assert didx.receive_response(response, recipient_verkey=unpacked.recipient_verkey,
                                     sender_verkey=unpacked.sender_verkey).state == "response-received"

        receipt = _receipt(client.request(endpoint, ProtocolId.DIDCOMM, envelope, timeout=5))
        assert receipt["error"] == "ReplayError"
        _, request2, key2 = didx.create_request(invitation)
        envelope2 = pack(request2.to_dict(), [invitation.recipient_key], sender=key2)
        receipt = _receipt(client.request(endpoint, ProtocolId.DIDCOMM, envelope2, timeout=5))
        assert receipt["error"] == "ReplayError" and "already used" in receipt["detail"]
    assert inbound.empty()  # no second response went out
    assert len(alice.call("connections", include_incomplete=True)) == before + 1

    # 7. Alice is still alive and serving everyone normally.
    assert alice.proc.poll() is None
    bob.call("send", peer="alice", message="still there?")
    assert alice.call("receive", timeout=5)["content"] == "still there?"
    alice.call("send", peer="carol", message="yes")
    assert carol.call("receive", timeout=5)["content"] == "yes"
    assert alice.call("ping", peer="bob", timeout=5) > 0


def test_a_replayed_message_is_refused_by_the_agent_api(cluster: Cluster) -> None:
    # Accepting an invitation that was already used: the inviter refuses, no connection is made.
    url = cluster["alice"].call("invite", label="alice-2")
    cluster["bob"].call("accept", url=url, timeout=10, label="bob-2")  # labels keep peers unambiguous
    with pytest.raises(AgentCallError) as info:
        cluster["carol"].call("accept", url=url, timeout=10)
    assert info.value.error == "ReplayError"
    states = [c["state"] for c in cluster["carol"].call("connections", include_incomplete=True)]
    assert states.count("abandoned") == 1
    with pytest.raises(AgentCallError) as info:
        cluster["carol"].call("accept", url="https://zerocomm.invalid/?oob=garbage", timeout=5)
    assert info.value.error == "InvitationError"


def test_restart_keeps_identities_connections_and_endpoints(cluster: Cluster) -> None:
    before = {name: cluster[name].call("connections") for name in NAMES}
    endpoints = {name: cluster[name].info["endpoint"] for name in NAMES}  # type: ignore[attr-defined]
    for name in NAMES:
        cluster[name].call("close")
        cluster[name].stop()
    started = time.monotonic()
    cluster.agents = _spawn(cluster.root, {n: None for n in NAMES})  # label comes from the keystore
    assert time.monotonic() - started < 20
    for name in NAMES:
        assert cluster[name].info == {"endpoint": endpoints[name], "label": name}  # type: ignore[attr-defined]
        assert cluster[name].call("connections") == before[name]

    alice, bob, carol = cluster["alice"], cluster["bob"], cluster["carol"]
    carol.call("send", peer="alice", message="back again")
    assert alice.call("receive", timeout=5)["content"] == "back again"
    alice.call("send", peer="bob", message="me too")
    assert bob.call("receive", timeout=5)["content"] == "me too"
    assert [p["pid"] for p in bob.call("discover", peer="carol", query="https://didcomm.org/trust_ping/*")] == [
        "https://didcomm.org/trust_ping/1.0"]
    assert carol.call("ping", peer="bob", timeout=5) > 0


def test_agent_lifecycle_in_process(tmp_path: Path) -> None:
    from zerocomm_spark import Agent
    from zerocomm_spark.errors import AgentAlreadyRunningError, AgentClosedError, ConnectionNotReadyError

    with Agent.open(tmp_path / "a", label="a") as a, Agent.open(tmp_path / "b", label="b") as b:
        with pytest.raises(AgentAlreadyRunningError):
            Agent.open(tmp_path / "a")
        conn = b.accept(a.invite(goal_code="aries.rel.build"), timeout=5)
        assert conn.completed and b.connection(conn.id) == conn and b.connection("a") == conn
        # Its own invitation (pasted into the inviter's terminal) made a connection to itself, silently.
        from zerocomm_spark.errors import OwnInvitationError

        with pytest.raises(OwnInvitationError, match="made by this member"):
            a.accept(a.invite(), timeout=5)
        assert a.connections(include_incomplete=True) == [a.connection("b")]
        assert b.connection(conn.their_did) == conn  # type: ignore[arg-type]
        # A second connection with the same label makes the label ambiguous, not silently wrong.
        b.accept(a.invite(), timeout=5)
        with pytest.raises(ConnectionNotFoundError, match="labelled") as ambiguous:
            b.send("a", "which one?")
        assert "Accept an invitation" not in ambiguous.value.hint  # it has two: the hint says to name one
        assert "by its id" in ambiguous.value.hint
        b.send(conn, "by the Connection itself")
        assert a.receive(timeout=5).content == "by the Connection itself"
        # A connection whose exchange did not complete cannot carry messages.
        dead_end = OutOfBandManager.parse_url(a.invite()).invitation
        dead_end.services[0].service_endpoint = "tcp://127.0.0.1:1"  # type: ignore[union-attr]
        with pytest.raises(PeerTimeoutError):
            b.accept(dead_end.to_url(), timeout=0.5)
        stuck = [c for c in b.connections(include_incomplete=True) if c.state == "abandoned"]
        assert len(stuck) == 1
        with pytest.raises(ConnectionNotReadyError):
            b.send(stuck[0].id, "x")

        # receive() blocked in another thread wakes with AgentClosedError when the agent closes.
        outcome: list[BaseException] = []

        def wait(timeout: float) -> None:
            try:
                a.receive(timeout=timeout)
            except BaseException as exc:  # noqa: BLE001
                outcome.append(exc)

        with pytest.raises(ConfigurationError):
            a.receive(timeout=-1)
        waiters = [threading.Thread(target=wait, args=(t,)) for t in (10, float("inf"))]  # inf: as long as None
        for waiter in waiters:
            waiter.start()
        time.sleep(0.2)
        a.close()
        for waiter in waiters:
            waiter.join(5)
        assert not any(w.is_alive() for w in waiters) and len(outcome) == 2
        assert all(isinstance(e, AgentClosedError) for e in outcome), outcome
        with pytest.raises(AgentClosedError):
            a.invite()
    # Closed and reopened in this process: the directory lock was released.
    with Agent.open(tmp_path / "a") as again:
        assert again.label == "a" and len(again.connections()) == 2


def test_round_trips_never_wait_for_the_io_loops_poll_timeout(tmp_path: Path) -> None:
    """A lost wake-up of a transport's IO thread left every later message waiting for its poll
    timeout (250 ms, pings of 250-500 ms instead of ~3 ms): sequential trust pings stay fast."""
    from zerocomm_spark import Agent

    with Agent.open(tmp_path / "a", label="a") as a, Agent.open(tmp_path / "b", label="b") as b:
        conn = b.accept(a.invite(), timeout=10)
        rtts = sorted(b.ping(conn.id, timeout=10) for _ in range(60))
    assert rtts[len(rtts) // 2] < 0.1, f"median trust ping {rtts[len(rtts) // 2] * 1000:.0f} ms"
    assert rtts[int(len(rtts) * 0.8)] < 0.2, f"80th percentile {rtts[int(len(rtts) * 0.8)] * 1000:.0f} ms"


def test_peers_that_never_answer_do_not_hold_up_the_agents_other_replies(tmp_path: Path) -> None:
    """Replies (pings, DID exchange responses...) went out on 4 threads, each blocked until the peer
    answered or 5 s passed: a peer that never answers, sending 40 pings, stalled every other reply of
    the agent for ~50 s. Now nothing waits on a reply's delivery."""
    from zerocomm_spark.member import Agent
    from zerocomm_spark.protocols.trust_ping.v1_0.messages import Ping

    alice, mallory, bob = (Agent.open(tmp_path / n, label=n) for n in ("alice", "mallory", "bob"))
    try:
        record = mallory._resolve(mallory.accept(alice.invite(), timeout=10))  # noqa: SLF001
        gate = threading.Event()
        mallory._transport.register(ProtocolId.DIDCOMM,  # noqa: SLF001 - a black hole from now on
                                    rpc=lambda payload, peer: (gate.wait(20), b'{"ok":true}')[1])
        for _ in range(40):
            mallory._deliver_to(record, Ping(response_requested=True), 5)  # noqa: SLF001 - alice takes each at once
        started = time.monotonic()
        bob.accept(alice.invite(), timeout=10)  # alice's DID exchange response goes out at once
        assert bob.ping("alice", timeout=5) < 5
        assert time.monotonic() - started < 8
        gate.set()
    finally:
        for agent in (bob, alice, mallory):
            agent.close()



# --- found in review F, on in-process agents --------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Any, Any, Any, str]]:
    """Agents a and b, connected: (a, b, b's connection to a, the invitation it used)."""
    from zerocomm_spark.member import Agent

    with Agent.open(tmp_path / "a", label="a") as a, Agent.open(tmp_path / "b", label="b") as b:
        url = a.invite()
        yield a, b, b.accept(url, timeout=10), url


def test_a_ping_in_a_thread_of_its_own_is_answered_on_that_thread(pair: tuple[Any, Any, Any, str]) -> None:
    """The ping_response carried the ping's @id as thid even when the ping continued a thread: a peer
    waiting on its thread id (ACA-Py replies with assign_thread_from) never matched the answer."""
    from zerocomm_spark.protocols.message import Thread
    from zerocomm_spark.protocols.trust_ping.v1_0.messages import Ping

    _, b, conn, _ = pair
    ping = Ping(response_requested=True, thread=Thread(thid="their-own-thread"))
    waiter = b._waiter("ping", "their-own-thread", conn.id)  # noqa: SLF001
    try:
        b._deliver_to(b._resolve(conn), ping, 5)  # noqa: SLF001
        assert waiter.result(timeout=5) is True
    finally:
        b._drop_waiter("ping", "their-own-thread", conn.id)  # noqa: SLF001


def test_a_discover_query_with_the_legacy_prefix_is_answered(pair: tuple[Any, Any, Any, str]) -> None:
    from zerocomm_spark.protocols.message import LEGACY_PREFIX

    _, b, conn, _ = pair
    assert [p.pid for p in b.discover(conn, LEGACY_PREFIX + "trust_ping/*", timeout=5)] == [
        "https://didcomm.org/trust_ping/1.0"]


def test_accepting_a_used_invitation_says_to_ask_for_a_fresh_one(pair: tuple[Any, Any, Any, str],
                                                                 tmp_path: Path) -> None:
    """The refusal said "Nothing to do: the duplicate was ignored", while nothing was connected."""
    from zerocomm_spark.errors import ReplayError
    from zerocomm_spark.member import Agent

    _, _, _, url = pair
    with Agent.open(tmp_path / "c", label="c") as c:
        with pytest.raises(ReplayError, match="fresh invitation") as info:
            c.accept(url, timeout=5)
    assert "duplicate was ignored" not in str(info.value)


def test_a_timeout_of_inf_is_refused_and_the_agent_keeps_working(pair: tuple[Any, Any, Any, str]) -> None:
    """send(timeout=inf) reached the transport, whose IO thread died on int(inf): every later call of
    the agent failed with TransportNotRunningError."""
    from zerocomm_spark.errors import ConfigurationError

    a, b, conn, _ = pair
    for call in (lambda: b.send(conn, "x", timeout=float("inf")), lambda: b.ping(conn, timeout=float("inf"))):
        with pytest.raises(ConfigurationError, match="finite"):
            call()
    time.sleep(0.3)  # an IO loop turn or two
    b.send(conn, "still here", timeout=5)
    assert a.receive(timeout=5).content == "still here"


def test_a_registered_protocol_takes_another_minor_version_of_its_messages(tmp_path: Path) -> None:
    """RFC 0003: a newer agent's 1.x message is processed by an agent that knows 1.0 (core protocols
    already were; protocols added with register_protocol, the group protocol among them, were looked
    up by their exact @type and a 1.1 message was refused as unsupported). Another major version is not."""
    from dataclasses import dataclass
    from typing import ClassVar

    from zerocomm_spark import Agent
    from zerocomm_spark.errors import ZeroCommError
    from zerocomm_spark.protocols.message import DIDCOMM_PREFIX, AgentMessage, ProtocolDescriptor, Thread, req_str

    @dataclass(kw_only=True)
    class Text(AgentMessage):
        text: str

        def body(self) -> dict[str, Any]:
            return {"text": self.text}

        @classmethod
        def parse_body(cls, data: Any) -> dict[str, Any]:
            return {"text": req_str(data, "text")}

    @dataclass(kw_only=True)
    class Ask(Text):
        message_type: ClassVar[str] = DIDCOMM_PREFIX + "zc-minor-test/1.0/ask"

    @dataclass(kw_only=True)
    class NewerAsk(Ask):  # what an agent that speaks 1.3 sends: a field 1.0 does not know
        message_type: ClassVar[str] = DIDCOMM_PREFIX + "zc-minor-test/1.3/ask"

        def body(self) -> dict[str, Any]:
            return {"text": self.text, "priority": "high"}

    @dataclass(kw_only=True)
    class OtherMajorAsk(Ask):
        message_type: ClassVar[str] = DIDCOMM_PREFIX + "zc-minor-test/2.0/ask"

    @dataclass(kw_only=True)
    class Answer(Text):
        message_type: ClassVar[str] = DIDCOMM_PREFIX + "zc-minor-test/1.0/answer"

    seen: list[tuple[str, str]] = []

    def answer(message: Ask, record: Any) -> Answer:
        seen.append((type(message).__name__, message.text))
        return Answer(text=message.text.upper(), thread=Thread(thid=message.id))

    descriptor = ProtocolDescriptor(DIDCOMM_PREFIX + "zc-minor-test/1.0", ("responder",))
    with Agent.open(tmp_path / "old", label="old") as old, Agent.open(tmp_path / "new", label="new") as new:
        old.register_protocol(descriptor, {Ask: answer})
        new.register_protocol(ProtocolDescriptor(DIDCOMM_PREFIX + "zc-minor-test/1.3", ("asker",)), {},
                              replies=(Answer,))
        conn = new.accept(old.invite(), timeout=10)
        reply = new.request(conn, NewerAsk(text="hello"), timeout=10)
        assert isinstance(reply, Answer) and reply.text == "HELLO"
        assert seen == [("Ask", "hello")]  # taken as the 1.0 message it knows, the new field ignored
        with pytest.raises(ZeroCommError, match="unsupported|no handler"):
            new.request(conn, OtherMajorAsk(text="nope"), timeout=10)
        assert seen == [("Ask", "hello")]


def _thread_ids_of_waiters(agent: Any) -> list[str]:
    """The thread ids ``agent`` starts waiting on from now on, in order (a spy on its waiters)."""
    thids: list[str] = []
    real_waiter = agent._waiter  # noqa: SLF001

    def spy(kind: str, thid: str, *args: Any) -> Any:
        thids.append(thid)
        return real_waiter(kind, thid, *args)

    agent._waiter = spy  # noqa: SLF001
    return thids


@pytest.mark.parametrize("kind", ["ping", "discover"])
def test_an_answer_on_another_connection_does_not_settle_a_ping_or_discover(tmp_path: Path, kind: str) -> None:
    """Ping and discover-features waiters were keyed by thread id alone: any connected peer that learnt
    (or guessed) the id could answer in the silent peer's place, and the caller took it as that peer's."""
    from zerocomm_spark.errors import ProtocolError, RemoteError, ZeroCommError
    from zerocomm_spark.member import Agent
    from zerocomm_spark.protocols.discover_features.v1_0.messages import Disclose, Query
    from zerocomm_spark.protocols.message import Thread
    from zerocomm_spark.protocols.trust_ping.v1_0.messages import Ping, PingResponse

    with Agent.open(tmp_path / "a", label="a") as a, Agent.open(tmp_path / "b", label="b") as b, \
            Agent.open(tmp_path / "m", label="mallory") as m:
        b.accept(a.invite(), timeout=10)
        m.accept(a.invite(), timeout=10)
        by_label = {c.label: c for c in a.connections()}
        to_m = next(c for c in m.connections())
        # b takes pings and queries but never answers them: a waits on its connection to b.
        b._handlers[Ping] = b._handlers[Query] = lambda message, context: None  # noqa: SLF001
        thids = _thread_ids_of_waiters(a)
        outcome: list[Any] = []

        def call() -> None:
            try:
                outcome.append(a.ping(by_label["b"], timeout=3) if kind == "ping"
                               else a.discover(by_label["b"], timeout=3))
            except ZeroCommError as exc:
                outcome.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        deadline = time.monotonic() + 5
        while not thids and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thids
        forged = (PingResponse(thread=Thread(thid=thids[0])) if kind == "ping"
                  else Disclose(protocols=[], thread=Thread(thid=thids[0])))
        with pytest.raises((ProtocolError, RemoteError)):
            m._deliver_to(m._resolve(to_m), forged, 5)  # noqa: SLF001
        caller.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], PeerTimeoutError), outcome


@pytest.mark.parametrize("kind", ["ping", "discover"])
def test_a_late_answer_is_dropped_quietly_and_only_from_the_peer_asked(tmp_path: Path, kind: str) -> None:
    """An answer that came after its request's deadline was refused as answering nothing, and the peer
    logged its delivery as failed (a warning, seen after an agent restart). It is dropped quietly now -
    only from the connection the request went to, and only for a request of ours that was given up."""
    from zerocomm_spark.errors import ProtocolError, RemoteError, ZeroCommError
    from zerocomm_spark.member import Agent
    from zerocomm_spark.protocols.discover_features.v1_0.messages import Disclose, Query
    from zerocomm_spark.protocols.message import Thread
    from zerocomm_spark.protocols.trust_ping.v1_0.messages import Ping, PingResponse

    with Agent.open(tmp_path / "a", label="a") as a, Agent.open(tmp_path / "b", label="b") as b, \
            Agent.open(tmp_path / "m", label="mallory") as m:
        b.accept(a.invite(), timeout=10)
        m.accept(a.invite(), timeout=10)
        to_b = next(c for c in a.connections() if c.label == "b")
        b_to_a, m_to_a = next(iter(b.connections())), next(iter(m.connections()))
        b._handlers[Ping] = b._handlers[Query] = lambda message, context: None  # noqa: SLF001  # b is slow
        thids = _thread_ids_of_waiters(a)
        with pytest.raises(ZeroCommError):
            a.ping(to_b, timeout=0.5) if kind == "ping" else a.discover(to_b, timeout=0.5)
        assert len(thids) == 1

        def answer(thid: str) -> Any:
            return (PingResponse(thread=Thread(thid=thid)) if kind == "ping"
                    else Disclose(protocols=[], thread=Thread(thid=thid)))

        with pytest.raises((ProtocolError, RemoteError)):  # another peer cannot answer for b, late either
            m._deliver_to(m._resolve(m_to_a), answer(thids[0]), 5)  # noqa: SLF001
        b._deliver_to(b._resolve(b_to_a), answer(thids[0]), 5)  # noqa: SLF001  # b's late answer: accepted
        with pytest.raises((ProtocolError, RemoteError)):  # once only
            b._deliver_to(b._resolve(b_to_a), answer(thids[0]), 5)  # noqa: SLF001
        with pytest.raises((ProtocolError, RemoteError)):  # and never for a thread we never started
            b._deliver_to(b._resolve(b_to_a), answer("not-ours"), 5)  # noqa: SLF001


def test_unreceived_basic_messages_are_bounded_and_refused_not_dropped_beyond(
        pair: tuple[Any, Any, Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every basic message waited in the receive() queue until received, with no bound: a connected
    peer sending large ones (16 MiB frames) grew the agent's memory without end. The queue is bounded
    now (count and characters); past it a message is refused with a typed error the sender gets,
    never dropped, and accepted again once the application received some."""
    from zerocomm_spark import errors, member

    a, b, conn, _ = pair
    monkeypatch.setattr(member, "MAX_INBOX", 3, raising=False)
    for i in range(3):
        b.send(conn, f"m{i}", timeout=5)
    with pytest.raises(errors.InboxFullError):
        b.send(conn, "one too many", timeout=5)
    assert [m.content for m in a.messages()] == ["m0", "m1", "m2"]  # the refused one is nowhere
    assert a.receive(timeout=5).content == "m0"
    b.send(conn, "m3", timeout=5)
    assert [a.receive(timeout=5).content for _ in range(3)] == ["m1", "m2", "m3"]
    # The same by size: one message alone is always taken, a second past the budget is refused.
    monkeypatch.setattr(member, "MAX_INBOX_CHARS", 1000, raising=False)
    b.send(conn, "x" * 1500, timeout=5)
    with pytest.raises(errors.InboxFullError):
        b.send(conn, "y", timeout=5)
    assert a.receive(timeout=5).content == "x" * 1500
    # messages() keeps recent ones within a size budget too (it was 10,000 of any size).
    monkeypatch.setattr(member, "MAX_HISTORY_CHARS", 2000, raising=False)
    for text in ("p" * 900, "q" * 900, "r" * 900):
        b.send(conn, text, timeout=5)
        a.receive(timeout=5)
    assert [m.content[0] for m in a.messages()] == ["q", "r"]


def test_an_agent_without_an_inbox_keeps_taking_basic_messages(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent process reads basic messages through messages() only and never calls receive(): it
    opens its member with inbox=False, so nothing waits for a receive() that never comes."""
    from zerocomm_spark import member
    from zerocomm_spark.member import Agent

    monkeypatch.setattr(member, "MAX_INBOX", 2, raising=False)
    with Agent.open(tmp_path / "a", label="a", inbox=False) as a, Agent.open(tmp_path / "b", label="b") as b:
        conn = b.accept(a.invite(), timeout=10)
        for i in range(5):
            b.send(conn, f"m{i}", timeout=5)
        assert [m.content for m in a.messages()] == [f"m{i}" for i in range(5)]
        with pytest.raises(ConfigurationError, match="inbox"):
            a.receive(timeout=0)
