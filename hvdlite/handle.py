"""Handle: one enqueued op (or group), and the buffers it must keep alive until it ends.

Ownership: Python owns the tensors. A Handle holds references to every buffer the core
may still read or write (inputs, outputs, the name and shape arrays) until the op has
ended. A Handle dropped while its op is in flight hands those references to a module
list of orphans, reaped once the op ends, so a forgotten handle can never let the core
write into freed memory.

ALLGATHER and ALLTOALL results live in a buffer the core allocated and that belongs to
the native handle (freed by ``hvdlite_release``). They are wrapped zero-copy: the numpy
array's base chain ends in an object that owns the native handle, so the handle is
released exactly once, when the last array viewing that memory is gone.
"""
import math
import threading
import time

import numpy as np

from hvdlite import errors, peer_faults
from hvdlite._native import check, error_for, ffi, last_error, lib

# Waits are cut into slices so that Ctrl-C reaches the main thread between them.
_WAIT_SLICE_S = 1.0
_OK = lib.HVDLITE_OK
_TIMEOUT = lib.HVDLITE_ERR_TIMEOUT
_wait_release = lib.hvdlite_wait_release  # every synchronize(): looked up once
_INVALID = lib.HVDLITE_ERR_INVALID_HANDLE
_UNKNOWN = (_INVALID, lib.HVDLITE_ERR_NOT_INITIALIZED)


class NativeHandle:
    """Owns one native handle id and releases it exactly once when dropped or released.

    Release happens when the last reference goes (``__del__``), which is right after the
    wait for plain ops, or with the last array viewing a core-owned result.
    """

    __slots__ = ("id", "__weakref__")

    def __init__(self, handle_id):
        self.id = int(handle_id)

    def release(self):
        """Releases the native handle now; later calls do nothing."""
        handle_id, self.id = self.id, 0
        if handle_id:
            lib.hvdlite_release(handle_id)

    def __del__(self):
        # Possibly run by the garbage collector at any point: never raise from here.
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter teardown
            pass


class _NativeBuffer:
    """Presents a core-owned buffer to numpy; keeps its NativeHandle alive meanwhile."""

    def __init__(self, owner, address, nbytes):
        self._owner = owner
        self.__array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
        }


# Handle.output's out cells, one set per thread: allocating them per call costs more
# than the call.
_output_cells = threading.local()

# In-flight handles whose Handle object was dropped: [(native ids, keepalive)].
_orphans = []
_orphans_lock = threading.Lock()


def _all_done(ids, strict=False):
    """Whether every native op of ``ids`` has ended (successfully or not).

    strict: raise for a handle the core does not know or a core that was shut down;
    otherwise those count as ended. (A handle another thread released a moment ago is
    known: the core keeps the statuses of recent releases.)
    """
    done = ffi.new("int32_t *")
    for handle_id in ids:
        status = lib.hvdlite_poll(handle_id, done)
        if status == _OK:
            if not done[0]:
                return False
        elif strict and status in _UNKNOWN:
            check(status)
    return True


def _release_all(ids):
    for handle_id in ids:
        lib.hvdlite_release(handle_id)


def _release_ended(ids):
    """Releases ids[-1], ids[-2], ... while each op has ended successfully, in one native
    call, and drops them from ``ids``; the first one in flight or failed stays, with
    those before it (and all of them if the call fails: they are then waited one by
    one, which reports whatever is wrong)."""
    released = ffi.new("int32_t *")
    status = lib.hvdlite_release_ended(ffi.new("hvdlite_handle_t[]", ids), len(ids), released)
    if status == _OK:
        del ids[len(ids) - released[0]:]


