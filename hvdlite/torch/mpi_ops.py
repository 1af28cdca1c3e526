"""Tensor collectives for PyTorch: CPU tensors by pointer, and their autograd functions.

Built on ``hvdlite.ops``: a tensor is looked at through a zero-copy numpy view so that
naming, validation (dtype, op, scaling, root, splits) and handles are exactly those of
the framework-free layer; the core then reads and writes the tensor's own memory
(``tensor.data_ptr()``). Nothing here is compiled against torch.

* Out-of-place ops (``allreduce``, ``broadcast``, ``reducescatter``) allocate the result
  with torch and let the core write into it; ``*_`` forms write into the given tensor.
* ``allgather`` and ``alltoall`` results are allocated by the core (their size is known
  only after negotiation); they are wrapped as tensors without a copy and keep the
  native handle alive until the last view of them is gone.
* Tensors must be contiguous CPU tensors: a non-contiguous one is refused rather than
  copied behind the caller's back (``tensor.contiguous()`` makes one); a CUDA tensor is
  refused until the GPU path lands.

``*_async`` functions return an ``hvdlite.Handle``; ``synchronize(handle)`` returns the
result tensor, ``poll(handle)`` says whether it is ready. Unnamed tensors are named as
in ``hvdlite.ops`` (``"allreduce.noname.<n>"``...), so names agree across ranks when
every rank makes the same unnamed calls in the same order.

This module is the public face (``horovod.torch.mpi_ops``) and holds the synchronous,
differentiable forms; the rest is by role: ``tensors`` (dtype table, tensor checks),
``async_collectives`` (the ``*_async`` functions) and ``autograd`` (the gradients).
"""

from hvdlite import _checks, _enqueue, _refusals, ops, process_sets
from hvdlite._enqueue import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 (Horovod)
from hvdlite.torch import async_collectives, autograd, repeats, tensors
# The asynchronous collectives (and control), where Horovod scripts import them from.
from hvdlite.torch.async_collectives import (SparseHandle, allgather_async,  # noqa: F401
                                             allreduce_async, allreduce_async_, alltoall_async,
                                             barrier, broadcast_async, broadcast_async_,
                                             grouped_allgather_async, grouped_allreduce_async,
                                             grouped_allreduce_async_,
                                             grouped_reducescatter_async, join, poll,
                                             reducescatter_async, sparse_allreduce_async,
                                             synchronize)
from hvdlite.torch.compression import Compression
from hvdlite.torch.tensors import (TORCH_DTYPE_NAMES, native_dtype_code,  # noqa: F401
                                   torch_dtype_name)


_ALLREDUCE, _ALLGATHER = _enqueue.ALLREDUCE, _enqueue.ALLGATHER
_BROADCAST, _REDUCESCATTER = _enqueue.BROADCAST, _enqueue.REDUCESCATTER
_ALLTOALL = _enqueue.ALLTOALL

