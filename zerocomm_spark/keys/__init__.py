"""Key pairs and the sealed keystore that keeps them across restarts."""

from zerocomm_spark.keys.keypair import (
    KeyPair,
    b58decode,
    b58encode,
    verify_signature,
    verkey_bytes,
    verkey_to_x25519,
)
from zerocomm_spark.keys.keystore import KeyInfo, Keystore

__all__ = [
    "KeyInfo",
    "KeyPair",
    "Keystore",
    "b58decode",
    "b58encode",
    "verify_signature",
    "verkey_bytes",
    "verkey_to_x25519",
]
