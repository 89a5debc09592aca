"""Source offsets: per (group, publisher) sequence numbers, as a small immutable value.

Why sequence numbers and not journal offsets: a journal offset is local to one member (each member
journals what it received, in its own order), while a publisher's ``seq`` is the same on every
member. A checkpoint made of seqs therefore means the same thing on the driver's member and on each
executor's member, survives an agent restart, and says exactly where a restarted query resumes.

A position is the *next* seq to read (Kafka's convention): everything below it was handed to Spark.
The JSON form carries a version so that a checkpoint written by a newer connector is refused with
a clear message instead of being misread::

    {"version": 1, "groups": {"sensors": {"did:peer:2.Ez...": 42}}, "consumer": "spark-4f0c..."}

``consumer`` names the query to the member (its journal keeps what each named consumer has not
committed); it is made once, at a new query's first offset, and travels in every offset after, so a
restarted query from its checkpoint is still the same consumer. Older offsets without it still read.

``origin`` appears only in the end offset of a query's first batch: the start that batch was planned
from. Spark does not checkpoint a first batch's start; it asks ``initialOffset()`` again when it
re-runs the batch after a restart, and that answer is resolved anew ("latest" is later by then,
"earliest" is past whatever retention deleted meanwhile). With ``origin`` the re-run reads exactly the
planned range, and reports what is gone from it as data loss. Older readers ignore the field.

Everything here is pure (no Spark, no agent), so the rules are unit-tested on their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from zerocomm_spark.errors import ConnectorOptionError, OffsetFormatError

__all__ = [
    "EARLIEST",
    "LATEST",
    "OFFSET_VERSION",
    "EndingOffsets",
    "PublisherKey",
    "SeqRange",
    "SeqSlice",
    "StartingOffsets",
    "ZeroCommOffset",
    "lag",
    "limit_rows",
    "split_ranges",
]

#: Version of the offset JSON this connector writes; it reads this version and older.
OFFSET_VERSION = 1
#: In per-publisher JSON: start at the first retained message / at the next new message (Kafka's -2 / -1).
EARLIEST = -2
LATEST = -1

PublisherKey = tuple[str, str]  # (group, publisher DID)


_MAX_SEQ = (1 << 63) - 1  # seqs are int64 in the journal and on the wire


def _check_seq(value: Any, where: str, *, allow_special: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OffsetFormatError(f"{where}: a position is an integer seq, not {type(value).__name__} {value!r}")
    if 1 <= value <= _MAX_SEQ or (allow_special and value in (EARLIEST, LATEST)):
        return value
    if value > _MAX_SEQ:
        raise OffsetFormatError(f"{where}: {value} is past the largest seq ({_MAX_SEQ})")
    allowed = "a seq >= 1, -2 (earliest) or -1 (latest)" if allow_special else "a seq >= 1"
    raise OffsetFormatError(f"{where}: {value} is not {allowed}")


@dataclass(frozen=True)
class ZeroCommOffset:
    """Where a query stands: for each (group, publisher DID), the next seq it will read."""

    positions: Mapping[PublisherKey, int] = field(default_factory=dict)
    consumer: str | None = None
    #: Only in a first batch's end offset: the start it was planned from (see the module's notes).
    origin: Mapping[PublisherKey, int] | None = None

    def __post_init__(self) -> None:
        if self.consumer is not None and (not isinstance(self.consumer, str) or not self.consumer
                                          or len(self.consumer) > 200):
            raise OffsetFormatError(f"the offset's consumer must be a short non-empty string, not {self.consumer!r}")
        # Sorted once, so the JSON (which Spark compares as text) is canonical.
        object.__setattr__(self, "positions", _checked_positions(self.positions))
        if self.origin is not None:
            object.__setattr__(self, "origin", _checked_positions(self.origin))

    # --- serialization --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict Spark checkpoints (keys sorted, so equal offsets give equal text)."""
        out: dict[str, Any] = {"version": OFFSET_VERSION, "groups": _grouped(self.positions)}
        if self.consumer is not None:
            out["consumer"] = self.consumer
        if self.origin is not None:
            out["origin"] = _grouped(self.origin)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> "ZeroCommOffset":
        """Parse a checkpointed offset; refuse unknown versions instead of guessing."""
        if not isinstance(data, Mapping):
            raise OffsetFormatError(f"an offset is a JSON object, not {type(data).__name__}")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise OffsetFormatError("the offset has no integer 'version' field (not written by this connector?)")
        if version > OFFSET_VERSION:
            raise OffsetFormatError(
                f"the offset has version {version}; this connector reads up to version {OFFSET_VERSION}",
                hint="Run the query with the zerocomm-spark version that wrote the checkpoint, or a newer one")
        if version < 1:
            raise OffsetFormatError(f"offset version {version} is not valid")
        groups = data.get("groups")
        if not isinstance(groups, Mapping):
            raise OffsetFormatError("the offset has no 'groups' object")
        origin = data.get("origin")
        if origin is not None and not isinstance(origin, Mapping):
            raise OffsetFormatError("the offset's 'origin' is not an object of group -> publisher DID -> seq")
        return cls(_parsed_positions(groups), data.get("consumer"),
                   _parsed_positions(origin) if origin is not None else None)

    @classmethod
    def from_json(cls, text: str | bytes) -> "ZeroCommOffset":
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # nested past the limit: not an offset
            raise OffsetFormatError(f"the offset is not JSON: {exc}") from None
        return cls.from_dict(data)

    # --- reading ------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self.positions

    def __getitem__(self, key: PublisherKey) -> int:
        return self.positions[key]

    def __iter__(self) -> Iterator[PublisherKey]:
        return iter(self.positions)

    def __len__(self) -> int:
        return len(self.positions)

    def get(self, key: PublisherKey, default: int | None = None) -> int | None:
        return self.positions.get(key, default)

    def items(self) -> Iterable[tuple[PublisherKey, int]]:
        return self.positions.items()

    def groups(self) -> set[str]:
        return {g for g, _ in self.positions}

    def updated(self, changes: Mapping[PublisherKey, int]) -> "ZeroCommOffset":
        """These positions with ``changes`` applied (an ``origin`` is not carried: it names one batch's start)."""
        merged = dict(self.positions)
        merged.update(changes)
        return ZeroCommOffset(merged, self.consumer)

    def with_consumer(self, consumer: str | None) -> "ZeroCommOffset":
        return ZeroCommOffset(self.positions, consumer)

    def with_origin(self, start: "ZeroCommOffset") -> "ZeroCommOffset":
        """This end offset, remembering the start its batch was planned from."""
        return ZeroCommOffset(self.positions, self.consumer, start.positions)

    def planned_start(self, start: "ZeroCommOffset") -> "ZeroCommOffset":
        """The start of the batch ending here: its recorded origin if it has one, else ``start``."""
        if self.origin is None:
            return start
        return ZeroCommOffset(self.origin, self.consumer)

    def rows_until(self, end: "ZeroCommOffset") -> int:
        """How many seqs lie between this offset and ``end`` (publishers missing here count nothing)."""
        return sum(max(0, seq - self.positions.get(key, seq)) for key, seq in end.items())

    def __repr__(self) -> str:
        return f"ZeroCommOffset({self.to_json()})"


