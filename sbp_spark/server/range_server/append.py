"""The APPEND path of a range server: a client's batches on a range's primary, and the batches
a primary forwards to its secondaries (replication.py).

One APPEND becomes a ``PendingAppend``: its entries are checked and grouped by the range they
go to (``RangeBatches``), each group is stored, and the answer (``AppendReplies``, one
``AppendResult`` per entry) leaves once every *part* the groups started is done: the local
fsync (``LocalDurability``, under the storage's fsync policy) and, on a primary of a
replicated range, the secondaries' answers (``Replication``). A part that fails turns the
results of its entries into errors; the others keep their base offsets.

The path sees the rest of the server through small interfaces: the stream's local ranges, the
storage's group commit (``Durability``), this server's role in each range (``Roles``), the
calls to the secondaries (``Forwarding``), the cap notices (``Notices``), the metrics and the
network core's worker pool (``Submit``).
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from ...protocol.errors import (
    BatchFormatError,
    ErrorCode,
    InvalidRequestError,
    NotPrimaryError,
    PayloadTooLargeError,
    RangeNotFoundError,
    RangeSealedError,
    ReplicationFailedError,
    ServerError,
    StreamNotFoundError,
    UnknownProducerError,
)
from ...protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    AppendResult,
    ProducerSequence,
    RangeId,
    RangeReplica,
    Status,
)
from ...protocol.records import BatchHeader, parse_header
from ..net import ConnectionClosed, RequestContext
from ..storage.durability import Waiter
from ..storage.range_log import RangeLog
from .metrics import Metrics
from .producers import STORE, ProducerLog, Verdict
from .replication import Forward, ReplicationProblem
from .roles import Roles

log = logging.getLogger(__name__)

# Runs ``fn(*args)`` on the network core's worker pool (False: the server stopped).
Submit = Callable[..., bool]
# Calls back once the range is durable up to the offset (``GroupCommit.when_durable``).
WhenDurable = Callable[[RangeLog, int, Waiter], None]


class Durability(Protocol):
    """The storage's group commit, as appends use it (``storage/durability.py``)."""

    def storing(self) -> AbstractContextManager[None]: ...

    def when_durable(self, rlog: RangeLog, target: int, callback: Waiter) -> None: ...


class Forwarding(Protocol):
    """The calls to a range's secondaries, as its primary's appends make them
    (``replication.py``)."""

    def order_lock(self, rlog: RangeLog) -> AbstractContextManager[object]: ...

    def send(self, rlog: RangeLog, secondaries: Sequence[RangeReplica],
             stored: Sequence[Sequence], timeout_ms: int,
             producers: Sequence[ProducerSequence] = ()) -> list[Forward]: ...

    def wait(self, rlog: RangeLog, forwards: Sequence[Forward]
             ) -> ReplicationProblem | None: ...


class Notices(Protocol):
    """The cap notices, as the APPEND path meets them (``cap_notices.py``): a notice from a
    range's primary arrives as an APPEND, and a primary's append that settled is due one."""

    def answer(self, rid: RangeId, req: AppendRequest, payload_bytes: int
               ) -> AppendResponse: ...

    def settled(self, rlog: RangeLog, end: int) -> None: ...


class ProducerState(Protocol):
    """Which batches of each producer a range holds (``producers.py``), as appends ask."""

    def guard(self, rlog: ProducerLog) -> AbstractContextManager[object]: ...

    def check(self, rlog: ProducerLog, producer_id: int, sequence: int) -> Verdict: ...

    def record(self, rlog: ProducerLog, batches: Iterable[tuple[int, int, int, int]],
               now_ms: int | None = None) -> None: ...

    def record_one(self, rlog: ProducerLog, producer_id: int, sequence: int, base: int,
                   end: int, now_ms: int) -> None: ...


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def status_of(exc: BaseException) -> Status:
    """The status an entry gets for ``exc`` (an I/O error means the disk would not take it)."""
    if isinstance(exc, ServerError):
        return Status.from_error(exc)
    return Status(ErrorCode.STORAGE_FULL, str(exc))


