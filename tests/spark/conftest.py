"""Spark test fixtures: one local[2] SparkSession and one embedded SBP cluster per test session.

``spark`` has the source registered with ``sbp_spark.register(filter_pushdown=True)`` (on a
pyspark with pushdown, 4.1+), so the pushdown path, which has the most logic, is what most
tests run (``test_pushdown_default.py`` runs the default registration);
``plain_spark`` is a second session on the same SparkContext where nothing was registered, so
``format("sbp")`` resolves to the automatically discovered ``pyspark_sbp.DefaultSource``.
``spark`` stays the active session: Spark plans some calls (``df.rdd``) with the active
session's settings.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sbp_spark.client import SbpClient

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """The session, with ``sbp_spark.register(filter_pushdown=True)`` applied (where pyspark
    has pushdown); tables made with CREATE TABLE live in a temporary warehouse and an
    in-memory catalog."""
    # pyspark discovers pyspark_sbp by listing top-level modules on the workers' sys.path. A
    # wheel install puts it in site-packages; an editable install only adds an import hook,
    # which such a listing does not see, so the checkout goes on the workers' path.
    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    from sbp_spark.environment import local_spark_session

    session = local_spark_session("sbp-spark-tests", **{
        "spark.driver.memory": "1g",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.warehouse.dir": str(tmp_path_factory.mktemp("spark-warehouse")),
    })
    session.sparkContext.setLogLevel("ERROR")
    import sbp_spark
    from sbp_spark.spark.pyspark_api import found

    # Pushdown where the pyspark under test has it (4.1+).
    sbp_spark.register(session, filter_pushdown=found().filter_pushdown)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def plain_spark(spark):
    """A session where the source was only discovered automatically (no pushdown setting)."""
    return spark.newSession()


@pytest.fixture(scope="session")
def sbp_cluster(tmp_path_factory):
    """An embedded cluster: one PD and three range servers on free loopback ports."""
    from sbp_spark.server.cluster import EmbeddedCluster

    with EmbeddedCluster(str(tmp_path_factory.mktemp("sbp-cluster")), range_servers=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def sbp_client(sbp_cluster):
    return SbpClient(sbp_cluster.pd_address)


@pytest.fixture(scope="session")
def pd(sbp_cluster) -> str:
    return sbp_cluster.pd_address
