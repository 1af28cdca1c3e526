"""A real Slurm on the namespace cluster (issue 31): slurmctld on h1, a slurmd on h1 and
h2, one munged (tests/cluster/slurm_harness.py), shared by the module's tests.

- ``srun -N 2 -n 4 --mpi=pmi2 python script.py``: ranks started by Slurm, no hvdliterun;
  MPI (the mpich wheel) takes its world from Slurm's PMI-2 server, and Slurm's own
  variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS) agree with the
  ranks hvdlite reports.
- ``srun --mpi=none``: each task would be an MPI world of one; ``hvd.init()`` refuses,
  naming srun's count and ``--mpi=pmi2``.
- an ``sbatch`` script whose one command is ``hvdliterun python script.py``: hvdliterun
  takes the hosts and slots of the allocation and starts h2's ranks with ``srun``.

The two that run (pmi2, sbatch) do an allreduce across the two hosts, checked against
numpy; every job leaves no process behind but the daemons.
"""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import harness
import needs
import slurm_harness
from cluster_harness import cluster_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

JOB_TIMEOUT = 120
NODES, TASKS_PER_NODE = 2, 2
TASKS = NODES * TASKS_PER_NODE
LENGTH = 1000
# What runs in the hosts between jobs (slurmscriptd is slurmctld's helper).
SLURM_DAEMONS = ("munged", "slurmctld", "slurmscriptd", "slurmd")

SCRIPT = r'''
import json, os, socket
import numpy as np
import hvdlite as hvd

hvd.init()
mine = np.arange(%(length)d, dtype=np.float64) * (hvd.rank() + 1) + hvd.rank() ** 2
total = hvd.allreduce(mine, op=hvd.Sum, name="sum")
slurm = {k: os.environ.get(k) for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
                                        "SLURM_NTASKS", "SLURM_JOB_ID")}
print("HVDLITE_RESULT", json.dumps({
    "host": socket.gethostname(), "rank": hvd.rank(), "size": hvd.size(),
    "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "sum": total.tolist(), "slurm": slurm}), flush=True)
''' % {"length": LENGTH}


def _expected_sum():
    return sum(np.arange(LENGTH, dtype=np.float64) * (r + 1) + r ** 2 for r in range(TASKS))


@pytest.fixture(scope="module")
def slurm(make_cluster, tmp_path_factory):
    """A running SlurmCluster on a 2-host namespace cluster; stopped after the module."""
    reason = slurm_harness.unavailable_reason()
    if reason:
        needs.need("slurm", reason)
    cluster = make_cluster(2)
    workdir = tmp_path_factory.mktemp("slurm")
    started = slurm_harness.SlurmCluster(cluster, str(workdir))
    try:
        started.start(timeout=90)
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("slurm-job")
    os.chmod(path, 0o755)
    script = path / "allreduce.py"
    script.write_text(SCRIPT)
    return path


def _job_env(slurm_cluster):
    """The job's environment: the cluster's MPI settings over its links, and no
    HVDLITE_REMOTE_SHELL (which would win over Slurm's srun in hvdliterun)."""
    env = cluster_env(slurm_cluster.cluster)
    env.pop("HVDLITE_REMOTE_SHELL", None)
    return env


def _run(slurm_cluster, argv, what):
    start = time.monotonic()
    try:
        result = slurm_cluster.run("h1", argv, timeout=JOB_TIMEOUT, env=_job_env(slurm_cluster),
                                   cwd=harness.REPO_ROOT)
    except subprocess.TimeoutExpired as exc:
        slurm_cluster.run("h1", ["scancel", "--full", "--user=root"], timeout=30)
        raise AssertionError(f"{what} hung: no end within {JOB_TIMEOUT}s\n"
                             f"{exc.stdout or ''}\n{exc.stderr or ''}\n"
                             + slurm_cluster.logs()) from None
    result.elapsed = time.monotonic() - start
    return result


def _results(text):
    found = {}
    for line in text.splitlines():
        head, sep, tail = line.partition("HVDLITE_RESULT ")
        if sep:
            value = json.loads(tail)
            found[value["rank"]] = value
    return [found[r] for r in sorted(found)]


