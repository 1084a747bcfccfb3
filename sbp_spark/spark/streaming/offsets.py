"""Streaming offsets as Spark checkpoints them: ``{"<stream_id>": next_offset, ...}``, plus
``"ranges": {"<stream_id>": range_index}``, the range that held the last record read of each
stream.

Spark stores the offsets of every micro-batch as JSON and decides whether there is new data by
comparing those JSON texts. So an offset must always serialise to the same text: string keys
(JSON has no others), sorted numerically (``"2"`` before ``"10"``), plain ``int`` values, and
nothing that changes while the position stays put (lag figures belong in
``reportLatestOffset``, never here). The range of the last record read is fixed by the
position, so it is safe here; it is what lets a restarted query notice that the range it read
was later sealed below where it had read (the epoch check of Kafka's leader epochs, or DCP's
failover log). Offsets checkpointed before ``"ranges"`` existed still load (without that
check).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from sbp_spark.spark.options import EARLIEST, LATEST, OffsetSpec

_STREAM_KEY = re.compile(r"\d+")
RANGES_KEY = "ranges"


class OffsetFormatError(ValueError):
    """An offset object that is not ``{"<stream_id>": offset, "ranges": {...}}``."""


def _checked(what: str, sid: int, value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OffsetFormatError(f"{what}: {name} of stream {sid} is {value!r}, not an int >= 0")
    return int(value)


def to_spark(offsets: Mapping[int, int], ranges: Mapping[int, int] | None = None
             ) -> dict[str, Any]:
    """The canonical JSON-safe form of ``offsets`` (numeric key order, plain ints), with the
    range of each stream's last read record where known (``ranges``)."""
    out: dict[str, Any] = {}
    for sid in sorted(int(s) for s in offsets):
        out[str(sid)] = _checked("offset", sid, offsets[sid], "offset")
    known = {sid: r for sid, r in (ranges or {}).items() if sid in offsets}
    if known:
        out[RANGES_KEY] = {str(sid): _checked("offset", sid, known[sid], "range")
                           for sid in sorted(known)}
    return out


def parse_spark(obj: Any, what: str = "offset") -> tuple[dict[int, int], dict[int, int]]:
    """Parse an offset Spark hands back (a dict, or its JSON text) into
    ``({stream_id: offset}, {stream_id: range of its last read record})``.

    ``what`` names the value in error messages (e.g. "start offset of batch 7").
    """
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as exc:
            raise OffsetFormatError(f"{what} {obj!r} is not JSON: {exc}") from None
    if not isinstance(obj, Mapping):
        raise OffsetFormatError(f"{what} {obj!r} is not an object {{\"<stream_id>\": offset}}")
    offsets: dict[int, int] = {}
    ranges: dict[int, int] = {}
    for key, value in obj.items():
        if key == RANGES_KEY and isinstance(value, Mapping):
            for sid, index in value.items():
                if not _STREAM_KEY.fullmatch(str(sid)):
                    raise OffsetFormatError(
                        f"{what} {dict(obj)!r}: key {sid!r} of {RANGES_KEY!r} is not a stream id")
                ranges[int(sid)] = _checked(f"{what} {dict(obj)!r}", int(sid), index, "range")
            continue
        if not _STREAM_KEY.fullmatch(str(key)):
            raise OffsetFormatError(f"{what} {dict(obj)!r}: key {key!r} is not a stream id")
        offsets[int(key)] = _checked(f"{what} {dict(obj)!r}", int(key), value, "offset")
    return offsets, {sid: r for sid, r in ranges.items() if sid in offsets}


def from_spark(obj: Any, what: str = "offset") -> dict[int, int]:
    """The ``{stream_id: offset}`` part of an offset Spark hands back (see ``parse_spark``)."""
    return parse_spark(obj, what)[0]


def resolve_starting(
    spec: OffsetSpec, streams: tuple[int, ...], bounds: Mapping[int, tuple[int, int]]
) -> dict[int, int]:
    """The first offsets of a new query.

    ``bounds[stream_id]`` is ``(start_offset, latest_offset)`` of the stream now. ``earliest``
    is the stream's start, ``latest`` its end; an explicit offset is taken as given (an offset
    below the start is data loss, found when the first micro-batch is planned), but one past
    the end of the stream is an error.
    """
    out: dict[int, int] = {}
    for sid in streams:
        start, latest = bounds[sid]
        wanted = spec.for_stream(sid)
        if wanted == EARLIEST:
            out[sid] = start
        elif wanted == LATEST:
            out[sid] = latest
        elif wanted > latest:
            raise ValueError(
                f"option 'startingOffsets' asks for offset {wanted} of stream {sid}, but the "
                f"stream ends at offset {latest} (its records are [{start}, {latest}))")
        else:
            out[sid] = wanted
    return out
