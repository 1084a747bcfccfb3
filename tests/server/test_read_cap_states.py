"""The read cap as a state machine (sbp_spark/server/read_cap.py), by itself: its table, and
random event sequences checked against the rules readers rely on."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from sbp_spark.server.storage.read_cap import TRANSITIONS, CapEvent, CapState, ReadCap


def test_the_table_names_every_state_and_event():
    assert set(TRANSITIONS) == set(itertools.product(CapState, CapEvent))


def test_final_is_absorbing_and_fenced_never_reopens():
    for event in CapEvent:
        assert TRANSITIONS[(CapState.FINAL, event)] is CapState.FINAL
        assert TRANSITIONS[(CapState.FENCED, event)] in (CapState.FENCED, CapState.FINAL)


def test_restored_states():
    def state(replicas: int, end: int, final: bool) -> CapState:
        return ReadCap.restored(replicas, 10, end, final).state

    assert state(1, -1, False) is CapState.UNCAPPED
    assert state(3, -1, True) is CapState.CAPPED
    assert state(3, 20, False) is CapState.FENCED
    assert state(1, 20, False) is CapState.UNCAPPED
    assert state(3, 20, True) is CapState.FINAL
    # Nothing past the start is known to be on every replica after a restart.
    assert ReadCap.restored(3, 10, -1, True).visible(durable=50, end=-1) == 10
    assert ReadCap.restored(3, 10, 20, False).visible(durable=20, end=20) == 10


def test_a_fenced_range_shows_its_cap_not_its_end():
    cap = ReadCap(CapState.CAPPED, 0)
    cap.learn(96, stored=104)
    assert cap.fence(104) == 104
    assert cap.visible(durable=104, end=104) == 96
    cap.finalize(96)
    assert cap.visible(durable=104, end=96) == 96 and cap.cap is None


def test_the_primary_cap_stops_at_the_first_pending_append():
    cap = ReadCap(CapState.CAPPED, 0)
    cap.hold(0)
    cap.hold(8)
    cap.release(8, 16)  # the later append settled first
    assert cap.cap == 0
    cap.release(0, 8)
    assert cap.cap == 16
    cap.hold(16)
    cap.release(16, None)  # failed: nothing of it becomes visible
    assert cap.cap == 16 and not cap.pending


def test_notices_go_out_once_per_cap_and_only_while_quiet():
    cap = ReadCap(CapState.CAPPED, 0)
    cap.hold(0)
    assert cap.notice_due(durable=8) is None  # pending: the next forward carries the cap
    cap.release(0, 8)
    assert cap.notice_due(durable=8) == 8
    assert cap.notice_due(durable=8) is None
    cap.fence(8)
    assert cap.notice_due(durable=8) is None and cap.committed(8) == -1


def test_a_primary_fenced_with_appends_pending_ends_before_them_and_never_settles_them():
    cap = ReadCap(CapState.CAPPED, 0)
    cap.hold(0)
    assert cap.release(0, 8)
    cap.hold(8)
    cap.hold(16)
    # Sealed while two appends wait for the secondaries: the range ends where the first
    # begins, so a failover that counts this replica alone keeps neither of them ...
    assert cap.fence(24) == 8
    assert cap.fence(24) == 8  # a second seal changes nothing
    # ... and when their secondaries answer after all, neither may be acknowledged.
    assert not cap.release(8, 16)
    assert not cap.release(16, 24)
    assert cap.cap == 8 and not cap.pending


def test_a_primary_fenced_after_a_later_append_settled_keeps_the_earlier_ones():
    cap = ReadCap(CapState.CAPPED, 0)
    cap.hold(0)
    cap.hold(8)
    cap.hold(16)
    # The append at 8 settled (and may have been acknowledged) before the one at 0 did: the
    # secondaries hold everything below 16, so the range keeps both.
    assert cap.release(8, 16)
    assert cap.fence(24) == 16
    assert cap.release(0, 8)
    assert not cap.release(16, 24)
    assert cap.cap == 16


def test_the_pds_end_says_which_pending_appends_the_range_keeps():
    cap = ReadCap(CapState.CAPPED, 0)
    cap.hold(0)
    cap.hold(8)
    assert cap.fence(16) == 0
    # The PD ended the range at 8 (it could not reach this primary, and the secondary it
    # counted held the first append): that one is in the range after all, the second not.
    cap.finalize(8)
    assert cap.release(0, 8)
    assert not cap.release(8, 16)


def test_a_range_that_becomes_replicated_keeps_what_it_showed():
    cap = ReadCap(CapState.UNCAPPED, 0)
    assert cap.visible(durable=5, end=-1) == 5
    cap.replicas_changed(2, durable=5)
    assert cap.state is CapState.CAPPED and cap.visible(durable=9, end=-1) == 5


_OPS = st.one_of(
    st.tuples(st.just("replicas"), st.integers(1, 3)),
    st.tuples(st.just("learn"), st.integers(0, 60)),
    st.tuples(st.just("append"), st.integers(1, 8)),
    st.tuples(st.just("settle_first"), st.booleans()),
    st.tuples(st.just("probe"), st.integers(0, 60)),
    st.tuples(st.just("fence"), st.none()),
    st.tuples(st.just("finalize"), st.none()),
)


@settings(max_examples=400, deadline=None)
@given(start_state=st.sampled_from(list(CapState)), ops=st.lists(_OPS, max_size=40))
def test_random_histories_keep_the_promises(start_state, ops):
    """Whatever happens: the cap never goes down, never passes what every replica holds (what
    was stored and settled), a fenced range never shows more than its cap, and FINAL stays."""
    changes = []
    cap = ReadCap(start_state, 0, on_change=lambda: changes.append(1))
    written = 0  # what this replica stored
    on_all = 0  # what every replica is known to hold (the truth the cap must not pass)
    pending: list[tuple[int, int]] = []
    end = -1 if start_state in (CapState.UNCAPPED, CapState.CAPPED) else 0
    seen_cap = cap.cap
    for op, arg in ops:
        state_before = cap.state
        if op == "replicas":
            cap.replicas_changed(arg, durable=on_all)
        elif op == "learn":
            # A primary only ever reports what every replica holds.
            cap.learn(min(arg, on_all), stored=written)
        elif op == "append" and end < 0:
            cap.hold(written)
            pending.append((written, written + arg))
            written += arg
        elif op == "settle_first" and pending:
            first, last = pending.pop(0)
            if arg:
                on_all = max(on_all, last)
                cap.release(first, last)
            else:
                cap.release(first, None)
                on_all = max(on_all, first)
        elif op == "probe" and not pending:
            on_all = max(on_all, min(arg, written))
            cap.settle(on_all)
        elif op == "fence" and end < 0:
            end = cap.fence(written)
            # It ends before every pending append (none of them is part of the range), but
            # never below what every replica holds.
            assert end == (max(pending[0][0], min(on_all, written)) if pending else written)
        elif op == "finalize" and end >= 0:
            end = min(end, on_all) if cap.capped else end
            cap.finalize(end)
        if state_before is CapState.FINAL:
            assert cap.state is CapState.FINAL
        if state_before is CapState.FENCED:
            assert cap.state in (CapState.FENCED, CapState.FINAL)
        if cap.cap is not None:
            if seen_cap is not None:  # capped before and after: it only rises
                assert cap.cap >= seen_cap
            assert cap.cap <= max(on_all, 0), (op, arg, cap.cap, on_all)
            if pending:
                assert cap.cap <= pending[0][0]
            assert cap.visible(durable=written, end=end) <= cap.cap
        seen_cap = cap.cap
