"""hvdlite.tensorflow on N ranks: every op eagerly and in tf.function, gradients,
DistributedGradientTape training vs one process with the whole batch, and a mismatch.

Expected values are recomputed from rank and size. Prints one HVDLITE_RESULT line.
"""
import ml_dtypes
import numpy as np
import tensorflow as tf
from common import Checks, single_threaded_tensorflow

import hvdlite.tensorflow as hvd

single_threaded_tensorflow()
hvd.init()
R, N = hvd.rank(), hvd.size()
C = Checks()


def base(shape, r, dtype=np.float32):
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) % 7 + r + 1).astype(dtype)


def all_ranks(shape, dtype=np.float32):
    return [base(shape, r, dtype) for r in range(N)]


MODES = {"eager": lambda f: f, "graph": lambda f: tf.function(f)}


def check_ops(mode):
    wrap = MODES[mode]
    x = base((3, 4), R)
    xs = all_ranks((3, 4))
    for op, ref in ((hvd.Average, np.mean), (hvd.Sum, np.sum), (hvd.Min, np.min),
                    (hvd.Max, np.max), (hvd.Product, np.prod)):
        got = wrap(lambda t, op=op: hvd.allreduce(t, op=op))(tf.constant(x))
        C.close(f"{mode}.allreduce.{op}", got, ref(np.stack(xs), axis=0), rtol=1e-5)
    # Integer Average: sum, then division by the ranks truncating toward zero (Horovod's).
    xi = base((5,), R, np.int32) * (1 if R else -1)
    si = np.sum([base((5,), r, np.int32) * (1 if r else -1) for r in range(N)], axis=0)
    got = wrap(lambda t: hvd.allreduce(t, op=hvd.Average))(tf.constant(xi))
    C.equal(f"{mode}.allreduce.int32_average", got.numpy().tolist(),
            np.trunc(si / N).astype(np.int32).tolist())
    C.equal(f"{mode}.allreduce.int32_dtype", got.dtype, tf.int32)
    # bool: Min / Max.
    xb = np.array([True, R == 0, False])
    got = wrap(lambda t: hvd.allreduce(t, op=hvd.Max))(tf.constant(xb))
    C.equal(f"{mode}.allreduce.bool_max", got.numpy().tolist(), [True, True, False])
    got = wrap(lambda t: hvd.allreduce(t, op=hvd.Min))(tf.constant(xb))
    C.equal(f"{mode}.allreduce.bool_min", got.numpy().tolist(), [True, N == 1, False])
    # float16 / bfloat16, reduced in float32.
    for tf_dtype, np_dtype in ((tf.float16, np.float16), (tf.bfloat16, ml_dtypes.bfloat16)):
        got = wrap(lambda t: hvd.allreduce(t, op=hvd.Sum))(tf.constant(x, dtype=tf_dtype))
        C.equal(f"{mode}.allreduce.{tf_dtype.name}.dtype", got.dtype, tf_dtype)
        C.close(f"{mode}.allreduce.{tf_dtype.name}", tf.cast(got, tf.float32),
                np.sum(np.stack(xs), axis=0), rtol=1e-2)
    # Scaling and compression.
    got = wrap(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5,
                                       postscale_factor=3.0))(tf.constant(x))
    C.close(f"{mode}.allreduce.scaled", got, 1.5 * np.sum(np.stack(xs), axis=0))
    got = wrap(lambda t: hvd.allreduce(t, compression=hvd.Compression.fp16))(tf.constant(x))
    C.equal(f"{mode}.allreduce.fp16_compression.dtype", got.dtype, tf.float32)
    C.close(f"{mode}.allreduce.fp16_compression", got, np.mean(np.stack(xs), axis=0),
            rtol=1e-3)
    # Grouped allreduce of mixed dtypes.
    got = wrap(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum))(
        tf.constant(x), tf.constant(base((2,), R, np.int64)))
    C.close(f"{mode}.grouped_allreduce.0", got[0], np.sum(np.stack(xs), axis=0))
    C.close(f"{mode}.grouped_allreduce.1", got[1],
            np.sum(all_ranks((2,), np.int64), axis=0))
    # Allgather with a different first dimension per rank (rank r has r + 1 rows).
    got = wrap(lambda t: hvd.allgather(t))(tf.constant(base((R + 1, 2), R)))
    C.close(f"{mode}.allgather", got,
            np.concatenate([base((r + 1, 2), r) for r in range(N)]))
    # Broadcast from the last rank.
    root = N - 1
    got = wrap(lambda t: hvd.broadcast(t, root))(tf.constant(x))
    C.close(f"{mode}.broadcast", got, xs[root])
    # Alltoall with splits: rank r sends (r + d + 1) rows to rank d.
    splits = [R + d + 1 for d in range(N)]
    rows = base((sum(splits), 2), R)
    got, received_splits = wrap(lambda t, s: hvd.alltoall(t, splits=s))(
        tf.constant(rows), tf.constant(splits, dtype=tf.int32))
    want = []
    for src in range(N):
        src_splits = [src + d + 1 for d in range(N)]
        start = sum(src_splits[:R])
        want.append(base((sum(src_splits), 2), src)[start:start + src_splits[R]])
    C.close(f"{mode}.alltoall", got, np.concatenate(want))
    C.equal(f"{mode}.alltoall.splits", received_splits.numpy().tolist(),
            [src + R + 1 for src in range(N)])
    # Reducescatter with uneven rows: 2N + 1 rows.
    y = base((2 * N + 1, 3), R)
    got = wrap(lambda t: hvd.reducescatter(t, op=hvd.Sum))(tf.constant(y))
    total = np.sum(all_ranks((2 * N + 1, 3)), axis=0)
    counts = [(2 * N + 1) // N + (1 if r < (2 * N + 1) % N else 0) for r in range(N)]
    start = sum(counts[:R])
    C.close(f"{mode}.reducescatter", got, total[start:start + counts[R]])
    # IndexedSlices: allgathered values and indices, averaged.
    slices = tf.IndexedSlices(tf.constant(base((2, 3), R)), tf.constant([R, R + 1]),
                              dense_shape=tf.constant([N + 1, 3]))
    got = wrap(lambda v, i: tf.convert_to_tensor(hvd.allreduce(
        tf.IndexedSlices(v, i, dense_shape=tf.constant([N + 1, 3])))))(
        slices.values, slices.indices)
    dense = np.zeros((N + 1, 3))
    for r in range(N):
        dense[r:r + 2] += base((2, 3), r) / N
    C.close(f"{mode}.allreduce.indexed_slices", got, dense)
    # Barrier and join.
    wrap(lambda: hvd.barrier())()
    got = wrap(lambda: hvd.join())()
    C.true(f"{mode}.join", 0 <= int(got) < N, str(got))


def check_variables_and_objects():
    v = tf.Variable(base((4,), R))
    w = tf.Variable(base((2, 2), R, np.float64))
    hvd.broadcast_variables([v, w], root_rank=0)
    C.close("broadcast_variables.0", v.numpy(), base((4,), 0))
    C.close("broadcast_variables.1", w.numpy(), base((2, 2), 0, np.float64))
    u = tf.Variable(base((3,), R))
    tf.function(lambda: hvd.broadcast_variables([u], root_rank=N - 1))()
    C.close("broadcast_variables.graph", u.numpy(), base((3,), N - 1))
    C.equal("broadcast_object", hvd.broadcast_object({"from": R, "l": [R] * 3}, N - 1),
            {"from": N - 1, "l": [N - 1] * 3})
    C.equal("allgather_object", hvd.allgather_object(("r", R)),
            [("r", r) for r in range(N)])


def check_gradients(mode):
    wrap = MODES[mode]
    scale = float(R + 1)
    total_scale = sum(r + 1 for r in range(N))

    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            a = tf.reduce_sum(hvd.allreduce(x * scale, op=hvd.Sum) * 2.0)
            b = tf.reduce_sum(hvd.allreduce(x * scale, op=hvd.Average))
            c = tf.reduce_sum(hvd.allgather(x[None, :] * scale) * 3.0)
            d = tf.reduce_sum(hvd.broadcast(x * scale, 0) * 5.0)
            e = tf.reduce_sum(hvd.grouped_allreduce([x * scale], op=hvd.Sum)[0])
        return [tape.gradient(t, x) for t in (a, b, c, d, e)]

    x = tf.constant([1.0, 2.0, 3.0])
    ga, gb, gc, gd, ge = wrap(grads)(x)
    ones = np.ones(3)
    # allreduce(Sum): d/dx_r = scale_r * sum over ranks of the upstream gradient.
    C.close(f"{mode}.grad.allreduce_sum", ga, ones * 2.0 * N * scale)
    C.close(f"{mode}.grad.allreduce_average", gb, ones * scale)
    # allgather (Horovod's): this rank's rows of the gradient averaged over ranks.
    C.close(f"{mode}.grad.allgather", gc, ones * 3.0 * scale)
    # broadcast (Horovod's): the averaged gradient on the root, zeros elsewhere.
    C.close(f"{mode}.grad.broadcast", gd, ones * 5.0 * scale * (R == 0))
    C.close(f"{mode}.grad.grouped_allreduce", ge, ones * N * scale)
    del total_scale


def check_tape_training(mode):
    """10 SGD steps, batch B per rank == one process with batch N * B."""
    rng = np.random.default_rng(42)
    B, steps = 4, 10
    X = rng.normal(size=(steps, N * B, 3)).astype(np.float32)
    Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    w0 = rng.normal(size=(3, 1)).astype(np.float32)
    emb0 = rng.normal(size=(5, 2)).astype(np.float32)
    ids = rng.integers(0, 5, size=(steps, N * B))

    def train(distributed):
        w = tf.Variable(w0)
        b = tf.Variable(tf.zeros([1]))
        emb = tf.Variable(emb0)  # gathered rows: IndexedSlices gradients
        opt_lr = 0.1

        def step(x, y, i):
            with tf.GradientTape() as tape:
                pred = x @ w + b + tf.reduce_sum(tf.gather(emb, i), axis=1, keepdims=True)
                loss = tf.reduce_mean((pred - y) ** 2)
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, [w, b, emb])
            for var, g in zip([w, b, emb], grads):
                var.assign_sub(opt_lr * tf.convert_to_tensor(g))
            return loss

        if mode == "graph":
            step = tf.function(step)
        for s in range(steps):
            if distributed:
                sl = slice(R * B, (R + 1) * B)
                step(X[s, sl], Y[s, sl], ids[s, sl])
            else:
                step(X[s], Y[s], ids[s])
        return [w.numpy(), b.numpy(), emb.numpy()]

    dist = train(True)
    ref = train(False)
    for i, (a, b) in enumerate(zip(dist, ref)):
        C.close(f"{mode}.tape_training.{i}", a, b, rtol=1e-4, atol=1e-5)
    C.true(f"{mode}.tape_training.moved", not np.allclose(dist[0], w0))


def check_mismatch():
    # Shapes differ across ranks: every rank must raise, eagerly and in a graph.
    x = tf.ones([R + 2])
    try:
        hvd.allreduce(x, name="mismatch.eager")
        C.true("mismatch.eager.raised", False)
    except hvd.HorovodInternalError as e:
        C.true("mismatch.eager.raised", isinstance(e, hvd.MismatchError), repr(e))
        C.values["eager_message"] = str(e)[:300]
    try:
        tf.function(lambda t: hvd.allreduce(t, name="mismatch.graph"))(x)
        C.true("mismatch.graph.raised", False)
    except tf.errors.OpError as e:
        C.true("mismatch.graph.raised", "mismatch" in str(e).lower(), str(e)[:300])
    # The core goes on after an error.
    got = hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum, name="after.mismatch")
    C.close("mismatch.recovered", got, [sum(range(N))])


for mode in MODES:
    C.run(f"{mode}.ops", lambda: check_ops(mode))
    C.run(f"{mode}.gradients", lambda: check_gradients(mode))
    C.run(f"{mode}.tape", lambda: check_tape_training(mode))
C.run("variables_objects", check_variables_and_objects)
C.run("mismatch", check_mismatch)
C.report(rank=R, size=N)
