"""FlatBuffers code generated from schemas/*.fbs by schemas/generate.py; do not edit.

Only sbp_spark.protocol.messages and the tests use these modules.
"""
