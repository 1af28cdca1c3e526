"""Every collective and dtype in one process (size 1), against numpy.

Expectations are written for any size where that costs nothing, but this module runs as
the MPI singleton, rank 0 of 1.
"""
import gc
import weakref

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)

DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, ml_dtypes.bfloat16,
          np.float32, np.float64]
ALL_DTYPES = DTYPES + [np.bool_]
FLOATS = {np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)}


def _ids(dtype):
    return np.dtype(dtype).name


def sample(dtype, shape=(3, 4), seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt in FLOATS:
        return rng.uniform(-4, 4, size=shape).astype(dt)
    low = 0 if dt.kind == "u" else -20
    return rng.integers(low, 20, size=shape).astype(dt)


def close(actual, expected):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype in FLOATS:
        tol = 1e-2 if actual.dtype.itemsize == 2 else 1e-6
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64),
                                   rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("op", ["Sum", "Average", "Min", "Max", "Product"])
def test_allreduce_each_dtype_and_op(hvd, dtype, op):
    x = sample(dtype)
    before = x.copy()
    out = hvd.allreduce(x, op=getattr(hvd, op))
    close(out, x)  # every reduction of one contribution is that contribution
    assert out is not x and not np.shares_memory(out, x)
    np.testing.assert_array_equal(x, before)  # the input is untouched


@pytest.mark.parametrize("op", ["Min", "Max"])
def test_allreduce_bool(hvd, op):
    x = sample(np.bool_)
    close(hvd.allreduce(x, op=getattr(hvd, op)), x)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64],
                         ids=_ids)
def test_allreduce_scaling(hvd, dtype):
    x = sample(dtype)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    close(out, (x.astype(np.float64) * 1.5).astype(dtype))


@pytest.mark.parametrize("shape", [(), (0,), (1,), (5,), (2, 0, 3), (2, 3, 4), (1000,)],
                         ids=str)
def test_allreduce_shapes(hvd, shape):
    x = sample(np.float32, shape)
    out = hvd.allreduce(x, op=hvd.Sum)
    close(out, x)


def test_allreduce_array_like(hvd):
    out = hvd.allreduce([1.0, 2.0, 3.0], op=hvd.Sum)
    close(out, np.array([1.0, 2.0, 3.0]))


def test_allreduce_async_poll_synchronize(hvd):
    x = sample(np.float64, (100,))
    handle = hvd.allreduce_async(x, name="async.one", op=hvd.Sum)
    result = hvd.synchronize(handle)
    close(result, x)
    assert hvd.poll(handle) is True
    assert hvd.synchronize(handle) is result  # a second wait returns the same result


def test_many_async_then_wait(hvd):
    xs = [sample(np.float32, (64,), seed=i) for i in range(100)]
    handles = [hvd.allreduce_async(x, name=f"many.{i}", op=hvd.Sum) for i, x in enumerate(xs)]
    for x, h in zip(xs, handles):
        close(hvd.synchronize(h), x)


def test_unnamed_calls_do_not_collide(hvd):
    handles = [hvd.allreduce_async(np.full(3, i, np.int32), op=hvd.Sum) for i in range(20)]
    assert [int(hvd.synchronize(h)[0]) for h in handles] == list(range(20))


def test_grouped_allreduce(hvd):
    arrays = [sample(t, (i + 1, 2), seed=i) for i, t in enumerate(DTYPES)]
    outs = hvd.grouped_allreduce(arrays, name="group.a", op=hvd.Sum)
    assert isinstance(outs, list) and len(outs) == len(arrays)
    for out, x in zip(outs, arrays):
        close(out, x)
    handle = hvd.grouped_allreduce_async(arrays[:3], op=hvd.Max)
    for out, x in zip(hvd.synchronize(handle), arrays[:3]):
        close(out, x)
    assert hvd.grouped_allreduce([]) == []


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_ids)
def test_allgather(hvd, dtype):
    x = sample(dtype, (3, 2))
    out = hvd.allgather(x)
    close(out, np.concatenate([x] * hvd.size()))


@pytest.mark.parametrize("shape", [(0,), (0, 3), (1,), (4, 2, 2)], ids=str)
def test_allgather_shapes(hvd, shape):
    x = sample(np.int64, shape)
    close(hvd.allgather(x), np.concatenate([x] * hvd.size()))


