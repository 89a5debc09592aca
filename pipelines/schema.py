"""The Delta history table: its columns, partitioning and properties, in one place.

One row per group message, as the ingesting member delivered it (docs/groups.md: per-publisher FIFO,
deduplicated), plus what history adds: the partition date, when it reached Delta, the origin proof,
and how the payload is stored.

=================  ===================  ========================================================
column             type                 meaning
=================  ===================  ========================================================
group              string, partition    the group's name
date               date, partition      UTC calendar date of ``sent_at`` (pruning by day)
message_id         string               unique per group; the idempotence and restore key
publisher_did      string               the publisher's member DID (a did:key: its own proof key)
publisher_label    string, nullable     the publisher's label, as the ingesting member knew it
seq                long                 per (group, publisher), from 1, contiguous
lamport_ts         long                 the publisher's Lamport time: (lamport_ts, publisher_did)
                                        is a total order that respects causality
sent_at            timestamp            when the publisher sent it (publisher's clock)
received_at        timestamp            when the ingesting member delivered it (its clock)
ingested_at        timestamp            when the micro-batch that wrote it ran (driver's clock)
headers            map<string,string>   application headers (the ``zc-origin`` proof moved out)
payload            binary               the payload, in clear or sealed (see payload_key_id)
payload_key_id     string, nullable     null: clear; else the history key's id and the payload
                                        is ``nonce || XChaCha20-Poly1305 ciphertext``
origin_scheme      string, nullable     the origin proof's scheme (``ed25519-member/1``), or null
origin_sig         binary, nullable     the publisher's signature (see pipelines/origin.py)
=================  ===================  ========================================================

Partitioning by (group, date) keeps a group's day in its own directory: a replay of one group, or
of the last days, reads only those files; OPTIMIZE and VACUUM can be run per partition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.types import StructType

__all__ = ["HISTORY_COLUMNS", "KEY_COLUMNS", "NOT_NULL_COLUMNS", "PARTITION_COLUMNS", "TABLE_PROPERTIES",
           "history_arrow_schema", "history_schema"]

SCHEMA_VERSION = "1"
PARTITION_COLUMNS = ("group", "date")
#: What a provider announces (seed 003's "keys"): enough to decide, without payloads, what to request.
KEY_COLUMNS = ("group", "message_id", "publisher_did", "seq", "lamport_ts")

#: Why each: the change data feed lets consumers follow a table incrementally (replay since a
#: version); append-only makes the history immutable (no UPDATE/DELETE/MERGE; OPTIMIZE and VACUUM
#: still work); old table versions stay readable for time travel for 30 days of log and 7 days of
#: deleted files (so VACUUM with the default retention never breaks a time travel within a week).
TABLE_PROPERTIES: dict[str, str] = {
    "delta.enableChangeDataFeed": "true",
    "delta.appendOnly": "true",
    "delta.logRetentionDuration": "interval 30 days",
    "delta.deletedFileRetentionDuration": "interval 7 days",
    "zerocomm.history.schemaVersion": SCHEMA_VERSION,
}

HISTORY_COLUMNS = (
    "group", "date", "message_id", "publisher_did", "publisher_label", "seq", "lamport_ts", "sent_at",
    "received_at", "ingested_at", "headers", "payload", "payload_key_id", "origin_scheme", "origin_sig",
)

#: The columns history_schema() declares NOT NULL: Delta refuses a whole append with a null in any.
NOT_NULL_COLUMNS = ("group", "date", "message_id", "publisher_did", "seq", "lamport_ts", "sent_at", "received_at",
                    "ingested_at", "payload")


def history_arrow_schema() -> pa.Schema:
    """The table's columns as Arrow types (what a provider's rows are cast to before they are checked).

    Every field is nullable here: a null where the table forbids one is a row to reject, not a
    schema to refuse (NOT_NULL_COLUMNS names them).
    """
    import pyarrow as pa

    utc = pa.timestamp("us", tz="UTC")
    types = {"group": pa.string(), "date": pa.date32(), "message_id": pa.string(), "publisher_did": pa.string(),
             "publisher_label": pa.string(), "seq": pa.int64(), "lamport_ts": pa.int64(), "sent_at": utc,
             "received_at": utc, "ingested_at": utc, "headers": pa.map_(pa.string(), pa.string()),
             "payload": pa.binary(), "payload_key_id": pa.string(), "origin_scheme": pa.string(),
             "origin_sig": pa.binary()}
    return pa.schema([pa.field(name, types[name]) for name in HISTORY_COLUMNS])


def history_schema() -> StructType:
    """The table's Spark schema (NOT NULL where a row without the value would be meaningless)."""
    from pyspark.sql.types import (
        BinaryType,
        DateType,
        LongType,
        MapType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    return StructType([
        StructField("group", StringType(), False),
        StructField("date", DateType(), False),
        StructField("message_id", StringType(), False),
        StructField("publisher_did", StringType(), False),
        StructField("publisher_label", StringType(), True),
        StructField("seq", LongType(), False),
        StructField("lamport_ts", LongType(), False),
        StructField("sent_at", TimestampType(), False),
        StructField("received_at", TimestampType(), False),
        StructField("ingested_at", TimestampType(), False),
        StructField("headers", MapType(StringType(), StringType(), True), True),
        StructField("payload", BinaryType(), False),
        StructField("payload_key_id", StringType(), True),
        StructField("origin_scheme", StringType(), True),
        StructField("origin_sig", BinaryType(), True),
    ])
