"""zerocomm-spark: end-to-end encrypted DIDComm v1 messaging over ZeroMQ, native to Spark.

``from zerocomm_spark import Agent`` is the entry point. It is imported lazily so that importing
a submodule (errors, keys) on a Spark executor does not pull in ZeroMQ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zerocomm_spark.connections import Connection
    from zerocomm_spark.member import Agent, ReceivedMessage

__all__ = ["Agent", "Connection", "ReceivedMessage"]


def __getattr__(name: str) -> Any:
    if name in ("Agent", "ReceivedMessage"):
        from zerocomm_spark import member

        return getattr(member, name)
    if name == "Connection":
        from zerocomm_spark.connections import Connection

        return Connection
    raise AttributeError(f"module 'zerocomm_spark' has no attribute {name!r}")
