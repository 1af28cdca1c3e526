"""Sharded parameters (ZeRO stage 3, FSDP-style): ``ShardedModule(module)`` stores a
module's parameters as pieces, and ``DistributedOptimizer(..., shard=3)`` steps them.

Layout. The module's parameters are dealt into *blocks*: by default each direct child
that has parameters, or the modules the caller names (``blocks=[...]``), plus one block
for whatever parameters are left (the root's own, those of children outside the named
blocks). In a block, the parameters of one dtype (and requires_grad) are laid end to end
in one flat *group*, and each rank keeps only its contiguous near-equal piece of it, cut
as a reduce-scatter cuts a buffer (``sharding.piece_bounds``, stage 2's rule): a
parameter may straddle ranks. The pieces are the ``nn.Parameter``s of the
ShardedModule (``parameters()``), what the optimizer steps; the module's own parameter
attributes are gone.

Forward. Just before a block runs (a forward pre-hook), its groups are all-gathered
into a full flat buffer per group, in place: each rank's span of the buffer is broadcast
from that rank (the core writes into the buffer itself; an allgather's result is
allocated by the core and would have to be copied out, 64 MiB blocks: forward 0.56 ->
0.43 s a step at 2 ranks here), and the block's parameter attributes become views of
that buffer. Right after (a forward hook) the
buffer's storage is released (resized to 0 bytes; the attributes become meta tensors of
the same shape), so a rank holds about one or two blocks' full parameters at a time.
Autograd's saved tensors keep the views, whose storage is released with them.

Backward. A hook on the block's outputs fires once their gradient is known, before any
of the block's backward runs: the block is gathered again into the same storage (the
values are written through ``.data``, so the saved views see them and autograd's version
checks do not trip). The full buffer is a leaf that requires grad: once its gradient is
final (its post-accumulate-grad hook, after every use of the block's parameters in the
pass), the block's gradients are reduce-scattered (averaged over the process set), one
reduce-scatter per block, the full gradients and the full parameters dropped. The
results are added to the pieces' ``.grad`` when the optimizer synchronizes (or when the
block's next pass starts one), so ``backward_passes_per_step`` accumulates in the pieces.

Prefetch. Each forward records the order in which blocks ran. In forward, while a block
computes, the gather of the block that followed it in the previous forward is
already on the wire (nothing is prefetched in the first forward). In backward, while a
block computes, the block before it in this step's forward is gathered: backward visits
blocks in the reverse of forward's order, which is known from the forward just run.

Cost. Memory per rank, P parameters with Adam: 4P/n of parameters, 4P/n of gradients,
8P/n of state, plus the one or two gathered blocks (and their gradient during backward).
Wire: each block's parameters are gathered twice per step (forward and backward),
(n-1)/n of their bytes each, and its gradients reduce-scattered once, (n-1)/n: 1.5x the
bytes of one allreduce.

Every rank must run the same blocks in each pass (as torch's FSDP requires); with one
pass a step, a block a rank did not run gets zero gradients from it at ``synchronize()``.
"""
import collections
import contextlib
import itertools

import torch

from hvdlite import process_sets
from hvdlite.torch import mpi_ops, sharding
from hvdlite.torch.compression import Compression

# Names the collectives of each ShardedModule apart: every rank builds its modules in the
# same order.
_instances = itertools.count()


class _Group:
    """One block's parameters of one dtype (and requires_grad) end to end: this rank's
    piece, and the full buffer the gathers fill (no storage while released)."""

    def __init__(self, block, params, slots, size, rank):
        self.block = block
        self.params = params          # [(names, offset, numel, shape)] in flat order
        self.slots = slots            # [(module, attribute, offset, numel, shape)]
        self.numel = sum(numel for _, _, numel, _ in params)
        self.bounds = sharding.piece_bounds(self.numel, size)
        self.low, self.high = self.bounds[rank], self.bounds[rank + 1]
        self.requires_grad = True     # set by the module, as its parameters'
        self.piece = None             # set by the module: an nn.Parameter
        self.full = None              # set by the module: a flat leaf of numel elements

    def release(self):
        self.full.untyped_storage().resize_(0)

    def allocate(self):
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.numel * self.full.element_size())

    def placeholders(self):
        for module, attribute, _, _, shape in self.slots:
            setattr(module, attribute, torch.empty(shape, dtype=self.full.dtype, device="meta"))

    def attach(self):
        """The block's parameter attributes become views of the gathered buffer (one
        split, so that backward sums their gradients in one node)."""
        views = self.full.split([numel for _, _, numel, _ in self.params])
        at = {offset: view for (_, offset, _, _), view in zip(self.params, views)}
        for module, attribute, offset, _, shape in self.slots:
            setattr(module, attribute, at[offset].view(shape))


