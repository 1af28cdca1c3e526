"""Variables and Python objects across ranks: broadcast_variables, *_object."""
import pickle

import numpy as np
import tensorflow as tf

from hvdlite import ops, runtime
from hvdlite.tensorflow import mpi_ops


def broadcast_variables(variables, root_rank, name=None):
    """Assigns ``root_rank``'s values to ``variables`` on every rank.

    All variables go in one step (enqueued before any wait, one graph node inside a
    tf.function), so they fuse. Reading a variable is zero-copy; ``assign`` copies once.

    Args:
        variables: tf.Variables or Keras variables, in the same order on every rank.
        root_rank: the rank whose values everyone receives.
        name: a base name, equal across ranks; None names them automatically.

    Returns:
        None eagerly; inside a tf.function, the grouped assign op.

    Raises:
        InvalidArgumentError: a root out of range or an unsupported dtype.
        HorovodInternalError: the broadcast failed (e.g. shapes differ across ranks).
    """
    variables = list(variables)
    if not variables:
        return None
    values = mpi_ops.broadcast_group([tf.convert_to_tensor(v) for v in variables],
                                     root_rank, name)
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def broadcast_object(obj, root_rank=0, name=None):
    """Returns ``root_rank``'s ``obj`` on every rank (pickled; eager only).

    Args:
        obj: any picklable object (only the root's is used).
        root_rank: the rank whose object everyone receives.
        name: a base name for the two tensors, equal across ranks; None names it
            automatically.

    Returns:
        The root's object (the root gets ``obj`` itself back).

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``broadcast``.
    """
    base = name or ops.auto_name("broadcast_object")
    is_root = runtime.rank() == root_rank
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if is_root else None
    length = np.array([payload.size if is_root else 0], dtype=np.int64)
    length = ops.broadcast(length, root_rank, f"{base}.sz")
    if not is_root:
        payload = np.zeros(int(length[0]), dtype=np.uint8)
    payload = ops.broadcast(payload, root_rank, f"{base}.t")
    return obj if is_root else pickle.loads(payload.tobytes())


def allgather_object(obj, name=None):
    """Returns the list of every rank's ``obj``, in rank order (pickled; eager only).

    Args:
        obj: any picklable object.
        name: a base name, equal across ranks; None names it automatically.

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``allgather``.
    """
    base = name or ops.auto_name("allgather_object")
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = ops.allgather(np.array([payload.size], dtype=np.int64), f"{base}.sz")
    raw = ops.allgather(payload, f"{base}.t").tobytes()
    out, offset = [], 0
    for size in sizes.tolist():
        out.append(pickle.loads(raw[offset:offset + size]))
        offset += size
    return out
