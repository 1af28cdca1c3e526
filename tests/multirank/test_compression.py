"""Compression reducers (top-k, quantize, PowerSGD) on real ranks, against numpy.

One job per rank count runs ``torch_scripts/compression.py``; the gradients there come
from seeds of (step, rank), so this file makes the same gradients and computes what the
ranks should have applied without hvdlite.
"""
import math
import os
import sys

import numpy as np
import pytest

import needs

from harness import assert_ok, run_job, shared_checks

needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(600)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torch_scripts", "compression.py")
sys.path.insert(0, os.path.join(HERE, "torch_scripts"))
from compression import SHAPES, STEPS, batch, gradient, regression  # noqa: E402

@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def job(request, native):
    size = request.param
    # Flat MPI allreduce, so that the wire counters see every collective the same way.
    result = assert_ok(run_job(size, SCRIPT, timeout=400,
                               env={"HVDLITE_SHM_ALLREDUCE": "0"}))
    bodies = []
    for rank in range(size):
        merged = {}
        for part in result.results[rank]:
            merged.update(part)
        bodies.append(merged)
    return size, bodies


def grads(size, name, step):
    return [gradient(name, step, r).reshape(-1) for r in range(size)]


def test_every_rank_applies_the_same_update(job):
    size, bodies = job
    for reducer in ("topk", "quantize8", "quantize4", "powersgd"):
        for rank in range(1, size):
            assert bodies[rank][reducer]["applied"] == bodies[0][reducer]["applied"], reducer
    digests = {label: {b["train"][label]["digest"] for b in bodies} for label in bodies[0]["train"]}
    assert all(len(d) == 1 for d in digests.values()), digests


def test_topk_first_step_matches_numpy(job):
    size, bodies = job
    for name in SHAPES:
        total = np.zeros(int(np.prod(SHAPES[name])), np.float32)
        for g in grads(size, name, 0):
            k = math.ceil(0.1 * g.size)
            top = np.argsort(-np.abs(g), kind="stable")[:k]
            np.add.at(total, top, g[top])
        applied = np.asarray(bodies[0]["topk"]["applied"][name][0]).reshape(-1)
        np.testing.assert_allclose(applied, total / size, rtol=1e-6, atol=1e-7)
        # Sparse: at most size * k entries are non-zero.
        assert np.count_nonzero(applied) <= size * math.ceil(0.1 * total.size)


def simulate_topk(per_rank, ratios, momentum=0.0, masking=False):
    """Top-k with error feedback on every rank, in numpy, written from the definitions:
    per_rank[r][t] is rank r's gradient at step t, ratios[t] the ratio at step t.
    Returns the updates handed to the optimizer, the ranks' residuals and velocities.

    A rank's velocity is u = m u + g (u = g without momentum); it selects the k largest
    magnitudes of residual + u, sends them and keeps the rest; the mean over ranks S_t
    goes to the optimizer as S_t - m S_(t-1) (its momentum buffer is then S_t). With
    masking, the velocity of the entries a rank sent is zeroed too.
    """
    size, n = len(per_rank), per_rank[0][0].size
    residual = [np.zeros(n) for _ in range(size)]
    velocity = [np.zeros(n) for _ in range(size)]
    updates, last = [], np.zeros(n)
    for t, ratio in enumerate(ratios):
        total = np.zeros(n)
        for r in range(size):
            velocity[r] = momentum * velocity[r] + per_rank[r][t]
            acc = residual[r] + velocity[r]
            top = np.argsort(-np.abs(acc), kind="stable")[:math.ceil(ratio * n)]
            total[top] += acc[top]
            residual[r] = acc.copy()
            residual[r][top] = 0.0
            if masking:
                velocity[r][top] = 0.0
        mean = total / size
        updates.append(mean - momentum * last)
        last = mean
    return updates, residual, velocity


@pytest.mark.parametrize("label, ratio, momentum, masking", [
    ("topk", 0.1, 0.0, False), ("topk_mc", 0.1, 0.9, False), ("topk_mask", 0.1, 0.9, True)])
