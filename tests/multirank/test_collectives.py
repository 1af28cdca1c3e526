"""Every collective on real 2- and 3-rank jobs: values, dtypes, shapes, errors, join.

Each rank script starts with PRELUDE: deterministic per-rank inputs (``data``) that any
rank can recompute for any other rank, so expected values come from numpy alone, and a
``check``/``expect_error`` pair that records failures instead of raising. A rank that
raises anyway fails the job with its traceback; otherwise every rank reports its
failures in one ``HVDLITE_RESULT`` line and the test asserts there are none, so one job
reports every broken case at once. Bodies use ``size``/``rank`` only, so they pass at
any rank count; jobs are few and each checks many cases, since a job costs a startup.
"""
import pytest

from harness import assert_ok, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

JOB_TIMEOUT = 150

PRELUDE = r'''
import json, sys, time, traceback
import numpy as np
import ml_dtypes
import hvdlite as hvd
from hvdlite import errors, ops

hvd.init()
rank, size = hvd.rank(), hvd.size()
failures = []
DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64", "bool"]
FLOATS = {"float16", "bfloat16", "float32", "float64"}
SIGNED = {"int8", "int16", "int32", "int64"} | FLOATS


def npdtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def data(r, shape, dt, salt=0):
    """Rank r's input: small integers (exact in every dtype), negative where signed."""
    shape = tuple(shape)
    n = int(np.prod(shape, dtype=np.int64))
    v = (np.arange(n, dtype=np.int64) * 3 + r * 5 + salt * 7) % 17
    if dt == "bool":
        return (v % 2 == 1).reshape(shape)
    if dt in SIGNED:
        v = v - 8
    return v.astype(npdtype(dt)).reshape(shape)


def reduce_expected(arrays, dt, op):
    """The reduction of ``arrays`` computed in float64/int64 by numpy, cast back."""
    wide = [a.astype(np.float64 if dt in FLOATS else np.int64) for a in arrays]
    if op in ("sum", "average"):
        total = np.sum(wide, axis=0)
        if op == "average":
            total = total / len(arrays) if dt in FLOATS else np.trunc(total / len(arrays))
    elif op == "min":
        total = np.min(wide, axis=0)
    else:
        total = np.max(wide, axis=0)
    return np.asarray(total).astype(npdtype(dt))


def check(label, got, expected):
    got = np.asarray(got)
    expected = np.asarray(expected)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        failures.append(f"{label}: got {got.dtype}{got.shape}, expected "
                        f"{expected.dtype}{expected.shape}")
        return
    if got.dtype.name in FLOATS or got.dtype == npdtype("bfloat16"):
        tol = 2e-2 if got.dtype.itemsize == 2 else 1e-6
        ok = np.allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol,
                         atol=tol)
    else:
        ok = np.array_equal(got, expected)
    if not ok:
        failures.append(f"{label}: got {got.tolist()!r}, expected {expected.tolist()!r}")


def expect_error(label, cls, fn, *fragments):
    """fn() must raise cls whose message contains every fragment."""
    try:
        fn()
    except cls as e:
        for f in fragments:
            if f not in str(e):
                failures.append(f"{label}: message {str(e)!r} lacks {f!r}")
        return str(e)
    except Exception as e:
        failures.append(f"{label}: raised {type(e).__name__}: {e}, expected {cls.__name__}")
        return None
    failures.append(f"{label}: did not raise {cls.__name__}")
    return None


def still_usable(label):
    """An allreduce right after an error: the job must go on."""
    got = hvd.allreduce(np.array([rank + 1.0]), name="usable." + label, op=hvd.Sum)
    check("usable after " + label, got, np.array([size * (size + 1) / 2.0]))


def report(**extra):
    print("HVDLITE_RESULT " + json.dumps({"failures": failures, **extra}), flush=True)
'''


def run_ranks(np_, body, **kwargs):
    """Runs PRELUDE + body on np_ ranks; returns the JobResult after checking failures."""
    result = assert_ok(run_job(np_, PRELUDE + body, timeout=JOB_TIMEOUT, **kwargs))
    problems = []
    for r in range(np_):
        for f in result.result(r)["failures"]:
            problems.append(f"rank {r}: {f}")
    assert not problems, "\n".join(problems)
    return result


# ---------------------------------------------------------------- every op, every dtype

