"""How one TensorFlow collective runs: named and checked at the call, then run now
(eagerly) or added to the graph as a node after the graph's previous collective node.

``hvdlite.tensorflow.mpi_ops`` (whose docstring gives the rules: names, order of graph
nodes, errors) builds every op from these. The ``*_now`` functions are the eager
implementations a node runs: EagerTensors in, EagerTensors out.
"""
import threading
import weakref

import numpy as np
import tensorflow as tf

from hvdlite import _checks, _names, _refusals, ops, process_sets
from hvdlite.errors import HvdliteError, InvalidArgumentError
from hvdlite.process_sets import global_process_set
from hvdlite.tensorflow import errors, tensors

# graph -> {base name: times used}: the same tensor reduced twice in one graph gets
# "<name>", then "<name>.1"... Weak keys: a graph's entry goes with the graph.
# graph -> {base name: times used}: the same tensor reduced twice in one graph gets
# "<name>", then "<name>.1"... Weak keys: a graph's entry goes with the graph.
_graph_names = weakref.WeakKeyDictionary()
_graph_names_lock = threading.Lock()


def collective_name(kind, name, tensor, process_set=global_process_set):
    """Returns the name of one collective, fixed now (eager call or graph trace)."""
    psid = process_sets.process_set_id(process_set)
    if name is not None:
        return _refusals.resolve_name(kind, name, psid)
    if tf.executing_eagerly():
        return _names.auto_name(kind, psid)
    graph = tf.compat.v1.get_default_graph()
    base = f"{kind}.{tensor.name}" if psid == 0 else f"{kind}.ps{psid}.{tensor.name}"
    with _graph_names_lock:
        used = _graph_names.setdefault(graph, {})
        count = used.get(base, 0)
        used[base] = count + 1
    return base if count == 0 else f"{base}.{count}"


@errors.tf_errors
def check_static(tensor, name, op=None, scales=None, min_ndim=0):
    """Refuses what can be refused before running (also while tracing a graph).

    The checks are those of ``hvdlite.ops``, applied to the tensor's dtype; the rest
    (e.g. shapes) is checked when the op runs.
    """
    label = name or "unnamed"
    tensors.check_dtype(tensor, label)
    is_bool = tensors.numpy_dtype(tensor.dtype) == np.bool_
    if op is not None:
        _checks.check_reduce_op(op, is_bool, label)
    if scales is not None:
        _checks.check_scale(scales[0], scales[1], is_bool, label)
    if tensor.shape.rank is not None and tensor.shape.rank < min_ndim:
        raise InvalidArgumentError(
            f"tensor '{label}' must have at least {min_ndim} dimension(s), "
            f"got shape {tensor.shape}")


check_rank = errors.tf_errors(_checks.check_rank)


# graph -> (op, ran) of its last collective node (see the module doc): ``ran`` is set
# once the node has run. Weak keys.
_last_collective = weakref.WeakKeyDictionary()


def run(fn, inputs, out_dtypes, out_shapes):
    """Runs ``fn(*eager_inputs) -> list of tensors`` now, or as a graph node.

    Returns:
        The list of output tensors.

    Raises:
        tf.errors.OpError: eagerly, the collective failed (see ``errors.py``).
    """
    if tf.executing_eagerly():
        return errors.tf_errors(fn)(*inputs)
    return _graph_node(fn, inputs, out_dtypes, out_shapes)


def _graph_node(fn, inputs, out_dtypes, out_shapes):
    """Adds ``fn`` to the default graph, after its previous collective node.

    The py_function returns the error's code and message with its outputs (TF would
    turn a raised error into UnknownError); the outputs pass through identities that
    wait on ``errors.raise_in_graph``, which fails the step with the right class.
    """
    ran = threading.Event()

    def node(*args):
        ran.set()
        try:
            outputs = list(fn(*args))
            code, message = errors.OK, ""
        except HvdliteError as e:
            coded = errors.graph_code(e)
            if coded is None:
                raise
            code, message = coded
            outputs = [tf.zeros([0], dtype) for dtype in out_dtypes]
        return outputs + [tf.constant(code, tf.int32), tf.constant(message)]

    graph = tf.compat.v1.get_default_graph()
    with tf.control_dependencies(_follow(graph)):
        results = tf.py_function(node, inputs, Tout=list(out_dtypes) + [tf.int32,
                                                                        tf.string])
    _last_collective[graph] = (results[0].op, ran)
    with tf.control_dependencies([errors.raise_in_graph(results[-2], results[-1])]):
        outputs = [tf.identity(result) for result in results[:-2]]
    for output, shape in zip(outputs, out_shapes):
        output.set_shape(shape)
    return outputs


