"""The restore exchange (announce, request or ignore, verify, deliver) over in-memory providers.

The rows are genuinely signed by publisher member keys; providers are real ArrowProvider instances
serving pyarrow tables, so every path of the exchange runs without Spark.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa
import pytest

from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.pipelines.history_key import HistoryKey
from zerocomm_spark.pipelines.origin import OriginSigner
from zerocomm_spark.pipelines.restore import ArrowProvider, Have, restore
from zerocomm_spark.pipelines.schema import HISTORY_COLUMNS

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def make_rows(signer: OriginSigner, n: int, *, first_lamport: int = 1, key: HistoryKey | None = None,
              label: str = "p") -> list[dict]:
    rows = []
    for i in range(n):
        mid = f"{label}-{i}"
        payload = f"{label} says {i}".encode()
        sig = signer.sign("g", mid, payload)
        stored = payload if key is None else key.seal(payload, "g", signer.publisher_did, mid)
        rows.append({"group": "g", "date": T0.date(), "message_id": mid, "publisher_did": signer.publisher_did,
                     "publisher_label": label, "seq": i + 1, "lamport_ts": first_lamport + 2 * i, "sent_at": T0,
                     "received_at": T0, "ingested_at": T0, "headers": None, "payload": stored,
                     "payload_key_id": None if key is None else key.key_id,
                     "origin_scheme": "ed25519-member/1", "origin_sig": sig})
    return rows


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows).select(list(HISTORY_COLUMNS))


@pytest.fixture
def alice() -> OriginSigner:
    return OriginSigner(KeyPair.generate())


@pytest.fixture
def bob() -> OriginSigner:
    return OriginSigner(KeyPair.generate())


def test_every_missing_message_once_from_the_first_provider_that_announced_it(alice, bob):
    rows = make_rows(alice, 30, label="a") + make_rows(bob, 30, first_lamport=2, label="b")
    p1 = ArrowProvider(table(rows[:40]), "p1")            # a0..a29, b0..b9
    p2 = ArrowProvider(table(rows[20:]), "p2")            # a20..a29, b0..b29
    have = Have.from_rows([r["message_id"] for r in rows[:5]],
                          [r["publisher_did"] for r in rows[:5]], [r["seq"] for r in rows[:5]])
    delivered: list[pa.Table] = []
    report = restore("g", [p1, p2], have=have, deliver=delivered.append)
    assert len(delivered) == 1
    got = delivered[0].column("message_id").to_pylist()
    assert len(got) == len(set(got)) == 55                # everything but the 5 it had, each once
    assert set(got) == {r["message_id"] for r in rows[5:]}
    # p1 was asked for what it announced first; p2 only for what p1 did not offer: nothing twice.
    assert p1.stats.requested == 35 and p2.stats.requested == 20
    assert report.ignored == {"p1": 5, "p2": 20} and report.skipped_have == 5
    assert report.rejected == [] and report.missing == [] and report.refetched == 0
    lamports = delivered[0].column("lamport_ts").to_pylist()
    assert lamports == sorted(lamports)                   # delivered in causal order


def test_a_forged_row_is_rejected_and_fetched_from_the_next_provider(alice, bob):
    rows = make_rows(alice, 10, label="a")
    forged = [dict(r) for r in rows]
    forged[3]["payload"] = b"alice never said this"                       # altered content
    forged[5]["origin_sig"] = bob.sign("g", "a-5", forged[5]["payload"])  # signed by the wrong member
    extra = make_rows(bob, 1, label="x")[0]
    extra["publisher_did"] = alice.publisher_did                          # bob's row passed off as alice's
    p_bad = ArrowProvider(table(forged + [extra]), "mallory")
    p_good = ArrowProvider(table(rows), "honest")
    delivered: list[pa.Table] = []
    report = restore("g", [p_bad, p_good], deliver=delivered.append)
    got = delivered[0].column("message_id").to_pylist()
    assert sorted(got) == sorted(r["message_id"] for r in rows) and len(got) == 10
    payloads = dict(zip(got, delivered[0].column("payload").to_pylist()))
    assert payloads["a-3"] == b"a says 3"                                 # the genuine one, from the honest provider
    rejected = {(r.provider, r.message_id) for r in report.rejected}
    assert rejected == {("mallory", "a-3"), ("mallory", "a-5"), ("mallory", "x-0")}
    assert report.refetched == 2 and p_good.stats.requested == 2
    assert report.missing == ["x-0"]                                      # no one could prove it


def test_rows_that_differ_from_their_announcement_or_were_not_requested_are_dropped(alice):
    rows = make_rows(alice, 4, label="a")

    class Liar(ArrowProvider):
        def request(self, group, message_ids):
            out = super().request(group, message_ids).to_pylist()
            out[0]["lamport_ts"] += 1000                     # claims another place in the causal order
            extra = dict(rows[1])
            return table(out + [extra])                       # and sends a row twice

    delivered: list[pa.Table] = []
    report = restore("g", [Liar(table(rows), "liar")], deliver=delivered.append)
    reasons = sorted(r.reason for r in report.rejected)
    assert any("announced" in r for r in reasons) and any("twice" in r for r in reasons)
    assert sorted(delivered[0].column("message_id").to_pylist()) == ["a-1", "a-2", "a-3"]


def test_sealed_history_opens_with_the_key_and_is_refused_without_it(alice):
    key = HistoryKey.generate()
    rows = make_rows(alice, 5, key=key, label="a")
    delivered: list[pa.Table] = []
    report = restore("g", [ArrowProvider(table(rows), "p")], history_key=key, deliver=delivered.append)
    assert report.delivered == 5
    assert delivered[0].column("payload").to_pylist()[0] == b"a says 0"
    assert delivered[0].column("payload_key_id").null_count == 5
    without = restore("g", [ArrowProvider(table(rows), "p")])
    assert without.delivered == 0 and len(without.rejected) == 5 and len(without.missing) == 5


def test_have_positions_skip_what_retention_no_longer_lists(alice):
    rows = make_rows(alice, 6, label="a")
    have = Have(frozenset(), {alice.publisher_did: 4})  # seqs 1..4 held, ids no longer listed
    report = restore("g", [ArrowProvider(table(rows), "p")], have=have)
    assert report.delivered_ids == ["a-4", "a-5"] and report.skipped_have == 4
    assert Have.from_rows(["x", "y", "z"], ["d", "d", "d"], [1, 2, 4]).positions == {"d": 2}


def test_unsigned_rows_need_an_explicit_opt_out(alice):
    rows = make_rows(alice, 3, label="a")
    for r in rows:
        r["origin_sig"] = None
    refused = restore("g", [ArrowProvider(table(rows), "p")])
    assert refused.delivered == 0
    # said as what it is (published unsigned, and how to restore them), not only counted as rejections
    assert refused.advice is not None and refused.advice.startswith("3 row(s) had no origin proof")
    assert "require_origin=False" in refused.advice and refused.summary()["advice"] == refused.advice
    opted_out = restore("g", [ArrowProvider(table(rows), "p")], require_origin=False)
    assert opted_out.delivered == 3 and opted_out.advice is None
    with pytest.raises(ConfigurationError):
        restore("g", [])
    with pytest.raises(ConfigurationError):
        restore("g", [ArrowProvider(table(rows), "p"), ArrowProvider(table(rows), "p")])


# --- a dishonest or broken provider cannot hide a message, starve the fallback, or crash restore ----


def test_a_seq_lie_at_one_provider_does_not_hide_the_message_from_the_others(alice):
    rows = make_rows(alice, 6, label="a")                    # seqs 1..6
    have = Have(frozenset(), {alice.publisher_did: 4})       # the member holds seqs 1..4
    lie = [dict(r) for r in rows]
    lie[5]["seq"] = 2                                        # mallory announces a-5 under a seq it holds
    honest = ArrowProvider(table(rows), "honest")
    report = restore("g", [ArrowProvider(table(lie), "mallory"), honest], have=have)
    assert sorted(report.delivered_ids) == ["a-4", "a-5"] and report.missing == []
    assert report.skipped_have == 4
    # an id the member holds is still skipped everywhere, whatever seq is announced
    held = Have(frozenset({"a-5"}), {alice.publisher_did: 4})
    report = restore("g", [ArrowProvider(table(lie), "mallory"), ArrowProvider(table(rows), "honest")], have=held)
    assert report.delivered_ids == ["a-4"] and report.skipped_have == 5


def test_a_seq_below_one_is_a_malformed_announcement_not_a_message_the_member_has(alice):
    """seq counts from 1: an announced seq of 0 or below was within every member's position (0 for a
    publisher it holds nothing of), so a lone provider could make a message count as held (skipped_have)."""
    rows = make_rows(alice, 3, label="a")
    lie = [dict(r) for r in rows]
    lie[1]["seq"], lie[2]["seq"] = 0, -5
    report = restore("g", [ArrowProvider(table(lie), "mallory")])
    assert report.delivered_ids == ["a-0"] and report.skipped_have == 0
    assert {(r.provider, r.message_id, r.reason) for r in report.rejected} == {
        ("mallory", "a-1", "malformed announcement"), ("mallory", "a-2", "malformed announcement")}
    report = restore("g", [ArrowProvider(table(lie), "mallory"), ArrowProvider(table(rows), "honest")])
    assert sorted(report.delivered_ids) == ["a-0", "a-1", "a-2"] and report.missing == []


@pytest.mark.parametrize("since", [2**63, -1, "5"])
def test_a_since_lamport_no_lamport_time_can_be_is_a_configuration_error(alice, since):
    """since_lamport was not checked: past a long it failed every provider ("announce failed")."""
    with pytest.raises(ConfigurationError, match="Lamport time"):
        restore("g", [ArrowProvider(table(make_rows(alice, 1)), "p")], since_lamport=since)


def test_each_provider_rows_are_matched_against_its_own_announcement(alice, bob):
    rows = make_rows(alice, 2, label="a")
    bad = [dict(r) for r in rows]
    bad[0]["lamport_ts"] += 1000                             # announced elsewhere in the causal order
    bad[0]["payload"] = b"tampered"                          # and its row fails origin
    report = restore("g", [ArrowProvider(table(bad), "mallory"), ArrowProvider(table(rows), "honest")])
    assert sorted(report.delivered_ids) == ["a-0", "a-1"] and report.missing == []
    assert {(r.provider, r.message_id) for r in report.rejected} == {("mallory", "a-0")}
    # same id under another publisher at the first provider, sealed with a key the member lacks
    a_rows = make_rows(alice, 1, label="m", key=HistoryKey.generate())
    b_rows = make_rows(bob, 1, label="m")
    b_rows[0]["seq"], b_rows[0]["lamport_ts"] = 7, 9
    report = restore("g", [ArrowProvider(table(a_rows), "A"), ArrowProvider(table(b_rows), "B")])
    assert report.delivered_ids == ["m-0"] and report.missing == []
    assert [r.provider for r in report.rejected] == ["A"]


def _loose(rows: list[dict]) -> pa.Table:
    """The history schema with headers as a map (string -> nullable string), nulls allowed anywhere."""
    schema = table(make_rows(OriginSigner(KeyPair.generate()), 1)).schema
    schema = schema.set(schema.get_field_index("headers"), pa.field("headers", pa.map_(pa.string(), pa.string())))
    schema = schema.set(schema.get_field_index("payload_key_id"), pa.field("payload_key_id", pa.string()))
    return pa.Table.from_pylist(rows, schema=schema)


@pytest.mark.parametrize("field, value", [
    ("headers", [("k", None)]),                 # null header value
    ("headers", [("zc-origin", None)]),
    ("payload", None),                          # null payload
    ("message_id", None),                       # null id
    ("publisher_did", None),
    ("seq", None),
])
def test_a_malformed_row_is_rejected_not_fatal(alice, field, value):
    rows = make_rows(alice, 3, label="h")
    broken = [dict(r) for r in rows]
    broken[1][field] = value
    report = restore("g", [ArrowProvider(_loose(broken), "hostile"), ArrowProvider(_loose(rows), "honest")])
    assert sorted(report.delivered_ids) == ["h-0", "h-1", "h-2"] and report.missing == []
    assert len(report.rejected) >= 1 and all(r.provider == "hostile" for r in report.rejected)


def test_providers_whose_tables_type_headers_differently_are_merged(alice):
    rows = make_rows(alice, 3, label="h")
    broken = [dict(r) for r in rows]
    broken[1]["headers"] = [("k", None)]                     # hostile: map headers; honest: all-null headers
    report = restore("g", [ArrowProvider(_loose(broken), "hostile"), ArrowProvider(table(rows), "honest")])
    assert sorted(report.delivered_ids) == ["h-0", "h-1", "h-2"] and report.missing == []
    assert [(r.provider, r.message_id) for r in report.rejected] == [("hostile", "h-1")]


def test_a_malformed_sealed_row_is_rejected_not_fatal(alice):
    key = HistoryKey.generate()
    rows = make_rows(alice, 3, key=key, label="s")
    for value in (None, b"short"):
        broken = [dict(r) for r in rows]
        broken[1]["payload"] = value

        class Hostile(ArrowProvider):                      # announces honestly, serves a broken row
            def request(self, group, message_ids):
                return _loose([r for r in broken if r["message_id"] in message_ids])

        report = restore("g", [Hostile(_loose(rows), "hostile"), ArrowProvider(_loose(rows), "honest")],
                         history_key=key)
        assert sorted(report.delivered_ids) == ["s-0", "s-1", "s-2"] and report.missing == []
        assert [(r.provider, r.message_id) for r in report.rejected] == [("hostile", "s-1")]


def test_a_row_of_another_group_is_rejected(alice):
    rows = make_rows(alice, 2, label="a")
    other = make_rows(alice, 2, label="a")
    other[0]["group"] = "h"                                  # a genuine row of group h ...
    other[0]["origin_sig"] = alice.sign("h", "a-0", b"a says 0")

    class Mixer(ArrowProvider):                              # ... served for a request in group g
        def request(self, group, message_ids):
            return table([r for r in other if r["message_id"] in message_ids])

    report = restore("g", [Mixer(table(rows), "mixer"), ArrowProvider(table(rows), "honest")])
    assert sorted(report.delivered_ids) == ["a-0", "a-1"]
    assert [(r.provider, r.message_id) for r in report.rejected] == [("mixer", "a-0")]


@pytest.mark.parametrize("field, value", [
    ("sent_at", None),                          # NOT NULL in the history table, not covered by the proof
    ("received_at", None),
    ("ingested_at", None),
    ("date", None),
    ("date", datetime(2020, 1, 1).date()),      # a partition date that is not sent_at's UTC date
])
def test_a_row_with_a_missing_time_or_a_wrong_date_is_rejected_not_delivered(alice, field, value):
    rows = make_rows(alice, 3, label="t")
    broken = [dict(r) for r in rows]
    broken[1][field] = value
    delivered: list[pa.Table] = []
    report = restore("g", [ArrowProvider(_loose(broken), "hostile"), ArrowProvider(_loose(rows), "honest")],
                     deliver=delivered.append)
    assert sorted(report.delivered_ids) == ["t-0", "t-1", "t-2"] and report.missing == []
    assert [(r.provider, r.message_id) for r in report.rejected] == [("hostile", "t-1")]
    got = {r["message_id"]: r for r in delivered[0].to_pylist()}
    assert got["t-1"][field] == rows[1][field]     # the honest provider's copy was delivered


def test_a_provider_whose_columns_have_the_wrong_types_is_not_fatal(alice):
    rows = make_rows(alice, 3, label="w")
    good = table(rows)
    wrong = good.set_column(good.schema.get_field_index("sent_at"), "sent_at",
                            pa.array(["not a time"] * 3, pa.string()))
    report = restore("g", [ArrowProvider(good.slice(0, 1), "first"), ArrowProvider(wrong, "hostile"),
                           ArrowProvider(good, "honest")])
    assert sorted(report.delivered_ids) == ["w-0", "w-1", "w-2"] and report.missing == []
    assert sorted((r.provider, r.message_id) for r in report.rejected) == [("hostile", "w-1"), ("hostile", "w-2")]


def test_reading_what_the_member_has_past_its_deadline_is_a_zerocomm_error():
    import time
    from types import SimpleNamespace

    from zerocomm_spark.errors import ApiTimeoutError
    from zerocomm_spark.pipelines.restore import have_from_client

    class SlowClient:  # a journal far bigger than the deadline allows to page through
        def __init__(self):
            self.offset = 0

        def fetch(self, *, group, start, max_rows, timeout):
            time.sleep(0.02)
            self.offset += 1
            empty = pa.table({"message_id": pa.array([], pa.string()), "publisher_did": pa.array([], pa.string()),
                              "seq": pa.array([], pa.int64())})
            return SimpleNamespace(table=empty, next_offset=self.offset, end_offset=10**9)

    with pytest.raises(ApiTimeoutError, match="journal"):
        have_from_client(SlowClient(), "g", timeout=0.1)


def test_a_provider_that_fails_or_announces_garbage_does_not_abort_the_restore(alice):
    """One provider's error (an unreadable table, a dropped link) or a malformed announcement raised
    out of restore and lost what the other providers offered; its keys now go to the next provider."""
    rows = make_rows(alice, 3, label="f")

    class Down(ArrowProvider):
        def request(self, group, message_ids):
            raise OSError(5, "history table unreadable")  # as the OS raises it: errno and reason

    class Garbage(ArrowProvider):
        def announce(self, group, since_lamport=None):
            return table(rows).select(["message_id"])        # no publisher, seq or Lamport time

    class Mute(ArrowProvider):
        def announce(self, group, since_lamport=None):
            raise ConnectionError("provider went away")

    class Broken(ArrowProvider):
        def request(self, group, message_ids):
            return None                                       # not an Arrow table at all

    class Grumpy(ArrowProvider):
        def ignore(self, group, message_ids):
            raise RuntimeError("cannot account")              # ignore is flow control: nothing rides on it

    for bad in (Down, Garbage, Mute, Broken):
        delivered: list[pa.Table] = []
        report = restore("g", [bad(table(rows), "bad"), ArrowProvider(table(rows), "honest")],
                         deliver=delivered.append)
        assert sorted(report.delivered_ids) == ["f-0", "f-1", "f-2"] and report.missing == [], bad
        assert report.rejected and all(r.provider == "bad" for r in report.rejected), bad
        assert sorted(delivered[0].column("message_id").to_pylist()) == ["f-0", "f-1", "f-2"]
    assert restore("g", [ArrowProvider(table(rows), "first"), Grumpy(table(rows), "grumpy")]).delivered == 3
    alone = restore("g", [Down(table(rows), "down")])        # no one else: missing, reported, not raised
    assert alone.delivered == 0 and sorted(alone.missing) == ["f-0", "f-1", "f-2"]
    assert {r.reason for r in alone.rejected} == {"provider failed (OSError: history table unreadable)"}
    # Other exceptions' text is left out: it can quote the value that failed (a payload, say).
    class Leaky(ArrowProvider):
        def request(self, group, message_ids):
            raise ValueError("could not convert b'SECRET-PAYLOAD'")

    leaky = restore("g", [Leaky(table(rows), "leaky")])
    assert {r.reason for r in leaky.rejected} == {"provider failed (ValueError)"}


def test_a_provider_that_never_answers_is_given_up_on_at_the_deadline(alice):
    """Restore called announce and request with no deadline: one hung provider held it forever."""
    import threading
    import time

    rows = make_rows(alice, 3, label="s")
    release = threading.Event()

    class Hung(ArrowProvider):
        def request(self, group, message_ids):
            release.wait(30)                                  # a provider that never answers
            return super().request(group, message_ids)

    class Silent(ArrowProvider):
        def announce(self, group, since_lamport=None):
            release.wait(30)
            return super().announce(group, since_lamport)

    try:
        for hung in (Hung, Silent):
            began = time.monotonic()
            report = restore("g", [hung(table(rows), "hung"), ArrowProvider(table(rows), "honest")],
                             provider_timeout=0.3)
            assert time.monotonic() - began < 5, hung
            assert sorted(report.delivered_ids) == ["s-0", "s-1", "s-2"] and report.missing == [], hung
            assert report.rejected and all(r.provider == "hung" and "0.3" in r.reason
                                           for r in report.rejected), hung
        with pytest.raises(ConfigurationError, match="provider_timeout"):
            restore("g", [ArrowProvider(table(rows), "p")], provider_timeout=0)
        import inspect

        assert inspect.signature(restore).parameters["provider_timeout"].default == 600.0  # a deadline by default
    finally:
        release.set()


@pytest.mark.parametrize("seq", [None, "two", 2.5, True])
def test_have_from_rows_with_a_seq_that_is_not_an_int_is_a_clear_error(seq):
    """A null seq (a row read without its seq, or an outer join's gap) raised a bare TypeError from int()."""
    with pytest.raises(ConfigurationError, match=r"row 1 .*seq"):
        Have.from_rows(["x", "y"], ["d", "d"], [1, seq])
    assert Have.from_rows(["x", "y"], ["d", "d"], [1, 2]).positions == {"d": 2}


def test_a_delta_provider_refuses_an_as_of_that_is_no_version_or_time_at_once() -> None:
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.restore import DeltaProvider

    for bad in ("junk", "2026-13-01", -1, True, 1.5):
        with pytest.raises(ConfigurationError):
            DeltaProvider(None, "/lake/history", as_of=bad)  # type: ignore[arg-type]
    for good in (0, 7, "2026-11-28T03:00:00", "2026-11-28T03:00:00+01:00"):
        assert DeltaProvider(None, "/lake/history", as_of=good).as_of == good  # type: ignore[arg-type]


def test_a_row_whose_id_is_not_utf8_is_rejected_as_such(alice):
    """A served row whose message_id is not UTF-8 reads as no id, and was rejected as "not requested
    from this provider (or sent twice)" before the check that says the text is not UTF-8."""
    rows = make_rows(alice, 3, label="u")

    class Garbler(ArrowProvider):                          # announces honestly, serves u-1 with a damaged id
        def request(self, group, message_ids):
            served = super().request(group, message_ids)
            ids = [m.encode() if m != "u-1" else b"u-\xff" for m in served.column("message_id").to_pylist()]
            at = served.schema.get_field_index("message_id")
            return served.set_column(at, "message_id", pa.array(ids, pa.binary()).view(pa.string()))

    report = restore("g", [Garbler(table(rows), "garbler"), ArrowProvider(table(rows), "honest")])
    assert sorted(report.delivered_ids) == ["u-0", "u-1", "u-2"] and report.missing == []
    assert [(r.provider, r.message_id, r.reason) for r in report.rejected] == [
        ("garbler", None, "malformed row (text that is not UTF-8)")]


def test_a_provider_that_timed_out_is_asked_nothing_more(alice, bob):
    """A provider that missed the deadline on one request was asked again for every other chunk (and in
    later rounds), each call waiting out provider_timeout again while the earlier ones still ran: a
    restore of k chunks from a hung provider took k deadlines, not one."""
    import threading
    import time

    rows = make_rows(alice, 4, label="h")
    release = threading.Event()
    calls: list[int] = []

    class Hung(ArrowProvider):
        def request(self, group, message_ids):
            calls.append(len(message_ids))
            release.wait(30)
            return super().request(group, message_ids)

    class Forger(ArrowProvider):  # serves h-0 forged: its key goes back to the next provider, not to Hung
        def request(self, group, message_ids):
            out = super().request(group, message_ids).to_pylist()
            for r in out:
                r["payload"] = b"forged"
            return pa.Table.from_pylist(out, schema=self.rows.schema)

    try:
        began = time.monotonic()
        report = restore("g", [Forger(table(rows[:1]), "forger"), Hung(table(rows), "hung"),
                               ArrowProvider(table(rows), "honest")],
                         provider_timeout=0.5, request_chunk=1)
        assert time.monotonic() - began < 2.5
        assert len(calls) == 1                                # one deadline waited out, not one per chunk
        assert sorted(report.delivered_ids) == ["h-0", "h-1", "h-2", "h-3"] and report.missing == []
        assert report.requested["hung"] == 1 and report.requested["honest"] == 4
        hung = [r for r in report.rejected if r.provider == "hung"]
        assert len(hung) == 4 and all("0.5" in r.reason for r in hung)
    finally:
        release.set()


def test_a_provider_that_never_takes_its_ignores_does_not_hold_the_restore(alice):
    """ignore() was called with no deadline (announce and request had provider_timeout): a provider that
    answered its announce and then hung on the ignore held the restore forever."""
    import threading
    import time

    rows = make_rows(alice, 3, label="i")
    release = threading.Event()

    class Deaf(ArrowProvider):
        def ignore(self, group, message_ids):
            release.wait(30)

        def request(self, group, message_ids):
            raise AssertionError("asked after it hung")

    try:
        began = time.monotonic()
        # Deaf announced i-1 and i-2 first, so they are requested from it; i-0 the member has (ignored).
        have = Have(message_ids=frozenset({"i-0"}))
        report = restore("g", [Deaf(table(rows), "deaf"), ArrowProvider(table(rows), "honest")], have=have,
                         provider_timeout=0.5)
        assert time.monotonic() - began < 5
        assert sorted(report.delivered_ids) == ["i-1", "i-2"] and report.missing == []
        assert report.requested == {"honest": 2}
    finally:
        release.set()
