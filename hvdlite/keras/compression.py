"""``hvd.Compression`` for Keras 3 on any backend, through ``keras.ops.cast``.

Same interface as ``hvdlite.tensorflow.Compression`` (see ``hvdlite.compression``).
"""
import keras

from hvdlite.compression import CastCompressor, Compressor, NoneCompressor, ReducerChoices

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class FP16Compressor(CastCompressor):
    """Sends floating-point tensors as float16; other tensors pass unchanged."""

    wire_dtype = "float16"
    dtype_of = staticmethod(lambda tensor: keras.backend.standardize_dtype(tensor.dtype))
    is_float = staticmethod(lambda dtype: "float" in dtype)
    cast = staticmethod(keras.ops.cast)


class Compression(ReducerChoices):
    """The cast compressors ``none`` and ``fp16``, and the reducers ``topk(ratio)``,
    ``quantize(bits)``, ``powersgd(rank)``."""

    none = NoneCompressor
    fp16 = FP16Compressor
