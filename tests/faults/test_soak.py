"""Load: a soak of >= 100,000 collective operations on 3 ranks.

Each step every rank submits the same random batch of ops (allreduce of several dtypes
and reductions, grouped allreduce, allgather, broadcast, alltoall, reducescatter) in its
own random order, then checks every result: inputs derive from (step, op, rank), so each
rank knows what every other rank sent. Sizes are 0 B to 8 MiB, mostly small so that the
soak takes minutes on two cores; half of the names keep their shape from step to step
(response-cache hits, like gradients), the other half change it (cache invalidations).
Resident memory is measured after a warm-up and at the end, and printed.

HVDLITE_SOAK_OPS sets the number of ops (default 100,000).
"""
import os

import pytest

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("native")]

NP = 3
OPS = int(os.environ.get("HVDLITE_SOAK_OPS", "100000"))
RSS_GROWTH_LIMIT_MIB = 8

SCRIPT = r'''
import json, os, sys, time
import numpy as np
import hvdlite as hvd

TOTAL = int(sys.argv[1])
hvd.init()
r, n = hvd.rank(), hvd.size()
PER_STEP = 100
STEPS = -(-TOTAL // PER_STEP)
WARMUP = max(1, STEPS // 5)
LARGE = 8 << 20
LARGE_P = float(os.environ.get("SOAK_LARGE_P", 1 / 2000))
KINDS = ["ar"] * 12 + ["grp", "ag", "bc", "a2a", "rs"]
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8]

def rss_mib():
    # Free heap pages go back to the OS first (glibc), so RSS shows what the process
    # really keeps (live memory and fragmentation it cannot return), not what malloc
    # happens to cache at that moment.
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def size_for(rng, step, i):
    # Mostly small; one op in ~2000 is large (and a warm-up step has one of each size).
    if (step == 1 and i == 0) or rng.random() < LARGE_P:
        return int(rng.integers(LARGE // 2, LARGE + 1))
    return int(rng.choice([0, 1, 7, 64, 512, 4096, 30000], p=[.03, .17, .2, .2, .2, .15, .05]))

def plan(step):
    """The same list of op specs on every rank."""
    rng = np.random.default_rng(step)
    specs = []
    for i in range(PER_STEP):
        steady = i % 2 == 0
        # A steady name keeps its op and parameters from step to step, like a gradient.
        # Gradient-like: a float32 Sum allreduce of a size fixed per name.
        pick = np.random.default_rng(10**6 + i) if steady else rng
        kind = "ar" if steady else KINDS[int(rng.integers(len(KINDS)))]
        dtype = np.float32 if steady else DTYPES[int(rng.integers(len(DTYPES)))]
        nbytes = int(pick.choice([4, 256, 4096, 40000])) if steady else size_for(rng, step, i)
        elems = max(0, nbytes // np.dtype(dtype).itemsize)
        op = "sum" if steady else str(rng.choice(["sum", "min", "max"]))
        root = int(pick.integers(n))
        specs.append((i, str(kind), dtype, elems, str(op), root, steady))
    return specs

def data(step, i, rank, elems, dtype):
    # Small integers: sums over ranks are exact in every dtype.
    return ((np.arange(elems, dtype=np.int64) + step + i + rank) % 5).astype(dtype)

def submit(step, spec):
    i, kind, dtype, elems, op, root, steady = spec
    name = f"{kind}.{i}"
    x = data(step, i, r, elems, dtype)
    hop = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max}[op]
    if kind == "ar":
        return hvd.allreduce_async(x, name=name, op=hop)
    if kind == "grp":
        return hvd.grouped_allreduce_async([x, x[: elems // 2]], name=name, op=hop)
    if kind == "ag":
        rows = elems // 4 if r % 2 else elems // 8  # ranks differ in the first dim
        return hvd.allgather_async(data(step, i, r, rows, dtype), name=name)
    if kind == "bc":
        return hvd.broadcast_async(x, root, name=name)
    rows = elems // n * n
    y = data(step, i, r, rows, dtype).reshape(n, -1) if rows else np.zeros((n, 0), dtype)
    if kind == "a2a":
        return hvd.alltoall_async(y, name=name)
    return hvd.reducescatter_async(y, name=name, op=hop)

def expected_reduce(step, i, elems, dtype, op):
    parts = [data(step, i, k, elems, dtype).astype(np.int64) for k in range(n)]
    fn = {"sum": np.sum, "min": np.min, "max": np.max}[op]
    return fn(np.stack(parts), axis=0) if elems else np.zeros(0, np.int64)

def check(step, spec, out):
    i, kind, dtype, elems, op, root, steady = spec
    if kind == "ar":
        want = expected_reduce(step, i, elems, dtype, op)
        assert out.dtype == dtype and np.array_equal(out.astype(np.int64), want), (step, spec)
    elif kind == "grp":
        full = expected_reduce(step, i, elems, dtype, op)
        assert np.array_equal(out[0].astype(np.int64), full), (step, spec)
        assert np.array_equal(out[1].astype(np.int64), full[: elems // 2]), (step, spec)
    elif kind == "ag":
        want = np.concatenate([data(step, i, k, elems // 4 if k % 2 else elems // 8, dtype)
                               for k in range(n)])
        assert np.array_equal(out, want), (step, spec)
    elif kind == "bc":
        assert np.array_equal(out, data(step, i, root, elems, dtype)), (step, spec)
    elif kind == "a2a":
        got, splits = out
        rows = elems // n * n
        cols = rows // n
        want = [data(step, i, k, rows, dtype).reshape(n, -1)[r] if rows else np.zeros(0, dtype)
                for k in range(n)]
        assert list(splits) == [1] * n, (step, spec, splits)
        assert np.array_equal(got.reshape(-1), np.concatenate(want)), (step, spec)
    else:
        rows = elems // n * n
        if rows:
            parts = np.stack([data(step, i, k, rows, dtype).astype(np.int64).reshape(n, -1)
                              for k in range(n)])
            fn = {"sum": np.sum, "min": np.min, "max": np.max}[op]
            want = fn(parts, axis=0)[r]
            assert np.array_equal(out.reshape(-1).astype(np.int64), want), (step, spec)

order_rng = np.random.default_rng(1000 + r)  # each rank its own submission order
t0 = time.monotonic()
ops = 0
rss_after_warmup = None
for step in range(STEPS):
    specs = plan(step)
    order = order_rng.permutation(len(specs))
    handles = {}
    for k in order:
        handles[int(k)] = submit(step, specs[k])
    for k in order_rng.permutation(len(specs)):  # and its own order of waiting
        check(step, specs[k], hvd.synchronize(handles[int(k)]))
    ops += len(specs)
    if step == WARMUP:
        rss_after_warmup = rss_mib()
        t_warm, ops_warm = time.monotonic(), ops
elapsed = time.monotonic() - t0
rss_end = rss_mib()
stats = hvd.stats()
print("HVDLITE_RESULT", json.dumps({
    "ops": ops, "seconds": elapsed, "rss_warm_mib": rss_after_warmup, "rss_end_mib": rss_end,
    "ops_after_warmup": ops - ops_warm, "stats": stats}))
hvd.shutdown()
'''


