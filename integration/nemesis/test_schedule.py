"""The nemesis's schedule: the same seed gives the same faults, and every fault keeps to its
kind's limits and its domain."""

from __future__ import annotations

import pytest

from .schedule import DOMAINS, GAP_S, KINDS, plan


def test_a_seed_gives_the_same_schedule_every_time():
    assert plan(1234, 5) == plan(1234, 5)
    assert plan(1234, 5) != plan(1235, 5)


def test_a_longer_run_begins_with_a_shorter_runs_faults():
    short, long = plan(7, 2), plan(7, 60)
    for domain in DOMAINS:
        assert long[domain][:len(short[domain])] == short[domain]


def test_each_domain_fills_the_run_with_its_own_kinds_within_their_limits():
    sequences = plan(99, 30)
    assert set(sequences) == set(DOMAINS)
    for domain, items in sequences.items():
        assert sum(p.gap_s + p.duration_s for p in items) >= 30 * 60
        assert [p.number for p in items] == list(range(1, len(items) + 1))
        for p in items:
            kind = KINDS[p.kind]
            assert kind.domain == domain == p.domain
            assert kind.duration_s[0] <= p.duration_s <= kind.duration_s[1]
            assert GAP_S[0] <= p.gap_s <= GAP_S[1]
    # Over half an hour every kind comes up.
    assert {p.kind for items in sequences.values() for p in items} == set(KINDS)


def test_pauses_last_one_to_eight_seconds():
    assert all(1.0 <= p.duration_s <= 8.0 for items in plan(5, 60).values() for p in items
               if p.kind.startswith("pause-"))


def test_a_run_needs_some_minutes():
    with pytest.raises(ValueError, match="minutes=0"):
        plan(1, 0)
