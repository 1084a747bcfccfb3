"""The container path for real: ``run_cluster.py`` builds the image on a locally made Debian
base, runs docker-compose.yml on the host's network, checks the job's data and tears down.

It takes minutes (the first run also makes the base image and downloads pyspark), so it is
marked slow::

    python -m pytest -m slow integration/docker -v -s

It skips, saying why, only where Docker cannot be had: not Linux, or no Docker and no way to
install it (root with apt-get). As root on Debian the script installs and starts Docker
itself. The fast tests below check the script's own pieces.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_cluster import (
    HOST_OVERRIDE,
    cluster_env,
    host_debian_sources,
    pick_ports,
    port_variables,
)

SCRIPT = Path(__file__).with_name("run_cluster.py")
RUN_TIMEOUT_S = 2400.0
TEARDOWN_TIMEOUT_S = 180.0


def why_no_docker() -> str | None:
    """Why Docker cannot be used here, or None when it can (or the script can install it)."""
    if not sys.platform.startswith("linux"):
        return f"Docker's Linux containers need a Linux host, this is {sys.platform}"
    if shutil.which("docker") is not None:
        return None
    if os.geteuid() == 0 and shutil.which("apt-get") is not None:
        return None
    return "Docker is not installed, and only root on Debian/Ubuntu (apt-get) can install it"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + TEARDOWN_TIMEOUT_S + 60)
def test_the_compose_cluster_runs_the_job_and_leaves_nothing_behind():
    reason = why_no_docker()
    if reason is not None:
        pytest.skip(reason)
    proc = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM, not a kill: the script tears the cluster down on its way out.
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=TEARDOWN_TIMEOUT_S)
        pytest.fail(f"run_cluster.py ran over {RUN_TIMEOUT_S:.0f} s:\n{out[-10000:]}")
    except BaseException:
        # Interrupted (Ctrl-C, pytest's timeout): let the script tear down before leaving.
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=TEARDOWN_TIMEOUT_S)
        raise
    print(out)
    assert proc.returncode == 0, out[-10000:]
    for step in ("runs as sbp, volume /data, health check `sbp cluster --pd-only`",
                 "job: wrote and read", "Spark master: application", "range servers live",
                 "without a hole", "teardown: no container, network or volume", "PASSED"):
        assert step in out, f"the run did not report {step!r}"


def test_the_override_asks_only_for_ports_and_the_pd_list():
    text = HOST_OVERRIDE.read_text()
    names = port_variables(text)
    assert {"SBP_PD_PORT", "SBP_RS1_PORT", "SBP_RS2_PORT", "SBP_RS3_PORT",
            "SPARK_MASTER_PORT"} <= set(names)
    ports = pick_ports(names)
    assert len(set(ports.values())) == len(names)
    env = cluster_env(ports)
    asked = set(re.findall(r"\$\{([A-Z0-9_]+)", text))
    assert asked <= set(env), f"the override needs {asked - set(env)}, which nobody sets"
    pd_ports = [name for name in ("SBP_PD_PORT", "SBP_PD2_PORT", "SBP_PD3_PORT") if name in ports]
    assert env["SBP_PD"] == ",".join(f"127.0.0.1:{ports[name]}" for name in pd_ports)


def test_the_pd_list_grows_with_the_pd_ports():
    # A PD cluster in the override (SBP_PD2_PORT, ...) joins the list every service gets.
    env = cluster_env({"SBP_PD_PORT": 5001, "SBP_PD2_PORT": 5002, "SBP_PD3_PORT": 5003,
                       "SBP_RS1_PORT": 5004})
    assert env["SBP_PD"] == "127.0.0.1:5001,127.0.0.1:5002,127.0.0.1:5003"
    assert env["SBP_RS1_PORT"] == "5004"


def test_the_base_image_uses_the_hosts_debian_sources(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main contrib\n\n"
        "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\n"
        "Components: main\nEnabled: no\n")
    (tmp_path / "sources.list.d" / "other.list").write_text(
        "deb [signed-by=/k.gpg] https://vendor.example/apt cloud-sdk-bookworm main\n")
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian bookworm main\n"
        "deb http://one-line.example/debian bookworm-backports main\n"
        "deb-src http://src.example/debian bookworm main\n")
    assert host_debian_sources(tmp_path) == [
        ("http://mirror.example/debian", ["bookworm", "bookworm-updates"]),
        ("http://mirror.example/debian-security", ["bookworm-security"]),
        ("http://one-line.example/debian", ["bookworm-backports"]),
    ]
    assert host_debian_sources(tmp_path / "missing") == []
