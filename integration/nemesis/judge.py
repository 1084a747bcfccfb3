"""A nemesis run's figures, and what the issue's definition of done asks of them (no I/O).

The history checker (``integration/faults/history.py``) judges the log's promises on the
writers' streams; this adds what the nemesis measures across the whole run:

- duplicates by cause. A writer's batch (``driver.py``) carries its writer, number, call and
  try; the same bytes stored twice were sent twice by the client within one append call (its
  own resends), while a batch stored under two tries of its call was sent again by the
  writer after the call failed. A Spark batch row (``spark_jobs.py``) carries its job, row,
  try and the task attempt that wrote it: the same value twice is the client's own resend
  within a task, another task attempt of the same try is a Spark task retry, another try is
  the job run again after it failed. An input record the relay's idempotent
  sink stored twice is the relay's.
- stalls: each writer's waits between two acknowledged appends, with the faults in place
  meanwhile. The issue's target is about single faults (no single fault stalls a stream's
  writes for more than 8 s), and the schedule lets a range-server fault and a control-plane
  fault overlap: a stall during which a second fault hit before it had lasted 8 s (a primary
  cut off from its secondaries, and the PD leader killed before the writers got their new
  range) is counted apart, and the definition of done is checked on the others. Only a PD
  follower's death never makes a stall one of two faults: no writer waits on a follower.
- give-ups: append calls that failed, Spark write jobs and reads that failed, relay query
  failures, each with its time and the faults around it.

Times are said as ``t=+S s`` from the start of the fault phase, so a run replayed with the same
seed can be compared event by event.
"""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from integration.faults.driver import parse_op
from integration.faults.history import History, Verdict
from integration.faults.relay import OutputCheck

from .faults import Injected
from .spark_jobs import parse_value

OWN_RESENDS = "client's own resends within one call"
RESENDS_AFTER_FAILURE = "writers' resends after a failed call"
SPARK_OWN_RESENDS = "client's own resends within a Spark task"
SPARK_TASK_RETRIES = "Spark task retries"
SPARK_JOB_RERUNS = "Spark jobs run again after failing"
RELAY_DUPLICATES = "relay's idempotent sink"
CAUSES = (OWN_RESENDS, RESENDS_AFTER_FAILURE, SPARK_OWN_RESENDS, SPARK_TASK_RETRIES,
          SPARK_JOB_RERUNS, RELAY_DUPLICATES)
# The definition of done: no write stalls longer than this.
STALL_LIMIT_S = 8.0
# Worst examples a failed figure names.
EXAMPLES = 5
# A duplicate or a give-up is set against the faults in place from this long before its call
# began (a failover outlasts the fault that caused it by a few seconds).
LEAD_S = 5.0


class WriterRecord(Protocol):
    """What the judge reads of a writer driver (``integration/faults/lab.py``'s ``Driver``)."""

    name: str
    stream: int | None
    stalls: list[tuple[float, float]]
    calls_failed: list[tuple[float, dict]]
    times: dict[str, list[float]]


@dataclass
class SparkRecord:
    """What the Spark process reported (``spark_jobs.py``'s events, by kind), the rows its
    reads returned, the batch stream's final records and the relay's output check."""

    jobs: list[dict] = field(default_factory=list)
    reads: list[dict] = field(default_factory=list)
    relay_failures: list[dict] = field(default_factory=list)
    micro_batches: int = 0
    relay_batches: dict[int, float] = field(default_factory=dict)  # micro-batch -> reported
    drained: dict | None = None
    read_rows: list[tuple[int, int]] = field(default_factory=list)  # (offset, value CRC-32)
    records: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (offset, key, value)
    output: OutputCheck | None = None
    rows_per_job: int = 0


@dataclass
class Finding:
    """One figure the definition of done asks about: how many, and the worst examples."""

    name: str
    count: int | float
    allowed: int | float
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.count <= self.allowed


@dataclass
class Report:
    """A run's figures (for the README and the log) and its findings."""

    seed: int
    figures: dict[str, Any]
    findings: list[Finding]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def failures(self) -> list[str]:
        """One message per figure that misses the definition of done, with its examples."""
        out = []
        for f in self.findings:
            if not f.ok:
                shown = "\n    ".join(f.examples[:EXAMPLES]) or "(no examples kept)"
                out.append(f"{f.name}: {f.count:g} (allowed: {f.allowed:g}), seed {self.seed}; "
                           f"worst:\n    {shown}")
        return out


