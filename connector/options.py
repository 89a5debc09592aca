"""The options of format("zerocomm"), parsed once into typed, picklable values.

Why strict: Spark hands a data source every option as a string, and a misspelt option that is
silently ignored (``maxMessagePerTrigger``) is the classic streaming bug. Unknown or malformed
options therefore fail at ``load()`` (reads) or ``start()``/``save()`` (writes), and every message
names the option and says what to write instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Literal

from zerocomm_spark.errors import ConnectorOptionError, InvalidGroupNameError
from zerocomm_spark.group.topics import check_group

from zerocomm_spark.connector.offsets import LATEST, EndingOffsets, StartingOffsets

__all__ = [
    "SINK_OPTIONS",
    "SOURCE_OPTIONS",
    "AgentOptions",
    "SinkOptions",
    "SourceOptions",
]

# canonical spelling -> what it does (the table in connector/README.md says the same)
_COMMON = {
    "group": "group name (reads: one or several, comma-separated or a JSON list; writes: exactly one)",
    "agent": "the member agent to use on every host: a socket directory, ipc:// endpoint or zerocomm.toml; "
             "default: the configuration in force on each host ($ZEROCOMM_CONFIG, ~/.zerocomm)",
    "spawnAgent": "start the host's agent when none answers (default true)",
    "agentTimeoutMs": "how long to wait for the agent to answer (or start) (default 30000)",
}
SOURCE_OPTIONS: dict[str, str] = {
    **_COMMON,
    "startingOffsets": "earliest, latest or per-publisher JSON (streaming default latest, batch earliest)",
    "startingTimestamp": "ms since the epoch: start at each publisher's first message sent at or after it",
    "endingOffsets": "batch reads only: latest (default) or per-publisher JSON, exclusive",
    "maxMessagesPerTrigger": "at most this many messages per micro-batch (Spark admission control)",
    "failOnDataLoss": "fail (true, default) or warn and skip (false) when messages are gone",
    "includeHeaders": "add a headers map<string,string> column (default false)",
    "minPartitions": "split reads into at least this many Spark partitions",
    "maxMessagesPerPartition": "split a publisher's range into partitions of at most this many (default 50000)",
    "readTimeoutMs": "how long an executor waits for its host's member to have a partition's messages "
                     "(default 60000)",
    "commitToAgent": "tell the agent the checkpointed position so its journal may prune below it (default true)",
}
SINK_OPTIONS: dict[str, str] = {
    **_COMMON,
    "publishTimeoutMs": "how long to wait for the group to acknowledge a batch of messages (default 120000)",
    "publishBatchSize": "messages per publish call, each acknowledged by the group (default 2000)",
    "publishBatchBytes": "bytes of payload per publish call at most (default 8388608, fitted to the agent's "
                         "api.max_request_bytes; a value set past it is refused)",
    "signOrigin": "have the agent sign every row with its member key, an origin proof history verifies "
                  "(header zc-origin; default false)",
}
# Options Spark itself passes to a data source (or that users set for Spark, not for us).
_SPARK_OWNED = {"checkpointlocation", "queryname", "__checkpointlocation"}
# What load(path) / save(path) / start(path) pass: a group is not a path, and ignoring one silently
# read or wrote the group option's group while the code said another.
_PATHS = {"path", "paths"}

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _check_known(options: Mapping[str, str], known: Mapping[str, str], other: Mapping[str, str],
                 what: Literal["read", "write"]) -> dict[str, str]:
    """Lower-cased option -> value; unknown names fail with the closest known name."""
    canonical = {name.lower(): name for name in known}
    out: dict[str, str] = {}
    for key, value in options.items():
        low = key.lower()
        if low in _PATHS:
            call = "load()" if what == "read" else "save() or start()"
            raise ConnectorOptionError(
                f"format(\"zerocomm\") {what}s take no path, but {call} was given {value!r}",
                hint=f"Name the group with .option(\"group\", ...) and call {call.split(' or ')[0]} without a "
                     "path" + ("; the checkpoint goes in .option(\"checkpointLocation\", ...)" if what == "write" else ""))
        if low in canonical:
            out[low] = value
            continue
        if low in _SPARK_OWNED or low.startswith("spark."):
            continue
        if low in {n.lower() for n in other}:
            mode = "writes" if what == "read" else "reads"
            raise ConnectorOptionError(f"option {key!r} applies to {mode} only, not to {what}s with format(\"zerocomm\")",
                                       hint="Remove it from this " + ("reader" if what == "read" else "writer"))
        close = get_close_matches(low, list(canonical), n=1, cutoff=0.6)
        suggestion = f"Did you mean {canonical[close[0]]!r}? " if close else ""
        raise ConnectorOptionError(
            f"unknown option {key!r} for format(\"zerocomm\") {what}s",
            hint=f"{suggestion}Known options: {', '.join(sorted(known))}")
    return out


def _bool(opts: Mapping[str, str], name: str, default: bool) -> bool:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConnectorOptionError(f"option {name} is {raw!r}, not a boolean", hint=f"Use {name}=true or {name}=false")


#: The longest a *TimeoutMs option may be: 2**31 - 1 ms (about 24.8 days), the usual bound of a
#: millisecond timeout. A larger one overflowed the lock and socket waits of the client (and the
#: agent) with an OverflowError from deep inside a call, outside the ZeroComm errors.
MAX_TIMEOUT_MS = (1 << 31) - 1


def _int(opts: Mapping[str, str], name: str, default: int | None, *, minimum: int = 1,
         maximum: int | None = None) -> int | None:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConnectorOptionError(f"option {name} is {raw!r}, not an integer",
                                   hint=f"Give a whole number >= {minimum}, e.g. {name}={max(minimum, 1000)}") from None
    if value < minimum:
        raise ConnectorOptionError(f"option {name} is {value}; it must be >= {minimum}",
                                   hint=f"Give a whole number >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConnectorOptionError(f"option {name} is {value}; it must be at most {maximum}",
                                   hint=f"Give a whole number from {minimum} to {maximum}"
                                        + (" (about 24.8 days)" if maximum == MAX_TIMEOUT_MS else ""))
    return value


def _groups(opts: Mapping[str, str], *, single: bool) -> tuple[str, ...]:
    raw = opts.get("group")
    if raw is None or not raw.strip():
        example = '.option("group", "sensors")'
        raise ConnectorOptionError("option group is missing",
                                   hint=f"Name the group to {'write to' if single else 'read'}: {example}"
                                   + ("" if single else ', or several: .option("group", "a,b")'))
    text = raw.strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except (ValueError, RecursionError):
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConnectorOptionError(f"option group is {raw!r}: not a JSON list of names",
                                       hint='Use a name, comma-separated names, or a JSON list: ["a", "b"]')
    else:
        names = [n.strip() for n in text.split(",")]
    groups: list[str] = []
    for i, name in enumerate(names):
        if name == "":  # check_group said only "a group name is a non-empty string, got str"
            where = f"after {names[i - 1]!r}" if i else "at the start"
            listed = "the JSON list" if text.startswith("[") else "the comma-separated list"
            raise ConnectorOptionError(
                f"option group is {raw!r}: {listed} has an empty name (name {i + 1} of {len(names)}, {where})",
                hint="Remove the stray comma (or the empty string), e.g. .option(\"group\", \"a,b\") or "
                     "'[\"a\", \"b\"]'")
        try:
            check_group(name)
        except InvalidGroupNameError as exc:
            raise ConnectorOptionError(f"option group: {str(exc).split('. ')[0]}", hint=exc.hint) from None
        if name not in groups:
            groups.append(name)
    if not groups:  # '[]' would read nothing, forever, without a word
        raise ConnectorOptionError(f"option group is {raw!r}: it names no group",
                                   hint='Name at least one group: .option("group", "sensors")')
    if single and len(groups) != 1:
        raise ConnectorOptionError(f"option group names {len(groups)} groups; a write goes to exactly one",
                                   hint="Write the DataFrame once per group, or union the groups' streams when reading")
    return tuple(groups)


@dataclass(frozen=True)
class AgentOptions:
    """Where each process finds its host's member; only plain values, so it pickles to executors."""

    where: str | None = None
    spawn: bool = True
    timeout_s: float = 30.0

    @classmethod
    def parse(cls, opts: Mapping[str, str]) -> "AgentOptions":
        where = opts.get("agent")
        if where is not None and not where.strip():
            raise ConnectorOptionError("option agent is empty",
                                       hint="Leave it out to use each host's configured agent, or give a socket "
                                            "directory, ipc:// endpoint or zerocomm.toml path")
        if where is not None and "\x00" in where:  # no path or endpoint holds one: it failed only once the query ran
            raise ConnectorOptionError("option agent contains a NUL character",
                                       hint="Give a socket directory, ipc:// endpoint or zerocomm.toml path")
        timeout = _int(opts, "agentTimeoutMs", 30_000, maximum=MAX_TIMEOUT_MS)
        assert timeout is not None
        return cls(where=where.strip() if where else None, spawn=_bool(opts, "spawnAgent", True),
                   timeout_s=timeout / 1000.0)


