"""Framework-free collectives: (pointer, dtype, shape) -> Handle, and the numpy API.

``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter`` (and their
``_async`` forms, and grouped forms), ``barrier`` and ``join`` work on numpy arrays. They
are built on the layers below, whose public names are re-exported here as well:
``hvdlite._enqueue`` (raw pointers, a native dtype code and a shape -> Handle: what the
framework adapters build on), ``hvdlite._checks`` (the validation every collective
shares), ``hvdlite._names`` (automatic names) and ``hvdlite._refusals`` (a refused call
fails on every rank).

Inputs must be C-contiguous: a non-contiguous array is refused (InvalidArgumentError)
rather than copied behind the caller's back; ``np.ascontiguousarray(x)`` makes one.
Non-array inputs (Python scalars, lists) are converted with ``np.asarray``. Every numpy
function returns new arrays; the input is never modified.

Unnamed tensors are named ``"<op>.noname.<n>"`` with one counter per op kind and
process set (``"<op>.ps<id>.noname.<n>"`` in set ``id`` other than the global one),
reset by ``init()`` (and a set's by adding or removing it; ``hvdlite._names``), so names
agree across the ranks of a set as long as they make the same unnamed calls in it in
the same order.
Names must be unique among the ops in flight on a rank, whatever their process set.

Every collective takes ``process_set=`` (default: the global set, every rank); see
``hvdlite.process_sets``.
"""
import threading
import weakref

import numpy as np

from hvdlite import _checks, _enqueue, _names, _refusals, adasum, core, dtypes, process_sets
# The layers' public names, where scripts and Horovod-style code reach them.
from hvdlite._checks import predivide_scaling, reducescatter_rows, resolve_op  # noqa: F401
from hvdlite._enqueue import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST,  # noqa: F401
                              JOIN, REDUCESCATTER, Adasum, Average, Max, Min, Product, Sum,
                              TensorSpec, enqueue, enqueue_fields, enqueue_group,
                              from_buffer, pointer_at)
from hvdlite._names import auto_name  # noqa: F401
from hvdlite._native import ffi, lib
from hvdlite._refusals import note_names, refuse, refusing  # noqa: F401
# Bound here, as before the split: allreduce_async calls them for every array of every
# step, and a module attribute would cost a lookup more per call.
from hvdlite._checks import output_array as _output_array
from hvdlite._checks import writable_contiguous as _writable_contiguous
from hvdlite._enqueue import submit as _submit
from hvdlite._enqueue import run as _run
from hvdlite._refusals import _attempt
from hvdlite.errors import InvalidArgumentError
from hvdlite.handle import Handle, OpHandle  # noqa: F401
from hvdlite.process_sets import global_process_set


# The per-step path. A training loop calls allreduce_async with the same array, name and
# arguments every step: what a name's last call checked and built (the dtype, the C
# struct, the buffers' addresses) still holds while the array (and the out array) are
# the same objects, with the same dtype and shape, and the arguments are the same
# objects. The addresses are kept as plain pointers, which reference nothing: the
# Handle keeps the arrays alive while the core uses them, and the entry here only weak
# references. That an array object keeps its memory rests on numpy: it refuses to
# reassign ``ndarray.data`` and to resize an array that has a weak reference (so an
# array, or out array, once used here cannot be resized in place). The one way left,
# ``ndarray.__setstate__`` on a live array (pickle only calls it on new ones), is not
# supported between two calls under one name. Bounded like the caches above.
_repeats = {}


class _Repeat:
    __slots__ = ("array", "out", "op", "prescale", "postscale", "process_set", "psid", "dtype",
                 "shape", "template", "input_ptr", "output_ptr")

    def __init__(self, array, out, op, prescale, postscale, process_set, template):
        self.array = weakref.ref(array)
        self.op, self.prescale, self.postscale = op, prescale, postscale
        self.process_set, self.psid = process_set, process_set.process_set_id
        self.dtype, self.shape = array.dtype, array.shape
        self.template = template
        self.input_ptr = ffi.cast("void *", from_buffer(array))
        self.keep_output(out)

    def keep_output(self, out):
        """Remembers ``out`` (checked) as the result buffer; returns its pointer."""
        self.out = weakref.ref(out)
        self.output_ptr = ffi.cast("void *", from_buffer(out))
        return self.output_ptr


