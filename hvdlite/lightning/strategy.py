"""HvdliteStrategy: Lightning 2.x training on processes started by ``hvdliterun``.

What happens where (Lightning calls each of these; nothing here starts a process):

* the ranks: HvdliteEnvironment, from hvdlite (``set_world_ranks`` also points
  Lightning's rank-zero-only logging at rank 0);
* ``setup``: the module's parameters and buffers are broadcast from rank 0 (at every
  stage: fit, validate, test, predict); when fitting, each optimizer's state too, then
  each optimizer is wrapped in hvdlite's DistributedOptimizer with
  ``backward_passes_per_step = accumulate_grad_batches``, so its gradient hooks start
  the allreduces during the last accumulated backward pass;
* ``optimizer_step``: the closure Lightning passes (training_step, backward) is followed
  by ``synchronize()``, before Lightning's ``on_before_optimizer_step`` and gradient
  clipping see the gradients, and the step itself skips a second synchronization;
* the sampler: ``distributed_sampler_kwargs`` (this rank of ``hvd.size()``), from which
  Lightning builds its DistributedSampler;
* ``reduce`` (``self.log(..., sync_dist=True)``), ``all_gather``, ``broadcast`` and
  ``barrier``: hvdlite's collectives, on the global process set or the ProcessSet given
  as ``group``;
* checkpoints: Lightning's own rule, rank 0 writes (``is_global_zero``); the module is
  never wrapped, so the file is the plain LightningModule's and loads in one process.
"""
import functools
import weakref

import torch
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

import hvdlite.torch as hvd
from hvdlite.lightning.environment import HvdliteEnvironment

# Lightning's names of reductions (strings, or torch.distributed.ReduceOp members) ->
# (hvdlite op, whether an integer tensor's result is the sum divided by the size).
_REDUCTIONS = {
    "mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum,
    "max": hvd.Max, "min": hvd.Min, "product": hvd.Product,
}


def _reduction_name(reduce_op):
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        return reduce_op.lower()
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        member = getattr(ReduceOp, name, None)
        if member is not None and reduce_op == member:
            return name.lower()
    return repr(reduce_op)


def hvdlite_op(reduce_op):
    """hvdlite's op for a Lightning reduction: "mean"/"avg"/None, "sum", "max", "min",
    "product" or the ReduceOp members of those names.

    Raises:
        ValueError: any other reduction (e.g. bitwise ones).
    """
    name = _reduction_name(reduce_op)
    if name not in _REDUCTIONS:
        raise ValueError(f"HvdliteStrategy cannot reduce with {reduce_op!r}; it takes "
                         f"{sorted(_REDUCTIONS)} or the ReduceOp members of those names")
    return _REDUCTIONS[name]


# The name of reduce's allreduce, one per op: a metric logged with sync_dist every step
# repeats it, a response-cache hit each time after the first, where a fresh automatic name
# made every one a negotiation through rank 0. (Blocking calls of Lightning's loop, one at
# a time; metrics of other dtypes or shapes under one name are negotiated again, as
# before, and a rank whose tensor differs still fails with MismatchError.)
_REDUCE_NAMES = {}
for _word, _op in _REDUCTIONS.items():
    _REDUCE_NAMES.setdefault(_op, f"lightning.reduce.{_word}")


def _process_set(group):
    """The ProcessSet for Lightning's ``group`` argument: None is every rank."""
    if group is None:
        return hvd.global_process_set
    if isinstance(group, hvd.ProcessSet):
        return group
    raise ValueError(f"HvdliteStrategy takes group=None (every rank) or an hvdlite "
                     f"ProcessSet, not {group!r} (there is no torch.distributed group)")


def _unwrap(optimizer):
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _is_distributed(optimizer):
    return getattr(optimizer, "_hvd_base", None) is not None


