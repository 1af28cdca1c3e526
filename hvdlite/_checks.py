"""Validation every collective shares: tensors, reduce ops, scaling, ranks, splits.

The numpy API (``hvdlite.ops``), Adasum and the framework adapters call these so that a
bad argument is refused with the same InvalidArgumentError, in the same words, whatever
the framework. Each raises before anything is enqueued.
"""
import warnings

import numpy as np

from hvdlite import core, dtypes
from hvdlite._enqueue import REDUCE_OP_NAMES, Adasum, Average, Max, Min, Sum
from hvdlite._native import lib
from hvdlite.errors import InvalidArgumentError, NotSupportedError, UnsupportedOpError

BOOL = lib.HVDLITE_BOOL


# numpy dtype -> native code, for the dtypes seen so far (a handful).
_codes = {}


def input_array(array, name, *, min_ndim=0):
    """Returns (array, dtype code) after the checks every numpy collective shares.

    Raises:
        InvalidArgumentError: unsupported dtype, not C-contiguous, too few dimensions.
    """
    arr = array if type(array) is np.ndarray else np.asarray(array)
    code = _codes.get(arr.dtype)
    if code is None:
        code = _codes[arr.dtype] = dtypes.code_of_numpy(arr.dtype, name)
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"tensor '{name}' is not C-contiguous (strides {arr.strides} for shape "
            f"{arr.shape}); pass np.ascontiguousarray(...) of it")
    if arr.ndim < min_ndim:
        raise InvalidArgumentError(
            f"tensor '{name}' must have at least {min_ndim} dimension(s), "
            f"got shape {arr.shape}")
    return arr, code


def check_reduce_op(op, is_bool, name):
    """Refuses an op that is not one of the five, or that bool tensors do not support."""
    if op == Adasum and not isinstance(op, bool):
        raise UnsupportedOpError(f"tensor '{name}': Adasum is supported by allreduce only")
    if (isinstance(op, bool) or not isinstance(op, (int, np.integer))
            or op not in REDUCE_OP_NAMES):
        raise InvalidArgumentError(
            f"tensor '{name}': op {op!r} is not one of hvdlite.Average, Sum, Min, Max, "
            "Product")
    if is_bool and op not in (Min, Max):
        raise InvalidArgumentError(
            f"tensor '{name}': bool tensors support only Min and Max, not "
            f"{REDUCE_OP_NAMES[op]}")


def check_scale(prescale, postscale, is_bool, name):
    """Refuses scale factors that are not numbers, or any scaling of bool tensors."""
    for label, value in (("prescale_factor", prescale), ("postscale_factor", postscale)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise InvalidArgumentError(
                f"tensor '{name}': {label} must be a number, not {type(value).__name__}")
    if is_bool and (prescale != 1.0 or postscale != 1.0):
        raise InvalidArgumentError(f"tensor '{name}': bool tensors cannot be scaled")


def check_reduction(op, prescale, postscale, code, name):
    """Both checks above, for a tensor of native dtype ``code`` (every reduction makes
    them together)."""
    if (type(op) is int and op in REDUCE_OP_NAMES and type(prescale) is float
            and type(postscale) is float and code != BOOL):
        return  # the usual case
    is_bool = code == BOOL
    check_reduce_op(op, is_bool, name)
    check_scale(prescale, postscale, is_bool, name)


def check_rank(value, label, name):
    """Returns ``value`` as an int after checking it is a rank of the world.

    Raises:
        InvalidArgumentError: not an int, or out of range.
    """
    size = core.size()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(
            f"tensor '{name}': {label} must be an int, not {type(value).__name__}")
    if not 0 <= value < size:
        raise InvalidArgumentError(
            f"tensor '{name}': {label} {value} is out of range for {size} rank(s)")
    return int(value)


def resolve_op(op, average):
    """Horovod's ``average=`` (deprecated) and ``op=`` arguments -> one reduce op.

    The adapters share it so that Horovod scripts passing either keep working.

    Raises:
        ValueError: both were given.
    """
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; pass only op")
    if average is not None:
        warnings.warn("the average parameter is deprecated; use op=Average or op=Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


def predivide_scaling(op, factor):
    """Horovod's ``gradient_predivide_factor`` as ``(op, prescale, postscale)``.

    Gradients are multiplied by 1/factor before the sum and by factor after it; the
    core's Average then divides by the ranks that contributed. The adapters' optimizers
    and gradient tapes share it.

    Raises:
        InvalidArgumentError: a factor other than 1 with an op other than Average.
    """
    if factor == 1.0:
        return op, 1.0, 1.0
    if op != Average:
        raise InvalidArgumentError("gradient_predivide_factor is supported only with op=Average")
    return Average, 1.0 / factor, float(factor)


def output_array(out, shape, dtype, name):
    """The result buffer: a new array, or the caller's ``out`` once checked (the shape
    and dtype given, C-contiguous, writable)."""
    if out is None:
        return np.empty(shape, dtype)
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
        raise InvalidArgumentError(
            f"tensor '{name}': out must be a numpy array of shape {shape} and dtype {dtype}")
    if not writable_contiguous(out.flags):
        raise InvalidArgumentError(f"tensor '{name}': out must be C-contiguous and writable")
    return out


def writable_contiguous(flags):
    """Whether an array with these flags can be written in place by the core."""
    return flags.c_contiguous and flags.writeable


def check_adasum_set(process_set_id, name):
    """Refuses Adasum in a process set other than the global one (NotImplementedError
    too, as Horovod's)."""
    if process_set_id != 0:
        raise NotSupportedError(
            f"tensor '{name}': Adasum runs over the global process set only, not process "
            f"set {process_set_id}")


def check_splits(splits, rows, name, size=None):
    """Checks alltoall's ``splits`` for ``size`` ranks (None: every rank)."""
    size = core.size() if size is None else size
    if splits is None:
        check_even_split(rows, size, name)
        return None
    values = np.asarray(splits)
    if values.ndim != 1 or (values.size and not np.issubdtype(values.dtype, np.integer)):
        raise InvalidArgumentError(
            f"tensor '{name}': splits must be a 1-D sequence of ints, got {splits!r}")
    if values.size != size:
        raise InvalidArgumentError(
            f"tensor '{name}': splits has {values.size} entries, expected one per rank "
            f"({size})")
    if (values < 0).any():
        raise InvalidArgumentError(f"tensor '{name}': splits {values.tolist()} has a "
                                   "negative entry")
    if int(values.sum()) != rows:
        raise InvalidArgumentError(
            f"tensor '{name}': splits {values.tolist()} sum to {int(values.sum())}, "
            f"not to the first dimension {rows}")
    return [int(v) for v in values]


def check_even_split(rows, size, name):
    """Refuses a first dimension of ``rows`` that ``size`` ranks cannot share evenly
    (an alltoall without splits).

    Raises:
        InvalidArgumentError: ``rows`` is not a multiple of ``size``.
    """
    if rows % size:
        raise InvalidArgumentError(
            f"tensor '{name}': first dimension {rows} does not divide evenly among "
            f"{size} ranks; pass splits")


def reducescatter_rows(rows, size, rank):
    """Returns how many of ``rows`` rows rank ``rank`` of ``size`` receives.

    The first ``rows % size`` ranks get one row more than the others.
    """
    return rows // size + (1 if rank < rows % size else 0)
