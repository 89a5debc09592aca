"""The journal key lives in the member's sealed keystore, never next to the journal."""

from __future__ import annotations

import nacl.utils

from zerocomm_spark.journal.crypto import KEY_BYTES
from zerocomm_spark.keys.keystore import Keystore

DEFAULT_SECRET_NAME = "journal-key"


def journal_key(keystore: Keystore, name: str = DEFAULT_SECRET_NAME) -> bytes:
    """The member's journal key, created (and sealed in the keystore) on first use.

    Losing the keystore makes the journal unreadable, which is the point: the journal directory
    alone reveals no payload or message id.
    """
    key = keystore.get_secret(name)
    if key is None:
        key = nacl.utils.random(KEY_BYTES)
        keystore.put_secret(name, key)
    return key
