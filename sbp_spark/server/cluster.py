"""Launchers: a whole cluster inside this process, or each role in its own process.

``EmbeddedCluster`` runs one PD and N range servers as threads of the calling process, on
loopback ports. It is what tests, demos and ``sbp server`` use::

    with EmbeddedCluster("/tmp/sbp", range_servers=3) as cluster:
        client = SbpClient(cluster.pd_address)

``ProcessCluster`` runs ``sbp pd`` and ``sbp range-server`` as child processes, so a test can
kill one with SIGKILL and start it again on the same data directory. With ``pd_nodes=N`` it
runs a PD cluster instead of one PD: a local etcd (``etcd_members`` members, or an etcd given
by its endpoints) and N ``sbp pd --etcd`` nodes that elect their leader there. Each role may
run on a host of its own (a ``Placement``: the address it listens on and a command prefix that
starts it there, such as ``ip netns exec NS`` for a network namespace).

Layout of a cluster's data directory: ``pd/`` (the PD's SQLite metadata), or ``etcd/`` (the
local etcd members' data), and ``rs-<i>/`` for range server ``i``. A range server keeps its
server id in its own directory, so restarting it there brings back the same server with the
same ranges.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbp_spark.client.config import ClientConfig
from sbp_spark.client.connection import Connection
from sbp_spark.protocol.errors import SbpError
from sbp_spark.transport.tls import TlsConfig

from .advertise import check_advertised
from .auth.authenticator import AuthSettings
from .etcd_process import LocalEtcd
from .net import NetConfig
from .pd import DEFAULT_HEARTBEAT_INTERVAL_S, PdConfig, PlacementDriver
from .range_server import RangeServer, RangeServerConfig
from .storage import (
    DEFAULT_FSYNC_INTERVAL_MS,
    DEFAULT_PAGE_CACHE_BYTES,
    FsyncPolicy,
    StorageConfig,
)

log = logging.getLogger(__name__)

# How long start-up may take before a launcher gives up: covers a cold interpreter, storage
# recovery of a large data directory and a few missed heartbeats.
DEFAULT_START_TIMEOUT_S = 60.0
# A PD declares a range server dead after this many heartbeat intervals without one.
_MISSED_HEARTBEATS = 3
# Grace period for a child process between SIGTERM and SIGKILL.
DEFAULT_STOP_TIMEOUT_S = 15.0


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def accepts_connections(address: str, timeout_s: float = 2.0,
                        config: ClientConfig | None = None) -> bool:
    """True when a server at ``address`` answers a PING (sent with ``config``: TLS...)."""
    try:
        with Connection(address, config) as conn:
            conn.ping(timeout=timeout_s)
        return True
    except SbpError:
        return False


def write_ready_file(path: str | Path, info: dict[str, Any]) -> None:
    """Write ``info`` as JSON to ``path`` atomically: readers never see half a file."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info, indent=None) + "\n")
    os.replace(tmp, target)


def _fsync_policy(fsync: FsyncPolicy | str | bool) -> FsyncPolicy:
    if fsync is True:
        return FsyncPolicy.ALWAYS
    if fsync is False:
        return FsyncPolicy.NEVER
    try:
        return FsyncPolicy(fsync)
    except ValueError:
        allowed = ", ".join(p.value for p in FsyncPolicy)
        raise ValueError(f"fsync={fsync!r} is not one of {allowed}") from None


