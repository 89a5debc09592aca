"""The Delta pipelines given hostile or damaged tables: someone with write access to the table's
storage, or a user pointing the tools at the wrong table.

Each table is real Delta, written through Spark (which, like Delta, checks neither that strings are
UTF-8 nor, for a table declared so, that columns are not null); rows are signed by a real member key.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import uuid
from pathlib import Path

import pytest

from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType

from zerocomm_spark.connector import source_schema
from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.keys.keypair import KeyPair
from zerocomm_spark.pipelines.history import HistoryWriter
from zerocomm_spark.pipelines.origin import OriginSigner
from zerocomm_spark.pipelines.replay import replay
from zerocomm_spark.pipelines.restore import DeltaProvider, DeltaSink, have_from_table, restore

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

SENT = dt.datetime(2026, 11, 23, 12, 0, 0)


@pytest.fixture(scope="module")
def alice() -> OriginSigner:
    return OriginSigner(KeyPair.generate())


def history(spark, tmp_path: Path, signer: OriginSigner, ids: list[str], payloads: dict[str, bytes] | None = None) -> str:
    """A history table written by ingest's writer from signed messages (headers {"k": "v"} plus the proof)."""
    ck = tmp_path / f"ck-{uuid.uuid4().hex[:6]}"
    ck.mkdir()
    (ck / "metadata").write_text(json.dumps({"id": str(uuid.uuid4())}) + "\n")
    schema = source_schema(include_headers=True)
    rows = []
    for i, mid in enumerate(ids):
        payload = (payloads or {}).get(mid, f"secret {mid}".encode())
        row = {"group": "g", "message_id": mid, "publisher_did": signer.publisher_did, "seq": i + 1,
               "lamport_ts": i + 1, "sent_at": SENT, "received_at": SENT, "payload": payload,
               "headers": signer.headers("g", mid, payload, {"k": "v"})}
        rows.append({f.name: row.get(f.name) for f in schema.fields})
    table = tmp_path / f"t-{uuid.uuid4().hex[:6]}"
    HistoryWriter(str(table), str(ck))(spark.createDataFrame(rows, schema), 0)
    return str(table)


def rewrite(spark, df, tmp_path: Path, *, nullable: bool = False) -> str:
    """``df`` saved as a new Delta table (every column nullable if asked: a table made by someone else)."""
    if nullable:
        df = spark.createDataFrame(df.rdd, StructType([StructField(f.name, f.dataType, True) for f in df.schema]))
    path = str(tmp_path / f"hostile-{uuid.uuid4().hex[:6]}")
    df.write.format("delta").partitionBy("group", "date").save(path)
    return path


def not_utf8(hex_bytes: str):
    """A Spark string column holding these bytes: Spark casts binary to string without checking them."""
    return F.unhex(F.lit(hex_bytes)).cast("string")


def test_a_table_whose_columns_have_other_types_is_refused_by_every_reader_and_the_sink(spark, tmp_path, alice):
    """Only the column names were checked: seq and lamport_ts as text replayed in text order
    ("10" before "2") as if verified, a provider's every key was "malformed", and a restore's sink failed
    with Delta's DELTA_FAILED_TO_MERGE_FIELDS after the whole exchange."""
    good = history(spark, tmp_path, alice, [f"m{i}" for i in range(12)])
    held = spark.read.format("delta").load(good)
    texts = rewrite(spark, held.withColumn("seq", F.col("seq").cast("string"))
                    .withColumn("lamport_ts", F.col("lamport_ts").cast("string")), tmp_path)
    with pytest.raises(ConfigurationError, match="seq is string, not bigint; lamport_ts is string, not bigint"):
        replay(spark, texts, "g", verify=True)
    with pytest.raises(ConfigurationError, match="lamport_ts is string"):
        restore("g", [DeltaProvider(spark, texts, "p")])
    with pytest.raises(ConfigurationError, match="seq is string"):
        have_from_table(spark, texts, "g")
    with pytest.raises(ConfigurationError, match="seq is string"):
        restore("g", [DeltaProvider(spark, good, "p")], deliver=DeltaSink(spark, texts))
    assert spark.read.format("delta").load(texts).count() == 12  # nothing appended
    narrow = rewrite(spark, held.withColumn("payload", F.col("payload").cast("string")), tmp_path)
    with pytest.raises(ConfigurationError, match="payload is string, not binary"):
        replay(spark, narrow, "g")
    extra = rewrite(spark, held.withColumn("note", F.lit(1)), tmp_path)  # extra columns are no harm
    assert replay(spark, extra, "g").count() == 12


