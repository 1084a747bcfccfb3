"""An etcd cluster whose members each run on a network node of their own, so a fault can hit one
member (kill it, pause it, cut it off) as it would hit one machine.

``LocalEtcd`` (``sbp_spark.server.etcd_process``) runs every member on one host; this puts
member ``i`` on ``placements[i]`` (a ``Placement``: its address and the command prefix that
starts it there), on etcd's own ports, which are free on a node of its own.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from sbp_spark.server.cluster import Placement
from sbp_spark.server.etcd_client import EtcdClient, EtcdError
from sbp_spark.server.etcd_process import find_etcd

CLIENT_PORT, PEER_PORT = 2379, 2380
# A cold etcd on a busy machine, or one rejoining after a kill.
START_TIMEOUT_S = 60.0


class EtcdOnNodes:
    """Members ``etcd-<i>``, member ``i`` on ``placements[i]``; data in ``data_dir/etcd-<i>``,
    output in ``data_dir/etcd-<i>.log``. Use as a context manager, or ``start``/``stop``."""

    def __init__(self, data_dir: Path, placements: Sequence[Placement]) -> None:
        if not placements:
            raise ValueError("an etcd cluster needs at least one member")
        self.data_dir = Path(data_dir)
        self.placements = list(placements)
        self.names = [f"etcd-{i}" for i in range(len(placements))]
        self._procs: list[subprocess.Popen | None] = [None] * len(placements)
        self._token = f"sbp-{uuid.uuid4().hex[:12]}"
        self._binary = ""

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client URL."""
        return [f"{p.host}:{CLIENT_PORT}" for p in self.placements]

    def pid(self, i: int) -> int | None:
        """The pid of member ``i`` (None when it is not running)."""
        proc = self._procs[i]
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> EtcdOnNodes:
        """Start every member and wait until each serves."""
        self._binary = find_etcd()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(len(self.names)):
                self._launch(i, "new")
            for i in range(len(self.names)):
                self._wait_serving(i)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, i: int, state: str) -> None:
        where = self.placements[i]
        peers = ",".join(f"{n}=http://{p.host}:{PEER_PORT}"
                         for n, p in zip(self.names, self.placements, strict=True))
        client_url = f"http://{where.host}:{CLIENT_PORT}"
        peer_url = f"http://{where.host}:{PEER_PORT}"
        args = [*where.prefix, self._binary, "--name", self.names[i],
                "--data-dir", str(self.data_dir / self.names[i]),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", peers, "--initial-cluster-state", state,
                "--initial-cluster-token", self._token]
        with open(self.data_dir / f"{self.names[i]}.log", "ab") as out:
            self._procs[i] = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL)

    def _wait_serving(self, i: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = EtcdClient([self.endpoints[i]], timeout_s=1.0, retry_s=0)
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
                        raise TimeoutError(f"etcd member {self.names[i]} did not serve within "
                                           f"{START_TIMEOUT_S:g} s") from None
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
        """SIGTERM every member (SIGKILL after ``timeout_s``; SIGCONT first, in case one is
        paused) and wait for them."""
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

    def __enter__(self) -> EtcdOnNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