def test_soak_100k_random_ops_on_3_ranks():
    result = assert_ok(run_job(NP, SCRIPT, timeout=840, args=(OPS,)))
    lines = []
    for r in range(NP):
        out = result.result(r)
        growth = out["rss_end_mib"] - out["rss_warm_mib"]
        st = out["stats"]
        lines.append(f"rank {r}: {out['ops']} ops in {out['seconds']:.1f} s; RSS "
                     f"{out['rss_warm_mib']:.1f} MiB after warm-up -> {out['rss_end_mib']:.1f} "
                     f"MiB at the end ({growth:+.2f} MiB over {out['ops_after_warmup']} ops); "
                     f"cache hits {st['cache_hits']}, misses {st['cache_misses']}, "
                     f"collectives {st['collectives']} ({st['fused_collectives']} fused), "
                     f"errors {st['errors']}")
    print("\n" + "\n".join(lines))
    for r in range(NP):
        out = result.result(r)
        assert out["ops"] >= OPS
        assert out["stats"]["errors"] == 0, describe(result)
    worst = max(result.result(r)["rss_end_mib"] - result.result(r)["rss_warm_mib"]
                for r in range(NP))
    # (With malloc_trim before each reading RSS grows 1-3 MiB over the run.)
    assert worst < RSS_GROWTH_LIMIT_MIB, (f"RSS grew {worst:.1f} MiB after warm-up (limit "
                                          f"{RSS_GROWTH_LIMIT_MIB} MiB):\n" + "\n".join(lines))
