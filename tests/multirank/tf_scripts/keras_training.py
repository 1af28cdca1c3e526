"""hvdlite.keras on N ranks, on the backend named by KERAS_BACKEND (tensorflow, torch);
imported as the module named by HVDLITE_KERAS_MODULE (default ``hvdlite.keras``; also
``hvdlite.tensorflow.keras``, Horovod's ``horovod.tensorflow.keras``).

* model.fit with DistributedOptimizer(SGD) + BroadcastGlobalVariablesCallback: every rank
  starts from different weights, ends with the same ones, equal to one process doing
  SGD with the whole batch from the root's initial weights;
* MetricAverageCallback: the logs after it are the mean over ranks of those before it;
* LearningRateWarmupCallback + LearningRateScheduleCallback: the rate at every batch;
* backward_passes_per_step=2 equals one process with twice the batch (and twice the rate);
* hvdlite.keras.load_model restores the wrapped optimizer and training goes on.

Prints one HVDLITE_RESULT line with the checks and the values the test compares.
"""
import os
import sys

import numpy as np
from common import Checks, single_threaded_tensorflow

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
if BACKEND == "tensorflow":
    single_threaded_tensorflow()
else:
    import torch

    torch.set_num_threads(1)

import keras  # noqa: E402

import importlib  # noqa: E402

hvd = importlib.import_module(os.environ.get("HVDLITE_KERAS_MODULE", "hvdlite.keras"))

hvd.init()
R, N = hvd.rank(), hvd.size()
C = Checks()
B, STEPS = 4, 6
rng = np.random.default_rng(7)
X = rng.normal(size=(STEPS * N * B, 5)).astype(np.float32)
Y = (np.tanh(X @ rng.normal(size=(5, 2))) + 0.1).astype(np.float32)


def shard(a, micro=B):
    """Rank R's rows: its B rows of every global batch of N * B rows."""
    return np.concatenate([a[k * N * micro + R * micro:k * N * micro + (R + 1) * micro]
                           for k in range(len(a) // (N * micro))])


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(2)])


def weights(model):
    return [np.asarray(keras.ops.convert_to_numpy(w), dtype=np.float64)
            for w in model.weights]


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.lrs = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({k: float(v) for k, v in (logs or {}).items()})

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def check_fit():
    model = make_model(100 + R)  # different initial weights on every rank
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse", metrics=["mae"])
    before, after = Recorder(), Recorder()
    model.fit(shard(X), shard(Y), batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), before,
                         hvd.callbacks.MetricAverageCallback(), after])
    reference = make_model(100)  # the root's initial weights
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(X, Y, batch_size=N * B, epochs=2, shuffle=False, verbose=0)
    for i, (a, b) in enumerate(zip(weights(model), weights(reference))):
        C.close(f"fit.equals_large_batch.{i}", a, b, rtol=1e-4, atol=1e-5)
    C.values["fit_weights"] = [w.ravel().tolist() for w in weights(model)]
    C.values["metrics_before"] = before.epochs
    C.values["metrics_after"] = after.epochs
    path = os.path.join(sys.argv[1], f"model_{R}.keras")
    model.save(path)
    return path, weights(model)


def check_load_model(path, saved):
    model = hvd.load_model(path)
    optimizer = model.optimizer
    C.true("load_model.wrapped", hasattr(type(optimizer), "_hvdlite_settings"),
           type(optimizer).__mro__)
    C.true("load_model.is_sgd", isinstance(optimizer, keras.optimizers.SGD))
    C.equal("load_model.iterations",
            int(keras.ops.convert_to_numpy(optimizer.iterations)), 2 * STEPS)
    for i, (a, b) in enumerate(zip(weights(model), saved)):
        C.close(f"load_model.weights.{i}", a, b)
    model.fit(shard(X), shard(Y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    C.values["after_load_weights"] = [w.ravel().tolist() for w in weights(model)]


def check_learning_rate_callbacks():
    model = make_model(5)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)),
                  loss="mse")
    recorder = Recorder()
    model.fit(shard(X), shard(Y), batch_size=B, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=2),
                         hvd.callbacks.LearningRateScheduleCallback(
                             0.2, multiplier=0.5, start_epoch=2),
                         recorder])
    C.values["lrs"] = recorder.lrs
    C.values["lr_logged"] = [e.get("lr") for e in recorder.epochs]


def check_backward_passes_per_step():
    model = make_model(200)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                     backward_passes_per_step=2),
                  loss="mse")
    model.fit(shard(X), shard(Y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    reference = make_model(200)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(X, Y, batch_size=2 * N * B, epochs=1, shuffle=False, verbose=0)
    for i, (a, b) in enumerate(zip(weights(model), weights(reference))):
        C.close(f"backward_passes.{i}", a, b, rtol=1e-4, atol=1e-5)


saved = {}
C.run("fit", lambda: saved.setdefault("fit", check_fit()))
if "fit" in saved:
    C.run("load_model", lambda: check_load_model(*saved["fit"]))
C.run("lr_callbacks", check_learning_rate_callbacks)
C.run("backward_passes", check_backward_passes_per_step)
C.report(rank=R, size=N, backend=keras.backend.backend(), steps=STEPS)
