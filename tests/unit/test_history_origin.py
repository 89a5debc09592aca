"""Origin proofs and the history key: real Ed25519 and XChaCha20-Poly1305, no Spark."""

from __future__ import annotations

import os
import pickle

import pyarrow as pa
import pytest

from zerocomm_spark.did.peer import did_key
from zerocomm_spark.errors import ConfigurationError, TamperedEnvelopeError
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.pipelines.history_key import HistoryKey, open_history_key, seal_history_key
from zerocomm_spark.pipelines.origin import (
    ORIGIN_HEADER,
    OriginSigner,
    origin_digest,
    signature_from_header,
    verify_origin,
    verify_rows,
)


@pytest.fixture
def alice() -> KeyPair:
    return KeyPair.generate()


def test_a_signed_message_verifies_against_the_publisher_did_alone(alice):
    signer = OriginSigner(alice)
    assert signer.publisher_did == did_key(alice.verkey)
    headers = signer.headers("g", "m1", b"hello", {"topic": "t"})
    sig = signature_from_header(headers[ORIGIN_HEADER])
    assert sig is not None and len(sig) == 64
    assert verify_origin("g", signer.publisher_did, "m1", b"hello", headers, sig)
    # The proof header itself is left out of what is signed, so stripping it (history does) changes nothing.
    assert verify_origin("g", signer.publisher_did, "m1", b"hello", {"topic": "t"}, sig)


@pytest.mark.parametrize("change", ["payload", "id", "group", "header", "extra header", "publisher"])
def test_any_change_to_a_signed_message_fails(alice, change):
    signer = OriginSigner(alice)
    sig = signer.sign("g", "m1", b"hello", {"topic": "t"})
    fields = {"group": "g", "did": signer.publisher_did, "id": "m1", "payload": b"hello", "headers": {"topic": "t"}}
    if change == "payload":
        fields["payload"] = b"hellO"
    elif change == "id":
        fields["id"] = "m2"
    elif change == "group":
        fields["group"] = "h"
    elif change == "header":
        fields["headers"] = {"topic": "u"}
    elif change == "extra header":
        fields["headers"] = {"topic": "t", "x": "y"}
    else:
        fields["did"] = did_key(KeyPair.generate().verkey)  # someone else claims it
    assert not verify_origin(fields["group"], fields["did"], fields["id"], fields["payload"], fields["headers"], sig)


def test_fields_cannot_slide_into_each_other(alice):
    # Without length prefixes, ("ab", "c") and ("a", "bc") would sign the same bytes.
    assert origin_digest("ab", "d", "c", b"") != origin_digest("a", "d", "bc", b"")
    assert origin_digest("g", "d", "m", b"", {"a": "bc"}) != origin_digest("g", "d", "m", b"", {"ab": "c"})


@pytest.mark.parametrize("field, value", [("payload", None), ("headers", {"topic": None}),
                                          ("headers", {None: "t"}), ("id", None), ("group", 7)])
def test_a_malformed_row_is_not_proven_and_does_not_raise(alice, field, value):
    signer = OriginSigner(alice)
    sig = signer.sign("g", "m1", b"hello", {"topic": "t"})
    fields = {"group": "g", "did": signer.publisher_did, "id": "m1", "payload": b"hello", "headers": {"topic": "t"}}
    fields[field] = value
    assert not verify_origin(fields["group"], fields["did"], fields["id"], fields["payload"], fields["headers"], sig)


def test_a_key_that_is_not_the_members_is_refused(alice):
    with pytest.raises(ConfigurationError):
        OriginSigner(alice, publisher_did=did_key(KeyPair.generate().verkey))


@pytest.mark.parametrize("value", [None, "", "2:abc", "1:not base64!", "1:" + "A" * 10])
def test_malformed_proof_headers_are_no_proof(value):
    assert signature_from_header(value) is None


