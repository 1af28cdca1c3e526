"""``import hvdlite.tensorflow.keras as hvd`` (what ``horovod.tensorflow.keras`` scripts
import) on 2 and 3 real ranks: the Keras training script of ``test_keras.py``
(``tf_scripts/keras_training.py``: fit from different initial weights equal to one
process with the whole batch, MetricAverageCallback, the learning-rate callbacks,
backward_passes_per_step, load_model) run through that namespace, plus its numpy-level
collectives, against values recomputed from rank and size.
"""
import os

import pytest

import needs

from harness import assert_ok, describe, run_job

pytestmark = [
    needs.needs("tensorflow", needs.installed("tensorflow"), "tensorflow not installed"),
    needs.needs("keras", needs.installed("keras"), "keras not installed"),
    pytest.mark.timeout(400),
]

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_scripts")

COLLECTIVES = """
import json
import numpy as np
import hvdlite.tensorflow.keras as hvd
hvd.init()
R, N = hvd.rank(), hvd.size()
out = {
    "sum": hvd.allreduce(np.array([R, 1.0]), op=hvd.Sum).tolist(),
    "avg": hvd.allreduce(np.array([float(R)])).tolist(),
    "gather": hvd.allgather(np.full((R + 1, 1), R)).ravel().tolist(),
    "bcast": hvd.broadcast(np.array([R, R]), root_rank=N - 1).tolist(),
    "scatter": hvd.reducescatter(np.ones((N, 2)) * (R + 1), op=hvd.Sum).tolist(),
}
print("HVDLITE_RESULT", json.dumps(out))
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_training_through_the_horovod_keras_namespace(native, tmp_path, np_):
    result = assert_ok(run_job(np_, os.path.join(SCRIPTS, "keras_training.py"),
                               args=[str(tmp_path)], timeout=300,
                               env={"KERAS_BACKEND": "tensorflow",
                                    "TF_CPP_MIN_LOG_LEVEL": "2",
                                    "HVDLITE_KERAS_MODULE": "hvdlite.tensorflow.keras"}))
    for rank in range(np_):
        body = result.result(rank)
        assert body["checks"] >= 15, describe(result)
        assert body["failures"] == {}, body["failures"]
    weights = [result.result(rank)["values"]["fit_weights"] for rank in range(np_)]
    assert all(w == weights[0] for w in weights)


@pytest.mark.parametrize("np_", [2, 3])
def test_numpy_level_collectives(native, np_):
    result = assert_ok(run_job(np_, COLLECTIVES, timeout=120,
                               env={"TF_CPP_MIN_LOG_LEVEL": "2"}))
    ranks = range(np_)
    for rank in ranks:
        got = result.result(rank)
        assert got["sum"] == [sum(ranks), np_]
        assert got["avg"] == [sum(ranks) / np_]
        assert got["gather"] == [r for r in ranks for _ in range(r + 1)]
        assert got["bcast"] == [np_ - 1, np_ - 1]
        assert got["scatter"] == [[sum(r + 1 for r in ranks)] * 2]
