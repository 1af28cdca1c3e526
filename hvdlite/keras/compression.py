"""Gradient compression for Keras 3, on any backend (``keras.ops.cast``).

Same interface as ``hvdlite.tensorflow.Compression`` (whose compressors also work
here on the TensorFlow backend): ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx)``.
"""
import keras


class NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Sends floating-point tensors as float16; other tensors pass unchanged."""

    @staticmethod
    def compress(tensor):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if "float" in dtype and dtype != "float16":
            return keras.ops.cast(tensor, "float16"), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else keras.ops.cast(tensor, ctx)


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
