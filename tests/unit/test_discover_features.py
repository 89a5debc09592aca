"""RFC 0031 discover features 1.0: wildcard matching over protocol URIs, query and disclose."""

from __future__ import annotations

import pytest

from zerocomm_spark.errors import ProtocolError
from zerocomm_spark.protocols.discover_features.v1_0.manager import DiscoverFeaturesManager, match_protocols
from zerocomm_spark.protocols.discover_features.v1_0.messages import Disclose, Query
from zerocomm_spark.protocols.message import SUPPORTED_PROTOCOLS, ProtocolDescriptor, Thread, parse_message

ALL = {p.pid for p in SUPPORTED_PROTOCOLS}


def _pids(query: str) -> set[str]:
    return {p.pid for p in match_protocols(query)}


def test_we_disclose_the_protocols_we_implement() -> None:
    assert ALL == {
        "https://didcomm.org/out-of-band/1.1",
        "https://didcomm.org/didexchange/1.0",
        "https://didcomm.org/discover-features/1.0",
        "https://didcomm.org/basicmessage/1.0",
        "https://didcomm.org/trust_ping/1.0",
    }
    roles = {p.pid: p.roles for p in SUPPORTED_PROTOCOLS}
    assert roles["https://didcomm.org/didexchange/1.0"] == ("requester", "responder")


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("*", ALL),
        ("https://didcomm.org/*", ALL),
        ("https://didcomm.org/didexchange/*", {"https://didcomm.org/didexchange/1.0"}),
        ("https://didcomm.org/didexchange/1.0", {"https://didcomm.org/didexchange/1.0"}),
        ("*basicmessage*", {"https://didcomm.org/basicmessage/1.0"}),
        ("*/1.0", ALL - {"https://didcomm.org/out-of-band/1.1"}),
        ("https://didcomm.org/*/1.1", {"https://didcomm.org/out-of-band/1.1"}),
        ("https://didcomm.org/didexchange/2.*", set()),
        ("https://didcomm.org/didexchange", set()),  # no wildcard: exact match only
        ("HTTPS://DIDCOMM.ORG/*", set()),  # case-sensitive, as URIs are
        ("https://didcomm.org/trust_ping/1.?", set()),  # only * is a wildcard
        ("https://didcomm.org/[bd]*", set()),  # brackets are literal too
        ("did:sov:*", set()),
    ],
)
def test_wildcard_matching(query: str, expected: set[str]) -> None:
    assert _pids(query) == expected


@pytest.mark.parametrize("query", ["", "*" * 257])
def test_bad_queries(query: str) -> None:
    with pytest.raises(ProtocolError, match="'query'"):
        match_protocols(query)


def test_query_and_disclose_round_trip() -> None:
    manager = DiscoverFeaturesManager()
    query = manager.create_query("https://didcomm.org/did*", comment="what do you speak?")
    back = parse_message(query.to_dict())
    assert isinstance(back, Query) and back == query
    disclose = manager.disclose(back)
    assert disclose.thid == query.id  # answers on the query's thread
    assert [p.pid for p in disclose.protocols] == ["https://didcomm.org/didexchange/1.0"]
    data = disclose.to_dict()
    assert data["protocols"] == [{"pid": "https://didcomm.org/didexchange/1.0", "roles": ["requester", "responder"]}]
    assert parse_message(data) == disclose


def test_custom_protocol_list() -> None:
    manager = DiscoverFeaturesManager([ProtocolDescriptor("https://example.org/x/1.0", ("a",))])
    assert manager.disclose(Query(query="*")).protocols == [ProtocolDescriptor("https://example.org/x/1.0", ("a",))]
    assert manager.disclose(Query(query="https://didcomm.org/*")).protocols == []


def test_invalid_messages_name_the_field() -> None:
    with pytest.raises(ProtocolError, match="'query'"):
        parse_message({"@type": "https://didcomm.org/discover-features/1.0/query", "@id": "1"})
    with pytest.raises(ProtocolError, match="'query'"):
        parse_message({"@type": "https://didcomm.org/discover-features/1.0/query", "@id": "1", "query": 3})
    with pytest.raises(ProtocolError, match="'~thread.thid'"):
        parse_message(Disclose().to_dict())
    base = Disclose(thread=Thread(thid="q")).to_dict()
    with pytest.raises(ProtocolError, match="'protocols'"):
        parse_message({**base, "protocols": "all"})
    with pytest.raises(ProtocolError, match=r"'protocols\[0\]'"):
        parse_message({**base, "protocols": ["x"]})
    with pytest.raises(ProtocolError, match=r"'protocols\[0\].roles'"):
        parse_message({**base, "protocols": [{"pid": "p", "roles": "r"}]})
    with pytest.raises(ProtocolError, match="'pid'"):
        parse_message({**base, "protocols": [{"roles": []}]})


# --- found in review F ----------------------------------------------------------------------------

LEGACY = "did:sov:BzCbsNYhMrjHiqZDTUASHg;spec/"


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (LEGACY + "*", ALL),
        (LEGACY + "trust_ping/1.0", {"https://didcomm.org/trust_ping/1.0"}),
        (LEGACY + "didexchange/*", {"https://didcomm.org/didexchange/1.0"}),
    ],
)
def test_a_query_with_the_legacy_prefix_matches_like_the_new_one(query: str, expected: set[str]) -> None:
    """RFC 0348: agents still sending did:sov:...;spec/ types are answered, with the new prefix. A
    legacy query matched nothing: such a peer concluded we speak none of the protocols it asked for."""
    assert _pids(query) == expected
    disclose = DiscoverFeaturesManager().disclose(parse_message(Query(query=query).to_dict()))  # type: ignore[arg-type]
    assert {p.pid for p in disclose.protocols} == expected


def test_a_disclose_with_legacy_pids_reads_as_the_new_prefix() -> None:
    data = Disclose(thread=Thread(thid="q")).to_dict()
    data["protocols"] = [{"pid": LEGACY + "trust_ping/1.0", "roles": ["receiver"]}]
    disclose = parse_message(data)
    assert isinstance(disclose, Disclose)
    assert disclose.protocols == [ProtocolDescriptor("https://didcomm.org/trust_ping/1.0", ("receiver",))]


def test_the_disclose_answers_on_the_querys_thread() -> None:
    """RFC 0008: a reply carries the thread id of what it answers, the query's @id only when the query
    opened the thread (as ACA-Py's assign_thread_from does)."""
    query = Query(query="*", thread=Thread(thid="a-thread-of-theirs"))
    assert DiscoverFeaturesManager().disclose(query).thid == "a-thread-of-theirs"
    fresh = Query(query="*")
    assert DiscoverFeaturesManager().disclose(fresh).thid == fresh.id
