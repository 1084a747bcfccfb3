"""The range server: stores the ranges the PD gives it and serves APPEND and FETCH for them
(``server.py`` holds the server itself)."""

from __future__ import annotations

from .config import RangeServerConfig
from .server import RangeServer

__all__ = ["RangeServer", "RangeServerConfig"]
