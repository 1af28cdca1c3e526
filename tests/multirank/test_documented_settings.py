"""Settings the documentation promises, checked by what runs (the core's path counters in
``hvd.stats()``, the MPI thread level), not by what is reported chosen:

* ``HVDLITE_SHM_ALLREDUCE=0`` turns the hierarchical allreduce off (with a notice on rank
  0 when it was asked for), not the hierarchical allgather (docs/hierarchical.md);
* ``HVDLITE_MPI_THREAD_FUNNELED=1``, and Horovod's ``HOROVOD_MPI_THREADS_DISABLE=1``,
  make hvdlite initialize MPI with MPI_THREAD_FUNNELED, not MULTIPLE (docs/tuning.md).

"Hosts" here are made with ``HVDLITE_HOST_ID`` (2 x 2, ranks placed alternately), as in
test_hierarchical_allreduce.py.
"""
import pytest

import needs

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import json, os
import numpy as np
os.environ["HVDLITE_HOST_ID"] = "host-" + "ABAB"[int(os.environ["HVDLITE_RANK"])]
import hvdlite as hvd
hvd.init()
rank, size = hvd.rank(), hvd.size()
counters = ("collectives", "hierarchical_collectives", "shm_collectives")

def delta(before):
    after = hvd.stats()
    return {c: after[c] - before[c] for c in counters}

before = hvd.stats()
for step in range(5):
    got = hvd.allreduce(np.full(1000, rank + step, np.float32), op=hvd.Sum, name="a")
    assert np.all(got == sum(r + step for r in range(size))), got[:3]
allreduce = delta(before)
before = hvd.stats()
for step in range(5):
    got = hvd.allgather(np.full((2, 3), rank, np.float32), name="g")
    assert np.array_equal(got[:, 0], np.repeat(np.arange(size), 2)), got
allgather = delta(before)
print("HVDLITE_RESULT", json.dumps({"allreduce": allreduce, "allgather": allgather}))
"""

HIERARCHICAL = {"HVDLITE_HIERARCHICAL_ALLREDUCE": "1", "HVDLITE_HIERARCHICAL_ALLGATHER": "1"}


def test_shm_allreduce_off_turns_the_hierarchical_allreduce_off_with_a_notice():
    result = assert_ok(run_job(4, SCRIPT, env={**HIERARCHICAL, "HVDLITE_SHM_ALLREDUCE": "0"},
                               timeout=240))
    info = describe(result)
    for rank in range(4):
        got = result.result(rank)
        assert got["allreduce"]["collectives"] == 5, info
        assert got["allreduce"]["hierarchical_collectives"] == 0, (rank, got, info)
        assert got["allreduce"]["shm_collectives"] == 0, (rank, got, info)
        # The hierarchical allgather stays on (MPI within the host).
        assert got["allgather"]["hierarchical_collectives"] == 5, (rank, got, info)
    assert "HVDLITE_SHM_ALLREDUCE=0 turns off" in result.stderr_text(0), info
    # The same job with shared memory on: the allreduce is hierarchical.
    result = assert_ok(run_job(4, SCRIPT, env={**HIERARCHICAL, "HVDLITE_SHM_ALLREDUCE": None},
                               timeout=240))
    for rank in range(4):
        got = result.result(rank)
        assert got["allreduce"]["hierarchical_collectives"] == 5, (rank, got, describe(result))
        assert "HVDLITE_SHM_ALLREDUCE=0 turns off" not in result.stderr_text(rank)


LEVEL = r"""
import json
import numpy as np
import hvdlite as hvd
hvd.init()
got = hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, name="x")
from mpi4py import MPI  # after init: MPI is hvdlite's, mpi4py only asks
print("HVDLITE_RESULT", json.dumps({"supported": hvd.mpi_threads_supported(),
                                    "level": MPI.Query_thread(), "sum": float(got[0]),
                                    "funneled": MPI.THREAD_FUNNELED,
                                    "multiple": MPI.THREAD_MULTIPLE}))
"""

UNSET = {"HVDLITE_MPI_THREAD_FUNNELED": None, "HOROVOD_MPI_THREADS_DISABLE": None}


@pytest.mark.parametrize("variable, funneled", [
    (None, False),
    ("HVDLITE_MPI_THREAD_FUNNELED", True),
    ("HOROVOD_MPI_THREADS_DISABLE", True),
])
@needs.needs("mpi4py", needs.installed("mpi4py"), "mpi4py is not installed")
def test_mpi_thread_level_follows_the_variable(variable, funneled):
    env = dict(UNSET)
    if variable:
        env[variable] = "1"
    result = assert_ok(run_job(2, LEVEL, env=env))
    for rank in range(2):
        got = result.result(rank)
        assert got["sum"] == 2.0
        want = got["funneled"] if funneled else got["multiple"]
        assert got["level"] == want, (variable, got, describe(result))
        assert got["supported"] is (not funneled), (variable, got)
