"""Horovod's TensorFlow semantics, checked in a TF1 graph (Session.run) and eagerly.

Each block runs first in a fresh ``tf.Graph`` evaluated by a ``tf.compat.v1.Session``
(where collective nodes run on TF's thread pool, with no automatic control
dependencies) and then eagerly, as Horovod's own suite runs its tests. Expected values
come from numpy, from rank and size. Every block is one check; an exception (or a wrong
value) fails it, and the job goes on with the next block, so one failure must not leave
the ranks out of step. Prints one HVDLITE_RESULT line.
"""
import numpy as np
import tensorflow as tf
from common import Checks

import hvdlite.tensorflow as hvd

tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
C = Checks()


def in_both_modes(name, body):
    """Runs ``body(evaluate)`` in a TF1 graph, then eagerly."""
    def graph():
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            body(session.run)
        C.count += 1

    def eager():
        body(lambda t: tf.nest.map_structure(np.asarray, t))
        C.count += 1

    C.run(f"graph.{name}", graph)
    C.run(f"eager.{name}", eager)


def check_close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=1e-6):
        raise AssertionError(f"{what}: got {got.tolist()} want {want.tolist()}")


def base(shape, rank, salt=0):
    """The values rank ``rank`` contributes: distinct per rank and position."""
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float64).reshape(shape) + 100 * rank + salt) % 97


def fused_allreduce(evaluate):
    # 15 unnamed allreduces evaluated by one run: the nodes may start in any order.
    dtypes = [tf.int32, tf.int64, tf.float16, tf.float32, tf.float64]
    outs, wants = [], []
    for i, dtype in enumerate(dtypes * 3):
        shape = [5] * (1 + i % 3)
        outs.append(hvd.allreduce(tf.constant(base(shape, R, i), dtype), op=hvd.Sum))
        wants.append(sum(base(shape, r, i) for r in range(N)))
    for i, (got, want) in enumerate(zip(evaluate(outs), wants)):
        check_close(got, want, f"allreduce {i}")


def allgather_grad(evaluate):
    rows = [3, 2, 7, 4][:N]
    for dtype in (tf.float32, tf.float64):
        x = tf.Variable(tf.constant(base([rows[R], 4], R), dtype))
        dy = tf.constant(np.concatenate([base([rows[r], 4], r, 1) for r in range(N)]), dtype)
        if tf.executing_eagerly():
            with tf.GradientTape() as tape:
                y = hvd.allgather(tf.identity(x))
            grad = tape.gradient(y, x, dy)
        else:
            evaluate(x.initializer)
            grad = tf.gradients(hvd.allgather(tf.identity(x)), x, dy)[0]
        # Horovod's gradient: the average over ranks of dy (the same dy everywhere),
        # this rank's rows.
        start = sum(rows[:R])
        check_close(evaluate(grad), np.concatenate(
            [base([rows[r], 4], r, 1) for r in range(N)])[start:start + rows[R]], dtype)


def broadcast_grad(evaluate):
    for root in range(N):
        x = tf.constant(base([3, 2], R))
        dy = tf.constant(base([3, 2], R, 5))  # differs per rank: averaged
        if tf.executing_eagerly():
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = hvd.broadcast(x, root)
            grad = tape.gradient(y, x, dy)
        else:
            grad = tf.gradients(hvd.broadcast(x, root), x, dy)[0]
        want = sum(base([3, 2], r, 5) for r in range(N)) / N * (R == root)
        check_close(evaluate(grad), want, f"root {root}")


def sparse_and_mixed(evaluate):
    # Two IndexedSlices and a dense tensor in one grouped allreduce (Average).
    def slices(rank, k):
        return tf.IndexedSlices(tf.constant(base([rank + 1, 3], rank, k)),
                                tf.constant(np.arange(rank + 1) + k, tf.int64),
                                dense_shape=tf.constant([8, 3], tf.int64))

    out = hvd.grouped_allreduce([slices(R, 0), tf.constant(base([4], R)), slices(R, 2)])
    got = evaluate([out[0].values, out[0].indices, out[1], out[2].values, out[2].indices])
    for k, (values, indices) in zip((0, 2), ((got[0], got[1]), (got[3], got[4]))):
        check_close(values, np.concatenate([base([r + 1, 3], r, k) for r in range(N)]) / N,
                    f"values {k}")
        check_close(indices, np.concatenate([np.arange(r + 1) + k for r in range(N)]),
                    f"indices {k}")
    check_close(got[2], sum(base([4], r) for r in range(N)) / N, "dense")
    # Integer values: Horovod's Average divides (a float result), no refusal.
    ints = tf.IndexedSlices(tf.constant([[R + 1]], tf.int32), tf.constant([R]),
                            dense_shape=tf.constant([N, 1]))
    averaged = evaluate(hvd.allreduce(ints).values)
    check_close(averaged, np.arange(1, N + 1).reshape(N, 1) / N, "int values")