def test_allgather_result_outlives_its_handle(hvd):
    # The result views memory the core owns; the array must keep the native handle.
    x = np.arange(1000, dtype=np.float64).reshape(100, 10)
    handle = hvd.allgather_async(x, name="outlives")
    out = hvd.synchronize(handle)
    owner = out
    while owner is not None and not hasattr(owner, "_owner"):
        owner = owner.base
    native = weakref.ref(owner._owner) if owner is not None else None
    del handle, owner
    gc.collect()
    # Reuse memory the allocator may hand out again, then read the result.
    junk = [np.ones(1000) for _ in range(50)]
    close(out, x)
    out[0, 0] = -1.0  # writable
    del junk
    if native is not None:
        assert native() is not None
        del out
        gc.collect()
        assert native() is None, "the native handle outlived every view of its buffer"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_ids)
def test_broadcast(hvd, dtype):
    x = sample(dtype)
    out = hvd.broadcast(x, root_rank=0)
    close(out, x)
    assert not np.shares_memory(out, x)


def test_broadcast_scalar_and_async(hvd):
    close(hvd.synchronize(hvd.broadcast_async(np.float32(2.5), 0, name="bscalar")),
          np.array(2.5, np.float32))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_ids)
def test_alltoall(hvd, dtype):
    x = sample(dtype, (4, 3))
    out, splits = hvd.alltoall(x, splits=[4])
    close(out, x)
    assert splits.dtype == np.int64 and splits.tolist() == [4]
    out, splits = hvd.alltoall(x)
    close(out, x)
    assert splits.tolist() == [4]


def test_alltoall_empty(hvd):
    x = np.zeros((0, 5), np.float32)
    out, splits = hvd.alltoall(x, splits=np.array([0]))
    assert out.shape == (0, 5) and splits.tolist() == [0]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter(hvd, dtype, op):
    x = sample(dtype, (5, 2))
    out = hvd.reducescatter(x, op=getattr(hvd, op))
    close(out, x)  # size 1: rank 0 gets every row


def test_reducescatter_rows_rule(native):
    from hvdlite.ops import reducescatter_rows

    assert [reducescatter_rows(7, 3, r) for r in range(3)] == [3, 2, 2]
    assert [reducescatter_rows(2, 3, r) for r in range(3)] == [1, 1, 0]
    assert sum(reducescatter_rows(10, 4, r) for r in range(4)) == 10


def test_barrier_and_join(hvd):
    hvd.barrier()
    hvd.barrier()
    assert hvd.join() == 0
    # Usable after a join.
    close(hvd.allreduce(np.ones(2, np.float32), op=hvd.Sum), np.ones(2, np.float32))


def test_dropped_handle_in_flight_is_safe(hvd):
    for i in range(20):
        hvd.allreduce_async(np.ones(10_000, np.float32), name=f"dropped.{i}")
    gc.collect()
    # Later calls reap the orphans; the names become free again once they end.
    import time

    deadline = time.monotonic() + 30
    while True:
        try:
            hvd.allreduce(np.ones(3, np.float32), name="dropped.0")
            break
        except hvd.errors.DuplicateNameError:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_stats_count(hvd):
    before = hvd.stats()
    hvd.allreduce(np.ones(8, np.float32), name="stats.x")
    after = hvd.stats()
    assert after["tensors"] > before["tensors"]
    assert after["cycles"] >= before["cycles"]


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(0, 5), max_size=3),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 1000))
def test_allreduce_property(hvd, shape, dtype, seed):
    x = sample(dtype, tuple(shape), seed)
    close(hvd.allreduce(x, op=hvd.Sum), x)


def test_names_used_once_do_not_keep_repeated_names_out_of_the_c_cache(hvd):
    # The C copies of names are cached, bounded; thousands of automatic names must not
    # fill it for good (every later named tensor would then pay for a new copy).
    from hvdlite import _enqueue
    x = np.ones(2, np.float32)
    for _ in range(_enqueue.C_CACHE_LIMIT + 10):
        hvd.allreduce(x)  # an automatic name each time
    hvd.allreduce(x, name="repeated.after.auto")
    assert "repeated.after.auto" in _enqueue._c_names
    assert len(_enqueue._c_names) <= _enqueue.C_CACHE_LIMIT