EVERY_OP = r'''
for dt in DTYPES:
    np_dt = npdtype(dt)

    # allgather: uneven first dims, a rank with zero rows, trailing dims kept.
    rows = [(r * 2 + 1) % 4 for r in range(size)]
    rows[size - 1] = 0                                      # the last rank sends nothing
    got = hvd.allgather(data(rank, (rows[rank], 2, 3), dt), name=f"ag.{dt}")
    check(f"allgather {dt}", got,
          np.concatenate([data(r, (rows[r], 2, 3), dt) for r in range(size)]))
    got = hvd.allgather(data(rank, (rank + 1,), dt, 1), name=f"ag1d.{dt}")
    check(f"allgather 1-d {dt}", got,
          np.concatenate([data(r, (r + 1,), dt, 1) for r in range(size)]))
    got = hvd.allgather(np.zeros((0, 4), np_dt), name=f"ag.empty.{dt}")
    check(f"allgather all-empty {dt}", got, np.zeros((0, 4), np_dt))
    got = hvd.synchronize(hvd.allgather_async(data(rank, (2, 0), dt), name=f"ag.0col.{dt}"))
    check(f"allgather zero-width rows {dt}", got, np.zeros((2 * size, 0), np_dt))

    # broadcast: every root, a 0-d scalar, an empty tensor.
    for root in range(size):
        got = hvd.broadcast(data(rank, (3, 2), dt), root, name=f"bc.{dt}")
        check(f"broadcast {dt} root {root}", got, data(root, (3, 2), dt))
        got = hvd.broadcast(data(rank, (), dt, 2), root_rank=root, name=f"bc0d.{dt}")
        check(f"broadcast 0-d {dt} root {root}", got, data(root, (), dt, 2))
    got = hvd.broadcast(np.zeros((0, 3), np_dt), size - 1, name=f"bc.empty.{dt}")
    check(f"broadcast empty {dt}", got, np.zeros((0, 3), np_dt))

    # alltoall with even splits: rank k sends rows [2m, 2m+2) to rank m.
    x = data(rank, (2 * size, 3), dt, 3)
    got, splits = hvd.alltoall(x, name=f"a2a.even.{dt}")
    check(f"alltoall even {dt}", got,
          np.concatenate([data(k, (2 * size, 3), dt, 3)[2 * rank:2 * rank + 2]
                          for k in range(size)]))
    check(f"alltoall even splits {dt}", splits, np.full(size, 2, np.int64))

    # alltoall with explicit splits, zeros among them.
    def sp(k):
        return [(k + 2 * m) % 3 for m in range(size)]

    def chunk(k, m):
        s = sp(k)
        return data(k, (sum(s), 2), dt, 4)[sum(s[:m]):sum(s[:m + 1])]

    got, splits = hvd.alltoall(data(rank, (sum(sp(rank)), 2), dt, 4), splits=sp(rank),
                               name=f"a2a.splits.{dt}")
    check(f"alltoall splits {dt}", got, np.concatenate([chunk(k, rank) for k in range(size)]))
    check(f"alltoall recv splits {dt}", splits, np.array([sp(k)[rank] for k in range(size)]))
    got, splits = hvd.alltoall(np.zeros((0, 3), np_dt), splits=[0] * size,
                               name=f"a2a.zero.{dt}")
    check(f"alltoall all-zero splits {dt}", got, np.zeros((0, 3), np_dt))
    check(f"alltoall all-zero recv splits {dt}", splits, np.zeros(size, np.int64))

    # reducescatter: uneven rows (first ranks take one more), fewer rows than ranks, none.
    rs_ops = [("min", hvd.Min), ("max", hvd.Max)] if dt == "bool" else \
             [("sum", hvd.Sum), ("average", hvd.Average)]
    for d0 in (2 * size + 1, 1, 0):
        base = d0 // size
        counts = [base + (1 if r < d0 % size else 0) for r in range(size)]
        lo = sum(counts[:rank])
        for label, op in rs_ops:
            got = hvd.reducescatter(data(rank, (d0, 2), dt, 5), op=op,
                                    name=f"rs.{dt}.{d0}.{label}")
            full = reduce_expected([data(r, (d0, 2), dt, 5) for r in range(size)], dt, label)
            check(f"reducescatter {label} {dt} rows {d0}", got, full[lo:lo + counts[rank]])

    # grouped allreduce: fused, scalars and empties among the members.
    red = ("max", hvd.Max) if dt == "bool" else ("sum", hvd.Sum)
    shapes = [(3,), (2, 2), (), (0, 5)]
    before = hvd.stats()
    got = hvd.grouped_allreduce([data(rank, s, dt, 6 + i) for i, s in enumerate(shapes)],
                                op=red[1], name=f"group.{dt}")
    after = hvd.stats()
    for i, s in enumerate(shapes):
        check(f"grouped_allreduce {dt} member {i}", got[i],
              reduce_expected([data(r, s, dt, 6 + i) for r in range(size)], dt, red[0]))
    if after["collectives"] - before["collectives"] != 1:
        failures.append(f"grouped_allreduce {dt}: {after['collectives'] - before['collectives']}"
                        " collectives, expected 1 (fused)")

    # allreduce of a 0-d scalar and of an empty tensor.
    got = hvd.allreduce(data(rank, (), dt, 8), op=red[1], name=f"ar0d.{dt}")
    check(f"allreduce 0-d {dt}", got,
          reduce_expected([data(r, (), dt, 8) for r in range(size)], dt, red[0]))
    got = hvd.allreduce(np.zeros((0, 3), np_dt), op=red[1], name=f"ar.empty.{dt}")
    check(f"allreduce empty {dt}", got, np.zeros((0, 3), np_dt))
    if dt != "bool":
        got = hvd.allreduce(data(rank, (4,), dt, 9), op=hvd.Average, name=f"ar.avg.{dt}")
        check(f"allreduce average {dt}", got,
              reduce_expected([data(r, (4,), dt, 9) for r in range(size)], dt, "average"))

# reducescatter with scaling, float64.
got = hvd.reducescatter(data(rank, (size, 3), "float64"), op=hvd.Sum, prescale_factor=2.0,
                        postscale_factor=0.5, name="rs.scaled")
check("reducescatter scaled", got,
      reduce_expected([data(r, (size, 3), "float64") for r in range(size)], "float64",
                      "sum")[rank:rank + 1])

# Mixed-dtype group, Min/Max/Product reductions.
got = hvd.grouped_allreduce([data(rank, (3,), "float32"), data(rank, (2,), "int64"),
                             data(rank, (4,), "float16")], op=hvd.Sum, name="group.mixed")
for i, (s, dt) in enumerate((((3,), "float32"), ((2,), "int64"), ((4,), "float16"))):
    check(f"mixed-dtype group member {i}", got[i],
          reduce_expected([data(r, s, dt) for r in range(size)], dt, "sum"))
for label, op in (("min", hvd.Min), ("max", hvd.Max)):
    got = hvd.reducescatter(data(rank, (size + 2, 2), "int32"), op=op, name=f"rs.{label}")
    full = reduce_expected([data(r, (size + 2, 2), "int32") for r in range(size)], "int32",
                           label)
    lo = sum((size + 2) // size + (1 if r < (size + 2) % size else 0) for r in range(rank))
    check(f"reducescatter {label}", got,
          full[lo:lo + (size + 2) // size + (1 if rank < (size + 2) % size else 0)])
got = hvd.allreduce(np.full(3, rank + 2, np.int64), op=hvd.Product, name="ar.prod")
check("allreduce product", got, np.full(3, np.prod(np.arange(2, size + 2)), np.int64))

# Many ops in flight at once; handles dropped unwaited; results kept while later ops
# reuse the core's memory.
kept = []
handles = [hvd.allgather_async(data(rank, (rank + i % 3, 3), "float32", i),
                               name=f"many.ag.{i}") for i in range(40)]
handles += [hvd.alltoall_async(data(rank, (size * (i % 2), 2), "int64", i),
                               name=f"many.a2a.{i}") for i in range(40)]
for i in range(0, 10):
    hvd.allgather_async(data(rank, (2, 2), "int32", i), name=f"dropped.{i}")
for h in reversed(handles):
    kept.append(hvd.synchronize(h))
kept.reverse()
for j in range(3):
    hvd.allgather(np.full((100, 100), -1.0, np.float32), name="churn")
for i in range(40):
    check(f"kept allgather {i}", kept[i],
          np.concatenate([data(r, (r + i % 3, 3), "float32", i) for r in range(size)]))
    recv, splits = kept[40 + i]
    check(f"kept alltoall {i}", recv,
          np.concatenate([data(r, (size * (i % 2), 2), "int64", i)
                          [rank * (i % 2):(rank + 1) * (i % 2)] for r in range(size)]))

# Big enough to take more than one MPI message on the way.
big = hvd.allgather(np.full((1 << 18, 4), rank, np.float32), name="big.ag")
check("big allgather", big, np.repeat(np.arange(size, dtype=np.float32), 1 << 18)[:, None]
      .repeat(4, axis=1))

# barrier: nobody leaves before everyone arrived.
time.sleep(0.2 * rank)
t0 = time.time()
hvd.barrier()
stamps = hvd.allgather(np.array([t0, time.time()]).reshape(1, 2), name="barrier.stamps")
if stamps[:, 1].min() < stamps[:, 0].max() - 0.05:
    failures.append(f"barrier: a rank left before another arrived: {stamps.tolist()}")
for i in range(3):
    hvd.barrier()

# 0-d tensors are refused by allgather, alltoall and reducescatter, with a clear error,
# in numpy's front end and in the core itself.
scalar = np.array(1.0, np.float32)
expect_error("allgather 0-d", errors.InvalidArgumentError, lambda: hvd.allgather(scalar),
             "dimension")
expect_error("alltoall 0-d", errors.InvalidArgumentError, lambda: hvd.alltoall(scalar),
             "dimension")
expect_error("reducescatter 0-d", errors.InvalidArgumentError,
             lambda: hvd.reducescatter(scalar), "dimension")
code = ops.dtypes.native_code("float32")
for kind in (ops.ALLGATHER, ops.ALLTOALL, ops.REDUCESCATTER):
    out = np.empty((), np.float32)
    expect_error(f"core 0-d op {kind}", errors.InvalidArgumentError,
                 lambda: ops.enqueue(kind, f"core0d.{kind}", code, (), scalar.ctypes.data,
                                     out.ctypes.data if kind == ops.REDUCESCATTER else None),
                 "at least one dimension")
still_usable("0-d refusals")

# In place through the raw API (output == input), as c_api.h allows: MPI must never see
# aliased buffers.
f32 = ops.dtypes.native_code("float32")
for label, kind, kw in (("reducescatter", ops.REDUCESCATTER, {"reduce_op": hvd.Sum}),
                        ("allreduce", ops.ALLREDUCE, {"reduce_op": hvd.Sum}),
                        ("broadcast", ops.BROADCAST, {"root_rank": size - 1})):
    x = data(rank, (2 * size + 1, 2), "float32", 11)
    hvd.synchronize(ops.enqueue(kind, f"inplace.{label}", f32, x.shape, x.ctypes.data,
                                x.ctypes.data, keepalive=(x,), **kw))
    inputs = [data(r, (2 * size + 1, 2), "float32", 11) for r in range(size)]
    if label == "broadcast":
        check("in-place broadcast", x, inputs[size - 1])
    elif label == "allreduce":
        check("in-place allreduce", x, reduce_expected(inputs, "float32", "sum"))
    else:
        mine = 2 + (1 if rank < 1 else 0)
        lo = sum(2 + (1 if r < 1 else 0) for r in range(rank))
        check("in-place reducescatter", x[:mine],
              reduce_expected(inputs, "float32", "sum")[lo:lo + mine])
still_usable("in-place ops")

# Results of core-allocated outputs outlive shutdown (they belong to their arrays).
survivor = hvd.allgather(data(rank, (2, 2), "int64"), name="survivor")
hvd.shutdown()
check("allgather result after shutdown", survivor,
      np.concatenate([data(r, (2, 2), "int64") for r in range(size)]))
expect_error("allgather after shutdown", errors.NotInitializedError,
             lambda: hvd.allgather(np.ones((1, 1))))
report()
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_every_op_and_dtype(np_):
    run_ranks(np_, EVERY_OP)


# ---------------------------------------------------------------- large, through shared memory

LARGE_GATHERS = r"""
SHM = os.environ.get("HVDLITE_SHM_ALLREDUCE") != "0"
AREA = 1 << 20  # bytes a round of the core's shared-memory collectives moves per rank


def counted(label, fn):
    # fn()'s result; every call must go through shared memory when it is on, else MPI.
    before = hvd.stats()["shm_collectives"]
    got = fn()
    went = hvd.stats()["shm_collectives"] - before
    if went != (1 if SHM else 0):
        failures.append(f"{label}: {went} collectives through shared memory, expected "
                        f"{1 if SHM else 0}")
    return got


def check_big(label, got, expected):
    # check(), reporting the first wrong element instead of whole arrays.
    before = len(failures)
    check(label, got, expected)
    if len(failures) > before:
        got, expected = np.asarray(got), np.asarray(expected)
        where = "shapes differ"
        if got.shape == expected.shape:
            if got.dtype.name in FLOATS:
                bad = np.argwhere(~np.isclose(got.astype(np.float64), expected.astype(np.float64),
                                              rtol=2e-2, atol=2e-2))
            else:
                bad = np.argwhere(got != expected)
            where = (f"{len(bad)} wrong, first at {bad[0].tolist()}: {got[tuple(bad[0])]!r} "
                     f"!= {expected[tuple(bad[0])]!r}" if len(bad) else "close")
        failures[before:] = [f"{label}: {got.dtype}{got.shape} vs {expected.dtype}"
                             f"{expected.shape}: {where}"]


def rs_expected(arrays, dt, op):
    if op != "product":
        return reduce_expected(arrays, dt, op)
    wide = [a.astype(np.float64 if dt in FLOATS else np.int64) for a in arrays]
    # Integers wrap as the core's products do (modulo 2**bits, from int64's).
    return np.prod(wide, axis=0).astype(npdtype(dt))


def split(d0):
    counts = [d0 // size + (1 if r < d0 % size else 0) for r in range(size)]
    return counts, sum(counts[:rank])


OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}
for dt in ("float32", "float16", "bfloat16", "float64", "int32", "uint8"):
    item = npdtype(dt).itemsize
    width = 700_003 // item  # a row of ~700 KB: rows never line up with chunks or areas
    # More rows than ranks (uneven), and fewer (the last rank's shard is empty).
    for d0 in (size + 1, size - 1):
        counts, lo = split(d0)
        for label, op in OPS.items():
            name = f"big.rs.{dt}.{d0}.{label}"
            got = counted(name, lambda: hvd.reducescatter(data(rank, (d0, width), dt, 3), op=op,
                                                          name=name))
            full = rs_expected([data(r, (d0, width), dt, 3) for r in range(size)], dt, label)
            check_big(name, got, full[lo:lo + counts[rank]])

    # allgather: uneven rows, the last rank sending none, then the first.
    for k, rows in enumerate(([2 * r + 1 for r in range(size - 1)] + [0],
                              [0] + [r + 2 for r in range(1, size)])):
        name = f"big.ag.{dt}.{k}"
        got = counted(name, lambda: hvd.allgather(data(rank, (rows[rank], width), dt, 4),
                                                  name=name))
        check_big(name, got, np.concatenate([data(r, (rows[r], width), dt, 4)
                                         for r in range(size)]))

# Several areas per rank (4 MiB each), and a fused group of smaller allgathers.
got = counted("huge allgather", lambda: hvd.allgather(
    data(rank, (AREA // 4 + 17 * rank, 4), "float32", 5), name="huge.ag"))
check_big("huge allgather", got, np.concatenate([data(r, (AREA // 4 + 17 * r, 4), "float32", 5)
                                                 for r in range(size)]))
def group_shapes(r):
    # Each member's result under 1 MiB (larger allgathers go alone), so that they fuse.
    return [(r + 1, 20_001), (0 if r == 0 else 2, 5), (2, 30_000)]
got = counted("grouped allgather", lambda: hvd.grouped_allgather(
    [data(rank, s, "float32", 6 + i) for i, s in enumerate(group_shapes(rank))],
    name="big.group"))
for i in range(3):
    check_big(f"grouped allgather member {i}", got[i],
              np.concatenate([data(r, group_shapes(r)[i], "float32", 6 + i)
                              for r in range(size)]))

# Broadcast: an allgather of the root's rows alone, through shared memory (the root's
# own result filled round by round beside the others' copies). Sizes around a round
# (AREA), from every root, into a new array and in place, and a small one.
for root in range(size):
    for nbytes in (4096, AREA - 1, AREA, AREA + 3, 2 * AREA + AREA // 2):
        name = f"big.bc.{root}.{nbytes}"
        mine = data(rank, (nbytes,), "uint8", 7)
        got = counted(name, lambda: hvd.broadcast(mine, root, name=name))
        check_big(name, got, data(root, (nbytes,), "uint8", 7))
        # The root fills its result from its input as the rounds go: the input stays.
        check_big(f"{name} input", mine, data(rank, (nbytes,), "uint8", 7))
    x = data(rank, (3, 100_001), "float64", 8)
    counted(f"in-place broadcast {root}", lambda: hvd.broadcast(x, root, name="big.bc.inplace",
                                                                out=x))
    check_big(f"in-place broadcast {root}", x, data(root, (3, 100_001), "float64", 8))

# Alltoall: each rank's send buffer published a round (AREA) at a time, less its own
# block, every rank taking its blocks from there (its own from its input). Uneven
# splits, zeros among them, blocks across round boundaries; and two small ones (one
# round each).
def a2a_splits(j, rows):  # rows rank j sends each rank
    return [0 if (j + k) % 3 == 2 else rows + 13 * j + 7 * k for k in range(size)]
for rows in (AREA // 8 + 5, 3, 0):
    x = data(rank, (sum(a2a_splits(rank, rows)), 2), "float32", 9)
    got, recv = counted(f"alltoall {rows}", lambda: hvd.alltoall(
        x, splits=a2a_splits(rank, rows), name=f"big.a2a.{rows}"))
    blocks = [np.split(data(j, (sum(a2a_splits(j, rows)), 2), "float32", 9),
                       np.cumsum(a2a_splits(j, rows))[:-1])[rank] for j in range(size)]
    check_big(f"alltoall {rows}", got, np.concatenate(blocks))
    check(f"alltoall {rows} recv splits", recv,
          np.array([a2a_splits(j, rows)[rank] for j in range(size)]))

# Random floats: through shared memory a reducescatter's shard holds the very bits of the
# allreduce's (each element reduced once, in rank order); either way numpy's sum within
# rounding.
rng = np.random.default_rng(rank)
x = rng.standard_normal((5 * size + 2, 100_003)).astype(np.float32)
counts, lo = split(x.shape[0])
got = counted("random reducescatter", lambda: hvd.reducescatter(x, op=hvd.Sum, name="rand.rs"))
whole = hvd.allreduce(x, op=hvd.Sum, name="rand.ar")[lo:lo + counts[rank]]
if SHM and not np.array_equal(got.view(np.uint32), whole.view(np.uint32)):
    failures.append("random reducescatter: not the allreduce's bits")
inputs = [np.random.default_rng(r).standard_normal(x.shape).astype(np.float32)
          for r in range(size)]
expected = np.sum([a.astype(np.float64) for a in inputs], axis=0)[lo:lo + counts[rank]]
if not np.allclose(got, expected, rtol=1e-5, atol=1e-5):
    failures.append("random reducescatter: not numpy's sum")
# Scaled, and averaged: the scaling is the op's, whichever path moved the bytes.
got = counted("scaled reducescatter", lambda: hvd.reducescatter(
    x, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.25, name="rand.rs.scaled"))
if not np.allclose(got, expected * 0.5 / size, rtol=1e-5, atol=1e-5):
    failures.append("scaled reducescatter: not numpy's")
report()
"""


@pytest.mark.parametrize("np_,shm", [(2, "on"), (3, "on"), (3, "off")])
def test_large_reducescatter_allgather_broadcast_and_alltoall(np_, shm):
    # Through shared memory (where the allreduce goes there), and through MPI with
    # HVDLITE_SHM_ALLREDUCE=0: the same results either way.
    run_ranks(np_, "import os\n" + LARGE_GATHERS,
              env={"HVDLITE_SHM_ALLREDUCE": "1" if shm == "on" else "0"})


# ---------------------------------------------------------------- mismatches

MISMATCH = r'''
other = 1  # the rank that disagrees
M = errors.MismatchError


