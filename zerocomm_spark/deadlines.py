"""Timeouts given by callers, checked in one place: every wait has a deadline.

An infinite (or absurdly long) timeout would overflow threading's waits and the transport's poll
computation, and NaN compares false with every deadline, so a wait given it would never end.
"""

from __future__ import annotations

import threading

from zerocomm_spark.errors import InvalidTimeoutError

__all__ = ["MAX_TIMEOUT", "check_timeout"]

#: The longest timeout any call takes (about 146 years on 64-bit builds): far beyond any real wait.
MAX_TIMEOUT = threading.TIMEOUT_MAX / 2


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
