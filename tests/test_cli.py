"""The ``sbp`` command as a user runs it: help for every subcommand, stream and range admin,
produce and tail (including ``tail -f`` across a seal), cluster, one-line errors, and the demo.
"""

from __future__ import annotations

import io
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbp_spark.cli import build_parser, main
from sbp_spark.commands.progress import Progress
from sbp_spark.server.cluster import EmbeddedCluster

SUBCOMMANDS = [
    ["streams", "create"], ["streams", "list"], ["streams", "describe"], ["streams", "update"],
    ["streams", "trim"], ["streams", "delete"], ["ranges", "list"], ["ranges", "seal"],
    ["produce"], ["tail"], ["cluster"], ["demo"], ["server"], ["pd"], ["range-server"],
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with EmbeddedCluster(tmp_path_factory.mktemp("cli-cluster"), range_servers=2) as c:
        yield c


@pytest.fixture
def sbp(capsys, cluster):
    """Run ``sbp ARGS --pd <cluster>`` in this process: (exit status, stdout, stderr)."""

    def run(*argv: str, pd: bool = True) -> tuple[int, str, str]:
        args = [*argv] + (["--pd", cluster.pd_address] if pd else [])
        status = main(args)
        out, err = capsys.readouterr()
        return status, out, err

    return run


def _create(sbp, count: int = 1) -> list[int]:
    status, out, err = sbp("streams", "create", "--count", str(count))
    assert status == 0, err
    return [int(line) for line in out.split()]


def _interrupt(proc: subprocess.Popen) -> tuple[int, str]:
    """Ctrl-C a ``sbp tail -f`` child (killed if it does not end within 15 s, and the test
    fails): its exit status and stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        status = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    stderr = proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    return status, stderr


def _assert_one_line_error(status: int, err: str, command: str, *words: str) -> None:
    assert status == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"sbp {command}: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], err


# -- help ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: sbp {' '.join(argv)}")


def test_bench_help_is_the_harness_own(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sbp bench") and "--quick" in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("server", "pd", "range-server", "streams", "ranges", "produce", "tail",
                 "cluster", "demo", "bench"):
        assert f"    {name} " in out


# -- streams and ranges --------------------------------------------------------------------------


def test_streams_lifecycle(sbp):
    first, second = _create(sbp, 2)

    status, out, _ = sbp("streams", "list")
    assert status == 0
    listed = [line.split()[0] for line in out.splitlines()[1:]]
    assert str(first) in listed and str(second) in listed

    status, out, _ = sbp("streams", "update", str(second), "--retention-ms", "60000", "--json")
    assert status == 0
    assert json.loads(out)["retention_ms"] == 60000

    status, out, _ = sbp("streams", "describe", str(first), str(second), "--json")
    facts = [json.loads(line) for line in out.splitlines()]
    assert [f["stream_id"] for f in facts] == [first, second]
    assert facts[0]["retention_ms"] == -1 and facts[1]["retention_ms"] == 60000
    assert facts[0]["next_offset"] == 0 and facts[0]["ranges"] == 1

    status, out, _ = sbp("streams", "delete", str(second))
    assert status == 0 and out.strip() == f"deleted stream {second}"
    _, out, _ = sbp("streams", "list", "--json")
    assert second not in [json.loads(line)["stream_id"] for line in out.splitlines()]

    status, _, err = sbp("streams", "describe", str(second))
    _assert_one_line_error(status, err, "streams describe", str(second))


def test_delete_says_which_streams_it_deleted_and_which_it_could_not(sbp):
    # The PD deletes every stream it can; an error naming only the missing one read as if
    # nothing had been deleted. A repeated id is deleted once, not failed as "was deleted".
    first, second = _create(sbp, 2)
    status, out, err = sbp("streams", "delete", str(first), "999999", str(second), str(first))
    assert out.splitlines() == [f"deleted stream {first}", f"deleted stream {second}"]
    _assert_one_line_error(status, err, "streams delete", "999999")
    assert str(first) not in err


def test_describe_and_ranges_list_show_what_they_found_and_name_every_missing_id(sbp):
    # One missing id hid the streams that were found and every other missing id.
    (stream,) = _create(sbp)
    for command in (["streams", "describe"], ["ranges", "list"]):
        status, out, err = sbp(*command, "999998", str(stream), "999999", str(stream),
                               "--json")
        assert status == 1, command
        assert [json.loads(line)["stream_id"] for line in out.splitlines()] == [stream]
        lines = err.strip().splitlines()
        assert len(lines) == 2 and "Traceback" not in err, err
        assert "999998" in lines[0] and "999999" in lines[1], err
        assert all(line.startswith(f"sbp {' '.join(command)}: error: ") for line in lines)


def test_create_asks_in_chunks_and_prints_what_it_made_before_a_failure(sbp, monkeypatch):
    # One request for every stream outlasted the client's timeout for large counts, and a
    # failure then printed no id of the streams that were made.
    from sbp_spark.client import SbpClient
    from sbp_spark.commands import streams

    monkeypatch.setattr(streams, "CREATE_CHUNK", 2)
    ids = _create(sbp, 5)
    assert len(set(ids)) == 5
    create = SbpClient.create_streams
    asked = []

    def fail_third(self, count=1, **kwargs):
        asked.append(count)
        if len(asked) == 3:
            raise ValueError("the PD went away")
        return create(self, count, **kwargs)

    monkeypatch.setattr(SbpClient, "create_streams", fail_third)
    status, out, err = sbp("streams", "create", "--count", "6")
    assert asked == [2, 2, 2]
    assert len(out.split()) == 4
    _assert_one_line_error(status, err, "streams create", "the PD went away")
    with pytest.raises(SystemExit) as usage:
        sbp("streams", "create", "--count", str(streams.MAX_CREATE_COUNT + 1))
    assert usage.value.code == 2


def test_update_needs_something_to_change(sbp):
    (stream,) = _create(sbp)
    # A command line that asks for nothing is a usage error (2), as argparse's own are.
    status, _, err = sbp("streams", "update", str(stream))
    assert status == 2
    _assert_one_line_error(1, err, "streams update", "--replicas")


def test_trim_then_reading_below_fails_with_the_new_start(sbp, tmp_path):
    (stream,) = _create(sbp)
    source = tmp_path / "lines.txt"
    source.write_text("".join(f"line {i}\n" for i in range(20)))
    assert sbp("produce", str(stream), str(source))[0] == 0

    status, out, _ = sbp("streams", "trim", str(stream), "5")
    assert status == 0 and "starts at offset 5" in out

    status, _, err = sbp("tail", str(stream), "--from", "2")
    _assert_one_line_error(status, err, "tail", "trimmed", "starts at 5")
    status, out, _ = sbp("tail", str(stream))
    assert out.splitlines() == [f"line {i}" for i in range(5, 20)]


def test_ranges_list_and_seal(sbp):
    (stream,) = _create(sbp)
    sbp_lines = "a\nb\nc\n"
    _produce_stdin(sbp, stream, sbp_lines)

    status, out, _ = sbp("ranges", "seal", str(stream))
    assert status == 0
    assert "sealed range 0" in out and "at offset 3" in out and "open range is now 1" in out
    _produce_stdin(sbp, stream, "d\n")

    status, out, _ = sbp("ranges", "list", str(stream), "--json")
    ranges = [json.loads(line) for line in out.splitlines()]
    assert [(r["range_index"], r["start_offset"], r["next_offset"], r["open"])
            for r in ranges] == [(0, 0, 3, False), (1, 3, 4, True)]
    assert all(r["servers"] and r["servers"][0]["primary"] for r in ranges)

    status, out, _ = sbp("tail", str(stream))
    assert out.splitlines() == ["a", "b", "c", "d"]


def test_a_seal_that_opened_no_new_range_says_it_sealed(sbp, cluster):
    # More replicas than live range servers: the PD seals the range, then cannot open the
    # next one. The error must not read as if the range were still open for appends.
    (stream,) = _create(sbp)
    _produce_stdin(sbp, stream, "a\nb\n")
    assert sbp("streams", "update", str(stream), "--replicas", "3")[0] == 0
    status, _, err = sbp("ranges", "seal", str(stream))
    _assert_one_line_error(status, err, "ranges seal", "range 0", "was sealed at offset 2",
                           "no range could be opened", "only 2 range servers are live")
    _, out, _ = sbp("ranges", "list", str(stream), "--json")
    assert [(r["range_index"], r["open"]) for r in map(json.loads, out.splitlines())] == [
        (0, False)]


# -- produce and tail ----------------------------------------------------------------------------


def _produce_stdin(sbp, stream: int, text: str, *extra: str) -> str:
    old = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(text.encode()))
    try:
        status, out, err = sbp("produce", str(stream), *extra)
    finally:
        sys.stdin = old
    assert status == 0, err
    return out


def test_produce_stdin_in_small_batches_then_tail_ranges_of_it(sbp):
    (stream,) = _create(sbp)
    out = _produce_stdin(sbp, stream, "".join(f"{i}\n" for i in range(1, 26)),
                         "--batch-records", "10")
    assert out.strip() == f"produced 25 records to stream {stream}, offsets 0 .. 24"

    assert sbp("tail", str(stream), "--from", "20")[1].split() == ["21", "22", "23", "24", "25"]
    assert sbp("tail", str(stream), "--from", "-2")[1].split() == ["24", "25"]
    assert sbp("tail", str(stream), "--from", "-1")[1].split() == ["25"]
    assert sbp("tail", str(stream), "--from", "-0")[1] == ""  # none before the end, not offset 0
    assert sbp("tail", str(stream), "--from", "3", "--max", "2")[1].split() == ["4", "5"]
    assert sbp("tail", str(stream), "--from", "latest")[1] == ""
    _, out, _ = sbp("tail", str(stream), "--from", "12", "-n", "2", "--print-offsets")
    assert out.splitlines() == ["12\t13", "13\t14"]


def test_produce_keys_and_files(sbp, tmp_path):
    (stream,) = _create(sbp)
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_bytes(b"k1:v1\r\nk2:v:2\n")
    two.write_bytes(b"k3:v3")  # no final newline: still a record
    status, out, _ = sbp("produce", str(stream), str(one), str(two), "--key-separator", ":")
    assert status == 0 and "offsets 0 .. 2" in out
    _, out, _ = sbp("tail", str(stream), "--print-keys", "--print-offsets")
    assert out.splitlines() == ["0\tk1\tv1", "1\tk2\tv:2", "2\tk3\tv3"]

    status, _, _ = sbp("produce", str(stream), str(one), "--whole-files", "--key", "file")
    assert status == 0
    _, out, _ = sbp("tail", str(stream), "--from", "3", "--print-keys")
    assert out == "file\tk1:v1\r\nk2:v:2\n\n"


def test_tail_prints_opaque_and_arrow_payloads(sbp, cluster):
    import pyarrow as pa

    from sbp_spark.client import SbpClient
    from sbp_spark.protocol.records import (
        PAYLOAD_ARROW,
        encode_arrow_batch,
        encode_batch,
        with_payload_kind,
    )

    (stream,) = _create(sbp)
    table = pa.record_batch({"id": [1, 2], "name": ["a", "b"]})
    SbpClient(cluster.pd_address).append(stream, [
        encode_batch(b"raw bytes"),
        encode_arrow_batch(with_payload_kind(table, PAYLOAD_ARROW)),
    ])
    _, out, _ = sbp("tail", str(stream), "--print-offsets")
    assert out.splitlines() == ["0\traw bytes", '1\t{"id": 1, "name": "a"}',
                                '2\t{"id": 2, "name": "b"}']


def test_tail_prints_records_payloads_with_string_columns(sbp, cluster):
    # Foreign writers may store a payload=records key or value as string, not binary.
    import pyarrow as pa

    from sbp_spark.client import SbpClient
    from sbp_spark.protocol.records import PAYLOAD_RECORDS, encode_arrow_batch, with_payload_kind

    (stream,) = _create(sbp)
    strings = pa.record_batch({"key": pa.array(["k1", None]), "value": pa.array(["v1", "é"])})
    large = pa.record_batch({"key": pa.array([b"k3"]),
                             "value": pa.array(["v3"], pa.large_string())})
    SbpClient(cluster.pd_address).append(stream, [
        encode_arrow_batch(with_payload_kind(strings, PAYLOAD_RECORDS)),
        encode_arrow_batch(with_payload_kind(large, PAYLOAD_RECORDS)),
    ])
    status, out, err = sbp("tail", str(stream), "--print-offsets", "--print-keys")
    assert (status, err) == (0, "")
    assert out.splitlines() == ["0\tk1\tv1", "1\t\té", "2\tk3\tv3"]


def test_tail_names_a_records_column_it_cannot_print(sbp, cluster):
    import pyarrow as pa

    from sbp_spark.client import SbpClient
    from sbp_spark.protocol.records import PAYLOAD_RECORDS, encode_arrow_batch, with_payload_kind

    (stream,) = _create(sbp)
    numbers = pa.record_batch({"key": pa.array([b"k"]), "value": pa.array([7])})
    SbpClient(cluster.pd_address).append(
        stream, [encode_arrow_batch(with_payload_kind(numbers, PAYLOAD_RECORDS))])
    status, _, err = sbp("tail", str(stream))
    _assert_one_line_error(status, err, "tail", "'value' column", "int64", "offset 0")


def test_produce_reports_a_line_without_separator(sbp, tmp_path):
    (stream,) = _create(sbp)
    source = tmp_path / "bad.txt"
    source.write_text("k:v\nno separator here\n")
    status, _, err = sbp("produce", str(stream), str(source), "--key-separator", ":")
    _assert_one_line_error(status, err, "produce", "line 2", "bad.txt")


def test_user_errors_are_one_line(sbp, tmp_path):
    (stream,) = _create(sbp)
    status, _, err = sbp("tail", "999999")
    _assert_one_line_error(status, err, "tail", "999999")
    status, _, err = sbp("tail", str(stream), "--from", "50")
    _assert_one_line_error(status, err, "tail", "beyond the end")
    status, _, err = sbp("produce", str(stream), str(tmp_path / "missing.txt"))
    _assert_one_line_error(status, err, "produce", "missing.txt")
    status, _, err = sbp("streams", "trim", "999999", "3")
    _assert_one_line_error(status, err, "streams trim", "999999")
    status, _, err = sbp("ranges", "list", "999999")
    _assert_one_line_error(status, err, "ranges list", "999999")


def test_unreachable_pd_is_named(capsys):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for argv in (["streams", "list"], ["cluster"], ["tail", "1"], ["ranges", "seal", "1"]):
        status = main([*argv, "--pd", f"127.0.0.1:{port}"])
        err = capsys.readouterr().err
        assert status == 1, argv
        assert f"cannot reach PD at 127.0.0.1:{port}" in err, err
        assert "Traceback" not in err


def test_bad_arguments_are_usage_errors(capsys):
    for argv in (["tail", "1", "--from", "soon"], ["tail", "-3"], ["streams", "trim", "1", "-4"],
                 ["produce", "x/y"], ["streams", "list", "--pd", "nohost"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
        assert "error:" in capsys.readouterr().err


def test_pd_comes_from_the_environment(capsys, cluster, monkeypatch):
    monkeypatch.setenv("SBP_PD", cluster.pd_address)
    assert main(["streams", "list"]) == 0
    assert capsys.readouterr().out.startswith("STREAM")


def test_a_bad_address_or_file_from_the_environment_names_the_variable(capsys, monkeypatch,
                                                                       tmp_path):
    # Nothing on the command line named 'nohost' or the CA file: say where they came from.
    monkeypatch.setenv("SBP_PD", "nohost")
    status = main(["streams", "list"])
    _assert_one_line_error(status, capsys.readouterr().err, "streams list", "$SBP_PD",
                           "nohost")
    monkeypatch.setenv("SBP_TLS_CA", str(tmp_path / "missing-ca.pem"))
    status = main(["streams", "list", "--pd", "127.0.0.1:1"])
    _assert_one_line_error(status, capsys.readouterr().err, "streams list", "$SBP_TLS_CA",
                           "missing-ca.pem")


def test_cluster_shows_members_and_range_servers(sbp, cluster):
    (stream,) = _create(sbp)
    status, out, _ = sbp("cluster", "--json")
    assert status == 0
    facts = json.loads(out)
    assert facts["members"] == [{"name": facts["members"][0]["name"],
                                 "address": cluster.pd_address, "leader": True}]
    # Every registered range server, including one that holds no range yet.
    addresses = {s["address"] for s in facts["range_servers"]}
    assert addresses == set(cluster.range_server_addresses)
    assert all(s["ping_ms"] is not None and s["live"] for s in facts["range_servers"])
    # How long ago the leader heard each one, by its own clock: within the liveness timeout.
    assert all(0 <= s["heartbeat_age_ms"] <= 3000 for s in facts["range_servers"])
    assert sum(s["primary_of"] for s in facts["range_servers"]) >= 1
    # Range servers report their metrics as soon as they register.
    assert all(s["metrics"]["disk_free_space"] > 0 and s["metrics"]["memory_used"] > 0
               for s in facts["range_servers"])
    assert facts["streams"] >= 1

    status, out, _ = sbp("cluster")
    assert status == 0 and "leader" in out and cluster.pd_address in out
    assert "DISK FREE" in out and "MiB" in out


def test_cluster_checks_one_range_server(sbp, cluster):
    address = cluster.range_server_addresses[0]
    status, out, _ = sbp("cluster", "--json", "--range-server", address)
    assert status == 0
    facts = json.loads(out)
    (server,) = facts["range_servers"]
    assert server["address"] == address and server["live"] and server["ping_ms"] is not None
    # A health check does not walk every stream's ranges: nothing counted, nothing claimed.
    assert "streams" not in facts and server["ranges"] is None and server["primary_of"] is None
    status, out, _ = sbp("cluster", "--range-server", address)
    assert status == 0 and address in out and cluster.range_server_addresses[1] not in out

    status, _, err = sbp("cluster", "--range-server", "127.0.0.1:1")
    _assert_one_line_error(status, err, "cluster")
    assert "range server 127.0.0.1:1 is not registered with the PD" in err


# -- tail -f in a real process -------------------------------------------------------------------


class _LineReader:
    """Lines of a child's stdout as they arrive. Reads the pipe's fd directly: a buffered
    ``readline`` after ``select`` would leave lines in Python's buffer that ``select`` then
    never reports, and the test would wait for lines it already received."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.fd = proc.stdout.fileno()
        self.partial = b""
        self.ready: list[str] = []

    def read_until(self, done, timeout: float) -> list[str]:
        """Lines until ``done(lines)`` or the deadline (the rest stay for the next call)."""
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.fd, selectors.EVENT_READ)
            while not done(lines):
                if self.ready:
                    lines.append(self.ready.pop(0))
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(timeout=left):
                    break
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    break
                *complete, self.partial = (self.partial + chunk).split(b"\n")
                self.ready += [line.decode() for line in complete]
        return lines


