"""format("sbp") against a cluster that requires mutual TLS: the tls.* options."""

from __future__ import annotations

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.spark.options import OptionError, parse_read_options


@pytest.fixture(scope="module")
def mtls_cluster(tmp_path_factory, certs):
    with EmbeddedCluster(tmp_path_factory.mktemp("mtls"), range_servers=1,
                         tls=certs.server_tls()) as cluster:
        yield cluster


def tls_options(certs) -> dict[str, str]:
    return {"tls.enabled": "true", "tls.caFile": certs.ca, "tls.certFile": certs.client_cert,
            "tls.keyFile": certs.client_key}


def test_tls_options_become_the_client_config(certs):
    parsed = parse_read_options({"pd": "127.0.0.1:1", "streams": "1", **tls_options(certs)})
    config = parsed.client.client_config()
    assert (config.tls, config.tls_ca_file, config.tls_cert_file, config.tls_key_file) == (
        True, certs.ca, certs.client_cert, certs.client_key)
    assert not parse_read_options({"pd": "127.0.0.1:1", "streams": "1"}
                                  ).client.client_config().tls


@pytest.mark.parametrize(("options", "message"), [
    ({"tls.enabled": "yes"}, "'tls.enabled'"),
    ({"tls.enabled": "true", "tls.caFile": "/no/such/ca.pem"}, "'tls.caFile'"),
    ({"tls.caFile": "CA"}, "needs 'tls.enabled' = true"),
    ({"tls.enabled": "true", "tls.certFile": "CERT"}, "go together"),
])
def test_bad_tls_options_name_the_option(certs, options, message):
    options = {k: certs.ca if v in ("CA", "CERT") else v for k, v in options.items()}
    with pytest.raises(OptionError, match=message):
        parse_read_options({"pd": "127.0.0.1:1", "streams": "1", **options})


def test_write_and_read_over_mutual_tls(spark, mtls_cluster, certs):
    config = ClientConfig(tls=True, tls_ca_file=certs.ca, tls_cert_file=certs.client_cert,
                          tls_key_file=certs.client_key)
    with ConnectionPool(config) as pool:
        [stream] = SbpClient(mtls_cluster.pd_address, config, pool).create_streams(1)
    rows = spark.createDataFrame([(b"k%d" % i, b"v%d" % i) for i in range(100)],
                                 "key binary, value binary")
    (rows.write.format("sbp").option("pd", mtls_cluster.pd_address)
     .option("stream", str(stream.stream_id)).options(**tls_options(certs))
     .mode("append").save())
    read = (spark.read.format("sbp").option("pd", mtls_cluster.pd_address)
            .option("streams", str(stream.stream_id)).options(**tls_options(certs)).load())
    assert sorted(bytes(r.value) for r in read.select("value").collect()) == sorted(
        b"v%d" % i for i in range(100))


def test_read_without_a_client_certificate_fails_clearly(spark, mtls_cluster, certs):
    options = {"tls.enabled": "true", "tls.caFile": certs.ca}
    with pytest.raises(Exception, match="certificate required|TLS"):
        (spark.read.format("sbp").option("pd", mtls_cluster.pd_address)
         .option("streams", "0").options(**options).load().count())
