"""DistributedGradientTape: a tf.GradientTape whose gradients are allreduced."""
import numpy as np
import tensorflow as tf

from hvdlite import ops
from hvdlite.errors import InvalidArgumentError
from hvdlite.tensorflow import mpi_ops
from hvdlite.tensorflow.compression import Compression


def allreduce_gradients(grads, compression=Compression.none, op=mpi_ops.Average,
                        sparse_as_dense=False, gradient_predivide_factor=1.0, name=None):
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
        reduced = _reduce_through(compression, values, op, prescale, postscale,
                                  [f"grad.{i}" for i in present])
    else:
        reduced = mpi_ops.grouped_allreduce(values, compression=compression, op=op,
                                            prescale_factor=prescale,
                                            postscale_factor=postscale, name=name)
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
                 gradient_predivide_factor=1.0):
        """Args:
            gradtape: the tf.GradientTape to wrap.
            device_dense, device_sparse: accepted for Horovod compatibility.
            compression: Compression.none or Compression.fp16.
            sparse_as_dense: densify tf.IndexedSlices gradients before reducing.
            op: Average (default) or Sum.
            gradient_predivide_factor: see ``allreduce_gradients``.
        """
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._predivide = gradient_predivide_factor

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, attr):
        return getattr(self._tape, attr)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """Returns the gradients of ``target`` w.r.t. ``sources``, allreduced.

        Args and Returns: as ``tf.GradientTape.gradient``.

        Raises:
            HorovodInternalError: the allreduce failed (eagerly; in a graph, a
                tf.errors exception carrying the message).
        """
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        return allreduce_gradients(grads, self._compression, self._op,
                                   self._sparse_as_dense, self._predivide)
