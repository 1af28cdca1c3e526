"""Blocking ops (``hvd.allreduce``, ``broadcast``, ``reducescatter``) are enqueued and
waited for in one native call (hvdlite_enqueue_buffers_wait), their caller counted as
waiting from the enqueue on, so that the background thread runs their cycle at once.

In real 2- and 3-rank jobs: results of every size class (the shared-memory path's
polled small sizes and its chunked large ones) against numpy's, recomputed from every
rank's regenerated contribution; the core's count of waiting threads
(``stats()["waiting_threads"]``) is 1 while a blocking call waits for a late peer
(longer than a wait slice, so the call goes on waiting after its first slice) and back
at 0 after every way a blocking call ends: success, the op's failure on every rank,
and a refusal at the enqueue (a name in flight, on the ranks whose op surely is). A count left above 0 would keep the background thread
from gathering bursts (every later cycle would run at once, unfused) and keep its
shared-memory waits polling.
"""
import pytest

from harness import assert_ok, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import json, threading, time
import numpy as np
import hvdlite as hvd
from hvdlite import errors

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"wrong": [], "waiting_after": {}}

def contribution(k, n, dtype, seed):
    return ((np.arange(n) * (seed + 1) + 7 * k + seed) % 97).astype(dtype)

def waiting():
    return hvd.stats()["waiting_threads"]

# Sizes: 4 KiB and 64 KiB (polled), 1 MiB + 4 (chunked); integer values keep float sums
# exact in any order.
for seed, (n, dtype) in enumerate([(1024, np.float32), (8192, np.float64), (262145, np.float32),
                                   (1000, np.int32)]):
    for step in range(3):
        mine = contribution(rank, n, dtype, seed + step)
        everyone = [contribution(k, n, dtype, seed + step) for k in range(size)]
        got = hvd.allreduce(mine, name=f"ar{seed}", op=hvd.Sum)
        if not np.array_equal(got, sum(everyone)):
            out["wrong"].append(["allreduce", seed, step])
        got = hvd.broadcast(mine, root_rank=step % size, name=f"bc{seed}")
        if not np.array_equal(got, everyone[step % size]):
            out["wrong"].append(["broadcast", seed, step])
        rows = np.stack([contribution(k, n, dtype, seed + step + 1) for k in range(size)])
        shard = hvd.reducescatter(np.stack([contribution(rank, n, dtype, seed + step + 1)] * size),
                                  name=f"rs{seed}", op=hvd.Sum)
        if not np.array_equal(shard, rows.sum(axis=0, dtype=dtype)[None, :].astype(dtype)):
            out["wrong"].append(["reducescatter", seed, step])
out["waiting_after"]["success"] = waiting()

# The op fails on every rank (shapes differ): raised by the blocking call.
try:
    hvd.allreduce(np.ones(4 + (rank == size - 1), np.float32), name="mismatch")
    out["mismatch"] = None
except errors.HorovodInternalError as e:
    out["mismatch"] = type(e).__name__
out["waiting_after"]["op_failed"] = waiting()

# Refused at the enqueue: a name in flight. Rank 0 submits "twice" only after the
# others tried, so theirs is surely still in flight then (it cannot end without rank 0's).
if rank != 0:
    pending = hvd.allreduce_async(np.ones(3, np.float32), name="twice", op=hvd.Sum)
    try:
        hvd.allreduce(np.ones(3, np.float32), name="twice")
        out["duplicate"] = None
    except errors.DuplicateNameError as e:
        out["duplicate"] = type(e).__name__
    out["waiting_after"]["refused"] = waiting()
hvd.allreduce(np.ones(1, np.float32), name="tried")
if rank == 0:
    pending = hvd.allreduce_async(np.ones(3, np.float32), name="twice", op=hvd.Sum)
if not np.array_equal(hvd.synchronize(pending), np.full(3, float(size), np.float32)):
    out["wrong"].append(["twice"])

# A late rank 0 (1.5 s: longer than a wait slice): the others' blocking call counts as
# waiting meanwhile, and goes on past its first slice.
seen = []
def watch():
    time.sleep(0.7)
    seen.append(waiting())
if rank != 0:
    watcher = threading.Thread(target=watch)
    watcher.start()
else:
    time.sleep(1.5)
