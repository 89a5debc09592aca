"""DIDs a member can resolve on its own: did:peer:2 (one per relationship) and did:key."""

from zerocomm_spark.did.peer import (
    ACCEPT_DIDCOMM_V1,
    GROUP_JOIN_SERVICE_TYPE,
    DIDDocument,
    create_peer_did,
    did_key,
    encode_peer_did_2,
    peer_did_3,
    resolve,
    verkey_from_did_key,
)

__all__ = [
    "ACCEPT_DIDCOMM_V1",
    "DIDDocument",
    "GROUP_JOIN_SERVICE_TYPE",
    "create_peer_did",
    "did_key",
    "encode_peer_did_2",
    "peer_did_3",
    "resolve",
    "verkey_from_did_key",
]
