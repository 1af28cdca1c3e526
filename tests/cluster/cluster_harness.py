"""Runs jobs on a namespace cluster (hvdlite.runner.netns_cluster), with a timeout.

The launcher runs inside the first host, as a user would run it on one node; the other
hosts are reached through the cluster's remote shell. A job's output is split per rank
by tests/multirank/harness.py's parser, so results read the same as single-host jobs:

    result = assert_ok(run_cluster_job(cluster, "h1:2,h2:2", script))
    result.result(3)["sum"]

On a timeout (or any exit) every process left in the cluster's hosts is killed, so a
hung rank on another host never outlives its test.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import harness
from hvdlite.runner.hosts import parse_host_string
from hvdlite.runner.netns_cluster import NetnsCluster


def kill_cluster_processes(cluster: NetnsCluster) -> None:
    """SIGKILLs every process running in any host of ``cluster``."""
    for host in cluster.hosts:
        for pid in cluster.pids(host.name):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def cluster_env(cluster: NetnsCluster, env=None):
    """A job's environment (harness.job_env) with MPI forced onto the cluster's links."""
    return cluster.mpi_env(harness.job_env(env))


def run_in_cluster(cluster: NetnsCluster, command: Sequence[str], *, host: str = "h1",
                   timeout: float = 120, env=None) -> harness.JobResult:
    """Runs ``command`` inside ``host`` and parses its rank-tagged output.

    The result's ``leftovers`` maps each host to the processes still running there after
    the command ended (then killed): a launcher that cleans up leaves none.

    Raises:
        AssertionError: the command timed out; the message has the output's tail.
    """
    proc = cluster.popen(host, list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, errors="replace",
                         env=cluster_env(cluster, env), cwd=harness.REPO_ROOT,
                         start_new_session=True)
    leftovers = {}

    def cleanup():
        leftovers.update(_leftovers(cluster))
        kill_cluster_processes(cluster)

    result = harness.wait_for_job(proc, command, timeout,
                                  end=lambda: kill_cluster_processes(cluster),
                                  cleanup=cleanup, what="cluster job")
    result.leftovers = leftovers
    return result


def _leftovers(cluster: NetnsCluster, settle_s: float = 5.0):
    """host -> commands of processes still running in it once the job ended (after
    giving exiting processes ``settle_s`` to go)."""
    deadline = time.monotonic() + settle_s
    while True:
        found = {}
        for host in cluster.hosts:
            names = []
            for pid in cluster.pids(host.name):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        names.append(f"{pid}: " + f.read().replace(b"\0", b" ").decode()[:200])
                except OSError:
                    continue
            if names:
                found[host.name] = names
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def run_cluster_job(cluster: NetnsCluster, hosts: str, script: str, *, np: Optional[int] = None,
                    timeout: float = 120, env=None, args: Sequence[str] = (),
                    launcher_args: Sequence[str] = ()) -> harness.JobResult:
    """Runs ``script`` through hvdliterun on ``hosts`` (``h1:2,h2:2``) of ``cluster``.

    Args:
        cluster: a started cluster.
        hosts: hvdliterun's ``-H`` value; ``np`` defaults to its total slots.
        script: a Python file or Python source (as in harness.run_job).
        timeout: seconds before every process of the cluster is killed.
        env: extra variables (None removes one).
        args: the script's arguments.
        launcher_args: more hvdliterun flags.

    Returns:
        A harness.JobResult.
    """
    if np is None:
        np = sum(entry.slots for entry in parse_host_string(hosts))
    with tempfile.TemporaryDirectory(prefix="hvdlite-cluster-job-") as tmpdir:
        os.chmod(tmpdir, 0o755)
        path = harness.script_file(script, tmpdir)
        command = [sys.executable, "-m", "hvdlite.runner", "-np", str(np), "-H", hosts,
                   "--remote-shell", cluster.remote_shell(), *launcher_args,
                   sys.executable, path, *[str(a) for a in args]]
        return run_in_cluster(cluster, command, host=cluster.hosts[0].name, timeout=timeout,
                              env=env)


def mpiexec_command(cluster: NetnsCluster, hosts: str, np: int, argv: Sequence[str],
                    tmpdir: str) -> list:
    """A plain hydra mpiexec command over ``cluster`` (no hvdlite launcher), for baselines."""
    script = os.path.join(tmpdir, "enter-host.sh")
    with open(script, "w", encoding="utf-8") as f:
        f.write(f"#!/bin/sh\nexec {cluster.remote_shell()} \"$@\"\n")
    os.chmod(script, 0o755)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    host_list = ",".join(entry.host + ":" + str(entry.slots) for entry in parse_host_string(hosts))
    return [mpiexec, "-launcher", "rsh", "-launcher-exec", script, "-hosts", host_list,
            "-n", str(np), "-prepend-pattern", "[%r]:", *argv]
