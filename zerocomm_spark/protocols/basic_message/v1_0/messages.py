"""RFC 0095 basic message 1.0: human-readable text between connected agents."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zerocomm_spark.protocols.message import DIDCOMM_PREFIX, AgentMessage, register, req_str, utc_now

__all__ = ["PROTOCOL", "BasicMessage"]

PROTOCOL = DIDCOMM_PREFIX + "basicmessage/1.0"


@register
@dataclass(kw_only=True)
class BasicMessage(AgentMessage):
    """One text message; ``sent_time`` is the sender's clock, as RFC 0095 requires."""

    message_type: ClassVar[str] = PROTOCOL + "/message"

    content: str
    sent_time: str = field(default_factory=utc_now)
    locale: str | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sent_time": self.sent_time, "content": self.content}
        if self.locale is not None:
            out["~l10n"] = {"locale": self.locale}
        return out

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        l10n = data.get("~l10n")
        locale = l10n.get("locale") if isinstance(l10n, Mapping) else None
        return {
            "content": req_str(data, "content", allow_empty=True),
            "sent_time": req_str(data, "sent_time", max_length=64),
            "locale": locale if isinstance(locale, str) else None,
        }
