"""Networks that fail: silent partitions (whole nodes, pairs of nodes, one direction) between
the PD, range servers and clients, each on a network namespace of its own (``netlab``).

Every case runs a real cluster (``Lab``: ``sbp pd`` and ``sbp range-server`` processes on
nodes ``pd`` and ``rs<i>``), client drivers on nodes of their own (writers and tails, recording
every operation into a ``History``), breaks the network while they run, heals it, and judges
the history (``history.py``): acknowledged batches readable at their offsets byte for byte,
no two readers ever seeing different bytes at one offset, every reader's view a prefix of the
final log, no holes, duplicates counted (none under idempotent writes). Needs root; skipped,
saying why, elsewhere.
"""

from __future__ import annotations

import time

import pytest

from sbp_spark.client.config import DEFAULT_PROBE_INTERVAL_S
from sbp_spark.protocol.records import ENVELOPE_SIZE, body_to_arrow
from sbp_spark.server.range_server.replication import SECONDARY_GIVE_UP_S
from tests.etcd import require_etcd

from .helpers import wait_until
from .history import Verdict, digest, leader_overlaps, leader_tenures
from .lab import Lab

pytestmark = pytest.mark.usefixtures("network_ready")

# Batches each writer gets acknowledged before a fault, during it, and after the heal.
BEFORE, DURING, AFTER = 40, 40, 40
# How long a fault lasts once the cluster has worked around it: long enough for clients to
# keep meeting the cut-off server, and for timeouts of a few seconds to run out.
HOLD_S = 6.0
# Round trips the slow-replication variant adds between range servers: the cut-off primary's
# forwards then arrive after the PD pushed the next range (its race, one run in eight without).
SLOW_REPLICATION_RTT_MS = 50.0
# The PD stays cut off this long: many liveness timeouts, so TCP retransmission timers of
# connections that went silent have backed off to several seconds when it heals.
PD_CUT_S = 20.0
# No fault of these cases may keep a writer waiting for an acknowledgement longer than this
# (issue 43): a writer does not wait for a network to heal (docs/reliability.md,
# "Partitions"). Checked in every case with writers (``assert_no_long_wait``).
LONGEST_WAIT_S = 8.0
# When a primary whose forwards go unanswered gives up on its secondaries: the forward's answer
# late by the give-up time, then its PING unanswered for a probe interval.
GIVE_UP_S = SECONDARY_GIVE_UP_S + DEFAULT_PROBE_INTERVAL_S
# The writer's link to its primary stays cut this long: twice the bound, so a writer that
# waited for the heal would fail the check.
WRITER_CUT_S = 2 * LONGEST_WAIT_S


def hold(seconds: float = HOLD_S) -> None:
    """Keep the fault in place this long (the fault's duration, not a wait for a condition)."""
    time.sleep(seconds)


def _report(figures: dict, lab: Lab, verdict, **extra) -> None:
    figures.update(verdict.figures)
    figures.update(extra)
    writers = [d for d in lab.drivers if d.role == "writer"]
    tails = [d for d in lab.drivers if d.role == "tail"]
    if writers:
        figures["longest wait for an ack"] = \
            f"{max(d.longest_stall_s for d in writers):.1f} s"
    if tails:
        figures["tail errors ridden out"] = sum(len(d.errors) for d in tails)
    if lab.replicas_without:
        figures["replicas lacking some of a range they are listed for"] = ", ".join(
            sorted(lab.replicas_without))


def assert_no_long_wait(lab: Lab) -> None:
    """No writer waited longer than ``LONGEST_WAIT_S`` between two acknowledgements."""
    waits = {d.name: d.longest_stall_s for d in lab.drivers if d.role == "writer"}
    long = {name: f"{wait:.1f} s" for name, wait in waits.items() if wait > LONGEST_WAIT_S}
    assert not long, (f"writers waited longer than {LONGEST_WAIT_S:g} s for an "
                      f"acknowledgement: {long} (logs: {lab.data_dir})")


