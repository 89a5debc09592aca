"""The journal's Arrow schema, and turning what append() is given into one batch of it.

Times are ``timestamp[us, tz=UTC]``: int microseconds since the Unix epoch, which is what Spark's
TimestampType holds, so the Spark source passes the columns through without conversion. Callers give
int microseconds or timezone-aware datetimes; floats are refused because pyarrow would silently
truncate them (seconds vs micros is the classic off-by-10^6 bug).

Offsets and seqs are int64 (Spark has no unsigned types); both are non-negative.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa

from zerocomm_spark.errors import InvalidJournalRowError

TIMESTAMP = pa.timestamp("us", tz="UTC")
HEADERS = pa.map_(pa.string(), pa.string())

#: One delivered group message per row, in journal order. ``offset`` is journal-wide, contiguous from 0.
JOURNAL_SCHEMA: pa.Schema = pa.schema([
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("group", pa.string(), nullable=False),
    pa.field("message_id", pa.string(), nullable=False),
    pa.field("publisher_did", pa.string(), nullable=False),
    pa.field("seq", pa.int64(), nullable=False),
    pa.field("lamport_ts", pa.int64(), nullable=False),
    pa.field("sent_at", TIMESTAMP, nullable=False),
    pa.field("received_at", TIMESTAMP, nullable=False),
    pa.field("headers", HEADERS, nullable=True),
    pa.field("payload", pa.binary(), nullable=False),
])

#: What append() takes: the journal schema without ``offset`` (the journal assigns it).
#: ``received_at`` and ``headers`` may be missing or null: received_at then defaults to the append time.
APPEND_SCHEMA: pa.Schema = pa.schema([f for f in JOURNAL_SCHEMA if f.name != "offset"])

_REQUIRED = ("group", "message_id", "publisher_did", "seq", "lamport_ts", "sent_at", "payload")
_NON_NULL = tuple(f.name for f in APPEND_SCHEMA if not f.nullable)
_NON_NULL_AT = tuple(APPEND_SCHEMA.get_field_index(name) for name in _NON_NULL)
_SEQ_AT = APPEND_SCHEMA.get_field_index("seq")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def now_micros() -> int:
    return time.time_ns() // 1000


def to_micros(value: int | datetime, what: str = "timestamp") -> int:
    """Int microseconds since the epoch from an int or an aware datetime (the one unit the journal uses)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, datetime)):
        raise InvalidJournalRowError(
            f"{what} must be int microseconds since the epoch or an aware datetime, not {type(value).__name__}")
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidJournalRowError(f"{what} is a naive datetime; give it a timezone (UTC)")
        delta = value - _EPOCH
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return int(value)


def _check_times(name: str, values: list[Any]) -> None:
    for i, v in enumerate(values):
        t = type(v)
        if t is int or v is None:
            continue
        if t is float or t is bool or not isinstance(v, (int, np.integer, datetime)):
            raise InvalidJournalRowError(
                f"row {i}: {name} must be int microseconds since the epoch or an aware datetime, "
                f"not {t.__name__}")
        if isinstance(v, datetime) and v.tzinfo is None:
            raise InvalidJournalRowError(f"row {i}: {name} is a naive datetime; give it a timezone (UTC)")


def _field(row: Any, name: str, index: int, required: bool) -> Any:
    if isinstance(row, Mapping):
        if required:
            try:
                return row[name]
            except KeyError:
                raise InvalidJournalRowError(f"row {index} has no {name!r}") from None
        return row.get(name)
    if required:
        try:
            return getattr(row, name)
        except AttributeError:
            raise InvalidJournalRowError(f"row {index} ({type(row).__name__}) has no {name!r}") from None
    return getattr(row, name, None)


#: Per append column: (field, required, is a timestamp, is an int64), worked out once, not per append.
_COLUMNS = tuple((f, f.name in _REQUIRED, f.type == TIMESTAMP, f.type == pa.int64()) for f in APPEND_SCHEMA)


def rows_to_batch(rows: Sequence[Any], received_at: int) -> pa.RecordBatch:
    """Dicts or objects (dataclasses, named tuples with attributes) -> one APPEND_SCHEMA batch."""
    # Plain dicts (what the agent appends) skip the per-row Mapping checks: an ABC isinstance costs
    # ~1 us, and was paid per row for each optional column too (~40% of a 100-row append's conversion).
    dicts = all(type(row) is dict for row in rows)
    if not dicts:
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping) and not dataclasses.is_dataclass(row) and not hasattr(row, "group"):
                raise InvalidJournalRowError(f"row {i} is a {type(row).__name__}, not a dict or a message object")
    columns: list[pa.Array] = []
    for field, required, is_time, is_int in _COLUMNS:
        name = field.name
        if rows and required and (dicts or isinstance(rows[0], Mapping)):
            try:
                values = [r[name] for r in rows]
            except (KeyError, TypeError):
                values = [_field(r, name, i, True) for i, r in enumerate(rows)]
        elif dicts:
            values = [r.get(name) for r in rows]
        else:
            values = [_field(r, name, i, required) for i, r in enumerate(rows)]
        if is_time:
            _check_times(name, values)
            if name == "received_at":
                values = [received_at if v is None else v for v in values]
        elif is_int:
            for i, v in enumerate(values):
                if type(v) is not int and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                    raise InvalidJournalRowError(f"row {i}: {name} must be an int, not {type(v).__name__}")
        elif name == "payload":
            for i, v in enumerate(values):
                if not isinstance(v, (bytes, bytearray, memoryview)):
                    raise InvalidJournalRowError(f"row {i}: payload must be bytes, not {type(v).__name__}")
        try:
            array = pa.array(values, type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, UnicodeEncodeError) as exc:
            # UnicodeEncodeError: a lone surrogate in a string, which no UTF-8 (so no row) can hold.
            # Not the exception's text: it can quote the offending value, which may be message content.
            raise InvalidJournalRowError(
                f"column {name!r} cannot be stored as {field.type} ({type(exc).__name__})") from None
        if not field.nullable and array.null_count:
            raise InvalidJournalRowError(f"column {name!r} has {array.null_count} null value(s)")
        columns.append(array)
    batch = pa.RecordBatch.from_arrays(columns, schema=APPEND_SCHEMA)
    _check_values(batch)
    return batch


