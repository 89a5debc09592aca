"""ZeroComm groups end to end: every member a separate process with its own sockets and keystore.

Members run tests/integration/group_driver.py and are driven through stdin/stdout with their own
Python API (agent.groups). Covered: groups of 2, 3 and 8; joins through different acceptors and
concurrent joins; leave; SIGKILL and restart of a member that rejoins with its identity and gets
what it missed; role switch; a joiner refused by policy; a byzantine acceptor with an intruder in
its view; messages in all three modes delivered to everyone in publisher order.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

DRIVER = Path(__file__).with_name("group_driver.py")
CALL_TIMEOUT = 40.0
CONFIG: dict[str, Any] = {
    "digest_interval_s": 0.5,
    "consistency_wait_s": 4.0,
    "resume_timeout_s": 3.0,
    "dataplane": {"keepalive_ms": 300.0, "dead_after_ms": 1500.0},
}


class CallError(Exception):
    def __init__(self, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.error = error
        self.message = message


class Member:
    """One agent process, called like the API it wraps."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.path = root / name
        self._log_path = root / f"{name}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.did = ""
        self.spawn()

    def spawn(self) -> None:
        log = self._log_path.open("a")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-u", str(DRIVER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env)
        log.close()
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self._lines), daemon=True).start()
        self.start("open", path=str(self.path), label=self.name, group_config=CONFIG)

    def opened(self) -> None:
        self.did = self.result()["did"]

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def start(self, op: str, **args: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = CALL_TIMEOUT) -> Any:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name} gave no answer in {timeout}s (see {self._log_path})") from None
        if line is None:
            assert self.proc is not None
            raise AssertionError(f"{self.name} exited with {self.proc.wait(5)} (see {self._log_path})")
        answer = json.loads(line)
        if not answer["ok"]:
            raise CallError(answer["error"], answer["message"])
        return answer["result"]

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **args: Any) -> Any:
        self.start(op, **args)
        return self.result(timeout)

    def g(self, method: str, **args: Any) -> Any:
        return self.call("groups", method=method, args=args)

    def g_start(self, method: str, **args: Any) -> None:
        self.start("groups", method=method, args=args)

    def publish(self, group: str, payloads: list[str], wait: float | None = 20.0) -> Any:
        return self.call("groups", method="publish", args={"group": group, "payloads": payloads}, wait=wait)

    def collect(self, group: str, n: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = self.call("collect", timeout=timeout + 5, group=group, n=n, within=timeout)
        return got

    def connect_to(self, other: "Member") -> str:
        """A DIDComm connection from self to other (other invites); returns the connection id."""
        url = other.call("invite")
        return str(self.call("accept", url=url, timeout=10)["id"])

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self.call("exit", timeout=20)
                self.proc.wait(timeout=10)
        except (AssertionError, CallError, subprocess.TimeoutExpired, BrokenPipeError):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=5)


def _stop_all(members: list[Member]) -> None:
    threads = [threading.Thread(target=m.stop) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)


def _spawn(root: Path, names: list[str]) -> dict[str, Member]:
    members = {name: Member(root, name) for name in names}  # all start in parallel
    for member in members.values():
        member.opened()
    return members


def _eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


def _view(member: Member, group: str) -> dict[str, tuple[str, str, bool]]:
    """label -> (status, role, connected) as ``member`` sees ``group``."""
    return {m["label"]: (m["status"], m["role"], m["connected"] or m["is_self"])
            for m in member.g("members", group=group)}


def _converged(members: list[Member], group: str) -> bool:
    """Every member sees every member active, with a relationship to each."""
    want = {m.name for m in members}
    for member in members:
        view = _view(member, group)
        if set(view) != want or any(status != "active" or not connected for status, _, connected in view.values()):
            return False
    return True


def _check_order(received: list[dict[str, Any]], publishers: dict[str, list[str]]) -> None:
    """Each publisher's messages arrived complete, once, and in its order (seq and payload)."""
    by_publisher: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for message in received:
        by_publisher[message["publisher"]].append(message)
    assert set(by_publisher) == set(publishers)
    for did, sent in publishers.items():
        got = by_publisher[did]
        assert [m["payload"] for m in got] == sent
        seqs = [m["seq"] for m in got]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


_CONNECTIONS: dict[tuple[str, str], str] = {}