def test_topk_every_step_matches_the_simulation(job, label, ratio, momentum, masking):
    """Each step's update, and what each rank holds back, against the numpy simulation:
    plain error feedback, DGC's momentum correction, and with momentum factor masking."""
    size, bodies = job
    for name in SHAPES:
        per_rank = [[gradient(name, t, r).reshape(-1).astype(np.float64)
                     for t in range(STEPS)] for r in range(size)]
        updates, residual, velocity = simulate_topk(per_rank, [ratio] * STEPS, momentum,
                                                    masking)
        for t in range(STEPS):
            np.testing.assert_allclose(np.reshape(bodies[0][label]["applied"][name][t], -1),
                                       updates[t], rtol=1e-5, atol=1e-5, err_msg=f"{name} {t}")
        for r in range(size):
            np.testing.assert_allclose(bodies[r][label]["residuals"][name], residual[r],
                                       rtol=1e-5, atol=1e-5)
            if momentum:
                np.testing.assert_allclose(bodies[r][label]["velocities"][name], velocity[r],
                                           rtol=1e-5, atol=1e-5)
            else:
                assert bodies[r][label]["velocities"][name] is None
    if masking:  # the masked velocities differ from the unmasked ones: masking did act
        assert bodies[0]["topk_mask"]["velocities"]["w"] != bodies[0]["topk_mc"]["velocities"]["w"]


def test_topk_warmup_sends_more_at_first(job):
    """warmup_steps=3 with ratio 0.05: 25% at step 0, falling geometrically to 5% at step 3."""
    size, bodies = job
    ratios = [0.25 * (0.05 / 0.25) ** (t / 3) if t < 3 else 0.05 for t in range(STEPS)]
    for name in SHAPES:
        per_rank = [[gradient(name, t, r).reshape(-1).astype(np.float64)
                     for t in range(STEPS)] for r in range(size)]
        updates, _, _ = simulate_topk(per_rank, ratios)
        for t in range(STEPS):
            applied = np.reshape(bodies[0]["topk_warm"]["applied"][name][t], -1)
            np.testing.assert_allclose(applied, updates[t], rtol=1e-5, atol=1e-5)
    # w (192 entries): 48 per rank at first, 10 after the warm-up.
    first = np.count_nonzero(bodies[0]["topk_warm"]["applied"]["w"][0])
    last = np.count_nonzero(bodies[0]["topk_warm"]["applied"]["w"][-1])
    assert first > 3 * last, (first, last)


