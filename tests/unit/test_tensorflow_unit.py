"""hvdlite.tensorflow in one process (size 1): the copy paths of tensors.py and the ops.

The zero-copy claims of ``hvdlite/tensorflow/tensors.py`` are checked here by looking
at the memory the arrays and tensors share.
"""
import numpy as np
import pytest

import needs

tf = needs.import_or_skip("tensorflow")


@pytest.fixture(scope="module")
def hvd_tf(hvd):
    import hvdlite.tensorflow as hvd_tf

    return hvd_tf


def test_host_array_of_an_eager_tensor_is_zero_copy():
    from hvdlite.tensorflow import tensors

    t = tf.constant(np.arange(1000, dtype=np.float32))
    assert np.shares_memory(tensors.host_array(t), np.asarray(t))
    assert not np.shares_memory(t.numpy(), np.asarray(t))  # why numpy() is not used


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32",
                                   "int64", "uint8", "int8", "bool"])
def test_aligned_results_become_tensors_without_a_copy(dtype):
    from hvdlite import dtypes
    from hvdlite.tensorflow import tensors

    arr = tensors.empty_aligned((3, 5), dtypes.numpy_dtype(dtype))
    assert arr.ctypes.data % tensors.ALIGNMENT == 0
    arr[...] = np.arange(15).reshape(3, 5) % 2
    t = tensors.to_tensor(arr)
    assert t.dtype.name == dtype
    assert np.shares_memory(np.asarray(t), arr)
    np.testing.assert_array_equal(np.asarray(t).astype(np.float64), arr.astype(np.float64))


def test_unaligned_results_are_copied():
    from hvdlite.tensorflow import tensors

    raw = np.zeros(400 + tensors.ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % tensors.ALIGNMENT + 4
    arr = raw[offset:offset + 400].view(np.float32)
    arr[:] = 1.0
    t = tensors.to_tensor(arr)
    assert not np.shares_memory(np.asarray(t), arr)
    assert float(tf.reduce_sum(t)) == 100.0  # TF would abort on an unaligned buffer


def test_ops_eagerly_and_in_a_graph_at_size_one(hvd_tf):
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    for fn in (lambda t: hvd_tf.allreduce(t), tf.function(lambda t: hvd_tf.allreduce(t))):
        np.testing.assert_allclose(fn(x), x)
    np.testing.assert_allclose(tf.function(lambda t: hvd_tf.allgather(t))(x), x)
    np.testing.assert_allclose(hvd_tf.broadcast(x, 0), x)


def test_bad_arguments_are_refused_at_the_call_and_when_tracing(hvd_tf):
    with pytest.raises(hvd_tf.InvalidArgumentError, match="unsupported dtype"):
        hvd_tf.allreduce(tf.constant([1, 2], dtype=tf.uint32))
    # While tracing, autograph re-raises it as a StagingError carrying the message.
    with pytest.raises(Exception, match="unsupported dtype"):
        tf.function(lambda t: hvd_tf.allreduce(t))(tf.constant(["a"]))
    with pytest.raises(hvd_tf.InvalidArgumentError, match="bool"):
        hvd_tf.allreduce(tf.constant([True]), op=hvd_tf.Sum)
    with pytest.raises(hvd_tf.InvalidArgumentError, match="root_rank"):
        hvd_tf.broadcast(tf.constant([1.0]), 3)


def test_fp16_compression_round_trip(hvd_tf):
    x = tf.constant([1.5, -2.25], dtype=tf.float32)
    wire, ctx = hvd_tf.Compression.fp16.compress(x)
    assert wire.dtype == tf.float16
    assert hvd_tf.Compression.fp16.decompress(wire, ctx).dtype == tf.float32
    same, ctx = hvd_tf.Compression.fp16.compress(tf.constant([1], dtype=tf.int32))
    assert same.dtype == tf.int32 and ctx is None


def test_keras_topk_takes_its_momentum_correction_from_sgd(hvd_tf):
    keras = needs.import_or_skip("keras")
    import hvdlite.keras as hvd_keras

    def wrap(optimizer, **topk):
        compression = hvd_keras.Compression.topk(0.01, **topk)
        hvd_keras.DistributedOptimizer(optimizer, compression=compression)
        return compression.momentum

    assert wrap(keras.optimizers.SGD(0.1, momentum=0.9)) == 0.9
    assert wrap(keras.optimizers.SGD(0.1)) == 0.0
    assert wrap(keras.optimizers.Adam()) == 0.0
    assert wrap(keras.optimizers.SGD(0.1, momentum=0.9), momentum=0) == 0.0
    assert wrap(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), momentum=0) == 0.0
    with pytest.raises(ValueError, match="Nesterov"):
        wrap(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True))
    with pytest.raises(ValueError, match="must be equal"):
        wrap(keras.optimizers.SGD(0.1, momentum=0.9), momentum=0.5)
