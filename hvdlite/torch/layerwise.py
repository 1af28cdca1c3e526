"""Layer-wise adaptive optimizers for large batches: LARS (SGD with momentum) and LAMB
(Adam), each scaling a parameter's step by a trust ratio ||w|| / ||update||.

Both are plain ``torch.optim`` optimizers: wrap them in ``hvd.DistributedOptimizer`` like
any other. Under ``shard=1`` each parameter is stepped whole by the rank that owns it, so
its norms are local. Under ``shard=2`` a rank steps a piece of a parameter: the pieces'
squared norms, of every parameter at once, are summed across the ranks by one small
allreduce (``_Layerwise._sum_norm_parts``, which the sharded optimizer overrides).

A ratio whose norms are not both positive is 1 (a fresh zero layer, a zero update).
"""
import torch


def _evaluate(closure):
    """The loss of ``closure`` (recomputed with gradients on), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _Layerwise(torch.optim.Optimizer):
    """What LARS and LAMB share: the trust ratios of all parameters of a step at once."""

    def _sum_norm_parts(self, squares):
        """Sums each parameter's squared norms over the parts held by several ranks; here
        the parameters are whole (a sharded optimizer overrides this)."""
        return squares

    def _trust_ratios(self, pairs, coefficients):
        """coefficient * ||weight|| / ||update|| for each (weight, update) pair where both
        norms are positive, else 1: a tensor, so that no step waits for the device."""
        if not pairs:
            return []
        squares = torch.stack([torch.stack([w.square().sum(), u.square().sum()])
                               for w, u in pairs])
        w, u = self._sum_norm_parts(squares).sqrt().unbind(1)
        ok = (w > 0) & (u > 0)
        scale = torch.tensor(coefficients, dtype=w.dtype, device=w.device)
        return torch.where(ok, scale * w / torch.where(ok, u, torch.ones_like(u)),
                           torch.ones_like(w)).unbind(0)


class LARS(_Layerwise):
    """Layer-wise Adaptive Rate Scaling (You, Gitman and Ginsburg, 2017).

    For each parameter w with gradient g::

        d = g + weight_decay * w
        local_lr = lr * trust_coefficient * ||w|| / ||d||   (lr alone if a norm is 0)
        buf = momentum * buf + local_lr * d
        w = w - buf

    Args:
        params: parameters or parameter groups.
        lr: base learning rate.
        momentum: momentum factor (0: none).
        weight_decay: L2 penalty added to the gradient before the ratio.
        trust_coefficient: eta, the ratio's factor.
    """

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001):
        if lr <= 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError(f"LARS: lr {lr} and trust_coefficient {trust_coefficient} must be "
                             f"> 0, momentum {momentum} and weight_decay {weight_decay} >= 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        todo = []  # (group, weight, its decayed gradient)
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is not None:
                    d = w.grad.add(w, alpha=group["weight_decay"]) if group["weight_decay"] \
                        else w.grad
                    todo.append((group, w, d))
        ratios = self._trust_ratios([(w, d) for _, w, d in todo],
                                    [group["trust_coefficient"] for group, _, _ in todo])
        for (group, w, d), ratio in zip(todo, ratios):
            scaled = d * (ratio * group["lr"])
            if group["momentum"]:
                state = self.state[w]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = scaled.clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(scaled)
                scaled = state["momentum_buffer"]
            w.sub_(scaled)
        return loss


class LAMB(_Layerwise):
    """Layer-wise Adaptive Moments for Batch training (You et al., 2019).

    For each parameter w with gradient g, at step t::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
        w = w - lr * ||w|| / ||r|| * r                      (lr alone if a norm is 0)

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: (beta1, beta2).
        eps: added to the denominator.
        weight_decay: decoupled weight decay, inside the ratio's update.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        if lr <= 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"LAMB: bad lr {lr}, betas {betas}, eps {eps} or weight_decay "
                             f"{weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        todo = []  # (group, weight, its update r)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for w in group["params"]:
                if w.grad is None:
                    continue
                g = w.grad
                state = self.state[w]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(w)
                    state["exp_avg_sq"] = torch.zeros_like(w)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                r = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    r.add_(w, alpha=group["weight_decay"])
                todo.append((group, w, r))
        ratios = self._trust_ratios([(w, r) for _, w, r in todo], [1.0] * len(todo))
        for (group, w, r), ratio in zip(todo, ratios):
            w.sub_(r * (ratio * group["lr"]))
        return loss
