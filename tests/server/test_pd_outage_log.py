"""What a range server logs while its PD is down: one warning, reminders, one line when back."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import time

import pytest

from sbp_spark.server.cluster import ProcessCluster
from sbp_spark.server.pd_outage import PdOutage
from tests.polling import stays_true, wait_until


def warnings_of(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines()
            if " WARNING sbp_spark.server.range_server.registration:" in line]


@pytest.mark.slow
def test_a_pd_outage_is_one_warning_and_one_line_when_the_pd_is_back(tmp_path):
    # Every heartbeat (once a second) that failed while the PD was down was a warning of its
    # own, and so was every REPORT_METRICS: a PD outage flooded every range server's log.
    with ProcessCluster(tmp_path, range_servers=1) as cluster:
        rs_log = tmp_path / "rs-0.log"
        server_id = cluster.range_servers[0].info["server_id"]
        cluster.stop_pd()
        wait_until(lambda: warnings_of(rs_log.read_text()), "the first warning", timeout=10)
        # Heartbeats go on failing every second; the log stays quiet.
        stays_true(lambda: len(warnings_of(rs_log.read_text())) == 1,
                   "a single warning for the outage", duration=5)
        (warning,) = warnings_of(rs_log.read_text())
        assert f"range server {server_id}: HEARTBEAT to the PD failed" in warning
        assert "Connection refused" in warning and "failing since " in warning
        cluster.start_pd()
        wait_until(lambda: "the PD answers again" in rs_log.read_text(),
                   "the line saying the PD is back", timeout=15)
        back = [line for line in rs_log.read_text().splitlines()
                if "the PD answers again" in line]
        assert len(back) == 1 and " INFO " in back[0]
        assert len(warnings_of(rs_log.read_text())) == 1
        # and the server is live at the PD again
        shown = subprocess.run([sys.executable, "-m", "sbp_spark.cli", "cluster", "--json",
                                "--pd", cluster.pd_address], capture_output=True, text=True,
                               timeout=30)
        assert [s["live"] for s in json.loads(shown.stdout)["range_servers"]] == [True]


def test_a_range_server_started_before_its_pd_warns_once_while_it_waits(tmp_path):
    # Started before its PD, a range server warned once per attempt to get a server id
    # (0.2 s, 0.4 s, 0.8 s apart...), naming itself by nothing but "allocating ... failed".
    # A port bound and never listened on: connections to it are refused, and no other
    # process can take it while the test runs (a port closed again was once taken by another
    # test's server, whose answers the range server then reported instead).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        pd_port = probe.getsockname()[1]
        data_dir = tmp_path / "rs"
        server = subprocess.Popen(
            [sys.executable, "-m", "sbp_spark.cli", "range-server", "--pd",
             f"127.0.0.1:{pd_port}", "--data-dir", str(data_dir), "--port", "0"],
            stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(4)  # about five attempts
        finally:
            server.send_signal(signal.SIGTERM)
            _, stderr = server.communicate(timeout=30)
    (warning,) = warnings_of(stderr)
    assert f"range server with data in {data_dir} (no server id yet): ALLOCATE_ID to the " \
           f"PD failed" in warning, warning
    assert "Connection refused" in warning and "failing since " in warning


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reminders_come_at_most_once_per_interval_and_say_for_how_long(caplog):
    caplog.set_level(logging.INFO, logger="test.outage")
    clock = FakeClock()
    outage = PdOutage(lambda: "range server 3", logging.getLogger("test.outage"),
                      remind_every_s=30.0, monotonic=clock, wall=clock)
    for _ in range(95):  # 95 s of heartbeats failing once a second, metrics every 5 s
        outage.failed("HEARTBEAT", ConnectionError("cannot connect to 127.0.0.1:2378"))
        if int(clock.now) % 5 == 0:
            outage.failed("REPORT_METRICS", ConnectionError("cannot connect"))
        clock.now += 1.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4  # the first failure, then after 30, 60 and 90 s
    assert lines[0].startswith("range server 3: HEARTBEAT to the PD failed: cannot connect")
    assert [line.split(" have failed for ")[1].split(" s")[0] for line in lines[1:]] == [
        "30", "60", "90"]
    assert "HEARTBEAT x31" in lines[1] and "REPORT_METRICS x6" in lines[1]
    # Back: once every failing call has succeeded again.
    outage.succeeded("HEARTBEAT")
    assert outage.failing and len(caplog.records) == 4
    outage.succeeded("REPORT_METRICS")
    assert not outage.failing
    assert caplog.records[-1].levelno == logging.INFO
    assert "the PD answers again (REPORT_METRICS succeeded), after 95 s" in \
        caplog.records[-1].getMessage()
    assert "(114 failed)" in caplog.records[-1].getMessage()
    # The next outage starts over with one warning.
    outage.failed("HEARTBEAT", TimeoutError("timed out"))
    assert caplog.records[-1].levelno == logging.WARNING and "timed out" in \
        caplog.records[-1].getMessage()