class AppendReplies:
    """The answer to one APPEND: one ``AppendResult`` per entry, in entry order."""

    __slots__ = ("entries", "results")

    def __init__(self, entries: Sequence[AppendEntry]) -> None:
        self.entries = entries
        self.results: list[AppendResult | None] = [None] * len(entries)

    def stored(self, index: int, base_offset: int, now_ms: int) -> None:
        e = self.entries[index]
        self.results[index] = AppendResult(e.stream_id, e.request_index, base_offset, now_ms)

    def refuse(self, indexes: Sequence[int], status: Status) -> None:
        """The entries at ``indexes`` were not stored, or not made durable or replicated."""
        for i in indexes:
            e = self.entries[i]
            self.results[i] = AppendResult(e.stream_id, e.request_index, -1, 0, status)

    @property
    def failures(self) -> int:
        return sum(1 for r in self.results if r is None or r.status.code)

    def response(self) -> AppendResponse:
        results = [r for r in self.results if r is not None]
        if len(results) != len(self.results):
            raise AssertionError("an APPEND answered before every entry had its result")
        return AppendResponse(append_responses=results)


@dataclass
class RangeBatches:
    """The entries of one APPEND that go to one range, in arrival order: a client's batches,
    or (``replicated``) a primary's forward, whose batches carry their base offsets."""

    rlog: RangeLog
    replicated: bool
    indexes: list[int] = field(default_factory=list)
    batches: list[tuple[BatchHeader, memoryview]] = field(default_factory=list)
    # Each batch's producer and sequence (idempotent appends), or empty.
    producers: list[ProducerSequence] = field(default_factory=list)


class Part(abc.ABC):
    """Something an APPEND waits for before it is answered, for the entries at ``indexes``."""

    def __init__(self, rlog: RangeLog, indexes: list[int]) -> None:
        self.rlog = rlog
        self.indexes = indexes

    @abc.abstractmethod
    def start(self, pending: PendingAppend) -> None:
        """Begin; call ``pending.part_done(self, error)`` once done (never blocking)."""


class LocalDurability(Part):
    """The stored batches become durable here under the fsync policy (range up to ``target``)."""

    def __init__(self, rlog: RangeLog, indexes: list[int], target: int,
                 when_durable: WhenDurable) -> None:
        super().__init__(rlog, indexes)
        self.target = target
        self._when_durable = when_durable

    def start(self, pending: PendingAppend) -> None:
        # Called back on the fsync thread.
        self._when_durable(self.rlog, self.target, lambda exc: pending.part_done(self, exc))


class Replication(Part):
    """Every secondary stores the forwarded batches (``start`` to ``end`` of the range)."""

    def __init__(self, rlog: RangeLog, indexes: list[int], forwards: list[Forward],
                 start: int, end: int, replicator: Forwarding, notices: Notices,
                 submit: Submit) -> None:
        super().__init__(rlog, indexes)
        self.forwards = forwards
        self.begin = start
        self.end = end
        self._replicator = replicator
        self._notices = notices
        self._submit = submit

    def start(self, pending: PendingAppend) -> None:
        self._submit(self._await, pending)  # waits on the worker pool

    def _await(self, pending: PendingAppend) -> None:
        rlog = self.rlog
        problem = self._replicator.wait(rlog, self.forwards)
        if problem is None:
            if rlog.cap.release(self.begin, self.end):
                self._notices.settled(rlog, self.end)
                pending.part_done(self, None)
                return
            pending.part_done(self, self._past_the_end())
            return
        sealed_before = rlog.sealed  # by the PD (a failover), or another append's failure
        if not sealed_before:
            log.warning("range %d/%d: replication failed (%s); sealing it so writers move on",
                        rlog.stream_id, rlog.range_index, problem)
            try:
                rlog.seal()
            except (OSError, ServerError) as exc:
                log.error("sealing range %d/%d after a replication failure failed: %s",
                          rlog.stream_id, rlog.range_index, exc)
        # Whether the range keeps these entries is the seal's to say (``ReadCap.fence``):
        # it does when a later append settled first (so these reached every secondary too)
        # or the PD's end holds them; their writer must not send them again then.
        if rlog.sealed and rlog.cap.release(self.begin, self.end):
            pending.part_done(self, None)
            return
        rlog.cap.release(self.begin, None)
        if sealed_before:
            log.info("range %d/%d: sealed at %d while offsets %d..%d waited for the "
                     "secondaries (%s); their writer sends them again", rlog.stream_id,
                     rlog.range_index, rlog.end_offset, self.begin, self.end, problem)
            pending.part_done(self, self._past_the_end())
            return
        pending.part_done(self, ReplicationFailedError(
            f"not stored on every replica: {problem}"))

    def _past_the_end(self) -> RangeSealedError:
        """The error of this append's entries when the range was sealed before they settled:
        the seal ended it before them (``ReadCap.fence``), so they are not part of it, and
        their writer sends them to the next range."""
        rlog = self.rlog
        return RangeSealedError(
            f"range {rlog.stream_id}/{rlog.range_index} was sealed at {rlog.end_offset} "
            f"before every replica had stored offsets {self.begin}..{self.end}: they are not "
            f"part of it")


