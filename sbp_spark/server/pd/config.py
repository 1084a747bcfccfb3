"""How a PD node is set up: where it keeps its metadata and listens, and its timing rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..advertise import check_advertised
from ..auth.authenticator import AuthSettings
from ..net import NetConfig
from ..peer_tls import check_peer_tls
from .etcd_store import DEFAULT_PREFIX
from .leader import DEFAULT_LEASE_TTL_S

# Range servers heartbeat this often by default; the PD's liveness timeout is a multiple of it.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
# A range server is presumed dead after this many missed heartbeat intervals: one late
# heartbeat (a GC pause, a busy core) must not make the PD route around a healthy server.
MISSED_HEARTBEATS_BEFORE_DEAD = 3
DEFAULT_HEARTBEAT_TIMEOUT_S = MISSED_HEARTBEATS_BEFORE_DEAD * DEFAULT_HEARTBEAT_INTERVAL_S
# Bound on one call from the PD to a range server when the request carries no timeout_ms. Long
# enough for a seal behind a slow fsync, short enough that an admin call on a hung server fails.
DEFAULT_RANGE_SERVER_TIMEOUT_S = 10.0


@dataclass
class PdConfig:
    """Where the PD keeps its data and listens, and its timing rules."""

    # Where the SQLite metadata lives (unused with ``etcd``).
    data_dir: str | Path | None
    host: str = "127.0.0.1"
    port: int = 0
    # host:port that clients should use, when it differs from the bound address (containers);
    # or only the host, with the bound port (see advertise.py). Neither: the bound address.
    advertise_addr: str = ""
    advertise_host: str = ""
    name: str = "pd-1"
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    range_server_timeout_s: float = DEFAULT_RANGE_SERVER_TIMEOUT_S
    fsync: bool = True
    net: NetConfig | None = field(default=None, repr=False)
    # etcd client endpoints (host:port): the metadata lives there and this PD is one node of a
    # cluster that elects its leader there; empty: a lone PD on SQLite in data_dir.
    etcd: Sequence[str] = ()
    # Keys of this cluster in etcd start with this (several clusters may share one etcd).
    etcd_prefix: str = DEFAULT_PREFIX
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    # Prometheus metrics over HTTP on this port (0: a free one; None: not served), on
    # metrics_host (None: the host the PD listens on).
    metrics_port: int | None = None
    metrics_host: str | None = None
    # Who may connect and as whom (docs/wire.md, "Who may do what"); the default: nobody
    # authenticates, the cluster is open.
    auth: AuthSettings = field(default_factory=AuthSettings)

    def __post_init__(self) -> None:
        if not self.etcd and not self.data_dir:
            raise ValueError("PdConfig needs a data_dir (SQLite metadata) or etcd endpoints")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(
                f"PdConfig.heartbeat_timeout_s={self.heartbeat_timeout_s!r} must be > 0")
        if self.range_server_timeout_s <= 0:
            raise ValueError(
                f"PdConfig.range_server_timeout_s={self.range_server_timeout_s!r} must be > 0")
        check_advertised(self.host, self.advertise_addr, self.advertise_host,
                         f"PD {self.name}")
        # Range servers may dial the PD by another name than it advertises (a load balancer):
        # its name is not checked, only what the servers check of each other's certificates.
        check_peer_tls(self.net.tls if self.net is not None else None, None, f"PD {self.name}")
