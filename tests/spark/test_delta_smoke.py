"""The set-up path works: a session from the helper writes a Delta table and reads it back offline."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.spark


def test_delta_round_trip(spark, tmp_path):
    path = str(tmp_path / "smoke")
    rows = [(i, f"message {i}") for i in range(100)]
    spark.createDataFrame(rows, "id INT, body STRING").write.format("delta").save(path)
    spark.createDataFrame([(100, "appended")], "id INT, body STRING").write.format("delta").mode("append").save(path)

    back = spark.read.format("delta").load(path)
    assert back.count() == 101
    assert back.where("id = 42").collect()[0]["body"] == "message 42"
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
    assert [h["version"] for h in history] == [1, 0]
    # Time travel reads the first version only.
    assert spark.read.format("delta").option("versionAsOf", 0).load(path).count() == 100


def test_workers_run_this_interpreter(spark):
    import sys

    seen = spark.sparkContext.parallelize(range(4), 2).map(lambda _: __import__("sys").executable).distinct().collect()
    assert seen == [sys.executable]
