"""Blocking SBP client: connections, the connection pool, retries, and the PD, range-server and
stream-level APIs. No Spark here."""

from ..transport.tls import TlsConfig
from .config import DEFAULT_FETCH_MAX_BYTES, ClientConfig
from .connection import Connection, ResponseStream, parse_address
from .heartbeat import Heartbeat
from .pd import PdClient, parse_pd_addresses
from .pool import ConnectionPool, close_pool, get_pool
from .range_server import BatchLike, FetchChunk, RangeServerClient
from .replicas import known_range
from .retry import Retrier, is_retriable
from .sbp_client import SbpClient
from .types import Appended, FetchedBatch, ItemResult, ReplicaLocation
from .writer import ResendCheck, StreamWriter

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
    "ReplicaLocation",
    "ResendCheck",
    "ResponseStream",
    "Retrier",
    "SbpClient",
    "StreamWriter",
    "TlsConfig",
    "close_pool",
    "get_pool",
    "is_retriable",
    "known_range",
    "parse_address",
    "parse_pd_addresses",
]
