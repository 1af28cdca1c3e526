"""Rank script of test_compression.py's TensorFlow/Keras part: the reducers through
DistributedGradientTape (eager and inside tf.function) and through the Keras
DistributedOptimizer's model.fit. Gradients come from seeds of (step, rank) so the test
can recompute them."""
import json
import sys

import numpy as np
from common import single_threaded_tensorflow

single_threaded_tensorflow()
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402


def seeded_gradients(step, rank):
    rng = np.random.default_rng([step, rank])
    return (rng.standard_normal((8, 6)).astype(np.float32),
            rng.standard_normal(6).astype(np.float32))


def tape_updates(compression, function):
    """Two steps of a tape whose gradients are the seeded ones; the reduced gradients."""
    w = tf.Variable(tf.zeros((8, 6)))
    b = tf.Variable(tf.zeros((6,)))

    def reduced(gw, gb):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(w * gw) + tf.reduce_sum(b * gb)
        return hvd.DistributedGradientTape(t, compression=compression).gradient(loss, [w, b])

    run = tf.function(reduced) if function else reduced
    return [[g.numpy().tolist() for g in run(*map(tf.constant, seeded_gradients(s, hvd.rank())))]
            for s in range(2)]


def keras_fit(compression):
    import keras

    import hvdlite.keras as hvd_keras

    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(11)
    x = rng.normal(size=(256, 10)).astype(np.float32)
    y = x @ rng.normal(size=(10, 1)).astype(np.float32)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=compression)
    model.compile(optimizer=opt, loss="mse")
    first = float(model.evaluate(x, y, verbose=0))
    mine = slice(hvd.rank(), None, hvd.size())
    model.fit(x[mine], y[mine], batch_size=16, epochs=8, verbose=0, shuffle=False,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    digest = float(sum(np.sum(v) * (i + 1) for i, v in enumerate(model.get_weights())))
    return {"first": first, "last": float(model.evaluate(x, y, verbose=0)), "digest": digest}


def main():
    hvd.init()
    out = {"eager_topk": tape_updates(hvd.Compression.topk(0.25, dense_below=0), False),
           "function_powersgd": tape_updates(hvd.Compression.powersgd(2), True),
           "eager_quantize": tape_updates(hvd.Compression.quantize(8), False),
           "keras_topk": keras_fit(hvd.Compression.topk(0.3)),
           "keras_powersgd": keras_fit(hvd.Compression.powersgd(2))}
    print("HVDLITE_RESULT", json.dumps(out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
