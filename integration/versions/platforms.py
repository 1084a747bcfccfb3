"""The platforms of the version matrix and their virtualenvs, built once and kept.

A platform is a Python and a pyspark as a Spark platform installs them; the package goes in
beside. Making one costs minutes and hundreds of MB (pyspark alone is about 400 MB), so each is
made once and kept in ``$SBP_VERSIONS_DIR`` (default ``~/.cache/sbp-spark-versions``), under
a key of what went into it: the platform, the exact Python, and the dependencies the wheel
declares. A test run only installs its freshly built wheel again. An entry is complete once
its ``ready.json`` exists; one without it (a build that was killed) is made anew, and a new
entry replaces the older ones of its platform.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

CACHE_ENV = "SBP_VERSIONS_DIR"
PIP_TIMEOUT_S = 1800
# Bump when the way an entry is made changes, so older entries are made anew.
ENTRY_FORMAT = 1
# pyspark 4.3 warns that it does not fully support pandas 3 yet (pyspark[connect] needs pandas).
CONNECT_CONSTRAINTS = ("pandas<3",)


@dataclass(frozen=True)
class Platform:
    """One column of the matrix."""

    id: str  # the test id: "4.0" or "no-pyspark"
    python: str  # "3.10"
    pyspark: str | None  # pip's requirement ("pyspark==4.0.*"); None: a host without Spark
    floors: bool = False  # every runtime dependency of the wheel at exactly its floor
    connect: bool = False  # pyspark[connect]'s packages beside it, for the Connect case

    @property
    def label(self) -> str:
        what = "no pyspark" if self.pyspark is None else f"pyspark {self.id}"
        return f"{what}, Python {self.python}" + (", floors" if self.floors else "")


# Oldest pyspark with the oldest Python and dependency floors; each newer pyspark on a newer
# Python, so that every Python the classifiers name runs the cases.
PLATFORMS = (
    Platform("4.0", "3.10", "pyspark==4.0.*", floors=True, connect=True),
    Platform("4.1", "3.11", "pyspark==4.1.*", connect=True),
    Platform("4.2", "3.12", "pyspark==4.2.*", connect=True),
    Platform("4.3", "3.13", "pyspark==4.3.*", connect=True),
)
NO_PYSPARK = Platform("no-pyspark", "3.10", None)


class PlatformError(RuntimeError):
    """A platform's virtualenv could not be made, or the wheel not installed in it."""


def cache_dir() -> Path:
    path = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sbp-spark-versions")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _python_env_var(version: str) -> str:
    return "SBP_PYTHON_" + version.replace(".", "_")


def find_python(version: str) -> Path:
    """An interpreter of Python ``version`` ("3.10"): ``$SBP_PYTHON_3_10``, a pyenv version,
    or ``python3.10`` on PATH; PlatformError saying where it looked when there is none."""
    candidates = [os.environ.get(_python_env_var(version), "")]
    candidates += sorted(glob.glob(str(Path.home() / f".pyenv/versions/{version}.*/bin/python3")),
                         reverse=True)
    candidates += [shutil.which(f"python{version}") or "", sys.executable]
    for candidate in filter(None, candidates):
        try:
            done = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2]); "
                                  "print(sys.executable)"],
                capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        lines = done.stdout.split()
        if done.returncode == 0 and len(lines) == 2 and lines[0] == version:
            return Path(lines[1])
    raise PlatformError(
        f"no Python {version} found (looked at ${_python_env_var(version)}, "
        f"~/.pyenv/versions/{version}.*, python{version} on PATH): install one, or set "
        f"{_python_env_var(version)} to its interpreter")


def floor_pins(requirements: list[str]) -> list[str]:
    """``name==X`` for each ``name>=X`` of ``requirements``; PlatformError for one without a
    floor (it could not be tested at its oldest)."""
    pins = []
    for requirement in requirements:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)\s*(,.*)?", requirement)
        if not match:
            raise PlatformError(f"runtime requirement {requirement!r} has no floor (>=X) to "
                                "test at")
        pins.append(f"{match.group(1)}=={match.group(2)}")
    return pins


def _clean_env() -> dict[str, str]:
    """This environment without what would make a virtualenv's Python see other packages."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PYSPARK_", "SPARK_")) and k != "VIRTUAL_ENV"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(argv: list[str], what: str, timeout: float = PIP_TIMEOUT_S) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=_clean_env(), stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise PlatformError(f"{what} failed ({' '.join(argv)}):\n"
                            + (done.stdout[-2000:] + done.stderr[-4000:]).strip())
    return done.stdout


@dataclass
class Venv:
    """A platform's virtualenv in the cache; ``record`` is what was found when it was made."""

    platform: Platform
    entry: Path
    record: dict = field(default_factory=dict)

    @property
    def bin(self) -> Path:
        return self.entry / "venv" / "bin"

    @property
    def python(self) -> str:
        return str(self.bin / "python")

    @property
    def connect_dir(self) -> Path | None:
        path = self.entry / "connect"
        return path if self.record.get("connect_error") is None and path.is_dir() else None

    def pip(self, *args: str, what: str) -> str:
        return _run([self.python, "-m", "pip", *args], what)

    def packages(self) -> dict[str, str]:
        """Installed distributions: normalized name -> version."""
        listed = json.loads(self.pip("list", "--format=json", what="pip list"))
        return {dist_name(p["name"]): p["version"] for p in listed}

    def install_wheel(self, wheel: Path) -> dict:
        """Install ``wheel`` the way a user would (dependencies resolved against what is
        there) after removing an older one; return what pip installed and what changed."""
        with contextlib.suppress(PlatformError):
            self.pip("uninstall", "-y", "sbp-spark", what="removing the previous wheel")
        before = self.packages()
        report = self.entry / "install-report.json"
        self.pip("install", "--report", str(report), str(wheel), what="installing the wheel")
        after = self.packages()
        installed = [f"{dist_name(i['metadata']['name'])}=={i['metadata']['version']}"
                     for i in json.loads(report.read_text())["install"]]
        changed = {name: [before.get(name), after.get(name)]
                   for name in sorted(set(before) | set(after))
                   if before.get(name) != after.get(name) and name != "sbp-spark"}
        return {"installed": installed, "changed": changed, "pyspark": after.get("pyspark"),
                "packages": after}