def _checked_positions(positions: Mapping[PublisherKey, int]) -> dict[PublisherKey, int]:
    ordered = {k: positions[k] for k in sorted(positions)}
    for (group, did), seq in ordered.items():
        if not isinstance(group, str) or not isinstance(did, str) or not group or not did:
            raise OffsetFormatError(f"an offset key is (group, publisher DID), got {(group, did)!r}")
        _check_seq(seq, f"offset of {did} in group {group!r}", allow_special=False)
    return ordered


def _grouped(positions: Mapping[PublisherKey, int]) -> dict[str, dict[str, int]]:
    groups: dict[str, dict[str, int]] = {}
    for (group, did), seq in positions.items():
        groups.setdefault(group, {})[did] = seq
    return groups


def _parsed_positions(groups: Mapping[Any, Any]) -> dict[PublisherKey, int]:
    positions: dict[PublisherKey, int] = {}
    for group, publishers in groups.items():
        if not isinstance(publishers, Mapping):
            raise OffsetFormatError(f"group {group!r} in the offset maps to {type(publishers).__name__}, "
                                    "not an object of publisher DID -> seq")
        for did, seq in publishers.items():
            positions[(str(group), str(did))] = _check_seq(seq, f"offset of {did} in group {group!r}",
                                                           allow_special=False)
    return positions


