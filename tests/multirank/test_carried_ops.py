"""A small cached op that is its rank's only one rides with the coordination round.

On one host the coordination round goes through shared memory; a cached allreduce,
allgather, broadcast, alltoall or reducescatter of at most 16 KiB of host memory that is
a rank's only request writes its data beside the round's bit vector
(ProcessSetState::Carry), and when every member carried the same op, each computes the
result from those copies after the round: the op takes no meeting of its own
(``stats()["carried_collectives"]`` counts them).

In real 2- and 3-rank jobs, each run twice, with ``HVDLITE_CARRY_DATA`` on and off:
every dtype and reduction, scale factors, in place and with ``out=``, a broadcast from
every root, allgathers of a different number of rows from each rank, alltoalls of
uneven splits, reducescatters, a process set, sizes on both sides of the limit, async
ops waited for at once, a rank that has two ops pending while its peer has one (nothing
carried then, results right), and a join. Results are checked against numpy where they
are exact, and every result's bytes must be the same with and without carrying (the
carried reduction reduces in rank order, as the shared-memory allreduce does). The count
of carried collectives is most of a loop's with carrying on and zero with it off.
"""
import pytest

from harness import assert_ok, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import hashlib, json
import numpy as np
import hvdlite as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"wrong": [], "digests": {}, "own": {}}
try:
    from ml_dtypes import bfloat16
except ImportError:
    bfloat16 = None

def contribution(k, n, dtype, seed):
    if dtype == np.bool_:
        return ((np.arange(n) + k + seed) % 3 == 0)
    values = (np.arange(n) * (seed + 1) + 7 * k + seed) % 97
    if np.issubdtype(np.dtype(dtype), np.floating) or dtype is bfloat16:
        values = values / 8.0 - 3.3  # not exact: only the digests compare these
    return values.astype(dtype)

def record(key, array):
    out["digests"][key] = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()

def check(what, got, expected):
    if not np.array_equal(got, expected):
        out["wrong"].append(what)

def carried():
    return hvd.stats()["carried_collectives"]

# A loop of blocking allreduces and broadcasts, every dtype and reduction.
dtypes = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8]
if bfloat16 is not None:
    dtypes.append(bfloat16)
# Across hosts only what no order of reduction changes is carried: exact (broadcasts,
# integers) and, with 2 ranks, float_sums (floats' Sum, Average, Product).
before, calls, exact_calls, float_sums = carried(), 0, 0, 0
kinds = {}  # kind: [calls, carried]

def counted(kind, call):
    before = carried()
    result = call()
    tally = kinds.setdefault(kind, [0, 0])
    tally[0] += 1
    tally[1] += carried() - before
    return result

