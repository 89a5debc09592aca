"""Deeply nested JSON from a remote party gets the same clear error as any other malformed input.

json.loads raises RecursionError (not ValueError) on "[[[[..." a few thousand deep; paths that parse
what a peer sent must turn it into their ZeroComm error, not let it escape as a crash.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zstandard

from zerocomm_spark.errors import MalformedGroupMessageError, ProtocolError
from zerocomm_spark.group.view import open_status
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.member import Agent
from zerocomm_spark.protocols.out_of_band.v1_1.manager import OutOfBandManager
from zerocomm_spark.transport.frames import ProtocolId
from zerocomm_spark.transport.peer import PeerTransport

DEEP = b"[" * 200_000


def test_a_receipt_nested_too_deeply_is_a_protocol_error(tmp_path: Path) -> None:
    # A hostile inviter answers the DID-exchange request with a "receipt" nested 200k deep.
    hostile = PeerTransport("tcp://127.0.0.1:*")
    hostile.register(ProtocolId.DIDCOMM, rpc=lambda payload, peer: DEEP)
    hostile.start()
    try:
        with Keystore.open(tmp_path / "inviter", None) as keystore:
            invitation, _ = OutOfBandManager(keystore, hostile.endpoint, "mallory").create_invitation()
        with Agent.open(tmp_path / "alice", label="alice") as alice:
            with pytest.raises(ProtocolError, match="not a ZeroComm receipt"):
                alice.accept(invitation.to_url(), timeout=5.0)
    finally:
        hostile.close(timeout=2.0)


def test_a_status_message_nested_too_deeply_is_malformed() -> None:
    blob = zstandard.ZstdCompressor().compress(DEEP)
    with pytest.raises(MalformedGroupMessageError):
        open_status("g", blob, {}, lambda kid: None)


def test_a_receipt_tells_the_peer_about_its_message_not_about_this_members_own_failures() -> None:
    """A refusal of the peer's message names what was wrong with it; a local failure (a keystore or
    journal error whose text names local paths) stays in the log: the peer learns only that it failed."""
    from zerocomm_spark.errors import JournalError, KeystoreError, TamperedEnvelopeError
    from zerocomm_spark.member import _receipt_error

    local = json.loads(_receipt_error(KeystoreError("cannot read /home/ops/ids/alice/keystore.db")))
    assert local == {"ok": False, "error": "RemoteHandlerError", "detail": "the agent failed while handling the message"}
    assert "/home/ops" not in json.dumps(json.loads(_receipt_error(JournalError("disk full at /srv/j"))))
    theirs = json.loads(_receipt_error(TamperedEnvelopeError("the envelope's tag does not verify")))
    assert theirs["error"] == "TamperedEnvelopeError" and "tag does not verify" in theirs["detail"]