def test_text_that_is_not_utf8_fails_its_row_not_the_replay_or_the_restore(spark, tmp_path, alice):
    """One message id (or label) that is not UTF-8 failed a whole verified replay (UnicodeDecodeError in
    the Python worker), made a provider's announce fail (none of its messages restored), and made
    have_from_table raise UnicodeDecodeError."""
    good = history(spark, tmp_path, alice, ["a", "b", "c", "d"])
    held = spark.read.format("delta").load(good)
    hostile = rewrite(spark, held
                      .withColumn("message_id", F.when(F.col("message_id") == "b", not_utf8("62fe"))
                                  .otherwise(F.col("message_id")))
                      .withColumn("publisher_label", F.when(F.col("message_id") == "c", not_utf8("ff41"))
                                  .otherwise(F.col("publisher_label"))), tmp_path)
    checked = replay(spark, hostile, "g", verify=True).select(F.hex("message_id").alias("id"), "origin_ok").collect()
    assert sorted((r["id"], r["origin_ok"]) for r in checked) == [
        ("61", True), ("62FE", False), ("63", True), ("64", True)]  # c's label is not covered by the proof
    report = restore("g", [DeltaProvider(spark, hostile, "hostile"), DeltaProvider(spark, good, "honest")])
    assert sorted(report.delivered_ids) == ["a", "b", "c", "d"]
    assert {(r.provider, r.message_id, r.reason) for r in report.rejected} == {
        ("hostile", None, "malformed announcement"),
        ("hostile", "c", "malformed row (text that is not UTF-8)")}
    assert report.requested == {"hostile": 3, "honest": 2}
    assert have_from_table(spark, hostile, "g").message_ids == {"a", "c", "d"}


def test_a_proof_header_added_to_a_row_or_a_nulled_payload_is_not_verified(spark, tmp_path, alice):
    """The origin digest leaves the zc-origin header out (the publisher attaches it after signing), and
    ingest moves it into origin_sig: a zc-origin header added to a history row's headers still
    verified, and was restored as verified. A null payload (NOT NULL, but not enforced on read) was
    verified as the empty payload."""
    good = history(spark, tmp_path, alice, ["a", "b", "empty"], payloads={"empty": b""})
    held = spark.read.format("delta").load(good)
    added = F.map_concat(F.col("headers"), F.create_map(F.lit("zc-origin"), F.lit("1:forged")))
    hostile = rewrite(spark, held
                      .withColumn("headers", F.when(F.col("message_id") == "b", added).otherwise(F.col("headers")))
                      .withColumn("payload", F.when(F.col("message_id") == "empty", F.lit(None).cast("binary"))
                                  .otherwise(F.col("payload"))), tmp_path, nullable=True)
    verdicts = {r["message_id"]: r["origin_ok"] for r in replay(spark, hostile, "g", verify=True).collect()}
    assert verdicts == {"a": True, "b": False, "empty": False}
    assert {r["message_id"]: r["origin_ok"] for r in replay(spark, good, "g", verify=True).collect()} == {
        "a": True, "b": True, "empty": True}
    report = restore("g", [DeltaProvider(spark, hostile, "hostile"), DeltaProvider(spark, good, "honest")])
    assert sorted((r.provider, r.message_id) for r in report.rejected) == [("hostile", "b"), ("hostile", "empty")]
    assert report.delivered == 3 and report.missing == []


