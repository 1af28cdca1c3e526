"""The autograd functions of the differentiable torch collectives (Horovod's gradients).

Each forward runs its collective to the end (``hvdlite.torch.async_collectives``); each
backward runs the collective that Horovod defines as its gradient.
"""
import torch

from hvdlite import _enqueue, ops, process_sets, runtime
from hvdlite._enqueue import Average, Sum
from hvdlite.torch.async_collectives import (allgather_async, alltoall_async, enqueue_allreduce,
                                             enqueue_broadcast, enqueue_grouped_allgather,
                                             enqueue_grouped_allreduce, enqueue_reducescatter,
                                             group_names, grouped_allgather_async,
                                             grouped_reducescatter_async)


class _Untracked:
    """The ctx of a forward run outside autograd (``run``): nothing calls its backward."""

    def mark_non_differentiable(self, *tensors):
        pass


def run(function, *args):
    """``function.apply(*args)`` where autograd records the collective (grad enabled and
    a tensor argument requiring it), else only its forward: ``Function.apply`` costs a
    few microseconds a call, as much as a small collective itself, and a loss or metric
    averaged every step (``hvd.allreduce(loss.detach())``) is never differentiated. The
    result is the same tensor either way (apply attaches no graph to it then)."""
    if torch.is_grad_enabled():
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                return function.apply(*args)
    return function.forward(_Untracked(), *args)


def _run(enqueue, *args):
    """One single-tensor collective to the end: enqueued and waited for in one call of the
    core (``_enqueue.at_once``); returns its result."""
    return ops.synchronize(_enqueue.at_once(enqueue, *args))


class AllreduceFunction(torch.autograd.Function):
    """allreduce whose backward is the allreduce of the gradient with the same op."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op = op
        ctx.scale = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        return _run(enqueue_allreduce, tensor, None, name, op, prescale_factor, postscale_factor,
                    process_set)

    @staticmethod
    def backward(ctx, grad_output):
        grad = _run(enqueue_allreduce, grad_output.contiguous(), None, None, ctx.op, *ctx.scale,
                    ctx.process_set)
        return grad, None, None, None, None, None


class GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.op = op
        ctx.scale = (prescale_factor, postscale_factor)
        ctx.process_set = process_set
        tensors, names, group = group_names(tensors, name, process_set)
        return tuple(ops.synchronize(enqueue_grouped_allreduce(
            tensors, [None] * len(tensors), names, op, prescale_factor, postscale_factor,
            process_set, group)))

    @staticmethod
    def backward(ctx, *grads):
        grads, names, group = group_names([g.contiguous() for g in grads], None,
                                          ctx.process_set)
        reduced = ops.synchronize(enqueue_grouped_allreduce(
            grads, [None] * len(grads), names, ctx.op, *ctx.scale, ctx.process_set, group))
        return (None, None, None, None, None, *reduced)


class AllgatherFunction(torch.autograd.Function):
    """allgather whose backward is Horovod's: the gradient averaged over ranks, then
    this rank's rows (so ranks that all pass the same gradient get exactly it back)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        handle = _enqueue.at_once(allgather_async, tensor, name, process_set)  # validates first
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        return ops.synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        grad = _run(enqueue_allreduce, grad_output.contiguous(), None, None, Average, 1.0, 1.0,
                    ctx.process_set)
        rows = ops.synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int64),
                                               None, ctx.process_set))
        offset = int(rows[:process_sets.members(ctx.process_set)[1]].sum())
        return grad.narrow(0, offset, ctx.rows), None, None


class BroadcastFunction(torch.autograd.Function):
    """broadcast whose backward is Horovod's: the gradient averaged over ranks on the
    root, zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return _run(enqueue_broadcast, tensor, None, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        grad = _run(enqueue_allreduce, grad_output.contiguous(), None, None, Average, 1.0, 1.0,
                    ctx.process_set)
        if runtime.rank() != ctx.root_rank:
            grad.zero_()
        return grad, None, None, None


class AlltoallFunction(torch.autograd.Function):
    """alltoall whose backward sends each gradient row back where it came from."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        received, recv_splits = _run(alltoall_async, tensor, splits, name, process_set)
        ctx.recv_splits = recv_splits.tolist()
        ctx.mark_non_differentiable(recv_splits)
        return received, recv_splits

    @staticmethod
    def backward(ctx, grad_output, _grad_splits):
        grad, _ = _run(alltoall_async, grad_output.contiguous(), ctx.recv_splits, None,
                       ctx.process_set)
        return grad, None, None, None


class ReducescatterFunction(torch.autograd.Function):
    """reducescatter whose backward is Horovod's: the allgather of the gradient rows,
    times size() for Sum and times the scale factors."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.scale = None
        if op in (Sum, Average):
            ctx.scale = prescale_factor * postscale_factor * (
                process_sets.members(process_set)[0] if op == Sum else 1)
        ctx.process_set = process_set
        return _run(enqueue_reducescatter, tensor, name, op, prescale_factor, postscale_factor,
                    process_set)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.scale is None:
            raise RuntimeError("reducescatter is differentiable only for op=Sum or Average")
        grad = ops.synchronize(allgather_async(grad_output.contiguous(), None,
                                               ctx.process_set))
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        return grad, None, None, None, None, None


class GroupedAllgatherFunction(torch.autograd.Function):
    """Grouped allgather; as Horovod defines it, each tensor's gradient is this rank's
    rows of the average over ranks of the result's gradient."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [int(t.shape[0]) for t in tensors]
        ctx.process_set = process_set
        return tuple(ops.synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        grads, names, group = group_names([g.contiguous() for g in grads], None,
                                          ctx.process_set)
        reduced = ops.synchronize(enqueue_grouped_allreduce(
            grads, [None] * len(grads), names, Average, 1.0, 1.0, ctx.process_set, group))
        rows = ops.synchronize(allgather_async(
            torch.tensor([ctx.rows], dtype=torch.int64), None, ctx.process_set))
        offsets = rows[:process_sets.members(ctx.process_set)[1]].sum(0).tolist()
        return (None, None, *[g.narrow(0, int(at), n)
                              for g, at, n in zip(reduced, offsets, ctx.rows)])


class GroupedReducescatterFunction(torch.autograd.Function):
    """Grouped reducescatter; as Horovod defines it, each tensor's gradient is the
    allgather of its result's gradient, times size() for Sum and times the scale
    factors."""

    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.scale = None
        if op in (Sum, Average):
            ctx.scale = prescale_factor * postscale_factor * (
                process_sets.members(process_set)[0] if op == Sum else 1)
        ctx.process_set = process_set
        return tuple(ops.synchronize(grouped_reducescatter_async(
            tensors, name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.scale is None:
            raise RuntimeError("reducescatter is differentiable only for op=Sum or Average")
        grads, names, group = group_names([g.contiguous() for g in grads], None,
                                          ctx.process_set, "grouped_allgather")
        gathered = ops.synchronize(enqueue_grouped_allgather(grads, names, group,
                                                             ctx.process_set))
        if ctx.scale != 1.0:
            gathered = [g * ctx.scale for g in gathered]
        return (None, None, None, None, None, *gathered)