def through_failover(lab: Lab, sid: int, writers: list, figures: dict, cut) -> Verdict:
    """Once every writer has ``BEFORE`` batches acknowledged, break the network with
    ``cut()``; wait until the PD failed the stream's open range over, keep the fault
    ``HOLD_S`` longer and until every writer got ``DURING`` more batches acknowledged, heal,
    let them get ``AFTER`` more, and judge the history (its figures go to ``figures``)."""
    for w in writers:
        w.wait_for(BEFORE)
    began = time.monotonic()
    fault = cut()
    wait_until(lambda: len(lab.client.list_ranges(sid)) > 1, 60,
               "the PD to fail the cut-off primary's range over")
    failed_over_s = time.monotonic() - began
    hold()
    for w in writers:
        w.wait_for(DURING)
    return heal_and_judge(lab, sid, fault, writers, figures, **{
        "range failed over after": f"{failed_over_s:.1f} s"})


def heal_and_judge(lab: Lab, sid: int, fault, writers: list, figures: dict,
                   **extra: object) -> Verdict:
    """Heal ``fault``, let every writer get ``AFTER`` more batches acknowledged, and judge the
    history; its figures, the stream's ranges and ``extra`` go to ``figures``."""
    lab.net.heal(fault)
    for w in writers:
        w.wait_for(AFTER)
    verdict = lab.check(sid)
    _report(figures, lab, verdict, **extra, ranges=len(lab.client.list_ranges(sid)))
    return verdict


@pytest.mark.timeout(300)
@pytest.mark.parametrize("replication_rtt_ms", [None, SLOW_REPLICATION_RTT_MS],
                         ids=["fast", "slow-replication"])
@pytest.mark.fault_case(
    "primary cut off from the PD (R=3)",
    "4 range servers, a 3-replica stream; drop everything between the primary of its open "
    "range and the PD (clients and secondaries still reach the primary) while 2 writers append "
    "and a tail reads, until the PD has failed the range over and writes went on; then heal. "
    f"slow-replication: the links between range servers add {SLOW_REPLICATION_RTT_MS:g} ms "
    "round trips, so the cut-off primary's last forwards reach the secondaries after the PD "
    "opened the next range there",
    "the history: acknowledged batches at their offsets byte for byte, readers (and replicas) "
    "agree, every reader's view a prefix of the final log, no holes; duplicates counted")
def test_primary_cut_off_from_the_pd(tmp_path, figures, replication_rtt_ms):
    with Lab(tmp_path, range_servers=4, clients=["w1", "w2", "r1"],
             replication_rtt_ms=replication_rtt_ms) as lab:
        [stream] = lab.client.create_streams(1, replicas=3)
        sid = stream.stream_id
        primary = lab.primary_node(sid)
        writers = [lab.writer("w1", sid), lab.writer("w2", sid)]
        lab.tail("r1", sid)
        through_failover(lab, sid, writers, figures,
                         lambda: lab.net.partition(primary, "pd")).assert_ok()
        assert_no_long_wait(lab)


@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "primary cut off from its secondaries (R=3)",
    "4 range servers, a 3-replica stream; drop everything between the primary of its open "
    "range and its two secondaries (all still reach the PD and the clients) while 2 writers "
    "append and a tail reads, until writes went on elsewhere; then heal",
    "the history, as above")
def test_primary_cut_off_from_its_secondaries(tmp_path, figures):
    with Lab(tmp_path, range_servers=4, clients=["w1", "w2", "r1"]) as lab:
        [stream] = lab.client.create_streams(1, replicas=3)
        sid = stream.stream_id
        primary, secondaries = lab.primary_node(sid), lab.secondary_nodes(sid)
        writers = [lab.writer("w1", sid), lab.writer("w2", sid)]
        lab.tail("r1", sid)
        for w in writers:
            w.wait_for(BEFORE)
        cut = time.monotonic()
        fault = lab.net.partition(primary, secondaries)
        # Well within the replication timeout (30 s): the clients asked for 2 s.
        for w in writers:
            w.wait_for(DURING, timeout=30)
        resumed_s = time.monotonic() - cut
        hold()
        heal_and_judge(lab, sid, fault, writers, figures, **{
            "writes went on after": f"{resumed_s:.1f} s"}).assert_ok()
        assert_no_long_wait(lab)


@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "primary cut off from its secondaries, then the PD leader killed (R=3)",
    "4 range servers, 3 PD nodes on etcd, a 3-replica stream; drop everything between the "
    "primary of its open range and its two secondaries while 2 writers (the client's default "
    "settings) append and a tail reads; kill -9 the PD leader as the primary gives up on its "
    f"secondaries and the writers ask for the seal ({GIVE_UP_S:g} s into the cut); hold the cut "
    f"{HOLD_S:g} s past the time writes went on, then heal and restart the PD node",
    "no writer waits more than 8 s for an acknowledgement, though the give-up, the PD's "
    "election and the new leader's seal come one after the other; the history, as above")
