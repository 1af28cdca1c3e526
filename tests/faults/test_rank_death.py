"""A rank is SIGKILLed in the middle of a training loop with allreduces in flight.

What happens: the dead rank's wrapper reports its exit status to hvdliterun at once;
hvdliterun prints which rank died and how, orders every other rank's wrapper to end its
process group (SIGTERM, SIGKILL after a grace), and exits with 128 + the signal. The
survivors, blocked in a collective with the dead rank, are ended by the launcher.
Checked: the whole job ends within 30 s of the kill, the exit status is non-zero, the
message names the lost rank, and no rank process is left, nor MPICH's shared-memory
segment (which MPI_Finalize would have unlinked: the rank wrappers remove it).
"""
import json
import os
import time

import pytest

from harness import describe, run_job
from hvdlite import build_record
from hvdlite.runner.testing import pid_alive

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

NP = 3
VICTIM = 1
BOUND_S = 30.0

SCRIPT = r'''
import json, os, signal, sys, time
import numpy as np
import hvdlite as hvd
from hvdlite.runner.rank_wrapper import MPI_SEGMENT_PREFIXES, SHM_DIR
PREFIXES = tuple(f"{SHM_DIR}/{p}" for p in MPI_SEGMENT_PREFIXES)

hvd.init()
r = hvd.rank()
segments = sorted({line.split()[-1] for line in open("/proc/self/maps")
                   if line.split()[-1].startswith(PREFIXES)})
print("HVDLITE_RESULT", json.dumps({"pid": os.getpid(), "segments": segments}), flush=True)
time.sleep(1.5)  # segments younger than a second are left alone (they may be a new job's)
x = np.ones(64 * 1024, np.float32)
for step in range(1_000_000):
    handles = [hvd.allreduce_async(x, name=f"grad{i}") for i in range(8)]
    if step == 30 and r == int(sys.argv[1]):
        print("HVDLITE_RESULT", json.dumps({"killed_at": time.time()}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # allreduces in flight everywhere
    for h in handles:
        hvd.synchronize(h)
'''


def test_killed_rank_ends_the_job_quickly_and_cleanly():
    result = run_job(NP, SCRIPT, timeout=120, args=(VICTIM,))
    ended = time.time()
    assert result.returncode == 128 + 9, describe(result)
    killed_at = result.result(VICTIM)["killed_at"]
    elapsed = ended - killed_at
    print(f"\nrank {VICTIM} SIGKILLed; job ended {elapsed:.2f} s later, "
          f"hvdliterun exit status {result.returncode}")
    assert elapsed < BOUND_S, describe(result)
    launcher = "\n".join(result.untagged)
    assert f"rank {VICTIM}" in launcher and "SIGKILL" in launcher, describe(result)
    pids = [result.result(r, 0)["pid"] for r in range(NP)]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if pid_alive(p)]
    assert not left, f"rank processes left behind: {left}\n" + describe(result)
    segments = {s for r in range(NP) for s in result.result(r, 0)["segments"]}
    mpi = build_record.read_if_readable().get("mpi_implementation")
    if mpi in ("MPICH", "Open MPI"):
        assert segments, f"{mpi}'s ranks mapped no shared-memory segment in /dev/shm"
    left = [s for s in segments if os.path.exists(s)]
    assert not left, f"MPI shared memory left in /dev/shm: {left}\n" + describe(result)


STALLED_WRAPPER_SCRIPT = r'''
import os, signal, sys
import numpy as np
import hvdlite as hvd
from hvdlite.runner.testing import stall_wrapper

hvd.init()
for step in range(1_000_000):
    if step == 20 and hvd.rank() == int(sys.argv[1]):
        # This rank's wrapper stops for 3 s, then it dies: its peers' shared-memory wait
        # sees the process end before the launcher hears of it.
        stall_wrapper(3)
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.allreduce(np.ones(1024, np.float32), name=f"step{step}")
'''


def test_a_death_the_launcher_hears_of_late_is_still_the_failure_it_names():
    # The survivors' uncaught RankFailedError ends them; had they ended before the dead
    # rank's wrapper reported, the launcher would have named a survivor's exit status 1
    # ("rank 0 exited with code 1") as the job's failure and never the dead rank.
    result = run_job(NP, STALLED_WRAPPER_SCRIPT, timeout=120, args=(VICTIM,))
    launcher = "\n".join(result.untagged)
    assert "ended during a shared-memory collective" in result.stderr, describe(result)
    assert f"rank {VICTIM} (pid" in launcher and "killed by signal 9" in launcher, \
        describe(result)
    assert "exited with code 1" not in launcher, describe(result)
    assert result.returncode == 128 + 9, describe(result)
