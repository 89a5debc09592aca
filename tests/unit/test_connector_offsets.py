"""Source offsets, starting/ending positions, admission control and partition planning (pure)."""

from __future__ import annotations

import json

import pytest

from zerocomm_spark.connector.offsets import (
    EARLIEST,
    LATEST,
    OFFSET_VERSION,
    EndingOffsets,
    SeqRange,
    StartingOffsets,
    ZeroCommOffset,
    lag,
    limit_rows,
    split_ranges,
)
from zerocomm_spark.errors import ConnectorOptionError, OffsetFormatError

A = ("g", "did:peer:2.alice")
B = ("g", "did:peer:2.bob")
C = ("h", "did:peer:2.carol")


def test_offset_json_round_trip_is_canonical_and_versioned():
    one = ZeroCommOffset({B: 5, A: 3, C: 1})
    two = ZeroCommOffset({C: 1, A: 3, B: 5})
    assert one.to_json() == two.to_json()  # Spark compares offsets as text
    data = json.loads(one.to_json())
    assert data["version"] == OFFSET_VERSION
    assert data["groups"] == {"g": {"did:peer:2.alice": 3, "did:peer:2.bob": 5}, "h": {"did:peer:2.carol": 1}}
    assert list(data["groups"]["g"]) == sorted(data["groups"]["g"])
    back = ZeroCommOffset.from_json(one.to_json())
    assert back == one and back[A] == 3 and len(back) == 3
    assert ZeroCommOffset.from_dict(one.to_dict()).to_dict() == one.to_dict()


@pytest.mark.parametrize("bad, words", [
    ({"groups": {}}, "version"),
    ({"version": 99, "groups": {}}, "version 99"),
    ({"version": 0, "groups": {}}, "not valid"),
    ({"version": 1}, "groups"),
    ({"version": 1, "groups": {"g": 5}}, "publisher DID"),
    ({"version": 1, "groups": {"g": {"d": 0}}}, "seq >= 1"),
    ({"version": 1, "groups": {"g": {"d": "7"}}}, "integer"),
    ({"version": 1, "groups": {"g": {"d": True}}}, "integer"),
    ([1, 2], "JSON object"),
])
def test_malformed_offsets_are_refused_with_a_reason(bad, words):
    with pytest.raises(OffsetFormatError, match=words):
        ZeroCommOffset.from_dict(bad)


def test_a_first_batchs_end_offset_keeps_the_start_it_was_planned_from():
    """Spark re-runs a failed first batch from a fresh initialOffset(); the end offset it checkpointed
    carries the planned start (origin), and planning from it reads exactly the planned range."""
    start = ZeroCommOffset({A: 1, B: 4}, "spark-1")
    end = limit_rows(start, ZeroCommOffset({A: 50, B: 60}), 20).with_origin(start)
    data = json.loads(end.to_json())
    assert data["origin"] == {"g": {"did:peer:2.alice": 1, "did:peer:2.bob": 4}} and data["consumer"] == "spark-1"
    back = ZeroCommOffset.from_json(end.to_json())
    assert back == end and back.origin == start.positions
    rerun = ZeroCommOffset({A: 50, B: 60}, "spark-2")  # initialOffset() asked again after the restart
    assert back.planned_start(rerun) == start
    assert split_ranges(back.planned_start(rerun), back, max_per_slice=100) == split_ranges(start, end,
                                                                                           max_per_slice=100)
    # the next batch's end does not carry it, and an offset without one plans from the start given
    after = back.updated({A: 70})
    assert after.origin is None and "origin" not in after.to_dict() and after.consumer == "spark-1"
    assert limit_rows(back, ZeroCommOffset({A: 80}), 5).origin is None
    assert start.planned_start(rerun) == rerun
    with pytest.raises(OffsetFormatError, match="origin"):
        ZeroCommOffset.from_dict({**data, "origin": [1]})
    with pytest.raises(OffsetFormatError, match="seq >= 1"):
        ZeroCommOffset.from_dict({**data, "origin": {"g": {"d": 0}}})


