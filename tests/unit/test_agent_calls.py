"""What the publish call accepts from an Arrow batch, checked before anything reaches the group."""

from __future__ import annotations

import pyarrow as pa
import pytest

from zerocomm_spark.agent.calls import _publish_rows, _signed
from zerocomm_spark.errors import BadRequestError, BadRowError

_HEADERS = pa.map_(pa.string(), pa.string())


@pytest.mark.parametrize("rows, match", [
    ([[("k", None)]], r"publish: row 0 has a null value for header 'k'"),
    ([[("", "v")]], r"publish: row 0 has a header with an empty key"),
    ([None, [("trace", "1"), ("k", None)]], r"publish: row 1 has a null value for header 'k'"),
])
def test_headers_the_group_cannot_carry_are_a_bad_request(rows: list, match: str) -> None:
    """The data plane refused them with a ConfigurationError whose hint points at the config file
    (and the CLI's exit code 2 for a bad setting): they are bad input to this call."""
    table = pa.table({"payload": pa.array([b"x"] * len(rows)), "headers": pa.array(rows, type=_HEADERS)})
    with pytest.raises(BadRowError, match=match):  # a BadRequestError: the row's data, not the call
        _publish_rows(table)


@pytest.mark.parametrize("columns, match", [
    ({"payload": pa.array([b"x", None])}, r"the payload of row 1 is null"),
    ({"payload": pa.array([b"x", b"y"]), "message_id": pa.array(["a", "b" * 257])}, r"message_id of row 1 is longer"),
    ({"payload": pa.array([b"x", b"y"]), "message_id": pa.array(["a", "a"])}, r"'a' of row 1 appears twice"),
    ({"payload": pa.array([b"x"]), "headers": pa.array([[(f"k{i}", "v") for i in range(65)]], _HEADERS)},
     r"publish: row 0 has 65 headers; a group message carries at most 64"),
    ({"payload": pa.array([b"x"]), "headers": pa.array([[("k", "v" * 4097)]], _HEADERS)},
     "publish: row 0 has header 'k' whose key or value is longer than 4096"),
    # An Arrow map may repeat a key: dict() kept the last value and published the row without the others.
    ({"payload": pa.array([b"x", b"y"]), "headers": pa.array([[("k", "v")], [("k", "a"), ("j", "c"), ("k", "b")]],
                                                             _HEADERS)},
     "publish: row 1 has the header 'k' 2 times"),
])
def test_a_rows_data_the_call_cannot_publish_is_a_bad_row(columns: dict, match: str) -> None:
    """Its own type, so a caller (the Spark sink) tells a row's data from a call this agent cannot take
    (an unknown argument or column, from a client of another version), both BadRequestError before."""
    with pytest.raises(BadRowError, match=match):
        _publish_rows(pa.table(columns))


@pytest.mark.parametrize("columns, match", [
    ({"payload": pa.array([b"x"]), "value": pa.array([1])}, "unknown column"),
    ({"message_id": pa.array(["a"])}, "no 'payload' column"),
    ({"payload": pa.array([1])}, "'payload' must be binary or string"),
    ({"payload": pa.array([b"x"]), "message_id": pa.array([1])}, "'message_id' must be string"),
])
def test_a_batch_the_call_cannot_take_is_a_bad_request_not_a_bad_row(columns: dict, match: str) -> None:
    with pytest.raises(BadRequestError, match=match) as info:
        _publish_rows(pa.table(columns))
    assert not isinstance(info.value, BadRowError)


def test_rows_sign_cannot_sign_are_bad_rows() -> None:
    class Signer:
        def headers(self, group, mid, payload, head):
            return {**(head or {}), "zc-origin": "1:proof"}

    with pytest.raises(BadRowError, match=r"row 1 \(message_id 'b'\) has a 'zc-origin' header, and sign is true"):
        _signed(Signer(), "g", [b"x", b"y"], ["a", "b"], [None, {"zc-origin": "1:x"}])
    with pytest.raises(BadRowError,
                       match=r"row 0 \(message_id 'a'\) has 64 headers; a group message carries at most 63 with sign "):
        _signed(Signer(), "g", [b"x"], ["a"], [{f"k{i}": "v" for i in range(64)}])


def test_good_headers_pass() -> None:
    table = pa.table({"payload": pa.array([b"x", b"y"]), "headers": pa.array([[("k", "v")], None], type=_HEADERS)})
    assert _publish_rows(table)[2] == [{"k": "v"}, None]


class _Process:
    """What the read call uses of an agent process: a real journal, no member."""

    def __init__(self, journal: object) -> None:
        self.journal = journal
        self.ingest = None


