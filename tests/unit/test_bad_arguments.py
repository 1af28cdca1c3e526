"""Bad input is refused at the call with a clear exception naming the tensor."""
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)


def _collectives(hvd):
    """(label, call(array, name)) for every numpy collective that takes an array."""
    return [
        ("allreduce", lambda x, n: hvd.allreduce(x, name=n)),
        ("allreduce_async", lambda x, n: hvd.allreduce_async(x, name=n)),
        ("grouped_allreduce", lambda x, n: hvd.grouped_allreduce([x], name=n)),
        ("allgather", lambda x, n: hvd.allgather(x, name=n)),
        ("broadcast", lambda x, n: hvd.broadcast(x, 0, name=n)),
        ("alltoall", lambda x, n: hvd.alltoall(x, name=n)),
        ("reducescatter", lambda x, n: hvd.reducescatter(x, name=n)),
    ]


@pytest.mark.parametrize("dtype", [np.complex64, object, "U4", np.uint32,
                                   np.uint64, ">f4"], ids=str)
def test_unsupported_dtype(hvd, dtype):
    x = np.zeros((2, 2), dtype=dtype)
    for label, call in _collectives(hvd):
        with pytest.raises(hvd.errors.InvalidArgumentError) as info:
            call(x, f"bad.{label}")
        message = str(info.value)
        assert f"bad.{label}" in message, message
        assert "supported" in message and "float32" in message, message


def test_non_contiguous(hvd):
    x = np.zeros((4, 6), np.float32)[:, ::2]
    assert not x.flags.c_contiguous
    for label, call in _collectives(hvd):
        with pytest.raises(hvd.errors.InvalidArgumentError, match=f"nc.{label}.*contiguous"):
            call(x, f"nc.{label}")
    # The hint works.
    hvd.allreduce(np.ascontiguousarray(x), name="nc.fixed")


def test_fortran_order_is_refused(hvd):
    x = np.asfortranarray(np.zeros((3, 4), np.float64))
    with pytest.raises(hvd.errors.InvalidArgumentError, match="contiguous"):
        hvd.allreduce(x, name="fortran")


@pytest.mark.parametrize("op", ["Sum", "Average", "Product"])
def test_bool_needs_min_or_max(hvd, op):
    x = np.ones(3, bool)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="bool.*Min and Max"):
        hvd.allreduce(x, name="flags", op=getattr(hvd, op))
    with pytest.raises(hvd.errors.InvalidArgumentError, match="bool"):
        hvd.reducescatter(x, name="flags.rs", op=getattr(hvd, op))


@pytest.mark.parametrize("op", [99, -1, "sum", True, None, 1.0])
def test_unknown_reduce_op(hvd, op):
    with pytest.raises(hvd.errors.InvalidArgumentError, match="badop.*not one of"):
        hvd.allreduce(np.ones(2, np.float32), name="badop", op=op)


def test_bad_scale_factor(hvd):
    with pytest.raises(hvd.errors.InvalidArgumentError, match="prescale_factor"):
        hvd.allreduce(np.ones(2, np.float32), name="scale", prescale_factor="2")


@pytest.mark.parametrize("root", [-1, 1, 10, True, "0", 0.0])
def test_bad_root(hvd, root):
    with pytest.raises(hvd.errors.InvalidArgumentError, match="bcast.*root_rank"):
        hvd.broadcast(np.ones(2, np.float32), root, name="bcast")


@pytest.mark.parametrize("splits,pattern", [
    ([1, 1], "entries"),          # size 1 wants one entry
    ([3], "sum to 3"),            # the first dimension is 4
    ([-1], "negative|sum"),
    ([2.5], "ints"),
    ([[4]], "1-D"),
])
def test_bad_splits(hvd, splits, pattern):
    with pytest.raises(hvd.errors.InvalidArgumentError, match=f"a2a.*(?:{pattern})"):
        hvd.alltoall(np.ones((4, 2), np.float32), splits=splits, name="a2a")


def test_scalars_need_a_dimension(hvd):
    for call in (hvd.allgather, hvd.alltoall, hvd.reducescatter):
        with pytest.raises(hvd.errors.InvalidArgumentError, match="scalar0.*dimension"):
            call(np.float32(1.0), name="scalar0")


@pytest.mark.parametrize("name", ["", "a\0b", 7, b"bytes"])
def test_bad_names(hvd, name):
    with pytest.raises(hvd.errors.InvalidArgumentError, match="name"):
        hvd.allreduce(np.ones(2, np.float32), name=name)


def test_refused_group_enqueues_nothing(hvd):
    good = np.ones(3, np.float32)
    bad = np.ones(3, np.complex64)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="grp.1"):
        hvd.grouped_allreduce([good, bad], name="grp")
    # Nothing of the refused group is in flight: the same names work at once.
    outs = hvd.grouped_allreduce([good, good], name="grp", op=hvd.Sum)
    assert [o.tolist() for o in outs] == [[1, 1, 1]] * 2


def test_native_refusal_maps_to_invalid_argument(hvd):
    # Bypass the Python checks: the core itself must refuse a bad dtype code.
    from hvdlite import ops

    x = np.ones(2, np.float32)
    with pytest.raises(hvd.errors.InvalidArgumentError) as info:
        ops.enqueue(ops.ALLREDUCE, "raw.bad.dtype", 12345, x.shape, x.ctypes.data,
                    x.ctypes.data, reduce_op=hvd.Sum, keepalive=(x,))
    assert info.value.status is not None and info.value.message


def test_native_refuses_bad_root(hvd):
    from hvdlite import dtypes, ops

    x = np.ones(2, np.float32)
    out = np.empty_like(x)
    with pytest.raises(hvd.errors.InvalidArgumentError):
        ops.enqueue(ops.BROADCAST, "raw.bad.root", dtypes.native_code("float32"), x.shape,
                    x.ctypes.data, out.ctypes.data, root_rank=5, keepalive=(x, out))


def test_wait_timeout_is_not_fatal(hvd):
    handle = hvd.allreduce_async(np.ones(2, np.float32), name="timeout.zero")
    try:
        hvd.synchronize(handle, timeout=0)
    except hvd.errors.WaitTimeoutError:
        pass  # the op goes on; the next wait gets the result
    assert hvd.synchronize(handle).tolist() == [1.0, 1.0]


def test_gradient_predivide_is_refused_with_ops_other_than_average(native):
    # One rule for every adapter: torch and Keras (on either backend) and the TF tape.
    import keras

    import hvdlite as hvd
    from hvdlite import ops
    from hvdlite.keras import DistributedOptimizer

    assert ops.predivide_scaling(hvd.Average, 4.0) == (hvd.Average, 0.25, 4.0)
    assert ops.predivide_scaling(hvd.Sum, 1.0) == (hvd.Sum, 1.0, 1.0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        ops.predivide_scaling(hvd.Sum, 2.0)
    # Keras refuses at construction, not at the first step (it used to sum on torch).
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
