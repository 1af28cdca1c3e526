"""Framework-free collectives: (pointer, dtype, shape) -> Handle, and the numpy API.

Two layers:

* ``enqueue`` / ``enqueue_group`` take raw pointers, a native dtype code and a shape. The
  framework adapters (torch, TensorFlow) build on them: they validate their tensors,
  pass pointers and keep the tensors alive through the Handle.
* ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter`` (and their
  ``_async`` forms), ``barrier`` and ``join`` work on numpy arrays.

Inputs must be C-contiguous: a non-contiguous array is refused (InvalidArgumentError)
rather than copied behind the caller's back; ``np.ascontiguousarray(x)`` makes one.
Non-array inputs (Python scalars, lists) are converted with ``np.asarray``. Every numpy
function returns new arrays; the input is never modified.

Unnamed tensors are named ``"<op>.noname.<n>"`` with one counter per op kind and
process set (``"<op>.ps<id>.noname.<n>"`` in set ``id`` other than the global one),
reset by ``init()`` (and a set's by adding or removing it), so names agree across the
ranks of a set as long as they make the same unnamed calls in it in the same order.
Names must be unique among the ops in flight on a rank, whatever their process set.

Every collective takes ``process_set=`` (default: the global set, every rank); see
``hvdlite.process_sets``.
"""
import functools
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from hvdlite import dtypes, process_sets, runtime
from hvdlite._native import check, ffi, lib
from hvdlite.errors import InvalidArgumentError
from hvdlite.handle import Handle, OpHandle
from hvdlite.process_sets import global_process_set

# Reduction ops (values read from the library).
Average = lib.HVDLITE_AVERAGE
Sum = lib.HVDLITE_SUM
Min = lib.HVDLITE_MIN
Max = lib.HVDLITE_MAX
Product = lib.HVDLITE_PRODUCT
Adasum = lib.HVDLITE_ADASUM  # allreduce only; runs in hvdlite.adasum

_REDUCE_OP_NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max",
                    Product: "Product"}

# Collective kinds, also used as the prefixes of automatic names.
ALLREDUCE = lib.HVDLITE_OP_ALLREDUCE
ALLGATHER = lib.HVDLITE_OP_ALLGATHER
BROADCAST = lib.HVDLITE_OP_BROADCAST
ALLTOALL = lib.HVDLITE_OP_ALLTOALL
REDUCESCATTER = lib.HVDLITE_OP_REDUCESCATTER
BARRIER = lib.HVDLITE_OP_BARRIER
JOIN = lib.HVDLITE_OP_JOIN


