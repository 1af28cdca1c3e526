"""Sharded optimizers: ``DistributedOptimizer(..., shard=1)`` shards the optimizer state
(ZeRO stage 1), ``shard=2`` the reduced gradients too (stage 2).

Stage 1. Gradients are averaged exactly as without sharding (the hooks, fusion, overlap
with backward). Then each parameter belongs to one rank of the process set: whole
parameters, dealt out largest first to the rank holding the fewest elements so far, the
same on every rank. A rank steps only its own parameters, so the wrapped optimizer creates
state (Adam's moments, SGD's momentum) for those alone. Any ``torch.optim`` optimizer works
unchanged: every one of them skips a parameter whose ``.grad`` is None, which is how the
others' parameters are left out of a rank's step. Memory: about 1/size of the optimizer
state per rank (give or take one parameter). Wire: the gradients' allreduce, 2(n-1)/n of
their bytes, plus the parameters' allgather, (n-1)/n: 1.5x an unsharded step.

Stage 2. The parameters are cut element-wise instead: gradients are packed in buckets (the
``groups``, else about ``BUCKET_BYTES`` of consecutive parameters of one dtype, in the order
backward produces them), and each bucket, as soon as backward has finished its gradients,
goes through one reduce-scatter: each rank receives a contiguous, near-equal piece of the
bucket's averaged gradients (a parameter may straddle ranks), and the full gradients are
dropped. A rank then steps its *pieces*: flat views of its slice of each parameter, so the
wrapped optimizer creates state for those elements alone. Memory: 1/size of the gradients
and of the optimizer state. Wire: reduce-scatter (n-1)/n plus allgather (n-1)/n: the bytes
of one allreduce. Optimizers whose update mixes a parameter's elements work through a hook:
LARS and LAMB sum the pieces' squared norms of every parameter in one small allreduce.
Optimizers that need a parameter's shape (LBFGS, Adafactor's factored moments) are refused.

Both stages: the updated parameters reach every rank after the step, in one allgather per
bucket (``_gather_parameters``: two at a time, so that no rank ever holds a second copy
of the model). Checkpoints: ``consolidate_state_dict(to=r)`` on every rank
gathers the whole state on rank r, whose ``state_dict()`` then returns it in the unsharded
layout (loadable by any rank count, sharded or not, either stage); ``load_state_dict``
takes such a dict on every rank (each keeps its part), and ``broadcast_optimizer_state``
sends the root's whole state. Elastic commits keep each rank's part as it holds it
(``local_state_dict``) and a new world of any size takes its share of the old world's
parts (``load_local_state_dicts``): see hvdlite/torch/sharded_commit.py.
"""
import contextlib

import torch

from hvdlite import _checks, process_sets
from hvdlite.torch import mpi_ops, reduction
from hvdlite.torch.functions import allgather_object, broadcast_object

#: Stage 2 packs about this many bytes of consecutive gradients into one reduce-scatter
#: when no ``groups`` are given: large enough that one MPI call moves a lot, small enough
#: that the first buckets are on the wire while backward computes the rest.
BUCKET_BYTES = 16 << 20

# Optimizers whose step needs a parameter whole (its shape, or all its elements at once).
_WHOLE_PARAMETER_OPTIMIZERS = ("LBFGS", "Adafactor", "Muon")


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


def piece_bounds(elements, ranks):
    """Where each rank's piece of a flat buffer of ``elements`` starts and ends, as a
    reduce-scatter splits it (the first ``elements % ranks`` ranks get one more).

    Returns:
        ``ranks + 1`` offsets: rank r holds ``[bounds[r], bounds[r + 1])``.
    """
    bounds = [0]
    for rank in range(ranks):
        bounds.append(bounds[-1] + _checks.reducescatter_rows(elements, ranks, rank))
    return bounds


