"""Seeded mutation fuzzing of every parser that reads what a peer, a client or the disk hands us.

The house rule under test: bad input gets a ZeroCommError (whose message says what to do), never a
raw TypeError, KeyError, OverflowError, UnicodeEncodeError..., and no small input costs unbounded
time. Each loop is deterministic (fixed seeds, a fixed number of cases) and takes well under a
few seconds, so it runs in CI; a failure prints the seed and case that broke.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from zerocomm_spark.errors import ZeroCommError
from zerocomm_spark.group import datamessage as dm
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.transport import frames

pytestmark = pytest.mark.timeout(60)

# Values that break naive parsers: wrong types, extremes, NaN/inf, lone surrogates, nesting.
JUNK: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**64, -(2**63), 10**400, 1e300, 1.5, float("nan"), float("inf"),
    float("-inf"), "", "x", "\ud800", "A" * 300, [], [1], {}, {"a": 1}, [[[[]]]], "did:peer:2", "=", "!!!!",
    "\x00", "-1", "1e999",
)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def mutate_json(rng: random.Random, value: Any) -> Any:
    """One structural change somewhere in a JSON value: a junk value, a dropped key, a cut string..."""
    out = copy.deepcopy(value)
    path = rng.choice(list(_paths(out)))
    current = _at(out, path)
    op = rng.randrange(6)
    if op == 1 and path:
        del _at(out, path[:-1])[path[-1]]
        return out
    if op == 2 and isinstance(current, str) and current:
        chars = list(current)
        for _ in range(rng.randint(1, 4)):
            chars[rng.randrange(len(chars))] = rng.choice("aZ09-_=+/ \x00\u00e9?#&%:;\ud800")
        new: Any = "".join(chars)
    elif op == 3 and isinstance(current, str):
        new = current[: rng.randrange(len(current) + 1)]
    elif op == 4 and isinstance(current, dict):
        current[rng.choice(["@type", "@id", "~thread", "id", "x"])] = rng.choice(JUNK)
        return out
    elif op == 5:
        new = [current] if rng.random() < 0.5 else {"k": current}
    else:
        new = rng.choice(JUNK)
    if not path:
        return new
    _at(out, path[:-1])[path[-1]] = new
    return out


def dumps(value: Any) -> bytes:
    """JSON as a hostile peer may write it: NaN/Infinity and lone surrogates included."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Bit flips, cuts, insertions and truncation."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            start = rng.randrange(len(out))
            del out[start : start + rng.randint(1, 8)]
        elif op == 2:
            at = rng.randrange(len(out) + 1)
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and out:
            del out[rng.randrange(len(out)) :]
    return bytes(out)


def only_project_errors(parse: Callable[[Any], object], cases: Iterator[Any]) -> None:
    """Run ``parse`` on every case: returning or raising a ZeroCommError is fine, anything else fails."""
    for number, case in enumerate(cases):
        try:
            parse(case)
        except ZeroCommError:
            pass
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {number}: {type(exc).__name__}: {exc!s:.200} on input {case!r:.400}")


# --- group data plane and peer frames ------------------------------------------------------------


def _data_samples() -> list[bytes]:
    key = KeyPair.generate()
    batch = dm.DataBatch("g", "did:example:alice", tuple(
        dm.DataMessage(f"id-{i}", i, 100 + i, 1_700_000_000.5 + i, b"x" * i, {"a": "b"} if i % 2 else None)
        for i in range(1, 4)), base=1, last=9, gone=(3, 6))
    return [dm.encode(batch), dm.encode(batch, signer=key), dm.encode(dm.Hello("g", "a", "b", "n", 1, 2), signer=key),
            dm.encode(dm.Ack("g", "a", "b", 3, "n")), dm.encode(dm.ResendRequest("g", "a", "b", 1, 5))]


@pytest.mark.parametrize("seed", range(3))
def test_data_plane_messages_mutated_as_json_are_refused_cleanly(seed: int) -> None:
    rng = random.Random(seed)
    samples = [json.loads(s) for s in _data_samples() if not s.startswith(dm._SIGNED_HEAD)]  # noqa: SLF001
    only_project_errors(dm.decode, (dumps(mutate_json(rng, rng.choice(samples))) for _ in range(1500)))


@pytest.mark.parametrize("seed", range(3))
def test_data_plane_messages_mutated_as_bytes_are_refused_cleanly(seed: int) -> None:
    rng = random.Random(seed)
    samples = _data_samples()
    only_project_errors(dm.decode, (mutate_bytes(rng, rng.choice(samples)) for _ in range(1500)))


