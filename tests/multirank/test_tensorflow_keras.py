"""``import hvdlite.tensorflow.keras as hvd`` (what ``horovod.tensorflow.keras`` scripts
import) on 2 and 3 real ranks: the Keras training script of ``test_keras.py``
(``tf_scripts/keras_training.py``: fit from different initial weights equal to one
process with the whole batch, MetricAverageCallback, the learning-rate callbacks,
backward_passes_per_step, load_model) run through that namespace, then its numpy-level
collectives in the same ranks, against values recomputed from rank and size.
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

# One job per rank count: the training script, then the collectives in the same ranks
# (after training, which sets TensorFlow's threads before its first op). Each prints one
# HVDLITE_RESULT line: the training's first, the collectives' last.
JOB = """
import json, os, runpy, sys
import numpy as np
sys.argv = sys.argv[1:]  # the training script's own: [script, directory]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
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
def test_training_and_collectives_through_the_horovod_keras_namespace(native, tmp_path, np_):
    script = os.path.join(SCRIPTS, "keras_training.py")
    result = assert_ok(run_job(np_, JOB, args=[script, str(tmp_path)], timeout=300,
                               env={"KERAS_BACKEND": "tensorflow",
                                    "TF_CPP_MIN_LOG_LEVEL": "2",
                                    "HVDLITE_KERAS_MODULE": "hvdlite.tensorflow.keras"}))
    for rank in range(np_):
        body = result.result(rank, 0)
        assert body["checks"] >= 15, describe(result)
        assert body["failures"] == {}, body["failures"]
    weights = [result.result(rank, 0)["values"]["fit_weights"] for rank in range(np_)]
    assert all(w == weights[0] for w in weights)

    ranks = range(np_)
    for rank in ranks:
        got = result.result(rank, -1)
        assert len(result.results[rank]) == 2, describe(result)
        assert got["sum"] == [sum(ranks), np_]
        assert got["avg"] == [sum(ranks) / np_]
        assert got["gather"] == [r for r in ranks for _ in range(r + 1)]
        assert got["bcast"] == [np_ - 1, np_ - 1]
        assert got["scatter"] == [[sum(r + 1 for r in ranks)] * 2]
