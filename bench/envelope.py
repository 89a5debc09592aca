"""RFC 0019 envelope throughput against the bare pynacl calls each envelope needs.

The question this answers: how much do our envelope layer's JSON, base64, validation and key
look-ups cost on top of the cryptography that no implementation can avoid? For each case the same
sequence of primitive calls (CEK generation, per-recipient crypto_box + sealed box or sealed box,
one AEAD) is timed without our code, with X25519 keys pre-converted (our code caches them too).
``ratio`` = our seconds per message / primitives' seconds per message; the target is <= 1.5.
Ours and the primitives are timed call by call in interleaved pairs and compared by their medians,
which keeps the ratio steady on a shared, noisy machine. Prints one JSON document to stdout.

Run: .venv/bin/python bench/envelope.py [--seconds-per-case 1.0]
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nacl  # noqa: E402
import nacl.bindings as sodium  # noqa: E402

from zerocomm_spark.envelope import ANONCRYPT, AUTHCRYPT, pack, unpack  # noqa: E402
from zerocomm_spark.keys.keypair import KeyPair  # noqa: E402

TARGET = 1.5
RECIPIENT_COUNTS = (1, 8, 64)
PAYLOAD_SIZES = (100, 10_000)


def _b64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _compare(ours: Callable[[], object], prims: Callable[[], object], seconds: float) -> tuple[float, float]:
    """Median seconds per call of each, timed call by call in interleaved pairs.

    Pairing makes both sides share whatever the (possibly shared, throttled) machine does at that
    moment; the order flips every pair so neither side always runs on a warmer cache; the median
    drops the calls a preemption landed on.
    """
    ours(), prims()  # warm caches (our lru_cache of X25519 conversions, the allocator)
    clock = time.perf_counter
    t0 = clock()
    ours(), prims()
    pairs = max(21, int(seconds / max(clock() - t0, 1e-7)))
    ours_times: list[float] = []
    prims_times: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(pairs):
            first, second = (ours, prims) if i & 1 else (prims, ours)
            t0 = clock()
            first()
            t1 = clock()
            second()
            t2 = clock()
            (ours_times if i & 1 else prims_times).append(t1 - t0)
            (prims_times if i & 1 else ours_times).append(t2 - t1)
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(ours_times), statistics.median(prims_times)


def _pack_primitives(alg: str, body: bytes, aad: bytes, sender: KeyPair, targets: list[bytes]) -> Callable[[], object]:
    box, seal, aead, urandom = sodium.crypto_box, sodium.crypto_box_seal, sodium.crypto_aead_chacha20poly1305_ietf_encrypt, os.urandom
    sender_vk = sender.verkey.encode("ascii")
    sender_sk = bytes(sender.x25519_private())

    if alg == AUTHCRYPT:

        def run() -> object:
            cek = urandom(32)
            for pk in targets:
                box(cek, urandom(24), pk, sender_sk)
                seal(sender_vk, pk)
            return aead(body, aad, urandom(12), cek)

    else:

        def run() -> object:
            cek = urandom(32)
            for pk in targets:
                seal(cek, pk)
            return aead(body, aad, urandom(12), cek)

    return run


def _unpack_primitives(alg: str, envelope: bytes, me: KeyPair) -> Callable[[], object]:
    outer = json.loads(envelope)
    header = json.loads(_b64(outer["protected"]))
    entry = next(r for r in header["recipients"] if r["header"]["kid"] == me.verkey)
    aad = outer["protected"].encode("ascii")
    iv = _b64(outer["iv"])
    sealed = _b64(outer["ciphertext"]) + _b64(outer["tag"])
    encrypted_key = _b64(entry["encrypted_key"])
    my_pk, my_sk = bytes(me.x25519_public()), bytes(me.x25519_private())
    seal_open, box_open, aead = sodium.crypto_box_seal_open, sodium.crypto_box_open, sodium.crypto_aead_chacha20poly1305_ietf_decrypt

    if alg == AUTHCRYPT:
        sealed_sender = _b64(entry["header"]["sender"])
        nonce = _b64(entry["header"]["iv"])
        sender_pk = sodium.crypto_sign_ed25519_pk_to_curve25519(
            __import__("base58").b58decode(seal_open(sealed_sender, my_pk, my_sk))
        )

        def run() -> object:
            seal_open(sealed_sender, my_pk, my_sk)
            return aead(sealed, aad, iv, box_open(encrypted_key, nonce, sender_pk, my_sk))

    else:

        def run() -> object:
            return aead(sealed, aad, iv, seal_open(encrypted_key, my_pk, my_sk))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds-per-case", type=float, default=1.0)
    args = parser.parse_args()

    started = time.perf_counter()
    sender = KeyPair.generate()
    recipients = [KeyPair.generate() for _ in range(max(RECIPIENT_COUNTS))]
    targets_all = [bytes(kp.x25519_public()) for kp in recipients]
    cases = []

    for op, algs in (("pack", (AUTHCRYPT, ANONCRYPT)), ("unpack", (AUTHCRYPT,))):
        for alg in algs:
            for count in RECIPIENT_COUNTS:
                for size in PAYLOAD_SIZES:
                    body = os.urandom(size)
                    verkeys = [kp.verkey for kp in recipients[:count]]
                    from_key = sender if alg == AUTHCRYPT else None
                    envelope = pack(body, verkeys, from_key)
                    if op == "pack":
                        aad = json.loads(envelope)["protected"].encode("ascii")  # same AAD size as ours
                        prims = _pack_primitives(alg, body, aad, sender, targets_all[:count])

                        def ours(body=body, verkeys=verkeys, from_key=from_key) -> object:
                            return pack(body, verkeys, from_key)

                    else:
                        me = recipients[count - 1]  # ours is the last entry: the longest kid scan
                        keys = {me.verkey: me}
                        assert unpack(envelope, keys.get).message == body
                        prims = _unpack_primitives(alg, envelope, me)

                        def ours(envelope=envelope, lookup=keys.get) -> object:
                            return unpack(envelope, lookup)

                    t_ours, t_prims = _compare(ours, prims, args.seconds_per_case)
                    ratio = t_ours / t_prims
                    cases.append(
                        {
                            "op": op,
                            "alg": alg,
                            "recipients": count,
                            "payload_bytes": size,
                            "envelope_bytes": len(envelope),
                            "ours_msgs_per_s": round(1 / t_ours, 1),
                            "primitives_msgs_per_s": round(1 / t_prims, 1),
                            "overhead_us_per_msg": round((t_ours - t_prims) * 1e6, 1),
                            "ratio": round(ratio, 3),
                            "within_target": ratio <= TARGET,
                        }
                    )

    report = {
        "benchmark": "zerocomm_spark.envelope (RFC 0019) vs bare pynacl calls",
        "target": TARGET,
        "ratio_definition": "our seconds per message / primitives' seconds per message (lower is better)",
        "all_within_target": all(c["within_target"] for c in cases),
        "cases": cases,
        "environment": {
            "python": platform.python_version(),
            "pynacl": nacl.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "seconds_per_case": args.seconds_per_case,
            "timing": "median of per-call perf_counter times, ours and primitives interleaved",
        },
        "runtime_s": round(time.perf_counter() - started, 1),
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
