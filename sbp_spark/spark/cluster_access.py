"""Everything the connector asks of an SBP cluster, in one place, through ``sbp_spark.client``.

Clients are cached per Python process (Spark reuses its Python workers between tasks, so the
connections of one task serve the next) and closed when the worker exits.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Generator, Mapping, Sequence
from contextlib import closing
from typing import TYPE_CHECKING

from sbp_spark.client import FetchedBatch, SbpClient, known_range
from sbp_spark.protocol.errors import OffsetOutOfRangeError, SbpError, StreamNotFoundError

from .options import ClientOptions
from .planning import RangeLayout, ReplicaLocation, SbpPartition, StreamLayout

if TYPE_CHECKING:  # what the client returns; this layer reads these, never builds them
    from sbp_spark.protocol.messages import Range

log = logging.getLogger(__name__)

_lock = threading.Lock()
_clients: dict[ClientOptions, SbpClient] = {}


def get_client(options: ClientOptions) -> SbpClient:
    """The process's client for these options (made on first use)."""
    with _lock:
        client = _clients.get(options)
        if client is None:
            client = SbpClient(list(options.pd), options.client_config())
            _clients[options] = client
        return client


def close_clients() -> None:
    """Close every cached client (at interpreter exit, and in tests)."""
    with _lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        client.close()


atexit.register(close_clients)


class StreamMissingError(ValueError):
    """A stream the query names does not exist."""


class RangeUnavailableError(RuntimeError):
    """No range server holding a range answered."""


def describe_replicas(replicas: Sequence[ReplicaLocation]) -> str:
    """``host:port (primary), host:port`` for messages."""
    return ", ".join(f"{r.address}{' (primary)' if r.is_primary else ''}"
                     for r in replicas) or "none"


def _replicas(rng: Range) -> tuple[ReplicaLocation, ...]:
    replicas = [ReplicaLocation(r.server.server_id, r.server.advertise_addr, r.is_primary)
                for r in rng.servers]
    replicas.sort(key=lambda r: not r.is_primary)  # primary first
    return tuple(replicas)


def check_streams_exist(client: SbpClient, stream_ids: Sequence[int], pd: Sequence[str]) -> None:
    """Raise ``StreamMissingError`` naming every stream in ``stream_ids`` that does not exist."""
    missing = []
    for sid in stream_ids:
        try:
            client.describe_streams([sid])
        except StreamNotFoundError:
            missing.append(sid)
    if missing:
        names = ", ".join(str(s) for s in missing)
        raise StreamMissingError(
            f"stream{'s' if len(missing) > 1 else ''} {names} "
            f"do{'' if len(missing) > 1 else 'es'} not exist at pd {','.join(pd)} "
            "(create streams with `sbp streams create`)")


def stream_layouts(client: SbpClient, stream_ids: Sequence[int], pd: Sequence[str],
                   read_ends: Mapping[int, int] | None = None) -> list[StreamLayout]:
    """Each stream's ranges now; the open range's end is a snapshot of its next_offset.

    ``read_ends`` (stream id -> offset) are the ends of a read that names them: a stream
    read only up to an offset at or below its open range's start does not need that range,
    so when none of its servers answers, its layout ends there (with a warning) instead of
    failing; reading history needs only the servers that hold it."""
    try:
        streams = client.describe_streams(list(stream_ids))
    except StreamNotFoundError:
        check_streams_exist(client, stream_ids, pd)
        raise
    layouts = []
    for stream in streams:
        ranges = sorted(client.list_ranges(stream.stream_id), key=lambda r: r.range_index)
        out = []
        for rng in ranges:
            replicas = _replicas(rng)
            if rng.end_offset >= 0:
                end, is_open = rng.end_offset, False
            else:
                try:
                    end, is_open = client.open_range_end(rng), True
                except SbpError as exc:
                    read_end = (read_ends or {}).get(stream.stream_id)
                    if read_end is not None and 0 <= read_end <= rng.start_offset:
                        log.warning(
                            "stream %d: none of the range servers of its open range %d "
                            "answered (%s: %s); the read ends at offset %d, before that "
                            "range, so it goes on without it", stream.stream_id,
                            rng.range_index, describe_replicas(replicas), exc, read_end)
                        out.append(RangeLayout(rng.range_index, rng.start_offset,
                                               rng.start_offset, replicas, True))
                        continue
                    raise RangeUnavailableError(
                        f"cannot learn where the open range {rng.range_index} of stream "
                        f"{stream.stream_id} ends: none of its range servers answered "
                        f"({describe_replicas(replicas)}): {type(exc).__name__}: {exc}"
                    ) from exc
            out.append(RangeLayout(rng.range_index, rng.start_offset, end, replicas, is_open))
        start = max([stream.start_offset] + [r.start_offset for r in out[:1]])
        layouts.append(StreamLayout(stream.stream_id, start, tuple(out)))
    return layouts


