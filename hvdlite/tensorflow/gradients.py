"""The TensorFlow gradient reduction: a structure of gradients allreduced in one group.

Shared by ``DistributedGradientTape``, the TF1 ``DistributedOptimizer`` and the Keras
``DistributedOptimizer`` on the tensorflow backend.
"""
import numpy as np
import tensorflow as tf

from hvdlite import _checks, process_sets, reducers
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
    op, prescale, postscale = _checks.predivide_scaling(op, gradient_predivide_factor)
    flat = tf.nest.flatten(grads, expand_composites=False)
    present = [i for i, g in enumerate(flat) if g is not None]
    reducer = reducers.is_reducer(compression)
    values = []
    for i in present:
        g = flat[i]
        if (sparse_as_dense or reducer) and isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        values.append(g)
    if reducer:
        reducers.check_reducer(compression, op, (prescale, postscale) != (1.0, 1.0),
                               process_sets.process_set_id(process_set), InvalidArgumentError)
        reduced = _reduce_through(compression, values, [f"grad.{i}" for i in present])
    else:
        reduced = mpi_ops.grouped_allreduce(values, compression=compression, op=op,
                                            prescale_factor=prescale,
                                            postscale_factor=postscale, name=name,
                                            process_set=process_set)
    out = list(flat)
    for i, g in zip(present, reduced):
        out[i] = g
    return tf.nest.pack_sequence_as(grads, out, expand_composites=False)


def _reduce_through(reducer, values, names):
    """Runs a reducer (``hvdlite.reducers``) on the gradients' values as numpy arrays,
    eagerly or inside a tf.function (through tf.numpy_function)."""

    def run(*arrays):
        token = reducer.start(names, [np.asarray(a, np.float32) for a in arrays])
        (updates,) = reducer.finish_all([token])
        return [u.astype(a.dtype) for u, a in zip(updates, arrays)]

    reduced = tf.numpy_function(run, values, [v.dtype for v in values], stateful=True)
    for out, value in zip(reduced, values):
        out.set_shape(value.shape)
    return reduced
