"""The 1 MiB APPEND's pipeline without the server: what each thing the protocol adds costs.

The range server stores a stream of 1 MiB APPEND frames with three threads: a reader
(``recv_into`` and the CRC), a handler (``pwritev`` and the write-behind) and the group commit's
flushing thread (``fdatasync``, then the answers). This script builds the same pipeline from the
bare calls and adds, one at a time, what the protocol and its client add around them:

* ``stream``: the sender writes as fast as TCP takes it; nothing is answered;
* ``acked``: every MiB is answered once an ``fdatasync`` covers it, and the sender keeps at
  most ``--window`` MiB unanswered (the client's frames in flight);
* ``acked+python``: as ``acked``, with ``--python-us`` of busy Python per MiB on the receiving
  and the storing thread, and half of it per ``fdatasync`` on the syncing one (the interpreter
  work the server does per frame, as a stand-in);
* ``acked+python+drain``: as above, and the sender waits for every answer after each
  ``--call-mib`` MiB, as a caller of ``StreamWriter.append`` does at the end of each call.

Each run is compared with the storage ceiling of ``sbp bench`` (the same bytes appended to a
file, fsynced every 10 ms), measured right before and right after it; the faster of the two
counts. Variants run alternately, a fresh file each run.

Measured here (2026-11-26, 2 vCPUs, 512 MiB per run, three sets): ``acked+python`` at
0.86-0.90x of the ceiling, ``acked+python+drain`` at 0.80-0.85x, where the range server stands
at 0.64-0.73x in ``sbp bench`` (see integration/bench/RESULTS.md, the tenth session).

Usage: ``python integration/bench/append_pipeline.py [--mib 512] [--rounds 3] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time

from sbp_spark.bench.loopback import accept_process, file_append_seconds
from sbp_spark.protocol.frame import crc32
from sbp_spark.server.storage.writeback import start_writeback

MIB = 1024 * 1024
VARIANTS = ("stream", "acked", "acked+python", "acked+python+drain")
_ACK = struct.Struct(">q")  # the stored position an answer covers
SLOTS = 8  # receive buffers between the receiving and the storing thread


def busy(seconds: float) -> None:
    """Hold the interpreter (and the GIL) for ``seconds``, as Python code would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def send(port: int, total: int, window: int, call: int) -> None:
    """The sending process: ``total`` bytes in 1 MiB ``sendall`` calls, at most ``window``
    bytes unanswered (0: no answers), all answered after every ``call`` bytes (0: never)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        data = os.urandom(MIB)
        answered = 0
        changed = threading.Condition()

        def read_answers() -> None:
            nonlocal answered
            pending = b""
            while chunk := sock.recv(4096):
                pending += chunk
                whole = len(pending) - len(pending) % _ACK.size
                if whole:
                    with changed:
                        answered = _ACK.unpack_from(pending, whole - _ACK.size)[0]
                        changed.notify_all()
                    pending = pending[whole:]

        def wait_for_answers(upto: int) -> None:
            with changed:
                changed.wait_for(lambda: answered >= upto)

        if window:
            threading.Thread(target=read_answers, daemon=True).start()
        sent = 0
        while sent < total:
            if call and sent and sent % call == 0:
                wait_for_answers(sent)
            if window:
                wait_for_answers(sent + MIB - window)  # at most ``window`` unanswered after
            sock.sendall(data)
            sent += MIB
        if window:
            wait_for_answers(total)
        else:
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # the receiver's word that everything is durable


def receive(sock: socket.socket, fd: int, total: int, answer: bool, python_s: float
            ) -> dict[str, list[float]]:
    """Receive ``total`` bytes into ``fd`` through the three threads; returns the seconds of
    each ``pwritev`` and ``fdatasync``."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    full: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(SLOTS):
        free.put(bytearray(MIB))
    stored = 0  # bytes written to the file so far
    lock = threading.Lock()
    done = threading.Event()
    times: dict[str, list[float]] = {"pwritev": [], "fdatasync": []}

    def store() -> None:
        nonlocal stored
        pos = 0
        while (buf := full.get()) is not None:
            started = time.perf_counter()
            os.pwritev(fd, [buf], pos)
            times["pwritev"].append(time.perf_counter() - started)
            start_writeback(fd, pos, MIB)
            busy(python_s)
            pos += MIB
            with lock:
                stored = pos
            free.put(buf)

    def sync() -> None:
        synced = 0
        while True:
            with lock:
                target = stored
            if target > synced:
                started = time.perf_counter()
                os.fdatasync(fd)
                times["fdatasync"].append(time.perf_counter() - started)
                if answer:  # one answer per MiB, as one per frame
                    for pos in range(synced + MIB, target + 1, MIB):
                        sock.sendall(_ACK.pack(pos))
                busy(python_s / 2)
                synced = target
            elif done.is_set():
                return
            else:
                time.sleep(0.0001)

    threads = [threading.Thread(target=store), threading.Thread(target=sync)]
    for t in threads:
        t.start()
    for _ in range(total // MIB):
        buf = free.get()
        view, got = memoryview(buf), 0
        while got < MIB:
            n = sock.recv_into(view[got:])
            if not n:
                raise EOFError("the sender closed early")
            got += n
        crc32(buf)
        busy(python_s)
        full.put(buf)
    full.put(None)
    threads[0].join()
    done.set()
    threads[1].join()
    return times


def run_once(variant: str, total: int, directory: str, window_mib: int, call_mib: int,
             python_us: int) -> tuple[float, dict[str, list[float]]]:
    """MB/s of one run, from the first byte to everything durable (and answered)."""
    answer = variant != "stream"
    window = window_mib * MIB if answer else 0
    call = call_mib * MIB if variant.endswith("drain") else 0
    python_s = python_us / 1e6 if "python" in variant else 0.0
    sock, sender = accept_process(lambda port: [
        sys.executable, __file__, "--send", str(port), str(total), str(window), str(call)])
    fd, path = tempfile.mkstemp(prefix="append-pipeline-", dir=directory)
    try:
        with sock:
            # Answers go out at once, as the range server sends them: with Nagle's algorithm
            # on, an answer waits for the sender's delayed ACK (up to 40 ms) whenever the
            # sender has nothing to send, as when it drains.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = time.perf_counter()
            times = receive(sock, fd, total, answer, python_s)
            os.fdatasync(fd)
            seconds = time.perf_counter() - start
            if not answer:
                sock.sendall(b"k")
            if sender.wait(timeout=60) != 0:
                raise RuntimeError(f"the sender process exited with {sender.returncode}")
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
        os.close(fd)
        os.unlink(path)
    return total / 1e6 / seconds, times


def ceiling(total: int, directory: str) -> float:
    """MB/s of ``sbp bench``'s storage ceiling under ``group``: 1 MiB appends, fsync every 10 ms."""
    return total / 1e6 / file_append_seconds(directory, total, os.urandom(MIB), 10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB per run (default 512)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant (default 3)")
    parser.add_argument("--window-mib", type=int, default=32,
                        help="MiB the sender keeps unanswered at most (default 32)")
    parser.add_argument("--call-mib", type=int, default=64,
                        help="MiB between two waits for every answer in the drain variant "
                             "(default 64, as sbp bench's append calls)")
    parser.add_argument("--python-us", type=int, default=80,
                        help="busy Python per MiB on the receiving and storing threads "
                             "(default 80)")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the scratch files go (the disk under test)")
    parser.add_argument("--send", nargs=4, type=int, help=argparse.SUPPRESS)  # the sender
    args = parser.parse_args(argv)
    if args.send:
        send(*args.send)
        return 0
    if min(args.mib, args.rounds, args.window_mib, args.call_mib) < 1 or args.python_us < 0:
        parser.error("--mib, --rounds, --window-mib and --call-mib must be >= 1, "
                     "--python-us >= 0")
    total = args.mib * MIB
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS:
            before = ceiling(total, args.dir)
            mbs, times = run_once(variant, total, args.dir, args.window_mib, args.call_mib,
                                  args.python_us)
            best = max(before, ceiling(total, args.dir))
            rates[variant].append(mbs)
            ratios[variant].append(mbs / best)
            print(f"round {r + 1} {variant:19s} {mbs:7,.0f} MB/s  {mbs / best:.2f}x ceiling "
                  f"({best:,.0f} MB/s); pwritev median "
                  f"{statistics.median(times['pwritev']) * 1e6:,.0f} us, fdatasync median "
                  f"{statistics.median(times['fdatasync']) * 1e3:.2f} ms", flush=True)
    for variant in VARIANTS:
        print(f"{variant:19s} {statistics.median(rates[variant]):8,.0f} MB/s  "
              f"{statistics.median(ratios[variant]):.2f}x ceiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