# The other collectives' calls repeated under one name (a metric broadcast every step, a
# batch gathered every step): what the last call of that kind under the name checked
# and filled (the dtype's code, the C struct, alltoall's splits, a result's shape) holds
# for an array of the same dtype and shape with the same other arguments, in the same
# world (an elastic reset starts another). The array need not be the same: its address
# is taken each call. kind -> {name -> _Kept}, each bounded like the caches above.
_kept_calls = {ALLGATHER: {}, BROADCAST: {}, ALLTOALL: {}, REDUCESCATTER: {}}


class _Kept:
    __slots__ = ("dtype", "shape", "args", "types", "psid", "world", "template", "finisher",
                 "out_shape")

    def __init__(self, arr, args, psid, template, finisher=None, out_shape=None):
        self.dtype, self.shape, self.args, self.psid = arr.dtype, arr.shape, args, psid
        self.types = tuple(map(type, args))
        self.world = core._world
        self.template, self.finisher = template, finisher
        self.out_shape = arr.shape if out_shape is None else out_shape


def _repeat_kept(submit, kind, name, array, out, args):
    """Submits a call that repeats the kept call of kind ``kind`` under ``name`` with
    ``array``'s (and ``out``'s) buffers, and returns what ``submit`` (``_enqueue.submit``
    or ``run``) returns; None where it does not repeat one (``args``: the call's other
    arguments, the process set last, equal and of the same types: a bool, a float or a
    numpy scalar where the first call had an int is what the first call's path refuses
    or converts, and an array would not compare). A call with an
    ``out`` not fit for the kept result is not a repeat either: the first call's path
    refuses it, on every rank. Undecorated (see ``refusing``): nothing here raises a
    refusal, and a small blocking call's time is mostly Python frames like that one."""
    kept = _kept_calls[kind].get(name) if type(name) is str else None
    if (kept is None or type(array) is not np.ndarray or array.dtype is not kept.dtype
            or array.shape != kept.shape or not array.flags.c_contiguous
            or tuple(map(type, args)) != kept.types or args != kept.args
            or kept.world is not core._world
            or args[-1].process_set_id != kept.psid):
        return None
    if kept.finisher is not None:  # the core allocates the result
        return submit(kept.template, from_buffer(array), ffi.NULL, (array,), kept.finisher, name,
                      None)
    if out is None:
        out = np.empty(kept.out_shape, kept.dtype)
    elif (type(out) is not np.ndarray or out.dtype is not kept.dtype
          or out.shape != kept.out_shape or not _writable_contiguous(out.flags)):
        return None
    return submit(kept.template, from_buffer(array), from_buffer(out), (array, out), None, name,
                  out)


def _keep_call(kind, name, named, arr, array, args, psid, template, finisher=None,
               out_shape=None):
    """Keeps a call that was enqueued (see ``_repeat_kept``), when its name was given, its
    array taken as it was and its process set given (not None)."""
    if named and arr is array and args[-1] is not None:
        _enqueue.remember(_kept_calls[kind], name,
                          _Kept(arr, args, psid, template, finisher, out_shape))


def allreduce_async(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                    out=None, process_set=global_process_set):
    """Starts an allreduce of ``array`` across ranks; returns a Handle at once.

    Args:
        array: a C-contiguous numpy array (or array-like) of a supported dtype.
        name: the tensor's name, equal across ranks; None names it automatically.
        op: Average, Sum, Min, Max, Product (bool arrays: Min or Max only), or Adasum
            (floating-point arrays; see ``hvdlite.adasum``).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        out: an array of the same shape and dtype to write the result into (it may be
            ``array`` itself, for an in-place reduction); None allocates a new one.
        process_set: the ProcessSet whose members reduce (this rank must be one);
            Average divides by its size.

    Returns:
        A Handle whose result is ``out`` or a new array of the same shape and dtype.

    Raises:
        InvalidArgumentError: bad dtype, layout, op or scaling.
        DuplicateNameError: a tensor of that name is in flight.
        NotInitializedError: before init() or after shutdown().
    """
    return _allreduce(_submit, array, name, op, prescale_factor, postscale_factor, out,
                      process_set)