def test_results_land_in_the_given_buffers(hvd):
    x = sample(np.float32, (4, 3))
    for label, call, shape in [
            ("bc", lambda out: hvd.broadcast(x, 0, name="out.bc", out=out), x.shape),
            ("rs", lambda out: hvd.reducescatter(x, name="out.rs", op=hvd.Sum, out=out),
             x.shape),  # one rank keeps every row
            ("ar", lambda out: hvd.allreduce(x, name="out.ar", op=hvd.Sum, out=out), x.shape)]:
        out = np.full(shape, np.nan, np.float32)
        assert call(out) is out, label
        assert np.array_equal(out, x), label
        with pytest.raises(hvd.errors.InvalidArgumentError, match=f"out.{label}.*out must be"):
            call(np.empty((1, 1), np.float32))
    outs = [np.empty_like(x), np.empty((2,), np.float64)]
    got = hvd.grouped_allreduce([x, np.arange(2.0)], name="out.grp", op=hvd.Sum, outs=outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    assert np.array_equal(outs[0], x) and np.array_equal(outs[1], np.arange(2.0))
    with pytest.raises(hvd.errors.InvalidArgumentError, match="1 outs for 2 arrays"):
        hvd.grouped_allreduce([x, x], name="out.grp2", outs=[np.empty_like(x)])


def test_a_repeated_call_rechecks_what_changed(hvd):
    # A name's next call with the same array and argument objects reuses the last call's
    # checks (the per-step path); an in-place change of the array's shape or dtype, or
    # other arguments, must go through the checks again.
    from hvdlite import ops
    x = np.arange(12, dtype=np.float32)
    for _ in range(2):
        assert np.array_equal(hvd.allreduce(x, name="repeat.x", op=hvd.Sum), x)
    assert ops._repeats["repeat.x"].array() is x
    x.shape = (3, 4)
    got = hvd.allreduce(x, name="repeat.x", op=hvd.Sum)
    assert got.shape == (3, 4) and np.array_equal(got, x)
    x.dtype = np.int32  # the same bytes, read as int32
    got = hvd.allreduce(x, name="repeat.x", op=hvd.Sum)
    assert got.dtype == np.int32 and np.array_equal(got, x)
    # hvd.Sum is 1, but True is refused as an op even right after a call with Sum.
    with pytest.raises(hvd.errors.InvalidArgumentError, match="repeat.x.*op True"):
        hvd.allreduce(x, name="repeat.x", op=True)
    y = np.ones(3, np.float32)
    close(hvd.allreduce(y, name="repeat.y", op=hvd.Sum, prescale_factor=2.0), 2 * y)
    close(hvd.allreduce(y, name="repeat.y", op=hvd.Sum, prescale_factor=2.0), 2 * y)
    close(hvd.allreduce(y, name="repeat.y", op=hvd.Sum, prescale_factor=3.0), 3 * y)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="repeat.y.*prescale_factor"):
        hvd.allreduce(y, name="repeat.y", op=hvd.Sum, prescale_factor="2")
    # Another array under the name, and the result buffer checked every call.
    z = np.full(3, 5.0, np.float32)
    close(hvd.allreduce(z, name="repeat.y", op=hvd.Sum, prescale_factor=3.0), 3 * z)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="repeat.y.*out must be"):
        hvd.allreduce(z, name="repeat.y", op=hvd.Sum, prescale_factor=3.0,
                      out=np.empty(3, np.float64))
    # The result buffer's address is reused only for the same out object, still of the
    # same shape, dtype and layout, and writable.
    first, second = np.zeros(3, np.float32), np.zeros(3, np.float32)
    for out in (first, first, second):
        assert hvd.allreduce(z, name="repeat.y", op=hvd.Sum, prescale_factor=3.0,
                             out=out) is out
    close(first, 3 * z)
    close(second, 3 * z)
    first[:] = 0
    assert hvd.allreduce(z, name="repeat.y", op=hvd.Sum, prescale_factor=3.0) is not second
    close(hvd.allreduce(z, name="repeat.y", op=hvd.Sum, prescale_factor=3.0, out=first),
          3 * z)
    # In-place changes of the remembered out (first): each refused.
    for change, undo, message in [
            (lambda: setattr(first.flags, "writeable", False),
             lambda: setattr(first.flags, "writeable", True), "writable"),
            (lambda: setattr(first, "shape", (1, 3)),
             lambda: setattr(first, "shape", (3,)), "out must be"),
            (lambda: setattr(first, "dtype", np.int32),
             lambda: setattr(first, "dtype", np.float32), "out must be")]:
        change()
        with pytest.raises(hvd.errors.InvalidArgumentError, match="repeat.y.*" + message):
            hvd.allreduce(z, name="repeat.y", op=hvd.Sum, prescale_factor=3.0, out=first)
        undo()
        assert hvd.allreduce(z, name="repeat.y", op=hvd.Sum, prescale_factor=3.0,
                             out=first) is first
    # The reuse keeps no array alive.
    alive = [weakref.ref(a) for a in (z, first, second)]
    del z, first, second, out
    gc.collect()
    assert all(a() is None for a in alive)


