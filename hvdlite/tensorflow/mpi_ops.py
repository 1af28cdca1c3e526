"""Tensor collectives for TensorFlow 2: eagerly, inside ``tf.function``, with gradients.

Built on ``hvdlite.ops``: a tensor is looked at through a zero-copy numpy view of its
host memory, so naming, validation (dtype, op, scaling, root, splits) and handles are
those of the framework-free layer (``tensors.py`` says which path copies, per case).
Nothing here is compiled against TensorFlow.

* Eagerly, an op enqueues with the core and waits (the GIL is released while waiting).
* Inside a ``tf.function`` the same eager code runs as a ``tf.py_function`` node; its
  output shapes are set where they are known. ``py_function`` is stateful, so
  tf.function's automatic control dependencies run these nodes in program order on
  every rank: the order of collectives is the program's, and one blocked node never
  waits on a node that another rank has not reached. (Not XLA-compilable: use
  ``jit_compile=False``.)
* Names: an explicit ``name`` is used as is. Unnamed eager calls take the counter-based
  names of ``hvdlite.ops`` (``"allreduce.noname.<n>"``). Unnamed calls in a graph are
  named at trace time after the input tensor's graph name, Horovod-style
  (``"allreduce.<tensor name>"``), so names agree across ranks even when one rank
  retraces (e.g. for a smaller last batch) and the others do not.
* ``allreduce``, ``grouped_allreduce``, ``allgather`` and ``broadcast`` have gradients
  (``tf.custom_gradient``): allreduce -> allreduce of the gradient with the same op and
  scaling; allgather -> this rank's rows of the summed gradient; broadcast -> the summed
  gradient on the root, zeros elsewhere.
* A collective that fails inside a graph surfaces as a ``tf.errors`` exception whose
  message carries the hvdlite error (e.g. the mismatch across ranks); eagerly the
  hvdlite exception itself is raised.
"""
import threading
import weakref

import numpy as np
import tensorflow as tf

from hvdlite import ops, process_sets, runtime
from hvdlite.errors import InvalidArgumentError
from hvdlite.process_sets import (ProcessSet, add_process_set,  # noqa: F401 (API)
                                  global_process_set, remove_process_set)
from hvdlite.tensorflow import tensors
from hvdlite.tensorflow.compression import Compression

Average = ops.Average
Sum = ops.Sum
Min = ops.Min
Max = ops.Max
Product = ops.Product
_basics = process_sets.basics




# -- names -------------------------------------------------------------------------------

# graph -> {base name: times used}: the same tensor reduced twice in one graph gets
# "<name>", then "<name>.1"... Weak keys: a graph's entry goes with the graph.
_graph_names = weakref.WeakKeyDictionary()
_graph_names_lock = threading.Lock()


def _op_name(kind, name, tensor, process_set=global_process_set):
    """Returns the name of one collective, fixed now (eager call or graph trace)."""
    psid = process_sets.process_set_id(process_set)
    if name is not None:
        return ops._resolve_name(kind, name, psid)
    if tf.executing_eagerly():
        return ops.auto_name(kind, psid)
    graph = tf.compat.v1.get_default_graph()
    base = f"{kind}.{tensor.name}" if psid == 0 else f"{kind}.ps{psid}.{tensor.name}"
    with _graph_names_lock:
        used = _graph_names.setdefault(graph, {})
        count = used.get(base, 0)
        used[base] = count + 1
    return base if count == 0 else f"{base}.{count}"


def _check_static(tensor, name, op=None, scales=None, min_ndim=0):
    """Refuses what can be refused before running (also while tracing a graph).

    The checks are those of ``hvdlite.ops``, applied to the tensor's dtype; the rest
    (e.g. shapes) is checked when the op runs.
    """
    label = name or "unnamed"
    tensors.check_dtype(tensor, label)
    is_bool = tensors.numpy_dtype(tensor.dtype) == np.bool_
    if op is not None:
        ops._check_reduce_op(op, is_bool, label)
    if scales is not None:
        ops._check_scale(scales[0], scales[1], is_bool, label)
    if tensor.shape.rank is not None and tensor.shape.rank < min_ndim:
        raise InvalidArgumentError(
            f"tensor '{label}' must have at least {min_ndim} dimension(s), "
            f"got shape {tensor.shape}")


def _run(fn, inputs, out_dtypes, out_shapes):
    """Runs ``fn(*eager_inputs) -> list of tensors`` now, or as a graph node.

    Returns:
        The list of output tensors.
    """
    if tf.executing_eagerly():
        return fn(*inputs)
    outputs = tf.py_function(fn, inputs, Tout=out_dtypes)
    for output, shape in zip(outputs, out_shapes):
        output.set_shape(shape)
    return outputs


