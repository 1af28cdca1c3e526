"""Allreduce through shared memory (every rank on this machine), in real 2- and 3-rank
jobs, against numpy and against the MPI path (``HVDLITE_SHM_ALLREDUCE=0``).

Sizes cover what the chunked algorithm could get wrong: empty tensors, fewer elements
than ranks (some ranks reduce nothing), and tensors of several 512 KiB chunks whose last
chunk is partial, for every dtype; in place and not; one after another, so that the two
alternating slot sets are reused. Expected values come from ``core_reference``: each
rank regenerates every rank's contribution with numpy.
"""
import pytest

import harness

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import json, sys
import numpy as np
import hvdlite as hvd
from core_reference import Case, DTYPES, FLOAT_DTYPES, allreduce_case, contribution, check, np_dtype

hvd.init()
rank, size = hvd.rank(), hvd.size()
CHUNK = 1 << 19  # the core's chunk size in bytes

cases = []
for dtype in DTYPES:
    item = np_dtype(dtype).itemsize
    ops = ("Min", "Max") if dtype == "bool" else ("Sum", "Average", "Min", "Max", "Product")
    for op in ops:
        for k, n in enumerate((0, 1, 2 * size - 1, 1000)):
            cases.append(Case(f"{dtype}.{op}.{k}", dtype, op, (n,)))
    # Several chunks, the last one partial; 2-D, so rows do not line up with chunks.
    big_op = "Max" if dtype == "bool" else "Sum"
    cases.append(Case(f"{dtype}.{big_op}.big", dtype, big_op, (2 * CHUNK // item // 3 + 5, 3)))
cases.append(Case("float32.Product.big", "float32", "Product", (CHUNK // 4 + 1,)))
cases.append(Case("float64.Average.big.scaled", "float64", "Average", (CHUNK // 8 * 3 + 7,),
                  0.5, 3.0))

failures, disagree = [], []
gathers_through_shm = 0  # the allgathers below that went through shared memory
for i, case in enumerate(cases):
    got = allreduce_case(hvd, case, rank, in_place=i % 2 == 1)
    problem = check(got, [contribution(1, r, case) for r in range(size)], case)
    if problem:
        failures.append(problem)
    # Every rank must hold the same bits, not just values within a tolerance.
    raw = np.ascontiguousarray(got).view(np.uint8).ravel()
    before = hvd.stats()["shm_collectives"]
    every = hvd.allgather(raw[None, :] if raw.size else raw.reshape(1, 0),
                          name=case.name + ".bits")
    gathers_through_shm += hvd.stats()["shm_collectives"] - before
    if not all(np.array_equal(every[0], every[r]) for r in range(size)):
        disagree.append(case.name)
print("HVDLITE_RESULT", json.dumps({"cases": len(cases), "failures": failures,
                                    "disagree": disagree, "stats": hvd.stats(),
                                    "gathers_through_shm": gathers_through_shm}))
hvd.shutdown()
"""


@pytest.mark.parametrize("np_,shm", [(2, "on"), (3, "on"), (3, "off")])
def test_allreduce_every_dtype_and_size(np_, shm):
    env = {"HVDLITE_SHM_ALLREDUCE": "1" if shm == "on" else "0",
           "HVDLITE_FUSION_THRESHOLD": None}
    job = harness.assert_ok(harness.run_job(np_, SCRIPT, timeout=300, env=env))
    for rank in range(np_):
        res = job.result(rank)
        assert not res["failures"], (f"rank {rank}: {len(res['failures'])} wrong:\n"
                                     + "\n".join(res["failures"][:20]))
        assert not res["disagree"], f"rank {rank}: ranks hold different bits for {res['disagree']}"
        shm_ops = res["stats"]["shm_collectives"]
        if shm == "on":
            # Every allreduce above went through shared memory (besides those allgathers
            # that did).
            assert shm_ops - res["gathers_through_shm"] == res["cases"], res["stats"]
        else:
            assert shm_ops == 0, res["stats"]


LAGGING_SCRIPT = r"""
import json, threading
import numpy as np
import hvdlite as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
CHUNK = 1 << 19
n = CHUNK * 7 // 2 // 4 + 3  # float32: three and a half chunks, and a few elements
stop = threading.Event()

def hog():
    # Takes the cores from the background threads at random moments (numpy releases
    # the GIL), so that ranks fall behind one another in the middle of an allreduce.
    a = np.random.default_rng(rank).random((256, 256))
    while not stop.is_set():
        a = a @ a
        a /= np.abs(a).max()

hogs = [threading.Thread(target=hog) for _ in range(2)]
for h in hogs:
    h.start()
base = np.arange(n, dtype=np.float32) % 1000
wrong = []
for it in range(40):
    handles = [hvd.allreduce_async(base * (rank + 1) + it + k, name=f"lag.{it}.{k}", op=hvd.Sum)
               for k in range(3)]
    for k, h in enumerate(handles):
        got = hvd.synchronize(h)
        want = base * (size * (size + 1) // 2) + size * (it + k)
        if not np.array_equal(got, want):
            wrong.append(f"{it}.{k}: {int((got != want).sum())} elements differ")
stop.set()
for h in hogs:
    h.join()
print("HVDLITE_RESULT", json.dumps({"wrong": wrong, "stats": hvd.stats()}))
hvd.shutdown()
"""


def shm_results(np_, script):
    """Runs script on np_ ranks through shared memory; every rank's result, each checked
    to have nothing in its "wrong" list."""
    env = {"HVDLITE_SHM_ALLREDUCE": "1", "HVDLITE_FUSION_THRESHOLD": None}
    job = harness.assert_ok(harness.run_job(np_, script, timeout=300, env=env))
    results = [job.result(rank) for rank in range(np_)]
    for rank, res in enumerate(results):
        assert not res["wrong"], f"rank {rank}: {res['wrong'][:10]}"
    return results


@pytest.mark.parametrize("np_", [2, 3])
def test_allreduce_with_ranks_falling_behind_mid_call(np_):
    # Chunks pipelined over per-rank progress counters: a rank may run a chunk ahead of
    # a peer and must never overwrite a slot the peer still reads, across calls too.
    for res in shm_results(np_, LAGGING_SCRIPT):
        assert res["stats"]["shm_collectives"] >= 40, res["stats"]


FUSED_SCRIPT = r"""
import json
import numpy as np
import hvdlite as hvd
from core_reference import grouped_allreduce_counted

hvd.init()
rank, size = hvd.rank(), hvd.size()
CHUNK = 1 << 19
# Small and large (over 1 MiB, several chunks) tensors of one group, in place.
counts = (3, CHUNK * 5 // 4 + 5, 7, CHUNK * 3 // 4, 1)
wrong, collectives = [], []
for it in range(3):
    tensors = [np.arange(n, dtype=np.float32) % 97 * (rank + 1) + it + k
               for k, n in enumerate(counts)]
    got, used = grouped_allreduce_counted(hvd, tensors, name=f"mixed.{it}", op=hvd.Sum)
    collectives.append(used)
    for k, (n, g) in enumerate(zip(counts, got)):
        want = np.arange(n, dtype=np.float32) % 97 * (size * (size + 1) // 2) + size * (it + k)
        if not np.array_equal(g, want):
            wrong.append(f"{it}.{k}: {int((g != want).sum())} of {n} elements differ")
print("HVDLITE_RESULT", json.dumps({"wrong": wrong, "collectives": collectives}))
hvd.shutdown()
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_large_tensors_fuse_with_small_ones_through_shared_memory(np_):
    # Through shared memory a fused allreduce reads every tensor in place, so tensors
    # over 1 MiB (which go alone over MPI, to spare the fusion buffer's copies) join
    # the others: one collective per group.
    for res in shm_results(np_, FUSED_SCRIPT):
        assert res["collectives"] == [1, 1, 1], res


ORDER_SCRIPT = r"""
import json
import numpy as np
import hvdlite as hvd
from core_reference import grouped_allreduce_counted

hvd.init()
rank, size = hvd.rank(), hvd.size()
CHUNK = 1 << 19
# Tensors fused into one collective: parts of chunks that lie in one tensor (reduced
# and written in one pass) and parts that straddle two tensors (reduced in the slot
# and copied out).
counts = (CHUNK // 4 * 3 + 11, 5, CHUNK // 8 + 3, CHUNK // 4 + 1)
wrong, collectives = [], []
for dtype in (np.float32, np.float64):
    for op in ("Sum", "Average"):
        for in_place in (False, True):
            name = f"{np.dtype(dtype).name}.{op}.{'in_place' if in_place else 'out'}"
            # Every rank's values, of mixed magnitudes, so that another order of the sum
            # or another way of scaling would round differently.
            contribs = [[(np.random.default_rng(100 * r + k).standard_normal(n) *
                          10.0 ** np.random.default_rng(7 * r + k).integers(-3, 4, n)).astype(dtype)
                         for k, n in enumerate(counts)] for r in range(size)]
            mine = [t.copy() for t in contribs[rank]]
            hvd_op = hvd.Sum if op == "Sum" else hvd.Average
            # One group: one fused collective (checked below), so that some parts
            # straddle tensors.
            got, used = grouped_allreduce_counted(hvd, mine, name=name, op=hvd_op,
                                                  outs=mine if in_place else None)
            collectives.append(used)
            for k in range(len(counts)):
                want = contribs[0][k].copy()
                for r in range(1, size):
                    want = want + contribs[r][k]  # rank order
                if op == "Average":
                    want = want * dtype(1.0 / size)
                if got[k].tobytes() != want.tobytes():
                    wrong.append(f"{name}.{k}: {int((got[k] != want).sum())} of {counts[k]} differ")
print("HVDLITE_RESULT", json.dumps({"wrong": wrong, "collectives": collectives}))
hvd.shutdown()
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_float_sums_are_the_rank_order_sum_bit_for_bit(np_):
    # Each part is summed in rank order and scaled by 1/size, whether its owner
    # writes it straight into its tensor or it goes through the slot.
    for res in shm_results(np_, ORDER_SCRIPT):
        assert res["collectives"] == [1] * 8, res
