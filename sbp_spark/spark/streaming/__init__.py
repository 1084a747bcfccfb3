"""Structured Streaming for format ``sbp``: the stream reader (offsets, admission control,
data-loss handling, lag reporting) and the stream writer (at-least-once or idempotent)."""
