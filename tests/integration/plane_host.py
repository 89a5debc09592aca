"""Hosts several group data planes in one process, driven by JSON lines on stdin (test_group_scale.py).

Each plane is a complete member minus membership: its own keystore, PeerTransport, CURVE key pair
and DataPlane (real sockets, CURVE, envelopes). The test wires the planes of all hosts to each
other the way membership would (every plane adds every other as a RemoteMember), so a 64-member
group fits in a few processes on a 2-core machine.

One request per line, ``{"op": ..., "id": ..., ...}``; one answer per line, with the same id:
``{"id": ..., "ok": true, "result": ...}`` or ``{"id": ..., "ok": false, "error": "<class>", "message": "..."}``. Ops:

* ``start`` {n, prefix, dir, config}: start n planes; returns their public particulars.
* ``open`` {group, mode}: open the group on every plane (a group key each); returns DID -> group verkey.
* ``add`` {group, members, to?}: every local plane (or only the local DIDs listed in ``to``) adds
  every member of ``members`` but itself; returns the seconds it took.
* ``probe`` {group, did, within}: plane ``did`` probes every other member of the group, in parallel.
* ``publish`` {group, did, n, per_call, within}: plane ``did`` publishes payloads ``"<i>"``
  (i = 0..n-1), ``per_call`` per publish() call, and waits until every member acked them.
* ``collect`` {group, publisher, n, within}: waits until every local plane delivered n messages of
  ``publisher`` in ``group`` (deadline ``within``); returns per plane what it got, checked.
* ``close_group`` {group}, ``stats`` {}, ``exit`` {}.

Logs go to stderr and name DIDs and counts only: no keys, no payloads.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from zerocomm_spark.group import DataPlane, DataPlaneConfig, Delivered, RemoteMember
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.keys.keystore import Keystore
from zerocomm_spark.transport.peer import PeerTransport

log = logging.getLogger("plane_host")


@dataclass
class Plane:
    did: str
    ks: Keystore
    tr: PeerTransport
    curve: tuple[bytes, bytes]
    rel: KeyPair  # this member's relationship key, used with every other member here
    dp: DataPlane | None = None
    group_keys: dict[str, KeyPair] = field(default_factory=dict)
    got: dict[tuple[str, str], list[Delivered]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def deliver(self, d: Delivered) -> None:
        with self.cond:
            self.got.setdefault((d.group, d.publisher_did), []).append(d)
            self.cond.notify_all()

    def info(self) -> dict[str, Any]:
        assert self.dp is not None
        return {"did": self.did, "relationship_verkey": self.rel.verkey, "publish_endpoint": self.dp.publish_endpoint,
                "transport_key": self.curve[0].decode("ascii"), "peer_endpoint": self.tr.endpoint}


class Host:
    def __init__(self) -> None:
        self.planes: dict[str, Plane] = {}
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="plane-host")

    def _all(self, fn: Any, planes: list[Plane] | None = None) -> list[Any]:
        """Run ``fn(plane)`` for every plane in parallel; re-raise the first failure."""
        return list(self.pool.map(fn, planes if planes is not None else list(self.planes.values())))

    def start(self, n: int, prefix: str, dir: str, config: dict[str, Any]) -> list[dict[str, Any]]:
        cfg = DataPlaneConfig(**config)

        def make(i: int) -> Plane:
            did = f"did:example:{prefix}{i}"
            ks = Keystore.open(Path(dir) / f"{prefix}{i}")
            tr = PeerTransport(workers=2).start()
            plane = Plane(did, ks, tr, zmq.curve_keypair(), ks.create_key("relationship", ref="all"))
            plane.dp = DataPlane(member_did=did, keystore=ks, transport=tr, curve_keypair=plane.curve,
                                 on_deliver=plane.deliver, config=cfg).start()
            return plane

        for plane in self.pool.map(make, range(n)):
            self.planes[plane.did] = plane
        return [p.info() for p in self.planes.values()]

    def open(self, group: str, mode: str) -> dict[str, str]:
        def one(p: Plane) -> tuple[str, str]:
            if group not in p.group_keys:
                p.group_keys[group] = p.ks.create_key("group", ref=group)
            assert p.dp is not None
            p.dp.open_group(group, mode=mode, ordered=True, group_key=p.group_keys[group],  # type: ignore[arg-type]
                            role="read_write")
            return p.did, p.group_keys[group].verkey

        return dict(self._all(one))

    def add(self, group: str, members: list[dict[str, Any]], to: list[str] | None = None) -> float:
        start = time.monotonic()

        def one(p: Plane) -> None:
            assert p.dp is not None
            for m in members:
                if m["did"] != p.did:
                    p.dp.add_member(group, RemoteMember(my_relationship_verkey=p.rel.verkey, **m))

        targets = [p for p in self.planes.values() if to is None or p.did in to]
        self._all(one, targets)
        return time.monotonic() - start

    def probe(self, group: str, did: str, within: float) -> float:
        plane = self.planes[did]
        assert plane.dp is not None
        others = [m.did for m in plane.dp.members(group)]
        start = time.monotonic()
        list(self.pool.map(lambda other: plane.dp.probe(group, other, timeout=within), others))  # type: ignore[union-attr]
        return time.monotonic() - start

    def publish(self, group: str, did: str, n: int, per_call: int, within: float) -> dict[str, Any]:
        dp = self.planes[did].dp
        assert dp is not None
        payloads = [str(i).encode() for i in range(n)]
        start = time.monotonic()
        receipt = None
        for i in range(0, n, per_call):
            receipt = dp.publish(group, payloads[i:i + per_call], timeout=within)
        published = time.monotonic() - start
        assert receipt is not None
        receipt.wait(within)
        return {"published_s": published, "acked_s": time.monotonic() - start}

    def collect(self, group: str, publisher: str, n: int, within: float) -> dict[str, Any]:
        deadline = time.monotonic() + within
        expected = [str(i).encode() for i in range(n)]
        out: dict[str, Any] = {}
        for p in self.planes.values():
            if p.did == publisher:
                continue
            with p.cond:
                while len(p.got.get((group, publisher), [])) < n:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    p.cond.wait(min(remaining, 0.2))
                got = list(p.got.get((group, publisher), []))
            out[p.did] = {
                "count": len(got),
                "seqs_in_order": [d.seq for d in got] == list(range(1, len(got) + 1)),
                "payloads_match": [d.payload for d in got] == expected[:len(got)],
                "unique_ids": len({d.message_id for d in got}) == len(got),
                "last_delivered_at": max((d.received_at for d in got), default=0.0),
            }
        return out

    def close_group(self, group: str) -> None:
        def one(p: Plane) -> None:
            assert p.dp is not None
            p.dp.close_group(group)

        self._all(one)

    def stats(self) -> dict[str, dict[str, int]]:
        return {p.did: {k: v for k, v in p.dp.stats().items() if isinstance(v, int)}  # type: ignore[union-attr]
                for p in self.planes.values()}

    def exit(self) -> None:
        def one(p: Plane) -> None:
            if p.dp is not None:
                p.dp.close(2)
            p.tr.close(2)
            p.ks.close()

        self._all(one)


def main() -> int:
    logging.basicConfig(level=os.environ.get("PLANE_HOST_LOG", "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s")
    host = Host()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        rid = request.pop("id", None)
        try:
            result = getattr(host, op)(**request)
            answer = {"id": rid, "ok": True, "result": result}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            log.exception("%s failed", op)
            answer = {"id": rid, "ok": False, "error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(answer), flush=True)
        if op == "exit":
            return 0
    host.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