def _wait_slices(wait, handle_id, deadline, name):
    """Waits for one native op with ``wait`` (hvdlite_wait or hvdlite_wait_release);
    returns its status (the message, if any, is the calling thread's last error).

    The wait is cut into slices so that the main thread handles Ctrl-C between them
    (other threads just wake once per slice, which costs nothing measurable), and so
    that a peer the launcher reported lost ends the wait (see peer_faults.py).

    Raises:
        WaitTimeoutError: ``deadline`` (time.monotonic(), or None) passed first.
        RankFailedError: the launcher reported lost ranks while the op was pending.
    """
    while True:
        if deadline is None:
            timeout = _WAIT_SLICE_S
        else:
            remaining = deadline - time.monotonic()
            timeout = min(max(remaining, 0.0), _WAIT_SLICE_S)
        status = wait(handle_id, timeout)
        if status != _TIMEOUT:
            return status
        lost = peer_faults.failure()
        if lost is not None:
            raise lost
        if deadline is not None and time.monotonic() >= deadline:
            raise error_for(_TIMEOUT, f"waiting for {name!r} timed out; the op goes on")


def _drop(ids, keepalive):
    """For a handle dropped before it ended: releases its ids if every op has ended,
    else hands them and the buffers the core may still use to the orphans."""
    if _all_done(ids):
        _release_all(ids)
        return
    with _orphans_lock:
        _orphans.append((ids, keepalive))


def reap_orphans():
    """Releases orphaned handles whose ops have ended (and drops their buffers)."""
    if not _orphans:
        return
    with _orphans_lock:
        kept = []
        for entry in _orphans:
            if _all_done(entry[0]):
                _release_all(entry[0])
            else:
                kept.append(entry)
        _orphans[:] = kept


