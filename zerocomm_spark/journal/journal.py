"""The public Journal: one member's durable, encrypted, append-only log of delivered group messages."""

from __future__ import annotations

import bisect
import logging
import os
import stat
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from zerocomm_spark.deadlines import check_timeout
from zerocomm_spark.errors import (
    ConfigurationError,
    DataLossError,
    InsecurePermissionsError,
    JournalClosedError,
    OffsetOutOfRangeError,
)
from zerocomm_spark.journal import crypto, files, index, retention
from zerocomm_spark.journal.consumers import ConsumerPoints, check_consumer
from zerocomm_spark.journal.index import Key, Run, SegmentIndex, SeqIndex, State
from zerocomm_spark.journal.reader import Hole, Piece, iter_pieces, load_record, open_segment
from zerocomm_spark.journal.recovery import key_opens_records, recover
from zerocomm_spark.journal.schema import JOURNAL_SCHEMA, now_micros, rows_within_bytes, to_append_batch, to_micros
from zerocomm_spark.journal.segment import RecordEntry, Segment, create_segment, open_for_append
from zerocomm_spark.journal.superseded import Superseded
from zerocomm_spark.journal.writer import AppendResult, FsyncPolicy, JournalStats, Writer
from zerocomm_spark.paths import make_dirs, refuse_shared_directory

log = logging.getLogger(__name__)

_POLICIES = ("always", "interval", "never")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_MAX_FSYNC_INTERVAL_MS = 86_400_000


@dataclass(frozen=True, slots=True)
class PublisherPosition:
    """How far one publisher's messages in one group have been journaled."""

    group: str
    publisher_did: str
    last_seq: int
    last_offset: int


@dataclass(frozen=True, slots=True)
class LatestOffsets:
    """The journal's end: the next offset to be assigned, and each publisher's last seq and offset."""

    next_offset: int
    publishers: Mapping[Key, PublisherPosition]


