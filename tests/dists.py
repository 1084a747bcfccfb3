"""The sdist and wheel of this checkout, built as a packager builds them: ``python -m build``
(the sdist, then the wheel from the unpacked sdist) in an isolated build environment, from a
copy of the files git would check out. Built once per test process."""

from __future__ import annotations

import email.message
import email.parser
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class Distributions:
    sdist: Path
    wheel: Path

    def wheel_metadata(self) -> email.message.Message:
        """The wheel's METADATA file, parsed (its fields repeat: use ``get_all``)."""
        with zipfile.ZipFile(self.wheel) as wheel:
            [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
            return email.parser.Parser().parsestr(wheel.read(name).decode())

    def runtime_requirements(self) -> list[str]:
        """The wheel's Requires-Dist entries that no extra conditions."""
        return [r for r in self.wheel_metadata().get_all("Requires-Dist") or []
                if "extra ==" not in r]


def _checkout_copy(target: Path) -> Path:
    """The files of a fresh clone with this working tree's changes (tracked and new files,
    nothing git ignores): what a build from a clean checkout sees, without the checkout's own
    build leftovers (egg-info, build/)."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a file deleted in the working tree is still listed as cached
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def build_distributions(work: Path) -> Distributions:
    """Build the sdist and the wheel under ``work``; AssertionError with build's output if it
    fails."""
    source, out = _checkout_copy(work / "source"), work / "dist"
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(source)],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, "python -m build failed:\n" + done.stdout[-3000:] + \
        done.stderr[-3000:]
    [sdist], [wheel] = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    return Distributions(sdist, wheel)


_built: Distributions | None = None


def distributions(tmp_path_factory) -> Distributions:
    """This checkout's distributions, built on the first call of the test process."""
    global _built
    if _built is None:
        _built = build_distributions(tmp_path_factory.mktemp("distributions"))
    return _built
