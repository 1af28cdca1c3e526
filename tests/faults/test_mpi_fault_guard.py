"""A fault inside MPI on the background thread parks that thread instead of killing the rank.

MPICH's error path after a lost peer dereferences a null pointer inside MPI_Test (see
native/src/transport/mpi_fault_guard.h); ranks died of SIGSEGV before the launcher's lost-peer
notice reached them. Here the test hook hvdlite_test_fault_in_mpi makes the last rank's
next MPI call fault the same way (a real SIGSEGV on a null pointer, inside the call's
guard), deterministically. Checked: that rank lives on and says on stderr which MPI call
faulted, its pending collective (and every peer's) times out instead of completing,
shutdown refuses with a clear error instead of joining the parked thread forever, and
the process exits on its own with status 0, not of SIGSEGV.

A second case: a process that recorded lost peers ends at exit with status 1 at once,
its output flushed, even when the script itself ends normally (the teardown that would
race the background thread is skipped).
"""
import json
import os
import subprocess
import sys

import pytest

from harness import REPO_ROOT, describe, job_env, run_job

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("native")]

SCRIPT = r'''
import json, os, sys, time
import numpy as np
import hvdlite as hvd
from hvdlite._native import lib
from hvdlite.errors import HvdliteError, WaitTimeoutError
from hvdlite.runner.rank_wrapper import MPI_SEGMENT_PREFIXES, SHM_DIR
PREFIXES = tuple(f"{SHM_DIR}/{p}" for p in MPI_SEGMENT_PREFIXES)

# "background": the fault hits the background thread's next MPI call; "caller": the
# next MPI call of a thread that runs its own blocking call's cycle (across hosts,
# tests/cluster/test_cluster_faults.py); "caller-shutdown": the same a second after
# that call began, while another thread shuts down. There rank 0 hands its ops to its
# background thread, so that its wait can time out: a thread in its own cycle waits
# there for the peers' round, which the faulted rank never joins (its process lives on,
# so no lost-peer notice ends that wait).
where = sys.argv[1] if len(sys.argv) > 1 else "background"
if where != "background" and os.environ["HVDLITE_RANK"] == "0":
    os.environ["HVDLITE_CALLER_CYCLE"] = "0"
hvd.init()
rank, size = hvd.rank(), hvd.size()
faulting = rank == size - 1
x = np.full(1024, rank + 1, np.float32)
report = {"before": float(hvd.allreduce(x, op=hvd.Sum, name="before")[0]),
          "segments": sorted({line.split()[-1] for line in open("/proc/self/maps")
                              if line.split()[-1].startswith(PREFIXES)})}
if faulting and where == "caller-shutdown":
    # shutdown() passes its checks while another thread's cycle is inside MPI, before
    # its fault; then it must not wait for good on the background thread, which waits
    # for the cycle token that the faulted cycle keeps.
    import threading
    outcome = {}
    def calls():  # blocking calls until one fails: the first whose cycle is its own
        for _ in range(200):
            try:
                hvd.allreduce(x, op=hvd.Sum, name="after")
            except HvdliteError as e:
                outcome["after"] = f"{type(e).__name__}: {e}"
                return
    before = hvd.stats()["caller_cycles"]
    lib.hvdlite_test_fault_in_caller_cycle(1.0)
    caller = threading.Thread(target=calls, daemon=True)
    caller.start()
    deadline = time.monotonic() + 30
    while hvd.stats()["caller_cycles"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # inside its first cycle, which faults 1 s after it began
    started = time.monotonic()
    try:
        hvd.shutdown()
        report["shutdown"] = "ok"
    except HvdliteError as e:
        report["shutdown"] = f"{type(e).__name__}: {e}"
    report["shutdown_s"] = time.monotonic() - started
    caller.join(timeout=30)
    report["after"] = outcome.get("after", "no failure")
    print("HVDLITE_RESULT", json.dumps(report), flush=True)
    sys.exit(0)
if faulting:
    (lib.hvdlite_test_fault_in_mpi() if where == "background"
     else lib.hvdlite_test_fault_in_caller_cycle(0.0))
# Calls until one does not end: the first whose cycle the chosen thread runs (an op the
# other thread takes first completes, and the hook waits on).
report["after"] = "completed"
for calls in range(1, 201):
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="after")
    try:
        handle.wait(timeout=4)
    except WaitTimeoutError:
        report["after"] = "timed out"
        break
    except HvdliteError as e:  # no cycle runs after a caller's escape: the ops fail
        report["after"] = f"{type(e).__name__}: {e}"
        break
report["calls"] = calls
if faulting:
    try:
        hvd.shutdown()
        report["shutdown"] = "ok"
    except HvdliteError as e:
        report["shutdown"] = f"{type(e).__name__}: {e}"
print("HVDLITE_RESULT", json.dumps(report), flush=True)
if not faulting:
    # This rank's thread waits on the parked one forever (shutdown would too); the
    # faulting rank ends first, on its own.
    time.sleep(5)
    os._exit(0)
'''


