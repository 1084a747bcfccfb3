"""What one received MiB costs on its way from a TCP socket into a file, by kernel path.

The range server stores an APPEND's payload with two kernel copies: ``recv_into`` into its
own buffer (where the frame's CRC-32 is checked) and ``pwritev`` into the page cache. Splicing
the payload instead (socket to pipe to file) saves the first copy, but the CRC must then be
read back from the page cache. This script measures whether that trade pays, without the
server around it, so the kernel paths alone are compared:

* ``copy``: ``recv_into`` a 1 MiB buffer, CRC-32 it, ``pwritev`` it (on a second thread,
  as the range server's reader and handler threads split the work);
* ``splice-pread``: ``splice`` socket -> pipe on the receiving thread, pipe -> file on the
  second thread, then ``preadv`` the bytes back and CRC-32 them;
* ``splice-mmap``: as above, the CRC-32 taken over an ``mmap`` of the written range;
* ``splice-unchecked``: as above with no CRC at all (the floor; not a valid server);
* ``recv-mmap``: ``recv_into`` a shared mapping of the file itself, so the bytes cross one
  kernel copy (socket to page cache), CRC-32 them there; each MiB's pages are made writable
  in one call first (``MADV_POPULATE_WRITE``, where the kernel has it) instead of a fault
  per 4 KiB page.

Every variant hands each MiB to the disk with ``sync_file_range`` as it goes and fsyncs
back to back on a third thread, as the range server does under ``group``; the sender is a
separate process doing plain ``sendall`` of 1 MiB buffers. Variants run alternately, a fresh
file each run; the report is each variant's median MB/s and its ratio to ``copy``.

Measured here (2026-11-24, 2 vCPUs, 512 MiB per run, 4 rounds): no splice variant that checks
the CRC beats ``copy``; receiving into a mapping of the file ran at a quarter to a half of
``copy`` (2026-11-25; see integration/bench/RESULTS.md). Linux only (``os.splice``).

Usage: ``python integration/bench/receive_paths.py [--mib 512] [--rounds 4] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import os
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time

from sbp_spark.bench.loopback import accept_process
from sbp_spark.protocol.frame import crc32
from sbp_spark.server.storage.writeback import start_writeback

MIB = 1024 * 1024
# Buffers (or pipes) between the receiving thread and the storing one.
SLOTS = 8
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
VARIANTS = ("copy", "splice-pread", "splice-mmap", "splice-unchecked", "recv-mmap")
# linux/mman.h (5.14+): populate the range's pages writable, as write faults would.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def send(port: int, total: int) -> None:
    """The sending process: ``total`` bytes in 1 MiB ``sendall`` calls."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        data = os.urandom(MIB)
        for _ in range(total // MIB):
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # wait until the receiver has made everything durable


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("sender closed early")
        got += n


def _splice_exact(src: int, dst: int, n: int, offset_dst: int | None = None) -> None:
    left = n
    while left:
        moved = (os.splice(src, dst, left) if offset_dst is None
                 else os.splice(src, dst, left, offset_dst=offset_dst + n - left))
        if not moved:
            raise EOFError("sender closed early")
        left -= moved


def _pipeline(receive, store, slots: list, chunks: int) -> None:
    """``receive(slot)`` on this thread, ``store(slot, pos)`` on a second, ``SLOTS`` apart."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    full: queue.SimpleQueue = queue.SimpleQueue()
    for slot in slots:
        free.put(slot)

    def storer() -> None:
        pos = 0
        while (slot := full.get()) is not None:
            store(slot, pos)
            pos += MIB
            free.put(slot)

    thread = threading.Thread(target=storer, name="store")
    thread.start()
    for _ in range(chunks):
        slot = free.get()
        receive(slot)
        full.put(slot)
    full.put(None)
    thread.join()


def receive_into_file(variant: str, sock: socket.socket, fd: int, total: int) -> None:
    chunks = total // MIB
    if variant == "copy":
        def receive(buf: bytearray) -> None:
            _recv_exact(sock, memoryview(buf))
            crc32(buf)

        def store(buf: bytearray, pos: int) -> None:
            os.pwritev(fd, [buf], pos)
            start_writeback(fd, pos, MIB)

        _pipeline(receive, store, [bytearray(MIB) for _ in range(SLOTS)], chunks)
        return
    if variant == "recv-mmap":
        _receive_into_mapping(sock, fd, total)
        return
    check = variant.split("-", 1)[1]
    readback = bytearray(MIB)
    pipes = [os.pipe() for _ in range(SLOTS)]
    try:
        for _, w in pipes:
            fcntl.fcntl(w, F_SETPIPE_SZ, MIB)

        def receive_pipe(pipe: tuple[int, int]) -> None:
            _splice_exact(sock.fileno(), pipe[1], MIB)

        def store_pipe(pipe: tuple[int, int], pos: int) -> None:
            _splice_exact(pipe[0], fd, MIB, offset_dst=pos)
            start_writeback(fd, pos, MIB)
            if check == "pread":
                os.preadv(fd, [readback], pos)
                crc32(readback)
            elif check == "mmap":
                with mmap.mmap(fd, MIB, offset=pos, prot=mmap.PROT_READ) as mapped:
                    crc32(memoryview(mapped))

        _pipeline(receive_pipe, store_pipe, pipes, chunks)
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def _receive_into_mapping(sock: socket.socket, fd: int, total: int) -> None:
    """``recv_into`` the file's own pages through a shared mapping and CRC them there; the
    second thread only starts each MiB's write-behind."""
    os.ftruncate(fd, total)
    positions = iter(range(0, total, MIB))
    populate = True
    with mmap.mmap(fd, total, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
        def receive(_slot: int) -> None:
            nonlocal populate
            pos = next(positions)
            if populate:
                try:
                    mapped.madvise(MADV_POPULATE_WRITE, pos, MIB)
                except OSError:  # an older kernel: the first touch of each page faults
                    populate = False
            with memoryview(mapped)[pos:pos + MIB] as chunk:
                _recv_exact(sock, chunk)
                crc32(chunk)

        def store(_slot: int, pos: int) -> None:
            start_writeback(fd, pos, MIB)

        _pipeline(receive, store, list(range(SLOTS)), total // MIB)


def run_once(variant: str, total: int, directory: str) -> float:
    """MB/s of one run: from the first byte to everything fsynced."""
    sock, sender = accept_process(
        lambda port: [sys.executable, __file__, "--send", str(port), str(total)])
    fd, path = tempfile.mkstemp(prefix="receive-paths-", dir=directory)
    done = threading.Event()

    def sync_loop() -> None:
        while not done.is_set():
            os.fsync(fd)

    syncer = threading.Thread(target=sync_loop, name="fsync")
    try:
        start = time.perf_counter()
        syncer.start()
        receive_into_file(variant, sock, fd, total)
        done.set()
        syncer.join()
        os.fsync(fd)
        seconds = time.perf_counter() - start
        sock.sendall(b"k")
    finally:
        done.set()
        if syncer.is_alive():
            syncer.join()
        sock.close()
        if sender.wait(timeout=60) != 0:
            raise RuntimeError(f"the sender process exited with {sender.returncode}")
        os.close(fd)
        os.unlink(path)
    return total / 1e6 / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB per run (default 512)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each variant (default 4)")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the scratch files go (the disk under test)")
    parser.add_argument("--send", nargs=2, type=int, metavar=("PORT", "BYTES"),
                        help=argparse.SUPPRESS)  # the sending process's own entry
    args = parser.parse_args(argv)
    if args.send:
        send(*args.send)
        return 0
    if not hasattr(os, "splice"):
        print("os.splice is not available here (Linux, Python >= 3.10)", file=sys.stderr)
        return 2
    if args.mib < 1 or args.rounds < 1:
        parser.error("--mib and --rounds must be >= 1")
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS:
            results[variant].append(run_once(variant, args.mib * MIB, args.dir))
        print(f"round {r + 1}: " + "  ".join(f"{v} {results[v][-1]:,.0f}" for v in VARIANTS),
              flush=True)
    base = statistics.median(results["copy"])
    for variant in VARIANTS:
        mbs = statistics.median(results[variant])
        print(f"{variant:17s} {mbs:8,.0f} MB/s  {mbs / base:.2f}x copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
