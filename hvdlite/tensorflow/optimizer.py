"""The TensorFlow ``DistributedOptimizer``: a TF1 optimizer whose ``compute_gradients``
allreduces, or, for a Keras optimizer, ``hvdlite.keras.DistributedOptimizer``."""
import tensorflow as tf

from hvdlite.tensorflow import execution, mpi_ops
from hvdlite.tensorflow.compression import Compression
from hvdlite.tensorflow.gradients import allreduce_gradients


class _DistributedLegacyOptimizer(tf.compat.v1.train.Optimizer):
    """A tf.compat.v1.train.Optimizer whose ``compute_gradients`` allreduces them."""

    def __init__(self, optimizer, name=None, use_locking=False, compression=Compression.none,
                 sparse_as_dense=False, op=mpi_ops.Average, gradient_predivide_factor=1.0,
                 process_set=mpi_ops.global_process_set):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)
        self._optimizer = optimizer
        self._settings = (compression, op, sparse_as_dense, gradient_predivide_factor)
        self._process_set = process_set

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, gradients allreduced."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = allreduce_gradients([g for g, _ in pairs], *self._settings,
                                    process_set=self._process_set)
        return list(zip(grads, [v for _, v in pairs]))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1,
                         op=mpi_ops.Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=mpi_ops.global_process_set,
                         scale_local_gradients=True):
    """Wraps an optimizer so that gradients are allreduced before they are applied.

    A ``tf.compat.v1.train.Optimizer`` gets a wrapper whose ``compute_gradients``
    allreduces; a Keras optimizer gets ``hvdlite.keras.DistributedOptimizer``.

    Args:
        optimizer: the optimizer to wrap.
        backward_passes_per_step: Keras optimizers only (local accumulation).
        the others: as for ``DistributedGradientTape`` (``use_locking`` and ``name``
            go to the TF1 optimizer).

    Raises:
        TypeError: ``optimizer`` is neither kind.
        ValueError: backward_passes_per_step > 1 for a TF1 optimizer (not supported
            here).
    """
    execution.check_process_set(process_set)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 is not supported for "
                             "tf.compat.v1.train optimizers")
        return _DistributedLegacyOptimizer(optimizer, name, use_locking, compression,
                                           sparse_as_dense, op, gradient_predivide_factor,
                                           process_set)
    # Keras is imported only when a Keras optimizer is wrapped (``hvdlite.keras`` is built
    # on this package: it sits above it and is never imported by its modules' tops).
    from hvdlite import keras as hvd_keras

    return hvd_keras.DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, process_set=process_set)