def check_fault_report(result, np_, thread):
    """What every rank of SCRIPT's job reported, and the faulting rank's stderr naming
    the thread (``in the background thread``, ``in a blocking call's cycle``). Its op
    waits for good where the background thread is parked; after a caller's escape no
    cycle runs, and the op fails with the fault's error. The others' ops time out."""
    faulting = np_ - 1
    for rank in range(np_):
        report = result.result(rank)
        assert report["before"] == np_ * (np_ + 1) / 2, (rank, report)
        if rank == faulting and "blocking call" in thread:
            after = report["after"]
            assert after.startswith("TransportError") and "faulted inside MPI" in after, after
        else:
            assert report["after"] == "timed out", (rank, report)
    stderr = "\n".join(result.rank_stderr.get(faulting, []))
    assert "hvdlite: SIGSEGV inside MPI_" in stderr and thread in stderr, describe(result)
    assert "Segmentation fault" not in result.stderr + result.stdout, describe(result)
    shutdown = result.result(faulting)["shutdown"]
    assert shutdown.startswith("TransportError") and "faulted inside MPI" in shutdown, shutdown


@pytest.mark.parametrize("np_", [2, 3])
def test_fault_inside_mpi_parks_the_background_thread(np_):
    result = run_job(np_, SCRIPT, timeout=120, env={"HVDLITE_SHM_ALLREDUCE": "0"})
    faulting = np_ - 1
    check_fault_report(result, np_, "in the background thread")
    assert result.result(faulting)["calls"] == 1, result.result(faulting)
    # It ended on its own with status 0 (hvdliterun names a rank that failed or died of
    # a signal). Not checked: the job's status, which the hydra launcher makes non-zero
    # when it sees ranks end without MPI_Finalize.
    launcher = "\n".join(result.untagged)
    assert f"rank {faulting} " not in launcher, describe(result)
    # No rank finalized MPI and mpiexec killed the rank wrappers: hvdliterun removes
    # the MPI's shared memory of the job (it would stay in /dev/shm for good).
    segments = {s for rank in range(np_) for s in result.result(rank)["segments"]}
    left = [s for s in segments if os.path.exists(s)]
    assert not left, f"MPI shared memory left in /dev/shm: {left}\n" + describe(result)


EXIT_SCRIPT = r'''
import os, sys
from hvdlite import peer_faults
read_end, _ = os.pipe()
assert peer_faults.start_listening({"HVDLITE_FAULT_FD": str(read_end)})
peer_faults.record({"ranks": [3], "hosts": ["h2"], "reason": "was killed"})
sys.stdout.write("unflushed line before exit")  # no newline: flushed by the exit hook
sys.exit(0)
'''


def test_a_process_with_lost_peers_exits_at_once_with_status_1():
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True,
                          timeout=60, env=job_env({"PYTHONUNBUFFERED": None}), cwd=REPO_ROOT)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "unflushed line before exit", (proc.stdout, proc.stderr)
