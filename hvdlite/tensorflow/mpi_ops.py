"""Tensor collectives for TensorFlow 2: eagerly, inside ``tf.function``, in TF1-style
graphs, with gradients.

Built on ``hvdlite.ops``: a tensor is looked at through a zero-copy numpy view of its
host memory, so naming, validation (dtype, op, scaling, root, splits) and handles are
those of the framework-free layer (``tensors.py`` says which path copies, per case).
Nothing here is compiled against TensorFlow.

* Eagerly, an op enqueues with the core and waits (the GIL is released while waiting).
* In a graph the same eager code runs as a ``tf.py_function`` node; its output shapes
  are set where they are known. Such a node blocks one of TF's threads until the
  collective ends, so the nodes of one graph must run in the same order on every rank,
  or two ranks each wait, with every thread taken, for a node the other has not
  started (a fused step of many allreduces in a TF1 ``Session.run``, or the two
  allgathers of a tf.IndexedSlices, hung so). In a function graph each collective
  node has a control dependency on the previous one (program order, as tf.function's
  automatic control dependencies give). In a TF1 graph, where that would make every
  run execute all earlier nodes, a node takes relays standing for the earlier nodes
  as inputs, and ``Session.run`` feeds those a run does not need
  (``execution._GraphOrder``).
  Not XLA-compilable: use ``jit_compile=False``.
* Names: an explicit ``name`` is used as is. Unnamed eager calls take the counter-based
  names of ``hvdlite.ops`` (``"allreduce.noname.<n>"``). Unnamed calls in a graph are
  named at trace time after the input tensor's graph name, Horovod-style
  (``"allreduce.<tensor name>"``), so names agree across ranks even when one rank
  retraces (e.g. for a smaller last batch) and the others do not.
* Gradients (``tf.custom_gradient``) are Horovod's: allreduce -> allreduce of the
  gradient with the same op and scaling; allgather -> this rank's rows of the
  averaged gradient; broadcast -> the averaged gradient on the root, zeros elsewhere;
  alltoall -> alltoall of the gradient back along the received splits; reducescatter
  -> allgather of the gradient (times size() for Sum, times the scale factors).
* Errors are the ``tf.errors`` classes Horovod raises (``errors.py``): a mismatch
  across ranks is ``FailedPreconditionError``, bad splits ``InvalidArgumentError``,
  eagerly and in graphs; each is also the hvdlite class (e.g. ``MismatchError``).

How one collective runs (its name, the checks at the call, the eager implementation,
the ordered graph node) is ``hvdlite.tensorflow.execution``; this module holds the ops.
"""
import numpy as np
import tensorflow as tf

from hvdlite import _checks, ops, process_sets, runtime
from hvdlite._enqueue import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 (Horovod)
from hvdlite.process_sets import (ProcessSet, add_process_set,  # noqa: F401 (API)
                                  global_process_set, remove_process_set)
from hvdlite.tensorflow import errors, tensors
from hvdlite.tensorflow.compression import Compression
from hvdlite.tensorflow.execution import (allgather_now, allreduce_now, broadcast_now,
                                          check_process_set, check_rank, check_static,
                                          collective_name, group_names,
                                          grouped_allreduce_now, reducescatter_now, run,
                                          trailing)

_basics = process_sets.basics


# -- allreduce ---------------------------------------------------------------------------


def _allreduce(tensor, name, op, prescale, postscale, process_set=global_process_set):
    """Dense allreduce with its gradient; ``name`` None means automatic."""
    # Adasum is checked where it runs (hvdlite.adasum: float types, the global set).
    check_static(tensor, name, None if op == Adasum else op, (prescale, postscale))

    @tf.custom_gradient
    def allreduce_fn(x):
        op_name = collective_name("allreduce", name, x, process_set)
        y = run(lambda t: [allreduce_now(t, op_name, op, prescale, postscale,
                                         process_set)],
                [x], [x.dtype], [x.shape])[0]

        def grad(dy):
            if op not in (Average, Sum):
                raise NotImplementedError("only Average and Sum allreduces have gradients")
            return _allreduce(dy, None, op, prescale, postscale, process_set)

        return y, grad

    return allreduce_fn(tensor)


