"""format("sbp") against a cluster that authenticates (issue 44 items 4 and 5): the token and
tokenFile options, refusals surfaced unchanged and not retried, a revocation failing a running
streaming query with the clear error, and tokens that never show in plans or logs."""

from __future__ import annotations

import logging
import time

import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.messages import Permission
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.spark.options import OptionError, parse_read_options
from tests.polling import wait_until
from tests.server.auth.keys import Keys


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory, keys):
    auth = keys.settings()
    with EmbeddedCluster(tmp_path_factory.mktemp("auth-spark"), range_servers=1,
                         auth=auth) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def root(auth_cluster, keys):
    with ConnectionPool() as pool:
        yield SbpClient(auth_cluster.pd_address, pool=pool, token=keys.token("root"))


def _grant(root, auth_cluster, *permissions: Permission) -> None:
    version = root.pd.grant_permissions(list(permissions))
    wait_until(lambda: all(rs.permissions.table().version >= version
                           for rs in auth_cluster.range_servers),
               "the range servers to learn the grant", 10)


def test_token_options_reach_the_client_and_are_never_printed(tmp_path, keys):
    token = keys.token("reader")
    parsed = parse_read_options({"pd": "127.0.0.1:1", "streams": "1", "token": token})
    assert parsed.client.client_config().token == token
    assert token not in repr(parsed) and token not in repr(parsed.client.client_config())
    token_file = tmp_path / "reader.token"
    token_file.write_text(token + "\n")
    parsed = parse_read_options({"pd": "127.0.0.1:1", "streams": "1",
                                 "tokenFile": str(token_file)})
    assert parsed.client.token is None and parsed.client.client_config().token == token
    with pytest.raises(OptionError, match="give one"):
        parse_read_options({"pd": "127.0.0.1:1", "streams": "1", "token": token,
                            "tokenFile": str(token_file)})
    with pytest.raises(OptionError) as empty:
        parse_read_options({"pd": "127.0.0.1:1", "streams": "1", "token": " "})
    assert "is empty" in str(empty.value)


def test_read_with_a_token_and_a_refusal_surfaced_unchanged(spark, auth_cluster, root, keys,
                                                            tmp_path, caplog):
    [stream] = root.create_streams(1)
    root.append(stream.stream_id, [batch_bytes(b"row %d" % i) for i in range(10)])
    _grant(root, auth_cluster, Permission("reader", "read", str(stream.stream_id)))
    token = keys.token("reader")
    token_file = tmp_path / "reader.token"
    token_file.write_text(token)
    # Our loggers at their most talkative (py4j's DEBUG log echoes every call made to the JVM,
    # the option's value included: that is the caller's own call, not ours).
    with caplog.at_level(logging.DEBUG, logger="sbp_spark"):
        by_token = (spark.read.format("sbp").option("pd", auth_cluster.pd_address)
                    .option("streams", str(stream.stream_id)).option("token", token).load())
        plans = [by_token._jdf.queryExecution().toString(),
                 by_token._sc._jvm.PythonSQLUtils.explainString(
                     by_token._jdf.queryExecution(), "formatted")]
        assert by_token.count() == 10
        by_file = (spark.read.format("sbp").option("pd", auth_cluster.pd_address)
                   .option("streams", str(stream.stream_id))
                   .option("tokenFile", str(token_file)).load())
        plans.append(by_file._jdf.queryExecution().toString())
        assert by_file.count() == 10
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("sbp_spark"))
    for text in (*plans, ours):
        assert token not in text
    # Another principal: refused with the server's words, at once (not retried).
    stranger = (spark.read.format("sbp").option("pd", auth_cluster.pd_address)
                .option("streams", str(stream.stream_id))
                .option("token", keys.token("stranger")).load())
    began = time.monotonic()
    with pytest.raises(Exception) as refused:
        stranger.count()
    assert "PERMISSION_DENIED" in str(refused.value)
    assert "principal 'stranger' may not" in str(refused.value)
    assert time.monotonic() - began < 30


def test_a_revocation_fails_a_running_streaming_query(spark, auth_cluster, root, keys,
                                                      tmp_path):
    [stream] = root.create_streams(1)
    root.append(stream.stream_id, [batch_bytes(b"first")])
    _grant(root, auth_cluster, Permission("tail", "read", str(stream.stream_id)))
    query = (spark.readStream.format("sbp").option("pd", auth_cluster.pd_address)
             .option("streams", str(stream.stream_id)).option("token", keys.token("tail"))
             .option("startingOffsets", "earliest").load()
             .writeStream.format("memory").queryName("auth_tail")
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(processingTime="200 milliseconds").start())
    try:
        wait_until(lambda: query.exception() is not None
                   or spark.sql("select count(*) c from auth_tail").first().c >= 1,
                   "the query to read the first record", 60)
        assert query.exception() is None, query.exception()
        root.pd.revoke_permissions([Permission("tail", "read", str(stream.stream_id))])
        root.append(stream.stream_id, [batch_bytes(b"second")])
        with pytest.raises(Exception) as failed:  # awaitTermination raises the query's error
            query.awaitTermination(120)
        error = query.exception()
        assert error is not None, "the query went on after the revocation"
        for text in (str(error), str(failed.value)):
            assert "PERMISSION_DENIED" in text and "principal 'tail' may not" in text
    finally:
        query.stop()


@pytest.mark.spark  # a Spark of its own, in a subprocess: the session's runs without a UI
def test_the_spark_ui_never_shows_the_token(pd, tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    done = subprocess.run([sys.executable, str(REPO / "tests" / "spark" / "ui_job.py"), pd],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["rows"] == 100 and result["pages"] == 9
    # What was searched does show the queries' plans and the settings.
    assert result["sql_api_shows_the_plans"] and result["environment_shows_settings"]
    assert result["token_in"] == [], f"the token shows in {result['token_in']}"
