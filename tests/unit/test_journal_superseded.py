"""The superseded-seq ranges: the append path asks any_within for every append of a publisher that
has some, so it is a search; it must answer as the full listing does."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from zerocomm_spark.journal.superseded import SUPERSEDED_FILE, Superseded


def test_any_within_answers_as_within_does(tmp_path: Path) -> None:
    rng = random.Random(7)
    ranges = Superseded(tmp_path, bytes(32), fsync=False)
    key = ("g", "did:example:p")
    ranges.add([(key, seq) for seq in rng.sample(range(1, 400), 120)])  # single seqs and merged runs
    for _ in range(5000):
        first = rng.randint(0, 410)
        last = first + rng.randint(0, 20)
        assert ranges.any_within(key, first, last) == bool(ranges.within(key, first, last)), (first, last)
    assert not ranges.any_within(("g", "did:example:other"), 1, 10**9)
    reopened = Superseded(tmp_path, bytes(32), fsync=False)  # what a restart reads back
    assert all(reopened.any_within(key, s, s) == ranges.any_within(key, s, s) for s in range(0, 410))


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic"])
def test_a_damaged_file_is_reported_not_dropped_silently(tmp_path: Path, damage: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    # A rotten or cut superseded.idx was read as "nothing superseded" without a word: readers then
    # reported the superseded seqs as lost messages, and nothing said why.
    key = bytes(range(32))
    Superseded(tmp_path, key, fsync=False).add([(("g", "p"), 3), (("g", "p"), 4)])
    path = tmp_path / SUPERSEDED_FILE
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        del blob[-5:]
    elif damage == "flip":
        blob[-2] ^= 1
    else:
        blob[0] ^= 1
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.ERROR, logger="zerocomm_spark.journal.superseded"):
        loaded = Superseded(tmp_path, key, fsync=False)
    assert not loaded.has(("g", "p"))
    assert any(SUPERSEDED_FILE in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
