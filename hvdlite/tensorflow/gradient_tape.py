"""DistributedGradientTape (a tf.GradientTape whose gradients are allreduced) and
PartialDistributedGradientTape.

The reduction itself is ``hvdlite.tensorflow.gradients.allreduce_gradients`` (still
importable from here); the TF1 optimizer is in ``hvdlite.tensorflow.optimizer``.
"""
import tensorflow as tf

from hvdlite import process_sets
from hvdlite.tensorflow import execution, mpi_ops
from hvdlite.tensorflow.compression import Compression
from hvdlite.tensorflow.gradients import allreduce_gradients  # noqa: F401 (former home)


class DistributedGradientTape:
    """Wraps a tf.GradientTape; ``gradient()`` returns gradients allreduced across ranks.

    All gradients of one ``gradient()`` call are submitted together (one group), so
    they fuse. Everything else is the wrapped tape's::

        with tf.GradientTape() as tape:
            loss = ...
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    It can also wrap a tape before recording (``with hvd.DistributedGradientTape(
    tf.GradientTape()) as tape:``). It is a wrapper, not a tf.GradientTape subclass.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="",
                 compression=Compression.none, sparse_as_dense=False, op=mpi_ops.Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=mpi_ops.global_process_set, scale_local_gradients=True):
        """Args:
            gradtape: the tf.GradientTape to wrap.
            device_dense, device_sparse: accepted for Horovod compatibility.
            compression: Compression.none or Compression.fp16.
            sparse_as_dense: densify tf.IndexedSlices gradients before reducing.
            op: Average (default) or Sum.
            gradient_predivide_factor: see ``allreduce_gradients``.
            num_groups, groups: accepted for Horovod compatibility: every gradient of
                a ``gradient()`` call already goes in one group.
            process_set: the ProcessSet whose members average the gradients.
            scale_local_gradients: see ``PartialDistributedGradientTape``.
        """
        execution.check_process_set(process_set)
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._predivide = gradient_predivide_factor
        self._process_set = process_set
        self._local_refs = set()
        self._scale_local_gradients = scale_local_gradients

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, attr):
        return getattr(self._tape, attr)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """Returns the gradients of ``target`` w.r.t. ``sources``, allreduced.

        Gradients of local sources (``PartialDistributedGradientTape``) are not
        reduced; with ``scale_local_gradients`` they are divided by size().

        Args and Returns: as ``tf.GradientTape.gradient``.

        Raises:
            tf.errors.OpError: the allreduce failed (see ``hvdlite.tensorflow.errors``).
        """
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        if not self._local_refs:
            return allreduce_gradients(grads, self._compression, self._op,
                                       self._sparse_as_dense, self._predivide,
                                       process_set=self._process_set)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        local = [_ref(s) in self._local_refs for s in flat_sources]
        shared = allreduce_gradients([None if loc else g for g, loc in
                                      zip(flat_grads, local)],
                                     self._compression, self._op, self._sparse_as_dense,
                                     self._predivide, process_set=self._process_set)
        size = process_sets.members(self._process_set)[0]
        scale = 1.0 / size if self._scale_local_gradients else 1.0
        out = [_scaled(g, scale) if loc else r
               for g, r, loc in zip(flat_grads, shared, local)]
        return tf.nest.pack_sequence_as(grads, out, expand_composites=False)


def _ref(variable):
    return variable.ref() if hasattr(variable, "ref") else id(variable)


def _scaled(grad, scale):
    if grad is None or scale == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * scale, grad.indices, grad.dense_shape)
    return grad * scale


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=mpi_ops.Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None,
                                   process_set=mpi_ops.global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A DistributedGradientTape that leaves the gradients of ``local_layers`` local.

    Args:
        local_layers: a Keras layer or a list of them, whose trainable weights are
            trained on each rank alone: their gradients are not reduced, and are
            divided by size() with ``scale_local_gradients`` (as Horovod does).
        the others: as for ``DistributedGradientTape``.

    Raises:
        ValueError: ``local_layers`` holds something that is not a Keras layer.
    """
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("local_layers must be a Keras layer or a list of them")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor,
                                   num_groups, groups, process_set, scale_local_gradients)
    tape._local_refs = {_ref(w) for layer in local_layers for w in layer.trainable_weights}
    return tape
