"""``python -m sbp_spark.bench``: the same as ``sbp bench``."""

from .harness import main

raise SystemExit(main())
