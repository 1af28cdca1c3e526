"""The C-struct enqueue layer: (pointer, native dtype code, shape) -> Handle.

The framework adapters and the numpy API (``hvdlite.ops``) build on it: they validate
their tensors (``hvdlite._checks``), pass pointers and keep the tensors alive through the
Handle. Here are the op kinds and reduction ops (values read from the library), one
tensor's fields (``TensorSpec``), and the structs kept from step to step so that a
training step's repeated tensors cost a lookup, not a fill.
"""
import math
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from hvdlite import errors
from hvdlite._native import check, ffi, lib
from hvdlite.handle import _WAIT_SLICE_S, Handle, OpHandle, _orphans, reap_orphans

# Reduction ops (values read from the library).
Average = lib.HVDLITE_AVERAGE
Sum = lib.HVDLITE_SUM
Min = lib.HVDLITE_MIN
Max = lib.HVDLITE_MAX
Product = lib.HVDLITE_PRODUCT
Adasum = lib.HVDLITE_ADASUM  # allreduce only; runs in hvdlite.adasum

REDUCE_OP_NAMES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max",
                   Product: "Product"}

# Collective kinds, also used as the prefixes of automatic names.
ALLREDUCE = lib.HVDLITE_OP_ALLREDUCE
ALLGATHER = lib.HVDLITE_OP_ALLGATHER
BROADCAST = lib.HVDLITE_OP_BROADCAST
ALLTOALL = lib.HVDLITE_OP_ALLTOALL
REDUCESCATTER = lib.HVDLITE_OP_REDUCESCATTER
BARRIER = lib.HVDLITE_OP_BARRIER
JOIN = lib.HVDLITE_OP_JOIN


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
    ready_event: Any = None


# Pointers by address: a framework's tensors keep their memory from step to step, and a
# cast costs several times a lookup. A pointer references nothing, so an entry for
# memory since freed is harmless. Bounded like the caches below.
_pointers = {}


def pointer_at(address):
    """``ffi.cast("void *", address)``, kept for the next call with that address."""
    p = _pointers.get(address)
    if p is None:
        p = ffi.cast("void *", address)
        remember(_pointers, address, p)
    return p


def pointer(p):
    """A cffi pointer for an address (int), a cffi pointer, or None (NULL)."""
    if p is None:
        return ffi.NULL
    if isinstance(p, ffi.CData):
        return p
    return pointer_at(p)


_OK = lib.HVDLITE_OK
# Looked up once: the per-tensor path calls them for every gradient of every step.
_enqueue_buffers = lib.hvdlite_enqueue_buffers
_enqueue_buffers_wait = lib.hvdlite_enqueue_buffers_wait
# An array's memory as a cffi pointer (several times cheaper than ``arr.ctypes.data``;
# the pointer references the array).
from_buffer = ffi.from_buffer

# Names and shapes repeat every training step; their C copies are reused (the core
# copies both at enqueue, so sharing them between calls is safe). Bounded, so that
# automatically named tensors cannot grow it without end.
C_CACHE_LIMIT = 1 << 12
_c_names = {}
_c_shapes = {}


def c_name(name):
    """The C copy of a tensor name (kept for the next call with that name)."""
    c = _c_names.get(name)
    if c is None:
        c = ffi.new("char[]", name.encode("utf-8"))
        remember(_c_names, name, c)
    return c


def _c_shape(shape):
    key = tuple(shape)
    c = _c_shapes.get(key)
    if c is None:
        c = ffi.new("int64_t[]", [int(d) for d in key] or [0])
        remember(_c_shapes, key, c)
    return c


