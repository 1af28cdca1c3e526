"""DistributedOptimizer: averages gradients across ranks while backward is still running.

Each parameter gets a post-accumulate-grad hook. The moment autograd has finished a
parameter's gradient, the hook enqueues that gradient's in-place allreduce with the core
and returns: the background thread negotiates and fuses it with the others while
backward goes on (wait-free backprop). ``step()`` waits for every handle, decompresses
and then steps the wrapped optimizer.

Gradient tensors are named ``"allreduce.<parameter name>"`` (the names of
``named_parameters``, else ``"allreduce.grad.noname.<i>"`` in parameter-group order), so
the same parameter has the same name on every rank.
"""
import contextlib
import warnings

import torch

from hvdlite import _checks, process_sets, runtime
from hvdlite.torch import mpi_ops, parameters, reduction, sharded_module, sharding
from hvdlite.torch.adasum import _DistributedAdasumOptimizer
from hvdlite.torch.compression import Compression


def _sparse_op(op, name):
    """The op of a sparse gradient's reduction: gathered entries are summed (and divided
    for Average), so no other op has a meaning there."""
    if op not in (mpi_ops.Sum, mpi_ops.Average):
        raise ValueError(f"gradient '{name}' is sparse: DistributedOptimizer reduces sparse "
                         "gradients with op Sum or Average only (or pass "
                         "sparse_as_dense=True)")
    return op


