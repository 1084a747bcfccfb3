"""`sbp ranges seal` on a range whose push has not reached its primary yet.

The PD records the new range of a seal, releases the stream's lock and only then pushes the
range to its servers (SYNC_RANGES). A second seal right behind the first (`sbp ranges seal` in
a loop, several sealers on a replicas=2 stream of a 3-server cluster) reached the new range's
primary before the push and failed with RANGE_NOT_FOUND: "range S/R is not on server N".
"""

from __future__ import annotations

import subprocess
import sys
import threading

from sbp_spark.client import ClientConfig
from sbp_spark.protocol.records import encode_batch
from tests.client.private_cluster import client_of, private_cluster
from tests.polling import wait_until


def test_a_seal_right_behind_another_finds_the_range_on_its_servers(tmp_path, monkeypatch):
    with private_cluster(tmp_path, range_servers=3) as cluster, \
            client_of(cluster, ClientConfig()) as client:
        sid = client.create_streams(1, replicas=2)[0].stream_id
        pd, calls = cluster.pd, cluster.pd.calls
        # The first seal's push of range 1 is held until a second seal reached the PD, and
        # then until that seal reached range 1's servers (or 2 s passed: it waits for the
        # push, as it should).
        second_arrived, sealing_range_1 = threading.Event(), threading.Event()
        held: list[int] = []
        seal_range, sync_to, seal_one = pd.seal_range, calls.sync_to, calls.seal_one

        def counted_seal(stream_id, range_index, timeout_s=None):
            if range_index == 1:
                second_arrived.set()
            return seal_range(stream_id, range_index, timeout_s)

        def late_sync(server_id, ranges, timeout_s=None):
            if not held and any(r.stream_id == sid and r.range_index == 1 for r in ranges):
                held.append(server_id)
                assert second_arrived.wait(30), "the second seal never reached the PD"
                sealing_range_1.wait(2.0)
            return sync_to(server_id, ranges, timeout_s)

        def noted_seal_one(server_id, request, rng, timeout_s):
            if rng.range_index == 1:
                sealing_range_1.set()
            return seal_one(server_id, request, rng, timeout_s)

        monkeypatch.setattr(pd, "seal_range", counted_seal)
        monkeypatch.setattr(calls, "sync_to", late_sync)
        monkeypatch.setattr(calls, "seal_one", noted_seal_one)
        first = threading.Thread(target=client.seal_range, args=(sid,))
        first.start()
        wait_until(lambda: held, "the PD to push range 1")
        try:
            second = subprocess.run(
                [sys.executable, "-m", "sbp_spark.cli", "ranges", "seal", str(sid), "--pd",
                 cluster.pd_address], capture_output=True, text=True, timeout=60)
        finally:
            second_arrived.set()
            first.join(30)
        assert second.returncode == 0, second.stderr
        assert f"sealed range 1 of stream {sid} at offset 0" in second.stdout
        assert "open range is now 2" in second.stdout

        ranges = client.list_ranges(sid)
        assert [(r.range_index, r.end_offset) for r in ranges] == [(0, 0), (1, 0), (2, -1)]
        # Every replica of range 1 holds it sealed.
        replicas = {rep.server.server_id for rep in ranges[1].servers}
        for rs in cluster.range_servers:
            assert rs is not None
            if rs.server_id in replicas:
                wait_until(lambda rs=rs: rs.storage.get_range(sid, 1) is not None,
                           f"range 1 on server {rs.server_id}")
                assert rs.storage.get_range(sid, 1).end_offset == 0
        # and the stream goes on: range 2 takes appends
        client.append(sid, [encode_batch(b"after")])
