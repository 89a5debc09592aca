"""Which segments retention may delete: a pure function, so the rule is testable on its own.

Only whole closed segments go, oldest first, and only while each is entirely below the commit point
(the consumer has everything in it) *and* beyond a retention limit (the journal is over its size
budget, or the segment's newest row is older than the age limit). Deleting a prefix only keeps the
journal one contiguous range ``[earliest_offset, next_offset)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from zerocomm_spark.journal.segment import Segment


def segments_to_delete(segments: Sequence[Segment], *, committed: int, now_us: int,
                       retention_bytes: int | None, retention_ms: int | None) -> int:
    """How many of the oldest ``segments`` to delete (the last, active one never is)."""
    if retention_bytes is None and retention_ms is None:
        return 0
    total = sum(s.file_size for s in segments)
    count = 0
    for segment in segments[:-1]:
        if segment.end_offset > committed:
            break
        over_size = retention_bytes is not None and total > retention_bytes
        newest = segment.max_ts if segment.max_ts is not None else segment.created_us
        too_old = retention_ms is not None and newest < now_us - retention_ms * 1000
        if not (over_size or too_old):
            break
        total -= segment.file_size
        count += 1
    return count
