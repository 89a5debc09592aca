"""The set of members heard of second-hand (group/manager.py _Pending): per-voucher and overall caps."""

from __future__ import annotations

from zerocomm_spark.group.manager import _Pending
from zerocomm_spark.group.view import ACTIVE, MemberEntry


def _entry(n: int) -> MemberEntry:
    return MemberEntry(did=f"did:key:z{n}", label="", role="read_write", status=ACTIVE, peer_endpoint="",
                       publish_endpoint="", group_verkey="", transport_key="", invitation="", version=1)


def test_a_voucher_over_its_cap_loses_its_own_oldest() -> None:
    pending = _Pending()
    pending.put(_entry(0), "carol", per_voucher=3, total=100)
    for n in range(1, 11):
        pending.put(_entry(n), "bob", per_voucher=3, total=100)
    assert [e.did for e in pending.values()] == ["did:key:z0", "did:key:z8", "did:key:z9", "did:key:z10"]


def test_when_full_the_voucher_holding_most_gives_way() -> None:
    pending = _Pending()
    for n in range(3):
        pending.put(_entry(n), "carol", per_voucher=8, total=10)
    for n in range(10, 30):
        pending.put(_entry(n), "bob", per_voucher=8, total=10)
    assert len(pending) == 10
    assert {e.did for e in pending.values()} >= {"did:key:z0", "did:key:z1", "did:key:z2"}
    for n in range(30, 40):  # a third voucher: its fair share comes out of bob's, the largest
        pending.put(_entry(n), "dave", per_voucher=8, total=10)
    held = sorted(int(e.did.removeprefix("did:key:z")) for e in pending.values())
    assert held == [0, 1, 2, 27, 28, 29, 36, 37, 38, 39]  # carol 3 (untouched), bob 3, dave 4


def test_pop_and_replace_keep_the_books() -> None:
    pending = _Pending()
    pending.put(_entry(1), "bob", per_voucher=1, total=10)
    pending.put(_entry(1), "carol", per_voucher=1, total=10)  # a newer version vouched by someone else
    pending.put(_entry(2), "bob", per_voucher=1, total=10)
    assert {e.did for e in pending.values()} == {"did:key:z1", "did:key:z2"}
    assert pending.pop("did:key:z1") is not None and pending.pop("did:key:z1") is None
    pending.put(_entry(3), "carol", per_voucher=1, total=10)
    assert len(pending) == 2 and pending.get("did:key:z2") is not None
