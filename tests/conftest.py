"""Shared test configuration: where the team's shared material lives, and the Java check that
only runs when a selected test starts Spark."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _shared_dir() -> Path:
    env = os.environ.get("SBP_SHARED_DIR")
    if env:
        return Path(env)
    return REPO.parent / "shared"


VECTORS_DIR = _shared_dir() / "vectors"


def load_vectors(name: str) -> list[dict]:
    """The shared test vectors; tests/vectors/ keeps a copy so a lone checkout still has them."""
    for folder in (VECTORS_DIR, REPO / "tests" / "vectors"):
        path = folder / name
        if path.exists():
            return json.loads(path.read_text())
    pytest.fail(f"test vectors {name} not found in {VECTORS_DIR} or tests/vectors")


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A CA and certificates signed by it, and by a CA nobody trusts (``tests/certs.py``)."""
    from .certs import make_certs

    return make_certs(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def etcd_endpoints(tmp_path_factory):
    """Client endpoints of a one-member etcd on loopback, for the tests that need etcd
    (skipped where there is none: ``tests/etcd.py``)."""
    from sbp_spark.server.etcd_process import LocalEtcd

    from .etcd import require_etcd

    require_etcd()
    cluster = LocalEtcd(tmp_path_factory.mktemp("etcd")).start()
    yield cluster.endpoints
    cluster.stop()


@pytest.fixture
def etcd_prefix(request) -> str:
    """A key prefix of this test's own in the shared etcd."""
    return f"/test/{uuid.uuid4().hex[:12]}/"


# Fixtures that start a SparkSession (tests/spark/conftest.py, integration/faults/conftest.py).
SPARK_FIXTURES = frozenset({"spark", "plain_spark"})


def pytest_configure(config):
    from sbp_spark.environment import use_this_python_for_workers

    use_this_python_for_workers()


def starts_spark(item: pytest.Item) -> bool:
    """Whether ``item`` starts Spark: it uses a Spark session fixture or is marked ``spark``."""
    return bool(SPARK_FIXTURES & set(getattr(item, "fixturenames", ()))) or \
        item.get_closest_marker("spark") is not None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the tests that use a Spark session fixture ``spark`` too, before ``-m`` selects:
    ``-m 'not spark'`` leaves out every test that needs Java."""
    for item in items:
        if starts_spark(item):
            item.add_marker("spark")


def pytest_collection_finish(session):
    """Fail the run at once, with install instructions, when a selected test starts Spark and
    Java is missing. Runs that select no such test (the protocol, client and server tests)
    never look for Java."""
    spark_tests = [item for item in session.items if starts_spark(item)]
    if not spark_tests:
        return
    from sbp_spark.environment import JavaNotFoundError, check_java

    try:
        check_java()
    except JavaNotFoundError as exc:
        raise pytest.UsageError(
            f"{len(spark_tests)} selected test(s) start Spark, which needs Java (leave them out "
            f"with -m 'not spark'): {exc}") from None