def _mark_steps_for_scheduler(optimizer):
    """Makes ``optimizer.step`` record its calls the way torch's LR schedulers check
    (they patch the optimizer they were built with, and warn at their first step when
    the optimizer they now hold was not patched or not stepped). The record calls the
    class's step, i.e. the DistributedOptimizer's, so synchronization is never bypassed.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step
    holder = weakref.ref(optimizer)

    @functools.wraps(step)
    def recorded_step(*args, **kwargs):
        opt = holder()
        opt._opt_called = True
        return step(opt, *args, **kwargs)

    recorded_step._wrapped_by_lr_sched = True
    optimizer.step = recorded_step


class HvdliteStrategy(ParallelStrategy):
    """Data-parallel training through hvdlite, one process per rank started by
    ``hvdliterun -np N python train.py`` (or mpirun, srun): ``Trainer(strategy="hvdlite")``
    once ``hvdlite.lightning`` is imported, or ``Trainer(strategy=HvdliteStrategy(...))``
    to pass options.

    The learning rate is not scaled: N ranks with batch B each train as one process
    with batch N*B and the same learning rate would (scale it yourself if you want).

    Args:
        compression: DistributedOptimizer's ``compression`` (Compression.none, fp16,
            bf16, or a reducer such as ``Compression.topk(ratio)``).
        op: Average (default), Sum or Adasum, as for DistributedOptimizer.
        gradient_predivide_factor: as for DistributedOptimizer.
        sparse_as_dense: as for DistributedOptimizer.
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
            precision_plugin: Lightning's; the environment defaults to
            HvdliteEnvironment.
    """

    strategy_name = "hvdlite"

    def __init__(self, compression=hvd.Compression.none, op=hvd.Average,
                 gradient_predivide_factor=1.0, sparse_as_dense=False, accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment or HvdliteEnvironment(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._optimizer_options = dict(compression=compression, op=op,
                                       gradient_predivide_factor=gradient_predivide_factor,
                                       sparse_as_dense=sparse_as_dense)

    @property
    def root_device(self):
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cpu":
            return torch.device("cpu")
        # One accelerator per process on its host: local rank i takes device i.
        return devices[self.local_rank % len(devices)]

    @property
    def is_distributed(self):
        """Lightning's accelerator connector reads it: True makes the Trainer put a
        DistributedSampler on every dataloader (with distributed_sampler_kwargs)."""
        return True

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self):
        """Called by the Trainer's connector: hvdlite's ranks are fixed, so this only
        tells Lightning's rank-zero-only logging which process is rank 0."""
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self):
        super().setup_environment()
        self.set_world_ranks()

    def model_to_device(self):
        self.model.to(self.root_device)

    def setup(self, trainer):
        if self._layer_sync is not None:
            raise ValueError("Trainer(sync_batchnorm=True) converts to torch's "
                             "SyncBatchNorm, which needs torch.distributed; use "
                             "hvdlite.torch.SyncBatchNorm layers in the module instead")
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_accumulation(trainer)
        super().setup(trainer)
        # Every stage starts from rank 0's weights and buffers (a checkpoint restored
        # before setup is the same on every rank; this covers modules built apart).
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        if fitting:
            self.optimizers = [self._distributed(_unwrap(opt), trainer.accumulate_grad_batches)
                               for opt in self.optimizers]

    @staticmethod
    def _check_accumulation(trainer):
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ValueError("HvdliteStrategy takes a fixed accumulate_grad_batches; a "
                             "GradientAccumulationScheduler changes it between epochs")

    def _distributed(self, optimizer, passes):
        """``optimizer`` with rank 0's state, wrapped in a DistributedOptimizer whose
        schedulers now step the wrapper (its param_groups are the ones that survive a
        load_state_dict)."""
        if _is_distributed(optimizer):
            return optimizer
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        params = {p for group in optimizer.param_groups for p in group["params"]}
        named = [(name, p) for name, p in self.lightning_module.named_parameters()
                 if p in params]
        wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                           backward_passes_per_step=passes,
                                           **self._optimizer_options)
        for config in self.lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is optimizer:
                config.scheduler.optimizer = wrapped
                _mark_steps_for_scheduler(wrapped)
        return wrapped

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """Lightning's step, with the gradients averaged between the closure (training
        step and backward) and what Lightning does before stepping (clipping, the
        on_before_optimizer_step hooks). In manual optimization the closure does nothing
        and the gradients of the earlier ``manual_backward`` calls are averaged."""
        optimizer = _unwrap(optimizer)
        if not _is_distributed(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_synchronize():
            result = closure()
            optimizer.synchronize()
            return result

        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """Reduces ``tensor`` over the ranks (``self.log(..., sync_dist=True)`` comes
        here); anything that is not a tensor is returned as it is.

        An integer tensor's mean is the sum divided by the size, truncated to its dtype
        (as Lightning's DDP does).
        """
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = hvdlite_op(reduce_op)
        process_set = _process_set(group)
        if op is hvd.Average and not tensor.is_floating_point():
            total = hvd.allreduce(tensor, op=hvd.Sum, name=_REDUCE_NAMES[hvd.Sum],
                                  process_set=process_set)
            return (total / process_set.size()).to(tensor.dtype)
        return hvd.allreduce(tensor, op=op, name=_REDUCE_NAMES[op], process_set=process_set)

    def all_gather(self, tensor, group=None, sync_grads=False):
        """Every rank's ``tensor`` stacked: shape ``(ranks, *tensor.shape)``. With
        ``sync_grads`` it is differentiable (hvdlite's allgather gradient: the incoming
        gradient averaged over ranks)."""
        process_set = _process_set(group)
        stacked = tensor.unsqueeze(0)
        if sync_grads:
            return hvd.allgather(stacked, process_set=process_set)
        with torch.no_grad():
            return hvd.allgather(stacked.detach(), process_set=process_set)

    def broadcast(self, obj, src=0):
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name=None):
        hvd.barrier()

    def teardown(self):
        # The wrappers' gradient hooks live on the module's parameters: a later fit
        # wraps new optimizers, and old hooks would start allreduces nobody waits for.
        for optimizer in self.optimizers:
            if _is_distributed(optimizer):
                optimizer.remove_hooks()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry):
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls,
                description="hvdlite data parallel, processes started by hvdliterun")