def everywhere(label, fn, *fragments):
    """fn() must fail with a MismatchError on every rank; then the job goes on."""
    msg = expect_error(label, M, fn, *fragments)
    still_usable(label)
    return msg


x32 = np.ones((2, 3), np.float32)
everywhere("allgather trailing dims",
           lambda: hvd.allgather(np.ones((rank + 1, 3 + (rank == other)), np.float32),
                                 name="m.ag"),
           "trailing", "rank 1", "[4]", "[3]", "'m.ag'")
everywhere("allgather ndim",
           lambda: hvd.allgather(np.ones((2, 3) + ((1,) if rank == other else ()), np.int32),
                                 name="m.ag.ndim"), "trailing", "[3, 1]")
everywhere("allgather dtype",
           lambda: hvd.allgather(np.ones((2,), np.int64 if rank == other else np.int32),
                                 name="m.ag.dtype"), "data types", "int64", "int32")
everywhere("broadcast roots differ",
           lambda: hvd.broadcast(x32, root_rank=0 if rank != other else 1, name="m.bc.root"),
           "root", "rank 1")
everywhere("broadcast shape",
           lambda: hvd.broadcast(np.ones((2, 3 + (rank == other)), np.float32), 0,
                                 name="m.bc.shape"), "shape")
everywhere("broadcast dtype",
           lambda: hvd.broadcast(np.ones(3, np.float64 if rank == other else np.float32), 0,
                                 name="m.bc.dtype"), "data types")
