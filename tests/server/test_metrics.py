"""Prometheus metrics of PD nodes and range servers, scraped over HTTP: a consumer's lag in
records and milliseconds, per stream end offsets and appended records, append and fsync
latency histograms, connections, bytes and memory; `sbp server --metrics-port` names the
addresses in its ready file; every metric exported is documented in docs/metrics.md."""

from __future__ import annotations

import re
import signal
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster
from tests.conftest import REPO
from tests.test_cli_server import start_sbp_server

DOC = (REPO / "docs" / "metrics.md").read_text()


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample served at http://address/metrics, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def families(address: str) -> set[str]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as answer:
        return {f.name for f in text_string_to_metric_families(answer.read().decode())}


def test_metrics_show_lag_latency_and_traffic_and_are_all_documented(tmp_path):
    with EmbeddedCluster(tmp_path / "c", range_servers=2, metrics_port=0) as cluster, \
            SbpClient(cluster.pd_address, pool=ConnectionPool()) as client:
        where = cluster.metrics_addresses
        assert set(where) == {"pd", "range_servers"} and len(where["range_servers"]) == 2
        assert all(a.startswith("127.0.0.1:") for a in [where["pd"], *where["range_servers"]])
        stream = client.create_stream("metered")
        client.append(stream.stream_id, [
            batch_bytes(b"x", record_count=1, base_timestamp_ms=5_000_000 + i * 500)
            for i in range(8)])
        client.consumers.join("watcher")
        client.consumers.commit("watcher", 1, {stream.stream_id: 2})

        pd = scrape(where["pd"])
        key = (("consumer", "watcher"), ("stream_id", str(stream.stream_id)))
        assert pd[("sbp_consumer_lag_records", key)] == 6
        assert pd[("sbp_consumer_lag_ms", key)] == 2500  # the record at 7 minus that at 2
        assert pd[("sbp_consumer_committed_offset", key)] == 2
        assert pd[("sbp_consumer_stream_end_offset", key)] == 8
        assert pd[("sbp_consumer_generation", (("consumer", "watcher"),))] == 1
        assert pd[("sbp_pd_leader", ())] == 1 and pd[("sbp_pd_took_office_total", ())] == 1
        assert pd[("sbp_pd_ranges", (("state", "open"),))] == 1
        assert pd[("sbp_pd_range_servers", (("state", "live"),))] == 2
        assert pd[("process_resident_memory_bytes", ())] > 0
        assert pd[("sbp_pd_connections", ())] >= 1 and pd[("sbp_pd_received_bytes_total", ())] > 0

        # The consumer catches up: its lag drops to 0.
        client.consumers.commit("watcher", 1, {stream.stream_id: 8})
        pd = scrape(where["pd"])
        assert pd[("sbp_consumer_lag_records", key)] == 0
        assert pd[("sbp_consumer_lag_ms", key)] == 0

        primary = next(a for a in where["range_servers"]
                       if ("sbp_stream_end_offset", (("stream_id", str(stream.stream_id)),))
                       in scrape(a))
        rs = scrape(primary)
        on = (("stream_id", str(stream.stream_id)),)
        assert rs[("sbp_stream_end_offset", on)] == 8
        assert rs[("sbp_stream_appended_records_total", on)] == 8
        assert rs[("sbp_range_server_append_seconds_count", ())] >= 1
        assert rs[("sbp_range_server_fsync_seconds_count", ())] >= 1
        assert rs[("sbp_range_server_received_bytes_total", ())] > 0
        assert rs[("sbp_range_server_connections", ())] >= 1

        exported = families(where["pd"]) | families(primary)
    ours = {name for name in exported if name.startswith("sbp_")}
    assert len(ours) >= 20
    undocumented = sorted(n for n in exported if f"`{n}`" not in DOC)
    assert not undocumented, f"docs/metrics.md does not document {undocumented}"
    # And the page documents nothing that is not exported (by the servers tested here).
    documented = set(re.findall(r"^\| `(sbp_\w+)`", DOC, flags=re.M))
    assert documented <= ours, sorted(documented - ours)


def test_sbp_server_names_its_metrics_addresses_in_the_ready_file(tmp_path):
    proc, info, _ = start_sbp_server(tmp_path, "--range-servers", "2", "--metrics-port", "0")
    try:
        metrics = info["metrics"]
        assert len(metrics["range_servers"]) == 2
        assert "sbp_pd_leader" in families(metrics["pd"])
        assert all("sbp_range_server_append_seconds" in families(a)
                   for a in metrics["range_servers"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
