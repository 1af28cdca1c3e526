"""hvdlite on Ray: ``RayExecutor`` (horovod.ray's API) and a Ray Train backend.

    from hvdlite.ray import RayExecutor
    executor = RayExecutor(RayExecutor.create_settings(), num_workers=4)
    executor.start()
    executor.run(train)          # train() calls hvd.init() as under hvdliterun
    executor.shutdown()

Each worker is a Ray actor and one rank; the world across them is formed by hvdliterun's
own launcher, with the actors as its remote shell (see world.py and docs/ray.md).
Needs ``ray`` (``pip install hvdlite[ray]``).
"""
try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised without ray only
    raise ImportError("hvdlite.ray needs Ray: pip install 'ray[train]' "
                      "(or hvdlite[ray])") from exc

from hvdlite.ray.executor import BaseWorker, RayExecutor, RaySettings
from hvdlite.ray.train import HvdliteConfig

__all__ = ["BaseWorker", "HvdliteConfig", "RayExecutor", "RaySettings"]
