"""hvdlite for PyTorch: ``import hvdlite.torch as hvd`` where Horovod scripts have
``import horovod.torch as hvd``.

    hvd.init()
    torch.set_num_threads(1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Thin Python over the core's C API: CPU tensors go to the core by pointer (no copy) and
nothing is compiled against torch. CUDA tensors are refused with a clear error until the
GPU path lands.
"""
from hvdlite.errors import (HorovodInternalError, HvdliteError, InvalidArgumentError,
                            MismatchError)
from hvdlite.runtime import (cross_rank, cross_size, init, is_initialized, local_rank,
                             local_size, mpi_threads_supported, rank, shutdown, size,
                             start_timeline, stats, stop_timeline)
from hvdlite.torch.compression import Compression
from hvdlite.torch.functions import (allgather_object, broadcast_object,
                                     broadcast_optimizer_state, broadcast_parameters)
from hvdlite.torch.mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,
                                   add_process_set, allgather, grouped_allgather,
                                   grouped_allgather_async, grouped_reducescatter,
                                   grouped_reducescatter_async, remove_process_set,
                                   allgather_async, allreduce, allreduce_, allreduce_async,
                                   allreduce_async_, alltoall, alltoall_async, barrier,
                                   broadcast, broadcast_, broadcast_async, broadcast_async_,
                                   global_process_set, grouped_allreduce,
                                   grouped_allreduce_, grouped_allreduce_async,
                                   grouped_allreduce_async_, join, poll, reducescatter,
                                   reducescatter_async, sparse_allreduce_async,
                                   synchronize)
from hvdlite.torch.optimizer import DistributedOptimizer
from hvdlite.torch.layerwise import LAMB, LARS
from hvdlite.torch.sharded_module import ShardedModule
from hvdlite.torch.sync_batch_norm import SyncBatchNorm
from hvdlite.torch import elastic  # noqa: E402 - hvd.elastic.run, TorchState, ElasticSampler


# What this build has, by the names Horovod scripts query (shared with TensorFlow).
from hvdlite.capabilities import (ccl_built, cuda_built, ddl_built, gloo_built,
                                  gloo_enabled, gpu_available, is_homogeneous, mpi_built,
                                  mpi_enabled, nccl_built, rocm_built)

__all__ = [name for name in dir() if not name.startswith("_")]
