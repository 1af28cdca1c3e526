"""Jobs across the hosts of a namespace cluster, started with hvdliterun -H through the
cluster's remote shell: topology (local/cross rank and size from the real host layout)
and every collective against values numpy computes from the ranks' known inputs.

Layouts: 2 hosts x 2 ranks, uneven 3 + 1, 1 rank per host (2 and 3 hosts), and ranks
placed round-robin over the hosts (hydra's -ppn 1: a host's ranks are not contiguous).
One job per layout checks everything and reports its failures in one result line. With
one rank per host, small ops carried by the coordination round (the direct exchange), and
the ranks of the cluster's hosts counted as sharing this machine's cores. A blocking call
that runs its own cycle there, MPI calls and all.
"""
import os

import pytest

import needs
import test_caller_cycle
import test_carried_ops
import test_thread_sched
from cluster_harness import run_cluster_job
from harness import describe

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("native")]

JOB_TIMEOUT = 180

SCRIPT = r'''
import json, socket
import numpy as np
import hvdlite as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
failures = []


def data(r, shape, dtype, salt=0):
    n = int(np.prod(shape))
    v = (np.arange(n, dtype=np.int64) * 3 + r * 5 + salt * 7) % 17 - 8
    return v.astype(dtype).reshape(shape)


def check(label, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        failures.append(f"{label}: got {got.dtype}{got.shape} {got.ravel()[:6]}, "
                        f"want {want.dtype}{want.shape} {want.ravel()[:6]}")


everyone = list(range(size))
for dtype in (np.float32, np.float64, np.int32, np.int64):
    for shape in ((5,), (3, 7), (1 << 20,)):  # the last one is 4-8 MiB: many packets
        mine = data(rank, shape, dtype)
        stack = np.stack([data(r, shape, dtype) for r in everyone])
        name = f"{np.dtype(dtype).name}-{len(shape)}-{shape[0]}"
        check(f"sum {name}", hvd.allreduce(mine, op=hvd.Sum, name="s" + name),
              stack.sum(axis=0).astype(dtype))
        check(f"min {name}", hvd.allreduce(mine, op=hvd.Min, name="mn" + name), stack.min(axis=0))
        check(f"max {name}", hvd.allreduce(mine, op=hvd.Max, name="mx" + name), stack.max(axis=0))
        if np.dtype(dtype).kind == "f":
            got = hvd.allreduce(mine, op=hvd.Average, name="a" + name)
            want = (stack.astype(np.float64).sum(axis=0) / size).astype(dtype)
            if not np.allclose(got, want, rtol=1e-6):
                failures.append(f"average {name} differs")

grads = [data(rank, (n,), np.float32, salt=n) for n in (3, 1000, 70000)]
got = hvd.grouped_allreduce(grads, op=hvd.Sum, name="group")
for n, g in zip((3, 1000, 70000), got):
    check(f"grouped {n}", g, np.sum([data(r, (n,), np.float32, salt=n) for r in everyone], axis=0))

rows = lambda r: r + 1  # uneven first dimensions
check("allgather", hvd.allgather(data(rank, (rows(rank), 4), np.int32), name="ag"),
      np.concatenate([data(r, (rows(r), 4), np.int32) for r in everyone]))
root = size - 1
for r in (0, root):
    check(f"broadcast from {r}", hvd.broadcast(data(rank, (9, 2), np.float64), r, name=f"b{r}"),
          data(r, (9, 2), np.float64))
splits = [(rank + d) % 3 + 1 for d in everyone]  # rank sends splits[d] rows to rank d
sent = data(rank, (sum(splits), 2), np.int64)
received, received_splits = hvd.alltoall(sent, splits=splits, name="a2a")
want_parts = []
for src in everyone:
    src_splits = [(src + d) % 3 + 1 for d in everyone]
    start = sum(src_splits[:rank])
    want_parts.append(data(src, (sum(src_splits), 2), np.int64)[start:start + src_splits[rank]])
check("alltoall", received, np.concatenate(want_parts))
check("alltoall splits", received_splits, np.array([p.shape[0] for p in want_parts]))
full = np.sum([data(r, (2 * size + 1, 3), np.float32) for r in everyone], axis=0)
n_rows = 2 * size + 1  # the first n_rows % size ranks get one row more
counts = [n_rows // size + (1 if r < n_rows % size else 0) for r in everyone]
start = sum(counts[:rank])
check("reducescatter", hvd.reducescatter(data(rank, (2 * size + 1, 3), np.float32), op=hvd.Sum,
                                         name="rs"), full[start:start + counts[rank]])
hvd.barrier()

print("HVDLITE_RESULT", json.dumps({
    "host": socket.gethostname(), "rank": rank, "size": size,
    "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "shm_collectives": hvd.stats()["shm_collectives"], "failures": failures}))
'''