def _follow(graph):
    """Returns the control inputs of a new collective node of ``graph``.

    The previous collective node, unless it has already run: then the program is at a
    new step (build a node, run it, build the next...), every rank has run it, and a
    dependency would only make each later run of a TF1 session run it again.
    """
    previous = _last_collective.get(graph)
    if previous is None or previous[1].is_set():
        return []
    return [previous[0]]


def trailing(shape, first=None):
    """``[first] + shape[1:]`` as a TensorShape (unknown rank stays unknown)."""
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([first]).concatenate(shape[1:])


def allreduce_now(tensor, name, op, prescale, postscale, process_set):
    arr = tensors.host_array(tensor)
    out = tensors.empty_aligned(arr.shape, arr.dtype)
    ops.allreduce(arr, name, op, prescale, postscale, out=out, process_set=process_set)
    return tensors.to_tensor(out)


def grouped_allreduce_now(tensor_list, group, op, prescale, postscale, process_set):
    arrays = [tensors.host_array(tensor) for tensor in tensor_list]
    outs = [tensors.empty_aligned(arr.shape, arr.dtype) for arr in arrays]
    ops.grouped_allreduce(arrays, group, op, prescale, postscale, outs=outs,
                          process_set=process_set)
    return [tensors.to_tensor(out) for out in outs]


def broadcast_now(tensor_list, names, root_rank, process_set):
    """Broadcasts several tensors: all enqueued before any wait, so they can fuse."""
    arrays = [tensors.host_array(tensor) for tensor in tensor_list]
    outs = [tensors.empty_aligned(arr.shape, arr.dtype) for arr in arrays]
    return wait_all([ops.broadcast_async(arr, root_rank, name, out=out,
                                         process_set=process_set)
                     for arr, name, out in zip(arrays, names, outs)], outs)


def allgather_now(tensor_list, names, process_set):
    """Allgathers several tensors: all enqueued before any wait, so they can fuse."""
    return wait_all([ops.allgather_async(tensors.host_array(tensor), name, process_set)
                     for tensor, name in zip(tensor_list, names)])


def reducescatter_now(tensor_list, names, op, prescale, postscale, process_set):
    """Reduce-scatters several tensors: all enqueued before any wait."""
    arrays = [tensors.host_array(tensor) for tensor in tensor_list]
    size, rank = process_sets.members(process_set)
    outs = []
    for arr in arrays:
        rows = None
        if arr.ndim >= 1:  # else ops refuses it, naming the tensor
            rows = _checks.reducescatter_rows(arr.shape[0], size, rank)
        outs.append(None if rows is None
                    else tensors.empty_aligned((rows,) + arr.shape[1:], arr.dtype))
    return wait_all([ops.reducescatter_async(arr, name, op, prescale, postscale, out=out,
                                             process_set=process_set)
                     for arr, name, out in zip(arrays, names, outs)])


def wait_all(handles, outs=None):
    """Waits every handle (even after one failed), then raises the first error.

    Returns:
        The results as tensors: ``outs`` if given, else each handle's result.
    """
    results, failure = [], None
    for handle in handles:
        try:
            results.append(ops.synchronize(handle))
        except HvdliteError as e:
            failure = failure or e
    if failure is not None:
        raise failure
    return [tensors.to_tensor(r) for r in (results if outs is None else outs)]


def group_names(kind, name, tensor_list, process_set):
    """Returns the names of a group's tensors: ``"<group>.<i>"``."""
    group = collective_name(kind, name, tensor_list[0], process_set)
    return [f"{group}.{i}" for i in range(len(tensor_list))]


@errors.tf_errors
def check_process_set(process_set):
    """Refuses, at the call, a process set that is not a registered ProcessSet.

    Returns:
        Its id (0 for None and the global set).
    """
    return process_sets.process_set_id(process_set)
