"""`zerocomm history`: the journal listing keeps its old form beside the Delta actions; key files."""

from __future__ import annotations

import os

import pytest

from zerocomm_spark.agent.cli import _with_history_action, build_parser
from zerocomm_spark.errors import ConfigurationError, InsecurePermissionsError
from zerocomm_spark.pipelines.commands import origin_label, read_key_file
from zerocomm_spark.pipelines.history_key import HistoryKey


@pytest.mark.parametrize("argv, expected", [
    (["history", "g"], ["history", "show", "g"]),
    (["--json", "history", "g", "--all"], ["--json", "history", "show", "g", "--all"]),
    (["--config", "c.toml", "history", "--limit", "5", "g"], ["--config", "c.toml", "history", "show", "--limit", "5", "g"]),
    (["history", "ingest", "g", "--table", "t"], ["history", "ingest", "g", "--table", "t"]),
    (["--timeout", "9", "history", "vacuum", "--table", "t"], ["--timeout", "9", "history", "vacuum", "--table", "t"]),
    (["send", "history", "x"], ["send", "history", "x"]),  # "history" as a group name elsewhere is left alone
    (["history", "--help"], ["history", "--help"]),
])
def test_history_without_an_action_is_the_journal_listing(argv, expected):
    assert _with_history_action(argv) == expected


def test_every_history_action_parses():
    parser = build_parser()
    args = parser.parse_args(_with_history_action(["history", "g", "--limit", "3"]))
    assert (args.history_command, args.group, args.limit) == ("show", "g", 3)
    args = parser.parse_args(["history", "ingest", "a", "b", "--table", "/t", "--available-now", "--max-per-trigger", "9"])
    assert (args.groups, args.table, args.available_now, args.max_per_trigger) == (["a", "b"], "/t", True, 9)
    args = parser.parse_args(["history", "replay", "g", "--table", "/t", "--since-lamport", "7", "--verify"])
    assert (args.since_lamport, args.since_version, args.verify) == (7, None, True)
    with pytest.raises(SystemExit):  # one "since" at a time
        parser.parse_args(["history", "replay", "g", "--table", "/t", "--since-lamport", "7", "--since-version", "1"])
    args = parser.parse_args(["history", "vacuum", "--table", "/t", "--retain-hours", "0", "--dry-run"])
    assert (args.retain_hours, args.dry_run) == (0.0, True)
    assert parser.parse_args(["history", "compact", "--table", "/t"]).group is None


def test_key_files_must_be_owner_only_and_hold_a_key(tmp_path):
    key = HistoryKey.generate()
    raw, text = tmp_path / "raw.key", tmp_path / "hex.key"
    raw.write_bytes(key.secret)
    text.write_text(key.secret.hex() + "\n")
    for path in (raw, text):
        os.chmod(path, 0o600)
        assert read_key_file(path) == key
    os.chmod(text, 0o644)
    with pytest.raises(InsecurePermissionsError):
        read_key_file(text)
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    os.chmod(bad, 0o600)
    with pytest.raises(ConfigurationError):
        read_key_file(bad)
    with pytest.raises(ConfigurationError):
        read_key_file(tmp_path / "missing.key")


def test_compacts_date_filter_goes_into_sql_only_as_a_checked_date() -> None:
    from zerocomm_spark.errors import ConfigurationError
    from zerocomm_spark.pipelines.history import _where

    assert _where("o'k", "2026-01-31") == "`group` = 'o\\'k' AND `date` >= DATE '2026-01-31'"
    for bad in ("2026-01-31' OR TRUE --", "yesterday", 20260131):
        with pytest.raises(ConfigurationError, match="since_date"):
            _where(None, bad)  # type: ignore[arg-type]


def test_the_origin_column_tells_an_unsigned_row_from_a_forged_one() -> None:
    assert origin_label({"origin_ok": True, "origin_sig": b"s" * 64}) == "ok"
    assert origin_label({"origin_ok": False, "origin_sig": b"s" * 64}) == "FAILED"
    assert origin_label({"origin_ok": False, "origin_sig": None}) == "unsigned"  # sent without a signer
    assert origin_label({"origin_sig": None}) == ""  # not verified
    # Signed, but sealed with a history key we were not given: it cannot be checked, it did not fail.
    sealed = {"origin_ok": False, "origin_sig": b"s" * 64, "payload_key_id": "k1"}
    assert origin_label(sealed) == "sealed" and origin_label(sealed, "k2") == "sealed"
    assert origin_label(sealed, "k1") == "FAILED"  # still sealed under the key given: altered or moved


def test_replay_json_says_what_the_origin_column_says(monkeypatch, capsys, tmp_path):
    """`history replay --verify --json` gave origin_ok false alike for a row nobody signed, a row sealed
    with a key not given and a forged one; the table tells them apart (ORIGIN), so the JSON does too."""
    import datetime as dt
    import json

    import zerocomm_spark.pipelines.commands as commands
    import zerocomm_spark.pipelines.replay as replay_mod
    from zerocomm_spark.agent.cli import main as zerocomm

    at = dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc)

    def row(seq, sig, ok, key_id=None):
        return {"group": "g", "message_id": f"m{seq}", "publisher_did": "did:key:z6Mkp", "publisher_label": "p",
                "seq": seq, "lamport_ts": seq, "sent_at": at, "received_at": at, "headers": None,
                "payload": b"x", "payload_key_id": key_id, "origin_sig": sig, "origin_ok": ok}

    rows = [row(1, b"s" * 64, True), row(2, None, False), row(3, b"s" * 64, False), row(4, b"s" * 64, False, "k9")]

    class Frame:
        def limit(self, n):
            return self

        def toArrow(self):
            class Table:
                def to_pylist(self):
                    return rows
            return Table()

    monkeypatch.setenv("HOME", str(tmp_path))  # no configuration of this host's
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(commands, "_spark", lambda: None)
    monkeypatch.setattr(replay_mod, "replay", lambda *a, **k: Frame())
    assert zerocomm(["--json", "history", "replay", "g", "--table", "/t", "--verify"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert [r["origin"] for r in out] == ["ok", "unsigned", "FAILED", "sealed"]
    assert [r["origin_ok"] for r in out] == [True, False, False, False]
    rows = [{k: v for k, v in r.items() if k != "origin_ok"} for r in rows]  # not verified: no verdict
    assert zerocomm(["--json", "history", "replay", "g", "--table", "/t"]) == 0
    assert {json.loads(x)["origin"] for x in capsys.readouterr().out.splitlines() if x.strip()} == {None}
