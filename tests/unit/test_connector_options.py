"""Options of format("zerocomm"): parsed into typed values, or refused naming the option and the fix."""

from __future__ import annotations

import pickle

import pytest

from zerocomm_spark.connector.options import SINK_OPTIONS, SOURCE_OPTIONS, AgentOptions, SinkOptions, SourceOptions
from zerocomm_spark.errors import ConfigurationError, ConnectorOptionError


def test_source_defaults():
    opts = SourceOptions.parse({"group": "sensors"}, mode="stream")
    assert opts.groups == ("sensors",)
    assert opts.starting.kind == "latest"
    assert opts.max_messages_per_trigger is None
    assert opts.fail_on_data_loss is True and opts.include_headers is False
    assert opts.agent == AgentOptions(where=None, spawn=True, timeout_s=30.0)
    assert SourceOptions.parse({"group": "sensors"}, mode="batch").starting.kind == "earliest"
    # values are plain data: the options travel to executors inside partitions
    assert pickle.loads(pickle.dumps(opts)) == opts


def test_source_options_are_case_insensitive_and_typed():
    opts = SourceOptions.parse({"GROUP": "a, b,a", "maxmessagespertrigger": "25", "FailOnDataLoss": "false",
                                "includeHeaders": "TRUE", "agent": " /run/zc ", "agentTimeoutMs": "1500",
                                "minPartitions": "4", "readTimeoutMs": "250", "startingOffsets": "earliest",
                                "checkpointLocation": "/tmp/x"}, mode="stream")
    assert opts.groups == ("a", "b")
    assert opts.max_messages_per_trigger == 25
    assert opts.fail_on_data_loss is False and opts.include_headers is True
    assert opts.agent.where == "/run/zc" and opts.agent.timeout_s == 1.5
    assert opts.min_partitions == 4 and opts.read_timeout_s == 0.25
    assert SourceOptions.parse({"group": '["x,y", "z"]'}).groups == ("x,y", "z")


@pytest.mark.parametrize("options, words", [
    ({}, "option group is missing"),
    ({"group": " "}, "option group is missing"),
    ({"group": "a:b"}, "option group"),
    ({"group": "[1]"}, "JSON list"),
    ({"group": "[" * 100_000}, "JSON list"),
    ({"group": "[]"}, "option group is .*: it names no group"),
    # An empty name in the list said only "a group name is a non-empty string, got str".
    ({"group": "sensors,"}, r"option group is 'sensors,': the comma-separated list has an empty name \(name 2 of 2, "
                            r"after 'sensors'\)"),
    ({"group": "a,,b"}, r"the comma-separated list has an empty name \(name 2 of 3, after 'a'\)"),
    ({"group": ",a"}, r"the comma-separated list has an empty name \(name 1 of 2, at the start\)"),
    ({"group": '["a",""]'}, r"option group is '\[\"a\",\"\"\]': the JSON list has an empty name \(name 2 of 2, "
                            r"after 'a'\)"),
    ({"group": "g", "maxMessagePerTrigger": "5"}, "Did you mean 'maxMessagesPerTrigger'"),
    ({"group": "g", "colour": "blue"}, "unknown option 'colour'"),
    ({"group": "g", "maxMessagesPerTrigger": "0"}, "maxMessagesPerTrigger is 0; it must be >= 1"),
    ({"group": "g", "maxMessagesPerTrigger": "lots"}, "maxMessagesPerTrigger is 'lots', not an integer"),
    ({"group": "g", "failOnDataLoss": "maybe"}, "failOnDataLoss is 'maybe', not a boolean"),
    ({"group": "g", "publishTimeoutMs": "5"}, "applies to writes only"),
    ({"group": "g", "startingOffsets": "soon"}, "startingOffsets is 'soon'"),
    ({"group": "g", "agent": ""}, "option agent is empty"),
    ({"group": "g", "agent": "/run/zc\x00x"}, "option agent contains a NUL"),
])
def test_bad_source_options_name_the_option(options, words):
    with pytest.raises(ConnectorOptionError, match=words) as info:
        SourceOptions.parse(options)
    assert isinstance(info.value, ConfigurationError) and isinstance(info.value, ValueError)
    assert info.value.hint  # every refusal says what to do


def test_mode_specific_source_checks():
    with pytest.raises(ConnectorOptionError, match="endingOffsets applies to batch reads"):
        SourceOptions.parse({"group": "g", "endingOffsets": "latest"}, mode="stream")
    with pytest.raises(ConnectorOptionError, match="maxMessagesPerTrigger applies to streams"):
        SourceOptions.parse({"group": "g", "maxMessagesPerTrigger": "5"}, mode="batch")
    assert SourceOptions.parse({"group": "g", "endingOffsets": "latest"}, mode="batch").ending.kind == "latest"


def test_sink_options():
    opts = SinkOptions.parse({"group": "out", "publishTimeoutMs": "2000", "checkpointLocation": "/c"})
    assert opts.group == "out" and opts.publish_timeout_s == 2.0 and opts.publish_batch_size == 2000
    with pytest.raises(ConnectorOptionError, match="a write goes to exactly one"):
        SinkOptions.parse({"group": "a,b"})
    with pytest.raises(ConnectorOptionError, match="option group is 'out,': the comma-separated list has an empty"):
        SinkOptions.parse({"group": "out,"})
    with pytest.raises(ConnectorOptionError, match="applies to reads only"):
        SinkOptions.parse({"group": "a", "startingOffsets": "earliest"})
    with pytest.raises(ConnectorOptionError, match="publishBatchSize"):
        SinkOptions.parse({"group": "a", "publishBatchSize": "-1"})


