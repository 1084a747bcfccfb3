"""Idempotent appends on a range server: which batches of each producer a range holds.

A client appends under a producer id, and numbers its batches per range from 0 (a resend
keeps its batch's sequence). For every range this server holds, ``Producers`` keeps, per
producer, the sequences of its recent batches with the offsets they were stored at; the
APPEND path asks it about each entry before storing (``check``): a batch it already holds is
not stored again, and its resend is answered with the original base offset once that batch is
settled (durable here and, on a replicated range, on every replica).

The state is rebuilt from the log: every batch appended under a producer keeps its producer
id and sequence in its storage header (``storage/segment.py``), on the primary and, through
the forwards, on every secondary. A range's state is loaded the first time a producer's
batch or question reaches it, from the segments written within the expiry period.

Memory is bounded, and the rule is:
- a producer's state in a range is dropped once it has not appended there for
  ``expiry_s`` (15 minutes by default, far beyond a client's retry deadline);
- per producer and range, the last ``window`` batches are kept (older sequences are
  forgotten);
- at most ``max_states`` (producer, range) states are kept by a server; past that, the one
  that appended least recently is dropped.
A producer the range does not know is new there, whatever its sequence (it may also be one
that expired: idle that long, it resends nothing it sent before, as a client's call gives up
within a minute). What was dropped while it mattered is answered honestly: a batch whose
sequence is older than what is kept fails UNKNOWN_PRODUCER (it may be stored; nothing is
stored again); and once a range had a producer dropped to make room, only sequence 0 starts a
producer it does not know (the APPEND's later sequences of that producer with it), any other
fails UNKNOWN_PRODUCER.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ...protocol.errors import (
    InvalidRequestError,
    RangeNotFoundError,
    RangeSealedError,
    SequencePendingError,
    ServerError,
    UnknownProducerError,
)
from ...protocol.messages import LookupSequencesRequest, LookupSequencesResponse, Status

# A batch a range holds: its base offset and the offset after it.
Held = tuple[int, int]


class ProducedBatch(Protocol):
    """A stored batch appended under a producer, as the log hands it back
    (``storage.segment.ProducedBatch``)."""

    @property
    def base_offset(self) -> int: ...

    @property
    def record_count(self) -> int: ...

    @property
    def append_time_ms(self) -> int: ...

    @property
    def producer_id(self) -> int: ...

    @property
    def sequence(self) -> int: ...


class ProducerLog(Protocol):
    """A range's log, as the producers' state sees it (``storage.range_log.RangeLog``)."""

    stream_id: int
    range_index: int

    @property
    def readable_offset(self) -> int: ...

    @property
    def end_offset(self) -> int: ...

    @property
    def end_pending(self) -> bool: ...

    @property
    def written_offset(self) -> int: ...

    def produced_since(self, min_time_ms: int) -> Sequence[ProducedBatch]: ...


@dataclass(frozen=True)
class ProducerLimits:
    """The bounds of the producers' state (the rule is in the module's docstring)."""

    expiry_s: float = 900.0
    window: int = 1024
    max_states: int = 4096

    def __post_init__(self) -> None:
        if self.expiry_s <= 0 or self.window < 1 or self.max_states < 1:
            raise ValueError(f"producer limits {self} must be positive")


class Verdict(NamedTuple):
    """What to do with one entry: store it (``held`` None, ``error`` None), answer it with
    the base offset it was stored at (``held``), or refuse it (``error``)."""

    held: Held | None
    error: ServerError | None


STORE = Verdict(None, None)


@dataclass
class _ProducerState:
    """One producer in one range: its recent sequences (oldest first), and the last one
    dropped."""

    last_ms: int
    held: dict[int, Held] = field(default_factory=dict)
    floor: int = -1  # every sequence at or below it is forgotten (or was never sent)

    def add(self, sequence: int, held: Held, window: int) -> None:
        """``sequence`` (not held yet) is stored at ``held``."""
        kept = self.held
        if len(kept) >= window:
            dropped = next(iter(kept))  # the oldest: a dict keeps the order of insertion
            del kept[dropped]
            if dropped > self.floor:
                self.floor = dropped
        kept[sequence] = held


@dataclass
class _RangeState:
    """A range's producers (read and changed under ``lock``, its guard), whether they are
    loaded, and whether every producer active within the expiry period is still known (none
    dropped to make room for others)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    producers: dict[int, _ProducerState] = field(default_factory=dict)
    loaded: bool = False
    complete: bool = True


