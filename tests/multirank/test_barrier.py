"""The barrier on 2 and 3 real ranks: nobody leaves before everyone arrived, call after
call (a different rank late each time), in the global set and in a process set, from
two threads of each rank at once, and between cached allreduces; a repeated barrier is
a response-cache hit (one name per set), not a negotiation through rank 0.
"""
import pytest

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r'''
import json
import threading
import time
import numpy as np
import hvdlite as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
failures = []
LATE = 0.02  # the late rank's delay: a barrier that did not wait shows it whole

def rounds(members, n, tag, process_set=hvd.global_process_set):
    """n barriers, member i % len(members) late in round i; every rank's arrival and
    departure gathered and checked: each round's first departure after its last arrival."""
    stamps = []
    for i in range(n):
        if rank == members[i % len(members)]:
            time.sleep(LATE)
        arrived = time.time()
        hvd.barrier(process_set=process_set)
        stamps.append((arrived, time.time()))
    every = hvd.allgather(np.array(stamps).reshape(1, n, 2), name=tag + ".stamps",
                          process_set=process_set)
    for i in range(n):
        last_in, first_out = every[:, i, 0].max(), every[:, i, 1].min()
        if first_out < last_in:
            failures.append(f"{tag} round {i}: a rank left {last_in - first_out:.4f} s "
                            "before the last one arrived")

before = hvd.stats()
rounds(list(range(size)), 24, "global")
after = hvd.stats()

# Between cached allreduces, whose values are checked.
x = np.arange(64, dtype=np.float32) + rank
for i in range(10):
    got = hvd.allreduce(x * i, name="between", op=hvd.Sum)
    want = sum((np.arange(64, dtype=np.float32) + r) * i for r in range(size))
    if not np.array_equal(got, want):
        failures.append(f"allreduce {i} between barriers: {got[:4]} != {want[:4]}")
    hvd.barrier()

# In a process set of the first and the last rank (3 ranks: the middle one meanwhile
# waits at the global barrier below).
if size > 2:
    pair = hvd.add_process_set([0, size - 1])
    if rank in pair.ranks:
        rounds([0, size - 1], 10, "pair", process_set=pair)
    hvd.barrier()
    hvd.remove_process_set(pair)

# Two threads of every rank, each calling barrier 10 times: a rank's barriers run one at
# a time and pair with the other ranks' in that order.
errors = []
def loop():
    try:
        for _ in range(10):
            hvd.barrier()
    except Exception as e:  # reported below
        errors.append(repr(e))
threads = [threading.Thread(target=loop) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
failures += [f"thread: {e}" for e in errors]

print("HVDLITE_RESULT " + json.dumps({
    "failures": failures,
    "hits": after["cache_hits"] - before["cache_hits"],
    "gathers": after["coordinator_gathers"] - before["coordinator_gathers"]}), flush=True)
hvd.shutdown()
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_barriers_wait_for_everyone_and_repeat_from_the_cache(np_):
    result = assert_ok(run_job(np_, SCRIPT, timeout=240))
    for r in range(np_):
        out = result.result(r)
        assert out["failures"] == [], f"rank {r}: {out['failures']}\n" + describe(result)
        # 24 barriers: the first negotiates, the others are cache hits (a few rounds
        # gather anyway: the stall check's; every barrier negotiated, it was 48 or more).
        assert out["hits"] >= 23 and out["gathers"] <= 8, (
            f"rank {r}: {out['hits']} cache hits, {out['gathers']} coordinator gathers in 24 "
            "barriers\n" + describe(result))


EVICTED = r'''
import json
import threading
import time
import numpy as np
import hvdlite as hvd

