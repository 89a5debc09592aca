"""The sink's signOrigin end to end: real member agents (processes, as `zerocomm agent start` runs
them), real Spark, real Delta. Rows written with signOrigin=true reach another member signed by the
writer's agent; history ingest keeps the proofs and replay verifies every one of them."""

from __future__ import annotations

import time

import pytest

from zerocomm_spark.pipelines.history import ingest
from zerocomm_spark.pipelines.local_group import LocalGroup
from zerocomm_spark.pipelines.replay import replay
from zerocomm_spark.pipelines.restore import have_from_client

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]


def test_rows_the_sink_writes_with_sign_origin_replay_origin_verified(spark, tmp_path):
    from pyspark.sql.types import MapType, StringType, StructField, StructType

    schema = StructType([StructField("payload", StringType()), StructField("message_id", StringType()),
                         StructField("headers", MapType(StringType(), StringType()))])
    with LocalGroup.start(["writer", "historian"], group="signed", mode="agents",
                          base_dir=tmp_path / "members") as members:
        writer, historian = members["writer"], members["historian"]
        assert writer.signer is None  # agents mode: the key is in the agent process, nothing signs here

        def write(rows, sign: str) -> None:
            (spark.createDataFrame(rows, schema).write.format("zerocomm").option("group", "signed")
             .option("agent", writer.agent).option("signOrigin", sign).mode("append").save())

        write([("one", "s1", {"kind": "a"}), ("two", "s2", None), ("three", "s3", {})], "true")
        write([("plain", "u1", None)], "false")
        with pytest.raises(Exception, match="zc-origin"):  # a row claiming an origin of its own, with signOrigin
            write([("forged", "f1", {"zc-origin": "1:" + "A" * 86 + "=="})], "true")

        deadline = time.monotonic() + 60
        while sorted(have_from_client(historian.client, "signed").message_ids) != ["s1", "s2", "s3", "u1"]:
            assert time.monotonic() < deadline, "the historian did not get the four rows"
            time.sleep(0.5)
        query = ingest(spark, ["signed"], str(tmp_path / "history"), str(tmp_path / "ck"), agent=historian.agent,
                       trigger="available_now")
        assert query.awaitTermination(300) and query.exception() is None

        rows = replay(spark, str(tmp_path / "history"), "signed", verify=True).select(
            "message_id", "publisher_did", "headers", "origin_scheme", "origin_sig", "origin_ok").toArrow()
        by_id = {r["message_id"]: r for r in rows.to_pylist()}
        assert sorted(by_id) == ["s1", "s2", "s3", "u1"]
        for mid in ("s1", "s2", "s3"):
            row = by_id[mid]
            assert row["origin_ok"] is True, mid
            assert row["publisher_did"] == writer.did and len(row["origin_sig"]) == 64
            assert row["origin_scheme"] == "ed25519-member/1"
        assert dict(by_id["s1"]["headers"]) == {"kind": "a"}  # the proof moved to origin_sig, the rest stayed
        assert by_id["u1"]["origin_ok"] is False and by_id["u1"]["origin_sig"] is None