for step in range(12):
    for dt in dtypes:
        key = np.dtype(dt).name
        mine = contribution(rank, 300, dt, step)
        exact = not np.issubdtype(np.dtype(dt), np.floating) and dt is not bfloat16
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            got = hvd.allreduce(mine, name=f"ar.{key}.{op}", op=op)
            record(f"ar.{key}.{op}.{step}", got)
            calls += 1
            exact_calls += exact
            float_sums += not exact and op not in (hvd.Min, hvd.Max)
        got = hvd.allreduce(mine, name=f"scaled.{key}", op=hvd.Average, prescale_factor=0.75,
                            postscale_factor=3.0)
        record(f"scaled.{key}.{step}", got)
        root = step % size
        got = hvd.broadcast(mine, root, name=f"bc.{key}")
        check(["broadcast", key, step], got, contribution(root, 300, dt, step))
        # An allgather of rows of every rank's own count (rank r: r + 1 rows).
        rows = [contribution(k, (k + 1) * 30, dt, step).reshape(k + 1, 30) for k in range(size)]
        got = counted("allgather", lambda: hvd.allgather(rows[rank], name=f"ag.{key}"))
        check(["allgather", key, step], got, np.concatenate(rows))
        # An alltoall: rank k sends k + j + 1 rows of 20 to rank j.
        sent = [contribution(k, sum(k + j + 1 for j in range(size)) * 20, dt, step).reshape(-1, 20)
                for k in range(size)]
        got, got_splits = counted("alltoall", lambda: hvd.alltoall(
            sent[rank], splits=[rank + j + 1 for j in range(size)], name=f"a2a.{key}"))
        check(["alltoall", key, step], got, np.concatenate(
            [sent[k][sum(k + j + 1 for j in range(rank)):][:k + rank + 1] for k in range(size)]))
        check(["alltoall splits", key, step], got_splits, [k + rank + 1 for k in range(size)])
        # A reducescatter of 3 rows per rank (its bits compared with carrying off); those
        # of integers are carried everywhere, of floats where the data path reduces in a
        # carried copy's order (one host; hosts of several ranks, as an allreduce over
        # the layers: ProcessSetState::ReducescatterByLayers).
        op = hvd.Sum if step % 2 else hvd.Average
        got = counted("reducescatter" if exact else "float reducescatter", lambda: hvd.reducescatter(
            contribution(rank, size * 3 * 20, dt, step).reshape(-1, 20), name=f"rs.{key}.{op}", op=op))
        out["own"][f"rs.{key}.{step}"] = hashlib.sha256(got.tobytes()).hexdigest()  # a shard
        # And its rows against numpy's (near, for floats; small integers that cannot wrap).
        if not exact or (op is hvd.Sum and np.dtype(dt).itemsize >= 4):
            inputs = [contribution(k, size * 3 * 20, dt, step).astype(np.float64).reshape(-1, 20)
                      for k in range(size)]
            want = sum(inputs)[rank * 3:(rank + 1) * 3] / (size if op is hvd.Average else 1)
            if not np.allclose(np.asarray(got, np.float64), want, rtol=0.02, atol=0.05):
                out["wrong"].append(["reducescatter rows", key, str(op), step])
        if not exact:  # scaled on the way in and out (a float sum: order-free at 2 ranks)
            got = counted("float reducescatter", lambda: hvd.reducescatter(
                contribution(rank, size * 3 * 20, dt, step).reshape(-1, 20), name=f"rs.scaled.{key}",
                op=hvd.Sum, prescale_factor=0.75, postscale_factor=3.0))
            out["own"][f"rs.scaled.{key}.{step}"] = hashlib.sha256(got.tobytes()).hexdigest()
            inputs = [contribution(k, size * 3 * 20, dt, step).astype(np.float64).reshape(-1, 20)
                      for k in range(size)]
            want = sum(inputs)[rank * 3:(rank + 1) * 3] * 0.75 * 3.0
            if not np.allclose(np.asarray(got, np.float64), want, rtol=0.02, atol=0.1):
                out["wrong"].append(["scaled reducescatter rows", key, step])
            calls += 1
            float_sums += 1
        calls += 5  # scaled, broadcast, allgather, alltoall, reducescatter
        exact_calls += 3 + 2 * exact
        float_sums += 2 * (not exact)
    # Integers: exact against numpy.
    every = [contribution(k, 300, np.int64, step) for k in range(size)]
    check(["sum int64", step], hvd.allreduce(every[rank], name="exact.sum", op=hvd.Sum), sum(every))
    check(["max int64", step], hvd.allreduce(every[rank], name="exact.max", op=hvd.Max),
          np.max(every, axis=0))
    flags = [contribution(k, 64, np.bool_, step) for k in range(size)]
    check(["bool min", step], hvd.allreduce(flags[rank], name="exact.bool", op=hvd.Min),
          np.min(flags, axis=0))
    # In place, and into an out= buffer.
    buf = every[rank].copy()
    hvd.allreduce(buf, name="inplace", op=hvd.Sum, out=buf)
    check(["in place", step], buf, sum(every))
    target = np.empty_like(every[rank])
    hvd.broadcast(every[rank], size - 1, name="bc.out", out=target)
    check(["broadcast out", step], target, every[size - 1])
    calls += 5
    exact_calls += 5
out["loop"] = {"calls": calls, "exact": exact_calls, "float_sums": float_sums,
               "carried": carried() - before, "kinds": kinds}

# Sizes: 16 KiB may be carried, anything larger never is.
for n, tag in ((4096, "at limit"), (4097, "over limit"), (60000, "large")):
    every = [contribution(k, n, np.int32, 1) for k in range(size)]
    before = carried()
    for i in range(6):
        check([tag, i], hvd.allreduce(every[rank], name=f"size.{n}", op=hvd.Sum), sum(every))
    out[tag] = carried() - before

# An async op waited for at once: its rank's only op, so carried too.
before = carried()
for step in range(10):
    every = [contribution(k, 500, np.int64, step) for k in range(size)]
    check(["sync", step], hvd.synchronize(hvd.allreduce_async(every[rank], name="sync", op=hvd.Sum)),
          sum(every))
out["sync"] = carried() - before

# The last rank has two ops pending where the others have one: never carried as a
# pair, and both right (the first may still go alone on the others' side).
for step in range(10):
    a = [contribution(k, 200, np.int64, step) for k in range(size)]
    b = [contribution(k, 300, np.int64, step + 1) for k in range(size)]
    if rank == size - 1:
        ha = hvd.allreduce_async(a[rank], name="pair.a", op=hvd.Sum)
        hb = hvd.allreduce_async(b[rank], name="pair.b", op=hvd.Sum)
        got_a, got_b = hvd.synchronize(ha), hvd.synchronize(hb)
    else:
        got_a = hvd.allreduce(a[rank], name="pair.a", op=hvd.Sum)
        got_b = hvd.allreduce(b[rank], name="pair.b", op=hvd.Sum)
    check(["pair a", step], got_a, sum(a))
    check(["pair b", step], got_b, sum(b))