def test_offset_from_newer_connector_says_what_to_do():
    with pytest.raises(OffsetFormatError) as info:
        ZeroCommOffset.from_json('{"version": 2, "groups": {}}')
    assert "zerocomm-spark version that wrote the checkpoint" in str(info.value)
    with pytest.raises(OffsetFormatError, match="not JSON"):
        ZeroCommOffset.from_json("{nope")
    with pytest.raises(OffsetFormatError, match="not JSON"):
        ZeroCommOffset.from_json("[" * 100_000)


KNOWN = {A: SeqRange(1, 10), B: SeqRange(4, 9), C: SeqRange(1, 0)}


def test_starting_earliest_and_latest_resolve_per_publisher():
    earliest = StartingOffsets.parse("earliest", ["g", "h"], default="latest").resolve(KNOWN)
    assert earliest.positions == {A: 1, B: 4, C: 1}
    latest = StartingOffsets.parse(None, ["g", "h"], default="latest").resolve(KNOWN)
    assert latest.positions == {A: 11, B: 10, C: 1}
    assert StartingOffsets.parse(" LATEST ", ["g"], default="earliest").kind == "latest"


def test_starting_json_per_publisher_and_group_shorthand():
    text = json.dumps({"g": {A[1]: 7, B[1]: LATEST, "did:peer:2.new": 3}, "h": "latest"})
    spec = StartingOffsets.parse(text, ["g", "h"], default="latest")
    got = spec.resolve(KNOWN)
    assert got[A] == 7 and got[B] == 10 and got[C] == 1
    assert got[("g", "did:peer:2.new")] == 3  # named but not yet known: kept
    # publishers the JSON does not name start at earliest (like new Kafka partitions)
    partial = StartingOffsets.parse(json.dumps({"g": {A[1]: EARLIEST}}), ["g", "h"], default="latest")
    assert partial.resolve(KNOWN).positions == {A: 1, B: 4, C: 1}


def test_starting_json_accepts_an_offset_copied_from_a_checkpoint():
    offset = ZeroCommOffset({A: 6, B: 8})
    got = StartingOffsets.parse(offset.to_json(), ["g"], default="latest").resolve({A: KNOWN[A], B: KNOWN[B]})
    assert got == offset


@pytest.mark.parametrize("text, words", [
    ("newest", "not earliest, latest or JSON"),
    ('{"other": {"d": 1}}', "does not subscribe"),
    ('{"g": 5}', "maps to int"),
    ('{"g": "middle"}', "maps to 'middle'"),
    ('{"g": {"d": 0}}', "seq >= 1"),
    ('{"g": {"d": -3}}', "-2 \\(earliest\\)"),
    ("[1]", "must be an object"),
    ("[" * 100_000, "not earliest, latest or JSON"),
])
def test_bad_starting_offsets_name_the_option(text, words):
    with pytest.raises(ConnectorOptionError, match=words) as info:
        StartingOffsets.parse(text, ["g"], default="latest")
    assert "startingOffsets" in str(info.value)


def test_starting_timestamp():
    spec = StartingOffsets.parse(None, ["g"], default="latest", timestamp="1767225600000")
    assert spec.kind == "timestamp" and spec.timestamp_ms == 1767225600000
    seen = []

    def lookup(key, ts):
        seen.append((key, ts))
        return 6 if key == A else 2  # B's retained range starts at 4: clamp

    got = spec.resolve({A: KNOWN[A], B: KNOWN[B]}, lookup)
    assert got.positions == {A: 6, B: 4}
    assert sorted(seen) == [(A, 1767225600000), (B, 1767225600000)]
    with pytest.raises(ConnectorOptionError, match="both startingOffsets and startingTimestamp"):
        StartingOffsets.parse("earliest", ["g"], default="latest", timestamp="1767225600000")
    with pytest.raises(ConnectorOptionError, match="looks like seconds") as info:
        StartingOffsets.parse(None, ["g"], default="latest", timestamp="1767225600")
    assert "1767225600000" in str(info.value)
    with pytest.raises(ConnectorOptionError, match="not an integer"):
        StartingOffsets.parse(None, ["g"], default="latest", timestamp="yesterday")


