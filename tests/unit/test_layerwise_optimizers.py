"""hvdlite.torch.LARS and LAMB against the papers' update rules written out in numpy,
over several steps, including a zero parameter (its trust ratio is 1)."""
import numpy as np
import pytest
import torch

from hvdlite.torch.layerwise import LAMB, LARS


def _setup():
    rng = np.random.default_rng(5)
    weights = [rng.normal(size=(4, 3)), rng.normal(size=5), np.zeros(2)]
    grads = [[rng.normal(size=w.shape) for w in weights] for _ in range(4)]
    params = [torch.tensor(w, requires_grad=True) for w in weights]
    return weights, grads, params


def _run(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.tensor(g)
        opt.step()
    return [p.detach().numpy() for p in params]


def _ratio(w, u, coefficient=1.0):
    wn, un = np.linalg.norm(w), np.linalg.norm(u)
    return coefficient * wn / un if wn > 0 and un > 0 else 1.0


def test_lamb_follows_its_update_rule():
    weights, grads, params = _setup()
    got = _run(LAMB(params, lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1), params, grads)
    ws = [w.copy() for w in weights]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            ms[i] = 0.8 * ms[i] + 0.2 * g
            vs[i] = 0.95 * vs[i] + 0.05 * g * g
            r = (ms[i] / (1 - 0.8 ** t)) / (np.sqrt(vs[i] / (1 - 0.95 ** t)) + 1e-6) + 0.1 * ws[i]
            ws[i] = ws[i] - 0.05 * _ratio(ws[i], r) * r
    for g, w in zip(got, ws):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_lars_follows_its_update_rule(momentum):
    weights, grads, params = _setup()
    got = _run(LARS(params, lr=0.3, momentum=momentum, weight_decay=0.01, trust_coefficient=0.02),
               params, grads)
    ws = [w.copy() for w in weights]
    bufs = [None] * len(ws)
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            d = g + 0.01 * ws[i]
            scaled = 0.3 * _ratio(ws[i], d, 0.02) * d
            bufs[i] = scaled if bufs[i] is None or not momentum else momentum * bufs[i] + scaled
            ws[i] = ws[i] - bufs[i]
    for g, w in zip(got, ws):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_bad_hyperparameters_are_refused():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="LARS"):
        LARS(p, lr=0.1, trust_coefficient=0)
    with pytest.raises(ValueError, match="LAMB"):
        LAMB(p, betas=(0.9, 1.0))
