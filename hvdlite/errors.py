"""Exceptions: HvdliteError and one subclass per status code of the C API.

``STATUS_CLASSES`` is the one table, keyed by the status constant's name; the numbers
belong to the loaded library (``hvdlite._native`` maps a code to its name), never written
here. Importing this module does not
load the native library, so scripts can catch these classes on a broken install.

Where natural a class also derives from a builtin (``ValueError`` for bad arguments,
``RuntimeError`` for state errors, ``TimeoutError``), so generic handlers keep working.
``HorovodInternalError`` is the base of collective failures (mismatch across ranks,
shutdown, stall, transport, a lost rank), as Horovod scripts expect when they catch it.
"""
import builtins


class HvdliteError(Exception):
    """Base of every error the hvdlite core reports.

    Attributes:
        status: the numeric status code (None for errors raised in Python only).
        status_name: the constant's name, e.g. ``"HVDLITE_ERR_MISMATCH"``.
        message: the core's message (``hvdlite_last_error()``) or the Python one.
    """

    def __init__(self, status=None, status_name=None, message=None):
        if message is None and status_name is None and not isinstance(status, int):
            # Raised from Python with just a message: HvdliteError("text").
            status, message = None, status
        self.status = status
        self.status_name = status_name
        self.message = message or ""
        super().__init__(self.message)

    def __str__(self):
        if self.status_name:
            return f"{self.message} [{self.status_name}]" if self.message else self.status_name
        return self.message

    def __reduce__(self):
        # Keeps the fields through pickling (e.g. exceptions sent between processes).
        return (type(self), (self.status, self.status_name, self.message))


class NotInitializedError(HvdliteError, RuntimeError, ValueError):
    """Called before ``hvdlite.init()`` or after ``hvdlite.shutdown()``. Also a ValueError:
    Horovod's ``rank()``/``size()`` raise one then (its collectives a RuntimeError)."""


class InvalidArgumentError(HvdliteError, ValueError):
    """Refused at the call (bad dtype, layout, splits, root...); nothing was enqueued."""


class UnsupportedDtypeError(InvalidArgumentError, RuntimeError):
    """A tensor of an element type the core does not take. Also a RuntimeError: the
    class horovod.torch raises for one, so handlers written for either keep working."""


class UnsupportedOpError(InvalidArgumentError, RuntimeError):
    """A reduction op the collective does not take (``reducescatter(op=Adasum)``). Also a
    RuntimeError: Horovod's core aborts such an op and ``horovod.torch`` raises that."""


class NotSupportedError(InvalidArgumentError, NotImplementedError):
    """A combination Horovod has not implemented either and refuses with
    NotImplementedError (Adasum in a process set other than the global one)."""


class DuplicateNameError(HvdliteError, ValueError):
    """A tensor of the same name is already in flight on this rank."""


class HorovodInternalError(HvdliteError, RuntimeError):
    """A collective failed after it was enqueued; the name Horovod scripts catch."""


class MismatchError(HorovodInternalError):
    """Ranks disagreed on a tensor's properties (shape, dtype, op, scaling, root...)."""


class ShutdownError(HorovodInternalError):
    """The core shut down (on this or another rank) before the op finished."""


class StalledError(HorovodInternalError):
    """Some ranks never submitted the tensor within HVDLITE_STALL_SHUTDOWN_TIME."""


class TransportError(HorovodInternalError):
    """The transport (MPI) reported an error."""


class RankFailedError(HorovodInternalError):
    """A peer rank is gone."""


class AbortedError(HorovodInternalError):
    """The op cannot run: another rank refused it (the message names the rank and its
    reason), or it is not supported while ranks have joined (Horovod raises then too)."""


class InvalidHandleError(HvdliteError, ValueError):
    """An unknown or already released handle."""


class InProgressError(HvdliteError, RuntimeError):
    """The op has not finished yet."""


class AlreadyInitializedError(HvdliteError, RuntimeError):
    """``init`` was called while the core was running."""


class WaitTimeoutError(HvdliteError, builtins.TimeoutError):
    """Waiting for a handle timed out; the op itself goes on."""


class InternalError(HvdliteError, RuntimeError):
    """A bug in hvdlite: please report it with the message."""


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added to an elastic job: the world resets at this commit to take them in.

    Raised by ``state.commit()`` / ``state.check_host_updates()`` on every rank at once;
    ``hvdlite.elastic.run`` catches it. Not a status of the core.

    Attributes:
        skip_sync: True when no rank was lost, so the state needs no rollback.
    """

    def __init__(self, skip_sync=True):
        super().__init__("hosts were added to the elastic job")
        self.skip_sync = skip_sync


# Compatibility names for code written against Horovod.
MpiError = TransportError

# The one table: status constant name -> exception class.
STATUS_CLASSES = {
    "HVDLITE_ERR_NOT_INITIALIZED": NotInitializedError,
    "HVDLITE_ERR_INVALID_ARGUMENT": InvalidArgumentError,
    "HVDLITE_ERR_DUPLICATE_NAME": DuplicateNameError,
    "HVDLITE_ERR_MISMATCH": MismatchError,
    "HVDLITE_ERR_SHUTDOWN": ShutdownError,
    "HVDLITE_ERR_STALLED": StalledError,
    "HVDLITE_ERR_MPI": TransportError,
    "HVDLITE_ERR_INVALID_HANDLE": InvalidHandleError,
    "HVDLITE_ERR_IN_PROGRESS": InProgressError,
    "HVDLITE_ERR_ALREADY_INITIALIZED": AlreadyInitializedError,
    "HVDLITE_ERR_TIMEOUT": WaitTimeoutError,
    "HVDLITE_ERR_RANK_FAILED": RankFailedError,
    "HVDLITE_ERR_INTERNAL": InternalError,
    "HVDLITE_ERR_ABORTED": AbortedError,
}


def class_for(status_name):
    """Returns the exception class for a status constant's name.

    Args:
        status_name: e.g. ``"HVDLITE_ERR_MISMATCH"`` (``_native.status_name(code)``).

    Returns:
        The mapped subclass, or HvdliteError itself for a name this table does not know
        (a newer core); the message still says what happened.
    """
    return STATUS_CLASSES.get(status_name, HvdliteError)
