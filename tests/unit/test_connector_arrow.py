"""The connector's pure Arrow work: journal rows -> source batches, sink chunking and columns, lag."""

from __future__ import annotations

import json
import pickle

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, IntegerType, MapType, StringType, StructField, StructType

from zerocomm_spark.connector.lag import LagListener, progress_lag
from zerocomm_spark.connector.micro_batch_stream import plan_partitions
from zerocomm_spark.connector.offsets import ZeroCommOffset
from zerocomm_spark.connector.options import SourceOptions
from zerocomm_spark.connector.schema import arrow_schema, sink_columns, source_schema, to_source_batches
from zerocomm_spark.connector.writer import _chunks, message_id_prefix
from zerocomm_spark.errors import SinkSchemaError
from zerocomm_spark.journal import JOURNAL_SCHEMA


def journal_rows(n: int, publisher: str = "did:a") -> pa.Table:
    return pa.Table.from_pylist([{
        "offset": i, "group": "g", "message_id": f"m{i}", "publisher_did": publisher, "seq": i + 1,
        "lamport_ts": 10 + i, "sent_at": 1_700_000_000_000_000 + i, "received_at": 1_700_000_000_000_100 + i,
        "headers": [("k", str(i))] if i % 2 else None, "payload": f"p{i}".encode()} for i in range(n)],
        schema=JOURNAL_SCHEMA)


@pytest.mark.parametrize("headers", [False, True])
def test_source_batches_match_the_arrow_schema_spark_checks(headers):
    target = arrow_schema(source_schema(headers))
    table = pa.concat_tables([journal_rows(5), journal_rows(3, "did:b")])
    batches = list(to_source_batches(table, {"did:a": "alice"}, target, max_rows=4))
    assert [b.num_rows for b in batches] == [4, 4]
    assert all(b.schema.equals(target) for b in batches)  # nullability and map layout included
    out = pa.Table.from_batches(batches).to_pylist()
    assert [r["publisher_label"] for r in out] == ["alice"] * 5 + [None] * 3
    assert [r["seq"] for r in out] == [1, 2, 3, 4, 5, 1, 2, 3]
    assert out[1]["payload"] == b"p1"
    if headers:
        assert out[1]["headers"] == [("k", "1")] and out[0]["headers"] is None
    else:
        assert "headers" not in out[0]
    assert list(to_source_batches(journal_rows(0), {}, target)) == []


def test_sink_columns():
    ok = sink_columns(StructType([StructField("payload", StringType()), StructField("message_id", StringType()),
                                  StructField("headers", MapType(StringType(), StringType()))]))
    assert ok.payload_is_string and ok.has_message_id and ok.has_headers
    assert not sink_columns(StructType([StructField("payload", BinaryType())])).payload_is_string
    with pytest.raises(SinkSchemaError, match="found 'value': rename it to payload"):
        sink_columns(StructType([StructField("value", BinaryType())]))
    with pytest.raises(SinkSchemaError, match="columns \\['extra'\\]"):
        sink_columns(StructType([StructField("payload", BinaryType()), StructField("extra", StringType())]))
    with pytest.raises(SinkSchemaError, match="payload column is int"):
        sink_columns(StructType([StructField("payload", IntegerType())]))
    with pytest.raises(SinkSchemaError, match="headers column is map<string,int>"):
        sink_columns(StructType([StructField("payload", BinaryType()),
                                 StructField("headers", MapType(StringType(), IntegerType()))]))


def test_chunks_keep_row_order_and_bound_rows_and_bytes():
    batches = [pa.record_batch({"payload": pa.array([bytes([i % 256]) * 100 for i in range(start, start + n)])})
               for start, n in ((0, 7), (7, 0), (7, 25), (32, 3))]
    chunks = list(_chunks(iter(batches), rows=10, size=10_000))
    assert [c.num_rows for c in chunks] == [10, 10, 10, 5]
    flat = [p for c in chunks for p in c.column("payload").to_pylist()]
    assert flat == [bytes([i % 256]) * 100 for i in range(35)]
    by_bytes = list(_chunks(iter(batches), rows=1000, size=1_000))
    assert all(c.column("payload").nbytes <= 1_100 for c in by_bytes)
    assert sum(c.num_rows for c in by_bytes) == 35
    big = [pa.record_batch({"payload": pa.array([b"x" * 5000, b"y"])})]
    assert [c.num_rows for c in _chunks(iter(big), rows=10, size=1000)] == [1, 1]  # a big one goes alone


def test_message_ids_are_deterministic_per_query_batch_partition():
    assert message_id_prefix("q", 7, 3) == "q.7.3"
    assert message_id_prefix("w", None, 0) == "w.0"


def test_partitions_carry_plain_values_only():
    options = SourceOptions.parse({"group": "g", "agent": "/run/zc", "includeHeaders": "true",
                                   "maxMessagesPerPartition": "10"}, mode="stream")
    parts = plan_partitions(options, ZeroCommOffset({("g", "did:a"): 1}), ZeroCommOffset({("g", "did:a"): 26}),
                            {("g", "did:a"): "alice"})
    assert [(p.first, p.end) for p in parts] == [(1, 10), (10, 19), (19, 26)]
    assert all(p.label == "alice" and p.agent.where == "/run/zc" and p.include_headers for p in parts)
    again = pickle.loads(pickle.dumps(parts))
    assert [(p.first, p.end, p.publisher) for p in again] == [(p.first, p.end, p.publisher) for p in parts]


def test_lag_from_progress_and_listener():
    end = ZeroCommOffset({("g", "a"): 5, ("g", "b"): 3}).to_json()
    latest = ZeroCommOffset({("g", "a"): 9, ("g", "b"): 3, ("g", "c"): 2}).to_json()
    progress = {"id": "q1", "sources": [{"endOffset": end, "latestOffset": latest},
                                        {"endOffset": json.dumps({"offset": 3}), "latestOffset": "7"}]}
    assert progress_lag(progress) == {"g": {"a": 4, "b": 0, "c": 1}}
    assert progress_lag(None) == {} and progress_lag({"sources": []}) == {}
    seen = []
    listener = LagListener(on_lag=lambda q, lag: seen.append((q, lag)))

    class Event:
        pass

    event = Event()
    event.progress = progress  # type: ignore[attr-defined]
    listener.onQueryProgress(event)
    assert listener.lag("q1") == {"g": {"a": 4, "b": 0, "c": 1}} and listener.max_lag() == 4
    assert seen == [("q1", {"g": {"a": 4, "b": 0, "c": 1}})]
    other = Event()
    other.progress = {"id": "q2", "sources": [{"endOffset": "{}", "latestOffset": "{}"}]}  # type: ignore[attr-defined]
    listener.onQueryProgress(other)
    assert listener.lag("q2") == {} and len(seen) == 1
