"""Network namespaces joined by a bridge, and the faults a test injects into them.

Layout of one ``Network`` (``n`` counts the networks this process made, ``pid`` is its id)::

    sbpn<pid>-<n>-hub      the switch: bridge br0, one veth port per node, the drop rules
    sbpn<pid>-<n>-<node>   one namespace per node, eth0 = 198.18.x.y/24 (or 198.19.x.y)
    sbpn<pid>h<n>          this process's own namespace joins the bridge too (node "host"),
                           so the test process can talk to every node

Addresses come from 198.18.0.0/15 (set aside for benchmarking networks, RFC 2544): one /24
that no address or route of this host uses yet, only on these links, never routed anywhere.

Faults are silent, as on a real network: frames are dropped at the switch (nftables, bridge
family), so peers see no reset, only silence. ``isolate`` cuts a node off from everyone,
``partition`` cuts two groups of nodes apart, ``drop`` cuts one direction only, ``link_down``
takes a node's cable out; ``heal`` undoes them. ``shape`` makes a node's links to chosen peers
slow (latency and a bandwidth cap) through the delay-line proxy of ``delay.py``.

Everything is removed by ``close()`` (also on errors: use ``with Network(...)``); a run that was
killed leaves names whose pid is gone, which ``remove_leftovers()`` deletes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sbp_spark.server.cluster import Placement

from .reaper import dying_with_parent

PREFIX = "sbpn"
SUPERNET = ipaddress.ip_network("198.18.0.0/15")
HOST = "host"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_OURS = re.compile(rf"^{PREFIX}(\d+)[-h]")
_TABLE = "sbpnet"  # nftables table of the switch (bridge family) and of shaped nodes (ip)
_SHAPE_MARK = 0x5B5  # the delay proxy's own upstream connections carry it: not redirected
_counter = itertools.count(1)
REPO = Path(__file__).resolve().parents[2]


class NetworkError(RuntimeError):
    """A command that builds or breaks the network failed."""


def run(*args: str, input: str | None = None, check: bool = True) -> str:
    """Run one command; its output. NetworkError naming the command and its error."""
    try:
        done = subprocess.run(args, input=input, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkError(f"{' '.join(args)}: {exc}") from exc
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(args)} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why networks cannot be built here (None when they can): root, ip, nft, namespaces."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth links and nftables rules"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"the {tool} command is missing (apt-get install {package})"
    probe = f"{PREFIX}{os.getpid()}-0-probe"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "netns", "exec", probe, "nft", "add", "table", "bridge", _TABLE)
    except NetworkError as exc:
        return f"network namespaces or nftables do not work here: {exc}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces and links of networks whose process is gone (a killed run);
    returns their names. Networks of live processes are left alone."""
    removed = []
    for ns in run("ip", "netns", "list", check=False).split():
        match = _OURS.match(ns)
        if match and not _pid_alive(int(match.group(1))):
            _kill_members(ns)
            run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    for line in run("ip", "-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        match = _OURS.match(name)
        if match and not _pid_alive(int(match.group(1))):
            run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def _kill_members(ns: str) -> None:
    """SIGKILL the processes still inside namespace ``ns`` (ours: we made it)."""
    for pid in run("ip", "netns", "pids", ns, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks this host's own namespace has addresses or routes in."""
    used = []
    for word in run("ip", "-4", "-o", "addr", "show", check=False).split():
        if "/" in word:
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_interface(word).network)
    for line in run("ip", "-4", "route", "show", "table", "all", check=False).splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("default", "broadcast", "local", "unreachable", "prohibit"):
            continue
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(first, strict=False))
    return used


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    subnets = list(SUPERNET.subnets(new_prefix=24))
    used = _used_networks()
    for i in range(len(subnets)):
        candidate = subnets[(seed + i) % len(subnets)]
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise NetworkError(f"every /24 of {SUPERNET} is in use on this host")


@dataclass(frozen=True)
class Node:
    """One machine of the network: its namespace (None: this process's own) and address."""

    name: str
    namespace: str | None
    address: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """Command prefix that runs a program on this node (exec in place: same pid)."""
        return ("ip", "netns", "exec", self.namespace) if self.namespace else ()

    def placement(self) -> Placement:
        """Where a ``ProcessCluster`` role on this node listens and how it is started."""
        return Placement(self.address, self.prefix)


@dataclass(frozen=True)
class Fault:
    """A set of drop rules: (source, destination) addresses, None for any."""

    what: str
    rules: tuple[tuple[str | None, str | None], ...]


@dataclass
class Shaper:
    """A slow link: the delay proxy process on ``node`` and what it delays."""

    node: Node
    targets: tuple[str, ...]
    rtt_ms: float
    rate_mbit: float | None
    process: subprocess.Popen
    port: int
    log_path: Path


