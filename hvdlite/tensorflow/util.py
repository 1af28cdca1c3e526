"""Horovod's ``horovod.tensorflow.util`` helpers that test suites and scripts import."""
import tensorflow as tf


def _executing_eagerly():
    """Returns True when TF executes eagerly (Horovod's helper of this name)."""
    return tf.executing_eagerly()
