"""How far readers of one local range may see: the range's read cap, as a state machine.

A record may be shown to a reader only once it can never disappear. Here that means: durable on
this replica and, for a range with more than one replica, known to be on **every** replica (the
high-watermark rule). The PD ends a range, after a failover, at the smallest end its surviving
replicas hold, so a record that one replica holds and another does not may be cut away.

States (``CapState``):

* ``UNCAPPED``: the range has one replica: readers see every durable record, and once it is
  sealed, everything up to its end (this replica's end is the range's end).
* ``CAPPED``: open and replicated: readers see up to the cap, the end of the prefix known to be
  on every replica. The cap only rises: on the primary as its secondaries store appends, on a
  secondary as the primary tells it (forwards and cap notices).
* ``FENCED``: sealed here (no more appends) but the PD has not recorded the range's end yet.
  The cap still rules: the PD may end the range below what this replica holds (another
  replica holds less), and a reader must never see a record the final range does not contain.
* ``FINAL``: the PD recorded the range's end; readers see up to it.

Every (state, event) pair is in ``TRANSITIONS``; an event that does not apply in a state leaves
it where it is, as the table says. ``ReadCap`` also keeps the primary's own bookkeeping of
appends sent to the secondaries but not yet stored by all of them (``hold``/``release``): the
cap never passes the start of the first such append.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class CapState(enum.Enum):
    UNCAPPED = "uncapped"
    CAPPED = "capped"
    FENCED = "fenced"
    FINAL = "final"


class CapEvent(enum.Enum):
    REPLICATED = "replicated"  # the range now has two or more replicas
    UNREPLICATED = "unreplicated"  # it has one replica (or none known)
    RAISE = "raise"  # every replica is known to hold a longer prefix
    FENCE = "fence"  # sealed here: no more appends
    FINALIZE = "finalize"  # the PD recorded the range's end


_U, _C, _F, _X = CapState.UNCAPPED, CapState.CAPPED, CapState.FENCED, CapState.FINAL
_E = CapEvent

# (state, event) -> next state. Events whose offset matters (RAISE) only move the cap in the
# states that have one (CAPPED, FENCED).
TRANSITIONS: dict[tuple[CapState, CapEvent], CapState] = {
    (_U, _E.REPLICATED): _C,
    (_U, _E.UNREPLICATED): _U,
    (_U, _E.RAISE): _U,  # nothing to raise: every durable record is visible
    (_U, _E.FENCE): _U,  # one replica: its end is the range's end
    (_U, _E.FINALIZE): _X,
    (_C, _E.REPLICATED): _C,
    (_C, _E.UNREPLICATED): _U,
    (_C, _E.RAISE): _C,
    (_C, _E.FENCE): _F,
    (_C, _E.FINALIZE): _X,
    # Fenced: which records the range keeps is the PD's decision now; the replica set no
    # longer matters, and appends still settling may raise the cap (they reached every replica
    # before it was sealed, so the PD's end holds them).
    (_F, _E.REPLICATED): _F,
    (_F, _E.UNREPLICATED): _F,
    (_F, _E.RAISE): _F,
    (_F, _E.FENCE): _F,
    (_F, _E.FINALIZE): _X,
    # Final: the end the PD recorded rules; late evidence about the open range is stale.
    (_X, _E.REPLICATED): _X,
    (_X, _E.UNREPLICATED): _X,
    (_X, _E.RAISE): _X,
    (_X, _E.FENCE): _X,
    (_X, _E.FINALIZE): _X,
}

_HAS_CAP = frozenset({CapState.CAPPED, CapState.FENCED})


class ReadCap:
    """The read cap of one local range (thread-safe). ``on_change`` runs, outside the lock,
    whenever what readers may see could have grown (long polls wake up on it)."""

    def __init__(self, state: CapState, cap: int, on_change: Callable[[], None] = lambda: None
                 ) -> None:
        self._lock = threading.Lock()
        self._state = state
        self._cap = cap
        self._on_change = on_change
        # Primary only: where the appends sent to the secondaries and not yet stored by all of
        # them begin, and the end of the prefix every replica is known to hold (None until the
        # first append of this process).
        self._pending: set[int] = set()
        self._settled: int | None = None
        # Primary only: the highest cap sent to the secondaries (forward or notice).
        self._sent = -1
        # Where the range was fenced here (``fence``), or None while it takes appends: an
        # append still pending then ends past it, and can no longer settle.
        self._fenced_at: int | None = None

    @classmethod
    def restored(cls, replicas: int, start: int, end: int, final: bool,
                 on_change: Callable[[], None] = lambda: None) -> ReadCap:
        """The cap of a range as found on disk. Nothing past the start is known to be on every
        replica after a restart, so a replicated range that is not final starts capped there."""
        if end >= 0 and final:
            state = CapState.FINAL
        elif replicas < 2:
            state = CapState.UNCAPPED
        else:
            state = CapState.FENCED if end >= 0 else CapState.CAPPED
        return cls(state, start, on_change)

    # -- what readers see ----------------------------------------------------------------------

    @property
    def state(self) -> CapState:
        return self._state

    @property
    def capped(self) -> bool:
        """Whether a cap limits readers (CAPPED or FENCED)."""
        return self._state in _HAS_CAP

    @property
    def cap(self) -> int | None:
        """The cap, or None where none applies (UNCAPPED, FINAL)."""
        return self._cap if self._state in _HAS_CAP else None

    def visible(self, durable: int, end: int) -> int:
        """The offset after the last record readers may see, given the offset after the last
        durable record here and the range's end (-1 while open)."""
        state = self._state
        if state in _HAS_CAP:
            return min(durable, self._cap)
        if end >= 0:
            return end
        return durable

    # -- events -----------------------------------------------------------------------------

    def _apply(self, event: CapEvent, offset: int | None = None) -> bool:
        """Move by ``TRANSITIONS`` (under the lock); RAISE lifts the cap to ``offset`` where a
        cap applies. True when readers may now see more."""
        before = self._state
        self._state = TRANSITIONS[(before, event)]
        if event is CapEvent.RAISE and self._state in _HAS_CAP and offset is not None \
                and offset > self._cap:
            self._cap = offset
            return True
        return self._state is not before

    def _changed(self, moved: bool) -> bool:
        if moved:
            self._on_change()
        return moved

    def replicas_changed(self, count: int, durable: int) -> None:
        """The range now has ``count`` replicas. A range that becomes replicated keeps showing
        what it showed (``durable``) and nothing more until every replica is known to hold it."""
        with self._lock:
            event = CapEvent.REPLICATED if count >= 2 else CapEvent.UNREPLICATED
            if self._state is CapState.UNCAPPED and event is CapEvent.REPLICATED:
                self._cap = durable
            moved = self._apply(event)
        self._changed(moved)

    def learn(self, offset: int, stored: int) -> bool:
        """A secondary learns from its primary that every replica holds the range below
        ``offset``: the cap rises there, never above what is ``stored`` here. True when it
        moved."""
        with self._lock:
            moved = self._apply(CapEvent.RAISE, min(offset, stored))
        return self._changed(moved)

    def fence(self, written: int) -> int:
        """The range is sealed here, its records written up to ``written``: where it ends
        here, which is not final until the PD records it.

        On a primary, that is the start of the first append still pending (sent to the
        secondaries, not yet known to be stored by all of them), if any: the PD ends the
        range at the smallest end its replicas report, and an append past that end is not
        part of the range. Such an append can no longer settle (``release`` says so), so its
        writer is told it failed and sends it again, and it lands once. Ending here at
        ``written`` instead would let a failover that counts only this replica (its
        secondary died) keep an append whose writer is then told it failed: the resend would
        store it twice.

        Never below what every replica is known to hold (``_settled``): appends settle out of
        order, and one that settled (and may have been acknowledged) shows that every append
        before it reached every secondary too (each secondary's log is a prefix of this
        one's), so those still pending below it are kept and settle as usual."""
        with self._lock:
            if self._fenced_at is None:
                end = written
                if self._pending:
                    end = min(min(self._pending), end)
                    if self._settled is not None:
                        end = min(max(end, self._settled), written)
                self._fenced_at = end
            self._apply(CapEvent.FENCE)
            return self._fenced_at

    def finalize(self, end: int) -> None:
        """The PD recorded the range's end at ``end``: readers see up to it from now on."""
        with self._lock:
            shown = self._cap if self._state in _HAS_CAP else None
            # The range's end now: nothing past it settles from now on, and whatever is
            # below it is in the range (``release``).
            self._fenced_at = end
            self._apply(CapEvent.FINALIZE)
        if shown is not None and end < shown:
            # The PD ends ranges at or above every replica's cap; this breaks that promise.
            log.error("the PD ended a range at %d, below the %d its readers here could see",
                      end, shown)
        self._on_change()

    # -- the primary's appends ---------------------------------------------------------------

    def hold(self, start: int) -> None:
        """An append at ``start`` is about to be stored and sent to the secondaries: readers
        stop there until ``release(start, ...)``."""
        with self._lock:
            self._pending.add(start)
            if self._settled is None:
                # First append since this process opened the range: only the cap (the range's
                # start after a restart) is known to be on every replica, not ``start``.
                self._settled = min(self._cap, start) if self._state in _HAS_CAP else start
            moved = self._settle_locked()
        self._changed(moved)

    def release(self, start: int, end: int | None) -> bool:
        """The append held at ``start`` settled: every secondary stored it up to ``end``, or
        (``end`` None) it was not stored or not replicated: nothing of it becomes visible.
        False when it ends past where the range was fenced here (``fence``) or ended by the
        PD (``finalize``): it is not part of the range, however many replicas stored it, and
        must not be acknowledged. On a sealed range, True says the range keeps it."""
        with self._lock:
            self._pending.discard(start)
            kept = False
            if end is not None and (self._fenced_at is None or end <= self._fenced_at):
                kept = True
                if self._settled is not None:
                    self._settled = max(self._settled, end)
            moved = self._settle_locked()
        self._changed(moved)
        return kept

    def settle(self, end: int) -> bool:
        """Every replica holds the range below ``end`` (a restarted primary asked them): readers
        may see that far once no earlier append is pending. True when the cap moved."""
        with self._lock:
            self._settled = end if self._settled is None else max(self._settled, end)
            moved = self._settle_locked()
        return self._changed(moved)

    def _settle_locked(self) -> bool:
        if self._settled is None:
            return False
        cap = min(min(self._pending), self._settled) if self._pending else self._settled
        return self._apply(CapEvent.RAISE, cap)

    @property
    def pending(self) -> bool:
        """Whether an append was sent to the secondaries and has not settled."""
        return bool(self._pending)

    def committed(self, durable: int) -> int:
        """The cap to tell the secondaries (bounded by what is ``durable`` here), or -1 when the
        open range has none."""
        with self._lock:
            return min(self._cap, durable) if self._state is CapState.CAPPED else -1

    def note_sent(self, committed: int) -> None:
        """``committed`` went to the secondaries (on a forward or in a notice)."""
        with self._lock:
            self._sent = max(self._sent, committed)

    def notice_due(self, durable: int) -> int | None:
        """The cap to send the secondaries in a notice now, or None: an append is pending (its
        forward or the next one carries the cap), or they already have this cap."""
        with self._lock:
            if self._pending or self._state is not CapState.CAPPED:
                return None
            committed = min(self._cap, durable)
            if committed <= self._sent:
                return None
            self._sent = committed
            return committed
