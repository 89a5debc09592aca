"""What the publish call accepts from an Arrow batch, checked before anything reaches the group."""

from __future__ import annotations

import pyarrow as pa
import pytest

from zerocomm_spark.agent.calls import _publish_rows
from zerocomm_spark.errors import BadRequestError

_HEADERS = pa.map_(pa.string(), pa.string())


@pytest.mark.parametrize("rows, match", [
    ([[("k", None)]], r"headers of row 0 .* null value"),
    ([[("", "v")]], r"headers of row 0 .* empty key"),
    ([None, [("trace", "1"), ("k", None)]], r"headers of row 1"),
])
def test_headers_the_group_cannot_carry_are_a_bad_request(rows: list, match: str) -> None:
    """The data plane refused them with a ConfigurationError whose hint points at the config file
    (and the CLI's exit code 2 for a bad setting): they are bad input to this call."""
    table = pa.table({"payload": pa.array([b"x"] * len(rows)), "headers": pa.array(rows, type=_HEADERS)})
    with pytest.raises(BadRequestError, match=match):
        _publish_rows(table)


def test_good_headers_pass() -> None:
    table = pa.table({"payload": pa.array([b"x", b"y"]), "headers": pa.array([[("k", "v")], None], type=_HEADERS)})
    assert _publish_rows(table)[2] == [{"k": "v"}, None]
