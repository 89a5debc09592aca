"""RFC 0434 out-of-band 1.1 messages: the invitation and its URL form."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlencode, urlsplit

from zerocomm_spark.errors import InvitationError, ProtocolError
from zerocomm_spark.protocols.message import (
    DIDCOMM_PREFIX,
    AgentMessage,
    b64url_decode,
    b64url_encode,
    normalize_type,
    opt_str,
    register,
    req_str,
    req_str_list,
)

__all__ = ["DIDEXCHANGE_1_0", "INVITATION", "Invitation", "Service", "DEFAULT_URL_BASE", "MAX_URL_LENGTH"]

PROTOCOL = DIDCOMM_PREFIX + "out-of-band/1.1"
INVITATION = PROTOCOL + "/invitation"
DIDEXCHANGE_1_0 = DIDCOMM_PREFIX + "didexchange/1.0"
DEFAULT_URL_BASE = "https://zerocomm.invalid/"
# An invitation is a few hundred bytes; anything far bigger is garbage or an attack on the parser.
MAX_URL_LENGTH = 64 * 1024


@dataclass
class Service:
    """An inline DIDComm service block: where to send the request and which key encrypts it."""

    recipient_keys: list[str]
    service_endpoint: str
    routing_keys: list[str] = field(default_factory=list)
    id: str = "#inline"
    type: str = "did-communication"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "recipientKeys": list(self.recipient_keys),
            "routingKeys": list(self.routing_keys),
            "serviceEndpoint": self.service_endpoint,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], index: int) -> "Service":
        name = f"services[{index}]"
        error = InvitationError
        keys = req_str_list(data, "recipientKeys", error=error)
        for i, key in enumerate(keys):
            if not key.startswith("did:key:"):
                raise InvitationError(f"field '{name}.recipientKeys[{i}]' must be a did:key")
        routing = req_str_list(data, "routingKeys", error=error, allow_empty=True) if "routingKeys" in data else []
        endpoint = req_str(data, "serviceEndpoint", error=error, max_length=2048)
        return cls(
            recipient_keys=keys,
            service_endpoint=endpoint,
            routing_keys=routing,
            id=opt_str(data, "id", error=error, max_length=256) or "#inline",
            type=opt_str(data, "type", error=error, max_length=128) or "did-communication",
        )


@register
@dataclass(kw_only=True)
class Invitation(AgentMessage):
    """An out-of-band invitation; ``services`` holds inline blocks or resolvable DIDs."""

    message_type: ClassVar[str] = INVITATION
    validation_error: ClassVar[type[ProtocolError]] = InvitationError

    services: list[Service | str]
    label: str | None = None
    goal_code: str | None = None
    goal: str | None = None
    accept: list[str] = field(default_factory=lambda: ["didcomm/aip1", "didcomm/aip2;env=rfc19"])
    handshake_protocols: list[str] = field(default_factory=lambda: [DIDEXCHANGE_1_0])

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("label", "goal_code", "goal"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.accept:  # none given means no preference (RFC 0434): an empty list would say "nothing"
            out["accept"] = list(self.accept)
        out["handshake_protocols"] = list(self.handshake_protocols)
        out["services"] = [s.to_dict() if isinstance(s, Service) else s for s in self.services]
        return out

    @classmethod
    def parse_body(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        error = InvitationError
        if "requests~attach" in data and "handshake_protocols" not in data:
            raise InvitationError("field 'handshake_protocols' is missing; invitations with only "
                                  "'requests~attach' are not supported")
        handshakes = [normalize_type(h) for h in req_str_list(data, "handshake_protocols", error=error)]
        raw_services = data.get("services")
        if not isinstance(raw_services, list) or not raw_services:
            raise InvitationError("field 'services' must be a non-empty list")
        services: list[Service | str] = []
        for i, item in enumerate(raw_services):
            if isinstance(item, str):
                if not item.startswith("did:"):
                    raise InvitationError(f"field 'services[{i}]' must be a DID or a service block")
                services.append(item)
            elif isinstance(item, Mapping):
                services.append(Service.from_dict(item, i))
            else:
                raise InvitationError(f"field 'services[{i}]' must be a DID or a service block")
        accept = req_str_list(data, "accept", error=error, allow_empty=True) if "accept" in data else []
        return {
            "services": services,
            "label": opt_str(data, "label", error=error, max_length=256),
            "goal_code": opt_str(data, "goal_code", error=error, max_length=256),
            "goal": opt_str(data, "goal", error=error, max_length=1024),
            "accept": accept,
            "handshake_protocols": handshakes,
        }

    def to_url(self, base: str = DEFAULT_URL_BASE) -> str:
        """The RFC 0434 URL form: ``base?oob=<base64url of the JSON>``; paste it anywhere."""
        separator = "&" if "?" in base else "?"
        return base + separator + urlencode({"oob": b64url_encode(self.to_json().encode("utf-8"))})

    @classmethod
    def from_url(cls, url: str) -> "Invitation":
        """Parse an invitation URL (or the bare ``oob`` value), raising InvitationError on any defect."""
        if not isinstance(url, str):
            raise InvitationError(f"an invitation URL must be a string, got {type(url).__name__}")
        url = url.strip()
        if len(url) > MAX_URL_LENGTH:
            raise InvitationError(f"the invitation URL is longer than {MAX_URL_LENGTH} characters")
        if not url:
            raise InvitationError("the invitation URL is empty")
        try:
            # A '+' stays a '+': an oob value in standard base64 has them, and a space is never valid there.
            query = parse_qs(urlsplit(url).query.replace("+", "%2B")) if "?" in url else {}
        except ValueError:  # urlsplit refuses e.g. an unclosed '[' (an IPv6 host)
            raise InvitationError("the invitation URL is malformed (check that it was copied whole)") from None
        if "oob" in query:
            encoded = query["oob"][0]
        elif "c_i" in query or "d_m" in query:
            raise InvitationError("this is an RFC 0160 connection invitation; only RFC 0434 'oob' URLs are supported")
        elif "?" in url or "://" in url:
            raise InvitationError("the URL has no 'oob' query parameter")
        else:
            encoded = url
        try:
            data = json.loads(b64url_decode(encoded).decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            if encoded is url:  # no URL around it: it was taken for a bare oob value, which it is not either
                raise InvitationError("this is not an invitation URL (https://...?oob=...) nor the base64url "
                                      "'oob' value of one (truncated, or something else pasted?)") from None
            raise InvitationError("the 'oob' parameter is not base64url-encoded JSON (truncated URL?)") from None
        return cls.from_dict(data)