def _allreduce(submit, array, name, op, prescale_factor, postscale_factor, out, process_set):
    """``allreduce_async``, with ``submit`` as its last step (as ``_allgather``'s); not
    Adasum's blocking form (``allreduce``)."""
    last = _repeats.get(name) if type(name) is str else None
    if (last is not None and last.array() is array and last.op is op
            and last.prescale is prescale_factor and last.postscale is postscale_factor
            and last.process_set is process_set and process_set.process_set_id == last.psid
            and array.dtype is last.dtype and array.shape == last.shape
            and array.flags.c_contiguous):
        if (out is not None and last.out() is out and out.dtype is last.dtype
                and out.shape == last.shape and _writable_contiguous(out.flags)):
            output_ptr = last.output_ptr
        elif out is None:  # a new array each call: nothing to keep
            out = _output_array(None, last.shape, last.dtype, name)
            output_ptr = from_buffer(out)
        else:
            out = _output_array(out, last.shape, last.dtype, name)
            output_ptr = last.keep_output(out)
        return submit(last.template, last.input_ptr, output_ptr, (array, out), None, name, out)
    named = name is not None
    _attempt.names = ()  # a new call: forget the last one's names (see _refusals)
    try:
        psid = process_sets.process_set_id(process_set)
        name = _refusals.resolve_name("allreduce", name, psid)
        if op == Adasum:
            _checks.check_adasum_set(psid, name)
            return adasum.allreduce_async(array, name, prescale_factor, postscale_factor, out)
        arr, code = _checks.input_array(array, name)
        _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
        out = _output_array(out, arr.shape, arr.dtype, name)
        template = _enqueue.template(ALLREDUCE, name, code, arr.shape, op, prescale_factor,
                                     postscale_factor, 0, psid, -1)
        submitted = submit(template, from_buffer(arr), from_buffer(out), (arr, out), None, name,
                         out)
    except InvalidArgumentError as error:
        _refusals.refused(ALLREDUCE, error)
        raise
    if named and arr is array and process_set is not None:
        _enqueue.remember(_repeats, name, _Repeat(arr, out, op, prescale_factor, postscale_factor,
                                                  process_set, template))
    return submitted


def allreduce(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
              out=None, process_set=global_process_set):
    """Reduces ``array`` across ranks and returns the result as a new array (or ``out``).

    See ``allreduce_async`` for the arguments.

    Returns:
        A new array of the same shape and dtype.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: as for
            ``allreduce_async``.
        HorovodInternalError: the collective failed (e.g. MismatchError across ranks).
    """
    if op == Adasum:  # its own ops (hvdlite.adasum), the first waited for at once
        return synchronize(_enqueue.at_once(allreduce_async, array, name, op, prescale_factor,
                                            postscale_factor, out, process_set))
    return _allreduce(_run, array, name, op, prescale_factor, postscale_factor, out,
                      process_set)


@refusing(ALLREDUCE)
def grouped_allreduce_async(arrays, name=None, op=Average, prescale_factor=1.0,
                            postscale_factor=1.0, outs=None, process_set=global_process_set):
    """Starts allreduces of several arrays that are negotiated and run together.

    Args:
        arrays: a sequence of arrays (each as for ``allreduce_async``).
        name: the group's name; tensor i is named ``"<name>.<i>"``. None names the group
            automatically.
        op, prescale_factor, postscale_factor: as for ``allreduce_async``, for all.
        outs: one result buffer per array (each as ``allreduce_async``'s ``out``), or
            None for new arrays.
        process_set: as for ``allreduce_async``.

    Returns:
        A Handle whose result is the list of results, in order.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: as for
            ``allreduce_async``; nothing is enqueued if any array is refused.
    """
    psid = process_sets.process_set_id(process_set)
    group, arrays, _ = _group_members("grouped_allreduce", arrays, name, outs, psid)
    if op == Adasum:
        _checks.check_adasum_set(psid, group)
        return adasum.grouped_allreduce_async(arrays, group, prescale_factor,
                                              postscale_factor, outs)
    return _enqueue_grouped_reduction(ALLREDUCE, group, arrays, outs, op, prescale_factor,
                                      postscale_factor, psid, lambda shape: shape, min_ndim=0)


def _enqueue_grouped_reduction(kind, group, arrays, outs, op, prescale_factor,
                               postscale_factor, psid, result_shape, min_ndim):
    """Enqueues a group of reductions of ``kind``; array i is ``"<group>.<i>"``.

    ``result_shape`` maps an input's shape to its result's (allreduce: the same;
    reducescatter: this rank's rows).
    """
    specs, keep, results = [], [], []
    for i, array in enumerate(arrays):
        tensor_name = f"{group}.{i}"
        arr, code = _checks.input_array(array, tensor_name, min_ndim=min_ndim)
        _checks.check_reduction(op, prescale_factor, postscale_factor, code, tensor_name)
        out = _checks.output_array(None if outs is None else outs[i], result_shape(arr.shape),
                                   arr.dtype, tensor_name)
        specs.append(TensorSpec(kind, tensor_name, code, arr.shape, from_buffer(arr),
                                from_buffer(out), op, prescale_factor, postscale_factor,
                                process_set_id=psid))
        keep += [arr, out]
        results.append(out)
    return enqueue_group(specs, name=group, keepalive=keep, result=results)


