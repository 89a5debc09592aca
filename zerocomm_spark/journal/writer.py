"""The writer thread (group commit) and the background syncer.

One committer at a time takes everything queued at that moment, applies the idempotence rule in
arrival order, encrypts each append as one record (large ones split), and writes them all with one
``writev`` and, under ``fsync="always"``, one fdatasync: concurrent appenders share the syscalls and
the disk flush. Only then are the records published to readers and the appenders released.

Who commits: an appender that finds nobody committing commits its own append (and whatever else is
queued by then) in its own thread, so a lone appender pays no hand-off between threads (measured:
~0.25 ms of ~1 ms per append). Appenders that arrive meanwhile queue and wait, with their deadline;
when the committing appender is done it hands what is left to the writer thread, which drains the
queue (so no appender ever commits for others indefinitely) and hands back to inline commits once
the queue is empty. The committing appender's own wait is its write: local writes do not stall for
long, and its deadline still bounds every wait for the queue.

Durability: an append returns after ``write(2)`` handed the bytes to the kernel, so it survives the
process being killed (kill -9) under every policy; it survives power loss only under ``"always"``
(``"interval"`` syncs every ``fsync_interval_ms`` in the background, ``"never"`` leaves it to the OS).
Under ``"interval"`` the background thread also starts the disk writing of every ``WRITEBACK_BYTES``
appended as soon as they are written (``files.start_writeback``), so the disk works while appends go
on and each fdatasync (and a ``sync()`` or close) waits for little: without it the kernel holds the
dirty pages until the fdatasync, which then writes everything at once (measured: 57 MB appended in
~70 ms, then a 24 ms fdatasync; with it, under 1 ms).
Under every policy the writer reserves the active segment's disk blocks ahead of its writes
(``PREALLOCATE_BYTES`` at a time, ``files.preallocate``), so a write allocates nothing. What is left
of the reserve past a segment's end is given back once the segment is on disk (a truncate to its own
size: some file systems, XFS among them, write the file's unwritten tail first): at the roll under
``"always"``, after the syncer's fdatasync under ``"interval"``, at close; under ``"never"`` a rolled
segment keeps it (less than one record, as the roll comes when the next record does not fit).

Any write or fsync error stops the journal (later appends raise JournalClosedError): after a failed
fsync the kernel may have dropped the dirty pages, so carrying on would acknowledge data that is not
there. Reopening recovers from what is on disk.
"""

from __future__ import annotations

import _signal  # signal's C module: the same calls without the enum conversions (~15 us per append)
import logging
import os
import signal
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa

from zerocomm_spark.errors import JournalClosedError, JournalError, JournalTimeoutError
from zerocomm_spark.journal import codec, files, index
from zerocomm_spark.journal.codec import Frame
from zerocomm_spark.journal.files import fsync_dir
from zerocomm_spark.journal.index import Run
from zerocomm_spark.journal.schema import APPEND_SCHEMA, JOURNAL_SCHEMA, now_micros
from zerocomm_spark.journal.segment import RecordEntry, Segment, create_segment
from zerocomm_spark.journal.state import RecentIds, filter_new

if TYPE_CHECKING:
    from zerocomm_spark.journal.journal import Journal

log = logging.getLogger(__name__)

FsyncPolicy = Literal["always", "interval", "never"]

