"""The sink's task logic against a stand-in member: derived ids, retries, re-runs (pure, no agent)."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pytest

from zerocomm_spark.connector import writer
from zerocomm_spark.connector.options import SinkOptions
from zerocomm_spark.connector.schema import SinkColumns
from zerocomm_spark.connector.writer import publish_partition
from zerocomm_spark.errors import (
    ApiTimeoutError,
    BadRequestError,
    ConnectorOptionError,
    PublishNotAcknowledgedError,
    RequestTooLargeError,
    SinkHeaderError,
    SinkNullPayloadError,
    SinkOriginClaimError,
    SinkRowError,
    UnknownCallError,
)


class Member:
    """Keeps the first message of each id, like a group's members do; can fail after n publishes."""

    def __init__(self) -> None:
        self.delivered: dict[str, tuple[bytes, object]] = {}
        self.fail_after: int | None = None
        self.calls = 0
        self.payload_calls: list[list[bytes]] = []  # each publish call's payloads

    def connect(self, _agent):
        return self

    label = "alice"
    max_request_bytes = 64 * 1024 * 1024  # the agent's api.max_request_bytes (its default)
    max_message_bytes: int | None = None  # the largest payload the agent publishes (None: not said)

    def close(self) -> None:
        pass

    def publish(self, _group, table: pa.Table, _timeout, *, sign: bool = False):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise PublishNotAcknowledgedError("the group did not acknowledge (test)")
        self.calls += 1
        ids = table.column("message_id").to_pylist()
        payloads = table.column("payload").to_pylist()
        self.payload_calls.append(payloads)
        headers = table.column("headers").to_pylist() if "headers" in table.column_names else [None] * len(ids)
        dups = 0
        for mid, payload, head in zip(ids, payloads, headers):
            if mid in self.delivered:
                dups += 1
            else:
                self.delivered[mid] = (payload, head)
        return SimpleNamespace(message_ids=ids, seqs=[None] * len(ids), duplicates=dups)


@pytest.fixture
def member(monkeypatch):
    fake = Member()
    monkeypatch.setattr(writer.MemberLink, "connect", fake.connect)
    return fake


def batches(payloads, headers=None):
    data = {"payload": pa.array(payloads, pa.string())}
    if headers is not None:
        data["headers"] = pa.array(headers, pa.map_(pa.string(), pa.string()))
    return iter([pa.record_batch(data)])


@pytest.mark.parametrize("with_headers", [False, True])
def test_a_retried_task_whose_rows_come_in_another_order_delivers_each_row_once(member, with_headers):
    """A task after a shuffle reads its rows in fetch order, which differs between attempts (and
    between a batch and its re-run). Ids by row position gave the first rows of attempt 2 the ids
    attempt 1 had used for other rows: those rows were dropped as duplicates (lost) and the rows
    that moved were delivered twice."""
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=with_headers)
    options = SinkOptions.parse({"group": "g", "publishBatchSize": "2"})
    rows = [f"p{i}" for i in range(6)] + ["p0"]  # a payload twice: two messages
    heads = [[("k", str(i % 2))] for i in range(7)] if with_headers else None
    member.fail_after = 1  # attempt 1: its first chunk is acknowledged, then the task fails
    with pytest.raises(PublishNotAcknowledgedError):
        publish_partition(batches(rows, heads), options, columns, "q.3.0", 0)
    member.fail_after = None
    order = [5, 3, 6, 1, 0, 4, 2]  # attempt 2 reads the same rows in another order
    done = publish_partition(batches([rows[i] for i in order], [heads[i] for i in order] if heads else None),
                             options, columns, "q.3.0", 0)
    assert done.messages == 7 and done.duplicates == 2
    got = sorted((payload, tuple(head or ())) for payload, head in member.delivered.values())
    assert got == sorted((p.encode(), tuple(heads[i]) if heads else ()) for i, p in enumerate(rows))


def test_rows_differing_only_in_headers_are_different_messages(member):
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=True)
    options = SinkOptions.parse({"group": "g"})
    heads = [[("k", "a")], [("k", "b")], None, []]
    publish_partition(batches(["x"] * 4, heads), options, columns, "q.0.0", 0)
    assert len(member.delivered) == 4
    again = publish_partition(batches(["x"] * 4, heads[::-1]), options, columns, "q.0.0", 0)
    assert again.duplicates == 4 and len(member.delivered) == 4


