"""Horovod's semantics on 2 and 3 real ranks: join, one rank refusing an op the others
submitted, and the int16/uint16 types.

* join: a joined rank takes part in allreduces with zeros and Average still divides by
  every rank; allgather, broadcast, alltoall and reducescatter raise (a RuntimeError)
  on the ranks that submitted them; ``join()`` returns the same rank everywhere, the
  last one to join.
* refusal: when rank 1 rejects a tensor at the call (bad dtype, non-contiguous,
  mismatched splits...) that the other ranks submitted, they fail with AbortedError
  naming rank 1 within seconds: the jobs run with a stall shutdown time far above their
  own timeout, so a wait for a stall would fail the test by timing out.
"""
import pytest

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

# Long enough that a job which waited for a stall would hit its own timeout first.
NO_STALL = {"HVDLITE_STALL_SHUTDOWN_TIME": "600", "HVDLITE_STALL_CHECK_TIME": "600"}

PRELUDE = r'''
import json
import numpy as np
import torch
import hvdlite.torch as hvd
from hvdlite import errors

torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
failures = []


def check(label, got, expected):
    got, expected = np.asarray(got), np.asarray(expected)
    same = (np.allclose(got, expected, rtol=1e-6, atol=0) if got.dtype.kind == "f"
            else np.array_equal(got, expected))
    if got.shape != expected.shape or got.dtype != expected.dtype or not same:
        failures.append(f"{label}: got {got.tolist()}, expected {expected.tolist()}")


def expect(label, cls, fn, *fragments):
    try:
        fn()
    except cls as e:
        missing = [f for f in fragments if f not in str(e)]
        if missing:
            failures.append(f"{label}: {str(e)!r} lacks {missing}")
        return
    except Exception as e:
        failures.append(f"{label}: raised {type(e).__name__}: {e}")
        return
    failures.append(f"{label}: did not raise {cls.__name__}")


def report(**extra):
    print("HVDLITE_RESULT " + json.dumps({"failures": failures, **extra}), flush=True)
'''

JOIN_BODY = r'''
# As Horovod's own join test: two tensors (fused) of shapes 5^d and 17^d, ints and
# floats, cached or not, each rank in turn joining first. Integer Average truncates
# toward zero (Horovod's test divides with rounding_mode='trunc'); the joined rank
# adds zeros.
returned = []
for first in range(size):
    cases = [(dtype, dim) for dtype in (torch.int32, torch.int64) for dim in (1, 2, 3)]
    cases += [(dtype, 2) for dtype in (torch.float32, torch.float64, torch.int16)]
    for dtype, dim in cases:
        for caching in (False, True):
            g = torch.Generator().manual_seed(1234)
            a = torch.randint(-100, 100, (5,) * dim, generator=g).to(dtype)
            b = torch.randint(-100, 100, (17,) * dim, generator=g).to(dtype)
            if caching:
                hvd.synchronize(hvd.allreduce_async(a, name="tensor_a", op=hvd.Average))
                hvd.synchronize(hvd.allreduce_async(b, name="tensor_b", op=hvd.Average))
            if rank == first:
                returned.append(hvd.join())
                continue
            ha = hvd.allreduce_async(a, name="tensor_a", op=hvd.Average)
            hb = hvd.allreduce_async(b, name="tensor_b", op=hvd.Average)
            got_a, got_b = hvd.synchronize(ha), hvd.synchronize(hb)
            returned.append(hvd.join())
            for label, t, got in (("a", a, got_a), ("b", b, got_b)):
                total = t.double() * (size - 1)
                exp = (torch.trunc(total / size) if not dtype.is_floating_point
                       else total / size).to(dtype)
                check(f"join avg {label} first={first} {dtype} dim={dim} cache={caching}", got,
                      exp.numpy())
# Every rank's join returned the same (last-joined) rank, never the first to join
# when another rank joined after it.
everyone = hvd.allgather_object(returned)
if any(r != everyone[0] for r in everyone):
    failures.append(f"join returned different values on different ranks: {everyone}")

# Collectives other than allreduce raise on the ranks that submitted them while a
# rank has joined, with Horovod's exception base (RuntimeError); the job goes on.
t = torch.ones(size, 3)
if rank == 0:
    hvd.join()
else:
    for label, call in (("allgather", lambda: hvd.allgather(t, name="j.ag")),
                        ("broadcast", lambda: hvd.broadcast(t, 1, name="j.bc")),
                        ("alltoall", lambda: hvd.alltoall(t, name="j.a2a")),
                        ("reducescatter", lambda: hvd.reducescatter(t, name="j.rs"))):
        expect(f"{label} while rank 0 joined", RuntimeError, call, label, "joined")
    got = hvd.allreduce(torch.full((2,), 2.0), op=hvd.Min, name="j.min")
    check("min while rank 0 joined (its zeros count)", got, np.zeros(2, np.float32))
    hvd.join()
check("after join", hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after"),
      np.full(2, float(size), np.float32))
report()
'''

