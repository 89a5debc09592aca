"""release_checkpointed reads a checkpoint's logs: which offset it would commit, and when none."""

from __future__ import annotations

import json
from pathlib import Path

from zerocomm_spark.pipelines.history import release_checkpointed

ZC = {"version": 1, "groups": {"g": {"did:key:z6Mk": 5}}, "consumer": "spark-abc"}


def _checkpoint(root: Path, sources: list[str], committed: list[int]) -> str:
    for batch in range(max(committed, default=0) + 1):
        offsets = root / "offsets"
        offsets.mkdir(parents=True, exist_ok=True)
        (offsets / str(batch)).write_text("\n".join(["v1", json.dumps({"batchTimestampMs": 1}), *sources]) + "\n")
    (root / "commits").mkdir(parents=True, exist_ok=True)
    for batch in committed:
        (root / "commits" / str(batch)).write_text("v1\n{}\n")
        (root / "commits" / f".{batch}.crc").write_text("")  # what Hadoop leaves beside each file
    return str(root)


def test_nothing_is_committed_without_one_named_zerocomm_source(tmp_path: Path) -> None:
    """Each case returns before any agent is asked (none runs here): nothing committed yet; another
    source's offset, or a source with none yet; an offset from before queries were named; two
    zerocomm sources, whose groups the checkpoint does not say."""
    assert release_checkpointed(None, "g", _checkpoint(tmp_path / "none", [json.dumps(ZC)], [])) is None
    other = json.dumps({"topic": {"0": 42}})
    assert release_checkpointed(None, "g", _checkpoint(tmp_path / "other", [other, "-"], [0])) is None
    unnamed = json.dumps({k: v for k, v in ZC.items() if k != "consumer"})
    assert release_checkpointed(None, "g", _checkpoint(tmp_path / "unnamed", [unnamed], [0])) is None
    two = [json.dumps(ZC), json.dumps({**ZC, "consumer": "spark-def"})]
    assert release_checkpointed(None, "g", _checkpoint(tmp_path / "two", two, [0])) is None
    one_unnamed = [json.dumps(ZC), unnamed]  # two zerocomm sources, one of them from before names
    assert release_checkpointed(None, "g", _checkpoint(tmp_path / "one-unnamed", one_unnamed, [0])) is None
    assert release_checkpointed(None, "g", "s3a://bucket/checkpoint") is None  # not listed
