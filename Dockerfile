# One image for every service of docker-compose.yml: the SBP placement driver and range
# servers (`sbp pd`, `sbp range-server`), the Spark master and worker (pyspark's own
# spark-class), and the job container (spark-submit integration/standalone/job.py).
#
# BASE_IMAGE is any Debian bookworm image: bookworm packages OpenJDK 17, the Java this project
# is tested with (Spark 4 needs 17+), and Python 3.11. Without a registry, make one locally and
# pass it in (integration/docker/run_cluster.py does this with debootstrap):
#     docker build --build-arg BASE_IMAGE=sbp-spark-base:bookworm -t sbp-spark:local .
ARG BASE_IMAGE=debian:bookworm-slim

# -- build: a virtualenv with the package, its dependencies and SBP_EXTRAS -------------------
FROM ${BASE_IMAGE} AS build
# A package index for pip (a mirror), and CA certificates (PEM text) to trust besides the
# usual ones, for networks that inspect HTTPS. Build arguments of this stage only: none of
# them reaches the image.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG EXTRA_CA_CERTS
# The extras installed with the package: spark gives the Spark master, worker and job their
# pyspark (the package itself needs none: the PD and range servers run without it); bench
# gives `sbp bench --plot` its chart.
ARG SBP_EXTRAS=spark,bench

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && cp /etc/ssl/certs/ca-certificates.crt /etc/pip-ca.pem \
    && if [ -n "$EXTRA_CA_CERTS" ]; then printf '%s\n' "$EXTRA_CA_CERTS" >> /etc/pip-ca.pem; fi
ENV PIP_CERT=/etc/pip-ca.pem \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, from pyproject.toml alone, so editing the code does not download and
# build pyspark (a 450 MB source archive) again.
WORKDIR /src
COPY pyproject.toml ./
RUN python3 -m venv /opt/venv \
    && python3 -c 'import sys, tomllib; project = tomllib.load(open("pyproject.toml", "rb"))["project"]; extras = [e for e in sys.argv[1].split(",") if e]; print("\n".join(project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]))' "$SBP_EXTRAS" > requirements.txt \
    && /opt/venv/bin/pip install -r requirements.txt

COPY README.md LICENSE pyspark_sbp.py ./
COPY sbp_spark ./sbp_spark
# pip and setuptools only install: the image runs what is installed.
RUN /opt/venv/bin/pip install --no-deps . \
    && /opt/venv/bin/sbp --help > /dev/null \
    && /opt/venv/bin/pip uninstall -y -q pip setuptools

# -- runtime: Python, the JRE and the virtualenv, nothing used only to build ---------------
FROM ${BASE_IMAGE}

# Leave out manuals, docs and translations, as slim images do, whatever the base; man1 must
# still exist: the JRE's post-install step fails when it cannot link java's manual page.
# procps: Spark's launch scripts call `ps`. etcd-server: the etcd service and `sbp server
# --pd-nodes` run Debian's etcd.
RUN printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
        'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
        'path-exclude /usr/share/locale/*' > /etc/dpkg/dpkg.cfg.d/01-sbp-slim \
    && mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3 openjdk-17-jre-headless procps \
        etcd-server \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log

COPY --from=build /opt/venv /opt/venv

# Spark's Python workers must use the interpreter that has pyarrow and sbp_spark.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    PYSPARK_DRIVER_PYTHON=/opt/venv/bin/python

# Named volumes mounted on /data start out with this directory's owner, so the servers can
# write there without running as root.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin sbp \
    && mkdir -p /data /spark-work \
    && chown sbp:sbp /data /spark-work
WORKDIR /opt/sbp-spark
COPY integration/standalone/job.py integration/standalone/job.py

USER sbp
VOLUME ["/data"]
# Asks the PD for its members ($SBP_PD, default 127.0.0.1:2378), rather than probing a port:
# healthy means the PD answers requests. docker-compose.yml gives range servers their own
# check (is this server live in the PD's eyes) and the Spark services theirs.
HEALTHCHECK --interval=10s --timeout=10s --start-period=20s --retries=3 \
    CMD ["sbp", "cluster", "--pd-only"]
CMD ["sbp", "--help"]
