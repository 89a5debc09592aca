"""Group data planes over real ZeroMQ on loopback, with real CURVE, envelopes and keystores.

Each test wires 2-8 DataPlanes in this process by hand, the way membership will: every pair gets
relationship key pairs in their keystores, every member a group key, and each side adds the other
as a RemoteMember. Raw ZeroMQ sockets play the eavesdropper and the rogue publisher.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import nacl.bindings
import pytest
import zmq

from zerocomm_spark import envelope
from zerocomm_spark.errors import (
    BackpressureError,
    ConfigurationError,
    FrameTooLargeError,
    GroupError,
    GroupNotOpenError,
    InvalidTimeoutError,
    MalformedGroupMessageError,
    MessagesDroppedError,
    NotAMemberError,
    PeerTimeoutError,
    ReadOnlyMemberError,
)
from zerocomm_spark.group import DataPlane, DataPlaneConfig, Delivered, RemoteMember
from zerocomm_spark.group import datamessage as dm
from zerocomm_spark.group import topics
from zerocomm_spark.group.lamport import LamportClock
from zerocomm_spark.keys.keypair import KeyPair, verkey_bytes
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.transport.frames import ProtocolId
from zerocomm_spark.transport.peer import DEFAULT_MAX_FRAME_BYTES, PeerTransport

pytestmark = pytest.mark.timeout(120)

FAST = DataPlaneConfig(nack_after_ms=30, nack_retry_ms=100, resend_after_ms=300, ack_interval_ms=20,
                       keepalive_ms=500, dead_after_ms=3000)


@dataclass
class Node:
    """One member: keystore, transport, data plane, and what it received."""

    did: str
    directory: Path
    config: DataPlaneConfig
    ks: Keystore = field(init=False)
    tr: PeerTransport = field(init=False)
    curve: tuple[bytes, bytes] = field(init=False)
    dp: DataPlane = field(init=False)
    got: list[Delivered] = field(default_factory=list)
    states: list[tuple[str, bytes]] = field(default_factory=list)
    group_keys: dict[str, KeyPair] = field(default_factory=dict)
    rel: dict[str, KeyPair] = field(default_factory=dict)  # peer DID -> our relationship key with it
    hook: Callable[[Delivered], None] | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        self.ks = Keystore.open(self.directory)
        self.curve = zmq.curve_keypair()
        self.start()

    def start(self) -> None:
        self.tr = PeerTransport(max_frame_bytes=self.max_frame_bytes).start()
        self.got = []
        self.dp = DataPlane(member_did=self.did, keystore=self.ks, transport=self.tr, curve_keypair=self.curve,
                            on_deliver=self._deliver, on_state=self._state, config=self.config).start()

    def _deliver(self, d: Delivered) -> None:
        if self.hook is not None:
            self.hook(d)
        with self.cond:
            self.got.append(d)
            self.cond.notify_all()

    def _state(self, group: str, blob: bytes, did: str) -> None:
        with self.cond:
            self.states.append((group, blob))
            self.cond.notify_all()

    def stop(self) -> None:
        self.dp.close(2)
        self.tr.close(2)

    def from_(self, publisher: Node, group: str = "g") -> list[Delivered]:
        with self.cond:
            return [d for d in self.got if d.publisher_did == publisher.did and d.group == group]

    def wait(self, pred: Callable[[], bool], timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(min(remaining, 0.1))
        return True


def remote(of: Node, at: Node, group: str, role: str = "read_write") -> RemoteMember:
    """``of`` as ``at`` knows it after DID exchange and subscribe."""
    if of.did not in at.rel:
        at.rel[of.did] = at.ks.create_key("relationship", ref=of.did)
    if at.did not in of.rel:
        of.rel[at.did] = of.ks.create_key("relationship", ref=at.did)
    return RemoteMember(did=of.did, group_verkey=of.group_keys[group].verkey,
                        relationship_verkey=of.rel[at.did].verkey, my_relationship_verkey=at.rel[of.did].verkey,
                        publish_endpoint=of.dp.publish_endpoint, transport_key=of.curve[0].decode(),
                        peer_endpoint=of.tr.endpoint, role=role)


def form_group(nodes: list[Node], group: str = "g", mode: str = "shared", *, ordered: bool = True,
               probe: bool = True) -> None:
    for n in nodes:
        if group not in n.group_keys:
            n.group_keys[group] = n.ks.create_key("group", ref=group)
        n.dp.open_group(group, mode=mode, ordered=ordered, group_key=n.group_keys[group], role="read_write")  # type: ignore[arg-type]
    for a in nodes:
        for b in nodes:
            if a is not b:
                a.dp.add_member(group, remote(b, a, group))
    if probe:
        for a in nodes:
            for b in nodes:
                if a is not b:
                    assert a.dp.probe(group, b.did, timeout=10) < 10


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def factory(name: str, config: DataPlaneConfig = FAST, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Node:
        node = Node(f"did:example:{name}", tmp_path / name, config, max_frame_bytes=max_frame_bytes)
        made.append(node)
        return node

    yield factory
    for n in made:
        n.dp.close(2)
    # Transports linger up to a second on frames to peers that already left: close them together.
    closers = [threading.Thread(target=n.tr.close, args=(2,)) for n in made]
    for c in closers:
        c.start()
    for c in closers:
        c.join(5)
    for n in made:
        n.ks.close()


def payloads(publisher: str, n: int, start: int = 0) -> list[bytes]:
    return [f"{publisher}:{i}".encode() for i in range(start, start + n)]


# --- delivery in every mode ----------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "size"), [("single", 4), ("multi", 4), ("shared", 8)])
def test_burst_is_delivered_in_publisher_order_to_every_member(make, mode: str, size: int) -> None:  # type: ignore[no-untyped-def]
    nodes = [make(f"m{i}") for i in range(size)]
    form_group(nodes, mode=mode)
    alice, bob = nodes[0], nodes[1]
    receipts = []

    def burst_one_by_one() -> None:
        receipts.extend(alice.dp.publish("g", [p]) for p in payloads("alice", 1000))

    t = threading.Thread(target=burst_one_by_one)
    t.start()
    receipts.append(bob.dp.publish("g", payloads("bob", 1000), headers={"kind": "burst"}))  # one call
    t.join(30)
    for r in receipts:
        r.wait(20)
        assert r.done()
    for n in nodes:
        for pub in (alice, bob):
            if n is pub:
                continue
            assert n.wait(lambda: len(n.from_(pub)) >= 1000), (n.did, pub.did, len(n.from_(pub)))
            got = n.from_(pub)
            assert [d.seq for d in got] == list(range(1, 1001))
            assert [d.payload for d in got] == payloads("alice" if pub is alice else "bob", 1000)
            assert len({d.message_id for d in got}) == 1000
    assert all(d.headers == {"kind": "burst"} for d in nodes[2].from_(bob))
    assert all(d.headers is None for d in nodes[2].from_(alice))
    # Lamport stamps grow with seq per publisher; every member ends up past every stamp it saw.
    for n in nodes[2:]:
        stamps = [d.lamport_ts for d in n.from_(alice)]
        assert stamps == sorted(stamps) and len(set(stamps)) == 1000
        assert n.dp.lamport_time >= max(stamps)
    s = nodes[-1].dp.stats()
    assert s["messages_in"] == 2000 and s["duplicates_dropped"] == 0 and s["lost"] == 0
    assert all(n.dp.stats()["forged_batches"] == 0 for n in nodes)  # every batch signed and verified
    if mode == "single":
        assert s["not_for_me"] > 0  # others' envelopes were skipped, by kid, without decrypting
    elif mode == "multi":
        assert s["not_for_me"] == 0  # pair topics: only our own envelopes ever arrive
    else:  # shared: data envelopes are for everyone; only hellos probing the others are skipped
        assert s["not_for_me"] <= sum(n.dp.stats()["probes_sent"] for n in nodes[:-1])
    assert alice.dp.stats()["envelopes_out"] < 1000 * (size - 1) / 4  # batched: crypto per batch


def test_unordered_group_delivers_everything_once(make) -> None:  # type: ignore[no-untyped-def]
    nodes = [make(f"u{i}") for i in range(3)]
    form_group(nodes, mode="shared", ordered=False)
    r = nodes[0].dp.publish("g", payloads("u0", 500))
    r.wait(20)
    for n in nodes[1:]:
        assert n.wait(lambda: len(n.from_(nodes[0])) >= 500)
        assert sorted(d.seq for d in n.from_(nodes[0])) == list(range(1, 501))


def test_state_blobs_reach_the_others_opaque(make) -> None:  # type: ignore[no-untyped-def]
    nodes = [make(f"s{i}") for i in range(3)]
    form_group(nodes, mode="multi")
    blob = bytes(range(256)) * 3
    nodes[0].dp.publish_state("g", blob)
    for n in nodes[1:]:
        assert n.wait(lambda: ("g", blob) in n.states)
    assert nodes[0].states == []


# --- topics, eavesdroppers, strangers -------------------------------------------------------------


def test_exact_topics_keep_bob_and_bob2_and_g_and_g2_apart(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob, bob2 = make("alice"), make("bob"), make("bob2")
    form_group([alice, bob, bob2], "g", mode="multi")
    form_group([alice, bob2], "g2", mode="multi")
    alice.dp.publish("g", [b"g-1", b"g-2"]).wait(10)
    alice.dp.publish("g2", [b"g2-secret"]).wait(10)
    assert bob2.wait(lambda: len(bob2.from_(alice, "g2")) == 1 and len(bob2.from_(alice, "g")) == 2)
    assert bob.wait(lambda: len(bob.from_(alice, "g")) == 2)
    time.sleep(0.2)
    assert [d.payload for d in bob.got] == [b"g-1", b"g-2"]  # nothing of g2, nothing of bob2's queue
    s = bob.dp.stats()
    assert s["not_for_me"] == 0 and s["wrong_topic"] == 0 and s["rejected_non_member"] == 0
    # bob's own, admitted CURVE key cannot subscribe to g2 (not his group) nor to bob2's pair topic.
    ctx = zmq.Context()
    spy = ctx.socket(zmq.SUB)
    try:
        spy.curve_serverkey = alice.curve[0]
        spy.curve_publickey, spy.curve_secretkey = bob.curve
        spy.connect(alice.dp.publish_endpoint)
        for t in (topics.data_topic("g2"), topics.state_topic("g2"), topics.pair_topic("g", alice.did, bob2.did),
                  topics.pair_topic("g2", alice.did, bob2.did), b"", b"urn:didcomm-queue:g"):
            spy.setsockopt(zmq.SUBSCRIBE, t)
        before = alice.dp.stats()["subscriptions_refused"]
        deadline = time.monotonic() + 5
        while alice.dp.stats()["subscriptions_refused"] < before + 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert alice.dp.stats()["subscriptions_refused"] >= before + 6
        for i in range(3):
            alice.dp.publish("g2", [b"more-g2-%d" % i])
            alice.dp.publish("g", [b"more-g-%d" % i])
            alice.dp.publish_state("g2", b"state")
        spy.setsockopt(zmq.RCVTIMEO, 500)
        with pytest.raises(zmq.Again):
            spy.recv_multipart()
    finally:
        spy.close(0)
        ctx.term()


def test_eavesdropper_with_unknown_curve_key_receives_nothing(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    ctx = zmq.Context()
    spy = ctx.socket(zmq.SUB)
    try:
        spy.curve_serverkey = alice.curve[0]
        spy.curve_publickey, spy.curve_secretkey = zmq.curve_keypair()
        spy.connect(alice.dp.publish_endpoint)
        spy.setsockopt(zmq.SUBSCRIBE, b"")
        spy.setsockopt(zmq.SUBSCRIBE, topics.data_topic("g"))
        time.sleep(0.3)
        alice.dp.publish("g", payloads("alice", 50)).wait(10)
        alice.dp.publish_state("g", b"status")
        spy.setsockopt(zmq.RCVTIMEO, 700)
        with pytest.raises(zmq.Again):
            spy.recv_multipart()
        assert bob.wait(lambda: len(bob.from_(alice)) == 50)
    finally:
        spy.close(0)
        ctx.term()


def test_non_member_publisher_is_ignored(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob, mallory = make("alice"), make("bob"), make("mallory")
    form_group([alice, bob], mode="shared")
    # mallory adds bob on her side only: bob never admitted her, so nothing of hers reaches him.
    mallory.group_keys["g"] = mallory.ks.create_key("group")
    mallory.dp.open_group("g", mode="shared", ordered=True, group_key=mallory.group_keys["g"], role="read_write")
    mallory.dp.add_member("g", remote(bob, mallory, "g"))
    with pytest.raises(PeerTimeoutError):
        mallory.dp.probe("g", bob.did, timeout=1.0)
    mallory.dp.publish("g", [b"forged"] * 5)
    alice.dp.publish("g", [b"real"]).wait(10)
    assert bob.wait(lambda: len(bob.from_(alice)) == 1)
    time.sleep(0.3)
    assert [d.payload for d in bob.got] == [b"real"]


def test_forged_envelopes_on_a_members_queue_are_dropped_and_counted(make) -> None:  # type: ignore[no-untyped-def]
    """A raw XPUB holding carol's CURVE key (as if her transport were compromised) cannot make bob
    deliver anything that is not authcrypted by carol's group key and about carol's own stream."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    carol_curve = zmq.curve_keypair()
    carol_group = KeyPair.generate()
    carol_rel = KeyPair.generate()
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.XPUB)
    try:
        rogue.curve_server = True
        rogue.curve_publickey, rogue.curve_secretkey = carol_curve
        rogue.bind("tcp://127.0.0.1:*")
        endpoint = rogue.getsockopt_string(zmq.LAST_ENDPOINT)
        bob.rel["did:example:carol"] = bob.ks.create_key("relationship")
        bob.dp.add_member("g", RemoteMember(
            did="did:example:carol", group_verkey=carol_group.verkey, relationship_verkey=carol_rel.verkey,
            my_relationship_verkey=bob.rel["did:example:carol"].verkey, publish_endpoint=endpoint,
            transport_key=carol_curve[0].decode(), peer_endpoint="tcp://127.0.0.1:1"))
        rogue.setsockopt(zmq.RCVTIMEO, 5000)
        assert rogue.recv()[0] == 1  # bob's SUB subscribed
        msg = dm.DataMessage("x", 1, 1, time.time(), b"forged")
        stranger = KeyPair.generate()
        forged_sender = envelope.pack(dm.encode(dm.DataBatch("g", "did:example:carol", (msg,)), signer=stranger),
                                      [bob.group_keys["g"].verkey], sender=stranger)
        # signed by carol's group key, but about alice's stream or another group: refused on the claims
        forged_publisher = envelope.pack(dm.encode(dm.DataBatch("g", alice.did, (msg,)), signer=carol_group),
                                         [bob.group_keys["g"].verkey], sender=carol_group)
        forged_group = envelope.pack(dm.encode(dm.DataBatch("g2", "did:example:carol", (msg,)), signer=carol_group),
                                     [bob.group_keys["g"].verkey], sender=carol_group)
        # from carol's group key but unsigned, or signed by someone else: refused on the signature
        unsigned = envelope.pack(dm.encode(dm.DataBatch("g", "did:example:carol", (msg,))),
                                 [bob.group_keys["g"].verkey], sender=carol_group)
        wrong_signer = envelope.pack(dm.encode(dm.DataBatch("g", "did:example:carol", (msg,)), signer=stranger),
                                     [bob.group_keys["g"].verkey], sender=carol_group)
        before = bob.dp.stats()
        for _ in range(20):
            for env in (forged_sender, forged_publisher, forged_group, unsigned, wrong_signer):
                rogue.send_multipart([topics.data_topic("g"), env])
            rogue.send_multipart([topics.data_topic("g") + b"x", forged_sender])  # not our exact topic
            time.sleep(0.02)
        deadline = time.monotonic() + 5
        while (bob.dp.stats()["rejected_non_member"] < before["rejected_non_member"] + 60
               or bob.dp.stats()["forged_batches"] < before["forged_batches"] + 40) and time.monotonic() < deadline:
            time.sleep(0.05)
        after = bob.dp.stats()
        assert after["rejected_non_member"] >= before["rejected_non_member"] + 60
        assert after["forged_batches"] >= before["forged_batches"] + 40
        assert bob.got == []
        assert bob.dp.positions("g").get("did:example:carol", 0) == 0
    finally:
        rogue.close(0)
        ctx.term()


