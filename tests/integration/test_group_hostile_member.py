"""What one malicious member (admitted legitimately, running modified code) can do to the others.

The attacker is a real member over loopback whose own data plane is made to send crafted, correctly
signed frames (``_send_crafted``): what its group key signs is its own, so only what receivers check
on content stands between it and them. Agents in this process (real sockets, real crypto)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_cli_support import wait_for
from zerocomm_spark import Agent
from zerocomm_spark.agent.ingest import JournalIngest
from zerocomm_spark.agent.metrics import Metrics
from zerocomm_spark.envelope import pack
from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.group import datamessage as dm
from zerocomm_spark.group.manager import GroupConfig, GroupManager
from zerocomm_spark.journal import Journal

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

CONFIG = GroupConfig(digest_interval_s=0.3, resume_timeout_s=3.0)


def _send_crafted(agent: Agent, group: str, messages: list[dict[str, Any]], **fields: Any) -> None:
    """Publish, on ``agent``'s own XPUB, a batch of hand-written messages signed by its group key.

    ``messages`` are the wire dicts (``id``, ``seq``, ``lamport``, ``sent_at``, ``payload`` base64,
    ``headers``); json.dumps writes a lone surrogate as ``\\ud800``, as a hostile peer may."""
    plane = agent.groups.dataplane
    g = plane._group(group)  # noqa: SLF001
    head = {"@type": dm.DATA_BATCH, "@id": uuid.uuid4().hex, "group": group, "publisher": plane.member_did,
            **fields, "messages": messages}
    signed = dm.sign(json.dumps(head, separators=(",", ":")).encode("ascii"), g.group_key)
    members = list(g.members.values())
    if g.mode == "shared":
        frames = [[g.data_topic, pack(signed, [m.info.group_verkey for m in members], sender=g.group_key)]]
    elif g.mode == "single":
        frames = [[g.data_topic, pack(signed, [m.info.relationship_verkey], sender=m.my_key)] for m in members]
    else:
        frames = [[m.pair_topic, pack(signed, [m.info.relationship_verkey], sender=m.my_key)] for m in members]
    plane._io_send_data([(f, None, 0) for f in frames])  # noqa: SLF001


def _message(seq: int, payload: bytes = b"x", **fields: Any) -> dict[str, Any]:
    import base64

    return {"id": f"evil-{seq}", "seq": seq, "lamport": seq, "sent_at": 1.0,
            "payload": base64.b64encode(payload).decode("ascii"), **fields}


class _Ingest(JournalIngest):
    """The agent's journal ingest, but a fatal failure raises instead of blocking the receive thread
    for good (the agent process would exit with EXIT_JOURNAL_FAILED here)."""

    def _block_forever(self) -> None:
        raise RuntimeError("the agent would have exited here")


@pytest.fixture()
def trio(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """alice (victim, journaling like the agent does), bob (honest), mallory (the attacker)."""
    journal = Journal.open(tmp_path / "journal", key=bytes(range(32)), fsync="never")
    fatal: list[BaseException] = []
    ingest = _Ingest(journal, Metrics(), on_fatal=fatal.append)

    def prepare(agent: Agent, manager: GroupManager) -> None:
        manager.on_messages(ingest.on_messages)

    alice = Agent.open(tmp_path / "alice", label="alice", group_config=CONFIG, prepare_groups=prepare)
    bob = Agent.open(tmp_path / "bob", label="bob", group_config=CONFIG)
    mallory = Agent.open(tmp_path / "mallory", label="mallory", group_config=CONFIG)
    try:
        yield {"alice": alice, "bob": bob, "mallory": mallory, "journal": journal, "fatal": fatal,
               "ingest": ingest}
    finally:
        for agent in (mallory, bob, alice):
            agent.close()
        journal.close()


def _form(trio: dict[str, Any], group: str, mode: str) -> None:
    alice, bob, mallory = trio["alice"], trio["bob"], trio["mallory"]
    alice.groups.create(group, mode=mode)
    for member in (bob, mallory):
        member.groups.join(group, via=member.accept(alice.invite(), timeout=10), timeout=30)
    alice.groups.publish(group, [b"warm"]).wait(20)


def _journaled(trio: dict[str, Any]) -> list[tuple[str, bytes]]:
    return [(r["publisher_did"], r["payload"]) for r in trio["journal"].read(0).to_pylist()]


@pytest.mark.parametrize("where", ["id", "header key", "header value"])
def test_a_lone_surrogate_from_a_member_does_not_stop_the_journaling_agent(trio: dict[str, Any], where: str) -> None:
    """JSON can spell "\\ud800", which no UTF-8 holds. A member's message id or header holding one
    was delivered; the journal could not encode it (UnicodeEncodeError, not a refused row), so the
    agent's ingest took it for a disk failure and the agent exited, and after every restart the
    publisher re-sent it: one member kept every journaling member down. The receiver refuses it."""
    _form(trio, "g", "shared")
    alice, bob, mallory = trio["alice"], trio["bob"], trio["mallory"]
    before = alice.groups.stats()["rejected_malformed"]
    bad = {"id": _message(1, id="evil-\ud800")["id"]} if where == "id" else {
        "headers": {"k\udc00": "v"} if where == "header key" else {"k": "v\ud800"}}
    _send_crafted(mallory, "g", [_message(1, **bad)])
    wait_for(lambda: trio["fatal"] or alice.groups.stats()["rejected_malformed"] > before, 10.0,
             "alice to refuse the batch (or fail on it)")
    assert not trio["fatal"], f"the journaling member failed: {trio['fatal'][0]!r}"
    bob.groups.publish("g", [b"after"]).wait(20)  # the honest members' streams go on
    wait_for(lambda: (bob.groups.did, b"after") in _journaled(trio), 10.0, "bob's message journaled")
    assert mallory.groups.did not in {did for did, _ in _journaled(trio)}
    with pytest.raises(ConfigurationError, match="lone surrogate"):  # nor does an honest publisher send one
        mallory.groups.publish("g", [b"x"], **({"message_ids": ["m-\ud800"]} if where == "id" else bad))
