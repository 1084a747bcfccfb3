"""The benchmark harness behind ``sbp bench``: codec, client, Spark batch and streaming figures
measured in one run on the same data and machine, each next to its ceiling and target.

``main(argv)`` runs it; ``python -m sbp_spark.bench --help`` lists the options.
"""

from .harness import main

__all__ = ["main"]
