"""A captured DIDComm envelope re-sent to an agent is refused, before and after the agent restarts."""

from __future__ import annotations

import json
from pathlib import Path

from zerocomm_spark.member import Agent
from zerocomm_spark.transport.frames import ProtocolId
from zerocomm_spark.transport.peer import PeerTransport


def test_a_captured_basic_message_is_refused_after_the_receiver_restarts(tmp_path: Path) -> None:
    """DIDComm v1 envelopes carry no time or counter: without a record of handled messages that
    outlives the process, anyone who captured one could deliver it again after a restart."""
    alice = Agent.open(tmp_path / "alice", label="alice", endpoint="tcp://127.0.0.1:*")
    bob = Agent.open(tmp_path / "bob", label="bob", endpoint="tcp://127.0.0.1:*")
    eavesdropper = PeerTransport("tcp://127.0.0.1:*")
    eavesdropper.start()
    try:
        bob.accept(alice.invite())
        captured: list[bytes] = []
        real_request = bob._transport.request  # noqa: SLF001 - the wire, as an eavesdropper sees it

        def capture(endpoint, protocol, payload, **kwargs):  # type: ignore[no-untyped-def]
            captured.append(payload)
            return real_request(endpoint, protocol, payload, **kwargs)

        bob._transport.request = capture  # type: ignore[method-assign]  # noqa: SLF001
        bob.send("alice", "transfer 100 to mallory")
        assert alice.receive(timeout=5).content == "transfer 100 to mallory"
        endpoint = alice.endpoint

        def replay() -> dict:
            return json.loads(eavesdropper.request(endpoint, ProtocolId.DIDCOMM, captured[-1], timeout=5))

        assert replay()["error"] == "ReplayError"
        alice.close()
        alice = Agent.open(tmp_path / "alice")  # binds the same endpoint again
        assert alice.endpoint == endpoint
        answer = replay()
        assert answer["ok"] is False and answer["error"] == "ReplayError"
        assert alice.messages() == []  # nothing reached the inbox
        bob.send("alice", "a new message gets through")
        assert alice.receive(timeout=5).content == "a new message gets through"
    finally:
        eavesdropper.close(timeout=2.0)
        bob.close()
        alice.close()
