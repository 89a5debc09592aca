"""Throughput of the group data plane: one publisher to N members, each member its own process.

Real sockets (CURVE on loopback), real envelopes, real acks. Prints one JSON line.
Run: python bench_dataplane.py --members 8 --mode shared --messages 100000 --size 100 --per-call 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time


def _member(idx: int, mode: str, total: int, conn) -> None:  # runs in a child process
    import zmq

    from zerocomm_spark.group import DataPlane, RemoteMember
    from zerocomm_spark.keys.keystore import Keystore
    from zerocomm_spark.transport.peer import PeerTransport

    did = f"did:example:member{idx}"
    tmp = tempfile.mkdtemp(prefix="zc-bench-")
    ks = Keystore.open(tmp)
    tr = PeerTransport().start()
    curve = zmq.curve_keypair()
    count = [0]
    done = threading.Event()
    first = [0.0]

    def on_deliver(d) -> None:
        count[0] += 1
        if count[0] == 1:
            first[0] = time.time()
        if count[0] >= total:
            done.set()

    dp = DataPlane(member_did=did, keystore=ks, transport=tr, curve_keypair=curve, on_deliver=on_deliver).start()
    gk = ks.create_key("group", ref="bench")
    rel = ks.create_key("relationship")
    dp.open_group("bench", mode=mode, ordered=True, group_key=gk, role="read_write")
    conn.send({"did": did, "group_verkey": gk.verkey, "relationship_verkey": rel.verkey,
               "publish_endpoint": dp.publish_endpoint, "transport_key": curve[0].decode(),
               "peer_endpoint": tr.endpoint})
    pub = conn.recv()
    dp.add_member("bench", RemoteMember(my_relationship_verkey=rel.verkey, **pub))
    conn.send("ready")
    cpu0 = time.process_time()
    done.wait(600)
    conn.send({"count": count[0], "done_at": time.time(), "first_at": first[0], "cpu_s": time.process_time() - cpu0, "threads": thread_cpu(), "stats": {
        k: v for k, v in dp.stats().items() if isinstance(v, int)}})
    conn.recv()  # publisher finished: close
    dp.close(2)
    tr.close(2)
    ks.close()


def thread_cpu() -> dict[str, float]:
    """CPU seconds per live thread of this process, by thread name (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    names = {th.native_id: th.name for th in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "native")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--mode", default="shared", choices=("shared", "single", "multi"))
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--per-call", type=int, default=1, help="payloads per publish() call")
    args = ap.parse_args()

    import zmq

    from zerocomm_spark.group import DataPlane, RemoteMember
    from zerocomm_spark.keys.keystore import Keystore
    from zerocomm_spark.transport.peer import PeerTransport

    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for i in range(args.members):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_member, args=(i, args.mode, args.messages, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)

    tmp = tempfile.mkdtemp(prefix="zc-bench-pub-")
    ks = Keystore.open(tmp)
    tr = PeerTransport().start()
    curve = zmq.curve_keypair()
    dp = DataPlane(member_did="did:example:publisher", keystore=ks, transport=tr, curve_keypair=curve,
                   on_deliver=lambda d: None).start()
    gk = ks.create_key("group", ref="bench")
    dp.open_group("bench", mode=args.mode, ordered=True, group_key=gk, role="read_write")
    infos = [c.recv() for c in pipes]
    for conn, info in zip(pipes, infos):
        mine = ks.create_key("relationship")
        dp.add_member("bench", RemoteMember(my_relationship_verkey=mine.verkey, **info))
        conn.send({"did": "did:example:publisher", "group_verkey": gk.verkey, "relationship_verkey": mine.verkey,
                   "publish_endpoint": dp.publish_endpoint, "transport_key": curve[0].decode(),
                   "peer_endpoint": tr.endpoint})
    for c in pipes:
        assert c.recv() == "ready"
    for info in infos:
        dp.probe("bench", info["did"], timeout=30)

    payload = os.urandom(args.size)
    batch = [payload] * args.per_call
    calls = args.messages // args.per_call
    start = time.time()
    cpu0 = time.process_time()
    receipt = None
    for _ in range(calls):
        receipt = dp.publish("bench", batch, timeout=120)
    published = time.time()
    pub_cpu = time.process_time() - cpu0
    results = [c.recv() for c in pipes]
    delivered = max(r["done_at"] for r in results)
    assert receipt is not None
    receipt.wait(120)
    acked = time.time()
    total = calls * args.per_call
    out = {
        "bench": "group_dataplane_throughput",
        "mode": args.mode,
        "members": args.members,
        "messages": total,
        "payload_bytes": args.size,
        "per_publish_call": args.per_call,
        "cpus": os.cpu_count(),
        "publish_rate_msg_s": round(total / (published - start)),
        "delivered_to_all_msg_s": round(total / (delivered - start)),
        "acked_by_all_s": round(acked - start, 3),
        "all_delivered": all(r["count"] >= total for r in results),
        "cpu_us_per_msg": {"publisher_until_published": round(pub_cpu / total * 1e6, 1),
                           "each_member": round(sum(r["cpu_s"] for r in results) / len(results) / total * 1e6, 1)},
        "publisher": {k: v for k, v in dp.stats().items()
                      if k in ("envelopes_out", "retransmits", "heartbeats", "backpressure_waits")},
        "members_retransmit_requests": sum(r["stats"].get("nacks_sent", 0) for r in results),
        "members_duplicates": sum(r["stats"].get("duplicates_dropped", 0) for r in results),
    }
    agg: dict[str, float] = {}
    for r in results:
        for k, v in r["threads"].items():
            agg[k] = agg.get(k, 0.0) + v / len(results)
    out["member_thread_cpu_s"] = {k: round(v, 2) for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:6]}
    out["publisher_thread_cpu_s"] = {k: round(v, 2) for k, v in sorted(thread_cpu().items(), key=lambda kv: -kv[1])[:8]}
    print(json.dumps(out))
    for c in pipes:
        c.send("bye")
    for p in procs:
        p.join(10)
    dp.close(2)
    tr.close(2)
    ks.close()


if __name__ == "__main__":
    sys.exit(main())
