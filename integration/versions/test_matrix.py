"""The package on every Spark 4 platform, from its wheel: pyspark 4.0, 4.1, 4.2 and 4.3, each
in a virtualenv of its own that first holds only that pyspark (as the platform installs it)
and then the wheel beside it; and a host with neither pyspark nor Java, for the servers and
the command line.

For each platform a cluster of that virtualenv's ``sbp server`` runs on 127.0.0.1 and
``cases.py`` runs the cases in one local Spark session (and Spark Connect in a second
process, with pyspark[connect]'s packages). A test per platform and case says which failed and
why; a version x case table ends the run. The wheel is built once per run, and each
platform's virtualenv once for all runs (platforms.py), so a run after the first takes a few
minutes::

    python -m pytest -m slow integration/versions -v
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import threading
import time

import pytest
from matrix import PlatformRun, SbpServer, runner_env
from platforms import NO_PYSPARK, PLATFORMS, PlatformError, dist_name, prepare, record

from tests.processes import spawn, stop

# A platform's first test also makes its virtualenv (minutes the first time) and runs every
# case: more than pytest's default timeout of pyproject.toml.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

# case -> its row in the table.
CASES = {
    "discovery": 'format("sbp") found without register(), beside another pyspark_* source',
    "batch_round_trip": "batch write and read (records, arrow)",
    "sql_table": "CREATE TABLE ... USING sbp, INSERT, SELECT",
    "streaming_restart": "maxRecordsPerTrigger, availableNow (4.0, 4.1: a batch a run), restart",
    "idempotent_sink": "idempotent sink, micro-batch re-run",
    "filter_pushdown": "filter pushdown (4.0: refused)",
    "connect": "Spark Connect round trip",
}
INSTALL_ROW = "wheel installed beside it, pyspark kept"
CLI_TIMEOUT_S = 120.0
TAIL_TIMEOUT_S = 60.0


def _same_version(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name one release ("19" and "19.0.0" do)."""

    def parts(version: str) -> list[str]:
        numbers = version.split(".")
        while len(numbers) > 1 and numbers[-1] == "0":
            numbers.pop()
        return numbers

    return parts(a) == parts(b)


def _fail(run: PlatformRun, row: str, message: str) -> None:
    record(row, run.column, "FAIL")
    pytest.fail(f"{run.column}: {message}", pytrace=False)


@pytest.mark.spark
@pytest.mark.parametrize("platform_run", PLATFORMS, ids=[p.id for p in PLATFORMS],
                         indirect=True)
@pytest.mark.parametrize("case", list(CASES))
def test_case(platform_run: PlatformRun, case: str):
    run, row = platform_run, CASES[case]
    result = run.results.get(case)
    if result is None:
        if run.error is not None:
            _fail(run, row, f"the platform could not run case {case}: {run.error}")
        assert run.venv is not None
        if case == "connect" and run.venv.connect_dir is None:
            record(row, run.column, "n/a")
            pytest.skip(f"{run.column}: pyspark[connect] did not install: "
                        f"{run.venv.record.get('connect_error')}")
        _fail(run, row, f"case {case} gave no result (runners: {run.ended}):\n"
                        + run.log_tails())
    if result["status"] == "ok":
        record(row, run.column, "ok")
    elif result["status"] == "refused":  # cases.py accepts only the expected refusal
        record(row, run.column, "refused, as expected")
    else:
        _fail(run, row, f"case {case} failed: {result['detail']}")


@pytest.mark.parametrize("platform_run", PLATFORMS, ids=[p.id for p in PLATFORMS],
                         indirect=True)
def test_installing_the_wheel_keeps_the_platforms_pyspark(platform_run: PlatformRun):
    run = platform_run
    if run.venv is None:
        _fail(run, INSTALL_ROW, f"the platform's virtualenv could not be made: {run.error}")
    assert run.venv is not None
    platform_packages = run.venv.record["platform_packages"]
    first, now = run.venv.record["first_install"], run.venv.record["install"]
    pyspark = platform_packages.get("pyspark")
    if not pyspark or first["pyspark"] != pyspark or now["pyspark"] != pyspark:
        _fail(run, INSTALL_ROW, f"pyspark was {pyspark}, {first['pyspark']} after the first "
                                f"install of the wheel, {now['pyspark']} after this run's")
    # Into the platform as it came, the wheel only adds what it needs; it upgrades nothing.
    replaced = {k: v for k, v in first["changed"].items() if v[0] is not None}
    if replaced:
        _fail(run, INSTALL_ROW, f"installing the wheel changed the platform's {replaced}")
    if run.platform.floors:
        # Every runtime dependency sits at its declared floor, so the cases ran on the floors.
        pins = dict(p.split("==") for p in run.venv.record["platform_requirements"][1:])
        found = {name: now["packages"].get(dist_name(name)) for name in pins}
        if any(not _same_version(pins[n], found[n] or "") for n in pins):
            _fail(run, INSTALL_ROW, f"the floors {pins} were not kept: {found}")
    if now["changed"] or [i for i in now["installed"] if not i.startswith("sbp-spark==")]:
        _fail(run, INSTALL_ROW, f"reinstalling the wheel installed {now['installed']} and "
                                f"changed {now['changed']}")
    record(INSTALL_ROW, run.column, f"ok ({pyspark} kept)")


