"""Reading a partition on an executor against a stand-in member (pure: a fake clock, no agent)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from zerocomm_spark.connector import partition_reader
from zerocomm_spark.connector.options import AgentOptions
from zerocomm_spark.connector.partition_reader import ZeroCommInputPartition, read_partition
from zerocomm_spark.errors import IncompleteReadError
from zerocomm_spark.journal import JOURNAL_SCHEMA

GROUP, DID = "g", "did:peer:2.bob"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _FakeLink:
    """Stands in for MemberLink: connect() gives itself, and it is its own context manager."""

    def connect(self, _agent):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class Member(_FakeLink):
    """Holds seqs 1..received(now) of one publisher: it is catching up at ``rate`` messages a second."""

    def __init__(self, clock: Clock, rate: float, total: int) -> None:
        self.clock, self.rate, self.total = clock, rate, total


    def received(self) -> int:
        return min(self.total, int(self.clock.now * self.rate))

    def read_seqs(self, group, publisher, first, last):
        top = min(last, self.received())
        if top >= first:
            yield pa.Table.from_pylist([{
                "offset": s, "group": group, "message_id": f"m{s}", "publisher_did": publisher, "seq": s,
                "lamport_ts": s, "sent_at": 1_700_000_000_000_000, "received_at": 1_700_000_000_000_000,
                "headers": None, "payload": b"x"} for s in range(first, top + 1)], schema=JOURNAL_SCHEMA)

    def last_seqs(self, groups):
        got = self.received()
        return {(GROUP, DID): got} if got else {}

    def first_seq(self, group, publisher, at_least, last):
        return at_least if at_least <= min(last, self.received()) else None

    def superseded(self, group, publisher, first, last):
        return []

    def group_names(self):
        return {GROUP}  # a member of the group, only behind


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(partition_reader.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(partition_reader.time, "sleep", fake.sleep)
    return fake


def partition(first: int, end: int, timeout: float) -> ZeroCommInputPartition:
    return ZeroCommInputPartition(group=GROUP, publisher=DID, first=first, end=end, label=None, agent=AgentOptions(),
                                  include_headers=False, fail_on_data_loss=True, read_timeout_s=timeout)


def seqs(batches) -> list[int]:
    return [s for b in batches for s in b.column("seq").to_pylist()]


def test_a_member_catching_up_steadily_is_waited_for_past_the_read_timeout(clock, monkeypatch):
    """readTimeoutMs bounds a wait for the member, not the whole read: a member that keeps
    delivering (one message every 0.5 s here, timeout 2 s) must not fail a partition whose read takes
    longer than the timeout in all (the error said it had waited 2 s when it had not waited at all)."""
    member = Member(clock, rate=2.0, total=20)
    monkeypatch.setattr(partition_reader.MemberLink, "connect", member.connect)
    assert seqs(read_partition(partition(1, 21, timeout=2.0))) == list(range(1, 21))
    assert clock.now >= 9.5


def test_a_member_that_stops_delivering_fails_the_read_after_the_timeout(clock, monkeypatch):
    member = Member(clock, rate=2.0, total=5)
    monkeypatch.setattr(partition_reader.MemberLink, "connect", member.connect)
    with pytest.raises(IncompleteReadError, match="only up to seq 5; this partition needs 6..10"):
        seqs(read_partition(partition(1, 11, timeout=2.0)))
    assert 4.0 <= clock.now <= 5.5  # the last message came at 2.5 s; then 2 s of waiting


class Inconsistent(Member):
    """Says it holds seqs (last_seqs, first_seq) that its reads never return: a bug or a race, which
    must end at the read timeout rather than spin without a wait or a deadline."""

    def read_seqs(self, group, publisher, first, last):
        return iter(())


def test_a_member_whose_reads_contradict_what_it_says_it_holds_fails_at_the_timeout(clock, monkeypatch):
    member = Inconsistent(clock, rate=100.0, total=5)
    monkeypatch.setattr(partition_reader.MemberLink, "connect", member.connect)
    clock.now = 1.0  # it "holds" all 5 from the start
    with pytest.raises(IncompleteReadError):
        seqs(read_partition(partition(1, 6, timeout=2.0)))
    assert 2.5 <= clock.now <= 4.0


def test_a_streams_publisher_label_is_null_once_the_publisher_left_as_documented():
    """publisher_label is "its label in this member's view (null once it left)": a batch read asks the
    member each time, but a stream kept the first label it saw for the whole query, and went on
    labelling the rows of a publisher that had left the group."""
    from pyspark.sql.types import StructType

    from zerocomm_spark.connector.micro_batch_stream import ZeroCommMicroBatchStream
    from zerocomm_spark.connector.offsets import ZeroCommOffset
    from zerocomm_spark.connector.options import SourceOptions

    class View:
        def __init__(self) -> None:
            self.members = {(GROUP, DID): "bob"}

        def labels(self, groups):
            return dict(self.members)

    view = View()
    stream = ZeroCommMicroBatchStream(SourceOptions.parse({"group": GROUP}, mode="stream"), StructType())
    stream._link = view  # type: ignore[assignment]  # noqa: SLF001 - the driver's member, a stand-in

    def labels(start: int, end: int) -> list[str | None]:
        parts = stream.partitions(ZeroCommOffset({(GROUP, DID): start}).to_dict(),
                                  ZeroCommOffset({(GROUP, DID): end}).to_dict())
        return [p.label for p in parts]

    assert labels(1, 5) == ["bob"]
    del view.members[(GROUP, DID)]  # bob left the group
    assert labels(5, 9) == [None]
    view.members[(GROUP, DID)] = "robert"  # and a label can change
    assert labels(9, 12) == ["robert"]


def test_a_commit_that_moves_nothing_still_tells_the_journal_the_query_is_alive():
    """The journal forgets a consumer that stops committing (journal.consumer_expiry): a query whose
    point stays (pinned by another group's first row, say) sent nothing and was forgotten."""
    from zerocomm_spark.connector.agent_link import MemberLink
    from zerocomm_spark.connector.offsets import ZeroCommOffset

    class Link(MemberLink):
        def __init__(self, consumers: dict[str, int]) -> None:
            self.consumers = consumers
            self.calls: list[tuple] = []

        def _call(self, method, *args, **kwargs):  # type: ignore[override]
            self.calls.append((method, args, kwargs))
            if method == "latest":
                return {"next_offset": 5, "committed_offset": 5, "consumers": dict(self.consumers), "publishers": []}
            return {}

    end = ZeroCommOffset({(GROUP, DID): 3}).with_consumer("spark-q")
    known = Link({"spark-q": 5})
    assert known.commit(end, [GROUP]) is None  # the point does not move...
    assert ("commit", (5,), {"consumer": "spark-q"}) in known.calls  # ...but the query said it is alive
    forgotten = Link({})  # the journal forgot it meanwhile: its commit makes it a consumer again
    assert forgotten.commit(end, [GROUP]) == 5
    assert [c for c in forgotten.calls if c[0] == "commit"] == [("commit", (5,), {"consumer": "spark-q"})]


def test_a_query_with_nothing_to_read_keeps_telling_the_journal_it_is_alive(monkeypatch):
    """Spark runs no batch (so commits nothing) while nothing is new: an idle query on a quiet group
    was forgotten by the journal after journal.consumer_expiry."""
    from pyspark.sql.types import StructType

    from zerocomm_spark.connector import micro_batch_stream as mbs
    from zerocomm_spark.connector.offsets import SeqRange, ZeroCommOffset
    from zerocomm_spark.connector.options import SourceOptions

    class Link:
        def __init__(self) -> None:
            self.commits: list[tuple[ZeroCommOffset, bool]] = []

        def ranges(self, groups, known_first=None):
            return {(GROUP, DID): SeqRange(1, 4)}  # nothing after seq 4

        def commit(self, end, groups, *, register=False):
            self.commits.append((end, register))
            return None

    link = Link()
    stream = mbs.ZeroCommMicroBatchStream(SourceOptions.parse({"group": GROUP}, mode="stream"), StructType())
    stream._link = link  # type: ignore[assignment]  # noqa: SLF001 - the driver's member, a stand-in
    start = ZeroCommOffset({(GROUP, DID): 5}).with_consumer("spark-q").to_dict()
    assert stream.latestOffset(start, None) == start  # nothing new
    assert len(link.commits) == 1  # the registration at the stream's start
    monkeypatch.setattr(mbs, "KEEP_ALIVE_S", 0.0)
    for _ in range(3):
        assert stream.latestOffset(start, None) == start
    assert len(link.commits) == 4 and all(register for _, register in link.commits)
    assert {end.consumer for end, _ in link.commits} == {"spark-q"}


class PlanningMember(_FakeLink):
    """What the batch planner asks the driver's member: bob's seqs 9..12 are all it holds (retention took
    1..8); carol's 1..3 are all there."""

    BOB, CAROL = (GROUP, "did:peer:2.bob"), (GROUP, "did:peer:2.carol")

    def __init__(self, sent_since: dict) -> None:
        self.sent_since = sent_since  # key -> what first_sent_at_or_after answers

    def check_groups(self, groups):
        pass

    def ranges(self, groups):
        from zerocomm_spark.connector.offsets import SeqRange

        return {self.BOB: SeqRange(9, 12), self.CAROL: SeqRange(1, 3)}

    def first_sent_at_or_after(self, key, timestamp_ms, span):
        return self.sent_since[key]

    def labels(self, groups):
        return {}


@pytest.mark.parametrize("starting, fail_on_data_loss, words", [
    ({"startingOffsets": "earliest"}, "false", "startingOffsets earliest starts it at seq 9, where what this member "
                                               "holds of it begins: its seqs below 9 are not on this member "
                                               "(retention took them, or it joined the group later)"),
    ({}, "true", "startingOffsets earliest starts it at seq 9"),  # earliest is the default of a batch read
    ({"startingTimestamp": "1767225600000"}, "true", "this member holds no message of it sent at or after "
                                                     "startingTimestamp 1767225600000 before seq 5: the read starts "
                                                     "it at seq 13"),
])
def test_a_batch_read_whose_resolved_start_is_past_its_end_is_empty_with_a_warning(monkeypatch, caplog, starting,
                                                                                   fail_on_data_loss, words):
    """endingOffsets {bob: 5} below the first seq the member holds (9), or a startingTimestamp after
    every message of bob (its start is last + 1 = 13): refused as an option error at planning, even with
    failOnDataLoss=false, while the same range named as startingOffsets {bob: 1} is warned of and skipped.
    Now bob's read is empty and a warning says why; carol is read as asked."""
    import json
    import logging

    from zerocomm_spark.connector import batch_reader
    from zerocomm_spark.connector.options import SourceOptions

    member = PlanningMember({PlanningMember.BOB: 13, PlanningMember.CAROL: 1})
    monkeypatch.setattr(batch_reader.MemberLink, "connect", member.connect)
    options = SourceOptions.parse({"group": GROUP, "endingOffsets": json.dumps({GROUP: {DID: 5}}),
                                   "failOnDataLoss": fail_on_data_loss, **starting}, mode="batch")
    with caplog.at_level(logging.WARNING, logger="zerocomm_spark.connector"):
        parts = batch_reader.ZeroCommBatchReader(options, None).partitions()
    assert [(p.publisher, p.first, p.end) for p in parts] == [("did:peer:2.carol", 1, 4)]
    [record] = [r for r in caplog.records if r.name == "zerocomm_spark.connector" and r.levelno == logging.WARNING]
    said = record.getMessage()
    assert f"group {GROUP!r}, publisher {DID}: " in said and words in said
    assert "with endingOffsets 5 (exclusive) the read returns none of its messages" in said
    assert "first message" not in said