@dataclass(frozen=True)
class SeqRange:
    """What a member's journal holds for one publisher: seqs ``first..last`` (inclusive).

    ``first`` is the first *retained* seq (retention deletes the oldest; a member that joined late
    starts after the seqs it was never owed). ``last < first`` means nothing is retained.
    """

    first: int
    last: int

    @property
    def next(self) -> int:
        """The position just after the newest message: what "latest" means."""
        return max(self.last + 1, self.first)


@dataclass(frozen=True)
class StartingOffsets:
    """The ``startingOffsets`` / ``startingTimestamp`` option, parsed but not yet resolved.

    ``default`` applies to every publisher the JSON does not name (and to publishers that appear
    after the query started, which always start at their earliest retained seq, like new Kafka
    partitions).
    """

    kind: Literal["earliest", "latest", "json", "timestamp"]
    default: int = EARLIEST  # EARLIEST or LATEST for publishers not named
    per_group: Mapping[str, int] = field(default_factory=dict)  # group -> EARLIEST/LATEST shorthand
    per_publisher: Mapping[PublisherKey, int] = field(default_factory=dict)  # seq, EARLIEST or LATEST
    timestamp_ms: int | None = None

    @classmethod
    def parse(cls, text: str | None, groups: Iterable[str], *, default: str, option: str = "startingOffsets",
              timestamp: str | None = None) -> "StartingOffsets":
        """Parse the option value; errors name the option and show the accepted forms."""
        group_set = set(groups)
        if timestamp is not None:
            if text is not None:
                raise ConnectorOptionError(
                    f"both {option} and startingTimestamp are set",
                    hint="Give one of them: startingTimestamp (ms since the epoch) picks, per publisher, the first "
                         f"message sent at or after it; {option} names positions")
            return cls("timestamp", timestamp_ms=parse_timestamp_ms(timestamp, "startingTimestamp"))
        if text is None:
            text = default
        value = text.strip()
        if value.lower() == "earliest":
            return cls("earliest", default=EARLIEST)
        if value.lower() == "latest":
            return cls("latest", default=LATEST)
        return cls("json", **_parse_json_positions(value, group_set, option, allow_latest=True))

    def resolve(self, known: Mapping[PublisherKey, SeqRange],
                first_sent_at_or_after: Callable[[PublisherKey, int], int] | None = None) -> ZeroCommOffset:
        """Concrete positions for the publishers a member knows now (``known``) plus named ones.

        ``first_sent_at_or_after(key, timestamp_ms)`` finds a publisher's first seq sent at or after
        the timestamp (only needed for ``startingTimestamp``).
        """
        positions: dict[PublisherKey, int] = {}
        for key, span in known.items():
            if self.kind == "timestamp":
                if first_sent_at_or_after is None or self.timestamp_ms is None:
                    raise ConnectorOptionError("startingTimestamp needs a timestamp lookup")
                positions[key] = max(first_sent_at_or_after(key, self.timestamp_ms), span.first)
                continue
            choice = self.per_publisher.get(key, self.per_group.get(key[0], self.default))
            positions[key] = _concrete(choice, span)
        for key, choice in self.per_publisher.items():
            # Named but not (yet) known on this member: a seq is kept (read from it once it comes);
            # -2 and -1 leave the publisher out, so it is introduced when it appears at its first
            # retained seq, as any new publisher is. Seq 1 instead (a member that joined after the
            # publisher's first messages never holds them) read as data loss - and for -1 ("only
            # what comes from now on") nothing held now is older than what comes.
            if key not in positions and choice >= 1:
                positions[key] = choice
        return ZeroCommOffset(positions)

    def unknown(self, known: Mapping[PublisherKey, SeqRange]) -> list[PublisherKey]:
        """Publishers the JSON names that ``known`` lacks (for a warning: a misspelt DID waits forever)."""
        return sorted(key for key in self.per_publisher if key not in known)


