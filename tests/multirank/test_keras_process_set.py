"""hvdlite.keras's DistributedOptimizer in a process set: members average their
gradients over the set alone (against numpy), a rank outside trains on its own."""
import pytest

import needs

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r'''
import json
import os
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
import keras
import hvdlite.keras as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
members = [r for r in range(size) if r != 1]          # {0, 2} at 3 ranks: not contiguous
pair = hvd.add_process_set(members)
B, LR = 8, 0.1
w0 = np.random.default_rng(1).standard_normal((4, 1)).astype(np.float32)


def data(r):
    rng = np.random.default_rng([r, 5])
    return (rng.standard_normal((B, 4)).astype(np.float32),
            rng.standard_normal((B, 1)).astype(np.float32))


def grad(r):  # of mean((x w - y)^2) at w0
    x, y = data(r)
    return 2.0 / B * x.T @ (x @ w0 - y)


model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False)])
model.set_weights([w0])
opt = keras.optimizers.SGD(LR)
if pair.included():
    opt = hvd.DistributedOptimizer(opt, process_set=pair)
model.compile(optimizer=opt, loss="mse")
model.train_on_batch(*data(rank))
expected = w0 - LR * (np.mean([grad(r) for r in members], axis=0) if pair.included()
                      else grad(rank))
error = float(np.abs(model.get_weights()[0] - expected).max())
hvd.barrier()  # a rank that shuts down ends the job for all, as in Horovod
print("HVDLITE_RESULT " + json.dumps({"error": error, "member": pair.included()}), flush=True)
'''


def test_keras_optimizer_averages_over_its_process_set():
    needs.import_or_skip("keras")
    result = assert_ok(run_job(3, SCRIPT, timeout=240))
    bodies = [result.result(r) for r in range(3)]
    assert [b["member"] for b in bodies] == [True, False, True], describe(result)
    assert all(b["error"] < 1e-6 for b in bodies), bodies
