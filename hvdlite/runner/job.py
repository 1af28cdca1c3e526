"""One job as the launcher starts it: the validated request, each rank's command, the
mpiexec command line, and the supervised run.

The launcher (launch.py) runs one such job; the elastic driver (elastic_driver.py) one
after another, each a world of its own size and hosts.
"""
import logging
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from hvdlite.runner import hosts as hostlib
from hvdlite.runner import mpi_command
from hvdlite.runner import openmpi
from hvdlite.runner import rank_wrapper
from hvdlite.runner import remote_start as remote_start_module
from hvdlite.runner.elastic_settings import ElasticSettings

logger = logging.getLogger("hvdlite")

DEFAULT_START_TIMEOUT_S = 60.0
_RANK_WRAPPER_PATH = os.path.abspath(rank_wrapper.__file__)
_REMOTE_START_PATH = os.path.abspath(remote_start_module.__file__)


@dataclass
class LaunchConfig:
    """A validated hvdliterun request."""

    num_ranks: int
    command: List[str]
    hosts: Optional[List[hostlib.HostSlots]] = None
    tuning_env: Dict[str, str] = field(default_factory=dict)
    output_dir: Optional[str] = None
    start_timeout: float = DEFAULT_START_TIMEOUT_S
    mpi_args: List[str] = field(default_factory=list)
    verbose: bool = False
    check_build: bool = False
    allow_run_as_root: bool = False
    remote_shell: Optional[str] = None
    network_interface: Optional[str] = None
    elastic: Optional[ElasticSettings] = None


def rank_command(command: Sequence[str], python: str = sys.executable) -> List[str]:
    """The argv each rank runs: the rank wrapper (by path, stdlib only) and the command.

    Args:
        command: the user's command.
        python: the interpreter for the wrapper (the same path must exist on every host).

    Returns:
        The argument vector.
    """
    # -I: the wrapper needs nothing from PYTHONPATH or site customisations.
    return [python, "-I", _RANK_WRAPPER_PATH, "--", *command]


def build_job_command(config: LaunchConfig, launcher: mpi_command.MpiLauncher,
                      env: Dict[str, str], python: str = sys.executable,
                      run_as_root: Optional[bool] = None,
                      remote_start: Optional[str] = None) -> List[str]:
    """The full mpiexec argv for a request (pure: nothing is started).

    Args:
        config: the validated request.
        launcher: the mpiexec to use.
        env: the environment the ranks will get (names are forwarded for Open MPI).
        python: the interpreter that runs the rank wrapper.
        run_as_root: add Open MPI's --allow-run-as-root; None: as root, when
            --allow-run-as-root or Open MPI's variables in ``env`` say so.
        remote_start: the script mpiexec starts remote processes with (see
            :func:`write_remote_start_script`), or None for mpiexec's ssh.

    Returns:
        The argument vector.
    """
    if run_as_root is None:
        run_as_root = openmpi.run_as_root(config.allow_run_as_root, env)
    hosts = config.hosts
    set_env = dict(config.tuning_env)
    if launcher.flavor is mpi_command.MpiFlavor.OPENMPI:
        set_env.update(openmpi.rank_env(env, config.mpi_args))
    options = mpi_command.MpiCommandOptions(
        launcher=launcher, num_ranks=config.num_ranks,
        rank_command=rank_command(config.command, python), hosts=hosts,
        set_env=set_env,
        forward_env=mpi_command.forwardable_env_names(env),
        extra_args=config.mpi_args, run_as_root=run_as_root, remote_start=remote_start,
        network_interface=config.network_interface)
    return mpi_command.build_mpi_command(options)


def write_remote_start_script(directory: str, remote_shell: str,
                              python: str = sys.executable) -> str:
    """Writes the executable mpiexec calls to start processes on other hosts.

    mpiexec takes one program path (hydra's ``-launcher-exec``, Open MPI's
    ``plm_rsh_agent``); the script runs remote_start.py with the remote shell command.

    Returns:
        The script's path.
    """
    path = os.path.join(directory, "remote-start")
    with open(path, "w", encoding="utf-8") as f:
        f.write("#!/bin/sh\nexec " + shlex.join([python, "-I", _REMOTE_START_PATH, "--shell",
                                                 remote_shell, "--"]) + ' "$@"\n')
    os.chmod(path, 0o755)
    return path


def new_supervisor(config: LaunchConfig, bind: str, advertise: str, cls, peer_timeout):
    """A ``cls`` (JobSupervisor or a subclass) for the job ``config`` describes."""
    supervisor = cls(config.num_ranks, config.start_timeout, config.output_dir,
                     bind_host=bind, advertise_host=advertise,
                     rank_hosts=hostlib.rank_hosts(config.hosts, config.num_ranks),
                     tag_hosts=config.verbose)
    supervisor.peer_timeout = peer_timeout
    return supervisor


def supervise_job(config: LaunchConfig, launcher: mpi_command.MpiLauncher, supervisor,
                  extra_env: Optional[Dict[str, str]] = None):
    """Starts the job ``config`` describes and supervises it to its end.

    Args:
        config: the request (one world of an elastic job: its size and hosts).
        launcher: the mpiexec to use.
        supervisor: from :func:`new_supervisor`.
        extra_env: more variables for the ranks.

    Returns:
        The supervisor's JobResult.
    """
    env = dict(os.environ)
    env.update(config.tuning_env)
    env.update(supervisor.rank_env())
    env.update(extra_env or {})
    if config.network_interface:
        # The mpich wheel's transports pick their interface from these.
        env.setdefault("UCX_NET_DEVICES", config.network_interface)
        env.setdefault("FI_TCP_IFACE", config.network_interface)
    local = config.hosts is None or hostlib.all_local(config.hosts)
    with tempfile.TemporaryDirectory(prefix="hvdliterun-") as tmpdir:
        remote_start = None
        if config.remote_shell and not local:
            remote_start = write_remote_start_script(tmpdir, config.remote_shell)
            logger.debug("starting remote processes with: %s", config.remote_shell)
        argv = build_job_command(config, launcher, env, remote_start=remote_start)
        logger.debug("running: %s", shlex.join(argv))
        started = time.time()
        try:
            return supervisor.run(argv, env)
        finally:
            # The rank wrappers remove what ranks that died without MPI_Finalize left in
            # this host's shared memory, unless mpiexec killed them first (MPICH's does,
            # once a rank ends without finalizing): then it is done here, for this host.
            rank_wrapper.remove_orphaned_mpi_segments(started)