def test_tail_follow_sees_new_records_across_a_seal(sbp, cluster):
    (stream,) = _create(sbp)
    _produce_stdin(sbp, stream, "old\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbp_spark.cli", "tail", str(stream), "-f", "--from", "latest",
         "--print-offsets", "--wait-ms", "200", "--pd", cluster.pd_address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = _LineReader(proc)
    try:
        # The follower is waiting once a long-poll FETCH is outstanding; records appended
        # before it started are skipped (--from latest), so produce only after it is up.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            _produce_stdin(sbp, stream, "probe\n")
            if out.read_until(bool, timeout=0.5):
                break
        _produce_stdin(sbp, stream, "new 1\nnew 2\n")
        assert sbp("ranges", "seal", str(stream))[0] == 0
        _produce_stdin(sbp, stream, "after seal\n")
        lines = out.read_until(lambda got: any(g.endswith("after seal") for g in got),
                               timeout=30)
        values = [line.split("\t", 1)[1] for line in lines]
        assert values[-3:] == ["new 1", "new 2", "after seal"], lines
        offsets = [int(line.split("\t", 1)[0]) for line in lines]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    finally:
        status, stderr = _interrupt(proc)
    assert status == 130 and "Traceback" not in stderr


def test_produce_sends_lines_from_a_live_pipe_as_they_come(sbp, cluster):
    # `tail -f app.log | sbp produce 7`: the input stays open; what arrived must not wait for
    # a megabyte more of it, or for its end, before it is appended.
    from sbp_spark.client import SbpClient

    (stream,) = _create(sbp)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbp_spark.cli", "produce", str(stream), "--pd",
         cluster.pd_address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    reader = SbpClient(cluster.pd_address)
    try:
        for line in (b"first", b"second"):
            proc.stdin.write(line + b"\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc.poll() is None:
                if sbp("tail", str(stream), "--from", "-1")[1] == line.decode() + "\n":
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"{line!r} was not produced while the input stayed open")
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        assert "produced 2 records" in proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
    assert sum(b.header.record_count for b in reader.read(stream)) == 2


# -- progress ------------------------------------------------------------------------------------


def test_progress_line_shows_a_bar_only_with_a_known_total():
    out = io.StringIO()
    progress = Progress(total_bytes=2_000_000, out=out, enabled=True)
    line = progress.render(1_000_000, 1234, elapsed=2.0)
    assert line.startswith("[" + "#" * 12 + "-" * 12 + "]  50%")
    assert "1,234 records" in line and "0.5 MB/s" in line
    assert Progress(out=out, enabled=True).render(3_000_000, 5, 1.0).startswith("3.0 MB")


def test_progress_is_silent_off_a_terminal():
    out = io.StringIO()  # not a TTY
    progress = Progress(total_bytes=10, out=out)
    progress.started -= 10  # long past the delay before the first draw
    progress.update(5, 1)
    progress.close()
    assert out.getvalue() == ""


# -- demo ----------------------------------------------------------------------------------------


def test_demo_without_java_says_how_to_install_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # no java here
    proc = subprocess.run([sys.executable, "-m", "sbp_spark.cli", "demo"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "Java 17" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_demo_cleans_up_when_a_step_fails(monkeypatch):
    import re
    import socket

    from sbp_spark.commands import demo

    def broken_spark(workdir):
        raise demo.DemoError("Spark refused to start")

    monkeypatch.setattr(demo, "_quiet_spark", broken_spark)
    out = io.StringIO()
    with pytest.raises(demo.DemoError, match="refused"):
        demo.run_demo(rows=10, out=out)
    text = out.getvalue()
    workdir = Path(re.search(r"range servers\) in (\S+) \.\.\.", text).group(1))
    host, port = re.search(r"PD at (\S+):(\d+);", text).groups()
    assert not workdir.exists()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


@pytest.mark.slow
@pytest.mark.spark
def test_demo_runs_end_to_end(tmp_path):
    data_dir = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "sbp_spark.cli", "demo", "--rows", "20000",
                           "--data-dir", str(data_dir)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "OK: every count and offset matched." in out
    assert "20,000 rows in" in out and "exactly the 1,000 new rows" in out
    assert "MB/s" in out and "rows/s" in out
    assert "Traceback" not in proc.stderr and " INFO " not in proc.stderr
    # --data-dir is kept: the streaming output is there.
    assert any(Path(data_dir, "stream-output").glob("*.parquet"))


def test_parser_builds_without_spark():
    # Building the parser (every `sbp` start) must not import pyspark: it costs seconds.
    code = ("import sys; from sbp_spark.cli import build_parser; build_parser(); "
            "sys.exit('pyspark' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    assert build_parser().prog == "sbp"


def test_servers_listening_on_every_interface_must_be_told_what_to_advertise(capsys, tmp_path):
    def usage_error(argv: list[str]) -> str:
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own checks
            status = exc.code
        assert status == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    data = str(tmp_path / "data")
    # Refused before anything listens: 0.0.0.0 is no address a client can connect to.
    err = usage_error(["server", "--data-dir", data, "--host", "0.0.0.0", "--port", "0"])
    assert "sbp server: error:" in err and "listening on '0.0.0.0' (every interface)" in err
    assert "--advertise-host" in err and "--advertise-addr" not in err  # not an option here
    for argv in (["pd", "--data-dir", data], ["range-server", "--pd", "127.0.0.1:1",
                                                "--data-dir", data]):
        err = usage_error([*argv, "--host", "0.0.0.0", "--port", "0"])
        assert "(every interface) gives clients no address" in err, err
        err = usage_error([*argv, "--advertise-addr", "h:1", "--advertise-host", "h"])
        assert "not allowed with argument --advertise-addr" in err, err
    err = usage_error(["server", "--data-dir", data, "--pd-nodes", "1",
                       "--advertise-host", "h"])
    assert "--advertise-host is not passed on to the processes --pd-nodes starts" in err
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_cluster_without_range_servers_fails_the_health_check(capsys, tmp_path):
    with EmbeddedCluster(tmp_path / "empty", range_servers=0) as empty:
        status = main(["cluster", "--pd", empty.pd_address])
        out, err = capsys.readouterr()
        assert status == 1
        assert "none has registered" in out
        assert "no range server has registered with the PD" in err
        # The PD alone is healthy: --pd-only checks only that.
        assert main(["cluster", "--pd-only", "--pd", empty.pd_address]) == 0


def test_cluster_health_check_fails_while_no_pd_node_leads(capsys, cluster, monkeypatch):
    # What a PD cluster answers while it elects a leader (or cannot reach etcd): members,
    # none of them leading. Nothing can be created or planned then, so the check fails.
    import sbp_spark.commands.health as command

    gather = command.gather

    def electing(client, **kwargs):
        facts = gather(client, **kwargs)
        facts["members"] = [{**m, "leader": False} for m in facts["members"]]
        return facts

    monkeypatch.setattr(command, "gather", electing)
    for argv in (["cluster", "--pd-only"], ["cluster"]):
        status = main([*argv, "--pd", cluster.pd_address])
        out, err = capsys.readouterr()
        assert status == 1, argv
        assert "no leader elected right now" in out
        assert "no PD node leads right now" in err


def test_produce_with_stdin_closed_says_so(sbp, monkeypatch):
    # `sbp produce 1 <&-` (or a service started without stdin): Python has no sys.stdin.
    (stream,) = _create(sbp)
    monkeypatch.setattr(sys, "stdin", None)
    status, _, err = sbp("produce", str(stream))
    _assert_one_line_error(status, err, "produce", "stdin is closed")
    # Files are still read with no stdin at all.
    status, _, err = sbp("produce", str(stream), os.devnull)
    assert status == 0, err


def test_files_and_stream_ids_may_follow_options(sbp, tmp_path):
    # argparse took FILE/STREAM_ID positionals only before the first option: those after
    # it were refused as "unrecognized arguments" (and --whole-files FILE never worked).
    stream, other = _create(sbp, 2)
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_bytes(b"a\nb\n")
    two.write_bytes(b"c\n")
    status, out, err = sbp("produce", str(stream), "--whole-files", str(one), str(two))
    assert status == 0 and "offsets 0 .. 1" in out, err
    status, out, err = sbp("produce", str(stream), str(one), "--key", "k", str(two))
    assert status == 0 and "offsets 2 .. 4" in out, err
    status, out, err = sbp("streams", "describe", str(stream), "--json", str(other))
    assert status == 0, err
    assert [json.loads(line)["stream_id"] for line in out.splitlines()] == [stream, other]
    status, out, err = sbp("ranges", "list", str(stream), "--json", str(other))
    assert status == 0 and len(out.splitlines()) == 2, err
    # What is not a positional is still refused, as before.
    for argv in (["produce", str(stream), "--key", "k", "--bogus"],
                 ["streams", "describe", str(stream), "--json", "x/y"],
                 ["streams", "trim", str(stream), "--pd", "127.0.0.1:1", "3", "4"]):
        with pytest.raises(SystemExit) as exit_info:
            sbp(*argv)
        assert exit_info.value.code == 2


def test_tail_follow_waits_out_a_range_server_restart(tmp_path):
    # A rolling restart ended `sbp tail -f` with "cannot connect to ...".
    with EmbeddedCluster(tmp_path, range_servers=1, heartbeat_interval_s=0.2) as cluster:
        pd = cluster.pd_address

        def produce(text: str) -> None:
            old = sys.stdin
            sys.stdin = io.TextIOWrapper(io.BytesIO(text.encode()))
            try:
                assert main(["produce", "1", "--pd", pd]) == 0
            finally:
                sys.stdin = old

        assert main(["streams", "create", "--pd", pd]) == 0
        produce("before\n")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sbp_spark.cli", "tail", "1", "-f", "--wait-ms", "200",
             "--pd", pd], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = _LineReader(proc), _LineReader(proc)
        err.fd = proc.stderr.fileno()
        try:
            assert out.read_until(lambda got: "before" in got, timeout=30) == ["before"]
            cluster.stop_range_server(0)
            said = err.read_until(lambda got: any("waiting for stream 1" in g for g in got),
                                  timeout=30)
            assert any("waiting for stream 1" in g for g in said), said
            cluster.start_range_server(0)
            produce("after\n")
            assert out.read_until(lambda got: "after" in got, timeout=30) == ["after"]
            said = err.read_until(lambda got: any("readable again" in g for g in got),
                                  timeout=30)
            assert said == ["sbp tail: stream 1 is readable again"], said
        finally:
            status, stderr = _interrupt(proc)
    assert status == 130 and "Traceback" not in stderr, stderr


def test_cluster_does_not_count_a_down_server_that_holds_no_range(capsys, tmp_path):
    # A range server taken out of service stays known to the PD (there is no command to
    # forget one): while it holds no range it must not fail the health check forever.
    with EmbeddedCluster(tmp_path / "c", range_servers=2) as two:
        pd = ["--pd", two.pd_address]
        retired, kept = two.server_id(1), two.server_id(0)
        two.stop_range_server(1)
        assert main(["cluster", *pd]) == 0
        out, err = capsys.readouterr()
        assert f"{retired} at " in err and "down but holding no range" in err
        # A stream placed on the server that is left, then that one stopped too: it holds a
        # range, so the check fails (and the idle one is still named as not counted).
        assert main(["streams", "create", "--replicas", "1", *pd]) == 0
        capsys.readouterr()
        two.stop_range_server(0)
        assert main(["cluster", *pd]) == 1
        out, err = capsys.readouterr()
        assert f"{retired} at " in err and f"{kept} at " not in err
        # The one-server check names the server it was asked about, whatever it holds.
        address = next(line.split()[1] for line in out.splitlines()
                       if line.split()[:1] == [str(retired)])
        assert main(["cluster", "--range-server", address, *pd]) == 1


def test_pd_may_come_before_the_command(sbp, cluster, capsys):
    # As etcdctl and kubectl take their endpoints: argparse took the address for the command's
    # name ("invalid choice: '127.0.0.1:...'").
    [stream] = _create(sbp)
    pd = cluster.pd_address
    for argv in (["--pd", pd, "streams", "list"], ["streams", "--pd", pd, "list"],
                 ["--log-level", "warning", f"--pd={pd}", "ranges", "list", str(stream)]):
        assert main(argv) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith(("STREAM", "RANGE")), argv
    # A command that takes no --pd still refuses it, naming it.
    with pytest.raises(SystemExit) as exit_info:
        main(["--pd", pd, "demo"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --pd" in capsys.readouterr().err


# -- streams by name -----------------------------------------------------------------------------


def test_every_command_takes_a_stream_name(sbp, tmp_path):
    status, out, err = sbp("streams", "create", "--name", "cli-orders", "--name", "cli-clicks")
    assert status == 0, err
    orders, clicks = (int(line) for line in out.split())

    _, out, _ = sbp("streams", "list")
    header, *rows = out.splitlines()
    assert header.split()[:2] == ["STREAM", "NAME"]
    assert [str(orders), "cli-orders"] in [row.split()[:2] for row in rows]
    _, out, _ = sbp("streams", "describe", "cli-clicks", str(orders), "--json")
    assert [(f["stream_id"], f["name"]) for f in map(json.loads, out.splitlines())] == [
        (clicks, "cli-clicks"), (orders, "cli-orders")]

    source = tmp_path / "lines.txt"
    source.write_text("".join(f"line {i}\n" for i in range(6)))
    status, out, _ = sbp("produce", "cli-orders", str(source))
    assert status == 0
    assert out.strip() == "produced 6 records to stream 'cli-orders', offsets 0 .. 5"
    assert sbp("tail", "cli-orders", "--from", "4")[1].splitlines() == ["line 4", "line 5"]
    assert "retention_ms" in sbp("streams", "update", "cli-orders", "--retention-ms", "60000",
                                 "--json")[1]
    status, out, _ = sbp("ranges", "seal", "cli-orders")
    assert status == 0 and "sealed range 0 of stream 'cli-orders' at offset 6" in out
    _, out, _ = sbp("ranges", "list", "cli-orders", "--json")
    assert [(r["stream_id"], r["range_index"]) for r in map(json.loads, out.splitlines())] == [
        (orders, 0), (orders, 1)]
    status, out, _ = sbp("streams", "trim", "cli-orders", "2")
    assert status == 0 and "stream 'cli-orders' now starts at offset 2" in out

    status, out, err = sbp("streams", "delete", "cli-orders", "cli-nothing", str(clicks))
    assert out.splitlines() == [f"deleted stream {orders} (cli-orders)",
                                f"deleted stream {clicks}"]
    _assert_one_line_error(status, err, "streams delete", "cli-nothing", "no stream is named")
    # A deleted name is gone for every command (produce reads no input before it says so).
    for command, extra in ((["streams", "describe"], []), (["ranges", "list"], []),
                           (["tail"], []), (["produce"], [str(source)]),
                           (["ranges", "seal"], []), (["streams", "trim"], ["0"]),
                           (["streams", "update"], ["--replicas", "1"])):
        status, _, err = sbp(*command, "cli-orders", *extra)
        _assert_one_line_error(status, err, " ".join(command), "cli-orders")


def test_names_are_checked_before_anything_is_asked(capsys):
    for argv, words in ((["streams", "create", "--name", "123"], "digits only"),
                        (["streams", "create", "--name", "a/b"], "not a valid stream name"),
                        (["streams", "create", "--name", "x", "--name", "x"], "given twice"),
                        (["streams", "create", "--name", "x", "--count", "2"], "differs"),
                        (["tail", "a b"], "neither a stream id")):
        try:
            status = main([*argv, "--pd", "127.0.0.1:1"])
        except SystemExit as exit_info:
            status = exit_info.code
        assert status == 2, argv
        assert words in capsys.readouterr().err, argv


def test_a_taken_name_is_one_error_line(sbp):
    assert sbp("streams", "create", "--name", "cli-taken")[0] == 0
    status, _, err = sbp("streams", "create", "--name", "cli-taken")
    _assert_one_line_error(status, err, "streams create", "'cli-taken' is taken")