def test_verify_rows_checks_a_whole_table_in_parallel(alice):
    signer = OriginSigner(alice)
    mallory = OriginSigner(KeyPair.generate())
    rows = []
    for i in range(3000):
        payload = f"m{i}".encode()
        sig = signer.sign("g", f"id{i}", payload)
        did = signer.publisher_did
        if i == 7:
            payload = b"forged"  # altered content
        if i == 11:
            sig = mallory.sign("g", f"id{i}", payload)  # someone else's key under alice's name
        if i == 13:
            sig = None  # no proof
        rows.append({"group": "g", "message_id": f"id{i}", "publisher_did": did, "headers": None, "payload": payload,
                     "origin_sig": sig})
    table = pa.Table.from_pylist(rows)
    ok = verify_rows(table, threads=2)
    assert len(ok) == 3000
    assert [i for i, good in enumerate(ok) if not good] == [7, 11, 13]


def test_a_proof_header_in_a_rows_headers_or_text_that_is_not_utf8_is_no_proof(alice):
    """The digest leaves the zc-origin header out, and ingest moves it into origin_sig: one in a history
    row's headers was added after signing (it verified). Text that is not UTF-8 made verify_rows raise
    UnicodeDecodeError for the whole table."""
    signer = OriginSigner(alice)
    sig = signer.sign("g", "m", b"x", {"k": "v"})
    strings = pa.array([b"m", b"m", b"m\xfe", b"m"], pa.binary())
    ids = pa.Array.from_buffers(pa.string(), 4, strings.buffers())  # as Spark hands over unchecked text
    heads = pa.array([[("k", "v")], [("k", "v"), (ORIGIN_HEADER, "1:added")], [("k", "v")], [("k", "v")]],
                     pa.map_(pa.string(), pa.string()))
    rows = pa.table({"group": ["g"] * 4, "message_id": ids, "publisher_did": [signer.publisher_did] * 4,
                     "headers": heads, "payload": [b"x"] * 4, "origin_sig": [sig] * 4})
    assert verify_rows(rows, threads=1) == [True, False, False, True]


def test_history_key_seals_and_binds_each_payload_to_its_row():
    key = HistoryKey.generate()
    sealed = key.seal(b"secret", "g", "did:key:zA", "m1")
    assert b"secret" not in sealed and len(sealed) == 24 + 6 + 16
    assert key.open(sealed, "g", "did:key:zA", "m1") == b"secret"
    for moved in (("h", "did:key:zA", "m1"), ("g", "did:key:zB", "m1"), ("g", "did:key:zA", "m2")):
        with pytest.raises(TamperedEnvelopeError):
            key.open(sealed, *moved)
    flipped = bytearray(sealed)
    flipped[30] ^= 1
    with pytest.raises(TamperedEnvelopeError):
        key.open(bytes(flipped), "g", "did:key:zA", "m1")
    with pytest.raises(TamperedEnvelopeError):
        HistoryKey.generate().open(sealed, "g", "did:key:zA", "m1")


def test_history_key_columns_use_fresh_nonces_and_never_show_the_key():
    key = HistoryKey(os.urandom(32))
    column = key.seal_column(["g"] * 3, ["d"] * 3, ["a", "b", "c"], [b"same"] * 3)
    values = column.to_pylist()
    assert len({v[:24] for v in values}) == 3 and len(set(values)) == 3
    assert key.open_column(["g"] * 3, ["d"] * 3, ["a", "b", "c"], values) == [b"same"] * 3
    assert key.secret.hex() not in repr(key) and key.key_id in repr(key)
    assert pickle.loads(pickle.dumps(key)) == key  # Spark ships it to its Python workers
    with pytest.raises(ConfigurationError):
        HistoryKey(b"short")


def test_a_history_key_sealed_for_members_opens_only_with_their_keys():
    bob, carol, eve = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    key = HistoryKey.generate()
    sealed = seal_history_key(key, [bob.verkey, carol.verkey])
    assert key.secret not in sealed
    for member in (bob, carol):
        assert open_history_key(sealed, {member.verkey: member}.get) == key
    with pytest.raises(Exception):
        open_history_key(sealed, {eve.verkey: eve}.get)
