"""sbp_spark.server: the reference SBP cluster (PD, range servers, launchers)."""

from .cluster import EmbeddedCluster, ProcessCluster

__all__ = ["EmbeddedCluster", "ProcessCluster"]
