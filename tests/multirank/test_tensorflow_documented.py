"""What docs/frameworks.md says of two TensorFlow/Keras names that only had their names
checked before (tests/unit/test_horovod_public_names.py):

* ``PartialDistributedGradientTape(local_layers=...)``: the other layers' gradients are
  averaged over the ranks, the local layers' are not (divided by size() with
  ``scale_local_gradients``, as Horovod does), against gradients computed in this
  process from every rank's data with a plain tape;
* ``keras.callbacks.BestModelCheckpoint``: keeps the best model only (the saved weights
  are those of the epoch with the lowest val_loss, not the last epoch's).
"""
import pytest

import needs

from harness import assert_body_passed, describe, run_bodies

pytestmark = [
    needs.needs("tensorflow", needs.installed("tensorflow"), "tensorflow not installed"),
    needs.needs("keras", needs.installed("keras"), "keras not installed"),
    pytest.mark.timeout(300), pytest.mark.usefixtures("native"),
]

# Both checks run in one job of 2 ranks (harness.run_bodies: TensorFlow is imported
# once, not twice), each reporting its own values and failures by name.

PARTIAL = r"""
import json, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np
import tensorflow as tf
import keras
import hvdlite.tensorflow as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
keras.utils.set_random_seed(0)  # the same initial weights on every rank
shared, local = keras.layers.Dense(4, name="shared"), keras.layers.Dense(2, name="local")
model = keras.Sequential([keras.Input((3,)), shared, local])

def data(rank):
    g = np.random.default_rng(10 + rank)
    return g.normal(size=(5, 3)).astype(np.float32), g.normal(size=(5, 2)).astype(np.float32)

def plain_grads(rank):
    x, y = data(rank)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]

out = {}
for scale in (True, False):
    x, y = data(R)
    with tf.GradientTape() as t:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    tape = hvd.PartialDistributedGradientTape(t, local_layers=[local],
                                              scale_local_gradients=scale)
    got = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
    every = [plain_grads(k) for k in range(N)]
    errors = {}
    for i, w in enumerate(model.trainable_weights):
        is_local = any(w is v for v in local.trainable_weights)
        want = every[R][i] / (N if scale else 1) if is_local else \
            sum(e[i] for e in every) / N
        errors[w.path] = float(np.max(np.abs(got[i] - want)))
    out[f"scale={scale}"] = errors
values.update(out)
"""


def test_partial_tape_averages_all_but_the_local_layers(job):
    _, outcomes, result = job
    assert_body_passed(outcomes, "partial")
    for rank in range(2):
        for scale, errors in outcomes["partial"][rank]["values"].items():
            assert len(errors) == 4, errors  # kernel and bias of both layers
            assert max(errors.values()) < 1e-6, (rank, scale, errors, describe(result))


CHECKPOINT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np
import keras
import hvdlite.keras as hvd

hvd.init()
keras.utils.set_random_seed(0)
g = np.random.default_rng(hvd.rank())
x = g.normal(size=(64, 4)).astype(np.float32)
y = x @ np.arange(1, 5, dtype=np.float32)[:, None]
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
# Epochs 0-1 learn; epochs 2-3 take far too large steps: val_loss rises past its best.
rates = [0.05, 0.05, 2.0, 2.0]
weights = []
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             keras.callbacks.LearningRateScheduler(lambda epoch, lr: rates[epoch]),
             keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: weights.append(
                 [w.tolist() for w in model.get_weights()]))]
path = os.path.join(sys.argv[1], "best.weights.h5")
if hvd.rank() == 0:
    callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=path,
                                                       save_weights_only=True))
history = model.fit(x, y, batch_size=16, epochs=4, verbose=0, shuffle=False,
                    validation_data=(x, y), callbacks=callbacks)
out = {"val_loss": history.history["val_loss"], "weights": weights}
if hvd.rank() == 0:
    model.load_weights(path)
    out["saved"] = [w.tolist() for w in model.get_weights()]
values.update(out)
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The checkpoint's directory, the bodies' outcomes and the JobResult."""
    directory = tmp_path_factory.mktemp("checkpoint")
    outcomes, result = run_bodies(2, {"partial": PARTIAL, "checkpoint": CHECKPOINT},
                                  timeout=240, args=[str(directory)])
    return directory, outcomes, result


def test_best_model_checkpoint_keeps_the_best_epoch_on_rank_0(job):
    tmp_path, outcomes, result = job
    assert_body_passed(outcomes, "checkpoint")
    got = outcomes["checkpoint"][0]["values"]
    losses = got["val_loss"]
    best = min(range(len(losses)), key=lambda e: losses[e])
    assert best < len(losses) - 1, f"val_loss did not rise after its best: {losses}"
    assert got["saved"] == got["weights"][best], (losses, describe(result))
    assert got["saved"] != got["weights"][-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.weights.h5"]
    assert "saved" not in outcomes["checkpoint"][1]["values"]