def remember(cache, key, value):
    """Stores ``cache[key] = value`` in one of the bounded caches of the per-step path."""
    # A full cache starts over, so that names used once (automatic names, say) cannot
    # keep the ones every step repeats out of it for good.
    if len(cache) >= C_CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def fill(struct, op, name, dtype, shape, input, output, reduce_op, prescale, postscale,
         root_rank, splits, process_set_id, device, ready_event=None):
    """Fills one hvdlite_tensor_t.

    Returns the cffi objects the struct points to, which must stay referenced until the
    enqueue call returns (the core copies name, shape and splits at enqueue).
    """
    name_c = c_name(name)
    c_shape = _c_shape(shape)
    c_splits = ffi.NULL
    if splits is not None:
        c_splits = ffi.new("int64_t[]", [int(s) for s in splits] or [0])
    struct.name = name_c
    struct.op = op
    struct.dtype = dtype
    struct.ndim = len(shape)
    struct.shape = c_shape
    struct.input = pointer(input)
    struct.output = pointer(output)
    struct.reduce_op = reduce_op
    struct.prescale_factor = prescale
    struct.postscale_factor = postscale
    struct.root_rank = root_rank
    struct.splits = c_splits
    struct.process_set_id = process_set_id
    struct.device = device
    struct.ready_event = pointer(ready_event)
    return name_c, c_shape, c_splits


def enqueue(op, name, dtype_code, shape, input_ptr, output_ptr=None, *, reduce_op=Average,
            prescale=1.0, postscale=1.0, root_rank=0, splits=None, process_set_id=0,
            device=-1, ready_event=None, keepalive=(), finisher=None, result=None):
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
        ready_event: a GPU tensor's cudaEvent_t (address), recorded after the input was
            produced and the output allocated; the core waits on it. Kept alive through
            ``keepalive``.
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
    if ready_event is None:
        return submit(template(op, name, dtype_code, tuple(shape), reduce_op, prescale,
                               postscale, root_rank, process_set_id, device, splits),
                      pointer(input_ptr), pointer(output_ptr), keepalive, finisher, name,
                      result)
    out = ffi.new("hvdlite_handle_t *")
    struct = ffi.new("hvdlite_tensor_t *")
    keep = fill(struct, op, name, dtype_code, shape, input_ptr, output_ptr, reduce_op,
                prescale, postscale, root_rank, splits, process_set_id, device, ready_event)
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


def template(op, name, dtype, shape, reduce_op, prescale, postscale, root_rank,
             process_set_id, device, splits=None):
    """The kept struct of a tensor (with what it points to), filled on first use.
    ``splits``: an ALLTOALL's, checked (a list of ints), or None."""
    key = (op, name, dtype, shape, reduce_op, prescale, postscale, root_rank, process_set_id,
           device, splits if splits is None else tuple(splits))
    kept = _templates.get(key)
    # 0.0 and -0.0 are one key, yet the sign of a zero factor shows in the results.
    if kept is None or not prescale or not postscale:
        struct = ffi.new("hvdlite_tensor_t *")
        keep = fill(struct, op, name, dtype, shape, None, None, reduce_op, prescale,
                    postscale, root_rank, splits, process_set_id, device)
        kept = (struct, keep)
        remember(_templates, key, kept)
    return kept


