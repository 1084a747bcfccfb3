# One image for every service of docker-compose.yml: the SBP placement driver and range
# servers (`sbp pd`, `sbp range-server`), the Spark master and worker (pyspark's own
# spark-class), and the job container (spark-submit integration/standalone/job.py).
#
# The bookworm variant is pinned because it is the Debian release that packages OpenJDK 17,
# the Java this project is tested with (Spark 4 needs 17+).
FROM python:3.11-slim-bookworm

# procps: Spark's launch scripts call `ps`. The man1 directory: slim images drop it, and the
# JRE's post-install step fails when it cannot link java's manual page there.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*

# Spark's Python workers must use the interpreter that has pyarrow and sbp_spark.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYSPARK_PYTHON=python3 \
    PYSPARK_DRIVER_PYTHON=python3

WORKDIR /opt/sbp-spark
COPY . .
RUN pip install . \
    && useradd --create-home --uid 1000 sbp \
    && mkdir -p /data /spark-work \
    && chown sbp:sbp /data /spark-work

# Named volumes mounted on /data start out with this directory's owner, so the servers can
# write there without running as root.
USER sbp
VOLUME ["/data"]
CMD ["sbp", "--help"]
