"""The agent's group settings (conf/zerocomm.toml ``[groups]``) as the group manager's configuration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerocomm_spark.agent.config import Config
from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.group.manager import GroupConfig

__all__ = ["group_config", "policy_of"]


def policy_of(config: Config) -> Mapping[str, Any]:
    """groups.joiner_policy (+ groups.allow) as an admission policy document of the group manager."""
    kind = config.get("groups", "joiner_policy")
    allow = config.get("groups", "allow")
    if kind == "open":
        return {"kind": "open"}
    if kind == "invitation":
        if allow:  # allow-listed DIDs, or holders of an invitation for the group
            return {"kind": "any-of", "policies": [{"kind": "invitation"}, {"kind": "allow-list", "dids": allow}]}
        return {"kind": "invitation"}
    if kind == "allow-list":
        if not allow:
            raise ConfigurationError("groups.joiner_policy is allow-list but groups.allow lists no DIDs",
                                     hint="List the member DIDs to admit in groups.allow, or choose another policy")
        return {"kind": "allow-list", "dids": allow}
    raise ConfigurationError(f"groups.joiner_policy {kind!r} is not known")


def group_config(config: Config) -> GroupConfig:
    # The journal takes every message; nothing here reads the manager's receive() buffer or
    # messages(), so they keep none (they held up to 110,000 messages per group, never read). It takes
    # each publisher's messages in seq order, an unordered group's too (fifo): see GroupConfig.fifo.
    return GroupConfig(publish_bind=config.get("groups", "publish_endpoint") or None,
                       default_policy=dict(policy_of(config)), history_max=0, inbox_max=0, fifo=True)
