"""hvdliterun's many-host flags on a namespace cluster: the remote shell, a host that
cannot be reached, a host whose link is down at start, --verbose host tags,
--network-interface; and hosts taken from a scheduler (a Slurm allocation, an MPI
operator's launcher pod)."""
import os
import re
import sys
import tempfile
import time

import pytest

import harness
from cluster_harness import run_cluster_job, run_in_cluster
from harness import describe

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

HELLO = r'''
import json, socket
import hvdlite as hvd
hvd.init()
print("HVDLITE_RESULT", json.dumps({"host": socket.gethostname(), "rank": hvd.rank()}))
'''


def test_a_host_the_remote_shell_cannot_reach_is_named(cluster2):
    start = time.monotonic()
    result = run_cluster_job(cluster2, "h1:1,nosuchhost:2", HELLO, timeout=120,
                             launcher_args=["--start-timeout", "60"])
    elapsed = time.monotonic() - start
    assert result.returncode != 0, describe(result)
    launcher = "\n".join(result.untagged)
    assert "cannot start ranks 1, 2 on host nosuchhost" in launcher, describe(result)
    assert elapsed < 60, f"took {elapsed:.1f}s, longer than --start-timeout"
    assert not result.leftovers, result.leftovers


def test_a_host_whose_link_is_down_fails_the_start_naming_it(cluster2):
    cluster2.set_link("h2", up=False)
    try:
        start = time.monotonic()
        result = run_cluster_job(cluster2, "h1:1,h2:1", HELLO, timeout=120,
                                 launcher_args=["--start-timeout", "8"])
        elapsed = time.monotonic() - start
    finally:
        cluster2.set_link("h2", up=True)
    assert result.returncode != 0, describe(result)
    launcher = "\n".join(result.untagged)
    assert re.search(r"missing ranks: 1 on host h2", launcher), describe(result)
    assert elapsed < 8 + 30, f"took {elapsed:.1f}s"
    assert not result.leftovers, result.leftovers


def test_verbose_tags_lines_with_the_host_and_interface_sets_the_call_back(cluster2):
    result = run_cluster_job(cluster2, "h1:1,h2:2", HELLO, timeout=120,
                             launcher_args=["--verbose", "--network-interface", "eth0"])
    assert result.returncode == 0, describe(result)
    assert [result.result(r)["host"] for r in range(3)] == ["h1", "h2", "h2"]
    for rank, host in enumerate(["h1", "h2", "h2"]):
        assert re.search(rf"^\[{rank}@{host}\]<stdout>:HVDLITE_RESULT", result.stdout, re.M), \
            result.stdout
    h1 = cluster2.host("h1").address
    assert f"ranks call the launcher back at {h1}" in result.stderr, result.stderr
    assert "-iface eth0" in result.stderr
    assert not result.leftovers, result.leftovers


def test_launcher_host_variable_sets_the_call_back_address(cluster2):
    # HVDLITE_LAUNCHER_HOST wins over the routed address: h1's address works (and is
    # the one announced); h2's, where no launcher listens, cannot work.
    h1, h2 = cluster2.host("h1").address, cluster2.host("h2").address
    result = run_cluster_job(cluster2, "h1:1,h2:1", HELLO, timeout=120,
                             env={"HVDLITE_LAUNCHER_HOST": h1}, launcher_args=["--verbose"])
    assert result.returncode == 0, describe(result)
    assert f"ranks call the launcher back at {h1}" in result.stderr, result.stderr
    start = time.monotonic()
    result = run_cluster_job(cluster2, "h1:1,h2:1", HELLO, timeout=120,
                             env={"HVDLITE_LAUNCHER_HOST": h2},
                             launcher_args=["--verbose", "--start-timeout", "8"])
    assert result.returncode != 0, describe(result)
    assert f"ranks call the launcher back at {h2}" in result.stderr, result.stderr
    assert time.monotonic() - start < 8 + 30
    assert not result.leftovers, result.leftovers


# hvdliterun without the cluster's remote shell (HVDLITE_REMOTE_SHELL, which the
# cluster's environment sets and which would win over a scheduler's).
WITHOUT_CLUSTER_SHELL = ["env", "-u", "HVDLITE_REMOTE_SHELL", sys.executable, "-m", "hvdlite.runner"]


def _stand_in(tmpdir, name, body):
    path = os.path.join(tmpdir, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)
    return path


def test_inside_a_slurm_allocation_hosts_and_slots_come_from_slurm_and_srun_starts_ranks(cluster2):
    # No -H and no remote shell: SLURM_JOB_NODELIST/SLURM_TASKS_PER_NODE give the hosts,
    # and ranks on the other node start through srun (a stand-in here that does what
    # srun --nodelist=HOST does: run the command on HOST).
    with tempfile.TemporaryDirectory(prefix="hvdlite-slurm-") as tmpdir:
        os.chmod(tmpdir, 0o755)
        log = os.path.join(tmpdir, "srun.log")
        _stand_in(tmpdir, "srun", f'''
for a in "$@"; do case "$a" in --nodelist=*) host=${{a#--nodelist=}};; esac; done
echo "srun $*" >>{log}
while [ $# -gt 0 ] && [ "$1" != "-c" ]; do shift; done
exec {cluster2.remote_shell()} "$host" "$2"
''')
        script = harness.script_file(HELLO, tmpdir)
        env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "h[1-2]",
               "SLURM_TASKS_PER_NODE": "2,1", "PATH": tmpdir + os.pathsep + os.environ["PATH"]}
        result = run_in_cluster(cluster2, [*WITHOUT_CLUSTER_SHELL, "--verbose", sys.executable,
                                           script], env=env, timeout=120)
        assert result.returncode == 0, describe(result)
        assert [result.result(r)["host"] for r in range(3)] == ["h1", "h1", "h2"]
        assert "hosts from Slurm job 4242: h1:2,h2:1" in result.stderr, result.stderr
        assert os.path.exists(log), result.stderr
        with open(log) as f:
            calls = f.read()
        assert "--nodelist=h2" in calls and "--nodelist=h1" not in calls, calls
    assert not result.leftovers, result.leftovers


def test_in_an_mpijob_launcher_pod_the_mounted_hostfile_and_agent_are_used(cluster2):
    # What the MPI operator gives an MPICH job's launcher pod: HYDRA_HOST_FILE (host:N)
    # and HYDRA_LAUNCHER_EXEC, its kubexec.sh (called as AGENT POD COMMAND).
    with tempfile.TemporaryDirectory(prefix="hvdlite-mpijob-") as tmpdir:
        os.chmod(tmpdir, 0o755)
        hostfile = os.path.join(tmpdir, "hostfile")
        with open(hostfile, "w") as f:
            f.write("h1:1\nh2:2\n")
        log = os.path.join(tmpdir, "agent.log")
        agent = _stand_in(tmpdir, "kubexec.sh",
                          f'echo "$1" >>{log}\nexec {cluster2.remote_shell()} "$@"\n')
        script = harness.script_file(HELLO, tmpdir)
        env = {"HYDRA_HOST_FILE": hostfile, "HYDRA_LAUNCHER_EXEC": agent}
        result = run_in_cluster(cluster2, [*WITHOUT_CLUSTER_SHELL, sys.executable, script],
                                env=env, timeout=120)
        assert result.returncode == 0, describe(result)
        assert [result.result(r)["host"] for r in range(3)] == ["h1", "h2", "h2"]
        with open(log) as f:
            assert f.read().split() == ["h2"]  # the agent started h2's ranks
    assert not result.leftovers, result.leftovers