def _trailing(shape, first=None):
    """``[first] + shape[1:]`` as a TensorShape (unknown rank stays unknown)."""
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([first]).concatenate(shape[1:])


# -- eager implementations: EagerTensors in, EagerTensors out --------------------------


def _allreduce_now(tensor, name, op, prescale, postscale, process_set):
    arr = tensors.host_array(tensor)
    out = tensors.empty_aligned(arr.shape, arr.dtype)
    ops.allreduce(arr, name, op, prescale, postscale, out=out, process_set=process_set)
    return tensors.to_tensor(out)


def _grouped_allreduce_now(tensor_list, group, op, prescale, postscale, process_set):
    arrays = [tensors.host_array(tensor) for tensor in tensor_list]
    outs = [tensors.empty_aligned(arr.shape, arr.dtype) for arr in arrays]
    ops.grouped_allreduce(arrays, group, op, prescale, postscale, outs=outs,
                          process_set=process_set)
    return [tensors.to_tensor(out) for out in outs]


def _broadcast_now(tensor_list, names, root_rank, process_set):
    """Broadcasts several tensors: all enqueued before any wait, so they can fuse."""
    arrays = [tensors.host_array(tensor) for tensor in tensor_list]
    outs = [tensors.empty_aligned(arr.shape, arr.dtype) for arr in arrays]
    handles = [ops.broadcast_async(arr, root_rank, name, out=out, process_set=process_set)
               for arr, name, out in zip(arrays, names, outs)]
    for handle in handles:
        ops.synchronize(handle)
    return [tensors.to_tensor(out) for out in outs]


def _reducescatter_now(tensor, name, op, prescale, postscale, process_set):
    arr = tensors.host_array(tensor)
    out = None
    if arr.ndim >= 1:  # else ops refuses it, naming the tensor
        rows = ops.reducescatter_rows(arr.shape[0], *process_sets.members(process_set))
        out = tensors.empty_aligned((rows,) + arr.shape[1:], arr.dtype)
    return tensors.to_tensor(ops.reducescatter(arr, name, op, prescale, postscale, out=out,
                                               process_set=process_set))


# -- allreduce ---------------------------------------------------------------------------


def _allreduce(tensor, name, op, prescale, postscale, process_set=global_process_set):
    """Dense allreduce with its gradient; ``name`` None means automatic."""
    _check_static(tensor, name, op, (prescale, postscale))

    @tf.custom_gradient
    def allreduce_fn(x):
        op_name = _op_name("allreduce", name, x, process_set)
        y = _run(lambda t: [_allreduce_now(t, op_name, op, prescale, postscale, process_set)],
                 [x], [x.dtype], [x.shape])[0]

        def grad(dy):
            if op not in (Average, Sum):
                raise NotImplementedError("only Average and Sum allreduces have gradients")
            return _allreduce(dy, None, op, prescale, postscale, process_set)

        return y, grad

    return allreduce_fn(tensor)


def _sparse_allreduce(slices, name, op, compression, prescale, postscale,
                      process_set=global_process_set):
    """IndexedSlices: allgather values and indices, as Horovod does."""
    if op not in (Average, Sum):
        raise InvalidArgumentError(
            "tf.IndexedSlices are reduced by allgather: only Average and Sum are "
            "supported (or pass sparse_as_dense=True)")
    values, ctx = compression.compress(slices.values)
    if op == Average and not values.dtype.is_floating:
        raise InvalidArgumentError(
            "Average of integer tf.IndexedSlices is not supported; use op=Sum")
    values = _allgather(values, None if name is None else f"{name}.values", process_set)
    indices = _allgather(slices.indices, None if name is None else f"{name}.indices",
                         process_set)
    values = compression.decompress(values, ctx)
    size = process_sets.members(process_set)[0]
    scale = prescale * postscale / (size if op == Average else 1)
    if scale != 1.0:
        values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=global_process_set):
    """Reduces a tensor across ranks; eagerly or inside a tf.function; differentiable.

    Args:
        tensor: a tf.Tensor (or variable, or value convertible to one), or a
            tf.IndexedSlices, which is allgathered (values and indices) Horovod-style.
        average: deprecated; True means op=Average, False op=Sum.
        device_dense, device_sparse: accepted for Horovod compatibility; collectives
            run on host memory.
        compression: Compression.none or Compression.fp16 (the wire type).
        op: Average (default), Sum, Min, Max or Product (bool: Min or Max only).
            Average on integers sums, then divides (C integer division) by the ranks.
        prescale_factor, postscale_factor: multiply the input / the result.
        name: equal across ranks; None names it automatically (see the module doc).
        process_set: the ProcessSet whose members reduce (this rank must be one).

    Returns:
        A tensor of the same shape and dtype (tf.IndexedSlices for IndexedSlices).

    Raises:
        InvalidArgumentError: bad dtype, op or scaling (at the call, also when tracing).
        HorovodInternalError: eagerly, the collective failed (e.g. MismatchError);
            inside a graph, a tf.errors exception carrying that message.
    """
    op = ops.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, compression, prescale_factor,
                                 postscale_factor, process_set)
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce(compressed, name, op, prescale_factor, postscale_factor,
                         process_set)
    return compression.decompress(reduced, ctx)


