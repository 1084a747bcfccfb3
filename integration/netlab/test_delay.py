"""The delay line's model of a link (no network needed): when bytes arrive."""

from __future__ import annotations

import pytest

from integration.netlab.delay import PACED_PIECE, Wire


def test_without_a_cap_every_byte_arrives_one_delay_later():
    wire = Wire(one_way_s=0.025, rate_bps=None)
    [(due, data)] = wire.schedule(b"x" * 100_000, now=10.0)
    assert due == pytest.approx(10.025) and len(data) == 100_000


def test_a_cap_is_shared_by_every_connection_on_the_link():
    # 8 Mbit/s: a megabyte takes one second to cross. Two connections handing a megabyte each
    # to the link at the same moment finish after two seconds, not one (the link is one wire).
    wire = Wire(one_way_s=0.01, rate_bps=8e6)
    first = wire.schedule(b"a" * 1_000_000, now=0.0)
    second = wire.schedule(b"b" * 1_000_000, now=0.0)
    assert first[-1][0] == pytest.approx(1.0 + 0.01)
    assert second[-1][0] == pytest.approx(2.0 + 0.01)
    assert all(len(piece) <= PACED_PIECE for _, piece in first + second)
    # An idle link sends at once: bytes handed over later do not wait for the earlier ones.
    [(due, _)] = wire.schedule(b"c" * 1000, now=5.0)
    assert due == pytest.approx(5.0 + 0.001 + 0.01)