def grouped_allreduce(arrays, name=None, op=Average, prescale_factor=1.0,
                      postscale_factor=1.0, outs=None, process_set=global_process_set):
    """Reduces several arrays together; returns the list of results.

    See ``grouped_allreduce_async`` for the arguments and errors.
    """
    return synchronize(grouped_allreduce_async(arrays, name, op, prescale_factor,
                                               postscale_factor, outs, process_set))


def allgather_async(array, name=None, process_set=global_process_set):
    """Starts concatenating every rank's ``array`` along the first dimension.

    Ranks may differ in the first dimension; the other dimensions must agree.

    Args:
        array: a C-contiguous array with at least one dimension.
        name: the tensor's name, equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members' arrays are concatenated, in the
            order of their ranks.

    Returns:
        A Handle whose result has shape ``(sum of first dims, *array.shape[1:])``.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
    """
    return _allgather(_submit, array, name, process_set)


def _allgather(submit, array, name, process_set):
    """``allgather_async``, with ``submit`` as its last step: ``_enqueue.submit`` (the
    call returns a Handle), or ``_enqueue.run`` for a blocking call (its result)."""
    args = (process_set,)
    repeated = _repeat_kept(submit, ALLGATHER, name, array, None, args)
    return _first_allgather(submit, array, name, args) if repeated is None else repeated


@refusing(ALLGATHER)
def _first_allgather(submit, array, name, args):
    """``_allgather`` of a call that repeats no kept one: checked, submitted, kept."""
    process_set, = args
    named = name is not None
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("allgather", name, psid)
    arr, code = _checks.input_array(array, name, min_ndim=1)
    size, _ = process_sets.members(process_set)
    finisher = _enqueue.CoreResult(arr.dtype, arr.shape[1:], arr.shape[0] * size)
    template = _enqueue.template(ALLGATHER, name, code, arr.shape, Average, 1.0, 1.0, 0, psid,
                                 -1)
    submitted = submit(template, from_buffer(arr), ffi.NULL, (arr,), finisher, name, None)
    _keep_call(ALLGATHER, name, named, arr, array, args, psid, template, finisher)
    return submitted


def allgather(array, name=None, process_set=global_process_set):
    """Concatenates every rank's ``array`` along the first dimension.

    See ``allgather_async``; raises HorovodInternalError subclasses if it fails.
    """
    return _allgather(_run, array, name, process_set)


def broadcast_async(array, root_rank, name=None, out=None, process_set=global_process_set):
    """Starts sending ``array`` from ``root_rank`` to every rank.

    Args:
        array: a C-contiguous array; same shape and dtype on every rank.
        root_rank: the rank whose values everyone receives (a global rank, a member
            of ``process_set``).
        name: the tensor's name, equal across ranks; None names it automatically.
        out: an array of the same shape and dtype for the result, or None for a new one.
        process_set: the ProcessSet whose members receive.

    Returns:
        A Handle whose result (``out`` or a new array) holds the root's values.

    Raises:
        InvalidArgumentError: bad dtype, layout or root_rank out of range.
        DuplicateNameError, NotInitializedError: refused.
    """
    return _broadcast(_submit, array, root_rank, name, out, process_set)


def _broadcast(submit, array, root_rank, name, out, process_set):
    """``broadcast_async``, with ``submit`` as its last step (as ``_allgather``'s)."""
    args = (root_rank, process_set)
    repeated = _repeat_kept(submit, BROADCAST, name, array, out, args)
    return _first_broadcast(submit, array, name, out, args) if repeated is None else repeated


