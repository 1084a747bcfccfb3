"""One append call keeps its batches in order when the stream's next range reaches its primary
after the writer heard of it.

The PD records a new range, then tells its servers (SYNC_RANGES). A writer that looks the range
up in between sends its frames to a primary that does not hold the range yet: the first frames
are refused (retriable), and frames after them, served once the range arrived, were stored.
The refused ones were then sent again and landed after them: one partition's records out of
order (seen with a Spark write while a secondary restarted). A writer now sends one batch
alone to a range until the range took one, and the rest after it.
"""

from __future__ import annotations

import threading

import pytest

from sbp_spark.protocol.errors import TransportError
from sbp_spark.protocol.records import ENVELOPE_SIZE, encode_batch
from tests.pd_link import hook_syncs
from tests.polling import wait_until

from .private_cluster import client_of, numbered_body, private_cluster, retrying_config

BATCHES = 16
BATCH_BYTES = 200_000  # about five batches per APPEND frame of 1 MiB: several frames


def _primary_id(rng) -> int:
    return rng.primary.server_id


def test_an_append_keeps_its_order_when_the_next_range_reaches_its_primary_late(
        tmp_path, monkeypatch):
    with private_cluster(tmp_path, range_servers=2) as cluster, \
            client_of(cluster, retrying_config(retries=20, retry_deadline_s=30)) as client:
        # Placement is by load (open ranges), ties to the lower id: make the server of our
        # stream the busier one, so that its next range opens on the other server.
        sid = client.create_streams(1)[0].stream_id
        other = client.create_streams(1)[0].stream_id
        client.create_streams(1)  # back on our stream's server
        client.delete_streams([other])
        first = _primary_id(client.list_ranges(sid)[0])

        writer = client.open_stream(sid)
        writer.append([encode_batch(numbered_body(b"o", 0, BATCH_BYTES), 1, 1)])

        # The PD's push of range 1 waits until the writer's first frame was refused there.
        release = threading.Event()

        def late_sync(server_id, ranges):
            if any(r.stream_id == sid and r.range_index == 1 for r in ranges):
                assert release.wait(30), "the writer never reached range 1's primary"

        hook_syncs(cluster.pd, late_sync, monkeypatch)
        sealer = threading.Thread(target=client.seal_range, args=(sid,))
        sealer.start()
        wait_until(lambda: len(client.list_ranges(sid)) == 2, "the PD to record range 1")
        second = _primary_id(client.list_ranges(sid)[1])
        assert second != first, "range 1 opened on the server of range 0"
        index = next(i for i in range(2) if cluster.server_id(i) == second)
        server = cluster.range_servers[index]
        path = server.handler.appends
        serve = path.serve

        def serve_then_let_the_range_arrive(ctx, req):
            refused = not server.storage.stream_ranges(sid)
            serve(ctx, req)
            if refused and not release.is_set():
                # Frames behind this one are served only once the range arrived.
                release.set()
                wait_until(lambda: server.storage.stream_ranges(sid), "range 1 on its primary")

        monkeypatch.setattr(path, "serve", serve_then_let_the_range_arrive)
        appended = writer.append([encode_batch(numbered_body(b"o", i, BATCH_BYTES), 1, 1)
                                  for i in range(1, BATCHES + 1)])
        sealer.join(30)
        assert release.is_set()

        assert [a.range_index for a in appended] == [1] * BATCHES
        assert [a.base_offset for a in appended] == list(range(1, BATCHES + 1))
        stored = [bytes(b.data[ENVELOPE_SIZE:ENVELOPE_SIZE + 9]) for b in client.read(sid)]
        assert stored == [b"o-%06d|" % i for i in range(BATCHES + 1)]


def test_an_append_that_gives_up_says_what_and_where(tmp_path):
    # A writer whose range server is gone used to fail with only "cannot connect to
    # 127.0.0.1:PORT: Connection refused": no stream, nothing of how long it tried, how much of
    # the call was stored or what to do.
    with private_cluster(tmp_path, range_servers=1) as cluster, \
            client_of(cluster, retrying_config(retries=2, retry_deadline_s=5)) as client:
        sid = client.create_streams(1)[0].stream_id
        writer = client.open_stream(sid)
        writer.append([encode_batch(numbered_body(b"g", 0, 10), 1, 1)])
        cluster.stop_range_server(0)
        with pytest.raises(TransportError) as failure:
            writer.append([encode_batch(numbered_body(b"g", i, 10), 1, 1) for i in (1, 2)])
        message = str(failure.value)
        assert message.startswith(f"append to stream {sid} gave up after 3 attempts in "), message
        assert "with 0 of 2 batches of the call stored (is the range server up?" in message
        assert "cannot connect to" in message
