"""Group views: signed entries, the membership checksum, merge by version, and status sections (zstd)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import zstandard

from zerocomm_spark.envelope import pack
from zerocomm_spark.errors import EnvelopeError, MalformedGroupMessageError, NoRecipientKeyError, SignatureError
from zerocomm_spark.group.view import (
    ACTIVE,
    JOINING,
    LEFT,
    GroupView,
    MemberEntry,
    StatusSection,
    member_did_for,
    next_version,
    open_status,
    parse_entries,
    seal_status,
)
from zerocomm_spark.keys.keypair import KeyPair


def _entry(key: KeyPair, *, label: str = "m", status: str = ACTIVE, role: str = "read_write", version: int = 1,
           transport: str = "T" * 40, endpoint: str = "tcp://127.0.0.1:5000", group: str = "g") -> MemberEntry:
    return MemberEntry(did=member_did_for(key.verkey), label=label, role=role, status=status,
                       peer_endpoint="tcp://127.0.0.1:4000", publish_endpoint=endpoint,
                       group_verkey=KeyPair.generate().verkey, transport_key=transport,
                       invitation="https://zerocomm.invalid/?oob=x", version=version, group=group).signed(key)


@pytest.fixture(scope="module")
def keys() -> list[KeyPair]:
    return [KeyPair.generate() for _ in range(4)]


# --- entries -----------------------------------------------------------------------------------


def test_an_entry_is_signed_as_an_entry_of_one_group(keys: list[KeyPair]) -> None:
    """A member has one DID and key for all its groups: its entry of one group, replayed in another by
    a member of both (its "left" there, say), must not pass for an entry of that group."""
    other = _entry(keys[0], status=LEFT, version=9, group="other")
    assert other.verify() is other and other.verify("other") is other
    with pytest.raises(SignatureError, match="not of this group"):
        other.verify("g")
    assert parse_entries([other.to_dict()], group="g", skip_invalid=True) == []
    with pytest.raises(SignatureError):  # the group is under the signature: it cannot be changed
        replace(other, group="g").verify("g")


def test_an_entry_is_signed_by_the_key_its_did_names(keys: list[KeyPair]) -> None:
    entry = _entry(keys[0])
    assert entry.verify() is entry
    round_trip = MemberEntry.from_dict(json.loads(json.dumps(entry.to_dict())))
    assert round_trip == entry and round_trip.verify()
    with pytest.raises(SignatureError):
        replace(entry, signature="").signed(keys[1])  # only the DID's own key may sign


@pytest.mark.parametrize("field,value", [("role", "read_only"), ("status", LEFT), ("version", 99),
                                         ("transport_key", "U" * 40), ("publish_endpoint", "tcp://10.0.0.1:1"),
                                         ("label", "mallory")])
def test_any_change_breaks_the_signature(keys: list[KeyPair], field: str, value: object) -> None:
    forged = replace(_entry(keys[0]), **{field: value})
    with pytest.raises(SignatureError):
        forged.verify()


def test_an_entry_cannot_be_reattributed_to_another_did(keys: list[KeyPair]) -> None:
    entry = _entry(keys[0])
    with pytest.raises(SignatureError):
        replace(entry, did=member_did_for(keys[1].verkey)).verify()


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("did"),
    lambda d: d.update(version=-1),
    lambda d: d.update(version=True),
    lambda d: d.update(role="admin"),
    lambda d: d.update(status="inactive"),  # inactive is local, never announced
    lambda d: d.update(did="did:peer:2.xyz"),
    lambda d: d.update(ticket="not an object"),
    lambda d: d.update(label=7),
    # keys others encrypt to: one unusable key would fail every shared-mode batch sealed for all members
    lambda d: d.update(group_verkey="1" * 44),  # base58, 32 bytes, but not a point with an X25519 form
    lambda d: d.update(group_verkey="0OIl" * 11),  # not base58
    lambda d: d.update(group_verkey="2" * 300),
    lambda d: d.update(transport_key="T" * 39),
    # JSON may spell a lone surrogate ("\\ud800"); signing or hashing the entry raised UnicodeEncodeError
    lambda d: d.update(label="m\ud800"),
    lambda d: d.update(invitation="\udc00"),
    lambda d: d.update(ticket={"by": "\ud800"}),
])
def test_malformed_entries_are_refused_naming_the_field(keys: list[KeyPair], mutate) -> None:  # type: ignore[no-untyped-def]
    data = _entry(keys[0]).to_dict()
    mutate(data)
    with pytest.raises(MalformedGroupMessageError, match="field"):
        MemberEntry.from_dict(data)


def test_parse_entries_verifies_every_signature(keys: list[KeyPair]) -> None:
    good = _entry(keys[0]).to_dict()
    bad = dict(_entry(keys[1]).to_dict(), label="forged")
    assert len(parse_entries([good])) == 1
    with pytest.raises(SignatureError):
        parse_entries([good, bad])
    assert len(parse_entries([good, bad], verify=False)) == 2


def test_an_entry_with_a_lone_surrogate_is_skipped_alone_in_a_view(keys: list[KeyPair]) -> None:
    good = _entry(keys[0]).to_dict()
    hostile = json.loads(json.dumps(dict(_entry(keys[1]).to_dict(), label="\ud800")))
    assert parse_entries([good, hostile], skip_invalid=True) == [MemberEntry.from_dict(good)]
    with pytest.raises(MalformedGroupMessageError):
        parse_entries([good, hostile])


def test_next_version_grows_even_past_a_version_from_the_future() -> None:
    now = next_version()
    assert next_version(now) > now
    future = now + 10**9
    assert next_version(future) == future + 1


def test_repr_shows_no_keys(keys: list[KeyPair]) -> None:
    entry = _entry(keys[0], transport="Z" * 40)
    assert "Z" * 40 not in repr(entry) and entry.group_verkey not in repr(entry)


# --- checksum and merge --------------------------------------------------------------------------


def test_checksum_is_about_who_is_in_the_group(keys: list[KeyPair]) -> None:
    a, b, c = (_entry(k, label=n) for k, n in zip(keys, "abc"))
    view = GroupView("g", [a, b, c])
    shuffled = [c, a, b]
    assert GroupView("g", shuffled).checksum() == view.checksum()  # order does not matter
    assert GroupView("other", [a, b, c]).checksum() != view.checksum()  # the group's name does
    assert GroupView("g", [a, b]).checksum() != view.checksum()  # an extra member does
    # a joiner not yet announced, or a member that left, is not in the group
    joining = _entry(keys[3], status=JOINING)
    assert GroupView("g", [a, b, c, joining]).checksum() == view.checksum()
    left = GroupView("g", [a, b, c])
    left.merge(_entry(keys[2], label="c", status=LEFT, version=2))
    assert left.checksum() == GroupView("g", [a, b]).checksum()


def test_checksum_ignores_roles_labels_and_endpoints_but_not_keys(keys: list[KeyPair]) -> None:
    a, b = _entry(keys[0]), _entry(keys[1])
    base = GroupView("g", [a, b]).checksum()
    relabelled = GroupView("g", [a, replace(b, label="b2", role="read_only", publish_endpoint="tcp://h:9",
                                               version=2).signed(keys[1])])
    assert relabelled.checksum() == base
    rekeyed = GroupView("g", [a, replace(b, transport_key="K" * 40, version=2).signed(keys[1])])
    assert rekeyed.checksum() != base


def test_merge_by_version_is_idempotent_and_commutative(keys: list[KeyPair]) -> None:
    versions = [_entry(keys[0], version=v, role=r) for v, r in ((1, "read_only"), (2, "read_write"), (3, "read_only"))]
    others = [_entry(k) for k in keys[1:]]
    reference = GroupView("g", [*versions, *others])
    for _ in range(10):
        items = [*versions, *others]
        random.shuffle(items)
        assert GroupView("g", items).entries() == reference.entries()
    view = GroupView("g", others)
    assert view.merge(versions[2]) is versions[2]  # new
    before = view.entries()
    assert view.merge(versions[2]) is None  # the same again: nothing changes
    assert view.merge(versions[0]) is None  # an older one: nothing changes
    assert view.entries() == before
    assert view.get(versions[2].did).role == "read_only"


def test_digest_helpers_say_what_to_send_and_what_to_pull(keys: list[KeyPair]) -> None:
    a1, a2 = _entry(keys[0], version=1), _entry(keys[0], version=2)
    b, c = _entry(keys[1]), _entry(keys[2])
    mine, theirs = GroupView("g", [a2, b]), GroupView("g", [a1, b, c])
    assert [e.did for e in mine.newer_than(theirs.versions())] == [a2.did]
    assert mine.wanted_from(theirs.versions()) == [c.did]
    assert mine.state_hash() != theirs.state_hash()
    for entry in mine.newer_than(theirs.versions()):
        theirs.merge(entry)
    for did in mine.wanted_from(theirs.versions()):
        mine.merge(theirs.get(did))  # type: ignore[arg-type]
    assert mine.state_hash() == theirs.state_hash() and mine.checksum() == theirs.checksum()


# --- status sections -------------------------------------------------------------------------------


class _Member:
    """A member with a relationship key per peer, as DID exchange leaves them."""

    def __init__(self) -> None:
        self.key = KeyPair.generate()
        self.did = member_did_for(self.key.verkey)
        self.rel: dict[str, KeyPair] = {}  # peer DID -> our relationship key with it
        self.keys: dict[str, KeyPair] = {}

    def relate(self, other: "_Member", exchange_id: str) -> None:
        mine, theirs = KeyPair.generate(), KeyPair.generate()
        self.rel[other.did], other.rel[self.did] = mine, theirs
        self.keys[mine.verkey], other.keys[theirs.verkey] = mine, theirs
        self.exchange = getattr(self, "exchange", {})
        other.exchange = getattr(other, "exchange", {})
        self.exchange[other.did] = other.exchange[self.did] = exchange_id


def _trio() -> tuple[_Member, _Member, _Member, _Member]:
    a, b, c, eve = _Member(), _Member(), _Member(), _Member()
    a.relate(b, "x-ab")
    a.relate(c, "x-ac")
    b.relate(c, "x-bc")
    return a, b, c, eve


def _sections(sender: _Member, *to: _Member) -> list[StatusSection]:
    return [StatusSection(sender.exchange[m.did], m.rel[sender.did].verkey, sender.rel[m.did]) for m in to]


def test_one_status_message_with_a_section_per_member(keys: list[KeyPair]) -> None:
    a, b, c, eve = _trio()
    entry = _entry(a.key, label="a", role="read_only", version=5)
    blob = seal_status("g", a.did, [entry], _sections(a, b, c))
    assert blob[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame
    outer = json.loads(zstandard.ZstdDecompressor().decompress(blob))
    assert set(outer["sections"]) == {"x-ab", "x-ac"}  # keyed by exchange id: no DID, no key in clear
    assert a.did not in json.dumps(outer) and b.did not in json.dumps(outer)
    for member in (b, c):
        opened = open_status("g", blob, {member.exchange[a.did]: a.rel[member.did].verkey}, member.keys.get)
        assert opened is not None and opened.sender_did == a.did and opened.entries == [entry]
    # someone with no section finds nothing for it, and cannot read the others'
    assert open_status("g", blob, {"x-ae": KeyPair.generate().verkey}, eve.keys.get) is None
    with pytest.raises(NoRecipientKeyError):
        open_status("g", blob, {"x-ab": a.rel[b.did].verkey}, eve.keys.get)


def test_applying_a_status_twice_changes_nothing() -> None:
    a, b, c, _ = _trio()
    view = GroupView("g", [_entry(a.key, version=1), _entry(b.key), _entry(c.key)])
    update = _entry(a.key, role="read_only", version=2)
    blob = seal_status("g", a.did, [update], _sections(a, b, c))
    opened = open_status("g", blob, {"x-ab": a.rel[b.did].verkey}, b.keys.get)
    assert opened is not None
    assert [view.merge(e) for e in opened.entries] != [None]
    after_first = (view.entries(), view.checksum(), view.state_hash())
    again = open_status("g", blob, {"x-ab": a.rel[b.did].verkey}, b.keys.get)
    assert again is not None
    assert [view.merge(e) for e in again.entries] == [None]
    assert (view.entries(), view.checksum(), view.state_hash()) == after_first


def test_a_section_must_come_from_the_member_its_exchange_belongs_to() -> None:
    a, b, c, _ = _trio()
    # c packs a section for b but files it under the exchange id b shares with a
    forged = seal_status("g", c.did, [_entry(a.key)], [StatusSection("x-ab", b.rel[c.did].verkey, c.rel[b.did])])
    with pytest.raises(EnvelopeError, match="exchange id"):
        open_status("g", forged, {"x-ab": a.rel[b.did].verkey}, b.keys.get)


def test_a_section_cannot_be_moved_to_another_status_message() -> None:
    a, b, c, _ = _trio()
    first = json.loads(zstandard.ZstdDecompressor().decompress(seal_status("g", a.did, [_entry(a.key)], _sections(a, b))))
    second = json.loads(zstandard.ZstdDecompressor().decompress(seal_status("g", a.did, [_entry(a.key)], _sections(a, b))))
    second["sections"]["x-ab"] = first["sections"]["x-ab"]
    spliced = zstandard.ZstdCompressor().compress(json.dumps(second).encode())
    with pytest.raises(MalformedGroupMessageError, match="moved"):
        open_status("g", spliced, {"x-ab": a.rel[b.did].verkey}, b.keys.get)


def test_a_status_for_another_group_or_broken_blob_is_refused() -> None:
    a, b, c, _ = _trio()
    blob = seal_status("g", a.did, [_entry(a.key)], _sections(a, b))
    mine = {"x-ab": a.rel[b.did].verkey}
    with pytest.raises(MalformedGroupMessageError):
        open_status("h", blob, mine, b.keys.get)
    with pytest.raises(MalformedGroupMessageError):
        open_status("g", b"not zstd at all", mine, b.keys.get)
    with pytest.raises(MalformedGroupMessageError):
        open_status("g", zstandard.ZstdCompressor().compress(b"[1,2]"), mine, b.keys.get)
    # a section holding a lone surrogate (valid JSON, but no UTF-8 text): refused, not UnicodeEncodeError
    outer = json.loads(zstandard.ZstdDecompressor().decompress(blob))
    outer["sections"]["x-ab"]["iv"] = "\ud800"
    with pytest.raises(MalformedGroupMessageError):
        open_status("g", zstandard.ZstdCompressor().compress(json.dumps(outer).encode()), mine, b.keys.get)
    # a section whose plaintext is not a status
    env = json.loads(pack(b'{"@type":"x"}', [a.rel[b.did].verkey], sender=b.rel[a.did]))
    outer = {"@type": "https://didcomm.org/zerocomm-group/1.0/status-sections", "@id": "1", "group": "g",
             "sections": {"x-ab": env}}
    with pytest.raises((MalformedGroupMessageError, EnvelopeError)):
        open_status("g", zstandard.ZstdCompressor().compress(json.dumps(outer).encode()), mine, b.keys.get)


def test_a_decompression_bomb_is_refused() -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(b" " * (17 * 1024 * 1024))
    assert len(bomb) < 10_000
    with pytest.raises(MalformedGroupMessageError, match="decompresses"):
        open_status("g", bomb, {}, lambda _: None)


def test_compression_pays_off_for_large_groups() -> None:
    sender = _Member()
    members = [_Member() for _ in range(25)]
    for i, m in enumerate(members):
        sender.relate(m, f"exchange-{i:04d}-{'0' * 24}")
    entries = [_entry(sender.key)]
    blob = seal_status("g", sender.did, entries, _sections(sender, *members))
    raw = zstandard.ZstdDecompressor().decompress(blob)
    assert len(blob) < 0.8 * len(raw)


def test_a_view_with_one_unusable_entry_keeps_the_others_where_asked(keys: list[KeyPair]) -> None:
    """A saved view (or a peer's repair answer) holding one entry an older version accepted must not
    cost the whole view: loading it refused it all, and the member forgot the group at restart."""
    good = _entry(keys[0]).to_dict()
    bad = dict(_entry(keys[1]).to_dict(), group_verkey="1" * 44)
    with pytest.raises(MalformedGroupMessageError, match="group_verkey"):
        parse_entries([good, bad])
    assert [e.did for e in parse_entries([good, bad], skip_invalid=True)] == [good["did"]]
    forged = dict(_entry(keys[2]).to_dict(), label="forged")
    assert [e.did for e in parse_entries([forged, good], skip_invalid=True)] == [good["did"]]


def test_a_status_that_inflates_far_beyond_what_sealed_sections_do_is_refused() -> None:
    """Sealed sections are ciphertext (zstd shrinks a real status by ~1.6): a small frame inflating to
    16 MiB is a bomb, refused before it is inflated; a status of many sections still opens."""
    a, b, c, _ = _trio()
    bomb = zstandard.ZstdCompressor(level=19).compress(b'{"pad":"' + b"a" * (16 * 1024 * 1024 - 20) + b'"}')
    with pytest.raises(MalformedGroupMessageError, match="decompresses to more than"):
        open_status("g", bomb, {"x-ab": a.rel[b.did].verkey}, b.keys.get)
    many = [StatusSection(f"x-{i:036d}", KeyPair.generate().verkey, KeyPair.generate()) for i in range(300)]
    entry = _entry(a.key, version=7)
    blob = seal_status("g", a.did, [entry], [*_sections(a, b, c), *many])
    opened = open_status("g", blob, {"x-ab": a.rel[b.did].verkey}, b.keys.get)
    assert opened is not None and opened.entries == [entry]
