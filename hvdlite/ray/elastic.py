"""Elastic training on Ray: hvdliterun's elastic driver, with Ray's nodes as its hosts.

    executor = RayExecutor(settings, min_workers=2, max_workers=4, cpus_per_worker=1)
    executor.start()
    results = executor.run(train)       # train decorated with @hvd.elastic.run

The elastic driver of ``hvdliterun --min-np/--max-np`` (hvdlite/runner/elastic_driver.py)
runs one world after another from the last commit; here it is given

- a discovery that asks Ray, on the driver, which nodes are alive and how many workers
  each can take now (its free CPUs and GPUs for ``cpus_per_worker``/``gpus_per_worker``,
  plus the workers this job holds there), every second while the job runs;
- a way to start a world: one new Ray actor per slot of the world's plan, pinned to its
  node, made into an hvdlite world as RayExecutor's (world.py), running ``fn``;
- a probe of a host: a task pinned to the node, answered within seconds or not.

Each world has new actors: an MPI world cannot shrink or grow in place, and a process
cannot call MPI_Init twice (docs/elastic.md), so a reset ends the world's actors with
it. A rank that leaves for a reset tells its stand-in under mpiexec (handoff.py), which
exits with the reset code, so the driver tells survivors from the dead as under
hvdliterun. The commit lives in tmpfs on each node, where the next world's actors on
that node find it.
"""
import logging
import math
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hvdlite.ray import ray_logger
from hvdlite.ray.world import World, WorldError
from hvdlite.runner import elastic_driver
from hvdlite.runner import hosts as hostlib
from hvdlite.runner import job as joblib
from hvdlite.runner import launch
from hvdlite.runner import wire
from hvdlite.runner.elastic_settings import ElasticSettings
from hvdlite.runner.supervisor import JobResult

logger = logging.getLogger("hvdlite")

# Seconds a node that Ray calls alive has to answer the probe of a host whose ranks all
# vanished (a loaded node takes seconds to run a task; a dead one Ray marks dead sooner).
HOST_PROBE_TIMEOUT_S = 60.0
# Seconds to wait for Ray to show the resources of a world's ended actors free again.
RELEASE_TIMEOUT_S = 10.0
# Seconds a finished world's workers have to exit (MPI_Finalize) and its job to end.
END_TIMEOUT_S = 30.0
# No max_workers: as many workers as the nodes can take.
UNBOUNDED = 1 << 30

_FLAG_NAMES = (("--min-np", "min_workers"), ("--max-np", "max_workers"),
               ("--elastic-timeout", "elastic_timeout"), ("--reset-limit", "reset_limit"))


class UserError(Exception):
    """``fn`` raised in a worker (not a reset): the job ends and it is raised."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@dataclass
class ElasticOptions:
    """RayExecutor's elastic arguments and how each worker is made."""

    min_workers: int
    max_workers: Optional[int]
    reset_limit: Optional[int]
    cooldown_range: Optional[Tuple[float, float]]
    elastic_timeout: float
    override_discovery: bool
    cpus_per_worker: float
    gpus_per_worker: float
    start_timeout: float
    nics: Optional[Sequence[str]]


def _probe():
    return True


def _free_resources(alive_nodes) -> Dict[str, Dict[str, float]]:
    """{node id: free resources}. Ray publishes them per node only in its own state
    module; should that move, each node's total is taken instead (as horovod.ray's
    discovery does), and Ray's scheduler then holds back what does not fit."""
    try:
        from ray._private import state

        return state.available_resources_per_node()
    except (ImportError, AttributeError):  # pragma: no cover - another Ray
        return {n["NodeID"]: n.get("Resources", {}) for n in alive_nodes}