def test_the_other_collectives_repeated_recheck_what_changed(hvd):
    # A broadcast's, allgather's, alltoall's or reducescatter's repeat under a name
    # reuses what its first call checked and filled while the array's dtype and shape
    # and the other arguments are the same; anything else, a bad out included, goes
    # through the first call's checks (and refusal) again.
    from hvdlite import ops
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    for _ in range(2):
        assert np.array_equal(hvd.broadcast(x, 0, name="again.bc"), x)
        assert np.array_equal(hvd.allgather(x, name="again.ag"), x)
        assert np.array_equal(hvd.alltoall(x, name="again.a2a")[0], x)
        assert np.array_equal(hvd.reducescatter(x, name="again.rs", op=hvd.Sum), x)
    for kind in (ops.BROADCAST, ops.ALLGATHER, ops.ALLTOALL, ops.REDUCESCATTER):
        assert ops._kept_calls[kind], kind
    out = np.empty_like(x)
    assert hvd.broadcast(x, 0, name="again.bc", out=out) is out and np.array_equal(out, x)
    assert hvd.reducescatter(x, name="again.rs", op=hvd.Sum, out=out) is out
    # Another dtype, shape or argument under the name: checked and run as such.
    y = np.arange(4, dtype=np.int64)
    assert np.array_equal(hvd.broadcast(y, 0, name="again.bc"), y)
    assert hvd.allgather(y, name="again.ag").dtype == np.int64
    assert np.array_equal(hvd.alltoall(y, splits=(4,), name="again.a2a")[0], y)
    close(hvd.reducescatter(x, name="again.rs", op=hvd.Sum, prescale_factor=2.0), 2 * x)
    for bad in (np.empty((2, 3), np.float32), np.empty(3, np.float64), x.T, [0.0] * 6):
        with pytest.raises(hvd.errors.InvalidArgumentError, match="again.bc.*out must be"):
            hvd.broadcast(x, 0, name="again.bc", out=bad)
        with pytest.raises(hvd.errors.InvalidArgumentError, match="again.rs.*out must be"):
            hvd.reducescatter(x, name="again.rs", op=hvd.Sum, out=bad)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="again.bc.*root_rank"):
        hvd.broadcast(x, 1, name="again.bc")
    # Bools equal 1 and 0 but are refused as ranks, ops and factors, repeat or not.
    hvd.reducescatter(x, name="again.rs", op=hvd.Sum)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="again.bc.*root_rank"):
        hvd.broadcast(x, False, name="again.bc")
    with pytest.raises(hvd.errors.InvalidArgumentError, match="again.rs.*op True"):
        hvd.reducescatter(x, name="again.rs", op=True)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="again.rs.*prescale_factor"):
        hvd.reducescatter(x, name="again.rs", op=hvd.Sum, prescale_factor=True)
    # Equal is not enough: of other types, what the first call's path refuses, converts
    # or cannot compare with ==.
    assert np.array_equal(hvd.broadcast(x, 0, name="again.bc"), x)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="again.bc.*root_rank"):
        hvd.broadcast(x, 0.0, name="again.bc")
    assert np.array_equal(hvd.broadcast(x, np.int64(0), name="again.bc"), x)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="again.rs.*op"):
        hvd.reducescatter(x, name="again.rs", op=1.0)
    assert np.array_equal(hvd.alltoall(x, name="again.a2a")[0], x)
    assert np.array_equal(hvd.alltoall(x, splits=np.array([3]), name="again.a2a")[0], x)
    for _ in range(2):  # None: the global set
        assert np.array_equal(hvd.allreduce(x, name="again.none", process_set=None), x)
        assert np.array_equal(hvd.broadcast(x, 0, name="again.none", process_set=None), x)
    frozen = np.empty_like(x)
    frozen.setflags(write=False)
    with pytest.raises(hvd.errors.InvalidArgumentError, match="again.bc.*writable"):
        hvd.broadcast(x, 0, name="again.bc", out=frozen)
    assert np.array_equal(hvd.broadcast(x, 0, name="again.bc"), x)  # still usable


