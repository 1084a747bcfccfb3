"""``sbp consumers list|describe|delete`` as a user runs them: per stream the committed offset,
the end, the records and the time behind (from the records' timestamps), the last commit and
the generation, in a table or as JSON."""

from __future__ import annotations

import json

import pytest

from sbp_spark.cli import main
from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.records import batch_bytes
from tests.test_cli import _assert_one_line_error, cluster, sbp  # noqa: F401 (fixtures)


@pytest.mark.parametrize("argv", [["consumers", "list"], ["consumers", "describe"],
                                  ["consumers", "delete"]], ids=" ".join)
def test_every_consumers_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: sbp {' '.join(argv)}")


def test_a_consumer_is_listed_described_and_deleted(sbp, cluster):  # noqa: F811
    with SbpClient(cluster.pd_address, pool=ConnectionPool()) as client:
        stream = client.create_stream("clicks")
        # Ten records, one a batch, a second apart in their own timestamps.
        client.append(stream.stream_id, [
            batch_bytes(b"x", base_timestamp_ms=1_000_000 + i * 1000) for i in range(10)])
        client.consumers.join("dashboard")
        client.consumers.commit("dashboard", 1, {stream.stream_id: 3})

    status, out, err = sbp("consumers", "describe", "dashboard", "--json")
    assert status == 0, err
    [facts] = [json.loads(line) for line in out.splitlines()]
    assert facts["name"] == "dashboard" and facts["generation"] == 1
    [on] = facts["streams"]
    assert on["stream_id"] == stream.stream_id and on["stream_name"] == "clicks"
    assert (on["committed_offset"], on["end_offset"], on["records_behind"]) == (3, 10, 7)
    assert on["time_behind_ms"] == 6000  # the record at 9 minus the first unread, at 3
    assert on["last_commit_ms"] > 0 and on["lost_records"] == 0

    status, out, _ = sbp("consumers", "list")
    assert status == 0
    header, *rows = out.splitlines()
    assert header.split()[:7] == ["CONSUMER", "GENERATION", "STREAM", "COMMITTED", "END",
                                  "BEHIND", "BEHIND_MS"]
    row = next(r for r in rows if r.startswith("dashboard"))
    assert row.split()[:8] == ["dashboard", "1", str(stream.stream_id), "(clicks)", "3", "10",
                               "7", "6,000"]

    status, _, err = sbp("consumers", "describe", "dashboard", "nobody")
    _assert_one_line_error(status, err, "consumers describe", "no consumer is named 'nobody'")

    status, out, _ = sbp("consumers", "delete", "dashboard")
    assert status == 0 and out.strip() == "deleted consumer dashboard"
    status, out, _ = sbp("consumers", "list", "--json")
    assert "dashboard" not in out
    status, _, err = sbp("consumers", "delete", "dashboard")
    _assert_one_line_error(status, err, "consumers delete", "dashboard")