# A process set of ranks 0 and 1 (3 ranks: rank 2 takes no part); of 6 ranks on 3 hosts
# of 2, ranks 0-3: two hosts of 2, coordinated by the set's own layered round, float
# sums carried there too (the same bits as its hierarchical allreduce: the digests).
if size > 2:
    members = [0, 1, 2, 3] if size >= 6 else [0, 1]
    group = hvd.add_process_set(members)
    if rank in group.ranks:
        before = carried()
        for step in range(10):
            every = [contribution(k, 700, np.int32, step) for k in members]
            check(["set", step], hvd.allreduce(every[rank], name="set.ar", op=hvd.Sum,
                                               process_set=group), sum(every))
            check(["set bc", step], hvd.broadcast(every[rank], 1, name="set.bc",
                                                  process_set=group), every[1])
            got = hvd.allreduce(contribution(rank, 700, np.float32, step), name="set.f32",
                                op=hvd.Average, process_set=group)
            out["own"][f"set.f32.{step}"] = hashlib.sha256(got.tobytes()).hexdigest()
        out["set"] = carried() - before
    hvd.barrier()
    hvd.remove_process_set(group)

# A join: the last rank joins early; the others' allreduces (with its zeros) stay right.
for step in range(3):
    every = [contribution(k, 100, np.int64, step) for k in range(size)]
    check(["before join", step], hvd.allreduce(every[rank], name="joined", op=hvd.Sum), sum(every))
if rank == size - 1:
    hvd.join()
else:
    for step in range(3):
        every = [contribution(k, 100, np.int64, step) for k in range(size - 1)]
        check(["while joined", step], hvd.allreduce(every[rank], name="joined", op=hvd.Sum),
              sum(every))
    hvd.join()
every = [contribution(k, 100, np.int64, 9) for k in range(size)]
check(["after join"], hvd.allreduce(every[rank], name="joined", op=hvd.Sum), sum(every))
print("HVDLITE_RESULT", json.dumps(out), flush=True)
hvd.shutdown()
"""


def carried_runs(run_job_with, np_, across_hosts=False):
    """Runs SCRIPT with carrying on and off through ``run_job_with(env)`` (a JobResult);
    checks every result against numpy and each other, and the counts; returns the
    reports of both runs. across_hosts: one rank per host (the direct round), where only
    the calls no order of reduction changes are carried."""
    runs = {}
    for carry in ("1", "0"):
        result = assert_ok(run_job_with({"HVDLITE_CARRY_DATA": carry}))
        runs[carry] = [result.result(r) for r in range(np_)]
        for r, body in enumerate(runs[carry]):
            assert body["wrong"] == [], f"rank {r} (HVDLITE_CARRY_DATA={carry}): {body['wrong'][:10]}"
    on, off = runs["1"], runs["0"]
    for r in range(np_):
        # Every result, bit for bit, as without carrying, on every rank.
        assert on[r]["digests"] == off[r]["digests"], f"rank {r}: carried results differ"
        assert on[r]["own"] == off[r]["own"], f"rank {r}: carried reducescatter results differ"
        assert on[r]["digests"] == on[0]["digests"], f"rank {r}: results differ across ranks"
        # Carried: most of a loop of blocking calls (a peer's idle round may meet a
        # caller's before its op came), the 16 KiB op, the waited-for async op, the
        # process set's; never a larger op, never with carrying off.
        loop = on[r]["loop"]
        carriable = loop["calls"]
        if across_hosts:
            carriable = loop["exact"] + (loop["float_sums"] if np_ == 2 else 0)
        assert carriable // 2 <= loop["carried"] <= carriable, f"rank {r}: {loop}"
        kinds = ("allgather", "alltoall", "reducescatter")  # each carried too
        if not across_hosts:  # and float reducescatters, reduced in the data path's order
            kinds += ("float reducescatter",)
        for kind in kinds:
            calls, kind_carried = loop["kinds"][kind]
            assert calls // 2 <= kind_carried, f"rank {r}: {kind} {loop}"
        assert on[r]["at limit"] >= 3 and on[r]["sync"] >= 5, f"rank {r}: {on[r]}"
        assert on[r]["over limit"] == 0 and on[r]["large"] == 0, f"rank {r}: {on[r]}"
        if np_ > 2 and r < (4 if np_ >= 6 else 2):
            assert on[r]["set"] >= 15, f"rank {r}: {on[r]}"
        assert off[r]["loop"]["carried"] == 0 and off[r]["sync"] == 0, f"rank {r}: {off[r]}"
    return on, off


@pytest.mark.parametrize("np_", [2, 3])
def test_carried_ops_give_the_same_bits_as_the_data_path(np_):
    carried_runs(lambda env: run_job(np_, SCRIPT, timeout=240, env=env), np_)
