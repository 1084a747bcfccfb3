"""A hook into what a running PD pushes to its range servers, for tests of the races a push
takes part in.

The PD's pushes reach range servers through one small interface, ``pd.pushes.PushLink``;
``hook_syncs`` puts a fake of it in front of the real one that runs a test's code before each
SYNC_RANGES (to hold it, or to let another request overtake it), then sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sbp_spark.protocol import messages as m
from sbp_spark.server.pd import PlacementDriver
from sbp_spark.server.pd.meta import RangeMeta
from sbp_spark.server.pd.pushes import PushLink


class SyncHook:
    """``link`` with ``before(server_id, ranges)`` run ahead of each SYNC_RANGES."""

    def __init__(self, link: PushLink,
                 before: Callable[[int, Sequence[RangeMeta]], None]) -> None:
        self._link = link
        self._before = before

    def sync(self, server_id: int, ranges: Sequence[RangeMeta],
             timeout_s: float | None = None) -> None:
        self._before(server_id, ranges)
        self._link.sync(server_id, ranges, timeout_s)

    def delete_streams(self, server_id: int, streams: Sequence[m.Stream],
                       timeout_s: float | None = None) -> None:
        self._link.delete_streams(server_id, streams, timeout_s)


def hook_syncs(pd: PlacementDriver | None, before: Callable[[int, Sequence[RangeMeta]], None],
               monkeypatch) -> None:
    """Run ``before`` ahead of every SYNC_RANGES ``pd`` sends, for the rest of the test."""
    assert pd is not None, "the cluster is not running"
    monkeypatch.setattr(pd.pushes, "link", SyncHook(pd.pushes.link, before))
