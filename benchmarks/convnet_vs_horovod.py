"""A compute-bound convnet on 2 ranks: hvdlite against Horovod 0.28.1 on the same
TensorFlow, rounds rotated, with one plain TensorFlow process as the reference.

Horovod 0.28.1 builds against neither the project's torch 2.13 nor TensorFlow >= 2.16,
so the comparison runs on TensorFlow 2.13 in a venv of its own, where hvdlite runs
from this checkout unchanged (its core is framework-free):

    python3.11 -m venv /tmp/hvd && . /tmp/hvd/bin/activate
    pip install tensorflow-cpu==2.13.1 "numpy<2" "cmake<4" mpich==5.0.2 cffi ml_dtypes
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \\
      HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 pip install --no-build-isolation horovod==0.28.1
    /tmp/hvd/bin/python benchmarks/convnet_vs_horovod.py --rounds 3

(run from a checkout whose core is built: ``python setup.py build_native``). Horovod
starts with that venv's ``mpiexec -n 2`` (its ``horovodrun`` does not recognize the
mpich wheel's launcher), hvdlite with ``hvdliterun -np 2``. The model: a ResNet-style
network of 2.8M parameters (a stem and six residual blocks of 64-256 channels, batch
norm) on 32x32x3 synthetic images, batch 16 per rank, SGD through
``DistributedGradientTape`` in a ``tf.function``, one intra- and one inter-op thread
per rank; only the ``import ... as hvd`` line differs. After the warm-up each rank
checks that the weights agree. Each run prints images/s (both ranks together) and the
CPU seconds other processes took meanwhile (a run with more than a second of it was
disturbed: rerun on a quiet machine); the end prints every run, the medians, ranges and
the ratio.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from rounds import rotated

HERE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.worker == "horovod":
        import horovod.tensorflow as hvd
    elif args.worker == "hvdlite":
        import hvdlite.tensorflow as hvd
    else:
        hvd = None
    if hvd is not None:
        hvd.init()
    rank, size = (hvd.rank(), hvd.size()) if hvd else (0, 1)
    tf.random.set_seed(1234 + rank)  # each rank's own start: the broadcast must fix it
    layers = tf.keras.layers

    def conv_bn(x, channels, stride=1):
        x = layers.Conv2D(channels, 3, strides=stride, padding="same", use_bias=False)(x)
        return layers.BatchNormalization()(x)

    def block(x, channels, stride=1):
        y = conv_bn(layers.ReLU()(conv_bn(x, channels, stride)), channels)
        if stride != 1 or x.shape[-1] != channels:
            x = layers.BatchNormalization()(
                layers.Conv2D(channels, 1, strides=stride, use_bias=False)(x))
        return layers.ReLU()(y + x)

    inputs = tf.keras.Input((32, 32, 3))
    x = layers.ReLU()(conv_bn(inputs, 64))
    for channels, stride in ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1)):
        x = block(x, channels, stride)
    model = tf.keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))
    opt = tf.keras.optimizers.SGD(learning_rate=0.01 * size)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank)
    images = tf.constant(rng.standard_normal((args.batch, 32, 32, 3), dtype=np.float32))
    labels = tf.constant(rng.integers(0, 10, args.batch), dtype=tf.int64)
    if hvd is not None:
        hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        if hvd is not None:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(args.warmup):
        step().numpy()
    if hvd is not None:
        w = model.trainable_variables[0]
        same = np.array_equal(hvd.allreduce(w, op=hvd.Max, name="check.max").numpy(),
                              hvd.allreduce(w, op=hvd.Min, name="check.min").numpy())
        assert same, "the ranks' weights differ after the warm-up"
        hvd.allreduce(tf.constant(0.0), name="start").numpy()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    loss.numpy()
    elapsed = time.perf_counter() - start
    if hvd is not None:  # the slowest rank's time
        elapsed = float(hvd.allreduce(tf.constant(elapsed, tf.float64), op=hvd.Max,
                                      name="elapsed").numpy())
    if rank == 0:
        print(f"IMAGES_PER_S {size * args.steps * args.batch / elapsed:.2f}", flush=True)


def busy_seconds():
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run(args, system):
    """(images/s, CPU seconds of other processes) of one run, or (None, ...) if it failed."""
    python = args.python or sys.executable
    me = [python, HERE, "--worker", system, "--steps", str(args.steps), "--batch",
          str(args.batch), "--warmup", str(args.warmup)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    if system == "horovod":
        cmd = [os.path.join(os.path.dirname(python), "mpiexec"), "-n", "2", *me]
    elif system == "hvdlite":
        cmd = [python, "-m", "hvdlite.runner", "-np", "2", *me]
    else:
        cmd = me
    before_busy, before = busy_seconds(), os.times()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    after = os.times()
    ours = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    foreign = busy_seconds() - before_busy - ours
    found = re.search(r"IMAGES_PER_S ([\d.]+)", done.stdout)
    if not found:
        sys.stderr.write(f"{system} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}\n")
        return None, foreign
    return float(found.group(1)), foreign


def driver(args):
    print(f"2 ranks on this machine, {args.steps} steps of batch {args.batch} per rank after "
          f"{args.warmup} warm-up steps; images/s of both ranks together", flush=True)
    figures = {"horovod": [], "hvdlite": [], "none": []}
    plan = [["none"]] + [rotated(["horovod", "hvdlite"], r) for r in range(args.rounds)] + [["none"]]
    for n, systems in enumerate(plan):
        for system in systems:
            rate, foreign = run(args, system)
            label = "plain TF, 1 process" if system == "none" else system
            shown = "FAILED" if rate is None else f"{rate:8.2f} images/s"
            print(f"  run {n}: {label:20s} {shown}   (other processes' CPU {foreign:.1f} s)", flush=True)
            if rate is not None:
                figures[system].append(rate)
    for system, values in figures.items():
        if values:
            print(f"{system:8s} median {statistics.median(values):.2f}, range "
                  f"{min(values):.2f}-{max(values):.2f}, runs {' '.join(f'{v:.2f}' for v in values)}")
    if figures["horovod"] and figures["hvdlite"]:
        ratio = statistics.median(figures["hvdlite"]) / statistics.median(figures["horovod"])
        print(f"hvdlite / Horovod (medians): {ratio:.3f}; each round: " +
              " ".join(f"{a / b:.3f}" for a, b in zip(figures["hvdlite"], figures["horovod"])))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--batch", type=int, default=16, help="per rank")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--python", help="the interpreter with TensorFlow and Horovod (default: this one)")
    p.add_argument("--worker", choices=["horovod", "hvdlite", "none"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
