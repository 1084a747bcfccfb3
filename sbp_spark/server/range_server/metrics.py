"""The counters a range server reports to the PD (REPORT_METRICS)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..storage.range_log import RangeLog


class Metrics:
    """Counters behind REPORT_METRICS (rates are computed by whoever samples them)."""

    def __init__(self) -> None:
        self.appends = 0
        self.failed_appends = 0
        # Idempotent resends answered with where the batch was stored before (not stored again).
        self.duplicate_appends = 0
        self.append_latency_s = 0.0
        self.fetches = 0
        self.failed_fetches = 0
        self.fetch_latency_s = 0.0
        self.active: dict[tuple[int, int], float] = {}  # range -> last use (monotonic)

    def touch(self, rlog: RangeLog) -> None:
        self.active[(rlog.stream_id, rlog.range_index)] = time.monotonic()

    def active_ranges(self, window_s: float = 60.0) -> int:
        cutoff = time.monotonic() - window_s
        return sum(1 for t in list(self.active.values()) if t >= cutoff)