class EmbeddedCluster:
    """A PD and ``range_servers`` range servers running in this process.

    ``fsync`` is the range servers' policy (``"group"``, ``"always"``, ``"interval"``,
    ``"never"``, or a bool: ``always``/``never``; see ``durability.py``) and
    ``fsync_interval_ms`` its interval; the PD syncs its metadata commits unless it is
    ``"never"``. ``pd_port`` fixes the
    PD's port (0 = any free port). Range servers take free ports; after a restart each one
    tries its previous port first. ``tls`` puts every port behind TLS (mutual TLS when it
    names a CA file); the servers then call each other with its certificate.
    ``page_cache_bytes`` bounds how much freshly written data each range server leaves in the
    OS page cache (``StorageConfig.page_cache_bytes``; 0: no bound). ``advertise_host`` is the
    host clients are told to use with each server's port (see advertise.py); it is required
    when ``host`` is a wildcard such as ``0.0.0.0``. ``metrics_port`` serves Prometheus
    metrics (``metrics_http.py``): the PD's on that port, range server ``i``'s on the port
    ``i + 1`` above it (0: every one on a free port; None: none served). ``auth`` says who
    may connect and as whom, on every server alike (docs/wire.md, "Who may do what";
    default: open).
    """

    def __init__(self, data_dir: str | Path, range_servers: int = 1, host: str = "127.0.0.1",
                 fsync: FsyncPolicy | str | bool = FsyncPolicy.GROUP, pd_port: int = 0,
                 heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 tls: TlsConfig | None = None,
                 page_cache_bytes: int = DEFAULT_PAGE_CACHE_BYTES,
                 fsync_interval_ms: int = DEFAULT_FSYNC_INTERVAL_MS,
                 advertise_host: str | None = None, metrics_port: int | None = None,
                 auth: AuthSettings | None = None) -> None:
        if not isinstance(range_servers, int) or range_servers < 0:
            raise ValueError(f"range_servers={range_servers!r} must be an integer >= 0")
        check_advertised(host, None, advertise_host, "embedded cluster", whole_address=False)
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s={heartbeat_interval_s!r} must be > 0")
        if not 0 <= pd_port <= 65535:
            raise ValueError(f"pd_port={pd_port!r} must be in 0..65535")
        self.data_dir = Path(data_dir)
        self.host = host
        self.advertise_host = advertise_host or ""
        self.fsync = _fsync_policy(fsync)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.start_timeout_s = start_timeout_s
        self.tls = tls
        self.auth = auth if auth is not None else AuthSettings()
        self.storage = StorageConfig(fsync=self.fsync, fsync_interval_ms=fsync_interval_ms,
                                     page_cache_bytes=page_cache_bytes)
        if metrics_port is not None and not 0 <= metrics_port <= 65535 - range_servers:
            raise ValueError(f"metrics_port={metrics_port!r} must be in 0..65535 with room "
                             f"for the {range_servers} range servers' ports above it")
        self._metrics_port = metrics_port
        self._pd_port = pd_port
        self._count = range_servers
        self._ports: list[int] = [0] * range_servers
        self.pd: PlacementDriver | None = None
        self.range_servers: list[RangeServer | None] = [None] * range_servers
        # Range servers whose registration start() or start_range_server() is waiting for: a
        # PD's refusal of their id is raised from there (see ``_on_refusal``).
        self._awaited: set[int] = set()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> EmbeddedCluster:
        """Start the PD, then every range server; return once all of them serve."""
        if self.pd is not None:
            raise RuntimeError("cluster already started")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.pd = PlacementDriver(PdConfig(
                self.data_dir / "pd", host=self.host, port=self._pd_port,
                advertise_host=self.advertise_host,
                fsync=self.fsync is not FsyncPolicy.NEVER,
                heartbeat_timeout_s=_MISSED_HEARTBEATS * self.heartbeat_interval_s,
                net=NetConfig(tls=self.tls), metrics_port=self._metrics_port,
                auth=self.auth)).start()
            # A restart comes back on the same PD port, so addresses held by clients stay good.
            self._pd_port = int(self.pd.bound_address.rsplit(":", 1)[1])
            for i in range(self._count):
                self._launch_range_server(i)
            for i in range(self._count):
                self._wait_registered(i)
        except BaseException:
            self._awaited.clear()
            self.stop()
            raise
        log.info("embedded cluster up: PD %s, range servers %s", self.pd_address,
                 ", ".join(self.range_server_addresses) or "none")
        return self

    def stop(self) -> None:
        """Stop every range server, then the PD (each gracefully)."""
        for i in range(self._count):
            self.stop_range_server(i)
        if self.pd is not None:
            pd, self.pd = self.pd, None
            pd.stop()

    def restart(self) -> None:
        """Stop everything and start it again on the same data directory."""
        self.stop()
        self.start()

    def __enter__(self) -> EmbeddedCluster:
        if self.pd is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def metrics_addresses(self) -> dict[str, object]:
        """Where Prometheus metrics are served (``metrics_port``): ``{"pd": host:port,
        "range_servers": [host:port of each running one]}``; empty when none are."""
        if self._metrics_port is None or self.pd is None or self.pd.metrics_server is None:
            return {}
        return {"pd": self.pd.metrics_server.address,
                "range_servers": [rs.metrics_server.address for rs in self.range_servers
                                  if rs is not None and rs.metrics_server is not None]}

    # -- range servers ----------------------------------------------------------------------

    def stop_range_server(self, i: int) -> None:
        """Stop range server ``i`` gracefully (no-op if it is not running)."""
        self._check_index(i)
        rs, self.range_servers[i] = self.range_servers[i], None
        if rs is not None:
            rs.stop()

    def start_range_server(self, i: int) -> RangeServer:
        """Start range server ``i`` again: same data directory, same server id."""
        self._check_index(i)
        if self.pd is None:
            raise RuntimeError("start the cluster before its range servers")
        if self.range_servers[i] is not None:
            raise RuntimeError(f"range server {i} is already running")
        self._launch_range_server(i)
        self._wait_registered(i)
        rs = self.range_servers[i]
        assert rs is not None
        return rs

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self._count:
            raise IndexError(f"range server index {i} is not in 0..{self._count - 1}")

    def _rs_config(self, i: int, port: int) -> RangeServerConfig:
        assert self.pd is not None
        return RangeServerConfig(
            data_dir=str(self.data_dir / f"rs-{i}"), host=self.host, port=port,
            advertise_host=self.advertise_host or None,
            pd_addresses=[self.pd.address], storage=self.storage,
            heartbeat_interval_s=self.heartbeat_interval_s,
            net=NetConfig(name="range-server", tls=self.tls), auth=self.auth,
            metrics_port=(None if self._metrics_port is None else
                          self._metrics_port + i + 1 if self._metrics_port else 0))

    def _launch_range_server(self, i: int) -> None:
        port = self._ports[i]
        self._awaited.add(i)  # until _wait_registered is done with it
        rs = self._range_server(i, port)
        try:
            rs.start()
        except OSError as exc:
            # Never started: only its storage is open (stop() expects a started server).
            rs.close_unstarted()
            if not port:
                raise
            log.info("range server %d cannot have port %d again (%s); taking a free one",
                     i, port, exc)
            rs = self._range_server(i, 0).start()
        self._ports[i] = rs.address[1]
        self.range_servers[i] = rs

    def _range_server(self, i: int, port: int) -> RangeServer:
        """Range server ``i`` on ``port``, not started; the PD's refusal of its id goes to
        ``_on_refusal``."""
        rs = RangeServer(self._rs_config(i, port))
        rs.on_refusal = functools.partial(self._on_refusal, i)
        return rs

    def _on_refusal(self, i: int, refusal: Exception) -> None:
        """The PD refused range server ``i``'s id for good. While the cluster waits for its
        registration, that wait raises the refusal (``sbp server`` exits with it): logging
        it too printed it twice. Later, nobody waits: it is logged."""
        if i not in self._awaited:
            log.error("%s", refusal)

    def _wait_registered(self, i: int) -> None:
        try:
            self._wait_registered_now(i)
        finally:
            self._awaited.discard(i)

    def _wait_registered_now(self, i: int) -> None:
        rs, pd = self.range_servers[i], self.pd
        assert rs is not None and pd is not None

        def registered() -> bool:
            if rs.pd_link is not None and rs.pd_link.refusal is not None:
                raise rs.pd_link.refusal
            sid = rs.server_id
            return sid >= 0 and pd.liveness.address(sid) == rs.advertise_addr \
                and pd.liveness.is_live(sid)

        _wait_for(registered, self.start_timeout_s,
                  f"range server {i} ({rs.advertise_addr}) to register with the PD")

    # -- addresses --------------------------------------------------------------------------

    @property
    def pd_address(self) -> str:
        """``host:port`` of the PD."""
        if self.pd is None:
            raise RuntimeError("the cluster is not running")
        return self.pd.address

    @property
    def range_server_addresses(self) -> list[str]:
        """``host:port`` of each running range server, in index order."""
        return [rs.advertise_addr for rs in self.range_servers if rs is not None]

    def server_id(self, i: int) -> int:
        """The server id of range server ``i`` (stable across its restarts)."""
        self._check_index(i)
        rs = self.range_servers[i]
        if rs is None:
            raise RuntimeError(f"range server {i} is not running")
        return rs.server_id


