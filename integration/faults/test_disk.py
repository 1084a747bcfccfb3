"""Disk faults: a range server whose disk fills up, and stored bytes that rot.

The full disk is real: the range server's data directory is a small tmpfs mounted for the test
(needs root). Where mounting is not allowed, the test falls back to a file-size limit on the
range server process (RLIMIT_FSIZE, set and lifted from outside with prlimit), which fails its
writes the same way (the write system call refuses), and says which method it used.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.errors import (
    AppendOutcomeUnknownError,
    ErrorCode,
    SbpError,
    StorageFullError,
)
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes
from sbp_spark.server.cluster import ProcessCluster
from tests.segment_files import flip_body_byte, only_segment, stored_batches

from .helpers import RIDE_OUT, check_body, check_stream, make_body

TMPFS_BYTES = 24 * 1024 * 1024
BODY = 64 * 1024
# Few retries: a full disk must come back to the caller as STORAGE_FULL, not hang it.
IMPATIENT = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retries=2,
                         retry_backoff_ms=20, retry_backoff_max_ms=100, retry_deadline_s=5)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int) -> Iterator[str | None]:
    """Mount a ``size``-byte tmpfs at ``path``; yields None, or why it could not be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        yield "not root (mounting a tmpfs needs root)"
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        yield f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
        return
    try:
        yield None
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _append_until_full(client: SbpClient, stream_id: int, acked: dict[int, bytes],
                       seq: list[int], limit_batches: int = 2000) -> StorageFullError:
    writer = client.open_stream(stream_id)
    for _ in range(limit_batches):
        seq[0] += 1
        body = make_body(stream_id, seq[0], BODY)
        try:
            [a] = writer.append([batch_bytes(body)])
        except AppendOutcomeUnknownError as exc:
            return _storage_full(exc)
        acked[a.base_offset] = body
    raise AssertionError(f"{limit_batches} batches of {BODY} bytes fitted: the disk never "
                         "filled up")


@pytest.mark.timeout(180)
@pytest.mark.fault_case(
    "disk full, then space returns",
    "the range server's data dir is a 24 MiB tmpfs (fallback: RLIMIT_FSIZE on the process); "
    "append 64 KiB batches until it is full; free the space; restart the server",
    "appends fail with STORAGE_FULL naming the disk, nothing partial is stored, reads keep "
    "working, the server stays up; appends work again once space returns; acked data intact "
    "across a restart")
def test_disk_full_gives_storage_full_and_recovers(tmp_path, figures):
    rs_dir = tmp_path / "rs-0"
    with small_tmpfs(rs_dir, TMPFS_BYTES) as mount_problem:
        method = "tmpfs" if mount_problem is None else "RLIMIT_FSIZE"
        if mount_problem is not None and not hasattr(os, "prlimit"):
            pytest.skip(f"cannot fill a disk here: {mount_problem}, and os.prlimit is missing")
        figures["method"] = method if mount_problem is None else \
            f"{method} ({mount_problem})"
        with ProcessCluster(tmp_path, range_servers=1) as cluster, \
                ConnectionPool(IMPATIENT) as pool:
            proc = cluster.range_servers[0]
            assert proc is not None
            client = SbpClient(cluster.pd_address, IMPATIENT, pool)
            [stream] = client.create_streams(1)
            sid = stream.stream_id
            if mount_problem is None:
                # Leave room for about 40 batches beside a filler file.
                free = shutil.disk_usage(rs_dir).free
                filler = rs_dir / "filler"
                filler.write_bytes(b"\0" * max(free - 40 * (BODY + 1024), 0))
                release = filler.unlink
            else:
                limit = 40 * (BODY + 1024)
                hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
                os.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, hard))

                def release() -> None:
                    os.prlimit(proc.pid, resource.RLIMIT_FSIZE, (hard, hard))

            acked: dict[int, bytes] = {}
            seq = [0]
            full = _append_until_full(client, sid, acked, seq)
            figures["batches acked before full"] = len(acked)
            figures["error"] = f"{ErrorCode(full.code).name}: {full.message[:80]}"
            assert full.code == ErrorCode.STORAGE_FULL
            assert "disk full" in full.message or "cannot write" in full.message, full.message
            # Still full: the same clean answer again, and the server is still up and reads.
            with pytest.raises(AppendOutcomeUnknownError) as again:
                client.open_stream(sid).append([batch_bytes(make_body(sid, 10**6, BODY))])
            _storage_full(again.value)
            assert proc.running
            check = check_stream(client, sid, acked)
            assert check.ok and check.records == len(acked), check.summary()

            release()
            client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
            writer = client.open_stream(sid)
            for _ in range(20):
                seq[0] += 1
                body = make_body(sid, seq[0], BODY)
                [a] = writer.append([batch_bytes(body)])
                acked[a.base_offset] = body
            check = check_stream(client, sid, acked)
            assert check.ok and check.records == len(acked), check.summary()

            cluster.kill_range_server(0)
            cluster.start_range_server(0)
            check = check_stream(client, sid, acked)
            figures["after restart"] = check.summary()
            assert check.ok and check.records == len(acked), check.summary()


