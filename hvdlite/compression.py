"""Gradient compression for the wire, framework-free: what Horovod calls ``hvd.Compression``.

A compressor turns a tensor into the tensor that is sent (``compress`` returns it and a
context) and turns the reduced result back (``decompress``). The reduction happens on
the compressed type: float16 and bfloat16 are summed in float32 per element pair by the
core, so compression costs precision only at the two casts. Each adapter supplies the
three framework operations a cast compressor needs.

Top-k, quantization and PowerSGD change the collective itself: they are reducers
(``hvdlite.reducers``), offered under the same ``Compression`` name by every adapter.
"""
from hvdlite import reducers


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


class CastCompressor(Compressor):
    """Sends floating-point tensors as ``wire_dtype``; other tensors pass unchanged.

    Subclasses set ``wire_dtype`` and define ``dtype_of(tensor)``, ``is_float(dtype)``
    and ``cast(tensor, dtype)`` for their framework.
    """

    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        dtype = cls.dtype_of(tensor)
        if cls.is_float(dtype) and dtype != cls.wire_dtype:
            return cls.cast(tensor, cls.wire_dtype), dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else cls.cast(tensor, ctx)


class ReducerChoices:
    """The reducers every adapter's ``Compression`` offers beside its cast compressors.

    Each call makes a reducer with state of its own (error-feedback residuals): give each
    optimizer or tape its own.
    """

    topk = reducers.TopK
    quantize = reducers.Quantize
    powersgd = reducers.PowerSGD

    @classmethod
    def parse(cls, text):
        """The compressor or a new reducer named by ``text``, for command lines:
        ``none``, ``fp16``, ``bf16`` (where the adapter has it), ``topk:RATIO``,
        ``quantize:BITS``, ``powersgd:RANK``; a reducer's keyword arguments may follow,
        e.g. ``topk:0.01:momentum=0:warmup_steps=36``.

        Raises:
            ValueError: an unknown name, a bad number or an unknown keyword.
        """
        name, _, arg = text.partition(":")
        make = {"topk": (cls.topk, float), "quantize": (cls.quantize, int),
                "powersgd": (cls.powersgd, int)}.get(name)
        if make is not None:
            first, *options = arg.split(":")
            if not first:
                raise ValueError(f"compression '{text}': say {name}:NUMBER")
            kwargs = {}
            for option in options:
                key, eq, value = option.partition("=")
                if not eq:
                    raise ValueError(f"compression '{text}': '{option}' is not KEY=VALUE")
                kwargs[key] = _option_value(value)
            try:
                return make[0](make[1](first), **kwargs)
            except TypeError as e:
                raise ValueError(f"compression '{text}': {e}") from None
        compressor = getattr(cls, name, None) if not arg else None
        if not (isinstance(compressor, type) and issubclass(compressor, Compressor)):
            raise ValueError(f"unknown compression '{text}'")
        return compressor


def _option_value(text):
    """A reducer option's value from a command line: true/false, an int or a float."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    number = float(text)
    return int(number) if number.is_integer() else number
