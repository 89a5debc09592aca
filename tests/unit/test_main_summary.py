"""The main job's human summary (pipelines/main.py render), without running the job."""

from __future__ import annotations

from zerocomm_spark.pipelines.main import render


def _summary(**extra):
    summary = {
        "group": "demo", "publishers": 1, "mode": "embedded", "members_start_s": 1.0, "spark_start_s": 2.0,
        "published": 5, "publish_s": 0.1, "publish_rate": 50.0, "replies": 0, "rows": 5, "distinct": 5,
        "missing": 0, "delta_version": 1, "micro_batches": 1, "encrypted": False, "replay_s": 1.0,
        "replay_rows_per_s": 5.0, "replies_after_original": 0, "origin_verified": 5,
        "latency_deliver_s": {"p50": 0.01, "p95": 0.02}, "latency_to_delta_s": {"p50": 1.0, "p95": 2.0},
        "per_publisher": {"alice": 5}, "table": "/tmp/zerocomm-main-x/history", "ok": True, "total_s": 9.0,
    }
    summary.update(extra)
    return summary


def test_the_table_line_says_when_the_table_went_with_the_temporary_work_directory():
    """It named a path the job had removed (no --work-dir, no --keep) as if the table were there."""
    removed = [line for line in render(_summary(table_removed=True)).splitlines() if line.startswith("table")]
    assert removed == ["table       /tmp/zerocomm-main-x/history (removed with the temporary work directory: "
                       "--keep or --work-dir DIR keeps it)"]
    kept = [line for line in render(_summary(table_removed=False)).splitlines() if line.startswith("table")]
    assert kept == ["table       /tmp/zerocomm-main-x/history"]
    assert [line for line in render(_summary()).splitlines() if line.startswith("table")] == kept
