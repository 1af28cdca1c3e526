"""RayExecutor on a multi-node Ray cluster: a head and two worker nodes, each in its own
host of a namespace cluster (own host name and address, MPI over the cluster's links).

The driver runs inside the head's host (as a user's script on the head node); ranks on
the other nodes start through the worker actors' node shells: no ssh and no remote shell
of the cluster's (its HVDLITE_REMOTE_SHELL is removed). Expected values come from numpy
(torch training through ``run`` against one process is checked on the single-node
cluster, test_ray_executor.py: importing torch in four actors costs half a minute on
2 cores).
"""
import json
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

import needs
import ray_bodies
from ray_support import HERE, worker_pythonpath

pytestmark = [pytest.mark.timeout(240),
              needs.needs("ray", needs.installed("ray"), "ray not installed")]

RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")
DRIVER = os.path.join(HERE, "ray_cluster_driver.py")


@pytest.fixture(scope="module")
def ray_cluster():
    """Three namespace hosts h1 (Ray's head), h2, h3, each a Ray node with 2 CPUs.

    Yields (cluster, head address, environment). Afterwards ``ray stop`` runs in every
    host, and the test fails if any process is left in the hosts."""
    needs.import_or_skip("ray")
    from hvdlite.runner import netns_cluster

    reason = netns_cluster.unavailable_reason()
    if reason:
        needs.need("cluster", reason)
    netns_cluster.cleanup_stale()
    cluster = netns_cluster.NetnsCluster(3).start()
    env = cluster.mpi_env(dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
                               PYTHONPATH=worker_pythonpath(), RAY_AUTH_MODE="token",
                               RAY_AUTH_TOKEN=secrets.token_hex(32),
                               # A killed node is seen dead in ~3 s, not ~30 s.
                               RAY_health_check_period_ms="1000",
                               RAY_health_check_timeout_ms="1000",
                               RAY_health_check_failure_threshold="3"))
    env.pop("HVDLITE_REMOTE_SHELL", None)  # the node shells must do it
    head = f"{cluster.host('h1').address}:6379"
    try:
        for host in cluster.hosts:
            argv = [RAY_BIN, "start", f"--node-ip-address={host.address}", "--num-cpus=2",
                    "--disable-usage-stats",
                    f"--temp-dir=/tmp/hvdlite-ray-{cluster.prefix}-{host.name}"]
            argv += (["--head", "--port=6379", "--include-dashboard=false"]
                     if host.name == "h1" else [f"--address={head}"])
            done = cluster.run(host.name, argv, env=env, capture_output=True, text=True,
                               timeout=120)
            assert done.returncode == 0, f"ray start on {host.name}: {done.stderr[-2000:]}"
        yield cluster, head, env
    finally:
        for host in cluster.hosts:
            cluster.run(host.name, [RAY_BIN, "stop", "--force"], env=env,
                        capture_output=True, timeout=60)
        import time

        deadline = time.monotonic() + 15
        left = {}
        while time.monotonic() < deadline:
            left = {h.name: cluster.pids(h.name) for h in cluster.hosts}
            if not any(left.values()):
                break
            time.sleep(0.3)
        cluster.close()
        assert not any(left.values()), f"processes left in the cluster's hosts: {left}"


def run_driver(ray_cluster, scenario, *args, timeout=180):
    cluster, head, env = ray_cluster
    try:
        done = cluster.run("h1", [sys.executable, DRIVER, head, scenario, *args], env=env,
                           capture_output=True, text=True, timeout=timeout, cwd=HERE)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the {scenario} driver hung: no end within {timeout} s\nstdout:\n"
                    f"{(exc.stdout or b'')[-3000:]}\nstderr:\n{(exc.stderr or b'')[-5000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"driver exited with {done.returncode}\nstdout:\n{done.stdout[-3000:]}\n"
        f"stderr:\n{done.stderr[-12000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def check_collectives(results, size):
    vectors = [ray_bodies.rank_values(r)[0] for r in range(size)]
    rows = np.concatenate([ray_bodies.rank_values(r)[1] for r in range(size)])
    for rank, got in enumerate(results):
        np.testing.assert_allclose(got["sum"], np.sum(vectors, axis=0), rtol=1e-12,
                                   err_msg=f"rank {rank}")
        np.testing.assert_allclose(got["average"], np.mean(vectors, axis=0), rtol=1e-12)
        np.testing.assert_array_equal(np.array(got["gathered"]), rows)
        np.testing.assert_array_equal(got["broadcast"], vectors[size - 1])