everywhere("allreduce dtype",
           lambda: hvd.allreduce(np.ones(3, np.float16 if rank == other else np.float32),
                                 name="m.ar.dtype"), "data types", "float16")
everywhere("allreduce shape",
           lambda: hvd.allreduce(np.ones((3 + (rank == other),), np.float32),
                                 name="m.ar.shape"), "shape")
everywhere("allreduce reduce op",
           lambda: hvd.allreduce(x32, op=hvd.Max if rank == other else hvd.Sum,
                                 name="m.ar.op"), "reduction")
everywhere("allreduce scale",
           lambda: hvd.allreduce(x32, prescale_factor=2.0 if rank == other else 1.0,
                                 name="m.ar.scale"), "scale")
everywhere("op kinds differ",
           lambda: (hvd.allgather(x32, name="m.kind") if rank == other
                    else hvd.allreduce(x32, name="m.kind")), "operations")
everywhere("reducescatter shape",
           lambda: hvd.reducescatter(np.ones((size + (rank == other), 2), np.float32),
                                     op=hvd.Sum, name="m.rs.shape"), "shape")
everywhere("reducescatter op",
           lambda: hvd.reducescatter(np.ones((size, 2), np.float32),
                                     op=hvd.Sum if rank == other else hvd.Average,
                                     name="m.rs.op"), "reduction")
