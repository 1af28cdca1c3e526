"""TensorFlow 2 custom training loop with hvdlite.tensorflow.DistributedGradientTape.

    hvdliterun -np 2 python examples/tensorflow2_gradient_tape.py

A softmax regression on scikit-learn's digits: each rank takes its shard, the tape
averages the gradients of one step across ranks (in one fused group), and the
variables start from rank 0's values (broadcast_variables after the first step,
Horovod-style, so that the optimizer's slots exist).
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1, help="single-rank rate")
    args = parser.parse_args()

    hvd.init()
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)[hvd.rank()::hvd.size()]
    y = digits.target.astype(np.int64)[hvd.rank()::hvd.size()]
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
               .shuffle(1000, seed=hvd.rank()).batch(args.batch_size))

    tf.random.set_seed(hvd.rank())
    w = tf.Variable(tf.random.normal([64, 10], stddev=0.1), name="w")
    b = tf.Variable(tf.zeros([10]), name="b")
    variables = [w, b]
    optimizer = tf.keras.optimizers.SGD(args.lr * hvd.size())

    @tf.function
    def train_step(images, labels, first):
        with tf.GradientTape() as tape:
            logits = images @ w + b
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        if first:
            hvd.broadcast_variables(variables + list(optimizer.variables), root_rank=0)
        return loss

    for step, (images, labels) in enumerate(dataset.take(args.steps)):
        loss = train_step(images, labels, step == 0)
        if step % 50 == 0:
            mean_loss = hvd.allreduce(loss, name="loss")
            if hvd.rank() == 0:
                print(f"step {step}: loss {float(mean_loss):.4f}")

    logits = (digits.data / 16.0).astype(np.float32) @ w.numpy() + b.numpy()
    accuracy = float(np.mean(np.argmax(logits, axis=1) == digits.target))
    if hvd.rank() == 0:
        print(f"accuracy on all of digits: {accuracy:.4f}")


if __name__ == "__main__":
    main()
