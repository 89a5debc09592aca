"""The data-plane codec: batches and control messages round-trip exactly; anything malformed is
refused with an error naming the field, never echoing its value."""

from __future__ import annotations

import base64
import json

import nacl.signing
import pytest

from zerocomm_spark.errors import MalformedDataMessageError
from zerocomm_spark.group import datamessage as dm
from zerocomm_spark.keys.keypair import KeyPair


def _batch(n: int = 3, **extra: object) -> dm.DataBatch:
    msgs = tuple(
        dm.DataMessage(f"id-{i}", i, 100 + i, 1_700_000_000.25 + i, bytes([i % 256]) * i,
                       {"content-type": "text/plain", "note": "caf\u00e9"} if i % 2 else None)
        for i in range(1, n + 1)
    )
    return dm.DataBatch("g", "did:example:alice", msgs, **extra)  # type: ignore[arg-type]


def _json(batch: dm.DataBatch) -> dict:
    return json.loads(dm.encode(batch))


def test_batch_round_trip_is_exact() -> None:
    batch = _batch(5)
    raw = dm.encode(batch)
    assert raw.isascii()  # non-ASCII header text is escaped
    obj = json.loads(raw)
    assert obj["@type"] == "https://didcomm.org/zerocomm-group/1.0/data-batch"
    assert obj["group"] == "g" and obj["publisher"] == "did:example:alice"
    assert [m["seq"] for m in obj["messages"]] == [1, 2, 3, 4, 5]
    assert obj["messages"][2]["payload"] == base64.b64encode(b"\x03" * 3).decode()
    assert "headers" not in obj["messages"][1] and obj["messages"][0]["headers"]["note"] == "caf\u00e9"
    assert dm.decode(raw) == batch
    assert dm.decode_batch(raw.decode()) == batch


def test_resend_fields_round_trip() -> None:
    batch = _batch(2, base=7, last=99, gone=(3, 6))
    assert dm.decode(dm.encode(batch)) == batch
    empty = dm.DataBatch("g", "did:example:alice", (), base=0, last=5)
    assert dm.decode(dm.encode(empty)) == empty
    void = _batch(1, base=70_000, last=70_001, void=(5, 70_000), member="did:example:bob")
    assert dm.decode(dm.encode(void)) == void


def test_binary_payloads_of_every_byte_survive() -> None:
    payload = bytes(range(256)) * 4
    batch = dm.DataBatch("g", "p", (dm.DataMessage("x", 1, 1, 0.0, payload),))
    assert dm.decode(dm.encode(batch)).messages[0].payload == payload


def test_encoded_messages_are_reusable_across_envelopes() -> None:
    batch = _batch(4)
    array = dm.encode_messages(batch.messages)
    assert dm.decode(dm.encode(dm.DataBatch("g", "did:example:alice", ()), encoded_messages=array)) == batch


@pytest.mark.parametrize("msg", [
    dm.Hello("g", "did:a", "did:b", "n0nce", 10, 42),
    dm.Ack("g", "did:a", "did:b", 17),
    dm.Ack("g", "did:a", "did:b", 0, nonce="abc"),
    dm.ResendRequest("g", "did:a", "did:b", 5, 9),
    dm.ResendRequest("g", "did:a", "did:b", 1, None),
])
def test_control_messages_round_trip(msg: dm.ControlMessage) -> None:
    assert dm.decode(dm.encode(msg)) == msg


def test_message_repr_hides_the_payload() -> None:
    m = dm.DataMessage("id", 1, 1, 0.0, b"secret-payload")
    assert "secret" not in repr(m)


SECRET = "c2VjcmV0LXZhbHVl"


@pytest.mark.parametrize(("field", "value", "named"), [
    ("id", "", "'id'"),
    ("id", 5, "'id'"),
    ("id", "x" * 257, "'id'"),
    ("seq", 0, "'seq'"),
    ("seq", "1", "'seq'"),
    ("seq", True, "'seq'"),
    ("seq", 2**63, "'seq'"),
    ("lamport", -1, "'lamport'"),
    ("lamport", 1.5, "'lamport'"),
    ("sent_at", "now", "'sent_at'"),
    ("sent_at", -1.0, "'sent_at'"),
    pytest.param("sent_at", 10**400, "'sent_at'", id="sent_at-int-beyond-float"),  # was an OverflowError
    ("sent_at", 1e300, "'sent_at'"),  # finite, but no journal timestamp holds it (int64 microseconds)
    ("sent_at", float("nan"), "'sent_at'"),
    ("payload", 7, "'payload'"),
    ("payload", SECRET + "!", "'payload'"),
    ("headers", {"k": 1}, "'headers'"),
    ("headers", ["k"], "'headers'"),
])
def test_invalid_message_fields_are_named(field: str, value: object, named: str) -> None:
    obj = _json(_batch(3))
    obj["messages"][1][field] = value
    with pytest.raises(MalformedDataMessageError) as err:
        dm.decode(json.dumps(obj))
    text = str(err.value)
    assert named in text and "messages[1]" in text
    assert SECRET not in text  # values never appear in errors