class _Request:
    def __init__(self, remaining: float) -> None:
        self._remaining = remaining

    def remaining(self) -> float:
        return self._remaining


def test_the_last_rows_of_a_rare_group_are_sought_only_within_the_deadline(tmp_path) -> None:
    """`read(last=N)` scans back from the end; for a group with no recent rows that is the whole
    journal, so the scan stops when the call's time is nearly up instead of answering after it."""
    from zerocomm_spark.agent.calls import AgentCalls
    from zerocomm_spark.journal import Journal

    with Journal.open(tmp_path / "j", key=bytes(32), fsync="never") as journal:
        rows = [{"group": "busy" if i else "rare", "message_id": f"m{i}", "publisher_did": "did:peer:x", "seq": i + 1,
                 "lamport_ts": i, "sent_at": 0, "payload": b"p"} for i in range(20_000)]
        journal.append(rows)
        calls = AgentCalls(_Process(journal))  # type: ignore[arg-type]
        table, end = calls._tail("rare", 1, 1000, 1 << 30, _Request(60.0))  # noqa: SLF001 - time enough: found
        assert table.column("message_id").to_pylist() == ["m0"] and end == 20_000
        table, end = calls._tail("rare", 1, 1000, 1 << 30, _Request(0.5))  # noqa: SLF001 - one chunk, then the deadline
        assert table.num_rows == 0 and end == 20_000


def test_the_last_rows_scan_goes_on_from_what_retention_left(tmp_path) -> None:
    """`read(last=N)` read the journal's earliest offset once; when retention deleted the oldest
    segments meanwhile, the scan's read of them raised DataLossError instead of ending at what is left."""
    from zerocomm_spark.agent.calls import AgentCalls
    from zerocomm_spark.journal import Journal

    with Journal.open(tmp_path / "j", key=bytes(32), fsync="never", segment_bytes=4096, retention_bytes=8192) as journal:
        for i in range(200):
            journal.append([{"group": "rare" if i in (3, 150) else "busy", "message_id": f"m{i}",
                             "publisher_did": "did:peer:x", "seq": i + 1, "lamport_ts": i, "sent_at": 0,
                             "payload": b"p" * 200}])
        stale = journal.earliest_offset()
        assert stale == 0
        journal.commit(120)
        journal.enforce_retention()  # what the syncer does between the scan's reads
        left = journal.earliest_offset()
        assert 3 < left <= 120
        reads: list[int] = []  # the scan read `earliest` before retention ran, then reads: the race, in order
        journal.earliest_offset = lambda: stale if not reads else left  # type: ignore[method-assign]
        real_read = journal.read
        journal.read = lambda *a, **k: (reads.append(1), real_read(*a, **k))[1]  # type: ignore[method-assign]
        calls = AgentCalls(_Process(journal))  # type: ignore[arg-type]
        table, end = calls._tail("rare", 5, 1000, 1 << 30, _Request(60.0))  # noqa: SLF001
        assert table.column("message_id").to_pylist() == ["m150"] and end == 200  # m3 is gone: no error


class _Receipt:
    def __init__(self, seqs: list[int]) -> None:
        self.seqs = seqs
        self.lamport_ts = seqs

    def wait(self, timeout: float) -> None:
        return None

    def done(self) -> bool:
        return True

    def failed(self) -> bool:
        return False


class _FailedReceipt(_Receipt):
    """Resolved with an error: the group closed before every member acked."""

    def wait(self, timeout: float) -> None:
        raise RuntimeError("the group closed")

    def failed(self) -> bool:
        return True


class _SlowGroups:
    """A group whose publish takes a while (a busy data plane), numbering rows as a group does."""

    did = "did:peer:me"

    def __init__(self) -> None:
        self.sent: list[str] = []
        self._lock = __import__("threading").Lock()

    def publish(self, group: str, payloads: list[bytes], *, message_ids: list[str], headers: object,
                timeout: float) -> _Receipt:
        import time

        time.sleep(0.2)
        with self._lock:
            first = len(self.sent) + 1
            self.sent += message_ids
        return _Receipt(list(range(first, first + len(message_ids))))


class _Config:
    max_request_bytes = 64 << 20

    def get(self, section: str, key: str) -> float:
        return self.max_request_bytes if (section, key) == ("api", "max_request_bytes") else 30.0


class _PublishingProcess:
    def __init__(self) -> None:
        from zerocomm_spark.agent.metrics import Metrics

        self.groups = _SlowGroups()
        self.config = _Config()
        self.ingest = None
        self.metrics = Metrics()