hvd.init()
rank = hvd.rank()
# A cache of two slots: the barrier's, then "a"'s; the barrier is the least recently used.
hvd.barrier()
hvd.allreduce(np.ones(4, np.float32), name="a")
if rank == 0:
    # Rank 0's barrier waits as a cache hit while "b" is negotiated: b's response takes
    # the barrier's slot (evicted on every rank), and rank 1's barrier, later, misses.
    waiter = threading.Thread(target=hvd.barrier)
    waiter.start()
    time.sleep(0.2)
    hvd.allreduce(np.ones(4, np.float32), name="b")
    waiter.join()
else:
    hvd.allreduce(np.ones(4, np.float32), name="b")
    time.sleep(0.5)
    hvd.barrier()
got = hvd.allreduce(np.full(4, rank, np.float32), name="after", op=hvd.Sum)
print("HVDLITE_RESULT " + json.dumps({"after": got.tolist()}), flush=True)
hvd.shutdown()
'''


def test_a_barrier_waiting_as_a_hit_whose_slot_is_evicted_still_completes():
    # The slot a rank waits on as a hit may be given to another tensor by the response
    # cache (least recently used, the same on every rank) while its peers have not
    # submitted yet: they then miss, and the waiting rank must send its request to the
    # coordinator too, not wait on a bit no one else sets (a hang, before).
    result = assert_ok(run_job(2, EVICTED, timeout=60,
                               env={"HVDLITE_CACHE_CAPACITY": "2",
                                    "HVDLITE_STALL_CHECK_TIME": "600"}))
    for r in range(2):
        assert result.result(r)["after"] == [1.0] * 4, describe(result)


INTERRUPTED = r'''
import json
import os
import signal
import threading
import time
import numpy as np
import hvdlite as hvd

hvd.init()
rank = hvd.rank()
hvd.barrier()
out = {}
if rank == 0:
    # Ctrl-C 0.3 s into a barrier that rank 1 reaches at 1.5 s; the barrier called again
    # waits for the one cut short (it pairs with rank 1's first), then for rank 1's second.
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        hvd.barrier()
        out["interrupted"] = False
    except KeyboardInterrupt:
        out["interrupted"] = True
    hvd.barrier()
    second = (0.0, time.time())
else:
    time.sleep(1.5)
    hvd.barrier()
    time.sleep(0.5)
    second = (time.time(), 0.0)
    hvd.barrier()
stamps = hvd.allgather(np.array([second]), name="stamps")
out["left_after_arrival"] = bool(stamps[0, 1] >= stamps[1, 0])
# The same for any named blocking call: rank 0's second allreduce of "metric" waits for
# the first (which pairs with rank 1's first), then pairs with rank 1's second.
if rank == 0:
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        hvd.allreduce(np.full(2, 1.0, np.float32), name="metric", op=hvd.Sum)
    except KeyboardInterrupt:
        out["metric_interrupted"] = True
    out["metric"] = hvd.allreduce(np.full(2, 2.0, np.float32), name="metric", op=hvd.Sum).tolist()
else:
    time.sleep(1.5)
    out["metric_first"] = hvd.allreduce(np.full(2, 10.0, np.float32), name="metric",
                                        op=hvd.Sum).tolist()
    out["metric"] = hvd.allreduce(np.full(2, 20.0, np.float32), name="metric", op=hvd.Sum).tolist()
out["after"] = hvd.allreduce(np.full(2, rank, np.float32), name="after", op=hvd.Sum).tolist()
print("HVDLITE_RESULT " + json.dumps(out), flush=True)
hvd.shutdown()
'''


def test_a_blocking_call_cut_short_by_ctrl_c_is_waited_for_by_the_next_of_its_name():
    result = assert_ok(run_job(2, INTERRUPTED, timeout=60))
    assert result.result(0)["interrupted"], describe(result)
    assert result.result(0)["metric_interrupted"], describe(result)
    assert result.result(1)["metric_first"] == [11.0, 11.0], describe(result)
    for r in range(2):
        out = result.result(r)
        assert out["left_after_arrival"] and out["after"] == [1.0, 1.0], (r, out)
        assert out["metric"] == [22.0, 22.0], (r, out)