@pytest.mark.parametrize("call", ["broadcast", "allgather", "alltoall", "reducescatter"])
def test_an_unhashable_name_is_refused_clearly_by_every_collective(hvd, call):
    x = np.ones((1, 2), np.float32)
    args = {"broadcast": (x, 0)}.get(call, (x,))
    with pytest.raises(hvd.errors.InvalidArgumentError, match="name must be a str"):
        getattr(hvd, call)(*args, name=["a"])


def test_threads_waiting_on_one_op_handle_all_get_its_result(hvd):
    # An allreduce's OpHandle has no lock: threads that wait together, or reach the
    # core just after another thread released the id (about one wait in ten here), all
    # get the same result, never an unknown-handle error; polls meanwhile see the op
    # pending or ended.
    import threading
    x = np.arange(256, dtype=np.float32)
    for i in range(300):
        handle = hvd.allreduce_async(x, name=f"opwait.{i}", op=hvd.Sum)
        assert isinstance(handle, hvd.OpHandle) and isinstance(handle, hvd.Handle)
        start = threading.Barrier(5)
        results, failures = [], []

        def waiter(poll):
            start.wait()
            try:
                if poll:
                    while not hvd.poll(handle):
                        pass
                results.append(hvd.synchronize(handle))
            except Exception as e:  # reported below with the iteration
                failures.append(e)

        threads = [threading.Thread(target=waiter, args=(k % 2,)) for k in range(4)]
        for t in threads:
            t.start()
        start.wait()
        for t in threads:
            t.join(timeout=30)
        assert not failures, (i, failures)
        assert len(results) == 4 and all(r is results[0] for r in results), i
        assert np.array_equal(results[0], x) and handle.native_ids == []


def test_a_wait_cut_short_after_the_release_still_gets_the_outcome(hvd):
    # Ctrl-C can reach Python after the core released the id and before the OpHandle
    # published the outcome: the next wait and poll must still end it (the core keeps
    # recent releases' statuses), at once.
    from hvdlite._native import lib
    x = np.ones(8, np.float32)
    handle = hvd.allreduce_async(x, name="cut.short", op=hvd.Sum)
    assert lib.hvdlite_wait_release(handle.native_ids[0], 30.0) == lib.HVDLITE_OK
    assert handle.poll()
    assert np.array_equal(handle.wait(timeout=1.0), x) and handle.native_ids == []
    with pytest.raises(hvd.errors.InvalidArgumentError, match="cut.short"):
        handle.output()


def test_ended_handles_are_released_in_one_call_up_to_an_unknown_id(hvd):
    # hvdlite_release_ended releases from the last id back, and stops at the first op
    # in flight or failed or id it does not know (here: unknown and released ones):
    # those, and the ids before them, stay as they were (a group's wait then takes them
    # one by one, as before).
    from hvdlite._native import ffi, lib

    def ended(*names):
        handles = [hvd.broadcast_async(np.ones(4, np.float32), 0, name=n) for n in names]
        ids = [h.native_ids[0] for h in handles]
        for i in ids:
            lib.hvdlite_wait(i, 30.0)
        return handles, ids

    def released(ids):
        count = ffi.new("int32_t *")
        assert lib.hvdlite_release_ended(ffi.new("hvdlite_handle_t[]", ids), len(ids), count) == lib.HVDLITE_OK
        return count[0]

    def live(i):  # an ended op's handle still there (any call on a released one: unknown)
        out, nbytes, first = ffi.new("void **"), ffi.new("int64_t *"), ffi.new("int64_t *")
        return lib.hvdlite_handle_output(i, out, nbytes, first) != lib.HVDLITE_ERR_INVALID_HANDLE

    keep, ids = ended("rel.a", "rel.b", "rel.c")
    assert all(live(i) for i in ids) and released(ids) == 3 and not any(live(i) for i in ids)
    done = ffi.new("int32_t *")
    assert lib.hvdlite_poll(ids[0], done) == lib.HVDLITE_OK and done[0] == 1  # a recent release

    keep, ids = ended("rel.d", "rel.e")
    assert released([ids[0], 1 << 40, ids[1]]) == 1 and live(ids[0]) and not live(ids[1])
    assert released([ids[0], ids[1]]) == 0 and live(ids[0])  # a released id stops it too
    assert released([]) == 0 and released([ids[0]]) == 1 and not live(ids[0])


