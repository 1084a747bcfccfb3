"""Which PD node leads: a lease-backed election in etcd, and the fence on the leader's writes.

Every PD node of a cluster holds an etcd lease (``lease_ttl_s``, renewed every third of it) and
keeps its member key (``<prefix>members/<name>``: name and address) attached to it, so a node
that stops renewing disappears from the membership by itself. The leader is whoever holds
``<prefix>leader``, also attached to its lease: a node campaigns by creating that key in a
transaction that only succeeds when it does not exist, and followers try again every
``poll_s`` until it does. When the leader's lease expires (the node died, or cannot reach
etcd), etcd deletes the key and the next follower's campaign takes it over.

Two rules keep two nodes from ever acting as leader at once:

* Fencing in etcd. Every metadata write of the leader carries a compare that the leader key
  still exists with the create revision it had when this node took office (``compare``). A
  key deleted with an expired lease, or taken over since, fails the compare, and the write is
  refused as a whole (``etcd_store.py``). So a former leader changes nothing, whatever it
  believes.
* Stepping down in time. A node counts its lease from the moment it *sent* the request that
  granted or renewed it, so its own deadline falls before etcd's; it stops answering as leader
  (``is_leader``) ``margin_s`` before that deadline. A new leader can only be elected after
  etcd expired the key, which is after that. A leader cut off from etcd thus goes quiet before
  anyone else can take over, and no client is answered by two leaders.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import PdNotLeaderError

from ..etcd_client import Compare, EtcdClient, EtcdError, Get, KeyValue, Put

log = logging.getLogger(__name__)

# Lease of a PD node: a dead leader is replaced within about this long (etcd raises TTLs below
# its minimum, about 1.5 s with default settings).
DEFAULT_LEASE_TTL_S = 3
# How often a follower asks whether the leader key is free.
DEFAULT_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Member:
    """A PD node as the cluster knows it."""

    name: str
    address: str


class Leadership:
    """This node's part in the election: campaigns, renews its lease, knows the leader.

    ``address()`` is where clients reach this node, asked once it campaigns (a node learns its
    port when it starts listening).
    """

    def __init__(self, etcd: EtcdClient, prefix: str, name: str, address: Callable[[], str],
                 lease_ttl_s: int = DEFAULT_LEASE_TTL_S, poll_s: float = DEFAULT_POLL_S,
                 on_elected: Callable[[], None] | None = None,
                 on_deposed: Callable[[], None] | None = None) -> None:
        if lease_ttl_s < 2:
            raise ValueError(f"lease_ttl_s={lease_ttl_s} must be at least 2 seconds")
        self.etcd = etcd
        self._name = name
        self._address = address
        self.key = f"{prefix}leader".encode()
        self._members_prefix = f"{prefix}members/".encode()
        self.lease_ttl_s = lease_ttl_s
        self.poll_s = poll_s
        self.margin_s = min(0.5, lease_ttl_s / 6)
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._lock = threading.Lock()
        self._lease = 0
        self._valid_until = 0.0  # monotonic deadline of the lease, as this node counts it
        self._office = 0  # create revision of the leader key this node holds (0: follower)
        self._leader: Member | None = None
        # When etcd last showed a follower the leader key (monotonic, taken before the read):
        # that leader is named for ``lease_ttl_s`` from then, no longer (see _known_leader).
        self._leader_seen = 0.0
        self._members: list[Member] = []  # as etcd last showed them
        self._next_renewal = 0.0
        self._next_view = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what others ask ---------------------------------------------------------------------

    @property
    def me(self) -> Member:
        """This node as the cluster knows it."""
        return Member(self._name, self._address())

    def is_leader(self) -> bool:
        """Whether this node may act as leader now."""
        with self._lock:
            return self._leads()

    def check_leading(self) -> None:
        """Raise the refusal of a follower (``not_leader``) unless this node leads now."""
        if not self.is_leader():
            raise self.not_leader()

    def _leads(self) -> bool:
        # with self._lock held
        return self._office > 0 and time.monotonic() < self._valid_until - self.margin_s

    def _known_leader(self) -> Member | None:
        # with self._lock held; a node whose lease is running out names no leader, not itself
        if self._office:
            return self.me if self._leads() else None
        # A follower names the leader etcd showed it within a lease's time: without a renewal
        # (which only etcd can confirm) that leader's lease has run out since, and it stepped
        # down. Naming it longer, while etcd is unreachable, sent clients back to a node that
        # could no longer act, again and again.
        if self._leader is not None and \
                time.monotonic() - self._leader_seen < self.lease_ttl_s:
            return self._leader
        return None

    def cluster(self) -> m.PlacementDriverCluster:
        """Every member and which one leads, as this node last saw them."""
        with self._lock:
            members = list(self._members)
            leader = self._known_leader()
        if leader is not None and leader not in members:
            members.append(leader)
        if self.me not in members:
            members.append(self.me)
        return m.PlacementDriverCluster(members=[
            m.PlacementDriverNode(name=x.name, advertise_addr=x.address,
                                  is_leader=leader is not None and x.name == leader.name)
            for x in sorted(members, key=lambda x: x.name)])

    def not_leader(self) -> PdNotLeaderError:
        """The refusal of a follower: it names the leader and carries the cluster."""
        with self._lock:
            leader, last = self._known_leader(), self._leader
            unconfirmed_s = time.monotonic() - self._leader_seen
        if leader is not None:
            where = f"the leader is {leader.name} at {leader.address}"
        elif last is not None and not self._office:
            where = (f"no leader is known: etcd last showed {last.name} leading "
                     f"{unconfirmed_s:.1f} s ago, and has not confirmed it since")
        else:
            where = "no leader is elected right now"
        return PdNotLeaderError(f"PD {self.me.name} is not the leader: {where}",
                                detail=self.cluster().to_flatbuffers())

    # -- the fence (etcd_store.Fence) --------------------------------------------------------

    def compare(self) -> Compare:
        if not self.is_leader():
            raise self.not_leader()
        with self._lock:
            return Compare.created_at(self.key, self._office)

    def holds(self, current: list[KeyValue]) -> bool:
        with self._lock:
            held = bool(current) and current[0].create_revision == self._office
        if not held:
            self._step_down("a write found the leader key taken or gone")
        return held

    def lost(self) -> PdNotLeaderError:
        return self.not_leader()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"{self.me.name}-election")
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a leader resigns at once (its lease is revoked), so a follower
        takes over without waiting for the lease to run out."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._step_down("stopping")
        with self._lock:
            lease, self._lease = self._lease, 0
        if lease:
            try:
                self.etcd.lease_revoke(lease)
            except EtcdError as exc:
                log.warning("PD %s: revoking its lease failed (it runs out in %d s): %s",
                            self.me.name, self.lease_ttl_s, exc)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                self._tick()
                failing_since = None
            except EtcdError as exc:
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                    log.warning("PD %s: etcd does not answer: %s", self.me.name, exc)
                if self._office and not self.is_leader():
                    self._step_down("its lease could not be renewed in time")
            self._stop.wait(self.poll_s)

    def _tick(self) -> None:
        if self._lease and time.monotonic() >= self._next_renewal:
            # Also once this node's own count says the lease ran out: etcd may have kept it
            # (it extends leases when its raft leader changes), and then this node takes its
            # office back at once instead of waiting for the old key to expire.
            self._renew()
        if not self._lease:
            self._new_session()
        if self._office:
            if not self.is_leader():
                self._step_down("its lease ran out")
        elif time.monotonic() < self._valid_until - self.margin_s:
            self._campaign()  # only on a lease this node may still count on
        if time.monotonic() >= self._next_view:
            self._refresh_view()

    def _new_session(self) -> None:
        sent = time.monotonic()
        lease, ttl = self.etcd.lease_grant(self.lease_ttl_s)
        self.etcd.put(self._members_prefix + self.me.name.encode(), json.dumps(
            {"name": self.me.name, "address": self.me.address}).encode(), lease)
        with self._lock:
            self._lease, self._valid_until = lease, sent + ttl
        self._next_renewal = sent + ttl / 3
        self._next_view = 0.0
        log.info("PD %s joined the cluster (lease %x, %d s)", self.me.name, lease, ttl)

    def _renew(self) -> None:
        sent = time.monotonic()
        ttl = self.etcd.lease_keepalive(self._lease, timeout_s=max(0.5, self.lease_ttl_s / 3))
        if ttl <= 0:
            log.warning("PD %s: its lease expired in etcd", self.me.name)
            self._step_down("its lease expired")
            with self._lock:
                self._lease = 0
            return
        with self._lock:
            self._valid_until = sent + ttl
        self._next_renewal = sent + ttl / 3

    def _campaign(self) -> None:
        value = json.dumps({"name": self.me.name, "address": self.me.address}).encode()
        sent = time.monotonic()
        result = self.etcd.txn([Compare.absent(self.key)], [Put(self.key, value, self._lease)],
                               [Get(self.key)])
        if result.succeeded:
            self._take_office(result.revision)
            return
        current = result.reads[0]
        if current and current[0].lease == self._lease:
            # Ours already: a campaign whose answer was lost, or a renewal that came late.
            self._take_office(current[0].create_revision)
            return
        leader = _member(current[0].value) if current else None
        with self._lock:
            changed, self._leader = leader != self._leader, leader
            self._leader_seen = sent
        if changed and leader is not None:
            log.info("PD %s: the leader is %s at %s", self.me.name, leader.name, leader.address)

    def _take_office(self, revision: int) -> None:
        with self._lock:
            self._office, self._leader = revision, self.me
        log.warning("PD %s is now the leader (revision %d)", self.me.name, revision)
        if self._on_elected is not None:
            self._on_elected()

    def _step_down(self, why: str) -> None:
        with self._lock:
            was, self._office = self._office, 0
            if was:
                self._leader = None
        if was:
            log.warning("PD %s is no longer the leader: %s", self.me.name, why)
            if self._on_deposed is not None:
                self._on_deposed()

    def _refresh_view(self) -> None:
        kvs, _ = self.etcd.range(self._members_prefix, prefix=True)
        members = [_member(kv.value) for kv in kvs]
        with self._lock:
            self._members = [x for x in members if x is not None] or [self.me]
        self._next_view = time.monotonic() + min(1.0, self.lease_ttl_s / 3)
        if self._office:
            current = self.etcd.get(self.key)
            if current is None or current.create_revision != self._office:
                self._step_down("the leader key is gone or taken")


def _member(value: bytes) -> Member | None:
    try:
        data = json.loads(value)
        return Member(str(data["name"]), str(data["address"]))
    except (ValueError, KeyError, TypeError):
        return None


class LoneOffice:
    """The office of a lone PD (metadata in SQLite, no election): it always leads, and the
    cluster is itself alone. ``address()`` is where clients reach it."""

    def __init__(self, name: str, address: Callable[[], str]) -> None:
        self._name = name
        self._address = address

    def is_leader(self) -> bool:
        return True

    def check_leading(self) -> None:
        """Nothing to refuse: a lone PD leads from its start to its stop."""

    def cluster(self) -> m.PlacementDriverCluster:
        return m.PlacementDriverCluster(members=[m.PlacementDriverNode(
            name=self._name, advertise_addr=self._address(), is_leader=True)])