# Process sets: the framework-free ones (hvdlite.process_sets), as Horovod's torch
# module exports them.
ProcessSet = process_sets.ProcessSet
global_process_set = process_sets.global_process_set
add_process_set = process_sets.add_process_set
remove_process_set = process_sets.remove_process_set
_basics = process_sets.basics  # Horovod's own tests query mpi_ops._basics


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` across ranks in place and returns it (not differentiable).

    See ``allreduce_async``; raises HorovodInternalError subclasses if it fails.
    """
    args = (op, prescale_factor, postscale_factor, process_set)
    repeated = None if average is not None else repeats.repeat(_ALLREDUCE, name, tensor,
                                                               tensor, args)
    return _first_allreduce_(tensor, average, name, args) if repeated is None else repeated


def _first_allreduce_(tensor, average, name, args):
    """``allreduce_`` of a call that repeats no kept one (``hvdlite.torch.repeats``):
    the whole way, then kept."""
    op, prescale_factor, postscale_factor, process_set = args
    result = ops.synchronize(_enqueue.at_once(allreduce_async_, tensor, average, name, op,
                                              prescale_factor, postscale_factor, process_set))
    if average is None:
        repeats.keep(_ALLREDUCE, name, tensor, args, _checks.resolve_op(op, None),
                     prescale_factor, postscale_factor)
    return result


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` across ranks and returns a new tensor; differentiable.

    The gradient is the allreduce of the incoming gradient with the same op and scaling
    (for Sum and Average that is the exact gradient of the sum of every rank's loss).

    Args:
        tensor, average, name, op, prescale_factor, postscale_factor, process_set: as for
            ``allreduce_async``.
        compression: compresses the tensor for the wire (e.g. Compression.fp16).

    Returns:
        A new tensor of the same shape and dtype.

    Raises:
        InvalidArgumentError, DuplicateNameError, NotInitializedError: refused.
        HorovodInternalError: the collective failed (e.g. MismatchError across ranks).
    """
    args = (op, prescale_factor, postscale_factor, process_set)
    repeated = (repeats.repeat(_ALLREDUCE, name, tensor, None, args)
                if average is None and compression is Compression.none else None)
    return (_first_allreduce(tensor, average, name, compression, args) if repeated is None
            else repeated)


def _first_allreduce(tensor, average, name, compression, args):
    """``allreduce`` of a call that repeats no kept one (as ``_first_allreduce_``)."""
    op, prescale_factor, postscale_factor, process_set = args
    resolved = _checks.resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = autograd.run(autograd.AllreduceFunction, compressed, name, resolved,
                           prescale_factor, postscale_factor, process_set)
    if average is None and compression is Compression.none:
        repeats.keep(_ALLREDUCE, name, tensor, args, resolved, prescale_factor,
                     postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """Reduces several tensors in place, together; returns them (not differentiable)."""
    return ops.synchronize(grouped_allreduce_async_(tensors, average, name, op,
                                                    prescale_factor, postscale_factor,
                                                    process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Reduces several tensors together; returns a list of new tensors; differentiable.

    See ``grouped_allreduce_async`` and ``allreduce``.
    """
    op = _checks.resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    reduced = autograd.run(autograd.GroupedAllreduceFunction, name, op, prescale_factor,
                           postscale_factor, process_set, *[c for c, _ in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's ``tensor`` along the first dimension; differentiable.

    The gradient is Horovod's: the incoming gradients averaged over ranks, this rank's
    rows of it. See ``allgather_async``; raises HorovodInternalError subclasses if it fails.
    """
    args = (process_set,)
    repeated = repeats.repeat(_ALLGATHER, name, tensor, None, args)
    return _first_allgather(tensor, name, args) if repeated is None else repeated


def _first_allgather(tensor, name, args):
    """``allgather`` of a call that repeats no kept one (as ``_first_allreduce_``)."""
    process_set, = args
    result = autograd.run(autograd.AllgatherFunction, tensor, name, process_set)
    repeats.keep(_ALLGATHER, name, tensor, args, finisher=tensors.core_result(
        tensor, tensor.shape[0] * process_sets.members(process_set)[0]))
    return result


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites ``tensor`` with ``root_rank``'s values and returns it (in place)."""
    args = (root_rank, process_set)
    repeated = repeats.repeat(_BROADCAST, name, tensor, tensor, args)
    return _first_broadcast_(tensor, name, args) if repeated is None else repeated


def _first_broadcast_(tensor, name, args):
    """``broadcast_`` of a call that repeats no kept one (as ``_first_allreduce_``)."""
    root_rank, process_set = args
    result = ops.synchronize(_enqueue.at_once(broadcast_async_, tensor, root_rank, name,
                                              process_set))
    repeats.keep(_BROADCAST, name, tensor, args, root_rank=root_rank)
    return result


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``tensor`` on every rank (a new tensor); differentiable.

    The gradient is Horovod's: the incoming gradients averaged over ranks on the root,
    zero on the other ranks. See ``broadcast_async``; raises HorovodInternalError
    subclasses if it fails.
    """
    args = (root_rank, process_set)
    repeated = repeats.repeat(_BROADCAST, name, tensor, None, args)
    return _first_broadcast(tensor, name, args) if repeated is None else repeated


def _first_broadcast(tensor, name, args):
    """``broadcast`` of a call that repeats no kept one (as ``_first_allreduce_``)."""
    root_rank, process_set = args
    result = autograd.run(autograd.BroadcastFunction, tensor, root_rank, name, process_set)
    repeats.keep(_BROADCAST, name, tensor, args, root_rank=root_rank)
    return result


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """All-to-all exchange of rows; differentiable.

    Returns:
        The received tensor when ``splits`` is None, else ``(received, received_splits)``
        as Horovod does.

    See ``alltoall_async`` for the arguments; raises HorovodInternalError subclasses if it
    fails.
    """
    # Only an even split (splits None) is kept: a list may change in place.
    repeated = (repeats.repeat(_ALLTOALL, name, tensor, None, (process_set,))
                if splits is None else None)
    return _first_alltoall(tensor, splits, name, process_set) if repeated is None else repeated


def _first_alltoall(tensor, splits, name, process_set):
    """``alltoall`` of a call that repeats no kept one (as ``_first_allreduce_``)."""
    received, recv_splits = autograd.run(
        autograd.AlltoallFunction, tensor, async_collectives.splits_list(splits), name,
        process_set)
    if splits is None:  # (its result then the received tensor alone: no splits read)
        repeats.keep(_ALLTOALL, name, tensor, (process_set,),
                     finisher=tensors.core_result(tensor, tensor.shape[0]))
    return received if splits is None else (received, recv_splits)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` across ranks and returns this rank's rows; differentiable.

    The gradient is Horovod's (for Sum and Average only): the allgather of the incoming
    gradients, times size() for Sum and times the scale factors. See
    ``reducescatter_async`` for the arguments.
    """
    args = (op, prescale_factor, postscale_factor, process_set)
    repeated = (repeats.repeat(_REDUCESCATTER, name, tensor, None, args)
                if compression is Compression.none else None)
    return (_first_reducescatter(tensor, name, compression, args) if repeated is None
            else repeated)


def _first_reducescatter(tensor, name, compression, args):
    """``reducescatter`` of a call that repeats no kept one (as ``_first_allreduce_``)."""
    op, prescale_factor, postscale_factor, process_set = args
    compressed, ctx = compression.compress(tensor)
    out = autograd.run(autograd.ReducescatterFunction, compressed, name, op, prescale_factor,
                       postscale_factor, process_set)
    if compression is Compression.none:
        repeats.keep(_REDUCESCATTER, name, tensor, args, op, prescale_factor, postscale_factor,
                     out_shape=out.shape)
    return compression.decompress(out, ctx)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Gathers several tensors together; returns a list of new tensors; differentiable.

    See ``grouped_allgather_async``; raises HorovodInternalError subclasses if it fails.
    """
    return list(autograd.run(autograd.GroupedAllgatherFunction, name, process_set, *tensors))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduces several tensors together, each scattered by rows; returns this rank's
    parts as new tensors; differentiable. See ``grouped_reducescatter_async``."""
    pairs = [compression.compress(t) for t in tensors]
    outs = autograd.run(autograd.GroupedReducescatterFunction, name, op, prescale_factor,
                        postscale_factor, process_set, *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# Refusals are sent to the other ranks (see async_collectives, which wraps the
# asynchronous forms alike).
# A repeated call's path (hvdlite.torch.repeats) raises no refusal: the first call's is
# wrapped instead of the public function.
for _fn_name, _op in (
        ("_first_allreduce", _enqueue.ALLREDUCE), ("_first_allreduce_", _enqueue.ALLREDUCE),
        ("grouped_allreduce", _enqueue.ALLREDUCE), ("grouped_allreduce_", _enqueue.ALLREDUCE),
        ("_first_allgather", _enqueue.ALLGATHER), ("grouped_allgather", _enqueue.ALLGATHER),
        ("_first_broadcast", _enqueue.BROADCAST), ("_first_broadcast_", _enqueue.BROADCAST),
        ("_first_alltoall", _enqueue.ALLTOALL), ("_first_reducescatter", _enqueue.REDUCESCATTER),
        ("grouped_reducescatter", _enqueue.REDUCESCATTER)):
    globals()[_fn_name] = _refusals.refusing(_op)(globals()[_fn_name])
del _fn_name, _op
