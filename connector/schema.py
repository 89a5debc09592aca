"""The source's rows and the sink's input columns, in Spark and Arrow terms.

Why Arrow end to end: the agent answers reads with Arrow IPC, the journal stores Arrow, and a
Python data source may yield ``pyarrow.RecordBatch``es that Spark takes without a per-row
conversion; so the only work per batch is picking columns and adding the publisher's label.

Sorting by (``lamport_ts``, ``publisher_did``) gives a total order that respects causality: each
member ticks its Lamport clock before it publishes and observes every timestamp it delivers, so a
message that could have been caused by another always has a larger ``lamport_ts``; ties (concurrent
messages) are broken by the publisher's DID, the same way on every member.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from zerocomm_spark.errors import SinkSchemaError

__all__ = ["SinkColumns", "arrow_schema", "sink_columns", "source_schema", "to_source_batches"]

_BASE = [
    StructField("group", StringType(), False),
    StructField("message_id", StringType(), False),
    StructField("publisher_did", StringType(), False),
    StructField("publisher_label", StringType(), True),
    StructField("seq", LongType(), False),
    StructField("lamport_ts", LongType(), False),
    StructField("sent_at", TimestampType(), False),
    StructField("received_at", TimestampType(), False),
    StructField("payload", BinaryType(), False),
]
_HEADERS = StructField("headers", MapType(StringType(), StringType(), True), True)


def source_schema(include_headers: bool = False) -> StructType:
    """The rows format("zerocomm") reads; ``headers`` only when includeHeaders=true."""
    return StructType(_BASE + ([_HEADERS] if include_headers else []))


def arrow_schema(schema: StructType) -> pa.Schema:
    """Exactly the Arrow schema Spark checks yielded batches against (nullability included)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


def to_source_batches(table: pa.Table, labels: Mapping[str, str], target: pa.Schema,
                      max_rows: int = 10_000) -> Iterator[pa.RecordBatch]:
    """Journal rows (JOURNAL_SCHEMA) -> batches of the source schema, ``max_rows`` at most each."""
    if table.num_rows == 0:
        return
    dids = table.column("publisher_did")
    if labels:
        keys = pa.array(list(labels), type=pa.string())
        values = pa.array(list(labels.values()), type=pa.string())
        label_col = pc.take(values, pc.index_in(dids, value_set=keys))
    else:
        label_col = pa.nulls(table.num_rows, pa.string())
    columns = []
    for field in target:
        if field.name == "publisher_label":
            column = label_col
        else:
            column = table.column(field.name)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if column.type != field.type:
            column = column.cast(field.type)
        columns.append(column)
    batch_table = pa.Table.from_arrays(columns, schema=target)
    yield from batch_table.to_batches(max_chunksize=max_rows)


@dataclass(frozen=True)
class SinkColumns:
    """Which optional columns the written DataFrame brings, and how its payload is typed."""

    payload_is_string: bool
    has_message_id: bool
    has_headers: bool


def sink_columns(schema: StructType) -> SinkColumns:
    """Check the written DataFrame's columns at start, not in the middle of a batch."""
    fields = {f.name: f for f in schema.fields}
    lowered = {name.lower(): name for name in fields}
    allowed = {"payload", "message_id", "headers"}
    if "payload" not in fields:
        near = lowered.get("payload") or lowered.get("value") or lowered.get("body")
        extra = f" (found {near!r}: rename it to payload)" if near else ""
        raise SinkSchemaError(f"the DataFrame written to format(\"zerocomm\") has no payload column{extra}; "
                              f"its columns are {list(fields)}")
    unknown = [name for name in fields if name not in allowed]
    if unknown:
        raise SinkSchemaError(f"the DataFrame written to format(\"zerocomm\") has columns {unknown} the sink does "
                              "not take (it takes payload, message_id, headers)")
    payload = fields["payload"].dataType
    if not isinstance(payload, (BinaryType, StringType)):
        raise SinkSchemaError(f"the payload column is {payload.simpleString()}, not binary or string")
    if "message_id" in fields and not isinstance(fields["message_id"].dataType, StringType):
        raise SinkSchemaError(f"the message_id column is {fields['message_id'].dataType.simpleString()}, not string")
    if "headers" in fields:
        headers = fields["headers"].dataType
        if not (isinstance(headers, MapType) and isinstance(headers.keyType, StringType)
                and isinstance(headers.valueType, StringType)):
            raise SinkSchemaError(f"the headers column is {headers.simpleString()}, not map<string,string>")
    return SinkColumns(payload_is_string=isinstance(payload, StringType), has_message_id="message_id" in fields,
                       has_headers="headers" in fields)
