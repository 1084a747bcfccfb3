"""What the version matrix runs in a platform's virtualenv: its ``sbp server``, and cases.py,
whose CASE lines become a PlatformRun."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from platforms import Platform, PlatformError, Venv

from tests.processes import spawn, stop

HERE = Path(__file__).resolve().parent
CASES_SCRIPT = HERE / "cases.py"
SERVER_START_TIMEOUT_S = 60.0
CLASSIC_TIMEOUT_S = 1200.0
CONNECT_TIMEOUT_S = 600.0


def runner_env(venv: Venv) -> dict[str, str]:
    """The environment for a process of ``venv``: its bin first on PATH, nothing that would
    point Python or Spark elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PYSPARK_", "SPARK_")) and k != "VIRTUAL_ENV"}
    env["PATH"] = f"{venv.bin}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv.bin.parent)
    return env


class SbpServer:
    """``sbp server`` of a platform's virtualenv on 127.0.0.1, as a helper process."""

    def __init__(self, sbp: Path, work: Path, running: Path, env: dict[str, str]) -> None:
        self.work, self.running = work, running
        work.mkdir(parents=True, exist_ok=True)
        self.ready = work / "ready.json"
        self.log = work / "sbp-server.log"
        with open(self.log, "wb") as log:
            self.proc = spawn([str(sbp), "server", "--data-dir", str(work / "data"),
                               "--range-servers", "2", "--host", "127.0.0.1", "--port", "0",
                               "--ready-file", str(self.ready)],
                              records=running, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
        try:
            self.pd = self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise PlatformError("sbp server did not start:\n" + self.log_tail())
            time.sleep(0.1)
        return json.loads(self.ready.read_text())["pd"]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        stop(self.proc, self.running)


@dataclass
class PlatformRun:
    """What one platform's run found; ``error`` is set when it could not run at all."""

    platform: Platform
    column: str
    venv: Venv | None = None
    error: str | None = None
    info: dict = field(default_factory=dict)  # the versions cases.py found
    results: dict[str, dict] = field(default_factory=dict)  # case -> its CASE line
    ended: dict[str, str] = field(default_factory=dict)  # runner mode -> how it ended
    logs: list[Path] = field(default_factory=list)

    def log_tails(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-chars:]}"
                         for p in self.logs if p.exists())


def run_cases(run: PlatformRun, mode: str, pd: str, work: Path, running: Path,
              timeout: float, *extra: str) -> None:
    """Run cases.py ``mode`` in the platform's virtualenv; put its CASE lines in ``run``."""
    assert run.venv is not None
    out, err = work / f"{mode}.out", work / f"{mode}.err"
    run.logs += [out, err]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = spawn([run.venv.python, "-I", str(CASES_SCRIPT), mode, pd, str(work / mode),
                      *extra], records=running, env=runner_env(run.venv), cwd=work,
                     stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
        try:
            proc.wait(timeout=timeout)
            ended = f"exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"was stopped after {timeout:.0f} s"
        finally:
            stop(proc, running)
    for line in out.read_text(errors="replace").splitlines():
        kind, _, payload = line.partition(" ")
        if kind == "PLATFORM":
            run.info = json.loads(payload)
        elif kind == "CASE":
            result = json.loads(payload)
            run.results[result["case"]] = result
    run.ended[mode] = ended