@dataclass(frozen=True)
class SourceOptions:
    """Everything a read needs, validated."""

    groups: tuple[str, ...]
    agent: AgentOptions
    starting: StartingOffsets
    ending: EndingOffsets
    max_messages_per_trigger: int | None
    fail_on_data_loss: bool
    include_headers: bool
    min_partitions: int
    max_messages_per_partition: int
    read_timeout_s: float
    commit_to_agent: bool

    @classmethod
    def parse(cls, options: Mapping[str, str], *, mode: Literal["any", "stream", "batch"] = "any") -> "SourceOptions":
        """Validate reader options; ``mode`` adds the checks that depend on streaming vs batch."""
        opts = _check_known(options, SOURCE_OPTIONS, SINK_OPTIONS, "read")
        groups = _groups(opts, single=False)
        streaming_default = "earliest" if mode == "batch" else "latest"
        starting = StartingOffsets.parse(opts.get("startingoffsets"), groups, default=streaming_default,
                                         timestamp=opts.get("startingtimestamp"))
        if mode == "stream" and "endingoffsets" in opts:
            raise ConnectorOptionError("option endingOffsets applies to batch reads (spark.read), not to streams",
                                       hint="Remove it, or use trigger(availableNow=True) to stop at the newest "
                                            "messages seen at start")
        ending = EndingOffsets.parse(opts.get("endingoffsets"), groups)
        ending.check_start(starting)  # seqs named in both; a start resolved past the end at planning is warned of
        if mode == "batch" and (starting.kind == "latest" or LATEST in starting.per_group.values()
                                or LATEST in starting.per_publisher.values()):
            # [latest, ...) is empty: the read came back with nothing, without a word (as Kafka refuses it)
            raise ConnectorOptionError("startingOffsets at latest (or -1) would read nothing in a batch read",
                                       hint="Use startingOffsets=earliest (the default for spark.read) or seqs, or "
                                            "spark.readStream for messages from now on")
        max_per_trigger = _int(opts, "maxMessagesPerTrigger", None)
        if mode == "batch" and max_per_trigger is not None:
            raise ConnectorOptionError("option maxMessagesPerTrigger applies to streams, not to batch reads",
                                       hint="Remove it, or limit the batch with endingOffsets")
        read_timeout = _int(opts, "readTimeoutMs", 60_000, maximum=MAX_TIMEOUT_MS)
        assert read_timeout is not None
        min_partitions = _int(opts, "minPartitions", 1)
        per_partition = _int(opts, "maxMessagesPerPartition", 50_000)
        assert min_partitions is not None and per_partition is not None
        return cls(groups=groups, agent=AgentOptions.parse(opts), starting=starting, ending=ending,
                   max_messages_per_trigger=max_per_trigger,
                   fail_on_data_loss=_bool(opts, "failOnDataLoss", True),
                   include_headers=_bool(opts, "includeHeaders", False),
                   min_partitions=min_partitions, max_messages_per_partition=per_partition,
                   read_timeout_s=read_timeout / 1000.0, commit_to_agent=_bool(opts, "commitToAgent", True))


@dataclass(frozen=True)
class SinkOptions:
    """Everything a write needs, validated."""

    group: str
    agent: AgentOptions
    publish_timeout_s: float
    publish_batch_size: int
    publish_batch_bytes: int
    publish_batch_bytes_set: bool = False  # given by the user (refused past the agent's limit) or the default (fitted)
    sign_origin: bool = False  # the agent adds each row's origin proof (zerocomm_spark/group/origin.py)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> "SinkOptions":
        opts = _check_known(options, SINK_OPTIONS, SOURCE_OPTIONS, "write")
        group = _groups(opts, single=True)[0]
        timeout = _int(opts, "publishTimeoutMs", 120_000, maximum=MAX_TIMEOUT_MS)
        size = _int(opts, "publishBatchSize", 2000)
        size_bytes = _int(opts, "publishBatchBytes", 8 * 1024 * 1024)
        assert timeout is not None and size is not None and size_bytes is not None
        return cls(group=group, agent=AgentOptions.parse(opts), publish_timeout_s=timeout / 1000.0,
                   publish_batch_size=size, publish_batch_bytes=size_bytes,
                   publish_batch_bytes_set="publishbatchbytes" in opts,
                   sign_origin=_bool(opts, "signOrigin", False))
