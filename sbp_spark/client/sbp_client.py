"""``SbpClient``, the stream-level API the connector and the CLI use: streams, ranges, reads
and writes.

``SbpClient`` hides placement: it asks the PD where ranges live, reads from a range's primary
(falling back to its replicas), and writes to the primary of the stream's open range,
following seals to the next range.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import replace

from sbp_spark.protocol.errors import (
    RangeNotFoundError,
    SbpError,
)
from sbp_spark.protocol.messages import Range, Stream
from sbp_spark.protocol.names import check_name, parse_stream_ref

from ._calls import unwrap
from .config import DEFAULT_FETCH_MAX_BYTES, ClientConfig
from .consumers import ConsumerClient
from .pd import PdClient
from .pool import ConnectionPool
from .producer import Producer
from .range_server import BatchLike, RangeServerClient
from .reading import RangeEnd, RangeRead
from .replicas import known_range
from .timesearch import TimeSearch, range_end
from .types import Appended, FetchedBatch, ItemResult, ReplicaLocation
from .writer import StreamWriter

_log = logging.getLogger(__name__)


class SbpClient:
    """Stream-level operations against the cluster whose PD is at ``pd``.

    ``pd`` is ``"host:port[,host:port]"``, a list of addresses, or a ``PdClient``.
    Connections come from the process-wide pool unless ``pool`` is given. ``token``: a signed
    token every connection presents, for clusters that authenticate (the same as
    ``ClientConfig.token``; it is never printed).
    """

    def __init__(self, pd: str | Sequence[str] | PdClient, config: ClientConfig | None = None,
                 pool: ConnectionPool | None = None, *, token: str | None = None) -> None:
        if token is not None:
            if isinstance(pd, PdClient):
                raise ValueError("give the token in the PdClient's config, not beside it")
            config = replace(config if config is not None else ClientConfig(),
                             token=token)
        if isinstance(pd, PdClient):
            self.pd = pd
            self.config = config if config is not None else pd.config
        else:
            self.config = config if config is not None else ClientConfig()
            self.pd = PdClient(pd, self.config, pool)
        self.pool = self.pd.pool if pool is None else pool
        # stream id -> the last range that stored a batch of this client's writers: the range
        # has reached its primary (see ``StreamWriter._send``).
        self._reached: dict[int, int] = {}
        # This client's producer identity (idempotent appends), shared by its writers.
        self.producer = Producer() if self.config.idempotent else None

    def __repr__(self) -> str:
        return f"SbpClient(pd={','.join(self.pd.addresses)!r})"

    @property
    def consumers(self) -> ConsumerClient:
        """The named consumers' requests (``client.consumers``)."""
        return ConsumerClient(self.pd, self.config.server_timeout_ms)

    def range_server(self, address: str) -> RangeServerClient:
        """A client for the range server at ``address`` sharing this client's pool."""
        return RangeServerClient(address, self.config, self.pool)

    def close(self) -> None:
        """Nothing to release: connections belong to the pool (kept for the next task)."""

    def __enter__(self) -> SbpClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- streams ---------------------------------------------------------------------------

    def create_streams(self, count: int = 1, replicas: int = 1, retention_ms: int = -1,
                       names: Sequence[str] | None = None) -> list[Stream]:
        """Create ``count`` streams, or one per name of ``names`` (each unique in the cluster:
        ``StreamAlreadyExistsError`` when a live stream has it); raises the first failure."""
        if names is not None:
            names = [check_name(n) for n in names]
            if not names:
                raise ValueError("names=[]: give at least one name")
            if len(set(names)) != len(names):
                raise ValueError(f"names={names!r}: a name appears twice")
            if count not in (1, len(names)):
                raise ValueError(f"count={count!r} differs from the {len(names)} names given")
            count = len(names)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count={count!r}: must be an integer >= 1")
        if not isinstance(replicas, int) or not 1 <= replicas <= 127:
            raise ValueError(f"replicas={replicas!r}: must be an integer in 1..127")
        if not isinstance(retention_ms, int) or (retention_ms < 1 and retention_ms != -1):
            raise ValueError(f"retention_ms={retention_ms!r}: must be > 0, or -1 (forever)")
        streams = [Stream(replica_nums=replicas, retention_period_ms=retention_ms,
                          name=names[i] if names is not None else "")
                   for i in range(count)]
        return [r.unwrap() for r in self.pd.create_streams(streams)]

    def create_stream(self, name: str = "", replicas: int = 1, retention_ms: int = -1
                      ) -> Stream:
        """Create one stream, named ``name`` unless it is ""."""
        return self.create_streams(1, replicas, retention_ms,
                                   names=[name] if name else None)[0]

    def describe_streams(self, ids: Sequence[int | str]) -> list[Stream]:
        """Metadata of streams given by id or name (``protocol.names.parse_stream_ref``), in
        the order asked, in one PD request; raises ``StreamNotFoundError`` for a missing
        one."""
        refs = [parse_stream_ref(s) for s in ids]
        numbers = [r for r in refs if isinstance(r, int)]
        names = [r for r in refs if isinstance(r, str)]
        # Ids and names never collide: a name is never digits only.
        found: dict[int | str, ItemResult[Stream]] = dict(zip(
            [*numbers, *names], self.pd.describe_streams(numbers, names), strict=True))
        return [unwrap(found[r], f"stream {r}" if isinstance(r, int) else f"stream {r!r}")
                for r in refs]

    def stream_ids(self, refs: Sequence[int | str]) -> list[int]:
        """The ids of streams given by id or name, in order: ids are taken as they are (no
        PD request), names looked up in one request (``StreamNotFoundError`` for a name no
        live stream has)."""
        parsed = [parse_stream_ref(r) for r in refs]
        names = list(dict.fromkeys(r for r in parsed if isinstance(r, str)))
        ids = dict(zip(names, (s.stream_id for s in self.describe_streams(names)),
                       strict=True)) if names else {}
        return [r if isinstance(r, int) else ids[r] for r in parsed]

    def stream_id(self, ref: int | str) -> int:
        """The id of one stream given by id or name (see ``stream_ids``)."""
        return self.stream_ids([ref])[0]

    def list_streams(self) -> list[Stream]:
        """Every stream that is not deleted, in id order."""
        return self.pd.list_streams()

    def describe_stream(self, stream_id: int | str) -> Stream:
        """Metadata of one stream, by id or name."""
        return self.describe_streams([stream_id])[0]

    def delete_streams(self, ids: Sequence[int | str]) -> list[Stream]:
        """Delete streams given by id or name; returns them as deleted; raises the first
        failure."""
        ids = self.stream_ids(ids)
        results = self.pd.delete_streams(ids)
        return [unwrap(r, f"stream {s}") for s, r in zip(ids, results, strict=True)]

    def trim_stream(self, stream_id: int | str, offset: int) -> Stream:
        """Drop the records of ``stream_id`` (an id or a name) below ``offset``; returns the
        stream after the trim (its ``start_offset`` is the new first offset)."""
        stream_id = self.stream_id(stream_id)
        (result,) = self.pd.trim_streams([(stream_id, offset)])
        trimmed = unwrap(result, f"stream {stream_id}")
        if trimmed.trimmed_stream is not None:
            return trimmed.trimmed_stream
        return self.describe_stream(stream_id)

    def update_stream(self, stream_id: int | str, replicas: int | None = None,
                      retention_ms: int | None = None,
                      retain_for_consumers: bool | None = None,
                      retain_cap_bytes: int | None = None,
                      retain_cap_ms: int | None = None) -> Stream:
        """Change a stream's replica count, retention, and retention that waits for its
        named consumers with its caps in bytes and ms (-1: none); None keeps the current
        value. Returns the updated stream."""
        if replicas is not None and (not isinstance(replicas, int) or not 1 <= replicas <= 127):
            raise ValueError(f"replicas={replicas!r}: must be an integer in 1..127")
        for name, value in (("retention_ms", retention_ms), ("retain_cap_bytes",
                            retain_cap_bytes), ("retain_cap_ms", retain_cap_ms)):
            if value is not None and (not isinstance(value, int) or (value < 1 and value != -1)):
                raise ValueError(f"{name}={value!r}: must be > 0, or -1 (none)")
        current = self.describe_stream(stream_id)
        stream_id = current.stream_id
        wanted = Stream(
            stream_id=stream_id,
            replica_nums=current.replica_nums if replicas is None else replicas,
            retention_period_ms=(current.retention_period_ms if retention_ms is None
                                 else retention_ms),
            retain_for_consumers=(current.retain_for_consumers if retain_for_consumers is None
                                  else retain_for_consumers),
            retain_cap_bytes=(current.retain_cap_bytes if retain_cap_bytes is None
                              else retain_cap_bytes),
            retain_cap_ms=current.retain_cap_ms if retain_cap_ms is None else retain_cap_ms)
        (result,) = self.pd.update_streams([wanted])
        return unwrap(result, f"stream {stream_id}")

    # -- ranges ----------------------------------------------------------------------------

    def seal_range(self, stream_id: int | str) -> Range:
        """Seal the stream's open range (the PD seals it where its primary stopped) and
        return the new open range; the stream by id or name."""
        stream_id = self.stream_id(stream_id)
        ranges = self.list_ranges(stream_id)
        if not ranges:
            raise RangeNotFoundError(f"stream {stream_id} has no range to seal")
        last = ranges[-1]
        (result,) = self.pd.seal_ranges([last])
        error = result.exception()
        if error is None:
            return result.unwrap()
        # The PD seals first and opens the next range after (NOT_ENOUGH_SERVERS when too few
        # servers are live): say so when the seal went through, not that it failed.
        sealed = next((r for r in self._ranges_if_known(stream_id)
                       if r.range_index == last.range_index and not r.is_open), None)
        if last.is_open and sealed is not None:
            raise error.with_context(f"range {last.range_index} of stream {stream_id} was "
                                       f"sealed at offset {sealed.end_offset}, but no range "
                                       f"could be opened after it (appends wait for one)")
        raise error.with_context(f"sealing range {last.range_index} of stream {stream_id}")

    def _ranges_if_known(self, stream_id: int) -> list[Range]:
        """``list_ranges``, or [] when the PD does not answer."""
        try:
            return self.list_ranges(stream_id)
        except SbpError:
            return []

    def list_ranges(self, stream_id: int | str) -> list[Range]:
        """The ranges of a stream (by id or name), in order (only the last may be open)."""
        stream_id = self.stream_id(stream_id)
        (result,) = self.pd.list_ranges([stream_id])
        return unwrap(result, f"stream {stream_id}")

    def locate(self, appended: Sequence[Appended], deadline: float | None = None
               ) -> list[Appended]:
        """``appended`` (what appends returned), each with the range that holds it by the
        PD's ranges: ``Appended.range_index`` is the range a batch was sent to, which a
        range server may have answered from the next range (see ``Appended``). One PD
        request (its errors raise; ``deadline``, a ``time.monotonic()`` value, ends its
        retries sooner); a batch below the first range the PD lists (trimmed away) keeps
        the range it was sent to."""
        sids = list(dict.fromkeys(a.stream_id for a in appended))
        if not sids:
            return []
        ranges: dict[int, tuple[list[int], list[int]]] = {}
        for sid, result in zip(sids, self.pd.list_ranges(sids, deadline), strict=True):
            listed = sorted((r.start_offset, r.range_index)
                            for r in unwrap(result, f"stream {sid}"))
            ranges[sid] = ([start for start, _ in listed], [index for _, index in listed])
        out = []
        for item in appended:
            starts, indexes = ranges[item.stream_id]
            at = bisect.bisect_right(starts, item.base_offset) - 1
            holder = indexes[at] if at >= 0 else item.range_index
            out.append(item if holder == item.range_index else replace(item, range_index=holder))
        return out

    def open_range_end(self, range: Range) -> int:
        """The offset after the last record of ``range`` now: its end if sealed, else the
        live next_offset from its primary (DESCRIBE_RANGES).

        Only the primary knows how far an open replicated range is acknowledged: a secondary
        may learn it a little later. While the primary does not answer, this keeps asking it
        and the PD (which seals the range after a failover) until the retry deadline; only
        then does it settle for what a secondary vouches for, with a warning: records
        acknowledged just before the primary failed may then be missing from this read (not
        from the stream). See ``reading.RangeEnd``.
        """
        if not range.is_open:
            return range.end_offset
        return RangeEnd(self.pd, self.range_server, self.config, range).find()

    # -- reading ---------------------------------------------------------------------------

    def retained_start(self, stream_id: int, range_index: int, addresses: Iterable[str]
                       ) -> int | None:
        """The first offset of range ``stream_id``/``range_index`` that its replicas at
        ``addresses`` still hold (the highest any of them reports), or None when none answers.
        Range servers delete trimmed and expired records first and tell the PD a moment later,
        so this can be past the start the PD lists."""
        starts = []
        for address in addresses:
            try:
                (result,) = self.range_server(address).describe_ranges([(stream_id,
                                                                          range_index)])
                described = result.unwrap()
            except SbpError:
                continue
            if described is not None:
                starts.append(described.start_offset)
        return max(starts, default=None)

    def fetch(
        self,
        range: Range,
        start_offset: int,
        end_offset: int = -1,
        max_bytes: int = DEFAULT_FETCH_MAX_BYTES,
        max_wait_ms: int = 0,
        min_bytes: int = 0,
    ) -> Generator[FetchedBatch, None, None]:
        """Stream the batches of ``range`` from ``start_offset`` up to ``end_offset`` (-1: no
        bound) with one FETCH, from the primary first, then the other replicas.

        Batches are whole: the first may begin before ``start_offset`` and the last may run
        past ``end_offset``; the reader keeps the records it asked for. If a server fails
        mid-way, the read resumes on the next replica after the last batch received, so no
        batch is yielded twice. ``max_bytes`` bounds the bytes of the whole answer.
        """
        if start_offset < 0:
            raise ValueError(f"start_offset={start_offset}: must be >= 0")
        if end_offset != -1 and end_offset < start_offset:
            raise ValueError(f"end_offset={end_offset} is below start_offset={start_offset}")
        if not range.is_open and (end_offset == -1 or end_offset > range.end_offset):
            end_offset = range.end_offset
        return RangeRead(self.pd, self.range_server, self.config, range, start_offset,
                         end_offset, max_bytes, max_wait_ms, min_bytes).batches()

    def fetch_from_replicas(
        self,
        stream_id: int,
        range_index: int,
        replicas: Sequence[ReplicaLocation],
        start_offset: int,
        end_offset: int = -1,
        sealed_end: int = -1,
        max_bytes: int = DEFAULT_FETCH_MAX_BYTES,
        max_wait_ms: int = 0,
    ) -> Generator[FetchedBatch, None, None]:
        """``fetch`` for a range known from an earlier look-up (no PD round trip): range
        ``range_index`` of ``stream_id`` on ``replicas``, open unless ``sealed_end`` (its end
        offset) is given. A stale replica list is refreshed from the PD as in ``fetch``."""
        rng = known_range(stream_id, range_index, replicas, end=sealed_end,
                          is_open=sealed_end < 0)
        return self.fetch(rng, start_offset, end_offset, max_bytes=max_bytes,
                          max_wait_ms=max_wait_ms)

    def read(self, stream_id: int | str, start: int = 0, end: int = -1
             ) -> Iterator[FetchedBatch]:
        """Every batch of ``stream_id`` (an id or a name) holding offsets in ``[start, end)``
        (``end`` -1: what the stream holds now), walking its ranges in order.

        A ``start`` below the stream's first stored offset (after a trim) reads from that
        first offset. Batches are whole, as in ``fetch``.
        """
        if start < 0:
            raise ValueError(f"start={start}: must be >= 0")
        if end != -1 and end < start:
            raise ValueError(f"end={end} is below start={start}")
        return self._read(self.stream_id(stream_id), start, end)

    def _read(self, stream_id: int, start: int, end: int) -> Iterator[FetchedBatch]:
        for range in self.list_ranges(stream_id):
            if end != -1 and range.start_offset >= end:
                return
            range_end = self.open_range_end(range) if range.is_open else range.end_offset
            low = max(start, range.start_offset)
            high = range_end if end == -1 else min(end, range_end)
            # A server may end an answer early (byte budget): ask again from where it stopped.
            while low < high:
                progressed = low
                for batch in self.fetch(range, low, high):
                    yield batch
                    progressed = max(progressed, batch.header.end_offset)
                if progressed == low:
                    break  # nothing more is stored below high (the range ends earlier)
                low = progressed

    def offset_for_time(self, stream_id: int | str, timestamp_ms: int) -> int | None:
        """The first offset of ``stream_id`` whose record timestamp is at or after
        ``timestamp_ms`` (ms since the epoch), or None when no stored record is; a search of
        O(log n) one-batch FETCHes (see ``client.timesearch`` for what it returns when
        timestamps run back in time); the stream by id or name."""
        stream_id = self.stream_id(stream_id)
        ranges = [replace(r, next_offset=self.open_range_end(r)) if r.is_open else r
                  for r in self.list_ranges(stream_id)]
        start = self.describe_stream(stream_id).start_offset
        end = range_end(ranges[-1]) if ranges else start
        return TimeSearch(self, ranges).first_at_or_after(timestamp_ms, start, end).offset

    # -- writing ---------------------------------------------------------------------------

    def open_stream(self, stream_id: int | str) -> StreamWriter:
        """A writer appending to ``stream_id`` (an id, or a name looked up once, now)."""
        return StreamWriter(self.pd, self.stream_id(stream_id), self.range_server, self.config,
                            self._reached, self.producer)

    def append(self, stream_id: int | str, batches: Sequence[BatchLike]) -> list[Appended]:
        """Append batches to a stream, by id or name (see ``StreamWriter.append``)."""
        return self.open_stream(stream_id).append(batches)