def expected_topology(hosts):
    """rank -> (local_rank, local_size, cross_rank, cross_size) from each rank's host."""
    out = {}
    for rank, host in enumerate(hosts):
        same_host = [r for r, h in enumerate(hosts) if h == host]
        local_rank = same_host.index(rank)
        same_local = [r for r in range(len(hosts))
                      if [q for q, h in enumerate(hosts) if h == hosts[r]].index(r) == local_rank]
        out[rank] = (local_rank, len(same_host), same_local.index(rank), len(same_local))
    return out


def _run_and_check(cluster, hosts, placement, launcher_args=()):
    """Runs SCRIPT on ``hosts``; checks each rank's host, results and topology.

    Returns:
        The ranks' reports.
    """
    result = run_cluster_job(cluster, hosts, SCRIPT, timeout=JOB_TIMEOUT,
                             launcher_args=launcher_args)
    assert result.returncode == 0, describe(result)
    size = len(placement)
    reports = [result.result(r) for r in range(size)]
    assert [rep["host"] for rep in reports] == placement, describe(result)
    for rep in reports:
        assert rep["size"] == size
        assert rep["failures"] == [], f"rank {rep['rank']} on {rep['host']}: {rep['failures']}"
    want = expected_topology(placement)
    got = {rep["rank"]: (rep["local_rank"], rep["local_size"], rep["cross_rank"],
                         rep["cross_size"]) for rep in reports}
    assert got == want, f"placement {placement}"
    return reports


@pytest.mark.parametrize("hosts,placement", [
    ("h1:2,h2:2", ["h1", "h1", "h2", "h2"]),
    ("h1:3,h2:1", ["h1", "h1", "h1", "h2"]),
    ("h1:1,h2:1", ["h1", "h2"]),
], ids=["2x2", "3+1", "2x1"])
def test_collectives_and_topology_across_hosts(cluster2, hosts, placement):
    _run_and_check(cluster2, hosts, placement)


def test_round_robin_placement(cluster2):
    # hydra's -ppn 1 deals ranks one per host in turn: h1 gets ranks 0 and 2.
    _run_and_check(cluster2, "h1:2,h2:2", ["h1", "h2", "h1", "h2"],
                   launcher_args=["--mpi-args", "-ppn 1"])


def test_one_rank_on_each_of_three_hosts(make_cluster):
    _run_and_check(make_cluster(3), "h1:1,h2:1,h3:1", ["h1", "h2", "h3"])


def test_ranks_in_one_host_of_the_cluster_share_memory(cluster2):
    # Two ranks in one namespace are one host: local_size 2 and the shared-memory
    # allreduce in use, as on a real machine (the core decides from MPI's node split,
    # which follows the hosts given to mpiexec, so it never spans two hosts).
    reports = _run_and_check(cluster2, "h1:2", ["h1", "h1"])
    assert all(rep["shm_collectives"] > 0 for rep in reports), reports


@pytest.mark.parametrize("hosts", ["h1:1,h2:1", "h1:1,h2:1,h3:1"], ids=["2x1", "3x1"])
def test_small_ops_carried_by_the_direct_round(make_cluster, hosts):
    # One rank per host: the coordination is one exchange of every rank's record, which
    # carries a small cached op's data (tests/multirank/test_carried_ops.py, whose job
    # this runs with carrying on and off): the same bits either way, since only what no
    # order of reduction changes is carried (MPI's order is its own).
    size = hosts.count(",") + 1
    cluster = make_cluster(size)
    test_carried_ops.carried_runs(
        lambda env: run_cluster_job(cluster, hosts, test_carried_ops.SCRIPT, timeout=JOB_TIMEOUT,
                                    env=env),
        size, across_hosts=True)


