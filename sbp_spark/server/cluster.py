"""Launchers: a whole cluster inside this process, or each role in its own process.

``EmbeddedCluster`` runs one PD and N range servers as threads of the calling process, on
loopback ports. It is what tests, demos and ``sbp server`` use::

    with EmbeddedCluster("/tmp/sbp", range_servers=3) as cluster:
        client = SbpClient(cluster.pd_address)

``ProcessCluster`` runs ``sbp pd`` and ``sbp range-server`` as child processes, so a test can
kill one with SIGKILL and start it again on the same data directory.

Layout of a cluster's data directory: ``pd/`` (the PD's SQLite metadata) and ``rs-<i>/`` for
range server ``i``. A range server keeps its server id in its own directory, so restarting it
there brings back the same server with the same ranges.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sbp_spark.client.config import ClientConfig
from sbp_spark.client.connection import Connection
from sbp_spark.protocol.errors import SbpError
from sbp_spark.transport.tls import TlsConfig

from .durability import DEFAULT_FSYNC_INTERVAL_MS, FsyncPolicy
from .net import NetConfig
from .pagecache import DEFAULT_PAGE_CACHE_BYTES
from .pd import DEFAULT_HEARTBEAT_INTERVAL_S, PdConfig, PlacementDriver
from .range_server import RangeServer, RangeServerConfig
from .storage import StorageConfig

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
    OS page cache (``StorageConfig.page_cache_bytes``; 0: no bound).
    """

    def __init__(self, data_dir: str | Path, range_servers: int = 1, host: str = "127.0.0.1",
                 fsync: FsyncPolicy | str | bool = FsyncPolicy.GROUP, pd_port: int = 0,
                 heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 tls: TlsConfig | None = None,
                 page_cache_bytes: int = DEFAULT_PAGE_CACHE_BYTES,
                 fsync_interval_ms: int = DEFAULT_FSYNC_INTERVAL_MS) -> None:
        if not isinstance(range_servers, int) or range_servers < 0:
            raise ValueError(f"range_servers={range_servers!r} must be an integer >= 0")
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s={heartbeat_interval_s!r} must be > 0")
        if not 0 <= pd_port <= 65535:
            raise ValueError(f"pd_port={pd_port!r} must be in 0..65535")
        self.data_dir = Path(data_dir)
        self.host = host
        self.fsync = _fsync_policy(fsync)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.start_timeout_s = start_timeout_s
        self.tls = tls
        self.storage = StorageConfig(fsync=self.fsync, fsync_interval_ms=fsync_interval_ms,
                                     page_cache_bytes=page_cache_bytes)
        self._pd_port = pd_port
        self._count = range_servers
        self._ports: list[int] = [0] * range_servers
        self.pd: PlacementDriver | None = None
        self.range_servers: list[RangeServer | None] = [None] * range_servers

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> EmbeddedCluster:
        """Start the PD, then every range server; return once all of them serve."""
        if self.pd is not None:
            raise RuntimeError("cluster already started")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.pd = PlacementDriver(PdConfig(
                self.data_dir / "pd", host=self.host, port=self._pd_port,
                fsync=self.fsync is not FsyncPolicy.NEVER,
                heartbeat_timeout_s=_MISSED_HEARTBEATS * self.heartbeat_interval_s,
                net=NetConfig(tls=self.tls))).start()
            # A restart comes back on the same PD port, so addresses held by clients stay good.
            self._pd_port = int(self.pd.bound_address.rsplit(":", 1)[1])
            for i in range(self._count):
                self._launch_range_server(i)
            for i in range(self._count):
                self._wait_registered(i)
        except BaseException:
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
            pd_addresses=[self.pd.address], storage=self.storage,
            heartbeat_interval_s=self.heartbeat_interval_s,
            net=NetConfig(name="range-server", tls=self.tls))

    def _launch_range_server(self, i: int) -> None:
        port = self._ports[i]
        rs = RangeServer(self._rs_config(i, port))
        try:
            rs.start()
        except OSError as exc:
            # Never started: only its storage is open (stop() expects a started server).
            rs.storage.close()
            if not port:
                raise
            log.info("range server %d cannot have port %d again (%s); taking a free one",
                     i, port, exc)
            rs = RangeServer(self._rs_config(i, 0)).start()
        self._ports[i] = rs.address[1]
        self.range_servers[i] = rs

    def _wait_registered(self, i: int) -> None:
        rs, pd = self.range_servers[i], self.pd
        assert rs is not None and pd is not None

        def registered() -> bool:
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


