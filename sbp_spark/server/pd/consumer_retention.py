"""Retention that waits for named consumers, at the PD: how far a trim of a stream may go.

A stream with ``retain_for_consumers`` keeps the records its consumers have not read: a
TRIM_STREAMS (an operator's, or a range server reporting its retention pass) stops at the
lowest position the stream's consumers committed, unless the records there are older than the
stream's ``retain_cap_ms``: then the trim goes up to the first record within the cap, and the
consumers below it have lost data (their position below the stream's start; ``sbp consumers``
and the metrics say so). The byte cap needs the bytes on disk, which range servers apply in
their retention pass (``storage.range_log.ConsumerHold``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .consumers import ConsumerStore, lowest_positions
from .meta import StreamMeta, now_ms

log = logging.getLogger(__name__)


class ConsumerFloor:
    """The lowest consumer positions of streams, from ``consumers``; ``offset_for_time(stream,
    ms)`` is the first offset of the stream whose record is at or after ``ms`` (None: none
    is); ``retained_start(stream)`` the first offset its replicas still hold (None: unknown)."""

    def __init__(self, consumers: ConsumerStore,
                 offset_for_time: Callable[[int, int], int | None],
                 retained_start: Callable[[int], int | None],
                 clock: Callable[[], int] = now_ms) -> None:
        self._consumers = consumers
        self._offset_for_time = offset_for_time
        self._retained_start = retained_start
        self._clock = clock

    def low_offset(self, stream_id: int) -> int | None:
        """The lowest position the stream's consumers committed (None: none did)."""
        return lowest_positions(self._consumers.list_all(), stream_id)

    def allowed(self, stream: StreamMeta, trim_offset: int) -> int:
        """How far a trim of ``stream`` asked to go to ``trim_offset`` may go."""
        if not stream.retain_for_consumers:
            return trim_offset
        low = self.low_offset(stream.stream_id)
        if low is None or trim_offset <= low:
            return trim_offset
        bound = low
        if stream.retain_cap_ms > 0:
            within = self._offset_for_time(stream.stream_id, self._clock() - stream.retain_cap_ms)
            bound = max(low, trim_offset if within is None else min(within, trim_offset))
        if bound < trim_offset and stream.retain_cap_bytes > 0:
            held = self._retained_start(stream.stream_id)
            if held is not None and held > bound:  # a pass already dropped them (byte cap)
                bound = min(held, trim_offset)
        if bound < trim_offset:
            log.info("stream %d: trim to %d held at %d for its consumers (lowest position %d)",
                     stream.stream_id, trim_offset, bound, low)
        else:
            log.warning("stream %d: trim to %d passes its consumers' lowest position %d: "
                        "those records are past its caps (retain_cap_ms=%d, retain_cap_bytes=%d)",
                        stream.stream_id, trim_offset, low, stream.retain_cap_ms,
                        stream.retain_cap_bytes)
        return bound
