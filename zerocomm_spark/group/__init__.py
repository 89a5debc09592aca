"""Group messaging: the data plane (this package's public API) and, on top of it, membership.

``DataPlane`` moves encrypted, acknowledged, ordered batches of messages between the members of a
group over CURVE-authenticated ZeroMQ pub/sub; see docs/groups.md.

The names below load on first use, so a process that only needs ``group.topics`` (a Spark task
checking a group name) does not pay for ZeroMQ, the envelope and the key store at import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerocomm_spark.group.dataplane import DataPlane, DataPlaneConfig, Delivered, PublishReceipt, RemoteMember
    from zerocomm_spark.group.lamport import LamportClock

__all__ = ["DataPlane", "DataPlaneConfig", "Delivered", "LamportClock", "PublishReceipt", "RemoteMember"]

_WHERE = {"LamportClock": "zerocomm_spark.group.lamport"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE.get(name, "zerocomm_spark.group.dataplane")), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