def authoritative_end(client: SbpClient, layout: StreamLayout, needed: int) -> int | None:
    """Where the stream ends as only its authority can say, asked because ``layout`` ends
    below ``needed`` (an offset the query read or planned to): the end of a sealed last range,
    or the open range's next offset from its primary. None when that is not known: the primary
    does not answer (``stream_layouts`` then settled for what a secondary vouches for, which
    may lag what the primary acknowledged), or it shows less than ``needed`` but still stores
    that far.

    A primary's next offset is how far its readers may see. A primary that restarted starts
    with the open range capped at its start, below records readers saw before, until every
    secondary said it holds them too (cap_notices.py); its FETCH still takes an offset it
    stores. So an end below ``needed`` counts only when the primary refuses a FETCH at
    ``needed`` (OFFSET_OUT_OF_RANGE): it does not hold those records (a rebuilt cluster)."""
    tail = layout.ranges[-1] if layout.ranges else None
    if tail is None or not tail.is_open:
        return layout.end_offset
    primary = next((r for r in tail.replicas if r.is_primary), None)
    if primary is None:
        return None
    server = client.range_server(primary.address)
    try:
        (result,) = server.describe_ranges([(layout.stream_id, tail.range_index)])
        described = result.unwrap()
    except SbpError:
        return None
    if described is None:
        return None
    end = described.next_offset if described.is_open else described.end_offset
    if not described.is_open or end >= needed:
        return end
    try:
        with closing(server.fetch(layout.stream_id, needed, batch_max_bytes=1)) as batches:
            next(batches, None)
    except OffsetOutOfRangeError:
        return end
    except SbpError:
        return None
    log.info("sbp: stream %d: the primary of its open range %d shows records up to offset %d "
             "only, but stores them up to %d (it restarted and has not heard from every "
             "secondary yet); waiting for it", layout.stream_id, tail.range_index, end, needed)
    return None


def replica_start(client: SbpClient, partition: SbpPartition) -> int | None:
    """The first offset of ``partition``'s range still stored on its replicas (the highest any
    of them reports), or None when none answers."""
    return client.retained_start(partition.stream_id, partition.range_index,
                                 [replica.address for replica in partition.replicas])


def layout_ranges(layout: StreamLayout) -> list[Range]:
    """The client's description of a stream's ranges as planned (an open range's
    ``next_offset`` is the planned end)."""
    return [known_range(layout.stream_id, r.range_index, r.replicas, r.start_offset,
                        r.end_offset, r.is_open) for r in layout.ranges]


def fetch(client: SbpClient, partition: SbpPartition, start: int, max_bytes: int,
          max_wait_ms: int) -> Generator[FetchedBatch, None, None]:
    """The stored batches of ``partition`` from ``start`` (one streaming FETCH, from the
    replicas the plan names: no PD round trip)."""
    return client.fetch_from_replicas(
        partition.stream_id, partition.range_index, partition.replicas, start,
        partition.end_offset, sealed_end=-1 if partition.range_is_open else partition.range_end,
        max_bytes=max_bytes, max_wait_ms=max_wait_ms)


def batch_at(client: SbpClient, layout: StreamLayout, offset: int) -> FetchedBatch | None:
    """The stored batch holding ``offset`` of the stream (one small FETCH), or None when no
    range of ``layout`` holds it."""
    for rng in layout.ranges:
        if max(rng.start_offset, layout.start_offset) <= offset < rng.end_offset:
            part = SbpPartition(layout.stream_id, rng.range_index, offset, offset + 1,
                                rng.start_offset, rng.end_offset, rng.replicas, rng.is_open)
            with closing(fetch(client, part, offset, 1, 0)) as batches:
                for batch in batches:
                    return batch
    return None


def filled_ranges(layout: StreamLayout) -> list[tuple[int, int]]:
    """[first, end) offsets of each range of ``layout`` that still holds records, in order."""
    out = []
    for rng in layout.ranges:
        first = max(rng.start_offset, layout.start_offset)
        if rng.end_offset > first:
            out.append((first, rng.end_offset))
    return out


def last_batch(client: SbpClient, layout: StreamLayout) -> FetchedBatch | None:
    """The newest stored batch of a stream (the one holding the offset before the end of its
    last range with records), or None when it holds no records."""
    filled = filled_ranges(layout)
    return batch_at(client, layout, filled[-1][1] - 1) if filled else None


__all__ = ["RangeUnavailableError", "StreamMissingError", "batch_at", "check_streams_exist",
           "close_clients", "describe_replicas", "fetch", "filled_ranges",
           "get_client", "last_batch", "layout_ranges", "replica_start", "stream_layouts"]
