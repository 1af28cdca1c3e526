"""How one TensorFlow collective runs: named and checked at the call, then run now
(eagerly) or added to the graph as a node ordered after the graph's earlier collective
nodes (``_GraphOrder``).

``hvdlite.tensorflow.mpi_ops`` (whose docstring gives the rules: names, order of graph
nodes, errors) builds every op from these. The ``*_now`` functions are the eager
implementations a node runs: EagerTensors in, EagerTensors out.
"""
import bisect
import functools
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
    """Adds ``fn`` to the default graph, ordered after its earlier collective nodes.

    The py_function returns the error's code and message with its outputs (TF would
    turn a raised error into UnknownError); the outputs pass through identities that
    wait on ``errors.raise_in_graph``, which fails the step with the right class.
    """
    count = len(inputs)

    def node(*args):
        try:
            outputs = list(fn(*args[:count]))
            code, message = errors.OK, ""
        except HvdliteError as e:
            coded = errors.graph_code(e)
            if coded is None:
                raise
            code, message = coded
            outputs = [tf.zeros([0], dtype) for dtype in out_dtypes]
        return outputs + [tf.constant(code, tf.int32), tf.constant(message)]

    graph = tf.compat.v1.get_default_graph()
    tout = list(out_dtypes) + [tf.int32, tf.string]
    with _graph_order_lock:
        if graph.building_function:
            # A function runs all its nodes: program order by control dependencies
            # (tf.function adds them too), nothing to feed.
            with tf.control_dependencies(_function_last.get(graph, [])):
                results = tf.py_function(node, inputs, Tout=tout)
            _function_last[graph] = [results[0].op]
        else:
            order = _graph_order.get(graph)
            if order is None:
                order = _graph_order[graph] = _GraphOrder()
            blocks = order.blocks_before_next()
            results = tf.py_function(node, list(inputs) + order.relay_tensors(blocks),
                                     Tout=tout)
            order.add(results[0].op, count, results[-2], blocks)
    with tf.control_dependencies([errors.raise_in_graph(results[-2], results[-1])]):
        outputs = [tf.identity(result) for result in results[:-2]]
    for output, shape in zip(outputs, out_shapes):
        output.set_shape(shape)
    return outputs


