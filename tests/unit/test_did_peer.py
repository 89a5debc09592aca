"""did:peer:2 and did:key: spec vectors, round trips through real keys, and malformed input."""

from __future__ import annotations

import base64
import dataclasses
import json

import base58
import pytest

from zerocomm_spark.did import (
    ACCEPT_DIDCOMM_V1,
    DIDDocument,
    create_peer_did,
    did_key,
    encode_peer_did_2,
    peer_did_3,
    resolve,
    verkey_from_did_key,
)
from zerocomm_spark.errors import DIDError
from zerocomm_spark.keys import KeyPair, b58encode

# Peer DID Method Specification, numalgo 2 ("Generating" / "Resolving a did:peer:2" examples).
SPEC_V = "z6Mkj3PUd1WjvaDhNZhhhXQdz5UnZXmS7ehtx8bsPpD47kKc"
SPEC_E = "z6LSg8zQom395jKLrGiBNruB9MM6V8PWuf2FpEy4uRFiqQBR"
SPEC_S1 = (
    "eyJ0IjoiZG0iLCJzIjp7InVyaSI6Imh0dHA6Ly9leGFtcGxlLmNvbS9kaWRjb21tIiwiYSI6WyJkaWRjb21tL3YyIl0sInIi"
    "OlsiZGlkOmV4YW1wbGU6MTIzNDU2Nzg5YWJjZGVmZ2hpI2tleS0xIl19fQ"
)
SPEC_S2 = (
    "eyJ0IjoiZG0iLCJzIjp7InVyaSI6Imh0dHA6Ly9leGFtcGxlLmNvbS9hbm90aGVyIiwiYSI6WyJkaWRjb21tL3YyIl0sInIi"
    "OlsiZGlkOmV4YW1wbGU6MTIzNDU2Nzg5YWJjZGVmZ2hpI2tleS0yIl19fQ"
)
SPEC_DID = f"did:peer:2.V{SPEC_V}.E{SPEC_E}.S{SPEC_S1}.S{SPEC_S2}"
SPEC_DID_3 = "did:peer:3zQmd6RdU6e2nDrLn1rjwdA5Buzq7wJwsv3WJ1AgrwKYJoLE"

# The spec's numalgo 3 example: E first, two V keys, an old-style flat "dm" service.
SPEC_M3_DID_2 = (
    "did:peer:2.Ez6LSbysY2xFMRpGMhb7tFTLMpeuPRaqaWM1yECx2AtzE3KCc"
    ".Vz6MkqRYqQiSgvZQdnBytw86Qbs2ZWUkGv22od935YF4s8M7V"
    ".Vz6MkgoLTnTypo3tDRwCkZXSccTPHRLhF4ZnjhueYAFpEX6vg"
    ".SeyJ0IjoiZG0iLCJzIjoiaHR0cHM6Ly9leGFtcGxlLmNvbS9lbmRwb2ludCIsInIiOlsiZGlkOmV4YW1wbGU6c29tZW1lZGlh"
    "dG9yI3NvbWVrZXkiXSwiYSI6WyJkaWRjb21tL3YyIiwiZGlkY29tbS9haXAyO2Vudj1yZmM1ODciXX0"
)
SPEC_M3_DID_3 = "did:peer:3zQmS19jtYDvGtKVrJhQnRFpBQAx3pJ9omx2HpNrcXFuRCz9"

# did:key specification: an Ed25519 key and the X25519 key agreement key derived from it.
DIDKEY_SPEC = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
DIDKEY_SPEC_X25519 = "z6LSj72tK8brWgZja8NLRwPigth2T9QRiG1uH9oKZuKjdh9p"

ENDPOINT = "tcp://127.0.0.1:5555"


def spec_service(uri: str, routing_key: str) -> dict:
    return {"type": "DIDCommMessaging",
            "serviceEndpoint": {"uri": uri, "accept": ["didcomm/v2"], "routingKeys": [routing_key]}}