class Handle:
    """An enqueued op (or group of ops) and the references that keep its buffers alive.

    ``wait()`` returns the op's result (built by the finisher, or the output given at
    construction), ``poll()`` says whether the op has ended. Use
    ``hvdlite.synchronize(handle)`` / ``hvdlite.poll(handle)`` or these methods directly.

    The native ids are released as soon as the op has ended and its result is built,
    except those whose core-owned buffer a result array views (``output_array``): a
    NativeHandle inside that array releases them with the array.
    """

    __slots__ = ("_ids", "_owners", "_finisher", "_keepalive", "name", "_lock", "_ended",
                 "_result", "_error", "_succeeded", "__weakref__")

    def __init__(self, native_ids, finisher=None, keepalive=(), name=None, result=None,
                 succeeded=False):
        """Wraps native handles returned by hvdlite_enqueue(_group).

        Args:
            native_ids: the native handle ids (one, or one per tensor of a group).
            finisher: ``finisher(handle) -> result``, called once after every native
                op ended successfully and before the handles are released; it may use
                :meth:`output`, :meth:`output_array`, :meth:`recv_splits`.
            keepalive: objects to reference until the ops have ended.
            name: a label for messages (the tensor or group name).
            result: the result when there is no finisher (e.g. the output array the
                core writes into).
            succeeded: the one native op was already waited for and succeeded (it was
                enqueued and waited for in one call): the wait is not asked again.
        """
        if _orphans:
            reap_orphans()
        self._ids = list(native_ids)  # ids the core may still hold: emptied as released
        self._owners = None  # index -> NativeHandle, for results viewing core memory
        self._finisher = finisher
        self._keepalive = keepalive
        self.name = name
        self._lock = threading.Lock()
        self._ended = False
        self._result = result
        self._error = None
        self._succeeded = succeeded

    def __repr__(self):
        state = "ended" if self._ended else "pending"
        return f"<hvdlite.Handle {self.name!r} {state} ids={self.native_ids}>"

    @property
    def native_ids(self):
        """The native handle ids not yet released, for adapters that call the C API
        directly (all of them until the op ends)."""
        return list(self._ids)

    def poll(self):
        """Returns True once the op has ended (successfully or not); never blocks.

        Raises:
            NotInitializedError: the core was shut down and forgot the handle.
            InvalidHandleError: the native handle is unknown to the core.
        """
        # A waiting thread may be emptying the list: poll walks a copy.
        return self._ended or _all_done(list(self._ids), strict=True)

    def wait(self, timeout=None):
        """Blocks until the op ends and returns its result.

        The GIL is released while blocked. A second call returns the same result (or
        raises the same error).

        Args:
            timeout: seconds to wait at most; None waits until the op ends.

        Returns:
            Whatever the op produces (e.g. a numpy array, a list for a group).

        Raises:
            WaitTimeoutError: ``timeout`` passed; the op goes on and can be waited again.
            HorovodInternalError: the collective failed (MismatchError, ShutdownError,
                StalledError, TransportError, RankFailedError).
            HvdliteError: another failure reported by the core.
        """
        if not self._ended:
            with self._lock:
                if not self._ended:
                    self._end(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def _end(self, timeout):
        """Waits for every native op, builds the result and releases the ids (with
        self._lock held). A timeout leaves the ops not yet ended for the next call."""
        ids = self._ids
        finisher = self._finisher
        release = finisher is None  # nothing to read after the wait: release with it
        wait = _wait_release if release else lib.hvdlite_wait
        deadline = None if timeout is None else time.monotonic() + timeout
        # Every op of a group is waited, even after a failure, so that all of them can be
        # released; from the last, so that releasing one is a pop. A finisher still
        # reads the ids: those are released after it, and waited from a copy.
        pending = ids if release else list(ids)
        error = self._error  # from an earlier call that timed out on another op
        tried = False  # the one call that releases what ended with the last op
        while pending:
            if self._succeeded:
                status, self._succeeded = _OK, False
            else:
                status = _wait_slices(wait, pending[-1], deadline, self.name)
            pending.pop()
            if status != _OK:
                error = error_for(status, last_error())  # ends as the first op's failure
                self._error = error
            elif release and pending and not tried:
                tried = True
                _release_ended(pending)  # the rest of a group mostly ended with its last
        if error is None and finisher is not None:
            try:
                self._result = finisher(self)
            except errors.HvdliteError as e:
                error = e
        if not release:
            # Ids viewed by result arrays go with the last of those arrays.
            owners, self._owners = self._owners or (), None
            _release_all([h for index, h in enumerate(ids) if index not in owners])
            ids.clear()
        if error is not None:
            self._error = error
            self._result = None
        self._ended = True
        self._finisher = None
        self._keepalive = None

    # -- helpers for finishers -------------------------------------------------------

    def output(self, index=0):
        """Returns (address, nbytes, first_dim) of a core-allocated result.

        For ALLGATHER and ALLTOALL the address is the buffer the core allocated (0 when
        nbytes is 0); for JOIN, first_dim is the last rank that joined.
        """
        try:
            data, address, sizes = _output_cells.cells
        except AttributeError:
            data = ffi.new("uintptr_t *")  # void** as the core sees it, an int as read here
            sizes = ffi.new("int64_t[2]")  # nbytes, first_dim
            data, address, sizes = _output_cells.cells = (data, ffi.cast("void **", data), sizes)
        check(lib.hvdlite_handle_output(self._ids[index], address, sizes, sizes + 1))
        return data[0], sizes[0], sizes[1]

    def output_array(self, index, dtype, trailing_shape):
        """Wraps a core-allocated result as a numpy array without copying.

        The array keeps the native handle alive; it is released once the array (and
        every view of it) is gone.

        Args:
            index: which native op of this handle.
            dtype: the numpy dtype of the elements.
            trailing_shape: the shape after the first dimension.

        Returns:
            An array of shape ``(first_dim, *trailing_shape)``.

        Raises:
            InternalError: the core's size disagrees with the shape.
        """
        dtype = np.dtype(dtype)
        address, nbytes, first_dim = self.output(index)
        shape = (first_dim,) + tuple(trailing_shape)
        expected = math.prod(shape) * dtype.itemsize
        if nbytes != expected:
            raise errors.InternalError(
                f"result of {self.name!r}: the core returned {nbytes} bytes for shape "
                f"{shape} of {dtype} ({expected} bytes expected)")
        if nbytes == 0:
            # Nothing to view (the pointer may be NULL); the handle can go now.
            return np.empty(shape, dtype=dtype)
        if self._owners is None:
            self._owners = {}
        owner = self._owners.get(index)
        if owner is None:
            owner = self._owners[index] = NativeHandle(self._ids[index])
        raw = np.asarray(_NativeBuffer(owner, address, nbytes))
        return raw.view(dtype).reshape(shape)

    def recv_splits(self, index, count):
        """Returns the ALLTOALL row counts received from each rank (np.int64, ``count``)."""
        out = ffi.new("int64_t[]", max(count, 1))
        check(lib.hvdlite_handle_recv_splits(self._ids[index], out))
        return np.frombuffer(ffi.buffer(out, 8 * count), dtype=np.int64).copy()

    def __del__(self):
        # Possibly run by the garbage collector at any point: never raise from here.
        try:
            if not self._ended and self._ids:
                _drop(self._ids, self._keepalive)
        except Exception:  # pragma: no cover - interpreter teardown
            pass


class OpHandle(Handle):
    """The Handle of one native op whose result is known when it is enqueued: an
    allreduce into a given (or new) array, the per-tensor path of every training step.

    Same interface as Handle, kept lean for that path: a step of 200 small allreduces
    makes 200 of them, and Handle's generality there (the id list, a lock per handle,
    the general end) measured 15-25% of the step. It has no finisher, so none of the
    finisher helpers (output, output_array, recv_splits) apply.

    No lock: the core lets several threads wait on one native op, and a thread that
    reaches it just after another released it still gets its status (the core keeps the
    statuses of recent releases), so every waiting thread publishes the same outcome
    (the error first, the id's 0 last). That also recovers an outcome a wait lost when
    Ctrl-C arrived between the core's release and the publishing.
    """

    __slots__ = ("_id",)

    def __init__(self, handle_id, keepalive, name, result):
        """Wraps the native handle of one enqueued op.

        Args:
            handle_id: the native handle (nonzero).
            keepalive: objects to reference until the op has ended (its buffers).
            name: a label for messages (the tensor's name).
            result: what ``wait`` returns once the op succeeded (its output array).
        """
        if _orphans:
            reap_orphans()
        self._id = handle_id  # 0 once the op has ended and the id was released
        self._keepalive = keepalive
        self.name = name
        self._ended = False
        self._result = result
        self._error = None

    @classmethod
    def after_wait(cls, handle_id, status, keepalive, name, result):
        """The handle of an op that was enqueued and waited for in one call
        (hvdlite_enqueue_buffers_wait) with this outcome: ended, unless ``status`` is a
        timeout, which leaves it to be waited for as any other."""
        if status == _TIMEOUT:
            return cls(handle_id, keepalive, name, result)
        handle = cls(0, None, name, result)
        handle._ended = True
        if status != _OK:
            handle._error = error_for(status, last_error())
            handle._result = None
        return handle

    @property
    def native_ids(self):
        handle_id = self._id
        return [handle_id] if handle_id else []

    def poll(self):
        handle_id = self._id
        return not handle_id or _all_done((handle_id,), strict=True)

    def wait(self, timeout=None):
        handle_id = self._id
        if handle_id:
            deadline = None if timeout is None else time.monotonic() + timeout
            status = _wait_slices(_wait_release, handle_id, deadline, self.name)
            if status == _INVALID and self._id != handle_id:
                # Another thread ended it meanwhile (its release left the core's
                # recent ones before this thread got there): its outcome stands.
                return self.wait()
            if status != _OK:
                if self._error is None:
                    self._error = error_for(status, last_error())
                self._result = None
            self._keepalive = None
            self._ended = True
            self._id = 0
        if self._error is not None:
            raise self._error
        return self._result

    def output(self, index=0):
        raise errors.InvalidArgumentError(
            f"{self.name!r}: the op wrote its result into the output given at enqueue; "
            "the core holds none for it")

    def recv_splits(self, index, count):
        self.output(index)

    def __del__(self):
        # Possibly run by the garbage collector at any point: never raise from here.
        try:
            if self._id:
                _drop([self._id], self._keepalive)
        except Exception:  # pragma: no cover - interpreter teardown
            pass
