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

from harness import assert_ok, run_job

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(600)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "torch_scripts", "compression.py")
sys.path.insert(0, os.path.join(HERE, "torch_scripts"))
from compression import SHAPES, STEPS, gradient  # noqa: E402 - the rank script's seeds

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


TF_SCRIPT = os.path.join(HERE, "tf_scripts", "compression.py")


def seeded_gradients(step, rank):  # as the TF rank script makes them
    rng = np.random.default_rng([step, rank])
    return (rng.standard_normal((8, 6)).astype(np.float32),
            rng.standard_normal(6).astype(np.float32))


@pytest.mark.parametrize("size", [2, 3])
def test_tensorflow_tape_and_keras_use_the_reducers(native, size):
    pytest.importorskip("tensorflow")
    result = assert_ok(run_job(size, TF_SCRIPT, timeout=400))
    bodies = [result.result(rank) for rank in range(size)]
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
