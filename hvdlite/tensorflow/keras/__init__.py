"""``import hvdlite.tensorflow.keras as hvd`` where Keras scripts have
``import horovod.tensorflow.keras as hvd``.

Keras 3 on the TensorFlow backend. The optimizer, ``load_model`` and the callbacks are
``hvdlite.keras``'s; the collectives take and return what Horovod's do (values in,
numpy out) and run through ``hvdlite.tensorflow``.

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss="mse")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""
import numpy as np
import tensorflow as tf

import hvdlite.tensorflow as _hvd_tf
from hvdlite.process_sets import (ProcessSet, add_process_set, global_process_set,
                                  remove_process_set)
from hvdlite.capabilities import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                  mpi_built, mpi_enabled, nccl_built, rocm_built)
from hvdlite.errors import HorovodInternalError, HvdliteError, MismatchError
from hvdlite import keras as _hvd_keras
from hvdlite.keras import DistributedOptimizer
from hvdlite.keras.compression import Compression
from hvdlite.runtime import (cross_rank, cross_size, init, is_initialized, local_rank,
                             local_size, mpi_threads_supported, rank, shutdown, size,
                             start_timeline, stop_timeline)
from hvdlite.tensorflow.functions import broadcast_global_variables
from hvdlite.tensorflow.keras import callbacks, elastic
from hvdlite.tensorflow.mpi_ops import Average, Sum


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none, process_set=global_process_set):
    """Reduces a value (tensor, variable, array or number) across ranks; returns numpy.

    Args:
        value: what to reduce, the same shape on every rank.
        name: equal across ranks; None names it automatically.
        average: deprecated; True means op=Average, False op=Sum.
        prescale_factor, postscale_factor, op, compression, process_set: as for
            ``hvdlite.tensorflow.allreduce``.

    Raises:
        As ``hvdlite.tensorflow.allreduce``.
    """
    return _hvd_tf.allreduce(tf.constant(value), average=average, compression=compression,
                             op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, name=name,
                             process_set=process_set).numpy()


def allgather(value, name=None, process_set=global_process_set):
    """Concatenates every member's value along the first dimension; returns numpy."""
    return _hvd_tf.allgather(tf.constant(value), name=name, process_set=process_set).numpy()


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s value on every member of ``process_set``, as numpy."""
    return _hvd_tf.broadcast(tf.constant(value), root_rank, name=name,
                             process_set=process_set).numpy()


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """Reduces a value across ranks; returns this rank's rows (numpy)."""
    return np.asarray(_hvd_tf.reducescatter(tf.constant(value), op=op, name=name,
                                            process_set=process_set))


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Loads a Keras model saved with a DistributedOptimizer (``hvdlite.keras.load_model``).

    Raises:
        ValueError: ``legacy_opts=True``: Keras 3 has no legacy optimizers.
    """
    if legacy_opts:
        raise ValueError("legacy_opts=True: Keras 3 has no tf.keras.optimizers.legacy")
    return _hvd_keras.load_model(filepath, custom_optimizers, custom_objects, compression)


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("np", "tf")]
