"""The nemesis's judgement: duplicates told apart by cause, and failures that name the figure,
the seed, the time and the fault behind each of their worst examples."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from integration.faults.history import History, digest
from integration.faults.relay import OutputCheck
from sbp_spark.spark.streaming.idempotent import WriteTag

from .faults import Injected
from .judge import (
    OWN_RESENDS,
    RELAY_DUPLICATES,
    RESENDS_AFTER_FAILURE,
    SPARK_JOB_RERUNS,
    SPARK_OWN_RESENDS,
    SPARK_TASK_RETRIES,
    SparkRecord,
    judge,
    read_divergence,
    spark_rows,
    writer_duplicates,
)
from .schedule import CONTROL_PLANE, RANGE_SERVERS, Planned
from .spark_jobs import parse_value, row_value

T0 = 1000.0  # the fault phase's start, on the monotonic clock


@dataclass
class FakeWriter:
    name: str
    stream: int
    stalls: list[tuple[float, float]] = field(default_factory=list)
    calls_failed: list[tuple[float, dict]] = field(default_factory=list)
    times: dict[str, list[float]] = field(default_factory=dict)


def _history() -> History:
    """w1 sent batch 1 once, stored twice (its client sent the bytes again); batch 2 failed
    and was sent again as try 1, and both tries are stored; batch 3 is stored once."""
    h = History()
    for op in ("w1:1", "w1:2", "w1:2/1", "w1:3"):
        h.record_sent(op, "w1", 1, digest(op.encode()))
    h.record_acked("w1:1", 0)
    h.record_failed("w1:2", "ReadTimeoutError: no answer")
    h.record_acked("w1:2/1", 3)
    h.record_acked("w1:3", 4)
    h.record_final(1, [(0, 1, digest(b"w1:1")), (1, 1, digest(b"w1:1")), (2, 1, digest(b"w1:2")),
                       (3, 1, digest(b"w1:2/1")), (4, 1, digest(b"w1:3"))])
    return h


def test_writer_duplicates_by_cause():
    found = writer_duplicates(_history())
    assert found[OWN_RESENDS] == [("w1:1", 1, ["stream 1 offset 0", "stream 1 offset 1"])]
    assert found[RESENDS_AFTER_FAILURE] == [("w1:2", 1, ["stream 1 offset 2",
                                                         "stream 1 offset 3"])]


def test_a_spark_row_says_who_wrote_it():
    value = row_value(7, 12, 1, 2, 0)
    assert value == b"j7 r12 a1 t2 i0"
    assert parse_value(value) == (7, 12, 1, 2, 0)


def _row(offset: int, job: int, row: int, attempt: int = 0, task: int = 0, task_id: int = 0):
    return offset, f"{job}:{row}".encode(), row_value(job, row, attempt, task, task_id)


def test_spark_rows_by_cause_and_rows_lost():
    records = [
        _row(0, 1, 0), _row(1, 1, 0),  # the same bytes twice: the client's own resend
        _row(2, 1, 1), _row(3, 1, 1, task=1, task_id=9),  # a task's second attempt
        _row(4, 2, 0), _row(5, 2, 0, attempt=1),  # the job run again after failing
        _row(6, 2, 1, attempt=1),
        (7, b"x", b"not a row"),
    ]
    jobs = [{"job": 1, "ok": True}, {"job": 2, "try": 0, "ok": False},
            {"job": 2, "try": 1, "ok": True}]
    rows = spark_rows(records, jobs, rows_per_job=2)
    assert rows.duplicates[SPARK_OWN_RESENDS] == [("1:0", 1, [0, 1])]
    assert rows.duplicates[SPARK_TASK_RETRIES] == [("1:1", 1, [2, 3])]
    assert rows.duplicates[SPARK_JOB_RERUNS] == [("2:0", 1, [4, 5])]
    assert rows.lost == []
    assert len(rows.bad) == 1 and "offset 7" in rows.bad[0]
    assert spark_rows(records[:2], jobs[:1], rows_per_job=2).lost == ["1:1"]


def test_a_spark_read_that_differs_from_the_final_log():
    records = [_row(0, 1, 0), _row(1, 1, 1)]
    good = [(0, zlib.crc32(records[0][2])), (1, zlib.crc32(records[1][2]))]
    assert read_divergence(good, records) == []
    assert len(read_divergence([(1, 0), (2, 0)], records)) == 2


def _fault(number: int = 1, kind: str = "kill-primary", start: float = 10.0,
           end: float = 14.0) -> Injected:
    domain = RANGE_SERVERS if kind in ("kill-primary", "cut-primary-from-secondaries") \
        else CONTROL_PLANE
    planned = Planned(domain, number, kind, end - start, 5.0, 3)
    return Injected(number, planned, "rs2" if domain == RANGE_SERVERS else "pd0",
                    "primary of stream 1, range 0", T0 + start, T0 + end)


def test_failures_name_the_figure_the_seed_the_time_and_the_fault():
    history = _history()
    writer = FakeWriter("w1", 1, stalls=[(T0 + 11.0, T0 + 20.5), (T0 + 30.0, T0 + 31.5)],
                        calls_failed=[(T0 + 13.0, {"call": 2, "attempt": 0, "seconds": 2.5,
                                                   "error": "ReadTimeoutError: no answer"})],
                        times={"w1:1": [T0 + 12.0, T0 + 12.5]})
    output = OutputCheck(duplicated=[5], copies={5: [WriteTag("q", 3, 0, 1),
                                                     WriteTag("q", 4, 0, 0)]})
    report = judge(4242, 10, T0, [_fault()], history, history.check(), [writer], 0,
                   SparkRecord(output=output, relay_batches={2: T0 + 9.0, 4: T0 + 15.0},
                               relay_failures=[{"error": "SbpTimeoutError: x",
                                                "t": T0 + 50.0}]), 3.0)
    failed = {f.name: f for f in report.findings if not f.ok}
    assert set(failed) == {
        "give-ups (calls, jobs, reads and queries that failed)",
        "duplicates from the client's own resends",
        "relay duplicates (exactly once through the idempotent sink)",
        "stalls over 8 s with one fault at a time"}
    text = "\n".join(report.failures())
    assert "seed 4242" in text
    assert ("9.5 s without an acknowledgement for w1 (stream 1) from t=+11.0 s to t=+20.5 s, "
            "during #1 kill-primary rs2 (primary of stream 1, range 0) t=+10.0..+14.0 s") in text
    assert "w1 (stream 1) call 2 try 0 failed at t=+13.0 s after 2.5 s" in text
    assert "relay query failed at t=+50.0 s" in text and "no fault in place" in text
    assert ("relay input offset 5 stored 2 times, by micro-batches [3, 4], first reported at "
            "t=+15.0 s, during #1 kill-primary") in text
    assert "w1:1 stored 2 times (stream 1 offset 0, stream 1 offset 1); sent t=+12.0 s" in text
    assert report.figures["duplicates by cause"].startswith(
        f"{OWN_RESENDS}: 1; {RESENDS_AFTER_FAILURE}: 1;")
    assert f"{RELAY_DUPLICATES}: 1" in report.figures["duplicates by cause"]
    assert report.figures["definition of done"].startswith("missed: ")
    assert report.figures["lost"] == 0 and report.figures["divergent"] == 0


def test_a_clean_run_meets_the_definition_of_done():
    h = History()
    h.record_sent("w1:1", "w1", 1, digest(b"a"))
    h.record_acked("w1:1", 0)
    h.record_final(1, [(0, 1, digest(b"a"))])
    report = judge(1, 1, T0, [], h, h.check(), [FakeWriter("w1", 1)], 0,
                   SparkRecord(output=OutputCheck()), 0.0)
    assert report.ok and report.failures() == []
    assert report.figures["definition of done"] == "met"
    assert report.figures["stalls over 8 s while two faults overlapped, each"] == "none"


def _stall_report(faults: list[Injected], stall: tuple[float, float]):
    h = History()
    h.record_sent("w1:1", "w1", 1, digest(b"a"))
    h.record_acked("w1:1", 0)
    h.record_final(1, [(0, 1, digest(b"a"))])
    writer = FakeWriter("w1", 1, stalls=[(T0 + stall[0], T0 + stall[1])])
    return judge(1, 1, T0, faults, h, h.check(), [writer], 0,
                 SparkRecord(output=OutputCheck()), 0.0)


def test_a_stall_while_two_faults_overlapped_is_counted_apart():
    # A primary cut off from its secondaries, then the PD leader killed before the writers got
    # their new range: the election adds to the give-up time, and no single fault is behind it.
    cut = _fault(1, "cut-primary-from-secondaries", 10.0, 20.0)
    leader = _fault(2, "kill-pd-leader", 17.0, 19.0)
    report = _stall_report([cut, leader], (10.0, 21.0))
    assert report.ok, report.failures()
    assert report.figures["stalls over 8 s"] == (
        "1: 0 with one fault at a time, 1 while two faults overlapped")
    assert report.figures["longest stall while two faults overlapped"].startswith(
        "11.0 s without an acknowledgement for w1 (stream 1)")
    assert report.figures["longest stall with one fault at a time"] == "none over 1 s"
    each = report.figures["stalls over 8 s while two faults overlapped, each"]
    assert each.startswith("11.0 s without an acknowledgement for w1 (stream 1) from t=+10.0 s")
    assert "#1 cut-primary-from-secondaries" in each and "#2 kill-pd-leader" in each


def test_a_second_fault_that_hits_after_the_cut_healed_but_before_the_writers_went_on():
    # An etcd member paused just after the cut healed, while the writers still waited for
    # the seal of the cut-off range (the nemesis saw this): both were in place during the
    # stall, the second before it had lasted 8 s.
    cut = _fault(1, "cut-primary-from-secondaries", 10.0, 16.0)
    etcd = _fault(2, "pause-etcd-member", 16.3, 18.0)
    report = _stall_report([cut, etcd], (9.9, 19.8))
    assert report.ok, report.failures()
    assert report.figures["stalls over 8 s"].endswith("1 while two faults overlapped")


def test_a_stall_of_one_fault_counts_against_the_definition_of_done():
    # The PD leader's death ended 2 s before the cut began: in the stall's lead time, but
    # not in place during it. A PD follower's death holds up no writer. And the etcd pause
    # came when the stall had lasted 8 s already.
    leader = _fault(1, "kill-pd-leader", 5.0, 8.0)
    cut = _fault(2, "cut-primary-from-secondaries", 10.0, 20.0)
    follower = _fault(3, "kill-pd-follower", 12.0, 15.0)
    etcd = _fault(4, "pause-etcd-member", 18.5, 19.0)
    report = _stall_report([leader, cut, follower, etcd], (10.0, 19.5))
    assert not report.ok
    [failure] = report.failures()
    assert failure.startswith("stalls over 8 s with one fault at a time: 1 (allowed: 0)")
    assert "#2 cut-primary-from-secondaries" in failure
    assert report.figures["longest stall with one fault at a time, by fault"] == (
        "cut-primary-from-secondaries 9.5 s")