def test_primary_cut_off_from_its_secondaries_then_the_pd_leader_killed(tmp_path, figures):
    require_etcd()
    with Lab(tmp_path, range_servers=4, clients=["w1", "w2", "r1"], pd_nodes=3) as lab:
        [stream] = lab.client.create_streams(1, replicas=3)
        sid = stream.stream_id
        primary, secondaries = lab.primary_node(sid), lab.secondary_nodes(sid)
        writers = [lab.writer("w1", sid, client="default"),
                   lab.writer("w2", sid, client="default")]
        lab.tail("r1", sid)
        for w in writers:
            w.wait_for(BEFORE)
        leader = lab.pd_leader()
        assert leader is not None
        cut = time.monotonic()
        fault = lab.net.partition(primary, secondaries)
        time.sleep(GIVE_UP_S)
        index = int(leader.removeprefix("pd"))
        lab.cluster.kill_pd_node(index)
        for w in writers:
            w.wait_for(DURING, timeout=30)
        resumed_s = time.monotonic() - cut
        new_leader = lab.pd_leader()
        hold()
        verdict = heal_and_judge(lab, sid, fault, writers, figures, **{
            "PD leader killed after": f"{GIVE_UP_S:g} s",
            "new leader": new_leader,
            "writes went on after": f"{resumed_s:.1f} s"})
        lab.cluster.start_pd_node(index)
        verdict.assert_ok()
        assert_no_long_wait(lab)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("idempotent", [False, True], ids=["plain", "idempotent"])
@pytest.mark.fault_case(
    "writer cut off from the primary mid-append, its answers lost (R=3)",
    "3 range servers, a 3-replica stream; drop everything the primary sends to one writer "
    "(its APPENDs still arrive and are stored; the answers are lost) while it appends, for "
    f"{WRITER_CUT_S:g} s; then heal. Plain: the writer sends again what it got no answer "
    "for; idempotent: it first looks for those batches' tags in the stream, as the idempotent "
    "streaming sink does",
    "the cut-off writer goes on during the cut (it seals the range and appends to the next, "
    "placed away from that primary), never waiting more than 8 s for an acknowledgement; the "
    "history, as above; plain: duplicates counted; idempotent: no batch stored twice")
def test_writer_cut_off_from_the_primary(tmp_path, figures, idempotent):
    with Lab(tmp_path, range_servers=3, clients=["w1", "w2", "r1"]) as lab:
        [stream] = lab.client.create_streams(1, replicas=3)
        sid = stream.stream_id
        primary = lab.primary_node(sid)
        cut_off = lab.writer("w1", sid, idempotent=idempotent)
        other = lab.writer("w2", sid, idempotent=idempotent)
        lab.tail("r1", sid)
        for w in (cut_off, other):
            w.wait_for(BEFORE)
        cut = time.monotonic()
        fault = lab.net.drop(primary, "w1")
        # While the cut lasts: the PD hears the primary, so nothing fails it over; the
        # writer used to wait for the heal.
        cut_off.wait_for(DURING, timeout=WRITER_CUT_S)
        resumed_s = time.monotonic() - cut
        hold(max(0.0, WRITER_CUT_S - resumed_s))
        other.wait_for(DURING)
        verdict = heal_and_judge(lab, sid, fault, [cut_off, other], figures, **{
            "cut-off writer went on after": f"{resumed_s:.1f} s"})
        figures["cut-off writer's appends given up"] = cut_off.failed
        verdict.assert_ok()
        assert_no_long_wait(lab)


@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "tail on a secondary while the primary is cut off and its range sealed (R=3)",
    "4 range servers, a 3-replica stream; a tail reads from a secondary (another reads as "
    "clients do: primary first) while a writer appends; the primary is cut off from every "
    "node (PD, secondaries, clients), the PD seals its range and opens the next elsewhere; "
    f"the cut lasts {HOLD_S:g} s past the failover; then heal",
    "the history, as above: in particular no tail sees a record the seal then removes")
