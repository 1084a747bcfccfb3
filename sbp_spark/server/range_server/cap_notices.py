"""Read cap notices between the replicas of an open range, both sides (see replication.py and
docs/reliability.md, "Cap notices").

A primary tells its secondaries how far every replica holds a range once it goes quiet (a
forward carries the cap under load), and after a restart asks them how far they stored it
(the cap probe). A secondary raises its cap when told and answers with its stored end.

``CapNotices`` sees the server through what it uses: the local ranges (``NoticedRanges``),
this server's role in each (``Roles``), the calls to the secondaries (``Notifying``), the
storage's durability callbacks and the network core's worker pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ...protocol.errors import ErrorCode, InvalidRequestError, ServerError
from ...protocol.messages import (
    AppendRequest,
    AppendResponse,
    AppendResult,
    RangeId,
    RangeReplica,
    Status,
)
from ..storage.durability import Waiter
from ..storage.range_log import RangeLog
from ..storage.read_cap import CapState
from .replication import NoticeAnswer
from .roles import Roles

log = logging.getLogger(__name__)

# A range quiet this long after an append settled sends its secondaries a cap notice: shorter
# than a reader would notice, longer than a writer's gap between one append and the next.
CAP_NOTICE_DELAY_S = 0.02


class NoticedRanges(Protocol):
    """The local ranges, as cap notices look them up (the storage)."""

    def ranges(self) -> list[RangeLog]: ...

    def get_range(self, stream_id: int, range_index: int) -> RangeLog | None: ...


class Notifying(Protocol):
    """The calls that carry cap notices to a range's secondaries (``replication.py``)."""

    def notify(self, rlog: RangeLog, secondaries: Sequence[RangeReplica], committed: int
               ) -> list[NoticeAnswer]: ...


