"""How a rank's threads are scheduled (native/src/common/thread_sched.h), in real jobs.

hvdliterun --bind-to core (HVDLITE_BIND_TO=core): every thread of local rank r, the
background thread included, and the threads it starts afterwards run on the r-th of
local_size equal blocks of the cores the job may use; with more ranks than cores nothing
is bound and every rank says why. Expected cores come from this process's own affinity,
which the job inherits.

The background thread is real-time (SCHED_FIFO) where the kernel permits it and every
rank sharing its cores (on this machine, whatever the host names: tests/cluster) can have
one, unless HVDLITE_BACKGROUND_REALTIME=0; no other thread is.
Whether the kernel permits it is asked of the kernel here, by a process of our own.

A bad value of either variable fails init with an error naming it.
"""
import os
import subprocess
import sys
import textwrap

import pytest

import needs

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import json, os, threading
import numpy as np
import hvdlite as hvd

def cores_of(tid):
    return sorted(os.sched_getaffinity(tid))

hvd.init()
threads, policies = {}, {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/comm") as f:
        name = f.read().strip() + ":" + tid
    threads[name] = cores_of(int(tid))
    policies[name] = os.sched_getscheduler(int(tid))  # with SCHED_RESET_ON_FORK
later = []
t = threading.Thread(target=lambda: later.append(cores_of(0)))
t.start(); t.join()
# The job still reduces right, bound or real-time.
total = hvd.allreduce(np.arange(4.0) + hvd.rank(), op=hvd.Sum, name="bound.sum")
print("HVDLITE_RESULT", json.dumps({"local_rank": hvd.local_rank(), "threads": threads,
                                    "policies": policies, "later": later[0],
                                    "sum": total.tolist()}))
"""


def expected_share(local_rank, local_size):
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_size
    if share == 0:
        return None  # more ranks than cores: not bound
    return cores[local_rank * share:(local_rank + 1) * share]


@pytest.mark.parametrize("np_", [2, 3])
def test_bind_to_core_gives_each_rank_its_share(np_):
    result = assert_ok(run_job(np_, SCRIPT, launcher_args=["--bind-to", "core"]))
    everything = sorted(os.sched_getaffinity(0))
    for rank in range(np_):
        got = result.result(rank)
        assert got["sum"] == [sum(k + i for k in range(np_)) for i in range(4)]
        want = expected_share(got["local_rank"], np_)
        if want is None:
            assert "ranks on this host and" in result.stderr_text(rank), describe(result)
            want = everything
        assert any(name.startswith("hvdlite-loop:") for name in got["threads"])
        for name, cores in got["threads"].items():
            assert cores == want, f"rank {rank} thread {name}: cores {cores}, expected {want}"
        assert got["later"] == want, f"rank {rank}: a thread started after init got {got['later']}"
    if expected_share(0, np_) is not None:
        shares = [set(result.result(r)["threads"][next(iter(result.result(r)["threads"]))])
                  for r in range(np_)]
        assert all(not (a & b) for i, a in enumerate(shares) for b in shares[i + 1:])


def test_unbound_by_default():
    result = assert_ok(run_job(2, SCRIPT))
    everything = sorted(os.sched_getaffinity(0))
    for rank in range(2):
        for name, cores in result.result(rank)["threads"].items():
            assert cores == everything, f"rank {rank} thread {name} bound to {cores}"


def realtime_permitted():
    """Whether the kernel lets a process of ours make a thread SCHED_FIFO."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          timeout=60).returncode == 0


# Two ranks' background threads real-time here: the kernel permits SCHED_FIFO to this
# user (root, CAP_SYS_NICE or RLIMIT_RTPRIO > 0; containers may take it away) and there is
# a core for each. CI runs as root on at least 2 cores and requires this (HVDLITE_REQUIRE
# includes "realtime", needs.py): there these tests fail instead of skipping.
REALTIME_PERMITTED = realtime_permitted()
REALTIME_HERE = REALTIME_PERMITTED and len(os.sched_getaffinity(0)) >= 2
REALTIME_MISSING = "the kernel does not let this user make threads real-time, or fewer than 2 cores"
needs_realtime = needs.needs("realtime", REALTIME_HERE, REALTIME_MISSING)

# Variables of this environment that would change what the tests expect (the job
# inherits the environment): the default, and no timeline writer thread.
UNSET = {"HVDLITE_BACKGROUND_REALTIME": None, "HVDLITE_TIMELINE": None, "HOROVOD_TIMELINE": None}


def loop_and_others(result, rank):
    """The background thread's policy (SCHED_RESET_ON_FORK masked) and every other
    thread's; asserts that a real-time background thread starts its threads normal."""
    policies = result.result(rank)["policies"]
    loop = [name for name in policies if name.startswith("hvdlite-loop:")]
    assert len(loop) == 1, f"rank {rank}: threads {sorted(policies)}"
    policy = policies[loop[0]]
    if policy & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO:
        assert policy & os.SCHED_RESET_ON_FORK, f"rank {rank}: threads it starts would be real-time too"
    return policy & ~os.SCHED_RESET_ON_FORK, {
        name: p & ~os.SCHED_RESET_ON_FORK for name, p in policies.items() if name != loop[0]}


@pytest.mark.parametrize("np_", [2, 3])
def test_background_thread_is_realtime_where_permitted(np_):
    fits = np_ <= len(os.sched_getaffinity(0))
    if fits and not REALTIME_PERMITTED and needs.required("realtime"):
        needs.need("realtime", REALTIME_MISSING)  # the expectation below would be SCHED_OTHER
    result = assert_ok(run_job(np_, SCRIPT, env=UNSET))
    want = os.SCHED_FIFO if fits and REALTIME_PERMITTED else os.SCHED_OTHER
    for rank in range(np_):
        assert result.result(rank)["sum"] == [sum(k + i for k in range(np_)) for i in range(4)]
        loop, others = loop_and_others(result, rank)
        assert loop == want, f"rank {rank}: background thread policy {loop}, expected {want}"
        assert set(others.values()) == {os.SCHED_OTHER}, f"rank {rank}: {others}"
        # Unasked, normal priority is no news.
        assert "HVDLITE_BACKGROUND_REALTIME" not in result.stderr_text(rank), describe(result)


@needs_realtime
def test_background_realtime_asked_where_permitted():
    result = assert_ok(run_job(2, SCRIPT, env={**UNSET, "HVDLITE_BACKGROUND_REALTIME": "1"}))
    for rank in range(2):
        loop, others = loop_and_others(result, rank)
        assert loop == os.SCHED_FIFO and set(others.values()) == {os.SCHED_OTHER}
        assert "HVDLITE_BACKGROUND_REALTIME" not in result.stderr_text(rank), describe(result)


# The start of a rank script: hvdlite initialized, ``seen`` filled with the background
# thread's scheduling policies by a sampling thread until ``done`` is set.
SAMPLER = """
import json, os, threading, time
import numpy as np
import hvdlite as hvd

hvd.init()
# The background thread is the first (lowest tid) thread of its name; a thread that
# Open MPI starts from it inherits the name and may end while this test runs. Once
# found, its tid is asked directly (a listing of /proc/self/task under load has missed
# it for seconds), and looked up again only if it no longer has the name.
found = []
def policy_of_loop():
    deadline = time.time() + 10
    while True:
        if found:
            try:
                if open(f"/proc/self/task/{found[0]}/comm").read().strip() == "hvdlite-loop":
                    return os.sched_getscheduler(found[0]) & ~os.SCHED_RESET_ON_FORK
            except (OSError, ProcessLookupError):
                pass
            found.clear()
        tids, names = [], {}
        for t in os.listdir("/proc/self/task"):
            try:
                names[int(t)] = open(f"/proc/self/task/{t}/comm").read().strip()
            except OSError:
                pass  # ended while listed
        tids = [t for t, n in names.items() if n == "hvdlite-loop"]
        if not tids:
            # Not seen in this listing (a read that failed under load): look again,
            # for a while, then say what threads there were.
            if time.time() > deadline:
                raise RuntimeError(f"no hvdlite-loop thread among {names}")
            time.sleep(0.001)
            continue
        found.append(min(tids))
# Found once before the job's collectives start (and threads with them).
policy_of_loop()
seen, done = set(), threading.Event()
def sample():
    while not done.is_set():
        seen.add(policy_of_loop())
sampler = threading.Thread(target=sample)
sampler.start()
"""


@needs_realtime
def test_blocking_mpi_collectives_run_at_normal_priority():
    # A blocking MPI call spins until every peer is in: the background thread leaves
    # real-time for it. On one host every collective goes through shared memory (at
    # real-time priority) unless HVDLITE_SHM_ALLREDUCE=0; then alltoall is a blocking
    # MPI call. A thread of each rank samples the policy while the ranks exchange 4 MiB
    # tensors: both must show.
    result = assert_ok(run_job(2, SAMPLER + textwrap.dedent("""
        part = np.full(1 << 20, float(hvd.rank() + 1), np.float32)
        for step in range(100):
            got, _ = hvd.alltoall(part * (step + 1), name=f"a2a.{step % 4}")
            # Half of each rank's tensor from each rank, in rank order.
            assert got.shape == (1 << 20,) and got[0] == step + 1 and got[-1] == 2 * (step + 1)
        done.set(); sampler.join()
        # Back to real-time once no blocking call is in flight (another may still be,
        # for a moment, when alltoall returns: give it a second).
        for _ in range(100):
            after = policy_of_loop()
            if after == os.SCHED_FIFO:
                break
            time.sleep(0.01)
        # No rank ends (its shutdown ends every rank's loop thread) before each has
        # looked: a collective that each joins once done.
        hvd.allreduce(np.zeros(1, np.float32), name="looked")
        print("HVDLITE_RESULT", json.dumps({"seen": sorted(seen), "after": after}))
    """), env={**UNSET, "HVDLITE_SHM_ALLREDUCE": "0"}))
    for rank in range(2):
        got = result.result(rank)
        assert set(got["seen"]) == {os.SCHED_FIFO, os.SCHED_OTHER}, describe(result)
        assert got["after"] == os.SCHED_FIFO


@needs_realtime
def test_a_rank_alone_never_leaves_realtime():
    # Alone, a blocking MPI call has no peer to wait for (it copies): the background
    # thread keeps real-time through it (two system calls a collective saved; a 4 KiB
    # allreduce of one rank took 65 us with them, 11 us without).
    result = assert_ok(run_job(1, SAMPLER + textwrap.dedent("""
        x = np.arange(1 << 20, dtype=np.float32)
        for step in range(200):
            assert np.array_equal(hvd.allreduce(x, op=hvd.Sum, name="ar"), x)
            assert np.array_equal(hvd.broadcast(x, 0, name="bc"), x)
            assert np.array_equal(hvd.allgather(x[:1000], name="ag"), x[:1000])
        done.set(); sampler.join()
        print("HVDLITE_RESULT", json.dumps({"seen": sorted(seen)}))
    """), env=UNSET))
    assert result.result(0)["seen"] == [os.SCHED_FIFO], describe(result)


def test_a_rank_with_cores_to_spare_keeps_its_background_thread_by_a_blocked_caller():
    # One rank on this machine's cores (2 or more, two for each rank): a blocking call
    # handed to the background thread (2 MiB: more than the 1 MiB a caller runs in its
    # own cycle) keeps that thread on the caller's core, an op enqueued without a wait
    # lets it go anywhere again. Two ranks on 2 cores: never moved.
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to keep the background thread off")
    script = textwrap.dedent("""
        import json, os
        import numpy as np
        import hvdlite as hvd

        hvd.init()
        def loop_cores():
            for t in os.listdir("/proc/self/task"):
                if open(f"/proc/self/task/{t}/comm").read().strip() == "hvdlite-loop":
                    return sorted(os.sched_getaffinity(int(t)))
        x = np.ones(524288, np.float32)
        seen = {"start": loop_cores()}
        for i in range(20):
            hvd.allreduce(x, op=hvd.Sum, name="blocking")
        seen["blocking"] = loop_cores()
        hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name="async"))
        seen["async"] = loop_cores()
        print("HVDLITE_RESULT", json.dumps(seen))
    """)
    alone = assert_ok(run_job(1, script, env=UNSET)).result(0)
    assert alone["start"] == cores and alone["async"] == cores, alone
    assert len(alone["blocking"]) == 1 and alone["blocking"][0] in cores, alone
    pair = assert_ok(run_job(2, script, env=UNSET))
    if len(cores) < 4:
        for rank in range(2):
            got = pair.result(rank)
            assert got["start"] == got["blocking"] == got["async"] == cores, (rank, got)


def test_background_realtime_off():
    result = assert_ok(run_job(2, SCRIPT, env={**UNSET, "HVDLITE_BACKGROUND_REALTIME": "0"}))
    for rank in range(2):
        loop, others = loop_and_others(result, rank)
        assert loop == os.SCHED_OTHER and set(others.values()) == {os.SCHED_OTHER}


def test_background_realtime_asked_with_more_ranks_than_cores_warns():
    # The job inherits this process's affinity: one core for two ranks.
    everything = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(everything)})
    try:
        result = assert_ok(run_job(2, SCRIPT, env={**UNSET, "HVDLITE_BACKGROUND_REALTIME": "1"}))
    finally:
        os.sched_setaffinity(0, everything)
    for rank in range(2):
        loop, _ = loop_and_others(result, rank)
        assert loop == os.SCHED_OTHER
        assert result.result(rank)["sum"] == [sum(k + i for k in range(2)) for i in range(4)]
        stderr = result.stderr_text(rank)
        assert "HVDLITE_BACKGROUND_REALTIME=1" in stderr, describe(result)
        assert "2 ranks share 1 core (the ranks on this machine" in stderr, describe(result)


@pytest.mark.parametrize("var,value,says", [
    ("HVDLITE_BIND_TO", "socket", "HVDLITE_BIND_TO='socket'"),
    ("HVDLITE_BACKGROUND_REALTIME", "yes", "HVDLITE_BACKGROUND_REALTIME='yes' must be 0 or 1"),
])
def test_bad_value_fails_init_naming_it(var, value, says):
    result = run_job(2, """
        import json
        import hvdlite as hvd
        try:
            hvd.init()
            print("HVDLITE_RESULT", json.dumps({"error": None}))
        except hvd.errors.InvalidArgumentError as e:
            print("HVDLITE_RESULT", json.dumps({"error": str(e)}))
    """, env={var: value})
    for rank in range(2):
        error = result.result(rank)["error"]
        assert error is not None and says in error, describe(result)