REFUSE_BODY = r'''
import hvdlite

# Each case: rank 1 makes the call with a bad tensor; the others submit a good one of
# the same name (given, or automatic: every rank's counter advances alike).
strided = torch.ones(6, 4)[:, ::2]
cases = [
    ("allreduce dtype", lambda bad, name: hvd.allreduce(
        torch.ones(3, dtype=torch.complex64) if bad else torch.ones(3), name=name)),
    ("allreduce layout", lambda bad, name: hvd.allreduce(
        strided if bad else torch.ones(6, 2), name=name)),
    ("allgather dtype", lambda bad, name: hvd.allgather(
        torch.ones(2, dtype=torch.uint16) if bad else torch.ones(2), name=name)),
    ("broadcast root", lambda bad, name: hvd.broadcast(
        torch.ones(2), size + 5 if bad else 0, name=name)),
    ("alltoall splits", lambda bad, name: hvd.alltoall(
        torch.ones(size, 2), splits=[size + 1] + [0] * (size - 1) if bad else None,
        name=name)),
    ("reducescatter op", lambda bad, name: hvd.reducescatter(
        torch.ones(size, 2), op=(hvd.Adasum if bad else hvd.Sum), name=name)),
    ("grouped allreduce member", lambda bad, name: hvd.grouped_allreduce(
        [torch.ones(2), torch.ones(2, dtype=torch.complex64) if bad else torch.ones(2)],
        name=name)),
    # numpy's out: a bad one in a call that otherwise repeats a kept one (step 1) is
    # refused as in a first call.
    ("numpy broadcast out", lambda bad, name: hvdlite.broadcast(
        np.ones(2, np.float32), 0, name=name, out=np.ones(3, np.float32) if bad else None)),
    ("numpy reducescatter out", lambda bad, name: hvdlite.reducescatter(
        np.ones((size, 2), np.float32), op=hvdlite.Sum, name=name,
        out=np.ones((1, 2), np.float64) if bad else None)),
]
for step in range(2):  # the second round finds the names in the response cache
    for label, call in cases:
        for name in (f"{label}.named", None):
            # Warm the cache under the same name (named cases only): every rank ok.
            if name is not None and step == 1:
                call(False, name)
            if rank == 1:
                expect(f"{label} ({name}) refused on rank 1", errors.InvalidArgumentError,
                       lambda: call(True, name))
            else:
                expect(f"{label} ({name}) on rank {rank}", errors.AbortedError,
                       lambda: call(False, name), "rank 1 refused")
    # The job is usable and in step after every refusal.
    check(f"usable after round {step}", hvd.allreduce(torch.ones(2), op=hvd.Sum),
          np.full(2, float(size), np.float32))
report()
'''

DTYPE_BODY = r'''
for dtype in (torch.int16,):
    x = (torch.arange(12).reshape(3, 4) * (rank + 1) - 7).to(dtype)
    each = [(torch.arange(12).reshape(3, 4) * (r + 1) - 7) for r in range(size)]
    check("int16 sum", hvd.allreduce(x, op=hvd.Sum, name="i16.sum"),
          sum(each).to(dtype).numpy())
    check("int16 max", hvd.allreduce(x, op=hvd.Max, name="i16.max"),
          torch.stack(each).max(0).values.to(dtype).numpy())
    check("int16 average", hvd.allreduce(x, op=hvd.Average, name="i16.avg"),
          torch.trunc(sum(each).double() / size).to(dtype).numpy())
    check("int16 allgather", hvd.allgather(x, name="i16.ag"), torch.cat(each).to(dtype).numpy())
    check("int16 broadcast", hvd.broadcast(x, size - 1, name="i16.bc"), each[-1].to(dtype).numpy())
    y = torch.arange(size * 2, dtype=dtype) + rank * 100
    got = hvd.alltoall(y, name="i16.a2a")
    check("int16 alltoall", got, torch.cat([torch.arange(size * 2)[rank * 2:rank * 2 + 2] + r * 100
                                           for r in range(size)]).to(dtype).numpy())
# torch.uint16 is refused as horovod.torch refuses it, on every rank alike.
expect("uint16 refused", errors.InvalidArgumentError,
       lambda: hvd.allreduce(torch.ones(2, dtype=torch.uint16), name="u16"), "unsupported dtype")
# ... with an error that is also the RuntimeError horovod.torch raises for such a type.
expect("uint16 refused as RuntimeError", RuntimeError,
       lambda: hvd.allgather(torch.ones(2, dtype=torch.uint16), name="u16.ag"), "u16.ag")
check("usable", hvd.allreduce(torch.ones(1), op=hvd.Sum, name="u16.after"),
      np.full(1, float(size), np.float32))
report()
'''