everywhere("alltoall trailing dims",
           lambda: hvd.alltoall(np.ones((size, 2 + (rank == other)), np.float32),
                                name="m.a2a"), "trailing")
everywhere("alltoall dtype",
           lambda: hvd.alltoall(np.ones((size,), np.int8 if rank == other else np.uint8),
                                name="m.a2a.dtype"), "data types")


def group():
    arrays = [np.ones(3, np.float32), np.ones((2 + (rank == other),), np.float32),
              np.ones(4, np.float32)]
    return hvd.grouped_allreduce(arrays, op=hvd.Sum, name="m.group")


everywhere("grouped allreduce, one member mismatched", group, "shape")
everywhere("grouped allreduce, member counts differ",
           lambda: hvd.grouped_allreduce([np.ones(2, np.float32)] * (3 if rank == other else 2),
                                         op=hvd.Sum, name="m.group.count"), "group")

# Bad splits and roots are refused at the call, on every rank that makes them.
I = errors.InvalidArgumentError
rows = np.ones((size + 1, 2), np.float32)
expect_error("alltoall uneven without splits", I, lambda: hvd.alltoall(rows), "splits")
expect_error("alltoall splits sum", I,
             lambda: hvd.alltoall(rows, splits=[1] * size), "sum")
expect_error("alltoall splits count", I,
             lambda: hvd.alltoall(rows, splits=[size + 1]), "per rank")
