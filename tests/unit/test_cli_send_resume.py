"""`zerocomm send GROUP - --json` that stops part way (the error document a script resumes from); `connect` of an empty URL."""

from __future__ import annotations

import argparse
import json

from zerocomm_spark import errors
from zerocomm_spark.agent.cli import _report_error, _say_how_to_send_the_rest


def _args(**kw):
    return argparse.Namespace(**{"group": "sensors", "id_prefix": None, "skip": 0, **kw})


def test_a_send_that_stopped_part_way_gives_its_resume_facts_as_json_fields(capsys):
    """The README lists acknowledged_lines, id_prefix, in_flight_lines and resume_options in the
    --json error document of a `send -` that stops part way; only Ctrl-C gave them. A member not
    acknowledging in time (exit 4) or the agent not answering gave the prefix only inside the hint."""
    exc = errors.PeerTimeoutError("1 member(s) did not ack seq 10 of group 'sensors' within 5s: did:key:x")
    _say_how_to_send_the_rest(exc, _args(), "88ff75e7e0814b98", acked=96, in_flight=4)
    code = _report_error(exc, True)
    doc = json.loads(capsys.readouterr().out)
    assert code == doc["exit_code"] == 4 and doc["ok"] is False
    assert doc["error"]["type"] == "PeerTimeoutError" and "--skip 96" in doc["error"]["hint"]
    assert doc["id_prefix"] == "88ff75e7e0814b98" and doc["group"] == "sensors"
    assert doc["acknowledged_lines"] == 96 and doc["acknowledged_by_this_run"] == 96
    assert doc["in_flight_lines"] == [97, 100]
    assert doc["resume_options"] == ["--id-prefix", "88ff75e7e0814b98", "--skip", "96"]


def test_the_resume_facts_count_lines_skipped_by_an_earlier_run_and_a_refusal_has_none_in_flight(capsys):
    exc = errors.BadRequestError("line 130 of stdin is not UTF-8 text", hint="Encode binary data first")
    exc.stdin_line = 130
    _say_how_to_send_the_rest(exc, _args(id_prefix="p1", skip=100), "p1", acked=29, in_flight=3)
    _report_error(exc, True)
    doc = json.loads(capsys.readouterr().out)
    assert doc["acknowledged_lines"] == 129 and doc["acknowledged_by_this_run"] == 29
    assert doc["in_flight_lines"] is None  # a refusal sent nothing of its chunk
    assert doc["resume_options"] == ["--id-prefix", "p1", "--skip", "129"]


def test_other_errors_keep_the_plain_error_document(capsys):
    _report_error(errors.GroupNotFoundError("this member is in no group named 'x'"), True)
    assert set(json.loads(capsys.readouterr().out)) == {"ok", "error", "exit_code"}


def test_connect_with_an_empty_url_says_the_url_is_empty_before_asking_any_agent(tmp_path, capsys):
    """`zerocomm connect "$URL"` with the variable unset said "accept: 'url' must not be empty" (the
    API's words, with advice about a Client method's signature), and only once an agent answered;
    blanks said "the invitation URL is empty" with another exit code (1 against 2)."""
    from zerocomm_spark.agent.cli import main

    for url in ("", "  "):
        code = main(["--identity-dir", str(tmp_path / "nobody"), "--json", "connect", url])
        doc = json.loads(capsys.readouterr().out)
        assert code == doc["exit_code"] == 2, doc
        assert doc["error"]["message"] == "the invitation URL is empty", doc
        assert "zerocomm invite" in doc["error"]["hint"] and "signature" not in doc["error"]["hint"], doc