SET_BODY = r'''
# Process set {1, 2} of 3 ranks: its own refusals, grouped ops and Adasum's limit.
import hvdlite

ps = hvd.add_process_set([1, 2])
if rank in (1, 2):
    set_rank = rank - 1
    for name in ("ps.refused", None):
        # Rank 2 (set rank 1) refuses; rank 1 learns it, named by its global rank.
        if rank == 2:
            expect(f"refused on rank 2 ({name})", errors.InvalidArgumentError,
                   lambda: hvd.allreduce(torch.ones(3, dtype=torch.complex64), name=name,
                                         process_set=ps))
        else:
            expect(f"aborted on rank 1 ({name})", errors.AbortedError,
                   lambda: hvd.allreduce(torch.ones(3), name=name, process_set=ps),
                   "rank 2 refused", "process set")

    def part(r, i):
        return torch.arange(4 * (i + 1), dtype=torch.float32).reshape(-1, 2) * (r + 1) + i

    xs = [part(rank, i) for i in range(2)]
    got = hvd.grouped_allgather(xs, name="ps.gag", process_set=ps)
    np_got = hvdlite.grouped_allgather([x.numpy() for x in xs], process_set=ps)
    for i in range(2):
        expected = torch.cat([part(r, i) for r in (1, 2)]).numpy()
        check(f"set grouped allgather {i}", got[i], expected)
        check(f"set grouped allgather {i} (numpy)", np_got[i], expected)
    got = hvd.grouped_reducescatter(xs, name="ps.grs", op=hvd.Sum, process_set=ps)
    np_got = hvdlite.grouped_reducescatter([x.numpy() for x in xs], op=hvdlite.Sum,
                                           process_set=ps)
    for i in range(2):
        full = (part(1, i) + part(2, i)).numpy()
        rows = full.shape[0]
        start = set_rank * (rows // 2) + min(set_rank, rows % 2)
        mine = full[start:start + rows // 2 + (1 if set_rank < rows % 2 else 0)]
        check(f"set grouped reducescatter {i}", got[i], mine)
        check(f"set grouped reducescatter {i} (numpy)", np_got[i], mine)
    expect("Adasum in a set", errors.InvalidArgumentError,
           lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum, name="ps.adasum",
                                 process_set=ps), "global process set")
    check("set usable", hvd.allreduce(torch.ones(2), op=hvd.Sum, name="ps.after",
                                      process_set=ps), np.full(2, 2.0, np.float32))
check("global usable", hvd.allreduce(torch.ones(2), op=hvd.Sum, name="g.after"),
      np.full(2, float(size), np.float32))
report()
'''


def _run(np_, body, **kwargs):
    result = assert_ok(run_job(np_, PRELUDE + body, **kwargs))
    problems = [f"rank {r}: {f}" for r in range(np_) for f in result.result(r)["failures"]]
    assert not problems, "\n".join(problems) + "\n" + describe(result)
    return result


@pytest.mark.parametrize("np_", [2, 3])
def test_join_follows_horovod(np_):
    _run(np_, JOIN_BODY, timeout=200)


@pytest.mark.parametrize("np_", [2, 3])
def test_a_refusing_rank_fails_the_others_at_once(np_):
    # 36 refusals, each answered within a cycle or two; a wait for the stall time
    # (600 s) on any of them would exceed the job's timeout.
    _run(np_, REFUSE_BODY, timeout=150, env=NO_STALL)


@pytest.mark.parametrize("np_", [2, 3])
def test_int16_collectives_and_uint16_refusal(np_):
    _run(np_, DTYPE_BODY, timeout=120)


def test_refusals_and_grouped_ops_in_a_process_set():
    # A wait for the stall time (600 s) on the refusal would exceed the job's timeout.
    _run(3, SET_BODY, timeout=150, env=NO_STALL)


