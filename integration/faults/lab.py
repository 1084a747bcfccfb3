"""The partition cases' test bench: a cluster on a ``netlab.Network``, client drivers on nodes
of their own, and the ``History`` they fill.

``Lab`` puts the PD on node ``pd`` (or PD node ``i`` on node ``pd<i>``, with etcd on ``host``)
and range server ``i`` on node ``rs<i>`` (``ProcessCluster`` with a ``Placement`` per role),
starts writer, tail and prober drivers (``driver.py``) on the nodes it is asked to, and, after
the faults are healed, reads the final log of each stream (and each range from each of its
replicas) into the history. The test process itself is node ``host``: it creates streams and
reads the final logs through its own link to the switch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

from integration.netlab.network import Network
from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.errors import OffsetOutOfRangeError, RangeNotFoundError, RangeSealedError
from sbp_spark.protocol.messages import Range
from sbp_spark.protocol.records import ENVELOPE_SIZE
from sbp_spark.server.cluster import ProcessCluster
from sbp_spark.server.etcd_process import LocalEtcd

from .helpers import wait_until
from .history import History, Verdict, digest

# The test process's own client: patient, since it reads the final logs while servers may
# still be catching up after the heal.
# A writer's wait between two acknowledgements longer than this is kept (``Driver.stalls``).
STALL_NOTED_S = 1.0
HOST_CONFIG = ClientConfig(connect_timeout_s=2.0, request_timeout_s=5.0, retries=500,
                           retry_backoff_ms=20, retry_backoff_max_ms=250, retry_deadline_s=60.0)


class Driver:
    """One ``driver.py`` process on a node; its events go into ``history`` as they come."""

    def __init__(self, lab: Lab, node: str, role: str, name: str, stream: int | None,
                 *options: str) -> None:
        self.name = name
        self.node = node
        self.role = role
        self.stream = stream
        self.history = lab.history
        self.acked = 0
        self.failed = 0
        self.seen = 0
        self.errors: list[str] = []
        self.last_ack: float | None = None  # when the newest acknowledgement came
        self.longest_stall_s = 0.0  # longest time between two acknowledged appends
        # (from, to) of each wait between two acknowledged appends longer than STALL_NOTED_S
        self.stalls: list[tuple[float, float]] = []
        # (when, event) of each append call that failed (a writer's)
        self.calls_failed: list[tuple[float, dict]] = []
        # op -> [when it was sent, when it was acknowledged or given up (0: not yet)]
        self.times: dict[str, list[float]] = {}
        self.claims: list[tuple[str, float]] = []  # a prober's: (PD node, when it led)
        self.done = threading.Event()
        self.log_path = lab.data_dir / f"driver-{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = lab.net.popen(node, [
            sys.executable, "-m", "integration.faults.driver", role, "--pd",
            lab.cluster.pd_address, "--name", name,
            *(["--stream", str(stream)] if stream is not None else []), *options],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1)
        self._reader = threading.Thread(target=self._read, name=f"driver-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        h = self.history
        for line in self.proc.stdout:
            event = json.loads(line)
            kind = event["e"]
            if kind == "sent":
                h.record_sent(event["op"], self.name, event["stream"], event["digest"])
                self.times[event["op"]] = [time.monotonic(), 0.0]
            elif kind == "acked":
                h.record_acked(event["op"], event["offset"], event["range"])
                now = time.monotonic()
                self.times[event["op"]][1] = now
                self._acked_at(now)
                self.acked += 1
            elif kind == "failed":
                h.record_failed(event["op"], event["error"])
                self.times[event["op"]][1] = time.monotonic()
                self.failed += 1
            elif kind == "call_failed":
                self.calls_failed.append((time.monotonic(), event))
            elif kind == "seen":
                h.record_seen(self.name, event["stream"], event["offset"], event["count"],
                              event["digest"], event["server"])
                self.seen += 1
            elif kind == "error":
                self.errors.append(event["error"])
            elif kind == "claim":
                self.claims.append((event["node"], event["t"]))
            elif kind == "done":
                self.done.set()

    def _acked_at(self, now: float) -> None:
        if self.last_ack is not None:
            waited = now - self.last_ack
            self.longest_stall_s = max(self.longest_stall_s, waited)
            if waited > STALL_NOTED_S:
                self.stalls.append((self.last_ack, now))
        self.last_ack = now

    def wait_for(self, count: int, what: str = "acked", timeout: float = 60.0) -> None:
        """Block until ``count`` more batches were acknowledged (``what="seen"``: read)."""
        target = getattr(self, what) + count
        wait_until(lambda: getattr(self, what) >= target or self.proc.poll() is not None,
                   timeout, f"{self.name} to get {count} more batches {what} (errors: "
                   f"{self.errors[-2:]}, log: {self.log_path})")
        assert getattr(self, what) >= target, \
            f"driver {self.name} exited with {self.proc.returncode}: {self.log_tail()}"

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the driver to finish (a writer completes its append) and wait for it. A writer
        waiting for an acknowledgement since longer than ``STALL_NOTED_S`` counts that wait as
        a stall up to now."""
        if self.role == "writer" and self.last_ack is not None and self.proc.poll() is None:
            now = time.monotonic()
            if now - self.last_ack > STALL_NOTED_S:
                self.stalls.append((self.last_ack, now))
                self.longest_stall_s = max(self.longest_stall_s, now - self.last_ack)
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
            except OSError:
                pass  # it is exiting already
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        self._log.close()
        assert self.done.is_set(), f"driver {self.name} did not finish: {self.log_tail()}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class Lab:
    """A cluster of one PD and ``range_servers`` range servers, plus client nodes, each on a
    network node of its own. Use as a context manager: everything is stopped and removed on
    the way out, also after a failure.

    ``pd_nodes`` > 0: a PD cluster instead, node ``i`` on node ``pd<i>``, over a local etcd
    that runs on ``host`` (this process's node), so a PD node can be cut off from etcd alone;
    or with ``etcd_members`` > 0, over an etcd of that many members, member ``i`` on node
    ``etcd<i>`` (``self.etcd``, a ``LocalEtcd`` with a member on each node).
    ``replication_rtt_ms``: the links between range servers add this round trip."""

    def __init__(self, data_dir: Path, range_servers: int, clients: list[str],
                 replication_rtt_ms: float | None = None, pd_nodes: int = 0,
                 etcd_members: int = 0) -> None:
        if etcd_members and not pd_nodes:
            raise ValueError(f"etcd_members={etcd_members} needs PD nodes (pd_nodes > 0): a "
                             "lone PD keeps its metadata in SQLite")
        self.data_dir = Path(data_dir)
        self.history = History()
        self.drivers: list[Driver] = []
        # "replica <id> range <index>" -> why that replica served nothing of the range
        self.replicas_without: dict[str, str] = {}
        servers = [f"rs{i}" for i in range(range_servers)]
        pds = [f"pd{i}" for i in range(pd_nodes)] if pd_nodes else ["pd"]
        members = [f"etcd{i}" for i in range(etcd_members)]
        self.net = Network([*pds, *servers, *members, *clients], log_dir=self.data_dir)
        self.etcd: LocalEtcd | None = None
        try:
            if members:
                self.etcd = LocalEtcd(self.data_dir / "etcd", start_timeout_s=60.0,
                                      placements=[self.net[m].placement() for m in members]
                                      ).start()
            if replication_rtt_ms is not None:
                # Slow links between range servers (forwards, cap notices), before any opens.
                for server in servers:
                    self.net.shape(server, [s for s in servers if s != server],
                                   replication_rtt_ms)
            placements = {ProcessCluster.role_name(i): self.net[s].placement()
                          for i, s in enumerate(servers)}
            if pd_nodes:
                placements.update({ProcessCluster.pd_node_name(i): self.net[n].placement()
                                   for i, n in enumerate(pds)})
            else:
                placements["pd"] = self.net["pd"].placement()
            self.cluster = ProcessCluster(
                self.data_dir, range_servers=range_servers, pd_nodes=pd_nodes,
                host=self.net["host"].address, placements=placements,
                etcd_endpoints=self.etcd.endpoints if self.etcd is not None else ())
            self.cluster.start()
            self.pool = ConnectionPool(HOST_CONFIG)
            self.client = SbpClient(self.cluster.pd_address, HOST_CONFIG, self.pool)
            self.wait_servers_live()
        except BaseException:
            self._stop_servers()
            raise

    def _stop_servers(self) -> None:
        try:
            if hasattr(self, "cluster"):
                self.cluster.stop()
            if self.etcd is not None:
                self.etcd.stop()
        finally:
            self.net.close()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for driver in self.drivers:
                if driver.proc.poll() is None:
                    driver.proc.kill()
                    driver.proc.wait()
            self.pool.close()
        finally:
            self._stop_servers()

    # -- nodes ------------------------------------------------------------------------------

    def server_node(self, address: str) -> str:
        """The node name of the range server at ``address``."""
        return self.net.node_of(address).name

    def wait_servers_live(self, timeout: float = 60.0) -> None:
        """Wait until the PD (a PD cluster's leader) sees every range server live: a leader
        knows a server once it heartbeated to that leader."""
        count = len(self.cluster.range_servers)
        wait_until(lambda: sum(s.live for s in self.client.pd.range_servers()) >= count,
                   timeout, f"the PD to see all {count} range servers live")

    def pd_leader(self) -> str | None:
        """The node of the PD node that leads, as the PD cluster says (None: none yet)."""
        for member in self.client.pd.describe_pd_cluster().members:
            if member.is_leader:
                return self.net.node_of(member.advertise_addr).name
        return None

    def primary_node(self, stream: int) -> str:
        """The node of the primary of the stream's open range."""
        rng = self.client.list_ranges(stream)[-1]
        return self.server_node(_primary(rng))

    def secondary_nodes(self, stream: int) -> list[str]:
        rng = self.client.list_ranges(stream)[-1]
        return [self.server_node(r.server.advertise_addr) for r in rng.servers
                if not r.is_primary]

    def server_index(self, node: str) -> int:
        """The ``ProcessCluster`` index of the range server on ``node``."""
        return int(node.removeprefix("rs"))

    # -- clients ----------------------------------------------------------------------------

    def writer(self, node: str, stream: int, name: str | None = None, idempotent: bool = False,
               pause_s: float = 0.02, batches: int = 8, resend_failed: bool = False,
               client: str = "patient") -> Driver:
        """A writer driver on ``node`` (``driver.py``: ``resend_failed`` sends the batches of a
        failed call again; ``client`` "default" uses the client's default settings)."""
        name = name or node
        writer_id = sum(1 for d in self.drivers if d.role == "writer")
        options = ["--pause-s", str(pause_s), "--batches", str(batches), "--writer-id",
                   str(writer_id), "--client", client]
        if resend_failed:
            options.append("--resend-failed")
        if idempotent:
            options.append("--idempotent")
            self.history.mark_idempotent(name)
        driver = Driver(self, node, "writer", name, stream, *options)
        self.drivers.append(driver)
        return driver

    def prober(self, node: str, name: str | None = None) -> Driver:
        """A driver on ``node`` asking every PD node whether it leads (its ``claims``)."""
        driver = Driver(self, node, "prober", name or node, None)
        self.drivers.append(driver)
        return driver

    def tail(self, node: str, stream: int, name: str | None = None, prefer: str = "",
             client: str = "patient") -> Driver:
        options = ["--client", client, *(["--prefer", prefer] if prefer else [])]
        driver = Driver(self, node, "tail", name or node, stream, *options)
        self.drivers.append(driver)
        return driver

    # -- after healing ----------------------------------------------------------------------

    def stream_end(self, stream: int) -> int:
        last = self.client.list_ranges(stream)[-1]
        return self.client.open_range_end(last) if last.is_open else last.end_offset

    def wait_tails(self, stream: int, timeout: float = 60.0) -> None:
        """Wait until every tail of ``stream`` has seen up to its end."""
        end = self.stream_end(stream)
        for driver in self.drivers:
            if driver.role == "tail" and driver.stream == stream:
                wait_until(lambda d=driver: self._tail_offset(d.name, stream) >= end, timeout,
                           f"tail {driver.name} to reach offset {end} of stream {stream} "
                           f"(errors: {driver.errors[-3:]})")

    def _tail_offset(self, name: str, stream: int) -> int:
        ends = [s.offset + s.count for s in list(self.history.seen)
                if s.observer == name and s.stream == stream]
        return max(ends, default=0)

    def record_final(self, stream: int) -> None:
        """Read ``stream`` end to end into the history's final log, and each of its ranges
        from each replica (observer ``replica <id> range <index>``)."""
        log = [(b.header.base_offset, b.header.record_count, digest(b.data[ENVELOPE_SIZE:]))
               for b in self.client.read(stream)]
        self.history.record_final(stream, log)
        for rng in self.client.list_ranges(stream):
            end = rng.end_offset if not rng.is_open else -1
            for replica in rng.servers:
                server = self.client.range_server(replica.server.advertise_addr)
                observer = f"replica {replica.server.server_id} range {rng.range_index}"
                try:
                    with closing(server.fetch(stream, rng.start_offset, end)) as batches:
                        for header, data in batches:
                            if end != -1 and header.base_offset >= end:
                                break
                            self.history.record_seen(
                                observer, stream, header.base_offset, header.record_count,
                                digest(data[ENVELOPE_SIZE:]), replica.server.advertise_addr)
                except (OffsetOutOfRangeError, RangeNotFoundError, RangeSealedError) as exc:
                    # A replica that never received the range, or holds nothing of it, says
                    # so: what a replica holds is checked, what it lacks is no reader's view.
                    # (One cut off during the failover fenced the range below the PD's end and
                    # says it is sealed there until the PD's end reaches it.)
                    self.replicas_without[observer] = f"{type(exc).__name__}: {exc}"

    def check(self, *streams: int, tail_timeout: float = 60.0) -> Verdict:
        """Stop the writers, let every tail reach the end of its stream and stop it, read the
        final logs of ``streams`` and judge the history."""
        for driver in self.drivers:
            if driver.role == "writer":
                driver.stop()
        try:
            for stream in streams:
                self.wait_tails(stream, tail_timeout)
        finally:
            for driver in self.drivers:
                if driver.role != "writer":
                    driver.stop()
        for stream in streams:
            self.record_final(stream)
        return self.history.check()

    def failovers(self) -> int:
        """How many ranges the PD (every PD node) failed over so far (its log says each)."""
        return sum(path.read_text(errors="replace").count("failover: range")
                   for path in self.cluster.data_dir.glob("pd*.log"))


def _primary(rng: Range) -> str:
    return next(r.server.advertise_addr for r in rng.servers if r.is_primary)
