"""Elastic training, framework-free: ``hvdlite.elastic.run``, ``State``, ``ObjectState``.

The PyTorch names (``TorchState``, ``ElasticSampler``) are in ``hvdlite.torch.elastic``,
which ``import hvdlite.torch as hvd`` makes ``hvd.elastic``. A job resets when it runs
under ``hvdliterun --min-np/--max-np`` (see hvdlite/runner/elastic_driver.py).
"""
from hvdlite.elastic.state import ObjectState, State, run
from hvdlite.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "run"]
