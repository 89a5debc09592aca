"""Consumer lag of zerocomm streams: messages behind the newest, per publisher.

Why from progress reports: a Python data source cannot add custom metrics to Spark's progress, but
it reports its newest positions (``reportLatestOffset``) next to the batch's end offset, so
``latestOffset - endOffset`` per publisher is exactly the lag at the end of that batch. Use
:func:`progress_lag` on ``query.lastProgress``, or register :class:`LagListener` to track every
query of a session (``listener.lag(query.id)``, ``listener.max_lag()``), like Kafka's
``records-lag``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from pyspark.sql.streaming import StreamingQueryListener

from zerocomm_spark.errors import OffsetFormatError

from zerocomm_spark.connector.offsets import ZeroCommOffset, lag

__all__ = ["LagListener", "progress_lag"]

Lag = dict[str, dict[str, int]]  # group -> publisher DID -> messages behind


def _offset(value: Any) -> ZeroCommOffset | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, Mapping) or "groups" not in value or "version" not in value:
        return None  # another source's offset
    try:
        return ZeroCommOffset.from_dict(value)
    except OffsetFormatError:
        return None


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def progress_lag(progress: Any) -> Lag:
    """Lag per group and publisher from a progress report (a StreamingQueryProgress or its dict).

    Sums over every zerocomm source of the query (a query reading two zerocomm streams reports both).
    Empty when the query has no zerocomm source or has not completed a batch yet.
    """
    if progress is None:
        return {}
    out: Lag = {}
    for source in _get(progress, "sources") or []:
        end = _offset(_get(source, "endOffset"))
        latest = _offset(_get(source, "latestOffset"))
        if end is None or latest is None:
            continue
        for (group, did), behind in lag(end, latest).items():
            row = out.setdefault(group, {})
            row[did] = row.get(did, 0) + behind
    return out


class LagListener(StreamingQueryListener):
    """Keeps the lag of every query after each batch; ``spark.streams.addListener(LagListener())``.

    ``on_lag(query_id, lag)`` is called after each progress report of a query with a zerocomm source
    (for alerting); the listener runs on the driver's listener thread, so keep it quick.
    """

    def __init__(self, on_lag: Callable[[str, Lag], None] | None = None) -> None:
        self._on_lag = on_lag
        self._lock = threading.Lock()
        self._lags: dict[str, Lag] = {}

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        found = progress_lag(progress)
        if not found and not any(_offset(_get(s, "endOffset")) for s in (_get(progress, "sources") or [])):
            return
        query_id = str(_get(progress, "id"))
        with self._lock:
            self._lags[query_id] = found
        if self._on_lag is not None:
            self._on_lag(query_id, found)

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass

    def lag(self, query_id: Any) -> Lag:
        """The last lag seen for a query (by ``query.id``); empty before its first batch."""
        with self._lock:
            return {g: dict(p) for g, p in self._lags.get(str(query_id), {}).items()}

    def max_lag(self) -> int:
        """The largest per-publisher lag over all queries: one number for a health check."""
        with self._lock:
            return max((n for lag_ in self._lags.values() for p in lag_.values() for n in p.values()), default=0)