class _GraphOrder:
    """The order of a TF1 graph's collective nodes: the same on every rank, and no run
    executes a node its fetches do not need.

    A node blocks one of TF's threads until every rank has run it, so the nodes one
    run executes must start in one order everywhere (else each rank may wait, its
    threads taken, for a node another has not started). A control dependency on the
    previous node would give that order but make every run execute all earlier nodes
    (a broadcast built after a training step would run the step, and ask for its
    feeds). So each node takes, as extra inputs ("links"), relays that stand for all
    earlier nodes: node ``i``'s code output is the relay of block ``(i, 1)``, and the
    relay of an aligned block ``(start, 2k)`` adds those of its two halves; node ``n``
    links to the blocks of the binary decomposition of ``[0, n)``. Around
    ``Session.run``, ``_run_with_order`` feeds the relay of every linked block that
    holds no node the run needs, so TF cuts it off, and the nodes it needs run in
    creation order. Edges: O(log n) a node; feeds: O(log n) a needed node.
    """

    def __init__(self):
        self.index = {}     # collective op -> (position, its own input count)
        self.blocks = []    # position -> the blocks that node links to
        self.relays = {}    # (start, size) -> int32 scalar tensor
        self.feeds = {}     # (fetch ids, feed ids) -> relay tensors to feed

    def blocks_before_next(self):
        """The aligned blocks covering every node built so far."""
        built, start, blocks = len(self.index), 0, []
        size = 1 << max(built.bit_length() - 1, 0)
        while built and size:
            if built & size:
                blocks.append((start, size))
                start += size
            size >>= 1
        return blocks

    def relay_tensors(self, blocks):
        return [self.relays[block] for block in blocks]

    def add(self, op, count, code, blocks):
        position = len(self.index)
        self.index[op] = (position, count)
        self.blocks.append(blocks)
        with tf.control_dependencies(None), tf.name_scope("hvdlite_order"):
            # stop_gradient: graph walks for gradients (tf.custom_gradient's search for
            # the variables a function uses) must not follow links to earlier nodes.
            self.relays[(position, 1)] = tf.stop_gradient(code)
            size = 2
            while (position + 1) % size == 0:
                start, half = position + 1 - size, size // 2
                self.relays[(start, size)] = tf.math.add(
                    self.relays[(start, half)], self.relays[(start + half, half)])
                size *= 2
        self.feeds.clear()

    def relays_to_feed(self, graph, fetches, feed_dict):
        """Returns the relays to feed in a run of ``fetches`` given ``feed_dict``."""
        roots = [_graph_op(graph, f) for f in tf.nest.flatten(fetches,
                                                               expand_composites=True)]
        roots = [op for op in roots if op is not None]
        fed = [_graph_element(graph, k) for k in tf.nest.flatten(
            list((feed_dict or {}).keys()), expand_composites=True)]
        fed = [t for t in fed if isinstance(t, tf.Tensor)]
        key = (tuple(map(id, roots)), tuple(map(id, fed)))
        relays = self.feeds.get(key)
        if relays is None:
            relays = self.feeds[key] = self._cut(self._needed(roots, fed))
        return relays

    def _needed(self, roots, fed):
        """Positions of the collective nodes a run of ``roots`` executes: those reached
        through data inputs (short of fed tensors and of links) and control inputs."""
        fed = {id(t) for t in fed}
        seen, stack = set(roots), list(roots)
        while stack:
            op = stack.pop()
            inputs = list(op.inputs)
            if op in self.index:
                inputs = inputs[:self.index[op][1]]
            parents = [t.op for t in inputs if id(t) not in fed] + list(op.control_inputs)
            for parent in parents:
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        return sorted(self.index[op][0] for op in seen if op in self.index)

    def _cut(self, needed):
        """The relays of the linked blocks (and sub-blocks) holding no needed node."""
        cut, seen = [], set()

        def cover(block):
            if block in seen:
                return
            seen.add(block)
            start, size = block
            first = bisect.bisect_left(needed, start)
            if first == len(needed) or needed[first] >= start + size:
                cut.append(self.relays[block])
            elif size > 1:
                cover((start, size // 2))
                cover((start + size // 2, size // 2))

        for position in needed:
            for block in self.blocks[position]:
                cover(block)
        return cut


def _graph_element(graph, fetch):
    if isinstance(fetch, str):
        try:
            return graph.as_graph_element(fetch)
        except (KeyError, ValueError, TypeError):
            return None
    return fetch if isinstance(fetch, (tf.Tensor, tf.Operation)) else None


def _graph_op(graph, fetch):
    element = _graph_element(graph, fetch)
    return element.op if isinstance(element, tf.Tensor) else element


# TF1 graph -> its _GraphOrder; function graph -> [its last collective op]. Weak keys:
# an entry goes with its graph.
_graph_order = weakref.WeakKeyDictionary()
_function_last = weakref.WeakKeyDictionary()
_graph_order_lock = threading.Lock()


def _run_with_order(run_fn):
    """Wraps ``Session.run``: feeds the relays the run does not need (``_GraphOrder``)."""
    @functools.wraps(run_fn)
    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        order = _graph_order.get(self.graph)
        if order is not None:
            relays = order.relays_to_feed(self.graph, fetches, feed_dict)
            if relays:
                feed_dict = dict(feed_dict or {})
                feed_dict.update({relay: 0 for relay in relays})
        return run_fn(self, fetches, feed_dict, options, run_metadata)

    run.hvdlite_order = True
    return run


def _make_callable_with_order(make_fn):
    """Wraps ``Session.make_callable`` as ``_run_with_order`` wraps ``run``."""
    @functools.wraps(make_fn)
    def make_callable(self, fetches, feed_list=None, accept_options=False):
        order = _graph_order.get(self.graph)
        relays = [] if order is None else order.relays_to_feed(
            self.graph, fetches, {k: None for k in feed_list or []})
        if not relays:
            return make_fn(self, fetches, feed_list, accept_options)
        call = make_fn(self, fetches, list(feed_list or []) + relays, accept_options)
        zeros = [0] * len(relays)

        def with_relays(*args, **kwargs):
            return call(*args, *zeros, **kwargs)

        return with_relays

    make_callable.hvdlite_order = True
    return make_callable


def _install_session_hooks():
    """Puts the wrappers around every TF1 session's ``run`` and ``make_callable``."""
    base = next(cls for cls in tf.compat.v1.Session.__mro__ if cls.__name__ == "BaseSession")
    if not getattr(base.run, "hvdlite_order", False):
        base.run = _run_with_order(base.run)
    if not getattr(base.make_callable, "hvdlite_order", False):
        base.make_callable = _make_callable_with_order(base.make_callable)


_install_session_hooks()


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
