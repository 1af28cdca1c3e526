"""hvdlite.keras on 2 real ranks (Keras 3), on the TensorFlow and the PyTorch backends.

One job per backend runs ``tf_scripts/keras_training.py``: model.fit with
DistributedOptimizer + BroadcastGlobalVariablesCallback from different initial weights
ends with the same weights on every rank, equal to one process doing SGD with the
whole batch; MetricAverageCallback logs the mean over ranks; the warmup and schedule
callbacks set the expected learning rate at every batch; backward_passes_per_step=2
equals one process with twice the batch; hvdlite.keras.load_model restores the wrapped
optimizer and training goes on identically on every rank.
"""
import importlib.util
import os

import numpy as np
import pytest

import needs

from harness import assert_ok, describe, run_job

pytestmark = pytest.mark.timeout(300)

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_scripts")
NP = 2


def _missing(*modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


BACKENDS = [
    pytest.param("tensorflow", marks=[
        needs.needs("tensorflow", not _missing("tensorflow"), "tensorflow not installed"),
        needs.needs("keras", not _missing("keras"), "keras not installed")]),
    pytest.param("torch", marks=[
        needs.needs("torch", not _missing("torch"), "torch not installed"),
        needs.needs("keras", not _missing("keras"), "keras not installed")]),
]


@pytest.fixture(scope="module", params=BACKENDS)
def job(request, native, tmp_path_factory):
    backend = request.param
    out_dir = tmp_path_factory.mktemp(f"keras-{backend}")
    result = assert_ok(run_job(NP, os.path.join(SCRIPTS, "keras_training.py"),
                               args=[str(out_dir)], timeout=240,
                               env={"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}))
    bodies = [result.result(rank) for rank in range(NP)]
    for body in bodies:
        assert body["backend"] == backend, describe(result)
        assert body["checks"] >= 15, describe(result)
    return bodies


def _failures(bodies, prefix):
    return "\n".join(f"--- rank {rank}: {key}\n{detail}"
                     for rank, body in enumerate(bodies)
                     for key, detail in sorted(body["failures"].items())
                     if key.startswith(prefix))


def test_fit_leaves_identical_weights_equal_to_large_batch_sgd(job):
    assert _failures(job, "fit") == ""
    first = job[0]["values"]["fit_weights"]
    for body in job[1:]:
        assert body["values"]["fit_weights"] == first  # bitwise identical on every rank


def test_metric_average_callback_logs_the_mean_over_ranks(job):
    before = [body["values"]["metrics_before"] for body in job]
    for body in job:
        after = body["values"]["metrics_after"]
        assert len(after) == 2
        for epoch, logs in enumerate(after):
            for key, value in logs.items():
                mean = np.mean([b[epoch][key] for b in before])
                assert value == pytest.approx(mean, rel=1e-6), (epoch, key)
    # The ranks saw different data, so the average is not any rank's own value.
    assert before[0][0]["loss"] != before[1][0]["loss"]


def test_warmup_and_schedule_callbacks_set_the_expected_rates(job):
    steps, warmup, initial = job[0]["steps"], 2, 0.2
    expected = []
    for epoch in range(3):
        for batch in range(steps):
            if epoch < warmup:
                e = epoch + batch / steps + 1.0 / steps
                expected.append(initial / NP * (e * (NP - 1) / warmup + 1))
            else:
                expected.append(initial * 0.5)
    for body in job:
        assert body["values"]["lrs"] == pytest.approx(expected, rel=1e-6)
        assert body["values"]["lr_logged"] == pytest.approx(
            [expected[steps - 1], expected[2 * steps - 1], initial * 0.5], rel=1e-6)


def test_backward_passes_per_step_equals_a_larger_batch(job):
    assert _failures(job, "backward_passes") == ""


def test_load_model_restores_the_wrapped_optimizer(job):
    assert _failures(job, "load_model") == ""
    first = job[0]["values"]["after_load_weights"]
    for body in job[1:]:
        assert body["values"]["after_load_weights"] == first


def test_no_check_failed(job):
    assert _failures(job, "") == ""