# -- child processes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where one server process runs: the address it listens on (and advertises), and the
    command prefix that starts it there (``("ip", "netns", "exec", "ns1")`` runs it in a
    network namespace; empty: this host). The prefix must exec the command in place, so the
    child's pid stays the server's and signals reach it."""

    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()


class ServerProcess:
    """One ``sbp`` server command running as a child process.

    Started with ``--ready-file``; ``info`` is what the child wrote there once it served.
    Output goes to ``log_path``. ``prefix`` goes before the command (see ``Placement``).
    """

    def __init__(self, args: Sequence[str], ready_file: Path, log_path: Path,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 env: dict[str, str] | None = None, prefix: Sequence[str] = ()) -> None:
        self.command = [*args]
        self.args = [*prefix, sys.executable, "-m", "sbp_spark.cli", *args, "--ready-file",
                     str(ready_file)]
        self.ready_file = Path(ready_file)
        self.log_path = Path(log_path)
        with contextlib.suppress(FileNotFoundError):
            self.ready_file.unlink()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        self.info: dict[str, Any] = {}
        try:
            _wait_for(self._ready, start_timeout_s, f"{' '.join(self.command[:1])} to be ready "
                      f"(log: {self.log_path})")
        except BaseException:
            self.kill()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{' '.join(self.command)} exited with status {self.proc.returncode}; "
                f"its log:\n{self.log_tail()}")
        try:
            self.info = json.loads(self.ready_file.read_text())
        except (FileNotFoundError, ValueError):
            return False
        return True

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the child's output."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (a crash, as far as the data on disk can tell)."""
        if self.running:
            self.proc.send_signal(signal.SIGKILL)
        self.wait()

    def terminate(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int:
        """SIGTERM (graceful stop), then SIGKILL if it has not exited within ``timeout_s``."""
        if self.running:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("pid %d ignored SIGTERM for %g s: killing it", self.pid, timeout_s)
                self.proc.kill()
        return self.wait()

    def wait(self) -> int:
        code = self.proc.wait()
        self._log.close()
        return code


class ProcessCluster:
    """``sbp pd`` and ``range_servers`` x ``sbp range-server``, each in its own process.

    Range server ``i`` keeps ``<data_dir>/rs-<i>`` across restarts; ``kill_range_server`` is a
    SIGKILL, ``stop_range_server`` a SIGTERM (the same for the PD: ``kill_pd``, ``stop_pd``).
    The PD takes a free port (or ``pd_port``) and comes back on the same port after a
    restart, so the address clients hold stays good; a range server first tries its previous
    port too (a server restarting on its configured port), and takes a free one if that is
    taken. ``env`` is the environment of every child process; ``tls`` becomes their
    ``--tls-cert``/``--tls-key``/``--tls-ca`` options, ``auth`` their authentication options
    (``--auth-token-secret`` and the others).

    ``pd_nodes=N`` (N >= 1) runs N PD nodes over etcd instead of one PD on SQLite: the etcd at
    ``etcd_endpoints``, or else a local one of ``etcd_members`` members (``etcd``, a
    ``LocalEtcd``, on ``host``). Node ``i`` is ``pd-<i>``, node 0 on ``pd_port``, the others on
    free ports (each keeps its port across restarts); ``pd_address`` lists every node
    (comma-separated), which is what range servers and clients are given; ``kill_pd_node(i)``
    and ``start_pd_node(i)`` kill and restart one.

    ``placements`` puts roles on hosts of their own: ``{"pd": Placement(...), "rs-0": ...}``
    (``role_name`` spells the keys: ``pd``, ``pd-<i>`` for PD nodes, ``rs-<i>``); a role
    without one runs here and listens on ``host``.
    """

    def __init__(self, data_dir: str | Path, range_servers: int = 1, host: str = "127.0.0.1",
                 fsync: FsyncPolicy | str | bool = FsyncPolicy.GROUP,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S, pd_port: int = 0,
                 env: dict[str, str] | None = None, tls: TlsConfig | None = None,
                 pd_nodes: int = 0, etcd_members: int = 1,
                 etcd_endpoints: Sequence[str] = (),
                 placements: Mapping[str, Placement] | None = None,
                 auth: AuthSettings | None = None) -> None:
        if not isinstance(range_servers, int) or range_servers < 0:
            raise ValueError(f"range_servers={range_servers!r} must be an integer >= 0")
        if not 0 <= pd_port <= 65535:
            raise ValueError(f"pd_port={pd_port!r} must be in 0..65535")
        if not isinstance(pd_nodes, int) or pd_nodes < 0:
            raise ValueError(f"pd_nodes={pd_nodes!r} must be an integer >= 0 (0: one PD on "
                             "SQLite)")
        known = {"pd", *(self.role_name(i) for i in range(range_servers)),
                 *(self.pd_node_name(i) for i in range(pd_nodes))}
        # Every role advertises the host it listens on: a wildcard is no address to give out.
        for role, where in [("cluster", Placement(host)), *(placements or {}).items()]:
            check_advertised(where.host, None, None, f"process cluster ({role})")
        unknown = sorted(set(placements or {}) - known)
        if unknown:
            raise ValueError(f"placements name roles this cluster does not have: {unknown} "
                             f"(roles: {', '.join(sorted(known))})")
        self.data_dir = Path(data_dir)
        self.host = host
        self.placements: dict[str, Placement] = dict(placements or {})
        self.fsync = _fsync_policy(fsync)
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.tls = tls
        self.auth = auth if auth is not None else AuthSettings()
        self._pd_port = pd_port
        self._rs_ports: list[int] = [0] * range_servers
        self.pd: ServerProcess | None = None
        self.range_servers: list[ServerProcess | None] = [None] * range_servers
        self.pd_nodes: list[ServerProcess | None] = [None] * pd_nodes
        # Node 0 takes pd_port; the others free ports (pd_port + 1 would be etcd's own 2379
        # when pd_port is the default 2378).
        self._node_ports: list[int] = [pd_port] + [0] * (pd_nodes - 1) if pd_nodes else []
        self.etcd: LocalEtcd | None = None
        self._etcd_endpoints = list(etcd_endpoints)
        if pd_nodes and not etcd_endpoints:
            self.etcd = LocalEtcd(self.data_dir / "etcd", members=etcd_members, host=host)

    def start(self) -> ProcessCluster:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.pd_nodes:
                if self.etcd is not None:
                    self._etcd_endpoints = self.etcd.start().endpoints
                for i in range(len(self.pd_nodes)):
                    self.start_pd_node(i)
                self.wait_pd_cluster()
            else:
                self.start_pd()
            for i in range(len(self.range_servers)):
                self.start_range_server(i)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every range server, then the PD (or every PD node, then etcd)."""
        for i in range(len(self.range_servers)):
            self.stop_range_server(i)
        self.stop_pd()
        for i in range(len(self.pd_nodes)):
            self.stop_pd_node(i)
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> ProcessCluster:
        if self.pd is None and not any(self.pd_nodes):
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def role_name(index: int | None) -> str:
        """The key of a range server (or, index None, the lone PD) in ``placements``:
        ``"rs-<index>"``, ``"pd"``."""
        return "pd" if index is None else f"rs-{index}"

    @staticmethod
    def pd_node_name(index: int) -> str:
        """The name of PD node ``index``, also its key in ``placements``: ``"pd-<index>"``."""
        return f"pd-{index}"

    def _node_address(self, i: int) -> str:
        return f"{self.placement(self.pd_node_name(i)).host}:{self._node_ports[i]}"

    def placement(self, role: str) -> Placement:
        """Where ``role`` runs (``role_name``): its own placement, else ``host`` here."""
        return self.placements.get(role) or Placement(self.host)

    # -- the PD -----------------------------------------------------------------------------

    @property
    def pd_address(self) -> str:
        """``host:port`` of the PD (the same across its restarts); with PD nodes, every
        node's, comma-separated."""
        if self.pd_nodes:
            if not all(self._node_ports):
                raise RuntimeError("the cluster's PD nodes have not been started")
            return ",".join(self._node_address(i) for i in range(len(self._node_ports)))
        if self.pd is not None:
            return str(self.pd.info["pd"])
        if self._pd_port:
            return f"{self.placement('pd').host}:{self._pd_port}"
        raise RuntimeError("the cluster's PD has not been started")

    @property
    def etcd_endpoints(self) -> list[str]:
        """The etcd client endpoints the PD nodes use (empty for a lone PD)."""
        return list(self._etcd_endpoints)

    def start_pd(self) -> ServerProcess:
        """Start the PD (again) on its data directory and port."""
        if self.pd_nodes:
            raise RuntimeError("this cluster runs PD nodes: use start_pd_node(i)")
        if self.pd is not None and self.pd.running:
            raise RuntimeError("the PD is already running")
        where = self.placement("pd")
        self.pd = ServerProcess(
            ["pd", "--data-dir", str(self.data_dir / "pd"), "--host", where.host,
             "--port", str(self._pd_port), "--fsync", self.fsync.value, *self._tls_args(),
             *self._auth_args()],
            self.data_dir / "pd.ready", self.data_dir / "pd.log", self.start_timeout_s,
            env=self.env, prefix=where.prefix)
        self._pd_port = int(str(self.pd.info["pd"]).rsplit(":", 1)[1])
        return self.pd

    def _tls_args(self) -> list[str]:
        tls = self.tls
        if tls is None:
            return []
        args = ["--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file)]
        return args + (["--tls-ca", tls.ca_file] if tls.ca_file else [])

    def _auth_args(self) -> list[str]:
        auth = self.auth
        args: list[str] = []
        for option, value in (("--auth-token-secret", auth.token_secret_file),
                              ("--auth-token-public-key", auth.token_public_key_file),
                              ("--server-token", auth.server_token_file)):
            if value:
                args += [option, str(value)]
        if auth.superusers:
            args += ["--superusers", ",".join(sorted(auth.superusers))]
        return args

    def kill_pd(self) -> None:
        """SIGKILL the PD."""
        proc, self.pd = self.pd, None
        if proc is not None:
            proc.kill()

    def stop_pd(self) -> None:
        """SIGTERM the PD and wait for it to exit."""
        proc, self.pd = self.pd, None
        if proc is not None:
            proc.terminate()

    # -- PD nodes ---------------------------------------------------------------------------

    def start_pd_node(self, i: int) -> ServerProcess:
        """Start PD node ``i`` (again) on its port."""
        node = self.pd_nodes[i]
        if node is not None and node.running:
            raise RuntimeError(f"PD node {i} is already running")
        name = self.pd_node_name(i)
        where = self.placement(name)
        proc = ServerProcess(
            ["pd", "--etcd", ",".join(self._etcd_endpoints), "--name", name,
             "--host", where.host, "--port", str(self._node_ports[i]), *self._tls_args(),
             *self._auth_args()],
            self.data_dir / f"{name}.ready", self.data_dir / f"{name}.log",
            self.start_timeout_s, env=self.env, prefix=where.prefix)
        self._node_ports[i] = int(str(proc.info["pd"]).rsplit(":", 1)[1])
        self.pd_nodes[i] = proc
        return proc

    def wait_pd_cluster(self) -> None:
        """Wait until every running PD node is a member of the PD cluster and one of them
        leads (a node is ready once it serves, a little before it has joined)."""
        from sbp_spark.protocol.messages import DescribePdClusterRequest, DescribePdClusterResponse

        wanted = {self._node_address(i) for i, node in enumerate(self.pd_nodes)
                  if node is not None}

        server_token = self.auth.server_token()

        def formed() -> bool:
            try:
                # Asked like the servers ask each other: with their certificate, their token.
                config = ClientConfig().with_tls(self.tls).with_token(server_token)
                with contextlib.closing(Connection(next(iter(wanted)), config)) as conn:
                    response, _ = conn.call(DescribePdClusterRequest())
            except SbpError:
                return False
            assert isinstance(response, DescribePdClusterResponse)
            members = response.cluster.members if response.cluster is not None else []
            return ({n.advertise_addr for n in members} >= wanted
                    and sum(1 for n in members if n.is_leader) == 1)

        _wait_for(formed, self.start_timeout_s,
                  f"PD nodes {', '.join(sorted(wanted))} to form a cluster with a leader")

    def kill_pd_node(self, i: int) -> None:
        """SIGKILL PD node ``i``."""
        proc, self.pd_nodes[i] = self.pd_nodes[i], None
        if proc is not None:
            proc.kill()

    def stop_pd_node(self, i: int) -> None:
        """SIGTERM PD node ``i`` and wait for it to exit."""
        proc, self.pd_nodes[i] = self.pd_nodes[i], None
        if proc is not None:
            proc.terminate()

    def pd_node_info(self) -> list[dict[str, Any]]:
        """Name, address and pid of every running PD node."""
        return [{"name": p.info["name"], "address": p.info["pd"], "pid": p.pid}
                for p in self.pd_nodes if p is not None]

    def pd_node_index(self, address: str) -> int:
        """Which node serves at ``address`` (IndexError when none does)."""
        for i in range(len(self._node_ports)):
            if address == self._node_address(i):
                return i
        raise IndexError(f"no PD node of this cluster serves at {address}")

    # -- range servers ----------------------------------------------------------------------

    @property
    def range_server_addresses(self) -> list[str]:
        return [str(p.info["range_server"]) for p in self.range_servers if p is not None]

    def range_server_dir(self, i: int) -> Path:
        """The data directory of range server ``i``."""
        return self.data_dir / f"rs-{i}"

    def start_range_server(self, i: int) -> ServerProcess:
        """Start range server ``i`` (again) on its data directory, on its previous port if
        that is free."""
        running = self.range_servers[i]
        if running is not None and running.running:
            raise RuntimeError(f"range server {i} is already running")
        port = self._rs_ports[i]
        try:
            proc = self._launch_range_server(i, port)
        except RuntimeError:
            if not port:
                raise
            log.info("range server %d could not start on port %d again; taking a free one",
                     i, port)
            proc = self._launch_range_server(i, 0)
        self._rs_ports[i] = int(str(proc.info["range_server"]).rsplit(":", 1)[1])
        self.range_servers[i] = proc
        return proc

    def _launch_range_server(self, i: int, port: int) -> ServerProcess:
        where = self.placement(self.role_name(i))
        return ServerProcess(
            ["range-server", "--pd", self.pd_address, "--data-dir",
             str(self.range_server_dir(i)), "--host", where.host, "--port", str(port),
             "--fsync", self.fsync.value, *self._tls_args(),
             *self._auth_args()],
            self.data_dir / f"rs-{i}.ready", self.data_dir / f"rs-{i}.log",
            self.start_timeout_s, env=self.env, prefix=where.prefix)

    def kill_range_server(self, i: int) -> None:
        """SIGKILL range server ``i``."""
        proc, self.range_servers[i] = self.range_servers[i], None
        if proc is not None:
            proc.kill()

    def stop_range_server(self, i: int) -> None:
        """SIGTERM range server ``i`` and wait for it to exit."""
        proc, self.range_servers[i] = self.range_servers[i], None
        if proc is not None:
            proc.terminate()
