"""Variables and Python objects across ranks: broadcast_variables, *_object."""
import tensorflow as tf

from hvdlite.objects import allgather_object, broadcast_object  # noqa: F401 (API)
from hvdlite.process_sets import global_process_set
from hvdlite.tensorflow import mpi_ops


def broadcast_variables(variables, root_rank, name=None, process_set=global_process_set):
    """Assigns ``root_rank``'s values to ``variables`` on every rank.

    All variables go in one step (enqueued before any wait, one graph node inside a
    tf.function), so they fuse. Reading a variable is zero-copy; ``assign`` copies once.

    Args:
        variables: tf.Variables or Keras variables, in the same order on every rank.
        root_rank: the rank whose values everyone receives.
        name: a base name, equal across ranks; None names them automatically.
        process_set: the ProcessSet whose members receive (root_rank is a member).

    Inside a tf.function the assignments run in program order (automatic control
    dependencies); nothing needs to be returned.

    Raises:
        InvalidArgumentError: a root out of range or an unsupported dtype.
        HorovodInternalError: the broadcast failed (e.g. shapes differ across ranks).
    """
    variables = list(variables)
    if not variables:
        return None
    values = mpi_ops.broadcast_group([tf.convert_to_tensor(v) for v in variables],
                                     root_rank, name, process_set)
    for variable, value in zip(variables, values):
        variable.assign(value)
