"""Reading one partition (one publisher's seq range) on an executor, as Arrow batches.

Why a partition carries everything: Spark pickles the partition (and the reader) to a Python worker
on an executor, where nothing from the driver exists. So the partition holds plain values (group,
publisher, range, label, agent options, flags) and the worker connects to the member on its own
host, reads, and closes; ZeroMQ contexts and sockets are made there and never pickled.

Why it may wait: an executor's member receives the group's messages on its own; when the driver's
member is ahead, the executor's one will have the same seqs moments later (seqs are per publisher,
identical on every member), so the reader waits up to ``readTimeoutMs`` for each next message before giving up. Seqs the
member has passed but does not hold are gone (retention, or a range the publisher no longer had):
that is data loss, handled as ``failOnDataLoss`` says.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import InputPartition

from zerocomm_spark.errors import GroupNotFoundError, IncompleteReadError, StreamDataLossError

from zerocomm_spark.connector.agent_link import MemberLink
from zerocomm_spark.connector.options import AgentOptions
from zerocomm_spark.connector.schema import arrow_schema, source_schema, to_source_batches

__all__ = ["ZeroCommInputPartition", "read_partition"]

log = logging.getLogger("zerocomm_spark.connector")

MAX_BATCH_ROWS = 10_000


@dataclass
class ZeroCommInputPartition(InputPartition):
    """Seqs ``first`` to ``end - 1`` of one publisher in one group, and what reading them needs."""

    group: str
    publisher: str
    first: int
    end: int
    label: str | None
    agent: AgentOptions
    include_headers: bool
    fail_on_data_loss: bool
    read_timeout_s: float

    def __post_init__(self) -> None:
        InputPartition.__init__(self, None)

    def __repr__(self) -> str:
        return (f"ZeroCommInputPartition({self.group!r}, {self.label or self.publisher[:24]!r}, "
                f"seqs {self.first}..{self.end - 1})")


def _gone(link: MemberLink, partition: ZeroCommInputPartition, first: int, last: int, why: str) -> None:
    """Seqs ``first..last`` have no row here: lost, except those superseded (their message ids came
    first from another publisher, as when a sink task is retried on another host) - those were
    delivered, under the other publisher."""
    at = first
    for a, b in link.superseded(partition.group, partition.publisher, first, last):
        if a > at:
            _lost(partition, at, a - 1, why)
        at = max(at, b + 1)
    if at <= last:
        _lost(partition, at, last, why)


def _lost(partition: ZeroCommInputPartition, first: int, last: int, why: str) -> None:
    who = partition.label or partition.publisher
    message = (f"messages {first}..{last} of publisher {who} in group {partition.group!r} are not in the journal of "
               f"the member on host {os.uname().nodename} ({why})")
    if partition.fail_on_data_loss:
        raise StreamDataLossError(message)
    log.warning("%s; skipping them because failOnDataLoss=false", message)


def read_partition(partition: ZeroCommInputPartition) -> Iterator[pa.RecordBatch]:
    """Yield the partition's messages in seq order, as batches of the source schema."""
    target = arrow_schema(source_schema(partition.include_headers))
    labels = {partition.publisher: partition.label} if partition.label else {}
    last = partition.end - 1
    expected = partition.first
    deadline = time.monotonic() + partition.read_timeout_s
    key = (partition.group, partition.publisher)
    pause = 0.02
    member_checked = False
    with MemberLink.connect(partition.agent) as link:
        while expected <= last:
            progressed = False
            for table in link.read_seqs(partition.group, partition.publisher, expected, last):
                seqs = table.column("seq")
                if table.num_rows > 1 and not pc.all(pc.greater(seqs[1:], seqs[:-1])).as_py():
                    table = table.sort_by("seq")
                    seqs = table.column("seq")
                lowest = int(seqs[0].as_py())
                if lowest > expected:  # later seqs are here, so these will never come
                    _gone(link, partition, expected, lowest - 1, "deleted by retention or never delivered to it")
                holes = int(seqs[-1].as_py()) - lowest + 1 - table.num_rows
                if holes > 0:
                    _report_holes(link, partition, table)
                yield from to_source_batches(table, labels, target, MAX_BATCH_ROWS)
                expected = int(seqs[-1].as_py()) + 1
                progressed = True
            if expected > last:
                break
            if progressed:  # readTimeoutMs bounds each wait for the member, not the whole read
                deadline = time.monotonic() + partition.read_timeout_s
                pause = 0.02
                continue
            journaled = link.last_seqs([partition.group]).get(key, 0)
            if journaled >= expected:
                # Delivery is FIFO per publisher: what the member lacks below its newest seq is gone.
                upto = min(journaled, last)
                found = link.first_seq(partition.group, partition.publisher, expected, upto)
                if found is None:
                    _gone(link, partition, expected, upto, f"it has journaled up to seq {journaled} without them")
                    expected = upto + 1
                    continue
                if found > expected:
                    _gone(link, partition, expected, found - 1, "deleted by retention or never delivered to it")
                    expected = found
                    continue
                # It says it holds `expected`, yet the read returned nothing (a race with retention, or
                # a bug): wait like for a member catching up, so this ends at the timeout, not a spin.
            if not member_checked:  # before the first wait: a member outside the group never gets them
                member_checked = True
                _check_member_of(link, partition, expected, last)
            if time.monotonic() >= deadline:
                raise IncompleteReadError(
                    f"the member on host {os.uname().nodename} has messages of publisher "
                    f"{partition.label or partition.publisher} in group {partition.group!r} only up to seq "
                    f"{journaled}; this partition needs {expected}..{last} (waited {partition.read_timeout_s:g}s)")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)


def _check_member_of(link: MemberLink, partition: ZeroCommInputPartition, first: int, last: int) -> None:
    """Fail at once when this host's member is not in the partition's group (not even joining it): the
    driver planned the read against its own member, and waiting readTimeoutMs here (at every retry of
    the task) for messages this member can never receive ended in an error that could only guess why."""
    mine = link.group_names()
    if partition.group in mine:
        return
    raise GroupNotFoundError(
        f"the member {link.label or ''} on host {os.uname().nodename} is not in group {partition.group!r} (its "
        f"groups: {', '.join(sorted(mine)) or 'none'}), so it can never hold messages {first}..{last} of publisher "
        f"{partition.label or partition.publisher} that this read needs; the driver's member, which planned the "
        "read, is in the group",
        hint="Each executor reads through the member on its own host: join that member to the group there "
             "(`zerocomm group join GROUP --via PEER`), or point that host's ZEROCOMM_CONFIG (or the agent option) "
             "at a member of the group")


def _report_holes(link: MemberLink, partition: ZeroCommInputPartition, table: pa.Table) -> None:
    seqs = table.column("seq").to_pylist()
    for a, b in zip(seqs, seqs[1:]):
        if b > a + 1:
            _gone(link, partition, a + 1, b - 1, "a gap: the publisher no longer had them when this member asked")
