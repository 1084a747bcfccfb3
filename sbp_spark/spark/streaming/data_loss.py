"""Data-loss verdicts of a streaming read: what a trimmed, deleted or rewritten stream means.

A streaming query reads each stream from where its checkpointed offsets say. Four things can
make that impossible, and each is a ``Loss`` built here from what the reader found (no I/O):

- ``trimmed``: records the query still had to read were trimmed (or expired by retention);
- ``stream_lost``: the stream was deleted, or no longer exists;
- ``range_sealed_below`` / ``stream_ends_below_read``: records the query already read are no
  longer part of the stream (a range sealed below them, or the whole stream ending below
  them: a rewritten history);
- ``planned_end_cut``: a micro-batch was planned to read up to an offset that the stream (or
  the range that held its last record) no longer reaches.

``judge`` applies ``failOnDataLoss``: it raises ``DataLossError`` with the loss's message and
what to do, or returns the loss, whose ``warning`` and ``resume_at`` say how the read goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..planning import StreamLayout

# What a query reports in its progress for a stream it went on from a rewritten history.
Rewritten = dict[str, int]


class DataLossError(RuntimeError):
    """Records a streaming query still had to read are gone (trimmed, or the stream deleted),
    or records it already read are no longer part of the stream (history rewritten)."""


@dataclass(frozen=True)
class Loss:
    """One stream's data loss: what happened (``message``), the error under
    failOnDataLoss=true and the warning under false, and where the read goes on."""

    stream_id: int
    # What happened, naming the stream and the offsets.
    message: str
    # The start of the error: "data loss in", "history rewritten in" (the message follows).
    error_prefix: str
    # What the error advises, after the message.
    advice: str
    # How the warning ends: what the read does instead.
    going_on: str
    # Where the stream is read from (or up to) instead; None: the stream is dropped.
    resume_at: int | None
    # Warn once per distinct loss: the key that tells them apart.
    key: tuple
    # The progress entry of a rewritten history the query goes on from (else None).
    rewritten: Rewritten | None = field(default=None)

    def error(self) -> DataLossError:
        return DataLossError(f"{self.error_prefix} {self.message}. {self.advice}")

    @property
    def warning(self) -> str:
        return f"sbp data loss (failOnDataLoss=false): {self.message}; {self.going_on}"


def judge(loss: Loss, fail_on_data_loss: bool) -> Loss:
    """Raise ``loss``'s error under ``failOnDataLoss=true``; else return it (the caller warns
    with ``loss.warning`` and goes on as ``loss.resume_at`` says)."""
    if fail_on_data_loss:
        raise loss.error()
    return loss


def trimmed(stream_id: int, wanted: int, first: int) -> Loss:
    """Offsets ``[wanted, first)`` were trimmed before the query read them."""
    return Loss(
        stream_id,
        f"stream {stream_id}: offsets [{wanted}, {first}) were trimmed before the query read "
        f"them; the stream now starts at offset {first}",
        "data loss in",
        f"Set failOnDataLoss=false to skip the missing records and continue from offset "
        f"{first}.",
        "continuing from there", first, ("trim", stream_id, wanted, first))


def stream_lost(stream_id: int, wanted: int) -> Loss:
    """The stream is gone while the query still had to read it from ``wanted``."""
    return Loss(
        stream_id,
        f"stream {stream_id} was deleted (or no longer exists) while the query still had to "
        f"read it from offset {wanted}",
        "data loss:",
        "Set failOnDataLoss=false to drop the stream from the query and go on with the "
        "others.",
        "dropping it", None, ("lost", stream_id))


def _rewound(stream_id: int, position: int, range_index: int | None, back_to: int,
             message: str, seen: Rewritten) -> Loss:
    return Loss(
        stream_id, message, "history rewritten in",
        f"Set failOnDataLoss=false to go on from offset {back_to}, reading the records that "
        "stand there now.",
        f"going on from offset {back_to}", back_to, ("rewound", stream_id, range_index, position),
        {**seen, "hadReadTo": position})


def range_sealed_below(stream_id: int, position: int, range_index: int | None,
                       layout: StreamLayout) -> Loss | None:
    """The query read the stream up to ``position``, its last record in range
    ``range_index``: a loss when ``layout`` shows that range sealed below ``position``."""
    rng = next((r for r in layout.ranges if r.range_index == range_index), None)
    if rng is None or rng.is_open or rng.end_offset >= position:
        return None
    back_to = rng.end_offset
    return _rewound(
        stream_id, position, range_index, back_to,
        f"stream {stream_id}: range {range_index} was sealed at offset {back_to}, but this "
        f"query had already read it up to offset {position}; the records [{back_to}, "
        f"{position}) it read are not part of the stream any more (the range's history was "
        "rewritten, e.g. by a failover that ended it below them)",
        {"range": rng.range_index, "sealedAt": back_to})


def needs_stream_end(layout: StreamLayout, position: int) -> bool:
    """Whether the stream's authoritative end decides if reading up to ``position`` lost
    records: ``layout`` (perhaps a secondary's word) ends below it."""
    return layout.end_offset < position


def stream_ends_below_read(stream_id: int, position: int, range_index: int | None,
                           end: int | None) -> Loss | None:
    """The query read the stream up to ``position``: a loss when the stream's authoritative
    ``end`` (None: not known) is below it.

    No range says so (an open range, or offsets checkpointed without ranges), but without
    this the query would wait for the stream to pass ``position``, then skip the records
    below it. Only the primary's word counts for ``end``: a secondary may not know yet how
    far the query read."""
    if end is None or end >= position:
        return None
    return _rewound(
        stream_id, position, range_index, end,
        f"stream {stream_id}: it now ends at offset {end}, but this query had already read it "
        f"up to offset {position}; the records [{end}, {position}) it read are not part of the "
        "stream any more (were they lost, or the stream made anew, e.g. on a rebuilt "
        "cluster?)",
        {"endsAt": end})


def planned_end_cut(stream_id: int, planned_end: int, end: int, what: str) -> Loss:
    """``what`` (the range that held the last record of the micro-batch as it was planned,
    perhaps before a restart, or the whole stream) now ends at ``end``, below the planned end:
    below records the query saw. Read up to ``end``; the next micro-batch goes on from
    there."""
    return Loss(
        stream_id,
        f"stream {stream_id}: this micro-batch was planned to read up to offset {planned_end}, "
        f"but {what} now ends at offset {end}; the records [{end}, {planned_end}) it was "
        "planned with are not part of the stream any more (its history was rewritten: a "
        "failover that ended a range below them, records lost, or the stream made anew)",
        "history rewritten in",
        "Set failOnDataLoss=false to read only what the stream holds.",
        f"reading up to offset {end}", end, ("ends below", stream_id, planned_end, end))


def sealed_end(layout: StreamLayout, range_index: int | None) -> int | None:
    """Where range ``range_index`` was sealed (None: still open, or not known). Only a seal
    is authoritative: an open range's end is a snapshot, which a secondary may give lower
    than what the primary acknowledged."""
    rng = next((r for r in layout.ranges if r.range_index == range_index), None)
    return None if rng is None or rng.is_open else rng.end_offset


__all__ = ["DataLossError", "Loss", "judge", "needs_stream_end", "planned_end_cut",
           "range_sealed_below", "sealed_end", "stream_ends_below_read", "stream_lost",
           "trimmed"]
