"""RFC 0048 trust ping 1.0: proves a connection works end to end, through both agents' crypto."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from zerocomm_spark.errors import ProtocolError
from zerocomm_spark.protocols.message import DIDCOMM_PREFIX, AgentMessage, opt_str, register

__all__ = ["PROTOCOL", "Ping", "PingResponse"]

PROTOCOL = DIDCOMM_PREFIX + "trust_ping/1.0"


@register
@dataclass(kw_only=True)
class Ping(AgentMessage):
    message_type: ClassVar[str] = PROTOCOL + "/ping"

    response_requested: bool = True
    comment: str | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"response_requested": self.response_requested}
        if self.comment is not None:
            out["comment"] = self.comment
        return out

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        requested = data.get("response_requested", True)
        if not isinstance(requested, bool):
            raise ProtocolError("field 'response_requested' must be true or false")
        return {"response_requested": requested, "comment": opt_str(data, "comment", max_length=1024)}


@register
@dataclass(kw_only=True)
class PingResponse(AgentMessage):
    message_type: ClassVar[str] = PROTOCOL + "/ping_response"

    comment: str | None = None

    def body(self) -> dict[str, Any]:
        return {} if self.comment is None else {"comment": self.comment}

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"comment": opt_str(data, "comment", max_length=1024)}

    @classmethod
    def from_dict(cls, data: Any) -> "PingResponse":
        message = super().from_dict(data)
        if message.thread is None or not message.thread.thid:
            raise ProtocolError("field '~thread.thid' is missing (the ping's @id)")
        return message
