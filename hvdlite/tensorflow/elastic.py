"""Elastic training for TensorFlow: ``hvd.elastic`` after ``import hvdlite.tensorflow as hvd``.

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

See hvdlite/elastic/state.py for what a commit and a reset do, and hvdlite/keras/elastic.py
for the Keras callbacks.
"""
import functools
import re

import tensorflow as tf

from hvdlite import errors as hvd_errors
from hvdlite.elastic import state as _state
from hvdlite.elastic.state import ObjectState, State
from hvdlite.elastic.variables import ListState, ModelState
from hvdlite.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "run"]

# "[HVDLITE_ERR_...]" as str(HvdliteError) ends: the status a graph's error came from.
_STATUS = re.compile(r"\[(HVDLITE_ERR_[A-Z_]+)\]")


class TensorFlowKerasState(ModelState):
    """A Keras model, its optimizer and other values, committed and restored together.

    Args:
        model: a built Keras model.
        optimizer: its optimizer; None takes ``model.optimizer``.
        **kwargs: further values, each an attribute of the state.
    """


class TensorFlowState(ListState):
    """``tf.Variable`` objects and other values, committed and restored together.

    Args:
        variables: the variables, in the same order on every rank.
        **kwargs: further values, each an attribute of the state.
    """


def internal_error(error):
    """The HorovodInternalError that a TensorFlow error stands for, or None.

    Eagerly a failed collective raises an HorovodInternalError (that is also its
    tf.errors class). In a graph (``tf.function``, ``model.fit``) TensorFlow turns it
    into ``UnknownError``, whose message keeps the status: the error is rebuilt from it.
    MismatchError is the script's own inconsistency, not a lost peer: None.
    """
    if isinstance(error, HorovodInternalError):
        return None if isinstance(error, hvd_errors.MismatchError) else error
    if not isinstance(error, tf.errors.OpError):
        return None
    match = _STATUS.search(error.message or "")
    cls = hvd_errors.STATUS_CLASSES.get(match.group(1)) if match else None
    if cls is None or not issubclass(cls, HorovodInternalError) or \
            issubclass(cls, hvd_errors.MismatchError):
        return None
    return cls(None, match.group(1), error.message)


def run(func):
    """Decorator for the training function ``func(state, *args, **kwargs)``, as
    ``hvdlite.elastic.run``; a collective that failed inside a graph counts too.

    Returns:
        The wrapped function; it returns ``func``'s result.
    """
    @functools.wraps(func)
    def translated(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            internal = internal_error(exc)
            if internal is None or internal is exc:
                raise
            raise internal from exc

    return _state.run(translated)
