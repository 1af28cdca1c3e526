"""The asynchronous torch collectives: tensors in, an ``hvdlite.Handle`` out.

``enqueue_*`` take every argument in order (no Horovod argument handling): the
autograd functions (``hvdlite.torch.autograd``), the optimizer's reducer and
SyncBatchNorm call them. The public ``*_async`` functions are Horovod's; see
``hvdlite.torch.mpi_ops`` for how results are allocated and named.
"""
import torch

from hvdlite import _checks, _enqueue, _refusals, adasum, ops, process_sets, runtime
from hvdlite._enqueue import Adasum, Average, Sum
from hvdlite.errors import InvalidArgumentError
from hvdlite.torch.tensors import (core_result, from_core, gpu_fields, host_array,
                                   tensor_code)

global_process_set = process_sets.global_process_set


def enqueue_allreduce(tensor, output, name, op, prescale_factor, postscale_factor,
                      process_set):
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("allreduce", name, psid)
    code = tensor_code(tensor, name)
    if op != Adasum:
        _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
    if output is None:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    if op == Adasum:
        _checks.check_adasum_set(psid, name)
        return adasum.allreduce_async(host_array(tensor, name), name, prescale_factor,
                                      postscale_factor, host_array(output, name), output)
    if tensor.is_cuda:
        device, event = gpu_fields(tensor)
        return _enqueue.enqueue(_enqueue.ALLREDUCE, name, code, tuple(tensor.shape),
                                tensor.data_ptr(), output.data_ptr(), reduce_op=op,
                                prescale=prescale_factor, postscale=postscale_factor,
                                process_set_id=psid, device=device,
                                ready_event=event.cuda_event,
                                keepalive=(tensor, output, event), result=output)
    # The per-gradient path: every argument in order, no keywords.
    return _enqueue.enqueue_fields(_enqueue.ALLREDUCE, name, code, tensor.shape,
                                   _enqueue.pointer_at(tensor.data_ptr()),
                                   _enqueue.pointer_at(output.data_ptr()), op, prescale_factor,
                                   postscale_factor, 0, psid, -1, (tensor, output), None, output)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts reducing ``tensor`` across ranks into a new tensor; returns a Handle.

    Args:
        tensor: a contiguous CPU tensor of a supported dtype.
        average: deprecated; True means op=Average, False op=Sum.
        name: the tensor's name, equal across ranks; None names it automatically.
        op: Average (default), Sum, Min, Max or Product (bool: Min or Max only).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ProcessSet that runs the op (this rank must be a member).

    Returns:
        A Handle; ``synchronize(handle)`` returns the result (same shape and dtype).

    Raises:
        InvalidArgumentError: bad dtype, device, layout, op or scaling.
        DuplicateNameError: a tensor of that name is in flight.
        NotInitializedError: before init() or after shutdown().
    """
    op = _checks.resolve_op(op, average)
    return enqueue_allreduce(tensor, None, name, op, prescale_factor, postscale_factor,
                             process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts reducing ``tensor`` in place; ``synchronize(handle)`` returns ``tensor``.

    See ``allreduce_async`` for the arguments and errors.
    """
    op = _checks.resolve_op(op, average)
    return enqueue_allreduce(tensor, tensor, name, op, prescale_factor, postscale_factor,
                             process_set)


