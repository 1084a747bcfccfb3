"""Client processes of the partition cases: a writer or a tail, run on a node of a
``netlab.Network`` so the network between it and the servers can be broken on its own.

Each prints one JSON object per line on stdout, which the test turns into its ``History``::

    {"e": "sent", "op": "w1:17", "stream": 1, "digest": "...", "call": 3, "attempt": 0}
    {"e": "acked", "op": "w1:17", "offset": 230, "range": 1}
    {"e": "failed", "op": "w1:17", "error": "ReadTimeoutError: ..."}
    {"e": "call_failed", "call": 3, "attempt": 0, "error": "...", "seconds": 20.1}
    {"e": "seen", "stream": 1, "offset": 230, "count": 1, "digest": "...", "server": "..."}
    {"e": "error", "error": "..."}          (a tail's failed read, ridden out)
    {"e": "claim", "node": "198.18.0.10:2378", "t": 1764000000.1}   (a PD node says it leads)
    {"e": "done"}

They run until stdin says ``stop`` (or closes); a writer finishes the append under way first.

    python -m integration.faults.driver writer --pd HOST:PORT --stream 1 --name w1 [--idempotent]
        [--resend-failed] [--client default]
    python -m integration.faults.driver tail --pd HOST:PORT --stream 1 --name r1 [--prefer H:P]
    python -m integration.faults.driver prober --pd H1:P1,H2:P2,H3:P3 --name p1

A writer's batches carry its name, their number, the append call and the try of that call
(``make_body``'s note ``c<call> a<try>``): ``--resend-failed`` sends the batches of a failed
call again, as the next try (op ``w1:17/1``), until they are acknowledged, so a batch stored
twice tells whether the client sent the same bytes twice within one call or the writer sent
them again after a call failed. Writers use a client patient enough to ride out any failover,
or with ``--client default`` the client's default settings.

``--idempotent`` writes as the connector's idempotent streaming sink does: each batch is an
Arrow body tagged (writer, append call, 0, index), and before a batch whose answer was lost is
sent again the writer looks for its tag in the stream (``find_landed``, the sink's own scan)
and does not send it twice. ``--prefer`` makes a tail read from that replica first. A prober
asks every PD node of a PD cluster, one by one, every ``--every-ms``, whether it leads
(DESCRIBE_PD_CLUSTER sent to that node alone), and reports each node's claim with the time of
its answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pyarrow as pa

from sbp_spark.client import Appended, ClientConfig, SbpClient, StreamWriter
from sbp_spark.client.connection import Connection
from sbp_spark.protocol.errors import BatchFormatError, SbpError
from sbp_spark.protocol.messages import DescribePdClusterRequest, Range, RangeReplica
from sbp_spark.protocol.records import (
    ENVELOPE_SIZE,
    BodyFormat,
    arrow_to_body,
    batch_bytes,
    encode_batch,
    make_records_batch,
)
from sbp_spark.spark.streaming.idempotent import WriteTag, find_landed, tag_batch, tag_of_body

from .helpers import StreamFollower, make_body
from .history import digest

# Clients notice a silent peer within seconds (a request waits request_timeout_s plus the
# server's timeout_ms), and keep retrying long enough to ride out a failover.
DRIVER_CONFIG = ClientConfig(connect_timeout_s=1.0, request_timeout_s=2.0,
                             server_timeout_ms=2000, retries=10_000, retry_backoff_ms=20,
                             retry_backoff_max_ms=250, retry_deadline_s=20.0)
CLIENTS = {"patient": DRIVER_CONFIG, "default": ClientConfig()}
PARTITION = 0  # the "Spark partition" of an idempotent driver's tags
# Sequence numbers of writer n are n * WRITER_SEQS + 1, 2, ... (make_body holds 9 digits).
WRITER_SEQS = 100_000_000


def op_name(writer: str, seq: int, attempt: int = 0) -> str:
    """The history's name of batch ``seq`` of ``writer`` sent in try ``attempt`` of its call:
    ``w1:17`` (the first), ``w1:17/1`` (sent again after the call failed once)."""
    return f"{writer}:{seq}" if attempt == 0 else f"{writer}:{seq}/{attempt}"


def parse_op(op: str) -> tuple[str, int, int]:
    """(writer, seq, attempt) of an ``op_name``."""
    writer, _, rest = op.rpartition(":")
    seq, _, attempt = rest.partition("/")
    return writer, int(seq), int(attempt or 0)


class Events:
    """JSON lines on stdout, whole lines only, flushed per group."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def emit(self, *events: dict) -> None:
        text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events)
        with self._lock:
            sys.stdout.write(text)
            sys.stdout.flush()


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def _watch_stdin(stop: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()


class Writer:
    """Appends numbered batches to one stream until stopped (see the module doc)."""

    def __init__(self, client: SbpClient, args: argparse.Namespace, events: Events) -> None:
        self.client = client
        self.stream = args.stream
        self.name = args.name
        self.writer_id = args.writer_id
        self.batches = args.batches
        self.body_size = args.body_size
        self.pause_s = args.pause_s
        self.idempotent = args.idempotent
        self.resend_failed = args.resend_failed
        self.events = events
        self.seq = 0
        self.call = 0

    def run(self, stop: threading.Event) -> None:
        writer = self.client.open_stream(self.stream)
        while not stop.is_set():
            self.call += 1
            seqs = list(range(self.seq + 1, self.seq + self.batches + 1))
            self.seq += self.batches
            attempt = 0
            acked = self._attempt(writer, seqs, attempt)
            while not acked and self.resend_failed and not stop.is_set():
                attempt += 1
                acked = self._attempt(writer, seqs, attempt)
            if acked and self.pause_s:
                stop.wait(self.pause_s)

    def _attempt(self, writer: StreamWriter, seqs: list[int], attempt: int) -> bool:
        """One append call of the batches numbered ``seqs`` (try ``attempt`` of this call);
        whether it was acknowledged."""
        ops, batches, digests = [], [], []
        for index, seq in enumerate(seqs):
            batch, body = self._batch(index, seq, attempt)
            ops.append(op_name(self.name, seq, attempt))
            batches.append(batch)
            digests.append(digest(body))
        self.events.emit(*({"e": "sent", "op": op, "stream": self.stream, "digest": d,
                            "call": self.call, "attempt": attempt}
                           for op, d in zip(ops, digests, strict=True)))
        check = self._resend_check(self.call) if self.idempotent else None
        began = time.monotonic()
        try:
            done = writer.append(batches, before_resend=check)
        except SbpError as exc:
            self.events.emit(
                *({"e": "failed", "op": op, "error": _error(exc)} for op in ops),
                {"e": "call_failed", "call": self.call, "attempt": attempt,
                 "error": _error(exc), "seconds": round(time.monotonic() - began, 3)})
            return False
        self.events.emit(*({"e": "acked", "op": op, "offset": a.base_offset,
                            "range": a.range_index} for op, a in zip(ops, done, strict=True)))
        return True

    def _batch(self, index: int, seq: int, attempt: int) -> tuple[bytes, bytes]:
        """(the record batch, its body) for batch ``index`` (number ``seq``) of the current
        call, sent for the ``attempt``-th time after failed calls."""
        # Numbered apart from other writers' bodies, so every body is unique in the stream;
        # the call and attempt tell a resend after a failed call from the first sending.
        value = make_body(self.stream, self.writer_id * WRITER_SEQS + seq, self.body_size,
                          note=f"c{self.call} a{attempt}")
        if not self.idempotent:
            return batch_bytes(value), value
        tag = WriteTag(self.name, self.call, PARTITION, index)
        rows = make_records_batch(pa.array([value], pa.binary()))
        body = arrow_to_body(tag_batch(rows, tag)).to_pybytes()
        return b"".join(bytes(b) for b in encode_batch(body, 1, body_format=BodyFormat.ARROW)), \
            body

    def _resend_check(self, call: int):
        """Before batches of this call are sent again: those already in the stream, found by
        their tags with the idempotent sink's backward scan."""
        def check(indexes: list[int]) -> dict[int, Appended]:
            located: dict[int, Appended] = {}
            ranges = self.client.list_ranges(self.stream)
            start = self.client.describe_stream(self.stream).start_offset
            last = ranges[-1]
            end = self.client.open_range_end(last) if last.is_open else last.end_offset

            def read_window(low: int, high: int) -> Iterator[tuple[int, WriteTag | None]]:
                for fetched in self.client.read(self.stream, low, high):
                    header = fetched.header
                    try:
                        tag = tag_of_body(fetched.data[ENVELOPE_SIZE:])
                    except BatchFormatError:
                        tag = None
                    if tag is not None and (tag.query_id, tag.batch_id, tag.partition_id) == (
                            self.name, call, PARTITION):
                        located[tag.seq] = Appended(self.stream, fetched.range_index,
                                                    header.base_offset, header.record_count,
                                                    header.batch_length)
                    yield header.base_offset, tag

            find_landed(read_window, start, end, self.name, call, PARTITION)
            return {i: located[i] for i in indexes if i in located}

        return check


class Tail(StreamFollower):
    """Follows a stream from offset 0 (``helpers.StreamFollower``); reports every batch it
    gets and every failure it rides out."""

    def __init__(self, client: SbpClient, args: argparse.Namespace, events: Events) -> None:
        self.client = client
        self.stream_id = args.stream
        self.prefer = args.prefer
        self.wait_ms = args.wait_ms
        self.events = events
        self.offset = 0
        self.stop = threading.Event()

    def _range_at(self, offset: int) -> Range | None:
        rng = super()._range_at(offset)
        return None if rng is None else self._preferred(rng)

    def _preferred(self, rng: Range) -> Range:
        """``rng`` with the preferred replica first (the others follow in their order)."""
        if not self.prefer or not any(r.server.advertise_addr == self.prefer
                                      for r in rng.servers):
            return rng
        ordered = sorted(rng.servers, key=lambda r: (r.server.advertise_addr != self.prefer,
                                                     not r.is_primary))
        return replace(rng, servers=[RangeReplica(r.server, False) for r in ordered])

    def _stopped(self) -> bool:
        return self.stop.is_set()

    def _pause(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def _got(self, b) -> None:
        self.events.emit({"e": "seen", "stream": self.stream_id,
                          "offset": b.header.base_offset, "count": b.header.record_count,
                          "digest": digest(b.data[ENVELOPE_SIZE:]), "server": b.server})

    def _failed(self, error: SbpError) -> None:
        self.events.emit({"e": "error", "error": _error(error)})

    def run(self, stop: threading.Event) -> None:
        self.stop = stop
        self._follow()


class Prober:
    """Asks each PD node whether it leads, over and over (see the module doc)."""

    def __init__(self, args: argparse.Namespace, events: Events) -> None:
        self.nodes = [a.strip() for a in args.pd.split(",") if a.strip()]
        self.every_s = args.every_ms / 1000.0
        self.events = events
        # Its own short timeouts: a node that is cut off must not hold up the round.
        self.config = ClientConfig(connect_timeout_s=0.3, request_timeout_s=0.5, retries=0)

    def claims(self, node: str, conn: Connection) -> bool:
        response, _ = conn.call(DescribePdClusterRequest())
        cluster = getattr(response, "cluster", None)
        return cluster is not None and any(
            member.is_leader and member.advertise_addr == node for member in cluster.members)

    def run(self, stop: threading.Event) -> None:
        connections: dict[str, Connection] = {}
        while not stop.is_set():
            for node in self.nodes:
                try:
                    conn = connections.get(node)
                    if conn is None or not conn.usable:
                        conn = connections[node] = Connection(node, self.config)
                    if self.claims(node, conn):
                        self.events.emit({"e": "claim", "node": node, "t": time.time()})
                except SbpError:
                    stale = connections.pop(node, None)  # cut off, or not up: next round
                    if stale is not None:
                        stale.close()
            stop.wait(self.every_s)
        for conn in connections.values():
            conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    for role in ("writer", "tail", "prober"):
        sub = roles.add_parser(role)
        sub.add_argument("--pd", required=True)
        sub.add_argument("--name", required=True)
        if role != "prober":
            sub.add_argument("--stream", type=int, required=True)
    roles.choices["prober"].add_argument("--every-ms", type=int, default=50)
    writer = roles.choices["writer"]
    writer.add_argument("--writer-id", type=int, default=0, choices=range(10),
                        help="numbers its bodies apart from other writers' (0-9)")
    writer.add_argument("--batches", type=int, default=8, help="batches per append call")
    writer.add_argument("--body-size", type=int, default=256)
    writer.add_argument("--pause-s", type=float, default=0.02, help="between append calls")
    writer.add_argument("--idempotent", action="store_true")
    writer.add_argument("--resend-failed", action="store_true",
                        help="after a failed call, send its batches again (as an application "
                             "that wants them stored does) until acknowledged")
    for sub in roles.choices.values():
        sub.add_argument("--client", choices=sorted(CLIENTS), default="patient",
                         help="patient: retries long enough to ride out any failover; "
                              "default: the client's default settings")
    tail = roles.choices["tail"]
    tail.add_argument("--prefer", default="", help="host:port of the replica to read first")
    tail.add_argument("--wait-ms", type=int, default=200)
    args = parser.parse_args(argv)
    if args.role == "writer" and args.idempotent and args.resend_failed:
        parser.error("--resend-failed sends other bytes under the same write tags: it does not "
                     "go with --idempotent")
    # The client's own account of what it rode out goes to stderr: the driver's log.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    events = Events()
    client = SbpClient(args.pd, CLIENTS[args.client])
    stop = threading.Event()
    threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    role: Writer | Tail | Prober
    if args.role == "writer":
        role = Writer(client, args, events)
    elif args.role == "tail":
        role = Tail(client, args, events)
    else:
        role = Prober(args, events)
    started = time.monotonic()
    role.run(stop)
    events.emit({"e": "done", "seconds": round(time.monotonic() - started, 3)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