class _BulkRequest(_Request):
    def __init__(self, bulk: bytes) -> None:
        super().__init__(30.0)
        self.bulk = bulk


def test_concurrent_publishes_of_the_same_new_ids_send_them_once() -> None:
    """A retry racing the call it retries (a client that timed out and re-sent, two task attempts)
    carries the same ids: both calls found them new and each sent them under its own seqs."""
    import threading

    from zerocomm_spark.agent.calls import AgentCalls
    from zerocomm_spark.client import table_to_ipc

    process = _PublishingProcess()
    calls = AgentCalls(process)  # type: ignore[arg-type]
    ids = [f"race-{i}" for i in range(5)]
    bulk = table_to_ipc(pa.table({"payload": pa.array([b"x"] * 5), "message_id": pa.array(ids)}))
    answers: list[dict] = []
    threads = [threading.Thread(target=lambda: answers.append(calls.publish(_BulkRequest(bulk), "g")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert process.groups.sent == ids  # sent once
    assert [a["seqs"] for a in answers] == [[1, 2, 3, 4, 5]] * 2
    assert sorted(a["duplicates"] for a in answers) == [0, 5]


def test_a_retry_of_ids_whose_publish_failed_publishes_them_anew() -> None:
    """The agent remembered a failed receipt under its ids: a retry with the same ids (what the error
    advises) got the old receipt back and failed again, until the agent restarted."""
    from zerocomm_spark.agent.calls import AgentCalls
    from zerocomm_spark.client import table_to_ipc

    process = _PublishingProcess()
    calls = AgentCalls(process)  # type: ignore[arg-type]
    ids = ["again-1", "again-2"]
    bulk = table_to_ipc(pa.table({"payload": pa.array([b"x"] * 2), "message_id": pa.array(ids)}))
    real = process.groups.publish

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        receipt = real(*args, **kwargs)
        return _FailedReceipt(receipt.seqs)

    process.groups.publish = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="group closed"):
        calls.publish(_BulkRequest(bulk), "g")
    process.groups.publish = real  # type: ignore[method-assign]
    answer = calls.publish(_BulkRequest(bulk), "g")
    assert answer["seqs"] == [3, 4] and answer["duplicates"] == 0  # sent again, under new seqs
    assert process.groups.sent == ids + ids


def test_a_publish_whose_frame_would_decompress_past_four_times_the_request_limit_is_refused() -> None:
    from zerocomm_spark.agent.calls import AgentCalls

    process = _PublishingProcess()
    process.config.max_request_bytes = 1 << 20
    calls = AgentCalls(process)  # type: ignore[arg-type]
    table = pa.table({"payload": pa.array([bytes(1000)] * 5000),
                      "message_id": pa.array([f"z{i}" for i in range(5000)])})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)  # 5 MB of payloads in a frame of a few kB
    with pytest.raises(BadRequestError, match="more than 4194304 bytes once decompressed"):
        calls.publish(_BulkRequest(sink.getvalue().to_pybytes()), "g")
    assert process.groups.sent == []
    process.config.max_request_bytes = 2 << 20  # 8 MiB once decompressed: the same frame is taken
    assert calls.publish(_BulkRequest(sink.getvalue().to_pybytes()), "g")["seqs"][-1] == 5000


class _ReadConfig:
    def __init__(self, max_read_bytes: int) -> None:
        self.values = {("api", "max_read_rows"): 100_000, ("api", "max_read_bytes"): max_read_bytes}

    def get(self, section: str, key: str) -> int:
        return self.values[(section, key)]


def _big_rows(n: int, size: int, groups: tuple[str, ...] = ("g",)) -> list[dict]:
    return [{"group": groups[i % len(groups)], "message_id": f"m{i}", "publisher_did": "did:peer:x", "seq": i // len(groups) + 1,
             "lamport_ts": i, "sent_at": 0, "payload": bytes([i % 251]) * size} for i in range(n)]


def test_reads_come_in_pages_of_at_most_max_read_bytes_and_miss_nothing(tmp_path) -> None:
    """100,000 rows of large messages in one reply (and in the agent's memory first) could be
    gigabytes: a page stops at api.max_read_bytes of payloads, and reading on from where it says
    gives every row once - by offset, by offset for one group, by seq, and the last rows."""
    from zerocomm_spark.agent.calls import AgentCalls
    from zerocomm_spark.client import ipc_to_table
    from zerocomm_spark.journal import Journal

    with Journal.open(tmp_path / "j", key=bytes(32), fsync="never") as journal:
        for start in range(0, 300, 50):  # records of 50 rows, 10 kB each, two groups interleaved
            journal.append(_big_rows(300, 10_000, ("g", "h"))[start:start + 50])
        process = _Process(journal)
        process.config = _ReadConfig(64_000)  # 6 rows of 10 kB fit
        calls = AgentCalls(process)  # type: ignore[arg-type]

        def pages(**args: object) -> list[pa.Table]:
            out, start = [], args.pop("start", 0)
            while True:
                info, bulk = calls.read(_Request(60.0), group=args.get("group"), start=start, end=None, publisher=None,
                                        first_seq=None, last_seq=None, max_rows=None, wait=None, last=None)
                table = ipc_to_table(bulk)
                if not table.num_rows:
                    return out
                out.append(table)
                start = info["next_offset"]

        for group, expected in ((None, 300), ("g", 150), ("h", 150)):
            got = pages(group=group)
            assert all(t.num_rows <= 6 and sum(len(p) for p in t.column("payload").to_pylist()) <= 64_000 for t in got)
            offsets = [o for t in got for o in t.column("offset").to_pylist()]
            assert len(offsets) == expected and offsets == sorted(set(offsets)), group
            if group is not None:
                assert {g for t in got for g in t.column("group").to_pylist()} == {group}

        seqs: list[int] = []
        at = 1
        while True:
            info, bulk = calls.read(_Request(60.0), group="g", start=None, end=None, publisher="did:peer:x",
                                    first_seq=at, last_seq=None, max_rows=None, wait=None, last=None)
            table = ipc_to_table(bulk)
            if not table.num_rows:
                break
            assert table.num_rows <= 6
            seqs += table.column("seq").to_pylist()
            at = info["next_seq"]
        assert seqs == list(range(1, 151))

        info, bulk = calls.read(_Request(60.0), group="h", start=None, end=None, publisher=None, first_seq=None,
                                last_seq=None, max_rows=None, wait=None, last=20)
        assert ipc_to_table(bulk).column("seq").to_pylist() == list(range(145, 151))  # the newest that fit

        process.config = _ReadConfig(1000)  # smaller than one message: it still comes, alone
        info, bulk = calls.read(_Request(60.0), group=None, start=7, end=None, publisher=None, first_seq=None,
                                last_seq=None, max_rows=None, wait=None, last=None)
        assert ipc_to_table(bulk).column("offset").to_pylist() == [7] and info["next_offset"] == 8


def test_a_seq_read_returns_no_more_than_its_page(tmp_path) -> None:
    from zerocomm_spark.journal import Journal

    with Journal.open(tmp_path / "j", key=bytes(32), fsync="never") as journal:
        for start in range(0, 400, 100):
            journal.append(_big_rows(400, 100)[start:start + 100])
        assert journal.read_by_seq("g", "did:peer:x", 1, 400, max_rows=150).column("seq").to_pylist() == list(range(1, 151))
        assert journal.read_by_seq("g", "did:peer:x", 5, 400, max_bytes=1000).num_rows == 10
        assert journal.read_by_seq("g", "did:peer:x", 5, 400, max_bytes=10).num_rows == 1  # one at least
        assert journal.read_by_seq("g", "did:peer:x", 1, 400).num_rows == 400


class _Ingest:
    """This member's own rows taken by its journal at once (the event the publish call waits for)."""

    def track_own(self, receipt: object, group: str, did: str, payloads: object, ids: object,
                  headers: object) -> object:
        import threading

        done = threading.Event()
        done.set()
        return done


def test_a_publish_answered_while_the_journal_closes_is_acknowledged_not_an_error(tmp_path) -> None:
    """The call settles its rows from this member's journal (kept, or dropped as an earlier copy's
    duplicate) after the group acknowledged them: a journal closed meanwhile (the agent stopping)
    turned that acknowledged publish into an error, and a retry into a second look. It answers, with
    how the rows are kept unknown."""
    from zerocomm_spark.agent.calls import AgentCalls
    from zerocomm_spark.client import table_to_ipc
    from zerocomm_spark.journal import Journal

    process = _PublishingProcess()
    process.ingest = _Ingest()
    journal = Journal.open(tmp_path / "j", key=bytes(32), fsync="never")
    journal.close()
    process.journal = journal  # type: ignore[attr-defined]
    calls = AgentCalls(process)  # type: ignore[arg-type]
    bulk = table_to_ipc(pa.table({"payload": pa.array([b"x"] * 2), "message_id": pa.array(["c-1", "c-2"])}))
    answer = calls.publish(_BulkRequest(bulk), "g")
    assert answer["seqs"] == [1, 2] and answer["journaled"] is False
    assert (answer["signed"], answer["signed_unknown"], answer["duplicates"]) == (0, 2, 0)
