"""``hvd.Compression`` for PyTorch: the cast compressors none, fp16 and bf16 (see
``hvdlite.compression``) and the reducers top-k, quantize and PowerSGD (see
``hvdlite.reducers``)."""
import torch

from hvdlite.compression import CastCompressor, Compressor, NoneCompressor, ReducerChoices

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


class Compression(ReducerChoices):
    """The compressors, by the names Horovod scripts use (``none``, ``fp16``, ``bf16``),
    and the reducers ``topk(ratio)``, ``quantize(bits)``, ``powersgd(rank)``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
