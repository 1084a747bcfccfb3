"""Latency histograms counted on hot paths (appends, fsyncs) without a metrics library: fixed
buckets and plain counters, read by the metrics exporter (``metrics_http.py``) when scraped."""

from __future__ import annotations

import bisect
import threading

# Upper bounds (seconds) of the buckets: from a quarter millisecond (an append acknowledged
# from the page cache) to ten seconds (an fsync on a disk in trouble).
LATENCY_BUCKETS_S = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                     0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    """Counts of observed durations per bucket (``LATENCY_BUCKETS_S``, then +Inf) and their
    sum; safe from any thread."""

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        at = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        with self._lock:
            self._counts[at] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """(cumulative count per upper bound, "+Inf" last; the sum of the durations), the
        form Prometheus histograms take."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for bound, count in zip([*map(str, LATENCY_BUCKETS_S), "+Inf"], counts, strict=True):
            running += count
            out.append((bound, running))
        return out, total
