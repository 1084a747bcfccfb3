"""A local etcd cluster as child processes: for ``sbp server --pd-nodes``, tests and try-outs.

``LocalEtcd(data_dir, members=3)`` starts ``members`` etcd processes that form one cluster,
every client and peer URL on a free loopback port (or on ``host``), each member's data in
``data_dir/etcd-<i>``. ``LocalEtcd(data_dir, placements=[...])`` puts member ``i`` on a node of
its own instead (``placements[i]``: its address and the command prefix that starts it there,
as ``cluster.Placement``), on etcd's own ports, which are free on such a node: the fault suite
kills, pauses and cuts off one member as it would one machine. ``kill(i)`` is a SIGKILL of
one member and ``start_member(i)`` brings it back on its data; ``stop()`` ends them all. The
etcd binary is found on PATH (or in ``$SBP_ETCD``); ``find_etcd`` says how to install it when
it is missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from .etcd_client import EtcdClient, EtcdError

log = logging.getLogger(__name__)

ETCD_ENV = "SBP_ETCD"
INSTALL_HINT = ("install etcd (Debian/Ubuntu: sudo apt-get install -y etcd-server; "
                "elsewhere the release archive from the etcd project), or point $SBP_ETCD at "
                "the etcd binary")
DEFAULT_START_TIMEOUT_S = 30.0
# etcd's own ports, for members on nodes of their own.
CLIENT_PORT, PEER_PORT = 2379, 2380


class Where(Protocol):
    """Where one member runs (``cluster.Placement`` is one): the address it listens on, and
    the command prefix that starts it there (it must exec the command in place)."""

    host: str
    prefix: tuple[str, ...]


class EtcdNotFoundError(RuntimeError):
    """No etcd binary on this machine."""


def find_etcd() -> str:
    """The etcd server binary: ``$SBP_ETCD``, else ``etcd`` on PATH."""
    configured = os.environ.get(ETCD_ENV)
    if configured:
        if not os.access(configured, os.X_OK):
            raise EtcdNotFoundError(f"${ETCD_ENV}={configured} is not an executable file")
        return configured
    found = shutil.which("etcd")
    if found is None:
        raise EtcdNotFoundError(f"the etcd server binary was not found on PATH: {INSTALL_HINT}")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    """``members`` etcd processes forming one cluster on ``host`` (free ports), or one member
    on each of ``placements`` (etcd's own ports)."""

    def __init__(self, data_dir: str | Path, members: int = 1, host: str = "127.0.0.1",
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 placements: Sequence[Where] | None = None) -> None:
        if placements is not None:
            members = len(placements)
        if members < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {members}")
        self.data_dir = Path(data_dir)
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.names = [f"etcd-{i}" for i in range(members)]
        self._placements = list(placements) if placements is not None else None
        self._hosts = [p.host for p in placements] if placements is not None else [host] * members
        self._prefixes = [tuple(p.prefix) for p in placements] if placements is not None \
            else [()] * members
        self._client_ports = [0] * members
        self._peer_ports = [0] * members
        self._procs: list[subprocess.Popen | None] = [None] * members
        self._token = f"sbp-{uuid.uuid4().hex[:12]}"
        self._binary = ""

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client URL."""
        return [f"{h}:{p}" for h, p in zip(self._hosts, self._client_ports, strict=True)]

    @property
    def pids(self) -> list[int | None]:
        return [self.pid(i) for i in range(len(self.names))]

    def pid(self, i: int) -> int | None:
        """The pid of member ``i`` (None when it is not running)."""
        proc = self._procs[i]
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> LocalEtcd:
        """Start every member and wait until the cluster answers."""
        self._binary = find_etcd()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._placements is None:
            self._client_ports = [free_port(self.host) for _ in self.names]
            self._peer_ports = [free_port(self.host) for _ in self.names]
        else:
            self._client_ports = [CLIENT_PORT] * len(self.names)
            self._peer_ports = [PEER_PORT] * len(self.names)
        try:
            for i in range(len(self.names)):
                self._launch(i, "new")
            for i in range(len(self.names)):
                self._wait_serving(i)
        except BaseException:
            self.stop()
            raise
        log.info("etcd cluster of %d serving on %s", len(self.names), ",".join(self.endpoints))
        return self

    def _launch(self, i: int, state: str) -> None:
        name = self.names[i]
        peers = ",".join(f"{n}=http://{h}:{p}" for n, h, p
                         in zip(self.names, self._hosts, self._peer_ports, strict=True))
        client_url = f"http://{self._hosts[i]}:{self._client_ports[i]}"
        peer_url = f"http://{self._hosts[i]}:{self._peer_ports[i]}"
        args = [*self._prefixes[i], self._binary, "--name", name,
                "--data-dir", str(self.data_dir / name),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", peers, "--initial-cluster-state", state,
                "--initial-cluster-token", self._token]
        with open(self.data_dir / f"{name}.log", "ab") as out:
            self._procs[i] = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL)

    def _wait_serving(self, i: int) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        client = EtcdClient([self.endpoints[i]], timeout_s=1.0, retry_s=0)  # retries here
        try:
            while True:
                if self.pid(i) is None:
                    raise RuntimeError(f"etcd member {self.names[i]} exited; its log: "
                                       f"{self.data_dir / (self.names[i] + '.log')}")
                try:
                    client.range(b"/")
                    return
                except EtcdError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"etcd member {self.names[i]} did not serve within "
                            f"{self.start_timeout_s:g} s") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def serving(self, i: int) -> bool:
        """Whether member ``i`` answers a read now (within a second)."""
        client = EtcdClient([self.endpoints[i]], timeout_s=1.0, retry_s=0)
        try:
            client.range(b"/")
            return True
        except EtcdError:
            return False
        finally:
            client.close()

    def kill(self, i: int) -> None:
        """SIGKILL member ``i``."""
        proc, self._procs[i] = self._procs[i], None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def start_member(self, i: int) -> None:
        """Start member ``i`` again on its data (it rejoins the cluster)."""
        if self.pid(i) is not None:
            raise RuntimeError(f"etcd member {self.names[i]} is already running")
        self._launch(i, "existing")
        self._wait_serving(i)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every member (SIGKILL after ``timeout_s``; SIGCONT first, in case a fault
        paused one) and wait for them."""
        procs = [p for p in self._procs if p is not None]
        self._procs = [None] * len(self.names)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout_s)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