def _check_sparse(op, prescale, postscale):
    # Horovod's limits for tf.IndexedSlices, with its exception type.
    if op not in (Average, Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with "
                                  "tf.IndexedSlices (or pass sparse_as_dense=True)")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with "
                                  "tf.IndexedSlices")


def _average_values(values, op, process_set):
    # Horovod's Average of tf.IndexedSlices: values / the set's size (a true division,
    # so integer values come back as floats, as TF's ``/`` makes them).
    if op != Average:
        return values
    return values / tf.cast(process_sets.members(process_set)[0], values.dtype)


def _sparse_allreduce(slices, name, op, compression, prescale, postscale, process_set):
    """IndexedSlices: allgather values and indices, as Horovod does."""
    _check_sparse(op, prescale, postscale)
    values, ctx = compression.compress(slices.values)
    values, indices = _grouped_allgather(
        [values, slices.indices], None if name is None else f"{name}.sparse", process_set)
    values = _average_values(compression.decompress(values, ctx), op, process_set)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduces a tensor across ranks; eagerly or in a graph; differentiable.

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
        process_set: the ProcessSet whose members reduce (this rank must be one);
            None or ``global_process_set`` for every rank.
        ignore_name_scope: accepted for Horovod compatibility (names never carry
            the scope here).

    Returns:
        A tensor of the same shape and dtype (tf.IndexedSlices for IndexedSlices).

    Raises:
        tf.errors.InvalidArgumentError: bad dtype, op or scaling (at the call, also
            when tracing).
        tf.errors.FailedPreconditionError: ranks disagree (shape, dtype, op...).
        tf.errors.UnknownError: the collective failed otherwise (shutdown, lost rank).
        NotImplementedError: an IndexedSlices with an op other than Average and Sum,
            or with scale factors (as Horovod).
    """
    check_process_set(process_set)
    op = _checks.resolve_op(op, average)
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
        check_static(tensor, None if name is None else f"{name}.{i}", op,
                     (prescale, postscale))

    @tf.custom_gradient
    def grouped_fn(*xs):
        group = collective_name("grouped_allreduce", name, xs[0], process_set)
        ys = run(lambda *ts: grouped_allreduce_now(ts, group, op, prescale, postscale,
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
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False,
                      name=None):
    """Reduces several tensors in one negotiation, so that they fuse; differentiable.

    Dense tensors go as one group (tensor i named ``"<name>.<i>"``); the values and
    indices of every tf.IndexedSlices go in one grouped allgather, as Horovod does.

    Args:
        tensors: a list of tensors and/or tf.IndexedSlices.
        average, device_dense, device_sparse, compression, op, prescale_factor,
        postscale_factor, process_set, ignore_name_scope: as for ``allreduce``,
            applied to every tensor.
        name: the group's name, equal across ranks; None names it automatically.

    Returns:
        A list of reduced tensors, in order.

    Raises:
        As ``allreduce``; nothing is enqueued if any tensor is refused at the call.
    """
    check_process_set(process_set)
    op = _checks.resolve_op(op, average)
    tensors_in = list(tensors)
    results = [None] * len(tensors_in)
    sparse_index = [i for i, t in enumerate(tensors_in) if isinstance(t, tf.IndexedSlices)]
    dense_index = [i for i, t in enumerate(tensors_in) if not isinstance(t, tf.IndexedSlices)]
    if sparse_index:
        _check_sparse(op, prescale_factor, postscale_factor)
        slices = [tensors_in[i] for i in sparse_index]
        compressed = [compression.compress(s.values) for s in slices]
        gathered = _grouped_allgather(
            [values for values, _ in compressed] + [s.indices for s in slices],
            None if name is None else f"{name}.sparse", process_set)
        count = len(slices)
        for i, s, (_, ctx), values, indices in zip(
                sparse_index, slices, compressed, gathered[:count], gathered[count:]):
            values = _average_values(compression.decompress(values, ctx), op, process_set)
            results[i] = tf.IndexedSlices(values, indices, dense_shape=s.dense_shape)
    if dense_index:
        compressed = [compression.compress(tf.convert_to_tensor(tensors_in[i]))
                      for i in dense_index]
        reduced = _grouped_allreduce([c for c, _ in compressed], name, op,
                                     prescale_factor, postscale_factor, process_set)
        for i, value, (_, ctx) in zip(dense_index, reduced, compressed):
            results[i] = compression.decompress(value, ctx)
    return results


# -- allgather, broadcast ------------------------------------------------------------


def _my_rows(gradient, x, process_set):
    """Returns this rank's rows of an allgather's ``gradient`` (input ``x``).

    The rows of every member come from an allgather of the first dimensions, so the
    graph is the same on every rank (only constants differ).
    """
    rows = _allgather(tf.shape(x, out_type=tf.int64)[:1], None, process_set)
    me = process_sets.members(process_set)[1]
    offset = tf.reduce_sum(rows[:me])
    return gradient[offset:offset + rows[me]]


def _grouped_allgather(tensor_list, name, process_set=global_process_set):
    tensor_list = [tf.convert_to_tensor(t) for t in tensor_list]
    for i, tensor in enumerate(tensor_list):
        check_static(tensor, None if name is None else f"{name}.{i}", min_ndim=1)

    @tf.custom_gradient
    def allgather_fn(*xs):
        names = group_names("allgather", name, xs, process_set)
        ys = run(lambda *ts: allgather_now(ts, names, process_set), list(xs),
                 [x.dtype for x in xs], [trailing(x.shape) for x in xs])

        def grad(*dys):
            # Horovod's: the average over ranks, then this rank's rows (one allreduce
            # per tensor: TF may hand float32 zeros for a float64 output).
            dys = [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, ys)]
            return [_my_rows(_allreduce(dy, None, Average, 1.0, 1.0, process_set), x,
                             process_set)
                    for dy, x in zip(dys, xs)]

        return list(ys), grad

    return list(allgather_fn(*tensor_list))


def _allgather(tensor, name, process_set=global_process_set):
    return _grouped_allgather([tensor], name, process_set)[0]


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates every rank's tensor along the first dimension; differentiable.

    Ranks may differ in the first dimension; the others must agree.

    Args:
        tensor: a tensor with at least one dimension.
        name: equal across ranks; None names it automatically.
        ignore_name_scope, process_set: as for ``allreduce``.

    Returns:
        A tensor of shape ``(sum of first dims, *tensor.shape[1:])``.

    Raises:
        As ``allreduce``.
    """
    check_process_set(process_set)
    return _allgather(tensor, name, process_set)


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """Allgathers several tensors in one step (one graph node), so that they fuse.

    Differentiable; tensor i is named ``"<name>.<i>"``.

    Args:
        tensors: a list of tensors with at least one dimension each.
        name, ignore_name_scope, process_set: as for ``allgather``.

    Returns:
        A list of gathered tensors, in order.

    Raises:
        As ``allreduce``.
    """
    check_process_set(process_set)
    tensors = list(tensors)
    return _grouped_allgather(tensors, name, process_set) if tensors else []


