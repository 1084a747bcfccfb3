"""Run docker-compose.yml for real: build the image, start the cluster, check the job, tear down.

    python integration/docker/run_cluster.py [--rebuild-base]

Steps, each printed with the time it was reached:

1. Docker: installs ``docker.io`` and ``docker-compose`` with apt when they are missing (as
   root on Debian), and starts ``dockerd`` when none runs (without a bridge network: nothing
   here uses one), stopping it again at the end.
2. A base image without a registry: ``debootstrap`` a minimal Debian bookworm from the mirror
   the host's apt uses, and ``docker import`` it as ``sbp-spark-base:bookworm`` (kept for the
   next run; ``--rebuild-base`` makes it again).
3. The image: ``docker build --build-arg BASE_IMAGE=<that base>`` of the repository's
   Dockerfile, on the host's network, passing the host's proxy settings (if any) as build
   arguments, so nothing of them stays in the image.
4. The cluster: docker-compose.yml with ``compose.host.yml`` over it, so every container is on
   the host's network and every server listens on 127.0.0.1, on ports picked free here (the
   ``*_PORT`` variables of the override; ``SBP_PD`` is the PD address list made of the
   ``SBP_PD*_PORT`` ones). ``up`` waits for the health checks; then the job container runs.
5. The checks, from the host: the job's own result line (rows, offsets and sums it read back
   through Spark), the Spark master's record of the application, ``sbp cluster`` (every range
   server live), and every record of every stream read again with the SBP client: offsets
   0..n-1 with no hole or duplicate, each on every replica, every value written exactly once.
6. Teardown, on success, failure or SIGINT/SIGTERM: ``down -v`` removes the containers,
   networks and volumes of the run, and the script checks none is left.

Exit status 0 when every check passed, 1 otherwise. ``integration/docker/test_run_cluster.py``
runs it (marked slow).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
HOST_OVERRIDE = HERE / "compose.host.yml"
JOB_SCRIPT = REPO / "integration" / "standalone" / "job.py"

SUITE = "bookworm"
BASE_IMAGE = f"sbp-spark-base:{SUITE}"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# What the official debian:bookworm images use when the host's apt names no Debian source.
DEFAULT_SOURCES = [(DEFAULT_MIRROR, [SUITE, f"{SUITE}-updates"]),
                   ("http://deb.debian.org/debian-security", [f"{SUITE}-security"])]
# Build arguments Docker predefines for proxies: passed on from the environment when set.
PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
# The Dockerfile's optional package index arguments (only http(s) ones make sense inside).
PIP_INDEX_VARS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")
LOCAL_CA_DIR = Path("/usr/local/share/ca-certificates")
# The PD address list the services get as SBP_PD: one 127.0.0.1 address per variable
# SBP_PD_PORT, SBP_PD2_PORT, ... of the override.
PD_PORT_VAR = re.compile(r"SBP_PD\d*_PORT")

# The lines of docker build's output worth showing: its steps that do something, and the end.
BUILD_PROGRESS = re.compile(r"^(Step \d+/\d+ : (FROM|RUN|COPY)|Successfully (built \w+$|tagged))")

DOCKER_START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 900.0
POLL_S = 2.0
DOWN_TIMEOUT_S = 20


class Failed(Exception):
    """A step or a check failed; the message says which and what was seen."""


class _Stopped(BaseException):
    """SIGTERM/SIGHUP arrived: unwind so the teardown runs (like KeyboardInterrupt)."""


_started = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - _started:6.1f} s] {message}", flush=True)


def run(argv: Sequence[str], *, capture: bool = False, check: bool = True,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """Run a command, printing it first; ``capture`` returns its output instead of showing
    it. A failure raises ``Failed`` with the command and (captured) output."""
    argv = [str(a) for a in argv]
    print(f"  $ {shlex.join(argv)}", flush=True)
    done = subprocess.run(argv, text=True, stdin=kwargs.pop("stdin", subprocess.DEVNULL),
                          capture_output=capture, **kwargs)
    if check and done.returncode != 0:
        output = (done.stdout or "") + (done.stderr or "") if capture else ""
        raise Failed(f"`{shlex.join(argv)}` exited {done.returncode}\n{output[-4000:]}")
    return done


def run_logged(argv: Sequence[str], log: Path, show: re.Pattern[str] | None = None,
               shown: Sequence[str | Path] | None = None, **kwargs: Any) -> None:
    """Run a long command with its output in ``log``, printing only the lines ``show``
    matches (and ``shown`` instead of ``argv``, when an argument is too long to print); on
    failure, the log's last lines go into the error."""
    argv = [str(a) for a in argv]
    print(f"  $ {shlex.join(str(a) for a in shown or argv)}   (output: {log})", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if show is not None and show.search(line):
                line = " ".join(line.split())
                print(f"    {line if len(line) <= 110 else line[:109] + '…'}", flush=True)
        status = proc.wait()
    if status != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise Failed(f"`{shlex.join(str(a) for a in shown or argv)}` exited {status}; end "
                     f"of {log}:\n{tail}")


# -- Docker itself --------------------------------------------------------------------------


def apt_install(packages: Sequence[str]) -> None:
    """Install Debian packages, or say what is missing when this is not root on Debian."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Failed(f"{', '.join(packages)} missing; install them (as root on Debian: "
                     f"apt-get install {' '.join(packages)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], capture=True, env=env)
    run(["apt-get", "install", "-y", "-q", *packages], capture=True, env=env)


def compose_command() -> list[str] | None:
    """``docker compose`` (the v2 plugin) if it works, else ``docker-compose`` (v1)."""
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def _docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def ensure_docker(logs: Path) -> tuple[list[str], subprocess.Popen | None]:
    """The compose command, and the dockerd this started (None when one was running)."""
    missing = [pkg for tool, pkg in (("docker", "docker.io"), ("dockerd", "docker.io"))
               if shutil.which(tool) is None]
    if compose_command() is None:
        missing.append("docker-compose")
    if missing:
        say(f"installing {', '.join(dict.fromkeys(missing))} with apt")
        apt_install(list(dict.fromkeys(missing)))
    compose = compose_command()
    assert compose is not None
    daemon = None
    if not _docker_answers():
        if os.geteuid() != 0:
            raise Failed("no Docker daemon answers and only root can start one")
        # The cluster runs on the host's network, and the image is built there too: no
        # bridge (and no iptables rules for one) is needed.
        argv = ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false"]
        say(f"starting {shlex.join(argv)} (log: {logs / 'dockerd.log'})")
        daemon = subprocess.Popen(argv, stdout=open(logs / "dockerd.log", "wb"),
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        deadline = time.monotonic() + DOCKER_START_TIMEOUT_S
        while not _docker_answers():
            if daemon.poll() is not None or time.monotonic() > deadline:
                stop_daemon(daemon)
                log = (logs / "dockerd.log").read_text(errors="replace")
                raise Failed(f"dockerd did not start:\n{log[-3000:]}")
            time.sleep(0.5)
    versions = [run(["docker", "version", "--format",
                     "client {{.Client.Version}}, daemon {{.Server.Version}}"],
                    capture=True).stdout.strip(),
                run([*compose, "version"], capture=True).stdout.splitlines()[0]]
    say(f"Docker {versions[0]}; {versions[1]}")
    return compose, daemon


def stop_daemon(daemon: subprocess.Popen) -> None:
    if daemon.poll() is None:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


# -- the base image -------------------------------------------------------------------------


def _suites_of_interest(suites: Sequence[str]) -> list[str]:
    return [s for s in suites if s == SUITE or s.startswith(f"{SUITE}-")]


def host_debian_sources(etc_apt: Path = Path("/etc/apt")) -> list[tuple[str, list[str]]]:
    """(URI, bookworm suites) of the host's enabled apt sources that serve Debian bookworm's
    main component, from deb822 ``*.sources`` files and one-line ``sources.list`` files."""
    found: list[tuple[str, list[str]]] = []
    for path in sorted(etc_apt.glob("sources.list.d/*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields: dict[str, list[str]] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.split()
            if ("deb" in fields.get("types", []) and "main" in fields.get("components", [])
                    and fields.get("enabled", ["yes"])[0].lower() != "no"):
                suites = _suites_of_interest(fields.get("suites", []))
                found += [(uri, suites) for uri in fields.get("uris", []) if suites]
    for path in [etc_apt / "sources.list", *sorted(etc_apt.glob("sources.list.d/*.list"))]:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
            if len(words) >= 4 and words[0] == "deb" and "main" in words[3:]:
                suites = _suites_of_interest([words[2]])
                if suites:
                    found.append((words[1], suites))
    return found


def apt_proxy() -> str | None:
    """The HTTP proxy the host's apt is configured with (Acquire::http::Proxy), if any."""
    if shutil.which("apt-config") is None:
        return None
    out = subprocess.run(["apt-config", "shell", "PROXY", "Acquire::http::Proxy"],
                         capture_output=True, text=True).stdout
    words = shlex.split(out.partition("=")[2]) if "=" in out else []
    return words[0] if words and words[0].lower() not in ("", "direct", "false") else None


def _proxy_env() -> dict[str, str]:
    """Proxy variables for tools run here and build arguments: the environment's, else
    apt's proxy (the one the host's own apt reaches Debian through)."""
    found = {name: os.environ[name] for name in PROXY_VARS if os.environ.get(name)}
    proxy = apt_proxy()
    if proxy and not any(n.lower() == "http_proxy" for n in found):
        found["http_proxy"] = proxy
    return found


def make_base_image(name: str, logs: Path) -> None:
    """debootstrap a minimal Debian into a directory and import it as ``name``."""
    if shutil.which("debootstrap") is None:
        say("installing debootstrap with apt")
        apt_install(["debootstrap"])
    sources = host_debian_sources() or DEFAULT_SOURCES
    mirror = next((uri for uri, suites in sources if SUITE in suites), DEFAULT_MIRROR)
    with tempfile.TemporaryDirectory(prefix="sbp-base-", dir="/var/tmp") as tmp:
        root = Path(tmp) / "rootfs"
        run_logged(["debootstrap", "--variant=minbase", SUITE, root, mirror],
                   logs / "debootstrap.log", show=re.compile(r"^I: (Retrieving Release|Base)"),
                   env={**os.environ, **_proxy_env()})
        # Like the official slim images: the host's Debian sources, no package lists or
        # caches, no manuals, docs or translations.
        (root / "etc/apt/sources.list").unlink(missing_ok=True)
        (root / "etc/apt/sources.list.d/debian.sources").write_text("\n".join(
            f"Types: deb\nURIs: {uri}\nSuites: {' '.join(suites)}\nComponents: main\n"
            f"Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
            for uri, suites in sources))
        for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*", "var/log/*",
                        "usr/share/doc/*", "usr/share/man/*", "usr/share/info/*",
                        "usr/share/locale/*"):
            for path in root.glob(pattern):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        say(f"importing {root} as {name}")
        tar_argv = ["tar", "-C", str(root), "--numeric-owner", "-c", "."]
        import_argv = ["docker", "import", "--change", 'CMD ["bash"]', "-", name]
        print(f"  $ {shlex.join(tar_argv)} | {shlex.join(import_argv)}", flush=True)
        tar = subprocess.Popen(tar_argv, stdout=subprocess.PIPE)
        assert tar.stdout is not None
        with tar.stdout:
            imported = subprocess.run(import_argv, stdin=tar.stdout, capture_output=True,
                                      text=True)
        if tar.wait() != 0 or imported.returncode != 0:
            raise Failed(f"importing {root} failed (tar {tar.returncode}, docker import "
                         f"{imported.returncode}): {imported.stderr[-2000:]}")


def image_size(name: str) -> int:
    return int(run(["docker", "image", "inspect", "--format", "{{.Size}}", name],
                   capture=True).stdout.strip())


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name],
                          capture_output=True).returncode == 0


def local_ca_certificates(directory: Path = LOCAL_CA_DIR) -> str:
    """The CA certificates added to this host's trust store (Debian keeps them in
    /usr/local/share/ca-certificates), as PEM text: a network that inspects HTTPS needs them
    trusted inside the build too."""
    return "".join(p.read_text() for p in sorted(directory.glob("*.crt")))


def build_image(image: str, base: str, logs: Path) -> None:
    """docker build of the repository's Dockerfile on ``base``, on the host's network."""
    # --force-rm: a failed step leaves no stopped container behind.
    args = ["docker", "build", "--force-rm", "--network", "host", "--build-arg",
            f"BASE_IMAGE={base}"]
    for name, value in _proxy_env().items():
        args += ["--build-arg", f"{name}={value}"]
    for name in PIP_INDEX_VARS:
        if os.environ.get(name, "").startswith(("http://", "https://")):
            args += ["--build-arg", f"{name}={os.environ[name]}"]
    certificates = local_ca_certificates()
    shown = None
    if certificates:
        args += ["--build-arg", f"EXTRA_CA_CERTS={certificates}"]
        shown = args[:-1] + [f"EXTRA_CA_CERTS=<{certificates.count('BEGIN CERTIFICATE')} "
                             f"certificates of {LOCAL_CA_DIR}>"]
    run_logged([*args, "-t", image, REPO], logs / "docker-build.log",
               show=BUILD_PROGRESS,
               shown=None if shown is None else [*shown, "-t", image, REPO])


# -- the compose cluster --------------------------------------------------------------------


def port_variables(text: str) -> list[str]:
    """The ``*_PORT`` variables a compose file interpolates, in order of appearance."""
    return list(dict.fromkeys(re.findall(r"\$\{([A-Z][A-Z0-9_]*_PORT)\b", text)))


def pick_ports(names: Sequence[str]) -> dict[str, int]:
    """A distinct port nothing listens on for each name: all bound on 127.0.0.1 at once
    (the kernel hands out only free ports, and no two alike while they are held)."""
    with contextlib.ExitStack() as held:
        ports = {}
        for name in names:
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports[name] = sock.getsockname()[1]
    return ports


def cluster_env(ports: dict[str, int]) -> dict[str, str]:
    """The override's variables: every port, and SBP_PD, the PD address list."""
    pds = [f"127.0.0.1:{port}" for name, port in ports.items() if PD_PORT_VAR.fullmatch(name)]
    if not pds:
        raise Failed(f"{HOST_OVERRIDE} names no SBP_PD*_PORT variable")
    return {**{name: str(port) for name, port in ports.items()}, "SBP_PD": ",".join(pds)}


def load_job() -> Any:
    spec = importlib.util.spec_from_file_location("sbp_compose_job", JOB_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job_arguments(job: Any, override: dict, pd: str) -> argparse.Namespace:
    """The job's settings (rows, streams, replicas), parsed from its compose command."""
    argv = [str(a) for a in override["services"]["job"]["command"]]
    script = next(i for i, a in enumerate(argv) if a.endswith(JOB_SCRIPT.name))
    return job.build_parser().parse_args([*argv[script + 1:], "--pd", pd])


class Cluster:
    """docker-compose.yml + the host-network override, as one compose project.

    The two files are merged once with ``compose config`` into ``merged``, and the ports
    docker-compose.yml publishes are dropped from it: they mean nothing on the host's network,
    Docker refuses them there, and compose 1.x has no way to reset a list in an override.
    """

    def __init__(self, compose: list[str], project: str, env: dict[str, str],
                 merged: Path) -> None:
        self.compose = compose
        self.project = project
        self.env = {**os.environ, **env}
        config = yaml.safe_load(run(
            [*compose, "-f", COMPOSE_FILE, "-f", HOST_OVERRIDE, "config"], capture=True,
            env=self.env, cwd=REPO).stdout)
        for service in config["services"].values():
            if service.get("network_mode") == "host":
                service.pop("ports", None)
        merged.write_text(yaml.safe_dump(config, sort_keys=False))
        self.merged = merged

    def argv(self, *args: str) -> list[str]:
        return [*self.compose, "-p", self.project, "-f", str(self.merged),
                "--project-directory", str(REPO), *args]

    def __call__(self, *args: str, capture: bool = False,
                 check: bool = True) -> subprocess.CompletedProcess:
        return run(self.argv(*args), capture=capture, check=check, env=self.env, cwd=REPO)

    def container(self, service: str) -> str:
        ids = self("ps", "-q", service, capture=True).stdout.split()
        if not ids:
            raise Failed(f"no container for service {service}")
        return ids[0]

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that still exist."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, argv in (("containers", ["docker", "ps", "-aq"]),
                           ("networks", ["docker", "network", "ls", "-q"]),
                           ("volumes", ["docker", "volume", "ls", "-q"])):
            out = subprocess.run([*argv, "--filter", label], capture_output=True, text=True)
            found[kind] = out.stdout.split()
        return found

    def down(self) -> None:
        """Remove the containers, networks and volumes of the project; fail if any stays."""
        self("down", "--volumes", "--remove-orphans", "--timeout", str(DOWN_TIMEOUT_S),
             check=False)
        left = self.leftovers()
        if any(left.values()):
            for kind, ids in (("container", left["containers"]), ("network", left["networks"]),
                              ("volume", left["volumes"])):
                if ids:
                    subprocess.run(["docker", kind, "rm", "-f" if kind == "container" else
                                    "--force", *ids], capture_output=True)
            raise Failed(f"`down` left {left}")
        say(f"teardown: no container, network or volume of project {self.project} left")


def wait_for_exit(container: str, timeout: float) -> int:
    """The exit code of ``container`` once it stopped; fails after ``timeout`` s."""
    argv = ["docker", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container]
    print(f"  $ {shlex.join(argv)}   (every {POLL_S:g} s)", flush=True)
    deadline = time.monotonic() + timeout
    while True:
        state = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
        if state[0] in ("exited", "dead"):
            return int(state[1])
        if time.monotonic() > deadline:
            raise Failed(f"the job still runs after {timeout:.0f} s")
        time.sleep(POLL_S)


def job_result(logs: str, job: Any) -> dict:
    lines = [line.split(job.RESULT_PREFIX, 1)[1] for line in logs.splitlines()
             if job.RESULT_PREFIX in line]
    if not lines:
        raise Failed(f"the job printed no {job.RESULT_PREFIX.strip()} line:\n{logs[-6000:]}")
    return json.loads(lines[-1])


# -- the checks -----------------------------------------------------------------------------


def check_image(image: str) -> None:
    """What the image promises: a user other than root, /data a volume, and a health check
    that asks the PD."""
    config = json.loads(run(["docker", "image", "inspect", "--format", "{{json .Config}}",
                             image], capture=True).stdout)
    health = (config.get("Healthcheck") or {}).get("Test") or []
    if config.get("User") in ("", "0", "root") or "/data" not in (config.get("Volumes") or {}) \
            or health[1:3] != ["sbp", "cluster"]:
        raise Failed(f"{image}: user {config.get('User')!r}, volumes {config.get('Volumes')}, "
                     f"health check {health}: expected a non-root user, /data a volume and "
                     f"`sbp cluster`")
    say(f"image {image}: runs as {config['User']}, volume /data, health check "
        f"`{shlex.join(health[1:])}`")


def show_health(project: str) -> None:
    """Every container of the project with its state (and health) as Docker sees it."""
    out = run(["docker", "ps", "--all", "--filter", f"label=com.docker.compose.project={project}",
               "--format", "{{.Names}}\t{{.Status}}"], capture=True).stdout
    for line in sorted(out.splitlines()):
        print(f"    {line}", flush=True)


def check_job(result: dict, args: argparse.Namespace, master_url: str) -> None:
    if not result["ok"]:
        raise Failed(f"the job found problems: {result['problems']}")
    if not result["rows_written"] == result["rows_read"] == args.rows:
        raise Failed(f"the job wrote {result['rows_written']} and read {result['rows_read']} "
                     f"rows, expected {args.rows}")
    if result["master"] != master_url or len(result["streams"]) != args.streams:
        raise Failed(f"the job ran on {result['master']} with streams {result['streams']}, "
                     f"expected {master_url} and {args.streams} streams")
    say(f"job: wrote and read {args.rows} rows in streams {result['streams']} "
        f"(write {result['write_s']} s, read {result['read_s']} s), app {result['app_id']}")


def check_spark_master(ui_port: int, result: dict, job: Any) -> None:
    """The master ran the job's application with executors (on the one worker)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=10) as answer:
        state = json.load(answer)
    apps = [a for a in state["completedapps"] + state["activeapps"]
            if a["id"] == result["app_id"]]
    alive = [w for w in state["workers"] if w["state"] == "ALIVE"]
    if not apps or apps[0]["name"] != job.APP_NAME or apps[0]["cores"] < 1 or len(alive) != 1:
        raise Failed(f"the Spark master does not show the job's application on its worker: "
                     f"apps {apps}, workers {state['workers']}")
    say(f"Spark master: application {apps[0]['id']} ({apps[0]['name']}) ran with "
        f"{apps[0]['cores']} cores on worker {alive[0]['id']}")


def check_sbp_cluster(pd: str, range_servers: list[str]) -> None:
    """``sbp cluster`` from the host: every range server live and answering."""
    done = run([sys.executable, "-m", "sbp_spark.cli", "cluster", "--json", "--pd", pd],
               capture=True)
    facts = json.loads(done.stdout)
    seen = sorted(s["address"] for s in facts["range_servers"])
    if seen != sorted(range_servers) or not all(s["live"] for s in facts["range_servers"]):
        raise Failed(f"sbp cluster shows {facts['range_servers']}, expected {range_servers} "
                     f"all live")
    leaders = [m["name"] for m in facts["members"] if m["leader"]]
    if len(leaders) != 1:
        raise Failed(f"sbp cluster shows PD members {facts['members']}, not one leader")
    say(f"sbp cluster: PD {facts['pd']} ({len(facts['members'])} members, {leaders[0]} "
        f"leads), {len(seen)} range servers live ({', '.join(seen)}), {facts['streams']} streams, "
        f"{facts['ranges']} ranges")


def check_streams(pd: str, result: dict, args: argparse.Namespace, job: Any) -> None:
    """Every record of every stream, read with the SBP client: offsets 0..n-1 without hole
    or duplicate, on ``replicas`` servers, and each number written exactly once."""
    from sbp_spark.client import SbpClient
    from sbp_spark.commands.tail import iter_records

    counts = job.expected_counts(args.rows, args.streams)
    with SbpClient(pd) as client:
        for index, (stream_id, count) in enumerate(zip(result["streams"], counts,
                                                       strict=True)):
            ranges = client.list_ranges(stream_id)
            start = 0
            for rng in ranges:
                if rng.start_offset != start or len(rng.servers) != args.replicas:
                    raise Failed(f"stream {stream_id}: range {rng.range_index} starts at "
                                 f"{rng.start_offset} (expected {start}) on "
                                 f"{len(rng.servers)} servers (expected {args.replicas})")
                start = rng.end_offset if not rng.is_open else client.open_range_end(rng)
            if start != count:
                raise Failed(f"stream {stream_id} ends at offset {start}, expected {count}")
            next_offset, numbers = 0, set()
            for batch in client.read(stream_id):
                for offset, _key, value in iter_records(batch):
                    if offset != next_offset:
                        raise Failed(f"stream {stream_id}: offset {offset} follows "
                                     f"{next_offset - 1}")
                    next_offset += 1
                    number = int(value.decode().removeprefix("event-"))
                    if number % args.streams != index or number in numbers:
                        raise Failed(f"stream {stream_id}: value {value!r} at offset {offset} "
                                     f"does not belong here or came twice")
                    numbers.add(number)
            if next_offset != count or len(numbers) != count:
                raise Failed(f"stream {stream_id}: read {next_offset} records, "
                             f"{len(numbers)} distinct, expected {count}")
            say(f"stream {stream_id}: offsets 0..{count - 1} without a hole, {len(ranges)} "
                f"range(s) on {args.replicas} replicas, all {count} values written once")


# -- the run --------------------------------------------------------------------------------


@contextlib.contextmanager
def teardown_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so the ``finally`` blocks tear down."""
    def stop(signum: int, _frame: Any) -> None:
        raise _Stopped(f"signal {signum}")

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Build the image on a locally made Debian base, run docker-compose.yml "
                    "on the host's network, check what the Spark job wrote and read, and "
                    "remove the containers, networks and volumes.")
    parser.add_argument("--base-image", default=BASE_IMAGE,
                        help=f"the base image; made with debootstrap when missing "
                             f"(default {BASE_IMAGE})")
    parser.add_argument("--rebuild-base", action="store_true",
                        help="make the base image again even if it exists")
    parser.add_argument("--project", default=f"sbp-compose-{os.getpid()}",
                        help="compose project name (default sbp-compose-<pid>)")
    parser.add_argument("--job-timeout-s", type=float, default=JOB_TIMEOUT_S,
                        help=f"how long the job may run (default {JOB_TIMEOUT_S:.0f})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    job = load_job()
    override_text = HOST_OVERRIDE.read_text()
    image = yaml.safe_load(COMPOSE_FILE.read_text())["x-sbp"]["image"]
    logs = Path(tempfile.mkdtemp(prefix="sbp-compose-logs-"))
    ok = False
    daemon = None
    with teardown_on_signals():
        try:
            say(f"logs in {logs}")
            compose, daemon = ensure_docker(logs)
            if args.rebuild_base or not image_exists(args.base_image):
                say(f"making base image {args.base_image} with debootstrap ({SUITE}, minbase)")
                make_base_image(args.base_image, logs)
            say(f"base image {args.base_image}: {image_size(args.base_image) / 1e6:.0f} MB")
            say(f"building {image} on {args.base_image}")
            build_image(image, args.base_image, logs)
            say(f"image {image}: {image_size(image) / 1e6:.0f} MB")
            check_image(image)

            ports = pick_ports(port_variables(override_text))
            env = cluster_env(ports)
            say("ports (free on 127.0.0.1): " + ", ".join(f"{k}={v}" for k, v in ports.items()))
            job_args = job_arguments(job, yaml.safe_load(override_text), env["SBP_PD"])
            cluster = Cluster(compose, args.project, env, logs / "compose.merged.yml")
            try:
                say(f"starting the cluster (project {args.project}); up waits for the health "
                    f"checks")
                cluster("up", "--detach", "--no-build")
                show_health(args.project)
                job_container = cluster.container("job")
                say(f"waiting for the job ({job_args.rows} rows, {job_args.streams} streams, "
                    f"{job_args.replicas} replicas)")
                status = wait_for_exit(job_container, args.job_timeout_s)
                job_logs = cluster("logs", "--no-color", "job", capture=True).stdout
                say(f"job exited {status}")
                result = job_result(job_logs, job)
                print(f"    {job.RESULT_PREFIX}{json.dumps(result)}", flush=True)
                if status != 0:
                    raise Failed(f"the job exited {status}:\n{job_logs[-6000:]}")
                check_job(result, job_args, f"spark://127.0.0.1:{ports['SPARK_MASTER_PORT']}")
                check_spark_master(ports["SPARK_MASTER_UI_PORT"], result, job)
                range_servers = [f"127.0.0.1:{port}" for name, port in ports.items()
                                 if re.fullmatch(r"SBP_RS\d+_PORT", name)]
                check_sbp_cluster(env["SBP_PD"], range_servers)
                check_streams(env["SBP_PD"], result, job_args, job)
                ok = True
            finally:
                if not ok:
                    say("failed: the end of every service's log follows")
                    cluster("logs", "--no-color", "--tail", "60", check=False)
                say("tearing down")
                try:
                    cluster.down()
                except Failed as exc:
                    say(f"FAILED: {exc}")
                    ok = False
        except (Failed, KeyboardInterrupt, _Stopped) as exc:
            say(f"FAILED: {exc}" if isinstance(exc, Failed) else f"stopped by {exc or 'Ctrl-C'}")
            ok = False
        finally:
            if daemon is not None:
                say("stopping the dockerd this run started")
                stop_daemon(daemon)
    if ok:
        shutil.rmtree(logs, ignore_errors=True)
        say("PASSED")
    else:
        say(f"logs kept in {logs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
