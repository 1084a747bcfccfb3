"""Blocking SBP client: connections, the connection pool, retries, and the PD, range-server and
stream-level APIs. No Spark here."""

from ..transport.tls import TlsConfig
from .config import DEFAULT_FETCH_MAX_BYTES, ClientConfig
from .connection import Connection, ResponseStream, parse_address
from .heartbeat import Heartbeat
from .pd import PdClient, parse_pd_addresses
from .pool import ConnectionPool, close_pool, get_pool
from .range_server import BatchLike, FetchChunk, RangeServerClient
from .retry import Retrier, call_with_retries, is_retriable
from .stream import ResendCheck, SbpClient, StreamWriter, known_range
from .types import Appended, FetchedBatch, ItemResult, Replica

__all__ = [
    "DEFAULT_FETCH_MAX_BYTES",
    "Appended",
    "BatchLike",
    "ClientConfig",
    "Connection",
    "ConnectionPool",
    "FetchChunk",
    "FetchedBatch",
    "Heartbeat",
    "ItemResult",
    "PdClient",
    "RangeServerClient",
    "Replica",
    "ResendCheck",
    "ResponseStream",
    "Retrier",
    "SbpClient",
    "StreamWriter",
    "TlsConfig",
    "call_with_retries",
    "close_pool",
    "get_pool",
    "is_retriable",
    "known_range",
    "parse_address",
    "parse_pd_addresses",
]
