"""The native core's allreduce in real 2- and 3-rank jobs: values, orders, cache, fusion.

Each job runs one rank script that makes many checks and reports them on
``HVDLITE_RESULT`` lines; ranks never raise on a wrong value (a diverging rank would
leave the others waiting), they report it, and the test asserts here. Expected values
come from ``core_reference`` (numpy), computed on each rank from every rank's
regenerated contribution, never from hvdlite.
"""
import pytest

import harness

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("native")]

RANKS = (2, 3)
DEFAULTS = {"HVDLITE_FUSION_THRESHOLD": None, "HVDLITE_CACHE_CAPACITY": None,
            "HVDLITE_CYCLE_TIME": None, "HVDLITE_STALL_CHECK_TIME": None,
            "HVDLITE_STALL_SHUTDOWN_TIME": None, "HVDLITE_TIMELINE": None}
FUSION = {"fusion_on": {}, "fusion_off": {"HVDLITE_FUSION_THRESHOLD": "0"}}
CACHE = {"cache_on": {}, "cache_off": {"HVDLITE_CACHE_CAPACITY": "0"}}
# Every rank is on this machine: allreduces go through shared memory unless turned off,
# which leaves MPI with the fusion buffer (its own packing, scaling and zeros for joins).
TRANSPORT = {"shm": {"HVDLITE_SHM_ALLREDUCE": "1"}, "mpi": {"HVDLITE_SHM_ALLREDUCE": "0"}}


def env_for(*settings):
    env = dict(DEFAULTS)
    for s in settings:
        env.update(s)
    return env


def results_by_kind(job, rank):
    """Returns {kind: payload} of the ``{"kind": ..., ...}`` results a rank printed."""
    return {r["kind"]: r for r in job.results.get(rank, [])}


# Every (dtype, op, shape) and scaled variant, twice: pass 1 negotiates through the
# coordinator, pass 2 (same names, new values) can hit the response cache. Each pass
# submits everything asynchronously in a per-rank random order, with jitter, then
# waits in another random order. A grouped pass before them submits the cases as grouped
# allreduces, one group per fusable family, so that fusion (when on) surely covers
# every family.
MATRIX_SCRIPT = r"""
import json, random, time
import numpy as np
import hvdlite as hvd
from core_reference import matrix_cases, contribution, check

hvd.init()
rank, size = hvd.rank(), hvd.size()
cases = matrix_cases()
OPS = {name: getattr(hvd, name) for name in ("Sum", "Average", "Min", "Max", "Product")}

def run_pass(seed):
    rng = random.Random(seed * 7919 + rank)
    order = list(cases)
    rng.shuffle(order)
    handles = {}
    for i, case in enumerate(order):
        if rng.random() < 0.05:
            time.sleep(0.002)  # ranks drift apart: tensors arrive in different cycles
        handles[case.name] = hvd.allreduce_async(
            contribution(seed, rank, case), name=case.name, op=OPS[case.op],
            prescale_factor=case.prescale, postscale_factor=case.postscale)
    rng.shuffle(order)
    failures = []
    for case in order:
        got = hvd.synchronize(handles[case.name])
        contribs = [contribution(seed, r, case) for r in range(size)]
        problem = check(got, contribs, case)
        if problem:
            failures.append(problem)
    return failures

def run_groups(seed):
    # Each family of cases the core may fuse (same dtype, op and scales) as one grouped
    # allreduce, in a per-rank random order: a group's members are released together,
    # so with fusion on each family is one collective whatever the timing (which tensors
    # of passes 1 and 2 meet in one cycle, and so fuse, is up to the scheduler).
    families = {}
    for case in cases:
        families.setdefault((case.dtype, case.op, case.prescale, case.postscale), []).append(case)
    rng = random.Random(seed * 7919 + rank)
    keys = sorted(families)
    rng.shuffle(keys)
    handles = {}
    for key in keys:
        dtype, op, pre, post = key
        handles[key] = hvd.grouped_allreduce_async(
            [contribution(seed, rank, case) for case in families[key]],
            name=f"family.{dtype}.{op}.{pre}.{post}", op=OPS[op], prescale_factor=pre,
            postscale_factor=post)
    rng.shuffle(keys)
    failures = []
    for key in keys:
        got = hvd.synchronize(handles[key])
        for member, case in zip(got, families[key]):
            problem = check(member, [contribution(seed, r, case) for r in range(size)], case)
            if problem:
                failures.append("grouped " + problem)
    return failures, len(families), sum(len(m) > 1 for m in families.values())

# The grouped pass comes first: a rank's counters can move before its next snapshot
# only through work every rank submits, except coordinator gathers, which a rank that
# went on to uncached work already starts (pass 2 after the snapshot s1 is all cache).
g0 = hvd.stats()
f3, families, multi = run_groups(3)
s0 = hvd.stats()
f1 = run_pass(1)
s1 = hvd.stats()
f2 = run_pass(2)
s2 = hvd.stats()
print("HVDLITE_RESULT", json.dumps({
    "kind": "matrix", "cases": len(cases), "failures": f3 + f1 + f2,
    "families": families, "multi_member_families": multi,
    "stats": [s0, s1, s2], "group_stats": [g0, s0]}))
"""


