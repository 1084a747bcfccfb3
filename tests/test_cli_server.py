"""The server commands of ``sbp``: `sbp server`, `sbp pd`, `sbp range-server`, `sbp streams
create`, run as real processes, and what users see when they get an argument wrong."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sbp_spark.cli import build_parser, main
from sbp_spark.server.cluster import Placement, ProcessCluster, accepts_connections
from tests.etcd import require_etcd
from tests.polling import wait_until as poll

SBP = [sys.executable, "-m", "sbp_spark.cli"]




def run_sbp(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*SBP, *args], capture_output=True, text=True, timeout=timeout)


def start_sbp_server(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, dict, Path]:
    """``sbp server ARGS`` as a child process: it, its ready file's content and its log."""
    ready = tmp_path / "ready.json"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*SBP, "server", "--data-dir", str(tmp_path / "data"), *args, "--port", "0",
             "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT)
    try:
        poll(lambda: ready.exists() or proc.poll() is not None, what="the ready file",
             timeout=90)
        assert proc.poll() is None, log_path.read_text()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, json.loads(ready.read_text()), log_path


def test_sbp_server_ready_file_streams_create_and_sigterm(tmp_path):
    proc, info, log_path = start_sbp_server(tmp_path, "--range-servers", "2")
    try:
        assert set(info) == {"pd", "range_servers"} and len(info["range_servers"]) == 2
        assert accepts_connections(info["pd"])
        assert all(accepts_connections(a) for a in info["range_servers"])

        created = run_sbp("streams", "create", "--pd", info["pd"], "--count", "3",
                          "--replicas", "2", "--retention-ms", "60000")
        assert created.returncode == 0, created.stderr
        ids = created.stdout.split()
        assert len(ids) == 3 and len(set(ids)) == 3 and all(i.isdigit() for i in ids)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A ready file left behind would tell the next script waiting for it that it serves.
    assert not (tmp_path / "ready.json").exists()
    text = log_path.read_text()
    assert f"PD serving clients at {info['pd']}" in text
    assert "SIGTERM received" in text and "Traceback" not in text
    assert not accepts_connections(info["pd"])


