"""Seqs a publisher used for a message the journal already held from another publisher.

The id rule drops a row whose message id was journaled before, whoever published it: a sink task
retried on another host republishes its rows (same ids) under that host's publisher, with new seqs.
Those seqs then have no row here, and a reader walking the publisher's seqs would take the hole for
lost messages. So the journal remembers them: per (group, publisher), ranges of superseded seqs,
saved (sealed, replaced atomically) before the commit that drops the rows is written, so a crash
can leave a range recorded whose rows come again (harmless: they are dropped again), never the
reverse. Readers ask for them only where they find a hole.
"""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path

from zerocomm_spark.journal import crypto
from zerocomm_spark.journal.files import write_atomic
from zerocomm_spark.journal.index import Key

__all__ = ["SUPERSEDED_FILE", "Superseded"]

log = logging.getLogger(__name__)

SUPERSEDED_FILE = "superseded.idx"
_MAGIC = b"ZCSS1\n"
_TOP = 1 << 63
MAX_RANGES_PER_PUBLISHER = 10_000  # beyond it the oldest ranges are forgotten (a reader would call them lost)


class Superseded:
    """Ranges of superseded seqs per publisher; not thread-safe (the journal's writer owns it)."""

    def __init__(self, directory: Path, key: bytes, *, fsync: bool) -> None:
        self._path = directory / SUPERSEDED_FILE
        self._key = key
        self._fsync = fsync
        self._ranges: dict[Key, list[list[int]]] = {}
        try:
            blob = self._path.read_bytes()
        except FileNotFoundError:
            return
        plain = crypto.open_sealed(blob[len(_MAGIC):], _MAGIC, key) if blob.startswith(_MAGIC) else None
        if plain is None:  # damaged (a power loss mid-rename, rot): what it held cannot be read back
            log.error("journal: %s is damaged and was not read; readers may report the seqs it recorded as "
                      "superseded (rows republished by another publisher) as lost", self._path)
            return
        for group, publisher, ranges in json.loads(plain):
            self._ranges[(group, publisher)] = [[int(a), int(b)] for a, b in ranges]

    def add(self, entries: list[tuple[Key, int]]) -> None:
        """Record these (publisher, seq) and save, before the rows' commit is written."""
        for key, seq in entries:
            ranges = self._ranges.setdefault(key, [])
            at = bisect.bisect_right(ranges, [seq, _TOP])  # ranges[:at] start at or before seq
            if at and ranges[at - 1][1] >= seq:
                continue  # already recorded
            if at and ranges[at - 1][1] == seq - 1:
                ranges[at - 1][1] = seq
                at -= 1
            else:
                ranges.insert(at, [seq, seq])
            if at + 1 < len(ranges) and ranges[at + 1][0] == ranges[at][1] + 1:
                ranges[at][1] = ranges.pop(at + 1)[1]
            if len(ranges) > MAX_RANGES_PER_PUBLISHER:
                del ranges[0]
        doc = [[g, p, r] for (g, p), r in self._ranges.items()]
        plain = json.dumps(doc, separators=(",", ":")).encode()
        write_atomic(self._path, _MAGIC + crypto.seal(plain, _MAGIC, self._key), fsync=self._fsync)

    def has(self, key: Key) -> bool:
        """Whether ``key`` has any superseded seq (a dict lookup: safe without the journal's lock)."""
        return key in self._ranges

    def any_within(self, key: Key, first: int, last: int) -> bool:
        """Whether a seq of ``key`` in ``first..last`` is superseded: a search of the sorted, disjoint
        ranges (the append path asks it for every append of such a publisher)."""
        ranges = self._ranges.get(key)
        if not ranges:
            return False
        at = bisect.bisect_right(ranges, [last, _TOP])  # ranges[:at] start at or before last
        return at > 0 and ranges[at - 1][1] >= first

    def within(self, key: Key, first: int, last: int) -> list[tuple[int, int]]:
        """The superseded seqs of ``key`` in ``first..last``, as inclusive ranges."""
        out = []
        for a, b in self._ranges.get(key, ()):
            if b >= first and a <= last:
                out.append((max(a, first), min(b, last)))
        return out
