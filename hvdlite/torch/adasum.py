"""DistributedOptimizer(op=Adasum): Adasum applied to each step's model update.

As Horovod defines it, Adasum combines what each rank's optimizer would do, not the raw
gradients: every rank steps the wrapped optimizer on its own gradients, the change of
each parameter is combined across ranks with Adasum (per parameter, see
``hvdlite.adasum``), and every rank applies the combined change to the parameters as
they were before the step. Rank-local optimizer state (momentum, Adam's moments) follows
each rank's own gradients, as in Horovod.

Gradients are not reduced during backward (there is nothing to overlap: the combined
quantity exists only after the local step), so ``step()`` does one grouped Adasum of all
the updates.
"""
import contextlib

import torch

from hvdlite import _checks, process_sets, runtime
from hvdlite.torch import mpi_ops, parameters
from hvdlite.torch.compression import Compression


class _DistributedAdasumOptimizer:
    """Methods mixed into a copy of the user's optimizer (see ``DistributedOptimizer``)."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set):
        parameters.check_backward_passes(backward_passes_per_step)
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor is supported only with op=Average")
        _checks.check_adasum_set(process_sets.process_set_id(process_set), "adasum.updates")
        self.op = op
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        if compression is not Compression.none:
            # The updates are combined here, not by the core's allreduce: a compressor
            # would be ignored, so it is refused rather than silently dropped.
            raise ValueError(f"op=Adasum takes no compression (got {compression!r})")
        params = [p for group in self.param_groups for p in group["params"]]
        # The same checks of named_parameters as the gradient-averaging optimizer's.
        parameters.name_parameters(named_parameters, params)
        self._adasum_params = [p for p in params if p.requires_grad]

    def synchronize(self):
        """Nothing to do before the step: Adasum combines the updates in ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Accepted for Horovod compatibility; ``step()`` combines the updates anyway."""
        yield

    def step(self, closure=None):
        """Steps the wrapped optimizer locally, then replaces each parameter's update by
        the Adasum of every rank's update."""
        if runtime.size() == 1:
            return self._hvd_base.step(self, closure)
        start = [p.detach().clone() for p in self._adasum_params]
        loss = self._hvd_base.step(self, closure)
        with torch.no_grad():
            updates = [(p.detach() - s).contiguous()
                       for p, s in zip(self._adasum_params, start)]
            combined = mpi_ops.grouped_allreduce_(updates, name="adasum.updates",
                                                  op=mpi_ops.Adasum,
                                                  process_set=self.process_set)
            for p, s, u in zip(self._adasum_params, start, combined):
                p.copy_(s + u)
        return loss