def _grouped_allreduce(tensor_list, name, op, prescale, postscale,
                       process_set=global_process_set):
    for i, tensor in enumerate(tensor_list):
        _check_static(tensor, None if name is None else f"{name}.{i}", op,
                      (prescale, postscale))

    @tf.custom_gradient
    def grouped_fn(*xs):
        group = _op_name("grouped_allreduce", name, xs[0], process_set)
        ys = _run(lambda *ts: _grouped_allreduce_now(ts, group, op, prescale, postscale,
                                                     process_set),
                  list(xs), [x.dtype for x in xs], [x.shape for x in xs])

        def grad(*dys):
            if op not in (Average, Sum):
                raise NotImplementedError("only Average and Sum allreduces have gradients")
            dys = [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, ys)]
            return _grouped_allreduce(dys, None, op, prescale, postscale, process_set)

        return list(ys), grad

    return list(grouped_fn(*tensor_list))


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, name=None, process_set=global_process_set):
    """Reduces several tensors in one negotiation, so that they fuse; differentiable.

    Dense tensors go as one group (tensor i named ``"<name>.<i>"``); tf.IndexedSlices
    are allgathered one by one as in ``allreduce``.

    Args:
        tensors: a list of tensors and/or tf.IndexedSlices.
        average, device_dense, device_sparse, compression, op, prescale_factor,
        postscale_factor, process_set: as for ``allreduce``, applied to every tensor.
        name: the group's name, equal across ranks; None names it automatically.

    Returns:
        A list of reduced tensors, in order.

    Raises:
        As ``allreduce``; nothing is enqueued if any tensor is refused.
    """
    op = ops.resolve_op(op, average)
    tensors_in = list(tensors)
    results = [None] * len(tensors_in)
    dense_index, dense, contexts = [], [], []
    for i, tensor in enumerate(tensors_in):
        if isinstance(tensor, tf.IndexedSlices):
            results[i] = _sparse_allreduce(
                tensor, None if name is None else f"{name}.sparse.{i}", op, compression,
                prescale_factor, postscale_factor, process_set)
            continue
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        dense_index.append(i)
        dense.append(compressed)
        contexts.append(ctx)
    if dense:
        reduced = _grouped_allreduce(dense, name, op, prescale_factor, postscale_factor,
                                     process_set)
        for i, value, ctx in zip(dense_index, reduced, contexts):
            results[i] = compression.decompress(value, ctx)
    return results


# -- allgather, broadcast ------------------------------------------------------------


def _allgather(tensor, name, process_set=global_process_set):
    tensor = tf.convert_to_tensor(tensor)
    _check_static(tensor, name, min_ndim=1)

    @tf.custom_gradient
    def allgather_fn(x):
        op_name = _op_name("allgather", name, x, process_set)
        y = _run(lambda t: [tensors.to_tensor(ops.allgather(tensors.host_array(t), op_name,
                                                            process_set))],
                 [x], [x.dtype], [_trailing(x.shape)])[0]

        def grad(dy):
            summed = _allreduce(dy, None, Sum, 1.0, 1.0, process_set)
            rows = _allgather(tf.shape(x, out_type=tf.int64)[:1], None, process_set)
            me = process_sets.members(process_set)[1]
            offset = tf.reduce_sum(rows[:me])
            return summed[offset:offset + rows[me]]

        return y, grad

    return allgather_fn(tensor)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's tensor along the first dimension; differentiable.

    Ranks may differ in the first dimension; the others must agree.

    Args:
        tensor: a tensor with at least one dimension.
        name: equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members' tensors are concatenated.

    Returns:
        A tensor of shape ``(sum of first dims, *tensor.shape[1:])``.

    Raises:
        As ``allreduce``.
    """
    return _allgather(tensor, name, process_set)


def _broadcast(tensor, root_rank, name, process_set=global_process_set):
    tensor = tf.convert_to_tensor(tensor)
    _check_static(tensor, name)
    ops._check_rank(root_rank, "root_rank", name or "unnamed")

    @tf.custom_gradient
    def broadcast_fn(x):
        op_name = _op_name("broadcast", name, x, process_set)
        y = _run(lambda t: _broadcast_now([t], [op_name], root_rank, process_set),
                 [x], [x.dtype], [x.shape])[0]

        def grad(dy):
            summed = _allreduce(dy, None, Sum, 1.0, 1.0, process_set)
            return summed if runtime.rank() == root_rank else tf.zeros_like(summed)

        return y, grad

    return broadcast_fn(tensor)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s tensor on every rank; differentiable.

    Args:
        tensor: a tensor of the same shape and dtype on every rank.
        root_rank: the rank whose values everyone receives (a global rank, a member of
            ``process_set``).
        name: equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members receive.

    Returns:
        A tensor holding the root's values.

    Raises:
        As ``allreduce``; InvalidArgumentError for a root out of range.
    """
    return _broadcast(tensor, root_rank, name, process_set)