class CoreResult:
    """The finisher of an op whose result the core allocates (ALLGATHER, ALLTOALL):
    ``(first dimension from the core, *trailing)`` elements of ``dtype`` and, for an
    ALLTOALL (``ranks``: the ranks of its set), the rows received from each rank.

    Called with the ended Handle, it views the core's buffer without a copy. An op
    waited for in its enqueue call (``at_once``) whose result is small is instead copied
    out and its handle released at once (``take``): wrapping the core's buffer, and
    releasing it with the array later, costs more than copying a few KiB.
    ``expected_rows``: the first dimension the result likely has (every rank's rows
    alike), which sizes the copy's array. ``wrap(rows, splits)``, when given, turns the
    numpy result (and an ALLTOALL's splits, else None) into a framework's.
    """

    __slots__ = ("dtype", "trailing", "ranks", "shape", "row_bytes", "wrap")

    def __init__(self, dtype, trailing, expected_rows, ranks=None, wrap=None):
        self.dtype, self.trailing, self.ranks = np.dtype(dtype), tuple(trailing), ranks
        self.row_bytes = math.prod(self.trailing) * self.dtype.itemsize
        fits = expected_rows * self.row_bytes <= TAKE_MAX_BYTES
        self.shape = (expected_rows,) + self.trailing if fits else None
        self.wrap = wrap

    def __call__(self, handle):
        rows = handle.output_array(0, self.dtype, self.trailing)
        return self._result(rows, None if self.ranks is None else handle.recv_splits(0, self.ranks))

    def _result(self, rows, splits):
        if self.wrap is not None:
            return self.wrap(rows, splits)
        return rows if splits is None else (rows, splits)

    def take(self, handle_id):
        """The ended op's result copied out and its handle released; None (the handle
        left as it was) when the result is larger than expected."""
        if self.shape is None:
            return None
        rows, splits, splits_ptr, sizes = self.room()
        check(_take_output(handle_id, from_buffer(rows), rows.nbytes, sizes, sizes + 1,
                           splits_ptr))
        return self.taken(rows, splits, sizes)

    def room(self):
        """Where a small result is copied (``shape`` not None): ``(rows, splits or None,
        splits' pointer or NULL, sizes)``, sizes receiving the bytes and rows taken."""
        rows = np.empty(self.shape, self.dtype)
        splits = None if self.ranks is None else np.empty(self.ranks, np.int64)
        try:
            sizes = _cells.sizes
        except AttributeError:
            sizes = _cells.sizes = ffi.new("int64_t[2]")
        return (rows, splits, ffi.NULL if splits is None else from_buffer("int64_t[]", splits),
                sizes)

    def taken(self, rows, splits, sizes):
        """The result copied into ``room()``'s arrays, or None where it did not fit."""
        nbytes, first_dim = sizes[0], sizes[1]
        if nbytes > rows.nbytes:
            return None
        if nbytes != first_dim * self.row_bytes:
            raise errors.InternalError(
                f"the core returned {nbytes} bytes for {first_dim} rows of {self.trailing} "
                f"{self.dtype} ({first_dim * self.row_bytes} bytes expected)")
        if first_dim != self.shape[0]:
            rows = rows[:first_dim]
        return self._result(rows, splits)


# Results of at most this many bytes are copied out of the core (CoreResult.take).
TAKE_MAX_BYTES = 64 * 1024
_take_output = lib.hvdlite_handle_take_output
_enqueue_wait_take = lib.hvdlite_enqueue_wait_take


def submit(kept, input_ptr, output_ptr, keepalive, finisher, name, result):
    """Enqueues a kept struct with these buffers; returns the Handle. Inside ``at_once``
    the first such op is also waited for (see there)."""
    if _cells.__dict__.get("at_once"):
        _cells.at_once = False
        return submit_wait(kept, input_ptr, output_ptr, keepalive, finisher, name, result)
    try:
        cell = _cells.handle
    except AttributeError:
        cell = _cells.handle = ffi.new("hvdlite_handle_t *")
    status = _enqueue_buffers(kept[0], input_ptr, output_ptr, cell)
    if status != _OK:
        check(status)
    if finisher is None:
        return OpHandle(cell[0], keepalive, name, result)
    return Handle([cell[0]], finisher, keepalive, name, result)


def submit_wait(kept, input_ptr, output_ptr, keepalive, finisher, name, result):
    """``submit``, the op also waited for in the same call of the core: its Handle,
    ended unless the wait's first slice passed first."""
    return run(kept, input_ptr, output_ptr, keepalive, finisher, name, result, False)