def test_the_replay_command_on_a_damaged_or_hostile_table_says_what_is_wrong(spark, tmp_path, alice, monkeypatch,
                                                                            capsys):
    """`zerocomm history replay` printed "'NoneType' object is not subscriptable" (with the hint to check
    conf/zerocomm.toml) for a row without a publisher, and a Py4J traceback for a damaged log, an --as-of
    or --since-lamport beyond a long, or text that is not UTF-8."""
    import zerocomm_spark.pipelines.commands as commands
    from zerocomm_spark.agent.cli import main as zerocomm

    monkeypatch.setenv("HOME", str(tmp_path))  # no configuration of this host's
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(commands, "_spark", lambda: spark)
    good = history(spark, tmp_path, alice, ["a", "b"])
    held = spark.read.format("delta").load(good)
    hostile = rewrite(spark, held.withColumn("publisher_did", F.when(F.col("message_id") == "a", F.lit(None))
                                             .otherwise(F.col("publisher_did")))
                      .withColumn("message_id", F.when(F.col("message_id") == "b", not_utf8("62ff"))
                                  .otherwise(F.col("message_id"))), tmp_path, nullable=True)
    capsys.readouterr()
    assert zerocomm(["history", "replay", "g", "--table", hostile, "--verify"]) == 0
    out = capsys.readouterr().out
    assert out.count("FAILED") == 2 and "secret a" in out and "secret b" in out
    assert zerocomm(["--json", "history", "replay", "g", "--table", hostile, "--verify"]) == 0
    rows = sorted((json.loads(x) for x in capsys.readouterr().out.splitlines()), key=lambda r: r["seq"])
    assert [(r["message_id"], r["publisher_did"], r["origin"]) for r in rows] == [
        ("a", None, "FAILED"), ("b\ufffd", alice.publisher_did, "FAILED")]

    for argv, said in ((["--as-of", str(2**63)], "no Delta version"), (["--since-lamport", str(2**64)], "2\\*\\*63-1"),
                       (["--since-version", str(2**63)], "2\\*\\*63-1")):
        assert zerocomm(["history", "replay", "g", "--table", good, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("zerocomm: error:") == 1 and re.search(said, err), err
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    for part in damaged.rglob("*.parquet"):
        part.unlink()
    assert zerocomm(["history", "replay", "g", "--table", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert "could not be read" in err and "FILE_NOT_EXIST" in err and "put the table back from a copy" in err
    assert "Traceback" not in err and "\tat org." not in err
    # compact and vacuum write: their wording says what failed, not that the table "could not be read".
    assert zerocomm(["history", "compact", "--table", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert f"compacting the history table at {damaged} failed" in err and "FILE_NOT_EXIST" in err, err
    assert "Traceback" not in err
    garbled = tmp_path / "garbled"
    shutil.copytree(good, garbled)
    for log in (garbled / "_delta_log").glob("*.json"):
        log.write_text("{not json\n")  # as on an object store, without Hadoop's .crc beside it
        (log.parent / f".{log.name}.crc").unlink(missing_ok=True)
    assert zerocomm(["history", "vacuum", "--table", str(garbled), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"vacuuming the history table at {garbled} failed" in err and "FAILED_READ_FILE" in err, err
    assert "MALFORMED_RECORD_IN_PARSING" in err and "put the table back from a copy" in err and "Traceback" not in err


def test_the_history_commands_on_a_table_with_no_rows_yet_succeed_and_say_so(spark, tmp_path, alice, monkeypatch,
                                                                               capsys):
    """`history replay` of a table an ingest made but has not written to yet (no messages so far) exited
    6, "holds no messages of group 'g'" with "the groups it holds: none": a failure for nothing to
    replay. It exits 0 and says the table holds no messages yet; the other commands on it succeed too."""
    import zerocomm_spark.pipelines.commands as commands
    from zerocomm_spark.agent.cli import main as zerocomm
    from zerocomm_spark.pipelines.history import ensure_table

    monkeypatch.setenv("HOME", str(tmp_path))  # no configuration of this host's
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(commands, "_spark", lambda: spark)
    empty = str(tmp_path / "new")
    ensure_table(spark, empty)  # what `history ingest` makes before its first message
    capsys.readouterr()
    for argv in ([], ["--verify"], ["--since-version", "0"], ["--as-of", "0"], ["--since-lamport", "5"]):
        assert zerocomm(["history", "replay", "g", "--table", empty, *argv]) == 0, argv
        said = capsys.readouterr()
        assert f"the history table at {empty} holds no messages yet" in said.out, (argv, said)
        assert "error" not in said.err, (argv, said.err)
    # --json: one line per message, so none, and exit 0; the note on stderr cannot break a reader.
    assert zerocomm(["--json", "history", "replay", "g", "--table", empty]) == 0
    said = capsys.readouterr()
    assert said.out.strip() == "" and "holds no messages yet" in said.err, said
    assert zerocomm(["--json", "history", "compact", "--table", empty]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]).get("numFilesAdded", 0) == 0
    assert zerocomm(["--json", "history", "vacuum", "--table", empty, "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["files"] == 0
    report = restore("g", [DeltaProvider(spark, empty, "new")])  # a provider with nothing: nothing, no error
    assert report.delivered == 0 and report.missing == [] and report.rejected == []
    # Once the table holds rows, a group it does not hold is exit 6 again, naming those it holds.
    spark.read.format("delta").load(history(spark, tmp_path, alice, ["a"])).write.format("delta").mode(
        "append").save(empty)
    assert zerocomm(["--json", "history", "replay", "h", "--table", empty]) == 6
    assert "'g'" in json.loads(capsys.readouterr().out.splitlines()[-1])["error"]["hint"]
    assert zerocomm(["history", "replay", "g", "--table", empty, "--as-of", "0"]) == 0  # g now, none then
    assert "(no messages)" in capsys.readouterr().out


def test_the_replay_command_given_another_groups_history_key_says_so_and_prints_nothing(spark, tmp_path, monkeypatch,
                                                                                      capsys):
    """`zerocomm history replay --history-key-file` with a key that sealed none of the group's rows (the
    wrong file, another group's key) listed every message as "(sealed)" (--json: payload null) and
    exited 0, as if the key were right: a script reading the output took it for the history."""
    import os

    import zerocomm_spark.pipelines.commands as commands
    from zerocomm_spark.agent.cli import main as zerocomm
    from zerocomm_spark.pipelines.history_key import HistoryKey

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ZEROCOMM_CONFIG", raising=False)
    monkeypatch.setattr(commands, "_spark", lambda: spark)
    right, wrong = HistoryKey.generate(), HistoryKey.generate()
    files = {}
    for name, key in (("right", right), ("wrong", wrong)):
        files[name] = tmp_path / f"{name}.key"
        files[name].write_text(key.secret.hex())
        os.chmod(files[name], 0o600)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "metadata").write_text(json.dumps({"id": str(uuid.uuid4())}) + "\n")
    schema = source_schema(include_headers=True)
    rows = [{f.name: {"group": "g", "message_id": mid, "publisher_did": "did:key:zAlice", "seq": i + 1,
                      "lamport_ts": i + 1, "sent_at": SENT, "received_at": SENT, "headers": {},
                      "payload": f"secret {mid}".encode()}.get(f.name) for f in schema.fields}
            for i, mid in enumerate(["a", "b"])]
    table = str(tmp_path / "sealed")
    HistoryWriter(table, str(ck), history_key=right)(spark.createDataFrame(rows, schema), 0)
    capsys.readouterr()
    for argv, more in (([], []), (["--json"], []), (["--json"], ["--verify"])):
        assert zerocomm([*argv, "history", "replay", "g", "--table", table,
                         "--history-key-file", str(files["wrong"]), *more]) == 2, argv
        out, err = capsys.readouterr()
        if argv:  # the error document alone: no message line before it
            assert len(out.splitlines()) == 1, out
            said = json.loads(out)["error"]["message"]
        else:
            assert out == "", out
            said = err
        assert "sealed none of" in said and right.key_id in said and wrong.key_id in said, said
    assert zerocomm(["--json", "history", "replay", "g", "--table", table, "--history-key-file",
                     str(files["right"])]) == 0
    assert [json.loads(x)["payload"] for x in capsys.readouterr().out.splitlines()] == ["secret a", "secret b"]
    assert zerocomm(["--json", "history", "replay", "g", "--table", table]) == 0  # no key: listed as sealed
    assert [json.loads(x)["sealed"] for x in capsys.readouterr().out.splitlines()] == [True, True]