class RayNodes:
    """What Ray says about its nodes. The driver's discovery thread calls :meth:`slots`
    every second, the job's thread the rest; ``held`` and ``node_of`` are guarded by
    ``_lock``.

    Args:
        cpus_per_worker, gpus_per_worker: what one worker (slot) takes.
    """

    def __init__(self, cpus_per_worker: float, gpus_per_worker: float):
        self.cpus, self.gpus = cpus_per_worker, gpus_per_worker
        self._lock = threading.Lock()
        self.held: Counter = Counter()        # node id -> workers of this job there
        self.node_of: Dict[str, str] = {}     # address -> node id (alive nodes)

    def slots(self) -> List[hostlib.HostSlots]:
        """Each alive node (by address) and the workers it can take now: what its free
        resources hold, plus this job's workers already there."""
        alive = [n for n in ray.nodes() if n.get("Alive")]
        free = _free_resources(alive)
        out, node_of = [], {}
        with self._lock:
            held = dict(self.held)
        for node in alive:
            node_id, address = node["NodeID"], node["NodeManagerAddress"]
            if address in node_of:  # two nodes on one address: the first only
                continue
            node_of[address] = node_id
            have = free.get(node_id, {})
            fits = []
            if self.cpus:
                fits.append(math.floor(have.get("CPU", 0) / self.cpus + 1e-9))
            if self.gpus:
                fits.append(math.floor(have.get("GPU", 0) / self.gpus + 1e-9))
            count = (min(fits) if fits else 1) + held.get(node_id, 0)
            if count > 0:
                out.append(hostlib.HostSlots(address, count))
        with self._lock:
            self.node_of = node_of
        return out

    def node_id(self, address: str) -> Optional[str]:
        with self._lock:
            return self.node_of.get(address)

    def hold(self, node_id: str, count: int):
        with self._lock:
            self.held[node_id] += count

    def release_all(self):
        with self._lock:
            self.held.clear()

    def wait_released(self, nodes: Dict[str, int], timeout: float = RELEASE_TIMEOUT_S):
        """Waits until Ray shows the resources of ``nodes`` ({node id: workers}) free
        again (ended actors release theirs a moment later), for alive nodes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes_now = [n for n in ray.nodes() if n.get("Alive")]
            alive = {n["NodeID"] for n in nodes_now}
            free = _free_resources(nodes_now)
            if all(node not in alive or free.get(node, {}).get("CPU", 0) + 1e-9
                   >= count * self.cpus for node, count in nodes.items()):
                return
            time.sleep(0.2)

    def alive(self, address: str, timeout: float = HOST_PROBE_TIMEOUT_S) -> bool:
        """Whether the node at ``address`` is alive: it runs a task, and Ray has not
        marked it dead. A killed raylet is seen dead by Ray only after its health checks,
        and a busy node may take long to run the task: while Ray calls the node alive,
        its answer is awaited up to ``timeout``."""
        node = self._alive_node(address)
        if node is None:
            return False
        ref = ray.remote(_probe).options(
            num_cpus=0, max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                try:
                    return bool(ray.get(ready[0]))
                except ray.exceptions.RayError:
                    return False
            if self._alive_node(address) != node:
                break
        ray.cancel(ref, force=True)
        return False

    @staticmethod
    def _alive_node(address: str) -> Optional[str]:
        return next((n["NodeID"] for n in ray.nodes()
                     if n.get("Alive") and n["NodeManagerAddress"] == address), None)


class _RayElasticDriver(elastic_driver.ElasticDriver):
    """hvdliterun's elastic driver, probing hosts through Ray and speaking of
    RayExecutor's arguments in its messages (kept for the final error)."""

    def __init__(self, *args, nodes: RayNodes, **kwargs):
        super().__init__(*args, **kwargs)
        self.nodes = nodes
        self.messages: List[str] = []

    def host_alive(self, host: str) -> bool:
        return self.nodes.alive(host)

    def _say(self, message: str):
        for flag, name in _FLAG_NAMES:
            message = message.replace(flag, name)
        self.messages.append(message)
        sys.stderr.write(f"hvdlite ray: elastic: {message}\n")
        sys.stderr.flush()


