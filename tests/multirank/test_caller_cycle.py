"""A thread blocked on a collective runs its cycle itself (Core::RunCallerCycle).

Where every rank of each process set is on one host, the coordination round, the
negotiation and the collectives of host tensors go through shared memory, so a
blocking call (``hvd.allreduce``, ``broadcast``, ``allgather``, ``alltoall``,
``reducescatter``, ``barrier``) with nothing else of its rank in flight runs its own
cycle instead of waking the background thread and sleeping until it is done; so does a
thread that waits for an async op (``synchronize``) that is its rank's only one. Cycles
are still one at a time (a token), so every rank runs the same collectives in the same
order whichever thread runs them.

In real 2- and 3-rank jobs: every kind of blocking op, named and unnamed (negotiated
afresh each call, through shared memory), inside a process set and beside a thread
whose async ops go through the background thread, against numpy's results recomputed
from every rank's regenerated contribution; a mismatch still fails on every rank; and
the core's count of cycles run by callers (``stats()["caller_cycles"]``) shows which
thread ran them: most of a loop of blocking calls, none with ``HVDLITE_CALLER_CYCLE=0``,
and none with ``HVDLITE_SHM_ALLREDUCE=0`` (the round an MPI_Iallreduce, which only the
background thread runs). Across hosts, where the caller's cycle calls MPI:
tests/cluster/test_cluster_collectives.py runs this job there.
"""
import os

import pytest

from harness import assert_ok, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import json, threading
import numpy as np
import hvdlite as hvd
from hvdlite import errors

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"wrong": []}

def contribution(k, n, dtype, seed):
    return ((np.arange(n) * (seed + 1) + 7 * k + seed) % 97).astype(dtype)

def check(what, got, expected):
    if not np.array_equal(got, expected):
        out["wrong"].append(what)

def blocking_ops(step, tag, process_set=hvd.global_process_set):
    # Every blocking op once; contributions of the set's members, recomputed here.
    members = list(range(size)) if process_set is hvd.global_process_set else process_set.ranks
    n = 1024 + 3 * step
    mine = contribution(rank, n, np.float32, step)
    every = [contribution(k, n, np.float32, step) for k in members]
    check([tag, "allreduce", step], hvd.allreduce(mine, name=tag + ".ar", op=hvd.Sum,
                                                  process_set=process_set), sum(every))
    check([tag, "unnamed", step], hvd.allreduce(mine, op=hvd.Max, process_set=process_set),
          np.max(every, axis=0))
    root = members[step % len(members)]
    check([tag, "broadcast", step], hvd.broadcast(mine, root, name=tag + ".bc",
                                                  process_set=process_set),
          contribution(root, n, np.float32, step))
    # Allgather: a different number of rows from each member.
    rows = lambda k: contribution(k, (k + 1) * 6, np.int32, step).reshape(-1, 6)
    check([tag, "allgather", step], hvd.allgather(rows(rank), name=tag + ".ag",
                                                  process_set=process_set),
          np.concatenate([rows(k) for k in members]))
    # Alltoall: member j sends j + k + 1 rows to member k.
    m = len(members)
    me = members.index(rank)
    splits = [me + k + 1 for k in range(m)]
    send = contribution(rank, sum(splits) * 2, np.float64, step).reshape(-1, 2)
    got, got_splits = hvd.alltoall(send, splits=splits, name=tag + ".a2a", process_set=process_set)
    expected = []
    for j, k in enumerate(members):
        theirs = contribution(k, sum(j + q + 1 for q in range(m)) * 2, np.float64, step).reshape(-1, 2)
        start = sum(j + q + 1 for q in range(me))
        expected.append(theirs[start:start + j + me + 1])
    check([tag, "alltoall", step], got, np.concatenate(expected))
    check([tag, "alltoall splits", step], np.asarray(got_splits), [j + me + 1 for j in range(m)])
    full = np.stack([contribution(rank, 40, np.float32, step + q) for q in range(m)])
    shard = hvd.reducescatter(full, name=tag + ".rs", op=hvd.Sum, process_set=process_set)
    check([tag, "reducescatter", step], shard,
          sum(contribution(k, 40, np.float32, step + me) for k in members)[None, :])
    hvd.barrier(process_set=process_set)
    return 7  # blocking calls made

def caller_cycles():
    return hvd.stats()["caller_cycles"]

# A loop of blocking calls, nothing else in flight.
before, calls = caller_cycles(), 0
for step in range(30):
    calls += blocking_ops(step, "loop")
out["loop"] = {"calls": calls, "caller_cycles": caller_cycles() - before}

