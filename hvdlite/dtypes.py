"""The one table of element types: canonical name <-> numpy dtype <-> native code.

Canonical names (``"float32"``, ``"bfloat16"``...) are the extension point for the
framework adapters: an adapter maps its own dtypes to these names next to its code
(e.g. ``{torch.float32: "float32", ...}``) and calls :func:`native_code` with the name,
so the native codes stay written in exactly one place: the C header, read through cffi.

bfloat16 arrays use ``ml_dtypes.bfloat16``, numpy's de-facto bfloat16.
"""
import threading

import ml_dtypes
import numpy as np

from hvdlite.errors import InvalidArgumentError, UnsupportedDtypeError

# (canonical name, native constant in c_api.h, numpy dtype). Order is the listing order.
_TABLE = (
    ("uint8", "HVDLITE_UINT8", np.dtype(np.uint8)),
    ("int8", "HVDLITE_INT8", np.dtype(np.int8)),
    ("uint16", "HVDLITE_UINT16", np.dtype(np.uint16)),
    ("int16", "HVDLITE_INT16", np.dtype(np.int16)),
    ("int32", "HVDLITE_INT32", np.dtype(np.int32)),
    ("int64", "HVDLITE_INT64", np.dtype(np.int64)),
    ("float16", "HVDLITE_FLOAT16", np.dtype(np.float16)),
    ("bfloat16", "HVDLITE_BFLOAT16", np.dtype(ml_dtypes.bfloat16)),
    ("float32", "HVDLITE_FLOAT32", np.dtype(np.float32)),
    ("float64", "HVDLITE_FLOAT64", np.dtype(np.float64)),
    ("bool", "HVDLITE_BOOL", np.dtype(np.bool_)),
)

#: Canonical names of the supported element types.
SUPPORTED = tuple(name for name, _, _ in _TABLE)

_NUMPY_BY_NAME = {name: dt for name, _, dt in _TABLE}
_NAME_BY_NUMPY = {dt: name for name, _, dt in _TABLE}
_CONSTANT_BY_NAME = {name: const for name, const, _ in _TABLE}

_codes = None  # {name: code} and {code: name}, read from the library on first use
_codes_lock = threading.Lock()


def _code_tables():
    global _codes
    if _codes is None:
        from hvdlite._native import lib  # deferred: canonical names work without the core

        with _codes_lock:
            if _codes is None:
                by_name = {name: getattr(lib, const) for name, const in _CONSTANT_BY_NAME.items()}
                _codes = (by_name, {code: name for name, code in by_name.items()})
    return _codes


def _unsupported(tensor_name, dtype):
    label = f"tensor '{tensor_name}'" if tensor_name else "tensor"
    return UnsupportedDtypeError(
        f"{label} has unsupported dtype {dtype}; supported: {', '.join(SUPPORTED)}")


def name_of_numpy(dtype):
    """Returns the canonical name of a numpy dtype, or None if it is not supported.

    Args:
        dtype: anything ``np.dtype`` accepts.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    # Byte order matters: the core reads native-endian memory.
    if not dt.isnative:
        return None
    return _NAME_BY_NUMPY.get(dt)


def numpy_dtype(name):
    """Returns the numpy dtype for a canonical name.

    Raises:
        InvalidArgumentError: the name is not a supported type.
    """
    try:
        return _NUMPY_BY_NAME[name]
    except KeyError:
        raise _unsupported(None, name) from None


def native_code(name, tensor_name=None):
    """Returns the native dtype code (``hvdlite_dtype_t``) for a canonical name.

    Args:
        name: a canonical name from SUPPORTED, e.g. ``"float32"``.
        tensor_name: names the tensor in the error message.

    Raises:
        InvalidArgumentError: the name is not a supported type.
    """
    by_name, _ = _code_tables()
    try:
        return by_name[name]
    except KeyError:
        raise _unsupported(tensor_name, name) from None


def name_of_code(code):
    """Returns the canonical name of a native dtype code.

    Raises:
        InvalidArgumentError: the core has no such code.
    """
    _, by_code = _code_tables()
    try:
        return by_code[code]
    except KeyError:
        raise InvalidArgumentError(f"unknown native dtype code {code}") from None


def numpy_dtype_of_code(code):
    """Returns the numpy dtype for a native dtype code."""
    return _NUMPY_BY_NAME[name_of_code(code)]


def code_of_numpy(dtype, tensor_name=None):
    """Returns the native dtype code for a numpy dtype.

    Args:
        dtype: a numpy dtype (or anything ``np.dtype`` accepts).
        tensor_name: names the tensor in the error message.

    Raises:
        InvalidArgumentError: the dtype is not supported (object, complex, strings,
            non-native byte order, ...); the message lists the supported types.
    """
    name = name_of_numpy(dtype)
    if name is None:
        raise _unsupported(tensor_name, dtype)
    return native_code(name, tensor_name)