class Producers:
    """The producers' state of every range this server holds (thread-safe)."""

    def __init__(self, limits: ProducerLimits | None = None) -> None:
        self.limits = limits if limits is not None else ProducerLimits()
        self._lock = threading.Lock()
        # Every (stream_id, range_index, producer_id) state, in the order they began (under
        # ``_lock``). The bounds look at each state's ``last_ms`` (``_bound``): the APPEND
        # path only sets that, and takes ``_lock`` only for a producer new to a range.
        self._states: dict[tuple[int, int, int], _ProducerState] = {}
        self._ranges: dict[tuple[int, int], _RangeState] = {}
        # The range looked up last, and its state: one writer's appends ask for the same
        # range three times each (guard, check, record).
        self._last: tuple[object, _RangeState] | None = None
        self._next_expiry_ms = 0  # when ``record`` next looks for expired states

    def __len__(self) -> int:
        return len(self._states)

    def guard(self, rlog: ProducerLog) -> threading.Lock:
        """The lock under which a range's entries are checked, stored and recorded, so that
        two resends of one batch cannot both be stored. Loads the range's state first."""
        state = self._range(rlog)
        if not state.loaded:
            with state.lock:
                if not state.loaded:
                    self._load(rlog, state)
        return state.lock

    def check(self, rlog: ProducerLog, producer_id: int, sequence: int) -> Verdict:
        """The verdict on one entry of ``producer_id`` (call under ``guard(rlog)``)."""
        if sequence < 0 or producer_id < 0:
            return Verdict(None, InvalidRequestError(
                f"producer {producer_id} sequence {sequence}: both must be >= 0"))
        rstate = self._range(rlog)
        state = rstate.producers.get(producer_id)
        if state is None:
            if rstate.complete or sequence == 0:
                return STORE
            return Verdict(None, UnknownProducerError(
                f"range {rlog.stream_id}/{rlog.range_index} no longer knows producer "
                f"{producer_id} (its state made room for others): sequence "
                f"{sequence} may be stored already, and is not stored again"))
        held = state.held.get(sequence)
        if held is not None:
            return Verdict(held, _settled(rlog, held, producer_id, sequence))
        if sequence <= state.floor:
            return Verdict(None, UnknownProducerError(
                f"range {rlog.stream_id}/{rlog.range_index} keeps producer {producer_id}'s "
                f"sequences above {state.floor} only: sequence {sequence} may be stored "
                f"already, and is not stored again"))
        return STORE

    def record(self, rlog: ProducerLog, batches: Iterable[tuple[int, int, int, int]],
               now_ms: int | None = None) -> None:
        """Stored: ``batches`` of (producer_id, sequence, base_offset, end_offset) (call
        under ``guard(rlog)``)."""
        now = _now_ms() if now_ms is None else now_ms
        window = self.limits.window
        producers = self._range(rlog).producers
        began: list[tuple[int, _ProducerState]] = []
        for producer_id, sequence, base, end in batches:
            state = producers.get(producer_id)
            if state is None:
                state = producers[producer_id] = _ProducerState(now)
                began.append((producer_id, state))
            state.last_ms = now
            state.add(sequence, (base, end), window)
        if not began and now < self._next_expiry_ms:
            return  # the common case: known producers, expiry looked at within the second
        stream_id, range_index = rlog.stream_id, rlog.range_index
        with self._lock:
            for producer_id, state in began:
                self._states[(stream_id, range_index, producer_id)] = state
            # Expiry is looked at once a second (to the second is all it needs), room at once.
            if now >= self._next_expiry_ms or len(self._states) > self.limits.max_states:
                self._next_expiry_ms = now + 1000
                self._bound(now)

    def record_one(self, rlog: ProducerLog, producer_id: int, sequence: int, base: int,
                   end: int, now_ms: int) -> None:
        """``record`` of one batch (a lone writer's append, the common case): the same,
        without the iterations."""
        state = self._range(rlog).producers.get(producer_id)
        if state is None or now_ms >= self._next_expiry_ms:
            self.record(rlog, ((producer_id, sequence, base, end),), now_ms)
            return
        state.last_ms = now_ms
        state.add(sequence, (base, end), self.limits.window)

    def held(self, rlog: ProducerLog, producer_id: int, sequences: Iterable[int]
             ) -> dict[int, Held | None]:
        """For each of ``sequences``: where the range holds that batch of ``producer_id``,
        None when it does not; UNKNOWN_PRODUCER when it cannot tell."""
        guard = self.guard(rlog)
        with guard:
            verdicts = {seq: self.check(rlog, producer_id, seq) for seq in sequences}
        out: dict[int, Held | None] = {}
        for seq, verdict in verdicts.items():
            if verdict.held is not None:
                out[seq] = verdict.held
            elif isinstance(verdict.error, UnknownProducerError):
                raise verdict.error
            else:
                out[seq] = None
        return out

    def lookup(self, rlog: ProducerLog, producer_id: int, sequences: Sequence[int]
               ) -> list[int]:
        """Where the sealed range holds each of ``sequences`` of ``producer_id`` (its base
        offset, -1 when it does not hold it); what a writer asks before it sends its batches
        in doubt there to the next range. Only a replica holding the whole range, whose end
        the PD recorded, answers: SEQUENCE_PENDING otherwise (ask again, or another
        replica); UNKNOWN_PRODUCER when it cannot tell."""
        where = f"range {rlog.stream_id}/{rlog.range_index}"
        if rlog.end_offset < 0 or rlog.end_pending:
            raise SequencePendingError(
                f"{where} is {'open' if rlog.end_offset < 0 else 'sealed'} here with its end "
                f"not final yet: which batches it holds is not settled; ask again")
        end = rlog.end_offset
        if rlog.written_offset < end:
            raise SequencePendingError(
                f"{where} holds up to {rlog.written_offset} here, below its end {end}: ask "
                f"another replica")
        with self.guard(rlog):
            verdicts = [self.check(rlog, producer_id, seq) for seq in sequences]
        out = []
        for verdict in verdicts:
            if isinstance(verdict.error, (UnknownProducerError, InvalidRequestError)):
                raise verdict.error
            held = verdict.held
            out.append(held[0] if held is not None and held[1] <= end else -1)
        return out

    def forget(self, stream_id: int) -> None:
        """The stream was deleted here: drop its state."""
        with self._lock:
            for key in [k for k in self._states if k[0] == stream_id]:
                del self._states[key]
            for rkey in [k for k in self._ranges if k[0] == stream_id]:
                del self._ranges[rkey]
            self._last = None

    # -- inside ------------------------------------------------------------------------------

    def _range(self, rlog: ProducerLog) -> _RangeState:
        last = self._last  # one read: the pair is replaced whole, never changed
        if last is not None and last[0] is rlog:
            return last[1]
        rkey = (rlog.stream_id, rlog.range_index)
        state = self._ranges.get(rkey)  # a dict read is atomic: no lock on the hot path
        if state is None:
            with self._lock:
                state = self._ranges.get(rkey)
                if state is None:
                    state = self._ranges[rkey] = _RangeState()
        self._last = (rlog, state)
        return state

    def _load(self, rlog: ProducerLog, state: _RangeState) -> None:
        """Rebuild the range's producers from the batches of its log written within the
        expiry period (under the range's guard)."""
        now = _now_ms()
        batches = rlog.produced_since(now - int(self.limits.expiry_s * 1000))
        self.record(rlog, ((b.producer_id, b.sequence, b.base_offset,
                            b.base_offset + b.record_count) for b in batches), now)
        # Restarted: each producer's last append time is that of its last batch.
        for b in batches:
            found = state.producers.get(b.producer_id)
            if found is not None:
                found.last_ms = b.append_time_ms
        state.loaded = True

    def _bound(self, now: int) -> None:
        """Drop expired states and, past ``max_states``, the least recently used (under
        ``_lock``). A look over every state (at most ``max_states`` and the few just
        begun), once a second or when a new producer finds no room."""
        cutoff = now - int(self.limits.expiry_s * 1000)
        states = self._states
        expired = [key for key, state in states.items() if state.last_ms < cutoff]
        for key in expired:
            self._drop(key, states.pop(key), for_room=False)
        excess = len(states) - self.limits.max_states
        if excess > 0:
            # The least recently appended first; ties in the order the states began.
            for key, state in heapq.nsmallest(excess, states.items(),
                                              key=lambda item: item[1].last_ms):
                del states[key]
                self._drop(key, state, for_room=True)

    def _drop(self, key: tuple[int, int, int], state: _ProducerState, for_room: bool) -> None:
        rstate = self._ranges.get(key[:2])
        if rstate is None:
            return
        # Its range's guard is not held here: a dict change is atomic, and a check that
        # still saw the state judged by what was true a moment before.
        if rstate.producers.get(key[2]) is state:
            rstate.producers.pop(key[2], None)
        if for_room:
            # Dropped while active, to make room: the range can no longer tell a new
            # producer from one it forgot. (An expired one, idle for the expiry period,
            # sends nothing it sent before: its calls ended long ago.)
            rstate.complete = False


