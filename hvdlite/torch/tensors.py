"""Torch tensors as the core takes them: the dtype table, the checks of a tensor handed
by pointer, and numpy views (Adasum) and wrappers (core-allocated results) of them.

Nothing here copies a tensor: the core reads and writes its memory
(``tensor.data_ptr()``), in host memory or on the tensor's GPU (``gpu_fields``).
"""
import numpy as np
import torch

from hvdlite import _enqueue, dtypes
from hvdlite.errors import InvalidArgumentError, UnsupportedDtypeError

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


_codes = {}


def tensor_code(tensor, name, min_ndim=0):
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
    if not tensor.is_cpu and not tensor.is_cuda:
        raise InvalidArgumentError(
            f"tensor '{name}' is on {tensor.device}: hvdlite takes CPU and CUDA tensors "
            "(move it with .cpu())")
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


def gpu_fields(tensor):
    """The core's ``device`` and ``ready_event`` for a checked tensor.

    Returns ``(-1, None)`` for a CPU tensor. For a CUDA tensor: its device ordinal and
    an event recorded now on that device's current stream, which the core's stream waits
    on before it reads the tensor or writes its outputs (so allocate the outputs first).
    Keep the event referenced until the op has ended.
    """
    if tensor.is_cpu:
        return -1, None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return tensor.device.index, event


def host_array(tensor, name):
    """A zero-copy numpy view of a checked CPU tensor (Adasum computes in numpy)."""
    if tensor.is_cuda:
        raise InvalidArgumentError(
            f"tensor '{name}' is on {tensor.device}: Adasum runs on CPU tensors only so far "
            "(Average or Sum run on CUDA tensors)")
    if tensor.dtype == torch.bfloat16:
        raise InvalidArgumentError(
            f"tensor '{name}': Adasum takes float16, float32 and float64 tensors, not "
            "torch.bfloat16")
    return tensor.detach().numpy()


def core_numpy_dtype(dtype):
    """The numpy dtype a core-allocated result of torch ``dtype`` is read as: numpy has
    no bfloat16 that torch.from_numpy accepts, so such results travel as int16 and are
    reinterpreted (``from_host``)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.int16)
    return dtypes.numpy_dtype(TORCH_DTYPE_NAMES[dtype])


def from_host(arr, dtype, device=None):
    """A host array read as ``core_numpy_dtype(dtype)`` as a tensor of ``dtype``, without
    a copy on the CPU; for a CUDA ``device``, one copy to that GPU."""
    result = torch.from_numpy(arr)
    if dtype == torch.bfloat16:
        result = result.view(torch.bfloat16)
    if device is not None and device.type == "cuda":
        return result.to(device)
    return result


def from_core(handle, index, dtype, trailing_shape, device=None):
    """Wraps a core-allocated ALLGATHER/ALLTOALL result as a tensor, without a copy on
    the CPU; for a CUDA ``device``, one copy to that GPU (the core's result is in host
    memory)."""
    return from_host(handle.output_array(index, core_numpy_dtype(dtype), trailing_shape), dtype,
                     device)


def core_result(tensor, expected_rows, ranks=None):
    """The finisher of a torch ALLGATHER (or, with ``ranks``, ALLTOALL) of ``tensor``:
    the core's result as a tensor on ``tensor``'s device (and an ALLTOALL's received
    splits as an int32 tensor), copied out of the core when small and waited for at once
    (``_enqueue.CoreResult``)."""
    dtype, device = tensor.dtype, tensor.device

    def wrap(rows, splits):
        received = from_host(rows, dtype, device)
        if splits is None:
            return received
        return received, torch.from_numpy(splits.astype(np.int32))

    return _enqueue.CoreResult(core_numpy_dtype(dtype), tuple(tensor.shape[1:]), expected_rows,
                               ranks, wrap)
