"""pyspark discovers format("sbp") next to the sources of other packages, on every pyspark.

pyspark imports every top-level ``pyspark_*`` module on the Python workers' path without a
guard, so a ``pyspark_sbp`` that failed to import (as it did on pyspark 4.0 and 4.1) hid every
Python data source of the environment. Discovery runs once per Spark process, so the reads run
in a fresh one (``discovery_job.py``), with a small ``pyspark_xyz`` of the test's own on the
workers' path.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from tests.children import run_child

from .conftest import REPO
from .streaming.helpers import append_values, new_stream

JOB = REPO / "tests" / "spark" / "discovery_job.py"
TIMEOUT_S = 240

OTHER_SOURCE = textwrap.dedent('''
    """A data source of another package, found by pyspark's discovery."""

    from pyspark.sql.datasource import DataSource, DataSourceReader


    class _Reader(DataSourceReader):
        def read(self, partition):
            yield (1,)
            yield (2,)


    class DefaultSource(DataSource):
        @classmethod
        def name(cls):
            return "xyz"

        def schema(self):
            return "n long"

        def reader(self, schema):
            return _Reader()
''')


@pytest.mark.spark
def test_another_packages_source_is_discovered_next_to_sbp(pd, sbp_client, tmp_path):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["a", "b", "c"])
    packages = tmp_path / "site"
    packages.mkdir()
    (packages / "pyspark_xyz.py").write_text(OTHER_SOURCE)
    env = dict(os.environ)
    # The workers list top-level modules on their path: the other package's, and this
    # checkout's pyspark_sbp (an editable install's import hook is invisible to the listing).
    env["PYTHONPATH"] = os.pathsep.join(
        [str(packages), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                      if p])
    env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    done = run_child([sys.executable, str(JOB), pd, str(sid)], env, TIMEOUT_S, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    assert json.loads(lines[-1].removeprefix("RESULT ")) == {"xyz": [1, 2], "sbp": 3}