def _job_processes(slurm_cluster, settle_s=10.0):
    """host -> commands still running in the hosts that are not Slurm's daemons."""
    deadline = time.monotonic() + settle_s
    while True:
        found = {}
        for host in slurm_cluster.cluster.hosts:
            for pid in slurm_cluster.cluster.pids(host.name):
                try:
                    with open(f"/proc/{pid}/comm", "r", encoding="utf-8") as f:
                        name = f.read().strip()
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        command = b" ".join(f.read().split(b"\0")).decode(errors="replace")
                except OSError:
                    continue
                if name not in SLURM_DAEMONS:
                    found.setdefault(host.name, []).append(f"{pid}: {command[:160]}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _check_allreduce(ranks, output):
    assert [r["rank"] for r in ranks] == list(range(TASKS)), output
    want = _expected_sum()
    for r in ranks:
        assert r["size"] == TASKS
        np.testing.assert_allclose(r["sum"], want, rtol=1e-12)
    # Slurm's block distribution: ranks 0-1 on h1, 2-3 on h2.
    assert [r["host"] for r in ranks] == ["h1", "h1", "h2", "h2"], output
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["cross_rank"] for r in ranks] == [0, 0, 1, 1]
    assert {r["local_size"] for r in ranks} == {TASKS_PER_NODE}
    assert {r["cross_size"] for r in ranks} == {NODES}


def test_srun_with_pmi2_starts_the_ranks_without_hvdliterun(slurm, job_dir):
    # One output file per task (%t): srun's merged stdout may cut long lines of
    # different tasks into each other.
    outputs = job_dir / "srun-%t.out"
    result = _run(slurm, ["srun", f"--nodes={NODES}", f"--ntasks={TASKS}", "--mpi=pmi2",
                          f"--output={outputs}", sys.executable, str(job_dir / "allreduce.py")],
                  "srun")
    tasks = "".join((job_dir / f"srun-{t}.out").read_text(errors="replace")
                    for t in range(TASKS) if (job_dir / f"srun-{t}.out").exists())
    output = f"{result.stdout}\n{result.stderr}\n{tasks}"
    assert result.returncode == 0, output + slurm.logs()
    ranks = _results(tasks)
    _check_allreduce(ranks, output)
    # What Slurm tells each task before MPI is up agrees with what hvdlite got from MPI.
    for r in ranks:
        assert r["slurm"]["SLURM_PROCID"] == str(r["rank"]), r
        assert r["slurm"]["SLURM_LOCALID"] == str(r["local_rank"]), r
        assert r["slurm"]["SLURM_NODEID"] == str(r["cross_rank"]), r
        assert r["slurm"]["SLURM_NTASKS"] == str(TASKS), r
    assert len({r["slurm"]["SLURM_JOB_ID"] for r in ranks}) == 1
    assert _job_processes(slurm) == {}


def test_srun_without_pmi_fails_naming_the_fix_rather_than_running_singletons(slurm, job_dir):
    # --mpi=none: MPI hears nothing from srun, and each task would be a world of one.
    result = _run(slurm, ["srun", f"--nodes={NODES}", f"--ntasks={TASKS}", "--mpi=none",
                          "--kill-on-bad-exit=1", sys.executable,
                          str(job_dir / "allreduce.py")], "srun --mpi=none")
    output = f"{result.stdout}\n{result.stderr}"
    assert result.returncode != 0, output
    assert "HVDLITE_RESULT" not in output, output
    assert f"started {TASKS} processes (SLURM_STEP_NUM_TASKS={TASKS})" in output, output
    assert "srun --mpi=pmi2" in output, output
    assert _job_processes(slurm) == {}


def test_sbatch_script_running_hvdliterun_uses_the_allocation(slurm, job_dir):
    batch = job_dir / "job.sh"
    out = job_dir / "job.out"
    batch.write_text(
        "#!/bin/sh\n"
        f"#SBATCH --nodes={NODES} --ntasks-per-node={TASKS_PER_NODE}\n"
        f"exec {sys.executable} -m hvdlite.runner --verbose {sys.executable} "
        f"{job_dir / 'allreduce.py'}\n")
    result = _run(slurm, ["sbatch", "--wait", f"--output={out}", str(batch)], "sbatch --wait")
    log = out.read_text(errors="replace") if out.exists() else "(no job output)"
    output = f"{result.stdout}\n{result.stderr}\n{log}"
    assert result.returncode == 0, output + slurm.logs()
    job = re.search(r"Submitted batch job (\d+)", result.stdout).group(1)
    assert f"hosts from Slurm job {job}: h1:{TASKS_PER_NODE},h2:{TASKS_PER_NODE}" in log, output
    assert "remote shell 'srun --nodes=1 --ntasks=1 --overlap --nodelist={host}" in log, output
    ranks = _results(log)
    _check_allreduce(ranks, output)
    # hvdliterun's tags name the host of each rank, the hosts Slurm gave.
    for r in ranks:
        assert re.search(rf"^\[{r['rank']}@{r['host']}\]<stdout>:HVDLITE_RESULT", log, re.M), log
    assert _job_processes(slurm) == {}
