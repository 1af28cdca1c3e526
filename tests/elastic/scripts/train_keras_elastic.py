"""An elastic Keras/TensorFlow training job that records what the tests check (probe.py),
and dies where told.

    train_keras_elastic.py LOG_DIR [--mode fit|tape] [--kill WORLD:RANK:STEP:WHERE ...]
                           [--grow-file F --grow-at S]

``fit``: ``model.fit`` with the elastic callbacks (epoch, batch, commit every batch);
``tape``: a GradientTape loop with ``TensorFlowKerasState`` and a commit per step.
Every epoch has the same number of steps whatever the world's size: step ``k`` of
epoch ``e`` trains on samples ``k*G .. (k+1)*G`` of the epoch's order, split evenly over
the world's ranks, so one process on the whole global batch would make the same update.
WHERE, besides probe's, is ``allreduce``: at the start of the step, so the others wait
for this rank's gradients when it dies.
"""
import argparse
import hashlib
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

import hvdlite.tensorflow as hvd_tf
import hvdlite.tensorflow.keras as hvd
from probe import Probe

parser = argparse.ArgumentParser()
parser.add_argument("log_dir")
parser.add_argument("--mode", choices=["fit", "tape"], default="fit")
parser.add_argument("--kill", action="append", default=[])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=36)
parser.add_argument("--global-batch", type=int, default=6)
parser.add_argument("--grow-file", help="write this file (the discovery script's input) ...")
parser.add_argument("--grow-at", type=int, default=-1, help="... at this step on rank 0")
parser.add_argument("--grow-hosts", default="localhost:3")
args = parser.parse_args()

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
RANK = hvd.rank()
probe = Probe(args.log_dir, args.kill, RANK)
G = args.global_batch
STEPS = args.samples // G          # steps per epoch, in every world
assert G % hvd.size() == 0, "the global batch must split evenly over the world"

data = np.random.default_rng(7).normal(size=(args.samples, 8)).astype(np.float32)
target = (data.sum(axis=1) > 0).astype(np.int32)


def indices(epoch, batch):
    """This rank's samples of step ``batch`` of ``epoch`` in the current world."""
    order = np.random.default_rng(100 + epoch).permutation(args.samples)
    share = G // hvd.size()
    return order[batch * G:(batch + 1) * G][RANK * share:(RANK + 1) * share].tolist()


keras.utils.set_random_seed(1234 + RANK)  # different on each rank: the first sync must fix it
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(2)])
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
if args.mode == "fit":
    elastic = hvd.elastic
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=optimizer, loss=loss_fn, jit_compile=False)
    state = elastic.KerasState(model, epoch=0, batch=0)
else:  # the tape averages the gradients; the optimizer is plain
    elastic = hvd_tf.elastic
    optimizer = keras.optimizers.Adam(0.01)
    state = elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


def digest():
    h = hashlib.sha256()
    for group, variables in (("model", model.variables), ("optimizer", optimizer.variables)):
        for i, v in enumerate(variables):
            h.update(f"{group}.{i}.{v.path}".encode())
            h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


def step_of(state):
    return state.epoch * STEPS + state.batch


probe.install(step_of, digest)


def trained(batch_index):
    """Records the step just trained; grows the host list where told."""
    step = state.epoch * STEPS + batch_index
    probe.log("trained", step=step, epoch=state.epoch, indices=indices(state.epoch, batch_index))
    if RANK == 0 and step + 1 == args.grow_at and args.grow_file and probe.gen == 0:
        with open(args.grow_file, "w") as f:
            f.write(args.grow_hosts + "\n")
        time.sleep(2.0)  # the driver reads the discovery script every second


class Recorder(keras.callbacks.Callback):
    """First in the list: sees ``state.batch`` before UpdateBatchStateCallback moves it."""

    def on_train_batch_begin(self, batch, logs=None):
        probe.step_now = step_of(state)
        probe.kill_here("allreduce", probe.step_now)

    def on_train_batch_end(self, batch, logs=None):
        trained(state.batch)


def remaining_data():
    """This rank's samples of every step not yet committed, in order."""
    rows = [i for epoch in range(state.epoch, args.epochs)
            for batch in range(state.batch if epoch == state.epoch else 0, STEPS)
            for i in indices(epoch, batch)]
    return data[rows], target[rows]


def fit_loop(state):
    x, y = remaining_data()
    callbacks = [Recorder(), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=1)]
    model.fit(x, y, batch_size=G // hvd.size(), shuffle=False, steps_per_epoch=STEPS,
              initial_epoch=state.epoch, epochs=args.epochs, callbacks=callbacks, verbose=0)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd_tf.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)


def tape_loop(state):
    while state.epoch < args.epochs:
        while state.batch < STEPS:
            probe.step_now = step_of(state)
            probe.kill_here("allreduce", probe.step_now)
            rows = indices(state.epoch, state.batch)
            train_step(tf.constant(data[rows]), tf.constant(target[rows]))
            trained(state.batch)
            state.batch += 1
            if state.batch < STEPS:
                state.commit()
        state.epoch, state.batch = state.epoch + 1, 0
        state.commit()


@elastic.run
def train(state):
    probe.log("start", size=hvd.size(), step=step_of(state), pid=os.getpid(),
              commit=state.commit_id, epoch=state.epoch, processed=state.batch * G,
              resets=list(resets), digest=digest(), time=time.time())
    (fit_loop if args.mode == "fit" else tape_loop)(state)
    return digest()


final = train(state)
probe.log("done", size=hvd.size(), step=step_of(state), digest=final)
print("HVDLITE_RESULT", json.dumps({"digest": final, "size": hvd.size()}), flush=True)
