"""Test marks for what the pyspark under test offers (``sbp_spark.spark.pyspark_api``)."""

from __future__ import annotations

import pytest

from sbp_spark.spark.pyspark_api import FEATURES, found


def requires(feature: str) -> pytest.MarkDecorator:
    """Skip the test where the pyspark under test lacks ``feature`` (a ``FEATURES`` name)."""
    spec = next(f for f in FEATURES if f.name == feature)
    return pytest.mark.skipif(
        not found().has(feature),
        reason=f"{found().describe()} has no {spec.title} (pyspark {spec.since}+)")


def lacks(feature: str) -> pytest.MarkDecorator:
    """Skip the test where the pyspark under test has ``feature``: it checks what the
    connector does without it."""
    spec = next(f for f in FEATURES if f.name == feature)
    return pytest.mark.skipif(
        found().has(feature),
        reason=f"{found().describe()} has {spec.title}; the test is for pyspark before "
               f"{spec.since}")