# Faults that cannot hold up a writer (no writer and no failover waits on a PD follower): a
# stall with one of these and one other fault in place is the other fault's alone.
HARMLESS_TO_WRITERS = frozenset({"kill-pd-follower"})


@dataclass(frozen=True)
class Stall:
    """A writer's wait between two acknowledgements, and the faults around it (in place at
    some time from ``LEAD_S`` before it to its end)."""

    seconds: float
    writer: str
    stream: int | None
    start: float
    end: float
    faults: tuple[Injected, ...]

    def _during(self) -> list[Injected]:
        """The faults that can hold up a writer and were in place during the stall itself,
        in the order they began."""
        return sorted((f for f in self.faults if f.kind not in HARMLESS_TO_WRITERS
                       and f.overlaps(self.start, self.end)), key=lambda f: f.start)

    @property
    def overlapping(self) -> bool:
        """Whether a second fault hit while the stall went on, before it had lasted
        ``STALL_LIMIT_S``: two faults in place during it, the later of them begun by then
        (a fault that ended before the stall began is its lead-up, not a second fault)."""
        during = self._during()
        return len(during) > 1 and during[1].start < self.start + STALL_LIMIT_S

    @property
    def cause(self) -> str:
        """The kind of the fault behind it: the first in place during it, else the last to
        begin before it (its failover outlasting it), "no fault" when none was around."""
        during = self._during()
        if during:
            return during[0].kind
        before = [f for f in self.faults if f.kind not in HARMLESS_TO_WRITERS]
        return max(before, key=lambda f: f.start).kind if before else "no fault"


def stalls_of(writers: Sequence[WriterRecord], faults: Sequence[Injected]) -> list[Stall]:
    """Every writer's stalls, the longest first, each with the faults around it."""
    out = [Stall(end - start, w.name, w.stream, start, end,
                 tuple(f for f in faults if f.overlaps(start - LEAD_S, end)))
           for w in writers for start, end in w.stalls]
    return sorted(out, key=lambda s: -s.seconds)


class Timeline:
    """Times and faults in words, from the start of the fault phase ``t0``."""

    def __init__(self, t0: float, faults: Sequence[Injected]) -> None:
        self.t0 = t0
        self.faults = faults

    def at(self, t: float) -> str:
        return f"t=+{t - self.t0:.1f} s"

    def fault(self, f: Injected) -> str:
        end = f"+{f.end - self.t0:.1f}" if f.end is not None else "end"
        return f"#{f.number} {f.kind} {f.target} ({f.detail}) t=+{f.start - self.t0:.1f}..{end} s"

    def around(self, start: float, end: float) -> str:
        """The faults in place at some time in [start - LEAD_S, end], in words."""
        hit = [self.fault(f) for f in self.faults if f.overlaps(start - LEAD_S, end)]
        return "during " + "; ".join(hit) if hit else "no fault in place"


# -- duplicates --------------------------------------------------------------------------------


def writer_duplicates(history: History) -> dict[str, list[tuple[str, int, list[str]]]]:
    """Batches of the writers stored more than once, by cause: (batch, extra copies, where)."""
    op_of = {s.digest: s.op for s in history.sent.values()}
    where: dict[str, list[str]] = defaultdict(list)
    for stream, log in sorted(history.final.items()):
        for b in log:
            op = op_of.get(b.digest)
            if op is not None:
                where[op].append(f"stream {stream} offset {b.offset}")
    own = [(op, len(places) - 1, places) for op, places in sorted(where.items())
           if len(places) > 1]
    tries: dict[tuple[str, int], list[str]] = defaultdict(list)
    for op in where:
        writer, seq, _ = parse_op(op)
        tries[(writer, seq)].append(op)
    after = [(f"{w}:{seq}", len(ops) - 1, [p for op in sorted(ops) for p in where[op]])
             for (w, seq), ops in sorted(tries.items()) if len(ops) > 1]
    return {OWN_RESENDS: own, RESENDS_AFTER_FAILURE: after}