@pytest.mark.parametrize("transport", sorted(TRANSPORT))
@pytest.mark.parametrize("cache", sorted(CACHE))
@pytest.mark.parametrize("fusion", sorted(FUSION))
@pytest.mark.parametrize("np_", RANKS)
def test_every_op_dtype_against_numpy(np_, fusion, cache, transport):
    job = harness.assert_ok(harness.run_job(
        np_, MATRIX_SCRIPT, timeout=180,
        env=env_for(FUSION[fusion], CACHE[cache], TRANSPORT[transport])))
    for rank in range(np_):
        res = results_by_kind(job, rank)["matrix"]
        assert not res["failures"], (
            f"rank {rank}: {len(res['failures'])} wrong results:\n"
            + "\n".join(res["failures"][:30]))
        n = res["cases"]
        s0, s1, s2 = res["stats"]
        g0, g1 = res["group_stats"]
        assert g1["tensors"] - g0["tensors"] == n
        assert s1["tensors"] - s0["tensors"] == n and s2["tensors"] - s1["tensors"] == n
        assert s2["errors"] == 0
        # Every collective here is an allreduce: all or none through shared memory.
        want_shm = s2["collectives"] if transport == "shm" else 0
        assert s2["shm_collectives"] == want_shm, s2
        if fusion == "fusion_on":
            # Passes 1 and 2 fuse what happens to be ready together; the grouped pass
            # fuses every family of two or more members into exactly one collective.
            assert s2["collectives"] - s0["collectives"] <= 2 * n, (s0, s2)
            assert g1["collectives"] - g0["collectives"] == res["families"], (g0, g1)
            assert (g1["fused_collectives"] - g0["fused_collectives"]
                    == res["multi_member_families"] > 0), (res, g0, g1)
        else:
            assert s2["fused_collectives"] == 0, s2
            assert s2["collectives"] - s0["collectives"] == 2 * n, (s0, s2)
            assert g1["collectives"] - g0["collectives"] == n, (g0, g1)
        if cache == "cache_on":
            # Pass 2: every tensor was negotiated by its cache bit alone.
            assert s2["cache_hits"] - s1["cache_hits"] == n, (s1, s2)
            assert s2["coordinator_gathers"] == s1["coordinator_gathers"], (s1, s2)
        else:
            assert s2["cache_hits"] == 0, s2
            assert s2["coordinator_gathers"] > s1["coordinator_gathers"], (s1, s2)
            assert s2["cache_misses"] - s1["cache_misses"] == n, (s1, s2)


