"""The breakable network itself: nodes reach each other, each kind of fault silences exactly
what it should, healing restores it, slow links are slow, and nothing is left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from integration.netlab.network import Network, remove_leftovers, run, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"netlab: {REASON}")

# A TCP echo server on port 7000 of its node.
ECHO = """
import socket, threading
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", 7000))
server.listen()
def echo(conn):
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""
# Connects from its node to argv[1]:7000; prints the mean round trip in ms, or "silent".
PROBE = """
import socket, sys, time
try:
    conn = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    began = time.monotonic()
    for _ in range(5):
        conn.sendall(b"x")
        conn.recv(1)
    print(round((time.monotonic() - began) / 5 * 1000, 2))
except OSError:
    print("silent")
"""


@pytest.fixture
def net():
    with Network(["a", "b", "c"]) as network:
        servers = [network.popen(n, [sys.executable, "-c", ECHO]) for n in ("a", "b", "c")]
        try:
            for n in ("a", "b", "c"):
                deadline = time.monotonic() + 10
                while probe(network, "host", n) == "silent":
                    assert time.monotonic() < deadline, f"echo server on {n} did not start"
                    time.sleep(0.05)
            yield network
        finally:
            for server in servers:
                server.kill()
                server.wait()


def probe(net: Network, source: str, target: str, timeout: float = 1.0) -> str:
    """Round trip in ms from ``source`` to ``target``'s echo server, or "silent"."""
    address = net[target].address
    if source == "host":
        try:
            with socket.create_connection((address, 7000), timeout=timeout) as conn:
                conn.sendall(b"x")
                conn.recv(1)
            return "ok"
        except OSError:
            return "silent"
    done = subprocess.run([*net[source].prefix, sys.executable, "-c", PROBE, address,
                           str(timeout)], capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or done.stderr


def reaches(net: Network, source: str, target: str) -> bool:
    return probe(net, source, target) != "silent"


def test_nodes_and_the_host_reach_each_other_on_their_own_addresses(net):
    addresses = {net[n].address for n in ("host", "a", "b", "c")}
    assert len(addresses) == 4 and all(a.startswith(str(net.subnet)[:-4]) for a in addresses)
    assert reaches(net, "a", "b") and reaches(net, "b", "c") and reaches(net, "host", "a")
    assert net["a"].placement().prefix == ("ip", "netns", "exec", net["a"].namespace)


def test_isolate_partition_drop_and_link_down_silence_what_they_name(net):
    fault = net.isolate("a")
    assert not reaches(net, "b", "a") and not reaches(net, "host", "a")
    assert reaches(net, "b", "c")
    net.heal(fault)
    assert reaches(net, "b", "a")

    fault = net.partition("a", ["b", "c"])
    assert not reaches(net, "a", "b") and not reaches(net, "c", "a")
    assert reaches(net, "host", "a") and reaches(net, "b", "c")
    net.heal(fault)

    # One way: a's packets to b vanish, b's to a arrive; TCP needs both, so a connection in
    # either direction goes silent, while c is untouched.
    fault = net.drop("a", "b")
    assert not reaches(net, "a", "b") and not reaches(net, "b", "a")
    assert reaches(net, "a", "c") and reaches(net, "c", "b")
    assert net.faults == [fault]
    net.heal()
    assert reaches(net, "a", "b") and net.faults == []

    net.link_down("b")
    assert not reaches(net, "a", "b") and not reaches(net, "host", "b")
    net.heal()
    assert reaches(net, "a", "b")


def test_a_shaped_link_adds_its_round_trip_to_the_named_peers_only(net):
    plain = float(probe(net, "a", "b"))
    net.shape("a", ["b"], rtt_ms=40)
    try:
        assert float(probe(net, "a", "b")) >= 40 > plain
        assert float(probe(net, "a", "c")) < 40  # not shaped
    finally:
        net.unshape("a")
    assert float(probe(net, "a", "b")) < 40


def test_close_removes_everything_and_leftovers_of_dead_runs_are_removed():
    with Network(["x"]) as network:
        namespaces = [network.hub, network["x"].namespace]
    listed = run("ip", "netns", "list")
    assert not any(ns in listed for ns in namespaces)
    assert network._host_link not in run("ip", "-o", "link", "show")
    # A run killed with SIGKILL leaves its names behind; a process that has exited is dead.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = f"sbpn{gone.stdout.strip()}-1-hub"
    run("ip", "netns", "add", stale)
    assert stale in remove_leftovers()
    assert stale not in run("ip", "netns", "list")
