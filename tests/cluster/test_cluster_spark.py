"""hvdlite.spark.run on a real Spark standalone cluster across namespace hosts: an
allreduce, a torch model trained through run(), a failing rank.

h1 runs the Spark master and the driver (spark/spark_driver.py), h2 and h3 a Spark
worker each (2 cores, so an executor of 2 task slots on each host). MPI goes over the
cluster's links (UCX/libfabric forced onto TCP by the cluster's environment). The
cluster, master and workers are shared by the module and ended after it: every process
in its hosts, the JVMs included, is killed, also on failure.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import needs
from cluster_harness import cluster_env, kill_cluster_processes

pyspark = needs.import_or_skip("pyspark", "spark")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    needs.need("spark", "no java on PATH and no JAVA_HOME (Spark needs Java 17 or 21)")

SPARK_HOME = os.path.dirname(os.path.abspath(pyspark.__file__))
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spark", "spark_driver.py")
WORKER_CORES = 2
WORKERS = ("h2", "h3")
SLOTS = WORKER_CORES * len(WORKERS)
MASTER_PORT = 7077


def _spark_env(cluster, host):
    env = cluster_env(cluster)
    env.update({"SPARK_HOME": SPARK_HOME, "SPARK_LOCAL_IP": cluster.host(host).address,
                "SPARK_DAEMON_MEMORY": "256m", "SPARK_NO_DAEMONIZE": "1",
                "SPARK_LOG_DIR": env.get("TMPDIR", "/tmp")})
    return env


@pytest.fixture(scope="module")
def spark_cluster(make_cluster, tmp_path_factory):
    """(cluster, master URL, logs folder): a master on h1, a worker on h2 and on h3."""
    cluster = make_cluster(3)
    logs = tmp_path_factory.mktemp("spark-daemons")
    spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
    master_address = cluster.host("h1").address
    url = f"spark://{master_address}:{MASTER_PORT}"
    daemons = []
    try:
        with open(logs / "master.log", "wb") as log:
            daemons.append(cluster.popen("h1", [
                spark_class, "org.apache.spark.deploy.master.Master", "--host", master_address,
                "--port", str(MASTER_PORT), "--webui-port", "0"],
                env=_spark_env(cluster, "h1"), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True))
        # The workers retry until the master answers; the driver waits for their slots.
        for host in WORKERS:
            with open(logs / f"worker-{host}.log", "wb") as log:
                daemons.append(cluster.popen(host, [
                    spark_class, "org.apache.spark.deploy.worker.Worker", url,
                    "--host", cluster.host(host).address, "--cores", str(WORKER_CORES),
                    "--memory", "1g", "--webui-port", "0",
                    "--work-dir", str(logs / f"work-{host}")],
                    env=_spark_env(cluster, host), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True))
        yield cluster, url, logs
    finally:
        kill_cluster_processes(cluster)   # master, workers, executors, drivers
        for proc in daemons:
            proc.wait(30)


def _hvdlite_processes(cluster):
    """host -> commands of hvdlite processes (ranks, launcher, MPI proxies) still there."""
    found = {}
    for host in cluster.hosts:
        for pid in cluster.pids(host.name):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = b" ".join(f.read().split(b"\0")).decode(errors="replace")
            except OSError:
                continue
            if any(word in command for word in ("hvdlite.spark", "hvdlite.runner",
                                                "rank_wrapper", "hydra_pmi_proxy",
                                                "task_shell", "mpiexec")):
                found.setdefault(host.name, []).append(f"{pid}: {command[:160]}")
    return found


@pytest.fixture(scope="module")
def driver_run(spark_cluster):
    """The driver script's RESULT, run once for the module's tests."""
    cluster, url, logs = spark_cluster
    command = [sys.executable, DRIVER, url, cluster.host("h1").address, str(SLOTS)]
    proc = cluster.popen("h1", command, env=cluster_env(cluster), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                         errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_cluster_processes(cluster)
        out, err = proc.communicate()
        raise AssertionError(f"the Spark driver did not finish within 300 s\n{out[-3000:]}\n"
                             f"{err[-6000:]}") from None
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT "):]) if lines else {"error": "no RESULT"}
    if "error" in result:
        daemons = "".join(f"--- {path.name} ---\n{path.read_text(errors='replace')[-2000:]}\n"
                          for path in sorted(logs.glob("*.log")))
        raise AssertionError(f"the Spark driver failed (exit {proc.returncode}): "
                             f"{result['error']}\n{out[-3000:]}\n{err[-6000:]}\n{daemons}")
    result["leftovers"] = _hvdlite_processes(cluster)
    result["output"] = out + err
    return result


@pytest.mark.timeout(420)
def test_allreduce_across_hosts_on_the_tasks_hosts(driver_run):
    ranks = driver_run["allreduce"]
    assert driver_run["slots"] == SLOTS
    assert [r["rank"] for r in ranks] == list(range(SLOTS))
    assert {r["size"] for r in ranks} == {SLOTS}
    # Every rank runs on a worker's host, never the driver's, two on each worker: the
    # hosts the barrier tasks ran on.
    hosts = [r["host"] for r in ranks]
    assert sorted(hosts) == sorted(h for h in WORKERS for _ in range(WORKER_CORES)), hosts
    assert driver_run["driver_host"] == "h1"
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert sorted(r["task"] for r in ranks) == list(range(SLOTS))
    for r in ranks:
        np.testing.assert_allclose(r["sum_head"], driver_run["want_head"], rtol=1e-12)
        assert r["sum_norm"] == pytest.approx(driver_run["want_norm"], rel=1e-12)
    # verbose=2 tags the output with each rank's host: the tasks' hosts.
    assert "@h1]" not in driver_run["output"]


@pytest.mark.timeout(420)
def test_torch_model_trained_on_the_workers_equals_one_process_on_the_whole_batch(driver_run):
    torch = needs.import_or_skip("torch")
    sys.path.insert(0, os.path.dirname(DRIVER))
    try:
        from spark_driver import TRAIN_LR, TRAIN_STEPS, training_data
    finally:
        sys.path.pop(0)
    x, y = training_data()
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 1)
    initial = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy()
    opt = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.tensor(x)), torch.tensor(y)).backward()
        opt.step()
    want = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    assert not np.allclose(initial, want), "the reference did not train"
    ranks = driver_run["torch"]
    assert [r["rank"] for r in ranks] == list(range(SLOTS))
    assert sorted(r["host"] for r in ranks) == sorted(h for h in WORKERS
                                                      for _ in range(WORKER_CORES))
    for r in ranks:
        np.testing.assert_allclose(r["weights"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(420)
def test_failing_rank_on_a_worker_names_it_and_leaves_nothing(driver_run):
    failure = driver_run["failure"]
    assert failure is not None, "the failing function did not fail the run"
    assert failure["rank"] == SLOTS - 1
    assert failure["host"] in WORKERS
    assert f"rank {SLOTS - 1} (Spark task {failure['task']} on host {failure['host']})" \
        in failure["message"]
    assert f"RuntimeError: planned failure on rank {SLOTS - 1}" in failure["message"]
    assert driver_run["failure_s"] < 60, driver_run["failure_s"]
    assert driver_run["leftovers"] == {}, driver_run["leftovers"]
