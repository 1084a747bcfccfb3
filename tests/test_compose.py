"""docker-compose.yml and the Dockerfile cannot drift from the code: Docker is not needed here.

Every command a service or health check runs is checked against what it names: ``sbp ...``
lines parse with the real ``sbp`` parser, ``spark-submit`` scripts exist and their arguments
parse with the script's own parser, inline Python compiles, and the addresses the services
advertise point at services and ports that exist.
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
SPARK_CLASSES = {"org.apache.spark.deploy.master.Master",
                 "org.apache.spark.deploy.worker.Worker"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


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
    assert {"pd", "rs1", "rs2", "rs3", "spark-master", "spark-worker", "job"} <= set(services)
    for name, service in services.items():
        assert service.get("build") == ".", f"{name} is not built from this repository"
        assert "command" in service, name
    assert services["job"]["restart"] == "no"


def test_every_command_exists_with_its_flags(compose):
    parser = _strict(build_parser())
    checked = {"sbp": 0, "spark-submit": 0, "spark-class": 0, "python": 0}
    for where, argv in _commands(compose):
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
    assert all(checked.values()), f"some kind of command is no longer checked: {checked}"


def test_addresses_point_at_services_and_their_ports(compose):
    services = compose["services"]
    listening: dict[str, str] = {}
    for name, service in services.items():
        for argv in _argvs(service["command"]):
            if argv[0] == "sbp" and argv[1] in ("pd", "range-server"):
                advertised = _option(argv, "--advertise-addr")
                assert advertised == f"{name}:{_option(argv, '--port')}", (
                    f"{name} advertises {advertised}, not its own name and port")
                assert _option(argv, "--host") == "0.0.0.0", f"{name} must listen on all"
                listening[name] = advertised
    pd_addresses = set()
    for where, argv in _commands(compose):
        pd = _option(argv, "--pd")
        if pd is not None:
            pd_addresses.add(pd)
        master = _option(argv, "--master") or (argv[2] if argv[:2] == [
            "spark-class", "org.apache.spark.deploy.worker.Worker"] else None)
        if master is not None:
            master_cmd = _argvs(services["spark-master"]["command"])[0]
            assert master == f"spark://spark-master:{_option(master_cmd, '--port')}", where
    assert pd_addresses == {listening["pd"]}


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


def test_dockerfile_builds_what_the_services_run():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.MULTILINE)
    assert "openjdk-17-jre-headless" in text and "pip install ." in text
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    needed = ["pyproject.toml", "README.md", "pyspark_sbp.py", "sbp_spark/cli.py",
              "sbp_spark/protocol/_generated", "integration/standalone/job.py"]
    for path in needed:
        for pattern in ignored:
            parts = Path(path).parts
            prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
            assert not any(fnmatch.fnmatch(p, pattern.rstrip("/")) for p in prefixes), (
                f".dockerignore pattern {pattern!r} drops {path}, which the image needs")
