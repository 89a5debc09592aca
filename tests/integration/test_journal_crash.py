"""kill -9 a process in the middle of a burst of appends: every acknowledged row survives, once.

The child process (this file run as a script) appends a deterministic burst from several threads (so
appends are group-committed) and prints one line per append that *returned*. The test kills it with
SIGKILL at a random moment, reopens the journal, and checks: every acknowledged row is there exactly
once, nothing is duplicated, offsets are contiguous, each publisher's rows are a gap-free prefix,
and re-appending the whole burst adds exactly the missing rows. Several kill/restart rounds run on
the same directory, each child re-sending the burst from the start as a restarted member would.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

PUBLISHERS = 4
MESSAGES = 2500  # per publisher
T0 = 1_700_000_000_000_000


def burst(seed: int) -> dict[int, list[list[dict]]]:
    """Per publisher, its messages cut into appends of random sizes (the same for a given seed)."""
    rng = random.Random(seed)
    out: dict[int, list[list[dict]]] = {}
    for p in range(PUBLISHERS):
        did = f"did:peer:2.Ez6LSpublisher{p}"
        messages = [{
            "group": "crash-group", "message_id": f"m-{p}-{s}", "publisher_did": did, "seq": s,
            "lamport_ts": s, "sent_at": T0 + s, "received_at": T0 + s,
            "payload": (f"{p}:{s}:".encode() * 400)[: rng.randint(10, 3000)],
        } for s in range(1, MESSAGES + 1)]
        chunks, i = [], 0
        while i < len(messages):
            n = rng.randint(1, 60)
            chunks.append(messages[i:i + n])
            i += n
        out[p] = chunks
    return out


def child(directory: str, key_hex: str, seed: int, policy: str) -> None:
    from zerocomm_spark.journal import Journal

    plan = burst(seed)
    lock = threading.Lock()
    # Small segments: many rolls, so kills land in them too.
    journal = Journal.open(directory, key=bytes.fromhex(key_hex), fsync=policy, segment_bytes=96 << 10)

    def publish(p: int) -> None:
        for chunk in plan[p]:
            r = journal.append(chunk)
            seqs = f"{chunk[0]['seq']} {chunk[-1]['seq']}"
            line = f"ACK {p} {seqs} {r.first_offset} {r.last_offset} {r.appended} {r.duplicates}\n"
            with lock:
                sys.stdout.write(line)
                sys.stdout.flush()

    threads = [threading.Thread(target=publish, args=(p,)) for p in range(PUBLISHERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("DONE", flush=True)
    time.sleep(60)  # wait to be killed: never close cleanly


def run_and_kill(directory: Path, key: bytes, seed: int, policy: str, kill_after: float) -> list[tuple[int, ...]]:
    proc = subprocess.Popen(
        [sys.executable, __file__, str(directory), key.hex(), str(seed), policy],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    acks: list[tuple[int, ...]] = []
    first_ack = threading.Event()

    def collect() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ACK"):
                acks.append(tuple(int(x) for x in line.split()[1:]))
                first_ack.set()
            elif line.startswith("DONE"):
                first_ack.set()

    reader = threading.Thread(target=collect, daemon=True)
    reader.start()
    try:
        assert first_ack.wait(60), proc.stderr.read() if proc.poll() is not None else "no ack within 60 s"
        time.sleep(kill_after)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        reader.join(30)
    assert proc.returncode == -signal.SIGKILL
    return acks


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["interval", "always"])
def test_every_acknowledged_append_survives_sigkill_exactly_once(tmp_path: Path, policy: str) -> None:
    import nacl.utils

    from zerocomm_spark.journal import Journal

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    plan = burst(seed)
    expected = {r["message_id"]: r for chunks in plan.values() for c in chunks for r in c}
    key = nacl.utils.random(32)
    directory = tmp_path / "journal"
    all_acks: list[tuple[int, ...]] = []
    for round_ in range(3):
        kill_after = rng.uniform(0.02, 1.2)
        acks = run_and_kill(directory, key, seed, policy, kill_after)
        context = f"seed={seed} round={round_} kill_after={kill_after:.3f}s acks={len(acks)}"
        assert acks, context
        all_acks.extend(acks)
        with Journal.open(directory, key=key) as journal:
            table = journal.read(0)
            ids = table.column("message_id").to_pylist()
            assert table.column("offset").to_pylist() == list(range(table.num_rows)), context
            assert len(ids) == len(set(ids)), f"duplicated rows: {context}"
            present = set(ids)
            by_offset = dict(zip(table.column("offset").to_pylist(),
                                 zip(table.column("publisher_did").to_pylist(), table.column("seq").to_pylist())))
            for p, first_seq, last_seq, first_off, last_off, appended, dups in all_acks:
                assert appended + dups == last_seq - first_seq + 1, context
                missing = [s for s in range(first_seq, last_seq + 1) if f"m-{p}-{s}" not in present]
                assert not missing, f"acknowledged rows lost: publisher {p} seqs {missing[:5]}: {context}"
                for off in range(first_off, last_off + 1):  # the offsets the ack reported hold those rows
                    did, seq = by_offset[off]
                    assert did.endswith(str(p)) and first_seq <= seq <= last_seq, context
            for p in range(PUBLISHERS):  # each publisher's rows: a gap-free prefix, in order
                mine = [s for d, s in zip(table.column("publisher_did").to_pylist(), table.column("seq").to_pylist())
                        if d.endswith(f"publisher{p}")]
                assert mine == list(range(1, len(mine) + 1)), context
            # Every row's content is what was sent.
            for got_id, got_seq, got_payload in zip(ids, table.column("seq").to_pylist(),
                                                    table.column("payload").to_pylist()):
                sent = expected[got_id]
                assert (got_seq, got_payload) == (sent["seq"], sent["payload"]), context
    # Finally re-append the whole burst: exactly the missing rows are added.
    with Journal.open(directory, key=key) as journal:
        before = journal.next_offset
        positions = {k[1]: p.last_seq for k, p in journal.latest().publishers.items()}
        added = dups = 0
        for p in range(PUBLISHERS):
            result = journal.append([r for c in plan[p] for r in c])
            added += result.appended
            dups += result.duplicates
        context = f"seed={seed} before={before} added={added} dups={dups} last seqs={positions}"
        assert dups == before and added == PUBLISHERS * MESSAGES - before, context
        table = journal.read(0)
        assert table.num_rows == PUBLISHERS * MESSAGES
        assert len(set(table.column("message_id").to_pylist())) == PUBLISHERS * MESSAGES
        assert journal.append(plan[0][0]).duplicates == len(plan[0][0])


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