class ServerProcess:
    """One ``sbp`` server command running as a child process.

    Started with ``--ready-file``; ``info`` is what the child wrote there once it served.
    Output goes to ``log_path``.
    """

    def __init__(self, args: Sequence[str], ready_file: Path, log_path: Path,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 env: dict[str, str] | None = None) -> None:
        self.args = [sys.executable, "-m", "sbp_spark.cli", *args, "--ready-file",
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
            _wait_for(self._ready, start_timeout_s, f"{' '.join(args[:1])} to be ready "
                      f"(log: {self.log_path})")
        except BaseException:
            self.kill()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{' '.join(self.args[3:])} exited with status {self.proc.returncode}; "
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
    ``--tls-cert``/``--tls-key``/``--tls-ca`` options.
    """

    def __init__(self, data_dir: str | Path, range_servers: int = 1, host: str = "127.0.0.1",
                 fsync: FsyncPolicy | str | bool = FsyncPolicy.GROUP,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S, pd_port: int = 0,
                 env: dict[str, str] | None = None, tls: TlsConfig | None = None) -> None:
        if not isinstance(range_servers, int) or range_servers < 0:
            raise ValueError(f"range_servers={range_servers!r} must be an integer >= 0")
        if not 0 <= pd_port <= 65535:
            raise ValueError(f"pd_port={pd_port!r} must be in 0..65535")
        self.data_dir = Path(data_dir)
        self.host = host
        self.fsync = _fsync_policy(fsync)
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.tls = tls
        self._pd_port = pd_port
        self._rs_ports: list[int] = [0] * range_servers
        self.pd: ServerProcess | None = None
        self.range_servers: list[ServerProcess | None] = [None] * range_servers

    def start(self) -> ProcessCluster:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.start_pd()
            for i in range(len(self.range_servers)):
                self.start_range_server(i)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every range server, then the PD."""
        for i in range(len(self.range_servers)):
            self.stop_range_server(i)
        self.stop_pd()

    def __enter__(self) -> ProcessCluster:
        if self.pd is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the PD -----------------------------------------------------------------------------

    @property
    def pd_address(self) -> str:
        """``host:port`` of the PD (the same across its restarts)."""
        if self.pd is not None:
            return str(self.pd.info["pd"])
        if self._pd_port:
            return f"{self.host}:{self._pd_port}"
        raise RuntimeError("the cluster's PD has not been started")

    def start_pd(self) -> ServerProcess:
        """Start the PD (again) on its data directory and port."""
        if self.pd is not None and self.pd.running:
            raise RuntimeError("the PD is already running")
        self.pd = ServerProcess(
            ["pd", "--data-dir", str(self.data_dir / "pd"), "--host", self.host,
             "--port", str(self._pd_port), "--fsync", self.fsync.value, *self._tls_args()],
            self.data_dir / "pd.ready", self.data_dir / "pd.log", self.start_timeout_s,
            env=self.env)
        self._pd_port = int(str(self.pd.info["pd"]).rsplit(":", 1)[1])
        return self.pd

    def _tls_args(self) -> list[str]:
        tls = self.tls
        if tls is None:
            return []
        args = ["--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file)]
        return args + (["--tls-ca", tls.ca_file] if tls.ca_file else [])

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
        if self.range_servers[i] is not None and self.range_servers[i].running:
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
        return ServerProcess(
            ["range-server", "--pd", self.pd_address, "--data-dir",
             str(self.range_server_dir(i)), "--host", self.host, "--port", str(port),
             "--fsync", self.fsync.value, *self._tls_args()],
            self.data_dir / f"rs-{i}.ready", self.data_dir / f"rs-{i}.log",
            self.start_timeout_s, env=self.env)

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