#: Plaintext bytes per record, about: larger appends are split into records of this size, which are
#: encrypted in parallel. Measured with AEGIS-256 (bench/journal.py, 10 KB rows): 1 MiB records
#: append ~25% and read ~2x faster than 256 KiB ones (per-record costs dominate below that: a pread,
#: a thread hand-off, an IPC parse), and 4 MiB ones are no faster and fall out of the cache.
MAX_RECORD_BYTES = 1 << 20
#: Bytes of appends the writer takes in one group at most (the rest waits for the next round).
MAX_GROUP_BYTES = 64 << 20
#: Bytes queued before appenders wait for the writer (backpressure, with their deadline).
MAX_QUEUED_BYTES = 256 << 20
_SIGINT, _SIG_IGN, _SIG_DFL = int(signal.SIGINT), int(signal.SIG_IGN), int(signal.SIG_DFL)
_IDLE_POLL_S = 1.0  # the idle writer thread's wait between notifications (a safety net: it is notified)
_HANDOFF = object()  # the committer role's value when an inline committer left work for the writer thread
_MAX_RETIRED = 4  # rolled segments' descriptors left for the syncer at most (more are synced at the roll)
#: Under fsync="never": rolled segments remembered for an explicit sync() before those retention
#: deleted are forgotten, so a journal nobody syncs keeps a list no longer than its segments on disk.
_MAX_UNSYNCED = 64
_IOV_MAX = 512  # buffers per writev (header + body per record); below every platform's IOV_MAX
#: Under fsync="interval": bytes appended to the active segment before the syncer is woken to start
#: their writeback (see the module docstring). Large enough to cost one wake-up per several appends.
WRITEBACK_BYTES = 4 << 20
#: Disk blocks reserved ahead of the writes at a time (files.preallocate), up to the segment's size:
#: enough that reserving is rare, little enough that a journal on tmpfs (where reserved blocks are
#: memory) or a nearly full disk holds back little that is not written.
PREALLOCATE_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Offsets ``first_offset..last_offset`` (inclusive) were given to the ``appended`` new rows.

    With nothing new, ``appended == 0`` and ``last_offset == first_offset - 1`` (an empty range at
    the journal's end), so ``range(first_offset, last_offset + 1)`` is always the appended offsets.
    """

    first_offset: int
    last_offset: int
    appended: int
    duplicates: int


_PAYLOAD = APPEND_SCHEMA.get_field_index("payload")
_MESSAGE_ID = APPEND_SCHEMA.get_field_index("message_id")
_RECEIVED_AT = APPEND_SCHEMA.get_field_index("received_at")
_OFFSET_FIELD = JOURNAL_SCHEMA.field("offset")


def approx_bytes(batch: pa.RecordBatch) -> int:
    """Payload bytes plus a per-row allowance: cheap (``nbytes`` walks every buffer of every column)."""
    payload = batch.column(_PAYLOAD)
    offsets = payload.buffers()[1]
    n = len(payload)
    first, = struct.unpack_from("<i", offsets, 4 * payload.offset)
    last, = struct.unpack_from("<i", offsets, 4 * (payload.offset + n))
    return last - first + 160 * n


@dataclass(frozen=True, slots=True)
class JournalStats:
    """Counters since open: how appends were grouped into writes (group commit) and synced."""

    appends: int  # append() calls that reached the writer
    rows_appended: int
    duplicates: int
    records: int  # encrypted record batches written
    writes: int  # writev calls (one per group, more if a group rolled a segment)
    fsyncs: int  # fdatasync of segment files
    bytes_written: int
    segments_rolled: int
    writebacks: int = 0  # early writeback requests (fsync="interval": start_writeback calls that took)


@dataclass(frozen=True, slots=True)
class _RecordMeta:
    """What publishing a record updates besides the offset index."""

    runs: list[Run]
    id_hashes: np.ndarray
    id_slots: np.ndarray | None
    id_array: pa.Array
    id_mark: int | None  # the table mark the ids got right after the check (RecentIds.mark)


class _Done:
    """A one-shot event for one waiter: a lock held until set (a third of ``threading.Event``'s cost,
    which is a condition variable for any number of waiters)."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        """Only the committer sets, once."""
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=min(timeout, threading.TIMEOUT_MAX)):
            self._lock.release()
        return self._set


class _Request:
    __slots__ = ("batch", "nbytes", "done", "result", "error")

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.batch = batch
        self.nbytes = max(1, approx_bytes(batch))
        self.done = _Done()
        self.result: AppendResult | None = None
        self.error: BaseException | None = None


def _int64s(array: pa.Array) -> np.ndarray:
    """The int64 values of a null-free timestamp array, without a copy."""
    return np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array), offset=array.offset * 8)


def _writev_all(fd: int, buffers: list[bytes | pa.Buffer]) -> None:
    for i in range(0, len(buffers), _IOV_MAX):
        chunk = [memoryview(b) for b in buffers[i:i + _IOV_MAX]]
        want = sum(len(m) for m in chunk)
        done = os.writev(fd, chunk)
        while done < want:  # short write (rare: signal, quota): finish what is left of this chunk
            rest: list[memoryview] = []
            skip = done
            for m in chunk:
                if skip >= len(m):
                    skip -= len(m)
                    continue
                rest.append(m[skip:])
                skip = 0
            chunk = rest
            want -= done
            done = os.writev(fd, chunk)


class Writer:
    """Owns the active segment's write descriptor and the idempotence state."""

    def __init__(self, journal: "Journal", active: Segment, fd: int, active_runs: list[tuple[int, list[Run]]],
                 recent: RecentIds) -> None:
        self._journal = journal
        self._active = active
        self._fd = fd
        self._active_runs = active_runs
        self._recent = recent
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Request] = deque()
        self._queued_bytes = 0
        self._stopping = False
        # Who commits: None (nobody), _HANDOFF (work left for the writer thread), or the token of the
        # appender or writer-thread round that holds the role. Tokens make giving it up idempotent.
        self._committer: object | None = None
        # Threads waiting on _cond for something other than work for the writer thread (queue space,
        # a committer to finish): only then do routine commits notify. Waking the idle writer thread
        # at every append cost a thread switch and a GIL hand-over each time.
        self._others_waiting = 0
        self.failure: BaseException | None = None
        # For the syncer: descriptors of rolled segments to sync and close, and whether work is due.
        self._sync_lock = threading.Lock()
        self._sync_serial = threading.Lock()  # held through a whole sync (see sync)
        self._retired: list[int] = []
        self._unsynced: list[Path] = []  # segments rolled under fsync="never", for an explicit sync()
        self._dir_dirty = False
        self._written = 0
        self._synced = 0
        # Early writeback (fsync="interval"): where in the active segment it was last started, and
        # the bytes written since the syncer was last woken for it.
        self._writeback_from = active.size
        self._unstarted = 0
        self._reserved = active.size  # blocks of the active segment reserved up to here (see _reserve)
        self._reserve_took = False  # whether any reservation for the active segment took (else nothing to give back)
        self._release_after_sync: dict[int, int] = {}  # retired descriptor -> its size: give back the reserve
        self._writeback = journal.fsync == "interval"
        self.counters = {"appends": 0, "rows_appended": 0, "duplicates": 0, "records": 0, "writes": 0,
                         "fsyncs": 0, "bytes_written": 0, "segments_rolled": 0, "writebacks": 0}
        self._thread = threading.Thread(target=self._run, name="zerocomm-journal-writer", daemon=True)
        self._syncer: threading.Thread | None = None
        self._syncer_stop = threading.Event()
        self._syncer_kick = threading.Event()  # set: the syncer has work now (writeback, or stopping)

    # --- appender side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        j = self._journal
        if j.fsync == "interval" or j.retention_bytes is not None or j.retention_ms is not None or \
                j.consumer_expiry_ms is not None:
            self._syncer = threading.Thread(target=self._background, name="zerocomm-journal-syncer", daemon=True)
            self._syncer.start()

    def submit(self, batch: pa.RecordBatch, timeout: float) -> AppendResult:
        deadline = time.monotonic() + timeout
        request = _Request(batch)
        token: object | None = None
        try:
            with self._cond:
                while self._queued_bytes > 0 and self._queued_bytes + request.nbytes > MAX_QUEUED_BYTES:
                    self._check_running()
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise JournalTimeoutError(f"the journal's write queue stayed full for {timeout:g} s")
                    self._wait_other(remaining)
                self._check_running()
                self._queue.append(request)
                self._queued_bytes += request.nbytes
                if self._committer is None:  # nobody is writing: this appender does
                    token = self._committer = object()
            if token is not None:
                self._commit_inline()
        finally:
            if token is not None:
                self._release(token)  # whatever happened, the role is given up or handed over
        if not request.done.wait(max(0.0, deadline - time.monotonic())):
            raise JournalTimeoutError(f"the append was not written within {timeout:g} s")
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _check_running(self) -> None:
        if self.failure is not None:
            raise JournalClosedError(f"the journal stopped after a write failure: {self.failure}") from self.failure
        if self._stopping:
            raise JournalClosedError("the journal is closed")

    # --- writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while self.failure is None and not (self._queue and self._committer in (None, _HANDOFF)):
                    if self._stopping and not self._queue and self._committer is None:
                        return
                    self._cond.wait(_IDLE_POLL_S)
                if self.failure is not None:
                    while self._committer not in (None, _HANDOFF):  # an appender still writing: stop() waits on us
                        self._wait_other(1.0)
                    self._committer = None
                    return
                token = self._committer = object()
            try:
                self._commit_queued(inline=False)
            finally:
                self._release(token)

    def _wait_other(self, timeout: float) -> None:
        """Wait on _cond (held) for queue space or a committer to finish: see ``_others_waiting``."""
        self._others_waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._others_waiting -= 1

    def _release(self, token: object) -> None:
        """Give up the committer role if ``token`` still holds it: to the writer thread if work is left."""
        with self._cond:
            if self._committer is token:
                self._committer = _HANDOFF if self._queue and self.failure is None else None
                if self._committer is _HANDOFF or self._others_waiting or self._stopping:
                    self._cond.notify_all()

    def _commit_inline(self) -> None:
        """Commit as the appender. In the main thread, a Ctrl-C that arrives meanwhile is held until
        the commit is done and then raised: a commit cut short would leave the journal's files and
        its index disagreeing, which only stopping the journal could make safe."""
        if threading.current_thread() is not threading.main_thread():
            self._commit_queued(inline=True)
            return
        previous = _signal.getsignal(_SIGINT)
        held: list[object] = []
        if previous is None or previous == _SIG_IGN:  # no Python-level SIGINT handling to hold back
            self._commit_queued(inline=True)
            return
        _signal.signal(_SIGINT, lambda signum, frame: held.append(frame))
        try:
            self._commit_queued(inline=True)
        finally:
            _signal.signal(_SIGINT, previous)
        if held:
            if callable(previous):
                previous(signal.SIGINT, held[0])
            elif previous == _SIG_DFL:
                signal.raise_signal(signal.SIGINT)  # what it would have done: the default action

    def _commit_queued(self, *, inline: bool) -> None:
        """Commit queued groups while this thread holds the committer role (one group when inline);
        the caller gives the role up (``_release``) whatever happens here."""
        while True:
            with self._cond:
                if not self._queue or self.failure is not None:
                    return
                group: list[_Request] = []
                size = 0
                while self._queue and (not group or size + self._queue[0].nbytes <= MAX_GROUP_BYTES):
                    request = self._queue.popleft()
                    size += request.nbytes
                    group.append(request)
                self._queued_bytes -= size
                if self._others_waiting:  # appenders waiting for queue space
                    self._cond.notify_all()
            try:
                self._commit(group)
            except BaseException as exc:  # noqa: BLE001 - anything here stops the journal
                self._fail(exc, group)
                return
            if inline:
                return

    def _fail(self, exc: BaseException, group: list[_Request]) -> None:
        # OS errors say what to fix (disk full...), and the journal's own errors are its words; other
        # exceptions only by type: their text could quote data.
        detail = (f"{exc.strerror or exc}" if isinstance(exc, OSError)
                  else exc.message if isinstance(exc, JournalError) else type(exc).__name__)
        log.error("journal %s: writing failed, the journal stops: %s", self._journal.directory, detail)
        if isinstance(exc, JournalError):
            error = exc
        elif isinstance(exc, OSError):  # the hint follows the errno: descriptors, space, permissions...
            error = JournalError(f"writing the journal failed: {detail}",
                                 hint=f"{files.os_error_fix(exc)}, then reopen the journal to recover")
            error.__cause__ = exc  # kept for an owner that says what to fix (the agent's health file)
        else:
            error = JournalError(f"writing the journal failed: {detail}")
        with self._cond:
            if self.failure is None:  # the first failure is the one that says what went wrong
                self.failure = error
            error = self.failure
            pending = group + list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        for request in pending:
            if not request.done.is_set():
                request.error = error
                request.done.set()

    def _commit(self, group: list[_Request]) -> None:
        j = self._journal
        pending: dict[index.Key, int] = {}
        pending_ids: set[bytes] | None = set() if len(group) > 1 else None
        next_offset = j._next_offset  # noqa: SLF001 - the writer is part of the journal
        jobs: list[tuple[pa.RecordBatch, int, int, int]] = []  # (batch with offsets, base, min ts, max ts)
        metas: list[_RecordMeta] = []
        superseded: list[tuple[index.Key, int]] = []
        for request in group:
            kept = filter_new(request.batch, j._last_seq, pending, self._recent, pending_ids,  # noqa: SLF001
                              j._any_superseded)  # noqa: SLF001
            mark = self._recent.mark(kept.slots) if kept.slots is not None else None
            superseded += kept.superseded
            batch = kept.batch
            n = batch.num_rows
            first = next_offset
            if n:
                size = request.nbytes if kept.duplicates == 0 else approx_bytes(batch)
                per_record = max(1, -(-n // max(1, -(-size // MAX_RECORD_BYTES))))  # even split
                # The id rule's keys of the kept rows (ids scoped by group), for the writer's RecentIds.add.
                id_column = kept.id_keys if kept.id_keys is not None else batch.column(_MESSAGE_ID)
                received = _int64s(batch.column(_RECEIVED_AT))
                # Whole-append work once (the offset column, the ids), then per record only slices.
                stored = batch.add_column(0, _OFFSET_FIELD, pa.array(np.arange(next_offset, next_offset + n,
                                                                               dtype=np.int64)))
                for start in range(0, n, per_record):
                    stop = min(n, start + per_record)
                    whole = start == 0 and stop == n
                    span = received if whole else received[start:stop]
                    jobs.append((stored if whole else stored.slice(start, stop - start), next_offset,
                                 int(span.min()), int(span.max())))
                    metas.append(_RecordMeta(kept.runs(start, stop, next_offset),
                                             kept.hashes if whole else kept.hashes[start:stop],
                                             kept.slots if whole or kept.slots is None else kept.slots[:, start:stop],
                                             id_column if whole else id_column.slice(start, stop - start), mark))
                    next_offset += stop - start
            request.result = AppendResult(first, first + n - 1, n, kept.duplicates)
        counters = self.counters
        counters["appends"] += len(group)
        counters["rows_appended"] += next_offset - j._next_offset  # noqa: SLF001
        counters["duplicates"] += sum(r.result.duplicates for r in group if r.result is not None)
        counters["records"] += len(jobs)
        if superseded:  # saved before the rows are written (superseded.py); rare, so under the lock
            with j._lock:  # noqa: SLF001
                j._superseded.add(superseded)  # noqa: SLF001
        self._write(list(zip(self._encode(jobs), metas)))
        for request in group:
            request.done.set()

    def _encode(self, jobs: list[tuple[pa.RecordBatch, int, int, int]]) -> list[Frame]:
        """Encrypt and checksum the records, several at once when there are several (libsodium releases
        the GIL, so records of a large append use every core)."""
        key = self._journal._key  # noqa: SLF001
        pool = self._journal._pool() if len(jobs) > 1 else None  # noqa: SLF001
        if pool is None:
            return [codec.encode_record(b, base, lo, hi, key) for b, base, lo, hi in jobs]
        futures = [pool.submit(codec.encode_record, b, base, lo, hi, key) for b, base, lo, hi in jobs[1:]]
        frames: list[Frame | None] = [codec.encode_record(*jobs[0][:4], key), *([None] * len(futures))]
        # The caller is one of read_threads: it takes back, from the end, the jobs no pool thread started.
        for i in range(len(futures), 0, -1):
            if futures[i - 1].cancel():
                frames[i] = codec.encode_record(*jobs[i][:4], key)
        try:
            for i, future in enumerate(futures, 1):
                if frames[i] is None:
                    frames[i] = future.result(timeout=self._journal.timeout)
        except TimeoutError:
            raise JournalTimeoutError("encrypting records took longer than the journal's timeout") from None
        return frames  # type: ignore[return-value]

    def _write(self, frames: list[tuple[Frame, _RecordMeta]]) -> None:
        j = self._journal
        todo: list[tuple[Frame, _RecordMeta]] = []
        size = self._active.size
        for frame, meta in frames:
            if (self._active.records or todo) and size + frame.length > j.segment_bytes:
                self._flush(todo)
                todo = []
                self._roll()
                size = self._active.size
            todo.append((frame, meta))
            size += frame.length
        self._flush(todo)

    def _flush(self, todo: list[tuple[Frame, _RecordMeta]]) -> None:
        if not todo:
            return
        buffers: list[bytes | pa.Buffer] = []
        for frame, _ in todo:
            buffers.append(frame.header)
            buffers.append(frame.body)
        position = self._active.size
        written = sum(frame.length for frame, _ in todo)
        if position + written > self._reserved:
            self._reserve(position + written)
        _writev_all(self._fd, buffers)
        self._check_linked()
        self._written += 1
        self.counters["writes"] += 1
        self.counters["bytes_written"] += written
        if self._journal.fsync == "always":
            os.fdatasync(self._fd)
            self.counters["fsyncs"] += 1
            if self._dir_dirty:
                fsync_dir(self._journal.directory)
                self._dir_dirty = False
        entries: list[tuple[RecordEntry, list[Run]]] = []
        for frame, meta in todo:
            entries.append((RecordEntry(position, frame.record), meta.runs))
            position += frame.length
            self._recent.add(meta.id_hashes, meta.id_array, meta.id_slots, meta.id_mark)  # only now: they are written
        self._active_runs.extend((entry.base_offset, runs) for entry, runs in entries)
        self._journal._publish(self._active, entries)  # noqa: SLF001
        if self._writeback:  # after _publish: the syncer starts up to the segment's published size
            self._unstarted += written
            if self._unstarted >= WRITEBACK_BYTES:
                self._unstarted = 0
                self._syncer_kick.set()

    def _reserve(self, end: int) -> None:
        """Reserve the active segment's blocks up to ``end`` and some way past it (PREALLOCATE_BYTES, not past
        the segment's size), so the writes into them allocate nothing. Where the file system cannot (or the disk
        is full) nothing changes: the writes allocate as they go, and report a full disk themselves."""
        start = max(self._reserved, self._active.size)
        stop = max(end, min(start + PREALLOCATE_BYTES, self._journal.segment_bytes))
        if files.preallocate(self._fd, start, stop - start):
            self._reserve_took = True
        self._reserved = stop  # refused or not: asked again only for what lies past it

    def _check_linked(self) -> None:
        """Raise JournalError if the active segment was unlinked (its directory removed, or the file
        deleted, under a running journal): what is written to it now is in no file a reopen finds, so
        acknowledging it would lose it at the next restart. Checked after the write, before anyone is
        told it is journaled; one fstat per write."""
        if os.fstat(self._fd).st_nlink == 0:
            raise JournalError(
                f"the journal's active segment {self._active.path} was removed while the journal was open "
                f"(was {self._journal.directory} deleted?); what it held is gone and nothing more is written",
                hint="Find what deletes files there (a tmp cleaner, a cleanup script) and keep it away from the "
                     "journal directory, then restart the agent: it opens a new journal there and publishers re-send "
                     "what it did not acknowledge")

    def active_file_linked(self) -> bool:
        """Whether the active segment is still a file of the journal directory (see _check_linked), for
        an owner that checks now and then while no append comes; True once closed."""
        with self._sync_lock:  # the roll and the close replace or close the descriptor under it
            return self._fd < 0 or os.fstat(self._fd).st_nlink > 0

    def _roll(self) -> None:
        """Close the active segment (saving its side index) and start the next one."""
        j = self._journal
        old, old_fd = self._active, self._fd
        if j.fsync == "always":
            os.fdatasync(old_fd)
        j._write_side_index(old, self._active_runs, self._recent.as_array())  # noqa: SLF001
        new, fd = create_segment(j.directory, old.end_offset, now_micros())
        took, self._reserve_took = self._reserve_took, False
        if took and j.fsync == "always":  # synced above: giving the reserve back writes nothing
            files.release_preallocation(old_fd, old.size)
        overflow: list[int] = []
        with self._sync_lock:
            self._active, self._fd = new, fd
            self._active_runs = []
            self._writeback_from = new.size
            self._reserved = new.size
            if j.fsync == "interval":  # the syncer syncs and closes it, off the append path
                self._retired.append(old_fd)
                if took:
                    self._release_after_sync[old_fd] = old.size
                self._dir_dirty = True
                # ...unless rolls outpace it (small segments, a slow disk): then the oldest are synced
                # and closed here, so open descriptors stay bounded.
                overflow, self._retired = self._retired[:-_MAX_RETIRED], self._retired[-_MAX_RETIRED:]
            else:
                os.close(old_fd)  # under "always" it was synced above
                if j.fsync == "always":
                    os.fdatasync(fd)
                    fsync_dir(j.directory)
                else:  # "never": an explicit Journal.sync() still owes this segment an fsync
                    self._dir_dirty = True
                    self._unsynced.append(old.path)
                    if len(self._unsynced) > _MAX_UNSYNCED:  # retention may have deleted most of them
                        self._unsynced = [path for path in self._unsynced if path.exists()]
        if overflow:
            # As a sync would: a sync() that starts meanwhile must not return before these are on
            # disk (it no longer sees them in _retired). Bounded: past the timeout, sync them anyway.
            serial = self._sync_serial.acquire(timeout=j.timeout)
            try:
                self._sync_and_close(overflow)
            finally:
                if serial:
                    self._sync_serial.release()
        self.counters["segments_rolled"] += 1
        j._add_segment(new)  # noqa: SLF001
        j._after_roll()  # noqa: SLF001

    # --- background: interval fsync and retention ----------------------------------------------

    def _background(self) -> None:
        j = self._journal
        period = j.fsync_interval_ms / 1000 if j.fsync == "interval" else 1.0
        next_round = time.monotonic() + period
        next_retention = time.monotonic() + 1.0
        while True:
            kicked = self._syncer_kick.wait(max(0.0, next_round - time.monotonic()))
            if self._syncer_stop.is_set():
                return
            try:
                if kicked:
                    self._syncer_kick.clear()
                    self._start_writeback()
                if time.monotonic() < next_round:
                    continue
                next_round = time.monotonic() + period
                if j.fsync == "interval":
                    self.sync()
                if (j.retention_bytes is not None or j.retention_ms is not None or j.consumer_expiry_ms is not None) \
                        and time.monotonic() >= next_retention:
                    next_retention = time.monotonic() + 1.0
                    j.enforce_retention()
            except BaseException as exc:  # noqa: BLE001
                if isinstance(exc, OSError):
                    self._fail(exc, [])
                if self.failure is not None:
                    return
                log.warning("journal %s: background work failed: %s", j.directory, exc)

    def _start_writeback(self) -> None:
        """Start writing what was appended to the active segment since the last call (see WRITEBACK_BYTES)."""
        with self._sync_lock:  # a descriptor of our own: the roll or close may close this one meanwhile
            start, end = self._writeback_from, self._active.size
            if self._fd < 0 or end <= start:
                return
            try:
                fd = os.dup(self._fd)
            except OSError:  # out of descriptors: writeback is only advice, the next sync writes it all
                return
            self._writeback_from = end
        try:  # outside the lock: a congested device may hold the call, and appends must not wait
            if files.start_writeback(fd, start, end - start):
                self.counters["writebacks"] += 1
        finally:
            os.close(fd)

    def _sync_and_close(self, fds: list[int]) -> None:
        """fdatasync and close rolled segments' descriptors: every one is closed whatever happens,
        and the first failure is raised once all were tried."""
        failure: OSError | None = None
        for fd in fds:
            size = self._release_after_sync.pop(fd, None)
            try:
                os.fdatasync(fd)
                self.counters["fsyncs"] += 1
                if size is not None:  # on disk now: giving its reserve back writes nothing
                    files.release_preallocation(fd, size)
            except OSError as exc:
                failure = failure or exc
            finally:
                os.close(fd)
        if failure is not None:
            raise failure

    def sync(self, *, force: bool = False) -> None:
        """fdatasync what was written since the last sync (and close rolled segments' descriptors).

        One sync at a time, so a sync is a barrier: an explicit one that starts while the syncer's
        round is syncing rolled segments waits for it rather than return before they are on disk.
        An fdatasync that fails stops the journal (the kernel may have dropped the pages it could
        not write) and raises its failure; so does every sync after it.
        """
        timeout = self._journal.timeout
        if not self._sync_serial.acquire(timeout=timeout):
            raise JournalTimeoutError(f"a sync in progress did not finish within {timeout:g} s")
        try:
            if self.failure is not None:
                raise self.failure
            with self._sync_lock:
                if self._fd < 0:
                    raise JournalClosedError("the journal is closed")
                written = self._written
                try:  # first, so that a failure takes nothing: a descriptor of our own for the active
                    # segment (a roll may retire it meanwhile, and a later roll close it)
                    fd = os.dup(self._fd) if force or written != self._synced else -1
                except OSError as exc:  # out of descriptors: nothing was lost, nothing is stopped
                    raise JournalError(f"cannot sync the journal now: {exc.strerror}",
                                       hint=f"{files.os_error_fix(exc)}, then sync again: nothing was lost") from None
                retired, self._retired = self._retired, []
                unsynced, self._unsynced = self._unsynced, []
                dir_dirty, self._dir_dirty = self._dir_dirty, False
            try:
                self._sync_snapshot(retired, unsynced, fd, dir_dirty or force, written)
            except OSError as exc:
                self._fail(exc, [])
                # (from its own cause, the OS error, not None: that would erase it for other owners)
                raise self.failure from self.failure.__cause__  # type: ignore[union-attr]
            finally:
                if fd >= 0:
                    os.close(fd)
        finally:
            self._sync_serial.release()

    def _sync_snapshot(self, retired: list[int], unsynced: list[Path], fd: int, sync_dir: bool, written: int) -> None:
        """sync() outside the lock: rolled segments, then the directory, then the active segment (``fd``, a dup)."""
        self._sync_and_close(retired)
        for path in unsynced:  # segments rolled under "never": their descriptors were closed unsynced
            try:
                old = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # retention deleted it meanwhile: nothing to keep
                continue
            try:
                os.fdatasync(old)
                self.counters["fsyncs"] += 1
            finally:
                os.close(old)
        if sync_dir:
            fsync_dir(self._journal.directory)
        if fd >= 0:
            os.fdatasync(fd)
            self.counters["fsyncs"] += 1
            self._synced = written

    # --- shutdown ------------------------------------------------------------------------------

    def stop(self, timeout: float) -> None:
        """Write what is queued, then stop both threads; the descriptors close in ``finish``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise JournalTimeoutError(f"the journal writer did not finish within {timeout:g} s")
        with self._cond:  # an appender may still be committing inline (after a failure the thread left early)
            while self._committer not in (None, _HANDOFF):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise JournalTimeoutError(f"an append being written did not finish within {timeout:g} s")
                self._wait_other(remaining)
        self._syncer_stop.set()
        self._syncer_kick.set()
        if self._syncer is not None:
            self._syncer.join(max(0.0, deadline - time.monotonic()))
            if self._syncer.is_alive():
                raise JournalTimeoutError(f"the journal syncer did not finish within {timeout:g} s")

    def busy(self) -> bool:
        """Is a write still under way (a stop that timed out)? Then nothing it uses may be closed: the
        descriptor number could be reused by another file, and the directory lock must stay held."""
        with self._cond:
            return (self._committer not in (None, _HANDOFF) or self._thread.is_alive()
                    or (self._syncer is not None and self._syncer.is_alive()))

    def finish(self) -> tuple[Segment, list[tuple[int, list[Run]]], pa.Array]:
        """After stop(): sync (unless "never"), close descriptors; what the side index needs."""
        try:
            if self._journal.fsync != "never" and self.failure is None:
                self.sync(force=True)
        finally:
            with self._sync_lock:
                for fd in self._retired:
                    self._release_after_sync.pop(fd, None)
                    os.close(fd)
                self._retired = []
                if self._fd >= 0:
                    if self.failure is None and self._reserve_took:
                        files.release_preallocation(self._fd, self._active.size)
                    os.close(self._fd)
                    self._fd = -1
        return self._active, self._active_runs, self._recent.as_array()
