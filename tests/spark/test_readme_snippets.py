"""The README's Python and SQL examples run as written, in order, against a cluster of their own
(streams made with the README's `sbp streams create`), and give what the README says."""

from __future__ import annotations

import re

import pytest

from sbp_spark.cli import main as sbp
from sbp_spark.server.cluster import EmbeddedCluster
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _records(spark, pd: str, stream: int) -> int:
    return spark.read.format("sbp").option("pd", pd).option("streams", str(stream)).load().count()


@pytest.mark.slow  # writes 110,000 rows and runs three streaming queries: about a minute
def test_the_readme_examples_run_as_written(spark, tmp_path, capsys):
    with EmbeddedCluster(str(tmp_path / "cluster"), range_servers=3) as cluster:
        pd = cluster.pd_address
        command = re.search(r"^sbp streams create .*?(?=\s+#)", README, flags=re.M).group(0)
        assert sbp(command.replace("127.0.0.1:2378", pd).split()[1:]) == 0
        assert capsys.readouterr().out.split() == ["1", "2", "3", "4"]

        namespace: dict = {}
        try:
            for block in _blocks("python"):
                code = (block.replace("127.0.0.1:2378", pd)
                        .replace("/tmp/out", str(tmp_path / "out"))
                        .replace("/tmp/chk", str(tmp_path / "chk")))
                exec(compile(code, "README.md", "exec"), namespace)
                if "relay" in namespace and namespace["relay"].isActive:
                    namespace["relay"].processAllAvailable()
                    namespace["relay"].stop()
                if "typed" in namespace and "read_back" not in namespace:
                    namespace["read_back"] = True
                    counts = namespace["df"].where("offset >= 1000").groupBy("stream_id").count()
                    assert dict(counts.collect()) == {1: 4000, 2: 9000}
                    assert namespace["typed"].columns == [
                        "id", "amount", "detail", "timestamp", "stream_id", "offset"]
                    assert namespace["typed"].count() == 1000
        finally:
            for query in spark.streams.active:
                query.stop()
            import sbp_spark
            from sbp_spark.spark.pyspark_api import found

            # as the session fixture has it
            sbp_spark.register(spark, filter_pushdown=found().filter_pushdown)

        assert spark.read.parquet(str(tmp_path / "out")).count() == 110_000
        assert _records(spark, pd, 4) == 110_000  # the relay
        assert namespace["df"].count() == 100_000  # stream 1 since 2026-11-24 09:00
        # events hold 1000 minutes from 08:00: 940 from 09:00 on; all were stored after it
        assert namespace["events"].where("timestamp >= '2026-11-24 09:00'").count() == 940
        assert namespace["stored"].count() == 1000

        for _ in range(3):
            assert sbp(["streams", "create", "--pd", pd]) == 0
        spark.range(5).selectExpr("id", "concat('user', id) AS name") \
            .createOrReplaceTempView("users")
        sql = "\n".join(line.split("  --")[0] for line in _blocks("sql")[0].splitlines())
        results = [spark.sql(statement.replace("127.0.0.1:2378", pd)).collect()
                   for statement in sql.split(";") if statement.strip()]
        assert [r.offset for r in results[2]] == [0, 1, 2, 3, 4]
        assert results[3][0][0] == 3
        assert [r.col_name for r in results[4]][:6] == [
            "stream_id", "range_index", "offset", "timestamp", "key", "value"]
        assert _records(spark, pd, 7) == 5  # DROP TABLE left the stream's records