got = hvd.allreduce(np.full(5, rank + 1.0, np.float32), name="late", op=hvd.Sum)
if not np.array_equal(got, np.full(5, size * (size + 1) / 2, np.float32)):
    out["wrong"].append(["late"])
if rank != 0:
    watcher.join()
out["waiting_while_late"] = seen
out["waiting_after"]["late"] = waiting()

# Bursts are still gathered afterwards: 40 tensors submitted at once are fused.
before = hvd.stats()
handles = [hvd.allreduce_async(np.full(100, float(i), np.float32), name=f"burst{i}", op=hvd.Sum)
           for i in range(40)]
for i, h in enumerate(handles):
    if not np.array_equal(hvd.synchronize(h), np.full(100, float(i) * size, np.float32)):
        out["wrong"].append(["burst", i])
after = hvd.stats()
out["burst_collectives"] = after["collectives"] - before["collectives"]
print("HVDLITE_RESULT", json.dumps(out), flush=True)
hvd.shutdown()
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_blocking_ops_are_right_and_leave_no_waiter_counted(np_):
    result = assert_ok(run_job(np_, SCRIPT, timeout=240))
    for r in range(np_):
        body = result.result(r)
        assert body["wrong"] == [], f"rank {r}: wrong results {body['wrong']}"
        assert body["mismatch"] == "MismatchError", body
        ends = {"success": 0, "op_failed": 0, "late": 0}
        if r != 0:
            assert body["duplicate"] == "DuplicateNameError", body
            assert body["waiting_while_late"] == [1], body
            ends["refused"] = 0
        assert body["waiting_after"] == ends, f"rank {r}: {body['waiting_after']}"
        # 40 tensors of 400 bytes in one burst: far fewer collectives than tensors.
        assert body["burst_collectives"] <= 10, body


INTERRUPT_SCRIPT = r"""
import gc, json, os, signal, threading, time, weakref
import numpy as np
import hvdlite as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {}
x = np.full(1000, rank + 1.0, np.float32)
if rank == 0:
    # Ctrl-C 0.3 s into a blocking allreduce that rank 1 joins only after 2 s.
    buf = np.zeros(1000, np.float32)
    alive = weakref.ref(buf)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        hvd.allreduce(x, name="interrupted", op=hvd.Sum, out=buf)
        out["interrupted"] = False
    except KeyboardInterrupt:
        out["interrupted"] = True
    # The op goes on without the caller: the core still writes into buf, so buf must
    # stay alive without this script's reference.
    del buf
    gc.collect()
    out["buffer_kept_while_running"] = alive() is not None
else:
    time.sleep(2.0)
    got = hvd.allreduce(x, name="interrupted", op=hvd.Sum)
    out["peer_result_right"] = bool(np.array_equal(got, np.full(1000, 3.0, np.float32)))
# The job goes on: a later blocking call, then the orphan is released once its op ended.
got = hvd.allreduce(np.ones(4, np.float32), name="after", op=hvd.Sum)
out["after_right"] = bool(np.array_equal(got, np.full(4, float(size), np.float32)))
if rank == 0:
    hvd.allreduce(np.ones(1, np.float32), name="reap", op=hvd.Sum)
    gc.collect()
    out["buffer_freed_after"] = alive() is None
else:
    hvd.allreduce(np.ones(1, np.float32), name="reap", op=hvd.Sum)
out["waiting"] = hvd.stats()["waiting_threads"]
print("HVDLITE_RESULT", json.dumps(out), flush=True)
hvd.shutdown()
"""


def test_a_blocking_call_interrupted_keeps_its_buffers_until_the_op_ends():
    # Ctrl-C while a blocking call waits in the core (its first wait slice): the op,
    # already enqueued, completes with the peers; its buffers are the core's until then.
    result = assert_ok(run_job(2, INTERRUPT_SCRIPT, timeout=120))
    first, second = result.result(0), result.result(1)
    assert first["interrupted"] is True, first
    assert first["buffer_kept_while_running"] is True, first
    assert second["peer_result_right"] is True, second
    assert first["after_right"] and second["after_right"], (first, second)
    assert first["buffer_freed_after"] is True, first
    assert first["waiting"] == 0 and second["waiting"] == 0, (first, second)
