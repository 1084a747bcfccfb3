"""The bench's server process: an EmbeddedCluster plus the raw loopback ceiling server.

Both run in one child process so that (a) the loopback ceiling copies bytes between the very
same two processes the SBP client talks between, and (b) the server's memory can be read from
/proc on its own. The child prints one JSON line with its addresses and runs until its stdin
closes.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from .loopback import LoopbackServer

STARTUP_TIMEOUT_S = 60.0


def _cluster_unavailable_reason() -> str | None:
    try:
        from sbp_spark.server.cluster import EmbeddedCluster  # noqa: F401
    except ImportError as exc:
        return f"sbp_spark.server.cluster.EmbeddedCluster not importable ({exc})"
    return None


def _serve(data_dir: str, range_servers: int, fsync: str | None) -> int:
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    loopback = LoopbackServer(directory=data_dir)
    info: dict[str, Any] = {"pid": os.getpid(), "loopback": loopback.address,
                            "pd": None, "range_servers": [], "cluster_error": None}
    reason = _cluster_unavailable_reason()
    cluster = None
    if reason is None:
        from sbp_spark.server.cluster import EmbeddedCluster
        if fsync is None:  # the cluster's default policy
            cluster = EmbeddedCluster(data_dir, range_servers=range_servers)
        else:
            cluster = EmbeddedCluster(data_dir, range_servers=range_servers, fsync=fsync)
        cluster.__enter__()
        info["pd"] = cluster.pd_address
        info["range_servers"] = list(cluster.range_server_addresses)
    else:
        info["cluster_error"] = reason
    print(json.dumps(info), flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        if cluster is not None:
            cluster.__exit__(None, None, None)
        loopback.close()
    return 0


class ServerProcess:
    """Starts the server child and knows its pid and addresses; a context manager."""

    def __init__(self, data_dir: Path, range_servers: int = 1, log_path: Path | None = None,
                 fsync: str | None = None):
        self.data_dir = Path(data_dir)
        self.range_servers = range_servers
        self.fsync = fsync
        self.log_path = log_path or self.data_dir.parent / "server.log"
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return int(self.info["pid"])

    @property
    def pd(self) -> str:
        """The PD's address; raises when the cluster is not running (sections that need it
        check ``cluster_error`` first)."""
        pd = self.info.get("pd")
        if pd is None:
            raise RuntimeError("the bench cluster is not running: "
                               f"{self.cluster_error or 'the server process has not started'}")
        return pd

    @property
    def range_server_addresses(self) -> list[str]:
        return list(self.info.get("range_servers") or [])

    @property
    def loopback(self) -> str:
        return self.info["loopback"]

    @property
    def cluster_error(self) -> str | None:
        return self.info.get("cluster_error")

    def start(self) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        argv = [sys.executable, "-m", "sbp_spark.bench.server_proc",
                "--data-dir", str(self.data_dir), "--range-servers", str(self.range_servers)]
        if self.fsync is not None:
            argv += ["--fsync", self.fsync]
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], STARTUP_TIMEOUT_S)
        line = self._proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(
                f"bench server process did not start; see its log {self.log_path}:\n"
                + self.log_path.read_text(errors="replace")[-2000:])
        self.info = json.loads(line)
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--range-servers", type=int, default=1)
    parser.add_argument("--fsync", default=None)
    args = parser.parse_args(argv)
    return _serve(args.data_dir, args.range_servers, args.fsync)


if __name__ == "__main__":
    raise SystemExit(main())
