"""Tensor collectives for PyTorch: CPU tensors by pointer, and their autograd functions.

Built on ``hvdlite.ops``: a tensor is looked at through a zero-copy numpy view so that
naming, validation (dtype, op, scaling, root, splits) and handles are exactly those of
the framework-free layer; the core then reads and writes the tensor's own memory
(``tensor.data_ptr()``). Nothing here is compiled against torch.

* Out-of-place ops (``allreduce``, ``broadcast``, ``reducescatter``) allocate the result
  with torch and let the core write into it; ``*_`` forms write into the given tensor.
* ``allgather`` and ``alltoall`` results are allocated by the core (their size is known
  only after negotiation); they are wrapped as tensors without a copy and keep the
  native handle alive until the last view of them is gone.
* Tensors must be contiguous CPU tensors: a non-contiguous one is refused rather than
  copied behind the caller's back (``tensor.contiguous()`` makes one); a CUDA tensor is
  refused until the GPU path lands.

``*_async`` functions return an ``hvdlite.Handle``; ``synchronize(handle)`` returns the
result tensor, ``poll(handle)`` says whether it is ready. Unnamed tensors are named as
in ``hvdlite.ops`` (``"allreduce.noname.<n>"``...), so names agree across ranks when
every rank makes the same unnamed calls in the same order.
"""

import numpy as np
import torch

from hvdlite import _checks, _enqueue, _refusals, adasum, dtypes, ops, process_sets, runtime
from hvdlite.errors import InvalidArgumentError, UnsupportedDtypeError
from hvdlite.torch.compression import Compression

Average = ops.Average
Sum = ops.Sum
Min = ops.Min
Max = ops.Max
Product = ops.Product
Adasum = ops.Adasum

# torch dtype -> canonical name of hvdlite.dtypes (the adapter's half of the one table).
# torch.uint16 (and uint32/uint64) stay out, as in horovod.torch, which refuses them.
TORCH_DTYPE_NAMES = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
}

# Process sets: the framework-free ones (hvdlite.process_sets), as Horovod's torch
# module exports them.
ProcessSet = process_sets.ProcessSet
global_process_set = process_sets.global_process_set
add_process_set = process_sets.add_process_set
remove_process_set = process_sets.remove_process_set
_process_set_id = process_sets.process_set_id
_basics = process_sets.basics


def torch_dtype_name(dtype):
    """Returns the canonical hvdlite name of a torch dtype, or None if unsupported."""
    return TORCH_DTYPE_NAMES.get(dtype)


def native_dtype_code(dtype, tensor_name=None):
    """Returns the native dtype code for a torch dtype.

    Args:
        dtype: a ``torch.dtype``.
        tensor_name: names the tensor in the error message.

    Raises:
        InvalidArgumentError: the dtype is not supported; the message lists those that are.
    """
    name = torch_dtype_name(dtype)
    if name is None:
        label = f"tensor '{tensor_name}'" if tensor_name else "tensor"
        supported = ", ".join(str(d) for d in TORCH_DTYPE_NAMES)
        raise UnsupportedDtypeError(f"{label} has unsupported dtype {dtype}; supported: "
                                    f"{supported}")
    return dtypes.native_code(name, tensor_name)


# torch.dtype -> native dtype code, for the dtypes seen so far (a handful).
_codes = {}


