"""Shared by the TensorFlow/Keras rank scripts: quiet single-threaded frameworks, checks."""
import json
import os
import traceback

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def single_threaded_tensorflow():
    """One intra-op and one inter-op thread per rank (the test machine has few cores).

    A script run after another one in the same process (test_tensorflow_parity.py's job)
    keeps the threads TensorFlow started with: they cannot change once it has run."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass


class Checks:
    """Collects named checks; ``report()`` prints one HVDLITE_RESULT line."""

    def __init__(self):
        self.count = 0
        self.failures = {}
        self.values = {}

    def close(self, name, got, want, rtol=1e-6, atol=1e-6):
        self.count += 1
        got = np.asarray(got, dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
            self.failures[name] = f"got {got.tolist()} want {want.tolist()}"

    def equal(self, name, got, want):
        self.count += 1
        if got != want:
            self.failures[name] = f"got {got!r} want {want!r}"

    def true(self, name, cond, detail=""):
        self.count += 1
        if not cond:
            self.failures[name] = f"false {detail}"

    def run(self, name, fn):
        """Runs a block of checks; an exception fails it with its traceback."""
        try:
            fn()
        except Exception:
            self.count += 1
            self.failures[name] = traceback.format_exc()[-2000:]

    def report(self, **extra):
        print("HVDLITE_RESULT", json.dumps({"checks": self.count, "failures": self.failures,
                                            "values": self.values, **extra}), flush=True)