class PendingAppend:
    """One APPEND from its arrival to its answer: the replies, and the parts still running."""

    def __init__(self, ctx: RequestContext, entries: Sequence[AppendEntry], metrics: Metrics,
                 submit: Submit) -> None:
        self.ctx = ctx
        self._metrics = metrics
        self._submit = submit
        self.started = time.monotonic()
        self.replies = AppendReplies(entries)
        self.parts: list[Part] = []
        self._left = 0
        self._lock = threading.Lock()

    def run(self) -> None:
        """Answer now if nothing is pending, else once every part is done."""
        if not self.parts:
            self.finish()
            return
        # Durability is signalled by the flush thread and replication is awaited on the
        # worker pool; the last part answers (see ``part_done``).
        self.ctx.defer()
        self._left = len(self.parts)
        for part in self.parts:
            part.start(self)

    def part_done(self, part: Part, exc: BaseException | None) -> None:
        """``part`` is done (``exc``: it failed); the last part answers. Called on the flush
        thread or a worker, which must not block on a client: the answer leaves at once when
        the socket has room, else from the worker pool."""
        if exc is not None:
            self.replies.refuse(part.indexes, status_of(exc))
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        response = self._response()
        try:
            sent = self.ctx.try_reply(response)
        except ConnectionClosed:
            self.ctx._abandon()
            return
        except Exception:  # the answer must leave all the same: from a worker, then
            log.exception("answering an append at once failed; answering from a worker")
            sent = False
        if not sent:
            self._submit(self.ctx.reply, response)

    def finish(self) -> None:
        self.ctx.reply(self._response())

    def _response(self) -> AppendResponse:
        metrics = self._metrics
        metrics.failed_appends += self.replies.failures
        took = time.monotonic() - self.started
        metrics.append_latency_s += took
        metrics.append_seconds.observe(took)
        return self.replies.response()


def _frame_problem(req: AppendRequest, payload: memoryview) -> str | None:
    """Why the request as a whole is malformed, or None."""
    entries = req.append_requests
    total = sum(e.batch_length for e in entries)
    if any(e.batch_length < 0 for e in entries) or total != payload.nbytes:
        return (f"the entries' batch_length values add up to {total} bytes but the payload "
                f"holds {payload.nbytes}")
    if req.committed_offset < -1:
        return f"committed_offset {req.committed_offset} must be >= 0, or -1 when not set"
    if req.producers and len(req.producers) != len(entries):
        return (f"producers holds {len(req.producers)} items for {len(entries)} entries: one "
                f"per entry, or none")
    return None


def _other_range(rlog: RangeLog, range_index: int) -> ServerError:
    """The refusal of an idempotent batch numbered for range ``range_index`` that reached
    ``rlog``, the stream's open range here: its sequence means nothing in this range."""
    where = f"range {rlog.stream_id}/{range_index}"
    if range_index < rlog.range_index:
        return RangeSealedError(f"{where} is sealed: range {rlog.range_index} follows it")
    return RangeNotFoundError(
        f"{where} is not open on this server yet (its open range is {rlog.range_index})")