@refusing(BROADCAST)
def _first_broadcast(submit, array, name, out, args):
    """``_broadcast`` of a call that repeats no kept one (as ``_first_allgather``)."""
    root_rank, process_set = args
    named = name is not None
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("broadcast", name, psid)
    arr, code = _checks.input_array(array, name)
    root = _checks.check_rank(root_rank, "root_rank", name)
    out = _checks.output_array(out, arr.shape, arr.dtype, name)
    template = _enqueue.template(BROADCAST, name, code, arr.shape, Average, 1.0, 1.0, root,
                                 psid, -1)
    submitted = submit(template, from_buffer(arr), from_buffer(out), (arr, out), None, name, out)
    _keep_call(BROADCAST, name, named, arr, array, args, psid, template)
    return submitted


def broadcast(array, root_rank, name=None, out=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``array`` on every rank (in ``out`` or a new array).

    See ``broadcast_async``; raises HorovodInternalError subclasses if it fails.
    """
    return _broadcast(_run, array, root_rank, name, out, process_set)


def alltoall_async(array, splits=None, name=None, process_set=global_process_set):
    """Starts an all-to-all: rows ``splits[r]`` of ``array`` go to rank r.

    Args:
        array: a C-contiguous array with at least one dimension.
        splits: rows for each rank, in rank order (size() entries summing to the first
            dimension; in a process set, one per member); None splits the first
            dimension evenly.
        name: the tensor's name, equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members exchange.

    Returns:
        A Handle whose result is ``(received, received_splits)``: the rows from every
        rank in rank order, and how many came from each (np.int64 array).

    Raises:
        InvalidArgumentError: bad dtype, layout or splits.
        DuplicateNameError, NotInitializedError: refused.
    """
    return _alltoall(_submit, array, splits, name, process_set)


def _alltoall(submit, array, splits, name, process_set):
    """``alltoall_async``, with ``submit`` as its last step (as ``_allgather``'s)."""
    args = (splits, process_set)
    repeated = _repeat_kept(submit, ALLTOALL, name, array, None, args)
    return _first_alltoall(submit, array, name, args) if repeated is None else repeated


@refusing(ALLTOALL)
def _first_alltoall(submit, array, name, args):
    """``_alltoall`` of a call that repeats no kept one (as ``_first_allgather``)."""
    splits, process_set = args
    named = name is not None
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("alltoall", name, psid)
    arr, code = _checks.input_array(array, name, min_ndim=1)
    size, _ = process_sets.members(process_set)
    checked = _checks.check_splits(splits, arr.shape[0], name, size)
    finisher = _enqueue.CoreResult(arr.dtype, arr.shape[1:], arr.shape[0], size)
    template = _enqueue.template(ALLTOALL, name, code, arr.shape, Average, 1.0, 1.0, 0, psid, -1,
                                 checked)
    submitted = submit(template, from_buffer(arr), ffi.NULL, (arr,), finisher, name, None)
    # Kept only for splits that cannot change behind its back (a list could, in place).
    if splits is None or type(splits) is tuple:
        _keep_call(ALLTOALL, name, named, arr, array, args, psid, template, finisher)
    return submitted


def alltoall(array, splits=None, name=None, process_set=global_process_set):
    """All-to-all exchange; returns ``(received, received_splits)``.

    See ``alltoall_async``; raises HorovodInternalError subclasses if it fails.
    """
    return _alltoall(_run, array, splits, name, process_set)


def reducescatter_async(array, name=None, op=Average, prescale_factor=1.0,
                        postscale_factor=1.0, out=None, process_set=global_process_set):
    """Starts a reduction whose result is scattered by rows among the ranks.

    Args:
        array: a C-contiguous array with at least one dimension, same shape everywhere.
        name: the tensor's name, equal across ranks; None names it automatically.
        op, prescale_factor, postscale_factor: as for ``allreduce_async``.
        out: an array for this rank's rows (shape as described below, same dtype), or
            None for a new one.
        process_set: the ProcessSet whose members reduce and share the rows.

    Returns:
        A Handle whose result holds this rank's rows of the reduction: the first
        dimension d0 is split so that the first ``d0 % size()`` ranks get one row more.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
    """
    return _reducescatter(_submit, array, name, op, prescale_factor, postscale_factor, out,
                          process_set)


def _reducescatter(submit, array, name, op, prescale_factor, postscale_factor, out,
                   process_set):
    """``reducescatter_async``, with ``submit`` as its last step (as ``_allgather``'s)."""
    args = (op, prescale_factor, postscale_factor, process_set)
    repeated = _repeat_kept(submit, REDUCESCATTER, name, array, out, args)
    return (_first_reducescatter(submit, array, name, out, args) if repeated is None
            else repeated)


@refusing(REDUCESCATTER)
def _first_reducescatter(submit, array, name, out, args):
    """``_reducescatter`` of a call that repeats no kept one (as ``_first_allgather``)."""
    op, prescale_factor, postscale_factor, process_set = args
    named = name is not None
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("reducescatter", name, psid)
    arr, code = _checks.input_array(array, name, min_ndim=1)
    _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
    rows = reducescatter_rows(arr.shape[0], *process_sets.members(process_set))
    out_shape = (rows,) + arr.shape[1:]
    out = _checks.output_array(out, out_shape, arr.dtype, name)
    template = _enqueue.template(REDUCESCATTER, name, code, arr.shape, op, prescale_factor,
                                 postscale_factor, 0, psid, -1)
    submitted = submit(template, from_buffer(arr), from_buffer(out), (arr, out), None, name, out)
    # A zero factor's sign shows in the results, yet 0.0 == -0.0 (see _enqueue.template).
    if prescale_factor and postscale_factor:
        _keep_call(REDUCESCATTER, name, named, arr, array, args, psid, template,
                   out_shape=out_shape)
    return submitted


def reducescatter(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                  out=None, process_set=global_process_set):
    """Reduces ``array`` across ranks and returns this rank's rows (in ``out`` or a new
    array).

    See ``reducescatter_async``; raises HorovodInternalError subclasses if it fails.
    """
    return _reducescatter(_run, array, name, op, prescale_factor, postscale_factor, out,
                          process_set)


def _group_members(kind, arrays, name, outs=None, process_set_id=0):
    """Resolves a group's name; returns (group, arrays as a list, member names), after
    checking there is one out per array when outs are given."""
    group = _refusals.resolve_name(kind, name, process_set_id)
    arrays = list(arrays)
    names = [f"{group}.{i}" for i in range(len(arrays))]
    _refusals.note_names(names, process_set_id)
    if outs is not None and len(outs) != len(arrays):
        raise InvalidArgumentError(
            f"group '{group}': {len(outs)} outs for {len(arrays)} arrays")
    return group, arrays, names


@refusing(ALLGATHER)
def grouped_allgather_async(arrays, name=None, process_set=global_process_set):
    """Starts allgathers of several arrays that are negotiated and run together.

    Args:
        arrays: a sequence of arrays (each as for ``allgather_async``).
        name: the group's name; array i is named ``"<name>.<i>"``. None names the group
            automatically.
        process_set: as for ``allgather_async``.

    Returns:
        A Handle whose result is the list of gathered arrays, in order.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: as for
            ``allgather_async``; nothing is enqueued if any array is refused.
    """
    psid = process_sets.process_set_id(process_set)
    group, arrays, names = _group_members("grouped_allgather", arrays, name, None, psid)
    specs, keep, layouts = [], [], []
    for array, tensor_name in zip(arrays, names):
        arr, code = _checks.input_array(array, tensor_name, min_ndim=1)
        specs.append(TensorSpec(ALLGATHER, tensor_name, code, arr.shape, from_buffer(arr),
                                process_set_id=psid))
        keep.append(arr)
        layouts.append((arr.dtype, arr.shape[1:]))

    def finish(handle):
        return [handle.output_array(i, dt, trailing) for i, (dt, trailing) in enumerate(layouts)]

    return enqueue_group(specs, name=group, keepalive=keep, finisher=finish)


def grouped_allgather(arrays, name=None, process_set=global_process_set):
    """Gathers several arrays together; returns the list of results.

    See ``grouped_allgather_async`` for the arguments and errors.
    """
    return synchronize(grouped_allgather_async(arrays, name, process_set))


@refusing(REDUCESCATTER)
def grouped_reducescatter_async(arrays, name=None, op=Average, prescale_factor=1.0,
                                postscale_factor=1.0, outs=None,
                                process_set=global_process_set):
    """Starts reducescatters of several arrays that are negotiated and run together.

    Args:
        arrays: a sequence of arrays (each as for ``reducescatter_async``).
        name: the group's name; array i is named ``"<name>.<i>"``. None names the group
            automatically.
        op, prescale_factor, postscale_factor: as for ``reducescatter_async``, for all.
        outs: one result buffer per array (each as ``reducescatter_async``'s ``out``), or
            None for new arrays.
        process_set: as for ``reducescatter_async``.

    Returns:
        A Handle whose result is the list of this rank's rows of each reduction.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: as for
            ``reducescatter_async``; nothing is enqueued if any array is refused.
    """
    psid = process_sets.process_set_id(process_set)
    group, arrays, _ = _group_members("grouped_reducescatter", arrays, name, outs, psid)
    size, rank = process_sets.members(process_set)

    def my_rows(shape):
        return (reducescatter_rows(shape[0], size, rank),) + tuple(shape[1:])

    return _enqueue_grouped_reduction(REDUCESCATTER, group, arrays, outs, op, prescale_factor,
                                      postscale_factor, psid, my_rows, min_ndim=1)


def grouped_reducescatter(arrays, name=None, op=Average, prescale_factor=1.0,
                          postscale_factor=1.0, outs=None, process_set=global_process_set):
    """Reduces several arrays together, each scattered by rows; returns this rank's parts.

    See ``grouped_reducescatter_async`` for the arguments and errors.
    """
    return synchronize(grouped_reducescatter_async(arrays, name, op, prescale_factor,
                                                   postscale_factor, outs, process_set))


class _Barrier:
    """A process set's barrier: one name (so that every barrier after the first is a
    response-cache hit, not a negotiation through the set's rank 0), its kept struct,
    and a lock that makes a rank's barriers of the set one at a time (two threads'
    barriers at once would be one name twice in flight; one after the other, they pair
    with the other ranks' in the order they run, as automatic names did)."""

    __slots__ = ("name", "template", "byte", "pointer", "lock")

    def __init__(self, psid):
        self.name = _names.fixed_name("barrier", psid)
        self.template = _enqueue.template(BARRIER, self.name, dtypes.native_code("uint8"), (),
                                          Average, 1.0, 1.0, 0, psid, -1)
        self.byte = np.zeros((), dtype=np.uint8)  # no data; a valid pointer for the core
        self.pointer = from_buffer(self.byte)
        self.lock = threading.Lock()


_barriers = {}  # process set id -> _Barrier


def barrier(process_set=global_process_set):
    """Blocks until every rank (of ``process_set``) has called ``barrier()``.

    Raises:
        NotInitializedError: before init() or after shutdown().
        HorovodInternalError: the barrier failed (e.g. a rank is gone).
    """
    psid = process_sets.process_set_id(process_set)
    kept = _barriers.get(psid)
    if kept is None:
        kept = _barriers.setdefault(psid, _Barrier(psid))
    with kept.lock:  # (one cut short by Ctrl-C is waited for first: _enqueue.run)
        _run(kept.template, kept.pointer, ffi.NULL, (kept.byte,), None, kept.name, None)


def join():
    """Declares that this rank has no more data; returns when every rank has joined.

    Until then this rank takes part in the other ranks' allreduces with zeros (Average
    still divides by every rank, as in Horovod), so ranks may run different numbers of
    steps. Any other collective submitted while a rank has joined fails with
    AbortedError on the ranks that submitted it, as Horovod's do.

    If the wait is cut short (Ctrl-C, a test's timeout: any exception out of it), the
    rank leaves the join before the exception goes on: the join fails and the rank takes
    part in every collective as before (Horovod would leave it joined, so that every
    later op but allreduce fails).

    Returns:
        The rank that joined last: the same value on every rank.

    Raises:
        NotInitializedError: before init() or after shutdown().
        HorovodInternalError: the join failed.
    """
    byte = np.zeros((), dtype=np.uint8)  # no data; a valid pointer for the core
    handle = enqueue(JOIN, _names.auto_name("join"), dtypes.native_code("uint8"), (),
                     from_buffer(byte), keepalive=(byte,), finisher=lambda h: h.output(0)[2])
    try:
        return synchronize(handle)
    except BaseException:
        # A join that already ended (or failed) is not left: the core ignores this.
        lib.hvdlite_leave_join()
        raise


def poll(handle):
    """Returns True once the op behind ``handle`` has ended; never blocks."""
    return handle.poll()


def synchronize(handle, timeout=None):
    """Waits for the op behind ``handle`` and returns its result.

    Args:
        handle: a Handle from an ``*_async`` call.
        timeout: seconds to wait at most; None waits until the op ends.

    Returns:
        The op's result (see the ``*_async`` function that made the handle).

    Raises:
        WaitTimeoutError: ``timeout`` passed; the op goes on.
        HorovodInternalError: the collective failed (MismatchError, ShutdownError,
            StalledError, TransportError, RankFailedError) on this rank.
    """
    return handle.wait(timeout)
