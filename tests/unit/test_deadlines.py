"""Every wait has a deadline: the one check every timeout a caller gives goes through."""

from __future__ import annotations

import pytest

from zerocomm_spark.deadlines import MAX_TIMEOUT, check_timeout
from zerocomm_spark.errors import ConfigurationError, InvalidTimeoutError
from zerocomm_spark.journal import Journal

NEVER = (float("inf"), float("nan"), None, "5", True, 10**400, MAX_TIMEOUT * 2)


@pytest.mark.parametrize("timeout", NEVER)
def test_a_timeout_that_never_passes_is_refused(timeout: object) -> None:
    for only_check in (False, True):
        with pytest.raises(InvalidTimeoutError, match="every wait has a deadline") as caught:
            check_timeout(timeout, "x's timeout", only_check=only_check)
        assert caught.value.message.startswith("x's timeout must be a finite")
        assert isinstance(caught.value, ConfigurationError) and isinstance(caught.value, ValueError)


def test_zero_only_checks_where_allowed() -> None:
    assert check_timeout(2, "t") == 2.0 and isinstance(check_timeout(2, "t"), float)
    assert check_timeout(MAX_TIMEOUT) == MAX_TIMEOUT
    assert check_timeout(0, only_check=True) == 0.0
    assert check_timeout(-1.5, only_check=True) == -1.5
    for no_wait in (0, 0.0, -1):
        with pytest.raises(InvalidTimeoutError, match="positive"):
            check_timeout(no_wait)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0])
def test_a_journal_refuses_a_timeout_without_a_deadline(tmp_path, timeout: float) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidTimeoutError, match="journal's timeout"):
        Journal.open(tmp_path / "j", key=bytes(32), timeout=timeout)