def test_derived_ids_differ_by_task_and_fit_the_id_limit(member):
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=False)
    options = SinkOptions.parse({"group": "g"})
    for prefix in ("q.0.0", "q.0.1", "q.1.0"):
        publish_partition(batches(["same"]), options, columns, prefix, 0)
    assert len(member.delivered) == 3
    assert all(mid.startswith(("q.0.0.", "q.0.1.", "q.1.0.")) and len(mid) <= 256 for mid in member.delivered)


def test_a_streaming_task_without_a_batch_id_publishes_nothing(member, monkeypatch):
    """Without the batch in the prefix, equal rows of every later batch would get the ids of the first
    batch's and be dropped as duplicates: lost without a word. Refuse instead."""
    import pyspark

    from zerocomm_spark.errors import StreamContextError

    class Context:
        def partitionId(self):  # noqa: N802 - Spark's name
            return 0

        def getLocalProperty(self, name):  # noqa: N802
            return "query-1" if name == writer.QUERY_ID_PROPERTY else None

    monkeypatch.setattr(pyspark.TaskContext, "get", staticmethod(lambda: Context()))
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=False)
    sink = writer.ZeroCommStreamWriter(SinkOptions.parse({"group": "g"}), columns)
    with pytest.raises(StreamContextError, match="batchId"):
        sink.write(batches(["x"]))
    assert member.delivered == {}


def test_publish_batch_bytes_bounds_every_call_even_when_payload_sizes_are_skewed(member):
    """publishBatchBytes is payload bytes per publish call. Cutting by the input batch's average row
    size put ten 1 MB rows (and the tiny ones around them) in one 10 MB call under an 8 MiB limit; with
    bigger rows a call passed the agent's api.max_request_bytes and failed at every retry."""
    sizes: list[int] = []
    publish = member.publish

    def recording(group, table, timeout, *, sign=False):
        sizes.append(sum(len(p) for p in table.column("payload").to_pylist()))
        return publish(group, table, timeout, sign=sign)

    member.publish = recording
    columns = SinkColumns(payload_is_string=False, has_message_id=False, has_headers=False)
    limit = 4 * 1024 * 1024
    options = SinkOptions.parse({"group": "g", "publishBatchBytes": str(limit)})
    big, small = b"x" * 1_000_000, b"y"
    rows = [small] * 5 + [big] * 10 + [small] * 985 + [b"z" * (limit + 10)] + [small] * 3
    done = publish_partition(iter([pa.record_batch({"payload": pa.array(rows, pa.binary())})]), options, columns,
                             "q.0.0", 0)
    assert done.messages == len(rows) and len(member.delivered) == len(rows)
    assert sum(sizes) == sum(len(r) for r in rows)
    # every call within the limit, except the one message bigger than it, which goes alone
    assert all(size <= limit for size in sizes if size != limit + 10), sizes
    assert limit + 10 in sizes


def test_a_publish_batch_bytes_past_the_agents_request_limit_is_refused_before_publishing(member):
    """publishBatchBytes had no upper bound: past the agent's api.max_request_bytes (less room for
    ids and headers) every full chunk failed at the agent, at every retry of the task. The task
    refuses a value set that high before publishing anything."""
    member.max_request_bytes = 100_000
    room = 100_000 - 64 * 1024
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=False)
    options = SinkOptions.parse({"group": "g", "publishBatchBytes": str(room + 1)})
    with pytest.raises(ConnectorOptionError, match=f"publishBatchBytes is {room + 1}, more than the {room} bytes") as info:
        publish_partition(batches(["a", "b"]), options, columns, "q.0.0", 0)
    assert "api.max_request_bytes is 100000" in str(info.value) and f"at most {room}" in info.value.hint
    assert member.calls == 0 and not member.delivered
    at_limit = SinkOptions.parse({"group": "g", "publishBatchBytes": str(room)})
    assert publish_partition(batches(["a", "b"]), at_limit, columns, "q.0.0", 0).messages == 2


def test_the_default_publish_batch_bytes_fits_an_agent_with_a_lower_request_limit(member):
    """An agent configured with api.max_request_bytes below the 8 MiB default: a sink that never set
    publishBatchBytes publishes, in calls that fit (refusing it failed every such sink at start)."""
    member.max_request_bytes = 100_000
    room = 100_000 - 64 * 1024
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=False)
    rows = ["x" * 1000] * 100  # 100 kB of payload: more than one request holds
    result = publish_partition(batches(rows), SinkOptions.parse({"group": "g"}), columns, "q.0.0", 0)
    assert result.messages == 100 and member.calls > 1
    assert all(sum(len(p) for p in call) <= room for call in member.payload_calls)


