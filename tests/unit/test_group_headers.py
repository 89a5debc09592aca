"""One rule for a message's headers (zerocomm_spark/group/headers.py): the data plane, the agent's
publish call and the Spark sink (its check run on real Arrow data, vectorised look included) refuse
the same header maps, and say the same thing about them, each naming its own place."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, IntegerType, MapType, StringType, StructField, StructType

from zerocomm_spark.agent.calls import _publish_rows, _signed
from zerocomm_spark.connector import writer
from zerocomm_spark.connector.schema import sink_columns
from zerocomm_spark.errors import (
    BadRequestError,
    BadRowError,
    ConfigurationError,
    SinkHeaderError,
    SinkOriginClaimError,
    SinkSchemaError,
)
from zerocomm_spark.group.headers import check_headers, header_problem, repeated_key

_HEADERS = pa.map_(pa.string(), pa.string())
_GOOD = {"trace": "1"}

# name, headers, kind, the core's words (as they follow "has")
BAD = [
    ("null value", {"a": "1", "k": None}, "null-value", "a null value for header 'k'"),
    ("empty key", {"": "x"}, "empty-key", "a header with an empty key"),
    ("over-long key", {"k" * 4097: "v"}, "too-long",
     f"header {'k' * 64!r} whose key or value is longer than 4096 characters"),
    ("over-long value", {"k": "v" * 4097}, "too-long", "header 'k' whose key or value is longer than 4096 characters"),
    ("too many", {f"k{i}": "v" for i in range(65)}, "too-many", "65 headers; a group message carries at most 64"),
]
# with signing (switch named as each place names it): one entry fewer, and no zc-origin of the row's own
BAD_SIGNED = [
    ("reserved key", {"a": "1", "zc-origin": "1:forged"}, "reserved",
     "a 'zc-origin' header, and {sign} is true: the agent adds the origin proof itself"),
    ("too many to sign", {f"k{i}": "v" for i in range(64)}, "too-many",
     "64 headers; a group message carries at most 63 with {sign} (which adds zc-origin)"),
]
# name, headers, whether they can also be signed
GOOD = [
    ("none", None, True),
    ("empty", {}, True),
    ("at the limits", {**{f"k{i}": "v" for i in range(61)}, "k" * 4096: "v" * 4096, "e": ""}, True),
    ("64 entries", {f"k{i}": "v" for i in range(64)}, False),
]


def _sink(headers: dict | None, sign: bool = False, at: int = 1) -> None:
    """The sink's check over one real Arrow chunk whose row ``at`` holds ``headers`` (partition 3, the
    chunk starting at partition row 10), the other rows valid."""
    rows = [_GOOD] * 3
    rows[at] = headers
    column = pa.chunked_array([pa.array([None if h is None else list(h.items()) for h in rows], _HEADERS)])
    writer._check_headers(column, 10, 3, sign)


def _agent(headers: dict | None, at: int = 1) -> None:
    rows = [_GOOD] * 3
    rows[at] = headers
    _publish_rows(pa.table({"payload": pa.array([b"x"] * 3),
                            "headers": pa.array([None if h is None else list(h.items()) for h in rows], _HEADERS)}))


@pytest.mark.parametrize("name, headers, kind, words", BAD, ids=[b[0] for b in BAD])
def test_the_data_plane_the_agent_and_the_sink_refuse_bad_headers_alike(name, headers, kind, words) -> None:
    problem = header_problem(headers)
    assert problem is not None and (problem.kind, problem.text) == (kind, words)
    with pytest.raises(ConfigurationError) as core:
        check_headers(headers)
    assert core.value.message == f"a message has {words}"
    with pytest.raises(BadRowError) as agent:
        _agent(headers)
    assert agent.value.message == f"publish: row 1 has {words}"
    with pytest.raises(SinkHeaderError) as sink:
        _sink(headers)
    assert not isinstance(sink.value, SinkOriginClaimError)
    assert sink.value.message == (f"row 11 of partition 3 has {words}; nothing from row 10 of the partition on was "
                                  "published")


@pytest.mark.parametrize("name, headers, kind, words", BAD_SIGNED, ids=[b[0] for b in BAD_SIGNED])
def test_the_agent_and_the_sink_refuse_headers_they_cannot_sign_alike(name, headers, kind, words) -> None:
    for sign in ("sign", "signOrigin"):
        problem = header_problem(headers, sign=sign)
        assert problem is not None and (problem.kind, problem.text) == (kind, words.format(sign=sign))
    assert header_problem(headers) is None and check_headers(headers) == headers  # unsigned, they are fine
    _agent(headers)
    _sink(headers)

    class Signer:
        def headers(self, group, mid, payload, head):
            return {**(head or {}), "zc-origin": "1:proof"}

    with pytest.raises(BadRowError) as agent:
        _signed(Signer(), "g", [b"x", b"y"], ["a", "b"], [_GOOD, headers])
    assert agent.value.message == f"publish: row 1 (message_id 'b') has {words.format(sign='sign')}"
    with pytest.raises(SinkOriginClaimError if kind == "reserved" else SinkHeaderError) as sink:
        _sink(headers, sign=True)
    assert sink.value.message == (f"row 11 of partition 3 has {words.format(sign='signOrigin')}; nothing from row 10 "
                                  "of the partition on was published")


@pytest.mark.parametrize("name, headers, signable", GOOD, ids=[g[0] for g in GOOD])
def test_the_data_plane_the_agent_and_the_sink_take_good_headers_alike(name, headers, signable) -> None:
    assert header_problem(headers) is None
    assert check_headers(headers) == (headers or None)
    _agent(headers)
    _sink(headers)
    if signable:
        assert header_problem(headers, sign="sign") is None
        _sink(headers, sign=True)
        _signed(type("S", (), {"headers": lambda self, g, m, p, h: h})(), "g", [b"x"], ["a"], [headers])


def test_a_key_repeated_in_an_arrow_map_is_refused_by_the_agent_and_the_sink_alike() -> None:
    """An Arrow map may repeat a key (Spark's own maps refuse that by default); keeping its last value
    would drop the others without a word: the agent refuses the row, and so does the sink where it looks
    at the row, in the core's words (repeated_key)."""
    words = "the header 'k' 2 times"
    for repeated in ([("k", None), ("k", "v")], [("k", "v"), ("k", None)]):
        table = pa.table({"payload": pa.array([b"x"]), "headers": pa.array([repeated], _HEADERS)})
        with pytest.raises(BadRowError, match=f"publish: row 0 has {words}"):
            _publish_rows(table)
        with pytest.raises(SinkHeaderError, match=f"row 0 of partition 0 has {words}"):
            writer._check_headers(pa.chunked_array([pa.array([repeated], _HEADERS)]), 0, 0, False)
    problem = repeated_key([("a", "1"), ("k", "x"), ("k", "y"), ("k", "z")])
    assert problem is not None and problem.kind == "repeated-key" and "the header 'k' 3 times" in problem.text
    assert repeated_key([("a", "1"), ("k", "x")]) is None and repeated_key(None) is None


def test_non_string_headers_are_refused_everywhere() -> None:
    """Only the data plane can be handed a non-string header (Python); Arrow's map<string,string> cannot
    hold one, and the agent and the sink refuse any other map type before looking at a row."""
    for headers, words in (({"k": 1}, "a value of type int for header 'k'"),
                           ({1: "v"}, "a header key of type int (1)"),
                           (["k", "v"], "headers that are a list, not a mapping")):
        problem = header_problem(headers)
        assert problem is not None and problem.kind in ("not-a-string", "not-a-map") and words in problem.text
        with pytest.raises(ConfigurationError, match="headers map non-empty strings to strings"):
            check_headers(headers)  # type: ignore[arg-type]
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        pa.array([[("k", 1)]], _HEADERS)
    with pytest.raises(BadRequestError, match="'headers' must be map<string, string>"):
        _publish_rows(pa.table({"payload": pa.array([b"x"]), "headers": pa.array([[("k", 1)]],
                                                                                  pa.map_(pa.string(), pa.int64()))}))
    with pytest.raises(SinkSchemaError, match="headers column is map<string,int>"):
        sink_columns(StructType([StructField("payload", BinaryType()),
                                 StructField("headers", MapType(StringType(), IntegerType()))]))


def test_a_header_holding_a_lone_surrogate_is_a_problem_of_its_own() -> None:
    problem = header_problem({"k": "v\ud800"})
    assert problem is not None and problem.kind == "not-text" and "lone surrogate" in problem.text
