"""zerocomm_spark.pipelines: Spark jobs over Delta that make Delta the group's memory.

* :mod:`~zerocomm_spark.pipelines.history` persist groups into a Delta history table (exactly once),
  plus ``compact`` (OPTIMIZE) and ``vacuum``;
* :mod:`~zerocomm_spark.pipelines.replay` read it back in causal order, from a point, as it was, or
  as a stream;
* :mod:`~zerocomm_spark.pipelines.restore` fill a late or returning member's gap from several
  providers (announce, then request or ignore), origins verified first;
* :mod:`~zerocomm_spark.pipelines.origin` the per-message origin proof history keeps;
* :mod:`~zerocomm_spark.pipelines.history_key` payloads sealed at rest with a group history key;
* :mod:`~zerocomm_spark.pipelines.local_group` a group of real members on this machine;
* :mod:`~zerocomm_spark.pipelines.main` the main job (``bash scripts/main.sh``).

Names are imported lazily: ``import zerocomm_spark.pipelines`` loads neither Spark nor the members.
The functions ``replay`` and ``restore`` live in the modules of the same name
(``from zerocomm_spark.pipelines.replay import replay``).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = [
    "ArrowProvider", "DeltaProvider", "DeltaSink", "Have", "HistoryKey", "IngestBatch", "LocalGroup",
    "OriginSigner", "RestoreReport", "Since", "compact", "ensure_table", "ingest", "release_checkpointed",
    "vacuum",
]

_WHERE = {
    "IngestBatch": "history", "compact": "history", "ensure_table": "history", "ingest": "history",
    "release_checkpointed": "history",
    "vacuum": "history", "Since": "replay", "ArrowProvider": "restore",
    "DeltaProvider": "restore", "DeltaSink": "restore", "Have": "restore", "RestoreReport": "restore",
    "HistoryKey": "history_key", "OriginSigner": "origin", "LocalGroup": "local_group",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'zerocomm_spark.pipelines' has no attribute {name!r}")
    return getattr(import_module(f"zerocomm_spark.pipelines.{module}"), name)