def test_a_payload_past_the_agents_message_limit_is_refused_naming_its_row(monkeypatch):
    """The agent refused such a publish call whole, with a hint to raise a setting no agent has."""
    from zerocomm_spark.errors import SinkPayloadTooLargeError

    member = Member()
    member.max_message_bytes = 100
    monkeypatch.setattr(writer, "MemberLink", member)
    options = SinkOptions.parse({"group": "g", "publishBatchSize": "2"})
    rows = iter([pa.record_batch({"payload": pa.array([b"a", b"b", b"c", b"x" * 101, b"d"])})])
    with pytest.raises(SinkPayloadTooLargeError, match="row 3 of partition 4 has a 101-byte payload; a group "
                       "message carries at most 100 bytes") as info:
        publish_partition(rows, options, SinkColumns(False, False, False), "q.0.4", 4)
    assert "nothing from row 2 of the partition on was published" in str(info.value)
    assert "length(payload) <= 100" in info.value.hint
    assert member.calls == 1  # rows 0 and 1 went out; the chunk with the big row did not


class SigningMember(Member):
    """Records the sign flag of each publish call (signOrigin)."""

    def __init__(self) -> None:
        super().__init__()
        self.signs: list[bool] = []

    def publish(self, _group, table: pa.Table, _timeout, *, sign: bool = False):  # type: ignore[override]
        self.signs.append(sign)
        return super().publish(_group, table, _timeout)


def test_sign_origin_asks_the_agent_to_sign_and_refuses_a_row_that_claims_an_origin(monkeypatch):
    fake = SigningMember()
    monkeypatch.setattr(writer.MemberLink, "connect", fake.connect)
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=True)
    signed = SinkOptions.parse({"group": "g", "signOrigin": "true", "publishBatchSize": "2"})
    publish_partition(batches(["a", "b", "c"], [None, [("k", "v")], []]), signed, columns, "q.0.0", 0)
    publish_partition(batches(["d"], [None]), SinkOptions.parse({"group": "g"}), columns, "q.0.1", 0)
    assert fake.signs == [True, True, False] and len(fake.delivered) == 4
    claims = [None, [("k", "v")], [("zc-origin", "1:forged")]]
    with pytest.raises(SinkOriginClaimError, match="row 2 of partition 7 has a 'zc-origin' header, and "
                                                   "signOrigin is true") as info:
        publish_partition(batches(["e", "f", "g"], claims), signed, columns, "q.1.0", 7)
    assert "nothing from row 2" in str(info.value) and len(fake.delivered) == 6  # the chunk before it went out
    assert not isinstance(info.value, PublishNotAcknowledgedError) and "map_filter" in info.value.hint
    # Without signOrigin a row's own header is passed on as before (history verifies it then).
    publish_partition(batches(["g"], [[("zc-origin", "1:forged")]]), SinkOptions.parse({"group": "g"}), columns,
                      "q.2.0", 0)
    assert len(fake.delivered) == 7


_RETRY_ADVICE = "rerun the query (or let Spark retry)"


@pytest.mark.parametrize("headers, words", [
    ([[("a", "1")], [("a", "2"), ("k", None)]], "row 3 of partition 5 has a null value for header 'k'"),
    ([[("a", "1")], [("", "x")]], "row 3 of partition 5 has a header with an empty key"),
    ([[("a", "1")], [(f"k{i}", "v") for i in range(65)]], "row 3 of partition 5 has 65 headers; a group message "
                                                          "carries at most 64"),
    ([[("a", "1")], [("k", "v" * 4097)]], "row 3 of partition 5 has header 'k' whose key or value is longer than "
                                          "4096 characters"),
])
def test_headers_the_agent_would_refuse_are_a_data_error_naming_the_row(member, headers, words):
    """A null header value came back as PublishNotAcknowledgedError, whose advice (rerun, check the
    members, raise publishTimeoutMs) cannot help: every retry fails the same way."""
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=True)
    options = SinkOptions.parse({"group": "g", "publishBatchSize": "2"})
    with pytest.raises(SinkHeaderError) as info:
        publish_partition(batches(["a", "b", "c", "d"], [None, None, *headers]), options, columns, "q.0.5", 5)
    assert words in str(info.value) and "nothing from row 2 of the partition on was published" in str(info.value)
    assert not isinstance(info.value, PublishNotAcknowledgedError) and _RETRY_ADVICE not in str(info.value)
    assert len(member.delivered) == 2  # the chunk before it went out
    if "null value" in words:
        assert "map_filter" in info.value.hint and "coalesce" in info.value.hint