def enqueue_grouped_allreduce(tensors, outputs, names, op, prescale_factor,
                              postscale_factor, process_set, label):
    """Enqueues allreduces that negotiate and run together; all or nothing."""
    psid = process_sets.process_set_id(process_set)
    if op == Adasum:
        _checks.check_adasum_set(psid, label)
        for tensor, name in zip(tensors, names):
            tensor_code(tensor, name)
        outputs = [torch.empty_like(t, memory_format=torch.contiguous_format)
                   if o is None else o for t, o in zip(tensors, outputs)]
        return adasum.grouped_allreduce_async(
            [host_array(t, n) for t, n in zip(tensors, names)], label, prescale_factor,
            postscale_factor, [host_array(o, n) for o, n in zip(outputs, names)], outputs)
    if not tensors:
        return _enqueue.enqueue_group([], name=label, result=[])
    # Checked one by one; the structs the core reads are kept from call to call under
    # what describes the group (as a training step's repeat), so that a call only hands
    # over its buffers.
    codes, checked = [], set()
    for tensor, name in zip(tensors, names):
        code = tensor_code(tensor, name)
        if code not in checked:
            _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
            checked.add(code)
        codes.append(code)
    if any(o is None for o in outputs):
        outputs = [torch.empty_like(t, memory_format=torch.contiguous_format)
                   if o is None else o for t, o in zip(tensors, outputs)]
    device, event = group_gpu_fields(tensors, label)
    shapes = tuple(t.shape for t in tensors)
    key = (label, op, prescale_factor, postscale_factor, psid, device, tuple(codes), shapes)

    def specs():
        return [_enqueue.TensorSpec(_enqueue.ALLREDUCE, name, code, tuple(shape), None, None, op,
                                    prescale_factor, postscale_factor, process_set_id=psid,
                                    device=device)
                for name, code, shape in zip(names, codes, shapes)]

    return _enqueue.enqueue_kept_group(
        key, specs, [t.data_ptr() for t in tensors], [o.data_ptr() for o in outputs],
        ready(event), name=label, keepalive=(tensors, outputs, event), result=list(outputs))


def group_gpu_fields(tensors, label):
    """A group's GPU ordinal (-1 on the CPU) and one event recorded now, after every
    output was allocated (None on the CPU).

    Raises:
        InvalidArgumentError: the group's tensors are not all on one device.
    """
    first = tensors[0].device
    if any(t.device != first for t in tensors):
        devices = {t.device for t in tensors}
        raise InvalidArgumentError(
            f"group '{label}' mixes devices ({', '.join(sorted(map(str, devices)))}): "
            "the tensors of one group must be on one device")
    return gpu_fields(tensors[0])


def mark_gpu(specs, tensors, label):
    """Gives a group's specs their GPU and one event recorded now, after every output
    was allocated; returns the event, to keep alive (None for CPU tensors).

    Raises:
        InvalidArgumentError: the group's tensors are not all on one device.
    """
    if not specs:
        return None
    device, event = group_gpu_fields(tensors, label)
    if event is not None:
        for spec in specs:
            spec.device, spec.ready_event = device, event.cuda_event
    return event


