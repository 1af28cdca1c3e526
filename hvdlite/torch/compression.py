"""``hvd.Compression`` for PyTorch: the cast compressors none, fp16 and bf16 (see
``hvdlite.compression``) and the reducers top-k, quantize and PowerSGD (see
``hvdlite.reducers``)."""
import torch

from hvdlite import reducers
from hvdlite.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]


class _TorchCast(CastCompressor):
    dtype_of = staticmethod(lambda tensor: tensor.dtype)
    is_float = staticmethod(lambda dtype: dtype.is_floating_point)
    cast = staticmethod(lambda tensor, dtype: tensor.to(dtype))


class FP16Compressor(_TorchCast):
    """Sends floating-point tensors as float16 (half the bytes)."""

    wire_dtype = torch.float16


class BF16Compressor(_TorchCast):
    """Sends floating-point tensors as bfloat16 (half the bytes, float32's range)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors, by the names Horovod scripts use, and the reducers.

    ``none``, ``fp16`` and ``bf16`` are Horovod's cast compressors. ``topk(ratio)``,
    ``quantize(bits)`` and ``powersgd(rank)`` make a reducer with state of its own (its
    error-feedback residuals): give each DistributedOptimizer its own.
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    topk = reducers.TopK
    quantize = reducers.Quantize
    powersgd = reducers.PowerSGD