@dataclass(frozen=True)
class EndingOffsets:
    """``endingOffsets`` of a batch read: ``latest`` or per-publisher JSON (exclusive, -1 = latest)."""

    kind: Literal["latest", "json"]
    per_group: Mapping[str, int] = field(default_factory=dict)
    per_publisher: Mapping[PublisherKey, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | None, groups: Iterable[str], option: str = "endingOffsets") -> "EndingOffsets":
        if text is None or text.strip().lower() == "latest":
            return cls("latest")
        value = text.strip()
        if value.lower() == "earliest":
            raise ConnectorOptionError(f"{option}=earliest would read nothing",
                                       hint=f"Use {option}=latest (the default) or per-publisher JSON")
        parsed = _parse_json_positions(value, set(groups), option, allow_latest=True)
        if any(v == EARLIEST for v in parsed["per_publisher"].values()) or \
                any(v == EARLIEST for v in parsed["per_group"].values()):
            raise ConnectorOptionError(f"{option} cannot use -2 (earliest)",
                                       hint="An ending position is a seq (exclusive) or -1 for latest")
        return cls("json", per_group=parsed["per_group"], per_publisher=parsed["per_publisher"])

    def resolve(self, known: Mapping[PublisherKey, SeqRange]) -> ZeroCommOffset:
        """Ends at most at what the member holds now: a batch read is planned once, and a seq past the
        publisher's latest would have the read wait for messages that may never come (and a huge one
        had the planner cut billions of slices).

        A publisher named that the member does not know is an error, as an unknown partition in
        Kafka's endingOffsets is: ignoring it read nothing of it without a word (a misspelt DID, or a
        member that never received from it)."""
        missing = [key for key in self.per_publisher if key not in known]
        if missing:
            group, did = missing[0]
            listed = ", ".join(sorted(d for g, d in known if g == group)) or "none"
            raise ConnectorOptionError(
                f"endingOffsets names {len(missing)} publisher(s) the member on this host has no messages of, "
                f"e.g. {did} in group {group!r} (its publishers there: {listed})",
                hint="Check the DID (the publisher_did column, or `zerocomm group members GROUP`), or leave the "
                     "publisher out of endingOffsets to read up to what the member holds")
        positions: dict[PublisherKey, int] = {}
        for key, span in known.items():
            choice = self.per_publisher.get(key, self.per_group.get(key[0], LATEST))
            positions[key] = span.next if choice == LATEST else min(choice, span.next)
        return ZeroCommOffset(positions)

    def check_start(self, starting: StartingOffsets) -> None:
        """At load: refuse a publisher whose start seq named in startingOffsets is after the end named for
        it in endingOffsets. Both are the user's: a contradiction between options, as Kafka refuses it."""
        if starting.kind != "json":
            return
        for key, end in self.per_publisher.items():
            begin = starting.per_publisher.get(key)
            if end == LATEST or begin is None or begin < 1 or begin <= end:
                continue
            group, did = key
            raise ConnectorOptionError(
                f"publisher {did} in group {group!r}: startingOffsets {begin} is after endingOffsets {end}; the read "
                "[start, end) would return none of its messages",
                hint="endingOffsets is exclusive and comes after the start: give that publisher a start at or below "
                     f"{end}, or a later end (-1: latest)")

    def late_starts(self, starting: StartingOffsets, start: ZeroCommOffset,
                    known: Mapping[PublisherKey, SeqRange] | None = None) -> list[str]:
        """At planning: for each publisher whose start, resolved from earliest or startingTimestamp, is at or
        after the end named for it, why the read returns none of its messages (for a warning).

        Not an error: the options do not contradict each other, the member just holds nothing in that
        range (retention, a later join, or no message sent since the timestamp), so the read is empty
        for that publisher, as a range named in seqs whose messages are gone is under failOnDataLoss=false."""
        said: list[str] = []
        for key, end in self.per_publisher.items():
            begin = start.get(key)
            named = starting.per_publisher.get(key) if starting.kind == "json" else None
            # begin == end is empty for the same reasons (end 1 asks for nothing); a seq named in both
            # was checked at load
            if end == LATEST or end == 1 or begin is None or begin < end or (named is not None and named >= 1):
                continue
            group, did = key
            span = known.get(key) if known is not None else None
            if starting.kind == "timestamp":
                # ``begin`` may be last + 1 (nothing sent at or after the time): a position, not a message
                why = (f"this member holds no message of it sent at or after startingTimestamp "
                       f"{starting.timestamp_ms} before seq {end}: the read starts it at seq {begin}")
                if span is not None and begin > span.last:
                    why += f", after its last seq here ({span.last})"
                if span is not None and span.first >= end and span.first > 1:
                    why += (f"; its seqs below {span.first} are not on this member (retention took them, or it "
                            "joined the group later)")
                todo = "give an earlier startingTimestamp, or a later endingOffsets (-1: latest) for it"
            else:
                why = (f"startingOffsets earliest starts it at seq {begin}, where what this member holds of it begins: "
                       f"its seqs below {begin} are not on this member (retention took them, or it joined the group "
                       "later)")
                todo = (f"give an endingOffsets past {begin} (-1: latest) for it, or read through a member that "
                        "holds those seqs")
            said.append(f"group {group!r}, publisher {did}: {why}; with endingOffsets {end} (exclusive) the read "
                        f"returns none of its messages. To read some, {todo}")
        return said


