"""``startingOffsets=committed``: a read that starts where a named consumer's record stands.

The positions come from the cluster's record of option ``consumer`` (the PD's named consumers),
read once when the read is planned (a batch read) or when a new streaming query fixes its first
offsets; a stream the record does not name starts at ``committedFallback``. The result is an
ordinary ``startingOffsets`` of offsets per stream, so the rules for offsets (trimmed away:
data loss; past the end: refused) apply unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from sbp_spark.client.types import ItemResult
from sbp_spark.protocol.errors import ErrorCode

from .options import COMMITTED, OffsetSpec, ReadOptions

if TYPE_CHECKING:
    from sbp_spark.protocol.messages import Consumer

log = logging.getLogger(__name__)


class ConsumerRecords(Protocol):
    """What the read asks of the cluster (``SbpClient.consumers``)."""

    def describe(self, names: Sequence[str]) -> list[ItemResult[Consumer]]: ...


def recorded_positions(records: ConsumerRecords, name: str) -> dict[int, int]:
    """The positions the consumer ``name`` recorded, by stream id ({} when it has no
    record)."""
    [result] = records.describe([name])
    if result.status.code == ErrorCode.INVALID_REQUEST and result.error is None:
        return {}  # the name is valid (the options checked it): the PD has no such consumer
    consumer = result.unwrap()
    return {p.stream_id: p.committed_offset for p in consumer.positions}


def resolve_committed(records: ConsumerRecords, options: ReadOptions) -> ReadOptions:
    """``options`` with startingOffsets=committed turned into the consumer's positions for
    the streams read (``options.streams``, already resolved), the others at the fallback;
    unchanged for any other startingOffsets."""
    if options.starting.default != COMMITTED:
        return options
    assert options.consumer is not None  # the options refuse committed without a consumer
    positions = recorded_positions(records, options.consumer)
    found = tuple((sid, positions[sid]) for sid in sorted(options.streams) if sid in positions)
    missing = [sid for sid in options.streams if sid not in positions]
    log.info("sbp: consumer %r recorded %s; %s", options.consumer, dict(found) or "nothing",
             f"streams {missing} start at committedFallback" if missing else
             "every stream read starts there")
    return replace(options, starting=OffsetSpec(options.committed_fallback, found))
