"""Progress of a streaming read: how far behind each stream's end a micro-batch leaves it.

After sizing each micro-batch the reader knows, per stream, where the micro-batch ends, where
the stream ends, and (from two stored batches' envelope times) how many ms of records lie
between. ``lag_report`` turns that into the per-stream entries Spark shows as the source's
``latestOffset`` in the query progress (with, where they apply, the rewritten history the
query went on from and the stored batches the micro-batch skips); ``StreamLag.describe`` is
the same as a log line. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..decode import SkipTally
from .data_loss import Rewritten

# One stream's entry in the lag report: counts, and the rewritten history it went on from.
StreamReport = dict[str, int | dict[str, int]]

# Envelope times a reader remembers (by stream and offset) before it forgets them all.
MAX_STAMPS = 4096


@dataclass(frozen=True)
class StreamLag:
    """Where a stream's micro-batch ends (``end``), where the stream ends (``latest``), and
    the envelope time between the newest record and the first one not read (``ms_behind``)."""

    stream_id: int
    end: int
    latest: int
    ms_behind: int = 0

    @property
    def records_behind(self) -> int:
        return max(0, self.latest - self.end)

    def describe(self) -> str:
        """The lag as a log line."""
        return (f"sbp stream {self.stream_id}: micro-batch ends at offset {self.end}; latest "
                f"{self.latest}; {self.records_behind} records and {self.ms_behind} ms behind "
                "the newest record")


def lag_report(lags: Iterable[StreamLag], rewritten: Mapping[int, Rewritten],
               skipped: Mapping[int, SkipTally] | None = None
               ) -> dict[str, StreamReport] | None:
    """The progress entries of ``lags`` (None when there are none): per stream
    ``latestOffset``, ``recordsBehind`` and ``msBehindLatest``, plus ``historyRewritten`` for
    a stream in ``rewritten`` and, when ``skipped`` is given (skipIncompatibleBatches), the
    batches and records the micro-batch skips."""
    report: dict[str, StreamReport] = {}
    for lag in sorted(lags, key=lambda lag: lag.stream_id):
        entry: StreamReport = {"latestOffset": lag.latest, "recordsBehind": lag.records_behind,
                               "msBehindLatest": lag.ms_behind}
        if lag.stream_id in rewritten:
            entry["historyRewritten"] = rewritten[lag.stream_id]
        if skipped is not None:
            tally = skipped.get(lag.stream_id, SkipTally())
            entry.update(incompatibleBatchesSkipped=tally.batches,
                         incompatibleRecordsSkipped=tally.records)
        report[str(lag.stream_id)] = entry
    return report or None


def ms_between(newest_ms: int, position_ms: int) -> int:
    """Envelope time of the newest record minus that of the first record not read; never
    negative (writers' clocks may disagree)."""
    return max(0, newest_ms - position_ms)


def skip_warning(stream_id: int, span: str, tally: SkipTally) -> str:
    """The warning for the stored batches micro-batch ``span`` skips in a stream."""
    return (f"sbp stream {stream_id}: micro-batch {span} skips {tally.batches} stored batches "
            f"({tally.records} records) that do not fit the read schema "
            f"(skipIncompatibleBatches=true); the first: {tally.first_problem}")


class StampCache:
    """Envelope times by (stream, offset), so the lag of an idle query costs no FETCH per
    trigger; forgets everything once it holds more than ``MAX_STAMPS``."""

    def __init__(self) -> None:
        self._stamps: dict[tuple[int, int], int] = {}

    def get(self, stream_id: int, offset: int) -> int | None:
        return self._stamps.get((stream_id, offset))

    def put(self, stream_id: int, offset: int, stamp_ms: int) -> None:
        if len(self._stamps) > MAX_STAMPS:
            self._stamps.clear()
        self._stamps[(stream_id, offset)] = stamp_ms


__all__ = ["MAX_STAMPS", "StampCache", "StreamLag", "StreamReport", "lag_report", "ms_between",
           "skip_warning"]