def test_peer_frames_mutated_are_refused_cleanly() -> None:
    rng = random.Random(7)
    samples = [frames.encode(m) for m in (frames.RpcRequest(1, 5, 0, b"abc"), frames.RpcResponse(5, 0, b"x"),
                                          frames.DirectSend(1, 0, b"y"), frames.Ping(3), frames.Pong(3),
                                          frames.Error(frames.ErrorCode(1), b"\x01\x02", 9))]
    only_project_errors(frames.decode, (mutate_bytes(rng, rng.choice(samples)) for _ in range(5000)))


# --- group membership: member entries as peers announce them -----------------------------------


def _member_entry() -> dict[str, Any]:
    from zerocomm_spark.group.view import MemberEntry, member_did_for

    key = KeyPair.generate()
    entry = MemberEntry(did=member_did_for(key.verkey), label="caf\u00e9", role="read_write", status="active",
                        peer_endpoint="tcp://127.0.0.1:4000", publish_endpoint="tcp://127.0.0.1:5000",
                        group_verkey=KeyPair.generate().verkey, transport_key="T" * 40,
                        invitation="https://zerocomm.invalid/?oob=x", version=3, ticket={"by": "did:key:z6Mk"})
    return entry.signed(key).to_dict()


@pytest.mark.parametrize("seed", range(2))
def test_member_entries_mutated_are_refused_cleanly(seed: int) -> None:
    from zerocomm_spark.group.view import parse_entries

    rng = random.Random(seed)
    entries = [_member_entry(), _member_entry()]

    def parse(view: Any) -> None:
        parse_entries(view, skip_invalid=True)
        parse_entries(view)

    only_project_errors(parse, (mutate_json(rng, entries) for _ in range(1500)))


# --- the agent's local API: request headers and call arguments ---------------------------------


def _api_registry() -> Any:
    from zerocomm_spark.agent.calls import build_registry

    return build_registry(object())  # type: ignore[arg-type] - parse() never reaches a handler


def test_a_number_argument_given_as_an_integer_beyond_a_float_is_a_bad_request() -> None:
    from zerocomm_spark.errors import BadRequestError

    registry = _api_registry()
    with pytest.raises(BadRequestError, match="'wait'"):  # float() of it raised OverflowError
        registry.parse({"v": 1, "id": "1", "call": "read", "args": {"wait": 10**400}}, None)
    with pytest.raises(BadRequestError, match="'wait'"):
        registry.parse({"v": 1, "id": "1", "call": "read", "args": {"wait": float("nan")}}, None)


@pytest.mark.parametrize("call, args, name", [
    ("read", {"group": "g\ud800"}, "group"),  # reached pyarrow's compute, which raised TypeError
    ("create", {"group": "\ud800"}, "group"),
    ("send", {"peer": "bob", "message": "hi \udc00"}, "message"),
    ("invite", {"label": "\ud800"}, "label"),
])
def test_a_text_argument_holding_a_lone_surrogate_is_a_bad_request(call: str, args: dict[str, Any], name: str) -> None:
    """JSON can spell "\\ud800"; no UTF-8 holds it. Such arguments passed the type check and failed
    deep in the handler with a non-project error (the client saw a generic internal error)."""
    from zerocomm_spark.errors import BadRequestError

    with pytest.raises(BadRequestError, match=f"'{name}' holds a lone surrogate"):
        _api_registry().parse({"v": 1, "id": "1", "call": call, "args": args}, None)


@pytest.mark.parametrize("seed", range(2))
def test_api_requests_mutated_are_refused_cleanly(seed: int) -> None:
    from zerocomm_spark.client import decode_header

    rng = random.Random(seed)
    registry = _api_registry()
    valid = {str: "text", int: 3, float: 2.5, bool: True, list: [], dict: {}}

    def request() -> bytes:
        call = registry.get(rng.choice(registry.names()))
        args = {name: valid[param.kind] for name, param in call.params.items() if rng.random() < 0.7}
        header = {"v": 1, "id": "r1", "call": call.name, "args": args, "timeout": 5}
        return dumps(mutate_json(rng, header))

    def parse(frame: bytes) -> None:
        header = decode_header(frame)
        registry.parse(header, b"bulk" if rng.random() < 0.5 else None)

    only_project_errors(parse, (request() for _ in range(3000)))


# --- DIDComm messages, invitations, DID documents and did:peer ---------------------------------