def buckets(params, limit_bytes):
    """The units of the sharded optimizers: runs of consecutive parameters of one dtype,
    taken from the last (whose gradient backward produces first), of at most
    ``limit_bytes`` unless one parameter alone is larger (it then goes alone, so that its
    gradient needs no packing); parameters in their own order within a bucket."""
    units, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (current[0].dtype != p.dtype or size + nbytes > limit_bytes):
            units.append(tuple(reversed(current)))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        units.append(tuple(reversed(current)))
    return units


def _per_element(value):
    """Whether a state entry holds one value per element of its parameter (moments,
    momentum) rather than one for the whole parameter (a step count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class _ShardedOptimizer:
    """Methods mixed in after ``_DistributedOptimizer``'s (see ``DistributedOptimizer``):
    what both stages share, and stage 1's way of splitting the parameters."""

    def _hvd_shard_setup(self, shard, groups):
        self.shard = shard
        self._shard_size, self._shard_rank = process_sets.members(self.process_set)
        self._params = [p for group in self.param_groups for p in group["params"]]
        # Per parameter: the tensor this rank steps for it (None: none) and the elements
        # of the parameter it covers, [start, stop) of the flattened parameter.
        self._stepped, self._span = [], []
        # The allgathers after a step, each (name, one list per rank of (parameter,
        # start, stop) in gathering order): the same on every rank.
        self._gathers = []
        self._split_parameters(groups)
        self._full_state = None  # a whole state dict this rank holds (consolidated or loaded)

    def _split_parameters(self, groups):
        """Stage 1: whole parameters, one owner each."""
        owners = assign_owners([p.numel() for p in self._params], self._shard_size)
        owner_of = dict(zip(self._params, owners))
        for p, owner in zip(self._params, owners):
            mine = owner == self._shard_rank
            self._stepped.append(p if mine else None)
            self._span.append((0, p.numel()) if mine else (0, 0))
            if not mine:  # state an optimizer made at construction (Adagrad's): not ours
                self.state.pop(p, None)
        # One allgather per bucket of whole parameters, each rank its own.
        for unit in buckets(self._requires_update, BUCKET_BYTES):
            by_rank = [[] for _ in range(self._shard_size)]
            for p in unit:
                by_rank[owner_of[p]].append((p, 0, p.numel()))
            self._gathers.append((f"shard.parameters.{self._parameter_names[unit[0]]}",
                                  by_rank))

    def _refuse_unless_stepped_in_pieces(self, stage):
        """Raises ValueError for what stages 2 and 3 cannot do: an optimizer that needs
        whole parameters, a reducer that is not a plain (compressed) allreduce."""
        whole = tuple(getattr(torch.optim, name) for name in _WHOLE_PARAMETER_OPTIMIZERS
                      if hasattr(torch.optim, name))
        if isinstance(self, whole):
            raise ValueError(f"shard={stage} steps pieces of parameters; "
                             f"{self._hvd_base.__name__} needs them whole (use shard=1)")
        if not isinstance(self._reducer, reduction.CompressedAllreduce):
            raise ValueError(f"shard={stage} reduce-scatters the gradients; {self._reducer!r} "
                             "changes the allreduce itself (use shard=1)")

    def owns(self, parameter):
        """Whether this rank steps (some elements of) ``parameter`` and holds their state."""
        start, stop = self._span[self._index(parameter)]
        return stop > start

    def _index(self, parameter):
        for index, p in enumerate(self._params):
            if p is parameter:
                return index
        raise ValueError("not a parameter of this optimizer")

    def step(self, closure=None):
        """Synchronizes the gradients, steps this rank's share of the parameters, and
        gathers every rank's updated parameters."""
        self._synchronize_for_step()
        with self._stepping():
            loss = self._hvd_base.step(self, closure)
        self._full_state = None
        self._gather_parameters()
        return loss

    @contextlib.contextmanager
    def _stepping(self):
        """Stage 1: the other ranks' parameters lose their gradients for the step."""
        others = {p: p.grad for p, mine in zip(self._params, self._stepped)
                  if mine is None and p.grad is not None}
        for p in others:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in others.items():
                p.grad = grad

    @contextlib.contextmanager
    def _as_stepped(self):
        """The parameter groups as the wrapped optimizer's state sees them (stage 1: the
        parameters themselves)."""
        yield

    def _gather_parameters(self):
        """Every rank's updated parameters (or pieces) to every rank: the allgathers one
        after the other, the next on the wire while this one is copied out, so that at
        most two gathered buffers exist at a time."""
        with torch.no_grad():
            pending = None
            for name, by_rank in self._gathers:
                started = self._start_gather(name, by_rank), by_rank
                if pending is not None:
                    self._scatter_gathered(*pending)
                pending = started
            if pending is not None:
                self._scatter_gathered(*pending)

    def _start_gather(self, name, by_rank):
        mine = [p.reshape(-1)[start:stop] for p, start, stop in by_rank[self._shard_rank]]
        if not mine:  # any rank's segment has the dtype
            p = next(segments[0][0] for segments in by_rank if segments)
            mine = [p.reshape(-1)[:0]]
        flat = torch.cat(mine) if len(mine) > 1 else mine[0]
        return mpi_ops.allgather_async(flat, name=name, process_set=self.process_set)

    def _scatter_gathered(self, handle, by_rank):
        full = mpi_ops.synchronize(handle)
        offset = 0
        for rank, segments in enumerate(by_rank):
            for p, start, stop in segments:
                n = stop - start
                if rank != self._shard_rank:
                    if n == p.numel():
                        p.copy_(full[offset:offset + n].view_as(p))
                    else:
                        p.view(-1)[start:stop].copy_(full[offset:offset + n])
                offset += n

    def consolidate_state_dict(self, to=0):
        """Gathers the whole optimizer state on rank ``to`` (collective: every rank calls
        it); that rank's ``state_dict()`` then returns it, in the unsharded layout."""
        with self._as_stepped():
            local = self._hvd_base.state_dict(self)
        parts = allgather_object(local["state"], name="shard.consolidate",
                                 process_set=self.process_set)
        if self._shard_rank == to:
            self._full_state = {"state": self._merge(parts),
                                "param_groups": local["param_groups"]}

    def _merge(self, parts):
        """The ranks' states (in rank order) as one: a per-element entry is the ranks'
        parts laid end to end in the parameter's shape; any other is the first rank's."""
        merged = {}
        for index in sorted({index for part in parts for index in part}):
            holders = [part[index] for part in parts if index in part]
            shape = self._params[index].shape
            merged[index] = {
                key: torch.cat([h[key].reshape(-1) for h in holders]).view(shape)
                if _per_element(value) else value
                for key, value in holders[0].items()}
        return merged

    def state_dict(self):
        """The whole state, after ``consolidate_state_dict`` on every rank (or after
        ``load_state_dict``).

        Raises:
            RuntimeError: this rank holds only its shard: call
                ``consolidate_state_dict(to=this rank)`` on every rank first.
        """
        if self._full_state is None:
            raise RuntimeError(
                f"DistributedOptimizer(shard={self.shard}): this rank holds only its part of "
                "the optimizer state; call optimizer.consolidate_state_dict(to=rank) on "
                "every rank, then optimizer.state_dict() on that rank")
        return self._full_state

    def load_state_dict(self, state_dict):
        """Loads a whole state dict (from ``state_dict()``, any rank count, sharded or
        not); this rank keeps the state of its own parameters (or pieces)."""
        state = {}
        for index, entries in state_dict["state"].items():
            mine = self._stepped[index]
            if mine is None:
                continue
            start, stop = self._span[index]
            state[index] = {
                key: value.reshape(-1)[start:stop].clone().view(mine.shape)
                if _per_element(value) else value
                for key, value in entries.items()}
        with self._as_stepped():
            self._hvd_base.load_state_dict(self, {"state": state,
                                                  "param_groups": state_dict["param_groups"]})
        self._full_state = state_dict

    def local_state_dict(self):
        """This rank's part of the state, as it holds it (no communication): what an
        elastic commit keeps (see hvdlite/torch/sharded_commit.py).

        Returns:
            ``{"state", "param_groups"}`` as ``state_dict()`` lays them out, with only this
            rank's entries (a per-element entry holds this rank's elements, flattened), and
            ``"spans"``: per parameter index, the elements ``[start, stop)`` of the
            flattened parameter those entries cover.
        """
        with self._as_stepped():
            local = self._hvd_base.state_dict(self)
        return {"state": {index: {key: value.reshape(-1) if _per_element(value) else value
                                  for key, value in entries.items()}
                          for index, entries in local["state"].items()},
                "param_groups": local["param_groups"],
                "spans": {index: self._span[index] for index in local["state"]}}

    def load_local_state_dicts(self, parts):
        """Loads this rank's part of a state saved as ``local_state_dict()`` parts by the
        ranks of any world, either stage: each part's elements that fall in this rank's
        pieces (or parameters) are copied in, one part at a time.

        Args:
            parts: an iterable of ``local_state_dict()`` results (consumed once, so a
                generator can hand them over one by one).

        Raises:
            RuntimeError: the parts cover only some elements of this rank's share of a
                parameter that has state.
        """
        state, filled, param_groups = {}, {}, None
        for part in parts:
            param_groups = part["param_groups"]
            for index, entries in part["state"].items():
                mine = self._stepped[index]
                if mine is None:
                    continue
                start, stop = self._span[index]
                part_start, part_stop = part["spans"][index]
                low, high = max(start, part_start), min(stop, part_stop)
                target = state.setdefault(index, {})
                for key, value in entries.items():
                    if not _per_element(value):
                        target.setdefault(key, value)
                        continue
                    if key not in target:
                        target[key] = torch.empty(stop - start, dtype=value.dtype)
                    if high > low:
                        target[key][low - start:high - start].copy_(
                            value[low - part_start:high - part_start])
                if high > low:
                    filled[index] = filled.get(index, 0) + high - low
        short = []
        for index in list(state):
            wanted, got = self._span[index][1] - self._span[index][0], filled.get(index, 0)
            if wanted and not got:  # no part with state covers it: it has none
                del state[index]
            elif got != wanted:
                short.append(index)
        if short:
            raise RuntimeError(
                f"DistributedOptimizer(shard={self.shard}): the saved parts do not cover this "
                f"rank's share of parameter(s) {short}")
        for index, entries in state.items():
            shape = self._stepped[index].shape
            for key, value in entries.items():
                if _per_element(value):
                    entries[key] = value.view(shape)
        with self._as_stepped():
            self._hvd_base.load_state_dict(
                self, {"state": state, "param_groups": param_groups
                       or self._hvd_base.state_dict(self)["param_groups"]})
        self._full_state = None

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


