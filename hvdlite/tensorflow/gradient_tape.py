"""DistributedGradientTape (a tf.GradientTape whose gradients are allreduced),
PartialDistributedGradientTape, and the TF1 DistributedOptimizer."""
import numpy as np
import tensorflow as tf

from hvdlite import ops, process_sets
from hvdlite.errors import InvalidArgumentError
from hvdlite.tensorflow import mpi_ops
from hvdlite.tensorflow.compression import Compression


def allreduce_gradients(grads, compression=Compression.none, op=mpi_ops.Average,
                        sparse_as_dense=False, gradient_predivide_factor=1.0, name=None,
                        process_set=mpi_ops.global_process_set):
    """Allreduces a (nested) structure of gradients in one group; None stays None.

    Shared by DistributedGradientTape and the Keras DistributedOptimizer: every dense
    gradient goes in one ``grouped_allreduce`` (one negotiation, fused on the wire);
    tf.IndexedSlices are allgathered, or densified first with ``sparse_as_dense``.

    Args:
        grads: a structure of tensors, tf.IndexedSlices and Nones.
        compression: Compression.none or Compression.fp16, or a reducer
            (Compression.topk(ratio), quantize(bits), powersgd(rank); Average only,
            IndexedSlices made dense).
        op: Average or Sum.
        sparse_as_dense: convert tf.IndexedSlices to dense tensors before reducing.
        gradient_predivide_factor: with op=Average, divide by this before the sum and
            by size()/factor after it (Horovod's predivide).
        name: the group's name, equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members average the gradients.

    Returns:
        The same structure with reduced gradients.

    Raises:
        InvalidArgumentError: an op other than Average or Sum, or a predivide factor
            with op=Sum.
    """
    if op not in (mpi_ops.Average, mpi_ops.Sum):
        raise InvalidArgumentError("gradients are reduced with op=Average or op=Sum only")
    op, prescale, postscale = ops.predivide_scaling(op, gradient_predivide_factor)
    flat = tf.nest.flatten(grads, expand_composites=False)
    present = [i for i, g in enumerate(flat) if g is not None]
    reducer = getattr(compression, "is_reducer", False)
    values = []
    for i in present:
        g = flat[i]
        if (sparse_as_dense or reducer) and isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        values.append(g)
    if reducer:
        if process_sets.process_set_id(process_set) != 0:
            raise InvalidArgumentError(f"{compression!r} runs on the global process set only")
        reduced = _reduce_through(compression, values, op, prescale, postscale,
                                  [f"grad.{i}" for i in present])
    else:
        reduced = mpi_ops.grouped_allreduce(values, compression=compression, op=op,
                                            prescale_factor=prescale,
                                            postscale_factor=postscale, name=name,
                                            process_set=process_set)
    out = list(flat)
    for i, g in zip(present, reduced):
        out[i] = g
    return tf.nest.pack_sequence_as(grads, out, expand_composites=False)


def _reduce_through(reducer, values, op, prescale, postscale, names):
    """Runs a reducer (``hvdlite.reducers``) on the gradients' values as numpy arrays,
    eagerly or inside a tf.function (through tf.numpy_function)."""
    if op != mpi_ops.Average or (prescale, postscale) != (1.0, 1.0):
        raise InvalidArgumentError(f"{reducer!r} averages gradients: it takes op=Average "
                                   "and no gradient_predivide_factor")
    if isinstance(reducer, type):
        raise InvalidArgumentError(f"{reducer.__name__} is a reducer class: pass an "
                                   "instance, e.g. Compression.topk(0.01)")

    def run(*arrays):
        token = reducer.start(names, [np.asarray(a, np.float32) for a in arrays])
        (updates,) = reducer.finish_all([token])
        return [u.astype(a.dtype) for u, a in zip(updates, arrays)]

    reduced = tf.numpy_function(run, values, [v.dtype for v in values], stateful=True)
    for out, value in zip(reduced, values):
        out.set_shape(value.shape)
    return reduced


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
        mpi_ops._check_process_set(process_set)
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
    mpi_ops._check_process_set(process_set)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 is not supported for "
                             "tf.compat.v1.train optimizers")
        return _DistributedLegacyOptimizer(optimizer, name, use_locking, compression,
                                           sparse_as_dense, op, gradient_predivide_factor,
                                           process_set)
    from hvdlite import keras as hvd_keras

    return hvd_keras.DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, process_set=process_set)
