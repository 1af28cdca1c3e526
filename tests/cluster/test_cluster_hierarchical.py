"""The hierarchical allreduce on a real namespace cluster: 2 hosts x 2 ranks, links at
1 Gbit/s, MPI over TCP, started by hvdliterun across the hosts. The rank script is the
one the single-machine tests run (there each rank names its "host" with
HVDLITE_HOST_ID; here the hosts are real), on a lighter set of dtypes: every reduction
and scaling, alone and grouped, several pipeline blocks, against numpy, same bits on
every rank, and the topology and the path taken as expected.
"""
import pytest

import harness
from cluster_harness import run_cluster_job

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("native")]


def test_two_hosts_of_two_allreduce_hierarchically(make_cluster):
    from test_hierarchical_allreduce import SCRIPT

    cluster = make_cluster(2, rate="1gbit")
    job = harness.assert_ok(run_cluster_job(cluster, "h1:2,h2:2", SCRIPT, timeout=500,
                                            args=("-", "", "int32,float16,float32,bool")))
    for rank in range(4):
        res = job.result(rank)
        assert not res["failures"], f"rank {rank}:\n" + "\n".join(res["failures"][:20])
        assert not res["disagree"], f"rank {rank}: ranks hold different bits for {res['disagree']}"
        # hvdliterun places ranks 0, 1 on h1 and 2, 3 on h2.
        assert res["topology"] == [rank % 2, 2, rank // 2, 2], res["topology"]
        assert res["stats"]["hierarchical_collectives"] == res["allreduces"], res["stats"]