def test_a_null_payload_is_a_data_error_naming_the_row(member):
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=False)
    with pytest.raises(SinkNullPayloadError, match="row 1 of partition 2 has a null payload") as info:
        publish_partition(batches(["a", None]), SinkOptions.parse({"group": "g"}), columns, "q.0.2", 2)
    assert not isinstance(info.value, PublishNotAcknowledgedError) and _RETRY_ADVICE not in str(info.value)
    assert "payload IS NOT NULL" in info.value.hint and not member.delivered


class AgentClient:
    """A stand-in for zerocomm_spark.client.Client under the real MemberLink: its publish answers as the
    agent would, through the wire's error round trip (error_header, then raise_for_error by type name),
    with the agent's own row checks (agent/calls.py _publish_rows) or a given error."""

    agent: dict = {}

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls = 0

    def publish(self, group, table, *, timeout, sign=False):
        from zerocomm_spark.agent.calls import _publish_rows
        from zerocomm_spark.client import error_header, raise_for_error

        self.calls += 1
        try:
            if self.error is not None and self.calls > 1:  # the first call of the task goes through
                raise self.error
            _publish_rows(table)
        except Exception as exc:  # noqa: BLE001 - what the agent's server does with any error
            raise_for_error(error_header(self.calls, exc)["error"])
        return SimpleNamespace(message_ids=table.column("message_id").to_pylist(), seqs=[None] * table.num_rows,
                               duplicates=0)

    def close(self) -> None:
        pass


def _through_member_link(monkeypatch, client: AgentClient) -> None:
    monkeypatch.setattr(writer.MemberLink, "connect", lambda agent: writer.MemberLink(client, agent))


def test_the_agent_refusing_a_rows_data_is_a_data_error_naming_where_its_row_numbers_count(monkeypatch):
    """Through the real MemberLink (which wraps the agent's errors) and the wire's error round trip: the
    agent refusing a row (BadRowError) is a SinkRowError saying that the agent's row numbers count
    within the publish call that started at partition row R, after repeated ids were dropped."""
    monkeypatch.setattr(writer, "_check_headers", lambda *args: None)  # let the agent's own check speak
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=True)
    options = SinkOptions.parse({"group": "g", "publishBatchSize": "2"})
    client = AgentClient()
    _through_member_link(monkeypatch, client)
    heads = [None, None, None, [("k", None)]]
    with pytest.raises(SinkRowError) as info:
        publish_partition(batches(["a", "b", "c", "d"], heads), options, columns, "q.0.3", 3)
    said = str(info.value)
    assert not isinstance(info.value, (PublishNotAcknowledgedError, ConnectorOptionError, BadRequestError))
    assert "refused a row of the publish call holding rows 2-3 of partition 3" in said, said
    assert "publish: row 1 has a null value for header 'k'" in said
    assert "the agent numbers the call's rows from 0: its row i is partition row 2 + i" in said
    assert _RETRY_ADVICE not in said and "Fix or leave out that row" in info.value.hint
    assert client.calls == 2

    # given ids, one repeated: the agent's row 1 is partition row 3 ('c' went out only once)
    given = SinkColumns(payload_is_string=True, has_message_id=True, has_headers=True)
    rows = iter([pa.record_batch({"payload": pa.array(["a", "b", "c"]), "message_id": pa.array(["x", "x", "y"]),
                                  "headers": pa.array([None, None, [("k", None)]], pa.map_(pa.string(),
                                                                                          pa.string()))})])
    _through_member_link(monkeypatch, AgentClient())
    with pytest.raises(SinkRowError) as info:
        publish_partition(rows, SinkOptions.parse({"group": "g"}), given, "q.0.3", 3)
    said = str(info.value)
    assert "holding rows 0-2 of partition 3" in said and "publish: row 1 has a null value for header 'k'" in said, said
    assert ("numbers the call's rows from 0 at partition row 0, counting only the first row of each message id "
            "(1 row(s) repeating an earlier id were left out of the call)") in said


@pytest.mark.parametrize("error, words", [
    (BadRequestError("publish: unknown argument(s) 'sign'"), "unknown argument(s) 'sign'"),  # an older agent
    (RequestTooLargeError("the request is 70000000 bytes"), "70000000 bytes"),
    (UnknownCallError("no call 'publish'"), "no call 'publish'"),
    (ApiTimeoutError("no answer"), "did not acknowledge 1 message(s)"),
])
def test_the_agent_refusing_the_call_not_a_row_is_not_a_sink_row_error(monkeypatch, error, words):
    """A version-skewed agent refusing an argument is a plain BadRequestError: the sink told the user to
    fix rows 'A-B' that were fine. Only BadRowError is the rows'; anything else stays what MemberLink
    makes of it (PublishNotAcknowledgedError, with the agent's words)."""
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=False)
    _through_member_link(monkeypatch, AgentClient(error))
    with pytest.raises(PublishNotAcknowledgedError) as info:
        publish_partition(batches(["a", "b"]), SinkOptions.parse({"group": "g", "publishBatchSize": "1"}), columns,
                          "q.0.3", 3)
    assert not isinstance(info.value, SinkRowError) and words in str(info.value)
    assert "refused" not in str(info.value) and "Fix or leave out" not in str(info.value)