class _Block:
    """A module whose parameters are gathered together, and where that stands."""

    def __init__(self, name, module, owner):
        self.name, self.module = name, module
        self.owner = owner      # the ShardedModule
        self.groups = []
        self.gathered = False
        self.gather = None      # the broadcasts in flight (a list of handles)
        self.ready = []         # groups whose gradient of this pass is final
        self.reduction = None   # (handle, [(group, ctx)]) of the last pass's reduce-scatter
        self.passes = 0         # reduce-scatters started since the last synchronize

    @property
    def nbytes(self):
        return sum(g.numel * g.full.element_size() for g in self.groups)

    @property
    def trained(self):
        return [g for g in self.groups if g.full.requires_grad]


class ShardedModule(torch.nn.Module):
    """Wraps ``module`` so that each rank of ``process_set`` stores only its piece of every
    parameter, gathered block by block when the forward or backward needs it.

    Train with ``hvd.DistributedOptimizer(opt, named_parameters=sharded.named_parameters(),
    shard=3)``, ``opt`` built on ``sharded.parameters()`` (the pieces). Its hooks run on
    the thread that runs forward and backward; they only enqueue and wait, as the
    optimizer's do.

    Args:
        module: the ``nn.Module`` (on CPU; its parameters contiguous).
        blocks: the submodules whose parameters are gathered together (each parameter
            goes to the first block that contains it; the rest to one block of the
            root); None: each direct child that has parameters (the children of a
            ModuleList or ModuleDict). A block must run through its own ``forward``
            (its hooks gather it), not only through its submodules.
        process_set: the ranks that share the parameters.
        broadcast_from: the rank whose parameters every rank starts from (one broadcast
            per block at construction); None if they are equal already.
        compression: a cast compressor (Compression.fp16, bf16) for the gradients'
            reduce-scatter.

    Raises:
        ValueError: a parameter shared by two blocks, a block that is not a submodule,
            a non-contiguous or 0-dimensional parameter.
    """

    def __init__(self, module, blocks=None, process_set=mpi_ops.global_process_set,
                 broadcast_from=0, compression=Compression.none):
        super().__init__()
        self.module = module
        self.process_set = process_set
        self.compression = compression
        self._name = f"shard3.{next(_instances)}"
        self._size, self._rank = process_sets.members(process_set)
        # The global rank of each member, the roots of the gathers' broadcasts.
        self._roots = process_set.ranks if process_set.process_set_id else list(
            range(self._size))
        self._keys = list(module.state_dict().keys())
        self._blocks = self._make_blocks(module, blocks)
        self._forward_order, self._last_order = [], []
        self._gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self._cut(broadcast_from)
        self.pieces = torch.nn.ParameterList(
            [g.piece for block in self._blocks for g in block.groups])
        for block in self._blocks:
            block.module.register_forward_pre_hook(self._hook_before_forward(block))
            block.module.register_forward_hook(self._hook_after_forward(block))

    def _make_blocks(self, module, blocks):
        names = {m: name for name, m in module.named_modules(remove_duplicate=False)}
        if blocks is None:
            blocks = list(_default_blocks(module))
        chosen = []
        for block in blocks:
            if block not in names:
                raise ValueError(f"ShardedModule: block {type(block).__name__} is not a "
                                 "submodule of the module")
            chosen.append(_Block(names[block] or "root", block, self))
        if module not in blocks:
            chosen.append(_Block("root", module, self))  # what the blocks leave
        return chosen

    def _cut(self, broadcast_from):
        """Deals the parameters into the blocks' groups and keeps this rank's pieces."""
        owner = {}  # parameter -> the first block that contains it
        for block in self._blocks:
            inside = set(block.module.modules())
            for p in block.module.parameters():
                first = owner.setdefault(p, block)
                if first.module not in inside and block.module not in set(first.module.modules()):
                    raise ValueError(f"ShardedModule: a parameter is shared by blocks "
                                     f"'{first.name}' and '{block.name}'; name one block "
                                     "that contains both")
        inside_of = {block: set(block.module.modules()) for block in self._blocks}
        slots = collections.defaultdict(list)  # block -> [(module, attribute, parameter)]
        names = collections.defaultdict(list)   # parameter -> its state-dict names
        for prefix, m in self.module.named_modules(remove_duplicate=False):
            for attribute, p in list(m._parameters.items()):
                if p is None:
                    continue
                if p.dim() == 0 or not p.is_contiguous():
                    raise ValueError(f"ShardedModule cuts parameters into flat pieces; "
                                     f"'{prefix}.{attribute}' is "
                                     f"{'0-dimensional' if p.dim() == 0 else 'not contiguous'}")
                block = owner[p]
                if m not in inside_of[block]:
                    raise ValueError(f"ShardedModule: the parameter of block '{block.name}' "
                                     f"is also '{prefix}.{attribute}', outside that block "
                                     "(held only while the block is gathered); name one "
                                     "block that contains both")
                slots[block].append((m, attribute, p))
                names[p].append(f"{prefix}.{attribute}" if prefix else attribute)
        owner.clear()
        # Block by block, each block's parameters let go once cut, so that the model's
        # parameters and their flat copies are never all held twice.
        for block in self._blocks:
            kinds = {}  # (dtype, requires_grad) -> parameters in order, each once
            block_slots = slots.pop(block, [])
            for _, _, p in block_slots:
                kinds.setdefault((p.dtype, p.requires_grad), dict())[p] = None
            handles = []
            for (dtype, requires_grad), params in kinds.items():
                offsets, layout, offset = {}, [], 0
                for p in params:
                    offsets[p] = offset
                    layout.append((names.pop(p), offset, p.numel(), p.shape))
                    offset += p.numel()
                group = _Group(block, layout, [(m, a, offsets[p], p.numel(), p.shape)
                                               for m, a, p in block_slots if p in offsets],
                               self._size, self._rank)
                group.requires_grad = requires_grad
                with torch.no_grad():
                    group.full = torch.cat([p.detach().reshape(-1) for p in params])
                if broadcast_from is not None and self._size > 1:
                    handles.append(mpi_ops.broadcast_async_(
                        group.full, broadcast_from, name=f"{self._name}.init.{block.name}."
                        f"{len(block.groups)}", process_set=self.process_set))
                block.groups.append(group)
            for handle in handles:
                mpi_ops.synchronize(handle)
            for m, attribute, _ in block_slots:
                del m._parameters[attribute]
            kinds = block_slots = params = p = None
            for group in block.groups:
                group.piece = torch.nn.Parameter(group.full[group.low:group.high].clone(),
                                                 requires_grad=group.requires_grad)
                group.piece._hvd_shard_group = group
                group.full.requires_grad_(group.requires_grad)
                group.release()
                group.placeholders()
                if group.requires_grad:
                    group.full.register_post_accumulate_grad_hook(self._hook_gradient(group))
        self._blocks = [block for block in self._blocks if block.groups]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- gathering ---------------------------------------------------------------------

    def _start_gather(self, block):
        """Starts gathering the block into its full buffers, in place: one broadcast per
        rank of its piece's span (the core writes straight into the buffer, which an
        allgather, whose result the core allocates, would need copying out of)."""
        if block.gathered or block.gather is not None:
            return
        handles = []
        with torch.no_grad():
            for index, group in enumerate(block.groups):
                group.allocate()
                full = group.full.data  # .data: no version bump for the saved views
                full[group.low:group.high].copy_(group.piece.detach())
                for rank, root in enumerate(self._roots):
                    low, high = group.bounds[rank], group.bounds[rank + 1]
                    if high > low:
                        handles.append(mpi_ops.broadcast_async_(
                            full[low:high], root, name=f"{self._name}.gather.{block.name}."
                            f"{index}.{rank}", process_set=self.process_set))
        block.gather = handles
        self._gathered_bytes += block.nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)

    def _gather(self, block):
        """The block's full parameters, gathered (from its prefetch if one is on the way)."""
        if block.gathered:
            return
        self._start_gather(block)
        for handle in block.gather:
            mpi_ops.synchronize(handle)
        block.gather = None
        block.gathered = True

    def _free(self, block):
        if block.gather is not None:  # a prefetch still on the wire: it ends first
            self._gather(block)
        if block.gathered:
            for group in block.groups:
                group.release()
                group.placeholders()
            block.gathered = False
            self._gathered_bytes -= block.nbytes

    def _release(self):
        """Drops every gathered copy (stale once the pieces change), after any prefetch
        still on the wire."""
        for block in self._blocks:
            self._free(block)

    def gathered_bytes(self):
        """Bytes of full parameters this rank holds now (0 between steps)."""
        return sum(g.full.untyped_storage().nbytes() for b in self._blocks for g in b.groups)

    # -- hooks ---------------------------------------------------------------------------

    def _hook_before_forward(self, block):
        def hook(module, inputs):
            if not self._forward_order or block is self._forward_order[0]:
                self._last_order = self._forward_order or self._last_order
                self._forward_order = []
            if block not in self._forward_order:
                self._forward_order.append(block)
            self._gather(block)
            for group in block.groups:
                group.attach()
            following = _after(self._last_order, block)
            if following is not None:
                self._start_gather(following)
        return hook

    def _hook_after_forward(self, block):
        def hook(module, inputs, output):
            output = _detached_from(block, output)
            backward = False
            if torch.is_grad_enabled():
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._hook_before_backward(block))
                        backward = True
            # The block that ran last in the previous forward is the first that backward
            # needs: it stays.
            if not (backward and self._last_order and block is self._last_order[-1]):
                self._free(block)
            return output
        return hook

    def _hook_before_backward(self, block):
        def hook(grad):
            self._gather(block)
            # The blocks after this one in forward have had their backward (or gather
            # again when it comes); those without trained parameters have no gradient
            # hook to release them.
            if block in self._forward_order:
                later = self._forward_order[self._forward_order.index(block) + 1:]
                for done in later:
                    if done.gathered and not done.trained:
                        self._free(done)
            previous = _after(self._forward_order[::-1], block)
            if previous is not None:
                self._start_gather(previous)
        return hook

    def _hook_gradient(self, group):
        def hook(full):
            block = group.block
            if group not in block.ready:  # once: its full.grad sums the passes it missed
                block.ready.append(group)
            if len(block.ready) == len(block.trained):
                self._reduce(block, [(g, g.full.grad) for g in block.ready])
                self._free(block)
        return hook

    # -- gradients -----------------------------------------------------------------------

    def _reduce(self, block, grads):
        """Starts the block's reduce-scatter of ``grads`` [(group, full gradient)]; the
        full gradients are dropped (the handle keeps them until it ends)."""
        if block.reduction is not None:  # the previous pass's: same name, so take it first
            self._take(block)
        sent = [self.compression.compress(grad.reshape(-1)) for _, grad in grads]
        tensors = [tensor for tensor, _ in sent]
        name = f"{self._name}.grad.{block.name}"
        handle = (mpi_ops.reducescatter_async(tensors[0], name=name, op=mpi_ops.Average,
                                              process_set=self.process_set)
                  if len(tensors) == 1 else
                  mpi_ops.grouped_reducescatter_async(tensors, name=name, op=mpi_ops.Average,
                                                      process_set=self.process_set))
        block.reduction = (handle, [(group, ctx) for (group, _), (_, ctx) in zip(grads, sent)])
        block.passes += 1
        block.ready = []
        for group, _ in grads:
            group.full.grad = None
        # A handle holds its input until waited on: the reduce-scatters that have ended
        # are taken now, so that the full gradients of the earlier blocks go.
        for other in self._blocks:
            if other is not block and other.reduction is not None \
                    and mpi_ops.poll(other.reduction[0]):
                self._take(other)

    def _take(self, block):
        """Adds the block's last reduce-scatter to its pieces' ``.grad``."""
        handle, groups = block.reduction
        block.reduction = None
        results = mpi_ops.synchronize(handle)
        if len(groups) == 1:
            results = [results]
        with torch.no_grad():
            for (group, ctx), result in zip(groups, results):
                result = self.compression.decompress(result, ctx)
                piece = group.piece
                if piece.grad is None:
                    piece.grad = result.view_as(piece).to(piece.dtype)
                else:
                    piece.grad.add_(result.view_as(piece))

    def _finish_gradients(self):
        """Every block's reduced gradients in its pieces' ``.grad``: a block this rank did
        not run (or not all of whose groups got a gradient) contributes zeros, so that
        the ranks that ran it find partners."""
        for block in self._blocks:
            trained = block.trained
            if trained and (block.ready or not block.passes):
                done = {id(g) for g in block.ready}
                grads = [(g, g.full.grad if id(g) in done else
                          torch.zeros(g.numel, dtype=g.full.dtype)) for g in trained]
                self._reduce(block, grads)
            if block.reduction is not None:
                self._take(block)
            block.passes = 0
        self._release()

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self, destination=None, prefix="", keep_vars=False, to=None):
        """The whole, unsharded parameters (and the module's buffers) under the wrapped
        module's own keys: loadable into the plain module, or into a ShardedModule at any
        rank count. Collective: every rank of the process set calls it.

        Args:
            to: the rank of the process set that receives it (the others get an empty
                dict); None: every rank.

        Returns:
            An OrderedDict name -> tensor (copies; ``keep_vars`` applies to buffers).
        """
        destination = collections.OrderedDict() if destination is None else destination
        keep = to is None or to == self._rank  # the others gather (collective), keep nothing
        values = {}
        for block in self._blocks:
            was = block.gathered
            self._gather(block)
            for group in block.groups if keep else ():
                full = group.full.detach()
                for names, offset, numel, shape in group.params:
                    value = full[offset:offset + numel].clone().view(shape)
                    for name in names:
                        values[name] = value
            if not was:
                self._free(block)
        if not keep:
            return destination
        buffers = self.module.state_dict(keep_vars=keep_vars)
        for key in self._keys:
            destination[prefix + key] = values[key] if key in values else buffers[key]
        return destination

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Loads the whole parameters of an ordinary module's state dict (or of
        ``state_dict()``, from any rank count): each rank keeps its pieces. Called on every
        rank (the gathered copies are dropped; no communication).

        Raises:
            RuntimeError: ``strict`` and keys missing or unexpected.
        """
        missing = [k for k in self._keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._keys]
        if strict and (missing or unexpected):
            raise RuntimeError(f"ShardedModule.load_state_dict: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        self._release()
        with torch.no_grad():
            for block in self._blocks:
                for group in block.groups:
                    for names, offset, numel, shape in group.params:
                        name = next((n for n in names if n in state_dict), None)
                        if name is None:
                            continue
                        value = state_dict[name].reshape(-1)
                        if value.numel() != numel:
                            raise RuntimeError(f"ShardedModule.load_state_dict: '{name}' has "
                                               f"{value.numel()} elements, expected {numel}")
                        start, stop = max(offset, group.low), min(offset + numel, group.high)
                        if start < stop:
                            group.piece[start - group.low:stop - group.low].copy_(
                                value[start - offset:stop - offset])
        params = {n for b in self._blocks for g in b.groups for ns, *_ in g.params for n in ns}
        buffers = {k: v for k, v in state_dict.items() if k in self._keys and k not in params}
        self.module.load_state_dict(buffers, strict=False)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def _default_blocks(module):
    """The direct children that have parameters; a ModuleList's or ModuleDict's children
    instead of the container (which has no forward of its own to hook)."""
    for child in module.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            yield from _default_blocks(child)
        elif next(child.parameters(), None) is not None:
            yield child


def _after(order, block):
    """The block that follows ``block`` in ``order``, or None."""
    for i, b in enumerate(order[:-1]):
        if b is block:
            return order[i + 1]
    return None


def _detached_from(block, output):
    """``output`` with each tensor that is a view of the block's gathered buffers (e.g. a
    parameter returned expanded) replaced by a copy: the buffers are released after the
    forward."""
    buffers = {g.full.untyped_storage().data_ptr() for g in block.groups
               if g.full.untyped_storage().nbytes()}

    def copied(value):
        if isinstance(value, torch.Tensor):
            shares = value.device.type != "meta" and \
                value.untyped_storage().data_ptr() in buffers
            return value.clone() if shares else value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(copied(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(copied(v) for v in value)
        if isinstance(value, dict):
            return type(value)((k, copied(v)) for k, v in value.items())
        return value

    return copied(output) if buffers else output


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


class _ShardedParameters:
    """``DistributedOptimizer(shard=3)``'s methods, mixed in after ``_ShardedOptimizer``'s:
    the parameters are a ShardedModule's pieces, reduced by the module during backward;
    the optimizer steps them and never allreduces. The consolidated state of a piece is
    its group's flat buffer (the ranks' parts end to end)."""

    def _split_parameters(self, groups):
        self._refuse_unless_stepped_in_pieces(3)
        if self._reducer.compression is not Compression.none:
            raise ValueError("shard=3: the ShardedModule reduces the gradients; pass "
                             "compression to ShardedModule(..., compression=...)")
        if self.op != mpi_ops.Average or self.gradient_predivide_factor != 1.0:
            raise ValueError("shard=3: the ShardedModule averages the gradients; op and "
                             "gradient_predivide_factor cannot change that")
        if groups is not None and groups != 0:
            raise ValueError("shard=3: the ShardedModule's blocks decide what is reduced "
                             "together; pass blocks=... to ShardedModule instead of groups")
        owners = []
        for p in self._params:
            group = getattr(p, "_hvd_shard_group", None)
            if group is None:
                raise ValueError(
                    f"shard=3 steps the pieces of a hvd.ShardedModule, and parameter "
                    f"'{self._parameter_names.get(p, '?')}' is not one: wrap the model in "
                    "hvd.ShardedModule(model) and build the optimizer on its parameters()")
            owners.append(group)
        self.remove_hooks()  # the pieces' gradients come from the module, not autograd
        self._sharded_modules = []
        for group in owners:
            module = _module_of(group)
            if module.process_set is not self.process_set:
                raise ValueError("shard=3: the optimizer's process_set must be the "
                                 "ShardedModule's")
            if module not in self._sharded_modules:
                self._sharded_modules.append(module)
        self._stepped = list(self._params)
        self._span = [(g.low, g.high) for g in owners]
        # What a consolidated state entry is shaped as: the group's flat buffer.
        self._params = [torch.empty(g.numel, dtype=g.full.dtype, device="meta")
                        for g in owners]
        # LARS/LAMB: one row of norms per original parameter, the same rows on every rank;
        # per piece, the rows of the parameters it covers and their span in the piece.
        self._norm_rows, self._segments = 0, []
        for g in owners:
            segments = []
            for _, offset, numel, _ in g.params:
                start, stop = max(offset, g.low), min(offset + numel, g.high)
                if start < stop:
                    segments.append((self._norm_rows, start - g.low, stop - g.low))
                self._norm_rows += 1
            self._segments.append(segments)

    def owns(self, parameter):
        """Whether this rank steps some elements (its piece is not empty)."""
        return parameter.numel() > 0

    def synchronize(self):
        """Waits for the ShardedModules' reduce-scatters: their averages are in the
        pieces' ``.grad`` (added to what was there)."""
        for module in self._sharded_modules:
            module._finish_gradients()
        self._synchronized = True

    @contextlib.contextmanager
    def _stepping(self):
        yield

    def _gather_parameters(self):
        """Nothing to gather after a step: the module gathers each block when it runs;
        copies gathered before the step are dropped."""
        for module in self._sharded_modules:
            module._release()

    _sum_norm_parts = sharding._ShardedGradients._sum_norm_parts

    def _trust_ratios(self, pairs, coefficients):
        """LARS/LAMB under shard=3: a piece holds parts of several parameters, so the
        ratios are per parameter, summed over the ranks in one allreduce, and handed back
        as one tensor per piece (each element its parameter's ratio)."""
        if not pairs:
            return []
        index = {id(piece): i for i, piece in enumerate(self._stepped)}
        squares = torch.zeros(self._norm_rows, 2, dtype=pairs[0][0].dtype)
        for w, u in pairs:
            for row, start, stop in self._segments[index[id(w)]]:
                squares[row, 0] = w[start:stop].square().sum()
                squares[row, 1] = u[start:stop].square().sum()
        w_norm, u_norm = self._sum_norm_parts(squares).sqrt().unbind(1)
        ok = (w_norm > 0) & (u_norm > 0)
        ratio = w_norm / torch.where(ok, u_norm, torch.ones_like(u_norm))
        ratios = []
        for (w, _), coefficient in zip(pairs, coefficients):
            segments = self._segments[index[id(w)]]
            rows = torch.tensor([row for row, _, _ in segments], dtype=torch.long)
            counts = torch.tensor([stop - start for _, start, stop in segments],
                                  dtype=torch.long)
            per_row = torch.where(ok[rows], coefficient * ratio[rows],
                                  torch.ones_like(ratio[rows]))
            ratios.append(torch.repeat_interleave(per_row, counts).view_as(w))
        return ratios


def _module_of(group):
    """The ShardedModule that made ``group``."""
    return group.block.owner
