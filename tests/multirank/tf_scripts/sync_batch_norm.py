"""SyncBatchNormalization on N ranks against one BatchNormalization over the whole batch.

Rank r holds r + 2 rows of a batch that every rank can rebuild; one training call
(eagerly and in a tf.function) must give this rank's rows of the reference output, the
reference moving statistics, and this rank's rows of the reference input gradient
(of a loss summed over the whole batch: the per-rank losses add up). Prints one
HVDLITE_RESULT line.
"""
import numpy as np
import tensorflow as tf
from common import Checks, single_threaded_tensorflow

single_threaded_tensorflow()
import keras  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
C = Checks()
rows = [r + 2 for r in range(N)]
rng = np.random.default_rng(3)
full = rng.normal(size=(sum(rows), 3, 4)).astype(np.float32) * 2 + 1
weights = rng.normal(size=(sum(rows), 3, 4)).astype(np.float32)
start = sum(rows[:R])
mine = slice(start, start + rows[R])


def forward_and_grad(layer, x, w, wrap):
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * w)
        return y, tape.gradient(loss, x)

    return wrap(step)(tf.constant(x))


for mode, wrap in (("eager", lambda f: f), ("function", tf.function)):
    def check(mode=mode, wrap=wrap):
        ref = keras.layers.BatchNormalization(axis=1, momentum=0.5)
        sync = hvd.SyncBatchNormalization(axis=1, momentum=0.5)
        y_ref, g_ref = forward_and_grad(ref, full, weights, wrap)
        y, g = forward_and_grad(sync, full[mine], weights[mine], wrap)
        C.close(f"{mode}.output", y, y_ref.numpy()[mine], rtol=1e-4, atol=1e-4)
        C.close(f"{mode}.grad", g, g_ref.numpy()[mine], rtol=1e-4, atol=1e-4)
        C.close(f"{mode}.moving_mean", sync.moving_mean.numpy(), ref.moving_mean.numpy(),
                rtol=1e-5, atol=1e-5)
        C.close(f"{mode}.moving_variance", sync.moving_variance.numpy(),
                ref.moving_variance.numpy(), rtol=1e-4, atol=1e-4)

    C.run(mode, check)

C.report()
