"""docker-compose.yml, its host-network override and the Dockerfile cannot drift from the code:
Docker is not needed here (integration/docker/test_run_cluster.py runs them for real, slowly).

Every command a service or health check runs is checked against what it names: ``sbp ...``
lines parse with the real ``sbp`` parser, ``spark-submit`` scripts exist and their arguments
parse with the script's own parser, inline Python compiles, and the addresses the services
advertise point at services and ports that exist. The override may change addresses and
ports only, so what the test runs is what users run.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

from sbp_spark.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
HOST_OVERRIDE = REPO / "integration" / "docker" / "compose.host.yml"
RUN_CLUSTER = REPO / "integration" / "docker" / "run_cluster.py"
SPARK_CLASSES = {"org.apache.spark.deploy.master.Master",
                 "org.apache.spark.deploy.worker.Worker"}
PD_NODES = ("pd1", "pd2", "pd3")
# The etcd flags the etcd service may use (etcd 3.4's names), each with a value.
ETCD_FLAGS = {"--name", "--data-dir", "--listen-client-urls", "--advertise-client-urls",
              "--listen-peer-urls", "--initial-advertise-peer-urls", "--initial-cluster"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _interpolated(text: str) -> str:
    """The override with its ``${NAME...}`` variables replaced by the values run_cluster.py
    would give them (a missing one is a KeyError: the script would not set it)."""
    run_cluster = _load_script(RUN_CLUSTER)
    names = run_cluster.port_variables(text)
    env = run_cluster.cluster_env({name: 20001 + i for i, name in enumerate(names)})
    return re.sub(r"\$\{([A-Z0-9_]+)(?::\?[^}]*)?\}", lambda m: env[m.group(1)], text)


@pytest.fixture(scope="module")
def host_override() -> dict:
    return yaml.safe_load(_interpolated(HOST_OVERRIDE.read_text()))


@pytest.fixture(params=["docker-compose.yml", "compose.host.yml"])
def merged(request, compose, host_override) -> dict:
    """docker-compose.yml alone, and with the override merged over it the way compose does
    for the keys it sets (command, healthcheck test, environment)."""
    if request.param == "docker-compose.yml":
        return compose
    services = {}
    for name, service in compose["services"].items():
        over = host_override["services"].get(name, {})
        services[name] = {**service, **{k: v for k, v in over.items()
                                         if k not in ("healthcheck", "environment")},
                          "environment": {**service.get("environment", {}),
                                          **over.get("environment", {})}}
        if "healthcheck" in service:
            services[name]["healthcheck"] = {**service["healthcheck"],
                                             **over.get("healthcheck", {})}
    return {**compose, "services": services}


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"compose_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` and its subparsers without prefix matching, so a shortened or misspelt
    option (``--wait`` for ``--wait-s``) in the compose file fails here instead of passing."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)
    return parser


def _argvs(command) -> list[list[str]]:
    """The command lines a compose ``command`` or healthcheck ``test`` runs."""
    if isinstance(command, str):
        argv = shlex.split(command)
    else:
        argv = [str(a) for a in command]
    if argv and argv[0] == "CMD":
        argv = argv[1:]
    elif argv and argv[0] == "CMD-SHELL":
        argv = ["sh", "-c", " ".join(argv[1:])]
    if argv and argv[0] in ("sh", "bash") and any(a in ("-c", "-ec") for a in argv[1:3]):
        script = argv[-1].replace("&&", ";").replace("\n", ";")
        return [shlex.split(part) for part in script.split(";") if part.strip()]
    return [argv]


def _commands(compose: dict) -> list[tuple[str, list[str]]]:
    found = []
    for name, service in compose["services"].items():
        for key in ("command",):
            if key in service:
                found += [(name, argv) for argv in _argvs(service[key])]
        health = service.get("healthcheck", {})
        if "test" in health:
            found += [(f"{name} healthcheck", argv) for argv in _argvs(health["test"])]
    return found


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_services_are_there(compose):
    services = compose["services"]
    assert {"etcd", *PD_NODES, "rs1", "rs2", "rs3", "spark-master", "spark-worker",
            "job"} <= set(services)
    for name, service in services.items():
        assert service.get("build") == ".", f"{name} is not built from this repository"
        assert "command" in service, name
    assert services["job"]["restart"] == "no"


def test_every_service_gets_the_pd_list_from_one_variable(compose, host_override):
    # One place names the PD address list (SBP_PD); no command repeats it.
    pds = "pd1:2378,pd2:2378,pd3:2378"
    assert compose["x-sbp"]["environment"]["SBP_PD"] == pds
    for name, service in compose["services"].items():
        assert service["environment"]["SBP_PD"] == pds, name
        assert "SBP_PD" in host_override["services"][name]["environment"], name
    for where, argv in _commands(compose):
        # A PD node's health check asks that node alone, which is the point of it.
        if where.removesuffix(" healthcheck") not in PD_NODES:
            assert _option(argv, "--pd") is None, f"{where} names the PD itself: {argv}"


def test_every_command_exists_with_its_flags(merged, monkeypatch):
    checked = {"sbp": 0, "spark-submit": 0, "spark-class": 0, "python": 0, "etcd": 0}
    for where, argv in _commands(merged):
        # Commands read the PD list from the service's environment, as in the container.
        service = merged["services"][where.split()[0]]
        monkeypatch.setenv("SBP_PD", service["environment"]["SBP_PD"])
        parser = _strict(build_parser())
        program = argv[0]
        assert program in checked, f"{where}: unknown program {program!r} in {argv}"
        checked[program] += 1
        if program == "sbp":
            try:
                args = parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse with the sbp CLI")
            assert getattr(args, "command", "").startswith("sbp "), (
                f"{where}: `{shlex.join(argv)}` names no sbp subcommand")
        elif program == "spark-submit":
            scripts = [a for a in argv if a.endswith(".py")]
            assert len(scripts) == 1, f"{where}: expected one script in {argv}"
            script = REPO / scripts[0]
            assert script.is_file(), f"{where}: {scripts[0]} does not exist"
            script_args = argv[argv.index(scripts[0]) + 1:]
            try:
                _strict(_load_script(script).build_parser()).parse_args(script_args)
            except SystemExit:
                pytest.fail(f"{where}: {script_args} do not parse with {scripts[0]}")
        elif program == "spark-class":
            assert argv[1] in SPARK_CLASSES, f"{where}: unknown Spark class {argv[1]}"
        elif program == "python":
            assert argv[1] == "-c", f"{where}: {argv}"
            compile(argv[2], f"<{where}>", "exec")
        elif program == "etcd":
            flags = argv[1::2]
            assert set(flags) <= ETCD_FLAGS and len(argv) % 2 == 1, (
                f"{where}: etcd flags {flags} are not all known ones with a value each")
    assert all(checked.values()), f"some kind of command is no longer checked: {checked}"


def test_addresses_point_at_services_and_their_ports(merged):
    services = merged["services"]
    listening: dict[str, str] = {}
    for name, service in services.items():
        argv = _argvs(service["command"])[0]
        if argv[0] == "sbp" and argv[1] in ("pd", "range-server"):
            advertised = _option(argv, "--advertise-addr")
            host = advertised.rsplit(":", 1)[0]
            assert advertised.endswith(f":{_option(argv, '--port')}") and host in (
                name, "127.0.0.1"), f"{name} advertises {advertised}, not itself and its port"
            assert _option(argv, "--host") == ("0.0.0.0" if host == name else host), (
                f"{name} must listen where it advertises")
            listening[name] = advertised
    etcd = _argvs(services["etcd"]["command"])[0]
    etcd_url = _option(etcd, "--advertise-client-urls")
    assert etcd_url.removeprefix("http://").split(":")[-1] == _option(
        etcd, "--listen-client-urls").split(":")[-1], "etcd advertises another port"
    for name in PD_NODES:
        argv = _argvs(services[name]["command"])[0]
        assert f"http://{_option(argv, '--etcd')}" == etcd_url, f"{name} asks another etcd"
        assert _option(argv, "--name") == name
        (check,) = _argvs(services[name]["healthcheck"]["test"])
        assert _option(check, "--pd") == listening[name], f"{name}'s health check asks another"
    for name, service in services.items():
        assert service["environment"]["SBP_PD"] == ",".join(listening[n] for n in PD_NODES), name
        if name.startswith("rs"):
            (check,) = _argvs(service["healthcheck"]["test"])
            assert _option(check, "--range-server") == listening[name], (
                f"{name}'s health check asks about another server")
    master_cmd = _argvs(services["spark-master"]["command"])[0]
    master_url = f"spark://{_option(master_cmd, '--host')}:{_option(master_cmd, '--port')}"
    for where, argv in _commands(merged):
        master = _option(argv, "--master") or (argv[2] if argv[:2] == [
            "spark-class", "org.apache.spark.deploy.worker.Worker"] else None)
        if master is not None:
            assert master == master_url, where


def _normalized(argv: list[str], hosts: set[str]) -> list[str]:
    """``argv`` with host names, addresses and port numbers blanked out."""
    names = "|".join(re.escape(h) for h in sorted(hosts, key=len, reverse=True))
    out = []
    for arg in argv:
        arg = re.sub(rf"(?<![\w-])({names})(?![\w-])", "HOST", arg)
        out.append(re.sub(r"(?<!\w)\d{4,5}(?!\w)", "PORT", arg))
    return out


def test_the_host_override_changes_addresses_and_ports_only(compose, host_override):
    assert set(host_override["services"]) == set(compose["services"])
    hosts = {*compose["services"], "0.0.0.0", "127.0.0.1", "localhost"}
    for name, over in host_override["services"].items():
        assert over["network_mode"] == "host", name
        assert set(over) <= {"network_mode", "environment", "command", "healthcheck"}, name
        base = compose["services"][name]
        pairs = [(base["command"], over["command"])]
        if "healthcheck" in over:
            pairs.append((base["healthcheck"]["test"], over["healthcheck"]["test"]))
        for mine, theirs in pairs:
            assert _normalized([str(a) for a in mine], hosts) == _normalized(
                [str(a) for a in theirs], hosts), f"{name}: {theirs} is not {mine} moved"


def test_data_lives_in_named_volumes(compose):
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        argv = _argvs(service["command"])[0]
        data_dir = _option(argv, "--data-dir")
        mounts = dict(v.split(":", 1) for v in service.get("volumes", []))
        assert set(mounts) <= declared, f"{name} mounts undeclared volumes {set(mounts)}"
        if data_dir is not None:
            assert data_dir in mounts.values(), f"{name} keeps {data_dir} outside a volume"


def test_dependencies_wait_for_health_checks(compose):
    services = compose["services"]
    for name, service in services.items():
        for target, rule in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            if rule.get("condition") == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no healthcheck"


def _docker_ignores(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore ``patterns`` leave ``path`` out of the build context: the last
    pattern matching the path or one of its parent directories decides (``!`` keeps)."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        glob = pattern.lstrip("!").rstrip("/")
        if glob.startswith("**/"):
            hit = any(fnmatch.fnmatch(p.split("/")[-1], glob[3:]) for p in prefixes)
        else:
            hit = any(fnmatch.fnmatch(p, glob) and p.count("/") == glob.count("/")
                      for p in prefixes)
        if hit:
            ignored = not keep
    return ignored


def test_dockerfile_builds_what_the_services_run():
    text = (REPO / "Dockerfile").read_text()
    # A slim Debian bookworm by default (OpenJDK 17 and Python 3.11), any other by argument.
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", text, re.MULTILINE)
    assert re.findall(r"^FROM (\S+)", text, re.MULTILINE) == ["${BASE_IMAGE}"] * 2
    assert "openjdk-17-jre-headless" in text and "pip install --no-deps ." in text
    # The Spark services run pyspark, which the package only brings with its spark extra.
    [extras] = re.findall(r"^ARG SBP_EXTRAS=(\S*)$", text, re.MULTILINE)
    assert "spark" in extras.split(",")
    assert re.search(r"^USER sbp$", text, re.MULTILINE)
    assert re.search(r'^VOLUME \["/data"\]$', text, re.MULTILINE)
    assert re.search(r'^\s+CMD \["sbp", "cluster", "--pd-only"\]$', text, re.MULTILINE)

    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = [src for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.MULTILINE)
              for src in line.split()[:-1]]
    needed = ["sbp_spark/cli.py", "sbp_spark/protocol/_generated/__init__.py"]
    assert "integration/standalone/job.py" in copied
    for path in copied + needed:
        assert (REPO / path).exists(), f"the Dockerfile copies {path}, which does not exist"
        assert not _docker_ignores(path, patterns), (
            f".dockerignore leaves out {path}, which the image needs")
    for path in ("tests/test_compose.py", ".venv/bin/python", "sbp_spark/__pycache__/x.pyc"):
        assert _docker_ignores(path, patterns), f".dockerignore sends {path} to the build"