def test_an_unknown_handle_never_reads_as_ended(hvd):
    # Id 0 is never handed out; the core's ring of recent releases starts filled with
    # zeros and must not answer for it (a failed enqueue leaves a caller's handle at 0).
    from hvdlite._native import ffi, lib
    done = ffi.new("int32_t *")
    for handle_id in (0, -1, 1 << 40):
        assert lib.hvdlite_wait(handle_id, 0.0) == lib.HVDLITE_ERR_INVALID_HANDLE
        assert lib.hvdlite_wait_release(handle_id, 0.0) == lib.HVDLITE_ERR_INVALID_HANDLE
        assert lib.hvdlite_poll(handle_id, done) == lib.HVDLITE_ERR_INVALID_HANDLE


def test_a_late_waiter_keeps_the_outcome_another_thread_published(hvd, monkeypatch):
    # A thread that read the id before another thread ended the op, and reached the core
    # only after that release left the recent ones, gets "unknown handle": the outcome
    # the other thread published stands.
    from hvdlite import handle as handle_module
    from hvdlite._native import lib
    x = np.ones(4, np.float32)
    handle = hvd.allreduce_async(x, name="late.waiter", op=hvd.Sum)
    stale = handle.native_ids[0]
    result = handle.wait()  # the other thread: ends and publishes

    def reaches_the_core_late(wait, handle_id, deadline, name):
        handle._id = 0  # what the other thread published meanwhile
        return lib.HVDLITE_ERR_INVALID_HANDLE

    monkeypatch.setattr(handle_module, "_wait_slices", reaches_the_core_late)
    handle._id = stale  # this thread's read, from before
    assert handle.wait() is result and handle.wait() is result


def test_poll_while_another_thread_waits_never_fails(hvd):
    # The waiting thread releases the native ids as they end, before the Handle has
    # ended: a poll in between must see ended ops, not unknown handles, and must not
    # skip an op of a group still in flight.
    import threading
    x = np.ones(1024, np.float32)
    for i in range(200):
        if i % 2:
            handle = hvd.grouped_allreduce_async([x, x, x, x], name=f"pollwait.g{i}",
                                                 op=hvd.Sum)
        else:
            handle = hvd.allreduce_async(x, name=f"pollwait.{i}", op=hvd.Sum)
        waiter = threading.Thread(target=hvd.synchronize, args=(handle,))
        waiter.start()
        while not hvd.poll(handle):
            pass
        results = handle.wait()  # ended: returns at once with every result in place
        waiter.join()
        for r in results if isinstance(results, list) else [results]:
            assert np.array_equal(r, x), i


def test_zero_scale_factors_keep_their_sign(hvd):
    # 0.0 and -0.0 compare equal: the kept C structs must not mix them up.
    x = np.ones(4, np.float32)
    assert not np.signbit(hvd.allreduce(x, name="zero.sign", op=hvd.Sum,
                                        postscale_factor=0.0)).any()
    assert np.signbit(hvd.allreduce(x, name="zero.sign", op=hvd.Sum,
                                    postscale_factor=-0.0)).all()


def test_unhashable_name_is_refused_clearly(hvd):
    with pytest.raises(hvd.errors.InvalidArgumentError, match="name must be a str"):
        hvd.allreduce(np.ones(2, np.float32), name=["a"])


def test_a_rank_alone_runs_its_blocking_calls_own_cycle(hvd):
    # One process: nothing waits for a peer, so a small blocking call's cycle is the
    # calling thread's (no hand-off to the background thread), every kind, and the
    # results are as ever.
    before = hvd.stats()["caller_cycles"]
    x = np.arange(1024, dtype=np.float32)
    for step in range(5):
        np.testing.assert_array_equal(hvd.allreduce(x * step, name="alone.ar", op=hvd.Sum),
                                      x * step)
        np.testing.assert_array_equal(hvd.broadcast(x + step, 0, name="alone.bc"), x + step)
        np.testing.assert_array_equal(hvd.allgather(x[:8] - step, name="alone.ag"), x[:8] - step)
        hvd.barrier()
    assert hvd.stats()["caller_cycles"] - before == 20