# 1,000 steps of 50 small tensors, each rank submitting in a new random order per step;
# every result checked. After a warm-up the coordinator is never asked again.
LOOP_SCRIPT = r"""
import json, random, sys
import numpy as np
import hvdlite as hvd

STEPS, TENSORS, WARMUP = int(sys.argv[1]), 50, 5
hvd.init()
rank, size = hvd.rank(), hvd.size()
rng = random.Random(rank)
names = [f"layer{i}.grad" for i in range(TENSORS)]
base = [np.arange(1 + i % 7, dtype=np.float32) for i in range(TENSORS)]
rank_sum = size * (size - 1) // 2
bad = []
snapshot = None
for step in range(STEPS):
    if step == WARMUP:
        snapshot = hvd.stats()
    order = list(range(TENSORS))
    rng.shuffle(order)
    handles = {}
    for i in order:
        if i % 10 == 9:  # a few int64 Max tensors among the float32 sums
            x = np.full(3, rank * 1000 + step + i, dtype=np.int64)
            handles[i] = hvd.allreduce_async(x, name=names[i], op=hvd.Max)
        else:
            handles[i] = hvd.allreduce_async(base[i] + (rank + step), name=names[i],
                                             op=hvd.Sum)
    rng.shuffle(order)
    for i in order:
        got = hvd.synchronize(handles[i])
        if i % 10 == 9:
            want = np.full(3, (size - 1) * 1000 + step + i, dtype=np.int64)
        else:
            want = size * (base[i] + step) + rank_sum
        if not np.array_equal(got, want) and len(bad) < 10:
            bad.append(f"step {step} {names[i]}: got {got.tolist()} want {want.tolist()}")
end = hvd.stats()
print("HVDLITE_RESULT", json.dumps({"kind": "loop", "bad": bad, "warm": snapshot,
                                    "end": end, "steps": STEPS, "tensors": TENSORS,
                                    "warmup": WARMUP}))
"""


@pytest.mark.parametrize("np_", RANKS)
def test_thousand_steps_steady_state_uses_cache_only(np_):
    job = harness.assert_ok(harness.run_job(np_, LOOP_SCRIPT, args=[1000], timeout=300,
                                            env=env_for()))
    for rank in range(np_):
        res = results_by_kind(job, rank)["loop"]
        assert not res["bad"], f"rank {rank}: wrong results: {res['bad']}"
        warm, end = res["warm"], res["end"]
        steady = (res["steps"] - res["warmup"]) * res["tensors"]
        # No gather to the coordinator in steady state, while the cache answers.
        assert end["coordinator_gathers"] == warm["coordinator_gathers"], (warm, end)
        assert end["cache_hits"] - warm["cache_hits"] == steady, (warm, end)
        assert end["cache_misses"] == warm["cache_misses"], (warm, end)
        assert end["tensors"] - warm["tensors"] == steady, (warm, end)
        assert end["fused_collectives"] > 0, end
        assert end["errors"] == 0, end


def test_steady_state_without_cache_gathers_every_step():
    # The control for the test above: with the cache off, the same loop needs the
    # coordinator at least once per step.
    steps = 50
    job = harness.assert_ok(harness.run_job(
        2, LOOP_SCRIPT, args=[steps], timeout=120, env=env_for(CACHE["cache_off"])))
    for rank in range(2):
        res = results_by_kind(job, rank)["loop"]
        assert not res["bad"], f"rank {rank}: wrong results: {res['bad']}"
        warm, end = res["warm"], res["end"]
        assert end["cache_hits"] == 0, end
        assert end["coordinator_gathers"] - warm["coordinator_gathers"] >= steps - res["warmup"]


def test_cache_too_large_for_shared_coordination_falls_back_to_mpi():
    # The coordination's bit vector goes through shared memory only up to ~65,000
    # cache entries; a larger cache sends it through MPI while the allreduces stay in
    # shared memory. The cache must still answer every steady-state step.
    steps = 100
    job = harness.assert_ok(harness.run_job(
        3, LOOP_SCRIPT, args=[steps], timeout=120,
        env=env_for(TRANSPORT["shm"], {"HVDLITE_CACHE_CAPACITY": "200000"})))
    for rank in range(3):
        res = results_by_kind(job, rank)["loop"]
        assert not res["bad"], f"rank {rank}: wrong results: {res['bad']}"
        warm, end = res["warm"], res["end"]
        steady = (steps - res["warmup"]) * res["tensors"]
        assert end["coordinator_gathers"] == warm["coordinator_gathers"], (warm, end)
        assert end["cache_hits"] - warm["cache_hits"] == steady, (warm, end)
        assert end["shm_collectives"] == end["collectives"] > 0, end


SETTINGS_SCRIPT = r"""
import json, os, sys
import numpy as np
import hvdlite as hvd

rank = int(os.environ["HVDLITE_RANK"])
setting, value = sys.argv[1], sys.argv[2]
if rank == 1:
    os.environ[setting] = value  # read by the core at init
try:
    hvd.init()
except hvd.errors.InvalidArgumentError as e:
    print("HVDLITE_RESULT", json.dumps({"error": str(e)}))
    sys.exit(0)
got = hvd.allreduce(np.full(5, rank + 1.0), name="x", op=hvd.Sum)
print("HVDLITE_RESULT", json.dumps({"error": None, "sum": got.tolist(), "stats": hvd.stats()}))
hvd.shutdown()
"""