def test_tail_on_a_secondary_while_the_range_is_sealed(tmp_path, figures):
    with Lab(tmp_path, range_servers=4, clients=["w1", "r1", "r2"]) as lab:
        [stream] = lab.client.create_streams(1, replicas=3)
        sid = stream.stream_id
        rng = lab.client.list_ranges(sid)[-1]
        primary = lab.primary_node(sid)
        secondary = next(r.server.advertise_addr for r in rng.servers if not r.is_primary)
        writer = lab.writer("w1", sid)
        lab.tail("r1", sid, prefer=secondary)
        lab.tail("r2", sid)
        through_failover(lab, sid, [writer], figures,
                         lambda: lab.net.isolate(primary)).assert_ok()
        assert_no_long_wait(lab)


@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "PD cut off from everything past the liveness timeout",
    "4 range servers, a 3-replica and a 1-replica stream; drop everything to and from the PD "
    f"for {PD_CUT_S:g} s (the PD's liveness timeout is 3 s) while a writer appends to "
    "each and a tail reads; then heal",
    "no range is failed over when the network heals (the servers were healthy: it was the PD "
    "that was cut off); the history, as above")
def test_pd_cut_off_from_everything(tmp_path, figures):
    with Lab(tmp_path, range_servers=4, clients=["w1", "w2", "r1"]) as lab:
        replicated = lab.client.create_streams(1, replicas=3)[0].stream_id
        single = lab.client.create_streams(1, replicas=1)[0].stream_id
        writers = [lab.writer("w1", replicated), lab.writer("w2", single)]
        lab.tail("r1", replicated)
        for w in writers:
            w.wait_for(BEFORE)
        ranges_before = {s: len(lab.client.list_ranges(s)) for s in (replicated, single)}
        fault = lab.net.isolate("pd")
        hold(PD_CUT_S)
        for w in writers:
            w.wait_for(DURING)
        lab.net.heal(fault)
        healed = time.monotonic()
        for w in writers:
            w.wait_for(AFTER)
        # Two liveness timeouts after the heal: any failover the heal caused has happened.
        hold(max(0.0, 6.0 - (time.monotonic() - healed)))
        failovers = lab.failovers()
        ranges_after = {s: len(lab.client.list_ranges(s)) for s in (replicated, single)}
        verdict = lab.check(replicated, single)
        _report(figures, lab, verdict, **{
            "ranges failed over at the heal": failovers,
            "ranges before / after": f"{ranges_before} / {ranges_after}"})
        verdict.assert_ok()
        assert_no_long_wait(lab)
        assert failovers == 0, (
            f"the PD failed {failovers} ranges of healthy servers over when the network "
            f"healed: {lab.cluster.data_dir / 'pd.log'}")


@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "PD leader cut off from etcd and the range servers (3 PD nodes)",
    "3 PD nodes over etcd, 3 range servers, a 3-replica stream; drop everything between the "
    "PD leader and both etcd and every range server (clients still reach it) while a writer "
    "appends, a tail reads and a prober asks every PD node every 50 ms whether it leads; a "
    f"follower takes over; the cut lasts {HOLD_S:g} s more, during which a stream is created; "
    "then heal",
    "no two PD nodes ever claim to lead at once (the prober's answers); no range is failed "
    "over (every range server stayed healthy); the history, as above")
