"""What a machine needs to run Spark with this connector: pyspark, a Java 17+ runtime, and
Python workers that use the same interpreter (and so the same packages) as the driver.

Used by `sbp demo`, `sbp bench` and the test suite, so a missing pyspark or JVM fails in one
place with one message that says how to install it, instead of deep inside pyspark. The
package does not depend on pyspark (the command, client and servers run without it): the
connector runs in whatever pyspark the platform has.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

MIN_JAVA = 17

INSTALL_JAVA = (
    "Install a Java 17+ runtime and put 'java' on PATH (or set JAVA_HOME):\n"
    "  Debian/Ubuntu: sudo apt-get install -y openjdk-17-jre-headless\n"
    "  Fedora/RHEL:   sudo dnf install -y java-17-openjdk-headless\n"
    "  macOS:         brew install openjdk@17"
)


INSTALL_PYSPARK = (
    "pip install 'sbp-spark[spark]' adds it (or install the pyspark of your Spark cluster's "
    "version: pip install 'pyspark==4.x.y')"
)


class JavaNotFoundError(RuntimeError):
    """No usable Java runtime for Spark."""


class PysparkNotFoundError(RuntimeError):
    """pyspark cannot be imported in this Python."""


def check_pyspark(needed_by: str, alternative: str = "") -> None:
    """Raise PysparkNotFoundError, saying that ``needed_by`` needs pyspark and how to install
    it (then ``alternative``, a way to do without), when this Python cannot import pyspark.
    Looks the module up without importing it, and so also finds a pyspark on PYTHONPATH (a
    Spark distribution's python/ directory)."""
    try:
        found = importlib.util.find_spec("pyspark") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        found = False
    if not found:
        raise PysparkNotFoundError(
            f"{needed_by} needs pyspark, which this Python ({sys.executable}) cannot import: "
            f"{INSTALL_PYSPARK}" + (f"; {alternative}" if alternative else ""))


def java_executable() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("java")


def java_major_version(java: str) -> int | None:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8" means Java 8


def check_java() -> int:
    """The Java major version, or JavaNotFoundError saying how to install Java 17+."""
    java = java_executable()
    if java is None:
        raise JavaNotFoundError(f"Spark needs Java {MIN_JAVA}+ and none was found.\n{INSTALL_JAVA}")
    major = java_major_version(java)
    if major is None:
        raise JavaNotFoundError(
            f"'{java} -version' did not run or print a version.\n{INSTALL_JAVA}")
    if major < MIN_JAVA:
        raise JavaNotFoundError(
            f"Spark needs Java {MIN_JAVA}+, but {java} is Java {major}.\n{INSTALL_JAVA}")
    return major


def use_this_python_for_workers() -> None:
    """Make Spark's Python workers run this interpreter (else they miss pyarrow and sbp_spark)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable


def local_spark_session(app_name: str = "sbp-spark", master: str = "local[2]", **conf: str):
    """A local SparkSession with the sbp source registered (``sbp_spark.register``: no filter
    pushdown; call ``register(spark, filter_pushdown=True)`` on it for pushdown), after
    checking pyspark (``PysparkNotFoundError`` without one, ``PysparkUnsupportedError`` for one
    without Python data sources) and Java.

    ``conf`` entries are Spark settings (e.g. ``**{"spark.sql.shuffle.partitions": "2"}``).
    """
    check_pyspark("a Spark session")
    from sbp_spark.spark.pyspark_api import found

    found().require_data_sources()  # a pyspark without Python data sources (before 4.0)
    check_java()
    use_this_python_for_workers()
    # Everything runs on this machine: Spark listens on loopback only (and does not warn that
    # the host name resolves to it).
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    from sbp_spark import register

    register(spark)
    return spark