def _b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def _unb64u(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def recipients(env: bytes) -> set[str]:
    return {r["header"]["kid"] for r in json.loads(_unb64u(json.loads(env)["protected"]))["recipients"]}


def reuse_recipient_entry(env: bytes, attacker: KeyPair, body: bytes) -> bytes:
    """The attack on multi-recipient authcrypt: ``attacker``, one recipient of a shared envelope,
    unwraps the content key from its own entry and encrypts ``body`` under the same protected
    header, so every other recipient's entry (wrapped by the publisher) still opens it."""
    outer = json.loads(env)
    protected = outer["protected"]
    header = json.loads(_unb64u(protected))
    entry = next(r for r in header["recipients"] if r["header"]["kid"] == attacker.verkey)
    sk, pk = bytes(attacker.x25519_private()), bytes(attacker.x25519_public())
    sender = nacl.bindings.crypto_box_seal_open(_unb64u(entry["header"]["sender"]), pk, sk).decode("ascii")
    sender_pk = nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(verkey_bytes(sender))
    cek = nacl.bindings.crypto_box_open(_unb64u(entry["encrypted_key"]), _unb64u(entry["header"]["iv"]), sender_pk, sk)
    iv = os.urandom(12)
    sealed = nacl.bindings.crypto_aead_chacha20poly1305_ietf_encrypt(body, protected.encode("ascii"), iv, cek)
    return json.dumps({"protected": protected, "iv": _b64u(iv), "ciphertext": _b64u(sealed[:-16]),
                       "tag": _b64u(sealed[-16:])}).encode("ascii")


def test_member_reusing_anothers_key_entry_cannot_forge_the_publishers_batches(make) -> None:  # type: ignore[no-untyped-def]
    """mallory, a member of a shared-mode group, sits on the path from alice to bob (she holds alice's
    CURVE key, as if alice's transport were compromised). From alice's genuine envelopes, which she
    can open, she crafts batches that open for bob as authcrypted by alice's group key. Without a
    publisher signature bob would deliver them as alice's; with it he drops and counts them."""
    alice, bob, mallory = make("alice"), make("bob"), make("mallory")
    form_group([alice, bob, mallory], mode="shared")
    g_alice, g_bob, g_mallory = (n.group_keys["g"] for n in (alice, bob, mallory))
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.XPUB)  # plays alice's publish socket towards bob
    relay = ctx.socket(zmq.SUB)  # mallory's own admitted subscription to alice
    try:
        rogue.curve_server = True
        rogue.curve_publickey, rogue.curve_secretkey = alice.curve
        rogue.bind("tcp://127.0.0.1:*")
        relay.curve_serverkey = alice.curve[0]
        relay.curve_publickey, relay.curve_secretkey = mallory.curve
        accepted = alice.dp.stats()["subscriptions_accepted"]
        relay.connect(alice.dp.publish_endpoint)
        relay.setsockopt(zmq.SUBSCRIBE, topics.data_topic("g"))
        # bob's SUB to alice now goes through mallory (same DID and keys, another endpoint)
        bob.dp.add_member("g", replace(remote(alice, bob, "g"), publish_endpoint=rogue.getsockopt_string(
            zmq.LAST_ENDPOINT)))
        rogue.setsockopt(zmq.RCVTIMEO, 5000)
        assert rogue.recv()[0] == 1  # bob subscribed at the rogue
        deadline = time.monotonic() + 5
        while alice.dp.stats()["subscriptions_accepted"] <= accepted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert alice.dp.stats()["subscriptions_accepted"] > accepted  # mallory's relay subscribed at alice

        captured: list[bytes] = []
        poller = zmq.Poller()
        poller.register(relay, zmq.POLLIN)

        def pump(until: Callable[[], bool], timeout: float = 10.0) -> bool:
            """Relay alice's frames to bob (keeping copies) until ``until()``."""
            end = time.monotonic() + timeout
            while not until():
                if time.monotonic() >= end:
                    return False
                if poller.poll(20):
                    while True:
                        try:
                            frames = relay.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        captured.append(frames[1])
                        rogue.send_multipart(frames)
            return True

        real = payloads("alice", 20)
        alice.dp.publish("g", real[:10])
        assert pump(lambda: len(bob.from_(alice)) >= 10), len(bob.from_(alice))
        genuine = next(e for e in captured if {g_bob.verkey, g_mallory.verkey} <= recipients(e))  # a data batch
        opened = envelope.unpack(genuine, lambda kid: g_mallory if kid == g_mallory.verkey else None)
        assert opened.sender_verkey == g_alice.verkey
        signed = dm.decode(opened.message)
        assert isinstance(signed, dm.DataBatch) and dm.verify(signed, g_alice.verkey)

        fake = dm.DataBatch("g", alice.did, (dm.DataMessage("forged-11", 11, 10**6, time.time(), b"FORGED"),))
        fake_plain = dm.encode(fake)
        # alice's genuine signature on a batch whose bytes mallory changed
        head = opened.message[:opened.message.index(b'"message":') + len(b'"message":')]
        altered = head + fake_plain + b"}"
        # a genuine batch signed by alice for mallory (her own resend answer), replayed to bob
        ask = envelope.pack(dm.encode(dm.ResendRequest("g", alice.did, mallory.did, 1, None)),
                            [alice.rel[mallory.did].verkey], sender=mallory.rel[alice.did])
        answer = mallory.tr.request(alice.tr.endpoint, ProtocolId.GROUP_DATA, ask, timeout=10)
        for_mallory = envelope.unpack(answer, lambda kid: mallory.rel[alice.did]).message
        assert dm.verify(dm.decode(for_mallory), g_alice.verkey) and dm.decode(for_mallory).member == mallory.did
        bodies = {
            "unsigned": fake_plain,
            "signed by mallory": dm.encode(fake, signer=g_mallory),
            "signature copied onto other bytes": altered,
            "replay of a batch signed for mallory": for_mallory,
        }
        before = bob.dp.stats()
        for body in bodies.values():
            forged = reuse_recipient_entry(genuine, g_mallory, body)
            # the attack works on the envelope: bob opens it as authcrypted by alice's group key
            seen = envelope.unpack(forged, lambda kid: g_bob if kid == g_bob.verkey else None)
            assert seen.sender_verkey == g_alice.verkey and seen.message == body
            rogue.send_multipart([topics.data_topic("g"), forged])
        assert pump(lambda: bob.dp.stats()["forged_batches"] >= before["forged_batches"] + len(bodies)
                    or len(bob.from_(alice)) > 10)
        assert [d.payload for d in bob.from_(alice)] == real[:10]  # nothing forged delivered
        after = bob.dp.stats()
        assert after["forged_batches"] == before["forged_batches"] + len(bodies)
        assert after["messages_in"] == before["messages_in"] == 10
        # the slot mallory aimed at is filled by alice's real message 11, and everything flows on
        alice.dp.publish("g", real[10:])
        assert pump(lambda: len(bob.from_(alice)) >= 20), len(bob.from_(alice))
        got = bob.from_(alice)
        assert [d.payload for d in got] == real and [d.seq for d in got] == list(range(1, 21))
        assert all(b"FORGED" not in d.payload for d in bob.got)
        assert mallory.dp.stats()["forged_batches"] == alice.dp.stats()["forged_batches"] == 0
    finally:
        rogue.close(0)
        relay.close(0)
        ctx.term()