def dist_name(name: str) -> str:
    """A distribution's name as pip lists it normalized (PEP 503): ``PyJWT`` -> ``pyjwt``,
    ``prometheus_client`` -> ``prometheus-client``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _key(platform: Platform, python_version: str, requirements: list[str]) -> str:
    material = json.dumps({"format": ENTRY_FORMAT, "platform": asdict(platform),
                           "python": python_version, "requires": sorted(requirements),
                           "connect": CONNECT_CONSTRAINTS}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:12]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (two runs never make one entry at once)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_CONNECT_REQUIREMENTS = """
import sys
from importlib.metadata import requires
for r in requires("pyspark") or []:
    spec, _, marker = r.partition(";")
    if "extra" in marker and '"connect"' in marker:
        print(spec.strip())
"""


def _add_connect_packages(venv: Venv) -> None:
    """pyspark[connect]'s packages, but pyspark and pyarrow (the platform's own), into
    ``entry/connect``: the Connect case puts them on its path, so the platform itself keeps
    only pyspark and what the wheel needs. A failure is recorded, not raised: that case then
    says pyspark[connect] did not install."""
    try:
        wanted = _run([venv.python, "-c", _CONNECT_REQUIREMENTS],
                      "reading pyspark's connect extra").split()
        wanted = [r for r in wanted
                  if dist_name(re.split(r"[<>=!~ ]", r, maxsplit=1)[0]) not in
                  ("pyspark", "pyarrow")]
        constraints = venv.entry / "connect-constraints.txt"
        constraints.write_text("\n".join(CONNECT_CONSTRAINTS) + "\n")
        venv.pip("install", "--target", str(venv.entry / "connect"), "-c", str(constraints),
                 *wanted, what="installing pyspark[connect]'s packages")
        venv.record["connect_packages"] = wanted
    except PlatformError as exc:
        venv.record["connect_error"] = str(exc)


def _make(venv: Venv, python: Path, requirements: list[str], wheel: Path) -> None:
    platform = venv.platform
    shutil.rmtree(venv.entry, ignore_errors=True)
    venv.entry.mkdir(parents=True)
    started = time.monotonic()
    _run([str(python), "-m", "venv", str(venv.entry / "venv")], "python -m venv")
    venv.pip("install", "-q", "--upgrade", "pip", what="upgrading pip")
    platform_requirements = [platform.pyspark] if platform.pyspark else []
    if platform.floors:
        platform_requirements += floor_pins(requirements)
    if platform_requirements:
        venv.pip("install", *platform_requirements,
                 what=f"installing the platform ({' '.join(platform_requirements)})")
    before = venv.packages()
    # The first install of the wheel into the platform as it came: what pip added or changed
    # then is the answer to "does sbp-spark leave my pyspark alone".
    first = venv.install_wheel(wheel)
    venv.pip("uninstall", "-y", "sbp-spark", what="removing the wheel")
    venv.record.update({"platform": asdict(platform), "python": str(python),
                        "platform_requirements": platform_requirements,
                        "platform_packages": before, "first_install": first})
    if platform.connect:
        _add_connect_packages(venv)
    venv.record["build_seconds"] = round(time.monotonic() - started, 1)
    (venv.entry / "ready.json").write_text(json.dumps(venv.record, indent=1, sort_keys=True))


def prepare(platform: Platform, wheel_requirements: list[str], wheel: Path) -> Venv:
    """The platform's virtualenv from the cache, made first if it is not there (under a lock),
    with ``wheel`` installed afresh; ``record["install"]`` says what that install did."""
    python = find_python(platform.python)
    version = _run([str(python), "-c", "import sys; print(sys.version.split()[0])"],
                   f"{python} --version").strip()
    cache = cache_dir()
    name = f"{platform.id}-py{version}"
    entry = cache / f"{name}-{_key(platform, version, wheel_requirements)}"
    venv = Venv(platform, entry)
    with _locked(cache / f"{platform.id}.lock"):
        ready = entry / "ready.json"
        if ready.exists():
            venv.record = json.loads(ready.read_text())
        else:
            for older in cache.glob(f"{platform.id}-py*"):
                if older != entry and older.is_dir():
                    shutil.rmtree(older, ignore_errors=True)
            _make(venv, python, wheel_requirements, wheel)
        venv.record["install"] = venv.install_wheel(wheel)
    return venv


# -- the table printed at the end of a run --------------------------------------------------

# (row, column) -> what happened, filled by the tests as they run.
OUTCOMES: dict[tuple[str, str], str] = {}


def record(row: str, column: str, outcome: str) -> None:
    OUTCOMES[(row, column)] = outcome


def format_table() -> str:
    """OUTCOMES as a Markdown table: a row per case, a column per platform."""
    rows = list(dict.fromkeys(r for r, _ in OUTCOMES))
    columns = list(dict.fromkeys(c for _, c in OUTCOMES))
    lines = ["| case | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    for row in rows:
        cells = [OUTCOMES.get((row, c), "-") for c in columns]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
