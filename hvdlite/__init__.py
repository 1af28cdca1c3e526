"""hvdlite: Horovod-style data-parallel training over one native core.

    import hvdlite as hvd
    hvd.init()
    avg = hvd.allreduce(np.ones(4, np.float32), name="x")

The names backed by the native library load it on first use (PEP 562 module
``__getattr__``), so ``import hvdlite`` and ``import hvdlite.runner`` work on an install
whose library is missing or broken; the first such use raises ImportError with the
cause. ``hvdlite.errors`` never needs the library.
"""
import importlib

from hvdlite import errors

__version__ = "0.1.0"  # the one source: pyproject.toml reads it (tool.setuptools.dynamic)

# Public name -> the submodule that defines it (loaded, with the core, on first use).
_LAZY = {
    "init": "hvdlite.runtime",
    **{name: "hvdlite.core" for name in (
        "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
        "cross_size", "cross_rank", "mpi_threads_supported", "stats", "start_timeline",
        "stop_timeline", "autotune_state")},
    **{name: "hvdlite.ops" for name in (
        "Average", "Sum", "Min", "Max", "Product", "Adasum",
        "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
        "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
        "grouped_reducescatter_async",
        "allgather", "allgather_async", "broadcast", "broadcast_async",
        "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
        "barrier", "join", "poll", "synchronize")},
    **{name: "hvdlite.process_sets" for name in (
        "ProcessSet", "global_process_set", "add_process_set", "remove_process_set")},
    "broadcast_object": "hvdlite.objects",
    "allgather_object": "hvdlite.objects",
    "Handle": "hvdlite.handle",
    "OpHandle": "hvdlite.handle",
}

__all__ = sorted(_LAZY) + ["errors", "__version__"]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdlite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
