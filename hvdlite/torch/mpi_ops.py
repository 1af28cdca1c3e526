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

from hvdlite import dtypes, ops, runtime
from hvdlite.errors import InvalidArgumentError
from hvdlite.torch.compression import Compression

Average = ops.Average
Sum = ops.Sum
Min = ops.Min
Max = ops.Max
Product = ops.Product

# torch dtype -> canonical name of hvdlite.dtypes (the adapter's half of the one table).
TORCH_DTYPE_NAMES = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
}

class ProcessSet:
    """A set of ranks that runs collectives together. Only the global set exists so far.

    Accepted wherever Horovod takes ``process_set=`` so scripts passing
    ``hvd.global_process_set`` run unchanged.
    """

    def __init__(self, process_set_id=0):
        self.process_set_id = process_set_id

    def size(self):
        return runtime.size()

    def rank(self):
        return runtime.rank()

    def included(self):
        return True

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id})"


global_process_set = ProcessSet(0)


def _process_set_id(process_set):
    if process_set is None or process_set is global_process_set or (
            isinstance(process_set, ProcessSet) and process_set.process_set_id == 0):
        return 0
    raise InvalidArgumentError(
        f"process_set {process_set!r}: only the global process set is supported so far")


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
        raise InvalidArgumentError(f"{label} has unsupported dtype {dtype}; supported: "
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
    name = ops._resolve_name("allreduce", name)
    code = _tensor_code(tensor, name)
    ops._check_reduction(op, prescale_factor, postscale_factor, code, name)
    psid = _process_set_id(process_set)
    if output is None:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    # The per-gradient path: every argument in order, no keywords.
    return ops.enqueue_fields(ops.ALLREDUCE, name, code, tensor.shape,
                              ops.pointer_at(tensor.data_ptr()),
                              ops.pointer_at(output.data_ptr()), op, prescale_factor,
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
        process_set: the global process set (the only one so far).

    Returns:
        A Handle; ``synchronize(handle)`` returns the result (same shape and dtype).

    Raises:
        InvalidArgumentError: bad dtype, device, layout, op or scaling.
        DuplicateNameError: a tensor of that name is in flight.
        NotInitializedError: before init() or after shutdown().
    """
    op = ops.resolve_op(op, average)
    return _allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts reducing ``tensor`` in place; ``synchronize(handle)`` returns ``tensor``.

    See ``allreduce_async`` for the arguments and errors.
    """
    op = ops.resolve_op(op, average)
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
    op = ops.resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _AllreduceFunction.apply(compressed, name, op, prescale_factor,
                                       postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


# -- grouped allreduce -------------------------------------------------------------------


def _grouped_allreduce_async(tensors, outputs, names, op, prescale_factor,
                             postscale_factor, process_set, label):
    """Enqueues allreduces that negotiate and run together; all or nothing."""
    psid = _process_set_id(process_set)
    specs, keep = [], []
    for tensor, output, name in zip(tensors, outputs, names):
        code = _tensor_code(tensor, name)
        ops._check_reduction(op, prescale_factor, postscale_factor, code, name)
        if output is None:
            output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        specs.append(ops.TensorSpec(ops.ALLREDUCE, name, code, tuple(tensor.shape),
                                    tensor.data_ptr(), output.data_ptr(), op,
                                    prescale_factor, postscale_factor,
                                    process_set_id=psid))
        keep += [tensor, output]
    results = keep[1::2]
    return ops.enqueue_group(specs, name=label, keepalive=keep, result=results)


def _group_names(tensors, name):
    tensors = list(tensors)
    group = ops._resolve_name("grouped_allreduce", name)
    return tensors, [f"{group}.{i}" for i in range(len(tensors))], group


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
    op = ops.resolve_op(op, average)
    tensors, names, group = _group_names(tensors, name)
    return _grouped_allreduce_async(tensors, [None] * len(tensors), names, op,
                                    prescale_factor, postscale_factor, process_set, group)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place ``grouped_allreduce_async``: the result list holds the given tensors."""
    op = ops.resolve_op(op, average)
    tensors, names, group = _group_names(tensors, name)
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
        tensors, names, group = _group_names(tensors, name)
        return tuple(ops.synchronize(_grouped_allreduce_async(
            tensors, [None] * len(tensors), names, op, prescale_factor, postscale_factor,
            process_set, group)))

    @staticmethod
    def backward(ctx, *grads):
        grads, names, group = _group_names([g.contiguous() for g in grads], None)
        reduced = ops.synchronize(_grouped_allreduce_async(
            grads, [None] * len(grads), names, ctx.op, *ctx.scale, ctx.process_set, group))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduces several tensors together; returns a list of new tensors; differentiable.

    See ``grouped_allreduce_async`` and ``allreduce``.
    """
    op = ops.resolve_op(op, average)
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
        process_set: the global process set.

    Returns:
        A Handle; ``synchronize(handle)`` returns the gathered tensor (a zero-copy view
        of the core's buffer).

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
    """
    name = ops._resolve_name("allgather", name)
    code = _tensor_code(tensor, name, min_ndim=1)
    psid = _process_set_id(process_set)
    dtype, trailing = tensor.dtype, tuple(tensor.shape[1:])
    return ops.enqueue(ops.ALLGATHER, name, code, tuple(tensor.shape), tensor.data_ptr(),
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
        offset = int(rows[:runtime.rank()].sum())
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
    name = ops._resolve_name("sparse_allreduce", name)
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
    name = ops._resolve_name("broadcast", name)
    code = _tensor_code(tensor, name)
    root = ops._check_rank(root_rank, "root_rank", name)
    psid = _process_set_id(process_set)
    if output is None:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return ops.enqueue(ops.BROADCAST, name, code, tuple(tensor.shape), tensor.data_ptr(),
                       output.data_ptr(), root_rank=root, process_set_id=psid,
                       keepalive=(tensor, output), result=output)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts sending ``root_rank``'s ``tensor`` to every rank, into a new tensor.

    Args:
        tensor: a contiguous CPU tensor; same shape and dtype on every rank.
        root_rank: the rank whose values everyone receives.
        name: the tensor's name, equal across ranks; None names it automatically.
        process_set: the global process set.

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
        process_set: the global process set.

    Returns:
        A Handle; ``synchronize(handle)`` returns ``(received, received_splits)``: the
        rows from every rank in rank order and an int32 tensor of how many came from each.

    Raises:
        InvalidArgumentError: bad dtype, device, layout or splits.
        DuplicateNameError, NotInitializedError: refused.
    """
    name = ops._resolve_name("alltoall", name)
    code = _tensor_code(tensor, name, min_ndim=1)
    checked = ops._check_splits(_splits_list(splits), tensor.shape[0], name)
    psid = _process_set_id(process_set)
    dtype, trailing, size = tensor.dtype, tuple(tensor.shape[1:]), runtime.size()

    def finish(handle):
        received = _from_core(handle, 0, dtype, trailing)
        recv_splits = torch.from_numpy(handle.recv_splits(0, size).astype(np.int32))
        return received, recv_splits

    return ops.enqueue(ops.ALLTOALL, name, code, tuple(tensor.shape), tensor.data_ptr(),
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
    name = ops._resolve_name("reducescatter", name)
    code = _tensor_code(tensor, name, min_ndim=1)
    ops._check_reduction(op, prescale_factor, postscale_factor, code, name)
    psid = _process_set_id(process_set)
    rows = ops.reducescatter_rows(tensor.shape[0], runtime.size(), runtime.rank())
    output = torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    return ops.enqueue(ops.REDUCESCATTER, name, code, tuple(tensor.shape), tensor.data_ptr(),
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
        process_set: the global process set.

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
                runtime.size() if op == Sum else 1)
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
    """Blocks until every rank has called ``barrier()``."""
    _process_set_id(process_set)
    ops.barrier()
