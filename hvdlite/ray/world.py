"""One hvdlite world across Ray actors, formed by hvdliterun's own machinery.

The driver (RayExecutor.start, or Ray Train's backend) has N worker actors, placed by
Ray. It forms the world in five steps, each a call into every worker (worker.py):

1. ``describe_node``: each worker's node (address, host name); ranks are given by node,
   nodes in the order of their first worker, workers of a node in their order: so
   rank, local rank and cross rank follow the nodes, as hvdliterun's ``-H`` does;
2. ``check_installation``: every node can load hvdlite's core and its MPI;
3. ``open_node_shell`` on the first worker of each node: that node's remote shell;
4. ``listen``: each worker waits for its rank's process;
5. the job: hvdliterun's launcher (job.supervise_job, JobSupervisor) runs mpiexec on
   the driver with ``-H node1:k1,node2:k2`` and the node shells as its remote shell,
   in a thread of the driver; each rank's process hands its MPI identity over to its
   worker (handoff.py), and ``join`` returns in every worker. Their ``hvd.init()``
   then forms the world.

Everything hvdliterun gives a rank comes along: the launcher watches every rank
(heartbeats), a worker that dies ends the job and the survivors' waits raise
RankFailedError, a rank that never starts is named with its host.
"""
import logging
import os
import shlex
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from hvdlite.ray import handoff as handoff_module
from hvdlite.ray import node_shell as node_shell_module
from hvdlite.ray import worker
from hvdlite.runner import hosts as hostlib
from hvdlite.runner import job as joblib
from hvdlite.runner import launch
from hvdlite.runner import mpi_command
from hvdlite.runner import wire
from hvdlite.runner.supervisor import JobResult, JobSupervisor

logger = logging.getLogger("hvdlite")

_HANDOFF_PATH = os.path.abspath(handoff_module.__file__)
_NODE_SHELL_PATH = os.path.abspath(node_shell_module.__file__)
# Seconds for the driver's small calls into the workers (describe, listen, ...).
CALL_TIMEOUT_S = 60.0

# call(index, fn, *args) -> ObjectRef: runs fn(*args) in worker ``index``.
Call = Callable[..., object]


class WorldError(RuntimeError):
    """The world could not be formed; the message names what and where."""


@dataclass
class WorkerPlace:
    """One worker of the world: where it runs and its ranks."""

    index: int
    ip: str
    hostname: str
    node_id: str
    rank: int = -1
    local_rank: int = -1
    cross_rank: int = -1


def assign_ranks(nodes: Sequence[Dict[str, str]]) -> List[WorkerPlace]:
    """Ranks by node: nodes in the order of their first worker, a node's workers in order.

    Args:
        nodes: :func:`worker.describe_node` of each worker, in the workers' order.

    Returns:
        One WorkerPlace per worker, in the workers' order.
    """
    places = [WorkerPlace(i, n["ip"], n["hostname"], n["node_id"]) for i, n in enumerate(nodes)]
    order: List[str] = []
    for place in places:
        if place.node_id not in order:
            order.append(place.node_id)
    rank = 0
    for cross_rank, node_id in enumerate(order):
        on_node = [p for p in places if p.node_id == node_id]
        for local_rank, place in enumerate(on_node):
            place.rank, place.local_rank, place.cross_rank = rank, local_rank, cross_rank
            rank += 1
    return places


def host_list(places: Sequence[WorkerPlace]) -> List[hostlib.HostSlots]:
    """hvdliterun's ``-H`` for the places: each node's address and its workers, in order."""
    hosts: List[hostlib.HostSlots] = []
    for place in sorted(places, key=lambda p: p.rank):
        if hosts and hosts[-1].host == place.ip:
            hosts[-1] = hostlib.HostSlots(place.ip, hosts[-1].slots + 1)
        else:
            hosts.append(hostlib.HostSlots(place.ip, 1))
    return hosts


def _get(refs, timeout, what, places=None):
    """ray.get with a timeout; a failure becomes a WorldError naming ``what`` and where."""
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as exc:
        raise WorldError(f"{what}: no answer from the workers within {timeout:g} s") from exc
    except ray.exceptions.RayError as exc:
        raise WorldError(f"{what} failed in a worker: {exc}") from exc


