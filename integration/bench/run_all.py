"""Every benchmark in one run: a thin entry point to ``sbp bench`` (sbp_spark.bench).

    python integration/bench/run_all.py [--quick] [--json FILE] [--plot FILE]

The measuring code lives in the installed package, so ``sbp bench`` gives the same figures.
"""

from __future__ import annotations

import sys

from sbp_spark.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