def test_pd_leader_cut_off_from_etcd_and_range_servers(tmp_path, figures):
    require_etcd()
    servers = [f"rs{i}" for i in range(3)]
    with Lab(tmp_path, range_servers=3, clients=["w1", "r1", "p1"], pd_nodes=3) as lab:
        [stream] = lab.client.create_streams(1, replicas=3)
        sid = stream.stream_id
        writer = lab.writer("w1", sid)
        lab.tail("r1", sid)
        prober = lab.prober("p1")
        writer.wait_for(BEFORE)
        leader = lab.pd_leader()
        assert leader is not None
        began = time.monotonic()
        # etcd runs on this process's node ("host"): cut the leader off from it too.
        fault = lab.net.partition(leader, ["host", *servers])
        wait_until(lambda: lab.pd_leader() not in (None, leader), 60,
                   f"a follower to take over from {leader}")
        took_over_s = time.monotonic() - began
        lab.wait_servers_live()
        servers_found_s = time.monotonic() - began
        created = lab.client.create_streams(1, replicas=3)[0].stream_id  # the new leader acts
        hold()
        writer.wait_for(DURING)
        verdict = heal_and_judge(lab, sid, fault, [writer], figures, **{
            "new leader after": f"{took_over_s:.1f} s",
            "every range server heartbeating to it after": f"{servers_found_s:.1f} s",
            "stream created during the cut": created})
        overlaps = leader_overlaps(prober.claims, gap_s=0.5)
        tenures = leader_tenures(prober.claims, gap_s=0.5)
        figures["leader claims"] = (
            f"{len(prober.claims)} from {len({n for n, _ in prober.claims})} nodes; tenures: "
            + ", ".join(f"{lab.net.node_of(n).name} {end - start:.1f} s"
                        for n, start, end in tenures))
        figures["two leaders at once"] = len(overlaps)
        figures["ranges failed over"] = lab.failovers()
        verdict.assert_ok()
        assert_no_long_wait(lab)
        assert not overlaps, overlaps
        assert lab.failovers() == 0, (
            f"healthy range servers' ranges were failed over: {lab.data_dir}/pd-*.log")


# The relay's connector options: a read or append that meets the cut-off primary gives up
# on it after 3 s (and retries elsewhere) instead of the default 30 s.
RELAY_OPTIONS = {"retries": "60", "requestTimeoutMs": "3000"}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "Spark streaming relay through a partition of its input's primary (R=3)",
    "4 range servers, 3-replica streams; a writer appends to an input stream while "
    "readStream.format('sbp') relays it (key = input offset) into an output stream with "
    "writeStream.format('sbp') idempotent=true, requestTimeoutMs=3000; the primary of the "
    "input's open range (chosen to lead the output's too) is cut off from every node during a "
    f"micro-batch, until the PD failed its ranges over and {HOLD_S:g} s more; then heal",
    "the output holds every input record exactly once, byte for byte, without holes; the "
    "history of the input (the writer's, the relay's view of it, the final log) obeys the "
    "rules above")
def test_spark_relay_through_a_partition_of_its_input_primary(tmp_path, figures, spark):
    from .relay import Relay, check_output, stream_led_by

    with Lab(tmp_path, range_servers=4, clients=["w1"]) as lab:
        client = lab.client
        source = client.create_streams(1, replicas=3)[0].stream_id
        victim = lab.primary_node(source)
        target, shared = stream_led_by(client, 3, victim, lab.primary_node)
        writer = lab.writer("w1", source, pause_s=0.05)
        relay = Relay(spark, lab.cluster.pd_address, source, target,
                      str(tmp_path / "checkpoint"), RELAY_OPTIONS)
        try:
            writer.wait_for(200)
            figures["cut off during"] = f"micro-batch {relay.start_and_wait_busy()}"
            cut = time.monotonic()
            fault = lab.net.isolate(victim)
            wait_until(lambda: len(client.list_ranges(source)) > 1, 60,
                       "the PD to fail the input's range over")
            hold()
            lab.net.heal(fault)
            writer.wait_for(200, timeout=120)
            writer.stop()
            end = lab.stream_end(source)
            relay.wait_processed(end, 240)
            caught_up_s = time.monotonic() - cut
        finally:
            relay.stop()
        inputs = {b.header.base_offset: bytes(b.data[ENVELOPE_SIZE:])
                  for b in client.read(source)}
        output = check_output(client, target, inputs, source)
        # What the relay read of the input, as the output tells it: a reader's view.
        for fetched in client.read(target):
            batch = body_to_arrow(fetched.data[ENVELOPE_SIZE:])
            for key, value in zip(batch.column("key").to_pylist(),
                                  batch.column("value").to_pylist(), strict=True):
                lab.history.record_seen("spark relay", source, int(key), 1, digest(value))
        verdict = lab.check(source)
        _report(figures, lab, verdict, **{
            "output": output.summary(),
            "micro-batches": relay.last_batch_id + 1,
            "query failures (restarted from the checkpoint)": len(relay.failures),
            "cut-off server also led the output stream": "yes" if shared else "no",
            "from the cut to the query through the end": f"{caught_up_s:.1f} s"})
        if relay.failures:
            figures["first failure"] = relay.failures[0]
        verdict.assert_ok()
        assert_no_long_wait(lab)
        assert output.exactly_once, output.summary()