ERROR_TYPES_BODY = r'''
# Each refusal raises our own class (an HvdliteError) that is also the class Horovod
# raises for the same call, so handlers written for Horovod catch it.
import time
import hvdlite


def refused(label, horovod_class, fn):
    try:
        fn()
    except Exception as e:
        if not isinstance(e, errors.HvdliteError):
            failures.append(f"{label}: {type(e).__name__} is not an HvdliteError")
        if not isinstance(e, horovod_class):
            failures.append(f"{label}: {type(e).__mro__} is not a {horovod_class.__name__}")
        return
    failures.append(f"{label}: did not raise")


rows = torch.ones(size, 2)
# horovod.torch: its core aborts a reducescatter that is not Sum or Average (RuntimeError).
refused("reducescatter Adasum", RuntimeError,
        lambda: hvd.reducescatter(rows, op=hvd.Adasum, name="e.rs"))
refused("grouped_reducescatter Adasum", RuntimeError,
        lambda: hvd.grouped_reducescatter([rows], op=hvd.Adasum, name="e.grs"))
refused("numpy reducescatter Adasum", RuntimeError,
        lambda: hvdlite.reducescatter(rows.numpy(), op=hvdlite.Adasum, name="e.nrs"))
# ValueError: the checks horovod.torch makes in Python or at enqueue (invalid argument).
refused("unsupported dtype", ValueError,
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64), name="e.dt"))
refused("unsupported dtype (RuntimeError too)", RuntimeError,
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64), name="e.dt2"))
refused("alltoall splits", ValueError,
        lambda: hvd.alltoall(torch.ones(3), splits=torch.tensor([2] * size), name="e.a2a"))
refused("broadcast root out of range", ValueError,
        lambda: hvd.broadcast(torch.ones(2), size, name="e.bc"))
# The name in flight: rank 0 submits it a second later, so it cannot finish meanwhile.
if rank == 0:
    time.sleep(1.0)
held = hvd.allreduce_async(torch.ones(2), name="e.dup")
if rank != 0:
    refused("duplicate name", ValueError,
            lambda: hvd.allreduce_async(torch.ones(2), name="e.dup"))
hvd.synchronize(held)
ps = hvd.add_process_set(list(range(size - 1)))
if ps.included():
    # Horovod: "Adasum does not support non-global process sets yet."
    refused("Adasum in a set", NotImplementedError,
            lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum, name="e.ps", process_set=ps))
else:
    refused("outside the set", ValueError,
            lambda: hvd.allreduce(torch.ones(2), name="e.out", process_set=ps))
hvd.remove_process_set(ps)
check("usable after", hvd.allreduce(torch.ones(2), op=hvd.Sum, name="e.after"),
      np.full(2, float(size), np.float32))
hvd.shutdown()
# Horovod's rank()/size() raise ValueError before init, its collectives RuntimeError.
refused("rank() after shutdown", ValueError, hvd.rank)
refused("allreduce after shutdown", RuntimeError, lambda: hvd.allreduce(torch.ones(2)))
report()
'''

RESTART_BODY = r'''
# init() after shutdown() starts hvdlite again (as Horovod's reset of its init flag
# allows): MPI is finalized at exit, not at shutdown. The sets are gone after a restart,
# and a set whose ranks exist already is answered rather than refused.
from hvdlite import process_sets
ps = hvd.add_process_set([size - 1])
left_behind = hvd.add_process_set([0])  # "a failed test" never removes it
twin = hvd.add_process_set([0])
check("twin set", np.array([twin.process_set_id]), np.array([left_behind.process_set_id]))
hvd.barrier()
for restart in range(2):
    hvd.shutdown()
    check(f"not initialized {restart}", np.array([hvd.is_initialized()]), np.array([False]))
    hvd.init()
    check(f"rank/size {restart}", np.array([hvd.rank(), hvd.size()]), np.array([rank, size]))
    check(f"sum after restart {restart}",
          hvd.allreduce(torch.full((3,), rank + 1.0), op=hvd.Sum, name="r.sum"),
          np.full(3, size * (size + 1) / 2, np.float32))
    table = process_sets.process_set_ids_and_ranks()
    if table != {0: list(range(size))}:
        failures.append(f"sets after restart {restart}: {table}")
    if ps.process_set_id is not None:
        failures.append(f"set still registered after restart {restart}: {ps}")
    ps = hvd.add_process_set([size - 1])
    if ps.included():
        check(f"set after restart {restart}",
              hvd.allreduce(torch.ones(2), op=hvd.Sum, name="r.ps", process_set=ps),
              np.ones(2, np.float32))
    hvd.barrier()  # a rank's shutdown ends every rank's run: not while one still works
# A shutdown by one rank ends the others' pending op (ShutdownError, a RuntimeError);
# every rank starts again and the job goes on.
if rank == 0:
    hvd.shutdown()
else:
    expect("pending at a remote shutdown", RuntimeError,
           lambda: hvd.allreduce(torch.ones(2), name="r.pending"), "shut down")
    hvd.shutdown()
hvd.init()
check("after a remote shutdown", hvd.allreduce(torch.ones(2), op=hvd.Sum, name="r.after"),
      np.full(2, float(size), np.float32))
joined = hvd.join()
check("join after restarts", np.array([joined]), np.array([joined]))
report()
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_refusals_raise_horovods_classes(np_):
    _run(np_, ERROR_TYPES_BODY, timeout=120, env=NO_STALL)


@pytest.mark.parametrize("np_", [2, 3])
def test_init_after_shutdown_and_sets_left_behind(np_):
    _run(np_, RESTART_BODY, timeout=150)