def test_sbp_server_with_pd_nodes_runs_etcd_and_a_pd_cluster(tmp_path):
    require_etcd()
    proc, info, log_path = start_sbp_server(tmp_path, "--pd-nodes", "3", "--range-servers", "1")
    try:
        assert set(info) == {"pd", "range_servers", "pd_nodes", "etcd"}
        nodes = info["pd_nodes"]
        assert [n["name"] for n in nodes] == ["pd-0", "pd-1", "pd-2"]
        assert info["pd"] == ",".join(n["address"] for n in nodes)
        assert len(info["etcd"]) == 1 and len(info["range_servers"]) == 1
        shown = run_sbp("cluster", "--json", "--pd", info["pd"])
        assert shown.returncode == 0, shown.stderr
        facts = json.loads(shown.stdout)
        assert len([m for m in facts["members"] if m["leader"]]) == 1
        assert {m["address"] for m in facts["members"]} == set(info["pd"].split(","))
        assert [s["live"] for s in facts["range_servers"]] == [True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log_path.read_text()
    for pid in [n["pid"] for n in nodes]:  # every child is gone
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_sbp_pd_and_range_server_processes(tmp_path):
    with ProcessCluster(tmp_path, range_servers=1) as cluster:
        assert cluster.pd.info == {"pd": cluster.pd_address}
        rs = cluster.range_servers[0]
        assert rs is not None and rs.info["server_id"] >= 1
        created = run_sbp("streams", "create", "--pd", cluster.pd_address)
        assert created.returncode == 0, created.stderr
        assert created.stdout.strip().isdigit()
        # The range server's health check (docker-compose.yml runs it): the PD sees it live
        # and it answers a PING.
        address = rs.info["range_server"]
        healthy = run_sbp("cluster", "--pd", cluster.pd_address, "--range-server", address)
        assert healthy.returncode == 0, healthy.stderr
        assert address in healthy.stdout and "up, ping" in healthy.stdout
        # SIGINT stops as gracefully as SIGTERM.
        rs.proc.send_signal(signal.SIGINT)
        assert rs.wait() == 0
        cluster.range_servers[0] = None
        down = run_sbp("cluster", "--pd", cluster.pd_address, "--range-server", address)
        assert down.returncode == 1 and "DOWN" in down.stdout, down.stdout + down.stderr
    assert "SIGINT received" in (tmp_path / "rs-0.log").read_text()


def test_process_cluster_places_roles_on_their_own_hosts(tmp_path):
    # Every 127.x.y.z address is this machine's loopback: three "hosts" without root. The
    # prefix runs each server through `env`, which execs it in place (as `ip netns exec`
    # does), with a variable that shows where it ran.
    def placed(host: str, name: str) -> Placement:
        return Placement(host, ("env", f"SBP_TEST_PLACED={name}"))

    placements = {"pd": placed("127.0.0.2", "pd"), "rs-1": placed("127.0.0.3", "rs-1")}
    with ProcessCluster(tmp_path, range_servers=2, placements=placements) as cluster:
        assert cluster.pd_address.startswith("127.0.0.2:")
        addresses = cluster.range_server_addresses
        assert addresses[0].startswith("127.0.0.1:") and addresses[1].startswith("127.0.0.3:")
        for role, proc in (("pd", cluster.pd), ("rs-1", cluster.range_servers[1])):
            assert proc is not None
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert f"SBP_TEST_PLACED={role}".encode() in environ
        # A restart keeps the placement (and the PD's address).
        cluster.kill_range_server(1)
        cluster.start_range_server(1)
        assert cluster.range_server_addresses[1].startswith("127.0.0.3:")
    with pytest.raises(ValueError, match=r"roles this cluster does not have: \['rs-2'\]"):
        ProcessCluster(tmp_path, range_servers=2, placements={"rs-2": Placement()})


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    return lines[-1]


@pytest.mark.parametrize("argv, status, expected", [
    (["streams", "create", "--pd", "nohost"], 2, "not of the form host:port"),
    (["streams", "create", "--pd", "127.0.0.1:2378", "--replicas", "0"], 2,
     "0 must be between 1 and 127"),
    (["streams", "create", "--pd", "127.0.0.1:2378", "--retention-ms", "0"], 2,
     "0 must be >= 1 or -1"),
    (["streams", "create", "--pd", "127.0.0.1:2378", "--count", "x"], 2, "'x' is not an integer"),
    (["server", "--data-dir", "d", "--port", "70000"], 2, "70000 must be between 0 and 65535"),
    (["server", "--data-dir", "d", "--range-servers", "0"], 2, "0 must be >= 1"),
    (["range-server", "--data-dir", "d", "--pd", "x"], 2, "not of the form host:port"),
    (["range-server", "--data-dir", "d"], 2, "the following arguments are required: --pd"),
    (["cluster", "--range-server", "rs1"], 2, "not of the form host:port"),
    (["cluster", "--range-server", "127.0.0.1:1", "--pd-only"], 2, "not allowed with"),
    (["pd"], 2, "--data-dir"),
    # Numbers the wire cannot carry (a signed 64-bit integer) are usage errors too.
    (["streams", "describe", "1", "9223372036854775808"], 2, "9223372036854775807"),
    (["streams", "trim", "1", "9223372036854775808"], 2, "at most 9223372036854775807"),
    (["streams", "update", "1", "--retention-ms", "9223372036854775808"], 2,
     "9223372036854775807"),
    (["streams", "create", "--retention-ms", "9223372036854775808"], 2,
     "9223372036854775807"),
])
def test_usage_errors(capsys, monkeypatch, argv, status, expected):
    monkeypatch.delenv("SBP_PD", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == status
    assert expected in one_error_line(capsys)


def test_range_server_takes_the_pd_from_the_environment(monkeypatch):
    # docker-compose.yml names the PD address list once, in $SBP_PD, for every service.
    monkeypatch.setenv("SBP_PD", "pd1:2378,pd2:2378")
    args = build_parser().parse_args(["range-server", "--data-dir", "d"])
    assert args.pd == "pd1:2378,pd2:2378"
    assert build_parser().parse_args(["range-server", "--data-dir", "d", "--pd",
                                      "pd:1"]).pd == "pd:1"


@pytest.mark.parametrize("command", ["server", "pd", "range-server --pd 127.0.0.1:1"])
def test_an_empty_data_dir_is_refused(tmp_path, capsys, monkeypatch, command):
    # `--data-dir "$DATA"` with DATA unset kept the data in the working directory.
    monkeypatch.chdir(tmp_path)
    assert main([*command.split(), "--data-dir", "", "--port", "0"]) == 2
    assert "--data-dir is empty" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_data_dir_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    assert main(["server", "--data-dir", str(path), "--port", "0"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("sbp server: error: --data-dir") and "not a directory" in line


def test_port_in_use(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["pd", "--data-dir", str(tmp_path), "--port", str(port)]) == 1
    line = one_error_line(capsys)
    assert line.startswith("sbp pd: error:") and "in use" in line
    # Which address: `sbp server` listens on several ports, and --host may be a name.
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_a_host_to_listen_on_that_is_not_here_is_named(tmp_path, capsys):
    for host, why in (("nosuchhost.invalid", ""), ("192.0.2.1", "not an address of this")):
        assert main(["server", "--data-dir", str(tmp_path), "--port", "0", "--host", host]) == 1
        line = one_error_line(capsys)
        assert f"cannot listen on {host}:" in line and why in line, line


def test_unreachable_pd(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    assert main(["streams", "create", "--pd", f"127.0.0.1:{port}"]) == 1
    line = one_error_line(capsys)
    assert line.startswith("sbp streams create: error:") and f"127.0.0.1:{port}" in line


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err
    assert main(["streams"]) == 2
    assert "create" in capsys.readouterr().err


def test_ready_file_is_written_atomically(tmp_path):
    from sbp_spark.server.cluster import write_ready_file

    target = tmp_path / "r.json"
    write_ready_file(target, {"pd": "127.0.0.1:1"})
    assert json.loads(target.read_text()) == {"pd": "127.0.0.1:1"}
    assert [p.name for p in Path(tmp_path).iterdir()] == ["r.json"]
    assert os.access(target, os.R_OK)


def test_pd_nodes_refuses_the_options_it_cannot_pass_on(tmp_path, capsys, monkeypatch):
    # The range server processes get only --fsync: a changed interval would be dropped.
    def start(self):
        raise AssertionError("the cluster was started despite an option it ignores")

    monkeypatch.setattr(ProcessCluster, "start", start)
    for option in (["--fsync-interval-ms", "50"], ["--page-cache-mib", "1"],
                   ["--metrics-port", "0"]):
        assert main(["server", "--data-dir", str(tmp_path), "--pd-nodes", "2", "--port", "0",
                     *option]) == 2
        line = one_error_line(capsys)
        assert line.startswith("sbp server: error: " + option[0]), line



@pytest.mark.parametrize("command", ["pd", "server", "range-server --pd pd:1"])
def test_ready_file_where_none_can_be_written_is_a_usage_error(tmp_path, capsys, command):
    # Written only once serving (a range server: once registered with its PD), so it was
    # found out after the servers started, and made them stop again.
    for ready, expected in ((tmp_path / "missing" / "r.json", "does not exist"),
                            (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args([*command.split(), "--data-dir", str(tmp_path / "data"),
                                       "--ready-file", str(ready)])
        assert exit_info.value.code == 2
        line = one_error_line(capsys)
        assert "--ready-file" in line and expected in line, line
    args = build_parser().parse_args([*command.split(), "--data-dir", str(tmp_path / "data"),
                                      "--ready-file", str(tmp_path / "r.json")])
    assert args.ready_file == tmp_path / "r.json"


def test_a_data_dir_in_use_is_refused_and_freed_on_stop(tmp_path):
    # A second server on a running one's data directory recovered (and truncated) the same
    # segment files and took over its server id; it must refuse, and touch nothing.
    proc, info, _ = start_sbp_server(tmp_path)
    data = tmp_path / "data"
    try:
        created = run_sbp("streams", "create", "--pd", info["pd"])
        assert created.returncode == 0, created.stderr
        for argv, where in ((["server", "--data-dir", str(data)], data / "pd"),
                            (["pd", "--data-dir", str(data / "pd")], data / "pd"),
                            (["range-server", "--pd", info["pd"], "--data-dir",
                              str(data / "rs-0")], data / "rs-0")):
            second = run_sbp(*argv, "--port", "0", timeout=30)
            assert second.returncode == 1, second.stderr
            assert "Traceback" not in second.stderr
            assert f"data directory {where} is in use by process {proc.pid}" in second.stderr
        # The running cluster still serves, and still knows its stream.
        listed = run_sbp("streams", "list", "--pd", info["pd"])
        assert listed.returncode == 0 and created.stdout.split()[0] in listed.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Stopped: the directory is free again, and the data is still there.
    proc, info, _ = start_sbp_server(tmp_path)
    try:
        listed = run_sbp("streams", "list", "--pd", info["pd"])
        assert listed.returncode == 0 and created.stdout.split()[0] in listed.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_a_corrupt_pd_database_is_named_and_left_alone(tmp_path, capsys):
    # A torn copy or a stray file where the PD keeps its metadata: a traceback before.
    db = tmp_path / "pd" / "pd.sqlite"
    db.parent.mkdir()
    db.write_bytes(b"not a database\n" * 100)
    assert main(["server", "--data-dir", str(tmp_path), "--port", "0"]) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"sbp server: error: {db} is not a readable PD metadata database")
    assert "backup" in line
    assert db.read_bytes() == b"not a database\n" * 100


@pytest.mark.parametrize("command", ["server", "pd", "range-server --pd 127.0.0.1:1"])
def test_unusable_server_tls_files_name_the_file_at_fault(tmp_path, capsys, certs, command):
    # OpenSSL says "PEM lib" for all of these; the operator must learn which file is wrong.
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\n")
    for files, expected in (
            ([certs.cert, certs.rogue_key], f"the key file {certs.rogue_key!r} is not the "
                                            f"private key of the certificate {certs.cert!r}"),
            ([certs.key, certs.cert], f"the certificate file {certs.key!r} holds no PEM "
                                      "certificate"),
            ([certs.cert, certs.cert], f"the key file {certs.cert!r} holds no PEM private key"),
            ([certs.cert, certs.key, str(junk)], f"the CA file {str(junk)!r} holds no PEM")):
        tls = ["--tls-cert", files[0], "--tls-key", files[1]] + (
            ["--tls-ca", files[2]] if len(files) > 2 else [])
        assert main([*command.split(), "--data-dir", str(tmp_path / "d"), "--port", "0",
                     *tls]) == 2
        line = one_error_line(capsys)
        assert line.startswith(f"sbp {command.split()[0]}: error: TLS files cannot be used: "
                               f"{expected}"), line


def test_fewer_range_servers_than_the_data_dir_holds_is_refused(tmp_path, capsys):
    # Restarted with a smaller --range-servers, the cluster came up without the others: their
    # streams answered "cannot connect" to every read and write, with nothing said at start.
    for i in range(3):
        (tmp_path / f"rs-{i}").mkdir()
        (tmp_path / f"rs-{i}" / "server.json").write_text(f'{{"server_id": {i + 1}}}')
    assert main(["server", "--data-dir", str(tmp_path), "--range-servers", "1",
                 "--port", "0"]) == 2
    line = one_error_line(capsys)
    assert "range servers rs-1, rs-2" in line and "--range-servers 3" in line, line
    assert not (tmp_path / "pd").exists()  # nothing was started


def test_sbp_server_whose_pd_never_issued_its_range_servers_ids_says_so_once(tmp_path):
    # The PD's metadata lost (its directory removed) while the range servers' data stayed: the
    # refusal was logged as an error line and then printed again as the command's error.
    proc, _, _ = start_sbp_server(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    shutil.rmtree(tmp_path / "data" / "pd")
    ran = run_sbp("server", "--data-dir", str(tmp_path / "data"), "--port", "0", timeout=60)
    assert ran.returncode == 1, ran.stderr
    error = ran.stderr.strip().splitlines()[-1]
    assert error.startswith("sbp server: error: range server data directory "), ran.stderr
    assert "empty --data-dir" in error and ran.stderr.count("empty --data-dir") == 1, \
        ran.stderr


def test_a_range_server_on_another_clusters_data_dir_exits_at_once(tmp_path):
    # The data directory of cluster a's range server, given to cluster b's PD: that PD never
    # issued its id. The server used to log the refusal and run on without a ready file, so
    # a script waiting for that file waited forever.
    with ProcessCluster(tmp_path / "a", range_servers=1):
        pass
    data_dir = tmp_path / "a" / "rs-0"
    server_id = json.loads((data_dir / "server.json").read_text())["server_id"]
    ready = tmp_path / "rs.ready"
    with ProcessCluster(tmp_path / "b", range_servers=0) as other:
        ran = run_sbp("range-server", "--pd", other.pd_address, "--data-dir", str(data_dir),
                      "--port", "0", "--ready-file", str(ready), timeout=30)
        shown = run_sbp("cluster", "--json", "--pd", other.pd_address)
    assert ran.returncode == 1, ran.stderr
    error = ran.stderr.strip().splitlines()[-1]
    assert error.startswith("sbp range-server: error: ")
    assert f"data directory {data_dir} holds server id {server_id}" in error
    assert "never issued" in error and "empty --data-dir" in error and "point --pd" in error
    # Said once, as the command's error: it was logged as an error line first, the same text.
    assert ran.stderr.count("never issued") == 1, ran.stderr
    assert "Traceback" not in ran.stderr
    assert not ready.exists()
    assert json.loads(shown.stdout)["range_servers"] == []
