"""The superseded-seq ranges: the append path asks any_within for every append of a publisher that
has some, so it is a search; it must answer as the full listing does."""

from __future__ import annotations

import random
from pathlib import Path

from zerocomm_spark.journal.superseded import Superseded


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