class DelayedCalls:
    """Calls ``fn(value)`` once per key, ``delay_s`` after the last ``schedule`` of that key,
    from one background thread (started on first use)."""

    def __init__(self, delay_s: float, fn: Callable[[object], object], name: str) -> None:
        self.delay_s = delay_s
        self._fn = fn
        self._name = name
        self._due: dict[object, tuple[float, object]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def schedule(self, key: object, value: object) -> None:
        with self._cond:
            if self._closed:
                return
            self._due[key] = (time.monotonic() + self.delay_s, value)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._due:
                    self._cond.wait()
                if self._closed:
                    return
                now = time.monotonic()
                ready = [k for k, (when, _) in self._due.items() if when <= now]
                if not ready:
                    self._cond.wait(min(when for when, _ in self._due.values()) - now)
                    continue
                values = [self._due.pop(k)[1] for k in ready]
            for value in values:
                try:
                    self._fn(value)
                except Exception:
                    log.exception("%s: a delayed call failed", self._name)


class CapNotices:
    """The cap notices of one range server: sent as the primary of a range, answered as a
    secondary."""

    def __init__(self, ranges: NoticedRanges, roles: Roles, notifier: Notifying,
                 when_durable: Callable[[RangeLog, int, Waiter], None],
                 submit: Callable[..., bool], probe_interval_s: float) -> None:
        self._ranges = ranges
        self._roles = roles
        self._notifier = notifier
        self._when_durable = when_durable
        self._probe_interval_s = probe_interval_s
        self._stop = threading.Event()
        self._delayed = DelayedCalls(CAP_NOTICE_DELAY_S, lambda rlog: submit(self.send, rlog),
                                     name="range-server-cap-notices")
        self.prober: threading.Thread | None = None

    def start(self) -> None:
        """Start the cap probe of ranges recovered at start (see ``probe``)."""
        self.prober = threading.Thread(target=self._probe_loop, name="range-server-cap-probe",
                                       daemon=True)
        self.prober.start()

    def stop(self) -> None:
        """No more notices or probes (in-flight ones finish)."""
        self._stop.set()
        self._delayed.close()

    def join(self, timeout: float) -> None:
        if self.prober is not None:
            self.prober.join(timeout)

    # -- the primary's side -----------------------------------------------------------------

    def settled(self, rlog: RangeLog, end: int) -> None:
        """An append of ``rlog`` up to ``end`` is on every secondary: once it is durable here
        too, and the range stayed quiet for ``CAP_NOTICE_DELAY_S`` (a writer sending one
        append after another would make the next forward carry the cap anyway), tell the
        secondaries the new cap."""
        def durable(exc: BaseException | None) -> None:
            if exc is None:
                self._delayed.schedule((rlog.stream_id, rlog.range_index), rlog)

        self._when_durable(rlog, end, durable)

    def send(self, rlog: RangeLog) -> None:
        """Send the secondaries of ``rlog`` its cap if nothing is pending and they do not
        have it yet. Best effort: the next forward carries the cap anyway."""
        committed = rlog.cap.notice_due(rlog.next_offset)
        if committed is None:
            return
        for answer in self._notifier.notify(rlog, self._roles.secondaries(rlog), committed):
            if answer.problem is not None:
                log.debug("range %d/%d: cap notice (%d) to secondary %d not taken: %s",
                          rlog.stream_id, rlog.range_index, committed,
                          answer.replica.server.server_id, answer.problem)

    def _probe_due(self, rlog: RangeLog) -> bool:
        # A primary's open replicated range whose readers miss records durable here, with no
        # append under way (one that settles raises the cap by itself).
        cap = rlog.cap
        return (cap.state is CapState.CAPPED and not rlog.deleted
                and rlog.readable_offset < rlog.next_offset and self._roles.is_primary(rlog)
                and bool(self._roles.secondaries(rlog)) and not cap.pending)

    def probe(self, rlog: RangeLog) -> bool:
        """Ask every secondary of ``rlog`` how far it stored the range, and let readers see
        what every replica holds. False when a secondary did not answer (try again later)."""
        durable = rlog.next_offset
        ends = [durable]
        for answer in self._notifier.notify(rlog, self._roles.secondaries(rlog), -1):
            if answer.problem is not None or answer.stored_end is None:
                log.info("range %d/%d: secondary %d did not say how far it stored the range "
                         "(%s); its readers stay at offset %s for now", rlog.stream_id,
                         rlog.range_index, answer.replica.server.server_id, answer.problem,
                         rlog.read_cap)
                return False
            ends.append(answer.stored_end)
        if rlog.cap.settle(min(ends)):
            log.info("range %d/%d: every replica holds it up to %d; readers see that far",
                     rlog.stream_id, rlog.range_index, rlog.read_cap)
        self.send(rlog)
        return True

    def _probe_once(self, done: set[tuple[int, int]]) -> int:
        """Probe every range that needs it and was not probed yet; the number left to retry."""
        left = 0
        for rlog in self._ranges.ranges():
            key = (rlog.stream_id, rlog.range_index)
            if key in done or not self._probe_due(rlog):
                continue
            try:
                ok = self.probe(rlog)
            except Exception:
                log.exception("cap probe of range %s failed", rlog)
                ok = False
            if ok:
                done.add(key)
            else:
                left += 1
        return left

    def _probe_loop(self) -> None:
        # Once the id is known, probe every range that needs it; retry the ones whose
        # secondaries did not answer until none is left.
        done: set[tuple[int, int]] = set()
        while not self._stop.is_set():
            wait = 0.2
            if self._roles.server_id >= 0:
                if not self._probe_once(done):
                    return
                wait = self._probe_interval_s
            self._stop.wait(wait)

    # -- the secondary's side ---------------------------------------------------------------

    def answer(self, rid: RangeId, req: AppendRequest, payload_bytes: int) -> AppendResponse:
        """A cap notice (``req``, whose ``cap_notice`` is ``rid``) from the primary of that
        range: raise its read cap to ``committed_offset`` (unless -1) and answer with the
        range's stored end here."""
        if req.append_requests or payload_bytes:
            status = Status(ErrorCode.INVALID_REQUEST,
                            f"a read cap notice (cap_notice set, for range {rid.stream_id}/"
                            f"{rid.range_index}) carries no entries and no payload; this one "
                            f"has {len(req.append_requests)} entries and {payload_bytes} bytes")
            return AppendResponse(status=status)
        now = time.time_ns() // 1_000_000
        try:
            rlog = self._noticed_range(rid.stream_id, rid.range_index)
        except ServerError as exc:
            return AppendResponse(append_responses=[
                AppendResult(rid.stream_id, 0, -1, 0, Status.from_error(exc))])
        if req.committed_offset >= 0:
            rlog.cap.learn(req.committed_offset, rlog.written_offset)
        return AppendResponse(append_responses=[
            AppendResult(rid.stream_id, 0, rlog.written_offset, now)])

    def _noticed_range(self, stream_id: int, range_index: int) -> RangeLog:
        """The range a cap notice names; INVALID_REQUEST saying why when this server is not a
        secondary of it, or it is not open here."""
        roles = self._roles
        me = roles.server_id
        name = f"range {stream_id}/{range_index}"
        rlog = self._ranges.get_range(stream_id, range_index)
        if stream_id < 0 or range_index < 0:
            why = "stream_id and range_index must be >= 0"
        elif rlog is None:
            why = f"server {me} holds no such range"
        elif rlog.deleted:
            why = f"stream {stream_id} was deleted"
        elif rlog.sealed:
            why = f"it is sealed at {rlog.end_offset} (a sealed range has no read cap)"
        elif roles.is_primary(rlog):
            why = f"server {me} is its primary, and only a secondary takes notices"
        elif not roles.is_replica(rlog):
            why = f"server {me} holds no replica of it"
        else:
            return rlog
        raise InvalidRequestError(f"read cap notice for {name}: {why}")