def run(kept, input_ptr, output_ptr, keepalive, finisher, name, result, wait=True):
    """``submit_wait(...).wait()``: the op's result (its error raised). An op that ended
    within the wait's first slice, the usual case, makes no Handle. (``wait=False``:
    ``submit_wait``; one function, so that a blocking call, the latency-bound one, pays
    for one Python frame here.)"""
    if _interrupted:  # first: what it lets go of, the orphans' reaping below releases
        _settle_interrupted(name)
    if _orphans:  # as a Handle's making does: a call that makes none releases them too
        reap_orphans()
    try:
        cell, op_status = _cells.wait_cells
    except AttributeError:
        cell, op_status = _cells.wait_cells = (ffi.new("hvdlite_handle_t *"),
                                               ffi.new("hvdlite_status_t *"))
    # An op with a finisher keeps its handle for the finisher to read (the Handle's own
    # wait then finds it ended).
    cell[0] = 0
    ended = taken = False
    handle = None
    try:
        try:
            if wait and type(finisher) is CoreResult and finisher.shape is not None:
                # A small core result, copied out in the same native call.
                rows, splits, splits_ptr, sizes = finisher.room()
                status = _enqueue_wait_take(kept[0], input_ptr, _WAIT_SLICE_S, from_buffer(rows),
                                            rows.nbytes, sizes, sizes + 1, splits_ptr, cell,
                                            op_status)
                if status == _OK and op_status[0] == _OK:
                    taken = True
                    result = finisher.taken(rows, splits, sizes)
                    ended = result is not None
            else:
                status = _enqueue_buffers_wait(kept[0], input_ptr, output_ptr, _WAIT_SLICE_S,
                                               finisher is None, cell, op_status)
                if wait and status == _OK and op_status[0] == _OK:
                    # Ended and released by the core, or a small core result copied out.
                    if finisher is None:
                        ended = True
                    elif type(finisher) is CoreResult:
                        taken = True
                        result = finisher.take(cell[0])
                        ended = result is not None
        finally:
            # Wrapped even when an exception (Ctrl-C during the wait) arrives as the call
            # returns: dropped, the handle of an op still running keeps its buffers until
            # it ends (the orphans of handle.py). A result take tried (it outgrew the
            # guess, or failed) is not tried again: the Handle's finisher reads it.
            handle = None if ended or not cell[0] else _waited(
                cell[0], op_status[0], keepalive, finisher, name, result, take=not taken)
    except BaseException as error:
        _keep_interrupted(error, name, handle)
        raise
    if ended:
        return result
    if status != _OK:
        check(status)
    if not wait:
        return handle
    try:
        return handle.wait()
    except errors.InvalidArgumentError as error:
        # The op failed on every rank: not this rank's refusal to send (a first call
        # waits inside its refusing wrapper, hvdlite._refusals).
        error.refusal_sent = True
        raise
    except BaseException as error:
        _keep_interrupted(error, name, handle)
        raise


# Blocking calls whose wait an exception other than the op's own cut short (Ctrl-C),
# still in flight: name -> Handle. A later blocking call of that name (a name repeated
# on purpose: the barrier's, the objects', a named metric) waits for it first, since it
# pairs with the peers' op of that name, instead of being refused as a duplicate.
_interrupted = {}


def _keep_interrupted(error, name, handle):
    if handle is not None and not isinstance(error, errors.HvdliteError):
        _interrupted[name] = handle


def _settle_interrupted(name):
    """Waits for the interrupted call of ``name``, if any, and lets go of those that
    ended (their buffers are then released, as an orphan's would be)."""
    for key, handle in list(_interrupted.items()):
        if key != name:
            try:
                if not handle.poll():
                    continue
            except errors.HvdliteError:
                pass  # ended badly: let go of it too
        del _interrupted[key]
        try:
            handle.wait()
        except errors.HvdliteError:
            pass  # its outcome was the interrupted call's (a shutdown since, say)


def _waited(handle_id, status, keepalive, finisher, name, result, take=True):
    """The handle of an op enqueued and waited for in one call (``submit`` in
    ``at_once``), whose wait returned ``status``; ``take``: a small result may still be
    copied out (not where that was tried already)."""
    if finisher is None:
        return OpHandle.after_wait(handle_id, status, keepalive, name, result)
    if status == _OK and take and type(finisher) is CoreResult:
        taken = finisher.take(handle_id)
        if taken is not None:
            return OpHandle.after_wait(handle_id, status, None, name, taken)
    # A failure is waited for again, which reads its message afresh.
    return Handle([handle_id], finisher, keepalive, name, result, succeeded=status == _OK)


