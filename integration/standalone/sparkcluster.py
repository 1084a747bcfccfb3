"""A Spark standalone cluster (one master, one worker) on 127.0.0.1, from pip's pyspark.

pip's pyspark ships ``bin/spark-class`` but not ``sbin/start-master.sh``, so the master and the
worker are started as ``spark-class org.apache.spark.deploy.{master.Master,worker.Worker}``
child processes. Readiness is read from the master's web UI JSON (``/json/``), which lists the
workers that registered.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import pyspark

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spark_home() -> Path:
    return Path(pyspark.__file__).resolve().parent


def spark_env(work: Path) -> dict[str, str]:
    """Environment for every Spark process: loopback only, this interpreter for Python."""
    env = dict(os.environ)
    env.update({
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_DIRS": str(work / "local"),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    })
    return env


class SparkStandalone:
    """Master + worker child processes; a context manager that always stops both."""

    def __init__(self, work: Path, worker_cores: int = 2, worker_memory: str = "2g") -> None:
        self.work = Path(work)
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        self.port = free_port()
        self.webui_port = free_port()
        self.env = spark_env(self.work)
        self._procs: list[tuple[str, subprocess.Popen, IO[bytes]]] = []

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.work / f"{name}.log", "wb")
        spark_class = str(spark_home() / "bin" / "spark-class")
        proc = subprocess.Popen([spark_class, *argv], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self._procs.append((name, proc, log))

    def master_state(self) -> dict[str, Any] | None:
        """The master's /json/ document, or None while it does not answer."""
        url = f"http://127.0.0.1:{self.webui_port}/json/"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def start(self) -> SparkStandalone:
        (self.work / "local").mkdir(parents=True, exist_ok=True)
        (self.work / "worker").mkdir(parents=True, exist_ok=True)
        self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(self.port), "--webui-port", str(self.webui_port)])
        self._spawn("worker", ["org.apache.spark.deploy.worker.Worker", self.master_url,
                               "--host", "127.0.0.1", "--webui-port", "0",
                               "--cores", str(self.worker_cores),
                               "--memory", self.worker_memory,
                               "--work-dir", str(self.work / "worker")])
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for name, proc, _ in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"Spark {name} exited with {proc.returncode}:\n"
                                       + self.log_tail(name))
            state = self.master_state()
            if state is not None and state.get("aliveworkers", 0) >= 1:
                return self
            time.sleep(0.2)
        raise TimeoutError(f"no Spark worker registered with the master within "
                           f"{START_TIMEOUT_S:.0f} s:\n" + self.log_tail("master")
                           + self.log_tail("worker"))

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def submit(self, script: Path, args: list[str], timeout: float,
               conf: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """spark-submit ``script`` to this master (client deploy mode: driver here)."""
        settings = {
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.pyspark.python": sys.executable,
            "spark.pyspark.driver.python": sys.executable,
            "spark.executor.memory": "1g",
            "spark.sql.shuffle.partitions": "2",
            **(conf or {}),
        }
        argv = [str(spark_home() / "bin" / "spark-submit"), "--master", self.master_url]
        for key, value in settings.items():
            argv += ["--conf", f"{key}={value}"]
        argv += [str(script), *args]
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        """SIGTERM the worker (it stops its executors), then the master; SIGKILL stragglers."""
        for _name, proc, log in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            log.close()
        self._procs.clear()

    def __enter__(self) -> SparkStandalone:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def have_spark_class() -> bool:
    return (spark_home() / "bin" / "spark-class").exists() and shutil.which("bash") is not None