@dataclass
class Network:
    """Namespaces ``nodes`` (plus ``host``, this process) on one switch; see the module doc.

    ``log_dir`` keeps the delay proxies' output."""

    nodes: Sequence[str] = ()
    log_dir: Path | None = None
    _nodes: dict[str, Node] = field(default_factory=dict, init=False)
    _faults: list[Fault] = field(default_factory=list, init=False)
    _shapers: dict[str, Shaper] = field(default_factory=dict, init=False)
    _down: set[str] = field(default_factory=set, init=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        bad = [n for n in self.nodes if not _NAME.match(n) or n == HOST]
        if bad or len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"node names {list(self.nodes)}: each must be unique, 1-10 "
                             f"lowercase letters and digits starting with a letter, not "
                             f"'{HOST}' (bad: {bad})")
        n = next(_counter)
        self.tag = f"{PREFIX}{os.getpid()}-{n}"
        self.hub = f"{self.tag}-hub"
        self._host_link = f"{PREFIX}{os.getpid()}h{n}"
        self.subnet = _free_subnet(os.getpid() * 7 + n)
        hosts = list(self.subnet.hosts())
        try:
            self._build(hosts)
        except BaseException:
            self.close()
            raise

    # -- building ---------------------------------------------------------------------------

    def _build(self, hosts: list) -> None:
        hub = self.hub
        run("ip", "netns", "add", hub)
        run("ip", "-n", hub, "link", "set", "lo", "up")
        run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", hub, "link", "set", "br0", "up")
        self._switch_rules()
        host_addr = str(hosts[0])
        run("ip", "link", "add", self._host_link, "type", "veth", "peer", "name", HOST,
            "netns", hub)
        run("ip", "addr", "add", f"{host_addr}/24", "dev", self._host_link)
        run("ip", "link", "set", self._host_link, "up")
        run("ip", "-n", hub, "link", "set", HOST, "master", "br0", "up")
        self._nodes[HOST] = Node(HOST, None, host_addr)
        for i, name in enumerate(self.nodes):
            ns = f"{self.tag}-{name}"
            address = str(hosts[9 + i])
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "link", "add", f"v-{name}", "netns", hub, "type", "veth", "peer", "name",
                "eth0", "netns", ns)
            run("ip", "-n", hub, "link", "set", f"v-{name}", "master", "br0", "up")
            run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._nodes[name] = Node(name, ns, address)

    def close(self) -> None:
        """Remove every namespace and link of this network (processes still inside are
        killed first); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for shaper in list(self._shapers.values()):
            self._stop_shaper(shaper)
        self._shapers.clear()
        for node in self._nodes.values():
            if node.namespace:
                _kill_members(node.namespace)
                run("ip", "netns", "del", node.namespace, check=False)
        run("ip", "netns", "del", self.hub, check=False)
        # The host link goes with its peer in the hub; make sure, without failing.
        deadline = time.monotonic() + 5
        while self._host_link in run("ip", "-o", "link", "show", check=False):
            if time.monotonic() > deadline:
                run("ip", "link", "del", self._host_link, check=False)
                break
            time.sleep(0.02)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- nodes ------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(f"no node {name!r} in this network (nodes: "
                           f"{', '.join(self._nodes)})") from None

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this network: the switch's and each node's."""
        return [self.hub, *(n.namespace for n in self._nodes.values() if n.namespace)]

    def node_of(self, address: str) -> Node:
        """The node with ``address`` (``host:port`` or a bare address)."""
        host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        for node in self._nodes.values():
            if node.address == host:
                return node
        raise KeyError(f"no node of this network has address {host}")

    def popen(self, node: str, args: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``args`` on ``node`` (from the repository root, so ``python -m
        integration...`` finds its modules). The process dies with the thread that starts it
        (``reaper.dying_with_parent``), so a killed run leaves none behind."""
        kwargs.setdefault("cwd", str(REPO))
        kwargs.setdefault("preexec_fn", dying_with_parent())
        return subprocess.Popen([*self[node].prefix, *args], **kwargs)

    # -- faults -----------------------------------------------------------------------------

    def _addresses(self, names: str | Iterable[str]) -> list[str]:
        return [self[n].address for n in ([names] if isinstance(names, str) else names)]

    def isolate(self, node: str) -> Fault:
        """Cut ``node`` off from every other node (both directions)."""
        (a,) = self._addresses(node)
        return self._add(Fault(f"{node} isolated", ((a, None), (None, a))))

    def partition(self, side_a: str | Iterable[str], side_b: str | Iterable[str]) -> Fault:
        """Cut every node of ``side_a`` off from every node of ``side_b`` (both directions);
        each side still reaches everyone else."""
        a_names = [side_a] if isinstance(side_a, str) else list(side_a)
        b_names = [side_b] if isinstance(side_b, str) else list(side_b)
        rules = tuple(rule for a in self._addresses(a_names) for b in self._addresses(b_names)
                      for rule in ((a, b), (b, a)))
        return self._add(Fault(f"{'+'.join(a_names)} | {'+'.join(b_names)}", rules))

    def drop(self, source: str, destination: str) -> Fault:
        """Drop everything ``source`` sends to ``destination``; the other way still works."""
        (a,) = self._addresses(source)
        (b,) = self._addresses(destination)
        return self._add(Fault(f"{source} -> {destination} dropped", ((a, b),)))

    def heal(self, fault: Fault | None = None) -> None:
        """Undo ``fault`` (every fault when None), and put taken-out cables back."""
        if fault is None:
            self._faults.clear()
            for name in list(self._down):
                self.link_up(name)
        else:
            self._faults = [f for f in self._faults if f is not fault]
        self._switch_rules()

    def link_down(self, node: str) -> None:
        """Take ``node``'s cable out (its switch port goes down): silence both ways."""
        run("ip", "-n", self.hub, "link", "set", f"v-{self[node].name}", "down")
        self._down.add(node)

    def link_up(self, node: str) -> None:
        run("ip", "-n", self.hub, "link", "set", f"v-{self[node].name}", "up")
        self._down.discard(node)

    @property
    def faults(self) -> list[Fault]:
        return list(self._faults)

    def _add(self, fault: Fault) -> Fault:
        self._faults.append(fault)
        self._switch_rules()
        return fault

    def _switch_rules(self) -> None:
        """Write the switch's rule set in one nftables transaction (no half-applied fault)."""
        lines = [f"table bridge {_TABLE} {{}}", f"delete table bridge {_TABLE}",
                 f"table bridge {_TABLE} {{",
                 "  chain forward { type filter hook forward priority 0; policy accept; }",
                 "}"]
        for fault in self._faults:
            for src, dst in fault.rules:
                match = " ".join(part for part in (
                    f"ip saddr {src}" if src else "", f"ip daddr {dst}" if dst else "") if part)
                lines.append(f"add rule bridge {_TABLE} forward {match} drop")
        run("ip", "netns", "exec", self.hub, "nft", "-f", "-", input="\n".join(lines) + "\n")

    # -- slow links -------------------------------------------------------------------------

    def shape(self, node: str, peers: Iterable[str], rtt_ms: float,
              rate_mbit: float | None = None, window_bytes: int | None = None) -> Shaper:
        """Make the TCP connections ``node`` opens to ``peers`` slow: ``rtt_ms`` more round
        trip and at most ``rate_mbit`` each way, through a delay proxy on ``node``. Only
        connections opened afterwards are affected; other traffic of the node is not."""
        where = self[node]
        if where.namespace is None:
            raise ValueError("shape a node of its own (the host namespace keeps its rules)")
        if node in self._shapers:
            raise ValueError(f"{node} is shaped already; unshape it first")
        targets = tuple(self._addresses(peers))
        log_path = Path(self.log_dir or "/tmp") / f"delay-{self.hub}-{node}.log"
        ready = log_path.with_suffix(".ready")
        ready.unlink(missing_ok=True)
        args = [sys.executable, "-m", "integration.netlab.delay", "--one-way-ms",
                str(rtt_ms / 2), "--mark", str(_SHAPE_MARK), "--ready-file", str(ready)]
        if rate_mbit:
            args += ["--rate-mbit", str(rate_mbit)]
        if window_bytes:
            args += ["--window-bytes", str(window_bytes)]
        with open(log_path, "ab") as log:
            proc = self.popen(node, args, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise NetworkError(f"the delay proxy on {node} did not start: "
                                   f"{log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)
        port = int(ready.read_text().strip())
        rules = "\n".join([
            f"table ip {_TABLE} {{",
            "  chain output { type nat hook output priority -100; policy accept;",
            f"    meta l4proto tcp ip daddr {{ {', '.join(targets)} }} "
            f"meta mark != {_SHAPE_MARK} redirect to :{port}",
            "  }", "}", ""])
        try:
            run("ip", "netns", "exec", where.namespace, "nft", "-f", "-", input=rules)
        except NetworkError:
            proc.kill()
            proc.wait()
            raise
        shaper = Shaper(where, targets, rtt_ms, rate_mbit, proc, port, log_path)
        self._shapers[node] = shaper
        return shaper

    def unshape(self, node: str) -> None:
        """Undo ``shape`` on ``node`` (new connections go direct again)."""
        shaper = self._shapers.pop(node, None)
        if shaper is not None:
            self._stop_shaper(shaper)

    def _stop_shaper(self, shaper: Shaper) -> None:
        run("ip", "netns", "exec", shaper.node.namespace or "", "nft", "delete", "table", "ip",
            _TABLE, check=False)
        shaper.process.terminate()
        try:
            shaper.process.wait(5)
        except subprocess.TimeoutExpired:
            shaper.process.kill()
            shaper.process.wait()