def test_sign_origin_is_off_unless_asked_and_must_be_a_boolean():
    assert SinkOptions.parse({"group": "g"}).sign_origin is False
    assert SinkOptions.parse({"group": "g", "signOrigin": "true"}).sign_origin is True
    assert SinkOptions.parse({"group": "g", "signorigin": "false"}).sign_origin is False
    with pytest.raises(ConnectorOptionError, match="signOrigin"):
        SinkOptions.parse({"group": "g", "signOrigin": "sometimes"})
    with pytest.raises(ConnectorOptionError, match="applies to writes only"):
        SourceOptions.parse({"group": "g", "signOrigin": "true"})


@pytest.mark.parametrize("name", ["agentTimeoutMs", "readTimeoutMs", "publishTimeoutMs"])
def test_timeouts_past_what_a_wait_can_take_are_refused_by_name(name):
    """A timeout of 10**14 ms parsed, then every call of the query died with an OverflowError from a
    lock wait in the client (outside the ZeroComm errors, after the query had started)."""
    import threading

    from zerocomm_spark.connector.options import MAX_TIMEOUT_MS

    parse = SinkOptions.parse if name == "publishTimeoutMs" else SourceOptions.parse
    with pytest.raises(ConnectorOptionError, match=f"{name} is 100000000000000; it must be at most {MAX_TIMEOUT_MS}"):
        parse({"group": "g", name: str(10**14)})
    parsed = parse({"group": "g", name: str(MAX_TIMEOUT_MS)})
    seconds = {"agentTimeoutMs": lambda o: o.agent.timeout_s, "readTimeoutMs": lambda o: o.read_timeout_s,
               "publishTimeoutMs": lambda o: o.publish_timeout_s}[name](parsed)
    assert seconds == MAX_TIMEOUT_MS / 1000 and seconds < threading.TIMEOUT_MAX
    assert threading.Lock().acquire(timeout=seconds)  # what the client's call does with it


def test_option_tables_document_every_option():
    for table in (SOURCE_OPTIONS, SINK_OPTIONS):
        assert all(isinstance(v, str) and v for v in table.values())
    assert {"group", "startingOffsets", "startingTimestamp", "maxMessagesPerTrigger", "failOnDataLoss",
            "includeHeaders"} <= set(SOURCE_OPTIONS)


@pytest.mark.parametrize("starting", ["latest", " Latest", '{"g": "latest"}', '{"g": {"did:peer:2.bob": -1}}'])
def test_a_batch_read_starting_at_latest_is_refused_like_one_ending_at_earliest(starting):
    """spark.read reads [startingOffsets, endingOffsets) once: from latest that is nothing, so every such
    read came back empty without a word (endingOffsets=earliest, as empty, is refused)."""
    with pytest.raises(ConnectorOptionError, match="startingOffsets .*latest.* would read nothing") as info:
        SourceOptions.parse({"group": "g", "startingOffsets": starting}, mode="batch")
    assert "earliest" in info.value.hint
    # streams start at latest by default; a batch read may start at earliest or at seqs
    assert SourceOptions.parse({"group": "g", "startingOffsets": starting}, mode="stream").starting is not None
    SourceOptions.parse({"group": "g", "startingOffsets": '{"g": {"did:peer:2.bob": 5}}'}, mode="batch")
    SourceOptions.parse({"group": "g", "startingOffsets": '{"g": "earliest"}'}, mode="batch")


@pytest.mark.parametrize("key", ["path", "PATH", "paths"])
def test_a_path_is_refused_naming_the_group_option(key):
    """load("sensors") passes the path option, which was dropped without a word: the read went to
    whatever the group option named (or failed on a missing group) while the code said "sensors"."""
    with pytest.raises(ConnectorOptionError, match="reads take no path, but load\\(\\) was given 'sensors'") as info:
        SourceOptions.parse({"group": "g", key: "sensors"})
    assert '.option("group", ...)' in info.value.hint
    with pytest.raises(ConnectorOptionError, match="writes take no path, but save\\(\\) or start\\(\\) was given") as info:
        SinkOptions.parse({"group": "g", key: "/tmp/out"})
    assert '.option("group", ...)' in info.value.hint and "checkpointLocation" in info.value.hint
    SinkOptions.parse({"group": "g", "checkpointLocation": "/c", "queryName": "q"})  # Spark's own still pass


@pytest.mark.parametrize("mode", ["any", "batch"])
def test_a_batch_read_starting_after_its_end_is_refused_at_load(mode):
    """startingOffsets {DID: 10} with endingOffsets {DID: 5} returned 0 rows of that publisher without a
    word. Refused at load, naming the group, the publisher and both values; an equal start and end (an
    empty range, endingOffsets being exclusive) and an end at -1 (latest) are not."""
    did = "did:peer:2.bob"
    with pytest.raises(ConnectorOptionError, match=f"publisher {did} in group 'g': startingOffsets 10 is after "
                                                   "endingOffsets 5") as info:
        SourceOptions.parse({"group": "g,h", "startingOffsets": f'{{"g": {{"{did}": 10}}, "h": "earliest"}}',
                             "endingOffsets": f'{{"g": {{"{did}": 5}}}}'}, mode=mode)
    assert "at or below 5" in info.value.hint
    for end in (10, 11, -1):
        SourceOptions.parse({"group": "g", "startingOffsets": f'{{"g": {{"{did}": 10}}}}',
                             "endingOffsets": f'{{"g": {{"{did}": {end}}}}}'}, mode=mode)
    # A stream takes no endingOffsets: it is refused as such, whatever the start.
    with pytest.raises(ConnectorOptionError, match="endingOffsets applies to batch reads"):
        SourceOptions.parse({"group": "g", "startingOffsets": f'{{"g": {{"{did}": 10}}}}',
                             "endingOffsets": f'{{"g": {{"{did}": 5}}}}'}, mode="stream")
