"""The Delta pipelines given hostile or damaged tables: someone with write access to the table's
storage, or a user pointing the tools at the wrong table.

Each table is real Delta, written through Spark (which, like Delta, checks neither that strings are
UTF-8 nor, for a table declared so, that columns are not null); rows are signed by a real member key.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path

import pytest

from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType

from zerocomm_spark.connector import source_schema
from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.pipelines.history import HistoryWriter
from zerocomm_spark.pipelines.origin import OriginSigner
from zerocomm_spark.pipelines.replay import replay
from zerocomm_spark.pipelines.restore import DeltaProvider, DeltaSink, have_from_table, restore

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

SENT = dt.datetime(2026, 11, 23, 12, 0, 0)


@pytest.fixture(scope="module")
def alice() -> OriginSigner:
    return OriginSigner(KeyPair.generate())


def history(spark, tmp_path: Path, signer: OriginSigner, ids: list[str], payloads: dict[str, bytes] | None = None) -> str:
    """A history table written by ingest's writer from signed messages (headers {"k": "v"} plus the proof)."""
    ck = tmp_path / f"ck-{uuid.uuid4().hex[:6]}"
    ck.mkdir()
    (ck / "metadata").write_text(json.dumps({"id": str(uuid.uuid4())}) + "\n")
    schema = source_schema(include_headers=True)
    rows = []
    for i, mid in enumerate(ids):
        payload = (payloads or {}).get(mid, f"secret {mid}".encode())
        row = {"group": "g", "message_id": mid, "publisher_did": signer.publisher_did, "seq": i + 1,
               "lamport_ts": i + 1, "sent_at": SENT, "received_at": SENT, "payload": payload,
               "headers": signer.headers("g", mid, payload, {"k": "v"})}
        rows.append({f.name: row.get(f.name) for f in schema.fields})
    table = tmp_path / f"t-{uuid.uuid4().hex[:6]}"
    HistoryWriter(str(table), str(ck))(spark.createDataFrame(rows, schema), 0)
    return str(table)


def rewrite(spark, df, tmp_path: Path, *, nullable: bool = False) -> str:
    """``df`` saved as a new Delta table (every column nullable if asked: a table made by someone else)."""
    if nullable:
        df = spark.createDataFrame(df.rdd, StructType([StructField(f.name, f.dataType, True) for f in df.schema]))
    path = str(tmp_path / f"hostile-{uuid.uuid4().hex[:6]}")
    df.write.format("delta").partitionBy("group", "date").save(path)
    return path


def not_utf8(hex_bytes: str):
    """A Spark string column holding these bytes: Spark casts binary to string without checking them."""
    return F.unhex(F.lit(hex_bytes)).cast("string")


def test_a_table_whose_columns_have_other_types_is_refused_by_every_reader_and_the_sink(spark, tmp_path, alice):
    """Only the column names were checked: seq and lamport_ts as text replayed in text order
    ("10" before "2") as if verified, a provider's every key was "malformed", and a restore's sink failed
    with Delta's DELTA_FAILED_TO_MERGE_FIELDS after the whole exchange."""
    good = history(spark, tmp_path, alice, [f"m{i}" for i in range(12)])
    held = spark.read.format("delta").load(good)
    texts = rewrite(spark, held.withColumn("seq", F.col("seq").cast("string"))
                    .withColumn("lamport_ts", F.col("lamport_ts").cast("string")), tmp_path)
    with pytest.raises(ConfigurationError, match="seq is string, not bigint; lamport_ts is string, not bigint"):
        replay(spark, texts, "g", verify=True)
    with pytest.raises(ConfigurationError, match="lamport_ts is string"):
        restore("g", [DeltaProvider(spark, texts, "p")])
    with pytest.raises(ConfigurationError, match="seq is string"):
        have_from_table(spark, texts, "g")
    with pytest.raises(ConfigurationError, match="seq is string"):
        restore("g", [DeltaProvider(spark, good, "p")], deliver=DeltaSink(spark, texts))
    assert spark.read.format("delta").load(texts).count() == 12  # nothing appended
    narrow = rewrite(spark, held.withColumn("payload", F.col("payload").cast("string")), tmp_path)
    with pytest.raises(ConfigurationError, match="payload is string, not binary"):
        replay(spark, narrow, "g")
    extra = rewrite(spark, held.withColumn("note", F.lit(1)), tmp_path)  # extra columns are no harm
    assert replay(spark, extra, "g").count() == 12