@pytest.mark.parametrize("setting,value,rest", [
    # A cache too large for the shared coordination area on one rank only: that rank
    # would coordinate through MPI while the others wait in shared memory.
    ("HVDLITE_CACHE_CAPACITY", "200000", "1024"),
    ("HVDLITE_FUSION_THRESHOLD", "0", str(128 * 1024 * 1024)),
    # Staged GPU allreduces run one collective per chunk.
    ("HVDLITE_GPU_STAGE_CHUNK", "65536", str(4 * 1024 * 1024)),
])
def test_settings_that_differ_across_ranks_fail_init_on_every_rank(setting, value, rest):
    job = harness.assert_ok(harness.run_job(3, SETTINGS_SCRIPT, args=[setting, value],
                                            timeout=120, env=env_for()))
    for rank in range(3):
        error = job.result(rank)["error"]
        assert error is not None, f"rank {rank} initialized with {setting} differing"
        assert f"{setting} must be the same on every rank" in error, error
        assert f"ranks 0, 2 had {rest}" in error and f"rank 1 had {value}" in error, error


def test_shared_memory_turned_off_on_one_rank_is_off_on_all():
    job = harness.assert_ok(harness.run_job(
        3, SETTINGS_SCRIPT, args=["HVDLITE_SHM_ALLREDUCE", "0"], timeout=120,
        env=env_for(TRANSPORT["shm"])))
    for rank in range(3):
        res = job.result(rank)
        assert res["error"] is None and res["sum"] == [6.0] * 5, res
        assert res["stats"]["shm_collectives"] == 0, res["stats"]


# Two threads of rank 0 wait on one op in flight while rank 1 holds it back: at the C
# level one plainly and one releasing the handle as the op ends (the released handle is
# then unknown), at the Python level both through synchronize. Rank 1 submits only once
# every waiting thread has reached its call ("go" is a collective of its own).
WAITERS_SCRIPT = r"""
import json, threading, time
import numpy as np
import hvdlite as hvd
from hvdlite import _enqueue
from hvdlite._native import ffi, lib

hvd.init()
rank = hvd.rank()
x = np.full(4, rank + 1.0, np.float32)
if rank == 0:
    o = np.empty_like(x)
    struct = ffi.new("hvdlite_tensor_t *")
    keep = _enqueue.fill(struct, _enqueue.ALLREDUCE, "waiters.c", lib.HVDLITE_FLOAT32, x.shape,
                         None, None, hvd.Sum, 1.0, 1.0, 0, None, 0, -1)
    cell = ffi.new("hvdlite_handle_t *")
    status = lib.hvdlite_enqueue_buffers(struct, ffi.from_buffer(x), ffi.from_buffer(o), cell)
    native = cell[0]
    handle = hvd.allreduce_async(x, name="waiters.py", op=hvd.Sum)
    statuses, got, started = {}, {}, []
    def wait(label, fn, at_call):
        at_call.set()
        statuses[label] = fn(native, 60.0)
    def sync(label, at_call):
        at_call.set()
        got[label] = hvd.synchronize(handle)
    threads = []
    for target, args in [(wait, ("wait", lib.hvdlite_wait)),
                         (wait, ("wait_release", lib.hvdlite_wait_release)),
                         (sync, ("a",)), (sync, ("b",))]:
        started.append(threading.Event())
        threads.append(threading.Thread(target=target, args=args + (started[-1],)))
    for t in threads:
        t.start()
    for event in started:
        event.wait(60)
    time.sleep(0.2)  # from their call into the wait: microseconds
    hvd.allreduce(np.zeros(1, np.float32), name="go", op=hvd.Sum)
    for t in threads:
        t.join(90)
    after = lib.hvdlite_wait(native, 0.0)
    cells = ffi.new("void **"), ffi.new("int64_t *"), ffi.new("int64_t *")
    output_after = lib.hvdlite_handle_output(native, *cells)
    name_of = lambda code: ffi.string(lib.hvdlite_status_name(code)).decode()
    print("HVDLITE_RESULT", json.dumps({
        "enqueued": status, "native": native, "statuses": statuses,
        "after": name_of(after), "output_after": name_of(output_after), "c_sum": o.tolist(),
        "same_result": got.get("a") is got.get("b") and got.get("a") is not None,
        "py_sum": got["a"].tolist() if "a" in got else None}))
else:
    hvd.allreduce(np.zeros(1, np.float32), name="go", op=hvd.Sum)
    hvd.allreduce(x, name="waiters.c", op=hvd.Sum)
    hvd.allreduce(x, name="waiters.py", op=hvd.Sum)
    print("HVDLITE_RESULT", json.dumps({}))
hvd.shutdown()
"""