class World:
    """An hvdlite world across workers: the mpiexec job and the workers' ranks.

    Used by the driver's thread; the job runs in a thread of its own.
    """

    def __init__(self, call: Call, num_workers: int, start_timeout: float = 30.0,
                 nics: Optional[Sequence[str]] = None,
                 extra_env: Optional[Dict[str, str]] = None,
                 job_env: Optional[Dict[str, str]] = None,
                 supervisor: Optional[JobSupervisor] = None):
        """
        Args:
            call: ``call(index, fn, *args)`` runs ``fn(*args)`` in worker ``index``.
            num_workers: the workers (ranks).
            start_timeout: seconds for every rank to start.
            nics: interfaces for MPI and the ranks' calls to the driver.
            extra_env: variables set in each worker once its rank joined.
            job_env: more variables for the ranks' processes (an elastic world's).
            supervisor: the job's supervisor (an elastic driver's, made for this
                world's hosts in rank order); default: a JobSupervisor made here.
        """
        self._call = call
        self.job_env = dict(job_env or {})
        self.num_workers = num_workers
        self.start_timeout = start_timeout
        self.nics = sorted(nics) if nics else []
        self.extra_env = dict(extra_env or {})
        self.job_id = uuid.uuid4().hex[:12]
        self.places: List[WorkerPlace] = []
        self._supervisor: Optional[JobSupervisor] = supervisor
        self._thread: Optional[threading.Thread] = None
        self.result: Optional[JobResult] = None
        self._ending = False

    # -- forming --------------------------------------------------------------------

    def form(self) -> List[WorkerPlace]:
        """Forms the world (steps 1-5 of the module's docstring).

        Returns:
            Each worker's place and ranks, in the workers' order.

        Raises:
            WorldError: a node lacks hvdlite or MPI, a worker died, or the ranks did not
                start within the start timeout; nothing of the job is left running.
        """
        n = self.num_workers
        nodes = _get([self._call(i, worker.describe_node) for i in range(n)],
                     CALL_TIMEOUT_S, "finding the workers' nodes")
        self.places = assign_ranks(nodes)
        problems = _get([self._call(i, worker.check_installation) for i in range(n)],
                        CALL_TIMEOUT_S, "checking hvdlite on the workers' nodes")
        bad = sorted({f"{self.places[i].hostname} ({self.places[i].ip}): {problem}"
                      for i, problem in enumerate(problems) if problem})
        if bad:
            raise WorldError("cannot run hvdlite ranks on node " + "; on node ".join(bad))
        token = worker.new_token()
        first_on_node = {}
        for place in self.places:
            first_on_node.setdefault(place.ip, place.index)
        ports = _get([self._call(i, worker.open_node_shell, token)
                      for i in first_on_node.values()], CALL_TIMEOUT_S,
                     "starting the node shells")
        shells = dict(zip(first_on_node, ports))
        _get([self._call(p.index, worker.listen, self.job_id, p.rank) for p in self.places],
             CALL_TIMEOUT_S, "preparing the workers for their ranks")
        self._start_job({**self.job_env,
                         node_shell_module.ENV_SHELLS: node_shell_module.format_shells(shells),
                         node_shell_module.ENV_TOKEN: token,
                         handoff_module.ENV_JOB: self.job_id,
                         "HVDLITE_RAY_HANDOFF_TIMEOUT": repr(float(self.start_timeout))})
        self._wait_joined()
        return self.places

    def _start_job(self, env: Dict[str, str]):
        try:
            mpiexec = mpi_command.find_mpiexec()
        except mpi_command.MpiNotFoundError as exc:
            raise WorldError(f"on the driver ({os.uname().nodename}): {exc}") from exc
        launcher = mpi_command.probe_launcher(mpiexec)
        hosts = host_list(self.places)
        config = joblib.LaunchConfig(
            num_ranks=self.num_workers,
            command=[sys.executable, "-I", _HANDOFF_PATH], hosts=hosts,
            start_timeout=self.start_timeout,
            remote_shell=shlex.join([sys.executable, "-I", _NODE_SHELL_PATH]),
            network_interface=self.nics[0] if self.nics else None)
        try:
            advertise = launch.launcher_address(hosts, config.network_interface, os.environ)
        except launch.UsageError as exc:
            raise WorldError(str(exc)) from exc
        bind = advertise if config.network_interface else "0.0.0.0"
        if self._supervisor is None:
            self._supervisor = joblib.new_supervisor(config, bind, advertise, JobSupervisor,
                                                     wire.peer_timeout(os.environ))
        logger.debug("hvdlite ray: job %s on %s", self.job_id,
                     ",".join(f"{h.host}:{h.slots}" for h in hosts))

        def run_job():
            self.result = joblib.supervise_job(config, launcher, self._supervisor,
                                               extra_env=env)

        self._thread = threading.Thread(target=run_job, name=f"hvdlite-ray-{self.job_id}",
                                        daemon=True)
        self._thread.start()

    def _wait_joined(self):
        import ray

        pending = [self._call(p.index, worker.join, self.start_timeout + 5, self.extra_env)
                   for p in self.places]
        index_of = {ref: i for i, ref in enumerate(pending)}
        deadline = time.monotonic() + self.start_timeout + 10
        while pending:
            if self.ended():
                raise WorldError(self._failure("the ranks did not start"))
            if time.monotonic() > deadline:
                missing = ", ".join(f"rank {self.places[index_of[r]].rank} on "
                                    f"{self.places[index_of[r]].hostname}" for r in pending)
                raise WorldError(f"the ranks did not start within {self.start_timeout:g} s "
                                 f"(timeout_s): missing {missing}")
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in done:
                place = self.places[index_of[ref]]
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise WorldError(f"the worker of rank {place.rank} on {place.hostname} "
                                     f"({place.ip}) failed while its rank started: "
                                     f"{exc}") from exc

    def _failure(self, what: str) -> str:
        self._thread.join(timeout=10)
        message = self.result.message if self.result else "the job ended"
        return f"{what}: {message}"

    # -- running and ending ---------------------------------------------------------

    def ended(self) -> bool:
        """Whether the job (mpiexec) has ended."""
        return self._thread is not None and not self._thread.is_alive()

    def failure(self) -> Optional[str]:
        """The job's failure, when it ended badly while not asked to end; else None."""
        if not self.ended() or self._ending:
            return None
        if self.result is None or self.result.exit_code != 0:
            return self.result.message if self.result else "the job ended"
        return None

    def leave(self, timeout: float = 10.0):
        """Ends each worker's rank well (to be followed by the workers' exit)."""
        self._ending = True
        try:
            _get([self._call(p.index, worker.leave) for p in self.places], timeout,
                 "ending the ranks")
        except WorldError as exc:
            logger.debug("hvdlite ray: %s", exc)

    def stop(self, timeout: float = 15.0):
        """Waits up to ``timeout`` for the job to end after the workers exited, then
        ends it (its ranks' processes and mpiexec)."""
        self._ending = True
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._supervisor.end()
            self._thread.join(timeout)
