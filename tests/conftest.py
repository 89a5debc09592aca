"""Shared fixtures: one real local Spark session for the whole run (it costs seconds to start)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from zerocomm_spark.connector.session import local_spark

    session = local_spark("zerocomm-tests", master="local[2]")
    yield session
    session.stop()
