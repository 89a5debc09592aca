"""zerocomm_spark.connector: a secure group as a Spark stream, and a stream as messages to a group.

```python
from zerocomm_spark.connector import register
register(spark)                                            # once per session; idempotent
stream = (spark.readStream.format("zerocomm").option("group", "sensors").load())
```

Installed as a package (not editable), the source is also found by Spark on its own: Spark 4.2 looks
up top-level modules named ``pyspark_*`` with a ``DefaultSource`` (see ``pyspark_zerocomm``), so a
notebook needs no call at all. ``zerocomm_spark.connector.session.local_spark()`` registers it too.

Imports are lazy so that executors importing a partition reader do not load the rest.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from zerocomm_spark.connector.lag import LagListener, progress_lag
    from zerocomm_spark.connector.offsets import ZeroCommOffset
    from zerocomm_spark.connector.provider import ZeroCommDataSource

__all__ = ["LagListener", "ZeroCommDataSource", "ZeroCommOffset", "progress_lag", "register", "source_schema"]

_lock = threading.Lock()
_registered: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(spark: "SparkSession") -> None:
    """Make ``format("zerocomm")`` available in ``spark``; calling it again does nothing."""
    from zerocomm_spark.connector.provider import ZeroCommDataSource

    with _lock:
        if spark in _registered:
            return
        spark.dataSource.register(ZeroCommDataSource)
        _registered.add(spark)


def source_schema(include_headers: bool = False) -> Any:
    """The StructType format("zerocomm") reads (headers only with includeHeaders=true)."""
    from zerocomm_spark.connector.schema import source_schema as build

    return build(include_headers)


def __getattr__(name: str) -> Any:
    if name == "ZeroCommDataSource":
        from zerocomm_spark.connector.provider import ZeroCommDataSource

        return ZeroCommDataSource
    if name == "ZeroCommOffset":
        from zerocomm_spark.connector.offsets import ZeroCommOffset

        return ZeroCommOffset
    if name in ("LagListener", "progress_lag"):
        from zerocomm_spark.connector import lag

        return getattr(lag, name)
    raise AttributeError(f"module 'zerocomm_spark.connector' has no attribute {name!r}")