@dataclass
class BatchRows:
    """The Spark batch stream's rows against the jobs that succeeded."""

    rows: int = 0
    lost: list[str] = field(default_factory=list)  # keys of acknowledged jobs' rows missing
    bad: list[str] = field(default_factory=list)  # rows that are no job's
    duplicates: dict[str, list[tuple[str, int, list[int]]]] = field(default_factory=dict)


def spark_rows(records: Iterable[tuple[int, bytes, bytes]], jobs: Iterable[dict],
               rows_per_job: int) -> BatchRows:
    """Check the batch stream's records (offset, key, value) against the jobs' reports."""
    out = BatchRows(duplicates={SPARK_OWN_RESENDS: [], SPARK_TASK_RETRIES: [],
                                SPARK_JOB_RERUNS: []})
    copies: dict[bytes, list[tuple[int, bytes]]] = defaultdict(list)
    for offset, key, value in records:
        out.rows += 1
        try:
            job, row, *_ = parse_value(value)
        except ValueError as exc:
            out.bad.append(f"offset {offset}: {exc}")
            continue
        if key != f"{job}:{row}".encode():
            out.bad.append(f"offset {offset}: key {key[:40]!r} does not match {value[:40]!r}")
            continue
        copies[key].append((offset, value))
    acked = sorted({e["job"] for e in jobs if e.get("ok")})
    out.lost = [f"{job}:{row}" for job in acked for row in range(rows_per_job)
                if f"{job}:{row}".encode() not in copies]
    for key, stored in sorted(copies.items()):
        if len(stored) < 2:
            continue
        offsets = [o for o, _ in stored]
        values = Counter(v for _, v in stored)
        parsed = [parse_value(v) for v in values]
        own = sum(n - 1 for n in values.values())
        tries = {p[2] for p in parsed}
        task = sum(len({(p[3], p[4]) for p in parsed if p[2] == t}) - 1 for t in tries)
        name = key.decode()
        for cause, extra in ((SPARK_OWN_RESENDS, own), (SPARK_TASK_RETRIES, task),
                             (SPARK_JOB_RERUNS, len(tries) - 1)):
            if extra:
                out.duplicates[cause].append((name, extra, offsets))
    return out


def read_divergence(read_rows: Iterable[tuple[int, int]],
                    records: Iterable[tuple[int, bytes, bytes]]) -> list[str]:
    """Rows a Spark read returned that the batch stream's final log does not hold as read."""
    final = {offset: zlib.crc32(value) for offset, _, value in records}
    out = []
    for offset, crc in read_rows:
        there = final.get(offset)
        if there is None:
            out.append(f"a Spark read returned offset {offset} of the batch stream, which its "
                       "final log does not hold")
        elif there != crc:
            out.append(f"a Spark read returned other bytes at offset {offset} of the batch "
                       "stream than its final log holds")
    return out


def relay_duplicates(output: OutputCheck | None, spark: SparkRecord, when: Timeline
                     ) -> list[str]:
    """Each input record the relay stored more than once, with the micro-batches of its copies
    and the faults around the time the first of them was reported."""
    out = []
    for offset, tags in sorted((output.copies if output is not None else {}).items()):
        batches = sorted({t.batch_id for t in tags if t is not None})
        # Progress names the newest micro-batch only: a batch was done by the first report
        # of it or of a later one.
        reported = sorted(t for b in batches[:1] for seen, t in spark.relay_batches.items()
                          if seen >= b)
        text = (f"relay input offset {offset} stored {len(tags)} times, by micro-batches "
                f"{batches or '(untagged)'}")
        if reported:
            # Progress is reported between Spark jobs: seconds after a micro-batch ran.
            text += (f", first reported at {when.at(reported[0])}, "
                     f"{when.around(reported[0] - LEAD_S, reported[0])}")
        out.append(text)
    return out


# -- the report --------------------------------------------------------------------------------


