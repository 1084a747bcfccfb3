"""Retention on a range server: deleting the local data its stream keeps no longer.

The PD holds each stream's retention period, and for a stream that waits for its named
consumers their lowest committed position and the caps; the PD link learns them
(``registration.py``) and sets them here. Every ``interval_s`` a background pass deletes, in
every local range of such a stream, the whole segments whose newest record is older than the
period (those holding records the consumers have not read only once past a cap), and reports
each stream's new start (the PD link passes it on as TRIM_STREAMS).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..storage.range_log import ConsumerHold, RangeLog

log = logging.getLogger(__name__)


class Retention:
    """The retention pass over the local ranges (``ranges()``), by each stream's period."""

    def __init__(self, ranges: Callable[[], list[RangeLog]], interval_s: float) -> None:
        self._ranges = ranges
        self.interval_s = interval_s
        # stream_id -> retention_period_ms, as the PD reports it (-1 or absent: kept forever).
        self._periods: dict[int, int] = {}
        # stream_id -> what its named consumers still need (retention that waits for them).
        self._holds: dict[int, ConsumerHold] = {}
        # Called with (stream_id, new start offset) for each stream a pass moved (the PD link
        # reports it to the PD); None: nobody is told.
        self.on_trim: Callable[[int, int], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_period(self, stream_id: int, retention_ms: int) -> None:
        """Keep the records of ``stream_id`` for ``retention_ms`` (-1: for ever)."""
        self._periods[stream_id] = retention_ms

    def set_hold(self, stream_id: int, hold: ConsumerHold | None) -> None:
        """Keep the records of ``stream_id`` its consumers have not read (``hold``; None:
        the retention period alone decides)."""
        if hold is None:
            self._holds.pop(stream_id, None)
        else:
            self._holds[stream_id] = hold

    def apply(self, now_ms: int | None = None) -> list[tuple[int, int]]:
        """Delete expired segments; returns (stream_id, new start) for each stream that moved."""
        moved: dict[int, int] = {}
        for rlog in self._ranges():
            retention = self._periods.get(rlog.stream_id, -1)
            if retention < 0:
                continue
            new_start = rlog.expire(retention, now_ms, self._holds.get(rlog.stream_id))
            if new_start is not None:
                moved[rlog.stream_id] = max(moved.get(rlog.stream_id, 0), new_start)
        for sid, start in moved.items():
            log.info("retention trimmed stream %d to offset %d", sid, start)
            if self.on_trim is not None:
                try:
                    self.on_trim(sid, start)
                except Exception:
                    log.exception("reporting the trim of stream %d failed", sid)
        return sorted(moved.items())

    # -- the background pass -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="range-server-maintenance",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No pass starts from now on (one under way finishes)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.apply()
            except Exception:
                log.exception("retention pass failed")
