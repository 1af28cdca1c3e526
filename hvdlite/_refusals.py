"""The refusal protocol: a call this rank refuses is failed on every rank.

A call this rank refuses (a bad tensor) is an op the other ranks may well have
submitted: left alone, they would wait for it until a stall timeout. So a refused call
tells the coordinator (hvdlite_refuse), which fails that tensor on every rank that
submits it, naming this rank and the reason. The names are those the call resolved
before it failed, automatic names included: the counters advance on every rank alike.
"""
import functools
import threading

from hvdlite import _enqueue, _names
from hvdlite._native import lib
from hvdlite.errors import InvalidArgumentError

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
        lib.hvdlite_refuse(op, _enqueue.c_name(name), process_set_id, text)


def refusing(op):
    """Decorates a collective so that an InvalidArgumentError it raises (for a tensor
    whose name it had resolved) is also sent to the other ranks as a refusal.

    Nested decorated calls send it once.
    """
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            _attempt.names = ()  # a new call: forget the last one's names
            try:
                return fn(*args, **kwargs)
            except InvalidArgumentError as error:
                refused(op, error)
                raise
        return call
    return wrap


def refused(op, error):
    """Sends ``error`` as this rank's refusal of the current call's tensors, once."""
    if not getattr(error, "refusal_sent", False):
        error.refusal_sent = True
        refuse(op, getattr(_attempt, "names", ()), error,
               getattr(_attempt, "process_set_id", 0))


def resolve_name(kind, name, process_set_id=0):
    """Returns the name of a tensor of op kind ``kind`` (an automatic one for None),
    recorded as the current call's for a refusal.

    Raises:
        InvalidArgumentError: not a str, empty, or with a NUL.
    """
    _attempt.process_set_id = process_set_id
    if type(name) is str and name and "\0" not in name:
        _attempt.names = (name,)
        return name  # the usual case
    if name is None:
        name = _names.auto_name(kind, process_set_id)
        _attempt.names = (name,)
        return name
    if not isinstance(name, str):
        raise InvalidArgumentError(f"tensor name must be a str, not {type(name).__name__}")
    if not name or "\0" in name:
        raise InvalidArgumentError(f"tensor name {name!r} must be non-empty and have no NUL")
    return name
