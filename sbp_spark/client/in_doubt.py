"""Across a seal-and-new: which of a writer's batches in doubt the sealed range holds.

A batch sent to a range whose answer was lost is *in doubt*. While the range is open, sending it
again under the same sequence is safe (the range stores it once). Once the range is sealed (a
failover, a writer's seal) the batch goes to the next range, which knows nothing of it; so
before that the writer asks the sealed range's replicas (LOOKUP_SEQUENCES) which of its
sequences the range holds for good. Those are stored: their place is where the sealed range
holds them. The others are known not to be in it and are sent to the next range as new
batches. When no replica can tell (all unreachable, or none knows the producer any more) the
batches are sent again all the same: at least once, as without idempotence, and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from sbp_spark.protocol.errors import SbpError, SequencePendingError
from sbp_spark.protocol.messages import Range, RangeId

log = logging.getLogger(__name__)


class SequenceLookup(Protocol):
    """A replica of a sealed range, as the check asks it (``RangeServerClient``)."""

    def lookup_sequences(self, rid: RangeId, producer_id: int, sequences: Sequence[int]
                         ) -> list[int]: ...


def held_in_sealed_range(rng: Range, producer_id: int, sequences: Sequence[int],
                         replica: Callable[[str], SequenceLookup]) -> dict[int, int] | None:
    """For each of ``sequences``: the base offset at which the sealed ``rng`` holds that
    batch of ``producer_id``, or -1 when it does not; None when no replica could tell.

    Raises ``SequencePendingError`` (retriable) when the replicas that answered all said the
    range's end is not settled yet: the writer tries again shortly."""
    rid = RangeId(rng.stream_id, rng.range_index)
    pending: SbpError | None = None
    failures: list[str] = []
    # The secondaries first: a range is sealed under a writer mostly because its primary
    # could not be reached (dead, or cut off from the writer), and a question to it would
    # wait out the call's timeout before the next replica is asked. Every replica the seal
    # heard from holds the range to its end.
    for server in sorted(rng.servers, key=lambda replica: replica.is_primary):
        address = server.server.advertise_addr
        if not address:
            continue
        try:
            offsets = replica(address).lookup_sequences(rid, producer_id, sequences)
        except SequencePendingError as exc:
            pending = exc
            continue
        except SbpError as exc:  # unreachable, or it no longer knows: ask the next
            failures.append(f"{address}: {exc}")
            continue
        return dict(zip(sequences, offsets, strict=True))
    if pending is not None:
        raise pending
    log.warning("range %d/%d: no replica could say which of producer %#x's batches in doubt "
                "it holds (%s); they are sent to the next range again and may be stored twice",
                rng.stream_id, rng.range_index, producer_id, "; ".join(failures) or "none")
    return None
