"""hvdliterun --bind-to core (HVDLITE_BIND_TO=core) in real jobs: every thread of local
rank r, the background thread included, and the threads it starts afterwards run on the
r-th of local_size equal blocks of the cores the job may use; with more ranks than cores
nothing is bound and every rank says why; a bad value fails init with an error naming the
variable. Expected cores come from this process's own affinity, which the job inherits.
"""
import os

import pytest

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import json, os, threading
import numpy as np
import hvdlite as hvd

def cores_of(tid):
    return sorted(os.sched_getaffinity(tid))

hvd.init()
threads = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/comm") as f:
        threads[f.read().strip() + ":" + tid] = cores_of(int(tid))
later = []
t = threading.Thread(target=lambda: later.append(cores_of(0)))
t.start(); t.join()
# The job still reduces right once bound.
total = hvd.allreduce(np.arange(4.0) + hvd.rank(), op=hvd.Sum, name="bound.sum")
print("HVDLITE_RESULT", json.dumps({"local_rank": hvd.local_rank(), "threads": threads,
                                    "later": later[0], "sum": total.tolist()}))
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


def test_bad_bind_to_value_fails_init_naming_it():
    result = run_job(2, """
        import json
        import hvdlite as hvd
        try:
            hvd.init()
            print("HVDLITE_RESULT", json.dumps({"error": None}))
        except hvd.errors.InvalidArgumentError as e:
            print("HVDLITE_RESULT", json.dumps({"error": str(e)}))
    """, env={"HVDLITE_BIND_TO": "socket"})
    for rank in range(2):
        error = result.result(rank)["error"]
        assert error is not None and "HVDLITE_BIND_TO='socket'" in error, describe(result)