class AppendPath:
    """Serves APPEND for one range server."""

    def __init__(self, stream_ranges: Callable[[int], list[RangeLog]], durability: Durability,
                 roles: Roles, replicator: Forwarding, notices: Notices, metrics: Metrics,
                 submit: Submit, max_batch_bytes: int, producers: ProducerState) -> None:
        self._stream_ranges = stream_ranges  # a stream's local ranges, by range_index
        self._durability = durability
        self._roles = roles
        self._replicator = replicator
        self._notices = notices
        self._metrics = metrics
        self._submit = submit
        self._max_batch_bytes = max_batch_bytes
        self._producers = producers

    def serve(self, ctx: RequestContext, req: AppendRequest) -> None:
        payload = memoryview(ctx.payload)
        if req.cap_notice is not None:
            ctx.reply(self._notices.answer(req.cap_notice, req, payload.nbytes))
            return
        entries = req.append_requests
        metrics = self._metrics
        metrics.appends += len(entries)
        problem = _frame_problem(req, payload)
        if problem is not None:
            status = Status(ErrorCode.INVALID_REQUEST, problem)
            metrics.failed_appends += len(entries)
            ctx.reply(AppendResponse(status=status, append_responses=[
                AppendResult(e.stream_id, e.request_index, -1, 0, status) for e in entries]))
            return
        pending = PendingAppend(ctx, entries, metrics, self._submit)
        with self._durability.storing():
            self._store_all(req, ctx, pending, payload)
        # The batches are in the page cache now (what a forward to secondaries still sends, it
        # holds itself): the frame's buffer may take the next frame while this one waits.
        del payload
        ctx.release_frame()
        pending.run()

    def _store_all(self, req: AppendRequest, ctx: RequestContext, pending: PendingAppend,
                   payload: memoryview) -> None:
        """Check, group and store every entry of ``req``; the parts to wait for go into
        ``pending``."""
        entries = req.append_requests
        groups = self._group(entries, payload, pending.replies, req.range_index,
                             req.producers)
        # A forward from a primary says how far every replica holds its (one) range: once its
        # batches are stored here, readers of this secondary may see that far.
        committed = req.committed_offset
        if committed >= 0 and sum(1 for g in groups if g.replicated) != 1:
            committed = -1  # not one range: the offset names none of them
        # A frame of one batch: its payload checksum, checked on arrival, is the batch's.
        crcs = [ctx.frame.payload_crc] if len(entries) == 1 else None
        now = _now_ms()
        for group in groups:
            try:
                if group.producers:
                    # Checked (a client's batches; a forward's were, on the primary), stored
                    # and recorded under the range's guard, its producers loaded first.
                    with self._producers.guard(group.rlog):
                        if not group.replicated:
                            group = self._drop_held(group, pending.replies, now)
                            if not group.indexes:
                                continue
                        bases, parts = self._store(group, now, committed, crcs,
                                                   req.timeout_ms)
                else:
                    bases, parts = self._store(group, now, committed, crcs, req.timeout_ms)
            except ServerError as exc:
                pending.replies.refuse(group.indexes, Status.from_error(exc))
                continue
            self._metrics.touch(group.rlog)
            if not group.replicated:  # a client's batches (a forward is counted by its primary)
                self._metrics.stored(group.rlog.stream_id,
                                     sum(h.record_count for h, _ in group.batches),
                                     sum(v.nbytes for _, v in group.batches))
            for i, base in zip(group.indexes, bases, strict=True):
                pending.replies.stored(i, base, now)
            pending.parts += parts

    # -- checking and grouping the entries ---------------------------------------------------

    def _drop_held(self, group: RangeBatches, replies: AppendReplies, now: int
                   ) -> RangeBatches:
        """``group`` without the batches its range already holds (answered with the base
        offset they were stored at) or cannot take (refused); under the range's guard."""
        rlog, check = group.rlog, self._producers.check
        if len(group.producers) == 1:  # a lone writer's batch, mostly new: nothing to drop
            producer = group.producers[0]
            if producer.range_index == rlog.range_index and \
                    check(rlog, producer.producer_id, producer.sequence) is STORE:
                return group
        kept = RangeBatches(rlog, group.replicated)
        seen: set[tuple[int, int]] = set()
        starting: set[int] = set()  # producers whose sequence 0 this APPEND stores
        for i, batch, producer in zip(group.indexes, group.batches, group.producers,
                                      strict=True):
            key = (producer.producer_id, producer.sequence)
            if producer.range_index != rlog.range_index:
                verdict = Verdict(None, _other_range(rlog, producer.range_index))
            elif key in seen:
                verdict = Verdict(None, InvalidRequestError(
                    f"producer {key[0]} sequence {key[1]} is in this APPEND twice"))
            else:
                verdict = check(rlog, key[0], key[1])
                if verdict.error is not None and key[0] in starting and \
                        isinstance(verdict.error, UnknownProducerError):
                    verdict = STORE  # unknown only until its sequence 0, stored just before
            seen.add(key)
            if verdict.error is not None:
                replies.refuse([i], Status.from_error(verdict.error))
            elif verdict.held is not None:
                replies.stored(i, verdict.held[0], now)
                self._metrics.duplicate_appends += 1
            else:  # STORE
                if key[1] == 0:
                    starting.add(key[0])
                kept.indexes.append(i)
                kept.batches.append(batch)
                kept.producers.append(producer)
        return kept

    def _group(self, entries: Sequence[AppendEntry], payload: memoryview,
               replies: AppendReplies, range_index: int,
               producers: Sequence[ProducerSequence] = ()) -> list[RangeBatches]:
        """The entries' batches grouped by the range (and kind of write) they go to, in arrival
        order; entries that cannot be stored get their refusal in ``replies``. ``range_index``
        >= 0: a primary's forward of that one range."""
        groups: dict[tuple[int, bool], RangeBatches] = {}
        pos = 0
        for i, e in enumerate(entries):
            view = payload[pos:pos + e.batch_length]
            pos += e.batch_length
            try:
                header = self._check_batch(e.stream_id, e.batch_length, view)
                rlog, replicated = self._open_range_for(e.stream_id, header, range_index)
            except ServerError as exc:
                replies.refuse([i], Status.from_error(exc))
                continue
            group = groups.setdefault((id(rlog), replicated), RangeBatches(rlog, replicated))
            group.indexes.append(i)
            group.batches.append((header, view))
            if producers:
                group.producers.append(producers[i])
        return list(groups.values())

    def _check_batch(self, stream_id: int, batch_length: int, view: memoryview) -> BatchHeader:
        if stream_id < 0:
            raise InvalidRequestError(f"stream_id {stream_id} must be >= 0")
        if batch_length == 0:
            raise InvalidRequestError(
                f"stream {stream_id}: an entry of batch_length 0 holds no record batch (a read "
                f"cap notice is an APPEND with cap_notice set and no entries)")
        limit = self._max_batch_bytes
        if batch_length > limit:
            raise PayloadTooLargeError(
                f"batch of {batch_length} bytes for stream {stream_id} exceeds the "
                f"{limit}-byte batch limit")
        try:
            header = parse_header(view)
        except BatchFormatError as exc:
            raise InvalidRequestError(f"stream {stream_id}: {exc}") from exc
        if header.batch_length != batch_length:
            raise InvalidRequestError(
                f"stream {stream_id}: entry batch_length {batch_length} but the batch "
                f"envelope says {header.batch_length} bytes")
        return header

    def _open_range_for(self, stream_id: int, header: BatchHeader, range_index: int = -1
                        ) -> tuple[RangeLog, bool]:
        """The open range an entry goes to, and whether it is a replicated write (a batch
        from the range's primary, which already carries its base offset). ``range_index``
        >= 0: a primary's forward of that range (see ``_forwarded_range``); otherwise a
        client's append, which only the range's primary takes. A base offset in a client's
        batch changes nothing: stored on a secondary alone, it would sit at an offset the
        primary gives to other records."""
        roles = self._roles
        ranges = self._stream_ranges(stream_id)
        if not ranges:
            raise RangeNotFoundError(f"stream {stream_id} has no range on this server")
        last = ranges[-1]
        if last.deleted:
            raise StreamNotFoundError(f"stream {stream_id} was deleted")
        if range_index >= 0:
            return self._forwarded_range(last, range_index, header), True
        if last.sealed:
            raise RangeSealedError(
                f"range {stream_id}/{last.range_index} is sealed at {last.end_offset}")
        if roles.is_primary(last):
            return last, False
        primary = next((r for r in last.replicas if r.is_primary), None)
        where = f" (primary: {primary.server.advertise_addr})" if primary else ""
        raise NotPrimaryError(
            f"server {roles.server_id} is not the primary of range "
            f"{stream_id}/{last.range_index}{where}")

    def _forwarded_range(self, last: RangeLog, range_index: int, header: BatchHeader
                         ) -> RangeLog:
        """A forward of range ``range_index`` goes into that range only, as a secondary of
        it: a stale forward from a primary the PD has replaced must not land in the range
        that followed, even where its offsets would continue it. ``last`` is the stream's
        newest range here."""
        roles, stream_id = self._roles, last.stream_id
        if range_index < last.range_index:
            raise RangeSealedError(
                f"range {stream_id}/{range_index} is sealed here: range {last.range_index} "
                f"follows it")
        if range_index > last.range_index:
            raise RangeNotFoundError(
                f"range {stream_id}/{range_index} is not on server {roles.server_id} (its "
                f"newest is range {last.range_index})")
        if last.sealed:
            raise RangeSealedError(
                f"range {stream_id}/{last.range_index} is sealed at {last.end_offset}")
        if header.base_offset < 0 or roles.is_primary(last) or not roles.is_replica(last):
            raise InvalidRequestError(
                f"range {stream_id}/{range_index}: a forward (range_index set) must carry "
                f"stored batches (base_offset >= 0) to a secondary of the range; server "
                f"{roles.server_id} is "
                f"{'its primary' if roles.is_primary(last) else 'no secondary'} and the "
                f"batch's base_offset is {header.base_offset}")
        return last

    # -- storing -----------------------------------------------------------------------------

    def _store(self, group: RangeBatches, now: int, committed: int,
               crcs: list[int | None] | None, timeout_ms: int) -> tuple[list[int], list[Part]]:
        """Store one group's batches; returns their base offsets and the parts to wait for."""
        rlog = group.rlog
        parts: list[Part] = []
        producers = [(p.producer_id, p.sequence) for p in group.producers] \
            if group.producers else None
        if group.replicated or not self._roles.secondaries(rlog):
            bases, target = rlog.append(group.batches, now, replicated=group.replicated,
                                        crcs=crcs, producers=producers)
            if group.replicated and committed >= 0:
                rlog.cap.learn(committed, rlog.written_offset)
        else:
            bases, target, replication = self._store_and_forward(group, now, crcs, timeout_ms,
                                                                 producers)
            parts.append(replication)
        if producers:
            if len(producers) == 1:  # a lone batch: no iterators
                (pid, seq), base = producers[0], bases[0]
                self._producers.record_one(rlog, pid, seq, base,
                                           base + group.batches[0][0].record_count, now)
            else:
                self._producers.record(
                    rlog, [(pid, seq, base, base + header.record_count)
                           for (pid, seq), base, (header, _) in zip(producers, bases,
                                                                    group.batches, strict=True)],
                    now)
        if rlog.next_offset < target:
            parts.insert(0, LocalDurability(rlog, group.indexes, target,
                                            self._durability.when_durable))
        return bases, parts

    def _store_and_forward(self, group: RangeBatches, now: int, crcs: list[int | None] | None,
                           timeout_ms: int, producers: list[tuple[int, int]] | None
                           ) -> tuple[list[int], int, Replication]:
        """On the primary of a replicated range: store the batches and forward them, as
        stored, to every secondary, in one order for all (see replication.py)."""
        rlog, replicator = group.rlog, self._replicator
        stored: list = []
        with replicator.order_lock(rlog):
            # Readers wait for the secondaries (see replication.py).
            start = rlog.written_offset
            rlog.cap.hold(start)
            try:
                bases, target = rlog.append(group.batches, now, stored=stored, crcs=crcs,
                                            producers=producers)
            except BaseException:
                rlog.cap.release(start, None)
                raise
            forwards = replicator.send(rlog, self._roles.secondaries(rlog), stored, timeout_ms,
                                       group.producers)
        return bases, target, Replication(rlog, group.indexes, forwards, start, target,
                                          replicator, self._notices, self._submit)