class _DistributedOptimizer:
    """Methods mixed into a copy of the user's optimizer (see ``DistributedOptimizer``)."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set):
        parameters.check_backward_passes(backward_passes_per_step)
        _, *scale = _checks.predivide_scaling(op, gradient_predivide_factor)
        process_sets.process_set_id(process_set)
        self._reducer = reduction.reducer_for(compression, op, scale, process_set)
        if hasattr(compression, "use_optimizer_momentum"):
            self._sgd_momentum(compression)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        all_params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = parameters.name_parameters(named_parameters, all_params)
        self._requires_update = [p for p in all_params if p.requires_grad]
        self._units = self._make_units(groups, self._requires_update)
        # Units are keyed by index: tuples of tensors must never be compared (a hash
        # collision would call Tensor.__eq__).
        self._unit_of = {p: i for i, unit in enumerate(self._units) for p in unit}
        # Each unit's tensor names, built once rather than for every step.
        self._unit_names = [[f"allreduce.{self._parameter_names[p]}" for p in unit]
                            for unit in self._units]
        self._delay = {p: backward_passes_per_step for p in self._requires_update}
        self._ready = {}      # unit index -> how many of its gradients are final this step
        # unit index -> (reducer token or None, its parameters, [(param, SparseHandle)])
        self._handles = {}
        self._sparse_dims = {}  # parameter -> sparse_dim of its last sparse gradient
        self._accumulating = False
        self._synchronized = False
        self._should_synchronize = True
        self._hook_handles = []
        # One process has nothing to average, and a rank outside process_set takes no
        # part: like Horovod, no hooks, and step() is the wrapped optimizer's. A set of
        # one rank in a larger job keeps its hooks (its allreduces are that rank's own).
        if runtime.size() > 1 and process_set.included():
            for p in self._requires_update:
                self._hook_handles.append(
                    p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _sgd_momentum(self, reducer):
        """Hands a reducer with momentum correction (Compression.topk) this optimizer's
        momentum: SGD's (0 for other optimizers, whose "momentum" is not SGD's).

        Raises:
            ValueError: the parameter groups' momenta differ (or see
                ``TopK.use_optimizer_momentum``).
        """
        momenta = {(0.0, 0.0, False)}
        if isinstance(self, torch.optim.SGD):
            momenta = {(g["momentum"], g["dampening"], g["nesterov"])
                       for g in self.param_groups}
        if len(momenta) > 1 and reducer.momentum != 0.0:
            raise ValueError(f"{reducer!r} corrects for one momentum, but the parameter "
                             f"groups have (momentum, dampening, nesterov) {sorted(momenta)}")
        momentum, dampening, nesterov = min(momenta)
        reducer.use_optimizer_momentum(momentum, plain=not (dampening or nesterov))

    def _make_units(self, groups, params):
        """Returns the allreduce units: tuples of parameters enqueued together."""
        if groups is None or groups == 0:
            return [(p,) for p in params]
        if isinstance(groups, int):
            if groups < 0:
                raise ValueError(f"groups must be a non-negative int or lists of "
                                 f"parameters, got {groups}")
            count = min(groups, len(params)) or 1
            per, extra = divmod(len(params), count)
            units, start = [], 0
            for i in range(count):
                end = start + per + (1 if i < extra else 0)
                units.append(tuple(params[start:end]))
                start = end
            return [u for u in units if u]
        wanted = set(params)
        units, seen = [], set()
        for group in groups:
            unit = tuple(group)
            for p in unit:
                if p not in wanted:
                    raise ValueError("groups contains a tensor that is not a parameter of "
                                     "this optimizer (or does not require grad)")
                if p in seen:
                    raise ValueError("a parameter appears in more than one of groups")
                seen.add(p)
            if unit:
                units.append(unit)
        units += [(p,) for p in params if p not in seen]
        return units

    def _make_hook(self, p):
        def hook(param):
            if self._delay[p] <= 0:
                raise AssertionError(
                    "gradients were computed more than backward_passes_per_step times "
                    "before step(); increase backward_passes_per_step to accumulate "
                    "gradients locally")
            self._accumulating = True
            self._delay[p] -= 1
            if self._delay[p] == 0:
                index = self._unit_of[p]
                self._ready[index] = self._ready.get(index, 0) + 1
                if self._ready[index] == len(self._units[index]):
                    self._handles[index] = self._allreduce_unit_async(index)
        return hook

    def _allreduce_unit_async(self, index):
        """Starts reducing the gradients of unit ``index``'s parameters: the dense ones
        through the reducer, the sparse ones each by ``sparse_allreduce_async`` (unless
        sparse_as_dense: then they are made dense and go through the reducer).

        Returns:
            (the reducer's token or None, the parameters it reduces,
            [(param, SparseHandle)]).
        """
        dense, names, grads, sparse = [], [], [], []
        for p, name in zip(self._units[index], self._unit_names[index]):
            grad = self._gradient_of(p)
            if grad.is_sparse:
                if not self.sparse_as_dense:
                    sparse.append((p, mpi_ops.sparse_allreduce_async(
                        grad, name, _sparse_op(self.op, name), self.process_set)))
                    continue
                grad = grad.to_dense()
            elif not grad.is_contiguous():
                grad = grad.contiguous()
            dense.append(p)
            names.append(name)
            grads.append(grad)
        token = self._reducer.start(names, grads) if dense else None
        self._reduction_started(dense)
        return token, dense, sparse

    def _reduction_started(self, params):
        """Called once the gradients of ``params`` are on their way; they stay, as the
        reduced values are written back into them."""

    def _gradient_of(self, p):
        """``p.grad``, made zeros where this rank computed none (parameter unused here this
        step): another rank may have one, so every rank must submit it. A parameter
        whose gradient was sparse before gets an empty sparse one, so that it is
        gathered like the others' (a parameter never seen with a gradient gets dense
        zeros: its first sparse gradient must come on every rank)."""
        if p.grad is None:
            sparse_dim = self._sparse_dims.get(p)
            if sparse_dim is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            else:
                p.grad = torch.sparse_coo_tensor(
                    torch.empty((sparse_dim, 0), dtype=torch.int64),
                    torch.empty((0,) + tuple(p.shape[sparse_dim:]), dtype=p.dtype), p.shape,
                    check_invariants=False)
        elif p.grad.is_sparse:
            self._sparse_dims[p] = p.grad.sparse_dim()
        return p.grad

    def synchronize(self):
        """Waits for every gradient's allreduce and writes the averages into ``p.grad``.

        Parameters whose allreduce was not enqueued by a hook this step (no gradient on
        this rank, e.g. a branch not taken, or fewer than backward_passes_per_step
        backward passes) are submitted now, with a zero gradient where ``p.grad`` is None:
        this is what Horovod does, so ranks that did compute that gradient do not wait
        forever; the result is the sum over ranks divided by the number of ranks, and a
        parameter unused on every rank gets a zero gradient rather than None.

        Raises:
            HorovodInternalError: a collective failed (e.g. MismatchError).
        """
        if not self._hook_handles and (runtime.size() == 1 or not self.process_set.included()):
            self._synchronized = True
            return
        for index in range(len(self._units)):
            if index not in self._handles:
                self._handles[index] = self._allreduce_unit_async(index)
        try:
            pending = list(self._handles.values())
            started = [(token, params) for token, params, _ in pending if params]
            updates = self._reducer.finish_all([token for token, _ in started])
            for (_, params), results in zip(started, updates):
                self._take_reduced(params, results)
            for _, _, sparse in pending:
                for p, handle in sparse:
                    p.grad = mpi_ops.synchronize(handle)
        finally:
            for p in self._requires_update:
                self._delay[p] = self.backward_passes_per_step
            self._handles.clear()
            self._ready.clear()
            self._accumulating = False
        self._synchronized = True

    def _take_reduced(self, params, results):
        """Writes a unit's reduced gradients into its parameters' ``.grad``."""
        for p, result in zip(params, results):
            if p.grad.is_sparse:
                # sparse_as_dense: back to sparse rows for optimizers such as SparseAdam
                # that take sparse gradients only.
                p.grad = result.to_sparse(p.grad.sparse_dim())
            elif result is not p.grad:
                p.grad.copy_(result)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Makes ``step()`` skip the synchronization, after an explicit ``synchronize()``.

        For gradient clipping or AMP's GradScaler::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronizes the gradients (unless skipped) and steps the wrapped optimizer."""
        self._synchronize_for_step()
        return self._hvd_base.step(self, closure)

    def _synchronize_for_step(self):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(); the gradients are "
                              "synchronized again, which is slow and, for Sum, wrong")
            self.synchronize()
        self._synchronized = False

    def zero_grad(self, set_to_none=True):
        """Clears gradients; refused while gradients are being accumulated or reduced.

        Raises:
            AssertionError: called between ``backward()`` and ``step()``/``synchronize()``.
        """
        if self._handles or self._accumulating:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); this is not allowed, as "
                "gradients are still being reduced or accumulated")
        return self._hvd_base.zero_grad(self, set_to_none)

    def remove_hooks(self):
        """Removes the gradient hooks (the optimizer then behaves like the wrapped one)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=mpi_ops.Average,
                         gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                         process_set=mpi_ops.global_process_set, shard=0):
    """Wraps a torch optimizer so that gradients are averaged across ranks before a step.

    The result is an instance of a subclass of ``type(optimizer)`` sharing the
    optimizer's parameter groups, state and hooks (so LR schedulers and checkpoints keep
    working); ``optimizer`` itself should no longer be stepped.

    Parameters that get no gradient on some ranks in a step (a branch not taken, a
    frozen head) do not hang the job: at ``step()``/``synchronize()`` every parameter
    whose allreduce no hook enqueued is submitted, with a zero gradient where ``p.grad``
    is None, as Horovod does. The ranks that did compute it thus find partners, and the
    result is the sum over ranks divided by the number of ranks (the zeros count). A
    parameter unused on every rank ends with a zero gradient instead of None, so
    weight decay or momentum still apply to it.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``, to name gradients consistently
            across ranks; None names them by position in the parameter groups.
        compression: Compression.none, fp16 or bf16 (a cast for the wire), or a reducer
            that changes the collective: ``Compression.topk(ratio)``,
            ``Compression.quantize(bits)``, ``Compression.powersgd(rank)`` (Average
            only; one reducer object per optimizer: it keeps error-feedback state).
        backward_passes_per_step: backward passes accumulated locally per ``step()``; the
            allreduce runs on the last one (gradients are summed over the passes, scale
            the loss if you want their mean).
        op: Average (default) or Sum (Min, Max, Product also run), or Adasum: each
            rank steps on its own gradients and the parameter updates are combined
            with Adasum (see ``hvdlite.torch.adasum``).
        gradient_predivide_factor: with Average, gradients are multiplied by 1/factor
            before the sum and by factor/size after it.
        groups: None (each gradient negotiated on its own; the core fuses them), an int
            (split the parameters into that many groups in order) or lists of parameters;
            a group's gradients are enqueued together once all of them are ready, and
            negotiated and run together.
        sparse_as_dense: False (default): a sparse gradient (e.g. of
            ``Embedding(sparse=True)``) is reduced by gathering every rank's indices and
            values (``sparse_allreduce_async``: entries with the same index summed,
            divided by size() for Average; compression and gradient_predivide_factor do
            not apply); the op must be Sum or Average. True: it is made dense and
            reduced like the others. Either way it is written back sparse, with its
            sparse_dim, so optimizers such as SparseAdam take it.
        process_set: the ProcessSet whose members average the gradients (Average
            divides by its size); every member wraps its optimizer alike.
        shard: 0 (default): every rank holds the whole optimizer state. 1: each rank
            steps only its share of the parameters and holds only their state; the
            updated parameters are gathered after each step (``hvdlite.torch.sharding``:
            checkpoints go through ``consolidate_state_dict``). 2: the gradients too:
            reduce-scattered during backward (in buckets, or the ``groups``), each rank
            steps its contiguous piece of every bucket; the parameters' ``.grad`` are
            None after ``synchronize()``/``step()``. 3: the parameters too: ``optimizer``
            is built on the pieces of an ``hvd.ShardedModule``
            (``hvdlite.torch.sharded_module``), which gathers the parameters and
            reduce-scatters the gradients; the optimizer steps the pieces.

    Returns:
        The distributed optimizer.

    Raises:
        ValueError: bad arguments (unnamed or duplicate parameters, bad groups, predivide
            with an op other than Average).
    """
    base = optimizer.__class__
    if getattr(optimizer, "_hvd_base", None) is not None:
        raise ValueError("the optimizer is already a DistributedOptimizer")
    mixins = [_DistributedAdasumOptimizer if op == mpi_ops.Adasum else _DistributedOptimizer]
    if shard not in (0, 1, 2, 3):
        raise ValueError(f"shard={shard!r}: 1 shards the optimizer state, 2 also the "
                         "gradients, 3 also the parameters (with hvd.ShardedModule); 0 turns "
                         "sharding off")
    if shard:
        if op == mpi_ops.Adasum:
            raise ValueError(f"shard={shard} cannot go with op=Adasum")
        mixins.append(sharding._ShardedOptimizer)
    if shard == 2:
        mixins.append(sharding._ShardedGradients)
    if shard == 3:
        mixins.append(sharded_module._ShardedParameters)
    methods = {k: v for mixin in mixins for k, v in mixin.__dict__.items()
               if not k.startswith("__")}
    cls = type(base.__name__, (base,), {**methods, "_hvd_base": base,
                                        "__module__": __name__,
                                        "__doc__": base.__doc__})
    wrapped = cls.__new__(cls)
    # Instance attributes that shadow our methods (e.g. a ``step`` wrapped in place by an
    # LR scheduler) would bypass the synchronization: they are left out.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if k not in methods})
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, groups, sparse_as_dense, process_set)
    if shard:
        wrapped._hvd_shard_setup(shard, groups)
    return wrapped