# --- roles -----------------------------------------------------------------------------------------


def test_read_only_publisher_is_rejected(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob, carol = make("alice"), make("bob"), make("carol")
    form_group([alice, bob, carol], mode="shared")
    bob.dp.set_role("g", carol.did, "read_only")  # bob's view: carol may only read
    carol.dp.publish("g", [b"from carol"] * 3)
    assert alice.wait(lambda: len(alice.from_(carol)) == 3)
    deadline = time.monotonic() + 5
    while bob.dp.stats()["rejected_read_only"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bob.dp.stats()["rejected_read_only"] >= 3
    assert bob.from_(carol) == []
    carol.dp.set_role("g", carol.did, "read_only")
    with pytest.raises(ReadOnlyMemberError):
        carol.dp.publish("g", [b"again"])
    assert [m.role for m in bob.dp.members("g") if m.did == carol.did] == ["read_only"]


def test_api_errors_are_specific(make) -> None:  # type: ignore[no-untyped-def]
    alice = make("alice")
    with pytest.raises(GroupNotOpenError):
        alice.dp.publish("nope", [b"x"])
    alice.group_keys["g"] = alice.ks.create_key("group")
    alice.dp.open_group("g", mode="single", ordered=True, group_key=alice.group_keys["g"], role="read_write")
    with pytest.raises(TypeError):
        alice.dp.publish("g", b"not a list")  # type: ignore[arg-type]
    with pytest.raises(NotAMemberError):
        alice.dp.remove_member("g", "did:example:nobody")
    with pytest.raises(NotAMemberError):
        alice.dp.probe("g", "did:example:nobody", timeout=0.2)
    assert alice.dp.publish("g", []).done()
    # Every wait has a deadline: a timeout that never passes is refused before anything waits.
    for forever in (float("inf"), float("nan"), None, 10.0**300):
        with pytest.raises(InvalidTimeoutError):
            alice.dp.probe("g", "did:example:nobody", timeout=forever)  # type: ignore[arg-type]
        with pytest.raises(InvalidTimeoutError):
            alice.dp.publish_state("g", b"state", timeout=forever)  # type: ignore[arg-type]
        with pytest.raises(InvalidTimeoutError):
            alice.dp.restore_positions("g", {}, timeout=forever)  # type: ignore[arg-type]


# --- reliability ---------------------------------------------------------------------------------


def test_killed_subscriber_socket_recovers_by_nack(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob, carol = make("alice"), make("bob"), make("carol")
    form_group([alice, bob, carol], mode="single")
    for i in range(10):
        alice.dp.publish("g", payloads("alice", 100, start=100 * i))
        if i == 3:
            bob.dp._kill_subscription("g", alice.did, down_for=0.3)  # noqa: SLF001 - test hook
        time.sleep(0.05)
    assert bob.wait(lambda: len(bob.from_(alice)) >= 1000, timeout=30), len(bob.from_(alice))
    got = bob.from_(alice)
    assert [d.seq for d in got] == list(range(1, 1001))
    assert [d.payload for d in got] == payloads("alice", 1000)
    assert bob.dp.stats()["nacks_sent"] >= 1
    assert alice.dp.stats()["retransmits"] >= 1
    assert carol.wait(lambda: len(carol.from_(alice)) == 1000)
    assert carol.dp.stats()["nacks_sent"] == 0


def test_tail_loss_is_recovered_by_heartbeat(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    bob.dp._kill_subscription("g", alice.did, down_for=1.0)  # noqa: SLF001 - the burst falls in the gap
    r = alice.dp.publish("g", payloads("alice", 200))
    r.wait(15)  # nothing more is published: only the publisher's heartbeat reveals the lost tail
    assert [d.seq for d in bob.from_(alice)] == list(range(1, 201))
    assert alice.dp.stats()["heartbeats"] >= 1


def test_slow_subscriber_is_backpressure_not_loss(make) -> None:  # type: ignore[no-untyped-def]
    tight = DataPlaneConfig(window=200, retention_max=400, sndhwm=4, rcvhwm=4, recv_queue_max=2, batch_max=50,
                            ack_interval_ms=20, nack_after_ms=200, resend_after_ms=2000)
    alice, bob = make("alice", tight), make("bob", tight)
    form_group([alice, bob], mode="shared")
    gate = threading.Event()
    bob.hook = lambda d: gate.wait(10)
    alice.dp.publish("g", payloads("alice", 200), timeout=5)  # fills the window
    t = time.monotonic()
    with pytest.raises(BackpressureError) as err:
        alice.dp.publish("g", [b"one too many"], timeout=0.3)
    assert time.monotonic() - t >= 0.29
    assert bob.did in str(err.value)
    gate.set()
    bob.hook = lambda d: time.sleep(0.001)  # still slower than the publisher
    for i in range(1, 8):
        alice.dp.publish("g", payloads("alice", 200, start=200 * i), timeout=20)
    assert bob.wait(lambda: len(bob.from_(alice)) >= 1600, timeout=40)
    assert [d.payload for d in bob.from_(alice)] == payloads("alice", 1600)
    a, b = alice.dp.stats(), bob.dp.stats()
    assert a["backpressure_waits"] >= 1
    assert a["retransmits"] == 0 and b["nacks_sent"] == 0 and b["duplicates_dropped"] == 0 and b["lost"] == 0


def test_lamport_order_respects_causality(make) -> None:  # type: ignore[no-untyped-def]
    """alice asks, bob answers each question once delivered, alice asks again once she has the
    answer: a causal chain q0 -> re0 -> q1 -> ... that carol, who also talks, sees stamped in order."""
    alice, bob, carol = make("alice"), make("bob"), make("carol")
    form_group([alice, bob, carol], mode="multi")

    def bob_replies(d: Delivered) -> None:
        if d.publisher_did == alice.did:
            bob.dp.publish("g", [b"re:" + d.payload])  # from the delivery callback itself

    bob.hook = bob_replies
    chain: list[bytes] = []
    for i in range(25):
        alice.dp.publish("g", [b"q%d" % i])
        carol.dp.publish("g", [b"noise%d" % i])  # concurrent, causally unrelated to the chain
        assert alice.wait(lambda: len(alice.from_(bob)) == i + 1)  # alice has the answer before asking again
        chain += [b"q%d" % i, b"re:q%d" % i]
    assert carol.wait(lambda: len(carol.from_(alice)) == 25 and len(carol.from_(bob)) == 25)
    stamp = {d.payload: d.lamport_ts for d in carol.got}
    assert [stamp[p] for p in chain] == sorted(stamp[p] for p in chain)
    assert len({stamp[p] for p in chain}) == len(chain)  # strictly increasing along the chain
    order = [d.payload for d in sorted(carol.got, key=lambda d: (d.lamport_ts, d.publisher_did))]
    assert [p for p in order if not p.startswith(b"noise")] == chain  # the total order keeps causality
    # every member's clock is past everything it delivered
    assert alice.dp.lamport_time >= max(d.lamport_ts for d in alice.got)


@pytest.mark.parametrize("ordered", [True, False])
def test_a_delivery_callback_that_raises_is_not_acked_and_gets_the_messages_again(make, ordered: bool) -> None:  # type: ignore[no-untyped-def]
    """A callback that raised did not take its message: not acked (the receipt waits), re-sent by the
    publisher and offered again, the earlier ones not twice."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], ordered=ordered)
    failures: list[int] = []

    def fails_twice_at_seq_7(d: Delivered) -> None:
        if d.seq == 7 and len(failures) < 2:
            failures.append(d.seq)
            raise RuntimeError("injected")

    bob.hook = fails_twice_at_seq_7
    receipt = alice.dp.publish("g", payloads("alice", 20))
    receipt.wait(20)
    assert failures == [7, 7]
    got = [d.seq for d in bob.from_(alice)]
    assert sorted(got) == list(range(1, 21)) and (got == sorted(got) or not ordered)
    stats = bob.dp.stats()
    assert stats["callback_errors"] == 2 and stats["deliveries_deferred"] >= 2  # one per raise, not per message
    assert bob.dp.positions("g")[alice.did] == 20


def test_a_member_with_an_unusable_key_is_refused_and_a_failed_batch_is_sent_later(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """In shared mode one envelope is sealed for every member: a member whose group key cannot be
    encrypted to would fail every batch, so add_member refuses it; and a batch whose packing fails
    anyway goes back to unsent (it was dropped, and nothing revealed the gap)."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    with pytest.raises(MalformedGroupMessageError, match="group_verkey"):
        alice.dp.add_member("g", replace(remote(bob, alice, "g"), group_verkey="1" * 44))
    real = envelope.pack
    failures = []

    def failing_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(1)
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(envelope, "pack", failing_once)
    alice.dp.publish("g", payloads("alice", 3)).wait(10)
    assert failures and [d.payload for d in bob.from_(alice)] == payloads("alice", 3)


def test_a_stamp_far_past_the_clock_cannot_drag_the_clocks_or_wedge_the_group(make) -> None:  # type: ignore[no-untyped-def]
    """One message stamped near 2**63 would drag every member's clock to the wire's limit, where the
    next stamps overflow it (or all tie): it is delivered, but moves clocks by 2**40 at most; and a
    clock that does reach the limit saturates, so its member's batches still go out."""
    mallory, bob, carol = make("mallory"), make("bob"), make("carol")
    form_group([mallory, bob, carol], mode="shared")
    mallory.dp._clock = LamportClock(dm.MAX_SEQ - 1)  # noqa: SLF001 - a member whose clock is hostile
    mallory.dp.publish("g", [b"poison"]).wait(10)
    assert bob.wait(lambda: [d.payload for d in bob.from_(mallory)] == [b"poison"])
    assert 2**40 <= bob.dp.lamport_time <= 2**40 + 10
    bob.dp.publish("g", [b"hello from bob"]).wait(10)  # acked: carol accepted bob's next stamp
    assert carol.wait(lambda: [d.payload for d in carol.from_(bob)] == [b"hello from bob"])
    bob.dp._clock = LamportClock(dm.MAX_SEQ - 1)  # noqa: SLF001 - reached the top anyway
    receipt = bob.dp.publish("g", [b"a", b"b", b"c"])
    receipt.wait(10)
    assert receipt.lamport_ts == (dm.MAX_SEQ, dm.MAX_SEQ, dm.MAX_SEQ)
    assert carol.wait(lambda: len(carol.from_(bob)) == 4)


# --- membership changes and restarts -------------------------------------------------------------


def test_removed_member_is_cut_off_and_the_others_lose_nothing(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob, carol = make("alice"), make("bob"), make("carol")
    form_group([alice, bob, carol], mode="shared")
    alice.dp.publish("g", payloads("alice", 100)).wait(10)
    alice.dp.remove_member("g", bob.did)  # re-binds alice's XPUB: carol reconnects, bob cannot
    r = alice.dp.publish("g", payloads("alice", 300, start=100))
    r.wait(20)
    assert [d.seq for d in carol.from_(alice)] == list(range(1, 401))
    time.sleep(0.3)
    assert len(bob.from_(alice)) == 100
    assert bob.did not in alice.dp.stats()["unacked"]["g"]


@pytest.mark.parametrize("mode", ["shared", "multi"])
def test_what_is_published_while_the_others_reconnect_after_a_leave_needs_no_resend(make, mode: str) -> None:  # type: ignore[no-untyped-def]
    """A leave re-binds the publisher's endpoint and the others reconnect. What was published in that
    window reached none of them (a PUB drops what no one subscribed to) and came only by heartbeat
    after resend_after_ms, then NACK: every leave stalled every member's publishes ~2 s. Now sends
    wait for the subscribers to be back: with the heartbeat path out of reach (2 minutes) the
    messages arrive by the data path, none resent, none twice, and the leaver gets none."""
    cfg = replace(FAST, resend_after_ms=120_000)
    alice, bob, carol, dave = make("alice", cfg), make("bob", cfg), make("carol", cfg), make("dave", cfg)
    form_group([alice, bob, carol, dave], mode=mode)
    alice.dp.publish("g", payloads("alice", 10)).wait(10)
    alice.dp.remove_member("g", dave.did)
    receipt = alice.dp.publish("g", payloads("alice", 20, start=10))  # at once: bob and carol are reconnecting
    receipt.wait(20)  # far below resend_after_ms: the heartbeat path cannot have delivered them
    for node in (bob, carol):
        assert node.wait(lambda node=node: len(node.from_(alice)) == 30, timeout=10)
        assert [d.payload for d in node.from_(alice)] == payloads("alice", 30)
        stats = node.dp.stats()
        assert (stats["nacks_sent"], stats["duplicates_dropped"]) == (0, 0)
    stats = alice.dp.stats()
    assert (stats["retransmits"], stats["heartbeats"]) == (0, 0)
    time.sleep(0.3)
    assert len(dave.from_(alice)) == 10  # cut off


def test_a_member_that_does_not_come_back_after_a_leave_holds_the_others_only_briefly(make) -> None:  # type: ignore[no-untyped-def]
    """Sends after a rebind wait for the subscribers the closed socket had; one of them whose SUB is
    down (alive otherwise: its keepalives answer) does not come back, and the others must not wait
    for it past the bound (resend_after_ms here): they get what was published by the data path,
    without asking for it, once the wait is over. (Her SUB's end is seen before the leave, so she
    is not waited for at all; the bound itself: the test of a member going away during the wait.)"""
    cfg = replace(FAST, resend_after_ms=3_000)
    alice, bob, carol, dave = make("alice", cfg), make("bob", cfg), make("carol", cfg), make("dave", cfg)
    form_group([alice, bob, carol, dave], mode="shared")
    alice.dp.publish("g", payloads("alice", 10)).wait(10)
    carol.dp._kill_subscription("g", alice.did, down_for=120.0)  # noqa: SLF001 - carol's SUB to alice is gone
    alice.dp.remove_member("g", dave.did)
    alice.dp.publish("g", payloads("alice", 5, start=10))
    assert bob.wait(lambda: len(bob.from_(alice)) == 15, timeout=20)
    assert [d.payload for d in bob.from_(alice)] == payloads("alice", 15)
    assert bob.dp.stats()["nacks_sent"] == 0  # sent to bob once the wait for carol ended, not recovered
    assert alice.dp.stats()["peers_alive"][carol.did] is True


@pytest.mark.parametrize("mode", ["shared", "single", "multi"])
def test_a_member_whose_subscription_ended_before_a_leave_is_not_waited_for(make, mode: str) -> None:  # type: ignore[no-untyped-def]
    """carol's SUB to alice ended before dave leaves (a crash not yet noticed by keepalives, or a
    SUB closed while carol stays a member). The rebind must not wait for her: her connection is
    gone, and waiting would stall every member's publishes for the whole bound (5 s here) at each
    leave. The others get what is published at once, by the data path."""
    cfg = replace(FAST, resend_after_ms=120_000)
    alice, bob, carol, dave = make("alice", cfg), make("bob", cfg), make("carol", cfg), make("dave", cfg)
    form_group([alice, bob, carol, dave], mode=mode)
    alice.dp.publish("g", payloads("alice", 10)).wait(10)
    assert bob.wait(lambda: len(bob.from_(alice)) == 10, timeout=10)
    carol.dp._kill_subscription("g", alice.did, down_for=120.0)  # noqa: SLF001 - carol's SUB to alice is gone
    time.sleep(0.5)  # alice's XPUB has seen the connection end
    alice.dp.remove_member("g", dave.did)
    start = time.monotonic()
    alice.dp.publish("g", payloads("alice", 5, start=10))
    assert bob.wait(lambda: len(bob.from_(alice)) == 15, timeout=20)
    took = time.monotonic() - start
    assert took < 2.5, f"bob got them after {took:.1f}s: alice waited for carol's SUB"
    assert [d.payload for d in bob.from_(alice)] == payloads("alice", 15)
    assert bob.dp.stats()["nacks_sent"] == 0
    assert alice.dp.stats()["peers_alive"][carol.did] is True


def test_a_member_that_goes_away_during_the_wait_after_a_leave_holds_the_others_only_until_the_bound(make) -> None:  # type: ignore[no-untyped-def]
    """carol's SUB was subscribed when dave left and goes away before it reconnects: alice cannot
    tell she will not come back and waits for her, but only up to resend_after_ms; bob then gets
    what was published by the data path, without asking for it."""
    cfg = replace(FAST, resend_after_ms=1_500)
    alice, bob, carol, dave = make("alice", cfg), make("bob", cfg), make("carol", cfg), make("dave", cfg)
    form_group([alice, bob, carol, dave], mode="shared")
    alice.dp.publish("g", payloads("alice", 10)).wait(10)
    alice.dp.remove_member("g", dave.did)
    carol.dp._kill_subscription("g", alice.did, down_for=120.0)  # noqa: SLF001 - before it reconnects (100 ms)
    alice.dp.publish("g", payloads("alice", 5, start=10))
    assert bob.wait(lambda: len(bob.from_(alice)) == 15, timeout=20)
    assert [d.payload for d in bob.from_(alice)] == payloads("alice", 15)
    assert bob.dp.stats()["nacks_sent"] == 0



@pytest.mark.parametrize("mode", ["shared", "multi"])
def test_what_the_old_socket_still_queued_at_a_leave_reaches_the_others(make, mode: str) -> None:  # type: ignore[no-untyped-def]
    """dave leaves while alice's XPUB still queues a burst for bob (slow: his callback held it up),
    all of it published while dave was a member. The rebind that cuts dave must not throw that
    queue away: bob would get it only by asking for it again (a NACK, or with nothing after it a
    heartbeat after resend_after_ms). Here nothing is resent nor asked for."""
    cfg = replace(FAST, resend_after_ms=120_000, batch_max=8, sndhwm=50, rcvhwm=50)
    alice, bob, carol, dave = make("alice", cfg), make("bob", cfg), make("carol", cfg), make("dave", cfg)
    form_group([alice, bob, carol, dave], mode=mode)
    gate = threading.Event()
    bob.hook = lambda d: gate.wait(30)
    try:
        big = [bytes(4096)] * 500
        for _ in range(6):  # 12 MB in 375 envelopes per member: bob's buffers fill, alice's queue for him too
            alice.dp.publish("g", big, timeout=30)
        time.sleep(1.0)
    finally:
        gate.set()  # bob reads again
    alice.dp.remove_member("g", dave.did)
    alice.dp.publish("g", [b"after"]).wait(30)
    for node in (bob, carol):
        assert node.wait(lambda node=node: len(node.from_(alice)) == 3001, timeout=30), len(node.from_(alice))
        assert [d.seq for d in node.from_(alice)] == list(range(1, 3002))
        assert node.dp.stats()["nacks_sent"] == 0
    assert alice.dp.stats()["retransmits"] == 0

@pytest.mark.parametrize("mode", ["shared", "multi"])
def test_a_group_closed_by_a_member_is_not_waited_for_when_another_group_rebinds(make, mode: str) -> None:  # type: ignore[no-untyped-def]
    """carol closed g2 (she leaves it; alice has not heard yet, so carol is still admitted there)
    when alice removes bob from g1. One XPUB serves both groups: its rebind must not wait for
    carol's g2 subscriptions, gone with her SUB, nor for bob's g1 ones; bob stays in g2."""
    cfg = replace(FAST, resend_after_ms=120_000)
    alice, bob, carol = make("alice", cfg), make("bob", cfg), make("carol", cfg)
    form_group([alice, bob, carol], "g1", mode=mode)
    form_group([alice, bob, carol], "g2", mode=mode)
    carol.dp.close_group("g2")
    time.sleep(0.5)  # alice's XPUB has seen carol's g2 connection end
    alice.dp.remove_member("g1", bob.did)
    start = time.monotonic()
    alice.dp.publish("g1", [b"g1 after"])
    alice.dp.publish("g2", [b"g2 after"])
    assert carol.wait(lambda: len(carol.from_(alice, "g1")) == 1, timeout=10)
    assert bob.wait(lambda: len(bob.from_(alice, "g2")) == 1, timeout=10)
    took = time.monotonic() - start
    assert took < 2.5, f"delivered after {took:.1f}s: alice waited for carol's g2 SUB"
    time.sleep(0.3)
    assert bob.from_(alice, "g1") == []
    assert (bob.dp.stats()["nacks_sent"], carol.dp.stats()["nacks_sent"]) == (0, 0)


def test_restart_restores_positions_and_fetches_what_was_missed(make, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="multi")
    alice.dp.publish("g", payloads("alice", 500)).wait(10)
    assert bob.wait(lambda: len(bob.from_(alice)) == 500)
    saved = bob.dp.positions("g")
    assert saved == {alice.did: 500}
    bob.stop()  # bob's process goes away; alice keeps publishing
    receipt = alice.dp.publish("g", payloads("alice", 300, start=500))
    with pytest.raises(PeerTimeoutError) as err:
        receipt.wait(0.3)
    assert bob.did in str(err.value)
    bob.start()  # new transport, new publish endpoint, same keys
    bob.dp.open_group("g", mode="multi", ordered=True, group_key=bob.group_keys["g"], role="read_write")
    bob.dp.restore_positions("g", saved)  # before alice is re-added: remembered and asked later
    bob.dp.add_member("g", remote(alice, bob, "g"))
    alice.dp.add_member("g", remote(bob, alice, "g"))  # same DID: new endpoints, progress kept
    receipt.wait(20)
    got = bob.from_(alice)
    assert [d.seq for d in got] == list(range(501, 801))
    assert [d.payload for d in got] == payloads("alice", 300, start=500)
    assert bob.dp.positions("g") == {alice.did: 800}


def test_silent_member_is_marked_inactive_and_stops_holding_the_window(make) -> None:  # type: ignore[no-untyped-def]
    quick = DataPlaneConfig(window=50, retention_max=1000, keepalive_ms=100, dead_after_ms=600, ack_interval_ms=20,
                            resend_after_ms=300, nack_after_ms=30)
    alice, bob, carol = make("alice", quick), make("bob", quick), make("carol", quick)
    form_group([alice, bob, carol], mode="shared")
    assert alice.dp.stats()["peers_alive"] == {bob.did: True, carol.did: True}
    carol.stop()  # carol's process dies: no acks, no pongs
    deadline = time.monotonic() + 10
    while alice.dp.stats()["peers_alive"][carol.did] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alice.dp.stats()["peers_alive"] == {bob.did: True, carol.did: False}
    receipts = [alice.dp.publish("g", payloads("alice", 40, start=40 * i), timeout=5) for i in range(5)]
    assert bob.wait(lambda: len(bob.from_(alice)) == 200)  # 4x the window: carol does not hold it
    with pytest.raises(PeerTimeoutError) as err:
        receipts[-1].wait(0.2)
    assert carol.did in str(err.value) and bob.did not in str(err.value)
    assert alice.dp.stats()["unacked"]["g"][carol.did] == 200  # kept for her, within retention


def test_close_group_fails_pending_receipts_and_stops_delivery(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="multi")
    bob.dp.close_group("g")
    r = alice.dp.publish("g", [b"after bob left"])
    alice.dp.close_group("g")
    with pytest.raises(GroupError):
        r.wait(1)
    with pytest.raises(GroupNotOpenError):
        alice.dp.publish("g", [b"x"])
    assert bob.got == []


def test_retrying_a_publish_with_the_same_ids_delivers_once(make) -> None:  # type: ignore[no-untyped-def]
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    ids = [f"order-{i}" for i in range(5)]
    alice.dp.publish("g", payloads("alice", 5), message_ids=ids).wait(10)
    alice.dp.publish("g", payloads("alice", 5), message_ids=ids).wait(10)  # e.g. after a crash
    alice.dp.publish("g", [b"next"]).wait(10)
    assert bob.wait(lambda: len(bob.from_(alice)) == 6)
    assert [d.message_id for d in bob.from_(alice)][:5] == ids
    assert bob.dp.stats()["duplicates_dropped"] == 5
    assert bob.dp.positions("g") == {alice.did: 11}  # the seqs of the retry were consumed, not delivered


def test_the_same_message_id_in_two_groups_is_two_messages(make) -> None:  # type: ignore[no-untyped-def]
    """Ids are the publisher's per group: a re-used id in another group is delivered, not dropped and acked."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], group="orders-eu")
    form_group([alice, bob], group="orders-us")
    alice.dp.publish("orders-eu", [b"eu row"], message_ids=["row-1"]).wait(10)
    alice.dp.publish("orders-us", [b"us row"], message_ids=["row-1"]).wait(10)
    assert bob.wait(lambda: len(bob.from_(alice, "orders-us")) == 1, timeout=10)
    assert [d.payload for d in bob.from_(alice, "orders-eu")] == [b"eu row"]
    assert [d.payload for d in bob.from_(alice, "orders-us")] == [b"us row"]
    assert bob.dp.stats()["duplicates_dropped"] == 0


def test_a_subscriber_that_stops_reading_cannot_stall_the_group(make) -> None:  # type: ignore[no-untyped-def]
    """carol's process dies but a socket with her key stays connected and never reads (as a frozen
    process would): XPUB_NODROP blocks, and after dead_after the publisher cuts every connection."""
    cfg = DataPlaneConfig(sndhwm=2, rcvhwm=2, batch_max=64, keepalive_ms=200, dead_after_ms=1000,
                          ack_interval_ms=20, nack_after_ms=50, resend_after_ms=300)
    alice, bob, carol = make("alice", cfg), make("bob", cfg), make("carol", cfg)
    form_group([alice, bob, carol], mode="shared")
    carol.stop()
    ctx = zmq.Context()
    frozen = ctx.socket(zmq.SUB)
    try:
        frozen.setsockopt(zmq.RCVHWM, 1)
        frozen.setsockopt(zmq.RCVBUF, 4096)
        frozen.curve_serverkey = alice.curve[0]
        frozen.curve_publickey, frozen.curve_secretkey = carol.curve
        frozen.connect(alice.dp.publish_endpoint)
        frozen.setsockopt(zmq.SUBSCRIBE, topics.data_topic("g"))
        time.sleep(0.3)
        big = [bytes(4096)] * 100
        for _ in range(30):  # 12 MB: far more than the frozen socket's buffers
            alice.dp.publish("g", big, timeout=30)
        assert bob.wait(lambda: len(bob.from_(alice)) == 3000, timeout=60), len(bob.from_(alice))
        assert [d.seq for d in bob.from_(alice)] == list(range(1, 3001))
        assert alice.dp.stats()["publish_resets"] >= 1
    finally:
        frozen.close(0)
        ctx.term()


def test_removing_the_member_that_blocks_the_publisher_does_not_reset_the_others_again(make) -> None:  # type: ignore[no-untyped-def]
    """dave's socket stops reading and blocks alice's XPUB (XPUB_NODROP); alice removes dave before
    dead_after. The rebind that cuts dave starts a fresh socket with nothing queued: the time alice
    was blocked on the old one must not carry over, or while the rebind waits for the others to
    subscribe again (carol's SUB is down here, so it waits out its bound) dead_after expires on the
    old socket's account and every member is cut off a second time (a spurious publish reset)."""
    cfg = DataPlaneConfig(sndhwm=2, rcvhwm=2, batch_max=64, keepalive_ms=200, dead_after_ms=3000,
                          ack_interval_ms=20, nack_after_ms=50, resend_after_ms=4000)
    alice, bob, carol, dave = make("alice", cfg), make("bob", cfg), make("carol", cfg), make("dave", cfg)
    form_group([alice, bob, carol, dave], mode="shared")
    dave.stop()
    ctx = zmq.Context()
    frozen = ctx.socket(zmq.SUB)
    try:
        frozen.setsockopt(zmq.RCVHWM, 1)
        frozen.setsockopt(zmq.RCVBUF, 4096)
        frozen.curve_serverkey = alice.curve[0]
        frozen.curve_publickey, frozen.curve_secretkey = dave.curve
        frozen.connect(alice.dp.publish_endpoint)
        frozen.setsockopt(zmq.SUBSCRIBE, topics.data_topic("g"))
        time.sleep(0.3)
        big = [bytes(4096)] * 100
        for _ in range(30):  # 12 MB: far more than the frozen socket's buffers, alice blocks at once
            alice.dp.publish("g", big, timeout=30)
        time.sleep(1.0)  # blocked for a second, dead_after is 3
        alice.dp.remove_member("g", dave.did)
        carol.dp._kill_subscription("g", alice.did, down_for=120.0)  # noqa: SLF001 - carol does not come back
        time.sleep(3.0)  # the rebind waits for carol up to 4 s: past dead_after counted from the first block
        assert alice.dp.stats()["publish_resets"] == 0
        assert bob.wait(lambda: len(bob.from_(alice)) == 3000, timeout=60), len(bob.from_(alice))
        assert [d.seq for d in bob.from_(alice)] == list(range(1, 3001))
    finally:
        frozen.close(0)
        ctx.term()


def test_rejoining_publisher_is_heard_by_a_member_that_missed_its_leave(make) -> None:  # type: ignore[no-untyped-def]
    """A publisher that leaves and joins again in the same process continues its sequence: a member
    that missed the leave keeps its stream and would take new seqs from 1 for duplicates, drop them
    and ack them (silent loss)."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    alice.dp.publish("g", payloads("alice", 100)).wait(10)
    assert bob.wait(lambda: len(bob.from_(alice)) == 100)
    alice.dp.close_group("g")  # alice leaves; the leave never reaches bob
    alice.dp.open_group("g", mode="shared", ordered=True, group_key=alice.group_keys["g"], role="read_write")
    alice.dp.add_member("g", remote(bob, alice, "g"))
    bob.dp.add_member("g", remote(alice, bob, "g"))  # alice's subscribe: known, updated in place
    alice.dp.probe("g", bob.did, timeout=10)
    alice.dp.publish("g", payloads("alice", 3, start=100)).wait(10)
    assert bob.wait(lambda: len(bob.from_(alice)) == 103, timeout=5)
    assert [d.payload for d in bob.from_(alice)][100:] == payloads("alice", 3, start=100)


def test_a_publish_endpoint_that_cannot_be_bound_again_is_retried_not_fatal(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Removing a member rebinds the publish socket (every connection re-authenticates); if another
    process took the port meanwhile, the bind failed past its wait and the exception killed the IO
    thread: the member never published or received again. Now it retries every second."""
    from zerocomm_spark.group import dataplane

    monkeypatch.setattr(dataplane, "_REBIND_WAIT_S", 0.2)
    alice, bob, carol = make("alice"), make("bob"), make("carol")
    form_group([alice, bob, carol], mode="shared")
    alice.dp.publish("g", payloads("alice", 5)).wait(10)
    real_make = alice.dp._make_xpub  # noqa: SLF001
    refused = {"until": time.monotonic() + 1.5}

    def make_xpub():  # type: ignore[no-untyped-def]
        sock = real_make()
        if time.monotonic() < refused["until"]:
            def bind(endpoint: str) -> None:
                raise zmq.ZMQError(zmq.EADDRINUSE, "Address already in use (test)")

            sock.bind = bind  # type: ignore[method-assign]
        return sock

    monkeypatch.setattr(alice.dp, "_make_xpub", make_xpub)
    alice.dp.remove_member("g", carol.did)  # rebinds: refused for 1.5 s
    assert alice.dp._io_thread.is_alive()  # noqa: SLF001
    receipt = alice.dp.publish("g", payloads("alice", 3, start=5))
    receipt.wait(20)  # acknowledged once the endpoint is bound again and bob has reconnected
    assert bob.wait(lambda: len(bob.from_(alice)) == 8, timeout=10)


def test_a_state_message_cut_off_by_close_is_a_closed_error(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """close() cancels state messages still queued for the IO thread; the caller got a bare
    concurrent.futures.CancelledError, outside the project's errors."""
    from zerocomm_spark.errors import DataPlaneClosedError

    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    monkeypatch.setattr(alice.dp, "_io_send_ctrl", lambda frames, fut: fut.cancel())  # as the IO thread's exit does
    with pytest.raises(DataPlaneClosedError, match="closed before the state message"):
        alice.dp.publish_state("g", b"status", timeout=5)


def test_messages_retention_dropped_for_an_inactive_member_fail_their_receipts(make) -> None:  # type: ignore[no-untyped-def]
    """carol was marked inactive and missed a burst larger than retention_max: alice drops what only
    carol lacks. When carol is back she learns those seqs are gone, skips them and acks past them;
    their receipts must fail naming her, not resolve as if every member had delivered them."""
    cfg = DataPlaneConfig(window=50, retention_max=100, ack_interval_ms=20, nack_after_ms=30, nack_retry_ms=100,
                          resend_after_ms=300, keepalive_ms=60_000, dead_after_ms=120_000)
    alice, bob, carol = make("alice", cfg), make("bob", cfg), make("carol", cfg)
    form_group([alice, bob, carol], mode="shared")
    carol.dp._kill_subscription("g", alice.did, down_for=2.0)  # noqa: SLF001 - carol hears nothing meanwhile
    time.sleep(0.3)  # the probes' late acks and the first keepalives land first: each marks carol alive
    alice.dp._set_alive(carol.did, False)  # noqa: SLF001 - the keepalive verdict, without waiting dead_after
    assert alice.dp.stats()["peers_alive"][carol.did] is False
    receipts = [alice.dp.publish("g", payloads("alice", 25, start=25 * i), timeout=10) for i in range(12)]
    assert bob.wait(lambda: len(bob.from_(alice)) == 300)
    assert alice.dp.stats()["retention_dropped"] >= 200
    time.sleep(1.8)  # carol's SUB is back: the next message shows her the hole, alice answers "gone"
    last = alice.dp.publish("g", [b"after"])
    last.wait(20)
    assert carol.wait(lambda: any(d.payload == b"after" for d in carol.from_(alice)))
    got = {d.seq for d in carol.from_(alice)}
    assert carol.dp.stats()["lost"] >= 200
    for r in receipts:
        assert r.done()
        if set(r.seqs) <= got:
            r.wait(0)
        else:
            with pytest.raises(MessagesDroppedError, match="retention") as err:
                r.wait(0)
            assert carol.did in str(err.value) and bob.did not in str(err.value)
    assert [d.seq for d in bob.from_(alice)] == list(range(1, 302))


# --- bounds in bytes, resend answers in frames, replies from callbacks ----------------------------


def test_the_publish_window_is_bounded_in_bytes_too(make) -> None:  # type: ignore[no-untyped-def]
    """16 KiB messages against a 64 KiB window: a count window of 1000 would hold 16 MB for a slow member."""
    cfg = replace(FAST, window=1000, retention_max=2000, window_bytes=64 * 1024, retention_max_bytes=128 * 1024)
    alice, bob = make("alice", cfg), make("bob", cfg)
    form_group([alice, bob], mode="shared")
    gate = threading.Event()
    bob.hook = lambda d: gate.wait(10)
    chunks = [os.urandom(16 * 1024) for _ in range(8)]
    alice.dp.publish("g", chunks[:4], timeout=5)  # 64 KiB: the window is full
    t = time.monotonic()
    with pytest.raises(BackpressureError, match="65536 bytes") as err:
        alice.dp.publish("g", chunks[4:5], timeout=0.3)
    assert time.monotonic() - t >= 0.29
    assert bob.did in str(err.value)
    assert alice.dp.stats()["held_bytes"]["g"] == 64 * 1024
    gate.set()
    for c in chunks[4:]:
        alice.dp.publish("g", [c], timeout=10)
    assert bob.wait(lambda: len(bob.from_(alice)) == 8)
    assert [d.payload for d in bob.from_(alice)] == chunks


def test_resend_answers_are_split_to_fit_the_transport_frame(make) -> None:  # type: ignore[no-untyped-def]
    """bob misses ~500 KB of messages but a resend answer is one 256 KiB frame: alice answers in parts,
    one of them a single message that alone fills ~90% of the frame, and parts whose headers, not
    payloads, make them large. Unsplit, every answer is refused as too large and bob never catches up."""
    frame = 256 * 1024
    cfg = replace(FAST, max_message_bytes=frame)
    alice, bob = make("alice", cfg, max_frame_bytes=frame), make("bob", cfg, max_frame_bytes=frame)
    form_group([alice, bob], mode="single")
    bob.dp._kill_subscription("g", alice.did, down_for=1.0)  # noqa: SLF001 - what follows is lost for bob
    small = [os.urandom(30_000) for _ in range(12)]
    near = os.urandom(frame * 9 // 16 * 9 // 10)  # base64 twice (batch, envelope): ~90% of the frame
    headers = {f"h{i}": "v" * 400 for i in range(40)}  # ~16 KB per message, not counted as payload
    alice.dp.publish("g", small[:6] + [near] + small[6:])
    last = alice.dp.publish("g", payloads("alice", 12), headers=headers)
    last.wait(30)
    got = bob.from_(alice)
    assert [d.payload for d in got] == [*small[:6], near, *small[6:], *payloads("alice", 12)]
    assert all(d.headers == headers for d in got[13:])
    assert bob.dp.stats()["nacks_sent"] >= 4  # several answers, each within the frame
    assert alice.dp.stats()["retransmits"] >= 25


def test_a_member_that_missed_many_answers_worth_recovers_them_at_full_speed(make) -> None:  # type: ignore[no-untyped-def]
    """Resend answers are budgeted per member (a few answers' worth, refilled slowly), so a member
    asking for the same seqs again and again draws little. bob, whose SUB is down, misses 24 MB: five
    times the budget with 1 MiB frames. What is resent for the first time is paid back as bob acks it,
    so bob gets everything, in order, as fast as without a budget (~1.7 s here, both); at the
    budget's rate alone (no pay-back) it did not get it all within 60 s."""
    frame = 1024 * 1024
    alice, bob = make("alice", max_frame_bytes=frame), make("bob", max_frame_bytes=frame)
    form_group([alice, bob], mode="single")
    budget = alice.dp._resend_burst  # noqa: SLF001
    bob.dp._kill_subscription("g", alice.did, down_for=120.0)  # noqa: SLF001 - all of it comes by resend
    sent = [os.urandom(200_000) for _ in range(120)]
    assert len(sent) * 200_000 > 5 * budget
    start = time.monotonic()
    alice.dp.publish("g", sent).wait(60)
    took = time.monotonic() - start
    assert [d.payload for d in bob.from_(alice)] == sent
    stats = alice.dp.stats()
    print(f"bob recovered {len(sent) * 200_000} bytes in {took:.2f} s; alice throttled {stats['resend_throttled']} "
          f"answer(s), {stats['resend_bytes_throttled']} bytes")
    assert took < 20.0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigurationError, match="resend_burst_bytes"):
            DataPlaneConfig(resend_burst_bytes=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="resend_rate_bytes"):
            DataPlaneConfig(resend_rate_bytes=bad)  # type: ignore[arg-type]


def test_the_resend_budget_holds_the_largest_message_whatever_the_batch_size(make) -> None:  # type: ignore[no-untyped-def]
    """The budget's unit was the answer of a batch's worth of payloads (4 x batch_max_bytes): with a
    small batch_max_bytes (16 KiB: a 514 KB burst refilled at 64 KB/s) one 4 MiB message's answer
    (~7.5 MB) took the bucket ~7 MB below zero, and were that answer lost, every resend to that member
    waited ~2 minutes for the bucket to fill. The unit now covers the largest message publish() takes."""
    from zerocomm_spark.group.dataplane import _answer_bytes

    alice = make("alice", config=replace(FAST, batch_max_bytes=16 * 1024))
    largest = _answer_bytes(alice.dp.max_payload_bytes, 1)
    assert alice.dp._resend_burst >= largest  # noqa: SLF001
    assert alice.dp._resend_burst / alice.dp._resend_rate <= 10.0  # noqa: SLF001 - refilled within seconds


def test_headers_per_message_ride_in_one_call_and_come_back_in_resends(make) -> None:  # type: ignore[no-untyped-def]
    """A sequence of headers gives each message its own (a per-message origin proof): one publish
    call, every member gets each message with exactly its headers, also when it is resent."""
    alice, bob, carol = make("alice"), make("bob"), make("carol")
    form_group([alice, bob, carol], mode="shared")
    bob.dp._kill_subscription("g", alice.did, down_for=1.0)  # noqa: SLF001 - bob gets these by resend
    heads = [{"n": str(i), "zc-origin": "1:" + "A" * 86 + "=="} if i % 3 else None for i in range(30)]
    alice.dp.publish("g", payloads("alice", 30), headers=heads).wait(30)
    for member in (bob, carol):
        got = member.from_(alice)
        assert [d.payload for d in got] == payloads("alice", 30), member.did
        assert [d.headers for d in got] == heads, member.did
    assert alice.dp.stats()["retransmits"] >= 1
    with pytest.raises(ConfigurationError, match="2 header mappings for 3 payloads"):
        alice.dp.publish("g", payloads("alice", 3), headers=[None, {"a": "b"}])
    with pytest.raises(ConfigurationError, match="headers map non-empty strings"):
        alice.dp.publish("g", payloads("alice", 2), headers=[None, {"a": 1}])  # type: ignore[dict-item]
    assert alice.dp.publish_position("g") == 30  # nothing of a refused call was sent


def test_a_payload_that_no_resend_answer_could_carry_is_refused(make) -> None:  # type: ignore[no-untyped-def]
    frame = 256 * 1024
    alice, bob = make("alice", replace(FAST, max_message_bytes=frame), max_frame_bytes=frame), make("bob")
    form_group([alice, bob], mode="shared")
    with pytest.raises(FrameTooLargeError, match=f"max_frame_bytes={frame}"):
        alice.dp.publish("g", [b"x" * (frame * 9 // 16 + 1)])  # its answer would exceed any frame
    assert alice.dp.publish_position("g") == 0


def test_members_replying_from_their_callbacks_with_full_windows_do_not_deadlock(make) -> None:  # type: ignore[no-untyped-def]
    """alice and bob each fill their window, then answer every message of the other from the delivery
    callback. A callback's publish waiting for the window would wait for acks the other member sends
    only once its own callback, waiting the same way, returns: both hung until the publish timeout."""
    cfg = replace(FAST, window=50, retention_max=1000)
    alice, bob = make("alice", cfg), make("bob", cfg)
    form_group([alice, bob], mode="shared")
    errors: list[str] = []

    def replier(me: Node, other: Node) -> Callable[[Delivered], None]:
        def hook(d: Delivered) -> None:
            if d.publisher_did == other.did and not d.payload.startswith(b"re:"):
                try:
                    me.dp.publish("g", [b"re:" + d.payload], timeout=30)
                except Exception as exc:  # noqa: BLE001 - counted and asserted below
                    errors.append(type(exc).__name__)
        return hook

    alice.hook, bob.hook = replier(alice, bob), replier(bob, alice)
    bursts = [threading.Thread(target=n.dp.publish, args=("g", payloads(n.did, 50))) for n in (alice, bob)]
    for b in bursts:
        b.start()
    for b in bursts:
        b.join(10)
    assert bob.wait(lambda: len(bob.from_(alice)) == 100, timeout=10), len(bob.from_(alice))
    assert alice.wait(lambda: len(alice.from_(bob)) == 100, timeout=10), len(alice.from_(bob))
    assert errors == []
    assert [d.payload for d in alice.from_(bob) if d.payload.startswith(b"re:")] == [
        b"re:" + p for p in payloads(alice.did, 50)]


# --- what a buggy or hostile member may claim over the peer transport -----------------------------


def direct_from(sender: Node, to: Node, body: bytes, group: str = "g") -> None:
    """A GROUP_DATA DirectSend from ``sender`` to ``to``, authcrypted as its data plane does it."""
    m = sender.dp._groups[group].members[to.did]  # noqa: SLF001 - the member's own keys for ``to``
    env = envelope.pack(body, [m.info.relationship_verkey], sender=m.my_key)
    sender.tr.send(to.tr.endpoint, ProtocolId.GROUP_DATA, env)


def test_an_ack_for_messages_not_yet_sent_does_not_resolve_their_receipt(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """alice's sender cannot get a batch out; bob (buggy, or lying) acks alice's newest seq anyway.
    The receipt of messages bob cannot have received must wait for them to be sent and acked."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    stuck = threading.Event()
    real = alice.dp._send_batch  # noqa: SLF001

    def cannot_send(g, msgs):  # type: ignore[no-untyped-def]
        if not stuck.is_set():
            raise RuntimeError("injected: the batch stays queued")
        return real(g, msgs)

    monkeypatch.setattr(alice.dp, "_send_batch", cannot_send)
    receipt = alice.dp.publish("g", payloads("alice", 3))
    assert receipt.seqs == (1, 2, 3)
    direct_from(bob, alice, dm.encode(dm.Ack("g", alice.did, bob.did, 3, None)))
    deadline = time.monotonic() + 1.5
    while not receipt.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not receipt.done(), "an ack for unsent messages resolved their receipt"
    assert alice.dp.stats()["unacked"]["g"][bob.did] == 3
    stuck.set()
    receipt.wait(10)
    assert [d.payload for d in bob.from_(alice)] == payloads("alice", 3)


@pytest.mark.parametrize("lacking", [False, True])
def test_an_open_ended_resend_request_does_not_report_seqs_the_member_holds_as_dropped(make, monkeypatch,  # type: ignore[no-untyped-def]
                                                                                     lacking: bool) -> None:
    """bob received alice's messages but not yet where his stream starts (no hello), while alice,
    his join still being checked, dropped what only he lacked past retention_max. His request
    "everything from seq 1" (no upper bound) was answered "1-200 are gone" and alice failed those
    receipts naming bob, though he held them and delivered them. Those he really lacks (``lacking``:
    seqs 26-50 never reached him) must still fail their receipt, naming him."""
    cfg = replace(FAST, window=50, retention_max=100, keepalive_ms=60_000, dead_after_ms=120_000)
    alice, bob, carol = make("alice", cfg), make("bob", cfg), make("carol", cfg)
    form_group([alice, carol], mode="shared")
    bob.group_keys["g"] = bob.ks.create_key("group", ref="g")
    bob.dp.open_group("g", mode="shared", ordered=True, group_key=bob.group_keys["g"], role="read_write")
    gate = threading.Event()
    real_request = bob.dp._request_resend  # noqa: SLF001

    def held_back(g, m, first, last):  # type: ignore[no-untyped-def]
        if gate.is_set():
            real_request(g, m, first, last)

    monkeypatch.setattr(bob.dp, "_request_resend", held_back)  # bob asks only once alice dropped them
    missed = set(range(26, 51)) if lacking else set()
    real_accept = bob.dp._accept_batch  # noqa: SLF001

    def lossy(g, m, batch):  # type: ignore[no-untyped-def]
        if batch.base is None:  # the data path, not an answer
            batch = replace(batch, messages=tuple(x for x in batch.messages if x.seq not in missed))
        real_accept(g, m, batch)

    monkeypatch.setattr(bob.dp, "_accept_batch", lossy)
    accepted = alice.dp.stats()["subscriptions_accepted"]
    for a, b in ((alice, bob), (bob, alice), (carol, bob), (bob, carol)):
        a.dp.add_member("g", remote(b, a, "g"))
    alice.dp.set_joining("g", bob.did, True)
    deadline = time.monotonic() + 10
    while alice.dp.stats()["subscriptions_accepted"] < accepted + 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # bob's SUB takes alice's data and state topics: nothing of hers misses him
    receipts = [alice.dp.publish("g", payloads("alice", 25, start=25 * i), timeout=10) for i in range(12)]
    assert carol.wait(lambda: len(carol.from_(alice)) == 300)
    stream = bob.dp._groups["g"].streams  # noqa: SLF001
    deadline = time.monotonic() + 10
    held = 300 - len(missed)
    while (alice.did not in stream or stream[alice.did].waiting_count < held) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream[alice.did].waiting_count == held and not stream[alice.did].has_baseline
    assert alice.dp.stats()["retention_dropped"] >= 200
    gate.set()
    assert bob.wait(lambda: len(bob.from_(alice)) == held)
    assert [d.payload for d in bob.from_(alice)] == [p for i, p in enumerate(payloads("alice", 300))
                                                     if i + 1 not in missed]
    for r in receipts:
        if missed & set(r.seqs):
            with pytest.raises(MessagesDroppedError, match="retention") as err:
                r.wait(10)
            assert f"{bob.did} ({len(missed)})" in str(err.value) and carol.did not in str(err.value)
        else:
            r.wait(10)  # bob has every one of them: none was dropped for him
    assert bob.dp.stats()["lost"] == len(missed)


def _blocked_receiver(alice: Node, bob: Node) -> threading.Event:
    """bob's receiver thread stuck in his delivery callback (on one message of alice's) until the
    returned event is set: nothing queued for it is taken meanwhile."""
    gate, entered = threading.Event(), threading.Event()

    def stuck(d: Delivered) -> None:
        entered.set()
        gate.wait(30)

    bob.hook = stuck
    alice.dp.publish("g", [b"hold on"])
    assert entered.wait(10)
    return gate


def _settled(node: Node, frames_in: int, timeout: float = 20.0) -> None:
    """Wait until ``node``'s transport read ``frames_in`` frames and its workers handled them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = node.tr.stats()
        if st["frames_in"] >= frames_in and st["inbox"] == 0:
            break
        time.sleep(0.02)
    time.sleep(0.3)  # the last jobs taken from the inbox finish their handler


def test_a_heartbeat_flood_cannot_grow_the_receive_queue_without_bound(make) -> None:  # type: ignore[no-untyped-def]
    """Heartbeats come over the peer transport, whose workers hand them to the receiver: they were
    queued whatever its backlog. A member sending them by the thousand (buggy, or hostile) while the
    receiver is busy grew the queue, in memory, as long as it kept on."""
    cfg = replace(FAST, recv_queue_max=8, resend_after_ms=60_000)
    alice, bob = make("alice", cfg), make("bob", cfg)
    form_group([alice, bob], mode="shared")
    gate = _blocked_receiver(alice, bob)
    g = alice.dp._groups["g"]  # noqa: SLF001 - alice's own heartbeat, as _heartbeat_stalled builds it
    beat = dm.encode(dm.DataBatch("g", alice.did, (), base=g.outbox.base_of(bob.did), last=g.wire_seq,
                                  member=bob.did), signer=g.group_key)
    frames_in = bob.tr.stats()["frames_in"]
    for _ in range(500):
        direct_from(alice, bob, beat)
    _settled(bob, frames_in + 500)
    queued = [item for item in list(bob.dp._rx) if item[0] == "batch"]  # noqa: SLF001
    assert len(queued) <= cfg.recv_queue_max, len(queued)
    assert bob.dp.stats()["receive_queue_full"] >= 500 - cfg.recv_queue_max
    gate.set()
    bob.hook = None
    receipt = alice.dp.publish("g", payloads("alice", 5))
    receipt.wait(10)  # bob goes on as usual
    assert [d.payload for d in bob.from_(alice)] == [b"hold on", *payloads("alice", 5)]


def test_resend_answers_piling_up_behind_a_busy_receiver_are_bounded(make) -> None:  # type: ignore[no-untyped-def]
    """Answers are queued for the receiver too. Requests go on past request_timeout_s while it is
    busy, so their answers must not pile up in memory unbounded: those past the bound are dropped,
    their requests end, and what they asked for is asked again."""
    cfg = replace(FAST, recv_queue_max=8)
    alice, bob = make("alice", cfg), make("bob", cfg)
    form_group([alice, bob], mode="shared")
    gate = _blocked_receiver(alice, bob)
    g = bob.dp._groups["g"]  # noqa: SLF001
    stream = g.streams[alice.did]
    for _ in range(40):  # as the receive timers would, request after request
        stream.nacks_sent(1)
        bob.dp._request_resend(g, g.members[alice.did], 1, 1)  # noqa: SLF001
    deadline = time.monotonic() + 20
    while bob.tr.stats()["pending"] and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # every request answered: the last answers are being handed over
    queued = [item for item in list(bob.dp._rx) if item[0] == "answer"]  # noqa: SLF001
    assert len(queued) == cfg.recv_queue_max
    assert bob.dp.stats()["receive_queue_full"] == 40 - cfg.recv_queue_max
    assert stream._nacks_out == cfg.recv_queue_max  # noqa: SLF001 - dropped answers ended their requests
    gate.set()
    bob.hook = None
    alice.dp.publish("g", payloads("alice", 5)).wait(10)
    assert [d.payload for d in bob.from_(alice)] == [b"hold on", *payloads("alice", 5)]


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_resend_request_that_fails_to_go_out_in_any_way_gives_its_share_back(make, monkeypatch,  # type: ignore[no-untyped-def]
                                                                               failure: type[BaseException]) -> None:
    """The answer counted for a resend request (per member, and all those on their way) was given
    back only when the request failed with a TransportError: any other failure left that member's
    share used up for good, and its gaps were never asked for again."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    alice.dp.publish("g", payloads("alice", 1)).wait(10)  # bob has alice's stream
    dp = bob.dp
    g = dp._groups["g"]  # noqa: SLF001
    stream = g.streams[alice.did]

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise failure("not sent")

    monkeypatch.setattr(bob.tr, "request_async", broken)
    failures = dp.stats()["nack_failures"]
    stream.nacks_sent(1)  # as the receive timers do before asking
    if failure is RuntimeError:
        dp._request_resend(g, g.members[alice.did], 1, 1)  # noqa: SLF001 - a failed request, counted
        assert dp.stats()["nack_failures"] == failures + 1
    else:
        with pytest.raises(failure):
            dp._request_resend(g, g.members[alice.did], 1, 1)  # noqa: SLF001
    with dp._rx_cond:  # noqa: SLF001
        assert dp._answers_out == 0  # noqa: SLF001
        assert alice.did not in dp._rx_from["answer"]  # noqa: SLF001
    assert stream._nacks_out == 0  # noqa: SLF001 - the request is over: the next one may go out


def test_no_resend_request_goes_out_while_its_answer_would_find_the_receive_queue_full(make) -> None:  # type: ignore[no-untyped-def]
    """Answers already queued or on their way fill recv_queue_max: a request then would fetch an
    answer over the network only for it to be dropped. bob lacks an announced tail and asks for it
    only once room is back."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    alice.dp.publish("g", payloads("alice", 3)).wait(10)
    assert bob.wait(lambda: sum(d.publisher_did == alice.did for d in bob.got) >= 3)
    dp = bob.dp
    with dp._rx_cond:  # noqa: SLF001 - as if recv_queue_max answers were on their way
        dp._answers_out += dp.config.recv_queue_max  # noqa: SLF001
    g = alice.dp._groups["g"]  # noqa: SLF001 - alice announces a seq bob never got
    before = dp.stats()["nacks_sent"]
    direct_from(alice, bob, dm.encode(dm.DataBatch("g", alice.did, (), base=0, last=g.outbox.last_seq + 1,
                                                   member=bob.did), signer=g.group_key))
    time.sleep(1.0)  # FAST: a receive tick every 10 ms, a tail asked for after 300 ms
    assert dp.stats()["nacks_sent"] == before
    with dp._rx_cond:  # noqa: SLF001 - the answers arrived and were handled
        dp._answers_out -= dp.config.recv_queue_max  # noqa: SLF001
    deadline = time.monotonic() + 10
    while dp.stats()["nacks_sent"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dp.stats()["nacks_sent"] > before
    assert dp.stats()["receive_queue_full"] == 0


def _heartbeat(publisher: Node, to: Node, group: str = "g", *, ahead: int = 0) -> bytes:
    """``publisher``'s heartbeat to ``to`` as _heartbeat_stalled builds it, announcing ``ahead``
    seqs past what it handed to ZeroMQ (0: an honest one)."""
    g = publisher.dp._groups[group]  # noqa: SLF001 - the publisher's own stream state and group key
    return dm.encode(dm.DataBatch(group, publisher.did, (), base=g.outbox.base_of(to.did), last=g.wire_seq + ahead,
                                  member=to.did, void=g.outbox.void), signer=g.group_key)


def test_one_member_flooding_heartbeats_does_not_crowd_out_another_members_heartbeat(make) -> None:  # type: ignore[no-untyped-def]
    """The heartbeat bound was one for all members: alice flooding heartbeats (buggy, or hostile)
    filled it, and carol's, the only news bob had of messages his SUB missed, was dropped with
    alice's excess. Now each member holds at most its share of the bound; carol's gets through and
    tells bob what he lacks."""
    cfg = replace(FAST, recv_queue_max=8, resend_after_ms=60_000)  # no heartbeats but these
    alice, bob, carol = make("alice", cfg), make("bob", cfg), make("carol", cfg)
    form_group([alice, bob, carol], mode="shared")
    bob.dp._kill_subscription("g", carol.did, down_for=60.0)  # noqa: SLF001 - carol's messages miss bob
    carol.dp.publish("g", payloads("carol", 3))
    deadline = time.monotonic() + 10
    while carol.dp._groups["g"].wire_seq < 3 and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.02)
    assert carol.dp._groups["g"].wire_seq == 3  # noqa: SLF001 - handed to ZeroMQ: her heartbeat announces it
    gate = _blocked_receiver(alice, bob)
    try:
        frames_in = bob.tr.stats()["frames_in"]
        flood = _heartbeat(alice, bob)
        for _ in range(500):
            direct_from(alice, bob, flood)
        _settled(bob, frames_in + 500)
        frames_in = bob.tr.stats()["frames_in"]
        direct_from(carol, bob, _heartbeat(carol, bob))
        _settled(bob, frames_in + 1)
        queued = [item[2] for item in list(bob.dp._rx) if item[0] == "batch"]  # noqa: SLF001
        share = max(1, cfg.recv_queue_max // 4)
        assert queued.count(carol.did) == 1, queued
        assert queued.count(alice.did) == share, queued
        st = bob.dp.stats()
        assert st["receive_share_full"] == 500 - share
        assert st["receive_queue_full"] == 500 - share  # every drop, whatever bound it met
    finally:
        gate.set()
    bob.hook = None
    deadline = time.monotonic() + 10
    while bob.dp.stats()["lag"]["g"].get(carol.did) != 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert bob.dp.stats()["lag"]["g"].get(carol.did) == 3  # carol's announcement was applied
    assert [d.payload for d in bob.from_(alice)] == [b"hold on"]
    assert not bob.dp._rx_from["batch"] and not bob.dp._rx_from["answer"]  # noqa: SLF001 - none kept at zero


def test_a_member_that_does_not_answer_resend_requests_keeps_to_its_share_of_them(make, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Resend requests were budgeted by recv_queue_max for all members together: alice announcing
    seqs in four groups and never answering for them (buggy, or hostile) took the whole budget
    while her requests were outstanding, and again each time they timed out, since her groups come
    first; carol's lost tail was never asked for. Now alice's requests keep to her share and carol
    is asked as usual."""
    cfg = replace(FAST, recv_queue_max=4, request_timeout_s=30.0)
    alice, bob, carol = make("alice", cfg), make("bob", cfg), make("carol", cfg)
    groups = [f"a{i}" for i in range(4)]
    for group in groups:
        form_group([alice, bob], group=group, mode="shared")
    form_group([bob, carol], group="g", mode="shared")  # after alice's: bob's timers ask in this order
    release, asked = threading.Event(), threading.Event()
    answer = alice.dp._resend_envelope  # noqa: SLF001

    def stalled(*args: object) -> bytes | None:
        asked.set()
        release.wait(30)
        return answer(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(alice.dp, "_resend_envelope", stalled)
    try:
        for group in groups:
            direct_from(alice, bob, _heartbeat(alice, bob, group, ahead=5), group=group)
        assert asked.wait(10)
        time.sleep(0.5)  # past the tail wait (resend_after_ms): every one of alice's tails is due
        bob.dp._kill_subscription("g", carol.did, down_for=60.0)  # noqa: SLF001 - only carol's heartbeat tells
        carol.dp.publish("g", payloads("carol", 3))
        assert bob.wait(lambda: len(bob.from_(carol)) == 3, timeout=8)
        assert [d.payload for d in bob.from_(carol)] == payloads("carol", 3)
        with bob.dp._rx_cond:  # noqa: SLF001
            assert bob.dp._rx_from["answer"].get(alice.did, 0) <= max(1, cfg.recv_queue_max // 4)  # noqa: SLF001
    finally:
        release.set()


@pytest.mark.parametrize("share", [0, -1, 9, 2.5, True, "2"])
def test_a_member_share_of_the_receive_bound_must_fit_in_it(share: object) -> None:
    from zerocomm_spark.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="recv_queue_share"):
        DataPlaneConfig(recv_queue_max=8, recv_queue_share=share)  # type: ignore[arg-type]
    assert DataPlaneConfig(recv_queue_max=8, recv_queue_share=8).recv_queue_share == 8  # one member may hold it all


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_ack_stall_s_is_a_positive_number_of_seconds_or_none(value: object) -> None:
    from zerocomm_spark.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="ack_stall_s"):
        DataPlaneConfig(ack_stall_s=value)  # type: ignore[arg-type]
    assert DataPlaneConfig().ack_stall_s == 30.0
    assert DataPlaneConfig(ack_stall_s=None).ack_stall_s is None and DataPlaneConfig(ack_stall_s=2).ack_stall_s == 2
    with pytest.raises(ConfigurationError, match="more than twice ack_interval_ms"):
        DataPlaneConfig(ack_stall_s=0.1, ack_interval_ms=50.0)  # healthy members would stall between acks
    assert DataPlaneConfig(ack_stall_s=0.2, ack_interval_ms=50.0).ack_stall_s == 0.2


def test_a_publisher_announcing_seqs_it_never_sends_is_not_asked_for_them_forever(make, caplog) -> None:  # type: ignore[no-untyped-def]
    """A heartbeat announcing seq 2**63-1 (a faulty or hostile publisher) is a tail bob lacks: he
    asked for it, the answer held nothing and said nothing was gone, and he asked again at every
    receive tick, forever. An answer like that now withdraws the announcement, once per announcement,
    with one warning naming the publisher (and no payload)."""
    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    alice.dp.publish("g", [b"secret payload"]).wait(10)
    g = alice.dp._groups["g"]  # noqa: SLF001 - alice's keys sign the lie, as a faulty alice would
    lie = dm.encode(dm.DataBatch("g", alice.did, (), base=0, last=dm.MAX_SEQ, member=bob.did), signer=g.group_key)
    before = bob.dp.stats()["nacks_sent"]
    caplog.set_level("WARNING", logger="zerocomm_spark.group.dataplane")
    direct_from(alice, bob, lie)
    deadline = time.monotonic() + 10
    while bob.dp.stats()["implausible_announcements"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.5)  # FAST: a receive tick every 10 ms, a tail asked for after 300 ms
    assert bob.dp.stats()["nacks_sent"] - before <= 2
    assert bob.dp.stats()["implausible_announcements"] == 1
    assert bob.dp.stats()["lag"]["g"][alice.did] == 0
    warned = [r.getMessage() for r in caplog.records if "announced" in r.getMessage()]
    assert len(warned) == 1 and alice.did in warned[0] and str(dm.MAX_SEQ) in warned[0]
    assert "secret" not in caplog.text
    for _ in range(3):  # announced again: asked once more each time, warned at most every 10 s
        direct_from(alice, bob, lie)
        time.sleep(0.6)
    assert bob.dp.stats()["nacks_sent"] - before <= 8
    assert len([r for r in caplog.records if "announced" in r.getMessage()]) == 1
    alice.dp.publish("g", payloads("alice", 3)).wait(10)  # the stream goes on as usual
    assert [d.payload for d in bob.from_(alice)] == [b"secret payload", *payloads("alice", 3)]


def test_waiting_for_a_receipt_without_a_deadline_is_refused(make) -> None:  # type: ignore[no-untyped-def]
    """bob is gone and will never ack: wait(inf) on alice's receipt waited forever."""
    from zerocomm_spark.errors import ConfigurationError

    alice, bob = make("alice"), make("bob")
    form_group([alice, bob], mode="shared")
    bob.stop()
    receipt = alice.dp.publish("g", [b"to nobody"])
    outcome: list[BaseException | None] = []

    def wait_forever() -> None:
        try:
            receipt.wait(float("inf"))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    t = threading.Thread(target=wait_forever, daemon=True)
    t.start()
    t.join(3)
    assert not t.is_alive(), "wait(inf) is still waiting: no deadline"
    assert isinstance(outcome[0], ConfigurationError) and "finite" in str(outcome[0])
    with pytest.raises(PeerTimeoutError, match=bob.did):
        receipt.wait(0.2)  # a finite wait still names the member that did not ack


def test_members_that_went_away_do_not_make_a_live_member_look_dead(make) -> None:  # type: ignore[no-untyped-def]
    """Keepalive pings ran on four threads, each blocking until its Pong or its timeout: with a dozen
    members gone, a live member's ping waited in line behind theirs past dead_after, and a quiet but
    live member was marked inactive."""
    import socket as socket_module

    def dead_endpoint() -> str:
        with socket_module.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    quick = DataPlaneConfig(window=50, retention_max=1000, keepalive_ms=100, dead_after_ms=1000,
                            ack_interval_ms=20, resend_after_ms=60_000, nack_after_ms=30)
    alice, bob = make("alice", quick), make("bob", quick)
    form_group([alice, bob], mode="shared")
    template = remote(bob, alice, "g")
    for i in range(16):  # members alice admitted that are gone: nothing answers at their endpoints
        alice.dp.add_member("g", replace(template, did=f"did:example:gone{i}", peer_endpoint=dead_endpoint(),
                                         publish_endpoint=dead_endpoint()))
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert alice.dp.stats()["peers_alive"][bob.did] is not False, "bob answers pings but was marked inactive"
        time.sleep(0.05)
