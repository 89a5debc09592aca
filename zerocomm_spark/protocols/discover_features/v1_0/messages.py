"""RFC 0031 discover features 1.0 messages: query and disclose."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zerocomm_spark.errors import ProtocolError
from zerocomm_spark.protocols.message import (
    DIDCOMM_PREFIX,
    AgentMessage,
    ProtocolDescriptor,
    normalize_type,
    opt_str,
    register,
    req_str,
)

__all__ = ["PROTOCOL", "Disclose", "Query", "MAX_QUERY_LENGTH"]

PROTOCOL = DIDCOMM_PREFIX + "discover-features/1.0"
# fnmatch compiles the pattern to a regex; a bound keeps a hostile query cheap.
MAX_QUERY_LENGTH = 256
MAX_PROTOCOLS = 1000


@register
@dataclass(kw_only=True)
class Query(AgentMessage):
    """Asks which protocols the peer speaks; ``query`` is a protocol URI with ``*`` wildcards."""

    message_type: ClassVar[str] = PROTOCOL + "/query"

    query: str = "*"
    comment: str | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"query": self.query}
        if self.comment is not None:
            out["comment"] = self.comment
        return out

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "query": req_str(data, "query", max_length=MAX_QUERY_LENGTH),
            "comment": opt_str(data, "comment", max_length=1024),
        }


@register
@dataclass(kw_only=True)
class Disclose(AgentMessage):
    """The answer to a query: the matching protocols and the roles we play in each."""

    message_type: ClassVar[str] = PROTOCOL + "/disclose"

    protocols: list[ProtocolDescriptor] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {"protocols": [p.to_dict() for p in self.protocols]}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        raw = data.get("protocols")
        if not isinstance(raw, list):
            raise ProtocolError("field 'protocols' must be a list")
        if len(raw) > MAX_PROTOCOLS:
            raise ProtocolError(f"field 'protocols' lists more than {MAX_PROTOCOLS} protocols")
        protocols = []
        for i, item in enumerate(raw):
            if not isinstance(item, Mapping):
                raise ProtocolError(f"field 'protocols[{i}]' must be a JSON object")
            pid = normalize_type(req_str(item, "pid", max_length=512))  # older agents disclose legacy pids
            roles = item.get("roles") or []
            if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
                raise ProtocolError(f"field 'protocols[{i}].roles' must be a list of strings")
            protocols.append(ProtocolDescriptor(pid, tuple(roles)))
        return {"protocols": protocols}

    @classmethod
    def from_dict(cls, data: Any) -> "Disclose":
        message = super().from_dict(data)
        if message.thread is None or not message.thread.thid:
            raise ProtocolError("field '~thread.thid' is missing (the query's @id)")
        return message
