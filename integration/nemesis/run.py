"""One nemesis run: a cluster on a network of namespaces, writers, tails and Spark jobs working
on it, the seeded faults for the given minutes, then the judgement (``judge.py``).

The cluster (``integration/faults/lab.py``'s ``Lab``): 3 etcd members, 3 PD nodes and 5 range
servers, each on a node of its own. Five 3-replica streams: two writers on the first, one on
the second, one writing the relay's input; the relay's output; the Spark batch stream. Two
tails follow the first two streams, the second reading from a secondary first. Writers and
tails use the client's default settings; writers send a failed call's batches again until
they are stored (``driver.py``). The Spark jobs (``spark_jobs.py``) run in a process of their
own on node ``spark``.

After the fault phase every fault is undone; the run waits until the cluster is whole, lets
each writer get more appends acknowledged, stops the writers, lets the relay process its input
through the end and the tails read to the end, reads every stream's final log (and every range
of every replica), and judges.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from integration.faults.helpers import wait_until
from integration.faults.history import digest
from integration.faults.lab import Driver, Lab
from integration.faults.relay import check_output
from sbp_spark.protocol.records import ENVELOPE_SIZE, body_to_arrow

from . import schedule
from .faults import Faults, NemesisError
from .judge import Report, SparkRecord, judge
from .spark_jobs import READ_ROW

RANGE_SERVERS, PD_NODES, ETCD_MEMBERS, REPLICAS = 5, 3, 3, 3
WRITERS = ("w1", "w2", "w3", "w4")
TAILS = ("r1", "r2")
SPARK_NODE = "spark"
# Each writer: 8 one-record batches per call, then this pause (about 25 batches a second: an
# hour's history, every replica's copy included, stays within a few hundred MiB).
WRITER_PAUSE_S = 0.25
# Rows of each Spark batch job.
SPARK_ROWS = 2000
# Acknowledged batches each writer needs before the faults begin, and again after the last.
WARM_UP, AFTER_HEAL = 16, 16
# How long a domain may take to be whole again after a fault before the run notes it (it goes
# on waiting: no new fault hits a domain that is not whole).
RECOVERY_NOTE_S = 60.0
# After the fault phase: the longest wait for the cluster to be whole, for writers to get
# going, for a writer to finish its call, for the relay and the tails to reach the end.
SETTLE_S, WRITER_STOP_S, DRAIN_S = 180.0, 180.0, 300.0
# Spark's start (a JVM on a busy machine) and the relay's first micro-batch.
SPARK_START_S = 300.0


@dataclass
class Settings:
    """What a run is asked to do."""

    seed: int
    minutes: float
    data_dir: Path
    spark: bool = True  # run the Spark jobs (False: clients only, for quick looks)
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr,
                                                                  flush=True))


class SparkProcess:
    """``spark_jobs.py`` on its node, its reports gathered into ``record``."""

    def __init__(self, lab: Lab, pd: str, streams: dict[str, int], data_dir: Path) -> None:
        self.record = SparkRecord(rows_per_job=SPARK_ROWS)
        self.reads_path = data_dir / "spark-reads.bin"
        self.log_path = data_dir / "spark-jobs.log"
        self.ready = threading.Event()
        self.done = threading.Event()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = lab.net.popen(SPARK_NODE, [
            sys.executable, "-m", "integration.nemesis.spark_jobs", "--pd", pd,
            "--batch-stream", str(streams["batch"]), "--relay-in", str(streams["relay in"]),
            "--relay-out", str(streams["relay out"]), "--checkpoint",
            str(data_dir / "relay-checkpoint"), "--reads", str(self.reads_path),
            "--rows", str(SPARK_ROWS), "--drain-timeout-s", str(DRAIN_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1)
        self._reader = threading.Thread(target=self._read, name="spark-jobs", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        r = self.record
        for line in self.proc.stdout:
            event = json.loads(line)
            kind = event["e"]
            if kind == "ready":
                self.ready.set()
            elif kind == "job":
                r.jobs.append(event)
            elif kind == "read":
                r.reads.append(event)
            elif kind == "relay":
                r.micro_batches = max(r.micro_batches, event["batch"] + 1)
                r.relay_batches.setdefault(event["batch"], time.monotonic())
            elif kind == "relay_failed":
                r.relay_failures.append(event)
            elif kind == "drained":
                r.drained = event
            elif kind == "done":
                self.done.set()

    def wait_ready(self) -> None:
        wait_until(lambda: self.ready.is_set() or self.proc.poll() is not None, SPARK_START_S,
                   f"the Spark jobs to start (log: {self.log_path})")
        assert self.proc.poll() is None, f"the Spark jobs exited: {self.log_tail()}"

    def stop(self, relay_end: int) -> None:
        """End the batch loop, let the relay process its input through ``relay_end``, and
        wait for the process to finish; then read what its reads returned."""
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.write(f"stop {relay_end}\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(DRAIN_S + 120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(10)
        finally:
            self._log.close()
        assert self.done.is_set(), f"the Spark jobs did not finish: {self.log_tail()}"
        data = self.reads_path.read_bytes() if self.reads_path.exists() else b""
        self.record.read_rows = [READ_ROW.unpack_from(data, i)
                                 for i in range(0, len(data), READ_ROW.size)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class Nemesis:
    """A run (see the module doc); ``run()`` returns its ``Report``."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.notes: list[str] = []
        self.longest_recovery_s = 0.0
        self.t0 = 0.0
        self._lock = threading.Lock()  # the domains' threads say things and note figures

    def say(self, text: str) -> None:
        at = f"t=+{time.monotonic() - self.t0:7.1f} s" if self.t0 else "setting up"
        line = f"[nemesis seed {self.s.seed}] {at}  {text}"
        with self._lock:
            self.s.log(line)
            with open(self.s.data_dir / "nemesis.log", "a") as log:
                log.write(line + "\n")

    def run(self) -> Report:
        data_dir = self.s.data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        clients = [*WRITERS, *TAILS, *([SPARK_NODE] if self.s.spark else [])]
        with Lab(data_dir, range_servers=RANGE_SERVERS, clients=clients, pd_nodes=PD_NODES,
                 etcd_members=ETCD_MEMBERS) as lab:
            spark: SparkProcess | None = None
            streams = self._streams(lab)
            faults = Faults(lab, list(streams.values()),
                            [*WRITERS, *([SPARK_NODE] if self.s.spark else [])])
            try:
                writers = self._clients(lab, streams)
                if self.s.spark:
                    spark = SparkProcess(lab, lab.cluster.pd_address, streams, data_dir)
                    spark.wait_ready()
                for w in writers:
                    w.wait_for(WARM_UP, timeout=120)
                for domain in schedule.DOMAINS:
                    wait_until(lambda d=domain: faults.whole(d), SETTLE_S,
                               f"the {domain} to be whole before the faults")
                self._fault_phase(faults)
                return self._finish(lab, streams, writers, spark, faults)
            finally:
                # After an error: undo what is still in place, so the servers stop cleanly.
                for fault in faults.injected:
                    if fault.end is None:
                        try:
                            faults.end(fault)
                        except (NemesisError, OSError, RuntimeError) as exc:
                            self.say(f"#{fault.number} {fault.kind} could not be undone: {exc}")
                faults.close()
                if spark is not None:
                    spark.kill()

    # -- setting up -------------------------------------------------------------------------

    def _streams(self, lab: Lab) -> dict[str, int]:
        names = ("writers", "writer", "relay in", "relay out", "batch")
        created = lab.client.create_streams(len(names), replicas=REPLICAS)
        streams = {name: s.stream_id for name, s in zip(names, created, strict=True)}
        self.say(f"streams: {streams}")
        return streams

    def _clients(self, lab: Lab, streams: dict[str, int]) -> list[Driver]:
        targets = {"w1": "writers", "w2": "writers", "w3": "writer", "w4": "relay in"}
        writers = [lab.writer(node, streams[targets[node]], pause_s=WRITER_PAUSE_S,
                              resend_failed=True, client="default") for node in WRITERS]
        lab.tail("r1", streams["writers"], client="default")
        # The other tail reads from a secondary first (where it can): what a reader near
        # a replica does, and where a read cap that lags or runs ahead would show.
        first = lab.client.list_ranges(streams["writer"])[0]
        secondary = next((r.server.advertise_addr for r in first.servers if not r.is_primary),
                         "")
        lab.tail("r2", streams["writer"], client="default", prefer=secondary)
        return writers

    # -- the faults -------------------------------------------------------------------------

    def _fault_phase(self, faults: Faults) -> None:
        """Each domain's faults in a thread of its own (a server slow to restart holds up
        only its own domain), for the run's minutes; then until each domain is whole."""
        plan = schedule.plan(self.s.seed, self.s.minutes)
        self.t0 = time.monotonic()
        end = self.t0 + self.s.minutes * 60
        self.say(f"faults begin, for {self.s.minutes:g} min")
        stop = threading.Event()  # set when a domain's thread failed: the other ends too
        failed: list[BaseException] = []

        def domain(name: str) -> None:
            try:
                self._domain(faults, name, plan[name], end, stop)
            except BaseException as exc:  # raised again on the main thread below
                failed.append(exc)
                stop.set()

        threads = [threading.Thread(target=domain, args=(name,), name=f"nemesis {name}",
                                    daemon=True) for name in schedule.DOMAINS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failed:
            raise failed[0]
        self.say(f"faults end: {len(faults.injected)} injected")

    def _domain(self, faults: Faults, domain: str, planned: list[schedule.Planned],
                end: float, stop: threading.Event) -> None:
        """One domain's faults, one at a time: a quiet gap, the fault (as soon as it has a
        target), its undoing, and a wait until the domain is whole again."""
        for item in planned:
            if stop.wait(item.gap_s) or time.monotonic() >= end:
                return
            fault = faults.inject(item, time.monotonic())
            while fault is None:  # no target now (no PD leader): look again soon
                if stop.wait(1.0) or time.monotonic() >= end:
                    return
                fault = faults.inject(item, time.monotonic())
            self.say(f"#{fault.number} {fault.kind} {fault.target} ({fault.detail}) for "
                     f"{item.duration_s:g} s")
            stop.wait(item.duration_s)
            faults.end(fault)
            self.say(f"#{fault.number} {fault.kind} {fault.target} undone"
                     + (f" ({'; '.join(fault.notes)})" if fault.notes else ""))
            assert fault.end is not None
            noted = False
            while not faults.whole(domain):
                waited = time.monotonic() - fault.end
                if waited > RECOVERY_NOTE_S and not noted:
                    noted = True
                    self._note(f"the {domain} was not whole {RECOVERY_NOTE_S:g} s after "
                               f"fault #{fault.number} ({fault.kind} {fault.target}) ended")
                if stop.is_set() or time.monotonic() > max(end, fault.end) + SETTLE_S:
                    self._note(f"the {domain} was still not whole {waited:.0f} s after fault "
                               f"#{fault.number} ({fault.kind} {fault.target}) ended")
                    return
                time.sleep(0.5)
            with self._lock:
                self.longest_recovery_s = max(self.longest_recovery_s,
                                              time.monotonic() - fault.end)

    def _note(self, text: str) -> None:
        with self._lock:
            self.notes.append(text)
        self.say(f"NOTE: {text}")

    # -- after the faults -------------------------------------------------------------------

    def _finish(self, lab: Lab, streams: dict[str, int], writers: list[Driver],
                spark: SparkProcess | None, faults: Faults) -> Report:
        for w in writers:
            try:
                w.wait_for(AFTER_HEAL, timeout=SETTLE_S)
            except AssertionError as exc:
                self._note(f"writer {w.name} did not get going after the faults: {exc}")
        self.say("stopping the writers")
        for w in writers:
            w.stop(WRITER_STOP_S)
        record = spark.record if spark is not None else SparkRecord()
        if spark is not None:
            relay_end = lab.stream_end(streams["relay in"])
            self.say(f"letting the relay process its input through offset {relay_end}")
            spark.stop(relay_end)
            if not (record.drained or {}).get("ok"):
                self._note(f"the relay did not process its input through offset {relay_end} "
                           f"within {DRAIN_S:g} s (it reached {record.drained})")
        self.say("waiting for the tails")
        try:
            for name in ("writers", "writer"):
                lab.wait_tails(streams[name], DRAIN_S)
        finally:
            for d in lab.drivers:
                if d.role == "tail":
                    d.stop()
        self.say("reading the final logs")
        for name in ("writers", "writer", "relay in"):
            lab.record_final(streams[name])
        if spark is not None:
            self._spark_checks(lab, streams, record)
        verdict = lab.history.check()
        report = judge(self.s.seed, self.s.minutes, self.t0, faults.injected, lab.history,
                       verdict, writers, sum(len(d.errors) for d in lab.drivers
                                             if d.role == "tail"),
                       record, self.longest_recovery_s, self.notes)
        (self.s.data_dir / "nemesis.json").write_text(json.dumps(report.figures, indent=1))
        return report

    def _spark_checks(self, lab: Lab, streams: dict[str, int], record: SparkRecord) -> None:
        client = lab.client
        source = streams["relay in"]
        inputs = {b.header.base_offset: bytes(b.data[ENVELOPE_SIZE:])
                  for b in client.read(source)}
        record.output = check_output(client, streams["relay out"], inputs, source)
        # What the relay read of its input, as its output tells it: a reader's view.
        for fetched in client.read(streams["relay out"]):
            batch = body_to_arrow(fetched.data[ENVELOPE_SIZE:])
            for key, value in zip(batch.column("key").to_pylist(),
                                  batch.column("value").to_pylist(), strict=True):
                lab.history.record_seen("spark relay", source, int(key), 1, digest(value))
        for fetched in client.read(streams["batch"]):
            batch = body_to_arrow(fetched.data[ENVELOPE_SIZE:])
            base = fetched.header.base_offset
            record.records += [(base + i, key, value) for i, (key, value) in enumerate(zip(
                batch.column("key").to_pylist(), batch.column("value").to_pylist(),
                strict=True))]

