"""The nemesis for 10 minutes (slow): every fault at random against a namespaced cluster with
writers, tails and Spark jobs at work, checked against issue 43's definition of done: nothing
acknowledged lost, no readers or replicas that disagree, no give-up, no duplicate from the
client's own resends, no stall over 8 s (and the relay exactly once).

``SBP_NEMESIS_SEED`` replays a seed (each run prints its own), ``SBP_NEMESIS_MINUTES`` changes
the length; with ``SBP_FAULTS_REPORT=1`` the figures go into integration/faults/README.md.
Needs root, etcd and Java.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from integration.faults import report as results
from integration.netlab.network import unavailable
from tests.etcd import require_etcd

from .run import Nemesis, Settings

MINUTES = float(os.environ.get("SBP_NEMESIS_MINUTES", "10"))


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(40 * 60)
def test_ten_minutes_of_faults_meet_the_definition_of_done(tmp_path):
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"the nemesis needs network namespaces: {reason}")
    require_etcd()
    seed = int(os.environ.get("SBP_NEMESIS_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"nemesis seed {seed}")
    began = time.monotonic()
    report = Nemesis(Settings(seed, MINUTES, tmp_path)).run()
    if results.requested_by_env():
        results.save_nemesis(MINUTES, report.figures, time.monotonic() - began)
    if not report.ok:
        figures = "\n".join(f"  {k}: {v}" for k, v in report.figures.items())
        pytest.fail(f"seed {seed} misses the definition of done (replay: "
                    f"SBP_NEMESIS_SEED={seed}, or python -m integration.nemesis --minutes "
                    f"{MINUTES:g} --seed {seed}):\n" + "\n".join(report.failures())
                    + f"\nfigures:\n{figures}", pytrace=False)
