"""Gradient compression for the wire: what Horovod calls ``hvd.Compression``.

``compress(tensor) -> (tensor, ctx)`` gives the tensor that is sent, ``decompress`` turns
the reduced result back. The core reduces float16 in float32 per element pair, so
compression costs precision only at the two casts.
"""
import tensorflow as tf


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


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16; other tensors pass unchanged."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
