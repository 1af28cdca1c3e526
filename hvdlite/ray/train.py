"""A Ray Train backend: hvdlite worlds for Ray Train's data-parallel trainer.

    from ray.train import ScalingConfig
    from ray.train.data_parallel_trainer import DataParallelTrainer
    from hvdlite.ray import HvdliteConfig

    def train_loop_per_worker(config):
        import hvdlite.torch as hvd
        hvd.init()                       # as under hvdliterun
        ...
        ray.train.report({"loss": loss})

    DataParallelTrainer(train_loop_per_worker, backend_config=HvdliteConfig(),
                        scaling_config=ScalingConfig(num_workers=4)).fit()

Ray Train owns the workers (placement, restarts after failures); when it starts a
worker group the backend forms an hvdlite world across it, as RayExecutor does (see
world.py): worker ``i`` of the group becomes hvdlite rank ``i`` when the group's workers
come grouped by node (Ray Train orders them so), else ranks follow the nodes. A worker
group that Ray Train restarts gets a new world; the old one ends with its group.
"""
import threading
from dataclasses import dataclass
from typing import Dict, Optional

from ray.train.backend import Backend, BackendConfig

from hvdlite.ray.world import World, WorldError

# Seconds a world's job may take to end after its worker group was shut down.
WORLD_END_S = 30.0


@dataclass
class HvdliteConfig(BackendConfig):
    """Ray Train's configuration of the hvdlite backend.

    Attributes:
        timeout_s: seconds for every rank to start and join the world.
        nics: network interfaces for MPI and for the ranks' calls to the launcher (the
            first in sorted order is used); None: the routed ones.
    """

    timeout_s: float = 30.0
    nics: Optional[set] = None

    @property
    def backend_cls(self):
        return _HvdliteBackend


class _HvdliteBackend(Backend):
    """Forms a world when Ray Train starts a worker group, ends it when the group ends.

    One per process (Ray Train's backends are singletons): worlds are kept per group.
    Called by Ray Train's controller, one call at a time.
    """

    def __init__(self):
        self._worlds: Dict[int, World] = {}

    def on_start(self, worker_group, backend_config: HvdliteConfig):
        world = World(worker_group.execute_single_async, len(worker_group),
                      start_timeout=backend_config.timeout_s, nics=backend_config.nics)
        try:
            world.form()
        except WorldError as exc:
            world.stop(timeout=5.0)
            raise RuntimeError(f"hvdlite ray train: {exc}") from exc
        self._worlds[id(worker_group)] = world

    def on_shutdown(self, worker_group, backend_config: HvdliteConfig):
        world = self._worlds.pop(id(worker_group), None)
        if world is None:
            return
        world.leave()
        # Ray Train ends the workers next and the job ends with them; a job still there
        # after WORLD_END_S is ended (on a thread: Ray Train's controller goes on).
        threading.Thread(target=world.stop, args=(WORLD_END_S,), daemon=True,
                         name="hvdlite-ray-train-end").start()