class Lookups:
    """LOOKUP_SEQUENCES on a range server: the range asked for among a stream's local ranges,
    the answer from ``Producers.lookup``."""

    def __init__(self, producers: Producers,
                 stream_ranges: Callable[[int], Sequence[ProducerLog]]) -> None:
        self._producers = producers
        self._stream_ranges = stream_ranges

    def answer(self, req: LookupSequencesRequest) -> LookupSequencesResponse:
        rid = req.range
        try:
            if rid is None or req.producer_id < 0:
                raise InvalidRequestError(
                    "LOOKUP_SEQUENCES needs a range and a producer_id >= 0")
            rlog = next((r for r in self._stream_ranges(rid.stream_id)
                         if r.range_index == rid.range_index), None)
            if rlog is None:
                raise RangeNotFoundError(
                    f"range {rid.stream_id}/{rid.range_index} is not on this server")
            offsets = self._producers.lookup(rlog, req.producer_id, req.sequences)
        except ServerError as exc:
            return LookupSequencesResponse(status=Status.from_error(exc))
        return LookupSequencesResponse(base_offsets=offsets)


def _settled(rlog: ProducerLog, held: Held, producer_id: int, sequence: int
             ) -> ServerError | None:
    """None when the batch held at ``held`` is part of the range for good (its resend may be
    answered with its base offset), else why not yet."""
    base, end = held
    if rlog.end_offset >= 0 and end > rlog.end_offset:
        return RangeSealedError(
            f"range {rlog.stream_id}/{rlog.range_index} was sealed at {rlog.end_offset}, "
            f"before producer {producer_id}'s batch {sequence} at {base}: it is not part of "
            f"the range")
    if end > rlog.readable_offset:
        return SequencePendingError(
            f"producer {producer_id}'s batch {sequence} is stored at {base} in range "
            f"{rlog.stream_id}/{rlog.range_index} but not settled yet (durable here and on "
            f"every replica); ask again")
    return None


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
