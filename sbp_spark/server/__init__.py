"""sbp_spark.server: the reference SBP cluster (PD, range servers, launchers).

``EmbeddedCluster`` and ``ProcessCluster`` load on first use, so small parts of this package
(``storage``'s settings for the CLI's defaults) import without the whole server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cluster import EmbeddedCluster, ProcessCluster

__all__ = ["EmbeddedCluster", "ProcessCluster"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