def test_topk_momentum_correction_with_the_optimizers_momentum(job):
    """DistributedOptimizer(SGD(momentum=0.9), Compression.topk(0.25)) takes momentum 0.9
    for the correction and trains as DGC does: the velocity accumulated on each rank,
    top-k with error feedback, and plain SGD steps on the exchanged sum. The reference is
    one process running every rank's batch with numpy's top-k."""
    torch = needs.import_or_skip("torch")
    size, bodies = job
    run = bodies[0]["topk_sgd_momentum"]
    assert run["momentum"] == 0.9
    assert all(b["topk_sgd_momentum"]["params"] == run["params"] for b in bodies)
    model, x, y = regression()
    params = list(model.parameters())
    residual = [[np.zeros(p.numel()) for p in params] for _ in range(size)]
    velocity = [[np.zeros(p.numel()) for p in params] for _ in range(size)]
    for step in range(20):
        totals = [np.zeros(p.numel()) for p in params]
        for r in range(size):
            xb, yb = batch(x, y, step, r, size)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            for i, p in enumerate(params):
                velocity[r][i] = 0.9 * velocity[r][i] + p.grad.double().reshape(-1).numpy()
                acc = residual[r][i] + velocity[r][i]
                top = np.argsort(-np.abs(acc), kind="stable")[:math.ceil(0.25 * acc.size)]
                totals[i][top] += acc[top]
                residual[r][i] = acc.copy()
                residual[r][i][top] = 0.0
        with torch.no_grad():
            for p, total in zip(params, totals):
                p -= 0.05 * torch.from_numpy(total / size).reshape(p.shape).to(p.dtype)
    for p, got in zip(params, run["params"]):
        np.testing.assert_allclose(got, p.detach().reshape(-1).numpy(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("reducer", ["topk", "powersgd"])
def test_error_feedback_loses_nothing(job, reducer):
    """Over the steps, the applied updates add up to the mean of the gradients' sums less
    the mean of what the ranks still hold back."""
    size, bodies = job
    for name in SHAPES:
        applied = np.sum(np.asarray(bodies[0][reducer]["applied"][name], np.float64), axis=0)
        residuals = [b[reducer]["residuals"][name] for b in bodies]
        vector = name == "b" and reducer == "powersgd"
        if vector:  # vectors go uncompressed: nothing is held back
            assert all(r is None for r in residuals)
            residuals = [np.zeros(applied.size)] * size
        held = np.mean([np.asarray(r, np.float64) for r in residuals], axis=0)
        given = np.mean([sum(grads(size, name, t)[r] for t in range(STEPS))
                         for r in range(size)], axis=0)
        np.testing.assert_allclose(applied.reshape(-1) + held, given, rtol=1e-4, atol=1e-4)
        assert vector or np.abs(held).max() > 0  # something was held back: it compresses


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_is_within_one_step_of_the_mean(job, bits):
    size, bodies = job
    levels = 2 ** (bits - 1) - 1
    for name in SHAPES:
        for step in range(STEPS):
            gs = grads(size, name, step)
            applied = np.asarray(bodies[0][f"quantize{bits}"]["applied"][name][step]).reshape(-1)
            # Each rank's value moves by less than one quantum (its chunk's scale / L).
            bound = np.zeros(gs[0].size)
            for g in gs:
                padded = np.zeros(-(-g.size // 64) * 64)
                padded[:g.size] = np.abs(g)
                bound += np.repeat(padded.reshape(-1, 64).max(axis=1) / levels, 64)[:g.size]
            error = np.abs(applied - np.mean(gs, axis=0))
            assert (error <= bound / size + 1e-6).all(), (name, step, error.max())
            assert error.max() > 0  # it is not exact: the codes are what was sent


def test_compression_cuts_the_wire_bytes(job):
    size, bodies = job
    dense = bodies[0]["dense_wire"]
    share = 2 * (size - 1) / size * 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    assert abs(dense - share) <= 16  # the dense allreduce's count: 2(n-1)/n S
    for reducer, most in (("topk", 0.5), ("quantize8", 0.6), ("quantize4", 0.4),
                          ("powersgd", 0.7)):
        per_step = bodies[0][reducer]["wire"]
        assert max(per_step) < most * dense, (reducer, per_step, dense)


def test_training_converges_with_every_reducer(job):
    _, bodies = job
    train = bodies[0]["train"]
    for label, run in train.items():
        assert run["last"] < 0.5 * run["first"], (label, run)
    for label in ("topk", "quantize8", "powersgd"):
        assert train[label]["last"] < 3 * train["none"]["last"] + 0.05, (label, train)


def seeded_gradients(step, rank):  # as the TF rank script makes them
    rng = np.random.default_rng([step, rank])
    return (rng.standard_normal((8, 6)).astype(np.float32),
            rng.standard_normal(6).astype(np.float32))


@pytest.mark.parametrize("size", [2, 3])
def test_tensorflow_tape_and_keras_use_the_reducers(native, size):
    needs.import_or_skip("tensorflow")
    # In harness.shared_checks's job, beside the other scripts of tf_scripts/.
    bodies, _ = shared_checks("tf_scripts", size, "compression.py")
    for key in bodies[0]:
        for rank in range(1, size):
            assert bodies[rank][key] == bodies[0][key], key  # the same update everywhere
    # Top-k's first step against numpy.
    for i, label in enumerate(("w", "b")):
        total = np.zeros(seeded_gradients(0, 0)[i].size, np.float32)
        for rank in range(size):
            g = seeded_gradients(0, rank)[i].reshape(-1)
            top = np.argsort(-np.abs(g), kind="stable")[:math.ceil(0.25 * g.size)]
            np.add.at(total, top, g[top])
        np.testing.assert_allclose(np.asarray(bodies[0]["eager_topk"][0][i]).reshape(-1),
                                   total / size, rtol=1e-6, atol=1e-7, err_msg=label)
    # PowerSGD inside tf.function: the vector b is averaged exactly.
    mean_b = np.mean([seeded_gradients(0, r)[1] for r in range(size)], axis=0)
    np.testing.assert_allclose(bodies[0]["function_powersgd"][0][1], mean_b, rtol=1e-5)
    for key in ("keras_topk", "keras_powersgd"):
        run = bodies[0][key]
        assert run["last"] < 0.5 * run["first"], (key, run)
