"""RayExecutor: hvdlite jobs on a Ray cluster, with horovod.ray's API.

    from hvdlite.ray import RayExecutor      # was: from horovod.ray import RayExecutor
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=4, cpus_per_worker=1)
    executor.start()
    results = executor.run(train_fn)          # one result per rank, in rank order
    executor.shutdown()

Workers are Ray actors in a placement group (one bundle per worker, ``PACK``; or one
bundle per host holding its workers, ``STRICT_SPREAD``, for ``num_hosts``); an
existing placement group (Ray Tune's trial) is used when asked. The world across them
is formed by hvdliterun's machinery (see world.py), so each actor is an MPI rank:
``hvd.init()`` inside ``run``'s function joins it.
"""
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import ray
from ray.util.placement_group import (get_current_placement_group, placement_group,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hvdlite.ray import ray_logger, worker
from hvdlite.ray.world import World, WorldError

logger = logging.getLogger("hvdlite")

# Seconds the workers get to report their own error once the job has ended under a call.
JOB_END_GRACE_S = 10.0


@dataclass
class RaySettings:
    """What ``RayExecutor.create_settings`` returns (horovod.ray's MiniSettings).

    Attributes:
        timeout_s: seconds for every rank to start and join the world.
        ssh_identity_file, ssh_str: accepted for horovod.ray's signature; unused (the
            ranks start through the actors, not ssh).
        placement_group_timeout_s: seconds for Ray to place every worker.
        nics: network interfaces for MPI and for the ranks' calls to the driver (the
            first one, in sorted order, is used).
    """

    timeout_s: int = 30
    ssh_identity_file: Optional[str] = None
    ssh_str: Optional[str] = None
    placement_group_timeout_s: int = 100
    nics: Optional[set] = None


class BaseWorker:
    """One rank: the Ray actor that runs the driver's functions (and the executable).

    Driven by the driver only, one call at a time.
    """

    def __init__(self):
        self.executable = None

    def call(self, fn: Callable, *args):
        """Runs ``fn(*args)`` here (the world-forming steps of world.py)."""
        return fn(*args)

    def update_env_vars(self, env_vars: Dict[str, str]):
        """Sets variables in this worker's environment."""
        import os

        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def start_executable(self, executable_cls, executable_args, executable_kwargs):
        """Makes this worker's executable: ``executable_cls(*args, **kwargs)``."""
        self.executable = executable_cls(*(executable_args or []),
                                         **(executable_kwargs or {}))

    def execute(self, fn: Callable):
        """Returns ``fn(executable)``."""
        return fn(self.executable)

    def run(self, fn: Callable, args=None, kwargs=None):
        """Returns ``fn(*args, **kwargs)``."""
        return fn(*(args or []), **(kwargs or {}))

    def leave(self):
        """Ends this rank well; the actor exits after this call (see RayExecutor)."""
        worker.leave()


class RayExecutor:
    """Runs an hvdlite job on Ray actors, with horovod.ray.RayExecutor's API.

    Args:
        settings: from :meth:`create_settings`.
        num_workers: the number of ranks, placed as Ray packs them (``PACK``).
        num_hosts: the number of hosts, each with ``num_workers_per_host`` ranks
            (``STRICT_SPREAD``: every host a different node).
        num_workers_per_host: ranks per host with ``num_hosts``.
        cpus_per_worker: CPUs each worker reserves.
        use_gpu: reserve GPUs (``gpus_per_worker``, default 1, each).
        gpus_per_worker: GPUs per worker; needs ``use_gpu``.
        use_current_placement_group: inside a placement group (a Ray Tune trial), place
            the workers in it instead of a new one.
        min_workers: elastic training: the job goes on while at least this many workers
            can run (docs/ray.md, "Elastic training"); excludes ``num_workers``.
        max_workers: at most this many workers (default: as many as the nodes take).
        reset_limit: end the job instead of a reset past this many resets.
        cooldown_range: ``(min_s, max_s)``: a failed worker's slot or a lost node comes
            back after a random time in it (default: never).
        elastic_timeout: seconds to wait for ``min_workers`` slots before giving up.
        override_discovery: recheck Ray's nodes while the job runs (True), or keep the
            nodes found at the start of :meth:`run`.

    Raises:
        ValueError: inconsistent arguments, with horovod.ray's checks.
    """

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: int = 100,
                        nics: Optional[set] = None) -> RaySettings:
        """Settings for :class:`RayExecutor` (horovod.ray's signature).

        Raises:
            ValueError: a timeout that is not a positive number.
        """
        for name, value in (("timeout_s", timeout_s),
                            ("placement_group_timeout_s", placement_group_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        return RaySettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                           ssh_str=ssh_str, placement_group_timeout_s=placement_group_timeout_s,
                           nics=set(nics) if nics else None)

    def __init__(self, settings: RaySettings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[int] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range=None,
                 elastic_timeout: int = 600, override_discovery: bool = True):
        if max_workers is not None and (not min_workers or min_workers <= 0):
            raise ValueError("`max_workers` provided without any positive `min_workers`")
        if min_workers is not None and num_workers is not None:
            raise ValueError("Both `min_workers` and `num_workers` provided.")
        if min_workers is not None and max_workers is not None and min_workers > max_workers:
            raise ValueError(f"`max_workers` ({max_workers}) < `min_workers` ({min_workers})")
        if min_workers is None:
            if num_workers is None and num_hosts is None:
                raise ValueError("One of `num_workers`, `num_hosts` or `min_workers` must be "
                                 "provided.")
            if num_workers is not None and num_hosts is not None:
                raise ValueError("Both `num_workers` and `num_hosts` provided: give one.")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("min_workers", min_workers)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if not isinstance(num_workers_per_host, int) or num_workers_per_host < 1:
            raise ValueError(f"`num_workers_per_host` must be a positive integer, got "
                             f"{num_workers_per_host!r}")
        if gpus_per_worker and not use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False. use_gpu must be "
                             "True if gpus_per_worker is set.")
        if use_gpu and isinstance(gpus_per_worker, int) and gpus_per_worker < 1:
            raise ValueError(f"gpus_per_worker must be >= 1: Got {gpus_per_worker}.")
        if cpus_per_worker is None or cpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker must be >= 0, got {cpus_per_worker!r}")
        self.settings = settings
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.min_workers, self.max_workers = min_workers, max_workers
        self.reset_limit, self.cooldown_range = reset_limit, cooldown_range
        self.elastic_timeout, self.override_discovery = elastic_timeout, override_discovery
        self.elastic = min_workers is not None
        self._elastic_start = None  # start()'s arguments, for each elastic run
        self.last_worlds: List[int] = []  # elastic: each world's size in the last run
        self.workers: List[Any] = []        # actor handles, in rank order once started
        self._placement_group = None
        self._own_placement_group = False
        self._world: Optional[World] = None

    # -- starting -----------------------------------------------------------------------

    @property
    def _size(self) -> int:
        return self.num_workers if self.num_workers is not None \
            else self.num_hosts * self.num_workers_per_host

    def _bundles(self):
        per_worker = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            per_worker["GPU"] = self.gpus_per_worker
        if self.num_hosts is not None:
            per_host = {k: v * self.num_workers_per_host for k, v in per_worker.items()}
            return [per_host] * self.num_hosts, "STRICT_SPREAD"
        return [per_worker] * self.num_workers, "PACK"

    def _place(self):
        """The placement group and each worker's bundle index."""
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            self._placement_group = current
            count = len(current.bundle_specs)
            return [i % count for i in range(self._size)]
        bundles, strategy = self._bundles()
        self._placement_group = placement_group(bundles, strategy=strategy)
        self._own_placement_group = True
        timeout = self.settings.placement_group_timeout_s
        ready, _ = ray.wait([self._placement_group.ready()], timeout=timeout)
        if not ready:
            free, total = ray.available_resources(), ray.cluster_resources()
            nodes = sum(1 for node in ray.nodes() if node["Alive"])
            have = ", ".join(f"{free.get(k, 0):g} of {total[k]:g} {k}" for k in ("CPU", "GPU")
                             if k in total)
            raise TimeoutError(
                f"Ray could not place the {self._size} worker(s) within {timeout:g} s "
                f"(placement_group_timeout_s): {len(bundles)} bundle(s) of {bundles[0]} with "
                f"strategy {strategy}, on a cluster of {nodes} node(s) with "
                f"{have} free. Lower cpus_per_worker/num_workers, or add nodes.")
        if self.num_hosts is not None:
            return [i // self.num_workers_per_host for i in range(self._size)]
        return list(range(self._size))

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict[str, str]] = None):
        """Places the workers, forms the hvdlite world across them and, with
        ``executable_cls``, makes each worker's executable.

        Args:
            executable_cls: a class instantiated on every worker (for :meth:`execute`).
            executable_args, executable_kwargs: its arguments.
            extra_env_vars: variables set in every worker before anything else runs.

        Raises:
            TimeoutError: the placement group was not ready in placement_group_timeout_s.
            RuntimeError: the world could not be formed (the message says what and where).
            In every case nothing is left behind: no actor, placement group or process.

        With ``min_workers`` (elastic) nothing is started here: each :meth:`run` starts
        its worlds, with these arguments, on the nodes Ray has then.
        """
        if self.workers or self._elastic_start is not None:
            raise RuntimeError("RayExecutor.start() was already called")
        if self.elastic:
            executable = (executable_cls, executable_args, executable_kwargs) \
                if executable_cls is not None else None
            self._elastic_start = (executable,
                                   {str(k): str(v) for k, v in (extra_env_vars or {}).items()})
            return
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, executable_cls, executable_args, executable_kwargs, extra_env_vars):
        bundle_of = self._place()
        actor_cls = ray.remote(BaseWorker)
        actors = [actor_cls.options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group,
                placement_group_bundle_index=bundle)).remote() for bundle in bundle_of]
        self.workers = actors
        # The user's variables go in first (so that the checks of the nodes see them) and
        # again after each rank's identity arrives, so that they win over the launcher's.
        if extra_env_vars:
            ray.get([a.update_env_vars.remote(extra_env_vars) for a in actors])
        self._world = World(lambda i, fn, *args: actors[i].call.remote(fn, *args),
                            len(actors), start_timeout=self.settings.timeout_s,
                            nics=self.settings.nics,
                            extra_env={str(k): str(v) for k, v in (extra_env_vars or {}).items()})
        try:
            places = self._world.form()
        except WorldError as exc:
            raise RuntimeError(f"hvdlite ray: {exc}") from exc
        places = sorted(places, key=lambda p: p.rank)
        self.workers = [actors[p.index] for p in places]
        if executable_cls is not None:
            refs = [w.start_executable.remote(executable_cls, executable_args,
                                              executable_kwargs) for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=None)
            for place, ref in zip(places, refs):
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise RuntimeError(
                        f"hvdlite ray: the worker of rank {place.rank} on {place.hostname} "
                        f"({place.ip}) died while making its {executable_cls.__name__}: "
                        f"{exc}") from exc

    # -- running ------------------------------------------------------------------------

    def _check_started(self, elastic_ok=False):
        if self.elastic and self._elastic_start is not None:
            if not elastic_ok:
                raise RuntimeError("an elastic RayExecutor (min_workers) runs its workers "
                                   "only during run() or execute(): each world has new "
                                   "ones, so there are none to call outside them")
            return
        if not self.workers or self._world is None:
            raise RuntimeError("RayExecutor is not started: call start() first")

    def _run_elastic(self, call, callbacks):
        from hvdlite.ray.elastic import ElasticJob, ElasticOptions

        executable, extra_env = self._elastic_start
        options = ElasticOptions(
            min_workers=self.min_workers, max_workers=self.max_workers,
            reset_limit=self.reset_limit, cooldown_range=self.cooldown_range,
            elastic_timeout=self.elastic_timeout, override_discovery=self.override_discovery,
            cpus_per_worker=self.cpus_per_worker, gpus_per_worker=self.gpus_per_worker,
            start_timeout=self.settings.timeout_s, nics=self.settings.nics)
        pump = ray_logger.CallbackPump(callbacks) if callbacks else None
        try:
            job = ElasticJob(options, BaseWorker, call, extra_env, executable, pump)
            self.last_worlds = job.worlds
            results = job.run()
        finally:
            if pump is not None:
                pump.close()
        if pump is not None and pump.error is not None:
            raise pump.error
        return results

    def _with_callbacks(self, callbacks, submit):
        """``submit()``'s results, with the workers' reports going to ``callbacks``."""
        if not callbacks:
            return self._get(submit())
        pump = ray_logger.CallbackPump(callbacks)
        try:
            ray.get([w.call.remote(ray_logger.configure, pump.queue) for w in self.workers])
            try:
                results = self._get(submit())
            finally:
                ray.wait([w.call.remote(ray_logger.configure, None) for w in self.workers],
                         num_returns=len(self.workers), timeout=10.0)
        finally:
            pump.close()
        if pump.error is not None:
            raise pump.error
        return results

    def _get(self, refs):
        """ray.get of ``refs`` (in order) that also ends when the job ended under the call.

        A worker's own error is raised as soon as it comes. When the job ends (a lost
        rank: the launcher ends the rest a few seconds later), the workers get
        JOB_END_GRACE_S to raise theirs (RankFailedError names the lost ranks); then
        RuntimeError gives the launcher's account.
        """
        refs = list(refs)
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
            if len(ready) == len(refs):
                return ray.get(refs)
            for ref in ready:
                ray.get(ref)  # raises a failed worker's error, with its traceback
            failure = self._world.failure() if self._world else None
            if failure:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=JOB_END_GRACE_S)
                results = [ray.get(ref) for ref in ready]
                if len(results) == len(refs):
                    return results
                raise RuntimeError(f"hvdlite ray: the job ended: {failure}")

    def run_remote(self, fn: Callable, args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List["ray.ObjectRef"]:
        """Starts ``fn(*args, **kwargs)`` on every worker; returns their object refs,
        in rank order."""
        self._check_started()
        return [w.run.remote(fn, args, kwargs) for w in self.workers]

    def run(self, fn: Callable, args: Optional[List] = None, kwargs: Optional[Dict] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """Runs ``fn(*args, **kwargs)`` on every worker.

        Args:
            fn: the function; it calls ``hvd.init()`` as under hvdliterun. Elastic
                (``min_workers``): a function that runs its training through one
                decorated with ``hvd.elastic.run``; it runs again from its start in
                every new world.
            args, kwargs: its arguments.
            callbacks: callables on the driver, each called with every report a worker
                sends with ``hvdlite.ray.ray_logger.log(...)`` while ``fn`` runs (as
                horovod.ray's); a callback's exception is raised once ``fn`` is done.

        Returns:
            The results, in rank order (elastic: those of the world that finished).

        Raises:
            Whatever ``fn`` raised on a worker (``ray.exceptions.RayTaskError``), or
            RuntimeError when the job ended under it (a lost rank; elastic: fewer than
            ``min_workers`` for ``elastic_timeout``, or past ``reset_limit``).
        """
        self._check_started(elastic_ok=True)
        if self.elastic:
            return self._run_elastic(lambda w: w.run.remote(fn, args, kwargs), callbacks)
        return self._with_callbacks(callbacks, lambda: self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """Runs ``fn(executable)`` on every worker; returns the results in rank order
        (``callbacks`` as for :meth:`run`)."""
        self._check_started(elastic_ok=True)
        if self.elastic:
            return self._run_elastic(lambda w: w.execute.remote(fn), callbacks)
        return self._with_callbacks(callbacks,
                                    lambda: [w.execute.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Runs ``fn(executable)`` on rank 0 only; returns its result."""
        self._check_started()
        return self._get([self.workers[0].execute.remote(fn)])[0]

    # -- ending -------------------------------------------------------------------------

    def shutdown(self):
        """Ends the ranks, the actors and the placement group (if the executor made it).

        Safe to call more than once, and after a failed start. (An elastic executor's
        workers end with each run.)
        """
        self._elastic_start = None
        actors, self.workers = self.workers, []
        if self._world is not None:
            if actors and not self._world.ended():
                self._world.leave()
            # Graceful exit: each actor's process ends, MPI finalizing at its exit.
            refs = [a.__ray_terminate__.remote() for a in actors]
            ray.wait(refs, num_returns=len(refs), timeout=10.0)
        for actor in actors:
            ray.kill(actor)
        if self._world is not None:
            self._world.stop(timeout=10.0)
            self._world = None
        if self._placement_group is not None and self._own_placement_group:
            remove_placement_group(self._placement_group)
        self._placement_group = None
        self._own_placement_group = False
