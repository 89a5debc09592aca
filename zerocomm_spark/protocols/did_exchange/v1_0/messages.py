"""RFC 0023 DID exchange 1.0 messages: request, response, complete and problem_report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zerocomm_spark.errors import ProtocolError
from zerocomm_spark.protocols.message import (
    DIDCOMM_PREFIX,
    AgentMessage,
    Attachment,
    opt_str,
    register,
    req_str,
)

__all__ = ["PROTOCOL", "DIDXComplete", "DIDXProblemReport", "DIDXRequest", "DIDXResponse", "ProblemCode"]

PROTOCOL = DIDCOMM_PREFIX + "didexchange/1.0"
MAX_DID_LENGTH = 8192  # did:peer:2 with services is long, but not this long


class ProblemCode:
    """The problem codes RFC 0023 defines."""

    REQUEST_NOT_ACCEPTED = "request_not_accepted"
    REQUEST_PROCESSING_ERROR = "request_processing_error"
    RESPONSE_NOT_ACCEPTED = "response_not_accepted"
    RESPONSE_PROCESSING_ERROR = "response_processing_error"
    COMPLETE_REJECTED = "complete_rejected"


def _require_thread(message: AgentMessage, *, pthid: bool) -> None:
    if message.thread is None or not message.thread.thid:
        raise ProtocolError("field '~thread.thid' is missing")
    if pthid and not message.thread.pthid:
        raise ProtocolError("field '~thread.pthid' is missing")


def _did_and_doc(data: Mapping[str, Any]) -> dict[str, Any]:
    attach = data.get("did_doc~attach")
    return {
        "did": req_str(data, "did", max_length=MAX_DID_LENGTH),
        "did_doc_attach": Attachment.from_dict(attach, "did_doc~attach") if attach is not None else None,
    }


def _with_doc(out: dict[str, Any], attach: Attachment | None) -> dict[str, Any]:
    if attach is not None:
        out["did_doc~attach"] = attach.to_dict()
    return out


@register
@dataclass(kw_only=True)
class DIDXRequest(AgentMessage):
    """Sent by the invitee to the invitation key; its @id becomes the thread id of the exchange."""

    message_type: ClassVar[str] = PROTOCOL + "/request"

    label: str
    did: str
    did_doc_attach: Attachment | None = None
    goal_code: str | None = None
    goal: str | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label}
        for name in ("goal_code", "goal"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out["did"] = self.did
        return _with_doc(out, self.did_doc_attach)

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "label": req_str(data, "label", max_length=256, allow_empty=True),
            "goal_code": opt_str(data, "goal_code", max_length=256),
            "goal": opt_str(data, "goal", max_length=1024),
            **_did_and_doc(data),
        }

    @classmethod
    def from_dict(cls, data: Any) -> "DIDXRequest":
        message = super().from_dict(data)
        # An exchange started from an invitation must say which one (pthid), RFC 0023.
        if message.pthid is None:
            raise ProtocolError("field '~thread.pthid' is missing (the invitation's @id)")
        return message


@register
@dataclass(kw_only=True)
class DIDXResponse(AgentMessage):
    """The inviter's new DID; its attached DID doc is signed with the invitation key."""

    message_type: ClassVar[str] = PROTOCOL + "/response"

    did: str
    did_doc_attach: Attachment | None = None

    def body(self) -> dict[str, Any]:
        return _with_doc({"did": self.did}, self.did_doc_attach)

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        return _did_and_doc(data)

    @classmethod
    def from_dict(cls, data: Any) -> "DIDXResponse":
        message = super().from_dict(data)
        _require_thread(message, pthid=False)
        return message


@register
@dataclass(kw_only=True)
class DIDXComplete(AgentMessage):
    """Tells the inviter its response arrived, so it may use the connection."""

    message_type: ClassVar[str] = PROTOCOL + "/complete"

    @classmethod
    def from_dict(cls, data: Any) -> "DIDXComplete":
        message = super().from_dict(data)
        _require_thread(message, pthid=True)
        return message


@register
@dataclass(kw_only=True)
class DIDXProblemReport(AgentMessage):
    """Ends the exchange: the peer refused or could not process our last message."""

    message_type: ClassVar[str] = PROTOCOL + "/problem_report"

    code: str
    explanation: str = ""
    problem_items: list[dict[str, Any]] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        # RFC 0035's form (ACA-Py, Credo read it) and RFC 0023's own (its example's 'problem-code' and
        # 'explain'), so an agent written to either text understands why the exchange ended.
        out: dict[str, Any] = {"description": {"code": self.code, "en": self.explanation},
                               "problem-code": self.code, "explain": self.explanation}
        if self.problem_items:
            out["problem_items"] = self.problem_items
        return out

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        description = data.get("description")
        if description is None and "problem-code" in data:
            # RFC 0023's problem report: top-level 'problem-code' and 'explain' instead of RFC 0035's
            # 'description' object. Refusing it left the requester waiting for its deadline.
            code = req_str(data, "problem-code", max_length=128)
            explanation = opt_str(data, "explain", max_length=1024) or ""
        elif isinstance(description, Mapping):
            code = req_str(description, "code", max_length=128)
            explanation = opt_str(description, "en", max_length=1024) or ""
        else:
            raise ProtocolError("field 'description' must be a JSON object with a 'code' "
                                "(or RFC 0023's 'problem-code' given instead)")
        items = data.get("problem_items") or []
        if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
            raise ProtocolError("field 'problem_items' must be a list of JSON objects")
        return {"code": code, "explanation": explanation, "problem_items": [dict(i) for i in items]}

    @classmethod
    def from_dict(cls, data: Any) -> "DIDXProblemReport":
        message = super().from_dict(data)
        _require_thread(message, pthid=False)
        return message
