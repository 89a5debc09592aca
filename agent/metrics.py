"""Counters the agent keeps for `metrics`: what came in, what went out, how the API is used.

Why here and not only in the data plane: the agent knows what it journaled and acknowledged (the
numbers that matter for a consumer's lag), and what clients asked of it. The data plane's own
counters (retransmissions, drops, liveness) are merged in when `metrics` is called, and the peer
transport's (frames, timeouts, drops, backlogs) are added under ``transport``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

__all__ = ["Metrics"]


class Metrics:
    """Thread-safe counters; :meth:`snapshot` is a JSON-ready dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self._counters: dict[str, int] = defaultdict(int)
        self._calls: dict[str, dict[str, float]] = {}
        # (group, publisher) -> last seq journaled; publishers' own progress comes from the data plane.
        self._journaled: dict[tuple[str, str], int] = {}

    def add(self, **delta: int) -> None:
        with self._lock:
            for name, value in delta.items():
                self._counters[name] += value

    def journaled(self, group: str, publisher: str, seq: int) -> None:
        with self._lock:
            key = (group, publisher)
            if seq > self._journaled.get(key, 0):
                self._journaled[key] = seq

    def call(self, name: str, ok: bool, seconds: float) -> None:
        with self._lock:
            entry = self._calls.setdefault(name, {"count": 0, "errors": 0, "seconds": 0.0, "max_seconds": 0.0})
            entry["count"] += 1
            entry["errors"] += 0 if ok else 1
            entry["seconds"] += seconds
            entry["max_seconds"] = max(entry["max_seconds"], seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self._counters)
            calls = {k: dict(v) for k, v in self._calls.items()}
            journaled: dict[str, dict[str, int]] = {}
            for (group, publisher), seq in self._journaled.items():
                journaled.setdefault(group, {})[publisher] = seq
        for name in ("messages_in", "bytes_in", "messages_out", "bytes_out", "journal_duplicates",
                     "basic_messages_in", "basic_messages_out"):
            counters.setdefault(name, 0)
        return {"uptime_s": round(time.time() - self.started, 3), **counters, "journaled_seq": journaled,
                "api_calls": calls}
