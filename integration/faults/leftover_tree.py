"""Not a case of the suite (pytest collects it only when named): the run that
``test_leftovers.py`` starts in a pytest of its own and then kills with SIGKILL.

It starts what fault cases start (busy loops loading the CPU, a cluster of PD node, etcd and
range server processes, and with ``SBP_LEFTOVER_NETWORK=1`` network namespaces with the servers
and a writer driver on nodes of their own), writes their pids to the file
``SBP_LEFTOVER_READY`` names, and waits to be killed.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import ExitStack
from pathlib import Path

from integration.netlab.reaper import identity
from sbp_spark.server.cluster import ProcessCluster

from .helpers import busy_cores

# Longer than the killing test waits for this one to be ready and to kill it.
WAIT_TO_BE_KILLED_S = 600


def test_a_run_to_kill(tmp_path: Path) -> None:
    ready = Path(os.environ["SBP_LEFTOVER_READY"])
    with ExitStack() as stack:
        spinners = stack.enter_context(busy_cores(2))
        processes = {f"busy loop {i}": p.pid for i, p in enumerate(spinners)}
        namespaces: list[str] = []
        if os.environ.get("SBP_LEFTOVER_NETWORK") == "1":
            from .lab import Lab

            lab = stack.enter_context(Lab(tmp_path, range_servers=1, clients=["w1"],
                                          pd_nodes=1))
            cluster = lab.cluster
            sid = lab.client.create_streams(1)[0].stream_id
            writer = lab.writer("w1", sid)
            writer.wait_for(8)
            processes["writer driver"] = writer.proc.pid
            namespaces = lab.net.namespaces
        else:
            cluster = stack.enter_context(ProcessCluster(tmp_path, range_servers=1, pd_nodes=1))
        assert cluster.etcd is not None
        processes.update({f"etcd member {i}": pid for i, pid in enumerate(cluster.etcd.pids)
                          if pid is not None})
        processes.update({f"PD node {i}": p.pid for i, p in enumerate(cluster.pd_nodes)
                          if p is not None})
        processes.update({f"range server {i}": p.pid for i, p in enumerate(cluster.range_servers)
                          if p is not None})
        ready.write_text(json.dumps({
            "processes": {name: identity(pid) for name, pid in processes.items()},
            "namespaces": namespaces}))
        threading.Event().wait(WAIT_TO_BE_KILLED_S)
        raise AssertionError(f"not killed within {WAIT_TO_BE_KILLED_S} s")
