"""did:peer:2 and did:key: DIDs that carry their own DID document, so no ledger or resolver is needed.

A member creates one did:peer:2 per relationship (Peer DID Method Specification, numalgo 2): the
Ed25519 verkey as the authentication key (``.V``), its X25519 twin as the key-agreement key (``.E``)
and the DIDComm v1 service with its ZeroMQ endpoint (``.S``), plus, for group admins, the group-join
service. Anyone holding the DID can rebuild the document from the string alone; Aries agents (ACA-Py,
Credo) resolve the same DIDs the same way, which is what makes DID Exchange between them work.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from zerocomm_spark.errors import DIDError
from zerocomm_spark.keys.keypair import b58decode, b58encode, verkey_bytes, verkey_to_x25519

__all__ = [
    "ACCEPT_DIDCOMM_V1",
    "DIDDocument",
    "GROUP_JOIN_SERVICE_TYPE",
    "create_peer_did",
    "did_key",
    "encode_peer_did_2",
    "peer_did_3",
    "resolve",
    "verkey_from_did_key",
]

ED25519_CODEC = b"\xed\x01"  # multicodec ed25519-pub, varint encoded
X25519_CODEC = b"\xec\x01"  # multicodec x25519-pub, varint encoded
DIDCOMM_V1_SERVICE_TYPE = "did-communication"
DIDCOMM_V2_SERVICE_TYPE = "DIDCommMessaging"
GROUP_JOIN_SERVICE_TYPE = "ZeroCommGroupJoin"
ACCEPT_DIDCOMM_V1 = ("didcomm/aip1", "didcomm/aip2;env=rfc19")

DID_CONTEXT = "https://www.w3.org/ns/did/v1"
MULTIKEY_CONTEXT = "https://w3id.org/security/multikey/v1"
ED25519_2018_CONTEXT = "https://w3id.org/security/suites/ed25519-2018/v1"
X25519_2019_CONTEXT = "https://w3id.org/security/suites/x25519-2019/v1"

# Peer DID spec, numalgo 2: purpose codes and the common-string abbreviations of services.
_PURPOSES = {
    "V": "authentication",
    "E": "keyAgreement",
    "A": "assertionMethod",
    "I": "capabilityInvocation",
    "D": "capabilityDelegation",
}
_ABBREVIATIONS = {"type": "t", "serviceEndpoint": "s", "routingKeys": "r", "accept": "a"}
_EXPANSIONS = {v: k for k, v in _ABBREVIATIONS.items()}
_TYPE_ABBREVIATIONS = {DIDCOMM_V2_SERVICE_TYPE: "dm"}
_TYPE_EXPANSIONS = {v: k for k, v in _TYPE_ABBREVIATIONS.items()}

# \Z, not $: '$' also matches before a final newline, which the decoders then drop (an alias DID).
_B58 = re.compile(r"^[1-9A-HJ-NP-Za-km-z]+\Z")
_B64URL = re.compile(r"^[A-Za-z0-9_-]+\Z")
_DID = re.compile(r"^did:([a-z0-9]+):(\S+)\Z")
_ED25519_TYPES = {"Ed25519VerificationKey2018", "Ed25519VerificationKey2020", "Multikey"}
_X25519_TYPES = {"X25519KeyAgreementKey2019", "X25519KeyAgreementKey2020", "Multikey"}
_DIDCOMM_V1_TYPES = {DIDCOMM_V1_SERVICE_TYPE, "IndyAgent"}
# Documents are a few levels deep; a bound keeps hostile nesting from exhausting the recursion limit.
_MAX_DEPTH = 32


def _too_deep(value: Any, limit: int = _MAX_DEPTH) -> bool:
    """Whether JSON ``value`` nests lists and objects more than ``limit`` levels (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _type_of(entry: Mapping[str, Any]) -> str | None:
    """An entry's ``type`` if it is a string; anything else (a list, an object) names no type we know."""
    kind = entry.get("type")
    return kind if isinstance(kind, str) else None


# --- multibase keys ------------------------------------------------------------------------------


def _multikey(codec: bytes, raw: bytes) -> str:
    return "z" + b58encode(codec + raw)


def _decode_multikey(value: str, where: str) -> tuple[bytes, bytes]:
    """(codec, raw 32 bytes) of a multibase base58btc multicodec key, or DIDError."""
    if not isinstance(value, str) or not value.startswith("z") or not _B58.match(value[1:]):
        shown = value[:60] if isinstance(value, str) else type(value).__name__  # a hostile value may be huge
        raise DIDError(f"{where}: {shown!r} is not a multibase base58btc ('z...') key")
    data = b58decode(value[1:])
    codec, raw = data[:2], data[2:]
    if codec not in (ED25519_CODEC, X25519_CODEC):
        raise DIDError(f"{where}: unsupported key type (multicodec 0x{data[:2].hex()}); "
                       "only Ed25519 and X25519 keys are supported")
    if len(raw) != 32:
        raise DIDError(f"{where}: a key must be 32 bytes, got {len(raw)}")
    return codec, raw


def did_key(verkey: str) -> str:
    """The did:key of a base58 Ed25519 verkey, as RFC 0360 out-of-band messages name keys."""
    return "did:key:" + _multikey(ED25519_CODEC, verkey_bytes(verkey))


def verkey_from_did_key(did: str) -> str:
    """The base58 Ed25519 verkey of a did:key (a ``#fragment`` repeating the key is accepted)."""
    if not isinstance(did, str) or not did.startswith("did:key:"):
        raise DIDError(f"{did!r} is not a did:key")
    ident, _, fragment = did[len("did:key:"):].partition("#")
    if fragment and fragment != ident:
        raise DIDError(f"{did!r}: a did:key fragment must repeat the key")
    codec, raw = _decode_multikey(ident, "did:key")
    if codec != ED25519_CODEC:
        raise DIDError(f"{did!r} holds an X25519 key; DIDComm v1 needs an Ed25519 verkey")
    return b58encode(raw)


# --- did:peer:2 encoding -------------------------------------------------------------------------


def _abbreviate(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            short = _ABBREVIATIONS.get(key, key)
            if key == "type" and isinstance(item, str):
                item = _TYPE_ABBREVIATIONS.get(item, item)
            out[short] = _abbreviate(item)
        return out
    if isinstance(value, list):
        return [_abbreviate(item) for item in value]
    return value


def _expand(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            long = _EXPANSIONS.get(key, key)
            if long == "type" and isinstance(item, str):
                item = _TYPE_EXPANSIONS.get(item, item)
            out[long] = _expand(item)
        return out
    if isinstance(value, list):
        return [_expand(item) for item in value]
    return value


def _encode_service(service: Mapping[str, Any]) -> str:
    text = json.dumps(_abbreviate(dict(service)), separators=(",", ":"), ensure_ascii=False)
    return base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii").rstrip("=")


def _decode_service(encoded: str, index: int) -> dict[str, Any]:
    where = f"did:peer:2 service element {index}"
    if not _B64URL.match(encoded):
        raise DIDError(f"{where} is not unpadded base64url")
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        service = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise DIDError(f"{where} is nested too deeply") from None
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise DIDError(f"{where} does not decode to JSON") from None
    if not isinstance(service, dict):
        raise DIDError(f"{where} is not a JSON object")
    if _too_deep(service):
        raise DIDError(f"{where} is nested too deeply (more than {_MAX_DEPTH} levels)")
    return _expand(service)


def encode_peer_did_2(keys: Sequence[tuple[str, str]], services: Iterable[Mapping[str, Any]] = ()) -> str:
    """A did:peer:2 from (purpose code, multibase key) pairs and full-form services, in order.

    The general form of :func:`create_peer_did`, for DIDs with other keys or services.
    """
    elements = []
    for purpose, multikey in keys:
        if purpose not in _PURPOSES:
            raise DIDError(f"unknown did:peer:2 purpose code {purpose!r}; use one of {''.join(_PURPOSES)}")
        _decode_multikey(multikey, f"the .{purpose} key")
        elements.append(f".{purpose}{multikey}")
    for service in services:
        elements.append(".S" + _encode_service(service))
    if not elements:
        raise DIDError("a did:peer:2 needs at least one key")
    return "did:peer:2" + "".join(elements)


def _check_endpoint(endpoint: object, what: str) -> str:
    if not isinstance(endpoint, str) or "://" not in endpoint or any(c.isspace() for c in endpoint):
        raise DIDError(f"the {what} {endpoint!r} is not an endpoint like tcp://host:port")
    if "*" in endpoint:
        raise DIDError(f"the {what} {endpoint!r} is a bind address; give the endpoint peers connect to "
                       "(the transport's .endpoint after start())")
    return endpoint


def create_peer_did(verkey: str, endpoint: str, *, group_endpoint: str | None = None) -> str:
    """The did:peer:2 a member hands to one peer: its verkey, the X25519 twin and its endpoints.

    The DIDComm service is the v1 ``did-communication`` form (the spec forbids ``dm`` for v1), with
    ``recipientKeys`` pointing at ``#key-1``, the ``.V`` key, as ACA-Py and Credo expect.
    """
    raw = verkey_bytes(verkey)
    x25519 = bytes(verkey_to_x25519(verkey))
    services: list[dict[str, Any]] = [
        {
            "id": "#didcomm-0",
            "type": DIDCOMM_V1_SERVICE_TYPE,
            "priority": 0,
            "recipientKeys": ["#key-1"],
            "routingKeys": [],
            "serviceEndpoint": _check_endpoint(endpoint, "endpoint"),
            "accept": list(ACCEPT_DIDCOMM_V1),
        }
    ]
    if group_endpoint is not None:
        services.append(
            {
                "id": "#group-join",
                "type": GROUP_JOIN_SERVICE_TYPE,
                "recipientKeys": ["#key-1"],
                "serviceEndpoint": _check_endpoint(group_endpoint, "group endpoint"),
            }
        )
    return encode_peer_did_2(
        [("V", _multikey(ED25519_CODEC, raw)), ("E", _multikey(X25519_CODEC, x25519))], services
    )


def peer_did_3(did: str) -> str:
    """The short did:peer:3 of a did:peer:2 (SHA-256 multihash of everything after the numalgo)."""
    if not isinstance(did, str) or not did.startswith("did:peer:2."):
        raise DIDError(f"{did!r} is not a did:peer:2")
    digest = hashlib.sha256(did[len("did:peer:2"):].encode("utf-8")).digest()
    return "did:peer:3z" + b58encode(b"\x12\x20" + digest)


# --- resolution ----------------------------------------------------------------------------------


def _check_did(did: object) -> tuple[str, str]:
    if not isinstance(did, str):
        raise DIDError(f"a DID must be a string, not {type(did).__name__}")
    if "#" in did or "?" in did:
        raise DIDError(f"{did[:60]!r} is a DID URL; resolve the DID without its ?query or #fragment")
    match = _DID.match(did)
    if match is None:
        raise DIDError(f"{did[:60]!r} is not a DID (expected did:<method>:<identifier>)")
    return match.group(1), match.group(2)


def _resolve_peer_2(did: str) -> dict[str, Any]:
    body = did[len("did:peer:2"):]
    if not body.startswith("."):
        raise DIDError(f"{did[:60]!r}: a did:peer:2 continues with '.<purpose><key>' elements")
    methods: list[dict[str, Any]] = []
    relationships: dict[str, list[str]] = {}
    services: list[dict[str, Any]] = []
    for index, element in enumerate(body[1:].split(".")):
        if len(element) < 2:
            raise DIDError(f"{did[:60]!r}: element {index} is empty")
        purpose, value = element[0], element[1:]
        if purpose == "S":
            services.append(_decode_service(value, index))
            continue
        if purpose not in _PURPOSES:
            raise DIDError(f"{did[:60]!r}: unknown purpose code {purpose!r} in element {index}")
        _decode_multikey(value, f"did:peer:2 element {index}")
        key_id = f"#key-{len(methods) + 1}"
        methods.append({"id": key_id, "type": "Multikey", "controller": did, "publicKeyMultibase": value})
        relationships.setdefault(_PURPOSES[purpose], []).append(key_id)
    if not methods:
        raise DIDError(f"{did[:60]!r}: a did:peer:2 holds at least one key")
    doc: dict[str, Any] = {
        "@context": [DID_CONTEXT, MULTIKEY_CONTEXT],
        "id": did,
        "verificationMethod": methods,
        **relationships,
    }
    unnamed = 0
    for service in services:
        if "id" not in service:
            service["id"] = "#service" if unnamed == 0 else f"#service-{unnamed}"
            unnamed += 1
    if services:
        doc["service"] = services
    doc["alsoKnownAs"] = [peer_did_3(did)]
    return doc


def _resolve_key(did: str) -> dict[str, Any]:
    verkey = verkey_from_did_key(did)
    ident = did[len("did:key:"):]
    x_key = _multikey(X25519_CODEC, bytes(verkey_to_x25519(verkey)))
    vm_id, x_id = f"{did}#{ident}", f"{did}#{x_key}"
    return {
        "@context": [DID_CONTEXT, ED25519_2018_CONTEXT, X25519_2019_CONTEXT],
        "id": did,
        "verificationMethod": [
            {"id": vm_id, "type": "Ed25519VerificationKey2018", "controller": did, "publicKeyBase58": verkey},
            {"id": x_id, "type": "X25519KeyAgreementKey2019", "controller": did,
             "publicKeyBase58": b58encode(bytes(verkey_to_x25519(verkey)))},
        ],
        "authentication": [vm_id],
        "assertionMethod": [vm_id],
        "capabilityInvocation": [vm_id],
        "capabilityDelegation": [vm_id],
        "keyAgreement": [x_id],
    }


def resolve(did: str) -> "DIDDocument":
    """The DID document of a did:peer:2 or did:key, rebuilt from the DID string alone."""
    method, ident = _check_did(did)
    if method == "key":
        return DIDDocument.from_dict(_resolve_key(did))
    if method == "peer":
        if ident.startswith("2"):
            return DIDDocument.from_dict(_resolve_peer_2(did))
        raise DIDError(f"did:peer numalgo {ident[:1]!r} is not supported; only did:peer:2 DIDs resolve "
                       "without an exchanged document")
    raise DIDError(f"the DID method {method!r} is not supported; use did:peer:2 or did:key")


# --- documents -----------------------------------------------------------------------------------


def _local_ref(ref: str, did: str) -> str:
    return ref[len(did):] if ref.startswith(did + "#") else ref


def _method_key(method: Mapping[str, Any], where: str) -> tuple[str, bytes]:
    """("ed25519" | "x25519", raw bytes) of a verification method."""
    kind = _type_of(method)
    if "publicKeyMultibase" in method:
        value = method["publicKeyMultibase"]
        if isinstance(value, str) and value.startswith("z") and len(b58decode(value[1:])) == 32:
            raw = b58decode(value[1:])  # pre-multicodec Ed25519VerificationKey2020 documents
            if kind in _ED25519_TYPES - {"Multikey"}:
                return "ed25519", raw
            if kind in _X25519_TYPES - {"Multikey"}:
                return "x25519", raw
        codec, raw = _decode_multikey(value, where)
        return ("ed25519" if codec == ED25519_CODEC else "x25519"), raw
    if "publicKeyBase58" in method:
        raw = b58decode(method["publicKeyBase58"]) if isinstance(method["publicKeyBase58"], str) else b""
        if len(raw) != 32:
            raise DIDError(f"{where}: publicKeyBase58 must decode to 32 bytes")
        if kind in ("Ed25519VerificationKey2018", "Ed25519VerificationKey2020"):
            return "ed25519", raw
        if kind in ("X25519KeyAgreementKey2019", "X25519KeyAgreementKey2020"):
            return "x25519", raw
        raise DIDError(f"{where}: unsupported verification method type {kind!r}")
    raise DIDError(f"{where}: needs publicKeyBase58 or publicKeyMultibase")


@dataclass(frozen=True)
class DIDDocument:
    """What a member needs from a peer's DID document: who (verkey) and where (endpoints).

    ``verkey`` is the base58 Ed25519 key DIDComm v1 envelopes are packed for: the first recipient
    key of the DIDComm service, else the first authentication key.
    """

    id: str
    verkey: str
    service_endpoint: str | None = None
    group_endpoint: str | None = None
    services: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    recipient_keys: tuple[str, ...] = ()
    routing_keys: tuple[str, ...] = ()
    key_agreement: str | None = None
    _document: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """The W3C DID document (a copy), e.g. for a DID Exchange ``did_doc~attach``."""
        if self._document:
            return copy.deepcopy(self._document)
        return self._build_document()

    def _build_document(self) -> dict[str, Any]:
        key_1 = {"id": "#key-1", "type": "Ed25519VerificationKey2018", "controller": self.id,
                 "publicKeyBase58": self.verkey}
        doc: dict[str, Any] = {
            "@context": [DID_CONTEXT, ED25519_2018_CONTEXT, X25519_2019_CONTEXT],
            "id": self.id,
            "verificationMethod": [key_1],
            "authentication": ["#key-1"],
        }
        if self.key_agreement:
            doc["verificationMethod"].append({"id": "#key-2", "type": "X25519KeyAgreementKey2019",
                                              "controller": self.id, "publicKeyBase58": self.key_agreement})
            doc["keyAgreement"] = ["#key-2"]
        if self.services:
            doc["service"] = copy.deepcopy(list(self.services))
        return doc

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> "DIDDocument":
        """Read a DID document another agent sent (DID Exchange attachment) or that we resolved.

        Accepts ``verificationMethod`` (or the legacy ``publicKey``) entries with publicKeyBase58 or
        publicKeyMultibase, embedded or referenced relationships, and ``did-communication``,
        ``IndyAgent``, ``DIDCommMessaging`` and ``ZeroCommGroupJoin`` services.
        """
        if not isinstance(document, Mapping):
            raise DIDError("a DID document must be a JSON object")
        if _too_deep(document):
            raise DIDError(f"the DID document is nested too deeply (more than {_MAX_DEPTH} levels)")
        doc = copy.deepcopy(dict(document))
        did = doc.get("id")
        if not isinstance(did, str) or not did.startswith("did:"):
            raise DIDError("the DID document has no 'id' DID")

        methods: dict[str, dict[str, Any]] = {}
        ordered: list[dict[str, Any]] = []

        def add_method(method: object, where: str) -> None:
            if not isinstance(method, dict) or not isinstance(method.get("id"), str):
                raise DIDError(f"{where}: a verification method is an object with an 'id'")
            ref = _local_ref(method["id"], did)
            if ref not in methods:
                methods[ref] = method
                ordered.append(method)

        for section in ("verificationMethod", "publicKey"):
            entries = doc.get(section, [])
            if not isinstance(entries, list):
                raise DIDError(f"the DID document's {section} is not a list")
            for i, method in enumerate(entries):
                add_method(method, f"{section}[{i}]")

        def relationship(name: str) -> list[dict[str, Any]]:
            found = []
            entries = doc.get(name, [])
            if not isinstance(entries, list):
                raise DIDError(f"the DID document's {name} is not a list")
            for i, entry in enumerate(entries):
                if isinstance(entry, dict) and "publicKey" in entry and "type" in entry \
                        and isinstance(entry["publicKey"], str):
                    entry = entry["publicKey"]  # legacy {"type": ...Authentication2018, "publicKey": ref}
                if isinstance(entry, str):
                    method = methods.get(_local_ref(entry, did))
                    if method is None:
                        raise DIDError(f"{name}[{i}] refers to {entry!r}, which the document does not define")
                    found.append(method)
                else:
                    add_method(entry, f"{name}[{i}]")
                    found.append(entry)
            return found

        authentication = relationship("authentication")
        agreement = relationship("keyAgreement")

        def key_of(ref: str, where: str) -> str:
            """A recipient key given as a reference, a did:key or a raw base58 verkey."""
            if not isinstance(ref, str):
                raise DIDError(f"{where}: a recipient key must be a string")
            if ref.startswith("did:key:"):
                return verkey_from_did_key(ref)
            local = _local_ref(ref, did)
            if local in methods:
                kind, raw = _method_key(methods[local], where)
                if kind != "ed25519":
                    raise DIDError(f"{where}: recipient key {ref!r} is not an Ed25519 key")
                return b58encode(raw)
            if ref.startswith("#") or ref.startswith("did:"):
                raise DIDError(f"{where}: recipient key {ref!r} is not defined in the document")
            verkey_bytes(ref)
            return ref

        services = doc.get("service", [])
        if not isinstance(services, list) or not all(isinstance(s, dict) for s in services):
            raise DIDError("the DID document's service is not a list of objects")
        service_endpoint: str | None = None
        group_endpoint: str | None = None
        recipient_keys: tuple[str, ...] = ()
        routing_keys: tuple[str, ...] = ()

        def endpoint_of(service: dict[str, Any], where: str) -> tuple[str, list[Any]]:
            endpoint, routing = service.get("serviceEndpoint"), service.get("routingKeys", [])
            if isinstance(endpoint, list) and endpoint:
                endpoint = endpoint[0]  # DIDCommMessaging may list several; take the preferred one
            if isinstance(endpoint, dict):
                routing = endpoint.get("routingKeys", routing)
                endpoint = endpoint.get("uri")
            if not isinstance(endpoint, str) or not endpoint:
                raise DIDError(f"{where}: serviceEndpoint is not a URI")
            if not isinstance(routing, list):
                raise DIDError(f"{where}: routingKeys is not a list")
            return endpoint, routing

        def priority(service: dict[str, Any]) -> int:
            value = service.get("priority", 0)
            return value if isinstance(value, int) else 0

        v1 = sorted((s for s in services if _type_of(s) in _DIDCOMM_V1_TYPES), key=priority)
        v2 = [s for s in services if _type_of(s) == DIDCOMM_V2_SERVICE_TYPE]
        for service in (v1 or v2)[:1]:
            where = f"service {service.get('id', '')!r}"
            service_endpoint, routing = endpoint_of(service, where)
            keys = service.get("recipientKeys", [])
            if not isinstance(keys, list):
                raise DIDError(f"{where}: recipientKeys is not a list")
            recipient_keys = tuple(key_of(k, where) for k in keys)
            routing_keys = tuple(str(k) for k in routing)
        for service in services:
            if service.get("type") == GROUP_JOIN_SERVICE_TYPE:
                group_endpoint, _ = endpoint_of(service, f"service {service.get('id', '')!r}")
                break

        verkey = recipient_keys[0] if recipient_keys else None
        if verkey is None:
            for method in authentication + ordered:
                kind, raw = _method_key(method, f"verification method {method.get('id')!r}")
                if kind == "ed25519":
                    verkey = b58encode(raw)
                    break
        if verkey is None:
            raise DIDError(f"the DID document of {did[:60]!r} holds no Ed25519 key; DIDComm v1 needs one")
        x25519: str | None = None
        for method in agreement:
            kind, raw = _method_key(method, f"keyAgreement {method.get('id')!r}")
            if kind == "x25519":
                x25519 = b58encode(raw)
                break
        return cls(
            id=did,
            verkey=verkey,
            service_endpoint=service_endpoint,
            group_endpoint=group_endpoint,
            services=tuple(copy.deepcopy(services)),
            recipient_keys=recipient_keys,
            routing_keys=routing_keys,
            key_agreement=x25519,
            _document=doc,
        )
