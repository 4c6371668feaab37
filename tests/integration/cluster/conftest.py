"""One real local 2-node Ray cluster (n0, n1; busybox; real runc) with a `dsec serve
--cluster` over it, per module that asks for it (test_node_loss.py: its drain and
node-loss tests share it; starting a cluster costs ~30 s). Module scope, not package:
the cluster is gone before the next module starts its own. Tests that change node states
leave them ready: a drained node is undrained, a killed node is restarted and waited for."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_nodes import TwoNodes


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    pytest.importorskip("ray")
    from dsec.api.launch import start_serve
    from dsec.cluster import local

    tmp = tmp_path_factory.mktemp("two-nodes")
    base = tmp / "c"
    c = local.up(base, 2, ["busybox"], log=lambda _m: None)
    srv = None
    try:
        # The box's own load (other work on a shared 2-core machine) must not refuse the
        # creates these tests place: the measured-load guard is not what they check.
        srv = start_serve(tmp / "api", {"DSEC_CLUSTER": c.address, **local.shared_env(c),
                                        "DSEC_OVERCOMMIT_THRESHOLD": "100"}, timeout=240)
        yield TwoNodes(c=c, base=base, srv=srv, tag=c.address.rpartition(":")[2])
    finally:
        if srv is not None:
            srv.proc.terminate()
            srv.proc.wait(60)
        local.down(base, log=lambda _m: None)