class _ShardedGradients:
    """Stage 2's methods, mixed in after ``_ShardedOptimizer``'s: element-wise pieces,
    gradients reduce-scattered into them, and the wrapped optimizer stepping them."""

    def _split_parameters(self, groups):
        """Stage 2: buckets cut element-wise, each rank a contiguous piece of each."""
        self._refuse_unless_stepped_in_pieces(2)
        for p in self._requires_update:
            if p.dim() == 0 or not p.is_contiguous():
                raise ValueError(f"shard=2 cuts parameters into flat pieces; parameter "
                                 f"'{self._parameter_names[p]}' is "
                                 f"{'0-dimensional' if p.dim() == 0 else 'not contiguous'}")
        reducer = self._reducer
        self._reducer = reduction.CompressedReducescatter(
            reducer.compression, reducer.op, reducer.scale, reducer.process_set)
        # Sparse gradients are reduced dense: a piece of a parameter is a flat slice.
        self.sparse_as_dense = True
        if groups is None or groups == 0:
            units = buckets(self._requires_update, BUCKET_BYTES)
        else:  # the user's groups, each split by dtype
            units = [tuple(p for p in unit if p.dtype == dtype) for unit in self._units
                     for dtype in dict.fromkeys(p.dtype for p in unit)]
        self._units = units
        self._unit_of = {p: i for i, unit in enumerate(units) for p in unit}
        self._unit_names = [[f"shard.gradients.{self._parameter_names[p]}" for p in unit]
                            for unit in units]

        index_of = {p: i for i, p in enumerate(self._params)}
        # Parameters that get no gradient are stepped as empty pieces.
        self._stepped = [p.detach().reshape(-1)[:0] for p in self._params]
        self._span = [(0, 0)] * len(self._params)
        self._pieces_of_unit = []  # per unit: (parameter index, offset in this rank's piece)
        size, me = self._shard_size, self._shard_rank
        for unit in units:
            bounds = piece_bounds(sum(p.numel() for p in unit), size)
            by_rank = [[] for _ in range(size)]
            self._gathers.append((f"shard.parameters.{self._parameter_names[unit[0]]}",
                                  by_rank))
            pieces, first = [], 0
            for p in unit:
                last = first + p.numel()
                for rank in range(size):
                    start, stop = max(first, bounds[rank]), min(last, bounds[rank + 1])
                    if start < stop:
                        by_rank[rank].append((p, start - first, stop - first))
                low, high = bounds[me], bounds[me + 1]
                start = min(max(first, low), last)
                stop = max(min(last, high), start)
                index = index_of[p]
                self._span[index] = (start - first, stop - first)
                self._stepped[index] = p.detach().view(-1)[start - first:stop - first]
                pieces.append((index, start - low if stop > start else 0))
                first = last
            self._pieces_of_unit.append(pieces)

    def _reduction_started(self, params):
        """The full gradients are dropped as soon as their bucket is on its way, and the
        earlier buckets whose reduce-scatter has ended let go of theirs (a handle holds its
        input until waited on): stage 2 never holds all of them at once."""
        for p in params:
            p.grad = None
        for token, _, _ in self._handles.values():
            if token is not None:
                self._reducer.settle(token)

    def _take_reduced(self, params, results):
        """This rank's piece of a bucket's reduction becomes its pieces' gradients."""
        (piece,) = results
        for index, offset in self._pieces_of_unit[self._unit_of[params[0]]]:
            stepped = self._stepped[index]
            stepped.grad = piece[offset:offset + stepped.numel()]

    @contextlib.contextmanager
    def _stepping(self):
        """The wrapped optimizer steps the pieces (with the gradients synchronize() gave
        them; without hooks, on a job of one, the parameters' own)."""
        if not self._hook_handles:
            for p, stepped, (start, stop) in zip(self._params, self._stepped, self._span):
                if stepped is not None and p.grad is not None:
                    stepped.grad = p.grad.reshape(-1)[start:stop]
        try:
            with self._as_stepped():
                yield
        finally:  # the pieces' gradients are spent: their memory goes now
            for stepped in self._stepped:
                stepped.grad = None

    @contextlib.contextmanager
    def _as_stepped(self):
        """The parameter groups hold the pieces (where the optimizer keys its state) for
        the duration."""
        pieces = iter(self._stepped)
        saved = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [next(pieces) for _ in group["params"]]
        try:
            yield
        finally:
            for group, params in zip(self.param_groups, saved):
                group["params"] = params

    def _sum_norm_parts(self, squares):
        """LARS/LAMB: each parameter's squared norms, summed over the ranks' pieces in one
        allreduce."""
        return mpi_ops.allreduce(squares, op=mpi_ops.Sum, name="shard.layer_norms",
                                 process_set=self.process_set)
