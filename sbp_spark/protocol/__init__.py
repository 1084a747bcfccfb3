"""Sans-IO SBP codec: frames, typed FlatBuffers headers, record batches and error codes.

Nothing in this package opens a socket, starts a thread or imports Spark.
"""