def b64url_json(value: object) -> str:
    raw = json.dumps(value, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def raw_verkey(multikey: str) -> str:
    return b58encode(base58.b58decode(multikey[1:])[2:])


# --- spec vectors ------------------------------------------------------------------------------


def test_encoding_reproduces_the_spec_example() -> None:
    services = [spec_service("http://example.com/didcomm", "did:example:123456789abcdefghi#key-1"),
                spec_service("http://example.com/another", "did:example:123456789abcdefghi#key-2")]
    assert encode_peer_did_2([("V", SPEC_V), ("E", SPEC_E)], services) == SPEC_DID


def test_resolution_matches_the_spec_example_document() -> None:
    doc = resolve(SPEC_DID).to_dict()
    assert doc["@context"] == ["https://www.w3.org/ns/did/v1", "https://w3id.org/security/multikey/v1"]
    assert doc["id"] == SPEC_DID
    assert doc["verificationMethod"] == [
        {"id": "#key-1", "type": "Multikey", "controller": SPEC_DID, "publicKeyMultibase": SPEC_V},
        {"id": "#key-2", "type": "Multikey", "controller": SPEC_DID, "publicKeyMultibase": SPEC_E},
    ]
    assert doc["authentication"] == ["#key-1"]
    assert doc["keyAgreement"] == ["#key-2"]
    assert doc["service"] == [
        {**spec_service("http://example.com/didcomm", "did:example:123456789abcdefghi#key-1"), "id": "#service"},
        {**spec_service("http://example.com/another", "did:example:123456789abcdefghi#key-2"),
         "id": "#service-1"},
    ]
    assert doc["alsoKnownAs"] == [SPEC_DID_3]


def test_spec_example_summary_fields() -> None:
    document = resolve(SPEC_DID)
    assert document.verkey == raw_verkey(SPEC_V)
    assert document.key_agreement == raw_verkey(SPEC_E)
    assert document.service_endpoint == "http://example.com/didcomm"
    assert document.routing_keys == ("did:example:123456789abcdefghi#key-1",)
    assert document.group_endpoint is None


def test_numalgo_3_example_and_multiple_keys() -> None:
    assert peer_did_3(SPEC_M3_DID_2) == SPEC_M3_DID_3
    document = resolve(SPEC_M3_DID_2)
    doc = document.to_dict()
    assert [m["publicKeyMultibase"] for m in doc["verificationMethod"]] == [
        "z6LSbysY2xFMRpGMhb7tFTLMpeuPRaqaWM1yECx2AtzE3KCc",
        "z6MkqRYqQiSgvZQdnBytw86Qbs2ZWUkGv22od935YF4s8M7V",
        "z6MkgoLTnTypo3tDRwCkZXSccTPHRLhF4ZnjhueYAFpEX6vg",
    ]
    assert doc["keyAgreement"] == ["#key-1"]
    assert doc["authentication"] == ["#key-2", "#key-3"]
    assert doc["service"] == [{
        "type": "DIDCommMessaging", "serviceEndpoint": "https://example.com/endpoint",
        "routingKeys": ["did:example:somemediator#somekey"],
        "accept": ["didcomm/v2", "didcomm/aip2;env=rfc587"], "id": "#service"}]
    assert document.verkey == raw_verkey("z6MkqRYqQiSgvZQdnBytw86Qbs2ZWUkGv22od935YF4s8M7V")
    assert document.service_endpoint == "https://example.com/endpoint"


def test_key_agreement_derivation_matches_the_did_key_spec() -> None:
    verkey = verkey_from_did_key(DIDKEY_SPEC)
    assert did_key(verkey) == DIDKEY_SPEC
    did = create_peer_did(verkey, ENDPOINT)
    assert did.startswith(f"did:peer:2.V{DIDKEY_SPEC[len('did:key:'):]}.E{DIDKEY_SPEC_X25519}.S")
    doc = resolve(DIDKEY_SPEC)
    assert doc.key_agreement == raw_verkey(DIDKEY_SPEC_X25519)
    assert doc.to_dict()["keyAgreement"] == [f"{DIDKEY_SPEC}#{DIDKEY_SPEC_X25519}"]


# --- our DIDs ----------------------------------------------------------------------------------


def test_create_and_resolve_round_trip() -> None:
    pair = KeyPair.generate()
    did = create_peer_did(pair.verkey, ENDPOINT)
    document = resolve(did)
    assert document.id == did
    assert document.verkey == pair.verkey
    assert document.recipient_keys == (pair.verkey,)
    assert document.key_agreement == b58encode(bytes(pair.x25519_public()))
    assert document.service_endpoint == ENDPOINT
    assert document.group_endpoint is None
    assert document.routing_keys == ()
    doc = document.to_dict()
    assert doc["verificationMethod"][0]["publicKeyMultibase"] == "z" + b58encode(b"\xed\x01" + pair.verkey_bytes)
    assert doc["service"] == [{
        "id": "#didcomm-0", "type": "did-communication", "priority": 0, "recipientKeys": ["#key-1"],
        "routingKeys": [], "serviceEndpoint": ENDPOINT, "accept": list(ACCEPT_DIDCOMM_V1)}]
    assert DIDDocument.from_dict(doc) == document
    assert resolve(did) == document  # deterministic
    assert create_peer_did(KeyPair.generate().verkey, ENDPOINT) != did


def test_service_element_is_the_abbreviated_json() -> None:
    pair = KeyPair.generate()
    elements = create_peer_did(pair.verkey, ENDPOINT).split(".")
    assert [e[0] for e in elements[1:]] == ["V", "E", "S"]
    encoded = elements[3][1:]
    assert "=" not in encoded
    raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    assert raw == ('{"id":"#didcomm-0","t":"did-communication","priority":0,"recipientKeys":["#key-1"],'
                   '"r":[],"s":"tcp://127.0.0.1:5555","a":["didcomm/aip1","didcomm/aip2;env=rfc19"]}')


def test_group_join_service() -> None:
    pair = KeyPair.generate()
    did = create_peer_did(pair.verkey, ENDPOINT, group_endpoint="tcp://10.0.0.7:6000")
    document = resolve(did)
    assert document.group_endpoint == "tcp://10.0.0.7:6000"
    assert document.service_endpoint == ENDPOINT
    assert [s["type"] for s in document.services] == ["did-communication", "ZeroCommGroupJoin"]
    assert document.verkey == pair.verkey


def test_did_key_round_trip() -> None:
    pair = KeyPair.generate()
    did = did_key(pair.verkey)
    assert did.startswith("did:key:z6Mk")
    assert verkey_from_did_key(did) == pair.verkey
    assert verkey_from_did_key(f"{did}#{did[8:]}") == pair.verkey
    document = resolve(did)
    assert document.verkey == pair.verkey
    assert document.service_endpoint is None
    vm = document.to_dict()["verificationMethod"][0]
    assert (vm["type"], vm["publicKeyBase58"]) == ("Ed25519VerificationKey2018", pair.verkey)


def test_document_is_frozen_and_detached() -> None:
    document = resolve(create_peer_did(KeyPair.generate().verkey, ENDPOINT))
    with pytest.raises(dataclasses.FrozenInstanceError):
        document.verkey = "x"  # type: ignore[misc]
    document.to_dict()["service"][0]["serviceEndpoint"] = "tcp://evil:1"
    document.services[0]["serviceEndpoint"] = "tcp://evil:2"
    assert document.to_dict()["service"][0]["serviceEndpoint"] == ENDPOINT


# --- documents from other agents ---------------------------------------------------------------


def test_from_dict_reads_a_legacy_aries_document() -> None:
    pair = KeyPair.generate()
    did = "did:sov:WgWxqztrNooG92RXvxSTWv"
    document = DIDDocument.from_dict({
        "@context": "https://w3id.org/did/v1",
        "id": did,
        "publicKey": [{"id": f"{did}#1", "type": "Ed25519VerificationKey2018", "controller": did,
                       "publicKeyBase58": pair.verkey}],
        "authentication": [{"type": "Ed25519SignatureAuthentication2018", "publicKey": f"{did}#1"}],
        "service": [{"id": f"{did};indy", "type": "IndyAgent", "priority": 0,
                     "recipientKeys": [pair.verkey], "routingKeys": [], "serviceEndpoint": "http://x:8020"}],
    })
    assert (document.verkey, document.service_endpoint) == (pair.verkey, "http://x:8020")


def test_from_dict_reads_multibase_and_didcomm_messaging() -> None:
    pair, mediator = KeyPair.generate(), KeyPair.generate()
    did = "did:example:alice"
    multikey = "z" + b58encode(b"\xed\x01" + pair.verkey_bytes)
    document = DIDDocument.from_dict({
        "id": did,
        "verificationMethod": [{"id": "#k", "type": "Ed25519VerificationKey2020", "controller": did,
                                "publicKeyMultibase": multikey}],
        "service": [{"id": "#dm", "type": "DIDCommMessaging", "recipientKeys": [did_key(pair.verkey)],
                     "serviceEndpoint": {"uri": "tcp://1.2.3.4:9", "routingKeys": [did_key(mediator.verkey)]}}],
    })
    assert document.verkey == pair.verkey
    assert document.service_endpoint == "tcp://1.2.3.4:9"
    assert document.routing_keys == (did_key(mediator.verkey),)
    # Without recipientKeys the verification method's key is used.
    bare = DIDDocument.from_dict({"id": did, "verificationMethod": [
        {"id": f"{did}#k", "type": "Multikey", "publicKeyMultibase": multikey}], "authentication": [f"{did}#k"]})
    assert bare.verkey == pair.verkey


@pytest.mark.parametrize(("document", "message"), [
    ({}, "no 'id'"),
    ({"id": "did:example:1"}, "no Ed25519 key"),
    ({"id": "did:example:1", "authentication": ["#nope"]}, "does not define"),
    ({"id": "did:example:1", "verificationMethod": [{"id": "#k", "type": "X25519KeyAgreementKey2019",
                                                      "publicKeyBase58": "1" * 32}],
      "service": [{"type": "did-communication", "serviceEndpoint": "tcp://a:1", "recipientKeys": ["#k"]}]},
     "not an Ed25519 key"),
    ({"id": "did:example:1", "verificationMethod": [{"id": "#k", "type": "Ed25519VerificationKey2018",
                                                      "publicKeyBase58": "abc"}]}, "32 bytes"),
    ({"id": "did:example:1", "verificationMethod": "nope"}, "not a list"),
    ({"id": "did:example:1", "service": [{"type": "did-communication", "serviceEndpoint": 5}]},
     "serviceEndpoint"),
])
def test_from_dict_rejects_broken_documents(document: dict, message: str) -> None:
    with pytest.raises(DIDError, match=message):
        DIDDocument.from_dict(document)


# --- malformed DIDs ----------------------------------------------------------------------------

GOOD_V = "V" + SPEC_V


@pytest.mark.parametrize(("did", "message"), [
    ("", "not a DID"),
    ("not-a-did", "not a DID"),
    ("did:web:example.com", "method 'web' is not supported"),
    ("did:peer:0z6MkqRYqQiSgvZQdnBytw86Qbs2ZWUkGv22od935YF4s8M7V", "numalgo '0'"),
    (SPEC_M3_DID_3, "numalgo '3'"),
    ("did:peer:2", "continues with"),
    ("did:peer:2.", "empty"),
    (f"did:peer:2.{GOOD_V}..E{SPEC_E}", "empty"),
    (f"did:peer:2X{SPEC_V}", "continues with"),
    (f"did:peer:2.X{SPEC_V}", "unknown purpose code 'X'"),
    ("did:peer:2.V6Mkj3PUd1WjvaDhNZhhhXQdz5UnZXmS7ehtx8bsPpD47kKc", "multibase"),
    ("did:peer:2.Vz0OIl0OIl", "multibase"),
    ("did:peer:2.Vz" + b58encode(b"\xed\x01" + b"\x01" * 31), "32 bytes"),
    ("did:peer:2.Vz" + b58encode(b"\xe7\x01" + b"\x02" * 33), "unsupported key type"),
    (f"did:peer:2.{GOOD_V}.S!!notbase64", "base64url"),
    (f"did:peer:2.{GOOD_V}.S" + base64.urlsafe_b64encode(b"{not json").decode().rstrip("="), "JSON"),
    (f"did:peer:2.{GOOD_V}.S" + b64url_json(["a", "list"]), "not a JSON object"),
    ("did:peer:2.S" + b64url_json({"t": "dm", "s": "tcp://a:1"}), "at least one key"),
    (f"did:peer:2.E{SPEC_E}", "no Ed25519 key"),
    (f"{SPEC_DID}#key-1", "DID URL"),
    ("did:peer:2 .Vz6Mk", "not a DID"),
    ("did:key:z6LSj72tK8brWgZja8NLRwPigth2T9QRiG1uH9oKZuKjdh9p", "X25519"),
    ("did:key:notmultibase", "multibase"),
])
def test_malformed_dids_are_refused(did: str, message: str) -> None:
    with pytest.raises(DIDError, match=message):
        resolve(did)


def test_a_did_with_a_trailing_newline_is_refused() -> None:
    """'$' also matches before a final newline, and base58 decoding strips it: an alias of the same key."""
    pair = KeyPair.generate()
    did = create_peer_did(pair.verkey, ENDPOINT)
    key_only = "did:peer:2.Vz" + b58encode(b"\xed\x01" + pair.verkey_bytes)
    for alias in (did + "\n", key_only + "\n"):
        with pytest.raises(DIDError):
            resolve(alias)
    with pytest.raises(DIDError):
        verkey_from_did_key(did_key(pair.verkey) + "\n")


@pytest.mark.parametrize("service", [
    {"t": ["did-communication"], "s": ENDPOINT, "recipientKeys": ["#key-1"]},
    {"t": {"a": 1}, "s": ENDPOINT},
])
def test_hostile_service_elements_are_did_errors(service: dict) -> None:
    """A peer's DID is parsed on its say-so (DID exchange, invitations): no TypeError or RecursionError."""
    did = f"did:peer:2.{GOOD_V}.S" + b64url_json(service)
    try:
        doc = resolve(did)
    except DIDError:
        return
    assert doc.service_endpoint is None  # a type that is not a string names no DIDComm service


def test_deeply_nested_service_element_is_a_did_error() -> None:
    """Nesting deep enough to exhaust the recursion limit fits well within a DID's length limit."""
    for depth in (900, 3000):
        did = f"did:peer:2.{GOOD_V}.S" + base64.urlsafe_b64encode(
            b'{"t":"dm","s":' + b"[" * depth + b"]" * depth + b"}").decode().rstrip("=")
        with pytest.raises(DIDError, match="nested"):
            resolve(did)


@pytest.mark.parametrize("document", [
    {"id": "did:example:1", "service": [{"type": ["did-communication"], "serviceEndpoint": ENDPOINT}],
     "verificationMethod": [{"id": "#k", "type": "Ed25519VerificationKey2018", "publicKeyBase58": "1" * 44}]},
    {"id": "did:example:1", "verificationMethod": [{"id": "#k", "type": ["Ed25519VerificationKey2020"],
                                                     "publicKeyMultibase": "z" + b58encode(b"\x01" * 32)}],
     "authentication": ["#k"]},
    {"id": "did:example:1", "authentication": [nested(2000)]},
    {"id": "did:example:1", "x": nested(990)},
])
def test_hostile_documents_raise_did_error_only(document: dict) -> None:
    try:
        DIDDocument.from_dict(document)
    except DIDError:
        pass


@pytest.mark.parametrize("value", [None, 42, b"did:peer:2"])
def test_non_string_dids_are_refused(value: object) -> None:
    with pytest.raises(DIDError, match="must be a string"):
        resolve(value)  # type: ignore[arg-type]


def test_create_refuses_bad_input() -> None:
    verkey = KeyPair.generate().verkey
    with pytest.raises(DIDError, match="bind address"):
        create_peer_did(verkey, "tcp://127.0.0.1:*")
    with pytest.raises(DIDError, match="bind address"):
        create_peer_did(verkey, ENDPOINT, group_endpoint="tcp://*:6000")
    with pytest.raises(DIDError, match="not an endpoint"):
        create_peer_did(verkey, "localhost 5555")
    with pytest.raises(DIDError):
        create_peer_did("not-base58-0OIl", ENDPOINT)
    with pytest.raises(DIDError, match="32 bytes"):
        create_peer_did(b58encode(b"\x01" * 16), ENDPOINT)
    with pytest.raises(DIDError, match="purpose code"):
        encode_peer_did_2([("Q", SPEC_V)])
    with pytest.raises(DIDError):
        verkey_from_did_key(f"{DIDKEY_SPEC}#z6MkOther")
    with pytest.raises(DIDError):
        verkey_from_did_key("did:peer:2.x")
