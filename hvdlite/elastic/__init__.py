"""Elastic training, framework-free: ``hvdlite.elastic.run``, ``State``, ``ObjectState``.

The PyTorch names (``TorchState``, ``ElasticSampler``) are in ``hvdlite.torch.elastic``,
which ``import hvdlite.torch as hvd`` makes ``hvd.elastic``. A job resets when it runs
under ``hvdliterun --min-np/--max-np`` (see hvdlite/runner/elastic_driver.py).

The names load ``hvdlite.elastic.state`` (and with it the collectives and the native
library) on first use (PEP 562 module ``__getattr__``): the launcher and
``hvdlite.process_sets`` import ``hvdlite.elastic.protocol`` (standard library only), and
importing it runs this file.
"""
import importlib

from hvdlite.errors import HorovodInternalError, HostsUpdatedInterrupt

_LAZY = ("ObjectState", "State", "run")

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "run"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'hvdlite.elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module("hvdlite.elastic.state"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
