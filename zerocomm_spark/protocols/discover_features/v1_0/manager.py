"""RFC 0031 discover features: answering queries with the protocols this agent implements."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from zerocomm_spark.errors import ProtocolError
from zerocomm_spark.protocols.discover_features.v1_0.messages import MAX_QUERY_LENGTH, Disclose, Query
from zerocomm_spark.protocols.message import SUPPORTED_PROTOCOLS, ProtocolDescriptor, Thread, normalize_type

__all__ = ["DiscoverFeaturesManager", "match_protocols"]


def match_protocols(query: str, protocols: Iterable[ProtocolDescriptor] = SUPPORTED_PROTOCOLS
                    ) -> list[ProtocolDescriptor]:
    """The protocols whose URI matches ``query``; ``*`` matches any run of characters (RFC 0031).

    Matching is case-sensitive, as URIs are, and only ``*`` is special: ``?`` and ``[`` are escaped,
    since RFC 0031 defines no other wildcard. A query with the legacy ``did:sov:...;spec/`` prefix
    matches as if it had the ``https://didcomm.org/`` one (RFC 0348: accept both, answer with the new).
    """
    if not isinstance(query, str) or not query or len(query) > MAX_QUERY_LENGTH:
        raise ProtocolError(f"field 'query' must be 1-{MAX_QUERY_LENGTH} characters")
    pattern = "".join("[" + c + "]" if c in "?[]" else c for c in normalize_type(query))
    return [p for p in protocols if fnmatchcase(p.pid, pattern)]


class DiscoverFeaturesManager:
    """Builds queries and the disclose answering them."""

    def __init__(self, protocols: Iterable[ProtocolDescriptor] = SUPPORTED_PROTOCOLS) -> None:
        self._protocols = tuple(protocols)

    @property
    def protocols(self) -> tuple[ProtocolDescriptor, ...]:
        return self._protocols

    def create_query(self, query: str = "*", comment: str | None = None) -> Query:
        match_protocols(query, ())  # validate before it goes on the wire
        return Query(query=query, comment=comment)

    def disclose(self, query: Query) -> Disclose:
        # The query's thread (RFC 0008): its @id unless it continues a thread of its own.
        return Disclose(protocols=match_protocols(query.query, self._protocols), thread=Thread(thid=query.thid))