def _storage_full(exc: AppendOutcomeUnknownError) -> StorageFullError:
    """The STORAGE_FULL that ended an append. Its batch is in doubt, not "not stored": the code
    also answers an append whose fsync failed after its bytes were written. (This server
    stores nothing of an append the disk refused, which the checks of the stream show.)"""
    assert isinstance(exc.__cause__, StorageFullError), exc
    assert exc.in_doubt == (0,) and exc.stored == ()
    return exc.__cause__


def _read_all(client: SbpClient, sid: int, start: int = 0) -> tuple[list, SbpError | None]:
    got = []
    try:
        for b in client.read(sid, start):
            got.append((b.header.base_offset, bytes(b.data[ENVELOPE_SIZE:])))
    except SbpError as exc:
        return got, exc
    return got, None


def _stream_with_corrupt_batch(cluster: ProcessCluster, client: SbpClient
                               ) -> tuple[int, dict[int, bytes], int]:
    """A stream of 200 acknowledged batches of 4 KiB whose batch at offset 100 has one byte
    flipped on disk: (stream_id, acked bodies by offset, the corrupt batch's offset)."""
    [stream] = client.create_streams(1)
    sid = stream.stream_id
    acked: dict[int, bytes] = {}
    writer = client.open_stream(sid)
    for i in range(0, 200, 20):
        bodies = [make_body(sid, i + j, 4096) for j in range(20)]
        for a, body in zip(writer.append([batch_bytes(b) for b in bodies]), bodies,
                           strict=True):
            acked[a.base_offset] = body
    segment = only_segment(cluster.range_server_dir(0) / "data" / "ranges", sid)
    position, length, bad_offset = stored_batches(segment)[100]
    flip_body_byte(segment, position, length)
    return sid, acked, bad_offset


# Reads give up after a few tries: a corrupt batch reads the same every time.
FEW_READ_RETRIES = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retries=3,
                                retry_backoff_ms=20, retry_backoff_max_ms=100,
                                retry_deadline_s=10)


@pytest.mark.timeout(180)
@pytest.mark.fault_case(
    "corrupted segment byte",
    "flip one byte inside a stored batch's body on disk, first while the range server runs, "
    "then across a kill -9 and restart",
    "the corrupt batch is never handed to a reader as data: reads stop before it with an "
    "error; batches before it read fine; reads starting after it work")
def test_corrupt_segment_byte_is_never_served(tmp_path, figures):
    with ProcessCluster(tmp_path, range_servers=1) as cluster, \
            ConnectionPool(FEW_READ_RETRIES) as pool:
        client = SbpClient(cluster.pd_address, FEW_READ_RETRIES, pool)
        sid, acked, bad_offset = _stream_with_corrupt_batch(cluster, client)

        # While the server runs.
        got, error = _read_all(client, sid)
        assert error is not None, "a read over the corrupt batch succeeded"
        figures["live read error"] = f"{type(error).__name__}: {str(error)[:90]}"
        for o, body in got:
            assert o < bad_offset and body == acked[o], f"bad batch at {o} was served"
            check_body(body)
        after, error = _read_all(client, sid, bad_offset + 1)
        assert error is None and [o for o, _ in after] == list(range(bad_offset + 1, 200))

        # Across a crash: recovery scans the segment and finds the bad batch.
        cluster.kill_range_server(0)
        cluster.start_range_server(0)
        got, error = _read_all(client, sid)
        figures["read after restart"] = (
            f"{len(got)} batches, then {type(error).__name__ if error else 'no error'}"
            f"{': ' + str(error)[:160] if error else ''}")
        assert all(o != bad_offset for o, _ in got)
        for o, body in got:
            assert body == acked[o], f"batch at {o} differs from what was acknowledged"


@pytest.mark.timeout(180)
@pytest.mark.fault_case(
    "corrupted byte in the active segment, then restart (R=1)",
    "flip one byte in the middle of the open range's segment; kill -9 and restart",
    "recovery does not take the corrupt batch for a torn tail: the acknowledged batches after "
    "it stay readable and their offsets are never handed out again to new records")
def test_corrupt_active_segment_does_not_rewrite_history(tmp_path, figures):
    with ProcessCluster(tmp_path, range_servers=1) as cluster, \
            ConnectionPool(FEW_READ_RETRIES) as pool:
        client = SbpClient(cluster.pd_address, FEW_READ_RETRIES, pool)
        sid, acked, bad_offset = _stream_with_corrupt_batch(cluster, client)
        cluster.kill_range_server(0)
        cluster.start_range_server(0)
        after, error = _read_all(client, sid, bad_offset + 1)
        figures["acked batches after the corrupt one still readable"] = \
            f"{len(after)} of {199 - bad_offset}"
        assert error is None, error
        assert [(o, acked[o]) for o in range(bad_offset + 1, 200)] == after
        [appended] = SbpClient(cluster.pd_address, RIDE_OUT, pool).open_stream(sid).append(
            [batch_bytes(make_body(sid, 10**6, 100))])
        figures["next append got offset"] = appended.base_offset
        assert appended.base_offset == 200, (
            f"offset {appended.base_offset} was acknowledged before for other data")
