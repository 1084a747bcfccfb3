"""Spark's read limits (pyspark 4.2+) and the source's own bounds, without Spark or a
cluster."""

from __future__ import annotations

import pytest

from sbp_spark.spark.streaming.limits import TriggerLimits

from ..pyspark_features import requires

pytestmark = requires("admission_control")


def test_default_read_limit_and_restoring_the_composite():
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadMaxBytes,
        ReadMaxFiles,
        ReadMaxRows,
        ReadMinRows,
    )

    from sbp_spark.spark.streaming.admission import default_read_limit, limits_for

    limits = TriggerLimits(max_records=100, max_bytes=4096, min_records=10,
                           max_trigger_delay_ms=500)
    assert default_read_limit(limits) == ReadMaxRows(100)
    assert limits_for(limits, ReadMaxRows(100)) == limits
    assert limits_for(limits, ReadMaxRows(20)).max_records == 20
    assert limits_for(limits, ReadAllAvailable()).unbounded
    assert default_read_limit(TriggerLimits(max_bytes=7)) == ReadMaxBytes(7)
    assert default_read_limit(TriggerLimits(min_records=3)) == ReadMinRows(3)
    assert default_read_limit(TriggerLimits()) == ReadAllAvailable()
    with pytest.raises(ValueError, match="ReadMaxFiles"):
        limits_for(limits, ReadMaxFiles(3))
