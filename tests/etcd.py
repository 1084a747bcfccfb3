"""Finding etcd for the tests that need it (the PD cluster on etcd)."""

from __future__ import annotations

import os

import pytest

from sbp_spark.server.etcd_process import EtcdNotFoundError, find_etcd


def require_etcd() -> str:
    """The etcd binary; skips the test, saying why, where there is none. Under CI, which
    installs it (.ci/run), a missing etcd fails instead, so a broken install cannot pass
    unseen as skipped tests."""
    try:
        return find_etcd()
    except EtcdNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide etcd: {exc}")
        pytest.skip(str(exc))