def _tensor_code(tensor, name, min_ndim=0):
    """Checks that the core can take ``tensor`` by pointer; returns its dtype code.

    This runs for every gradient of every step, so it asks torch only what it must and
    builds nothing (no numpy view).
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(
            f"tensor '{name}' must be a torch.Tensor, not {type(tensor).__name__}")
    code = _codes.get(tensor.dtype)
    if code is None:
        code = _codes[tensor.dtype] = native_dtype_code(tensor.dtype, name)
    if not tensor.is_cpu:
        raise InvalidArgumentError(
            f"tensor '{name}' is on {tensor.device}: hvdlite's GPU path has not landed yet, "
            "only CPU tensors are supported (move it with .cpu())")
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"tensor '{name}' has layout {tensor.layout}; only dense (strided) tensors are "
            "supported (use .to_dense())")
    if not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"tensor '{name}' is not contiguous (strides {tuple(tensor.stride())} for shape "
            f"{tuple(tensor.shape)}); pass tensor.contiguous()")
    if tensor.is_neg() or tensor.is_conj():
        # Its memory does not hold its values: the core would reduce the wrong ones.
        raise InvalidArgumentError(
            f"tensor '{name}' is a lazily negated or conjugated view; pass "
            "tensor.resolve_neg().resolve_conj()")
    if tensor.dim() < min_ndim:
        raise InvalidArgumentError(
            f"tensor '{name}' must have at least {min_ndim} dimension(s), "
            f"got shape {tuple(tensor.shape)}")
    return code


def _host_array(tensor, name):
    """A zero-copy numpy view of a checked CPU tensor (Adasum computes in numpy)."""
    if tensor.dtype == torch.bfloat16:
        raise InvalidArgumentError(
            f"tensor '{name}': Adasum takes float16, float32 and float64 tensors, not "
            "torch.bfloat16")
    return tensor.detach().numpy()


def _from_core(handle, index, dtype, trailing_shape):
    """Wraps a core-allocated ALLGATHER/ALLTOALL result as a tensor, without a copy."""
    if dtype == torch.bfloat16:
        # numpy has no bfloat16 that torch.from_numpy accepts: such results travel as
        # int16 and are reinterpreted (a view, no copy).
        arr = handle.output_array(index, np.int16, trailing_shape)
        return torch.from_numpy(arr).view(torch.bfloat16)
    arr = handle.output_array(index, dtypes.numpy_dtype(TORCH_DTYPE_NAMES[dtype]),
                              trailing_shape)
    return torch.from_numpy(arr)


# -- allreduce ---------------------------------------------------------------------------


def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor,
                     process_set):
    psid = _process_set_id(process_set)
    name = _refusals.resolve_name("allreduce", name, psid)
    code = _tensor_code(tensor, name)
    if op != Adasum:
        _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
    if output is None:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    if op == Adasum:
        _checks.check_adasum_set(psid, name)
        return adasum.allreduce_async(_host_array(tensor, name), name, prescale_factor,
                                      postscale_factor, _host_array(output, name), output)
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
    return _allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts reducing ``tensor`` in place; ``synchronize(handle)`` returns ``tensor``.

    See ``allreduce_async`` for the arguments and errors.
    """
    op = _checks.resolve_op(op, average)
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` across ranks in place and returns it (not differentiable).

    See ``allreduce_async``; raises HorovodInternalError subclasses if it fails.
    """
    return ops.synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                            postscale_factor, process_set))


class _AllreduceFunction(torch.autograd.Function):
    """allreduce whose backward is the allreduce of the gradient with the same op."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op = op
        ctx.scale = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return ops.synchronize(_allreduce_async(tensor, None, name, op, prescale_factor,
                                                postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = ops.synchronize(_allreduce_async(grad_output.contiguous(), None, None, ctx.op,
                                                *ctx.scale, ctx.process_set))
        return grad, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` across ranks and returns a new tensor; differentiable.

    The gradient is the allreduce of the incoming gradient with the same op and scaling
    (for Sum and Average that is the exact gradient of the sum of every rank's loss).

    Args:
        tensor, average, name, op, prescale_factor, postscale_factor, process_set: as for
            ``allreduce_async``.
        compression: compresses the tensor for the wire (e.g. Compression.fp16).

    Returns:
        A new tensor of the same shape and dtype.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
        HorovodInternalError: the collective failed (e.g. MismatchError across ranks).
    """
    op = _checks.resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _AllreduceFunction.apply(compressed, name, op, prescale_factor,
                                       postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


# -- grouped allreduce -------------------------------------------------------------------


def _grouped_allreduce_async(tensors, outputs, names, op, prescale_factor,
                             postscale_factor, process_set, label):
    """Enqueues allreduces that negotiate and run together; all or nothing."""
    psid = _process_set_id(process_set)
    if op == Adasum:
        _checks.check_adasum_set(psid, label)
        for tensor, name in zip(tensors, names):
            _tensor_code(tensor, name)
        outputs = [torch.empty_like(t, memory_format=torch.contiguous_format)
                   if o is None else o for t, o in zip(tensors, outputs)]
        return adasum.grouped_allreduce_async(
            [_host_array(t, n) for t, n in zip(tensors, names)], label, prescale_factor,
            postscale_factor, [_host_array(o, n) for o, n in zip(outputs, names)], outputs)
    specs, keep = [], []
    for tensor, output, name in zip(tensors, outputs, names):
        code = _tensor_code(tensor, name)
        _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
        if output is None:
            output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        specs.append(_enqueue.TensorSpec(_enqueue.ALLREDUCE, name, code, tuple(tensor.shape),
                                         tensor.data_ptr(), output.data_ptr(), op,
                                         prescale_factor, postscale_factor,
                                         process_set_id=psid))
        keep += [tensor, output]
    results = keep[1::2]
    return _enqueue.enqueue_group(specs, name=label, keepalive=keep, result=results)


def _group_names(tensors, name, process_set, kind="grouped_allreduce"):
    tensors = list(tensors)
    psid = _process_set_id(process_set)
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
    tensors, names, group = _group_names(tensors, name, process_set)
    return _grouped_allreduce_async(tensors, [None] * len(tensors), names, op,
                                    prescale_factor, postscale_factor, process_set, group)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place ``grouped_allreduce_async``: the result list holds the given tensors."""
    op = _checks.resolve_op(op, average)
    tensors, names, group = _group_names(tensors, name, process_set)
    return _grouped_allreduce_async(tensors, tensors, names, op, prescale_factor,
                                    postscale_factor, process_set, group)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """Reduces several tensors in place, together; returns them (not differentiable)."""
    return ops.synchronize(grouped_allreduce_async_(tensors, average, name, op,
                                                    prescale_factor, postscale_factor,
                                                    process_set))


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.op = op
        ctx.scale = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        tensors, names, group = _group_names(tensors, name, process_set)
        return tuple(ops.synchronize(_grouped_allreduce_async(
            tensors, [None] * len(tensors), names, op, prescale_factor, postscale_factor,
            process_set, group)))

    @staticmethod
    def backward(ctx, *grads):
        grads, names, group = _group_names([g.contiguous() for g in grads], None,
                                           ctx.process_set)
        reduced = ops.synchronize(_grouped_allreduce_async(
            grads, [None] * len(grads), names, ctx.op, *ctx.scale, ctx.process_set, group))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduces several tensors together; returns a list of new tensors; differentiable.

    See ``grouped_allreduce_async`` and ``allreduce``.
    """
    op = _checks.resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduceFunction.apply(name, op, prescale_factor, postscale_factor,
                                              process_set, *[c for c, _ in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


# -- allgather ---------------------------------------------------------------------------


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
    psid = _process_set_id(process_set)
    name = _refusals.resolve_name("allgather", name, psid)
    code = _tensor_code(tensor, name, min_ndim=1)
    dtype, trailing = tensor.dtype, tuple(tensor.shape[1:])
    return _enqueue.enqueue(_enqueue.ALLGATHER, name, code, tuple(tensor.shape), tensor.data_ptr(),
                            None, process_set_id=psid, keepalive=(tensor,),
                            finisher=lambda handle: _from_core(handle, 0, dtype, trailing))


class _AllgatherFunction(torch.autograd.Function):
    """allgather whose backward is Horovod's: the gradient averaged over ranks, then
    this rank's rows (so ranks that all pass the same gradient get exactly it back)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        handle = allgather_async(tensor, name, process_set)  # validates first
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        return ops.synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        grad = ops.synchronize(_allreduce_async(grad_output.contiguous(), None, None, Average,
                                                1.0, 1.0, ctx.process_set))
        rows = ops.synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int64),
                                               None, ctx.process_set))
        offset = int(rows[:process_sets.members(ctx.process_set)[1]].sum())
        return grad.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's ``tensor`` along the first dimension; differentiable.

    The gradient is Horovod's: the incoming gradients averaged over ranks, this rank's
    rows of it. See ``allgather_async``; raises HorovodInternalError subclasses if it fails.
    """
    return _AllgatherFunction.apply(tensor, name, process_set)


# -- sparse allreduce --------------------------------------------------------------------


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
    the values are divided by size(). Ranks may have different numbers of entries.

    Args:
        tensor: a sparse COO CPU tensor, same shape on every rank.
        name: a base name, equal across ranks (``<name>.indices`` and ``<name>.values``
            are gathered); None names it automatically.
        op: Sum or Average.
        process_set: the global process set.

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
    return SparseHandle(indices_handle, values_handle, tensor.shape,
                        runtime.size() if op == Average else 1)


# -- broadcast ---------------------------------------------------------------------------


def _broadcast_async(tensor, output, root_rank, name, process_set):
    psid = _process_set_id(process_set)
    name = _refusals.resolve_name("broadcast", name, psid)
    code = _tensor_code(tensor, name)
    root = _checks.check_rank(root_rank, "root_rank", name)
    if output is None:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _enqueue.enqueue(_enqueue.BROADCAST, name, code, tuple(tensor.shape), tensor.data_ptr(),
                            output.data_ptr(), root_rank=root, process_set_id=psid,
                            keepalive=(tensor, output), result=output)


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
    return _broadcast_async(tensor, None, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts broadcasting into ``tensor`` itself; ``synchronize`` returns ``tensor``."""
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites ``tensor`` with ``root_rank``'s values and returns it (in place)."""
    return ops.synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _BroadcastFunction(torch.autograd.Function):
    """broadcast whose backward is Horovod's: the gradient averaged over ranks on the
    root, zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return ops.synchronize(_broadcast_async(tensor, None, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = ops.synchronize(_allreduce_async(grad_output.contiguous(), None, None, Average,
                                                1.0, 1.0, ctx.process_set))
        if runtime.rank() != ctx.root_rank:
            grad.zero_()
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``tensor`` on every rank (a new tensor); differentiable.

    The gradient is Horovod's: the incoming gradients averaged over ranks on the root,
    zero on the other ranks. See ``broadcast_async``; raises HorovodInternalError subclasses if it fails.
    """
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set)


