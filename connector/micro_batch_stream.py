"""The streaming source: offsets, admission control, availableNow, partition planning, commit.

Mirrors Spark's KafkaMicroBatchStream. It runs in the driver's long-lived planner process and
talks to the member on the driver's host; the reading itself happens on executors
(:mod:`~zerocomm_spark.connector.partition_reader`).

* Offsets are per (group, publisher) next seqs (:mod:`~zerocomm_spark.connector.offsets`), so a
  query restarted from its checkpoint replays exactly the same ranges.
* ``maxMessagesPerTrigger`` is Spark admission control (``getDefaultReadLimit`` -> ``ReadMaxRows``);
  when the engine passes ``ReadAllAvailable`` (e.g. ``Trigger.Once``) the option is not applied.
* ``trigger(availableNow=True)`` records the newest positions once, at start, and never goes past them.
* A publisher that appears mid-stream is introduced at its first retained seq in one batch's end
  offset and read from the next batch on: every planned range is ``[checkpointed, end)``.
* The first batch's end offset also records the start it was planned from (``origin``): Spark does
  not checkpoint that start and asks ``initialOffset()`` again when it re-runs the batch after a restart.
* ``commit(end)`` tells the member the checkpointed positions, so its journal prunes only what every
  checkpoint has passed, never on a guess.
* ``reportLatestOffset`` puts the newest positions in each progress report; :mod:`.lag` turns
  ``latestOffset - endOffset`` into lag per publisher.
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from zerocomm_spark.errors import ZeroCommError

from zerocomm_spark.connector.agent_link import MemberLink, describe
from zerocomm_spark.connector.offsets import PublisherKey, SeqRange, ZeroCommOffset, limit_rows, split_ranges
from zerocomm_spark.connector.options import SourceOptions
from zerocomm_spark.connector.partition_reader import ZeroCommInputPartition, read_partition

__all__ = ["ZeroCommMicroBatchStream", "plan_partitions"]

log = logging.getLogger("zerocomm_spark.connector")
#: A query with nothing to read tells the member's journal it is alive this often (see _keep_alive).
KEEP_ALIVE_S = 60.0
#: How often the planner checks that the driver's member is still in the query's groups (see latestOffset).
MEMBERSHIP_CHECK_S = 5.0


def plan_partitions(options: SourceOptions, start: ZeroCommOffset, end: ZeroCommOffset,
                    labels: dict[PublisherKey, str]) -> list[ZeroCommInputPartition]:
    """Partitions for ``[start, end)``: per publisher, big ranges split, each carrying what read() needs."""
    slices = split_ranges(start, end, max_per_slice=options.max_messages_per_partition,
                          min_slices=options.min_partitions)
    return [ZeroCommInputPartition(group=s.group, publisher=s.publisher, first=s.first, end=s.end,
                                   label=labels.get((s.group, s.publisher)), agent=options.agent,
                                   include_headers=options.include_headers,
                                   fail_on_data_loss=options.fail_on_data_loss,
                                   read_timeout_s=options.read_timeout_s)
            for s in slices]


class ZeroCommMicroBatchStream(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """spark.readStream.format("zerocomm"): one instance per query run, on the driver."""

    def __init__(self, options: SourceOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self._link: MemberLink | None = None
        self._target: ZeroCommOffset | None = None  # availableNow: never read past this
        self._latest: ZeroCommOffset | None = None  # newest positions seen, for progress reports
        self._labels: dict[PublisherKey, str] = {}
        self._initial: dict | None = None  # initialOffset's answer, given again on every later call
        self._registered = False  # this run told the member's journal where the query starts
        self._alive_at = time.monotonic()  # when the query last told the member's journal it is alive
        self._groups_checked_at = time.monotonic()  # when the member was last seen in every group (connect checks)

    # Pickled into the read UDF for executors: only the options travel.
    def __getstate__(self) -> dict[str, object]:
        return {"options": self.options, "schema": self.schema}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["options"], state["schema"])  # type: ignore[misc, arg-type]

    # --- the member -------------------------------------------------------------------------------

    def _member(self) -> MemberLink:
        if self._link is None:
            link = MemberLink.connect(self.options.agent)
            try:
                link.check_groups(self.options.groups)
            except BaseException:
                link.close()
                raise
            self._link = link
        return self._link

    def _ranges(self, known_first: dict[PublisherKey, int] | None = None) -> dict[PublisherKey, SeqRange]:
        return self._member().ranges(self.options.groups, known_first)

    # --- offsets ----------------------------------------------------------------------------------

    def initialOffset(self) -> dict:
        """Where a new query starts (a restarted one resumes from its checkpoint instead).

        Spark asks more than once for batch 0 (to plan it and to run it): the first answer is kept,
        or the batch would run from a later start than it was planned with (rows in between lost)
        and register a second consumer with the member's journal.
        """
        if self._initial is None:
            ranges = self._ranges()
            link = self._member()
            offset = self.options.starting.resolve(
                ranges, lambda key, ts: link.first_sent_at_or_after(key, ts, ranges[key]))
            unknown = self.options.starting.unknown(ranges)
            if unknown:  # DIDs are not secret; a misspelt one would wait forever without a word
                log.warning("zerocomm source: startingOffsets names %d publisher(s) this member has no messages of "
                            "yet (%s); each is read from its position, or (-2/-1) from its first message, once it "
                            "appears", len(unknown), ", ".join(f"{g}/{d}" for g, d in unknown))
            offset = offset.with_consumer(f"spark-{uuid.uuid4().hex}")  # this query, to the member's journal
            log.info("zerocomm source starts at %s", offset.to_json())
            self._initial = offset.to_dict()
        return copy.deepcopy(self._initial)

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.options.max_messages_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the end of an availableNow run: the newest positions now, including publishers known now."""
        self._target = ZeroCommOffset({key: span.next for key, span in self._ranges().items()})
        log.info("zerocomm source (availableNow) ends at %s", self._target.to_json())

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next batch: newest positions, capped by the read limit and availableNow."""
        begin = ZeroCommOffset.from_dict(start)
        self._register(begin)
        self._check_still_member()
        ranges = self._ranges(known_first=dict(begin.items()))
        self._latest = ZeroCommOffset({key: span.next for key, span in ranges.items()})
        newest: dict[PublisherKey, int] = {}
        introduced: dict[PublisherKey, int] = {}
        for key, span in ranges.items():
            position = span.next
            if self._target is not None:
                if key not in self._target:
                    continue  # appeared after the availableNow run began: not part of it
                position = min(position, self._target[key])
            if key in begin:
                newest[key] = max(position, begin[key])
            else:
                introduced[key] = span.first
        if isinstance(limit, ReadMaxRows):
            end = limit_rows(begin, ZeroCommOffset(newest), limit.max_rows)
        elif isinstance(limit, ReadAllAvailable) or limit is None:
            end = begin.updated(newest)
        else:
            raise ZeroCommError(f"format(\"zerocomm\") got a read limit it does not implement: {limit!r}")
        if introduced:
            end = end.updated(introduced)
        if end.positions == begin.positions:
            self._keep_alive(begin)
            return start  # nothing new: the same offset, so Spark runs no batch (an origin kept in it)
        if self._initial is not None and start == self._initial:
            # The first batch: Spark checkpoints its end but not its start, and re-running it after a
            # restart asks initialOffset() again, answered anew (later for "latest", past what retention
            # deleted for "earliest"): rows of the planned range were skipped without a word.
            end = end.with_origin(begin)
        return end.to_dict()

    def reportLatestOffset(self) -> dict | None:
        return self._latest.to_dict() if self._latest is not None else None

    # --- planning and reading ---------------------------------------------------------------------

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        stop = ZeroCommOffset.from_dict(end)
        begin = stop.planned_start(ZeroCommOffset.from_dict(start))  # a re-run first batch: its planned start
        self._register(begin.with_consumer(stop.consumer))  # a batch re-run after a restart comes first
        # Asked for every batch, not kept from the first: a publisher that left has no label (null), as
        # in a batch read; one call per group.
        try:
            self._labels = self._member().labels(self.options.groups)
        except ZeroCommError as exc:  # labels are a courtesy; reading must not fail for them
            log.warning("zerocomm source: cannot fetch publisher labels (%s)", describe(exc))
        return plan_partitions(self.options, begin, stop, self._labels)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ZeroCommInputPartition)
        return read_partition(partition)

    def _register(self, start: ZeroCommOffset) -> None:
        """Once per run, at the stream's start: the journal keeps what the query has yet to read.

        Only a commit made the query a consumer of the member's journal, and Spark commits a batch
        when the next one starts: until then retention could delete rows the query was reading.
        """
        if self._registered or not self.options.commit_to_agent or start.consumer is None:
            return
        self._registered = True
        try:
            point = self._member().commit(start, self.options.groups, register=True)
            if point is not None:
                log.debug("zerocomm source registered with the journal at offset %d", point)
        except ZeroCommError as exc:  # as for commits: the query runs; retention may go ahead of it
            log.warning("zerocomm source: could not register the query with the agent's journal (%s); retention "
                        "does not wait for it until its first commit", describe(exc))

    def _check_still_member(self) -> None:
        """Every ``MEMBERSHIP_CHECK_S``: a member that left a group (or was removed) since the query
        started never receives its new messages, and its journal still answers for what it holds, so
        the query stayed active reading nothing new, with no lag reported, while a query started then
        failed at once (GroupNotFoundError). It now fails the same way, saying the member left."""
        now = time.monotonic()
        if now - self._groups_checked_at < MEMBERSHIP_CHECK_S:
            return
        self._member().check_groups(self.options.groups, running=True)
        self._groups_checked_at = now

    def _keep_alive(self, begin: ZeroCommOffset) -> None:
        """With nothing new to read Spark runs no batch, so nothing is committed: every
        ``KEEP_ALIVE_S`` the query's point is committed again (it moves nothing), or the journal would
        forget a query that waits on a quiet group (``journal.consumer_expiry``), and registered
        again if the journal forgot it meanwhile."""
        now = time.monotonic()
        if not self.options.commit_to_agent or begin.consumer is None or now - self._alive_at < KEEP_ALIVE_S:
            return
        self._alive_at = now
        try:
            self._member().commit(begin, self.options.groups, register=True)
        except ZeroCommError as exc:
            log.warning("zerocomm source: could not tell the agent the query is alive (%s)", describe(exc))

    # --- after a batch ----------------------------------------------------------------------------

    def commit(self, end: dict) -> None:
        """Spark checkpointed ``end``: the member may prune what lies below it (and nothing else)."""
        if not self.options.commit_to_agent:
            return
        try:
            point = self._member().commit(ZeroCommOffset.from_dict(end), self.options.groups)
            self._alive_at = time.monotonic()
            if point is not None:
                log.debug("zerocomm source committed journal offset %d", point)
        except ZeroCommError as exc:  # pruning later is harmless; failing the query is not
            log.warning("zerocomm source: could not tell the agent the commit point (%s)", describe(exc))

    def stop(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
