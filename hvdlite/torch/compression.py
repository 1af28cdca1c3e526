"""``hvd.Compression`` for PyTorch: none, fp16 and bf16 (see ``hvdlite.compression``)."""
import torch

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
    """The compressors, by the names Horovod scripts use."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
