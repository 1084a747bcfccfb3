"""A PD leader whose advertised address the client cannot reach is named as such.

docker-compose.yml publishes pd1's port on the host, and every node advertises its compose
name (pd2:2378). From the host, while pd2 led, every `sbp --pd 127.0.0.1:2378 ...` waited 10 s
and failed with "no node can lead while the nodes cannot reach etcd": pd1 answered
PD_NOT_LEADER naming pd2:2378, which does not resolve outside the compose network, and the
client blamed etcd, which was fine.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.polling import wait_until


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sbp(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sbp_spark.cli", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def leader_seen_by(address: str) -> str | None:
    shown = sbp("cluster", "--json", "--pd-only", "--pd", address)
    if not shown.stdout:
        return None
    leaders = [m["name"] for m in json.loads(shown.stdout)["members"] if m["leader"]]
    return leaders[0] if leaders else None


@pytest.mark.slow
def test_a_leader_advertised_under_a_name_this_client_cannot_resolve_is_named(
        tmp_path: Path, etcd_endpoints, etcd_prefix):
    # Two PD nodes on loopback that advertise names only "their" network resolves (.invalid
    # never resolves), as compose services do; the client reaches each by 127.0.0.1 only.
    nodes: dict[str, tuple[str, str, subprocess.Popen]] = {}
    try:
        for name in ("pda", "pdb"):
            port = _free_port()
            ready = tmp_path / f"{name}.json"
            log = open(tmp_path / f"{name}.log", "wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "sbp_spark.cli", "pd", "--etcd", ",".join(etcd_endpoints),
                 "--etcd-prefix", etcd_prefix, "--name", name, "--host", "127.0.0.1",
                 "--port", str(port), "--advertise-addr", f"{name}.invalid:{port}",
                 "--ready-file", str(ready)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            nodes[name] = (f"127.0.0.1:{port}", f"{name}.invalid:{port}", proc)
        wait_until(lambda: leader_seen_by(nodes["pda"][0]) is not None,
                   "a PD node to lead", timeout=30, interval=0.5)
        leader = leader_seen_by(nodes["pda"][0])
        follower = "pdb" if leader == "pda" else "pda"
        listed = sbp("streams", "list", "--pd", nodes[follower][0])
    finally:
        for _, _, proc in nodes.values():
            proc.terminate()
        for _, _, proc in nodes.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    assert listed.returncode == 1, listed
    message = listed.stderr
    assert "cannot reach etcd" not in message, message
    leader_advertised = nodes[leader][1]
    assert (f"the leader {leader} at {leader_advertised} (as the PD node at "
            f"{nodes[follower][0]} names it) cannot be reached from here") in message, message
    assert "--advertise-addr" in message, message