def _didcomm_samples() -> tuple[list[dict[str, Any]], str, str, dict[str, Any]]:
    from zerocomm_spark.did.peer import create_peer_did, did_key, resolve
    from zerocomm_spark.protocols.did_exchange.v1_0.manager import signed_did_doc
    from zerocomm_spark.protocols.did_exchange.v1_0.messages import DIDXProblemReport, DIDXRequest, DIDXResponse
    from zerocomm_spark.protocols.message import Thread
    from zerocomm_spark.protocols.out_of_band.v1_1.messages import Invitation, Service

    key = KeyPair.generate()
    did = create_peer_did(key.verkey, "tcp://127.0.0.1:5555", group_endpoint="tcp://127.0.0.1:5556")
    invitation = Invitation(services=[Service(recipient_keys=[did_key(key.verkey)], service_endpoint="tcp://h:1"),
                                      did], label="inviter")
    messages = [
        invitation.to_dict(),
        DIDXRequest(label="bob", did=did, did_doc_attach=signed_did_doc(did, key),
                    thread=Thread(pthid=invitation.id)).to_dict(),
        DIDXResponse(did=did, did_doc_attach=signed_did_doc(did, key), thread=Thread(thid="t")).to_dict(),
        DIDXProblemReport(code="request_not_accepted", explanation="no", thread=Thread(thid="t")).to_dict(),
    ]
    return messages, invitation.to_url(), did, resolve(did).to_dict()


def _handle_message(data: Any) -> None:
    """Parse as the agent does, then what its handlers do with the parts: attached docs, DIDs, URLs."""
    from zerocomm_spark.did.peer import resolve
    from zerocomm_spark.protocols.did_exchange.v1_0.manager import verify_did_doc
    from zerocomm_spark.protocols.message import parse_message
    from zerocomm_spark.protocols.out_of_band.v1_1.messages import Invitation

    message = parse_message(data)
    if isinstance(message, Invitation):
        Invitation.from_url(message.to_url())
    did = getattr(message, "did", None)
    if did is not None:
        resolve(did)
        verify_did_doc(did, getattr(message, "did_doc_attach", None), signer=None, required=False)


@pytest.mark.parametrize("seed", range(2))
def test_didcomm_messages_mutated_are_refused_cleanly(seed: int) -> None:
    rng = random.Random(seed)
    messages, _, _, _ = _didcomm_samples()
    only_project_errors(_handle_message, (json.loads(dumps(mutate_json(rng, rng.choice(messages))))
                                          for _ in range(800)))


def test_invitation_urls_dids_and_did_documents_mutated_are_refused_cleanly() -> None:
    from zerocomm_spark.did.peer import DIDDocument, resolve
    from zerocomm_spark.protocols.out_of_band.v1_1.messages import Invitation

    rng = random.Random(11)
    _, url, did, document = _didcomm_samples()
    only_project_errors(Invitation.from_url, (mutate_bytes(rng, url.encode()).decode("latin-1") for _ in range(1500)))
    only_project_errors(resolve, (mutate_bytes(rng, did.encode()).decode("latin-1") for _ in range(1500)))
    only_project_errors(DIDDocument.from_dict, (mutate_json(rng, document) for _ in range(1500)))


def test_an_overlong_base58_key_is_refused_at_once_not_decoded_in_quadratic_time() -> None:
    """base58 decoding is quadratic: a 200k-character "key" (a JWS kid, a publicKeyBase58) took
    half a minute of CPU per message, and a 16 MiB frame holds much longer ones."""
    import time

    from zerocomm_spark.did.peer import DIDDocument, verkey_from_did_key
    from zerocomm_spark.errors import DIDError
    from zerocomm_spark.protocols.message import Attachment, b64url_encode

    long_key = "2" * 200_000
    kid = "did:key:z" + long_key
    protected = b64url_encode(json.dumps({"alg": "EdDSA", "kid": kid}).encode())
    document = {"id": "did:example:1", "authentication": ["#k"],
                "verificationMethod": [{"id": "#k", "type": "Ed25519VerificationKey2018", "publicKeyBase58": long_key}]}
    started = time.monotonic()
    with pytest.raises(DIDError) as refused:
        verkey_from_did_key(kid)
    assert len(str(refused.value)) < 1000  # the message does not quote the 200k characters
    with pytest.raises(ZeroCommError):
        Attachment(base64="e30", jws={"protected": protected, "signature": "AA"}).signer()
    with pytest.raises(DIDError):
        DIDDocument.from_dict(document)
    assert time.monotonic() - started < 1.0


# --- RFC 0019 envelopes, with a real recipient key -----------------------------------------------