def test_ending_offsets():
    assert EndingOffsets.parse(None, ["g"]).resolve(KNOWN).positions == {A: 11, B: 10, C: 1}
    spec = EndingOffsets.parse(json.dumps({"g": {A[1]: 5}}), ["g", "h"])
    assert spec.resolve(KNOWN).positions == {A: 5, B: 10, C: 1}
    beyond = EndingOffsets.parse(json.dumps({"g": {A[1]: 10**15}}), ["g"])  # past the latest: what is there
    assert beyond.resolve(KNOWN).positions == {A: 11, B: 10, C: 1}
    with pytest.raises(ConnectorOptionError, match="largest seq"):  # not an int64: no seq can be there
        EndingOffsets.parse(json.dumps({"g": {A[1]: 1 << 63}}), ["g"])
    with pytest.raises(ConnectorOptionError, match="-2"):
        EndingOffsets.parse(json.dumps({"g": {A[1]: -2}}), ["g"])
    with pytest.raises(ConnectorOptionError, match="read nothing"):
        EndingOffsets.parse("earliest", ["g"])


def test_a_start_seq_named_after_the_named_end_is_refused_at_load_naming_both():
    """Both seqs are the user's: a contradiction between the options, refused as Kafka does."""
    ending = EndingOffsets.parse(json.dumps({"g": {A[1]: 5}}), ["g", "h"])
    named = StartingOffsets.parse(json.dumps({"g": {A[1]: 10}}), ["g"], default="earliest")
    with pytest.raises(ConnectorOptionError, match=f"publisher {A[1]} in group 'g': startingOffsets 10 is after "
                                                   "endingOffsets 5"):
        ending.check_start(named)
    for text in (json.dumps({"g": {A[1]: 5}}), json.dumps({"g": {A[1]: -2}}), "earliest"):  # empty, or resolved later
        ending.check_start(StartingOffsets.parse(text, ["g"], default="earliest"))
    ending.check_start(StartingOffsets.parse(None, ["g"], default="earliest", timestamp="1767225600000"))


def test_a_start_resolved_past_the_named_end_is_an_empty_read_with_a_reason_not_an_error():
    """At planning, earliest past retention (or a later join) or a startingTimestamp after the publisher's
    messages before the end starts it at or after the end: the member just holds nothing of that range.
    It was refused as an option error, ignoring failOnDataLoss=false (the same range named in seqs is
    warned of and skipped); and for a timestamp past every message it called last + 1 "its first message
    sent at or after it", a message that does not exist."""
    ending = EndingOffsets.parse(json.dumps({"g": {A[1]: 5}}), ["g", "h"])
    by_time = StartingOffsets.parse(None, ["g", "h"], default="earliest", timestamp="1767225600000")
    [said] = ending.late_starts(by_time, ZeroCommOffset({A: 7, B: 1}), KNOWN)
    assert said.startswith(f"group 'g', publisher {A[1]}: this member holds no message of it sent at or after "
                           "startingTimestamp 1767225600000 before seq 5: the read starts it at seq 7")
    assert "endingOffsets 5 (exclusive) the read returns none of its messages" in said
    assert "To read some, give an earlier startingTimestamp, or a later endingOffsets (-1: latest) for it" in said
    # Nothing sent at or after the time: the start is last + 1 (11), a position, never called a message
    [said] = ending.late_starts(by_time, ZeroCommOffset({A: 11}), KNOWN)
    assert "starts it at seq 11, after its last seq here (10)" in said
    assert "first message" not in said and "message sent at or after it" not in said
    # the timestamp's start is where retention left the publisher: said too
    [said] = ending.late_starts(by_time, ZeroCommOffset({A: 9}), {A: SeqRange(9, 12)})
    assert "its seqs below 9 are not on this member (retention took them, or it joined the group later)" in said
    earliest = StartingOffsets.parse("earliest", ["g", "h"], default="earliest")
    for spec in (earliest, StartingOffsets.parse(json.dumps({"g": {A[1]: -2}}), ["g"], default="latest"),
                 StartingOffsets.parse(json.dumps({"g": "earliest"}), ["g"], default="latest")):
        [said] = ending.late_starts(spec, ZeroCommOffset({A: 9}), {A: SeqRange(9, 12)})
        assert said.startswith(f"group 'g', publisher {A[1]}: startingOffsets earliest starts it at seq 9, where what "
                               "this member holds of it begins: its seqs below 9 are not on this member")
        assert "endingOffsets past 9" in said
    assert ending.late_starts(earliest, ZeroCommOffset({A: 5}), {A: SeqRange(5, 12)})  # [5, 5): empty, said why
    for start in ({A: 4}, {A: 1}, {B: 99}):  # a read, another publisher: nothing to say
        assert ending.late_starts(by_time, ZeroCommOffset(start), KNOWN) == []
    assert EndingOffsets.parse(json.dumps({"g": {A[1]: -1}}), ["g"]).late_starts(earliest, ZeroCommOffset({A: 9})) == []
    assert EndingOffsets.parse(json.dumps({"g": {A[1]: 1}}), ["g"]).late_starts(earliest, ZeroCommOffset({A: 9})) == []
    named = StartingOffsets.parse(json.dumps({"g": {A[1]: 3}}), ["g"], default="earliest")
    assert ending.late_starts(named, ZeroCommOffset({A: 9})) == []  # a seq named is load's to check


