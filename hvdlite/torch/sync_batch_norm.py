"""SyncBatchNorm: batch normalization over the batches of every rank together.

In training, each rank's batch is normalized with the mean and variance of the
concatenation of all ranks' batches (which may differ in size), so the output, the
gradients and the running statistics are those one ``BatchNorm`` would compute on the
whole batch in one process. Two collectives per layer and step, on small per-channel
vectors: an allgather of each rank's (count, mean, variance) in forward, an allreduce
of two per-channel sums in backward. In eval mode with running statistics it is a plain
``BatchNorm`` and never communicates.

Works on CPU tensors (the core's path); every rank must run the same layers in the same
order, as with any collective.
"""
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hvdlite import ops, runtime
from hvdlite.torch import async_collectives, mpi_ops


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over N-dimensional input (``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)``,
    ``(N, C, D, H, W)``) whose statistics are synchronized across ranks in training.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance for numerical stability.
        momentum: the weight of a new batch in the running statistics; None keeps a
            cumulative (simple) average instead.
        affine: learnable per-channel weight and bias.
        track_running_stats: keep running_mean, running_var and num_batches_tracked and
            use them in eval mode; if False, batch statistics (synchronized) are used in
            both modes.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        # Running statistics are updated in training only (as BatchNorm does).
        running = self.training and self.track_running_stats
        running_mean = self.running_mean if running else None
        running_var = self.running_var if running else None
        if runtime.size() == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                True, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor)


def _channel_view(vector, ndim):
    """(C,) -> (1, C, 1, ...) to broadcast over an input of ``ndim`` dimensions."""
    return vector.view((1, -1) + (1,) * (ndim - 2))


def _compute_dtype(dtype):
    """Half-precision inputs are normalized in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _global_moments(x):
    """Returns (count, mean, biased variance) per channel of every rank's ``x`` together
    (float64), from one allgather of each rank's own (count, mean, variance)."""
    channels = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    count = x.numel() // channels if channels else 0
    if count:
        var, mean = torch.var_mean(x, dim=dims, correction=0)
    else:
        var = mean = torch.zeros(channels, dtype=x.dtype, device=x.device)
    count_cell = torch.tensor([float(count)], dtype=torch.float64, device=x.device)
    row = torch.cat([count_cell, mean.double(), var.double()]).unsqueeze(0)
    rows = ops.synchronize(mpi_ops.allgather_async(row, "sync_batch_norm.moments"))
    counts, means, variances = rows[:, :1], rows[:, 1:channels + 1], rows[:, channels + 1:]
    total = counts.sum()
    if total <= 1:
        raise ValueError("SyncBatchNorm: expected more than 1 value per channel over all "
                         f"ranks when training, got {int(total)} (input shape on rank "
                         f"{runtime.rank()}: {tuple(x.shape)})")
    mean = (counts * means).sum(0) / total
    # Each rank's variance about the global mean: its own plus its mean's offset squared.
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
    return total, mean, var


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalizes with the global batch statistics; backward allreduces the two
    per-channel sums the input gradient needs (weight and bias gradients stay local, as
    every parameter's: the optimizer averages them)."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor):
        dtype = _compute_dtype(input.dtype)
        x = input.contiguous().to(dtype)
        total, mean, var = _global_moments(x)
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_((factor * mean).to(running_mean.dtype))
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - factor).add_((factor * unbiased).to(running_var.dtype))
        mean = mean.to(dtype)
        invstd = torch.rsqrt(var + eps).to(dtype)
        out = (x - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
        if weight is not None:
            out = out * _channel_view(weight.to(dtype), x.dim())
        if bias is not None:
            out = out + _channel_view(bias.to(dtype), x.dim())
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = float(total)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        ndim = x.dim()
        dims = [0] + list(range(2, ndim))
        dy = grad_output.contiguous().to(x.dtype)
        xhat = (x - _channel_view(mean, ndim)) * _channel_view(invstd, ndim)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if need_input:
            sums = torch.cat([sum_dy, sum_dy_xhat]).double()
            sums = ops.synchronize(async_collectives.enqueue_allreduce(
                sums, None, "sync_batch_norm.grad_sums", mpi_ops.Sum, 1.0, 1.0,
                mpi_ops.global_process_set))
            mean_dy, mean_dy_xhat = (sums / ctx.total).to(x.dtype).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(x.dtype)
            grad_input = ((dy - _channel_view(mean_dy, ndim)
                           - xhat * _channel_view(mean_dy_xhat, ndim))
                          * _channel_view(scale, ndim)).to(grad_output.dtype)
        # needs_input_grad is False for a weight or bias that is None.
        if need_weight:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if need_bias:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None