def judge(seed: int, minutes: float, t0: float, faults: Sequence[Injected], history: History,
          verdict: Verdict, writers: Sequence[WriterRecord], tail_errors: int,
          spark: SparkRecord, recovery_s: float, notes: Sequence[str] = ()) -> Report:
    """Every figure of the run, and the findings the definition of done is checked on."""
    when = Timeline(t0, faults)
    by_writer = {w.name: w for w in writers}

    def op_time(op: str) -> str:
        writer = by_writer.get(parse_op(op)[0])
        times = writer.times.get(op) if writer is not None else None
        if not times:
            return ""
        sent, done = times
        return f"sent {when.at(sent)}, {when.around(sent, done or sent)}"

    # lost: acknowledged and not there
    # The checker's messages begin with the op ("w1:17: acknowledged at ...").
    lost = [f"{v} ({op_time(v.split(': ', 1)[0])})"
            for v in verdict.violations.get("acked-readable", [])]
    rows = spark_rows(spark.records, spark.jobs, spark.rows_per_job)
    lost += [f"Spark row {key} of an acknowledged job is not in the batch stream"
             for key in rows.lost]
    output = spark.output
    if output is not None:
        lost += [f"relay input offset {o} never reached the output" for o in output.missing]
    # divergent: readers or replicas that disagree
    divergent = [*verdict.violations.get("readers-agree", []),
                 *verdict.violations.get("prefix", []),
                 *read_divergence(spark.read_rows, spark.records),
                 *(f"Spark read {r['start']}..{r['end']} at {when.at(r['t0'])}: {p}"
                   for r in spark.reads if r.get("ok") for p in r.get("problems", [])),
                 *(f"relay output of input offset {o} differs from the input"
                   for o in (output.changed if output is not None else []))]
    other = [*(f"{rule}: {p}" for rule in ("no-holes", "no-phantoms", "no-duplicates")
               for p in verdict.violations.get(rule, [])),
             *(f"batch stream: {b}" for b in rows.bad),
             *(f"relay output: hole at {h}" for h in (output.holes if output else [])),
             *(f"relay output: {b}" for b in (output.bad if output else []))]

    # duplicates by cause
    dupes = writer_duplicates(history)
    counts = {cause: sum(extra for _, extra, _ in items) for cause, items in dupes.items()}
    counts.update({cause: sum(extra for _, extra, _ in items)
                   for cause, items in rows.duplicates.items()})
    counts[RELAY_DUPLICATES] = len(output.duplicated) if output is not None else 0
    own_examples = [f"{op} stored {extra + 1} times ({', '.join(places)}); {op_time(op)}"
                    for op, extra, places in dupes[OWN_RESENDS]]
    own_examples += [f"Spark row {key} stored {extra + 1} times with the same value "
                     f"(batch stream offsets {offsets})"
                     for key, extra, offsets in rows.duplicates[SPARK_OWN_RESENDS]]

    # stalls: those of one fault at a time, and those while two overlapped
    stalls = stalls_of(writers, faults)

    def stall_text(s: Stall) -> str:
        return (f"{s.seconds:.1f} s without an acknowledgement for {s.writer} (stream "
                f"{s.stream}) from {when.at(s.start)} to {when.at(s.end)}, "
                f"{when.around(s.start, s.end)}")

    single = [s for s in stalls if not s.overlapping]
    overlapped = [s for s in stalls if s.overlapping]
    longest_by_cause: dict[str, float] = {}
    for s in single:
        longest_by_cause.setdefault(s.cause, s.seconds)

    # give-ups
    gave_up = sorted(
        [(t, f"{w.name} (stream {w.stream}) call {e['call']} try {e['attempt']} failed at "
             f"{when.at(t)} after {e['seconds']:.1f} s: {e['error'][:200]}; "
             f"{when.around(t - e['seconds'], t)}")
         for w in writers for t, e in w.calls_failed]
        + [(e["t1"], f"Spark write job {e['job']} try {e['try']} failed at {when.at(e['t1'])} "
                     f"after {e['t1'] - e['t0']:.1f} s: {e['error'][:200]}; "
                     f"{when.around(e['t0'], e['t1'])}")
           for e in spark.jobs if not e["ok"]]
        + [(e["t1"], f"Spark read after job {e['job']} failed at {when.at(e['t1'])}: "
                     f"{e['error'][:200]}; {when.around(e['t0'], e['t1'])}")
           for e in spark.reads if not e["ok"]]
        + [(e["t"], f"relay query failed at {when.at(e['t'])} (restarted from its "
                    f"checkpoint): {e['error'][:200]}; {when.around(e['t'], e['t'])}")
           for e in spark.relay_failures])
    writer_give_ups = sum(len(w.calls_failed) for w in writers)
    job_give_ups = sum(1 for e in spark.jobs if not e["ok"])
    read_give_ups = sum(1 for e in spark.reads if not e["ok"])

    findings = [
        Finding("lost (acknowledged, then not stored)", len(lost), 0, lost),
        Finding("divergent (readers or replicas disagree)", len(divergent), 0, divergent),
        Finding("other broken promises of the log (holes, phantoms, damaged records)",
                len(other), 0, other),
        Finding("give-ups (calls, jobs, reads and queries that failed)", len(gave_up), 0,
                [text for _, text in gave_up]),
        Finding("duplicates from the client's own resends",
                counts[OWN_RESENDS] + counts[SPARK_OWN_RESENDS], 0, own_examples),
        Finding("relay duplicates (exactly once through the idempotent sink)",
                counts[RELAY_DUPLICATES], 0, relay_duplicates(output, spark, when)),
        Finding(f"stalls over {STALL_LIMIT_S:g} s with one fault at a time",
                sum(1 for s in single if s.seconds > STALL_LIMIT_S), 0,
                [stall_text(s) for s in single]),
    ]
    over = [s for s in stalls if s.seconds > STALL_LIMIT_S]
    kinds = Counter(f.kind for f in faults)
    acked_jobs = [e for e in spark.jobs if e["ok"]]
    figures: dict[str, Any] = {
        "seed": seed,
        "faults for": f"{minutes:g} min",
        "faults injected": f"{len(faults)}: " + ", ".join(
            f"{kind} {n}" for kind, n in sorted(kinds.items())),
        "appends acknowledged": f"writers: {len(history.acked)} batches; Spark: "
                                f"{len(acked_jobs) * spark.rows_per_job} rows in "
                                f"{len(acked_jobs)} jobs",
        "lost": len(lost),
        "divergent": len(divergent),
        "other violations": len(other),
        "duplicates by cause": "; ".join(f"{cause}: {counts[cause]}" for cause in CAUSES),
        "longest stall": stall_text(stalls[0]) if stalls else "none over 1 s",
        f"stalls over {STALL_LIMIT_S:g} s": f"{len(over)}: {findings[-1].count} with one fault "
                                            f"at a time, {len(over) - findings[-1].count} "
                                            "while two faults overlapped",
        "longest stall with one fault at a time": stall_text(single[0]) if single
                                                  else "none over 1 s",
        "longest stall with one fault at a time, by fault": ", ".join(
            f"{cause} {took:.1f} s" for cause, took in longest_by_cause.items()) or "-",
        "longest stall while two faults overlapped": stall_text(overlapped[0]) if overlapped
                                                     else "none over 1 s",
        # Each is named: their causes are what a change to the failover would be judged on.
        f"stalls over {STALL_LIMIT_S:g} s while two faults overlapped, each": "; ".join(
            stall_text(s) for s in overlapped if s.seconds > STALL_LIMIT_S) or "none",
        "give-ups": f"{len(gave_up)} (writer calls: {writer_give_ups}; Spark write jobs: "
                    f"{job_give_ups}; Spark reads: {read_give_ups}; relay query failures: "
                    f"{len(spark.relay_failures)})",
        "first give-up": gave_up[0][1] if gave_up else "none",
        "history": "; ".join(f"{k}: {v}" for k, v in verdict.figures.items()),
        "tail errors ridden out": tail_errors,
        "Spark": f"{len(spark.jobs)} write jobs ({job_give_ups} failed), {len(spark.reads)} "
                 f"reads ({read_give_ups} failed, {len(spark.read_rows)} rows); relay: "
                 f"{spark.micro_batches} micro-batches, output "
                 f"{output.summary() if output is not None else 'not checked'}",
        "longest wait for the cluster to be whole after a fault": f"{recovery_s:.1f} s",
    }
    noted = [f"{when.fault(f)}: {'; '.join(f.notes)}" for f in faults if f.notes]
    if noted:
        figures["faults with notes"] = f"{len(noted)}: " + "; ".join(noted[:EXAMPLES])
    if notes:
        figures["notes"] = "; ".join(notes)
    missed = [f"{f.name}: {f.count:g}" for f in findings if not f.ok]
    figures["definition of done"] = "missed: " + "; ".join(missed) if missed else "met"
    return Report(seed, figures, findings)
