"""Gradient compression for the wire: what Horovod calls ``hvd.Compression``.

A compressor turns a tensor into the tensor that is sent (``compress`` returns it and
a context) and turns the reduced result back (``decompress``). The reduction itself
happens on the compressed type: float16 and bfloat16 are summed in float32 per element
pair by the core, so compression costs precision only at the two conversions.
"""
import torch


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire_dtype``; other tensors pass unchanged."""

    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16 (half the bytes)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16 (half the bytes, float32's range)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors, by the names Horovod scripts use."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