def _check_values(batch: pa.RecordBatch) -> None:
    """Checks beyond the schema (of an APPEND_SCHEMA batch without nulls in ``seq``)."""
    seq = batch.column(_SEQ_AT)
    if len(seq) and int(np.frombuffer(seq.buffers()[1], dtype=np.int64, count=len(seq), offset=seq.offset * 8).min()) < 0:
        raise InvalidJournalRowError("seq must be >= 0")


def arrow_to_batch(data: pa.RecordBatch | pa.Table, received_at: int) -> pa.RecordBatch:
    """A batch or table with the append columns (any order, castable types) -> one APPEND_SCHEMA batch."""
    if isinstance(data, pa.Table):
        data = data.combine_chunks()
        batches = data.to_batches()
        if not batches:
            return pa.RecordBatch.from_pylist([], schema=APPEND_SCHEMA)
        data = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
    schema = data.schema
    if schema.equals(APPEND_SCHEMA):
        batch = data
        for name, at in zip(_NON_NULL, _NON_NULL_AT):
            if batch.column(at).null_count:
                raise InvalidJournalRowError(f"column {name!r} has {batch.column(at).null_count} null value(s)")
        received = batch.column("received_at")
        if received.null_count:
            batch = batch.set_column(batch.schema.get_field_index("received_at"), APPEND_SCHEMA.field("received_at"),
                                     received.fill_null(pa.scalar(received_at, TIMESTAMP)))
        _check_values(batch)
        return batch
    n = data.num_rows
    names = set(schema.names)
    columns: list[pa.Array] = []
    for field in APPEND_SCHEMA:
        name = field.name
        if name not in names:
            if name == "received_at":
                columns.append(pa.array(np.full(n, received_at, dtype=np.int64), type=TIMESTAMP))
                continue
            if name == "headers":
                columns.append(pa.nulls(n, HEADERS))
                continue
            raise InvalidJournalRowError(f"the batch has no column {name!r}")
        column = data.column(name)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if column.type != field.type:
            if field.type == TIMESTAMP and not pa.types.is_timestamp(column.type) and not pa.types.is_integer(
                    column.type):
                raise InvalidJournalRowError(
                    f"column {name!r} is {column.type}; give timestamps or int64 microseconds since the epoch")
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise InvalidJournalRowError(
                    f"column {name!r} is {column.type} and cannot be cast to {field.type} ({type(exc).__name__})") from None
        if name == "received_at" and column.null_count:
            column = column.fill_null(pa.scalar(received_at, TIMESTAMP))
        if not field.nullable and column.null_count:
            raise InvalidJournalRowError(f"column {name!r} has {column.null_count} null value(s)")
        columns.append(column)
    batch = pa.RecordBatch.from_arrays(columns, schema=APPEND_SCHEMA)
    _check_values(batch)
    return batch


def to_append_batch(rows: Any, received_at: int | None = None) -> pa.RecordBatch:
    """Whatever append() accepts -> one APPEND_SCHEMA batch, validated before it reaches the writer."""
    now = now_micros() if received_at is None else received_at
    if isinstance(rows, (pa.RecordBatch, pa.Table)):
        return arrow_to_batch(rows, now)
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        if isinstance(rows, Mapping) or dataclasses.is_dataclass(rows):
            raise InvalidJournalRowError("append() takes a list of rows; wrap a single row in a list")
        try:
            rows = list(rows)
        except TypeError:
            raise InvalidJournalRowError(
                f"append() takes a list of rows or a pyarrow RecordBatch/Table, not {type(rows).__name__}") from None
    return rows_to_batch(rows, now)


def rows_within_bytes(payload: pa.Array | pa.ChunkedArray, rows: int, budget: int, *,
                      at_least_one: bool) -> tuple[int, int]:
    """How many of the first ``rows`` payloads fit in ``budget`` bytes, and their bytes: a page of a
    read by size, not only by rows (one row at least when ``at_least_one``, so a huge message still
    comes back alone)."""
    if isinstance(payload, pa.ChunkedArray):
        payload = payload.combine_chunks()
    rows = min(rows, len(payload))
    if rows <= 0:
        return 0, 0
    offsets = np.frombuffer(payload.buffers()[1], dtype=np.int64 if pa.types.is_large_binary(payload.type) else np.int32,
                            count=rows + 1, offset=payload.offset * (8 if pa.types.is_large_binary(payload.type) else 4))
    ends = offsets[1:].astype(np.int64) - int(offsets[0])
    fit = int(np.searchsorted(ends, max(budget, 0), side="right"))
    if fit == 0 and at_least_one:
        fit = 1
    return fit, int(ends[fit - 1]) if fit else 0
