"""Blocking SBP client: connections, the connection pool, retries, and the PD, range-server and
stream-level APIs. No Spark here."""

from .config import DEFAULT_FETCH_MAX_BYTES, ClientConfig
from .connection import Connection, ResponseStream, parse_address
from .heartbeat import Heartbeat
from .pool import ConnectionPool, close_pool, get_pool
from .retry import call_with_retries, is_retriable

__all__ = [
    "DEFAULT_FETCH_MAX_BYTES",
    "ClientConfig",
    "Connection",
    "ConnectionPool",
    "Heartbeat",
    "ResponseStream",
    "call_with_retries",
    "close_pool",
    "get_pool",
    "is_retriable",
    "parse_address",
]
