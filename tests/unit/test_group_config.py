"""GroupConfig refuses settings it cannot use, naming the setting."""

from __future__ import annotations

import pytest

from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.group.manager import GroupConfig


def test_fifo_is_off_by_default_and_only_a_bool():
    assert GroupConfig().fifo is False and GroupConfig(fifo=True).fifo is True
    for wrong in ("yes", 1, None):
        with pytest.raises(ConfigurationError, match="GroupConfig.fifo must be True or False"):
            GroupConfig(fifo=wrong)  # type: ignore[arg-type]


def test_a_timing_that_is_not_a_positive_number_is_refused():
    for wrong in (0, -1.0, True, "5"):
        with pytest.raises(ConfigurationError, match="GroupConfig.request_timeout_s must be a positive number"):
            GroupConfig(request_timeout_s=wrong)  # type: ignore[arg-type]
