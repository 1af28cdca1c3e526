"""A real Slurm on a namespace cluster (Debian's slurm-wlm and munge).

    slurm = SlurmCluster(cluster, workdir).start()   # slurmctld on h1, a slurmd per host
    slurm.run("h1", ["srun", "-N", "2", "-n", "4", "hostname"])
    slurm.close()

One ``munged`` serves every host: its socket is a file, and the namespaces share the
filesystem (a Unix socket named by a path is reached from any network namespace). It
runs in the first host with its own key, socket and files under ``workdir``, so it
never meets a system munge, and the cluster's teardown (or ``cleanup_stale`` after a
SIGKILL) ends it with the rest. ``slurmctld`` runs in the first host,
a ``slurmd`` in each host (its NodeName is the host's name, its NodeAddr the host's
address on the bridge); all of them in the foreground, as children of this process, and
all of them (and every job step) are killed by ``close()`` or by the cluster's own
teardown, which kills every process of its namespaces.

The configuration is the smallest that works without systemd or cgroups: root as the
Slurm user, ``proctrack/linuxproc``, ``task/none``, no accounting, ``select/cons_tres``
by CPU, generous timeouts. Clients (srun, sbatch, squeue) find it through ``SLURM_CONF``
(:meth:`SlurmCluster.env`).
"""
import os
import shutil
import signal
import subprocess
import time
from typing import Dict, Optional, Sequence

from hvdlite.runner.netns_cluster import NetnsCluster

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scancel")
CPUS_PER_NODE = 2
CGROUP_CONF = "CgroupPlugin=cgroup/v1\n"


def unavailable_reason() -> Optional[str]:
    """Why Slurm cannot run here (a program missing), or None."""
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        return ("Slurm needs " + ", ".join(missing) + " (apt-get install slurm-wlm munge; "
                "as root, scripts/setup_venv.sh slurm does it)")
    return None


class SlurmError(RuntimeError):
    """Slurm did not come up; the message has the daemons' log tails."""


class SlurmCluster:
    """munged, slurmctld and the slurmds of one namespace cluster."""

    def __init__(self, cluster: NetnsCluster, workdir: str, cpus_per_node: int = CPUS_PER_NODE):
        self.cluster = cluster
        self.workdir = os.path.abspath(workdir)
        self.cpus_per_node = cpus_per_node
        self.conf = os.path.join(self.workdir, "slurm.conf")
        self.munge_socket = os.path.join(self.workdir, "munge", "munge.socket")
        self._processes = []

    # ----- configuration -------------------------------------------------------------

    def _write_munge_key(self) -> str:
        munge_dir = os.path.join(self.workdir, "munge")
        os.makedirs(munge_dir, mode=0o700, exist_ok=True)
        os.chmod(munge_dir, 0o755)  # clients (as root here) reach the socket through it
        key = os.path.join(munge_dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        return key

    def slurm_conf(self) -> str:
        """slurm.conf's text for this cluster."""
        w = self.workdir
        controller = self.cluster.hosts[0]
        lines = [
            "ClusterName=hvdlite",
            f"SlurmctldHost={controller.name}({controller.address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={w}/state",
            f"SlurmdSpoolDir={w}/spool-%n",
            f"SlurmctldPidFile={w}/slurmctld.pid",
            f"SlurmdPidFile={w}/slurmd-%n.pid",
            f"SlurmctldLogFile={w}/slurmctld.log",
            f"SlurmdLogFile={w}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SlurmctldTimeout=300",
            "SlurmdTimeout=300",
            "MessageTimeout=60",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=30",
            "Waittime=0",
        ]
        for host in self.cluster.hosts:
            lines.append(f"NodeName={host.name} NodeAddr={host.address} "
                         f"CPUs={self.cpus_per_node} State=UNKNOWN")
        lines.append("PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF`` set."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        return env

    # ----- starting and stopping -----------------------------------------------------

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        """Starts munged, slurmctld and the slurmds; returns once every node is idle.

        Raises:
            SlurmError: a daemon exited or the nodes did not become idle in ``timeout``.
        """
        os.makedirs(os.path.join(self.workdir, "state"), exist_ok=True)
        for host in self.cluster.hosts:
            os.makedirs(os.path.join(self.workdir, f"spool-{host.name}"), exist_ok=True)
        os.chmod(self.workdir, 0o755)
        with open(self.conf, "w", encoding="ascii") as f:
            f.write(self.slurm_conf())
        with open(os.path.join(self.workdir, "cgroup.conf"), "w", encoding="ascii") as f:
            f.write(CGROUP_CONF)
        key = self._write_munge_key()
        munge_dir = os.path.dirname(key)
        controller = self.cluster.hosts[0].name
        try:
            self._spawn(controller, "munged", [
                "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={key}", f"--pid-file={munge_dir}/munged.pid",
                f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/munged.seed"])
            self._wait(lambda: os.path.exists(self.munge_socket), 20, "munged's socket")
            self._spawn(controller, "slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
            for host in self.cluster.hosts:
                self._spawn(host.name, f"slurmd-{host.name}",
                            ["slurmd", "-D", "-f", self.conf, "-N", host.name])
            self._wait(self._nodes_idle, timeout, "every node idle in sinfo")
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, host: str, name: str, argv: Sequence[str]) -> None:
        with open(os.path.join(self.workdir, f"{name}.out"), "wb") as log:
            proc = self.cluster.popen(host, list(argv), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self.env(),
                                      start_new_session=True)
        self._processes.append((name, proc))

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self._processes:
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited ({proc.returncode}) before {what}:\n"
                                     + self.logs())
            if time.monotonic() > deadline:
                raise SlurmError(f"no {what} after {timeout:.0f}s:\n" + self.logs())
            time.sleep(0.5)

    def _nodes_idle(self) -> bool:
        result = self.run(self.cluster.hosts[0].name, ["sinfo", "-h", "-N", "-o", "%N %T"],
                          timeout=30)
        states = dict(line.split()[:2] for line in result.stdout.splitlines()
                      if len(line.split()) >= 2)
        return (result.returncode == 0 and len(states) == len(self.cluster.hosts)
                and all(state == "idle" for state in states.values()))

    def run(self, host: str, argv: Sequence[str], timeout: float = 60.0,
            env: Optional[Dict[str, str]] = None, **kwargs) -> subprocess.CompletedProcess:
        """Runs a client command (srun, sbatch, squeue...) inside ``host``."""
        return self.cluster.run(host, list(argv), timeout=timeout, env=self.env(env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", stdin=subprocess.DEVNULL, **kwargs)

    def logs(self, tail: int = 30) -> str:
        """The last lines of every daemon's logs, for failure messages."""
        out = []
        for root, _, files in os.walk(self.workdir):
            for name in sorted(files):
                if name.endswith((".log", ".out")):
                    path = os.path.join(root, name)
                    try:
                        with open(path, "r", encoding="utf-8", errors="replace") as f:
                            lines = f.read().splitlines()[-tail:]
                    except OSError:
                        continue
                    out.append(f"--- {os.path.relpath(path, self.workdir)}\n" + "\n".join(lines))
        return "\n".join(out)

    def close(self) -> None:
        """Kills the daemons (and what they started). Idempotent."""
        for _, proc in reversed(self._processes):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for _, proc in self._processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._processes = []
