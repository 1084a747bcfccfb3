"""sbp_spark.server.pd: the placement driver (PD), owner of stream and range metadata.

``PlacementDriver`` (``driver.py``) and ``PdConfig`` load on first use, so the small modules of
this package (``etcd_store`` for the CLI's defaults, ``meta`` for the range server's PD link)
import without the whole PD.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .driver import DEFAULT_HEARTBEAT_INTERVAL_S, PdConfig, PlacementDriver

__all__ = ["DEFAULT_HEARTBEAT_INTERVAL_S", "PdConfig", "PlacementDriver"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".driver", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
