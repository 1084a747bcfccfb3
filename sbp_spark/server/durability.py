"""Group commit: the thread that fsyncs the range logs and releases what waits for durability.

Appends write to the page cache and mark their range *dirty*; acknowledgements wait here until
the range's ``next_offset`` (what is durable, see ``RangeLog.sync``) reaches their end. Policies
(``FsyncPolicy``):

* ``always``: a round starts as soon as a range is dirty; appends arriving during a round's
  fsyncs share the next round (group commit), so throughput does not collapse.
* ``interval``: rounds start at most once per ``fsync_interval_ms``; acknowledgements wait for
  the round after their append.
* ``never``: no rounds at all; appends are acknowledged once in the page cache (their range
  moves ``next_offset`` itself).

One round fsyncs every dirty range; several dirty ranges are fsynced side by side.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..protocol.errors import SbpError, StorageFullError

if TYPE_CHECKING:
    from .range_log import RangeLog

log = logging.getLogger(__name__)

# Group-commit period of the ``interval`` policy: a small added append latency for
# one fsync per period instead of one per append.
DEFAULT_FSYNC_INTERVAL_MS = 10
# Ranges fsynced at the same time in one group-commit round.
_SYNC_THREADS = 8

Waiter = Callable[[BaseException | None], None]


class FsyncPolicy(str, enum.Enum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


class GroupCommit:
    """The fsync thread of one storage, and the callbacks waiting for data to be durable.

    ``on_synced(count)`` is called after each fsync of a range that succeeded (statistics);
    ``after_round()`` after each round's waiters were released (work kept off their path).
    """

    def __init__(self, policy: FsyncPolicy, interval_ms: int,
                 on_synced: Callable[[], None] = lambda: None,
                 after_round: Callable[[], None] = lambda: None) -> None:
        self.policy = policy
        self.interval_ms = interval_ms
        self._on_synced = on_synced
        self._after_round = after_round
        self._dirty: dict[int, RangeLog] = {}  # id(range) -> range with unsynced writes
        self._waiters: list[tuple[RangeLog, int, Waiter]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if policy is not FsyncPolicy.NEVER:
            self._thread = threading.Thread(target=self._loop, name="sbp-fsync", daemon=True)
            self._thread.start()

    # -- what appends and acknowledgements call ----------------------------------------------

    def mark_dirty(self, rlog: RangeLog) -> None:
        """``rlog`` has written bytes that are not durable yet."""
        with self._cond:
            if not self._dirty:
                self._cond.notify()
            self._dirty[id(rlog)] = rlog

    def when_durable(self, rlog: RangeLog, target: int, callback: Waiter) -> None:
        """Call ``callback(None)`` once ``rlog.next_offset >= target`` (now, if already true),
        or ``callback(error)`` if the data cannot be made durable. Callbacks run on the fsync
        thread: they must not block."""
        with self._cond:
            if rlog.next_offset < target and rlog.failure is None and not self._closed:
                self._waiters.append((rlog, target, callback))
                return
        callback(self._failure(rlog) if rlog.next_offset < target else None)

    def wait_durable(self, rlog: RangeLog, target: int, timeout: float | None = None) -> None:
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

    def release_waiters(self, final: bool = False) -> None:
        """Call back every waiter whose data is durable now (or, failed or ``final``, never
        will be)."""
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

    def close(self) -> None:
        """Sync what is dirty, fail what still waits, and stop the thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # -- the fsync thread --------------------------------------------------------------------

    def _failure(self, rlog: RangeLog) -> BaseException:
        if self._closed:
            return StorageFullError("storage closed before the data was synced")
        return StorageFullError(rlog.failure or "data could not be synced")

    def _sync_one(self, rlog: RangeLog) -> None:
        try:
            rlog.sync()
            self._on_synced()
        except (OSError, SbpError) as exc:
            log.error("fsync of %s failed: %s", rlog, exc)

    def _loop(self) -> None:
        interval = self.interval_ms / 1000.0
        always = self.policy is FsyncPolicy.ALWAYS
        # Started with the second range that needs an fsync in one round.
        pool: ThreadPoolExecutor | None = None
        last_round = -interval  # monotonic start of the previous round
        try:
            while True:
                with self._cond:
                    while not self._dirty and not self._closed:
                        self._cond.wait()
                    if not self._dirty:
                        break  # closed and nothing left to sync
                    if not always and not self._closed:
                        # Group commit: appends until one interval after the previous round
                        # began share this fsync. Counting from its start, not its end, keeps
                        # rounds at most one per interval without adding the fsync's own
                        # duration to every acknowledgement's wait.
                        wait = last_round + interval - time.monotonic()
                        if wait > 0:
                            self._cond.wait_for(lambda: self._closed, timeout=wait)
                    dirty = list(self._dirty.values())
                    self._dirty.clear()
                last_round = time.monotonic()
                # Under "always", appends that arrive during these fsyncs wait for the next
                # round, which starts at once: one fsync per round, not per append.
                if len(dirty) == 1:
                    self._sync_one(dirty[0])
                else:
                    # Many active ranges: their fsyncs run side by side (the file system can
                    # commit them in one journal transaction), not one after another.
                    if pool is None:
                        pool = ThreadPoolExecutor(_SYNC_THREADS, thread_name_prefix="sbp-fsync")
                    list(pool.map(self._sync_one, dirty))
                self.release_waiters()
                self._after_round()  # after the answers: not on their critical path
        finally:
            if pool is not None:
                pool.shutdown()
            self.release_waiters(final=True)