def _concrete(choice: int, span: SeqRange) -> int:
    if choice == EARLIEST:
        return span.first
    if choice == LATEST:
        return span.next
    return choice


def _parse_json_positions(value: str, groups: set[str], option: str, *, allow_latest: bool) -> dict[str, Any]:
    example = '{"sensors": {"did:peer:2.Ez...": 17, "did:peer:2.Ab...": -2}} or {"sensors": "latest"}'
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):  # nested past the limit: no position JSON either
        raise ConnectorOptionError(
            f"{option} is {value[:80]!r}: not earliest, latest or JSON",
            hint=f"Use earliest, latest, or per-publisher JSON such as {example} (-2 earliest, -1 latest)") from None
    if not isinstance(data, dict):
        raise ConnectorOptionError(f"{option} JSON must be an object of group -> positions",
                                   hint=f"For example {example}")
    if "version" in data and "groups" in data:  # an offset copied from a checkpoint or progress report
        data = data["groups"]
        if not isinstance(data, dict):
            raise ConnectorOptionError(f"{option}: 'groups' must be an object", hint=f"For example {example}")
    per_group: dict[str, int] = {}
    per_publisher: dict[PublisherKey, int] = {}
    for group, positions in data.items():
        if group not in groups:
            raise ConnectorOptionError(
                f"{option} names group {group!r}, which the group option does not subscribe to "
                f"({', '.join(sorted(groups)) or 'none'})",
                hint="Add the group to the group option or remove it from " + option)
        if isinstance(positions, str):
            word = positions.strip().lower()
            if word not in ("earliest", "latest"):
                raise ConnectorOptionError(f"{option}: group {group!r} maps to {positions!r}",
                                           hint="A group maps to \"earliest\", \"latest\" or {publisher DID: seq}")
            per_group[group] = EARLIEST if word == "earliest" else LATEST
            continue
        if not isinstance(positions, dict):
            raise ConnectorOptionError(f"{option}: group {group!r} maps to {type(positions).__name__}",
                                       hint=f"A group maps to an object of publisher DID -> seq, e.g. {example}")
        for did, seq in positions.items():
            try:
                per_publisher[(group, did)] = _check_seq(seq, f"{option} for {did} in {group!r}",
                                                         allow_special=allow_latest)
            except OffsetFormatError as exc:
                raise ConnectorOptionError(str(exc).split(". ")[0],
                                           hint="Positions are seqs >= 1, -2 (earliest) or -1 (latest)") from None
    return {"per_group": per_group, "per_publisher": per_publisher}