def _check_directory(path: Path) -> None:
    """Refuse a journal directory of another user, and tighten one of ours that others may open.

    The records are encrypted, but whoever owns the directory (or may write it) can delete or roll back
    segments and the commit points, and read row counts, times and consumer names.
    """
    st = path.stat()
    if st.st_uid != os.getuid():
        raise InsecurePermissionsError(
            f"the journal directory {path} belongs to another user (uid {st.st_uid})",
            hint="Point journal.dir at a directory of the user running the agent (\"\" keeps it in the identity "
                 "directory)")
    refuse_shared_directory(
        "the journal directory", path, st, ConfigurationError,
        hint=f"Point journal.dir at a directory of the agent's own, such as {path}/zerocomm-journal (it is "
             "created mode 700), or leave it unset (<identity.dir>/journal)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:  # a file system that keeps its own modes (vfat, CIFS mounts)
            raise InsecurePermissionsError(
                f"the journal directory {path} has mode {stat.S_IMODE(st.st_mode):o} and cannot be made private "
                f"({exc.strerror})", hint="Point journal.dir at a directory on a file system with Unix permissions, "
                "of the user running the agent") from None
        log.info("tightened the journal directory %s to mode 700", path)


class Journal:
    """An append-only, encrypted log of delivered group messages; see the package docstring.

    Open it with :meth:`Journal.open`; it is thread-safe and a context manager.
    """

    def __init__(self, directory: Path, key: bytes, fsync: FsyncPolicy, fsync_interval_ms: int, segment_bytes: int,
                 retention_bytes: int | None, retention_ms: int | None, dedup_window: int, timeout: float,
                 read_threads: int, consumer_expiry_ms: int | None = None) -> None:
        self.directory = directory
        self._key = key
        self.fsync: FsyncPolicy = fsync
        self.fsync_interval_ms = fsync_interval_ms
        self.segment_bytes = segment_bytes
        self.retention_bytes = retention_bytes
        self.retention_ms = retention_ms
        self.consumer_expiry_ms = consumer_expiry_ms
        self.dedup_window = dedup_window
        self.timeout = timeout
        self._read_threads = read_threads
        self._lock = threading.RLock()  # index, state, offsets, closing
        self._commit_lock = threading.Lock()
        # One retention pass at a time, through its unlinks: passes that overlap (a commit, a roll,
        # the syncer) would unlink out of order, and a crash between could keep a segment whose
        # neighbours on both sides are gone (a hole in the journal). Not self._lock: appends and
        # reads never wait for an unlink.
        self._retention_lock = threading.Lock()
        self._segments: list[Segment] = []
        self._segment_bases: list[int] = []
        self._state: State = {}
        self._seq_index = SeqIndex()
        self._next_offset = 0
        self._committed = 0
        self._consumers = ConsumerPoints(self.directory, {}, fsync=False)  # loaded by _start
        self._closed = False
        self._lock_fd = -1
        self._writer: Writer | None = None
        self._executor: ThreadPoolExecutor | None = None

    # --- opening and closing -------------------------------------------------------------------

    @classmethod
    def open(cls, directory: str | os.PathLike[str], *, key: bytes, fsync: FsyncPolicy = "interval",
             fsync_interval_ms: int = 200, segment_bytes: int = 64 << 20, retention_bytes: int | None = None,
             retention_ms: int | None = None, dedup_window: int = 100_000, timeout: float = 30.0,
             read_threads: int | None = None, consumer_expiry_ms: int | None = None) -> "Journal":
        """Open (or create) the journal in ``directory``, recovering from a crash if there was one.

        ``key`` is the 32-byte journal key the member keeps sealed in its keystore (see
        ``zerocomm_spark.journal.keys.journal_key``). ``fsync`` chooses what an append that returned
        survives: every policy survives the process being killed; only ``"always"`` survives power
        loss. ``dedup_window`` is how many recent message ids the duplicate check remembers (at
        least; 0 turns the id rule off, leaving the seq rule, and saves its per-row cost);
        ``timeout`` bounds every wait (appends, close, reads). ``read_threads`` (default: the CPU
        count, at most 4) is how many threads decrypt a read or a large append: the calling thread
        and a shared pool of ``read_threads - 1``. ``consumer_expiry_ms`` (None: never) forgets a
        named consumer that has not committed for that long, so one that is gone without a
        ``release`` stops holding retention back (see ``consumers``).
        """
        if fsync not in _POLICIES:
            raise ConfigurationError(f"fsync must be one of {', '.join(_POLICIES)}, not {fsync!r}")
        for name, value, low in (("fsync_interval_ms", fsync_interval_ms, 1), ("segment_bytes", segment_bytes, 1024),
                                 ("dedup_window", dedup_window, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigurationError(f"{name} must be an int >= {low}, not {value!r}")
        if fsync_interval_ms > _MAX_FSYNC_INTERVAL_MS:  # its background wait overflowed: no fsync, no retention
            raise ConfigurationError(f"fsync_interval_ms must be at most {_MAX_FSYNC_INTERVAL_MS} (a day), "
                                     f"not {fsync_interval_ms!r}")
        for name, limit, low in (("retention_bytes", retention_bytes, 0), ("retention_ms", retention_ms, 0),
                                 ("consumer_expiry_ms", consumer_expiry_ms, 1)):  # expiry 0: everyone, at once
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < low):
                raise ConfigurationError(f"{name} must be None or an int >= {low}, not {limit!r}")
        check_timeout(timeout, "the journal's timeout")  # NaN or inf: a full queue's wait would never end
        threads = read_threads if read_threads is not None else min(4, os.cpu_count() or 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigurationError(f"read_threads must be an int >= 1, not {read_threads!r}")
        key = crypto.check_key(key)
        path = Path(directory).expanduser()
        try:
            make_dirs(path)
        except OSError as exc:
            raise ConfigurationError(f"cannot create the journal directory {path}: {exc.strerror}",
                                     hint="Set journal.dir to a directory this user can create, or leave it unset "
                                          "(<identity.dir>/journal)") from None
        _check_directory(path)
        journal = cls(path, key, fsync, fsync_interval_ms, segment_bytes, retention_bytes, retention_ms,
                      dedup_window, float(timeout), threads, consumer_expiry_ms)
        journal._lock_fd = files.acquire_lock(path)
        try:
            journal._start()
        except BaseException:
            journal._closed = True
            try:
                if journal._writer is not None:
                    journal._writer.stop(journal.timeout)
                    journal._writer.finish()
            finally:
                files.release_lock(journal._lock_fd)
                journal._lock_fd = -1
            raise
        return journal

    def _start(self) -> None:
        sync = self.fsync != "never"
        files.remove_temp_files(self.directory)
        files.check_key(self.directory, self._key, fsync=sync,
                        probe=lambda: key_opens_records(self.directory, self._key))
        committed = files.read_commit(self.directory)
        expiry = None if self.consumer_expiry_ms is None else self.consumer_expiry_ms / 1000
        consumers = ConsumerPoints.load(self.directory, fsync=sync, expiry_s=expiry)  # before a descriptor opens
        # Offsets below a commit point were read by a consumer, so written in full: a last record
        # there that fails its crc is damage, not a torn write (recovery keeps it).
        durable_end = max([committed, consumers.expired_floor, *consumers.points().values()])
        recovered = recover(self.directory, self._key, dedup_window=self.dedup_window, durable_end=durable_end)
        self._superseded = Superseded(self.directory, self._key, fsync=self.fsync != "never")
        segments = recovered.segments
        if segments:
            active = segments[-1]
            fd = open_for_append(active)
        else:
            active, fd = create_segment(self.directory, 0, now_micros())
        try:
            if sync:
                # What recovery found past the last sync (a write whose fdatasync a kill -9 cut off,
                # a truncated torn tail) is made durable before anything is read or acknowledged
                # against it: a re-send it turns into duplicates is acknowledged without a write.
                os.fdatasync(fd)
                files.fsync_dir(self.directory)
            segments = segments or [active]
            self._segments = segments
            self._segment_bases = [s.base_offset for s in segments]
            self._state = recovered.state
            self._seq_index = recovered.seq_index
            self._next_offset = active.end_offset
            if committed > self._next_offset:
                log.warning("journal %s: commit point %d is beyond the end %d (lost unsynced data?); using the end",
                            self.directory, committed, self._next_offset)
                committed = self._next_offset
                # Saved, as the named consumers' points are (clamp): left on disk, the next open would
                # take it back once new rows pass it, and retention would delete those rows unread.
                files.write_commit(self.directory, committed)
            self._committed = committed
            self._consumers = consumers
            self._consumers.clamp(self._next_offset)
            self._writer = Writer(self, active, fd, recovered.active_runs, recovered.recent)
        except BaseException:
            os.close(fd)  # nothing owns it yet: an open that fails must not leak a write descriptor
            raise
        self._writer.start()
        self.enforce_retention()

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, sync (unless ``fsync="never"``), save the side index, release the directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        writer = self._writer
        abandoned = False  # a write still under way after the timeout: its files stay open and locked
        try:
            if writer is not None:
                try:
                    writer.stop(self.timeout if timeout is None else timeout)
                finally:
                    abandoned = writer.busy()
                    if not abandoned:
                        active, runs, ids = writer.finish()
                if writer.failure is None:
                    with self._lock:
                        self._write_side_index(active, runs, ids)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            if self._lock_fd >= 0 and not abandoned:
                files.release_lock(self._lock_fd)
                self._lock_fd = -1

    def files_present(self) -> bool:
        """False once the active segment was removed under this open journal (its directory deleted):
        the next append fails then (nothing more is acknowledged), and a reopen starts a new journal
        there. For an owner to notice while no append comes. True once closed."""
        writer = self._writer
        return self._closed or writer is None or writer.active_file_linked()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"offsets={self.earliest_offset()}..{self._next_offset}"
        return f"Journal(directory={str(self.directory)!r}, fsync={self.fsync!r}, {state})"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # never pickle the key (or a lock and threads) by accident
        raise TypeError("a Journal holds its key, a directory lock and threads; it cannot be pickled")

    def _check_open(self) -> None:
        if self._closed:
            raise JournalClosedError(f"the journal {self.directory} is closed")

    # --- appending -----------------------------------------------------------------------------

    def append(self, rows: Any, *, timeout: float | None = None) -> AppendResult:
        """Journal the new rows among ``rows``; returns once they are written to the OS.

        ``rows``: a list of dicts or message objects with the JOURNAL_SCHEMA fields (``offset``
        excluded; ``received_at`` defaults to now, ``headers`` to null), or a pyarrow RecordBatch or
        Table with those columns. Rows already journaled (seq at or below the publisher's last, or a
        recent message id) are skipped and counted as duplicates, so re-sending after a restart or a
        timeout duplicates nothing. Under ``fsync="always"`` the rows are also on stable storage.
        """
        self._check_open()
        batch = to_append_batch(rows)
        if batch.num_rows == 0:
            with self._lock:
                return AppendResult(self._next_offset, self._next_offset - 1, 0, 0)
        assert self._writer is not None
        return self._writer.submit(batch, self.timeout if timeout is None else timeout)

    def sync(self) -> None:
        """Force what was appended to stable storage now (under ``"interval"`` or ``"never"``, before
        telling someone outside the machine that the data is safe)."""
        self._check_open()
        assert self._writer is not None
        self._writer.sync(force=True)  # a failed fdatasync stops the journal and raises (see Writer.sync)

    def stats(self) -> JournalStats:
        """Counters since open (appends, writes, fsyncs...): is group commit grouping, is fsync keeping up?"""
        assert self._writer is not None
        return JournalStats(**self._writer.counters)

    # --- the writer's side (called from the writer thread) --------------------------------------

    def _last_seq(self, key: Key) -> int | None:
        entry = self._state.get(key)
        return None if entry is None else entry[0]

    def _any_superseded(self, key: Key, first: int, last: int) -> bool:
        """Whether a seq of ``key`` in ``first..last`` is superseded: it had its message, dropped by the
        id rule, so a re-send of it is a duplicate even once its id has left the dedup window."""
        if not self._superseded.has(key):  # nearly every publisher: no lock on the append path
            return False
        with self._lock:
            return self._superseded.any_within(key, first, last)

    def _publish(self, segment: Segment, entries: list[tuple[RecordEntry, list[Run]]]) -> None:
        with self._lock:
            for entry, runs in entries:
                segment.add(entry)
                self._seq_index.add(entry.base_offset, runs)
                index.merge(self._state, runs)
            self._next_offset = segment.end_offset

    def _add_segment(self, segment: Segment) -> None:
        with self._lock:
            self._segments.append(segment)
            self._segment_bases.append(segment.base_offset)

    def _after_roll(self) -> None:
        self.enforce_retention()

    def _write_side_index(self, segment: Segment, runs: list[tuple[int, list[Run]]], ids: pa.Array) -> None:
        with self._lock:
            state = dict(self._state)
        index.write_index(segment.index_path, SegmentIndex(
            segment.base_offset, segment.end_offset, segment.size, list(runs), state), self._key)
        index.write_recent_ids(self.directory, segment.end_offset, ids, self._key)

    # --- reading -------------------------------------------------------------------------------

    @property
    def next_offset(self) -> int:
        """The offset the next appended row will get (one past the last journaled row)."""
        return self._next_offset

    def earliest_offset(self) -> int:
        """The first offset still retained (everything before it was deleted by retention)."""
        with self._lock:
            return self._segments[0].base_offset if self._segments else 0

    def latest(self) -> LatestOffsets:
        """The next offset, and per (group, publisher) the last seq and offset journaled.

        Publishers whose rows retention has deleted are still listed: the journal remembers them so
        that a late re-send is still a duplicate.
        """
        with self._lock:
            self._check_open()
            publishers = {k: PublisherPosition(k[0], k[1], seq, off) for k, (seq, off) in self._state.items()}
            return LatestOffsets(self._next_offset, MappingProxyType(publishers))

    def _range(self, start_offset: int, end_offset: int | None, max_rows: int | None) -> tuple[int, int]:
        for name, value in (("start_offset", start_offset), ("end_offset", end_offset), ("max_rows", max_rows)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise OffsetOutOfRangeError(f"{name} must be an int, not {type(value).__name__}")
        earliest = self._segments[0].base_offset
        end = self._next_offset if end_offset is None else end_offset
        if start_offset < 0 or end < start_offset:
            raise OffsetOutOfRangeError(f"[{start_offset}, {end}) is not a valid offset range")
        if end > self._next_offset:
            raise OffsetOutOfRangeError(
                f"offset {end - 1} is beyond the journal's end (next offset {self._next_offset})")
        if start_offset < earliest and start_offset < end:
            raise DataLossError(
                f"offsets {start_offset}..{earliest - 1} were deleted by retention; the earliest retained "
                f"offset is {earliest}")
        if max_rows is not None:
            if max_rows < 0:
                raise OffsetOutOfRangeError(f"max_rows must be >= 0, not {max_rows}")
            end = min(end, start_offset + max_rows)
        return start_offset, end

    def _plan(self, start: int, end: int) -> list[Piece | Hole]:
        plan: list[Piece | Hole] = []
        if start >= end:
            return plan
        i = max(0, bisect.bisect_right(self._segment_bases, start) - 1)
        for segment in self._segments[i:]:
            if segment.base_offset >= end:
                break
            if segment.end_offset <= start:
                continue
            holes = sorted((d for d in segment.damaged if d.end_offset > start and d.start_offset < end),
                           key=lambda d: d.start_offset)
            records = segment.records
            k = segment.locate(start)
            while k < len(records) and records[k].base_offset < end:
                entry = records[k]
                while holes and holes[0].start_offset < entry.base_offset:
                    plan.append(Hole(segment.path, holes.pop(0)))
                lo = max(start, entry.base_offset) - entry.base_offset
                hi = min(end, entry.end_offset) - entry.base_offset
                plan.append(Piece(segment.path, entry, lo, hi - lo))
                k += 1
            plan.extend(Hole(segment.path, d) for d in holes)
        return plan

    def _pool(self) -> ThreadPoolExecutor | None:
        if self._read_threads <= 1:
            return None
        with self._lock:
            if self._executor is None:
                # The calling thread reads and encrypts too (reader.iter_pieces, Writer._encode): it
                # is one of the read_threads.
                self._executor = ThreadPoolExecutor(self._read_threads - 1, thread_name_prefix="zerocomm-journal-read")
            return self._executor

    def read_batches(self, start_offset: int, end_offset: int | None = None, *,
                     max_rows: int | None = None) -> Iterator[pa.RecordBatch]:
        """Decrypted record batches covering exactly ``[start_offset, end_offset)``: the fast path to Spark.

        ``end_offset`` defaults to the journal's end at the time of the call. A range starting below
        :meth:`earliest_offset` raises DataLossError; beyond the end, OffsetOutOfRangeError. A damaged
        record raises JournalCorruptError when the iteration reaches it.
        """
        with self._lock:
            self._check_open()
            start, end = self._range(start_offset, end_offset, max_rows)
            plan = self._plan(start, end)
        return iter_pieces(plan, self._key, self._pool(), 2 * self._read_threads, self.timeout)

    def read(self, start_offset: int, end_offset: int | None = None, *, max_rows: int | None = None) -> pa.Table:
        """The rows ``[start_offset, end_offset)`` (at most ``max_rows``) as one table; see read_batches."""
        batches = list(self.read_batches(start_offset, end_offset, max_rows=max_rows))
        return pa.Table.from_batches(batches, schema=JOURNAL_SCHEMA)

    def read_by_seq(self, group: str, publisher_did: str, seq_from: int, seq_to: int, *,
                    max_rows: int | None = None, max_bytes: int | None = None) -> pa.Table:
        """One publisher's retained rows with ``seq_from <= seq <= seq_to``, in offset order.

        Served from the seq index, so only the records holding those seqs are decrypted. Rows deleted
        by retention are simply absent. ``max_rows`` / ``max_bytes`` (payload bytes, at least one row
        comes back) stop the read early: only the first rows are decrypted and held, whatever the range.
        """
        # Seqs are int64: a bound past that range (any JSON integer reaches here through the API's
        # `read`) is the range's end, not a number pyarrow's compare refuses with a TypeError.
        seq_from, seq_to = max(seq_from, _INT64_MIN), min(seq_to, _INT64_MAX)
        if seq_from > seq_to:
            return pa.Table.from_batches([], schema=JOURNAL_SCHEMA)
        out: list[pa.RecordBatch] = []
        rows_left = max_rows
        bytes_left = max_bytes
        after = -1  # base offset of the last record read: a re-plan starts past it
        while True:
            plan = self._seq_plan(group, publisher_did, seq_from, seq_to, after)
            pieces = iter_pieces(plan, self._key, self._pool(), 2 * self._read_threads, self.timeout)
            done = 0  # pieces read (each yields one batch)
            full = False
            try:
                for batch in pieces:
                    after = plan[done].entry.base_offset  # type: ignore[union-attr]
                    done += 1
                    mask = pc.and_(
                        pc.and_(pc.equal(batch.column("publisher_did"), publisher_did),
                                pc.equal(batch.column("group"), group)),
                        pc.and_(pc.greater_equal(batch.column("seq"), seq_from),
                                pc.less_equal(batch.column("seq"), seq_to)))
                    picked = batch.filter(mask)
                    if not picked.num_rows:
                        continue
                    take = picked.num_rows if rows_left is None else min(picked.num_rows, rows_left)
                    if bytes_left is not None:
                        fit, used = rows_within_bytes(picked.column("payload"), take, bytes_left, at_least_one=not out)
                        full, take = fit < take, fit
                        bytes_left -= used
                    if take:
                        out.append(picked if take == picked.num_rows else picked.slice(0, take))
                    if rows_left is not None:
                        rows_left -= take
                        full = full or rows_left <= 0
                    if full:
                        break
            except DataLossError:
                # Retention deleted a segment of the plan after it was made: its rows are gone, which
                # for this read means absent, as if the plan had been made a moment later. Anything
                # else missing (a segment retention did not delete) is an error.
                unread = plan[done] if done < len(plan) else None
                if not isinstance(unread, Piece) or unread.entry.base_offset >= self.earliest_offset():
                    raise
                continue
            finally:
                pieces.close()  # stopped early: the read-ahead ends and its descriptors close
            break
        return pa.Table.from_batches(out, schema=JOURNAL_SCHEMA)

    def _seq_plan(self, group: str, publisher_did: str, seq_from: int, seq_to: int, after: int) -> list[Piece | Hole]:
        """The records of read_by_seq still retained, past the record at base offset ``after``."""
        with self._lock:
            self._check_open()
            earliest = self._segments[0].base_offset
            plan: list[Piece | Hole] = []
            for base in self._seq_index.record_bases((group, publisher_did), seq_from, seq_to):
                if base < earliest or base <= after:
                    continue
                segment = self._segments[bisect.bisect_right(self._segment_bases, base) - 1]
                entry = segment.records[segment.locate(base)]
                plan.append(Piece(segment.path, entry, 0, entry.header.count))
            return plan

    def add_superseded(self, group: str, publisher_did: str, seqs: list[int]) -> None:
        """Record seqs of this publisher that will have no row (their message ids were delivered
        before, under these or other seqs) - saved before returning, so before they are acked."""
        self._check_open()
        if seqs:
            with self._lock:
                self._superseded.add([((group, publisher_did), int(seq)) for seq in seqs])

    def superseded(self, group: str, publisher_did: str, seq_from: int, seq_to: int) -> list[tuple[int, int]]:
        """Seqs of this publisher in ``seq_from..seq_to`` that have no row because their message id
        was journaled before from another publisher (a retried sink task on another host): not lost."""
        self._check_open()
        key = (group, publisher_did)
        if not self._superseded.has(key):  # nearly every publisher (and every publish asks): no lock
            return []
        with self._lock:
            return self._superseded.within(key, seq_from, seq_to)

    def offset_for_timestamp(self, ts: int | datetime) -> int:
        """The first offset received at or after ``ts`` (int microseconds since the epoch, or an aware
        datetime); the journal's end if no retained row is that recent."""
        target = to_micros(ts, "ts")
        while True:
            with self._lock:
                self._check_open()
                found: tuple[Segment, RecordEntry] | None = None
                for segment in self._segments:
                    if segment.max_ts is None or segment.max_ts < target:
                        continue
                    for entry in segment.records:
                        if entry.header.max_ts >= target:
                            found = (segment, entry)
                            break
                    if found:
                        break
                if found is None:
                    return self._next_offset
            segment, entry = found
            try:
                fd = open_segment(segment.path)
            except DataLossError:
                # Retention deleted it since the search: search again among what is left (a segment
                # it did not delete is missing for another reason: that stays an error).
                if segment.base_offset >= self.earliest_offset():
                    raise
                continue
            try:
                batch = load_record(fd, segment.path, entry, self._key)
            finally:
                os.close(fd)
            break
        received = batch.column("received_at").cast(pa.int64())
        position = pc.index(pc.greater_equal(received, target), True).as_py()
        return entry.base_offset + position

    # --- commit point and retention ------------------------------------------------------------

    @property
    def committed_offset(self) -> int:
        """Every offset below this has been consumed by every consumer (see commit): retention's bound.

        The lowest of the named consumers' points and of the unnamed point (once it was committed);
        with neither, the highest point of the named consumers released or expired (what they consumed
        stays consumed); 0 while nobody committed anything.
        """
        named = self._consumers.lowest()
        if named is None:
            return self._committed or self._consumers.expired_floor
        return named if self._committed == 0 else min(named, self._committed)

    def consumers(self) -> dict[str, int]:
        """Each named consumer's commit point."""
        return self._consumers.points()

    def commit(self, offset: int, consumer: str | None = None) -> int:
        """Record that ``consumer`` consumed every offset below ``offset``; durable before it returns.

        Monotonic per consumer: a lower offset than its current point changes nothing. Without a
        name it moves the journal's unnamed point (one consumer per journal). Retention deletes only
        segments wholly below every consumer's point. Returns the consumer's point now in force.
        """
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise OffsetOutOfRangeError(f"the commit offset must be an int, not {type(offset).__name__}")
        if consumer is not None:
            check_consumer(consumer)
        with self._commit_lock:
            self._check_open()
            if offset < 0 or offset > self._next_offset:
                raise OffsetOutOfRangeError(
                    f"cannot commit offset {offset}: the journal holds offsets below {self._next_offset}")
            if consumer is not None:
                point = self._consumers.commit(consumer, offset)
                if point != offset:
                    return point
            else:
                if offset <= self._committed:
                    return self._committed
                files.write_commit(self.directory, offset)
                self._committed = offset
        self.enforce_retention()
        return offset

    def release(self, consumer: str) -> bool:
        """Forget a named consumer that is gone for good, so it no longer holds retention back."""
        with self._commit_lock:
            self._check_open()
            known = self._consumers.release(consumer)
        if known:
            self.enforce_retention()
        return known

    def _expire_consumers(self) -> None:
        """Forget consumers past ``consumer_expiry_ms`` (see ``consumers``); never stops the journal."""
        if self.consumer_expiry_ms is None:
            return
        with self._commit_lock:
            if self._closed:
                return
            try:
                gone = self._consumers.expire()
            except OSError as exc:  # a full disk is what retention is for: the next pass retries
                log.warning("journal %s: could not save the consumers' commit points (%s); expired consumers "
                            "are forgotten at a later pass", self.directory.name, exc.strerror)
                return
        expiry_s = (self.consumer_expiry_ms or 0) / 1000
        said = f"{expiry_s / 3600:g} h" if expiry_s >= 3600 else f"{expiry_s:g} s"
        for name, point in gone:
            log.warning("journal %s: consumer %r has not committed for %s and is forgotten (it was at offset "
                        "%d); retention no longer waits for it - if it comes back, rows below the others' "
                        "points may be gone", self.directory.name, name, said, point)

    def enforce_retention(self) -> int:
        """Delete the segments retention allows now (it also runs after commits, rolls and every second)."""
        if not self._retention_lock.acquire(timeout=self.timeout):  # another pass is stuck unlinking: it
            return 0  # deletes what this one would have, or the next pass (every second) does
        try:
            self._expire_consumers()
            with self._lock:
                if self._closed and self._lock_fd < 0:
                    return 0
                count = retention.segments_to_delete(
                    self._segments, committed=self.committed_offset, now_us=now_micros(),
                    retention_bytes=self.retention_bytes, retention_ms=self.retention_ms)
                if not count:
                    return 0
                doomed = self._segments[:count]
                new_base = self._segments[count].base_offset
                # Saved before any segment goes (see index.BASE_STATE_FILE): who published what up to here.
                gone = {k: v for k, v in self._state.items() if v[1] < new_base}
                try:
                    index.write_index(self.directory / index.BASE_STATE_FILE,
                                      index.SegmentIndex(0, new_base, 0, [], gone), self._key,
                                      fsync=self.fsync != "never")
                except OSError as exc:  # a full disk is what retention is there to fix: it goes on regardless
                    log.warning("journal %s: could not save the positions of publishers retention removes (%s); "
                                "after a crash their late re-sends could be journaled again", self.directory.name,
                                exc.strerror)
                del self._segments[:count]
                del self._segment_bases[:count]
                self._seq_index.prune_below(new_base)
            for segment in doomed:
                log.info("journal %s: retention deletes %s (offsets %d..%d)", self.directory.name,
                         segment.path.name, segment.base_offset, segment.end_offset - 1)
                for path in (segment.path, segment.index_path):
                    try:
                        path.unlink()
                    except FileNotFoundError:
                        pass
                    except OSError as exc:  # the file stays (reopened, it is retained again and retried);
                        # a failed clean-up must not stop the journal as a failed write does
                        log.warning("journal %s: retention could not delete %s (%s)", self.directory.name,
                                    path.name, exc.strerror)
            return count
        finally:
            self._retention_lock.release()