def mixed_gradients(evaluate):
    # A model with an embedding (IndexedSlices gradient) and a dense weight, trained
    # through DistributedGradientTape (eager, tf.function) or tf.gradients (graph).
    emb0, w0 = base([6, 2], 0), base([2, 1], 0, 3) / 97
    ids = np.array([R % 6, (R + 2) % 6, 5])
    emb, w = tf.Variable(emb0), tf.Variable(w0)

    def loss():
        return tf.reduce_sum(tf.matmul(tf.gather(emb, ids), w))

    if tf.executing_eagerly():
        def step():
            with tf.GradientTape() as tape:
                value = loss()
            return hvd.DistributedGradientTape(tape).gradient(value, [emb, w])

        results = [step(), tf.function(step)()]
    else:
        evaluate([emb.initializer, w.initializer])
        results = [hvd.grouped_allreduce(tf.gradients(loss(), [emb, w]))]
    want_emb = np.zeros_like(emb0)
    want_w = np.zeros_like(w0)
    for r in range(N):
        rows = [r % 6, (r + 2) % 6, 5]
        for row in rows:
            want_emb[row] += w0[:, 0] / N
        want_w[:, 0] += emb0[rows].sum(axis=0) / N
    for g_emb, g_w in results:
        check_close(evaluate(tf.convert_to_tensor(g_emb)), want_emb, "embedding")
        check_close(evaluate(g_w), want_w, "dense")


