"""Each kind of fault of the schedule (``schedule.KINDS``), injected into and undone on a ``Lab``
(``integration/faults/lab.py``), and the checks that say a domain is whole again.

Targets are looked up when a fault starts, with a client that gives up within a couple of
seconds: while the PD cluster has no leader, a fault that needs one (the primary of a stream,
the PD leader) waits for the next look instead of holding up the other domain's faults.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from integration.faults.lab import Lab
from sbp_spark.client import ClientConfig, ConnectionPool
from sbp_spark.client.pd import PdClient
from sbp_spark.protocol.errors import SbpError
from sbp_spark.server.cluster import ServerProcess

from .schedule import RANGE_SERVERS, Planned

# The nemesis's own look at the cluster: a few quick tries, then "not now".
QUICK = ClientConfig(connect_timeout_s=0.5, request_timeout_s=1.0, retries=3,
                     retry_backoff_ms=10, retry_backoff_max_ms=100, retry_deadline_s=2.0)
# A server that does not come back: tries to start it again, that far apart.
RESTART_TRIES, RESTART_PAUSE_S = 3, 2.0
# A restart slower than this is noted with its fault (a cold start takes a second or two).
RESTART_NOTED_S = 5.0


class NemesisError(RuntimeError):
    """The nemesis could not inject or undo a fault (a server that would not restart)."""


@dataclass
class Injected:
    """A fault as injected: what, where, from when to when (``time.monotonic()``)."""

    number: int  # its place among every fault of the run, from 1
    planned: Planned
    target: str  # the node it hit
    detail: str  # the target in words ("primary of stream 3, range 2")
    start: float
    end: float | None = None  # when it was undone (restarted, resumed, healed)
    undo: Callable[[], None] = field(default=lambda: None, repr=False)
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.planned.kind

    def overlaps(self, start: float, end: float) -> bool:
        """Whether the fault was in place at some time in [start, end] (an active one: up to
        now)."""
        return self.start <= end and (self.end if self.end is not None else time.monotonic()) \
            >= start


class Faults:
    """Injects the schedule's faults into ``lab`` (3 PD nodes, etcd members on nodes of their
    own, range servers ``rs<i>``). ``streams``: the streams whose primaries faults hit;
    ``clients``: the nodes a primary is cut off from by ``cut-primary-from-clients``."""

    def __init__(self, lab: Lab, streams: list[int], clients: list[str]) -> None:
        if lab.etcd is None:
            raise ValueError("the nemesis needs etcd members on nodes of their own")
        self.lab = lab
        self.etcd = lab.etcd
        self.streams = streams
        self.clients = clients
        self.injected: list[Injected] = []
        self._lock = threading.Lock()
        self.pool = ConnectionPool(QUICK)
        self.pd = PdClient(lab.cluster.pd_address, QUICK, self.pool, wait_for_election=False)

    def close(self) -> None:
        self.pool.close()

    # -- looking at the cluster -------------------------------------------------------------

    def _primary(self, pick: int) -> tuple[str, list[str], str] | None:
        """(node, secondary nodes, words) of the primary of the open range of the stream
        ``pick`` chooses; None when the PD cannot say now."""
        stream = self.streams[pick % len(self.streams)]
        try:
            [result] = self.pd.list_ranges([stream])
            ranges = result.unwrap()
        except SbpError:
            return None
        rng = ranges[-1] if ranges else None
        if rng is None or not rng.is_open or rng.primary is None:
            return None
        node = self.lab.server_node(rng.primary.advertise_addr)
        secondaries = [self.lab.server_node(r.server.advertise_addr) for r in rng.servers
                       if not r.is_primary]
        return node, secondaries, f"primary of stream {stream}, range {rng.range_index}"

    def _pd_nodes(self) -> tuple[int, list[int]] | None:
        """(leader, followers) as PD node indexes; None while no node leads."""
        try:
            members = self.pd.describe_pd_cluster().members
        except SbpError:
            return None
        leaders = [self.lab.cluster.pd_node_index(m.advertise_addr) for m in members
                   if m.is_leader]
        if len(leaders) != 1:
            return None
        others = [i for i in range(len(self.lab.cluster.pd_nodes)) if i != leaders[0]]
        return leaders[0], others

    def whole(self, domain: str) -> bool:
        """Whether ``domain`` is whole again: every range server running and live at the PD
        leader; or every PD node running with one leader and every etcd member serving."""
        cluster = self.lab.cluster
        try:
            if domain == RANGE_SERVERS:
                if any(p is None or not p.running for p in cluster.range_servers):
                    return False
                states = self.pd.range_servers()
                return sum(s.live for s in states) >= len(cluster.range_servers)
            if any(p is None or not p.running for p in cluster.pd_nodes):
                return False
            if self._pd_nodes() is None:
                return False
        except SbpError:
            return False
        return all(self.etcd.serving(i) for i in range(len(self.etcd.names)))

    # -- injecting --------------------------------------------------------------------------

    def inject(self, planned: Planned, now: float) -> Injected | None:
        """Inject ``planned``; None when it has no target now (the PD cannot say who leads or
        where a stream's primary is): try again a little later."""
        with self._lock:  # the domains inject from threads of their own
            fault = self._inject(planned, now, len(self.injected) + 1)
            if fault is not None:
                self.injected.append(fault)
            return fault

    def _inject(self, planned: Planned, now: float, number: int) -> Injected | None:
        cluster = self.lab.cluster
        kind = planned.kind
        pick = planned.pick
        fault: Injected
        if kind in ("kill-primary", "cut-primary-from-pd", "cut-primary-from-secondaries",
                    "cut-primary-from-clients"):
            found = self._primary(pick)
            if found is None:
                return None
            node, secondaries, detail = found
            fault = Injected(number, planned, node, detail, now)
            if kind == "kill-primary":
                index = self.lab.server_index(node)
                cluster.kill_range_server(index)
                fault.undo = lambda: self._restart(
                    fault, lambda: cluster.start_range_server(index))
            else:
                others = {"cut-primary-from-pd": [f"pd{i}" for i in range(len(cluster.pd_nodes))],
                          "cut-primary-from-secondaries": secondaries,
                          "cut-primary-from-clients": self.clients}[kind]
                cut = self.lab.net.partition(node, others)
                fault.detail += f", cut off from {', '.join(others)}"
                fault.undo = lambda: self.lab.net.heal(cut)
        elif kind == "pause-range-server":
            index = pick % len(cluster.range_servers)
            fault = Injected(number, planned, f"rs{index}", f"range server {index}", now)
            self._pause(fault, _pid(cluster.range_servers[index]))
        elif kind in ("kill-pd-leader", "kill-pd-follower"):
            nodes = self._pd_nodes()
            if nodes is None:
                return None
            leader, followers = nodes
            index = leader if kind == "kill-pd-leader" else followers[pick % len(followers)]
            role = "leader" if index == leader else "follower"
            fault = Injected(number, planned, f"pd{index}", f"PD node {index} ({role})", now)
            cluster.kill_pd_node(index)
            fault.undo = lambda: self._restart(fault, lambda: cluster.start_pd_node(index))
        elif kind == "pause-pd-node":
            index = pick % len(cluster.pd_nodes)
            fault = Injected(number, planned, f"pd{index}", f"PD node {index}", now)
            self._pause(fault, _pid(cluster.pd_nodes[index]))
        elif kind == "kill-etcd-member":
            index = pick % len(self.etcd.names)
            fault = Injected(number, planned, f"etcd{index}", f"etcd member {index}", now)
            self.etcd.kill(index)
            fault.undo = lambda: self._restart(fault, lambda: self.etcd.start_member(index))
        elif kind == "pause-etcd-member":
            index = pick % len(self.etcd.names)
            fault = Injected(number, planned, f"etcd{index}", f"etcd member {index}", now)
            self._pause(fault, self.etcd.pid(index))
        else:
            raise ValueError(f"no such kind of fault: {kind!r}")
        return fault

    def end(self, fault: Injected) -> None:
        """Undo ``fault`` (restart, SIGCONT, heal) and note when."""
        fault.undo()
        fault.end = time.monotonic()

    def _pause(self, fault: Injected, pid: int | None) -> None:
        if pid is None:
            raise NemesisError(f"fault {fault.number} ({fault.kind}): {fault.detail} is not "
                               "running")
        os.kill(pid, signal.SIGSTOP)
        fault.undo = lambda: os.kill(pid, signal.SIGCONT)

    def _restart(self, fault: Injected, start: Callable[[], object]) -> None:
        began = time.monotonic()
        for attempt in range(1, RESTART_TRIES + 1):
            try:
                start()
                took = time.monotonic() - began
                if took > RESTART_NOTED_S:
                    fault.notes.append(f"took {took:.1f} s to start again")
                return
            except (RuntimeError, TimeoutError) as exc:
                fault.notes.append(f"restart {attempt} failed: {exc}"[:300])
                if attempt == RESTART_TRIES:
                    raise NemesisError(f"fault {fault.number} ({fault.kind}): {fault.detail} "
                                       f"did not start again: {fault.notes}") from exc
                time.sleep(RESTART_PAUSE_S)


def _pid(process: ServerProcess | None) -> int | None:
    return process.pid if process is not None and process.running else None
