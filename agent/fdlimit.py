"""The agent's file descriptor budget: raised to what the system allows, and reported.

Why: every TCP connection to the peer, group or API endpoint holds a descriptor until ZeroMQ drops
it, and anyone on the network can open them. A process at its limit cannot open its journal or health
file, and libzmq 4.3's IPC listener aborts the whole process when accept() fails with EMFILE (a local
client connecting then kills the agent: ipc_listener.cpp, unlike its TCP listener, does not tolerate
EMFILE). Most systems start processes with a soft limit of 1024 under a hard limit of 500k or more, so
the agent raises its soft limit to the hard one (as Go's runtime and many servers do); it never lowers it.
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Any

from zerocomm_spark.agent.logging import event
from zerocomm_spark.deadlines import LISTENER_HANDSHAKE_MS

__all__ = ["fd_usage", "raise_fd_limit"]

log = logging.getLogger(__name__)

#: Below this many descriptors the agent warns at start (systemd gives services 524288, some hosts 1024 or 4096).
LOW_LIMIT = 16384
# macOS refuses a soft limit above OPEN_MAX (10240) even when the hard limit is "unlimited".
_DARWIN_OPEN_MAX = 10240


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (never lower it); returns (soft, hard) in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard
    if wanted == resource.RLIM_INFINITY or wanted > (1 << 30):
        wanted = _DARWIN_OPEN_MAX if os.uname().sysname == "Darwin" else 1 << 20
    before = soft
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (OSError, ValueError) as exc:
            event(log, logging.WARNING, "cannot raise the open file limit; a flood of connections reaches it sooner",
                  soft=soft, hard=hard, reason=str(exc)[:200])
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    event(log, logging.INFO, "open file limit", soft=soft, hard=hard, raised_from=before if soft != before else None)
    if soft != resource.RLIM_INFINITY and soft < LOW_LIMIT:
        # Idle connections are dropped after LISTENER_HANDSHAKE_MS: this many of them opened within that
        # time still exhaust the agent, a few thousand is easy for any host that reaches the peer endpoint.
        event(log, logging.WARNING, "the open file limit is low: a flood of that many connections within the "
              "handshake allowance exhausts the agent; raise the hard limit (LimitNOFILE= in a systemd unit, "
              "`ulimit -Hn` in the shell that starts it)", limit=soft, recommended=LOW_LIMIT,
              handshake_allowance_ms=LISTENER_HANDSHAKE_MS)
    return soft, hard


def fd_usage() -> dict[str, Any]:
    """Descriptors open in this process and its soft limit (``open`` is None where it cannot be counted)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    opened: int | None = None
    for directory in ("/proc/self/fd", "/dev/fd"):
        try:
            opened = len(os.listdir(directory)) - 1  # less the descriptor listdir itself holds
            break
        except OSError:
            continue
    return {"open": opened, "limit": None if soft == resource.RLIM_INFINITY else soft}
