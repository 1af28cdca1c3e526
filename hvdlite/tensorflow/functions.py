"""Variables and Python objects across ranks, with Horovod's signatures:
broadcast_variables, broadcast_global_variables, broadcast_object(_fn), allgather_object.
"""
import tensorflow as tf

from hvdlite import objects
from hvdlite.process_sets import global_process_set
from hvdlite.tensorflow import execution, mpi_ops


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False,
                        name=None):
    """Assigns ``root_rank``'s values to ``variables`` on every rank.

    All variables go in one step (enqueued before any wait, one graph node in a graph),
    so they fuse. Reading a variable is zero-copy; ``assign`` copies once.

    Args:
        variables: tf.Variables or Keras variables, in the same order on every rank.
        root_rank: the rank whose values everyone receives (a member of process_set).
        process_set: the ProcessSet whose members receive.
        inplace: accepted for Horovod compatibility (the assignment is always in place).
        name: a base name, equal across ranks; None names them automatically.

    Returns:
        In a TF1 graph, the op that does the assignments (for ``Session.run``); None
        eagerly and in a tf.function, where they run in program order.

    Raises:
        tf.errors.InvalidArgumentError: a root out of range or an unsupported dtype.
        tf.errors.FailedPreconditionError: shapes or dtypes differ across ranks.
    """
    execution.check_process_set(process_set)
    variables = list(variables)
    if not variables:
        return _runnable()
    values = mpi_ops.broadcast_group([tf.convert_to_tensor(v) for v in variables],
                                     root_rank, name, process_set)
    assigned = [variable.assign(value) for variable, value in zip(variables, values)]
    return _runnable(*assigned)


def _runnable(*assigned):
    # A TF1 graph runs only what a session is asked for, so it gets the op; eagerly
    # and in a tf.function (automatic control dependencies) there is nothing to run.
    return None if tf.executing_eagerly() or tf.inside_function() else tf.group(*assigned)


def broadcast_global_variables(root_rank):
    """Broadcasts every TF1 global variable from ``root_rank`` (graph mode only).

    Raises:
        RuntimeError: called eagerly (TF2 keeps no global variables), as Horovod does;
            use ``broadcast_variables(model.variables, root_rank)``.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """Returns ``root_rank``'s ``obj`` on every rank (pickled with cloudpickle).

    Args:
        obj: any picklable object (only the root's is used).
        root_rank: the rank whose object everyone receives.
        session: accepted for Horovod compatibility (the exchange does not run in a
            graph, so no session is needed).
        name: a base name, equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members receive.

    Raises:
        As ``broadcast``.
    """
    execution.check_process_set(process_set)
    return objects.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None,
                        process_set=global_process_set):
    """Returns ``fn(obj)`` that does ``broadcast_object(obj, root_rank, ...)``."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Returns the list of every rank's ``obj``, in rank order (pickled).

    Args:
        obj: any picklable object.
        session, process_set: as for ``broadcast_object``.
        name: a base name, equal across ranks; None names it automatically.
    """
    execution.check_process_set(process_set)
    return objects.allgather_object(obj, name, process_set)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A TF1 SessionRunHook that broadcasts every global variable from ``root_rank``
    when the session is created (consistent initialization, or a restored checkpoint
    on the root only)."""

    def __init__(self, root_rank, device=""):
        """Args:
            root_rank: the rank whose values everyone receives.
            device: accepted for Horovod compatibility.
        """
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