class ElasticJob:
    """One ``RayExecutor.run`` of an elastic executor: worlds until one finishes.

    Runs in the caller's thread (the driver's loop and each world); the driver's own
    threads discover and answer the ranks' questions, the callbacks run in the pump's.

    Args:
        options: the executor's elastic arguments.
        actor_cls: the worker class (RayExecutor's BaseWorker), not yet remote.
        submit: ``submit(actor) -> ObjectRef``: starts what every rank runs (the
            user's function, which trains through one decorated with
            ``hvd.elastic.run``).
        extra_env: variables set in every worker first.
        executable: ``(cls, args, kwargs)`` made on every worker of every world, or None.
        pump: the callbacks' queue, or None.
    """

    def __init__(self, options: ElasticOptions, actor_cls, submit: Callable,
                 extra_env: Dict[str, str], executable=None,
                 pump: Optional[ray_logger.CallbackPump] = None):
        self.options = options
        self.actor_cls = ray.remote(actor_cls)
        self.submit = submit
        self.extra_env = extra_env
        self.executable = executable
        self.pump = pump
        self.nodes = RayNodes(options.cpus_per_worker, options.gpus_per_worker)
        self.results: Optional[List[Any]] = None
        self.worlds: List[int] = []     # each world's size, in order
        self.driver: Optional[_RayElasticDriver] = None

    def run(self) -> List[Any]:
        """Runs the job; returns the final world's results, in rank order.

        Raises:
            RuntimeError: the job could not go on (fewer than min_workers slots for
                elastic_timeout, past reset_limit); the message says which.
            ray.exceptions.RayTaskError: ``fn`` raised in a worker.
        """
        o = self.options
        settings = ElasticSettings(
            min_np=o.min_workers, max_np=o.max_workers or UNBOUNDED,
            elastic_timeout=float(o.elastic_timeout), reset_limit=o.reset_limit,
            cooldown_range=tuple(o.cooldown_range) if o.cooldown_range else None)
        config = joblib.LaunchConfig(num_ranks=0, command=[], elastic=settings,
                                     start_timeout=o.start_timeout)
        nics = sorted(o.nics) if o.nics else []
        first = self.nodes.slots()
        advertise = launch.launcher_address(first, nics[0] if nics else None, os.environ)
        bind = advertise if nics else "0.0.0.0"
        peer_timeout = wire.peer_timeout(os.environ)

        def make_supervisor(size, _hosts):
            world = joblib.LaunchConfig(num_ranks=size, command=[], hosts=self.driver.plan,
                                        start_timeout=o.start_timeout)
            return joblib.new_supervisor(world, bind, advertise,
                                         elastic_driver._WorldSupervisor, peer_timeout)

        discover = self.nodes.slots if o.override_discovery else None
        if discover is None:
            config.hosts = first
        self.driver = _RayElasticDriver(config, self._launch_world, make_supervisor, bind,
                                        advertise, discover=discover, nodes=self.nodes)
        try:
            code = self.driver.run()
        except UserError as exc:
            raise exc.error from None
        if code != 0 or self.results is None:
            said = "; ".join(self.driver.messages[-2:]) or f"exit code {code}"
            raise RuntimeError(f"hvdlite ray: the elastic job ended without finishing: {said}")
        return self.results

    # -- one world -------------------------------------------------------------------

    def _launch_world(self, supervisor, _hosts, size, env) -> JobResult:
        plan = list(self.driver.plan)
        self.worlds.append(size)
        actors, on_node = [], Counter()
        o = self.options
        node_ids = [self.nodes.node_id(host) for host, _ in plan]
        if None in node_ids:
            gone = [host for (host, _), node in zip(plan, node_ids) if node is None]
            supervisor.server.close()
            return JobResult(exit_code=1, message=f"node(s) {', '.join(gone)} left Ray")
        for (host, slots), node_id in zip(plan, node_ids):
            for _ in range(slots):
                actors.append(self.actor_cls.options(
                    num_cpus=o.cpus_per_worker, num_gpus=o.gpus_per_worker,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote())
                on_node[node_id] += 1
        for node_id, count in on_node.items():
            self.nodes.hold(node_id, count)
        world = None
        logger.debug("hvdlite ray: elastic: world %d: %d actor(s) asked for",
                     self.driver.generation, len(actors))
        try:
            problem = self._prepare(actors, plan)
            logger.debug("hvdlite ray: elastic: world %d: actors up", self.driver.generation)
            if problem:
                return JobResult(exit_code=1, message=problem)
            world = World(lambda i, f, *a: actors[i].call.remote(f, *a), size,
                          start_timeout=o.start_timeout, nics=o.nics,
                          extra_env=self.extra_env, job_env=env, supervisor=supervisor)
            try:
                places = world.form()
            except WorldError as exc:
                logger.warning("hvdlite ray: elastic: world %d did not form: %s",
                               self.driver.generation, exc)
                return world.result or JobResult(exit_code=1, message=str(exc))
            logger.debug("hvdlite ray: elastic: world %d formed", self.driver.generation)
            by_rank = [actors[p.index] for p in sorted(places, key=lambda p: p.rank)]
            return self._run_fn(world, by_rank)
        finally:
            for actor in actors:
                ray.kill(actor)
            if world is not None:
                world.stop(timeout=10.0)
            logger.debug("hvdlite ray: elastic: world %d ended", self.driver.generation)
            if world is None or world.result is None:
                supervisor.server.close()  # the job never ran: its listening socket
            self.nodes.wait_released(dict(on_node))
            self.nodes.release_all()
            logger.debug("hvdlite ray: elastic: world %d's resources free",
                         self.driver.generation)

    def _prepare(self, actors, plan) -> Optional[str]:
        """Waits for the actors to start and sets them up; returns a problem, or None."""
        refs = [a.call.remote(_probe) for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.options.start_timeout)
        hosts = [host for host, slots in plan for _ in range(slots)]
        if len(ready) < len(refs):
            late = sorted({hosts[i] for i, r in enumerate(refs) if r not in ready})
            return f"workers on {', '.join(late)} did not start within " \
                   f"{self.options.start_timeout:g} s"
        try:
            ray.get(refs)
            setup = []
            if self.extra_env:
                setup += [a.update_env_vars.remote(self.extra_env) for a in actors]
            if self.pump is not None:
                setup += [a.call.remote(ray_logger.configure, self.pump.queue)
                          for a in actors]
            ray.get(setup)
        except ray.exceptions.RayError as exc:
            return f"a worker died while it started: {exc}"
        return None

    def _run_fn(self, world: World, workers) -> JobResult:
        if self.executable is not None:
            cls, cargs, ckwargs = self.executable
            # A task's error first: one whose cause is another actor's death is also a
            # RayActorError, but its worker lives; a worker that died is not a task error.
            try:
                ray.get([w.start_executable.remote(cls, cargs, ckwargs) for w in workers])
            except ray.exceptions.RayTaskError as exc:
                world.stop(timeout=1.0)
                raise UserError(exc) from exc
            except ray.exceptions.RayActorError:
                pass  # the world failed under it: the job's end says how
        refs = [self.submit(w) for w in workers]
        results: Dict[int, Any] = {}
        pending = list(refs)
        logger.debug("hvdlite ray: elastic: world %d runs", self.driver.generation)
        while pending and not world.ended():
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in done:
                try:
                    results[refs.index(ref)] = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    world.stop(timeout=1.0)
                    raise UserError(exc) from exc
                except ray.exceptions.RayActorError:
                    pass  # left for a reset, or lost with its node
        if len(results) == len(refs):
            logger.debug("hvdlite ray: elastic: world %d finished", self.driver.generation)
            self.results = [results[i] for i in range(len(refs))]
            world.leave()
            ends = [w.__ray_terminate__.remote() for w in workers]
            ray.wait(ends, num_returns=len(ends), timeout=END_TIMEOUT_S)
            logger.debug("hvdlite ray: elastic: world %d's workers exited",
                         self.driver.generation)
        # The world ends: the supervisor saw each rank's exit (the driver reads them).
        world.stop(timeout=END_TIMEOUT_S)
        return world.result or JobResult(exit_code=1, message="the world ended")