def group_names(tensors, name, process_set, kind="grouped_allreduce"):
    tensors = list(tensors)
    psid = process_sets.process_set_id(process_set)
    group = _refusals.resolve_name(kind, name, psid)
    names = [f"{group}.{i}" for i in range(len(tensors))]
    _refusals.note_names(names, psid)
    return tensors, names, group


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts allreduces of several tensors that are negotiated and run together.

    Args:
        tensors: a sequence of tensors (each as for ``allreduce_async``).
        name: the group's name; tensor i is named ``"<name>.<i>"``.
        average, op, prescale_factor, postscale_factor, process_set: as for
            ``allreduce_async``, for all of them.

    Returns:
        A Handle; ``synchronize(handle)`` returns a list of new tensors, in order.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused; nothing
            is enqueued if any tensor is refused.
    """
    op = _checks.resolve_op(op, average)
    tensors, names, group = group_names(tensors, name, process_set)
    return enqueue_grouped_allreduce(tensors, [None] * len(tensors), names, op,
                                     prescale_factor, postscale_factor, process_set, group)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place ``grouped_allreduce_async``: the result list holds the given tensors."""
    op = _checks.resolve_op(op, average)
    tensors, names, group = group_names(tensors, name, process_set)
    return enqueue_grouped_allreduce(tensors, tensors, names, op, prescale_factor,
                                     postscale_factor, process_set, group)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts concatenating every rank's ``tensor`` along the first dimension.

    Ranks may differ in the first dimension; the other dimensions must agree.

    Args:
        tensor: a contiguous CPU tensor with at least one dimension.
        name: the tensor's name, equal across ranks; None names it automatically.
        process_set: the ProcessSet that runs the op (this rank must be a member).

    Returns:
        A Handle; ``synchronize(handle)`` returns the gathered tensor (a zero-copy view
        of the core's buffer).

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
    """
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("allgather", name, psid)
    code = tensor_code(tensor, name, min_ndim=1)
    finisher = core_result(tensor, tensor.shape[0] * process_sets.members(process_set)[0])
    device, event = gpu_fields(tensor)
    return _enqueue.enqueue(_enqueue.ALLGATHER, name, code, tuple(tensor.shape), tensor.data_ptr(),
                            None, process_set_id=psid, device=device, ready_event=ready(event),
                            keepalive=(tensor, event), finisher=finisher)


class SparseHandle:
    """The handle of ``sparse_allreduce_async``: call it (or pass it to ``synchronize``)
    for the reduced sparse tensor; ``poll()`` says whether both gathers have ended."""

    def __init__(self, indices_handle, values_handle, shape, divisor):
        self._indices_handle = indices_handle
        self._values_handle = values_handle
        self._shape = shape
        self._divisor = divisor
        self._result = None

    def poll(self):
        return self._result is not None or (ops.poll(self._values_handle)
                                            and ops.poll(self._indices_handle))

    def wait(self, timeout=None):
        if self._result is None:
            values = ops.synchronize(self._values_handle, timeout)
            indices = ops.synchronize(self._indices_handle, timeout)
            if self._divisor != 1:
                values = values / self._divisor
            # coalesce() sums the entries that several ranks (or one) gave the same index.
            self._result = torch.sparse_coo_tensor(indices.t(), values, self._shape,
                                                   check_invariants=False).coalesce()
        return self._result

    __call__ = wait


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Starts reducing a sparse COO tensor: every rank's indices and values are gathered.

    The result holds every rank's entries, those with the same index summed; for Average
    the values are divided by the set's size. Ranks may have different numbers of entries.

    Args:
        tensor: a sparse COO CPU tensor, same shape on every rank.
        name: a base name, equal across ranks (``<name>.indices`` and ``<name>.values``
            are gathered); None names it automatically.
        op: Sum or Average.
        process_set: the ProcessSet whose members take part (Average divides by its size).

    Returns:
        A SparseHandle: ``handle()`` or ``synchronize(handle)`` returns the reduced sparse
        tensor (coalesced).

    Raises:
        InvalidArgumentError: not a sparse COO tensor, an op other than Sum or Average,
            or values of an unsupported dtype.
        DuplicateNameError, NotInitializedError: refused.
    """
    name = _refusals.resolve_name("sparse_allreduce", name)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise InvalidArgumentError(
            f"tensor '{name}' must be a sparse COO tensor, not "
            f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    if op not in (Sum, Average):
        raise InvalidArgumentError(
            f"tensor '{name}': sparse allreduce supports op Sum or Average only, got {op!r}")
    # allgather concatenates rows: one row of indices per entry.
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    values_handle = allgather_async(values, f"{name}.values", process_set)
    indices_handle = allgather_async(indices, f"{name}.indices", process_set)
    # Average divides by the members of the set that gathered, as Horovod does.
    return SparseHandle(indices_handle, values_handle, tensor.shape,
                        process_sets.set_size(process_set) if op == Average else 1)


def ready(event):
    """The address of a GPU tensor's event for the core, None without one."""
    return None if event is None else event.cuda_event


def enqueue_broadcast(tensor, output, root_rank, name, process_set):
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("broadcast", name, psid)
    code = tensor_code(tensor, name)
    root = _checks.check_rank(root_rank, "root_rank", name)
    if output is None:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    device, event = gpu_fields(tensor)
    return _enqueue.enqueue(_enqueue.BROADCAST, name, code, tuple(tensor.shape), tensor.data_ptr(),
                            output.data_ptr(), root_rank=root, process_set_id=psid,
                            device=device, ready_event=ready(event),
                            keepalive=(tensor, output, event), result=output)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts sending ``root_rank``'s ``tensor`` to every rank, into a new tensor.

    Args:
        tensor: a contiguous CPU tensor; same shape and dtype on every rank.
        root_rank: the rank whose values everyone receives.
        name: the tensor's name, equal across ranks; None names it automatically.
        process_set: the ProcessSet that runs the op (this rank must be a member).

    Returns:
        A Handle; ``synchronize(handle)`` returns the new tensor.

    Raises:
        InvalidArgumentError: bad dtype, device, layout, or root_rank out of range.
        DuplicateNameError, NotInitializedError: refused.
    """
    return enqueue_broadcast(tensor, None, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts broadcasting into ``tensor`` itself; ``synchronize`` returns ``tensor``."""
    return enqueue_broadcast(tensor, tensor, root_rank, name, process_set)


def splits_list(splits):
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return splits.tolist()
    return list(splits)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts an all-to-all: rows ``splits[r]`` of ``tensor`` go to rank r.

    Args:
        tensor: a contiguous CPU tensor with at least one dimension.
        splits: rows for each rank (a list or int tensor of size() entries summing to the
            first dimension); None splits the first dimension evenly.
        name: the tensor's name, equal across ranks; None names it automatically.
        process_set: the ProcessSet that runs the op (this rank must be a member).

    Returns:
        A Handle; ``synchronize(handle)`` returns ``(received, received_splits)``: the
        rows from every rank in rank order and an int32 tensor of how many came from each.

    Raises:
        InvalidArgumentError: bad dtype, device, layout or splits.
        DuplicateNameError, NotInitializedError: refused.
    """
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("alltoall", name, psid)
    code = tensor_code(tensor, name, min_ndim=1)
    size, _ = process_sets.members(process_set)
    checked = _checks.check_splits(splits_list(splits), tensor.shape[0], name, size)
    device, event = gpu_fields(tensor)
    return _enqueue.enqueue(_enqueue.ALLTOALL, name, code, tuple(tensor.shape), tensor.data_ptr(),
                            None, splits=checked, process_set_id=psid, device=device,
                            ready_event=ready(event), keepalive=(tensor, event),
                            finisher=core_result(tensor, tensor.shape[0], size))


def enqueue_reducescatter(tensor, name, op, prescale_factor, postscale_factor, process_set):
    psid = process_sets.process_set_id(process_set)
    name = _refusals.resolve_name("reducescatter", name, psid)
    code = tensor_code(tensor, name, min_ndim=1)
    _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
    rows = _checks.reducescatter_rows(tensor.shape[0], *process_sets.members(process_set))
    output = torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                         device=tensor.device)
    device, event = gpu_fields(tensor)
    return _enqueue.enqueue(_enqueue.REDUCESCATTER, name, code, tuple(tensor.shape),
                            tensor.data_ptr(),
                            output.data_ptr(), reduce_op=op, prescale=prescale_factor,
                            postscale=postscale_factor, process_set_id=psid, device=device,
                            ready_event=ready(event), keepalive=(tensor, output, event),
                            result=output)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reduction whose result is scattered by rows among the ranks.

    Args:
        tensor: a contiguous CPU tensor with at least one dimension, same shape everywhere.
        name: the tensor's name, equal across ranks; None names it automatically.
        op, prescale_factor, postscale_factor: as for ``allreduce_async``.
        process_set: the ProcessSet that runs the op (this rank must be a member).

    Returns:
        A Handle; ``synchronize(handle)`` returns this rank's rows of the reduction (the
        first ``d0 % size()`` ranks get one row more).

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
    """
    return enqueue_reducescatter(tensor, name, op, prescale_factor, postscale_factor,
                                 process_set)


def enqueue_grouped_allgather(tensors, names, group, process_set):
    """Enqueues allgathers that negotiate and run together; all or nothing."""
    psid = process_sets.process_set_id(process_set)
    specs, layouts = [], []
    for tensor, name in zip(tensors, names):
        code = tensor_code(tensor, name, min_ndim=1)
        specs.append(_enqueue.TensorSpec(_enqueue.ALLGATHER, name, code, tuple(tensor.shape),
                                         tensor.data_ptr(), process_set_id=psid))
        layouts.append((tensor.dtype, tuple(tensor.shape[1:]), tensor.device))

    def finish(handle):
        return [from_core(handle, i, dtype, trailing, where)
                for i, (dtype, trailing, where) in enumerate(layouts)]

    event = mark_gpu(specs, tensors, group)
    return _enqueue.enqueue_group(specs, name=group, keepalive=(list(tensors), event),
                                  finisher=finish)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts allgathers of several tensors that are negotiated and run together.

    Args:
        tensors: a sequence of tensors (each as for ``allgather_async``).
        name: the group's name; tensor i is named ``"<name>.<i>"``.
        process_set: the ProcessSet whose members' tensors are concatenated.

    Returns:
        A Handle; ``synchronize(handle)`` returns the list of gathered tensors.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused; nothing
            is enqueued if any tensor is refused.
    """
    tensors, names, group = group_names(tensors, name, process_set, "grouped_allgather")
    return enqueue_grouped_allgather(tensors, names, group, process_set)


def enqueue_grouped_reducescatter(tensors, names, group, op, prescale_factor,
                                  postscale_factor, process_set):
    """Enqueues reducescatters that negotiate and run together; all or nothing."""
    psid = process_sets.process_set_id(process_set)
    size, rank = process_sets.members(process_set)
    specs, keep = [], []
    for tensor, name in zip(tensors, names):
        code = tensor_code(tensor, name, min_ndim=1)
        _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
        rows = _checks.reducescatter_rows(tensor.shape[0], size, rank)
        output = torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                             device=tensor.device)
        specs.append(_enqueue.TensorSpec(_enqueue.REDUCESCATTER, name, code, tuple(tensor.shape),
                                         tensor.data_ptr(), output.data_ptr(), op,
                                         prescale_factor, postscale_factor, process_set_id=psid))
        keep += [tensor, output]
    event = mark_gpu(specs, tensors, group)
    return _enqueue.enqueue_group(specs, name=group, keepalive=(keep, event),
                                  result=keep[1::2])


def grouped_reducescatter_async(tensors, name=None, op=Average,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Starts reducescatters of several tensors that are negotiated and run together.

    Args:
        tensors: a sequence of tensors (each as for ``reducescatter_async``).
        name: the group's name; tensor i is named ``"<name>.<i>"``.
        op, prescale_factor, postscale_factor, process_set: as for
            ``reducescatter_async``, for all of them.

    Returns:
        A Handle; ``synchronize(handle)`` returns the list of this rank's rows of each.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused; nothing
            is enqueued if any tensor is refused.
    """
    tensors, names, group = group_names(tensors, name, process_set,
                                        "grouped_reducescatter")
    return enqueue_grouped_reducescatter(tensors, names, group, op, prescale_factor,
                                         postscale_factor, process_set)


def synchronize(handle, timeout=None):
    """Waits for the op behind ``handle`` and returns its result (see the ``*_async`` call).

    Raises:
        WaitTimeoutError: ``timeout`` seconds passed; the op goes on.
        HorovodInternalError: the collective failed on this rank.
    """
    return ops.synchronize(handle, timeout)


def poll(handle):
    """Returns True once the op behind ``handle`` has ended; never blocks."""
    return ops.poll(handle)


def join(device=-1):
    """Declares that this rank has no more data; returns the rank that joined last.

    Until every rank has joined, this rank takes part in the others' collectives with
    nothing to contribute, so ranks may run different numbers of steps.
    ``device`` is accepted for Horovod compatibility (host memory only so far).
    """
    return ops.join()


def barrier(process_set=global_process_set):
    """Blocks until every rank of ``process_set`` has called ``barrier()``."""
    ops.barrier(process_set)


# A call refused here (a bad tensor) is also sent to the other ranks as a refusal, so
# that ranks which submitted the same tensor fail at once instead of waiting for it
# (see hvdlite._refusals.refusing). Wrapped here, in one place, rather than at each def;
# ``hvdlite.torch.mpi_ops`` wraps its synchronous forms alike.
for _fn_name, _op in (
        ("allreduce_async", _enqueue.ALLREDUCE), ("allreduce_async_", _enqueue.ALLREDUCE),
        ("grouped_allreduce_async", _enqueue.ALLREDUCE),
        ("grouped_allreduce_async_", _enqueue.ALLREDUCE),
        ("allgather_async", _enqueue.ALLGATHER),
        ("grouped_allgather_async", _enqueue.ALLGATHER),
        ("broadcast_async", _enqueue.BROADCAST), ("broadcast_async_", _enqueue.BROADCAST),
        ("alltoall_async", _enqueue.ALLTOALL),
        ("reducescatter_async", _enqueue.REDUCESCATTER),
        ("grouped_reducescatter_async", _enqueue.REDUCESCATTER)):
    globals()[_fn_name] = _refusals.refusing(_op)(globals()[_fn_name])
del _fn_name, _op
