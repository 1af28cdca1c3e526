"""The hierarchical collectives on a real namespace cluster: 2 hosts (2 x 2 and 3 + 1
ranks), links at 1 Gbit/s, MPI over TCP, started by
hvdliterun across the hosts. The rank scripts are the ones the single-machine tests run
(there each rank names its "host" with HVDLITE_HOST_ID; here the hosts are real).
Allreduce, on a lighter set of dtypes: every reduction and scaling, alone and grouped,
several pipeline blocks, against numpy, same bits on every rank, and the topology and
the path taken as expected. Allgather and broadcast: uneven first dims, groups, every
root, several chunks, against numpy.
"""
import pytest

import harness
from cluster_harness import run_cluster_job

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("native")]


@pytest.mark.parametrize("hosts", ["h1:2,h2:2", "h1:3,h2:1"])
def test_allreduce_across_hosts(make_cluster, hosts):
    # 2 x 2: shards across hosts; 3 + 1: through the hosts' leaders.
    from test_hierarchical_allreduce import SCRIPT

    cluster = make_cluster(2, rate="1gbit")
    dtypes = "int32,float16,float32,bool" if hosts == "h1:2,h2:2" else "int32,float32"
    job = harness.assert_ok(run_cluster_job(cluster, hosts, SCRIPT, timeout=500,
                                            args=("-", "", dtypes),
                                            env={"HVDLITE_HIERARCHICAL_ALLGATHER": "0"}))
    # hvdliterun places ranks host after host.
    first = int(hosts.split(",")[0].split(":")[1])
    local_rank = [r if r < first else r - first for r in range(4)]
    for rank in range(4):
        res = job.result(rank)
        assert not res["failures"], f"rank {rank}:\n" + "\n".join(res["failures"][:20])
        assert not res["disagree"], f"rank {rank}: ranks hold different bits for {res['disagree']}"
        same_local = [r for r in range(4) if local_rank[r] == local_rank[rank]]
        local_size = first if rank < first else 4 - first
        assert res["topology"] == [local_rank[rank], local_size, same_local.index(rank),
                                   len(same_local)], res["topology"]
        assert res["stats"]["hierarchical_collectives"] == res["allreduces"], res["stats"]


@pytest.mark.parametrize("hosts", ["h1:2,h2:2", "h1:3,h2:1"])
def test_allgather_and_broadcast_go_through_the_hosts_leaders(make_cluster, hosts):
    # The single-machine tests' script (uneven first dims, groups, every root, several
    # pipeline chunks) on real hosts, 2 x 2 and 3 + 1, against numpy.
    from test_hierarchical_gather_broadcast import SCRIPT

    cluster = make_cluster(2, rate="1gbit")
    job = harness.assert_ok(run_cluster_job(cluster, hosts, SCRIPT, timeout=500, args=("-",)))
    per_host = [int(h.split(":")[1]) for h in hosts.split(",")]
    for rank in range(4):
        res = job.result(rank)
        assert not res["failures"], f"rank {rank}:\n" + "\n".join(res["failures"][:20])
        host = 0 if rank < per_host[0] else 1
        assert res["topology"][1] == per_host[host], res["topology"]
        # Every allgather and broadcast took the leaders' path.
        assert res["stats"]["hierarchical_collectives"] == res["stats"]["collectives"] > 0, res["stats"]
