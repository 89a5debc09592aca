"""Timeouts given by callers, checked in one place: every wait has a deadline.

An infinite (or absurdly long) timeout would overflow threading's waits and the transport's poll
computation, and NaN compares false with every deadline, so a wait given it would never end.
"""

from __future__ import annotations

import threading

from zerocomm_spark.errors import InvalidTimeoutError

__all__ = ["LISTENER_HANDSHAKE_MS", "MAX_TIMEOUT", "check_timeout"]

#: The longest timeout any call takes (about 146 years on 64-bit builds): far beyond any real wait.
MAX_TIMEOUT = threading.TIMEOUT_MAX / 2

#: How long a connection to a listening socket (peer ROUTER, group XPUB, API TCP) may take to finish
#: its ZMTP/CURVE handshake before ZeroMQ drops it (ZMQ_HANDSHAKE_IVL; libzmq's default is 30 s). Anyone
#: on the network can connect and send nothing: each such connection holds a descriptor for this long,
#: and a process out of descriptors is aborted by libzmq when a local client connects (ipc_listener.cpp
#: asserts on EMFILE). A real peer finishes in a few round trips, milliseconds even across regions.
LISTENER_HANDSHAKE_MS = 5000


def check_timeout(timeout: object, what: str = "timeout", *, only_check: bool = False) -> float:
    """``timeout`` as float seconds, or InvalidTimeoutError.

    ``only_check``: 0 or less is allowed and means "do not wait, just look" (a receipt's wait);
    otherwise it must be positive.
    """
    if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout != timeout
            or timeout > MAX_TIMEOUT or (not only_check and timeout <= 0)):
        raise InvalidTimeoutError(f"{what} must be a finite {'' if only_check else 'positive '}number of seconds "
                                  f"(at most {MAX_TIMEOUT:g}), got {timeout!r}; every wait has a deadline")
    return float(timeout)
