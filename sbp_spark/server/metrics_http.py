"""Prometheus metrics over HTTP for a PD node or a range server (``--metrics-port``).

``MetricsServer`` serves ``GET /metrics`` in Prometheus' text format from a registry of its
own: the process collector of ``prometheus_client`` (memory, CPU, open files) and the
server's own collector, which reads the server's counters when scraped (nothing is counted
twice, and a server without a scraper pays nothing). Every metric is documented in
docs/metrics.md (a test checks that each exported name is there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, cast

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.process_collector import ProcessCollector

from .latency import LatencyHistogram

log = logging.getLogger(__name__)


class Collector(Protocol):
    """A source of metric families, read at each scrape (``prometheus_client``'s collector
    interface)."""

    def collect(self) -> Iterable[Any]: ...


def histogram_family(name: str, documentation: str, histogram: LatencyHistogram
                     ) -> HistogramMetricFamily:
    """``histogram`` as a Prometheus histogram named ``name`` (seconds)."""
    buckets, total = histogram.snapshot()
    family = HistogramMetricFamily(name, documentation, unit="")
    family.add_metric([], buckets, total)
    return family


class MetricsServer:
    """Serves the metrics of ``collectors`` (and of this process) at
    ``http://host:port/metrics``; port 0 takes a free one (``address`` says which)."""

    def __init__(self, collectors: Iterable[Collector], host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        for collector in collectors:
            # Ours are structural (the Protocol above); older prometheus_client releases type
            # the argument as their own base class.
            self.registry.register(cast(Any, collector))
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server interface)
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "metrics are at /metrics")
                    return
                try:
                    body = generate_latest(registry)
                except Exception as exc:  # a scrape must say what failed, not hang up
                    log.exception("collecting metrics failed")
                    self.send_error(500, f"collecting metrics failed: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("metrics %s: " + format, self.client_address[0], *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` the metrics are served on."""
        host, port = self._httpd.server_address[:2]
        return f"{host if isinstance(host, str) else host.decode()}:{port}"

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="sbp-metrics",
                                        daemon=True)
        self._thread.start()
        log.info("metrics at http://%s/metrics", self.address)
        return self

    def stop(self) -> None:
        """Stop serving and close the port (idempotent)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
