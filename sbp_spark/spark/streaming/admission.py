"""The stream reader for a pyspark with admission control (4.2 and later; ``pyspark_api``).

Spark passes ``latestOffset(start, limit)`` each micro-batch's start and one ``ReadLimit``;
pyspark has no composite limit, so the source keeps the whole configuration itself
(``limits.TriggerLimits``) and tells Spark the one limit it can carry
(``default_read_limit``), restoring the others when Spark passes it back (``limits_for``).
Spark asks ``prepareForTriggerAvailableNow`` to fix an availableNow run's end, and shows
``reportLatestOffset`` (the lag report) in the query's progress.

A module of its own because its base classes and read limits exist only on such a pyspark:
``reader.stream_reader`` imports it only when ``pyspark_api.found().admission_control``
says so.
"""

from __future__ import annotations

from dataclasses import replace

from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)

from .limits import TriggerLimits
from .reader_base import RefusedStreamReader, SbpStreamReaderBase


def default_read_limit(limits: TriggerLimits) -> ReadLimit:
    """The one ``ReadLimit`` Spark can carry for ``limits``.

    With several bounds configured, the maximum ones win the slot (they are what Spark
    shows); ``limits_for`` restores the others when Spark passes it back.
    """
    if limits.max_records is not None:
        return ReadMaxRows(limits.max_records)
    if limits.max_bytes is not None:
        return ReadMaxBytes(limits.max_bytes)
    if limits.min_records is not None:
        return ReadMinRows(limits.min_records)
    return ReadAllAvailable()


def limits_for(limits: TriggerLimits, limit: ReadLimit) -> TriggerLimits:
    """The bounds to apply when Spark passes ``limit`` to ``latestOffset``.

    ``ReadAllAvailable`` (a one-time trigger) ignores the configured bounds; any other limit
    is applied on top of the configured ones (the tighter value wins).
    """
    if isinstance(limit, ReadAllAvailable):
        return TriggerLimits(max_trigger_delay_ms=limits.max_trigger_delay_ms)
    if isinstance(limit, ReadMaxRows):
        return replace(limits, max_records=_tighter(limits.max_records, int(limit.max_rows)))
    if isinstance(limit, ReadMaxBytes):
        return replace(limits, max_bytes=_tighter(limits.max_bytes, int(limit.max_bytes)))
    if isinstance(limit, ReadMinRows):
        return replace(limits, min_records=max(limits.min_records or 0, int(limit.min_rows)))
    raise ValueError(
        f"read limit {limit!r} is not supported by format sbp: it understands "
        "ReadAllAvailable, ReadMaxRows, ReadMaxBytes and ReadMinRows")


def _tighter(configured: int | None, given: int) -> int:
    return given if configured is None else min(configured, given)


class SbpStreamReader(SbpStreamReaderBase, SupportsTriggerAvailableNow):
    """Micro-batch reads of SBP streams with admission control and data-loss checks."""

    def getDefaultReadLimit(self) -> ReadLimit:
        return default_read_limit(self.limits)

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the end of an availableNow run: what the streams hold now."""
        self.state.fix_target()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """The end of the next micro-batch: as far as ``limit`` (and the options) allow."""
        # ``start`` is where the last committed micro-batch ended (or the first offsets).
        self.state.committed(start)
        return self.state.next_end(start, limits_for(self.limits, limit))

    def reportLatestOffset(self) -> dict | None:
        """Per stream: the true latest offset, records behind it and ms behind the newest
        record, as of the last ``latestOffset`` (shown by Spark as ``latestOffset``); with
        skipIncompatibleBatches, also the stored batches (and records) the planned
        micro-batch skips."""
        return self.state.report


class RefusedAdmissionStreamReader(RefusedStreamReader, SupportsTriggerAvailableNow):
    """``RefusedStreamReader`` shaped as ``SbpStreamReader``."""

    def getDefaultReadLimit(self) -> ReadLimit:
        return self._refuse()

    def prepareForTriggerAvailableNow(self) -> None:
        self._refuse()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:  # type: ignore[override]
        return self._refuse()


__all__ = ["RefusedAdmissionStreamReader", "SbpStreamReader", "default_read_limit",
           "limits_for"]