expect_error("alltoall negative split", I,
             lambda: hvd.alltoall(rows, splits=[-1] + [0] * (size - 2) + [size + 2]),
             "negative")
expect_error("broadcast root out of range", I, lambda: hvd.broadcast(x32, size), "range")
expect_error("broadcast negative root", I, lambda: hvd.broadcast(x32, -1), "range")
still_usable("refusals")

# A tensor negotiated once (so in the response cache) that then disagrees: the cache
# must not hide the mismatch, and the next agreeing call must work again.
for kind, call in (
        ("allgather", lambda bad: hvd.allgather(
            np.ones((2, 3 + bad), np.float32), name="c.ag")),
        ("broadcast", lambda bad: hvd.broadcast(np.ones(3, np.float32), bad, name="c.bc")),
        ("alltoall", lambda bad: hvd.alltoall(
            np.ones((size, 2), np.float64 if bad else np.float32), name="c.a2a")),
        ("reducescatter", lambda bad: hvd.reducescatter(
            np.ones((size + bad, 2), np.float32), op=hvd.Sum, name="c.rs"))):
    for i in range(2):
        call(0)
    everywhere(f"{kind} cached then mismatched", lambda: call(int(rank == other)),
               "rank 1")
    for i in range(2):
        call(0)

# A name already in flight on this rank is refused at the call. The peers submit it only
# after the barrier, so it is surely still in flight when the checking rank repeats it.
for first in (0, other):
    dup = f"dup.{first}"
    if rank == first:
        h = hvd.allgather_async(np.ones((1, 2), np.float32), name=dup)
        expect_error("duplicate name", errors.DuplicateNameError,
                     lambda: hvd.allgather_async(np.ones((1, 2), np.float32), name=dup), dup)
        hvd.barrier()
    else:
        hvd.barrier()
        h = hvd.allgather_async(np.ones((1, 2), np.float32), name=dup)
    check("first of duplicate", hvd.synchronize(h), np.ones((size, 2), np.float32))

# The same names work once the ranks agree, and run through the cache on repeats.
for i in range(3):
    got = hvd.allgather(np.full((rank + 1, 3), rank, np.float32), name="m.ag")
    check("allgather after mismatch", got,
          np.concatenate([np.full((r + 1, 3), r, np.float32) for r in range(size)]))
    got = hvd.broadcast(np.full(3, rank, np.float32), 1, name="m.bc.root")
    check("broadcast after mismatch", got, np.full(3, 1, np.float32))
    got = hvd.grouped_allreduce([np.ones(3, np.float32)] * 3, op=hvd.Sum, name="m.group")
    for g in got:
        check("group after mismatch", g, np.full(3, size, np.float32))
report()
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_mismatches_fail_on_every_rank(np_):
    run_ranks(np_, MISMATCH)


# ---------------------------------------------------------------- join