def alltoall_even_split(evaluate):
    # Rank r sends r+1 rows to every rank, without splits: each rank's first dimension
    # is split evenly, ranks differing; only the received tensor comes back.
    for dtype in (tf.int32, tf.float32):
        rows = [[d] * (R + 1) for d in range(N)]
        tensor = tf.constant(np.concatenate(rows), dtype)
        got = evaluate(hvd.alltoall(tensor))
        check_close(got, np.full(N * (N + 1) // 2, R), dtype)


def alltoall_grad(evaluate):
    x = tf.constant(base([N * (R + 1), 2], R))
    splits = tf.constant([R + 1] * N, tf.int32)
    dy_rows = sum(r + 1 for r in range(N))
    dy = tf.constant(base([dy_rows, 2], R, 7))
    if tf.executing_eagerly():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, _ = hvd.alltoall(x, splits)
        grad = tape.gradient(y, x, dy)
    else:
        y, _ = hvd.alltoall(x, splits)
        grad = tf.gradients(y, x, dy)[0]
    # The gradient goes back along the splits: block d of rank R's input went to rank
    # d, where it is received as rank d's block R (R + 1 rows after sum(r + 1, r < R)).
    want = []
    for d in range(N):
        dy_d = base([dy_rows, 2], d, 7)
        start = sum(r + 1 for r in range(R))
        want.append(dy_d[start:start + R + 1])
    check_close(evaluate(grad), np.concatenate(want), "alltoall grad")


def grouped_allgather_reducescatter(evaluate):
    shapes = [[R + 1, 3], [2, 2]]
    gathered = evaluate(hvd.grouped_allgather(
        [tf.constant(base(s, R, i)) for i, s in enumerate(shapes)]))
    for i in range(2):
        want = np.concatenate([base([r + 1, 3] if i == 0 else [2, 2], r, i)
                               for r in range(N)])
        check_close(gathered[i], want, f"allgather {i}")
    full = [[2 * N + 1, 2], [N, 3]]
    for op, div in ((hvd.Sum, 1), (hvd.Average, N)):
        got = evaluate(hvd.grouped_reducescatter(
            [tf.constant(base(s, R, i)) for i, s in enumerate(full)], op=op))
        for i, s in enumerate(full):
            total = sum(base(s, r, i) for r in range(N)) / div
            extra = s[0] % N
            start = sum(s[0] // N + (r < extra) for r in range(R))
            check_close(got[i], total[start:start + s[0] // N + (R < extra)], f"rs {i}")


def reducescatter_grad(evaluate):
    # Horovod's gradient: allgather of dy, times size() for Sum.
    for op, factor in ((hvd.Sum, N), (hvd.Average, 1)):
        x = tf.constant(base([N, 2], R))
        dy = tf.constant(base([1, 2], R, 9))
        if tf.executing_eagerly():
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = hvd.reducescatter(x, op=op)
            grad = tape.gradient(y, x, dy)
        else:
            grad = tf.gradients(hvd.reducescatter(x, op=op), x, dy)[0]
        want = np.concatenate([base([1, 2], r, 9) for r in range(N)]) * factor
        check_close(evaluate(grad), want, op)


def expect(error_class, fn, what):
    try:
        fn()
    except error_class as e:
        return e
    except Exception as e:  # the wrong class: say which
        raise AssertionError(f"{what}: raised {type(e).__mro__[:3]}, not "
                             f"{error_class.__name__}: {e}") from None
    raise AssertionError(f"{what}: nothing raised")


def mismatches(evaluate):
    precondition = tf.errors.FailedPreconditionError
    e = expect(precondition, lambda: evaluate(hvd.allreduce(tf.ones([17 + R, 2]))), "shape")
    assert f"{17 + N - 1}" in str(e) and "17" in str(e) and "rank 1" in str(e), str(e)
    if tf.executing_eagerly():  # also the hvdlite class (a graph raises TF's own)
        assert isinstance(e, hvd.MismatchError), type(e).__mro__
    expect(precondition, lambda: evaluate(
        hvd.allreduce(tf.ones([3], tf.int32 if R % 2 == 0 else tf.float32))), "dtype")
    expect(precondition, lambda: evaluate(hvd.allgather(tf.ones([2, R + 1]))), "allgather")
    expect(precondition, lambda: evaluate(hvd.broadcast(tf.ones([3]), R)), "root")
    expect(precondition, lambda: evaluate(
        hvd.alltoall(tf.ones([N], tf.int32 if R % 2 else tf.float32))), "alltoall dtype")
    expect(tf.errors.InvalidArgumentError,
           lambda: evaluate(hvd.alltoall(tf.ones([N + 1]))), "alltoall length")
    expect(tf.errors.InvalidArgumentError,
           lambda: evaluate(hvd.alltoall(tf.ones([N]), splits=[N + 1] + [0] * (N - 1))),
           "alltoall splits")
    # The job goes on: the next collective agrees.
    check_close(evaluate(hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum)),
                [N * (N - 1) / 2], "after the errors")


def broadcast_in_place(evaluate):
    v = tf.Variable(base([2, 2], R))
    if not tf.executing_eagerly():
        evaluate(v.initializer)
    values = hvd.broadcast_(
        [v], root_rank=N - 1)
    check_close(evaluate(values[0]), base([2, 2], N - 1), "returned")
    check_close(evaluate(v.read_value()), base([2, 2], N - 1), "assigned")


def process_tensors(evaluate):
    got = evaluate([hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(),
                    hvd.local_size_op(), hvd.process_set_included_op()])
    assert [int(g) for g in got] == [R, N, hvd.local_rank(), hvd.local_size(), 1], got


def global_variables(evaluate):
    if tf.executing_eagerly():  # TF2 keeps no global variables: Horovod refuses
        expect(RuntimeError, lambda: hvd.broadcast_global_variables(0), "eager")
        return
    v = tf.compat.v1.get_variable("v", initializer=tf.constant(base([3], R)))
    hook = hvd.BroadcastGlobalVariablesHook(N - 1)
    hook.begin()
    evaluate(tf.compat.v1.global_variables_initializer())
    hook.after_create_session(tf.compat.v1.get_default_session(), None)
    check_close(evaluate(v.read_value()), base([3], N - 1), "hook")


ALLGATHER_DTYPES = [tf.uint16, tf.bool, tf.int8, tf.uint8, tf.int32, tf.int64, tf.float16,
                    tf.bfloat16, tf.float32, tf.float64]


def incremental_graph(evaluate):
    """Collectives built and run a few at a time, then all in one run: 30 allgathers
    (10 dtypes, 1-3 dims, 17 rows a rank), a fed allreduce, TF1 sessions with 1 and 2
    inter-op threads. The run of them all must not hang (each node blocks a TF thread),
    and a run of a new node must not rerun an old one (it would ask for its feed)."""
    if tf.executing_eagerly():
        return incremental_steps(lambda fetches, feeds=None: tf.nest.map_structure(
            np.asarray, fetches), lambda value: (tf.constant(value), {}))
    for threads in (1, 2):
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads,
                                          intra_op_parallelism_threads=1)
        with tf.Graph().as_default(), tf.compat.v1.Session(config=config) as session:
            def fed(value):
                placeholder = tf.compat.v1.placeholder(tf.float32, value.shape)
                return placeholder, {placeholder: value}
            incremental_steps(lambda fetches, feeds=None: session.run(fetches, feeds), fed)
    with tf.Graph().as_default():
        hook_after_a_model()


def hook_after_a_model():
    """Horovod's TF1 pattern: a model fed by a placeholder, its DistributedOptimizer, then
    BroadcastGlobalVariablesHook (its broadcast built after the gradients' allreduces)
    in a MonitoredTrainingSession: the broadcast runs alone, not the training step."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    w = tf.compat.v1.get_variable("w", initializer=tf.constant(base([3, 1], R)))
    loss = tf.reduce_sum(tf.matmul(x, tf.cast(w, tf.float32)))
    train = hvd.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5)).minimize(loss)
    rows = np.arange(6, dtype=np.float32).reshape(2, 3) + R
    with tf.compat.v1.train.MonitoredTrainingSession(
            hooks=[hvd.BroadcastGlobalVariablesHook(N - 1)]) as session:
        check_close(session.run(w), base([3, 1], N - 1), "broadcast by the hook")
        session.run(train, {x: rows})
        # d loss / d w = the column sums of x, averaged over ranks
        grad = np.mean([(np.arange(6).reshape(2, 3) + r).sum(0) for r in range(N)], 0)
        check_close(session.run(w), base([3, 1], N - 1) - 0.5 * grad[:, None], "one step")


def incremental_steps(run, fed):
    def contribution(i, rank):
        shape = [17] + [2] * (i % 3)
        value = base(shape, rank, i)
        return value % 2 if ALLGATHER_DTYPES[i % 10] == tf.bool else value

    gathers, wants = [], []
    for i in range(30):
        dtype = ALLGATHER_DTYPES[i % 10]
        gathers.append(hvd.allgather(tf.constant(contribution(i, R).astype(dtype.as_numpy_dtype))))
        wants.append(np.concatenate([contribution(i, r) for r in range(N)]))
        if i == 0 or i >= 10:  # the first alone, 10 more unrun, then one by one
            check_close(run(gathers[-1]), wants[-1], f"allgather {i} alone")
    value = base([4], R, 7).astype(np.float32)
    placeholder, feeds = fed(value)
    summed = hvd.allreduce(placeholder, op=hvd.Sum, name="incremental.fed")
    want_sum = sum(base([4], r, 7) for r in range(N))
    check_close(run(summed, feeds), want_sum, "fed allreduce")
    picked = run([gathers[3], gathers[17], gathers[29]])  # unrun nodes between them
    for i, g in zip((3, 17, 29), picked):
        check_close(g, wants[i], f"allgather {i} of three")
    later = hvd.broadcast(tf.constant(base([3], R, 8)), N - 1, name="incremental.later")
    check_close(run(later), base([3], N - 1, 8), "a new node alone (no feed for the old)")
    got = run(gathers + [summed, later], feeds)
    for i, (g, want) in enumerate(zip(got[:30], wants)):
        check_close(g, want, f"allgather {i} with all")
    check_close(got[30], want_sum, "fed allreduce with all")
    check_close(got[31], base([3], N - 1, 8), "broadcast with all")


for name, body in [("global_variables", global_variables), ("fused_allreduce", fused_allreduce), ("allgather_grad", allgather_grad),
                   ("broadcast_grad", broadcast_grad), ("sparse", sparse_and_mixed),
                   ("mixed_gradients", mixed_gradients),
                   ("alltoall_even_split", alltoall_even_split),
                   ("alltoall_grad", alltoall_grad),
                   ("grouped_gather_scatter", grouped_allgather_reducescatter),
                   ("reducescatter_grad", reducescatter_grad),
                   ("mismatch", mismatches), ("broadcast_", broadcast_in_place),
                   ("process_tensors", process_tensors),
                   ("incremental_graph", incremental_graph)]:
    in_both_modes(name, body)

C.report()
hvd.shutdown()
