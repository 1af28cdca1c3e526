"""``hvd.Compression`` for TensorFlow: none and fp16 (see ``hvdlite.compression``)."""
import tensorflow as tf

from hvdlite.compression import CastCompressor, Compressor, NoneCompressor, ReducerChoices

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class FP16Compressor(CastCompressor):
    """Sends floating-point tensors as float16; other tensors pass unchanged."""

    wire_dtype = tf.float16
    dtype_of = staticmethod(lambda tensor: tensor.dtype)
    is_float = staticmethod(lambda dtype: dtype.is_floating)
    cast = staticmethod(tf.cast)


class Compression(ReducerChoices):
    """The cast compressors ``none`` and ``fp16``, and the reducers ``topk(ratio)``,
    ``quantize(bits)``, ``powersgd(rank)`` (gradient tapes and optimizers only)."""

    none = NoneCompressor
    fp16 = FP16Compressor
