"""hvdlite.keras's DistributedOptimizer in a process set: members average their
gradients over the set alone (against numpy), a rank outside trains on its own."""
import pytest

import needs

from harness import describe, share_script, shared_checks

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r'''
import json
import os
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np
import tensorflow as tf
from common import single_threaded_tensorflow  # tf_scripts/common.py
single_threaded_tensorflow()
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
hvd.shutdown()
'''
# Run in harness.shared_checks's job of tf_scripts/ (TensorFlow imported once for them).
share_script("tf_scripts", (3,), "keras_process_set.py", SCRIPT)


def test_keras_optimizer_averages_over_its_process_set():
    needs.import_or_skip("keras")
    bodies, job = shared_checks("tf_scripts", 3, "keras_process_set.py")
    assert [b["member"] for b in bodies] == [True, False, True], describe(job)
    assert all(b["error"] < 1e-6 for b in bodies), bodies