class _AutoNames:
    """Per-kind and per-set counters for unnamed tensors; reset on every init(), and a
    set's when it is added or removed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counters = {}

    def next(self, kind, process_set_id=0):
        key = (kind, process_set_id)
        with self._lock:
            n = self._counters.get(key, 0)
            self._counters[key] = n + 1
        if process_set_id:
            return f"{kind}.ps{process_set_id}.noname.{n}"
        return f"{kind}.noname.{n}"

    def reset(self, process_set_id=None):
        with self._lock:
            if process_set_id is None:
                self._counters.clear()
            else:
                for key in [k for k in self._counters if k[1] == process_set_id]:
                    del self._counters[key]


_auto_names = _AutoNames()
runtime.add_init_hook(_auto_names.reset)
process_sets.add_change_hook(_auto_names.reset)


def auto_name(kind, process_set_id=0):
    """Returns the next automatic name for an op kind in a process set, e.g.
    ``"allreduce.noname.3"``.

    Adapters use it so their unnamed tensors follow the same rule as numpy ones.
    """
    return _auto_names.next(kind, process_set_id)


def _resolve_name(kind, name, process_set_id=0):
    _attempt.process_set_id = process_set_id
    if type(name) is str and name and "\0" not in name:
        _attempt.names = (name,)
        return name  # the usual case
    if name is None:
        name = auto_name(kind, process_set_id)
        _attempt.names = (name,)
        return name
    if not isinstance(name, str):
        raise InvalidArgumentError(f"tensor name must be a str, not {type(name).__name__}")
    if not name or "\0" in name:
        raise InvalidArgumentError(f"tensor name {name!r} must be non-empty and have no NUL")
    return name


# -- refusals ----------------------------------------------------------------------------
#
# A call this rank refuses (a bad tensor) is an op the other ranks may well have
# submitted: left alone, they would wait for it until a stall timeout. So a refused call
# tells the coordinator (hvdlite_refuse), which fails that tensor on every rank that
# submits it, naming this rank and the reason. The names are those the call resolved
# before it failed, automatic names included: the counters advance on every rank alike.

# The names the current call on this thread resolved (a group's member names), and the
# id of their process set.
_attempt = threading.local()


def note_names(names, process_set_id=0):
    """Records a group's member names as the current call's (see ``refusing``)."""
    _attempt.names = tuple(names)
    _attempt.process_set_id = process_set_id


def refuse(op, names, reason, process_set_id=0):
    """Tells the other ranks that this rank refuses the op ``op`` of these tensors.

    Best effort: a failure to send it (e.g. not initialized) is ignored, since the
    caller is raising its own error anyway.
    """
    text = str(reason).encode("utf-8", "replace")[:4096]
    for name in names:
        lib.hvdlite_refuse(op, _c_name(name), process_set_id, text)


def refusing(op):
    """Decorates a collective so that an InvalidArgumentError it raises (for a tensor
    whose name it had resolved) is also sent to the other ranks as a refusal.

    Nested decorated calls send it once.
    """
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            _attempt.names = ()
            try:
                return fn(*args, **kwargs)
            except InvalidArgumentError as error:
                _refused(op, error)
                raise
        return call
    return wrap


def _check_adasum_set(process_set_id, name):
    if process_set_id != 0:
        raise InvalidArgumentError(
            f"tensor '{name}': Adasum runs over the global process set only, not process "
            f"set {process_set_id}")


def _refused(op, error):
    if not getattr(error, "refusal_sent", False):
        error.refusal_sent = True
        refuse(op, getattr(_attempt, "names", ()), error,
               getattr(_attempt, "process_set_id", 0))


@dataclass
class TensorSpec:
    """One tensor for ``enqueue_group``: the fields of ``hvdlite_tensor_t``.

    ``input`` and ``output`` are addresses (int), cffi pointers, or None for NULL.
    """

    op: int
    name: str
    dtype: int
    shape: Sequence[int]
    input: Any
    output: Any = None
    reduce_op: int = Average
    prescale: float = 1.0
    postscale: float = 1.0
    root_rank: int = 0
    splits: Optional[Sequence[int]] = None
    process_set_id: int = 0
    device: int = -1


# Pointers by address: a framework's tensors keep their memory from step to step, and a
# cast costs several times a lookup. A pointer references nothing, so an entry for
# memory since freed is harmless. Bounded like the caches below.
_pointers = {}


def pointer_at(address):
    """``ffi.cast("void *", address)``, kept for the next call with that address."""
    p = _pointers.get(address)
    if p is None:
        p = ffi.cast("void *", address)
        _remember(_pointers, address, p)
    return p


def _pointer(p):
    if p is None:
        return ffi.NULL
    if isinstance(p, ffi.CData):
        return p
    return pointer_at(p)


_OK = lib.HVDLITE_OK
_BOOL = lib.HVDLITE_BOOL
# Looked up once: the per-tensor path calls them for every gradient of every step.
_enqueue_buffers = lib.hvdlite_enqueue_buffers
# An array's memory as a cffi pointer (several times cheaper than ``arr.ctypes.data``;
# the pointer references the array).
_from_buffer = ffi.from_buffer

# Names and shapes repeat every training step; their C copies are reused (the core
# copies both at enqueue, so sharing them between calls is safe). Bounded, so that
# automatically named tensors cannot grow it without end.
_C_CACHE_LIMIT = 1 << 12
_c_names = {}
_c_shapes = {}


def _c_name(name):
    c = _c_names.get(name)
    if c is None:
        c = ffi.new("char[]", name.encode("utf-8"))
        _remember(_c_names, name, c)
    return c


def _c_shape(shape):
    key = tuple(shape)
    c = _c_shapes.get(key)
    if c is None:
        c = ffi.new("int64_t[]", [int(d) for d in key] or [0])
        _remember(_c_shapes, key, c)
    return c


def _remember(cache, key, value):
    # A full cache starts over, so that names used once (automatic names, say) cannot
    # keep the ones every step repeats out of it for good.
    if len(cache) >= _C_CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def _fill(struct, op, name, dtype, shape, input, output, reduce_op, prescale, postscale,
          root_rank, splits, process_set_id, device):
    """Fills one hvdlite_tensor_t.

    Returns the cffi objects the struct points to, which must stay referenced until the
    enqueue call returns (the core copies name, shape and splits at enqueue).
    """
    c_name = _c_name(name)
    c_shape = _c_shape(shape)
    c_splits = ffi.NULL
    if splits is not None:
        c_splits = ffi.new("int64_t[]", [int(s) for s in splits] or [0])
    struct.name = c_name
    struct.op = op
    struct.dtype = dtype
    struct.ndim = len(shape)
    struct.shape = c_shape
    struct.input = _pointer(input)
    struct.output = _pointer(output)
    struct.reduce_op = reduce_op
    struct.prescale_factor = prescale
    struct.postscale_factor = postscale
    struct.root_rank = root_rank
    struct.splits = c_splits
    struct.process_set_id = process_set_id
    struct.device = device
    return c_name, c_shape, c_splits


def enqueue(op, name, dtype_code, shape, input_ptr, output_ptr=None, *, reduce_op=Average,
            prescale=1.0, postscale=1.0, root_rank=0, splits=None, process_set_id=0,
            device=-1, keepalive=(), finisher=None, result=None):
    """Enqueues one tensor with the core; returns at once.

    The caller has validated the tensor; the core checks what it can (and names in
    flight, and agreement across ranks during negotiation).

    Args:
        op: the collective (ALLREDUCE, ALLGATHER, ...).
        name: the tensor's name, equal across ranks.
        dtype_code: a native dtype code (see ``dtypes.native_code``).
        shape: the dimensions (empty for a scalar).
        input_ptr: address of the C-contiguous input (int or cffi pointer).
        output_ptr: address of the result for ALLREDUCE, BROADCAST, REDUCESCATTER (may
            equal input_ptr); None for ALLGATHER and ALLTOALL (the core allocates it).
        reduce_op, prescale, postscale: for ALLREDUCE and REDUCESCATTER.
        root_rank: for BROADCAST.
        splits: for ALLTOALL: rows sent to each rank (size() entries) or None.
        process_set_id: 0 for all ranks.
        device: -1 for host memory, else the device ordinal.
        keepalive: objects (the tensors) referenced until the op has ended.
        finisher: ``finisher(handle) -> result``, run once after success.
        result: what the Handle returns on success when there is no finisher (the
            output the core writes into).

    Returns:
        A Handle.

    Raises:
        NotInitializedError, InvalidArgumentError, DuplicateNameError: refused by the
            core; nothing was enqueued.
    """
    if splits is None:
        return enqueue_fields(op, name, dtype_code, tuple(shape), _pointer(input_ptr),
                              _pointer(output_ptr), reduce_op, prescale, postscale,
                              root_rank, process_set_id, device, keepalive, finisher,
                              result)
    out = ffi.new("hvdlite_handle_t *")
    struct = ffi.new("hvdlite_tensor_t *")
    keep = _fill(struct, op, name, dtype_code, shape, input_ptr, output_ptr, reduce_op,
                 prescale, postscale, root_rank, splits, process_set_id, device)
    check(lib.hvdlite_enqueue(struct, out))
    return Handle([out[0]], finisher, (keepalive, keep), name, result)


# A training step submits the same tensors, with the same properties, every step. Each
# one's hvdlite_tensor_t is filled once and kept here, keyed by those properties, with
# the objects it points to; a call then hands the core only its buffers
# (hvdlite_enqueue_buffers). Bounded like the caches above.
_templates = {}
# The out cell of hvdlite_enqueue_buffers, one per thread: allocating one per call would
# cost more than the enqueue itself.
_cells = threading.local()


def _template(op, name, dtype, shape, reduce_op, prescale, postscale, root_rank,
              process_set_id, device):
    """The kept struct of a tensor (with what it points to), filled on first use."""
    key = (op, name, dtype, shape, reduce_op, prescale, postscale, root_rank, process_set_id,
           device)
    template = _templates.get(key)
    # 0.0 and -0.0 are one key, yet the sign of a zero factor shows in the results.
    if template is None or not prescale or not postscale:
        struct = ffi.new("hvdlite_tensor_t *")
        keep = _fill(struct, op, name, dtype, shape, None, None, reduce_op, prescale,
                     postscale, root_rank, None, process_set_id, device)
        template = (struct, keep)
        _remember(_templates, key, template)
    return template


def _submit(template, input_ptr, output_ptr, keepalive, finisher, name, result):
    """Enqueues a kept struct with these buffers; returns the Handle."""
    try:
        cell = _cells.handle
    except AttributeError:
        cell = _cells.handle = ffi.new("hvdlite_handle_t *")
    status = _enqueue_buffers(template[0], input_ptr, output_ptr, cell)
    if status != _OK:
        check(status)
    if finisher is None:
        return OpHandle(cell[0], keepalive, name, result)
    return Handle([cell[0]], finisher, keepalive, name, result)


def enqueue_fields(op, name, dtype_code, shape, input_ptr, output_ptr, reduce_op, prescale,
                   postscale, root_rank, process_set_id, device, keepalive, finisher, result):
    """``enqueue`` of one tensor without splits, every argument given in order: the
    per-tensor path (a training step's gradients), several times cheaper than a struct
    filled per call and keyword arguments. ``input_ptr`` and ``output_ptr`` are cffi
    pointers (``ffi.from_buffer`` of an array, ``ffi.cast("void *", address)``)."""
    return _submit(_template(op, name, dtype_code, shape, reduce_op, prescale, postscale,
                             root_rank, process_set_id, device),
                   input_ptr, output_ptr, keepalive, finisher, name, result)


def enqueue_group(specs, *, name=None, keepalive=(), finisher=None, result=None):
    """Enqueues tensors that are negotiated and executed together; all or nothing.

    Args:
        specs: TensorSpec objects.
        name: a label for the Handle (e.g. the group's name).
        keepalive: objects referenced until every op has ended.
        finisher: ``finisher(handle) -> result``, run once after all succeeded.
        result: what the Handle returns on success when there is no finisher.

    Returns:
        One Handle for the whole group.

    Raises:
        NotInitializedError, InvalidArgumentError, DuplicateNameError: refused by the
            core; none was enqueued.
    """
    specs = list(specs)
    if not specs:
        # Nothing to negotiate; still a Handle so callers need no special case.
        return Handle([], finisher, keepalive, name, result)
    keep = []
    structs = ffi.new("hvdlite_tensor_t[]", len(specs))
    for i, q in enumerate(specs):
        keep.append(_fill(structs[i], q.op, q.name, q.dtype, q.shape, q.input, q.output,
                          q.reduce_op, q.prescale, q.postscale, q.root_rank, q.splits,
                          q.process_set_id, q.device))
    handles = ffi.new("hvdlite_handle_t[]", len(specs))
    check(lib.hvdlite_enqueue_group(structs, len(specs), handles))
    return Handle(list(handles), finisher, (keepalive, keep), name, result)


# -- numpy front end ---------------------------------------------------------------------


# numpy dtype -> native code, for the dtypes seen so far (a handful).
_codes = {}


def _input_array(array, name, *, min_ndim=0):
    """Returns (array, dtype code) after the checks every numpy collective shares."""
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


def _check_reduce_op(op, is_bool, name):
    """Refuses an op that is not one of the five, or that bool tensors do not support."""
    if op == Adasum and not isinstance(op, bool):
        raise InvalidArgumentError(f"tensor '{name}': Adasum is supported by allreduce only")
    if (isinstance(op, bool) or not isinstance(op, (int, np.integer))
            or op not in _REDUCE_OP_NAMES):
        raise InvalidArgumentError(
            f"tensor '{name}': op {op!r} is not one of hvdlite.Average, Sum, Min, Max, "
            "Product")
    if is_bool and op not in (Min, Max):
        raise InvalidArgumentError(
            f"tensor '{name}': bool tensors support only Min and Max, not "
            f"{_REDUCE_OP_NAMES[op]}")


def _check_scale(prescale, postscale, is_bool, name):
    """Refuses scale factors that are not numbers, or any scaling of bool tensors."""
    for label, value in (("prescale_factor", prescale), ("postscale_factor", postscale)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise InvalidArgumentError(
                f"tensor '{name}': {label} must be a number, not {type(value).__name__}")
    if is_bool and (prescale != 1.0 or postscale != 1.0):
        raise InvalidArgumentError(f"tensor '{name}': bool tensors cannot be scaled")


def _check_reduction(op, prescale, postscale, code, name):
    """Both checks above, for a tensor of native dtype ``code`` (every reduction makes
    them together)."""
    if (type(op) is int and op in _REDUCE_OP_NAMES and type(prescale) is float
            and type(postscale) is float and code != _BOOL):
        return  # the usual case
    is_bool = code == _BOOL
    _check_reduce_op(op, is_bool, name)
    _check_scale(prescale, postscale, is_bool, name)


def _check_rank(value, label, name):
    size = runtime.size()
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


def _output_array(out, shape, dtype, name):
    """The result buffer: a new array, or the caller's ``out`` once checked (the shape
    and dtype given, C-contiguous, writable)."""
    if out is None:
        return np.empty(shape, dtype)
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
        raise InvalidArgumentError(
            f"tensor '{name}': out must be a numpy array of shape {shape} and dtype {dtype}")
    if not _writable_contiguous(out.flags):
        raise InvalidArgumentError(f"tensor '{name}': out must be C-contiguous and writable")
    return out


def _writable_contiguous(flags):
    return flags.c_contiguous and flags.writeable


# The per-step path. A training loop calls allreduce_async with the same array, name and
# arguments every step: what a name's last call checked and built (the dtype, the C
# struct, the buffers' addresses) still holds while the array (and the out array) are
# the same objects, with the same dtype and shape, and the arguments are the same
# objects. The addresses are kept as plain pointers, which reference nothing: the
# Handle keeps the arrays alive while the core uses them, and the entry here only weak
# references. That an array object keeps its memory rests on numpy: it refuses to
# reassign ``ndarray.data`` and to resize an array that has a weak reference (so an
# array, or out array, once used here cannot be resized in place). The one way left,
# ``ndarray.__setstate__`` on a live array (pickle only calls it on new ones), is not
# supported between two calls under one name. Bounded like the caches above.
_repeats = {}


class _Repeat:
    __slots__ = ("array", "out", "op", "prescale", "postscale", "process_set", "psid", "dtype",
                 "shape", "template", "input_ptr", "output_ptr")

    def __init__(self, array, out, op, prescale, postscale, process_set, template):
        self.array = weakref.ref(array)
        self.op, self.prescale, self.postscale = op, prescale, postscale
        self.process_set, self.psid = process_set, process_set.process_set_id
        self.dtype, self.shape = array.dtype, array.shape
        self.template = template
        self.input_ptr = ffi.cast("void *", _from_buffer(array))
        self.keep_output(out)

    def keep_output(self, out):
        """Remembers ``out`` (checked) as the result buffer; returns its pointer."""
        self.out = weakref.ref(out)
        self.output_ptr = ffi.cast("void *", _from_buffer(out))
        return self.output_ptr


def allreduce_async(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                    out=None, process_set=global_process_set):
    """Starts an allreduce of ``array`` across ranks; returns a Handle at once.

    Args:
        array: a C-contiguous numpy array (or array-like) of a supported dtype.
        name: the tensor's name, equal across ranks; None names it automatically.
        op: Average, Sum, Min, Max, Product (bool arrays: Min or Max only), or Adasum
            (floating-point arrays; see ``hvdlite.adasum``).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        out: an array of the same shape and dtype to write the result into (it may be
            ``array`` itself, for an in-place reduction); None allocates a new one.
        process_set: the ProcessSet whose members reduce (this rank must be one);
            Average divides by its size.

    Returns:
        A Handle whose result is ``out`` or a new array of the same shape and dtype.

    Raises:
        InvalidArgumentError: bad dtype, layout, op or scaling.
        DuplicateNameError: a tensor of that name is in flight.
        NotInitializedError: before init() or after shutdown().
    """
    last = _repeats.get(name) if type(name) is str else None
    if (last is not None and last.array() is array and last.op is op
            and last.prescale is prescale_factor and last.postscale is postscale_factor
            and last.process_set is process_set and process_set.process_set_id == last.psid
            and array.dtype is last.dtype and array.shape == last.shape
            and array.flags.c_contiguous):
        if (out is not None and last.out() is out and out.dtype is last.dtype
                and out.shape == last.shape and _writable_contiguous(out.flags)):
            output_ptr = last.output_ptr
        elif out is None:  # a new array each call: nothing to keep
            out = _output_array(None, last.shape, last.dtype, name)
            output_ptr = _from_buffer(out)
        else:
            out = _output_array(out, last.shape, last.dtype, name)
            output_ptr = last.keep_output(out)
        return _submit(last.template, last.input_ptr, output_ptr, (array, out), None, name,
                       out)
    named = name is not None
    _attempt.names = ()
    try:
        psid = process_sets.process_set_id(process_set)
        name = _resolve_name("allreduce", name, psid)
        if op == Adasum:
            _check_adasum_set(psid, name)
            from hvdlite import adasum
            return adasum.allreduce_async(array, name, prescale_factor, postscale_factor, out)
        arr, code = _input_array(array, name)
        _check_reduction(op, prescale_factor, postscale_factor, code, name)
        out = _output_array(out, arr.shape, arr.dtype, name)
        template = _template(ALLREDUCE, name, code, arr.shape, op, prescale_factor,
                             postscale_factor, 0, psid, -1)
        handle = _submit(template, _from_buffer(arr), _from_buffer(out), (arr, out), None,
                         name, out)
    except InvalidArgumentError as error:
        _refused(ALLREDUCE, error)
        raise
    if named and arr is array:
        _remember(_repeats, name, _Repeat(arr, out, op, prescale_factor, postscale_factor,
                                          process_set, template))
    return handle


def allreduce(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
              out=None, process_set=global_process_set):
    """Reduces ``array`` across ranks and returns the result as a new array (or ``out``).

    See ``allreduce_async`` for the arguments.

    Returns:
        A new array of the same shape and dtype.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: as for
            ``allreduce_async``.
        HorovodInternalError: the collective failed (e.g. MismatchError across ranks).
    """
    return synchronize(allreduce_async(array, name, op, prescale_factor, postscale_factor, out,
                                       process_set))


@refusing(ALLREDUCE)
def grouped_allreduce_async(arrays, name=None, op=Average, prescale_factor=1.0,
                            postscale_factor=1.0, outs=None, process_set=global_process_set):
    """Starts allreduces of several arrays that are negotiated and run together.

    Args:
        arrays: a sequence of arrays (each as for ``allreduce_async``).
        name: the group's name; tensor i is named ``"<name>.<i>"``. None names the group
            automatically.
        op, prescale_factor, postscale_factor: as for ``allreduce_async``, for all.
        outs: one result buffer per array (each as ``allreduce_async``'s ``out``), or
            None for new arrays.
        process_set: as for ``allreduce_async``.

    Returns:
        A Handle whose result is the list of results, in order.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: as for
            ``allreduce_async``; nothing is enqueued if any array is refused.
    """
    psid = process_sets.process_set_id(process_set)
    group, arrays, _ = _group_members("grouped_allreduce", arrays, name, outs, psid)
    if op == Adasum:
        _check_adasum_set(psid, group)
        from hvdlite import adasum
        return adasum.grouped_allreduce_async(arrays, group, prescale_factor,
                                              postscale_factor, outs)
    return _enqueue_grouped_reduction(ALLREDUCE, group, arrays, outs, op, prescale_factor,
                                      postscale_factor, psid, lambda shape: shape, min_ndim=0)


def _enqueue_grouped_reduction(kind, group, arrays, outs, op, prescale_factor,
                               postscale_factor, psid, result_shape, min_ndim):
    """Enqueues a group of reductions of ``kind``; array i is ``"<group>.<i>"``.

    ``result_shape`` maps an input's shape to its result's (allreduce: the same;
    reducescatter: this rank's rows).
    """
    specs, keep, results = [], [], []
    for i, array in enumerate(arrays):
        tensor_name = f"{group}.{i}"
        arr, code = _input_array(array, tensor_name, min_ndim=min_ndim)
        _check_reduction(op, prescale_factor, postscale_factor, code, tensor_name)
        out = _output_array(None if outs is None else outs[i], result_shape(arr.shape),
                            arr.dtype, tensor_name)
        specs.append(TensorSpec(kind, tensor_name, code, arr.shape, _from_buffer(arr),
                                _from_buffer(out), op, prescale_factor, postscale_factor,
                                process_set_id=psid))
        keep += [arr, out]
        results.append(out)
    return enqueue_group(specs, name=group, keepalive=keep, result=results)


def grouped_allreduce(arrays, name=None, op=Average, prescale_factor=1.0,
                      postscale_factor=1.0, outs=None, process_set=global_process_set):
    """Reduces several arrays together; returns the list of results.

    See ``grouped_allreduce_async`` for the arguments and errors.
    """
    return synchronize(grouped_allreduce_async(arrays, name, op, prescale_factor,
                                               postscale_factor, outs, process_set))


@refusing(ALLGATHER)
def allgather_async(array, name=None, process_set=global_process_set):
    """Starts concatenating every rank's ``array`` along the first dimension.

    Ranks may differ in the first dimension; the other dimensions must agree.

    Args:
        array: a C-contiguous array with at least one dimension.
        name: the tensor's name, equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members' arrays are concatenated, in the
            order of their ranks.

    Returns:
        A Handle whose result has shape ``(sum of first dims, *array.shape[1:])``.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
    """
    psid = process_sets.process_set_id(process_set)
    name = _resolve_name("allgather", name, psid)
    arr, code = _input_array(array, name, min_ndim=1)
    trailing = arr.shape[1:]

    def finish(handle):
        return handle.output_array(0, arr.dtype, trailing)

    return enqueue(ALLGATHER, name, code, arr.shape, _from_buffer(arr), None,
                   process_set_id=psid, keepalive=(arr,), finisher=finish)


def allgather(array, name=None, process_set=global_process_set):
    """Concatenates every rank's ``array`` along the first dimension.

    See ``allgather_async``; raises HorovodInternalError subclasses if it fails.
    """
    return synchronize(allgather_async(array, name, process_set))


@refusing(BROADCAST)
def broadcast_async(array, root_rank, name=None, out=None, process_set=global_process_set):
    """Starts sending ``array`` from ``root_rank`` to every rank.

    Args:
        array: a C-contiguous array; same shape and dtype on every rank.
        root_rank: the rank whose values everyone receives (a global rank, a member
            of ``process_set``).
        name: the tensor's name, equal across ranks; None names it automatically.
        out: an array of the same shape and dtype for the result, or None for a new one.
        process_set: the ProcessSet whose members receive.

    Returns:
        A Handle whose result (``out`` or a new array) holds the root's values.

    Raises:
        InvalidArgumentError: bad dtype, layout or root_rank out of range.
        DuplicateNameError, NotInitializedError: refused.
    """
    psid = process_sets.process_set_id(process_set)
    name = _resolve_name("broadcast", name, psid)
    arr, code = _input_array(array, name)
    root = _check_rank(root_rank, "root_rank", name)
    out = _output_array(out, arr.shape, arr.dtype, name)
    return enqueue(BROADCAST, name, code, arr.shape, _from_buffer(arr), _from_buffer(out),
                   root_rank=root, process_set_id=psid, keepalive=(arr, out), result=out)


def broadcast(array, root_rank, name=None, out=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``array`` on every rank (in ``out`` or a new array).

    See ``broadcast_async``; raises HorovodInternalError subclasses if it fails.
    """
    return synchronize(broadcast_async(array, root_rank, name, out, process_set))


def _check_splits(splits, rows, name, size=None):
    """Checks alltoall's ``splits`` for ``size`` ranks (None: every rank)."""
    size = runtime.size() if size is None else size
    if splits is None:
        if rows % size:
            raise InvalidArgumentError(
                f"tensor '{name}': first dimension {rows} does not divide evenly among "
                f"{size} ranks; pass splits")
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


@refusing(ALLTOALL)
def alltoall_async(array, splits=None, name=None, process_set=global_process_set):
    """Starts an all-to-all: rows ``splits[r]`` of ``array`` go to rank r.

    Args:
        array: a C-contiguous array with at least one dimension.
        splits: rows for each rank, in rank order (size() entries summing to the first
            dimension; in a process set, one per member); None splits the first
            dimension evenly.
        name: the tensor's name, equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members exchange.

    Returns:
        A Handle whose result is ``(received, received_splits)``: the rows from every
        rank in rank order, and how many came from each (np.int64 array).

    Raises:
        InvalidArgumentError: bad dtype, layout or splits.
        DuplicateNameError, NotInitializedError: refused.
    """
    psid = process_sets.process_set_id(process_set)
    name = _resolve_name("alltoall", name, psid)
    arr, code = _input_array(array, name, min_ndim=1)
    size, _ = process_sets.members(process_set)
    checked = _check_splits(splits, arr.shape[0], name, size)
    trailing = arr.shape[1:]

    def finish(handle):
        return handle.output_array(0, arr.dtype, trailing), handle.recv_splits(0, size)

    return enqueue(ALLTOALL, name, code, arr.shape, _from_buffer(arr), None, splits=checked,
                   process_set_id=psid, keepalive=(arr,), finisher=finish)


def alltoall(array, splits=None, name=None, process_set=global_process_set):
    """All-to-all exchange; returns ``(received, received_splits)``.

    See ``alltoall_async``; raises HorovodInternalError subclasses if it fails.
    """
    return synchronize(alltoall_async(array, splits, name, process_set))


def reducescatter_rows(rows, size, rank):
    """Returns how many of ``rows`` rows rank ``rank`` of ``size`` receives.

    The first ``rows % size`` ranks get one row more than the others.
    """
    return rows // size + (1 if rank < rows % size else 0)


@refusing(REDUCESCATTER)
def reducescatter_async(array, name=None, op=Average, prescale_factor=1.0,
                        postscale_factor=1.0, out=None, process_set=global_process_set):
    """Starts a reduction whose result is scattered by rows among the ranks.

    Args:
        array: a C-contiguous array with at least one dimension, same shape everywhere.
        name: the tensor's name, equal across ranks; None names it automatically.
        op, prescale_factor, postscale_factor: as for ``allreduce_async``.
        out: an array for this rank's rows (shape as described below, same dtype), or
            None for a new one.
        process_set: the ProcessSet whose members reduce and share the rows.

    Returns:
        A Handle whose result holds this rank's rows of the reduction: the first
        dimension d0 is split so that the first ``d0 % size()`` ranks get one row more.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
    """
    psid = process_sets.process_set_id(process_set)
    name = _resolve_name("reducescatter", name, psid)
    arr, code = _input_array(array, name, min_ndim=1)
    _check_reduction(op, prescale_factor, postscale_factor, code, name)
    rows = reducescatter_rows(arr.shape[0], *process_sets.members(process_set))
    out = _output_array(out, (rows,) + arr.shape[1:], arr.dtype, name)
    return enqueue(REDUCESCATTER, name, code, arr.shape, _from_buffer(arr), _from_buffer(out),
                   reduce_op=op, prescale=prescale_factor, postscale=postscale_factor,
                   process_set_id=psid, keepalive=(arr, out), result=out)


def reducescatter(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                  out=None, process_set=global_process_set):
    """Reduces ``array`` across ranks and returns this rank's rows (in ``out`` or a new
    array).

    See ``reducescatter_async``; raises HorovodInternalError subclasses if it fails.
    """
    return synchronize(reducescatter_async(array, name, op, prescale_factor,
                                           postscale_factor, out, process_set))


def _group_members(kind, arrays, name, outs=None, process_set_id=0):
    """Resolves a group's name; returns (group, arrays as a list, member names), after
    checking there is one out per array when outs are given."""
    group = _resolve_name(kind, name, process_set_id)
    arrays = list(arrays)
    names = [f"{group}.{i}" for i in range(len(arrays))]
    note_names(names, process_set_id)
    if outs is not None and len(outs) != len(arrays):
        raise InvalidArgumentError(
            f"group '{group}': {len(outs)} outs for {len(arrays)} arrays")
    return group, arrays, names


@refusing(ALLGATHER)
def grouped_allgather_async(arrays, name=None, process_set=global_process_set):
    """Starts allgathers of several arrays that are negotiated and run together.

    Args:
        arrays: a sequence of arrays (each as for ``allgather_async``).
        name: the group's name; array i is named ``"<name>.<i>"``. None names the group
            automatically.
        process_set: as for ``allgather_async``.

    Returns:
        A Handle whose result is the list of gathered arrays, in order.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: as for
            ``allgather_async``; nothing is enqueued if any array is refused.
    """
    psid = process_sets.process_set_id(process_set)
    group, arrays, names = _group_members("grouped_allgather", arrays, name, None, psid)
    specs, keep, layouts = [], [], []
    for array, tensor_name in zip(arrays, names):
        arr, code = _input_array(array, tensor_name, min_ndim=1)
        specs.append(TensorSpec(ALLGATHER, tensor_name, code, arr.shape, _from_buffer(arr),
                                process_set_id=psid))
        keep.append(arr)
        layouts.append((arr.dtype, arr.shape[1:]))

    def finish(handle):
        return [handle.output_array(i, dt, trailing) for i, (dt, trailing) in enumerate(layouts)]

    return enqueue_group(specs, name=group, keepalive=keep, finisher=finish)


def grouped_allgather(arrays, name=None, process_set=global_process_set):
    """Gathers several arrays together; returns the list of results.

    See ``grouped_allgather_async`` for the arguments and errors.
    """
    return synchronize(grouped_allgather_async(arrays, name, process_set))


@refusing(REDUCESCATTER)
def grouped_reducescatter_async(arrays, name=None, op=Average, prescale_factor=1.0,
                                postscale_factor=1.0, outs=None,
                                process_set=global_process_set):
    """Starts reducescatters of several arrays that are negotiated and run together.

    Args:
        arrays: a sequence of arrays (each as for ``reducescatter_async``).
        name: the group's name; array i is named ``"<name>.<i>"``. None names the group
            automatically.
        op, prescale_factor, postscale_factor: as for ``reducescatter_async``, for all.
        outs: one result buffer per array (each as ``reducescatter_async``'s ``out``), or
            None for new arrays.
        process_set: as for ``reducescatter_async``.

    Returns:
        A Handle whose result is the list of this rank's rows of each reduction.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: as for
            ``reducescatter_async``; nothing is enqueued if any array is refused.
    """
    psid = process_sets.process_set_id(process_set)
    group, arrays, _ = _group_members("grouped_reducescatter", arrays, name, outs, psid)
    size, rank = process_sets.members(process_set)

    def my_rows(shape):
        return (reducescatter_rows(shape[0], size, rank),) + tuple(shape[1:])

    return _enqueue_grouped_reduction(REDUCESCATTER, group, arrays, outs, op, prescale_factor,
                                      postscale_factor, psid, my_rows, min_ndim=1)


def grouped_reducescatter(arrays, name=None, op=Average, prescale_factor=1.0,
                          postscale_factor=1.0, outs=None, process_set=global_process_set):
    """Reduces several arrays together, each scattered by rows; returns this rank's parts.

    See ``grouped_reducescatter_async`` for the arguments and errors.
    """
    return synchronize(grouped_reducescatter_async(arrays, name, op, prescale_factor,
                                                   postscale_factor, outs, process_set))


def _no_tensor_op(op, kind, finisher=None, process_set=global_process_set):
    # BARRIER and JOIN carry no data; a one-byte scalar gives the core a valid pointer.
    psid = process_sets.process_set_id(process_set)
    dummy = np.zeros((), dtype=np.uint8)
    return enqueue(op, auto_name(kind, psid), dtypes.native_code("uint8"), (),
                   _from_buffer(dummy), None, process_set_id=psid, keepalive=(dummy,),
                   finisher=finisher)


def barrier(process_set=global_process_set):
    """Blocks until every rank (of ``process_set``) has called ``barrier()``.

    Raises:
        NotInitializedError: before init() or after shutdown().
        HorovodInternalError: the barrier failed (e.g. a rank is gone).
    """
    synchronize(_no_tensor_op(BARRIER, "barrier", process_set=process_set))


def join():
    """Declares that this rank has no more data; returns when every rank has joined.

    Until then this rank takes part in the other ranks' allreduces with zeros (Average
    still divides by every rank, as in Horovod), so ranks may run different numbers of
    steps. Any other collective submitted while a rank has joined fails with
    AbortedError on the ranks that submitted it, as Horovod's do.

    Returns:
        The rank that joined last: the same value on every rank.

    Raises:
        NotInitializedError: before init() or after shutdown().
        HorovodInternalError: the join failed.
    """
    return synchronize(_no_tensor_op(JOIN, "join", finisher=lambda h: h.output(0)[2]))


def poll(handle):
    """Returns True once the op behind ``handle`` has ended; never blocks."""
    return handle.poll()


def synchronize(handle, timeout=None):
    """Waits for the op behind ``handle`` and returns its result.

    Args:
        handle: a Handle from an ``*_async`` call.
        timeout: seconds to wait at most; None waits until the op ends.

    Returns:
        The op's result (see the ``*_async`` function that made the handle).

    Raises:
        WaitTimeoutError: ``timeout`` passed; the op goes on.
        HorovodInternalError: the collective failed (MismatchError, ShutdownError,
            StalledError, TransportError, RankFailedError) on this rank.
    """
    return handle.wait(timeout)