def _broadcast(tensor, root_rank, name, process_set=global_process_set):
    tensor = tf.convert_to_tensor(tensor)
    check_static(tensor, name)
    check_rank(root_rank, "root_rank", name or "unnamed")

    @tf.custom_gradient
    def broadcast_fn(x):
        op_name = collective_name("broadcast", name, x, process_set)
        y = run(lambda t: broadcast_now([t], [op_name], root_rank, process_set),
                [x], [x.dtype], [x.shape])[0]

        def grad(dy):
            # Horovod's: the average over ranks on the root, zeros elsewhere (a
            # multiplication on every rank, so the graph is the same everywhere).
            averaged = _allreduce(dy, None, Average, 1.0, 1.0, process_set)
            return averaged * tf.cast(runtime.rank() == root_rank, averaged.dtype)

        return y, grad

    return broadcast_fn(tensor)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Returns ``root_rank``'s tensor on every rank; differentiable.

    Args:
        tensor: a tensor of the same shape and dtype on every rank.
        root_rank: the rank whose values everyone receives (a global rank, a member of
            ``process_set``).
        name: equal across ranks; None names it automatically.
        ignore_name_scope, process_set: as for ``allreduce``.

    Returns:
        A tensor holding the root's values.

    Raises:
        As ``allreduce``; tf.errors.InvalidArgumentError for a root out of range.
    """
    check_process_set(process_set)
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
        check_static(tensor, name)
    check_rank(root_rank, "root_rank", name or "unnamed")
    names = group_names("broadcast_group", name, tensor_list, process_set)
    return list(run(lambda *ts: broadcast_now(ts, names, root_rank, process_set),
                    tensor_list,
                    [t.dtype for t in tensor_list], [t.shape for t in tensor_list]))


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assigns ``root_rank``'s values to ``variables`` in place, in one fused step.

    Args:
        variables: tf.Variables, the same shapes and dtypes on every rank.
        root_rank: the rank whose values everyone receives.
        name, process_set: as for ``broadcast``.

    Returns:
        The variables' new values (a list of tensors).

    Raises:
        As ``broadcast``.
    """
    check_process_set(process_set)
    variables = list(variables)
    values = broadcast_group(variables, root_rank, name, process_set)
    assigned = [variable.assign(value) for variable, value in zip(variables, values)]
    with tf.control_dependencies(assigned):  # a graph's reads wait for the writes
        return [tf.identity(value) for value in values]