def parse_timestamp_ms(text: str, option: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ConnectorOptionError(f"{option} is {text!r}, not an integer",
                                   hint=f"Give milliseconds since the Unix epoch (UTC), e.g. {option}=1767225600000") from None
    if value < 0:
        raise ConnectorOptionError(f"{option} is negative ({value})", hint="Give milliseconds since the Unix epoch")
    if value < 10**11:  # before 1973 in ms: almost surely seconds
        raise ConnectorOptionError(f"{option}={value} looks like seconds, not milliseconds",
                                   hint=f"Multiply by 1000: {option}={value * 1000}")
    return value


# --- planning helpers (pure) --------------------------------------------------------------------


def limit_rows(start: ZeroCommOffset, latest: ZeroCommOffset, max_rows: int) -> ZeroCommOffset:
    """The furthest end within ``max_rows`` messages, shared max-min fairly between publishers.

    Why max-min fair rather than proportional (Kafka's choice): every publisher with a backlog
    moves forward in every batch, so the publishers' Lamport clocks advance together and the
    causal order across publishers shows up early in Delta instead of one publisher hogging the
    budget. The result never moves a position backwards.
    """
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    backlog: dict[PublisherKey, int] = {}
    for key, target in latest.items():
        begin = start.get(key)
        if begin is not None and target > begin:
            backlog[key] = target - begin
    grant = {key: 0 for key in backlog}
    budget = max_rows
    pending = sorted(backlog)
    while budget > 0 and pending:
        share = budget // len(pending)
        if share == 0:  # fewer messages left than publishers: one each, taking turns
            # Stateless round robin: the starting key moves with the sum of the start positions,
            # which grows by the budget every batch - always beginning at the first key in order
            # starved the keys that sort last for good.
            keys = sorted(pending)
            turn = sum(start.get(key) or 0 for key in keys) % len(keys)
            for key in (keys[turn:] + keys[:turn])[:budget]:
                grant[key] += 1
            break
        still = []
        for key in pending:
            take = min(share, backlog[key] - grant[key])
            grant[key] += take
            budget -= take
            if grant[key] < backlog[key]:
                still.append(key)
        pending = still
    merged = dict(start.positions)
    for key, target in latest.items():
        if key not in merged:  # a publisher the caller introduces: taken as given
            merged[key] = target
    for key, n in grant.items():
        merged[key] += n
    return ZeroCommOffset(merged, start.consumer)


@dataclass(frozen=True)
class SeqSlice:
    """One partition's share: seqs ``first`` to ``end - 1`` of one publisher in one group."""

    group: str
    publisher: str
    first: int
    end: int

    @property
    def count(self) -> int:
        return self.end - self.first


def split_ranges(start: ZeroCommOffset, end: ZeroCommOffset, *, max_per_slice: int,
                 min_slices: int = 1) -> list[SeqSlice]:
    """Cut ``[start, end)`` into slices: one per publisher at least, none bigger than ``max_per_slice``,
    and at least ``min_slices`` when there are enough messages.

    Publishers missing from ``start`` get no slice: the stream introduces a new publisher at its
    first retained seq in one batch's end offset, so every range it plans is ``[start, end)`` from
    checkpointed positions and a replayed batch reads exactly the same messages.
    """
    if max_per_slice < 1 or min_slices < 1:
        raise ValueError("max_per_slice and min_slices must be >= 1")
    spans = []
    for key, stop in end.items():
        first = start.get(key)
        if first is not None and stop > first:  # a publisher absent from start has no range yet
            spans.append((key, first, stop))
    if not spans:
        return []
    total = sum(stop - first for _, first, stop in spans)
    # Pieces per publisher in proportion to its share of min_slices (largest remainders first), and
    # enough that none holds more than max_per_slice. A slice size rounded up cut 9 messages into 3 slices
    # for min_slices=4.
    wanted = min(min_slices, total)
    pieces = [max(1, -(-(stop - first) // max_per_slice), (stop - first) * wanted // total)
              for _, first, stop in spans]
    short = wanted - sum(pieces)
    if short > 0:
        by_remainder = sorted(range(len(spans)), key=lambda i: -((spans[i][2] - spans[i][1]) * wanted % total))
        for i in by_remainder:
            if short == 0:
                break
            if pieces[i] < spans[i][2] - spans[i][1]:
                pieces[i] += 1
                short -= 1
    slices: list[SeqSlice] = []
    for ((group, did), first, stop), n in zip(spans, pieces):
        size = -(-(stop - first) // n)
        at = first
        for left in range(n, 0, -1):  # n slices: never fewer messages left than slices to make
            nxt = at + min(size, stop - at - (left - 1))
            slices.append(SeqSlice(group, did, at, nxt))
            at = nxt
    return slices


def lag(end: ZeroCommOffset, latest: ZeroCommOffset) -> dict[PublisherKey, int]:
    """Messages behind the newest, per publisher: what a dashboard shows as consumer lag."""
    return {key: max(0, seq - end.get(key, 1)) for key, seq in latest.items()}