@pytest.mark.parametrize("seed", range(2))
def test_envelopes_mutated_are_refused_cleanly(seed: int) -> None:
    import base64

    from zerocomm_spark.envelope import pack, unpack

    rng = random.Random(seed)
    alice, bob, carol = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    lookup = {bob.verkey: bob}.get

    def b64e(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).decode("ascii")

    def case() -> bytes:
        envelope = pack(b'{"a":1}', [carol.verkey, bob.verkey][: rng.randint(1, 2)] + [bob.verkey],
                        alice if rng.random() < 0.6 else None)
        outer = json.loads(envelope)
        header = json.loads(base64.urlsafe_b64decode(outer["protected"]))
        kind = rng.randrange(4)
        if kind == 0:
            return mutate_bytes(rng, envelope)
        if kind == 1:
            return dumps(mutate_json(rng, outer))
        if kind == 2:
            outer["protected"] = b64e(dumps(mutate_json(rng, header)))
        else:
            outer["protected"] = b64e(mutate_bytes(rng, base64.urlsafe_b64decode(outer["protected"])))
        return json.dumps(outer).encode()

    only_project_errors(lambda envelope: unpack(envelope, lookup), (case() for _ in range(1500)))


# --- Arrow IPC bulk frames of the local API -------------------------------------------------------


def test_arrow_ipc_bulk_frames_mutated_are_refused_cleanly() -> None:
    import pyarrow as pa

    from zerocomm_spark.agent.calls import _publish_rows
    from zerocomm_spark.client import ipc_to_table

    table = pa.table({"payload": [b"abc", b"de" * 50, None], "message_id": ["a", None, "c"],
                      "headers": pa.array([{"k": "v"}, None, {}], pa.map_(pa.string(), pa.string())),
                      "d": pa.array(["x", "y", "x"]).dictionary_encode()})
    samples = []
    for compression in (None, "lz4", "zstd"):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as out:
            out.write_table(table)
            out.write_table(table)
        samples.append(sink.getvalue().to_pybytes())
    rng = random.Random(5)
    only_project_errors(lambda frame: _publish_rows(ipc_to_table(frame, max_bytes=1 << 20)),
                        (mutate_bytes(rng, rng.choice(samples)) for _ in range(3000)))


# --- the journal's files on open: segments, side files, commit points ----------------------------


def test_journal_files_damaged_on_disk_open_with_clear_errors_or_recovery(tmp_path: Any) -> None:
    import os
    import shutil

    import nacl.utils

    from zerocomm_spark.journal import Journal

    t0 = 1_700_000_000_000_000

    def rows(first: int, last: int, publisher: str) -> list[dict[str, Any]]:
        return [{"group": "g", "message_id": f"m-{publisher[-3:]}-{s}", "publisher_did": publisher, "seq": s,
                 "lamport_ts": s, "sent_at": t0 + s, "received_at": t0 + s, "headers": {"t": str(s)},
                 "payload": b"p" * 40} for s in range(first, last + 1)]

    key = nacl.utils.random(32)
    base = tmp_path / "base"
    with Journal.open(base, key=key, segment_bytes=4096, fsync="never") as journal:
        for a in range(10):
            journal.append(rows(a * 5 + 1, a * 5 + 5, "did:peer:2.alice"))
            journal.append(rows(a * 3 + 1, a * 3 + 3, "did:peer:2.bob"))
        journal.commit(20)
        journal.commit(10, consumer="c1")
        journal.add_superseded("g", "did:peer:2.alice", [3, 4])
    rng = random.Random(3)

    def damaged(number: int) -> Any:
        work = tmp_path / f"w{number}"
        shutil.copytree(base, work)
        files = sorted(p for p in work.iterdir() if p.is_file())
        for _ in range(rng.randint(1, 2)):
            victim = rng.choice(files)
            data = victim.read_bytes()
            op = rng.randrange(3)
            if op == 0:
                data = mutate_bytes(rng, data)
            elif op == 1 and data:
                at = rng.randrange(len(data))
                data = data[:at] + os.urandom(8) + data[at + 8 :]
            else:
                data = data[: rng.randrange(len(data) + 1)]
            victim.write_bytes(data)
        return work

    def reopen(work: Any) -> None:
        with Journal.open(work, key=key, segment_bytes=4096, fsync="never") as journal:
            for read in (lambda: journal.read(journal.earliest_offset),
                         lambda: journal.read_by_seq("g", "did:peer:2.alice", 1, 50)):
                try:
                    read()
                except ZeroCommError:
                    pass  # a damaged record is named when a read reaches it
            journal.latest()
            journal.consumers()
            journal.superseded("g", "did:peer:2.alice", 1, 50)
            journal.offset_for_timestamp(t0 + 30)
            journal.append(rows(51, 53, "did:peer:2.alice"))
        shutil.rmtree(work)

    only_project_errors(reopen, (damaged(n) for n in range(60)))