def test_every_sent_at_a_batch_may_carry_fits_a_journal_timestamp() -> None:
    """What decode accepts is journaled as int64 microseconds: a larger value was acked, then either
    skipped by the journal or (past ~1.8e302 s) raised OverflowError in the ingest on every re-send."""
    from zerocomm_spark.agent.ingest import _micros

    obj = _json(_batch(1))
    obj["messages"][0]["sent_at"] = dm.MAX_SENT_AT
    assert _micros(dm.decode(json.dumps(obj)).messages[0].sent_at) <= 2**63 - 1
    obj["messages"][0]["sent_at"] = int(dm.MAX_SENT_AT) + 1
    with pytest.raises(MalformedDataMessageError, match="'sent_at'"):
        dm.decode(json.dumps(obj))


def test_missing_field_is_named() -> None:
    obj = _json(_batch(2))
    del obj["messages"][0]["lamport"]
    with pytest.raises(MalformedDataMessageError, match="lamport"):
        dm.decode(json.dumps(obj))


def test_seqs_must_ascend_strictly() -> None:
    obj = _json(_batch(3))
    obj["messages"][2]["seq"] = 2
    with pytest.raises(MalformedDataMessageError, match="ascending"):
        dm.decode(json.dumps(obj))


@pytest.mark.parametrize("mutate", [
    lambda o: o.update(group=""),
    lambda o: o.pop("publisher"),
    lambda o: o.update(messages={"not": "a list"}),
    lambda o: o.update(base=-1),
    lambda o: o.update(last="9"),
    lambda o: o.update(gone=[5, 3]),
    lambda o: o.update(gone=[0, 3]),
    lambda o: o.update(gone=[1]),
    lambda o: o.update(void=[9, 4]),
    lambda o: o.update(void=[0, 4]),
    lambda o: o.update({"@type": "https://didcomm.org/basicmessage/1.0/message"}),
])
def test_invalid_batches_are_refused(mutate) -> None:  # type: ignore[no-untyped-def]
    obj = _json(_batch(2))
    mutate(obj)
    with pytest.raises(MalformedDataMessageError):
        dm.decode(json.dumps(obj))


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'{"@type": 5}', b"\xff\xfe"])
def test_garbage_is_refused(raw: bytes) -> None:
    with pytest.raises(MalformedDataMessageError):
        dm.decode(raw)


def test_invalid_control_messages_are_refused() -> None:
    with pytest.raises(MalformedDataMessageError, match="'to'"):
        dm.decode(json.dumps({"@type": dm.RESEND, "group": "g", "publisher": "p", "member": "m", "from": 9, "to": 3}))
    with pytest.raises(MalformedDataMessageError, match="'seq'"):
        dm.decode(json.dumps({"@type": dm.ACK, "group": "g", "publisher": "p", "member": "m", "seq": -2}))
    with pytest.raises(MalformedDataMessageError, match="'nonce'"):
        dm.decode(json.dumps({"@type": dm.HELLO, "group": "g", "publisher": "p", "subscriber": "s", "base": 0, "last": 0}))


def test_decode_batch_refuses_other_types() -> None:
    with pytest.raises(MalformedDataMessageError, match="data-batch"):
        dm.decode_batch(dm.encode(dm.Ack("g", "a", "b", 1)))


# --- publisher signatures ------------------------------------------------------------------------

PUBLISHER = KeyPair.generate()
OTHER = KeyPair.generate()


def test_signed_batch_round_trips_and_verifies_only_against_its_signer() -> None:
    batch = _batch(4, base=3, last=9, gone=(1, 2), member="did:example:bob")
    raw = dm.encode(batch, signer=PUBLISHER)
    outer = json.loads(raw)
    assert outer["@type"] == dm.SIGNED and set(outer) == {"@type", "signature", "message"}
    got = dm.decode(raw)
    assert got == batch and got.member == "did:example:bob"
    # the signature covers the exact bytes of the batch as encoded, and nothing else
    assert got.signed == raw[raw.index(b'"message":') + 10:-1]
    nacl.signing.VerifyKey(PUBLISHER.verkey_bytes).verify(got.signed, got.signature)  # plain Ed25519
    assert dm.verify(got, PUBLISHER.verkey)
    assert not dm.verify(got, OTHER.verkey)
    assert not dm.verify(got, "not-a-verkey")
    assert dm.decode(raw.decode("ascii")) == batch  # text works too
    assert "signature" not in repr(got) and "signed" not in repr(got)


