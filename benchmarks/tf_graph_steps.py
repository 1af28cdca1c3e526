"""TF1-graph steps of one collective each: build a broadcast, run it with Session.run.

    .venv/bin/python -m hvdlite.runner -np 2 .venv/bin/python benchmarks/tf_graph_steps.py

The pattern of Horovod's own graph-mode tests (dtype x dims x root, one run per node):
each node is ordered after the earlier collective nodes of its graph through relays that
a run feeds when it does not need them (``hvdlite.tensorflow.execution._GraphOrder``), so
a run never reruns earlier steps. ``--baseline`` puts ``tf.identity`` in place
of the broadcast, to show what TF's own Session.run of a growing graph costs. Prints
rank 0's total and per-run seconds; on a shared machine run it a few times.
"""
import argparse
import time

import tensorflow as tf

import hvdlite.tensorflow as hvd


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", action="store_true", help="tf.identity, no collective")
    args = p.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    dtypes = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64,
              tf.bool, tf.int32, tf.float32]
    runs = 0
    start = time.perf_counter()
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        for dtype in dtypes:
            for dim in (1, 2, 3):
                for root in range(size):
                    value = tf.cast(tf.ones([17] * dim) * rank, dtype)
                    out = tf.identity(value) if args.baseline else hvd.broadcast(value, root)
                    session.run(out)
                    runs += 1
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"{'identity' if args.baseline else 'broadcast'}: {runs} runs on {size} "
              f"ranks, {elapsed:.1f} s, {elapsed / runs * 1000:.0f} ms per run", flush=True)


if __name__ == "__main__":
    main()
