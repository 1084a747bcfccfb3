"""Admission control: how far one micro-batch may read in each stream.

Spark (pyspark 4.2+) hands ``latestOffset(start, limit)`` one ``ReadLimit``; pyspark has no
composite limit, so the source keeps the whole configuration itself (``TriggerLimits``) and
applies every configured bound, as Spark's Kafka source does (``admission`` maps Spark's read
limits to these; before pyspark 4.2 Spark passes none, and the configured bounds apply alone):

- ``maxRecordsPerTrigger``: the records one micro-batch may read, shared by all streams in
  proportion to their backlog (``apportion``).
- ``maxBytesPerTrigger``: the same for bytes. Offsets count records, not bytes, so bytes are
  estimated per stream as ``records x bytes_per_record``; the reader measures
  ``bytes_per_record`` from the stored batches at each stream's start offset
  (``batch_length / record_count`` of those batches, envelope included). A micro-batch always
  admits at least one record, even if that record alone is larger than the limit.
- ``minRecordsPerTrigger`` with ``maxTriggerDelay``: skip the micro-batch (return the start
  offsets) until that many records wait or the delay since the last admitted micro-batch has
  passed (``TriggerDelay``).

Everything here is pure: no I/O, no Spark session; the clock is injectable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from sbp_spark.spark.options import StreamReadOptions


@dataclass(frozen=True)
class TriggerLimits:
    """Every admission bound of one micro-batch; ``None`` means unbounded."""

    max_records: int | None = None
    max_bytes: int | None = None
    min_records: int | None = None
    max_trigger_delay_ms: int = 15 * 60_000

    def __post_init__(self) -> None:
        for name in ("max_records", "max_bytes", "min_records"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"TriggerLimits.{name}={value!r}: must be None or an int >= 1")
        if self.max_trigger_delay_ms < 0:
            raise ValueError(
                f"TriggerLimits.max_trigger_delay_ms={self.max_trigger_delay_ms}: must be >= 0")

    @classmethod
    def from_options(cls, options: StreamReadOptions) -> TriggerLimits:
        """The limits a streaming read's options configure."""
        return cls(max_records=options.max_records_per_trigger,
                   max_bytes=options.max_bytes_per_trigger,
                   min_records=options.min_records_per_trigger,
                   max_trigger_delay_ms=options.max_trigger_delay_ms)

    @property
    def unbounded(self) -> bool:
        return self.max_records is None and self.max_bytes is None and self.min_records is None


def apportion(budget: int, weights: Mapping[int, int]) -> dict[int, int]:
    """Split ``budget`` units over streams in proportion to ``weights`` (their backlogs).

    Never gives a stream more than its weight, never more than ``budget`` in total, and gives
    all of every weight when they fit. Rounding leftovers go to the largest fractional shares
    (ties: lower stream id). Like Spark's Kafka source it does not starve small backlogs: each
    stream with a backlog gets at least one unit, taken from the largest shares, as long as the
    budget has one unit per such stream; a smaller budget goes one unit each to the largest
    backlogs.
    """
    if budget < 0:
        raise ValueError(f"budget {budget} must be >= 0")
    weights = {sid: max(0, int(w)) for sid, w in weights.items()}
    total = sum(weights.values())
    if total <= budget:
        return dict(weights)
    positive = sorted((sid for sid, w in weights.items() if w > 0),
                      key=lambda sid: (-weights[sid], sid))
    shares = {sid: 0 for sid in weights}
    if budget < len(positive):
        for sid in positive[:budget]:
            shares[sid] = 1
        return shares
    for sid in positive:
        shares[sid] = budget * weights[sid] // total
    leftover = budget - sum(shares.values())
    by_fraction = sorted(positive, key=lambda sid: (-(budget * weights[sid] % total), sid))
    for sid in by_fraction[:leftover]:
        shares[sid] += 1
    for sid in positive:
        if shares[sid] == 0:
            donor = max(positive, key=lambda d: (shares[d], -d))
            shares[donor] -= 1
            shares[sid] = 1
    return shares


