"""``spark.readStream.format("sbp")``: the micro-batch stream reader.

Offsets are ``{"<stream_id>": next_offset}`` (see ``offsets``): the micro-batch ``(start, end]``
reads records ``[start[s], end[s])`` of each stream ``s``. Everything a micro-batch reads is
fixed by those two offset objects, so Spark's replay of a micro-batch after a restart reads the
same records again.

Where each method runs (pyspark 4.x):

- ``initialOffset``, ``latestOffset``, ``partitions``, ``commit`` (and on pyspark 4.2+
  ``getDefaultReadLimit``, ``reportLatestOffset``, ``prepareForTriggerAvailableNow``) run in
  one long-lived driver-side Python process per query. They hand over to a
  ``MicroBatchPlanner`` (``planner``), which keeps what lives there between calls; none of it
  changes what a micro-batch reads.
- ``read`` runs on executors, on another instance made from the same options: it uses only the
  partition and those options (``sbp_spark.spark.reader.read_partition``, shared with batch
  reads).
- ``commit`` comes one micro-batch late and ``stop`` is not always called: nothing depends on
  them.

Which reader a query gets depends on the pyspark (``pyspark_api``): where it has admission
control (4.2+), ``admission.SbpStreamReader``, to which Spark passes each micro-batch's start
and read limit; before, ``SbpSelfLimitingStreamReader`` (here), to which Spark passes neither,
so it follows where micro-batches start itself and applies the limits the options configure
(as Spark's Kafka source did before admission control existed). Both build on
``reader_base.SbpStreamReaderBase``; ``stream_reader`` and ``refused_stream_reader`` pick the
class.

These classes are only what Spark sees; the rules live in plain modules: ``planner`` (sizing
and planning micro-batches over ``cluster_access.stream_layouts`` and
``planning.plan_partitions``), ``limits`` (admission control), ``data_loss`` (what a trimmed,
deleted or rewritten stream means), ``progress`` (lag reports) and ``long_poll`` (waiting at
the streams' tails).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from ..options import parse_stream_read_options
from ..pyspark_api import PysparkUnsupportedError, found
from ..reader import metadata_columns_of
from ..schemas import check_records_read_schema
from .data_loss import DataLossError
from .offsets import parse_spark
from .reader_base import RefusedStreamReader, SbpStreamReaderBase

# The Spark setting under which availableNow, on a pyspark without admission control, fixes
# its end by asking the source once before the query's start is known.
AVAILABLE_NOW_WRAPPER = "spark.sql.streaming.triggerAvailableNowWrapper.enabled"


class SbpSelfLimitingStreamReader(SbpStreamReaderBase):
    """The stream reader for a pyspark without admission control (4.0, 4.1).

    Spark calls ``latestOffset()`` with neither the micro-batch's start nor a read limit. The
    start is where the last micro-batch Spark planned ends: Spark plans each micro-batch
    (``partitions(start, end)``) before it asks for the next end, and on a restart it first
    plans the empty micro-batch at the checkpointed offsets (``setLatestSeenOffset``). The
    limits are the configured ones (``maxRecordsPerTrigger``, ``maxBytesPerTrigger``,
    ``minRecordsPerTrigger`` with ``maxTriggerDelay``), applied as on pyspark 4.2+.

    Spark asks for the first end before it says where a new query starts (it asks
    ``initialOffset`` right after); the reader then starts from its own initial offsets,
    which ``initialOffset`` returns too. The one other caller that asks first is availableNow's
    wrapper (``spark.sql.streaming.triggerAvailableNowWrapper.enabled``) on a restart, which
    fixes the run's end with that answer, given from the starting options instead of the
    checkpoint. Spark says where the query stands right after (``partitions(o, o)``), and the
    reader refuses the run there, before it reads, when that end does not follow from the
    checkpoint: with maxRecordsPerTrigger/maxBytesPerTrigger (it is the first micro-batch of a
    new query, not the next one), or lying before the checkpoint (a micro-batch backwards).
    Without those limits the end is where the streams ended at the start: the run reads
    everything up to it in one micro-batch.

    A micro-batch that the limits cut short is reported once with a warning (a one-time
    trigger on this pyspark runs only that micro-batch; docs/streaming.md).
    """

    def latestOffset(self) -> dict:  # type: ignore[override]  # pyspark 4.0/4.1's signature
        """The end of the next micro-batch, as far as the configured limits allow."""
        planner = self.state
        start = planner.next_start
        if start is None:
            start = planner.initial_offsets()
            end = planner.next_end(start, self.limits)
            planner.ended_before_start = end
        else:
            # Spark asks for the next end once the micro-batch that ended at start committed.
            planner.committed(start)
            end = planner.next_end(start, self.limits)
        if end != start:  # a micro-batch (not one minRecordsPerTrigger holds back)
            self._report_cut(end)
        return end

    def initialOffset(self) -> dict:
        # Spark starts a new query: an end given before was the first micro-batch's.
        self.state.started_new = True
        return super().initialOffset()

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        planner = self.state
        if (planner.next_start is None and planner.ended_before_start is not None
                and not planner.started_new and start == end):
            self._check_fixed_end(planner.ended_before_start, start)
        return planner.partitions(start, end)

    def _check_fixed_end(self, fixed: dict, standing: dict) -> None:
        """Refuse a restarted run whose end was fixed (``fixed``) before Spark said the query
        stands at ``standing``, when that end does not follow from ``standing``."""
        ends, _ = parse_spark(fixed, "end offset")
        starts, _ = parse_spark(standing, "start offset")
        behind = sorted((sid, ends[sid], at) for sid, at in starts.items()
                        if sid in ends and ends[sid] < at)
        limited = self.limits.max_records is not None or self.limits.max_bytes is not None
        if not behind and not limited:
            return
        why = ("from its starting options, with maxRecordsPerTrigger/maxBytesPerTrigger: the "
               "first micro-batch of a new query, not the next one from the checkpoint"
               if limited else "from its starting options")
        where = "; ".join(f"stream {sid}: end {end}, checkpoint {at}"
                          for sid, end, at in behind)
        raise PysparkUnsupportedError(
            f"format sbp cannot run this restarted availableNow query on "
            f"{found().describe()} with {AVAILABLE_NOW_WRAPPER}=true: the wrapper fixed the "
            "run's end by asking the source before Spark said where the query stands, so the "
            f"source answered {why} ({fixed}, checkpointed offsets {standing}"
            f"{'; behind them: ' + where if behind else ''}). Leave the wrapper off "
            "(availableNow then reads one micro-batch within the limits, going on from the "
            "checkpoint each run), or leave the limits out (a wrapped run then reads "
            "everything up to the end at its start), or use pyspark 4.2 or newer")

    def _report_cut(self, end: dict) -> None:
        """Warn once when the configured limits left records waiting after ``end``."""
        waiting = self.state.records_behind
        if not waiting or (self.limits.max_records is None and self.limits.max_bytes is None):
            return
        self.state.warn_once(
            ("cut short",), logging.WARNING,
            "sbp: %s has no admission control for Python streaming sources (pyspark 4.2 "
            "added it), so format sbp applies maxRecordsPerTrigger/maxBytesPerTrigger itself: "
            "this micro-batch reads up to %s and leaves %d records waiting. Under "
            "Trigger.Once or availableNow this pyspark runs one micro-batch, so they wait for "
            "the next run, which goes on from the checkpoint. To read everything in one run, "
            "leave the limits out, or use pyspark 4.2 or newer (docs/streaming.md, "
            "\"Triggers on each pyspark\")", found().describe(), end, waiting)


def refused_stream_reader(error: Exception) -> DataSourceStreamReader:
    """The reader that raises ``error`` at the query's first call (``RefusedStreamReader``),
    shaped as this pyspark's stream reader."""
    if found().admission_control:
        from .admission import RefusedAdmissionStreamReader

        return RefusedAdmissionStreamReader(error)
    return RefusedStreamReader(error)


def stream_reader(options: Mapping[str, str], schema: StructType,
                  data_columns: Sequence[str] | None = None,
                  case_folded: Sequence[str] = ()) -> SbpStreamReaderBase:
    """The stream reader of a query (``DataSource.streamReader``), options checked;
    ``data_columns`` as for a batch read (see ``metadata_columns_of``). Its kind follows the
    pyspark found (see the module docstring)."""
    parsed = parse_stream_read_options(options)
    if parsed.read.payload == "records":
        check_records_read_schema(schema)
    metadata = metadata_columns_of(schema, parsed.read.payload, data_columns)
    if found().admission_control:
        from .admission import SbpStreamReader

        return SbpStreamReader(parsed, schema, metadata, case_folded)
    return SbpSelfLimitingStreamReader(parsed, schema, metadata, case_folded)


__all__ = ["AVAILABLE_NOW_WRAPPER", "DataLossError", "RefusedStreamReader",
           "SbpSelfLimitingStreamReader", "SbpStreamReaderBase", "refused_stream_reader",
           "stream_reader"]