def test_a_given_message_id_longer_than_a_group_message_takes_is_refused_naming_its_partition_row(member):
    """The agent refused it by its row in the publish call (counted after repeated ids were dropped), not
    by its row in the partition."""
    columns = SinkColumns(payload_is_string=True, has_message_id=True, has_headers=False)
    ids = ["a", "a", "b", "c" * 256, "d" * 257, "e"]
    rows = iter([pa.record_batch({"payload": pa.array(["p"] * 6), "message_id": pa.array(ids)})])
    options = SinkOptions.parse({"group": "g", "publishBatchSize": "3"})
    with pytest.raises(SinkRowError, match="row 4 of partition 2 has a 257-character message_id; a group message's "
                                           "id has at most 256; nothing from row 3 of the partition on was "
                                           "published") as info:
        publish_partition(rows, options, columns, "q.0.2", 2)
    assert "sha2(message_id, 256)" in info.value.hint and not isinstance(info.value, ConnectorOptionError)
    assert sorted(member.delivered) == ["a", "b"]  # the chunk before it went out
    ok = iter([pa.record_batch({"payload": pa.array(["p", "q"]), "message_id": pa.array(["é" * 256, None])})])
    assert publish_partition(ok, options, columns, "q.0.2", 2).messages == 2  # characters, not bytes; null: derived


def test_a_sink_row_error_is_a_data_error_not_an_option_error():
    """It derived from ConnectorOptionError (a ConfigurationError): `except ConnectorOptionError` caught
    it and the CLI's exit code said bad usage."""
    from zerocomm_spark.agent.cli import EXIT_ERROR, exit_code_for
    from zerocomm_spark.errors import ConfigurationError, SinkPayloadTooLargeError, ZeroCommError

    for cls in (SinkRowError, SinkPayloadTooLargeError, SinkNullPayloadError, SinkHeaderError, SinkOriginClaimError):
        exc = cls("row 3 of partition 0 has a null payload")
        assert isinstance(exc, (ZeroCommError, ValueError)) and not isinstance(exc, ConfigurationError), cls
        assert exit_code_for(exc) == EXIT_ERROR, cls
        assert str(exc).startswith("row 3 of partition 0") and exc.hint, cls


def test_a_chunks_header_check_looks_only_at_its_own_rows():
    """A sliced MapArray's keys and items are the whole parent's: every chunk scanned the batch's entries,
    and one bad row sent every other chunk of the batch down the row-by-row path."""
    heads = pa.array([[("a", "1")], [("b", "2")], [("k", None)], [("", "x")], [("c", "3")]],
                     pa.map_(pa.string(), pa.string()))
    assert writer._headers_may_be_refused(heads.slice(0, 2), 64) is False  # valid; a later row is not
    assert writer._headers_may_be_refused(heads.slice(4, 1), 64) is False  # valid; earlier rows are not
    assert writer._headers_may_be_refused(heads.slice(2, 1), 64) is True
    assert writer._headers_may_be_refused(heads.slice(1, 3), 64) is True
    long = pa.array([[("k", "v")], [("k", "v" * 4097)]], pa.map_(pa.string(), pa.string()))
    assert writer._headers_may_be_refused(long.slice(0, 1), 64) is False
    assert writer._headers_may_be_refused(long.slice(1, 1), 64) is True


def test_valid_chunks_before_a_bad_header_are_not_checked_row_by_row(member, monkeypatch):
    walked: list[int] = []
    real = writer._check_row_headers
    monkeypatch.setattr(writer, "_check_row_headers", lambda head, at, *rest: (walked.append(at), real(head, at,
                                                                                                       *rest)))
    columns = SinkColumns(payload_is_string=True, has_message_id=False, has_headers=True)
    options = SinkOptions.parse({"group": "g", "publishBatchSize": "2"})
    with pytest.raises(SinkHeaderError, match="row 5 of partition 0 has a null value"):
        publish_partition(batches(list("abcdef"), [[("k", "v")]] * 5 + [[("k", None)]]), options, columns, "q.0.0", 0)
    assert walked == [4, 5] and len(member.delivered) == 4


