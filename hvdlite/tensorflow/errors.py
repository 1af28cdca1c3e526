"""hvdlite errors as the ``tf.errors`` classes Horovod's TensorFlow ops raise.

Horovod's ops are TF kernels, so a failed collective is a ``tf.errors.OpError``: a
mismatch across ranks (shape, dtype, root) is ``FailedPreconditionError``, a bad argument
(splits, name) ``InvalidArgumentError``, anything else (shutdown, a lost rank)
``UnknownError``. ``STATUS_TO_TF`` is the one table. An error raised here is an instance
of both classes (e.g. ``MismatchError`` and ``tf.errors.FailedPreconditionError``), so
handlers written for either catch it.

Eagerly the error is raised as such. Inside a graph the collective runs in a
``tf.py_function``, and TF turns every Python exception leaving one into
``UnknownError`` (or ``InvalidArgumentError`` for a ValueError), whatever its class. So
the node returns the error's code and message instead of raising, and ``raise_in_graph``
fails the step with the right class: ``tf.debugging.Assert`` for InvalidArgument, and for
FailedPrecondition the one TF kernel that fails with that code and a message chosen at
run time: ``ReadFile`` of a path under ``/dev/null`` (the OS answers ENOTDIR, which TF
reports as FailedPrecondition with the path in the message; nothing is read or written).
"""
import functools

import tensorflow as tf

from hvdlite import errors as hvd_errors

# hvdlite class -> tf.errors class (the first match in this order wins).
STATUS_TO_TF = (
    (hvd_errors.MismatchError, tf.errors.FailedPreconditionError),
    (hvd_errors.NotInitializedError, tf.errors.FailedPreconditionError),
    (hvd_errors.InvalidArgumentError, tf.errors.InvalidArgumentError),
    (hvd_errors.DuplicateNameError, tf.errors.InvalidArgumentError),
    (hvd_errors.HvdliteError, tf.errors.UnknownError),
)

# Codes a graph node hands to raise_in_graph.
OK, FAILED_PRECONDITION, INVALID_ARGUMENT = 0, 1, 2
_GRAPH_CODES = {tf.errors.FailedPreconditionError: FAILED_PRECONDITION,
                tf.errors.InvalidArgumentError: INVALID_ARGUMENT}
# Under PATH_MAX with room for the prefix; a longer message is cut.
_MAX_PATH_MESSAGE = 3800


def _tf_class(error):
    for hvd_class, tf_class in STATUS_TO_TF:
        if isinstance(error, hvd_class):
            return tf_class
    return tf.errors.UnknownError


@functools.lru_cache(maxsize=None)
def _both(hvd_class, tf_class):
    """Returns the class that is both ``hvd_class`` and ``tf_class``.

    The tf class comes first, so OpError's read-only ``message`` property serves both;
    ``__init__`` sets OpError's fields itself, as the two bases' constructors cannot
    both run (OpError's calls the next base with no message).
    """
    error_code = tf_class(None, None, "").error_code

    def __init__(self, node_def, op, message, *args):
        Exception.__init__(self, message)
        self._node_def, self._op, self._message = node_def, op, message
        self._error_code = error_code
        self._experimental_payloads = {}
        self.status = self.status_name = None

    return type(hvd_class.__name__, (tf_class, hvd_class),
                {"__module__": __name__, "__init__": __init__,
                 "__str__": tf_class.__str__})


def to_tf_error(error):
    """Returns ``error`` (an HvdliteError) as an instance of its tf.errors class too.

    The result keeps the hvdlite class, ``status`` and ``status_name``; its message is
    ``str(error)``.
    """
    if isinstance(error, tf.errors.OpError):
        return error
    result = _both(type(error), _tf_class(error))(None, None, str(error))
    result.status = error.status
    result.status_name = error.status_name
    return result


def graph_code(error):
    """Returns ``(code, message)`` for raise_in_graph, or None if the node should raise.

    Errors whose tf class a py_function keeps (UnknownError) are raised in the node.
    """
    code = _GRAPH_CODES.get(_tf_class(error))
    return None if code is None else (code, str(error))


def raise_in_graph(code, message):
    """Returns an op that fails with the tf.errors class of ``code`` (OK: passes).

    Plain ops, no conditional: each step reads ``/dev/null`` when there is nothing to
    raise. The read feeds the Assert, a stateful op, so graph optimizations that drop
    a control dependency on a stateless op keep it.

    Args:
        code: an int32 scalar tensor: OK, FAILED_PRECONDITION or INVALID_ARGUMENT.
        message: a string scalar tensor, the error's message.
    """
    path = tf.where(tf.equal(code, FAILED_PRECONDITION),
                    tf.strings.join(["/dev/null/[hvdlite] ",
                                     tf.strings.substr(message, 0, _MAX_PATH_MESSAGE)]),
                    "/dev/null")
    read = tf.io.read_file(path)
    return tf.debugging.Assert(
        tf.logical_and(tf.not_equal(code, INVALID_ARGUMENT),
                       tf.equal(tf.strings.length(read), 0)), [message])


def tf_errors(fn):
    """Decorator: HvdliteErrors leaving ``fn`` become their tf.errors class too."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except hvd_errors.HvdliteError as e:
            raise to_tf_error(e) from None

    return wrapper
