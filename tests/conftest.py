"""Shared fixtures: one real local Spark session for the whole run (it costs seconds to start)."""

from __future__ import annotations

import signal

import pytest

# Tests send Ctrl-C (SIGINT) to the commands they start and expect what a user at a terminal gets. A
# shell that runs the suite in the background (`bash scripts/test.sh &`, nohup) starts it with SIGINT
# ignored, an ignore every command started from it inherits, so those commands never saw the Ctrl-C
# and four tests failed for a reason of the launch, not of the code. A handler (unlike an ignore)
# is reset to the default when a child executes, so the commands get the terminal's disposition.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def spark():
    from zerocomm_spark.connector.session import local_spark

    session = local_spark("zerocomm-tests", master="local[2]")
    yield session
    session.stop()
