"""The connection proof: a member's entry is bound to the connection its request came over."""

from __future__ import annotations

from zerocomm_spark.group.proof import connection_proof, proves_connection
from zerocomm_spark.group.view import member_did_for
from zerocomm_spark.keys.keypair import KeyPair


def test_a_proof_holds_only_for_its_member_group_and_connection() -> None:
    bob, mallory = KeyPair.generate(), KeyPair.generate()
    bob_did = member_did_for(bob.verkey)
    proof = connection_proof(bob, "g", bob_did, "did:peer:2.bob-side-of-the-connection")
    assert proves_connection(proof, "g", bob_did, "did:peer:2.bob-side-of-the-connection")
    assert not proves_connection(proof, "g", bob_did, "did:peer:2.mallorys-connection")  # lifted elsewhere
    assert not proves_connection(proof, "h", bob_did, "did:peer:2.bob-side-of-the-connection")  # another group
    forged = connection_proof(mallory, "g", bob_did, "did:peer:2.mallorys-connection")  # her key, his DID
    assert not proves_connection(forged, "g", bob_did, "did:peer:2.mallorys-connection")
    for bad in ("", "not base64!", "AAAA", proof[:-4]):
        assert not proves_connection(bad, "g", bob_did, "did:peer:2.bob-side-of-the-connection")
    assert not proves_connection(proof, "g", bob_did, None)
    assert not proves_connection(proof, "g", "did:key:not-a-key", "did:peer:2.bob-side-of-the-connection")