def broadcast_group(tensor_list, root_rank, name=None, process_set=global_process_set):
    """Broadcasts several tensors in one step (one graph node), so that they fuse.

    Not differentiable. Tensor i is named ``"<name>.<i>"``.

    Returns:
        A list of tensors holding the root's values.
    """
    tensor_list = [tf.convert_to_tensor(t) for t in tensor_list]
    if not tensor_list:
        return []
    for tensor in tensor_list:
        _check_static(tensor, name)
    ops._check_rank(root_rank, "root_rank", name or "unnamed")
    group = _op_name("broadcast_group", name, tensor_list[0], process_set)
    names = [f"{group}.{i}" for i in range(len(tensor_list))]
    return list(_run(lambda *ts: _broadcast_now(ts, names, root_rank, process_set), tensor_list,
                     [t.dtype for t in tensor_list], [t.shape for t in tensor_list]))


# -- alltoall, reducescatter, join, barrier ----------------------------------------------


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """All-to-all: rows ``splits[r]`` of ``tensor`` go to rank r.

    Args:
        tensor: a tensor with at least one dimension.
        splits: rows for each rank (a list or an int tensor of size() entries summing
            to the first dimension); None splits the first dimension evenly.
        name: equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members exchange (splits: one per member).

    Returns:
        ``(received, received_splits)``: the rows from every rank in rank order, and
        how many came from each (int32, one per rank).

    Raises:
        As ``allreduce``; InvalidArgumentError for bad splits.
    """
    tensor = tf.convert_to_tensor(tensor)
    _check_static(tensor, name, min_ndim=1)
    op_name = _op_name("alltoall", name, tensor, process_set)
    size = process_sets.members(process_set)[0]

    def now(t, s=None):
        received, received_splits = ops.alltoall(
            tensors.host_array(t), None if s is None else tensors.host_array(s), op_name,
            process_set)
        return [tensors.to_tensor(received),
                tf.constant(received_splits.astype(np.int32))]

    inputs = [tensor] if splits is None else [tensor, tf.convert_to_tensor(splits)]
    received, received_splits = _run(now, inputs, [tensor.dtype, tf.int32],
                                     [_trailing(tensor.shape), tf.TensorShape([size])])
    return received, received_splits


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average,
                  name=None, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=global_process_set):
    """Reduces a tensor across ranks and returns this rank's rows of the result.

    The first dimension d0 is split so that the first ``d0 % size()`` ranks get one
    row more than the others.

    Args:
        tensor: a tensor with at least one dimension, the same shape on every rank.
        device_dense: accepted for Horovod compatibility.
        compression, op, prescale_factor, postscale_factor, name, process_set: as for
            ``allreduce`` (rows are split among the set's members).

    Returns:
        This rank's rows of the reduction.

    Raises:
        As ``allreduce``.
    """
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    _check_static(compressed, name, op, (prescale_factor, postscale_factor), min_ndim=1)
    op_name = _op_name("reducescatter", name, compressed, process_set)
    rows = None
    if compressed.shape.rank and compressed.shape[0] is not None:
        rows = ops.reducescatter_rows(compressed.shape[0], *process_sets.members(process_set))
    out = _run(lambda t: [_reducescatter_now(t, op_name, op, prescale_factor,
                                             postscale_factor, process_set)],
               [compressed], [compressed.dtype], [_trailing(compressed.shape, rows)])[0]
    return compression.decompress(out, ctx)


def join():
    """Declares that this rank has no more data; returns when every rank has joined.

    Returns:
        The rank that joined last (an int32 scalar tensor).
    """
    return _run(lambda: [tf.constant(ops.join(), tf.int32)], [], [tf.int32],
                [tf.TensorShape([])])[0]


def barrier(process_set=global_process_set):
    """Blocks until every rank (of ``process_set``) has reached the barrier (in a graph:
    when it runs)."""
    def now():
        ops.barrier(process_set)
        return [tf.constant(0, tf.int32)]

    # In a tf.function the node runs in program order without being returned
    # (automatic control dependencies run every stateful op).
    _run(now, [], [tf.int32], [tf.TensorShape([])])
