"""Elastic training (issue 17) on the namespace cluster (hvdlite.runner.netns_cluster),
ranks 0 on h1 and 1, 2 on h2: mid-training host h2 goes (every process in it, the MPI
proxy, the rank wrappers, the ranks, SIGKILLed, and its namespace deleted), or only the
workers of h2 are killed (the host stays). Either way the rank on h1 resets instead of
dying with them, and the job finishes on h1 alone from the last commit (history.check:
bit for bit, no step repeated or skipped, each sample once).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import harness
from hvdlite.runner import netns_cluster
from hvdlite.runner.testing import pid_alive

ELASTIC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elastic")
sys.path.insert(0, ELASTIC)
import history  # noqa: E402  (tests/elastic/history.py)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = os.path.join(ELASTIC, "scripts", "train_elastic.py")
SAMPLES, EPOCHS = 36, 2


def _saved_step(log_dir, step):
    path = os.path.join(log_dir, "g0-r0.jsonl")
    try:
        with open(path) as f:
            return any(f'"ev": "saved", "step": {step},' in line for line in f)
    except FileNotFoundError:
        return False


def _rank_pids(log_dir, ranks):
    pids = []
    for rank in ranks:
        with open(os.path.join(log_dir, f"g0-r{rank}.jsonl")) as f:
            pids += [json.loads(line)["pid"] for line in f if '"ev": "start"' in line]
    return pids


def _lose_h2_midway(cluster, tmp_path, lose):
    """Runs the job on ``cluster``, calls ``lose(log_dir)`` (it returns the pids it
    ended) once step 3 was saved, checks the job went on with h1; returns its result."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(log_dir, 0o777)
    command = [sys.executable, "-m", "hvdlite.runner", "-np", "3", "-H", "h1:1,h2:2",
               "--min-np", "1", "--max-np", "3", "--remote-shell", cluster.remote_shell(),
               sys.executable, SCRIPT, str(log_dir), "--samples", str(SAMPLES),
               "--epochs", str(EPOCHS), "--step-sleep", "0.3"]
    proc = cluster.popen("h1", command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, errors="replace",
                          env=netns_cluster.NetnsCluster.mpi_env(cluster, harness.job_env()),
                          cwd=harness.REPO_ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not _saved_step(log_dir, 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _saved_step(log_dir, 3), "the job never reached step 3"
        lost = lose(log_dir)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            for pid in cluster.pids("h1"):
                os.kill(pid, signal.SIGKILL)
            proc.communicate()
    assert lost, "no process ran on h2"
    result = harness.job_result(proc.returncode, stdout, stderr, command)
    assert result.returncode == 0, harness.describe(result)
    summary = history.check(log_dir, SAMPLES, EPOCHS)
    assert summary["worlds"] == [3, 1], summary["worlds"]
    assert summary["starts"][1]["step"] >= 3
    assert not [p for p in lost if pid_alive(p)], "processes of h2 left"
    return result


def test_a_lost_host_costs_its_ranks_not_the_job(cluster2, tmp_path):
    def lose(log_dir):
        lost = cluster2.pids("h2")
        # The host goes: its processes killed, its namespace deleted (nothing answers
        # there any more, not even the remote shell the driver probes it with).
        netns_cluster._remove_netns(cluster2.host("h2").netns)
        return lost

    result = _lose_h2_midway(cluster2, tmp_path, lose)
    assert "host h2 lost (ranks 1,2)" in result.stderr, harness.describe(result)


def test_all_workers_of_a_host_killed_the_other_host_resets(tmp_path, make_cluster):
    # Horovod's workers on the other host could die too instead of resetting.
    cluster = make_cluster(2, rate="10gbit")  # a cluster of its own: the test above deletes h2

    def lose(log_dir):
        victims = _rank_pids(log_dir, [1, 2])
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        return victims

    result = _lose_h2_midway(cluster, tmp_path, lose)
    for rank in (1, 2):
        assert f"rank {rank} on h2 was killed by signal 9" in result.stderr, \
            harness.describe(result)