# An async op waited for at once (synchronize right after it): the waiting thread runs
# its cycle too, when the op is its rank's only one.
before = caller_cycles()
for step in range(30):
    mine = contribution(rank, 256, np.float32, step)
    every = [contribution(k, 256, np.float32, step) for k in range(size)]
    check(["sync allreduce", step], hvd.synchronize(hvd.allreduce_async(mine, name="sync.ar",
                                                                        op=hvd.Sum)), sum(every))
    check(["sync allgather", step], hvd.synchronize(hvd.allgather_async(mine, name="sync.ag")),
          np.concatenate(every))
out["sync"] = {"calls": 60, "caller_cycles": caller_cycles() - before}

# Larger blocking calls: up to 1 MiB the caller runs the cycle where each rank has a
# core (at most 64 KiB where ranks outnumber the cores); a 2 MiB one goes to the
# background thread.
for label, n in (("256K", 65536), ("2M", 524288)):
    before = caller_cycles()
    for step in range(6):
        mine = contribution(rank, n, np.float32, step)
        check([label, "allreduce", step], hvd.allreduce(mine, name=label + ".ar", op=hvd.Sum),
              sum(contribution(k, n, np.float32, step) for k in range(size)))
        root = step % size
        check([label, "broadcast", step], hvd.broadcast(mine, root, name=label + ".bc"),
              contribution(root, n, np.float32, step))
    out[label] = {"calls": 12, "caller_cycles": caller_cycles() - before}

# Beside a thread whose async ops (fused bursts, through the background thread) are in
# flight: both paths at once, and every result right.
def burst_thread():
    for step in range(30):
        handles = [hvd.allreduce_async(np.full(50, float(i + step), np.float32),
                                       name=f"thread.{i}", op=hvd.Sum) for i in range(8)]
        for i, h in enumerate(handles):
            check(["thread", i, step], hvd.synchronize(h), np.full(50, float(i + step) * size, np.float32))
worker = threading.Thread(target=burst_thread)
worker.start()
for step in range(30):
    blocking_ops(step, "mixed")
worker.join()

# In a process set of ranks 0 and 1, rank 2 taking no part (3 ranks and more).
if size > 2:
    pair = hvd.add_process_set([0, 1])
    if rank in pair.ranks:
        for step in range(10):
            blocking_ops(step, "pair", process_set=pair)
    hvd.barrier()
    hvd.remove_process_set(pair)

# A mismatch (the last rank's shape differs) still fails on every rank.
try:
    hvd.allreduce(np.ones(4 + (rank == size - 1), np.float32), name="mismatch")
    out["mismatch"] = None
except errors.HorovodInternalError as e:
    out["mismatch"] = type(e).__name__
check(["after mismatch"], hvd.allreduce(np.ones(3, np.float32), name="after", op=hvd.Sum),
      np.full(3, float(size), np.float32))
print("HVDLITE_RESULT", json.dumps(out), flush=True)
hvd.shutdown()
"""


def run(np_, env=None, job=None):
    """Runs SCRIPT on np_ ranks (``job(env)``, by default on this host) and checks every
    rank's results; returns the ranks' reports."""
    job = job or (lambda env: run_job(np_, SCRIPT, timeout=240, env=env))
    result = assert_ok(job(env))
    bodies = [result.result(r) for r in range(np_)]
    for r, body in enumerate(bodies):
        assert body["wrong"] == [], f"rank {r}: wrong results {body['wrong'][:10]}"
        assert body["mismatch"] == "MismatchError", f"rank {r}: {body}"
    return bodies


@pytest.mark.parametrize("np_", [2, 3])
def test_blocking_calls_run_their_own_cycles_with_right_results(np_):
    for r, body in enumerate(run(np_)):
        # A peer's idle round (every 20 ms) can meet a caller's round before its own op
        # came: that call then goes on in the background thread. Most do not.
        for kind in ("loop", "sync"):
            assert body[kind]["caller_cycles"] >= body[kind]["calls"] // 2, f"rank {r}: {body}"
        if np_ <= len(os.sched_getaffinity(0)):  # a core for each rank
            assert body["256K"]["caller_cycles"] >= body["256K"]["calls"] // 2, f"rank {r}: {body}"
        else:
            assert body["256K"]["caller_cycles"] == 0, f"rank {r}: {body}"
        assert body["2M"]["caller_cycles"] == 0, f"rank {r}: {body}"


@pytest.mark.parametrize("setting", ["HVDLITE_CALLER_CYCLE", "HVDLITE_SHM_ALLREDUCE"])
def test_no_caller_cycles_when_turned_off_or_where_a_cycle_calls_mpi(setting):
    for r, body in enumerate(run(2, env={setting: "0"})):
        assert body["loop"]["caller_cycles"] == 0, f"rank {r}: {body['loop']}"
        assert body["sync"]["caller_cycles"] == 0, f"rank {r}: {body['sync']}"
