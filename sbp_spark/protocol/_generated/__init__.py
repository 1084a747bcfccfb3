"""Generated from schemas/*.fbs by schemas/generate.py; do not edit.

wire_tables.py holds the field ids, types, defaults and struct layouts the codec of
sbp_spark.protocol.messages is built from (flatc's Python classes, which only the tests use,
are generated into tests/flatc_classes).
"""
