"""Which micro-batches of a streaming query a Delta table already holds, read from its commit log.

Every history commit carries ``userMetadata = "<app id>:<batch id>"`` (the app id names the
streaming query, the batch id is Spark's), written atomically with the rows. After a restart, the
one batch Spark may re-run is the last one it had planned; whether Delta already has it is a
question about the newest commit with our app id, answered from the commit infos alone.

Why not Delta's own ``txnAppId``/``txnVersion`` on every batch: in Delta 4.4 the writer looks the
version up through a full reconstruction of the table's state (three Spark jobs per commit, growing
with the table), which costs more than the append itself on a small micro-batch. A query only needs
the answer once per run, and the log already holds it. (``ingest(..., delta_txn=True)`` adds
Delta's options back, for deployments where two live runs of one checkpoint could race.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["CLOCK_SKEW_MS", "TagLookup", "catch_up_tag", "commit_tag", "last_tagged_batch", "parse_tag"]

log = logging.getLogger("zerocomm_spark.pipelines.commit_tags")

#: Commit timestamps come from the writer's clock; a commit up to this much older than the
#: ``not_before_ms`` cut-off (when Spark planned the batch) is still looked at, so writers on hosts
#: with skewed clocks do not end the walk early.
CLOCK_SKEW_MS = 3_600_000
_FIRST_PAGE = 64


def commit_tag(app_id: str, batch_id: int) -> str:
    return f"{app_id}:{int(batch_id)}"


def catch_up_tag(app_id: str, newest_batch: int) -> str:
    """The tag of a commit written while the query's checkpoint is behind the table (it was put back
    from an older copy): its rows were appended only where the table lacked them, and the newest
    batch the table holds is ``newest_batch``."""
    return f"{app_id}:{int(newest_batch)}:behind"


def _parse_catch_up(tag: str | None, app_id: str) -> int | None:
    if not tag or not tag.startswith(app_id + ":") or not tag.endswith(":behind"):
        return None
    rest = tag[len(app_id) + 1:-len(":behind")]
    return int(rest) if rest.isdigit() else None


def parse_tag(tag: str | None, app_id: str) -> int | None:
    """The batch id of a commit tag written by ``app_id``, or None for anyone else's commit."""
    if not tag or not tag.startswith(app_id + ":"):
        return None
    rest = tag[len(app_id) + 1:]
    return int(rest) if rest.isdigit() else None


@dataclass(frozen=True)
class TagLookup:
    """The newest batch ``app_id`` committed, and where; ``complete`` False when the log was cut first.

    ``batch`` None with ``complete`` True: the app has no commit in this table since the cut-off
    (every commit since then was looked at). ``complete`` False: the log kept since then does not go
    back far enough (log retention removed commits while the query was down), so the log cannot say.
    """

    batch: int | None
    version: int | None
    complete: bool
    #: The newest commit of ``app_id`` is a catch-up one (:func:`catch_up_tag`): its checkpoint is
    #: behind the table up to ``batch``, so batch ids do not name the rows the table holds.
    behind: bool = False
    #: When that commit was made (Delta's commit timestamp, ms), if the log says.
    committed_ms: int | None = None


def last_tagged_batch(spark: SparkSession, table_path: str, app_id: str, *, not_before_ms: int = 0) -> TagLookup:
    """Walk the table's commits newest first until one of ``app_id``'s, or one from before the cut-off."""
    from delta.tables import DeltaTable

    table = DeltaTable.forPath(spark, str(table_path))
    limit = _FIRST_PAGE
    while True:
        rows = table.history(limit).select("version", "timestamp", "userMetadata").collect()
        for row in rows:
            batch = parse_tag(row["userMetadata"], app_id)
            if batch is not None:
                stamp = row["timestamp"]
                return TagLookup(batch, int(row["version"]), True,
                                 committed_ms=int(stamp.timestamp() * 1000) if stamp is not None else None)
            newest = _parse_catch_up(row["userMetadata"], app_id)
            if newest is not None:
                return TagLookup(newest, int(row["version"]), True, behind=True)
            stamp = row["timestamp"]
            if not_before_ms and stamp is not None and stamp.timestamp() * 1000 < not_before_ms - CLOCK_SKEW_MS:
                return TagLookup(None, None, True)  # older than the query: it cannot have written since
        if len(rows) < limit:  # the whole log the table keeps was read
            oldest = int(rows[-1]["version"]) if rows else 0
            if oldest != 0:
                log.warning("the log of %s starts at version %d: it no longer shows whether %s wrote", table_path,
                            oldest, app_id)
            return TagLookup(None, None, oldest == 0)
        limit *= 8
