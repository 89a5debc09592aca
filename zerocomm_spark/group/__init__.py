"""Group messaging: the data plane (this package's public API) and, on top of it, membership.

``DataPlane`` moves encrypted, acknowledged, ordered batches of messages between the members of a
group over CURVE-authenticated ZeroMQ pub/sub; see docs/groups.md.
"""

from zerocomm_spark.group.dataplane import (
    DataPlane,
    DataPlaneConfig,
    Delivered,
    PublishReceipt,
    RemoteMember,
)
from zerocomm_spark.group.lamport import LamportClock

__all__ = ["DataPlane", "DataPlaneConfig", "Delivered", "LamportClock", "PublishReceipt", "RemoteMember"]
