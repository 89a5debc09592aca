"""A member's durable journal of delivered group messages: append-only, encrypted, Arrow-native.

Every message the member delivers (docs/groups.md: per-publisher FIFO, after dedup and hold-back)
is appended with a journal-wide offset (contiguous from 0); the Spark streaming source reads ranges
of offsets back as Arrow record batches. Layout of the directory::

    journal.lock                 one writer at a time (flock)
    journal.meta                 key check: a wrong key fails at open
    commit.offset                the unnamed consumer's commit point
    consumers.json               named consumers' commit points (retention waits for the lowest)
    <base offset:020d>.zcj       segment files: encrypted Arrow record batches (see codec.py)
    <base offset:020d>.idx       sealed side index of a closed segment (per-publisher seqs)
    recent.ids                   sealed list of the message ids the duplicate check remembers

Speed comes from batches: one record is one Arrow record batch of an append (appends above ~1 MiB
are split, and their records encrypted in parallel), encrypted whole with one AEGIS-256 call (records
of earlier versions, AES-256-GCM and XChaCha20-Poly1305, stay readable; see crypto.py), so per-row
cost is Arrow's and numpy's, not Python's: the message-id duplicate check hashes a whole append's
ids in a few numpy calls and compares ids byte for byte only where a filter cannot rule them out
(state.py). A lone appender writes its append in its own thread; concurrent ones share a write
(group commit, writer.py). Times are int microseconds since the epoch (UTC), Arrow
``timestamp[us, UTC]``.

Durability: an append that returned survives the process being killed (even kill -9) under every
``fsync`` policy, and power loss only under ``fsync="always"``. On open, a torn tail is cut; no
complete acknowledged record is ever dropped. Appends are idempotent per (group, publisher, seq) and
per recent message id, so a restarted member can re-send everything it is unsure about.

Payloads, message ids, publishers and headers never appear in clear on disk; the key never appears
in logs, reprs or exceptions. Offsets, row counts and received_at ranges are in clear (indexing).

The core never imports Spark.
"""

from __future__ import annotations

from zerocomm_spark.journal.journal import Journal, LatestOffsets, PublisherPosition
from zerocomm_spark.journal.keys import journal_key
from zerocomm_spark.journal.schema import APPEND_SCHEMA, JOURNAL_SCHEMA
from zerocomm_spark.journal.writer import AppendResult, FsyncPolicy, JournalStats

__all__ = [
    "APPEND_SCHEMA",
    "JOURNAL_SCHEMA",
    "AppendResult",
    "FsyncPolicy",
    "Journal",
    "JournalStats",
    "LatestOffsets",
    "PublisherPosition",
    "journal_key",
]
