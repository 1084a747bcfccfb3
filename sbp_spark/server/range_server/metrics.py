"""The counters a range server reports to the PD (REPORT_METRICS) and exports to Prometheus
(``exported.py``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..latency import LatencyHistogram

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
        self.append_seconds = LatencyHistogram()  # APPEND received -> answered
        # Per stream: records and bytes of client batches stored here (the append rate).
        self.appended_records: dict[int, int] = {}
        self.appended_bytes: dict[int, int] = {}

    def stored(self, stream_id: int, records: int, size: int) -> None:
        """A client's batches of ``stream_id`` (``records`` records, ``size`` bytes) were
        stored here."""
        self.appended_records[stream_id] = self.appended_records.get(stream_id, 0) + records
        self.appended_bytes[stream_id] = self.appended_bytes.get(stream_id, 0) + size

    def touch(self, rlog: RangeLog) -> None:
        self.active[(rlog.stream_id, rlog.range_index)] = time.monotonic()

    def active_ranges(self, window_s: float = 60.0) -> int:
        cutoff = time.monotonic() - window_s
        return sum(1 for t in list(self.active.values()) if t >= cutoff)