def admit(
    start: Mapping[int, int],
    latest: Mapping[int, int],
    limits: TriggerLimits,
    bytes_per_record: Mapping[int, float | Fraction] | None = None,
) -> dict[int, int]:
    """The end offsets of a micro-batch from ``start`` towards ``latest`` under ``limits``.

    ``limits.min_records`` is not looked at here (see ``TriggerDelay``). Streams missing from
    ``latest`` keep their start. ``bytes_per_record`` (needed with ``max_bytes``) estimates each
    stream's stored bytes per record; a stream without an estimate counts one byte per record.
    """
    backlog = {sid: max(0, latest.get(sid, off) - off) for sid, off in start.items()}
    take = dict(backlog)
    if limits.max_records is not None:
        take = _min_each(take, apportion(limits.max_records, backlog))
    if limits.max_bytes is not None:
        take = _min_each(take, _records_within_bytes(limits.max_bytes, backlog,
                                                     bytes_per_record or {}))
    return {sid: off + take[sid] for sid, off in start.items()}


def _min_each(a: Mapping[int, int], b: Mapping[int, int]) -> dict[int, int]:
    return {sid: min(a[sid], b.get(sid, 0)) for sid in a}


def _records_within_bytes(
    max_bytes: int, backlog: Mapping[int, int],
    bytes_per_record: Mapping[int, float | Fraction],
) -> dict[int, int]:
    """Records per stream whose estimated size fits ``max_bytes``, shared by byte backlog."""
    # Exact fractions: a budget of exactly k records' bytes must admit k records.
    size = {sid: max(Fraction(1), Fraction(bytes_per_record.get(sid, 1)))
            for sid in backlog}
    byte_backlog = {sid: math.ceil(n * size[sid]) for sid, n in backlog.items()}
    budgets = apportion(max_bytes, byte_backlog)
    records = {sid: min(backlog[sid], math.floor(budgets[sid] / size[sid])) for sid in backlog}
    if sum(records.values()) == 0 and any(backlog.values()):
        # A record larger than the whole budget must still pass, or the query stalls forever.
        first = max((sid for sid in backlog if backlog[sid] > 0),
                    key=lambda sid: (budgets[sid], -sid))
        records[first] = 1
    return records


class TriggerDelay:
    """``minRecordsPerTrigger`` with ``maxTriggerDelay``, decided on the driver.

    ``should_wait`` says whether to skip this trigger: fewer than ``min_records`` records wait
    and ``max_delay_ms`` has not passed since the last admitted micro-batch. The first call
    never waits (as in Spark's Kafka source, a query admits what is there when it starts).
    The state lives in the long-lived driver-side reader and is lost on restart, which only
    affects when a micro-batch runs, never which records it holds.
    """

    def __init__(self, clock_ms: Callable[[], float] | None = None) -> None:
        self._clock_ms = clock_ms or (lambda: time.monotonic() * 1000.0)
        self._last_trigger_ms: float | None = None

    def should_wait(self, backlog: int, min_records: int | None, max_delay_ms: int) -> bool:
        """True to skip this trigger; False admits it (and restarts the delay)."""
        now = self._clock_ms()
        if min_records is None or backlog <= 0:
            if backlog > 0 or self._last_trigger_ms is None:
                # The first trigger starts the clock even with nothing to admit: records
                # arriving later are not what was there when the query started.
                self._last_trigger_ms = now
            return False
        if self._last_trigger_ms is None or backlog >= min_records or (
                now - self._last_trigger_ms >= max_delay_ms):
            self._last_trigger_ms = now
            return False
        return True

    def remaining_ms(self, max_delay_ms: int) -> float:
        """Time left until the delay forces a micro-batch (0 when it already would)."""
        if self._last_trigger_ms is None:
            return 0.0
        return max(0.0, self._last_trigger_ms + max_delay_ms - self._clock_ms())
