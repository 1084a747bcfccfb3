"""Group commit: the thread that flushes (fsyncs) the range logs and releases what waits for
durability.

Appends write to the page cache and mark their range *dirty*; acknowledgements wait here until
the range's ``next_offset`` (what is durable, see ``Flushable``) reaches their end. A
*flush* fsyncs every dirty range (several side by side); appends written while a flush runs
go into the next one, so one fsync serves every append that waited for it. When a flush
starts is the policy (``FsyncPolicy``):

* ``group`` (the default): as soon as something is dirty and no flush runs, unless more is on
  its way: appends being stored at that moment (a burst), or the writers the previous flush
  acknowledged, who are likely to come right back (it waits until as many appends were
  stored since that flush began as it acknowledged, at most as long as it took). Never
  later than ``fsync_interval_ms`` after the first write it will make durable, and not at
  all once ``GROUP_FLUSH_BYTES`` are dirty: waiting saves an fsync's fixed cost, which is
  small next to writing that much, while the acknowledgements of a pipelined writer's large
  appends would wait for nothing. One writer waiting for each acknowledgement gets a flush
  as soon as its append is stored; many busy writers share flushes, each fsync covering
  more of them (fsyncs side by side also share the file system's journal commit, so they
  cost less CPU each).
* ``always``: as soon as something is dirty and no flush runs, whatever arrives.
* ``interval``: at most one flush per ``fsync_interval_ms``, counted from the start of the
  previous one: the fewest fsyncs, and every acknowledgement waits for the next tick.
* ``never``: no flushes at all; appends are acknowledged once in the page cache (their range
  moves ``next_offset`` itself).

Under every policy but ``never`` an append is acknowledged only once it is durable.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Generic, Protocol, TypeVar

from ...protocol.errors import SbpError, StorageFullError

log = logging.getLogger(__name__)

# The longest a write waits for its flush to start under ``group`` while a burst is being
# stored, and the flush period of ``interval``: a small added latency for fewer fsyncs.
DEFAULT_FSYNC_INTERVAL_MS = 10
# Under ``group``, a flush starts at once when this much is dirty, whatever else may be coming.
# Measured with one writer keeping 32 APPENDs of 1 MiB in flight: waiting for the burst to
# end left the flush thread idle 38% of the time while the writer's window sat full.
GROUP_FLUSH_BYTES = 4 * 1024 * 1024
# Ranges fsynced at the same time in one flush.
_SYNC_THREADS = 8

Waiter = Callable[[BaseException | None], None]


class Flushable(Protocol):
    """What the flush thread makes durable: a range log, as group commit sees it."""

    @property
    def next_offset(self) -> int:
        """The offset after the last durable record (what waiters wait for)."""

    @property
    def failure(self) -> str | None:
        """Why nothing more can be made durable (a failed fsync), or None."""

    def sync(self) -> None:
        """Make everything written so far durable, moving ``next_offset``; raises on
        failure."""


F = TypeVar("F", bound=Flushable)


class FsyncPolicy(str, enum.Enum):
    """When appends are made durable (see the module's description)."""

    GROUP = "group"
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


# One line per policy for help texts (``sbp server --help``) and error messages.
POLICY_HELP = {
    FsyncPolicy.GROUP: "flush as soon as a write is stored and no flush runs, unless more "
                       "appends are on their way (a burst being stored, the writers the last "
                       "flush answered coming back): then gather them, for at most the fsync "
                       f"interval and until {GROUP_FLUSH_BYTES >> 20} MiB wait",
    FsyncPolicy.ALWAYS: "flush as soon as a write is stored and no flush runs",
    FsyncPolicy.INTERVAL: "flush at most once per fsync interval",
    FsyncPolicy.NEVER: "never fsync: acknowledge once in the page cache",
}


class _StoringBracket:
    """``GroupCommit.storing()`` under ``group``: holds no state of its own, so one serves
    every append of every thread."""

    __slots__ = ("_commit",)

    def __init__(self, commit: GroupCommit) -> None:
        self._commit = commit

    def __enter__(self) -> None:
        self._commit._begin_storing()

    def __exit__(self, *exc: object) -> None:
        self._commit._end_storing()


class GroupCommit(Generic[F]):
    """The flush thread of one storage, and the callbacks waiting for data to be durable.

    ``on_synced(seconds)`` is called after each fsync of a range that succeeded, with how long
    it took (statistics);
    ``after_round(ranges)`` after each flush's waiters were released, with the ranges it
    flushed (work kept off their path).
    """

    def __init__(self, policy: FsyncPolicy, interval_ms: int,
                 on_synced: Callable[[float], None] = lambda seconds: None,
                 after_round: Callable[[list[F]], object] = lambda ranges: None
                 ) -> None:
        self.policy = policy
        self.interval_s = interval_ms / 1000.0
        self._on_synced = on_synced
        self._after_round = after_round
        self._dirty: dict[int, F] = {}  # id(range) -> range with unsynced writes
        self._first_dirty = 0.0  # monotonic time the first of them was marked
        self._dirty_bytes = 0  # bytes written since the last flush took what was dirty
        self._waiters: list[tuple[F, int, Waiter]] = []
        self._storing = 0  # appends being stored right now (``storing()``)
        self._woken = False  # the flush thread was told of what is dirty now
        # ``group``: how many appends the previous flush acknowledged (their writers are likely
        # to come back with the next), how many were stored since it started, and when it
        # ended and how long it took.
        self._answered = 0
        self._returned = 0
        self._last_end = 0.0
        self._last_took = 0.0
        self._cond = threading.Condition()
        # What ``storing()`` returns: one object for every append (a generator-based context
        # manager cost a few microseconds per append, a tenth of a small append's own work).
        self._bracket: AbstractContextManager[None] = (
            _StoringBracket(self) if policy is FsyncPolicy.GROUP else nullcontext())
        self._closed = False
        self._last_flush = -self.interval_s  # monotonic start of the previous flush
        self.flushes = 0
        self._thread: threading.Thread | None = None
        if policy is not FsyncPolicy.NEVER:
            self._thread = threading.Thread(target=self._loop, name="sbp-fsync", daemon=True)
            self._thread.start()

    # -- what appends and acknowledgements call ----------------------------------------------

    def mark_dirty(self, rlog: F, nbytes: int) -> None:
        """``rlog`` has written ``nbytes`` more that are not durable yet."""
        with self._cond:
            if not self._dirty:
                self._first_dirty = time.monotonic()
                if not self._storing:  # else the append's own ``storing`` wakes it, at its end
                    self._wake()
            self._dirty[id(rlog)] = rlog
            self._dirty_bytes += nbytes

    def _wake(self) -> None:
        self._woken = True
        self._cond.notify()

    def storing(self) -> AbstractContextManager[None]:
        """Bracket the storing of one append: under ``group`` a flush that could start waits
        (at most the interval) until no append is being stored, so a burst shares it."""
        return self._bracket

    def _begin_storing(self) -> None:
        with self._cond:
            self._storing += 1

    def _end_storing(self) -> None:
        with self._cond:
            self._storing -= 1
            self._returned += 1
            # The flush thread learns of new dirty data at the end of the first append
            # that wrote it, and is woken again once it may start (``_flush_at``).
            if self._dirty and (not self._woken or self._dirty_bytes >= GROUP_FLUSH_BYTES
                                or (not self._storing and self._returned >= self._answered)):
                self._wake()

    def when_durable(self, rlog: F, target: int, callback: Waiter) -> None:
        """Call ``callback(None)`` once ``rlog.next_offset >= target`` (now, if already true),
        or ``callback(error)`` if the data cannot be made durable. Callbacks run on the flush
        thread: they must not block."""
        with self._cond:
            if rlog.next_offset < target and rlog.failure is None and not self._closed:
                self._waiters.append((rlog, target, callback))
                return
        callback(self._failure(rlog) if rlog.next_offset < target else None)

    def wait_durable(self, rlog: F, target: int, timeout: float | None = None) -> None:
        """Block until ``rlog.next_offset >= target``; raises on fsync failure or timeout."""
        done = threading.Event()
        result: list[BaseException | None] = []

        def finish(exc: BaseException | None) -> None:
            result.append(exc)
            done.set()

        self.when_durable(rlog, target, finish)
        if not done.wait(timeout):
            raise SbpError(f"data of {rlog} not durable within {timeout} s")
        if result[0] is not None:
            raise result[0]

    def release_waiters(self, final: bool = False) -> int:
        """Call back every waiter whose data is durable now (or, failed or ``final``, never
        will be); the number called back as durable."""
        ready: list[tuple[Waiter, BaseException | None]] = []
        with self._cond:
            keep = []
            for rlog, target, cb in self._waiters:
                if rlog.next_offset >= target:
                    ready.append((cb, None))
                elif rlog.failure is not None or final:
                    ready.append((cb, self._failure(rlog)))
                else:
                    keep.append((rlog, target, cb))
            self._waiters = keep
        for cb, exc in ready:
            try:
                cb(exc)
            except Exception:
                log.exception("durability callback failed")
        return sum(1 for _, exc in ready if exc is None)

    def close(self) -> None:
        """Flush what is dirty, fail what still waits, and stop the thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # -- the flush thread --------------------------------------------------------------------

    def _failure(self, rlog: F) -> BaseException:
        if self._closed:
            return StorageFullError("storage closed before the data was synced")
        return StorageFullError(rlog.failure or "data could not be synced")

    def _flush_at(self) -> float:
        """When the flush of what is dirty may start (monotonic). Call holding the lock."""
        if self.policy is FsyncPolicy.INTERVAL:
            # Counted from the previous flush's start, not its end: at most one flush per
            # interval without adding the fsync's own duration to every acknowledgement.
            return self._last_flush + self.interval_s
        if self.policy is not FsyncPolicy.GROUP or self._dirty_bytes >= GROUP_FLUSH_BYTES:
            return 0.0
        bound = self._first_dirty + self.interval_s
        if self._storing:
            # A burst is being stored: wait for it (``storing`` wakes us), within the bound.
            return bound
        if self._returned < self._answered:
            # The writers the previous flush answered are coming back with their next appends:
            # give them as long as that flush took (a lone writer is back at once).
            return min(bound, self._last_end + self._last_took)
        return 0.0

    def _next_batch(self) -> list[F] | None:
        """Wait until a flush may start; the ranges it flushes (None: closed, all flushed)."""
        with self._cond:
            while not self._dirty and not self._closed:
                self._cond.wait()
            while not self._closed:
                wait = self._flush_at() - time.monotonic()
                if wait <= 0:
                    break
                self._cond.wait(wait)
            if not self._dirty:
                return None
            dirty = list(self._dirty.values())
            self._dirty.clear()
            self._dirty_bytes = 0
            self._woken = False
            self._returned = 0
            return dirty

    def _sync_all(self, ranges: list[F]) -> None:
        for rlog in ranges:
            try:
                started = time.monotonic()
                rlog.sync()
                self._on_synced(time.monotonic() - started)
            except (OSError, SbpError) as exc:
                log.error("fsync of %s failed: %s", rlog, exc)

    def _flush(self, dirty: list[F], pool: ThreadPoolExecutor | None
               ) -> ThreadPoolExecutor | None:
        """fsync every range of ``dirty``; returns the helper threads (started on first use)."""
        if len(dirty) == 1:
            self._sync_all(dirty)
            return pool
        # Many active ranges: their fsyncs run side by side (the file system commits them in
        # one journal transaction), in as many shares as there are threads, this one taking
        # the first: one hand-off per helper thread, not per range.
        if pool is None:
            pool = ThreadPoolExecutor(_SYNC_THREADS - 1, thread_name_prefix="sbp-fsync")
        shares = [dirty[i::_SYNC_THREADS] for i in range(min(_SYNC_THREADS, len(dirty)))]
        helpers = [pool.submit(self._sync_all, share) for share in shares[1:]]
        self._sync_all(shares[0])
        for helper in helpers:
            helper.result()
        return pool

    def _loop(self) -> None:
        pool: ThreadPoolExecutor | None = None
        try:
            while (dirty := self._next_batch()) is not None:
                start = self._last_flush = time.monotonic()
                self.flushes += 1
                pool = self._flush(dirty, pool)
                answered = self.release_waiters()
                with self._cond:
                    self._answered = answered
                    self._last_end = time.monotonic()
                    self._last_took = self._last_end - start
                self._after_round(dirty)  # after the answers: not on their critical path
        finally:
            if pool is not None:
                pool.shutdown()
            self.release_waiters(final=True)