JOIN = r'''
# Horovod's join semantics: a joined rank takes part in allreduces with zeros, and
# Average still divides by every rank; any other collective raises (AbortedError, a
# HorovodInternalError) on the ranks that submitted it while some rank has joined.
steps = {2: [6, 3], 3: [4, 8, 2]}.get(size) or [3 + (r * 5) % 7 for r in range(size)]
longest = int(np.argmax(steps))
params = np.zeros((4, 3), np.float64)
lr = 0.1
for step in range(steps[rank]):
    active = [r for r in range(size) if steps[r] > step]
    grad = data(rank, (4, 3), "float64", step)
    avg = hvd.allreduce(grad, name="grad.avg", op=hvd.Average)
    expected_avg = np.sum([data(r, (4, 3), "float64", step) for r in active], axis=0) / size
    check(f"join avg step {step}", avg, expected_avg)
    total = hvd.allreduce(data(rank, (5,), "int32", step), name="count.sum", op=hvd.Sum)
    check(f"join sum step {step}", total,
          np.sum([data(r, (5,), "int32", step) for r in active], axis=0).astype(np.int32))
    iavg = hvd.allreduce(data(rank, (5,), "int64", step), name="int.avg", op=hvd.Average)
    check(f"join int average step {step}", iavg,
          np.trunc(np.sum([data(r, (5,), "int64", step) for r in active], axis=0) / size)
          .astype(np.int64))
    grouped = hvd.grouped_allreduce([data(rank, (2,), "float32", step),
                                     data(rank, (3, 1), "float32", step + 1)],
                                    op=hvd.Sum, name="grouped")
    check(f"join group step {step}", grouped[1],
          np.sum([data(r, (3, 1), "float32", step + 1) for r in active], axis=0)
          .astype(np.float32))
    biggest = hvd.allreduce(data(rank, (4,), "int32", step), name="max", op=hvd.Max)
    zeros = [np.zeros(4, np.int32)] * (size - len(active))
    check(f"join max step {step}", biggest,
          np.max([data(r, (4,), "int32", step) for r in active] + zeros, axis=0))
    if len(active) == size:
        gathered = hvd.allgather(data(rank, (rank + 1, 2), "int8", step), name="gather")
        check(f"allgather step {step}", gathered,
              np.concatenate([data(r, (r + 1, 2), "int8", step) for r in active]))
        got = hvd.broadcast(data(rank, (3,), "float32", step), longest, name="bcast")
        check(f"broadcast step {step}", got, data(longest, (3,), "float32", step))
    else:
        joined = [r for r in range(size) if r not in active]
        who = ("rank " if len(joined) == 1 else "ranks ") + ", ".join(map(str, joined))
        expect_error(f"allgather while joined, step {step}", errors.AbortedError,
                     lambda: hvd.allgather(data(rank, (rank + 1, 2), "int8", step),
                                           name="gather"), "allgather", who, "joined")
        expect_error(f"broadcast while joined, step {step}", errors.AbortedError,
                     lambda: hvd.broadcast(data(rank, (3,), "float32", step), longest,
                                           name="bcast"), "broadcast", "joined")
    params -= lr * avg
last = hvd.join()
if last != longest:
    failures.append(f"join returned {last}, expected {longest}")

# Each rank's parameters follow the averages of the steps it ran.
expected_params = np.zeros((4, 3))
for step in range(max(steps)):
    active = [r for r in range(size) if steps[r] > step]
    if rank in active:
        expected_params -= lr * (np.sum([data(r, (4, 3), "float64", step) for r in active],
                                        axis=0) / size)
check("params", params, expected_params)
# As after uneven epochs in training: the longest-running rank's parameters win.
params = hvd.broadcast(params, longest, name="params")

# After the join everything works normally again (all ranks contribute).
got = hvd.allreduce(np.full(2, rank + 1.0), name="grad.avg2", op=hvd.Average)
check("after join", got, np.full(2, (size + 1) / 2.0))

# While rank 0 has joined, only allreduce runs on the others.
if rank == 0:
    second = hvd.join()
else:
    for label, call in [
            ("reducescatter", lambda: hvd.reducescatter(np.ones((size, 2), np.float32),
                                                        name="rs.joined")),
            ("alltoall", lambda: hvd.alltoall(np.ones((size, 2), np.float32),
                                              name="a2a.joined")),
            ("broadcast", lambda: hvd.broadcast(np.ones(2, np.float32), 1, name="bc.joined")),
            ("allgather", lambda: hvd.allgather(np.ones((1, 2), np.float32),
                                                name="ag.joined")),
            ("barrier", hvd.barrier)]:
        expect_error(f"{label} while rank 0 joined", errors.AbortedError, call,
                     label, "rank 0 has joined")
    got = hvd.allreduce(np.ones(2, np.float32), op=hvd.Max, name="max.joined")
    check("max while rank 0 joined", got, np.ones(2, np.float32))
    got = hvd.allreduce(np.full(2, float(rank)), op=hvd.Average, name="avg.joined")
    check("average while rank 0 joined", got, np.full(2, sum(range(1, size)) / size))
    if rank == size - 1:
        # Join last: no other rank submits this allreduce, so it ends only once every
        # other rank has joined (joined ranks take part with zeros).
        got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="wait.for.joins")
        check("allreduce once every other rank joined", got, np.ones(2))
    second = hvd.join()
if second != size - 1:
    failures.append(f"second join returned {second}, expected {size - 1}")
got = hvd.allreduce(np.full(2, rank + 1.0), name="grad.avg3", op=hvd.Sum)
check("after second join", got, np.full(2, size * (size + 1) / 2.0))

# Every rank joins at once: join returns the same rank everywhere.
third = hvd.join()
report(third=third, params=params.tolist())
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_join_uneven_training_loop(np_):
    result = run_ranks(np_, JOIN)
    thirds = {result.result(r)["third"] for r in range(np_)}
    assert len(thirds) == 1 and thirds.pop() in range(np_)
    assert all(result.result(r)["params"] == result.result(0)["params"] for r in range(np_))


LEFT_JOIN = r'''
import signal

class GaveUp(Exception):
    pass

def give_up(signum, frame):
    raise GaveUp()

# Rank 0 joins while the others train on; its caller gives up waiting after 1 s (as a
# test's timeout or Ctrl-C would): the join is left, and rank 0 is a full rank again.
if rank == 0:
    signal.signal(signal.SIGALRM, give_up)
    signal.alarm(1)
    try:
        hvd.join()
        failures.append("join() returned although rank 0 gave up waiting")
    except GaveUp:
        pass
    signal.alarm(0)
