"""spark.read.format("zerocomm"): a bounded read of the member's journal, like Kafka's batch relation.

The range is ``[startingOffsets, endingOffsets)`` per publisher, resolved once on the driver against
the member on the driver's host (default: earliest to latest), then read on executors exactly as a
streaming batch is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from zerocomm_spark.connector.agent_link import MemberLink
from zerocomm_spark.connector.micro_batch_stream import plan_partitions
from zerocomm_spark.connector.offsets import ZeroCommOffset
from zerocomm_spark.connector.options import SourceOptions
from zerocomm_spark.connector.partition_reader import ZeroCommInputPartition, read_partition

__all__ = ["ZeroCommBatchReader"]

log = logging.getLogger("zerocomm_spark.connector")


class ZeroCommBatchReader(DataSourceReader):
    """Plans on the driver, is pickled to executors for read(); holds only plain values."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def resolve(self) -> tuple[ZeroCommOffset, ZeroCommOffset, dict]:
        """(start, end, labels) against the member on this host."""
        with MemberLink.connect(self.options.agent) as link:
            link.check_groups(self.options.groups)
            ranges = link.ranges(self.options.groups)
            start = self.options.starting.resolve(
                ranges, lambda key, ts: link.first_sent_at_or_after(key, ts, ranges[key]))
            end = self.options.ending.resolve(ranges)
            # A start resolved past the end (retention, a later join, nothing sent since the timestamp) is an
            # empty read of that publisher, not an error: the options themselves do not contradict.
            for said in self.options.ending.late_starts(self.options.starting, start, ranges):
                log.warning("zerocomm read: %s", said)
            # publishers named only in endingOffsets start at their first retained seq
            start = start.updated({k: ranges[k].first if k in ranges else 1 for k in end if k not in start})
            labels = link.labels(self.options.groups)
        return start, end, labels

    def partitions(self) -> Sequence[InputPartition]:
        start, end, labels = self.resolve()
        return plan_partitions(self.options, start, end, labels)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, ZeroCommInputPartition):  # Spark's placeholder for "no partitions"
            return iter(())
        return read_partition(partition)
