"""Streaming offsets as Spark checkpoints them: ``{"<stream_id>": next_offset}``.

Spark stores the offsets of every micro-batch as JSON and decides whether there is new data by
comparing those JSON texts. So an offset must always serialise to the same text: string keys
(JSON has no others), sorted numerically (``"2"`` before ``"10"``), plain ``int`` values, and
nothing else in it (lag figures belong in ``reportLatestOffset``, never here).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from sbp_spark.spark.options import EARLIEST, LATEST, OffsetSpec

_STREAM_KEY = re.compile(r"\d+")


class OffsetFormatError(ValueError):
    """An offset object that is not ``{"<stream_id>": offset}``."""


def to_spark(offsets: Mapping[int, int]) -> dict[str, int]:
    """The canonical JSON-safe form of ``offsets`` (numeric key order, plain ints)."""
    out: dict[str, int] = {}
    for sid in sorted(int(s) for s in offsets):
        value = offsets[sid]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OffsetFormatError(f"offset of stream {sid} is {value!r}: must be an int >= 0")
        out[str(sid)] = int(value)
    return out


def from_spark(obj: Any, what: str = "offset") -> dict[int, int]:
    """Parse an offset Spark hands back (a dict, or its JSON text) into ``{stream_id: offset}``.

    ``what`` names the value in error messages (e.g. "start offset of batch 7").
    """
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as exc:
            raise OffsetFormatError(f"{what} {obj!r} is not JSON: {exc}") from None
    if not isinstance(obj, Mapping):
        raise OffsetFormatError(f"{what} {obj!r} is not an object {{\"<stream_id>\": offset}}")
    out: dict[int, int] = {}
    for key, value in obj.items():
        if not _STREAM_KEY.fullmatch(str(key)):
            raise OffsetFormatError(f"{what} {dict(obj)!r}: key {key!r} is not a stream id")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OffsetFormatError(
                f"{what} {dict(obj)!r}: offset of stream {key} is {value!r}, not an int >= 0")
        out[int(key)] = value
    return out


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