def test_unsigned_and_wrongly_signed_messages_do_not_verify() -> None:
    batch = _batch(2)
    assert not dm.verify(dm.decode(dm.encode(batch)), PUBLISHER.verkey)
    assert not dm.verify(dm.decode(dm.encode(batch, signer=OTHER)), PUBLISHER.verkey)
    hello = dm.Hello("g", "did:a", "did:b", "n0nce", 10, 42)
    signed_hello = dm.decode(dm.encode(hello, signer=PUBLISHER))
    assert signed_hello == hello and dm.verify(signed_hello, PUBLISHER.verkey)
    assert not dm.verify(dm.decode(dm.encode(hello)), PUBLISHER.verkey)
    assert not dm.verify(dm.decode(dm.encode(dm.Ack("g", "a", "b", 1))), PUBLISHER.verkey)


def test_a_signature_moved_onto_other_bytes_fails() -> None:
    raw = dm.encode(_batch(3), signer=PUBLISHER)
    cut = raw.index(b'"message":') + 10
    other = dm.encode(dm.DataBatch("g", "did:example:alice", (dm.DataMessage("id-1", 1, 101, 0.0, b"evil"),)))
    swapped = dm.decode(raw[:cut] + other + b"}")  # well-formed, so it decodes...
    assert not dm.verify(swapped, PUBLISHER.verkey)  # ...but does not verify
    flipped = bytearray(raw)
    flipped[raw.index(b'"lamport":102') + 12] = ord("9")  # one digit of the signed bytes
    assert not dm.verify(dm.decode(bytes(flipped)), PUBLISHER.verkey)


@pytest.mark.parametrize("mangle", [
    lambda raw: raw[:-1],  # no closing brace
    lambda raw: raw.replace(b'","message":', b'","msg":', 1),
    lambda raw: raw.replace(b'"signature":"', b'"signature":"AAAA', 1),  # wrong length
    lambda raw: raw[:80] + b"!" + raw[81:],  # not base64url inside the signature
    lambda raw: json.dumps(json.loads(raw), indent=1).encode(),  # another layout of the same JSON
    lambda raw: raw[:raw.index(b'"message":') + 10] + raw + b"}",  # a wrapper inside a wrapper
])
def test_malformed_signed_wrappers_are_refused(mangle) -> None:  # type: ignore[no-untyped-def]
    raw = dm.encode(_batch(2), signer=PUBLISHER)
    with pytest.raises(MalformedDataMessageError):
        dm.decode(mangle(raw))


def test_only_batches_and_hellos_are_signed_and_dicts_cannot_carry_signatures() -> None:
    ack = dm.encode(dm.Ack("g", "a", "b", 1))
    raw = dm.encode(_batch(1), signer=PUBLISHER)
    cut = raw.index(b'"message":') + 10
    with pytest.raises(MalformedDataMessageError, match="data-batch or a data-hello"):
        dm.decode(raw[:cut] + ack + b"}")
    with pytest.raises(MalformedDataMessageError, match="data-signed"):
        dm.decode(json.loads(raw))


def test_recipient_kids_of_a_deeply_nested_protected_header_is_none() -> None:
    """GROUP_DATA handlers read it from any peer's frame: json raises RecursionError, not ValueError."""
    from zerocomm_spark.group.dataplane import _recipient_kids

    protected = base64.urlsafe_b64encode(b"[" * 100_000).rstrip(b"=")
    assert _recipient_kids(b'{"protected":"' + protected + b'"}') is None
    assert _recipient_kids(json.dumps({"protected": protected.decode()}).encode().replace(b'{"', b'{ "', 1)) is None


@pytest.mark.parametrize("field", ["id", "header key", "header value"])
def test_an_id_or_header_holding_a_lone_surrogate_is_refused(field: str) -> None:
    """JSON spells "\\ud800"; no UTF-8 (so no journal row) holds it: the whole batch is refused."""
    item = {"id": "m-1", "seq": 1, "lamport": 1, "sent_at": 1.0, "payload": ""}
    if field == "id":
        item["id"] = "m-\ud800"
    else:
        item["headers"] = {"k\udc00": "v"} if field == "header key" else {"k": "v\ud800"}
    raw = json.dumps({"@type": dm.DATA_BATCH, "group": "g", "publisher": "p", "messages": [item]})
    with pytest.raises(MalformedDataMessageError, match="lone surrogate"):
        dm.decode(raw.encode("ascii"))
    ok = dict(item, id="m-\u00e9", headers={"k\u00e9": "v\u4e2d\u0000"})  # text (NUL included) is fine
    assert dm.decode(json.dumps({"@type": dm.DATA_BATCH, "group": "g", "publisher": "p", "messages": [ok]}))