def at_once(start, *args, **kwargs):
    """``start(*args, **kwargs)`` (an ``*_async`` op) for a caller that waits for its
    result at once: the first op it submits through ``submit`` is enqueued and waited
    for in one call of the core, which then runs its cycle at once instead of first
    gathering a burst of requests (a blocking small allreduce: a wake-up of the
    background thread less, and one native call less). Returns ``start``'s handle."""
    _cells.at_once = True
    try:
        return start(*args, **kwargs)
    finally:
        _cells.at_once = False


def enqueue_fields(op, name, dtype_code, shape, input_ptr, output_ptr, reduce_op, prescale,
                   postscale, root_rank, process_set_id, device, keepalive, finisher, result):
    """``enqueue`` of one tensor without splits, every argument given in order: the
    per-tensor path (a training step's gradients), several times cheaper than a struct
    filled per call and keyword arguments. ``input_ptr`` and ``output_ptr`` are cffi
    pointers (``ffi.from_buffer`` of an array, ``ffi.cast("void *", address)``)."""
    return submit(template(op, name, dtype_code, shape, reduce_op, prescale, postscale,
                           root_rank, process_set_id, device),
                  input_ptr, output_ptr, keepalive, finisher, name, result)


def fill_spec(struct, q):
    """``fill`` with a TensorSpec's fields; returns what the struct points to."""
    return fill(struct, q.op, q.name, q.dtype, q.shape, q.input, q.output, q.reduce_op,
                q.prescale, q.postscale, q.root_rank, q.splits, q.process_set_id, q.device,
                q.ready_event)


# Groups submitted again and again (``grouped_allreduce`` in a loop) keep their filled
# structs like single tensors do (``template``): key -> _KeptGroup. Bounded likewise.
_groups = {}


class _KeptGroup:
    """A group's filled structs, reused by every call with the same key; a lock makes
    setting the buffers and enqueueing one step (two threads submitting the same group
    at once would otherwise swap each other's buffers)."""

    __slots__ = ("structs", "elements", "keep", "lock")

    def __init__(self, specs):
        self.structs = ffi.new("hvdlite_tensor_t[]", len(specs))
        self.elements = [self.structs[i] for i in range(len(specs))]
        self.keep = [fill_spec(e, q) for e, q in zip(self.elements, specs)]
        self.lock = threading.Lock()


def enqueue_kept_group(key, make_specs, inputs, outputs, ready_event=None, *, name=None,
                       keepalive=(), finisher=None, result=None):
    """``enqueue_group`` of a group whose tensors' properties (names, dtypes, shapes, op,
    scaling, process set, device) ``key`` stands for: the structs are filled once, from
    ``make_specs()`` (TensorSpecs without buffers), and a call sets only the buffers
    (``inputs``, ``outputs``: addresses, one each per tensor, in order) and the GPU event.
    """
    kept = _groups.get(key)
    if kept is None:
        kept = _KeptGroup(make_specs())
        remember(_groups, key, kept)
    count = len(kept.elements)
    handles = ffi.new("hvdlite_handle_t[]", count)
    with kept.lock:
        for element, input, output in zip(kept.elements, inputs, outputs):
            element.input = pointer_at(input)
            element.output = pointer_at(output)
        if ready_event is not None:  # a GPU group (a key is a CPU or a GPU one for good)
            event = pointer(ready_event)
            for element in kept.elements:
                element.ready_event = event
        status = lib.hvdlite_enqueue_group(kept.structs, count, handles)
    check(status)
    return Handle(list(handles), finisher, (keepalive, kept), name, result)


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
    structs = ffi.new("hvdlite_tensor_t[]", len(specs))
    keep = [fill_spec(structs[i], q) for i, q in enumerate(specs)]
    handles = ffi.new("hvdlite_handle_t[]", len(specs))
    check(lib.hvdlite_enqueue_group(structs, len(specs), handles))
    return Handle(list(handles), finisher, (keepalive, keep), name, result)
