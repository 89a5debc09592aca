"""A member's proof that a membership request over a DIDComm connection comes from it.

A join request or subscribe carries the sender's member entry, which is signed - but entries are
public (every member holds every entry), so an entry proves who the member is, not who sent it.
The proof binds the two: the member key the entry's DID names signs (group, member DID, the
sender's own DID of this connection). The receiver checks it against the connection the request
came over (their DID there), so a replayed entry - or a proof lifted from another connection - is
refused, and nobody can pair with a member's DID over a connection that is not that member's.
"""

from __future__ import annotations

import json

from zerocomm_spark.errors import DIDError, SignatureError
from zerocomm_spark.did.peer import verkey_from_did_key
from zerocomm_spark.keys.keypair import KeyPair, verify_signature
from zerocomm_spark.protocols.message import b64url_decode, b64url_encode

__all__ = ["connection_proof", "proves_connection"]

_PURPOSE = "zerocomm-group-connection/1"  # signatures made for this and nothing else


def _statement(group: str, member_did: str, connection_did: str) -> bytes:
    return json.dumps({"purpose": _PURPOSE, "group": group, "member": member_did, "connection": connection_did},
                      sort_keys=True, separators=(",", ":")).encode("utf-8")


def connection_proof(member_key: KeyPair, group: str, member_did: str, my_connection_did: str) -> str:
    """The proof to send over the connection where this member's DID is ``my_connection_did``."""
    return b64url_encode(member_key.sign(_statement(group, member_did, my_connection_did)))


def proves_connection(proof: str, group: str, member_did: str, their_connection_did: str | None) -> bool:
    """Does ``proof`` show that ``member_did``'s key sent this request over the connection where the
    sender is ``their_connection_did``?"""
    if not proof or not their_connection_did:
        return False
    try:
        verify_signature(verkey_from_did_key(member_did), _statement(group, member_did, their_connection_did),
                         b64url_decode(proof))
    except (SignatureError, DIDError, ValueError):
        return False
    return True
