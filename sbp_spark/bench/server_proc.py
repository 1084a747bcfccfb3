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

from sbp_spark.server import EmbeddedCluster
from sbp_spark.server.auth.authenticator import AuthSettings

from .loopback import LoopbackServer

STARTUP_TIMEOUT_S = 60.0


def _serve(data_dir: str, range_servers: int, fsync: str | None,
           auth_secret: str | None = None, superuser: str | None = None) -> int:
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    loopback = LoopbackServer(directory=data_dir)
    # With a secret: token authentication on, ``superuser`` may do everything.
    auth = AuthSettings(token_secret_file=auth_secret,
                        superusers=frozenset({superuser} if superuser else ()))
    try:
        if fsync is None:  # the cluster's default policy
            cluster = EmbeddedCluster(data_dir, range_servers=range_servers, auth=auth)
        else:
            cluster = EmbeddedCluster(data_dir, range_servers=range_servers, fsync=fsync,
                                      auth=auth)
        with cluster:
            print(json.dumps({"pid": os.getpid(), "loopback": loopback.address,
                              "pd": cluster.pd_address,
                              "range_servers": list(cluster.range_server_addresses)}),
                  flush=True)
            sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        loopback.close()
    return 0


class ServerProcess:
    """Starts the server child and knows its pid and addresses."""

    def __init__(self, data_dir: Path, range_servers: int = 1, log_path: Path | None = None,
                 fsync: str | None = None, auth_secret: Path | None = None,
                 superuser: str | None = None):
        self.data_dir = Path(data_dir)
        self.range_servers = range_servers
        self.fsync = fsync
        self.auth_secret = auth_secret
        self.superuser = superuser
        self.log_path = log_path or self.data_dir.parent / "server.log"
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return int(self.info["pid"])

    @property
    def pd(self) -> str:
        """The cluster's PD address."""
        return self.info["pd"]

    @property
    def range_server_addresses(self) -> list[str]:
        return list(self.info["range_servers"])

    @property
    def loopback(self) -> str:
        """The loopback ceiling server's address."""
        return self.info["loopback"]

    def start(self) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        argv = [sys.executable, "-m", "sbp_spark.bench.server_proc",
                "--data-dir", str(self.data_dir), "--range-servers", str(self.range_servers)]
        if self.fsync is not None:
            argv += ["--fsync", self.fsync]
        if self.auth_secret is not None:
            argv += ["--auth-secret", str(self.auth_secret), "--superuser",
                     self.superuser or ""]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--range-servers", type=int, default=1)
    parser.add_argument("--fsync", default=None)
    parser.add_argument("--auth-secret", default=None)
    parser.add_argument("--superuser", default=None)
    args = parser.parse_args(argv)
    return _serve(args.data_dir, args.range_servers, args.fsync, args.auth_secret,
                  args.superuser)


if __name__ == "__main__":
    raise SystemExit(main())
