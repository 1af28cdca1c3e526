"""Python objects across ranks, framework-free: pickled into uint8 arrays.

Eager only (they return Python objects). The adapters re-export them.
"""
import numpy as np

from hvdlite import _names, core, ops, process_sets
from hvdlite.process_sets import global_process_set

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle otherwise.
    import cloudpickle as pickle
except ImportError:  # pragma: no cover - cloudpickle is optional
    import pickle


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``obj`` on every rank (pickled; eager only).

    Args:
        obj: any picklable object (only the root's is used).
        root_rank: the rank whose object everyone receives.
        name: a base name for the two tensors, equal across ranks; None names it
            automatically.
        process_set: the ProcessSet whose members receive it (root_rank is a global
            rank, a member).

    Returns:
        The root's object (the root gets ``obj`` itself back).

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``broadcast``.
    """
    base = name or _names.auto_name("broadcast_object", process_sets.process_set_id(process_set))
    is_root = core.rank() == root_rank
    payload = broadcast_bytes(pickle.dumps(obj) if is_root else None, root_rank, base,
                              process_set)
    return obj if is_root else pickle.loads(payload.tobytes())


def broadcast_bytes(blob, root_rank, name, process_set=global_process_set):
    """Returns ``root_rank``'s bytes on every rank, as a uint8 array: their count is
    broadcast first (tensor ``"<name>.sz"``), then the bytes (``"<name>.t"``).

    Args:
        blob: on the root, any buffer (bytes, memoryview, array); ignored elsewhere.
        root_rank: the rank whose bytes everyone receives.
        name: the base name of the two tensors, equal across ranks.
        process_set: the ProcessSet whose members receive them.

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``broadcast``.
    """
    is_root = core.rank() == root_rank
    payload = np.frombuffer(blob, dtype=np.uint8) if is_root else None
    length = np.array([payload.size if is_root else 0], dtype=np.int64)
    length = int(ops.broadcast(length, root_rank, f"{name}.sz", process_set=process_set)[0])
    if is_root:
        payload = np.require(payload, requirements="W")  # the broadcast writes in place
    else:
        payload = np.empty(length, dtype=np.uint8)
    return ops.broadcast(payload, root_rank, f"{name}.t", out=payload, process_set=process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every rank's ``obj``, in rank order (pickled; eager only).

    Args:
        obj: any picklable object.
        name: a base name, equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members' objects are gathered (in the order
            of their ranks).

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``allgather``.
    """
    base = name or _names.auto_name("allgather_object", process_sets.process_set_id(process_set))
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = ops.allgather(np.array([payload.size], dtype=np.int64), f"{base}.sz",
                          process_set=process_set)
    raw = ops.allgather(payload, f"{base}.t", process_set=process_set).tobytes()
    out, offset = [], 0
    for size in sizes.tolist():
        out.append(pickle.loads(raw[offset:offset + size]))
        offset += size
    return out
