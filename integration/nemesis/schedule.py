"""The nemesis's fault schedule: which faults come, in what order, how long each lasts and how
long the cluster is left alone in between, all drawn from one seed (no I/O, no clock).

Faults fall into two domains, each with its own sequence:

- ``range servers``: kill -9 of a primary (restarted after its outage), SIGSTOP of a range
  server (SIGCONT after the pause), and partitions of a primary from the PD nodes, from its
  secondaries, or from the clients;
- ``control plane``: kill -9 of the PD leader or of a PD follower, kill -9 of an etcd member
  (each restarted after its outage), SIGSTOP of a PD node or of an etcd member.

The rule that keeps every fault survivable: at most one fault per domain at a time, and a
domain's next fault starts only once the cluster is whole again (every range server live at
the PD leader; every PD node and etcd member serving, with one leader) and its quiet gap has
passed. So at most one range server and one PD node or etcd member are impaired at once:
3-replica ranges keep two replicas, the PD cluster two of three nodes, etcd a quorum.

A fault's target is chosen when it starts, from what the cluster looks like then (the primary
of which stream, which follower): ``pick`` says which of the candidates, so a replay with the
same seed makes the same choices in the same situations.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

RANGE_SERVERS = "range servers"
CONTROL_PLANE = "control plane"
DOMAINS = (RANGE_SERVERS, CONTROL_PLANE)
# Quiet time in a domain between the moment the cluster is whole again and its next fault.
GAP_S = (3.0, 15.0)


@dataclass(frozen=True)
class Kind:
    """A kind of fault: its domain, the range its duration is drawn from, and what it does."""

    name: str
    domain: str
    duration_s: tuple[float, float]
    what: str


KINDS = {k.name: k for k in (
    Kind("kill-primary", RANGE_SERVERS, (1.0, 10.0),
         "kill -9 the primary of a stream's open range; restart it after the outage"),
    Kind("pause-range-server", RANGE_SERVERS, (1.0, 8.0),
         "SIGSTOP a range server; SIGCONT after the pause"),
    Kind("cut-primary-from-pd", RANGE_SERVERS, (3.0, 15.0),
         "drop everything between the primary of a stream's open range and every PD node"),
    Kind("cut-primary-from-secondaries", RANGE_SERVERS, (3.0, 15.0),
         "drop everything between the primary of a stream's open range and its secondaries"),
    Kind("cut-primary-from-clients", RANGE_SERVERS, (3.0, 15.0),
         "drop everything between the primary of a stream's open range and the writers "
         "(client drivers and the Spark node)"),
    Kind("kill-pd-leader", CONTROL_PLANE, (1.0, 10.0),
         "kill -9 the PD leader; restart it after the outage"),
    Kind("kill-pd-follower", CONTROL_PLANE, (1.0, 10.0),
         "kill -9 a PD follower; restart it after the outage"),
    Kind("kill-etcd-member", CONTROL_PLANE, (1.0, 10.0),
         "kill -9 an etcd member; restart it after the outage"),
    Kind("pause-pd-node", CONTROL_PLANE, (1.0, 8.0),
         "SIGSTOP a PD node (leader or follower); SIGCONT after the pause"),
    Kind("pause-etcd-member", CONTROL_PLANE, (1.0, 8.0),
         "SIGSTOP an etcd member; SIGCONT after the pause"),
)}


@dataclass(frozen=True)
class Planned:
    """One fault of a domain's sequence."""

    domain: str
    number: int  # its place in the domain's sequence, from 1
    kind: str
    duration_s: float
    gap_s: float  # quiet time before it, once the cluster is whole after the previous one
    pick: int  # which candidate target: pick % (number of candidates)

    def describe(self) -> str:
        return f"{self.kind} for {self.duration_s:g} s after {self.gap_s:g} s quiet"


def plan(seed: int, minutes: float) -> dict[str, list[Planned]]:
    """Each domain's fault sequence for ``seed``: at least enough to fill ``minutes`` of faults
    and gaps (the run stops starting faults when its time is up). The same seed always gives
    the same sequences, and a longer run's sequence starts with a shorter one's."""
    if minutes <= 0:
        raise ValueError(f"minutes={minutes!r}: a run needs some time for its faults")
    sequences = {}
    for domain in DOMAINS:
        rng = random.Random(f"sbp-nemesis/{seed}/{domain}")
        kinds = sorted(k.name for k in KINDS.values() if k.domain == domain)
        items: list[Planned] = []
        planned_s = 0.0
        while planned_s < minutes * 60:
            kind = KINDS[rng.choice(kinds)]
            item = Planned(domain, len(items) + 1, kind.name,
                           round(rng.uniform(*kind.duration_s), 1),
                           round(rng.uniform(*GAP_S), 1), rng.randrange(1 << 16))
            items.append(item)
            planned_s += item.gap_s + item.duration_s
        sequences[domain] = items
    return sequences