def test_limit_rows_is_fair_bounded_and_monotonic():
    start = ZeroCommOffset({A: 1, B: 1, C: 1})
    latest = ZeroCommOffset({A: 101, B: 3, C: 51})
    for n in (1, 2, 3, 7, 50, 99, 150, 1000):
        end = limit_rows(start, latest, n)
        taken = start.rows_until(end)
        assert taken == min(n, 152), n
        assert all(end[k] >= start[k] and end[k] <= latest[k] for k in start), n
    end = limit_rows(start, latest, 30)
    # B has only 2: the rest is shared between A and C equally.
    assert (end[A] - 1, end[B] - 1, end[C] - 1) == (14, 2, 14)
    # a position never moves backwards when the member reports less than the start
    end = limit_rows(ZeroCommOffset({A: 50}), ZeroCommOffset({A: 20}), 10)
    assert end[A] == 50
    with pytest.raises(ValueError):
        limit_rows(start, latest, 0)


def test_a_budget_smaller_than_the_publishers_rotates_instead_of_starving_the_last_keys():
    """Five publishers, 3 new messages each per batch, 3 rows per batch: every publisher moves, and
    no publisher falls behind another by more than a batch's worth."""
    keys = [("sensors", f"did:key:z{c}") for c in "ABCDE"]
    start = ZeroCommOffset({k: 1 for k in keys})
    top = 1
    for _ in range(50):
        top += 3
        start = limit_rows(start, ZeroCommOffset({k: top for k in keys}), 3)
    read = [start[k] - 1 for k in keys]
    assert sum(read) == 150
    assert max(read) - min(read) <= 3, read
    # a budget of 1, one publisher with a long and growing backlog, one with a single message
    a, b = ("g", "did:key:zA"), ("g", "did:key:zB")
    start, top_a = ZeroCommOffset({a: 1, b: 1}), 101
    for _ in range(4):
        top_a += 1
        start = limit_rows(start, ZeroCommOffset({a: top_a, b: 2}), 1)
    assert start[b] == 2  # served within a few batches, not starved behind the longest backlog


def test_limit_rows_keeps_introduced_publishers_as_given():
    end = limit_rows(ZeroCommOffset({A: 1}), ZeroCommOffset({A: 10, B: 4}), 5)
    assert end[A] == 6 and end[B] == 4


def test_split_ranges():
    start = ZeroCommOffset({A: 1, B: 5, C: 1})
    end = ZeroCommOffset({A: 101, B: 5, C: 11, ("g", "did:peer:2.new"): 7})
    slices = split_ranges(start, end, max_per_slice=30)
    # B has nothing, the new publisher is not in start: no slices for them
    assert {(s.group, s.publisher) for s in slices} == {A, C}
    a = [s for s in slices if (s.group, s.publisher) == A]
    assert [(s.first, s.end) for s in a] == [(1, 26), (26, 51), (51, 76), (76, 101)]
    assert all(s.count <= 30 for s in slices)
    assert sum(s.count for s in slices) == 110
    many = split_ranges(start, end, max_per_slice=1000, min_slices=8)
    assert len(many) >= 8 and sum(s.count for s in many) == 110
    # contiguous and non-overlapping per publisher
    for key in (A, C):
        parts = sorted((s.first, s.end) for s in many if (s.group, s.publisher) == key)
        assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))
    assert split_ranges(start, start, max_per_slice=10) == []


def test_lag():
    assert lag(ZeroCommOffset({A: 5, B: 9}), ZeroCommOffset({A: 10, B: 9, C: 4})) == {A: 5, B: 0, C: 3}


