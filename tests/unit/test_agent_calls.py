"""What the publish call accepts from an Arrow batch, checked before anything reaches the group."""

from __future__ import annotations

import pyarrow as pa
import pytest

from zerocomm_spark.agent.calls import _publish_rows
from zerocomm_spark.errors import BadRequestError

_HEADERS = pa.map_(pa.string(), pa.string())


@pytest.mark.parametrize("rows, match", [
    ([[("k", None)]], r"headers of row 0 .* null value"),
    ([[("", "v")]], r"headers of row 0 .* empty key"),
    ([None, [("trace", "1"), ("k", None)]], r"headers of row 1"),
])
def test_headers_the_group_cannot_carry_are_a_bad_request(rows: list, match: str) -> None:
    """The data plane refused them with a ConfigurationError whose hint points at the config file
    (and the CLI's exit code 2 for a bad setting): they are bad input to this call."""
    table = pa.table({"payload": pa.array([b"x"] * len(rows)), "headers": pa.array(rows, type=_HEADERS)})
    with pytest.raises(BadRequestError, match=match):
        _publish_rows(table)


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
        table, end = calls._tail("rare", 1, 1000, _Request(60.0))  # noqa: SLF001 - time enough: found
        assert table.column("message_id").to_pylist() == ["m0"] and end == 20_000
        table, end = calls._tail("rare", 1, 1000, _Request(0.5))  # noqa: SLF001 - one chunk, then the deadline
        assert table.num_rows == 0 and end == 20_000


class _Receipt:
    def __init__(self, seqs: list[int]) -> None:
        self.seqs = seqs
        self.lamport_ts = seqs

    def wait(self, timeout: float) -> None:
        return None

    def done(self) -> bool:
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