# -- alltoall ----------------------------------------------------------------------------


def _splits_list(splits):
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
    psid = _process_set_id(process_set)
    name = _refusals.resolve_name("alltoall", name, psid)
    code = _tensor_code(tensor, name, min_ndim=1)
    size, _ = process_sets.members(process_set)
    checked = _checks.check_splits(_splits_list(splits), tensor.shape[0], name, size)
    dtype, trailing = tensor.dtype, tuple(tensor.shape[1:])

    def finish(handle):
        received = _from_core(handle, 0, dtype, trailing)
        recv_splits = torch.from_numpy(handle.recv_splits(0, size).astype(np.int32))
        return received, recv_splits

    return _enqueue.enqueue(_enqueue.ALLTOALL, name, code, tuple(tensor.shape), tensor.data_ptr(),
                            None, splits=checked, process_set_id=psid, keepalive=(tensor,),
                            finisher=finish)


class _AlltoallFunction(torch.autograd.Function):
    """alltoall whose backward sends each gradient row back where it came from."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        received, recv_splits = ops.synchronize(alltoall_async(tensor, splits, name,
                                                               process_set))
        ctx.recv_splits = recv_splits.tolist()
        ctx.mark_non_differentiable(recv_splits)
        return received, recv_splits

    @staticmethod
    def backward(ctx, grad_output, _grad_splits):
        grad, _ = ops.synchronize(alltoall_async(grad_output.contiguous(), ctx.recv_splits,
                                                 None, ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """All-to-all exchange of rows; differentiable.

    Returns:
        The received tensor when ``splits`` is None, else ``(received, received_splits)``
        as Horovod does.

    See ``alltoall_async`` for the arguments; raises HorovodInternalError subclasses if it
    fails.
    """
    received, recv_splits = _AlltoallFunction.apply(tensor, _splits_list(splits), name,
                                                    process_set)
    return received if splits is None else (received, recv_splits)


# -- reducescatter -----------------------------------------------------------------------


def _reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set):
    psid = _process_set_id(process_set)
    name = _refusals.resolve_name("reducescatter", name, psid)
    code = _tensor_code(tensor, name, min_ndim=1)
    _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
    rows = _checks.reducescatter_rows(tensor.shape[0], *process_sets.members(process_set))
    output = torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    return _enqueue.enqueue(_enqueue.REDUCESCATTER, name, code, tuple(tensor.shape),
                            tensor.data_ptr(),
                            output.data_ptr(), reduce_op=op, prescale=prescale_factor,
                            postscale=postscale_factor, process_set_id=psid,
                            keepalive=(tensor, output), result=output)


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
    return _reducescatter_async(tensor, name, op, prescale_factor, postscale_factor,
                                process_set)


class _ReducescatterFunction(torch.autograd.Function):
    """reducescatter whose backward is Horovod's: the allgather of the gradient rows,
    times size() for Sum and times the scale factors."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.scale = None
        if op in (Sum, Average):
            ctx.scale = prescale_factor * postscale_factor * (
                process_sets.members(process_set)[0] if op == Sum else 1)
        ctx.process_set = process_set
        return ops.synchronize(_reducescatter_async(tensor, name, op, prescale_factor,
                                                    postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.scale is None:
            raise RuntimeError("reducescatter is differentiable only for op=Sum or Average")
        grad = ops.synchronize(allgather_async(grad_output.contiguous(), None,
                                               ctx.process_set))
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        return grad, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` across ranks and returns this rank's rows; differentiable.

    The gradient is Horovod's (for Sum and Average only): the allgather of the incoming
    gradients, times size() for Sum and times the scale factors. See
    ``reducescatter_async`` for the arguments.
    """
    compressed, ctx = compression.compress(tensor)
    out = _ReducescatterFunction.apply(compressed, name, op, prescale_factor,
                                       postscale_factor, process_set)
    return compression.decompress(out, ctx)


# -- grouped allgather and reducescatter -------------------------------------------------


def _grouped_allgather_async(tensors, names, group, process_set):
    """Enqueues allgathers that negotiate and run together; all or nothing."""
    psid = _process_set_id(process_set)
    specs, layouts = [], []
    for tensor, name in zip(tensors, names):
        code = _tensor_code(tensor, name, min_ndim=1)
        specs.append(_enqueue.TensorSpec(_enqueue.ALLGATHER, name, code, tuple(tensor.shape),
                                         tensor.data_ptr(), process_set_id=psid))
        layouts.append((tensor.dtype, tuple(tensor.shape[1:])))

    def finish(handle):
        return [_from_core(handle, i, dtype, trailing)
                for i, (dtype, trailing) in enumerate(layouts)]

    return _enqueue.enqueue_group(specs, name=group, keepalive=list(tensors), finisher=finish)


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
    tensors, names, group = _group_names(tensors, name, process_set, "grouped_allgather")
    return _grouped_allgather_async(tensors, names, group, process_set)


class _GroupedAllgatherFunction(torch.autograd.Function):
    """Grouped allgather; as Horovod defines it, each tensor's gradient is this rank's
    rows of the average over ranks of the result's gradient."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [int(t.shape[0]) for t in tensors]
        ctx.process_set = process_set
        return tuple(ops.synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        grads, names, group = _group_names([g.contiguous() for g in grads], None,
                                           ctx.process_set)
        reduced = ops.synchronize(_grouped_allreduce_async(
            grads, [None] * len(grads), names, Average, 1.0, 1.0, ctx.process_set, group))
        rows = ops.synchronize(allgather_async(
            torch.tensor([ctx.rows], dtype=torch.int64), None, ctx.process_set))
        offsets = rows[:process_sets.members(ctx.process_set)[1]].sum(0).tolist()
        return (None, None, *[g.narrow(0, int(at), n)
                              for g, at, n in zip(reduced, offsets, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Gathers several tensors together; returns a list of new tensors; differentiable.

    See ``grouped_allgather_async``; raises HorovodInternalError subclasses if it fails.
    """
    return list(_GroupedAllgatherFunction.apply(name, process_set, *tensors))


def _grouped_reducescatter_async(tensors, names, group, op, prescale_factor,
                                 postscale_factor, process_set):
    """Enqueues reducescatters that negotiate and run together; all or nothing."""
    psid = _process_set_id(process_set)
    size, rank = process_sets.members(process_set)
    specs, keep = [], []
    for tensor, name in zip(tensors, names):
        code = _tensor_code(tensor, name, min_ndim=1)
        _checks.check_reduction(op, prescale_factor, postscale_factor, code, name)
        rows = _checks.reducescatter_rows(tensor.shape[0], size, rank)
        output = torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
        specs.append(_enqueue.TensorSpec(_enqueue.REDUCESCATTER, name, code, tuple(tensor.shape),
                                         tensor.data_ptr(), output.data_ptr(), op,
                                         prescale_factor, postscale_factor, process_set_id=psid))
        keep += [tensor, output]
    return _enqueue.enqueue_group(specs, name=group, keepalive=keep, result=keep[1::2])


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
    tensors, names, group = _group_names(tensors, name, process_set,
                                         "grouped_reducescatter")
    return _grouped_reducescatter_async(tensors, names, group, op, prescale_factor,
                                        postscale_factor, process_set)


class _GroupedReducescatterFunction(torch.autograd.Function):
    """Grouped reducescatter; as Horovod defines it, each tensor's gradient is the
    allgather of its result's gradient, times size() for Sum and times the scale
    factors."""

    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.scale = None
        if op in (Sum, Average):
            ctx.scale = prescale_factor * postscale_factor * (
                process_sets.members(process_set)[0] if op == Sum else 1)
        ctx.process_set = process_set
        return tuple(ops.synchronize(grouped_reducescatter_async(
            tensors, name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.scale is None:
            raise RuntimeError("reducescatter is differentiable only for op=Sum or Average")
        grads, names, group = _group_names([g.contiguous() for g in grads], None,
                                           ctx.process_set, "grouped_allgather")
        gathered = ops.synchronize(_grouped_allgather_async(grads, names, group,
                                                            ctx.process_set))
        if ctx.scale != 1.0:
            gathered = [g * ctx.scale for g in gathered]
        return (None, None, None, None, None, *gathered)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduces several tensors together, each scattered by rows; returns this rank's
    parts as new tensors; differentiable. See ``grouped_reducescatter_async``."""
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatterFunction.apply(name, op, prescale_factor, postscale_factor,
                                               process_set, *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# -- control -----------------------------------------------------------------------------


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
# (see hvdlite.ops.refusing). Wrapped here, in one place, rather than at each def.
for _fn_name, _op in (
        ("allreduce_async", _enqueue.ALLREDUCE), ("allreduce_async_", _enqueue.ALLREDUCE),
        ("allreduce", _enqueue.ALLREDUCE), ("allreduce_", _enqueue.ALLREDUCE),
        ("grouped_allreduce_async", _enqueue.ALLREDUCE),
        ("grouped_allreduce_async_", _enqueue.ALLREDUCE),
        ("grouped_allreduce", _enqueue.ALLREDUCE), ("grouped_allreduce_", _enqueue.ALLREDUCE),
        ("allgather_async", _enqueue.ALLGATHER), ("allgather", _enqueue.ALLGATHER),
        ("grouped_allgather_async", _enqueue.ALLGATHER), ("grouped_allgather", _enqueue.ALLGATHER),
        ("broadcast_async", _enqueue.BROADCAST), ("broadcast_async_", _enqueue.BROADCAST),
        ("broadcast", _enqueue.BROADCAST), ("broadcast_", _enqueue.BROADCAST),
        ("alltoall_async", _enqueue.ALLTOALL), ("alltoall", _enqueue.ALLTOALL),
        ("reducescatter_async", _enqueue.REDUCESCATTER), ("reducescatter", _enqueue.REDUCESCATTER),
        ("grouped_reducescatter_async", _enqueue.REDUCESCATTER),
        ("grouped_reducescatter", _enqueue.REDUCESCATTER)):
    globals()[_fn_name] = _refusals.refusing(_op)(globals()[_fn_name])
del _fn_name, _op
