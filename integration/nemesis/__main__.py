"""Run the nemesis: ``python -m integration.nemesis --minutes 60 --seed N``.

Prints the seed first (run again with it to replay the schedule), each fault as it comes and
goes, then the run's figures and what misses the definition of done. Exit status 0 when the
run meets it, 1 when it does not, 2 when the run could not be made. ``--record`` writes the
figures into integration/faults/README.md (the last run of each length is kept).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integration.nemesis",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="how long faults are injected (default 10)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the schedule's seed (default: a new one, printed)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the cluster and the logs go (default: a new directory "
                             "under the system's temporary one, removed after a run that "
                             "meets the definition of done unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    parser.add_argument("--record", action="store_true",
                        help="write the figures into integration/faults/README.md")
    parser.add_argument("--no-spark", action="store_true",
                        help="without the Spark jobs (a quicker, lighter run)")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error(f"--minutes {args.minutes:g}: must be more than 0")

    from integration.netlab.network import unavailable
    from sbp_spark.server.etcd_process import EtcdNotFoundError, find_etcd

    reason = unavailable()
    if reason is not None:
        print(f"the nemesis cannot run here: {reason}", file=sys.stderr)
        return 2
    try:
        find_etcd()
    except EtcdNotFoundError as exc:
        print(f"the nemesis cannot run here: {exc}", file=sys.stderr)
        return 2

    from integration.faults import report as results
    from integration.netlab.reaper import guard

    from .run import Nemesis, Settings

    guard()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix=f"sbp-nemesis-{seed}-"))
    print(f"nemesis seed {seed} ({args.minutes:g} min of faults; replay: python -m "
          f"integration.nemesis --minutes {args.minutes:g} --seed {seed}); data and logs in "
          f"{data_dir}", flush=True)
    began = time.monotonic()
    report = Nemesis(Settings(seed, args.minutes, data_dir, spark=not args.no_spark)).run()
    print("\nfigures:")
    for name, value in report.figures.items():
        print(f"  {name}: {value}")
    for failure in report.failures():
        print(f"\nMISSED {failure}")
    if args.record:
        results.save_nemesis(args.minutes, report.figures, time.monotonic() - began)
        print(f"\nrecorded in {results.README}")
    if report.ok and not args.keep and args.data_dir is None:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
