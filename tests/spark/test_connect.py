"""Spark Connect (``SparkSession.builder.remote``, what Spark 4's thin client and serverless
platforms use): batch write, a read with a pushed filter, a catalog table and an availableNow
streaming query, all through a local Connect server.

pyspark refuses to start a Connect session in a process where a classic session runs (the
``spark`` fixture's): ``SESSION_ALREADY_EXIST``. So the job runs in a subprocess of its own,
bounded in time, against this session's embedded cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sbp_spark.spark.pyspark_api import found

from .conftest import REPO

JOB = REPO / "tests" / "spark" / "connect_job.py"
TIMEOUT_S = 300


def test_everything_through_spark_connect(pd, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    # pyspark's switch for its own parallel tests: the local Connect server takes a free port
    # (not 15002) and the client asks it which.
    env["SPARK_TESTING"] = "1"
    done = subprocess.run([sys.executable, str(JOB), pd, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["session"] == "pyspark.sql.connect.session"
    pushdown = found().filter_pushdown
    assert result["pushdown_conf"] == ("true" if pushdown else None)
    assert result["pushed_in_plan"] is pushdown and result["pushed_count"] == 100
    assert result["table_rows"] == 5
    # availableNow with maxRecordsPerTrigger=300: every record in micro-batches of 300 where
    # pyspark has admission control; one micro-batch of 300 before (docs/streaming.md).
    assert result["stream_exception"] is None
    assert result["relayed"] == (1000 if found().admission_control else 300)
    assert "not supported in Spark Connect" in result["spark_context"]
