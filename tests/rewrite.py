"""Forcing a rewritten history, to test that readers notice it.

Our PD never ends a range below a record a reader saw (docs/reliability.md). A broken peer, or
a bug like issue 22's, could: ``rewrite_history`` makes the PD of an embedded cluster seal a
stream's open range at an offset below what it holds, as such a failover would, and open the
next range there. It hands the PD's seal-then-open-next (``Succession``) an end no replica
reported, on purpose: no request can ask for this.
"""

from __future__ import annotations

from sbp_spark.server.cluster import EmbeddedCluster


def rewrite_history(cluster: EmbeddedCluster, stream_id: int, end_offset: int) -> None:
    """End the open range of ``stream_id`` at ``end_offset`` and open its successor there."""
    pd = cluster.pd
    assert pd is not None
    with pd.locks.hold(stream_id):
        last = pd.store.last_range(stream_id)
        assert last.is_open, f"stream {stream_id}'s last range is already sealed"
        done = pd.succession.seal_and_open_next(last, end_offset)
    assert done.opened is not None, done.unplaced
