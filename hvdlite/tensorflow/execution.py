"""How one TensorFlow collective runs: named and checked at the call, then run now
(eagerly) or added to the graph as a node ordered after the graph's earlier collective
nodes (``_GraphOrder``).

``hvdlite.tensorflow.mpi_ops`` (whose docstring gives the rules: names, order of graph
nodes, errors) builds every op from these. The ``*_now`` functions are the eager
implementations a node runs: EagerTensors in, EagerTensors out.
"""
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
    """Adds ``fn`` to the default graph, in order after its earlier collective nodes.

    The py_function returns the error's code and message with its outputs (TF would
    turn a raised error into UnknownError); the outputs pass through identities that
    wait on ``errors.raise_in_graph``, which fails the step with the right class.
    """
    ran = threading.Event()
    count = len(inputs)

    def node(*args):
        ran.set()
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
    with _graph_order_lock:
        order = _graph_order.get(graph)
        if order is None:
            order = _graph_order[graph] = _GraphOrder()
        after, links = order.before_new_node()
        with tf.control_dependencies(after):
            results = tf.py_function(node, list(inputs) + links,
                                     Tout=list(out_dtypes) + [tf.int32, tf.string])
        order.add(results[0].op, ran, token=results[-2], links=links)
    with tf.control_dependencies([errors.raise_in_graph(results[-2], results[-1])]):
        outputs = [tf.identity(result) for result in results[:-2]]
    for output, shape in zip(outputs, out_shapes):
        output.set_shape(shape)
    return outputs


class _GraphOrder:
    """The order of one graph's collective nodes, the same on every rank.

    A node blocks one of TF's threads until every rank has run it, so the nodes a step
    runs must start in one order everywhere (else each rank may wait, with its threads
    taken, for a node another has not started). Nodes built one after another (a
    "batch") are chained by control dependencies. A batch starts when the previous node
    has already run (build a step, run it, build the next): a control dependency on it
    would make every later run of a TF1 session run it again. Instead the first node of
    a new batch takes the code output of every earlier node as an extra input, a
    "link", and ``_run_with_links`` (around ``Session.run``) feeds the links whose
    nodes a run does not need, so TF runs those nodes only when the user's fetches
    need them, and then in order.
    """

    def __init__(self):
        self.nodes = []         # (op, ran event, code tensor) in creation order
        self.collectives = {}   # op -> the link tensors it takes
        self.linked = False     # some node takes links: runs must look at the feeds
        self.needs = {}         # (fetches, feeds) -> link tensors to feed, for that run

    def before_new_node(self):
        """Returns (control dependencies, links) for the node about to be added."""
        if not self.nodes:
            return [], []
        last_op, last_ran, _ = self.nodes[-1]
        if not last_ran.is_set():
            return [last_op], []
        return [], [token for _, _, token in self.nodes]

    def add(self, op, ran, token, links):
        self.nodes.append((op, ran, token))
        self.collectives[op] = links
        self.linked = self.linked or bool(links)
        self.needs.clear()

    def links_to_feed(self, graph, fetches, feed_dict):
        """Returns the links to feed in a run of ``fetches``: those of needed nodes
        whose own node the run does not otherwise need."""
        roots = [_graph_op(graph, f) for f in tf.nest.flatten(fetches,
                                                               expand_composites=True)]
        fed = [_graph_element(graph, k) for k in tf.nest.flatten(
            list((feed_dict or {}).keys()), expand_composites=True)]
        key = (tuple(id(op) for op in roots if op is not None),
               tuple(id(t) for t in fed if t is not None))
        links = self.needs.get(key)
        if links is None:
            needed = _ancestors([op for op in roots if op is not None],
                                {t for t in fed if t is not None}, self.collectives)
            links = {token for op in needed for token in self.collectives.get(op, ())
                     if token.op not in needed}
            self.needs[key] = links
        return links


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


def _ancestors(roots, fed, collectives):
    """The ops a run of ``roots`` executes: every op they reach through data inputs
    (short of fed tensors and of collective nodes' links) and control inputs."""
    seen, stack = set(roots), list(roots)
    while stack:
        op = stack.pop()
        links = collectives.get(op, ())
        reached = [t.op for t in op.inputs
                   if t not in fed and not any(t is link for link in links)]
        for parent in reached + list(op.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


# graph -> its _GraphOrder. Weak keys: an entry goes with its graph.
_graph_order = weakref.WeakKeyDictionary()
_graph_order_lock = threading.Lock()


def _run_with_links(run_fn):
    """Wraps ``Session.run``: feeds the links the run does not need (``_GraphOrder``)."""
    @functools.wraps(run_fn)
    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        order = _graph_order.get(self.graph)
        if order is not None and order.linked:
            links = order.links_to_feed(self.graph, fetches, feed_dict)
            if links:
                feed_dict = dict(feed_dict or {})
                feed_dict.update({link: 0 for link in links})
        return run_fn(self, fetches, feed_dict, options, run_metadata)

    run.hvdlite_links = True
    return run


def _install_session_hook():
    """Puts ``_run_with_links`` around every TF1 session's ``run`` (once)."""
    base = next(cls for cls in tf.compat.v1.Session.__mro__ if cls.__name__ == "BaseSession")
    if not getattr(base.run, "hvdlite_links", False):
        base.run = _run_with_links(base.run)


_install_session_hook()


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