def test_two_hosts_two_workers_each(ray_cluster):
    out = run_driver(ray_cluster, "hosts")
    ids = out["identity"]
    hosts = [i["hostname"] for i in ids]
    # STRICT_SPREAD: two different nodes, each with two consecutive ranks.
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2], ids
    assert set(hosts) <= {"h1", "h2", "h3"}, ids
    assert [i["rank"] for i in ids] == [0, 1, 2, 3]
    assert [i["local_rank"] for i in ids] == [0, 1, 0, 1], ids
    assert [i["cross_rank"] for i in ids] == [0, 0, 1, 1], ids
    assert all(i["size"] == 4 and i["local_size"] == 2 and i["cross_size"] == 2
               for i in ids), ids
    check_collectives(out["collectives"], 4)


def test_one_worker_per_node_when_packing_cannot_share(ray_cluster):
    out = run_driver(ray_cluster, "spread")
    ids = out["identity"]
    assert sorted(i["hostname"] for i in ids) == ["h1", "h2", "h3"], ids
    assert [i["rank"] for i in ids] == [0, 1, 2]
    assert [i["local_rank"] for i in ids] == [0, 0, 0], ids
    assert [i["cross_rank"] for i in ids] == [0, 1, 2], ids
    assert all(i["local_size"] == 1 and i["cross_size"] == 3 for i in ids), ids
    check_collectives(out["collectives"], 3)


@pytest.mark.timeout(400)  # the driver's own limit first: its output tells what hung
def test_elastic_grows_when_a_node_frees_and_goes_on_when_a_node_dies(ray_cluster):
    """min_workers=2, max_workers=3, one 2-CPU worker per node: 2 ranks (h3 busy), 3
    once h3 is free, 2 after h2 is killed (its raylet and everything else in it); the
    final world's ranks hold the weights numpy computes from the committed steps, and
    every step was committed exactly once."""
    cluster, _, _ = ray_cluster
    out = run_driver(ray_cluster, "elastic", cluster.host("h2").netns,
                     cluster.host("h3").address, timeout=330)
    results, events = out["results"], out["events"]
    print_timeline(out)
    assert out["worlds"] == [2, 3, 2], (out["worlds"], events)
    assert {"freed", "grown", "lost"} <= set(events), events
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    assert sorted(r["host"] for r in results) == ["h1", "h3"], results
    history = [tuple(h) for h in results[0]["history"]]
    # Every step committed once, in order; the world's size changed only at the resets.
    assert [step for step, _ in history] == list(range(ray_bodies.ELASTIC_STEPS)), history
    runs = [size for i, (_, size) in enumerate(history) if i == 0 or history[i - 1][1] != size]
    assert runs == [2, 3, 2], history
    expected = ray_bodies.elastic_reference(history)
    for r in results:
        assert [tuple(h) for h in r["history"]] == history
        np.testing.assert_allclose(r["w"], expected, rtol=1e-12, atol=1e-14,
                                   err_msg=f"rank {r['rank']}")
    # The callbacks got the reports of every world's ranks, and of every commit of the
    # final world from each of its ranks (its ranks ran to the end).
    reported = {(r["size"], r["rank"], r["step"]) for r in out["reports"]}
    assert {(size, rank) for size, rank, _ in reported} == \
        {(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)}, sorted(reported)
    last_grown = max(step for step, size in history if size == 3)
    last_run = [step for step, _ in history if step > last_grown]
    assert all((2, rank, step + 1) in reported for step in last_run for rank in (0, 1)), \
        sorted(reported)


def print_timeline(out):
    """When each world's rank 0 committed (seconds from the start of run), for -s."""
    events, start = out["events"], out["events"]["start"]
    worlds = []  # [size, first commit, last commit], a new one when the size changes
    for report in (r for r in out["reports"] if r["rank"] == 0):
        if not worlds or worlds[-1][0] != report["size"]:
            worlds.append([report["size"], report["time"], report["time"]])
        worlds[-1][2] = report["time"]
    for i, (size, first, last) in enumerate(worlds):
        print(f"world {i} ({size} ranks): commits {first - start:.1f} s .. "
              f"{last - start:.1f} s")
    for name in ("freed_at", "lost_at", "end"):
        if name in events:
            print(f"{name}: {events[name] - start:.1f} s")