# -- a host with no pyspark and no Java -------------------------------------------------------


@pytest.fixture(scope="module")
def no_pyspark(dists, running):
    try:
        return prepare(NO_PYSPARK, dists.runtime_requirements(), dists.wheel)
    except PlatformError as exc:
        record("server, CLI and demo message", NO_PYSPARK.label, "FAIL")
        pytest.fail(f"{NO_PYSPARK.label}: the virtualenv could not be made: {exc}",
                    pytrace=False)


def _no_java_env(venv) -> dict[str, str]:
    env = runner_env(venv)
    env["PATH"] = str(venv.bin)  # this virtualenv's programs only: no java, no pyspark
    env.pop("JAVA_HOME", None)
    return env


def _sbp(venv, env, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv.bin / "sbp"), *args], env=env, input=stdin,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


class _Lines:
    """The lines a helper process prints, read by a thread, awaited with a deadline."""

    def __init__(self, stream) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, count: int, timeout: float = TAIL_TIMEOUT_S) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.seen) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"sbp tail -f printed {self.seen}, expected {count} "
                                     f"lines within {timeout:.0f} s")
            try:
                self.seen.append(self.lines.get(timeout=left))
            except queue.Empty:
                continue
        return self.seen


def test_a_host_without_pyspark_or_java_runs_the_servers_and_the_cli(
        no_pyspark, running, tmp_path):
    venv, column = no_pyspark, NO_PYSPARK.label
    row = "sbp server, streams create, produce, tail -f"
    record(row, column, "FAIL")
    install = venv.record["install"]
    assert "pyspark" not in install["packages"], \
        f"installing the wheel brought pyspark: {install['installed']}"
    env = _no_java_env(venv)
    assert shutil.which("java", path=env["PATH"]) is None
    imported = subprocess.run([venv.python, "-c", "import pyspark"], env=env,
                              capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert "No module named 'pyspark'" in imported.stderr

    server = SbpServer(venv.bin / "sbp", tmp_path / "cluster", running, env)
    tail = None
    try:
        created = _sbp(venv, env, "streams", "create", "--pd", server.pd)
        assert created.returncode == 0, created.stderr
        stream = created.stdout.split()[0]
        produced = _sbp(venv, env, "produce", "--pd", server.pd, stream, stdin="a\nb\nc\n")
        assert produced.returncode == 0, produced.stderr
        tail = spawn([str(venv.bin / "sbp"), "tail", "--pd", server.pd, "-f", stream],
                     records=running, env=env, stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        lines = _Lines(tail.stdout)
        assert lines.wait_for(3) == ["a", "b", "c"]
        produced = _sbp(venv, env, "produce", "--pd", server.pd, stream, stdin="d\ne\n")
        assert produced.returncode == 0, produced.stderr
        assert lines.wait_for(5) == ["a", "b", "c", "d", "e"]
    finally:
        if tail is not None:
            stop(tail, running)
        server.stop()
    record(row, column, "ok")


def test_sbp_demo_without_pyspark_names_what_to_install(no_pyspark):
    venv, column = no_pyspark, NO_PYSPARK.label
    row = "sbp demo says to install sbp-spark[spark]"
    record(row, column, "FAIL")
    done = _sbp(venv, _no_java_env(venv), "demo", "--rows", "10")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "sbp demo needs pyspark" in done.stderr
    assert "pip install 'sbp-spark[spark]'" in done.stderr
    assert "Traceback" not in done.stderr and "Starting" not in done.stdout
    record(row, column, "ok")


def test_the_spark_extra_brings_pyspark_4(no_pyspark, dists, tmp_path):
    venv, column = no_pyspark, NO_PYSPARK.label
    row = "sbp-spark[spark] would install pyspark 4"
    record(row, column, "FAIL")
    report = tmp_path / "report.json"
    # What pip would install; --dry-run leaves the virtualenv without pyspark for the others.
    venv.pip("install", "--dry-run", "--report", str(report), f"{dists.wheel}[spark]",
             what="resolving the spark extra")
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"]
               for i in json.loads(report.read_text())["install"]}
    assert planned.get("pyspark", "").startswith("4."), planned
    record(row, column, f"ok (pyspark {planned['pyspark']})")
