"""sbp-spark: a PySpark connector for the Streaming Batch Protocol (SBP)."""

__version__ = "0.1.0"