else:
    # While rank 0 is joined it takes part with zeros.
    got = hvd.allreduce(np.full(3, float(rank)), op=hvd.Sum, name="left.while")
    check("allreduce while rank 0 is joined", got, np.full(3, float(sum(range(1, size)))))
    time.sleep(2.0)  # until rank 0 has given up
hvd.barrier()
# Every collective works again, rank 0 contributing its own data.
got = hvd.allreduce(np.full(3, rank + 1.0), op=hvd.Sum, name="left.after")
check("allreduce after the join was left", got, np.full(3, size * (size + 1) / 2.0))
check("broadcast after the join was left",
      hvd.broadcast(np.full(2, float(rank)), 1, name="left.bc"), np.full(2, 1.0))
rows = hvd.reducescatter(np.ones((size, 2), np.float32), op=hvd.Sum, name="left.rs")
check("reducescatter after the join was left", rows, np.full((1, 2), float(size), np.float32))
check("allgather after the join was left",
      hvd.allgather(np.full((1, 1), float(rank)), name="left.ag"),
      np.arange(size, dtype=np.float64).reshape(size, 1))
# A later join of every rank ends as usual.
last = hvd.join()
report(last=last)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_a_join_its_caller_gave_up_on_is_left(np_):
    result = run_ranks(np_, LEFT_JOIN)
    lasts = {result.result(r)["last"] for r in range(np_)}
    assert len(lasts) == 1 and lasts.pop() in range(np_)


# ---------------------------------------------------------------- mixed random order

MIXED = r'''
step_dtypes = ["float32", "int32", "float64", "bfloat16", "int8", "float16", "int64", "uint8"]
for step in range(40):
    dt = step_dtypes[step % len(step_dtypes)]
    rng = np.random.default_rng(1000 * rank + step)   # a different order on every rank
    root = step % size
    rows = [(r + step) % 3 for r in range(size)]      # zero rows now and then

    def sp(k):
        return [(k + m + step) % 3 for m in range(size)]

    def chunk(k, m):
        s = sp(k)
        return data(k, (sum(s), 2), dt, step)[sum(s[:m]):sum(s[:m + 1])]

    starters = {
        "allreduce": lambda: hvd.allreduce_async(data(rank, (5,), dt, step), name="mx.ar",
                                                 op=hvd.Sum),
        "allgather": lambda: hvd.allgather_async(data(rank, (rows[rank], 3), dt, step),
                                                 name="mx.ag"),
        "broadcast": lambda: hvd.broadcast_async(data(rank, (2, 2), dt, step), root,
                                                 name="mx.bc"),
        "alltoall": lambda: hvd.alltoall_async(data(rank, (sum(sp(rank)), 2), dt, step),
                                               splits=sp(rank), name="mx.a2a"),
    }
    order = list(starters)
    rng.shuffle(order)
    handles = {kind: starters[kind]() for kind in order}
    if step % 2:
        deadline = time.time() + 60
        while not all(hvd.poll(h) for h in handles.values()):
            if time.time() > deadline:
                raise RuntimeError(f"step {step}: ops never ended")
            time.sleep(0.001)
    waits = list(handles)
    rng.shuffle(waits)
    results = {kind: hvd.synchronize(handles[kind]) for kind in waits}
    check(f"mixed {step} allreduce", results["allreduce"],
          reduce_expected([data(r, (5,), dt, step) for r in range(size)], dt, "sum"))
    check(f"mixed {step} allgather", results["allgather"],
          np.concatenate([data(r, (rows[r], 3), dt, step) for r in range(size)]))
    check(f"mixed {step} broadcast", results["broadcast"], data(root, (2, 2), dt, step))
    got, splits = results["alltoall"]
    check(f"mixed {step} alltoall", got, np.concatenate([chunk(k, rank) for k in range(size)]))
    check(f"mixed {step} alltoall splits", splits, np.array([sp(k)[rank] for k in range(size)]))
stats = hvd.stats()
report(stats=stats)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_mixed_random_order_loop(np_):
    result = run_ranks(np_, MIXED)
    for r in range(np_):
        stats = result.result(r)["stats"]
        assert stats["errors"] == 0, stats
        assert stats["tensors"] >= 40 * 4, stats


# ---------------------------------------------------------------- allgather fusion

FUSED_ALLGATHERS = r'''
# Every step: one async allgather per dtype, rows differing per rank and step, all
# submitted before any wait, so the core sees them in one cycle and fuses them.
for step in range(4):
    handles = []
    for i, dt in enumerate(DTYPES):
        rows = (rank + i + step) % 3
        x = ((np.arange(rows * 5).reshape(rows, 5) + 10 * rank + i) % 7).astype(npdtype(dt))
        handles.append((i, dt, hvd.allgather_async(x, name=f"fag.{i}")))
    for i, dt, h in handles:
        want = np.concatenate([((np.arange(((k + i + step) % 3) * 5).reshape(-1, 5) + 10 * k + i) % 7)
                               .astype(npdtype(dt)) for k in range(size)])
        check(f"step {step} allgather {dt}", hvd.synchronize(h), want)
report(stats=hvd.stats())
'''


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("fusion", ["on", "off"])
def test_allgathers_fuse_into_one_collective(np_, fusion):
    env = {} if fusion == "on" else {"HVDLITE_FUSION_THRESHOLD": "0"}
    result = run_ranks(np_, FUSED_ALLGATHERS, env=env)
    for r in range(np_):
        stats = result.result(r)["stats"]
        if fusion == "on":
            assert stats["fused_collectives"] >= 1, stats
        else:
            assert stats["fused_collectives"] == 0, stats