def _connection(member: Member, to: Member) -> str:
    """One DIDComm connection per ordered pair of members, made on first use."""
    key = (member.name, to.name)
    if key not in _CONNECTIONS:
        _CONNECTIONS[key] = member.connect_to(to)
    return _CONNECTIONS[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("groups")


@pytest.fixture(scope="module")
def trio(root: Path) -> Iterator[dict[str, Member]]:
    members = _spawn(root, ["alice", "bob", "carol", "dave", "eve"])
    yield members
    _stop_all(list(members.values()))


# --- 2 and 3 members ---------------------------------------------------------------------------


def test_two_members_create_join_message_leave(trio: dict[str, Member]) -> None:
    alice, bob = trio["alice"], trio["bob"]
    created = alice.g("create", group="pair", mode="shared")
    assert (created["mode"], created["ordered"], created["consistent_join"]) == ("shared", True, True)
    with pytest.raises(CallError) as refused:
        alice.g("create", group="pair")
    assert refused.value.error == "GroupExistsError"

    via = bob.connect_to(alice)
    joined = bob.g("join", group="pair", via=via, timeout=20)
    assert joined["status"] == "active" and len(joined["members"]) == 2
    # bob's active status reaches alice on the state topic
    _eventually(lambda: alice.g("info", group="pair")["checksum"] == joined["checksum"], what="equal checksums")
    assert _view(alice, "pair") == {"alice": ("active", "read_write", True), "bob": ("active", "read_write", True)}

    # the very first message after the join arrives (probing), both ways, in order
    sent_a = [f"a{i}" for i in range(50)]
    alice.publish("pair", sent_a)
    sent_b = [f"b{i}" for i in range(50)]
    bob.publish("pair", sent_b)
    _check_order(bob.collect("pair", 50), {alice.did: sent_a})
    _check_order(alice.collect("pair", 50), {bob.did: sent_b})

    bob.g("leave", group="pair")
    assert bob.g("groups") == []
    _eventually(lambda: set(_view(alice, "pair")) == {"alice"}, what="alice dropping bob")
    left = {m["label"]: m["status"] for m in alice.g("members", group="pair", include_left=True)}
    assert left == {"alice": "active", "bob": "left"}
    # alice's receipts no longer wait for bob
    alice.publish("pair", ["after bob left"], wait=5)
    # bob can come back under the same DID (a newer entry than his tombstone), on the same connection
    again = bob.g("join", group="pair", via=via)
    assert {m["label"] for m in again["members"]} == {"alice", "bob"}
    _eventually(lambda: _converged([alice, bob], "pair"), what="bob back in alice's view")
    alice.publish("pair", ["welcome back"])
    assert [m["payload"] for m in bob.collect("pair", 1)] == ["welcome back"]


def test_three_members_acceptors_roles_and_refusals(trio: dict[str, Member]) -> None:
    alice, bob, carol, dave = trio["alice"], trio["bob"], trio["carol"], trio["dave"]
    alice.g("create", group="trio", mode="single", policy={"kind": "allow-list", "dids": [bob.did, carol.did]})
    bob.g("join", group="trio", via=bob.connect_to(alice))
    # carol joins through bob (a different acceptor), read-only; bob's own policy is open
    joined = carol.g("join", group="trio", via=carol.connect_to(bob), role="read_only")
    assert {m["label"]: m["role"] for m in joined["members"]} == {
        "alice": "read_write", "bob": "read_write", "carol": "read_only"}
    _eventually(lambda: _converged([alice, bob, carol], "trio"), what="views of trio converging")

    # a joiner not on alice's allow-list gets a clear, typed refusal, and nothing is left behind
    with pytest.raises(CallError) as refused:
        dave.g("join", group="trio", via=dave.connect_to(alice))
    assert refused.value.error == "JoinRefusedError"
    assert "allow-list" in refused.value.message
    assert dave.g("groups") == []
    # through bob (open policy) dave gets the view, but alice refuses his subscribe: refused again
    with pytest.raises(CallError) as refused_again:
        dave.g("join", group="trio", via=dave.connect_to(bob))
    assert refused_again.value.error == "JoinRefusedError"
    assert dave.g("groups") == []
    _eventually(lambda: "dave" not in _view(bob, "trio"), what="bob dropping the refused joiner")

    # read-only carol cannot publish; after switching role (no leave) she can, and everyone gets it
    with pytest.raises(CallError) as read_only:
        carol.publish("trio", ["nope"])
    assert read_only.value.error == "ReadOnlyMemberError"
    switched = carol.g("switch_role", group="trio", role="read_write")
    assert switched["role"] == "read_write"
    for member in (alice, bob):
        assert _view(member, "trio")["carol"][1] == "read_write"
    sent = [f"carol {i}" for i in range(20)]
    carol.publish("trio", sent)
    for member in (alice, bob):
        _check_order(member.collect("trio", 20), {carol.did: sent})
    # and alice's messages reach both, in order
    sent_a = [f"alice {i}" for i in range(20)]
    alice.publish("trio", sent_a)
    for member in (bob, carol):
        _check_order(member.collect("trio", 20), {alice.did: sent_a})


def test_byzantine_acceptor_cannot_slip_in_an_intruder(trio: dict[str, Member]) -> None:
    alice, bob, carol, eve = trio["alice"], trio["bob"], trio["carol"], trio["eve"]
    alice.g("create", group="byz", mode="shared")
    # bob admits only members a current member vouches for (an open member would let anyone in)
    bob.g("join", group="byz", via=_connection(bob, alice), policy={"kind": "invitation"})
    # eve runs her own group of the same name; alice (byzantine) puts eve's genuine entry in her view
    eve.g("create", group="byz", mode="shared")
    _eventually(lambda: _converged([alice, bob], "byz"), what="views of byz converging")
    honest = bob.g("info", group="byz")["checksum"]
    assert alice.g("info", group="byz")["checksum"] == honest
    forged = alice.call("inject", group="byz", entry=eve.call("entry", group="byz"))
    assert forged != honest
    with pytest.raises(CallError) as refused:
        carol.g("join", group="byz", via=_connection(carol, alice), timeout=20)
    assert refused.value.error == "InconsistentViewError"
    assert "bob" in refused.value.message or "eve" in refused.value.message
    assert "byz" not in carol.g("groups")
    # nobody kept carol: bob and eve dropped her subscription again
    _eventually(lambda: "carol" not in _view(bob, "byz"), what="bob dropping the withdrawn joiner")
    _eventually(lambda: "carol" not in _view(eve, "byz"), what="eve dropping the withdrawn joiner")
    # alice's repair digests offer eve to bob too; eve carries no ticket from a member bob knows
    time.sleep(4 * CONFIG["digest_interval_s"])
    assert set(_view(bob, "byz")) == {"alice", "bob"}
    assert bob.g("info", group="byz")["checksum"] == honest


def test_crash_and_restart_rejoins_and_gets_what_it_missed(trio: dict[str, Member]) -> None:
    alice, bob, carol = trio["alice"], trio["bob"], trio["carol"]
    alice.g("create", group="crash", mode="multi")
    bob.g("join", group="crash", via=_connection(bob, alice))
    carol.g("join", group="crash", via=_connection(carol, bob))
    _eventually(lambda: _converged([alice, bob, carol], "crash"), what="views of crash converging")
    before = [f"before {i}" for i in range(10)]
    alice.publish("crash", before)
    _check_order(carol.collect("crash", 10), {alice.did: before})
    carol_did = carol.did

    carol.kill()
    _eventually(lambda: _view(alice, "crash")["carol"][0] == "inactive", timeout=10, what="carol marked inactive")
    missed = [f"missed {i}" for i in range(30)]
    alice.publish("crash", missed, wait=None)  # carol cannot ack yet
    bob_sent = [f"bob {i}" for i in range(5)]
    bob.publish("crash", bob_sent, wait=None)

    carol.spawn()  # same identity directory: same DID, keys, groups
    carol.opened()
    assert carol.did == carol_did
    info = carol.g("wait_active", group="crash", timeout=20)
    assert info["status"] == "active" and len(info["members"]) == 3
    got = carol.collect("crash", 35, timeout=25)
    by_pub = defaultdict(list)
    for m in got:
        by_pub[m["publisher"]].append(m["payload"])
    assert by_pub[alice.did] == missed
    assert by_pub[bob.did] == bob_sent
    _eventually(lambda: _view(alice, "crash")["carol"][0] == "active", what="carol active again at alice")
    after = [f"carol again {i}" for i in range(10)]
    carol.publish("crash", after)
    # carol's stream continues where it was before the crash: members take her new messages
    _check_order(alice.collect("crash", 15), {bob.did: bob_sent, carol.did: after})
    _check_order(bob.collect("crash", 50), {alice.did: before + missed, carol.did: after})


# --- 8 members: concurrent joins, every mode -----------------------------------------------------


@pytest.fixture(scope="module")
def eight(root: Path) -> Iterator[list[Member]]:
    members = list(_spawn(root, [f"m{i}" for i in range(8)]).values())
    yield members
    _stop_all(members)


@pytest.mark.parametrize("mode", ["shared", "single", "multi"])
def test_eight_members_concurrent_joins_and_publisher_order(eight: list[Member], mode: str) -> None:
    group = f"eight-{mode}"
    first, second, rest = eight[0], eight[1], eight[2:]
    first.g("create", group=group, mode=mode)
    second.g("join", group=group, via=_connection(second, first))
    # the others join at once, half through each of two acceptors
    vias = [_connection(m, first if i % 2 == 0 else second) for i, m in enumerate(rest)]
    for member, via in zip(rest, vias):
        member.g_start("join", group=group, via=via, timeout=40)
    for member in rest:
        assert member.result(60)["status"] == "active"
    _eventually(lambda: _converged(eight, group), timeout=30, what=f"views of {group} converging")
    checksums = {m.g("info", group=group)["checksum"] for m in eight}
    assert len(checksums) == 1

    sent = {m.did: [f"{m.name}:{i}" for i in range(25)] for m in eight}
    for member in eight:
        member.start("groups", method="publish", args={"group": group, "payloads": sent[member.did]}, wait=30)
    for member in eight:
        member.result(60)
    for member in eight:
        expected = {did: payloads for did, payloads in sent.items() if did != member.did}
        _check_order(member.collect(group, 7 * 25, timeout=30), expected)
