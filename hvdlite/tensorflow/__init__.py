"""hvdlite for TensorFlow 2: ``import hvdlite.tensorflow as hvd`` for ``horovod.tensorflow``.

    import hvdlite.tensorflow as hvd
    hvd.init()
    tape = hvd.DistributedGradientTape(tape)
    hvd.broadcast_variables(model.variables, root_rank=0)

Every op works eagerly, inside ``tf.function`` and in TF1-style graphs (see
``mpi_ops``), raises the ``tf.errors`` classes Horovod's ops raise (``errors``), and
has Horovod's gradient; which path copies memory, per case, is in ``tensors``. Nothing
here is compiled against TensorFlow. The names are Horovod's (README, "TensorFlow and
Keras"); what is absent is listed there.
"""
from hvdlite.capabilities import (ccl_built, check_num_rank_power_of_2, cuda_built,
                                  ddl_built, gloo_built, gloo_enabled, gpu_available,
                                  is_homogeneous, mpi_built, mpi_enabled, nccl_built,
                                  rocm_built)
from hvdlite.errors import (HorovodInternalError, HvdliteError, InvalidArgumentError,
                            MismatchError)
from hvdlite.ops import resolve_op as handle_average_backwards_compatibility
from hvdlite.runtime import (cross_rank, cross_size, init, is_initialized, local_rank,
                             local_size, mpi_threads_supported, rank, shutdown, size,
                             start_timeline, stop_timeline)
from hvdlite.tensorflow.compression import Compression
from hvdlite.tensorflow.functions import (BroadcastGlobalVariablesHook, allgather_object,
                                          broadcast_global_variables,
                                          broadcast_object, broadcast_object_fn,
                                          broadcast_variables)
from hvdlite.tensorflow.gradient_tape import (DistributedGradientTape,
                                              PartialDistributedGradientTape)
from hvdlite.tensorflow.gradients import allreduce_gradients
from hvdlite.tensorflow.optimizer import DistributedOptimizer
from hvdlite.tensorflow.mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,
                                        add_process_set, allgather, allreduce, alltoall,
                                        barrier, broadcast, broadcast_, broadcast_group,
                                        global_process_set, grouped_allgather,
                                        grouped_allreduce, grouped_reducescatter, join,
                                        local_rank_op, local_size_op,
                                        process_set_included_op, rank_op, reducescatter,
                                        remove_process_set, size_op)
from hvdlite.tensorflow.sync_batch_norm import SyncBatchNormalization
from hvdlite.tensorflow import elastic  # hvd.elastic.run, TensorFlowKerasState, TensorFlowState
from hvdlite.tensorflow import util
from hvdlite.tensorflow.util import _executing_eagerly  # noqa: F401 (Horovod's suites use it)


def vars_to_refs(variables):
    """Returns hashable references of ``variables`` (``v.ref()``), as Horovod's helper."""
    return [v.ref() for v in variables]


def refs_to_vars(refs):
    """Returns the variables behind ``refs`` (the inverse of ``vars_to_refs``)."""
    return [ref.deref() for ref in refs]


__all__ = [name for name in dir() if not name.startswith("_")]
