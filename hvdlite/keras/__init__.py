"""hvdlite for Keras 3: ``import hvdlite.keras as hvd`` for ``horovod.tensorflow.keras``.

    import hvdlite.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

Works on the TensorFlow backend (through ``hvdlite.tensorflow``) and on the PyTorch
backend (through ``hvdlite.torch``); the callbacks and the numpy-level ``allreduce``,
``allgather``, ``broadcast`` here are backend-neutral.
"""
import keras
import numpy as np

from hvdlite import _checks, ops
from hvdlite.errors import HorovodInternalError, HvdliteError, MismatchError
from hvdlite.keras import callbacks, elastic
from hvdlite.keras.compression import Compression
from hvdlite.keras.optimizer import DistributedOptimizer, load_model
from hvdlite.objects import allgather_object, broadcast_object
from hvdlite.process_sets import (ProcessSet, add_process_set, global_process_set,
                                  remove_process_set)
from hvdlite.ops import Average, Max, Min, Product, Sum, barrier, join
from hvdlite.runtime import (cross_rank, cross_size, init, is_initialized, local_rank,
                             local_size, rank, shutdown, size, start_timeline,
                             stop_timeline)


def _to_numpy(value):
    # np.array keeps 0-d values 0-d (np.ascontiguousarray would make them 1-d).
    return np.array(keras.ops.convert_to_numpy(value), order="C")


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None):
    """Reduces a tensor-compatible value across ranks; returns a numpy array.

    Args:
        value: a backend tensor, variable, numpy array or number.
        name: equal across ranks; None names it automatically.
        average: deprecated; True means op=Average, False op=Sum.
        prescale_factor, postscale_factor, op: as for ``hvdlite.allreduce``.
    """
    op = _checks.resolve_op(op, average)
    return ops.allreduce(_to_numpy(value), name, op, prescale_factor, postscale_factor)


def allgather(value, name=None):
    """Concatenates every rank's value along the first dimension; returns numpy."""
    return ops.allgather(_to_numpy(value), name)


def broadcast(value, root_rank, name=None):
    """Returns ``root_rank``'s value on every rank, as numpy."""
    return ops.broadcast(_to_numpy(value), root_rank, name)


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "start_timeline", "stop_timeline",
    "Average", "Sum", "Min", "Max", "Product",
    "DistributedOptimizer", "Compression", "callbacks", "elastic", "load_model",
    "allreduce", "allgather", "broadcast", "barrier", "join",
    "broadcast_object", "allgather_object",
    "HvdliteError", "HorovodInternalError", "MismatchError",
]
