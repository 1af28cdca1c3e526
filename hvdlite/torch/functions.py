"""Broadcasting model and optimizer state, and Python objects, across ranks.

Horovod's helpers for the start of training (``broadcast_parameters``,
``broadcast_optimizer_state``) and for small Python values (``broadcast_object``,
``allgather_object``: pickled into uint8 tensors). Every rank must make the same calls
in the same order.
"""
import torch

from hvdlite import objects, ops, runtime
from hvdlite.torch import mpi_ops


def broadcast_parameters(params, root_rank, process_set=mpi_ops.global_process_set):
    """Overwrites parameters (or any tensors) with ``root_rank``'s values, in place.

    Args:
        params: a ``state_dict()``-like mapping name -> tensor (broadcast in sorted name
            order), or an iterable of tensors or of ``(name, tensor)`` pairs such as
            ``model.named_parameters()``.
        root_rank: the rank whose values everyone receives.
        process_set: the ProcessSet whose members take part (this rank must be one).

    The pieces of an ``hvd.ShardedModule`` are left as they are: they are one model
    spread over the ranks (made equal at its construction), not copies of one.

    Raises:
        ValueError: ``params`` is neither a mapping nor an iterable.
        InvalidArgumentError, HorovodInternalError: as for ``broadcast_``.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        try:
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        except TypeError:
            raise ValueError(f"invalid params of type {type(params).__name__}") from None
    handles = []
    for name, p in items:
        if getattr(p, "_hvd_shard_group", None) is not None:  # a ShardedModule's piece
            continue
        label = None if name is None else f"broadcast.{name}"
        with torch.no_grad():
            handles.append(mpi_ops.broadcast_async_(p.data if isinstance(p, torch.nn.Parameter)
                                                    else p, root_rank, label, process_set))
    for handle in handles:
        ops.synchronize(handle)


def _all_ok(ok, process_set):
    """True on every rank iff ``ok`` is True on every rank."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    return bool(mpi_ops.allreduce_(flag, op=mpi_ops.Min, process_set=process_set)[0])


def _zero_missing_gradients(optimizer):
    """Gives every parameter that requires a gradient and has none a zero one (sparse
    for SparseAdam), as Horovod leaves a fresh optimizer's parameters."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()


def broadcast_optimizer_state(optimizer, root_rank, process_set=mpi_ops.global_process_set):
    """Makes every rank's optimizer state and hyper-parameters equal to ``root_rank``'s.

    Works for any ``torch.optim`` optimizer (plain or wrapped by DistributedOptimizer).
    The root decides the structure: it broadcasts its hyper-parameters (every
    ``param_groups`` entry except ``params``: scalars, tuples, anything picklable) and a
    description of its per-parameter state; the others create any state tensor they lack
    (of the root's shape and dtype) and receive the values in place; state the root does
    not have is removed. If the root's optimizer is fresh (e.g. Adam before its first
    step), every optimizer ends fresh, as a single process starts.

    On a rank whose optimizer has no state yet, every parameter that requires a gradient
    and has none gets a zero one (sparse for SparseAdam; frozen parameters keep None),
    as after Horovod's call. Horovod also steps such an optimizer on those zeros to
    create its state; hvdlite does not, because that step is not harmless (Adam's step
    count becomes 1, weight decay enters SGD's momentum buffer) and training would then
    differ from one process.

    Args:
        optimizer: a ``torch.optim.Optimizer``.
        root_rank: the rank whose state everyone receives.
        process_set: the ProcessSet whose members take part (this rank must be one).

    Raises:
        ValueError: the optimizer is LBFGS (its state holds no per-parameter layout), or
            ranks' optimizers do not have the same parameters (raised on every rank).
        HorovodInternalError: a collective failed.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if getattr(optimizer, "shard", 0):
        return optimizer._hvd_broadcast_state(root_rank, process_set)
    if not optimizer.state:
        _zero_missing_gradients(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    is_root = runtime.rank() == root_rank
    spec = None
    if is_root:
        state = []
        for index, p in enumerate(params):
            entries = []
            for key, value in sorted(optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                if isinstance(value, torch.Tensor):
                    entries.append((key, "tensor", tuple(value.shape), str(value.dtype)[6:]))
                else:
                    entries.append((key, "value", value))
            if p in optimizer.state:
                state.append((index, entries))
        spec = {
            "groups": [{k: v for k, v in g.items() if k != "params"}
                       for g in optimizer.param_groups],
            "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
            "shapes": [tuple(p.shape) for p in params],
            "state": state,
        }
    spec = broadcast_object(spec, root_rank, name="broadcast_optimizer_state.spec",
                            process_set=process_set)
    ok = (spec["group_sizes"] == [len(g["params"]) for g in optimizer.param_groups]
          and spec["shapes"] == [tuple(p.shape) for p in params])
    if not _all_ok(ok, process_set):
        raise ValueError("broadcast_optimizer_state: ranks' optimizers do not hold the same "
                         f"parameters (root rank {root_rank} has groups of sizes "
                         f"{spec['group_sizes']})")

    for group, hyper in zip(optimizer.param_groups, spec["groups"]):
        for key, value in hyper.items():
            group[key] = value
    with_state = set()
    handles = []
    for index, entries in spec["state"]:
        p = params[index]
        with_state.add(index)
        state = optimizer.state[p]
        for entry in entries:
            key, kind = entry[0], entry[1]
            if kind == "value":
                state[key] = entry[2]
                continue
            shape, dtype = entry[2], getattr(torch, entry[3])
            tensor = state.get(key)
            if (not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape
                    or tensor.dtype != dtype or not tensor.is_contiguous()):
                tensor = torch.zeros(shape, dtype=dtype)
                state[key] = tensor
            handles.append(mpi_ops.broadcast_async_(
                tensor, root_rank, f"broadcast_optimizer_state.{index}.{key}", process_set))
        for key in [k for k in state if k not in {e[0] for e in entries}]:
            del state[key]
    for index, p in enumerate(params):
        if index not in with_state and p in optimizer.state:
            del optimizer.state[p]
    for handle in handles:
        ops.synchronize(handle)


def broadcast_object(obj, root_rank=0, name=None, process_set=mpi_ops.global_process_set):
    """Returns ``root_rank``'s ``obj`` on every rank (pickled through a uint8 tensor).

    Args:
        obj: any picklable object (only the root's is used).
        root_rank: the rank whose object everyone receives.
        name: a base name for the two tensors, equal across ranks; None names it
            automatically.
        process_set: the ProcessSet whose members take part (this rank must be one).

    Returns:
        The root's object (the root gets ``obj`` itself back).

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``broadcast_``.
    """
    return objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=mpi_ops.global_process_set):
    """Returns the list of every rank's ``obj``, in rank order (pickled through uint8).

    Args:
        obj: any picklable object.
        name: a base name, equal across ranks; None names it automatically.
        process_set: the ProcessSet whose members take part (this rank must be one).

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``allgather``.
    """
    return objects.allgather_object(obj, name, process_set)
