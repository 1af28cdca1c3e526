"""How a torch optimizer's gradients are reduced: through a reducer.

A cast compressor (Compression.none, fp16, bf16) is served by ``CompressedAllreduce``
(compress -> allreduce in place -> decompress); a framework-free reducer of
``hvdlite.reducers`` (top-k, quantization, PowerSGD) runs on numpy views of the
gradients (``OnCpuArrays``). The DistributedOptimizer and the Keras optimizer on the
torch backend both go through ``reducer_for``.
"""
import torch

from hvdlite import process_sets, reducers
from hvdlite.reducers import Reducer
from hvdlite.torch import async_collectives, mpi_ops


class CompressedAllreduce(Reducer):
    """compress -> allreduce in place -> decompress: the reducer of the cast compressors
    (Compression.none, fp16, bf16), on torch tensors with no copy beyond the casts."""

    def __init__(self, compression, op, scale, process_set):
        self.compression, self.op, self.scale = compression, op, scale
        self.process_set = process_set

    def start(self, names, grads):
        sent = [self.compression.compress(grad) for grad in grads]
        tensors = [tensor for tensor, _ in sent]
        if len(tensors) == 1:
            handle = async_collectives.enqueue_allreduce(tensors[0], tensors[0], names[0], self.op,
                                                         *self.scale, self.process_set)
        else:
            handle = async_collectives.enqueue_grouped_allreduce(tensors, tensors, names, self.op,
                                                                 *self.scale, self.process_set,
                                                                 names[0])
        return handle, sent

    def finish(self, token):
        handle, sent = token
        mpi_ops.synchronize(handle)
        return [self.compression.decompress(tensor, ctx) for tensor, ctx in sent]


class CompressedReducescatter(Reducer):
    """compress -> reduce-scatter -> decompress of a unit of gradients laid end to end in
    one flat buffer: each rank receives its contiguous, near-equal piece of the reduction
    (the first ``n % size`` ranks one element more), the gradients of sharded optimizer
    stage 2 (``hvdlite.torch.sharding``). One gradient goes as it is, several are packed
    (the core does not fuse reduce-scatters)."""

    def __init__(self, compression, op, scale, process_set):
        self.compression, self.op, self.scale = compression, op, scale
        self.process_set = process_set

    def start(self, names, grads):
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 \
            else grads[0].reshape(-1)
        tensor, ctx = self.compression.compress(flat)
        handle = async_collectives.enqueue_reducescatter(tensor, names[0], self.op, *self.scale,
                                                         self.process_set)
        return [handle, ctx, None]  # the result, once taken

    def settle(self, token):
        """Takes the result of a reduce-scatter that has ended, so that its handle lets go
        of the input (the gradients) before ``finish``; never blocks."""
        if token[2] is None and token[0].poll():
            self.finish(token)

    def finish(self, token):
        handle, ctx, result = token
        if result is None:
            result = token[2] = self.compression.decompress(mpi_ops.synchronize(handle), ctx)
        return [result]


class OnCpuArrays(Reducer):
    """Runs a framework-free reducer (``hvdlite.reducers``) on numpy views of the
    gradients, and gives its updates back as tensors of the gradients' dtype and device."""

    def __init__(self, reducer):
        self.reducer = reducer

    def start(self, names, grads):
        arrays = [grad.detach().to("cpu", torch.float32).numpy() for grad in grads]
        return self.reducer.start(names, arrays), [(g.dtype, g.device) for g in grads]

    def finish_all(self, tokens):
        updates = self.reducer.finish_all([token for token, _ in tokens])
        return [[torch.from_numpy(u).to(device, dtype) for u, (dtype, device) in zip(us, kinds)]
                for us, (_, kinds) in zip(updates, tokens)]


def reduce_gradients(compression, grads, names, op=mpi_ops.Average, scale=(1.0, 1.0),
                     process_set=mpi_ops.global_process_set):
    """Reduces torch gradients in one go through ``reducer_for(compression, ...)``;
    returns the updates in order (a cast compressor's are the gradients, reduced in
    place where it casts nothing)."""
    reducer = reducer_for(compression, op, list(scale), process_set)
    (updates,) = reducer.finish_all([reducer.start(names, grads)])
    return updates


def reducer_for(compression, op, scale, process_set):
    """The optimizer's reducer: ``compression`` itself when it is one, else the
    compressed allreduce of a cast compressor."""
    if not reducers.is_reducer(compression):
        return CompressedAllreduce(compression, op, scale, process_set)
    reducers.check_reducer(compression, op, list(scale) != [1.0, 1.0],
                           process_sets.process_set_id(process_set))
    return OnCpuArrays(compression)