def test_starting_timestamp_lands_on_a_row_the_member_holds():
    """The first message sent at or after the time, among those held: a search ending inside a gap
    (seqs the member lacks) started the query at a missing seq, reported as data loss."""
    import pyarrow as pa

    from zerocomm_spark.connector.agent_link import MemberLink

    class Link(MemberLink):
        def __init__(self, sent_ms: dict[int, int]) -> None:
            self.sent_ms = sent_ms

        def first_row(self, group, publisher, at_least, last):  # type: ignore[override]
            held = [s for s in sorted(self.sent_ms) if at_least <= s <= last]
            if not held:
                return None
            return pa.table({"seq": [held[0]], "sent_at": pa.array([self.sent_ms[held[0]] * 1000], pa.int64())})

    sent = {s: s * 1000 for s in range(1, 11) if s not in (5, 6)}  # seqs 5 and 6 are not held
    link = Link(sent)
    span = SeqRange(1, 10)
    assert link.first_sent_at_or_after(A, 5_500, span) == 7
    assert link.first_sent_at_or_after(A, 4_000, span) == 4
    assert link.first_sent_at_or_after(A, 1, span) == 1
    assert link.first_sent_at_or_after(A, 99_000, span) == 11  # after everything: the next seq


@pytest.mark.parametrize("counts, min_slices", [((9,), 4), ((5, 5), 3), ((7, 1, 1), 5), ((100, 3), 9), ((3,), 3)])
def test_split_ranges_makes_at_least_min_slices_when_there_are_that_many_messages(counts, min_slices):
    """minPartitions is "at least this many Spark partitions per batch": 9 messages with
    minPartitions=4 came out as 3 partitions of 3 (the slice size was rounded up, then the count)."""
    keys = [("g", f"did:peer:2.p{i}") for i in range(len(counts))]
    start = ZeroCommOffset({k: 1 for k in keys})
    end = ZeroCommOffset({k: 1 + n for k, n in zip(keys, counts)})
    slices = split_ranges(start, end, max_per_slice=1000, min_slices=min_slices)
    assert len(slices) >= min_slices, slices
    assert sum(s.count for s in slices) == sum(counts) and all(s.count >= 1 for s in slices)
    for key, n in zip(keys, counts):
        parts = sorted((s.first, s.end) for s in slices if (s.group, s.publisher) == key)
        assert parts[0][0] == 1 and parts[-1][1] == 1 + n
        assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))
    # never more than max_per_slice, and never more slices than messages
    small = split_ranges(start, end, max_per_slice=2, min_slices=min_slices)
    assert all(s.count <= 2 for s in small) and sum(s.count for s in small) == sum(counts)
    assert len(split_ranges(start, end, max_per_slice=1000, min_slices=10**6)) == sum(counts)


@pytest.mark.parametrize("choice", [LATEST, 7])
def test_ending_offsets_naming_a_publisher_the_member_does_not_know_are_refused(choice):
    """As Kafka refuses an unknown partition in endingOffsets: the publisher was ignored without a
    word, and the read came back without any of its messages."""
    spec = EndingOffsets.parse(json.dumps({"g": {A[1]: 5, "did:peer:2.typo": choice}}), ["g"])
    with pytest.raises(ConnectorOptionError, match="endingOffsets names 1 publisher.* did:peer:2.typo in group 'g'") \
            as info:
        spec.resolve(KNOWN)
    assert A[1] in str(info.value) and "leave the publisher out" in info.value.hint


@pytest.mark.parametrize("choice", [LATEST, EARLIEST])
def test_a_publisher_named_at_latest_or_earliest_but_not_known_yet_is_introduced_when_it_appears(choice):
    """It resolved to seq 1: a member that joined after the publisher's first messages never holds
    them, so the query read [1, first retained) as data loss; and -1 means from now on, when nothing
    of it is held. Left out, it is introduced at its first retained seq once it appears."""
    new = ("g", "did:peer:2.new")
    spec = StartingOffsets.parse(json.dumps({"g": {A[1]: 7, new[1]: choice}}), ["g", "h"], default="latest")
    got = spec.resolve(KNOWN)
    assert new not in got and got[A] == 7
    assert spec.unknown(KNOWN) == [new]