@pytest.mark.parametrize("hosts", ["h1:2,h2:2", "h1:2,h2:2,h3:2"], ids=["2x2", "3x2"])
def test_small_ops_carried_by_the_layered_round(make_cluster, hosts):
    # Hosts of 2 ranks: the round ANDs on each host through shared memory, then across
    # hosts by one exchange among the ranks of one local rank, and a small op's data
    # rides in both steps (each host's reduced over its ranks, then the hosts' in host
    # order: what the hierarchical allreduce computes, so every op is carried and every
    # result has the same bits as without carrying; a small reducescatter runs as that
    # allreduce, each rank keeping its rows, so every float reducescatter is carried too).
    size = 2 * (hosts.count(",") + 1)
    cluster = make_cluster(size // 2)
    test_carried_ops.carried_runs(
        lambda env: run_cluster_job(cluster, hosts, test_carried_ops.SCRIPT, timeout=JOB_TIMEOUT,
                                    env=env),
        size)


@pytest.mark.parametrize("hosts", ["h1:1,h2:1", "h1:1,h2:1,h3:1"], ids=["2x1", "3x1"])
def test_ranks_of_one_machine_share_its_cores_whatever_their_host_names(make_cluster, hosts):
    # The namespace hosts are one kernel's: their ranks share this machine's cores, each
    # host name notwithstanding. Where they outnumber the cores (3 ranks on this 2-core
    # machine) a background thread must not be real-time (equal real-time priorities do
    # not share a core), though each rank is alone on its host.
    size = hosts.count(",") + 1
    cores = len(os.sched_getaffinity(0))
    if size <= cores and not test_thread_sched.REALTIME_PERMITTED:
        needs.need("realtime", test_thread_sched.REALTIME_MISSING)
    result = run_cluster_job(make_cluster(3), hosts, test_thread_sched.SCRIPT, timeout=JOB_TIMEOUT,
                             env=test_thread_sched.UNSET)
    assert result.returncode == 0, describe(result)
    want = os.SCHED_FIFO if size <= cores else os.SCHED_OTHER
    for rank in range(size):
        assert result.result(rank)["sum"] == [sum(k + i for k in range(size)) for i in range(4)]
        loop, _ = test_thread_sched.loop_and_others(result, rank)
        assert loop == want, (f"rank {rank} of {size} on {cores} cores: background thread policy "
                              f"{loop}, expected {want}\n{describe(result)}")


@pytest.mark.parametrize("hosts,env", [
    ("h1:1,h2:1", None),
    ("h1:1,h2:1", {"HVDLITE_MPI_THREAD_FUNNELED": "1"}),
    ("h1:2,h2:2", None),
], ids=["2x1", "2x1-funneled", "2x2"])
def test_blocking_calls_run_their_own_cycles_across_hosts(cluster2, hosts, env):
    # Across hosts a blocking call's cycle calls MPI (the round's exchange of records, and
    # the op's own collective where the round could not carry it). The caller runs it
    # where MPI takes calls from any thread (not under HVDLITE_MPI_THREAD_FUNNELED=1) and
    # each rank has a core of its own (the namespace hosts share this machine's cores: 4
    # ranks on 2 do not). Every kind of blocking op, in and beside other threads' async
    # ops, a mismatch, against numpy (tests/multirank/test_caller_cycle.py's job).
    size = sum(int(h.split(":")[1]) for h in hosts.split(","))
    crowded = size > len(os.sched_getaffinity(0))
    bodies = test_caller_cycle.run(
        size, env=env,
        job=lambda env: run_cluster_job(cluster2, hosts, test_caller_cycle.SCRIPT,
                                        timeout=JOB_TIMEOUT, env=env))
    callers = env is None and not crowded
    for r, body in enumerate(bodies):
        for kind in ("loop", "sync"):
            cycles, calls = body[kind]["caller_cycles"], body[kind]["calls"]
            if callers:
                assert cycles >= calls // 2, f"rank {r}: {body}"
            else:
                assert cycles == 0, f"rank {r} ({'crowded' if crowded else env}): {body}"
