"""hvdlite for TensorFlow 2: ``import hvdlite.tensorflow as hvd`` for ``horovod.tensorflow``.

    import hvdlite.tensorflow as hvd
    hvd.init()
    tape = hvd.DistributedGradientTape(tape)
    hvd.broadcast_variables(model.variables, root_rank=0)

Every op works eagerly and inside ``tf.function`` (see ``mpi_ops``); which path copies
memory, per case, is in ``tensors``. Nothing here is compiled against TensorFlow.
"""
from hvdlite.errors import (HorovodInternalError, HvdliteError, InvalidArgumentError,
                            MismatchError)
from hvdlite.runtime import (cross_rank, cross_size, init, is_initialized, local_rank,
                             local_size, mpi_threads_supported, rank, shutdown, size,
                             start_timeline, stop_timeline)
from hvdlite.tensorflow.compression import Compression
from hvdlite.tensorflow.functions import (allgather_object, broadcast_object,
                                          broadcast_variables)
from hvdlite.tensorflow.gradient_tape import DistributedGradientTape, allreduce_gradients
from hvdlite.tensorflow.mpi_ops import (Average, Max, Min, Product, ProcessSet, Sum,
                                        add_process_set, allgather, allreduce, alltoall,
                                        barrier, broadcast, broadcast_group,
                                        global_process_set, grouped_allreduce, join,
                                        reducescatter, remove_process_set)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "mpi_threads_supported", "start_timeline", "stop_timeline",
    "Average", "Sum", "Min", "Max", "Product", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_group",
    "alltoall", "reducescatter", "join", "barrier",
    "broadcast_variables", "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "DistributedGradientTape", "allreduce_gradients",
    "HvdliteError", "HorovodInternalError", "InvalidArgumentError", "MismatchError",
]
