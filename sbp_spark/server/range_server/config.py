"""The settings of one range server (``RangeServerConfig``) and the limits they are held to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...protocol.constants import MAX_BATCH_BYTES
from ..advertise import advertised_host, check_advertised
from ..auth.authenticator import AuthSettings
from ..net import NetConfig
from ..peer_tls import check_peer_tls
from ..storage import StorageConfig
from .fetch import DEFAULT_FETCH_FRAME_BYTES
from .producers import ProducerLimits

# How often retention is applied to the stored ranges.
DEFAULT_RETENTION_CHECK_S = 30.0


@dataclass
class RangeServerConfig:
    """Everything a range server needs to run."""

    data_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    # host:port that clients should use, when it differs from the bound address (containers);
    # or only the host, with the bound port (see advertise.py). Neither: the bound address.
    advertise_addr: str | None = None
    advertise_host: str | None = None
    # Fixed server id (tests, standalone use). -1: the id stored in data_dir, else one
    # allocated by the PD (needs pd_addresses).
    server_id: int = -1
    pd_addresses: Sequence[str] = ()
    storage: StorageConfig = field(default_factory=StorageConfig)
    net: NetConfig = field(default_factory=lambda: NetConfig(name="range-server"))
    fetch_frame_bytes: int = DEFAULT_FETCH_FRAME_BYTES
    max_batch_bytes: int = MAX_BATCH_BYTES
    heartbeat_interval_s: float = 1.0
    metrics_interval_s: float = 5.0
    # Prometheus metrics over HTTP on this port (0: a free one; None: not served), on
    # metrics_host (None: the host the server listens on).
    metrics_port: int | None = None
    metrics_host: str | None = None
    retention_check_interval_s: float = DEFAULT_RETENTION_CHECK_S
    # After a restart: how often to ask unreachable secondaries again for their stored ends
    # (the cap probe, see replication.py).
    cap_probe_interval_s: float = 2.0
    # Who may connect and as whom, and the token this server presents to the PD and to its
    # peers (docs/wire.md, "Who may do what"); the default: the cluster is open.
    auth: AuthSettings = field(default_factory=AuthSettings)
    # The bounds of the idempotent producers' state (producers.py states the rule).
    producers: ProducerLimits = field(default_factory=ProducerLimits)

    def __post_init__(self) -> None:
        if not 0 < self.max_batch_bytes <= MAX_BATCH_BYTES:
            raise ValueError(
                f"max_batch_bytes={self.max_batch_bytes} must be in [1, {MAX_BATCH_BYTES}]")
        if not 4096 <= self.fetch_frame_bytes <= MAX_BATCH_BYTES:
            raise ValueError(
                f"fetch_frame_bytes={self.fetch_frame_bytes} must be in "
                f"[4096, {MAX_BATCH_BYTES}]")
        for name in ("heartbeat_interval_s", "metrics_interval_s",
                     "retention_check_interval_s", "cap_probe_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        check_advertised(self.host, self.advertise_addr, self.advertise_host, "range server")
        # The PD and primaries call this server at its advertised host.
        check_peer_tls(self.net.tls, advertised_host(self.host, self.advertise_addr,
                                                     self.advertise_host), "range server")
        if self.server_id < -1:
            raise ValueError(f"server_id={self.server_id} must be >= 0, or -1 for automatic")
