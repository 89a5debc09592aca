"""kill -9 of an agent in the middle of a burst of messages, then a restart: the receiver's journal
holds every acknowledged message exactly once, and the publisher re-sends the rest (by message id,
so nothing is delivered twice).

Two agent processes (alice publishes, bob receives) driven through the CLI and the Python client,
as a Spark sink would: batches with deterministic message ids, re-published after a failure.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli_support import Member, in_group, wait_for
from zerocomm_spark.client import Client
from zerocomm_spark.errors import ZeroCommError

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

BATCH = 50


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[tuple[Member, Member]]:
    with in_group(tmp_path) as members:
        yield members


def _batch(n: int) -> tuple[list[bytes], list[str]]:
    ids = [f"m{n:03d}-{i:02d}" for i in range(BATCH)]
    return [f"payload {mid}".encode() for mid in ids], ids


def _journal(member: Member) -> list[dict]:
    with Client.connect(member.config, timeout=20) as client:
        client.status()
        rows: list[dict] = []
        offset = None
        while True:
            page = client.fetch(group="g", start=offset)
            rows += page.table.to_pylist()
            if page.next_offset >= page.end_offset:
                return rows
            offset = page.next_offset


class Burst:
    """Publishes batches from a thread; remembers which the group acknowledged and which failed."""

    def __init__(self, member: Member, batches: int, timeout: float) -> None:
        self.member = member
        self.batches = batches
        self.timeout = timeout
        self.acked: list[int] = []
        self.failed: list[int] = []
        self.progress = threading.Event()
        self.stop_after_failures = 2  # then stop; the batches never tried are re-sent with the failed ones
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def unacknowledged(self) -> list[int]:
        return [n for n in range(self.batches) if n not in self.acked]

    def _run(self) -> None:
        client = Client.connect(self.member.config, timeout=20)
        try:
            for n in range(self.batches):
                payloads, ids = _batch(n)
                try:
                    result = client.publish("g", payloads, message_ids=ids, timeout=self.timeout)
                    assert result.message_ids == ids
                    self.acked.append(n)
                except ZeroCommError:
                    self.failed.append(n)
                if len(self.acked) >= 4:
                    self.progress.set()
                if len(self.failed) >= self.stop_after_failures:
                    break
        finally:
            client.close()
            self.progress.set()


def _resend(member: Member, batches: list[int]) -> Counter:
    """The publisher's recovery: publish every unacknowledged batch again with the same ids."""
    outcome: Counter = Counter()
    with Client.connect(member.config, timeout=30) as client:
        for n in batches:
            payloads, ids = _batch(n)
            result = client.publish("g", payloads, message_ids=ids, timeout=40)
            outcome["duplicates"] += result.duplicates
            outcome["rows"] += len(result)
    return outcome


def _check_exactly_once(bob: Member, total: int, acked_before: set[int]) -> list[dict]:
    rows = _journal(bob)
    counts = Counter(r["message_id"] for r in rows)
    assert [mid for mid, c in counts.items() if c > 1] == []  # nothing twice
    expected = {mid for n in range(total) for mid in _batch(n)[1]}
    missing = expected - set(counts)
    assert not missing, f"{len(missing)} messages missing from bob's journal, e.g. {sorted(missing)[:5]}"
    assert set(counts) == expected
    for n in acked_before:  # everything acknowledged before the crash survived it
        assert set(_batch(n)[1]) <= set(counts)
    for r in rows:
        assert r["payload"] == f"payload {r['message_id']}".encode()
    return rows


def test_kill_9_of_the_receiver_during_a_burst(pair: tuple[Member, Member]) -> None:
    alice, bob = pair
    burst = Burst(alice, batches=10, timeout=2.0)
    burst.thread.start()
    assert burst.progress.wait(60), "the burst did not get going"
    acked_before = set(burst.acked)
    pid = bob.pid()
    assert pid is not None
    bob.kill()  # SIGKILL, mid-burst
    bob.wait_gone(pid)
    burst.thread.join(90)
    assert not burst.thread.is_alive()
    assert burst.failed, "the publisher should notice that bob stopped acknowledging"
    assert bob.start()["pid"] != pid  # restart: the group resumes, alice pushes what bob lacks
    outcome = _resend(alice, burst.unacknowledged)
    # The agent remembered the ids it had published: those were not published twice, only waited for.
    assert outcome["duplicates"] == BATCH * len(burst.failed)
    assert outcome["rows"] == BATCH * len(burst.unacknowledged)
    rows = _check_exactly_once(bob, burst.batches, acked_before)
    alice_seqs = sorted(r["seq"] for r in rows if r["publisher_did"] == rows[0]["publisher_did"])
    assert alice_seqs == list(range(1, BATCH * burst.batches + 1))  # contiguous: no seq lost or reused
    metrics = bob.ok("metrics")
    assert metrics["messages_in"] >= 1
    assert "payload m0" not in bob.log() and "payload m0" not in alice.log()  # logs never carry payloads
    # The consumer's commit point: retention may drop what is below it; the journal says so.
    with Client.connect(bob.config, timeout=10) as client:
        assert client.commit(100)["committed_offset"] == 100
        assert client.latest("g")["committed_offset"] == 100


def test_kill_9_of_the_publisher_during_a_burst(pair: tuple[Member, Member]) -> None:
    alice, bob = pair
    burst = Burst(alice, batches=10, timeout=5.0)
    burst.thread.start()
    assert burst.progress.wait(60), "the burst did not get going"
    acked_before = set(burst.acked)
    pid = alice.pid()
    assert pid is not None
    alice.kill()
    alice.wait_gone(pid)
    burst.thread.join(90)
    assert burst.failed, "the client should notice that its agent died"
    alice.start()
    wait_for(lambda: alice.ok("group", "info", "g")["status"] == "active", 30, "alice to rejoin g")
    outcome = _resend(alice, burst.unacknowledged)
    assert outcome["rows"] == BATCH * len(burst.unacknowledged)
    rows = _check_exactly_once(bob, burst.batches, acked_before)
    assert len(rows) == BATCH * burst.batches
    # alice's own journal has her acknowledged messages too, once each
    own = Counter(r["message_id"] for r in _journal(alice))
    assert max(own.values()) == 1
