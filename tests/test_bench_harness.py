"""Smoke tests of `sbp bench` (sbp_spark.bench): its table, JSON and chart on tiny sizes.

Nothing here checks a speed: the figures of a tiny run mean nothing. The tests check that a run
produces a well-formed table and JSON, says why a figure is missing, and fails on bad options.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from sbp_spark.bench import harness, main
from sbp_spark.bench.client import storage_durability
from sbp_spark.bench.loopback import NO_FSYNC, LoopbackClient, LoopbackServer
from sbp_spark.bench.procmem import PeakSampler, hwm_kib, reset_peak, rss_kib, status_kib
from sbp_spark.bench.report import (
    AT_LEAST,
    AT_LEAST_RATIO,
    AT_MOST,
    AT_MOST_RATIO,
    Figure,
    Target,
    format_table,
    to_json,
)
from sbp_spark.bench.spark_batch import IDEMPOTENCE_PAIRS
from sbp_spark.bench.timing import percentile


def _figures() -> list[Figure]:
    return [
        Figure("client", "FETCH", "MB/s", 600.0, 1000.0, "loopback", Target(AT_LEAST_RATIO, 0.5)),
        Figure("client", "APPEND", "MB/s", 300.0, 1000.0, "loopback", Target(AT_LEAST_RATIO, 0.35)),
        Figure("codec", "headers", "/s", 12_000.0, target=Target(AT_LEAST, 10_000)),
        Figure("streaming", "p99", "s", 2.5, target=Target(AT_MOST, 2.0)),
        Figure("spark batch", "parquet", "MB/s", 150.0, 300.0, "Arrow ceiling"),
        Figure("streaming", "p50", "s", target=Target(AT_MOST, 1.0),
               note="error: RuntimeError: no record reached the sink"),
    ]


def test_targets_compare_ratio_or_value():
    fetch, append, headers, p99, parquet, missing = _figures()
    assert fetch.ratio == pytest.approx(0.6) and fetch.passed is True
    assert append.passed is False  # 0.30x of the ceiling, 0.35x wanted
    assert headers.passed is True
    assert p99.passed is False
    assert parquet.ratio == pytest.approx(0.5) and parquet.passed is None
    assert missing.passed is None and missing.ratio is None
    at_most = Target(AT_MOST_RATIO, 1.0)
    assert at_most.describe("us") == "<= 1x" and Target(AT_LEAST_RATIO, 0.7).describe("") == (
        ">= 0.7x")
    assert Figure("s", "cpu", "us", 90.0, 100.0, target=at_most).passed is True
    assert Figure("s", "cpu", "us", 110.0, 100.0, target=at_most).passed is False


def test_table_has_one_row_per_figure_with_verdicts():
    table = format_table(_figures())
    lines = table.splitlines()
    assert lines[0].split("|")[1].strip() == "figure"
    assert len(lines) == 2 + len(_figures())
    assert "| 0.60x" in lines[2] and "pass" in lines[2]
    assert "FAIL" in lines[3]
    assert "1,000 MB/s (loopback)" in lines[2]
    assert "error: RuntimeError: no record reached the sink" in lines[-1]
    assert len({len(line) for line in lines}) == 1  # aligned columns


def test_json_keeps_every_figure_and_the_meta():
    doc = json.loads(to_json(_figures(), {"quick": True, "machine": {"nproc": 2}}))
    assert doc["quick"] is True and doc["machine"]["nproc"] == 2
    assert [f["name"] for f in doc["figures"]] == [f.name for f in _figures()]
    fetch = doc["figures"][0]
    assert fetch["ratio"] == pytest.approx(0.6)
    assert fetch["target"] == {"kind": "ratio>=", "threshold": 0.5}
    assert fetch["status"] == "pass"
    assert doc["figures"][-1]["value"] is None
    assert doc["figures"][-1]["status"].startswith("error:")


def test_unknown_target_kind_is_refused():
    with pytest.raises(ValueError, match="target kind"):
        Target("~", 1)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_proc_memory_of_this_process():
    pid = os.getpid()
    assert rss_kib(pid) > 0 and hwm_kib(pid) >= rss_kib(pid) * 0.5
    reset_peak(pid)
    with PeakSampler([pid], interval_s=0.01) as sampler:
        block = bytearray(64 * 1024 * 1024)  # touched: counts in RSS
        block[::4096] = b"x" * len(block[::4096])
    assert sampler.max_mib() >= 64
    del block
    assert rss_kib(2**22 + 12345) is None  # no such process


def test_proc_status_fields_in_one_read():
    fields = status_kib(os.getpid(), ("VmRSS", "RssAnon", "Threads", "NoSuchField"))
    assert set(fields) == {"VmRSS", "RssAnon", "Threads"}
    assert fields["Threads"] >= 1 and 0 < fields["RssAnon"] <= fields["VmRSS"]
    assert status_kib(2**22 + 12345, ("VmRSS",)) == {}  # no such process


def test_bad_options_fail_with_a_message(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--sections", "codec,nonsense"])
    assert exc.value.code == 2
    assert "nonsense" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--rows", "0"])
    with pytest.raises(SystemExit):
        main(["--stream-seconds", "1"])
    assert "warm-up" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    with pytest.raises(SystemExit) as exc:
        main(["--sections", "codec", "--plot", str(tmp_path / "x.png")])
    assert "pip install matplotlib" in str(exc.value)


def test_codec_and_client_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--quick", "--sections", "codec,client", "--client-mib", "4", "--json", str(out)]
    code = main(argv)
    captured = capsys.readouterr()
    doc = json.loads(out.read_text())
    names = [(f["section"], f["name"]) for f in doc["figures"]]
    assert ("codec", "1 MiB frame encode+decode") in names
    assert any(s == "client" and n.startswith("FETCH 1 MiB") for s, n in names)
    for figure in doc["figures"]:
        # Every figure is either measured or says why not; none is silently empty.
        assert figure["value"] is not None or figure["status"].startswith("error:"), figure
    frame = next(f for f in doc["figures"] if f["name"] == "1 MiB frame encode+decode")
    assert frame["value"] > 0 and frame["ceiling"] > 0 and frame["ceiling_name"] == "zlib.crc32"
    fetch = next(f for f in doc["figures"] if f["name"].startswith("FETCH 1 MiB"))
    assert fetch["ceiling"] > 0
    storage = next(f for f in doc["figures"] if f["name"].endswith("next to the storage"))
    # The storage ceiling is durable the way the bench cluster (default policy) acknowledges.
    assert storage["ceiling_name"] == "file append, fsync every 10 ms"
    assert storage["ceiling"] > 0
    # Measured on both sides of every APPEND run; each round stands next to the faster.
    around = storage["extra"]["ceiling_before_after_s"]
    assert around and all(len(pair) == 2 and min(pair) > 0 for pair in around)
    assert storage["extra"]["ceiling_times_s"] == [min(pair) for pair in around]
    assert doc["machine"]["nproc"] == os.cpu_count()
    assert "| figure" in captured.out and "1 MiB frame encode+decode" in captured.out
    assert "codec: starting" in captured.err  # progress goes to stderr, one line per step
    assert code == (1 if any(f["status"].startswith("error") for f in doc["figures"]) else 0)


def test_planning_section_times_a_read_by_time_next_to_one_by_offsets(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--sections", "planning", "--planning-records", "200000",
                 "--planning-ranges", "20", "--json", str(out)]) == 0
    (figure,) = json.loads(out.read_text())["figures"]
    assert figure["name"] == "plan a read by time (200,000 records, 20 ranges)"
    assert figure["value"] > 0 and figure["ceiling_name"] == "planning by offsets"
    assert figure["extra"]["planned_records"] == 100_000 and figure["extra"]["batches"] == 200


def test_names_section_times_a_read_by_pattern_next_to_one_by_ids(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--sections", "names", "--pattern-streams", "150",
                 "--json", str(out)]) == 0
    (figure,) = json.loads(out.read_text())["figures"]
    assert figure["name"] == "plan a read of 150 streams by pattern"
    assert figure["value"] > 0 and figure["ceiling_name"] == "planning by ids"
    assert figure["ceiling"] > 0 and figure["extra"]["streams"] == 150


def test_client_bench_script_adds_the_per_batch_figures(tmp_path, capsys):
    from integration.bench import client_bench

    out = tmp_path / "client.json"
    code = client_bench.main(["--mib", "4", "--runs", "1", "--small-batches", "300",
                              "--json", str(out)])
    doc = json.loads(out.read_text())
    figures = {f["name"]: f for f in doc["figures"]}
    # The client section of sbp bench, run by the same code, then this script's own figures.
    assert figures["FETCH 1 MiB batches"]["ceiling_name"] == "loopback pull"
    for name in ("APPEND one 100 B record per batch", "FETCH one 100 B record per batch"):
        assert figures[name]["unit"] == "batches/s" and figures[name]["value"] > 0
        assert figures[name]["extra"]["batches"] == 300
    assert "one 100 B record per batch" in capsys.readouterr().out
    assert code == 0


@pytest.mark.skipif(not hasattr(os, "splice"), reason="os.splice needs Linux and Python >= 3.10")
def test_receive_paths_script_compares_every_path_with_the_copy(tmp_path, capsys):
    from integration.bench import receive_paths

    assert receive_paths.main(["--mib", "4", "--rounds", "1", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = {line.split()[0]: line for line in lines if line.endswith("x copy")}
    assert set(summary) == set(receive_paths.VARIANTS)
    assert summary["copy"].split()[-2] == "1.00x"
    assert list(tmp_path.iterdir()) == []  # every scratch file removed


def test_storage_ceiling_follows_the_cluster_fsync_policy(tmp_path):
    assert storage_durability(None) == (10, "file append, fsync every 10 ms")
    assert storage_durability("interval") == (10, "file append, fsync every 10 ms")
    assert storage_durability("always") == (0, "file append, fsync back to back")
    assert storage_durability("never") == (NO_FSYNC, "file append (page cache)")
    server = LoopbackServer(directory=str(tmp_path))
    try:
        with LoopbackClient(server.address) as client:
            for interval in (NO_FSYNC, 0, 5):
                assert client.file_append(8 << 20, interval) > 0
    finally:
        server.close()
    assert list(tmp_path.iterdir()) == []  # the scratch files are gone


def test_a_failing_section_becomes_an_error_row(tmp_path):
    def broken(ctx):
        raise RuntimeError("disk on fire")

    def fine(ctx):
        return [Figure("ok", "x", "MB/s", 1.0)]

    from sbp_spark.bench.context import BenchConfig, BenchContext
    from sbp_spark.bench.timing import Progress

    ctx = BenchContext(BenchConfig.quick_run(), tmp_path, Progress(open(os.devnull, "w")))
    figures = harness.run_sections(ctx, ["codec", "client"],
                                   runners={"codec": broken, "client": fine})
    ctx.close()
    assert figures[0].note == "error: RuntimeError: disk on fire"
    assert figures[1].value == 1.0


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from sbp_spark.bench.plot import plot

    path = tmp_path / "chart.png"
    plot(_figures(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.spark
def test_spark_and_streaming_sections_measure_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    code = main(["--quick", "--sections", "spark,streaming", "--rows", "20000", "--runs", "1",
                 "--stream-seconds", "3", "--json", str(out)])
    doc = json.loads(out.read_text())
    by_name = {f["name"]: f for f in doc["figures"]}
    assert code == 0, [f["status"] for f in doc["figures"]]
    for figure in doc["figures"]:
        assert figure["value"] is not None and figure["value"] > 0, figure
    read = next(f for n, f in by_name.items() if n.startswith("read sbp"))
    assert read["ceiling_name"] == "Arrow ceiling" and read["ceiling"] > 0
    write = next(f for n, f in by_name.items() if n.startswith("write sbp"))
    assert write["ceiling_name"] == "Arrow-writer ceiling" and write["ceiling"] > 0
    # Every sbp write, the warm-ups too, keeps the server CPU it cost: the record that shows
    # whether the timed writes were warm.
    extra = write["extra"]
    assert extra["warmups"] == 1 and len(extra["ceiling_times_s"]) == 1
    # The idempotence figure's pairs of sbp writes: more than the one timed round.
    assert len(extra["times_s"]) == IDEMPOTENCE_PAIRS
    assert len(extra["server_cpu_s"]) == 1 + IDEMPOTENCE_PAIRS
    # Each measured (/proc counts in 10 ms ticks: a write this small may cost the server none).
    cpu = extra["server_cpu_s"]
    assert all(s is not None and s >= 0 for s in cpu) and sum(cpu) > 0, cpu
    paired = next(f for n, f in by_name.items() if n.startswith("write sbp, idempotent"))
    assert paired["ceiling_name"] == "sbp write, idempotentAppends=false"
    assert len(paired["extra"]["times_s"]) == len(paired["extra"]["ceiling_times_s"]) \
        == IDEMPOTENCE_PAIRS
    assert any(n.startswith("append-to-sink latency p99") for n in by_name)


def _tiny_context(tmp_path, **settings):
    from sbp_spark.bench.context import BenchConfig, BenchContext
    from sbp_spark.bench.timing import Progress

    config = BenchConfig.quick_run()
    for name, value in settings.items():
        setattr(config, name, value)
    return BenchContext(config, tmp_path, Progress(open(os.devnull, "w")))


def test_latency_section_times_every_policy_next_to_its_floor(tmp_path):
    from sbp_spark.bench import latency

    ctx = _tiny_context(tmp_path, latency_seconds=0.4, latency_rounds=2)
    try:
        figures = latency.run(ctx)
    finally:
        ctx.close()
    policies = [f.extra["policy"] for f in figures if f.extra["stat"] == "p50"]
    assert policies == ["group", "always", "interval", "never"]  # the default first
    for f in figures:
        assert f.value > 0, f
        if f.unit == "ms":
            assert f.ceiling > 0 and f.ceiling_name
    by_name = {f.name: f for f in figures}
    assert by_name["one writer, 1 KiB batches, fsync group: p50"].target is not None
    assert by_name["one writer, 1 KiB batches, fsync never: p50"].ceiling_name == (
        "1 KiB round trip, plain TCP")
    # Idempotent appends next to the same writer with them off, on the never round trip.
    cost = by_name["one writer, 1 KiB batches, fsync never, idempotent appends: p50"]
    assert cost.ceiling_name == "the same, idempotent appends off"
    assert cost.target is not None and cost.extra["plain_appends"] > 0
    # They take turns append by append: as many appends each.
    assert cost.extra["appends"] == cost.extra["plain_appends"]


def test_scaling_section_loads_the_default_policy_beside_interval(tmp_path):
    from sbp_spark.bench import scaling

    ctx = _tiny_context(tmp_path, scaling_seconds=0.3, scaling_streams=(1, 64), scaling_rounds=2)
    try:
        figures = scaling.append_figures(ctx)
    finally:
        ctx.close()
    assert [(f.unit, f.extra["streams"]) for f in figures] == [
        ("batches/s", 1), ("us", 1), ("batches/s", 64), ("us", 64)]
    for f in figures:
        assert f.value > 0 and f.ceiling > 0, f
        assert f.ceiling_name == "fsync interval, same load"
        # Two loads per policy (A B B A), each kept beside the figure they add up to.
        assert len(f.extra["rates"]) == 2 and len(f.extra["baseline_rates"]) == 2, f
        assert min(f.extra["rates"]) > 0
    rate = figures[2]
    assert min(rate.extra["rates"]) <= rate.value <= max(rate.extra["rates"])
    assert [f.target is not None for f in figures] == [False, False, True, True]


def test_append_load_keeps_one_append_in_flight_per_stream(tmp_path):
    from sbp_spark.bench.append_load import AppendLoad, cpu_seconds
    from sbp_spark.client import SbpClient
    from sbp_spark.protocol.records import batch_bytes
    from sbp_spark.server import EmbeddedCluster

    with EmbeddedCluster(tmp_path, fsync="never") as cluster:
        client = SbpClient(cluster.pd_address)
        streams = [s.stream_id for s in client.create_streams(3)]
        with AppendLoad(cluster.range_server_addresses[0], streams, batch_bytes(b"x" * 100),
                        connections=2) as load:
            result = load.run(0.3)
        assert result.acks > 3 and not result.errors
        # Every acknowledged append is in its stream, one batch each.
        assert sum(len(list(client.read(s))) for s in streams) == result.acks
    assert cpu_seconds(os.getpid()) > 0


def test_plot_draws_the_latency_and_scaling_panels(tmp_path):
    pytest.importorskip("matplotlib")
    from sbp_spark.bench.plot import plot

    figures = _figures()
    for policy in ("group", "never"):
        for stat, value in (("p50", 0.5), ("p99", 2.0)):
            figures.append(Figure("latency", f"{policy} {stat}", "ms", value, 0.2, "floor",
                                  extra={"policy": policy, "stat": stat}))
    for n in (1, 8, 64):
        figures.append(Figure("scaling", f"rate {n}, fsync group", "batches/s", 100.0 * n,
                              90.0 * n, "fsync interval", extra={"streams": n}))
        figures.append(Figure("scaling", f"cpu {n}", "us", 100.0, 110.0, "fsync interval",
                              extra={"streams": n}))
        figures.append(Figure("scaling", f"read {n}", "MB/s", 200.0 / n, 210.0 / n, "Arrow",
                              extra={"ranges": n}))
    path = tmp_path / "chart.png"
    plot(figures, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_append_pipeline_script_reports_every_variant_next_to_the_ceiling(tmp_path, capsys):
    from integration.bench import append_pipeline

    assert append_pipeline.main(["--mib", "8", "--rounds", "1", "--call-mib", "4",
                                 "--python-us", "10", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rounds = [line for line in lines if line.startswith("round 1 ")]
    assert [line.split()[2] for line in rounds] == list(append_pipeline.VARIANTS)
    summary = {line.split()[0]: line for line in lines if line.endswith("x ceiling")}
    assert set(summary) == set(append_pipeline.VARIANTS)
    for line in summary.values():
        assert float(line.split()[1].replace(",", "")) > 0  # MB/s of a run that finished
    assert list(tmp_path.iterdir()) == []  # every scratch file removed


def test_write_sizes_script_compares_each_size_with_1_mib_in_a_file_and_the_server(
        tmp_path, capsys):
    from integration.bench import write_sizes

    assert write_sizes.main(["--mib", "4", "--rounds", "1", "--sizes", "2", "--server",
                             "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = {tuple(line.split()[:2]): line for line in lines if line.endswith("x 1 MiB")}
    assert set(summary) == {("file", "1"), ("file", "2"), ("server", "1"), ("server", "2")}
    assert summary[("file", "1")].split()[-3] == "1.00x"
    for line in summary.values():
        assert float(line.split()[3].replace(",", "")) > 0  # MB/s of a run that finished
    assert list(tmp_path.iterdir()) == []  # the files and the cluster's data are gone


def test_write_sizes_script_refuses_sizes_that_do_not_divide_the_run(capsys):
    from integration.bench import write_sizes

    with pytest.raises(SystemExit):
        write_sizes.main(["--mib", "6", "--sizes", "4"])
    assert "not a multiple" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        write_sizes.main(["--sizes", "two"])
    assert "--sizes" in capsys.readouterr().err


def test_append_pipeline_script_refuses_a_window_of_nothing(capsys):
    from integration.bench import append_pipeline

    with pytest.raises(SystemExit):
        append_pipeline.main(["--window-mib", "0"])
    assert "--window-mib" in capsys.readouterr().err