def test_threads_waiting_on_one_op_all_get_its_result():
    job = harness.assert_ok(harness.run_job(2, WAITERS_SCRIPT, timeout=120, env=env_for()))
    res = job.result(0)
    assert res["enqueued"] == 0 and res["native"] > 0, res
    assert res["statuses"] == {"wait": 0, "wait_release": 0}, res
    # Released by wait_release: its state is gone, yet a wait just after still learns
    # how the op ended (the core keeps the statuses of recent releases).
    assert res["output_after"] == "HVDLITE_ERR_INVALID_HANDLE", res
    assert res["after"] == "HVDLITE_OK", res
    assert res["c_sum"] == [3.0] * 4 and res["py_sum"] == [3.0] * 4, res
    assert res["same_result"], res


# Rank 1 has joined; a thread of it submits each tensor just before rank 0 does, so the
# response for a tensor can reach rank 1 after its request was added but before a cycle
# took it from the pending list. Every call must end, with rank 0's value alone or with
# both ranks' sum. (Whether the removed entry leaves the pending list depends on that
# timing, which this job does not force: tests/faults/test_protocol.py checks it on the
# queue alone, deterministically.) Rank 0 submits a tensor only once rank 1 has (a file
# beside the script counts rank 1's submissions): a request of rank 1 that came after
# rank 0 ran its tensor, joined and shut down would find no job to end in (CI met that
# when rank 1 slipped 3 ms on its last tensor).
JOIN_RACE_SCRIPT = r"""
import json, os, threading, time
import numpy as np
import hvdlite as hvd
hvd.init()
rank, n = hvd.rank(), 40
progress = os.path.join(os.path.dirname(os.path.abspath(__file__)), "submitted")


def submitted():
    try:
        with open(progress) as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0


hvd.barrier()
base = time.monotonic() + 0.3
if rank == 1:
    joiner = threading.Thread(target=hvd.join)
    joiner.start()
    handles = []
    for i in range(n):
        while time.monotonic() < base + 0.05 * i:
            time.sleep(0.0002)
        handles.append(hvd.allreduce_async(np.full(4, i, np.float32), name=f"late.{i}",
                                           op=hvd.Sum))
        with open(progress + ".new", "w") as f:
            f.write(str(i + 1))
        os.replace(progress + ".new", progress)
    sums = [hvd.synchronize(h, timeout=30).tolist() for h in handles]
    joiner.join(60)
else:
    sums = []
    for i in range(n):
        deadline = time.monotonic() + 30
        while (time.monotonic() < base + 0.05 * i + 0.003 or submitted() <= i) \
                and time.monotonic() < deadline:
            time.sleep(0.0002)
        sums.append(hvd.allreduce(np.full(4, i, np.float32), name=f"late.{i}",
                                  op=hvd.Sum).tolist())
    hvd.join()
print("HVDLITE_RESULT", json.dumps({"sums": sums}))
hvd.shutdown()
"""


def test_late_submissions_on_a_joined_rank_all_end():
    job = harness.assert_ok(harness.run_job(2, JOIN_RACE_SCRIPT, timeout=120, env=env_for()))
    for rank in range(2):
        sums = job.result(rank)["sums"]
        assert len(sums) == 40, (rank, sums)
        for i, got in enumerate(sums):
            # Rank 1 joined: rank 0's op may have run without it (its own value alone),
            # or with it; either way every rank sees the same result for a name.
            assert got in ([float(i)] * 4, [2.0 * i] * 4), (rank, i, got)
