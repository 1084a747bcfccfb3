"""The connector on a real Spark standalone cluster, not local mode.

Starts an SBP cluster (``sbp server``: a PD and two range servers, one process), a Spark master
and worker (``spark-class`` from pip's pyspark), submits ``job.py`` with spark-submit, and
checks that the job wrote and read every row through executors on the worker, and that the
rows are really in the SBP cluster. Everything binds 127.0.0.1 on free ports and is stopped at
the end. It takes one to two minutes (JVM start-ups dominate), so it is marked slow::

    python -m pytest -m slow integration/standalone -v
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sparkcluster import SparkStandalone, have_spark_class

from sbp_spark.client import SbpClient

HERE = Path(__file__).resolve().parent
JOB = HERE / "job.py"
ROWS = 60_000
STREAMS = 2
SERVER_START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 240.0

pytestmark = pytest.mark.skipif(not have_spark_class(),
                                reason="pyspark's bin/spark-class (and bash) are needed")


def _load_job():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sbp_standalone_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


job = _load_job()


@pytest.fixture
def sbp_server(tmp_path):
    """``sbp server`` with two range servers as a child process; yields its ready-file dict."""
    ready = tmp_path / "ready.json"
    log = open(tmp_path / "sbp-server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbp_spark.cli", "server", "--data-dir", str(tmp_path / "sbp"),
         "--range-servers", "2", "--host", "127.0.0.1", "--port", "0",
         "--ready-file", str(ready)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("sbp server did not start:\n"
                                   + (tmp_path / "sbp-server.log").read_text(errors="replace"))
            time.sleep(0.1)
        yield json.loads(ready.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
@pytest.mark.spark
def test_job_writes_and_reads_through_executors_on_a_worker(tmp_path, sbp_server):
    pd = sbp_server["pd"]
    with SparkStandalone(tmp_path / "spark") as spark_cluster:
        done = spark_cluster.submit(JOB, ["--pd", pd, "--rows", str(ROWS),
                                          "--streams", str(STREAMS), "--replicas", "2"],
                                    timeout=JOB_TIMEOUT_S)
        results = [line[len(job.RESULT_PREFIX):] for line in done.stdout.splitlines()
                   if line.startswith(job.RESULT_PREFIX)]
        assert done.returncode == 0 and results, (
            f"job failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-6000:]}")
        result = json.loads(results[-1])
        master = spark_cluster.master_state()

    assert result["ok"], result["problems"]
    assert result["master"] == spark_cluster.master_url
    assert result["rows_written"] == result["rows_read"] == ROWS

    # The master ran the application with executors on the worker, and the worker kept their
    # logs: the connector's reads and writes happened there, not in the driver.
    apps = [a for a in master["completedapps"] + master["activeapps"]
            if a["id"] == result["app_id"]]
    assert apps and apps[0]["name"] == job.APP_NAME and apps[0]["cores"] > 0
    executor_dirs = list((tmp_path / "spark" / "worker" / result["app_id"]).iterdir())
    assert executor_dirs and all((d / "stderr").exists() for d in executor_dirs)

    # The rows are in the SBP cluster: each stream's next offset is its share of the rows,
    # on two replicas.
    client = SbpClient(pd)
    for stream_id, count in zip(result["streams"], job.expected_counts(ROWS, STREAMS),
                                strict=True):
        ranges = client.list_ranges(stream_id)
        assert client.open_range_end(ranges[-1]) == count
        assert all(len(r.servers) == 2 for r in ranges)


def test_job_arguments_are_checked(monkeypatch):
    monkeypatch.delenv("SBP_PD", raising=False)
    with pytest.raises(SystemExit):
        job.build_parser().parse_args(["--rows", "5"])  # --pd is required
    assert job.main(["--pd", "127.0.0.1:1", "--rows", "0"]) == 2
    # ... unless $SBP_PD gives it (docker-compose.yml sets it for every service).
    monkeypatch.setenv("SBP_PD", "pd:2378")
    assert job.build_parser().parse_args(["--rows", "5"]).pd == "pd:2378"


def test_expected_figures_add_up():
    for rows, streams in ((10, 3), (60_000, 2), (7, 7), (1, 4)):
        counts, sums = job.expected_counts(rows, streams), job.expected_sums(rows, streams)
        assert counts == [len(range(i, rows, streams)) for i in range(streams)]
        assert sums == [sum(range(i, rows, streams)) for i in range(streams)]
