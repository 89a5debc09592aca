"""The agent's member, built so that its group manager journals from the first delivery on.

Why a subclass: ``Agent.open`` starts the group manager itself when the identity has groups (a
restarted member rejoins them at once), and the data plane may deliver, and then acknowledge,
messages within milliseconds of that start. The journal hook must therefore be registered on the
manager *before* ``start()``, which only the ``groups`` property sees. :func:`member_class` returns
an Agent whose ``groups`` builds the manager with the agent's configuration, lets the process open
the journal and register ``on_message``, and only then starts it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from zerocomm_spark.agent.config import Config
from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.group.manager import GroupConfig, GroupManager
from zerocomm_spark.member import Agent

__all__ = ["member_class", "group_config", "policy_of"]

Prepare = Callable[[Agent, GroupManager], None]


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
    return GroupConfig(publish_bind=config.get("groups", "publish_endpoint") or None,
                       default_policy=dict(policy_of(config)))


def member_class(prepare: Prepare) -> type[Agent]:
    """An Agent class whose group manager (configured by ``Agent.open(group_config=...)``) is
    prepared by ``prepare`` before it starts."""

    class ProcessAgent(Agent):
        @property
        def groups(self) -> GroupManager:
            self._check_open()
            with self._groups_lock:
                if self._groups is None:
                    manager = GroupManager(self, keystore=self._keystore, transport=self._transport,
                                           connections=self._store, config=self._group_config)
                    prepare(self, manager)
                    manager.start()
                    self._groups = manager
                return self._groups

    return ProcessAgent
