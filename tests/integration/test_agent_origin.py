"""Origin proofs signed by an agent process on request (publish sign=true, `zerocomm send --sign`):
real agent processes started through the `zerocomm` command, real sockets, real Ed25519."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli_support import Member, running, wait_for
from zerocomm_spark.client import Client
from zerocomm_spark.errors import BadRequestError
from zerocomm_spark.group.origin import ORIGIN_HEADER, signature_from_header, verify_origin

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[list[Member]]:
    """alice and bob in group g, each its own agent process."""
    with running(tmp_path, "alice", "bob") as members:
        alice, bob = members
        alice.ok("group", "create", "g", "--mode", "shared")
        bob.ok("connect", alice.ok("invite")["url"])
        bob.ok("group", "join", "g", "--via", "alice")
        wait_for(lambda: sorted(x["label"] for x in alice.ok("group", "members", "g") if x["status"] == "active")
                 == ["alice", "bob"], 20, "alice to see bob active")
        yield members


def _client(member: Member) -> Client:
    return Client.connect(config=str(member.config), timeout=10, call_timeout=60)


def _rows(member: Member, group: str = "g") -> list[dict]:
    with _client(member) as client:
        return client.read(group=group, start=0).to_pylist()


def _by_id(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for row in rows:
        assert row["message_id"] not in out, f"{row['message_id']} delivered twice"
        out[row["message_id"]] = row
    return out


def _proof_holds(row: dict, *, payload: bytes | None = None, headers: dict | None = None) -> bool:
    heads = dict(row["headers"] or []) if headers is None else headers
    return verify_origin(row["group"], row["publisher_did"], row["message_id"],
                         row["payload"] if payload is None else payload, heads,
                         signature_from_header(dict(row["headers"] or []).get(ORIGIN_HEADER)))


def test_an_agent_signs_what_it_publishes_and_another_member_can_prove_it(pair: list[Member]) -> None:
    alice, bob = pair
    payloads = [b"first", b"\x00\xffbinary", "caf\u00e9".encode()]
    heads = [{"kind": "a"}, None, {"kind": "b", "z": "1"}]
    with _client(alice) as client:
        signed = client.publish("g", payloads, message_ids=["s1", "s2", "s3"], headers=heads, sign=True)
        plain = client.publish("g", [b"unsigned"], message_ids=["u1"])
        alice_did = next(m["did"] for m in client.members("g") if m.get("is_self"))
    assert signed.seqs == [1, 2, 3] and plain.seqs == [4]
    got = _by_id(_rows(bob))
    assert set(got) == {"s1", "s2", "s3", "u1"}
    for mid, payload, head in zip(["s1", "s2", "s3"], payloads, heads):
        row = got[mid]
        assert row["publisher_did"] == alice_did  # the did:key the agent signed with is the one the group sees
        assert row["payload"] == payload
        carried = dict(row["headers"])
        assert {k: v for k, v in carried.items() if k != ORIGIN_HEADER} == (head or {})
        assert _proof_holds(row), mid
        # Any change to what was signed breaks the proof: the payload, a header, the id, the publisher.
        assert not _proof_holds(row, payload=payload + b"!")
        assert not _proof_holds(row, headers={**carried, "kind": "forged"})
        assert not _proof_holds(row, headers={**carried, "extra": "x"})
        assert not _proof_holds({**row, "message_id": "s9"})
        assert not _proof_holds({**row, "group": "other"})
    assert ORIGIN_HEADER not in dict(got["u1"]["headers"] or [])  # unsigned unless asked
    # alice's own journal holds the same proofs (a history ingested from alice verifies too).
    own = _by_id(_rows(alice))
    assert all(_proof_holds(own[mid]) for mid in ("s1", "s2", "s3"))
    assert [own[m]["headers"] for m in ("s1", "s2", "s3")] == [got[m]["headers"] for m in ("s1", "s2", "s3")]


def test_a_row_that_already_claims_an_origin_is_refused_and_nothing_is_sent(pair: list[Member]) -> None:
    alice, bob = pair
    claim = "1:" + base64.b64encode(bytes(64)).decode()
    with _client(alice) as client:
        with pytest.raises(BadRequestError,
                           match=r"row 1 \(message_id 'c2'\) has a 'zc-origin' header, and sign is true"):
            client.publish("g", [b"a", b"b"], message_ids=["c1", "c2"], headers=[None, {ORIGIN_HEADER: claim}],
                           sign=True)
        # Without sign the agent passes a row's own header on, as before (history then checks it).
        assert client.publish("g", [b"c"], message_ids=["c3"], headers=[{ORIGIN_HEADER: claim}]).seqs == [1]
    got = _by_id(_rows(bob))
    assert set(got) == {"c3"}  # neither row of the refused call went out


def test_republishing_signed_ids_is_exactly_once_also_across_an_agent_restart(pair: list[Member]) -> None:
    alice, bob = pair
    ids = [f"m{i}" for i in range(50)]
    payloads = [b"p%d" % i for i in range(50)]
    with _client(alice) as client:
        first = client.publish("g", payloads, message_ids=ids, sign=True)
        again = client.publish("g", payloads, message_ids=ids, sign=True)
        assert again.duplicates == 50 and again.seqs == first.seqs == list(range(1, 51))
        assert first.signed == again.signed == 50
        mixed = client.publish("g", payloads[40:] + [b"new"], message_ids=ids[40:] + ["m50"], sign=True)
        assert mixed.duplicates == 10 and mixed.seqs == list(range(41, 52)) and mixed.signed == 11
        # Signing is per message as it went out: a known id keeps its proof when re-sent without sign.
        assert client.publish("g", payloads[:2], message_ids=ids[:2]).signed == 2
    alice.ok("agent", "stop", "--timeout", "15", timeout=30)
    alice.start()  # its memory of published ids is gone: the group's members and journals drop them
    with _client(alice) as client:
        client.publish("g", payloads[:20], message_ids=ids[:20], sign=True, timeout=60)
    wait_for(lambda: len(_rows(bob)) >= 51, 20, "bob to have every message")
    got = _by_id(_rows(bob))  # raises on an id delivered twice
    assert set(got) == {*ids, "m50"}
    assert [got[m]["seq"] for m in ids] == list(range(1, 51))  # in order, under the first seqs
    assert all(_proof_holds(row) for row in got.values())


def test_zerocomm_send_sign_end_to_end(pair: list[Member]) -> None:
    alice, bob = pair
    one = alice.ok("send", "g", "hello, signed", "--sign")
    assert one["signed"] is True and one["seqs"] == [1]
    lines = alice.ok("send", "g", "-", "--sign", input="line one\nline two\n")
    assert lines["seqs"] == [2, 3] and lines["signed"] is True
    plain = alice.ok("send", "g", "not signed")
    assert plain["signed"] is False and plain["signed_count"] == 0
    # The same id again with --sign is a duplicate: not sent again, so it still has no proof - said so.
    again = alice.ok("send", "g", "not signed", "--sign", "--id", plain["message_ids"][0])
    assert again["duplicates"] == 1 and again["signed"] is False and again["signed_count"] == 0
    told = alice.run("send", "g", "not signed", "--sign", "--id", plain["message_ids"][0], json_out=False)
    assert told.code == 0 and "without a proof" in told.stdout and ", signed" not in told.stdout
    human = alice.run("send", "g", "human", "--sign", json_out=False)
    assert human.code == 0 and ", signed;" in human.stdout
    rows = {r["message_id"]: r for r in bob.run("history", "g").json_lines}
    signed_ids = one["message_ids"] + lines["message_ids"] + human.stdout.split()[1:2]
    assert len(rows) == 5
    for mid in signed_ids:
        row = rows[mid]
        proof = {**row, "payload": row["payload"].encode(), "headers": list((row["headers"] or {}).items())}
        assert _proof_holds(proof), mid
        assert not _proof_holds(proof, payload=b"tampered")
    assert ORIGIN_HEADER not in dict(rows[plain["message_ids"][0]]["headers"] or [])


def test_after_a_restart_an_id_first_sent_unsigned_is_not_counted_as_signed(pair: list[Member]) -> None:
    """The agent remembers the ids it published in memory only: after a restart, a re-publish with
    sign of ids that first went out unsigned was counted as signed, though every member (and its own
    journal) dropped the signed copy and kept the unsigned one. Its journal now tells it so."""
    alice, bob = pair
    ids = [f"u{i}" for i in range(5)]
    payloads = [b"plain %d" % i for i in range(5)]
    with _client(alice) as client:
        assert client.publish("g", payloads, message_ids=ids).signed == 0
    plain = alice.ok("send", "g", "plain line")
    alice.ok("agent", "stop", "--timeout", "15", timeout=30)
    alice.start()
    with _client(alice) as client:
        again = client.publish("g", payloads[:3] + [b"new"], message_ids=ids[:3] + ["n1"], sign=True, timeout=60)
        assert again.journaled
        assert (again.signed, again.signed_unknown, again.duplicates) == (1, 3, 3)  # only n1 is surely signed
        # Remembered now, as the journal told: a third time says the same, not "signed".
        third = client.publish("g", payloads[:3], message_ids=ids[:3], sign=True)
        assert (third.signed, third.signed_unknown, third.duplicates) == (0, 3, 3)
    one = alice.ok("send", "g", "plain line", "--sign", "--id", plain["message_ids"][0])
    assert one["signed"] is False and one["signed_count"] == 0 and one["signed_unknown"] == 1
    assert one["duplicates"] == 1
    told = alice.run("send", "g", "plain line", "--sign", "--id", plain["message_ids"][0], json_out=False)
    assert told.code == 0 and ", signed" not in told.stdout
    assert "whether with a proof is not known" in told.stdout and "zerocomm history g --json" in told.stdout
    wait_for(lambda: len(_rows(bob)) >= 7, 20, "bob to have every message")
    got = _by_id(_rows(bob))  # raises on an id delivered twice
    assert set(got) == {*ids, "n1", plain["message_ids"][0]}
    assert [ORIGIN_HEADER in dict(got[m]["headers"] or []) for m in ids[:3]] == [False] * 3  # as the answer said
    assert _proof_holds(got["n1"])