# -- alltoall, reducescatter, join, barrier ----------------------------------------------


def _even_splits(rows, label, size):
    _checks.check_even_split(rows, size, label)
    return np.full(size, rows // size, dtype=np.int64)


def _alltoall_now(tensor, splits, name, process_set):
    arr = tensors.host_array(tensor)
    if splits is None:
        splits = _even_splits(arr.shape[0] if arr.ndim else 0, name,
                              process_sets.members(process_set)[0])
    else:
        splits = tensors.host_array(splits)
    received, received_splits = ops.alltoall(arr, splits, name, process_set)
    return [tensors.to_tensor(received), tf.constant(received_splits.astype(np.int32))]


def _alltoall(tensor, splits, name, process_set=global_process_set):
    @tf.custom_gradient
    def alltoall_fn(x):
        op_name = collective_name("alltoall", name, x, process_set)
        inputs = [x] if splits is None else [x, splits]
        received, received_splits = run(
            lambda t, s=None: _alltoall_now(t, s, op_name, process_set), inputs,
            [x.dtype, tf.int32],
            [trailing(x.shape), tf.TensorShape([process_sets.members(process_set)[0]])])

        def grad(d_received, d_splits=None):
            # Horovod's: the gradient goes back along the splits it came by.
            return _alltoall(d_received, received_splits, None, process_set)[0]

        return (received, received_splits), grad

    return alltoall_fn(tensor)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """All-to-all: rows ``splits[r]`` of ``tensor`` go to rank r; differentiable.

    Args:
        tensor: a tensor with at least one dimension.
        splits: rows for each rank (a list or an int tensor of size() entries summing
            to the first dimension); None splits this rank's first dimension evenly
            (ranks may differ in it; it must be a multiple of size()).
        name: equal across ranks; None names it automatically.
        ignore_name_scope, process_set: as for ``allreduce``.

    Returns:
        As Horovod: with ``splits``, ``(received, received_splits)``: the rows from
        every rank in rank order, and how many came from each (int32, one per rank);
        without, ``received`` alone.

    Raises:
        As ``allreduce``; tf.errors.InvalidArgumentError for bad splits.
    """
    check_process_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    check_static(tensor, name, min_ndim=1)
    if splits is None and tensor.shape.rank and tensor.shape[0] is not None:
        errors.tf_errors(_even_splits)(tensor.shape[0], name or "unnamed",
                                       process_sets.members(process_set)[0])
    if splits is not None:
        splits = tf.convert_to_tensor(splits)
    received, received_splits = _alltoall(tensor, splits, name, process_set)
    return received if splits is None else (received, received_splits)


def _grouped_reducescatter(tensor_list, name, op, prescale, postscale,
                           process_set=global_process_set):
    for i, tensor in enumerate(tensor_list):
        check_static(tensor, None if name is None else f"{name}.{i}", op,
                     (prescale, postscale), min_ndim=1)

    @tf.custom_gradient
    def reducescatter_fn(*xs):
        names = group_names("reducescatter", name, xs, process_set)
        size, rank = process_sets.members(process_set)
        shapes = []
        for x in xs:
            rows = None
            if x.shape.rank and x.shape[0] is not None:
                rows = _checks.reducescatter_rows(x.shape[0], size, rank)
            shapes.append(trailing(x.shape, rows))
        ys = run(lambda *ts: reducescatter_now(ts, names, op, prescale, postscale,
                                               process_set),
                 list(xs), [x.dtype for x in xs], shapes)

        def grad(*dys):
            # Horovod's: the allgathered gradient, times the set's size for Sum and
            # times the scale factors.
            factor = (size if op == Sum else 1) * prescale * postscale
            dys = [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, ys)]
            if factor != 1:
                dys = [dy * tf.cast(factor, dy.dtype) for dy in dys]
            return _grouped_allgather(dys, None, process_set)

        return list(ys), grad

    return list(reducescatter_fn(*tensor_list))


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average,
                  name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduces a tensor across ranks and returns this rank's rows of the result.

    The first dimension d0 is split so that the first ``d0 % size()`` ranks get one
    row more than the others. Differentiable (Horovod's gradient, module doc).

    Args:
        tensor: a tensor with at least one dimension, the same shape on every rank.
        device_dense: accepted for Horovod compatibility.
        compression, op, prescale_factor, postscale_factor, name, process_set,
        ignore_name_scope: as for ``allreduce``.

    Returns:
        This rank's rows of the reduction.

    Raises:
        As ``allreduce``.
    """
    return grouped_reducescatter([tensor], device_dense, compression, op, name,
                                 process_set, ignore_name_scope, prescale_factor,
                                 postscale_factor)[0]


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none,
                          op=Average, name=None, process_set=global_process_set,
                          ignore_name_scope=False, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce-scatters several tensors in one step (one graph node), so that they fuse.

    Args and Raises: as ``reducescatter``, for every tensor (tensor i is named
    ``"<name>.<i>"``).

    Returns:
        A list of this rank's rows of each reduction, in order.
    """
    check_process_set(process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    compressed = [compression.compress(t) for t in tensors]
    reduced = _grouped_reducescatter([c for c, _ in compressed], name, op,
                                     prescale_factor, postscale_factor, process_set)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def join():
    """Declares that this rank has no more data; returns when every rank has joined.

    Returns:
        The rank that joined last (an int32 scalar tensor).
    """
    return run(lambda: [tf.constant(ops.join(), tf.int32)], [], [tf.int32],
               [tf.TensorShape([])])[0]


def barrier(process_set=global_process_set):
    """Blocks until every rank (of ``process_set``) has reached the barrier (in a graph:
    when it runs)."""
    check_process_set(process_set)

    def now():
        ops.barrier(process_set)
        return [tf.constant(0, tf.int32)]

    # In a graph the node runs in program order with the other collectives (module
    # doc); returned, so that a TF1 session can run it.
    return run(now, [], [tf.int32], [tf.TensorShape([])])[0]


# -- the process, as tensors ----------------------------------------------------------


def size_op(process_set_id=0, name=None):
    """Returns the size of set ``process_set_id`` (size() for 0) as an int32 scalar
    tensor."""
    ranks = _process_set_ranks(process_set_id)
    return tf.constant(runtime.size() if ranks is None else len(ranks), tf.int32,
                       name=name)


def local_size_op(name=None):
    """Returns local_size() as an int32 scalar tensor."""
    return tf.constant(runtime.local_size(), tf.int32, name=name)


def rank_op(name=None):
    """Returns rank() as an int32 scalar tensor."""
    return tf.constant(runtime.rank(), tf.int32, name=name)


def local_rank_op(name=None):
    """Returns local_rank() as an int32 scalar tensor."""
    return tf.constant(runtime.local_rank(), tf.int32, name=name)


def process_set_included_op(process_set_id=0, name=None):
    """Returns 1 if this rank is in set ``process_set_id``, else 0 (int32 tensor)."""
    ranks = _process_set_ranks(process_set_id)
    included = ranks is None or runtime.rank() in ranks
    return tf.constant(int(included), tf.int32, name=name)


@errors.tf_errors
def _process_set_ranks(process_set_id):
    # The set's global ranks (None for set 0); raises before init(), as Horovod's ops
    # do, and for an unknown id.
    runtime.size()
    return None if process_set_id == 0 else process_sets.process_set_ranks(process_set_id)
