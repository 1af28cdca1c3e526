"""Sharded optimizer state (ZeRO stage 1): ``DistributedOptimizer(..., shard=1)``.

Gradients are averaged exactly as without sharding (the hooks, fusion, overlap with
backward). Then each parameter belongs to one rank of the process set: whole parameters,
dealt out largest first to the rank holding the fewest elements so far, the same on every
rank. A rank steps only its own parameters, so the wrapped optimizer creates state
(Adam's moments, SGD's momentum) for those alone; the updated parameters reach the other
ranks in one allgather per dtype. Any ``torch.optim`` optimizer works unchanged: every
one of them skips a parameter whose ``.grad`` is None, which is how the others'
parameters are left out of a rank's step.

Memory: about 1/size of the optimizer state per rank (give or take one parameter).
Wire: the gradients' allreduce, 2(n-1)/n of their bytes, plus the parameters' allgather,
(n-1)/n: 1.5x an unsharded step.

Layer-wise optimizers (``hvdlite.torch.LARS``, ``LAMB``) see each parameter whole on
its owner, so their norms need no communication.

Checkpoints: ``consolidate_state_dict(to=r)`` on every rank gathers the whole state on
rank r, whose ``state_dict()`` then returns it in the unsharded layout (loadable by any
rank count, sharded or not); ``load_state_dict`` takes such a dict on every rank (each
keeps its part), and ``broadcast_optimizer_state`` sends the root's whole state.
"""
import torch

from hvdlite import process_sets
from hvdlite.torch import mpi_ops
from hvdlite.torch.functions import allgather_object, broadcast_object


def assign_owners(sizes, ranks):
    """Owner of each parameter: largest first (ties: first in order), to the rank with the
    fewest elements so far (ties: the lowest rank).

    Args:
        sizes: each parameter's number of elements, in parameter order.
        ranks: the number of ranks sharing them.

    Returns:
        A list of ranks, one per parameter.
    """
    load = [0] * ranks
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += sizes[index]
    return owners


class _ShardedOptimizer:
    """Methods mixed in after ``_DistributedOptimizer``'s (see ``DistributedOptimizer``)."""

    def _hvd_shard_setup(self, shard):
        if shard != 1:
            raise ValueError(f"shard={shard!r}: this version shards the optimizer state "
                             "(shard=1); 0 turns sharding off")
        self.shard = shard
        size, self._shard_rank = process_sets.members(self.process_set)
        params = [p for group in self.param_groups for p in group["params"]]
        owners = assign_owners([p.numel() for p in params], size)
        self._owner = {p: owner for p, owner in zip(params, owners)}
        # dtype -> one list of parameters per rank, in parameter order: the allgather's
        # layout, the same on every rank.
        self._layout = {}
        for p, owner in zip(params, owners):
            if p.requires_grad:
                self._layout.setdefault(p.dtype, [[] for _ in range(size)])[owner].append(p)
        self._full_state = None  # a whole state dict this rank holds (consolidated or loaded)

    def owns(self, parameter):
        """Whether this rank steps ``parameter`` (and holds its optimizer state)."""
        return self._owner[parameter] == self._shard_rank

    def step(self, closure=None):
        """Synchronizes the gradients, steps this rank's parameters, and gathers every
        rank's updated parameters."""
        self._synchronize_for_step()
        others = {p: p.grad for p in self._owner if not self.owns(p) and p.grad is not None}
        for p in others:
            p.grad = None
        try:
            loss = self._hvd_base.step(self, closure)
        finally:
            for p, grad in others.items():
                p.grad = grad
        self._full_state = None
        self._gather_parameters()
        return loss

    def _gather_parameters(self):
        me = self._shard_rank
        with torch.no_grad():
            for dtype, by_rank in self._layout.items():
                mine = [p.reshape(-1) for p in by_rank[me]]
                flat = torch.cat(mine) if mine else torch.empty(0, dtype=dtype,
                                                                device=self._device())
                full = mpi_ops.allgather(flat, name=f"shard.parameters.{dtype}",
                                         process_set=self.process_set)
                offset = 0
                for rank, params in enumerate(by_rank):
                    for p in params:
                        n = p.numel()
                        if rank != me:
                            p.copy_(full[offset:offset + n].view_as(p))
                        offset += n

    def _device(self):
        return next(iter(self._owner)).device

    def consolidate_state_dict(self, to=0):
        """Gathers the whole optimizer state on rank ``to`` (collective: every rank calls
        it); that rank's ``state_dict()`` then returns it, in the unsharded layout."""
        local = self._hvd_base.state_dict(self)
        parts = allgather_object(local["state"], name="shard.consolidate",
                                 process_set=self.process_set)
        if self._shard_rank == to:
            merged = {}
            for part in parts:
                merged.update(part)
            self._full_state = {"state": dict(sorted(merged.items())),
                                "param_groups": local["param_groups"]}

    def state_dict(self):
        """The whole state, after ``consolidate_state_dict`` on every rank (or after
        ``load_state_dict``).

        Raises:
            RuntimeError: this rank holds only its shard: call
                ``consolidate_state_dict(to=this rank)`` on every rank first.
        """
        if self._full_state is None:
            raise RuntimeError(
                "DistributedOptimizer(shard=1): this rank holds only its part of the "
                "optimizer state; call optimizer.consolidate_state_dict(to=rank) on every "
                "rank, then optimizer.state_dict() on that rank")
        return self._full_state

    def load_state_dict(self, state_dict):
        """Loads a whole state dict (from ``state_dict()``, any rank count, sharded or
        not); this rank keeps the state of its own parameters."""
        self._hvd_base.load_state_dict(self, state_dict)
        for p in list(self.state):
            if not self.owns(p):
                del self.state[p]
        self._full_state = state_dict

    def _hvd_broadcast_state(self, root_rank, process_set):
        """broadcast_optimizer_state for a sharded optimizer: the root's whole state (one
        it loaded, else the ranks' shards gathered on it) goes to every rank, and each
        keeps its part."""
        root_set_rank = process_set.ranks.index(root_rank) if process_set.process_set_id \
            else root_rank
        has_full = broadcast_object(self._full_state is not None, root_rank,
                                    name="shard.broadcast.has", process_set=process_set)
        if not has_full:
            self.consolidate_state_dict(to=root_set_rank)
        full = broadcast_object(self._full_state, root_rank, name="shard.broadcast.state",
                                process_set=process_set)
        self.load_state_dict(full)
