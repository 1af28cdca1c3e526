"""Hierarchical allgather and broadcast (through the hosts' leaders: gather within the
host, one exchange per host across hosts, share within the host) in real jobs on this
machine, whose ranks are put on "hosts" by ``HVDLITE_HOST_ID``: 2 hosts x 2 ranks
(consecutive and alternating placement), 3 + 1 ranks, 1 + 2 ranks, 2 x 1 (flat: one rank
per host), and 2 x 2 with the hierarchy turned off.

Allgathers of uneven first dims (a rank with no rows too), several dtypes, small and
large enough for several pipeline chunks, alone and grouped; broadcasts from every root,
small, several chunks long, and byte counts on and beside the pipeline's chunk
boundaries. Every result against numpy (each rank regenerates every
rank's contribution from its rank), and the hierarchical and the flat run against each
other, exactly (these collectives only copy).
"""
import pytest

import harness

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import hashlib, json, os, sys
import numpy as np
layout = sys.argv[1]
if layout != "-":
    os.environ["HVDLITE_HOST_ID"] = "host-" + layout[int(os.environ["HVDLITE_RANK"])]
import hvdlite as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
failures, digest = [], hashlib.sha256()
ops = 0  # allgathers and broadcasts below (a group counts once)
broadcasts = 0
before = hvd.stats()

def rows_of(r, case):
    # Uneven first dims; rank 1 gives no rows in the "gap" cases.
    return 0 if case.endswith("gap") and r == 1 else (r + 1) * 3 + (7 if "big" in case else 0)

def contribution(r, case, dtype, cols):
    n = rows_of(r, case)
    base = (np.arange(n * cols, dtype=np.int64) * 7 + r * 1000003 + len(case)) % 251
    return base.reshape(n, cols).astype(dtype)

def check(name, got, want):
    digest.update(name.encode())
    digest.update(np.ascontiguousarray(got).tobytes())
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        failures.append(f"{name}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
                        + ("" if got.shape != want.shape else
                           f", {int(np.sum(got != want))} elements differ"))

# Allgather: small rows, and rows long enough for several 1 MiB chunks in all.
for case, cols in (("small", 5), ("small.gap", 3), ("big", 40000), ("big.gap", 30000)):
    for dtype in (np.float32, np.int64, np.uint8, np.float16):
        name = f"allgather.{case}.{np.dtype(dtype).name}"
        got = hvd.allgather(contribution(rank, case, dtype, cols), name=name)
        ops += 1
        check(name, got, np.concatenate([contribution(r, case, dtype, cols) for r in range(size)]))
# Grouped: one fused collective of tensors of several dtypes and shapes.
group = [("g0", np.float64, 4), ("g1.gap", np.int32, 1), ("g2.big", np.float32, 20000)]
got = hvd.grouped_allgather([contribution(rank, c, d, k) for c, d, k in group], name="grouped")
ops += 1
for (case, dtype, cols), g in zip(group, got):
    check(f"grouped.{case}", g, np.concatenate([contribution(r, case, dtype, cols)
                                                for r in range(size)]))
# Broadcast from every root: a few elements, and several chunks (not a whole number).
for root in range(size):
    for case, n, dtype in (("small", 13, np.int32), ("big", (5 << 20) // 8 + 999, np.float64)):
        name = f"broadcast.{case}.{root}"
        value = ((np.arange(n, dtype=np.int64) * 13 + root * 7919) % 1009).astype(dtype)
        x = value if rank == root else np.full(n, -1, dtype)
        got = hvd.broadcast(x, root_rank=root, name=name)
        ops += 1
        broadcasts += 1
        check(name, got, value)
# Byte counts on and beside the pipeline's chunk boundaries (chunks of 256 KiB up to
# 2 MiB, then 8 chunks), from the first and the last rank (a leader, and on most
# layouts not one), so that no chunk's edge loses, repeats or shifts a byte.
for nbytes in (1, (256 << 10) - 1, 256 << 10, (256 << 10) + 1, (1 << 20) + 3,
               (2 << 20) - 1, 2 << 20, (2 << 20) + 1, (2 << 20) + 9):
    for root in sorted({0, size - 1}):
        name = f"broadcast.edge.{nbytes}.{root}"
        value = ((np.arange(nbytes, dtype=np.int64) * 31 + root * 17 + nbytes) % 253).astype(np.uint8)
        x = value if rank == root else np.zeros(nbytes, np.uint8)
        got = hvd.broadcast(x, root_rank=root, name=name)
        ops += 1
        broadcasts += 1
        check(name, got, value)
stats = hvd.stats()
for key in ("hierarchical_collectives", "collectives"):
    stats[key] -= before[key]  # this script's collectives, all allgathers and broadcasts
print("HVDLITE_RESULT", json.dumps({
    "failures": failures, "digest": digest.hexdigest(), "ops": ops, "broadcasts": broadcasts,
    "stats": stats,
    "topology": [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]}))
hvd.shutdown()
"""


def run(layout, allgather=None, broadcast=None):
    env = {"HVDLITE_HIERARCHICAL_ALLGATHER": allgather, "HOROVOD_HIERARCHICAL_ALLGATHER": None,
           "HVDLITE_HIERARCHICAL_BROADCAST": broadcast, "HVDLITE_HIERARCHICAL_ALLREDUCE": None}
    job = harness.assert_ok(harness.run_job(len(layout), SCRIPT, timeout=400, env=env,
                                            args=(layout,)))
    for rank in range(len(layout)):
        res = job.result(rank)
        assert not res["failures"], f"rank {rank}:\n" + "\n".join(res["failures"][:20])
    return job


def hierarchical(job, rank):
    return job.result(rank)["stats"]["hierarchical_collectives"]


@pytest.mark.parametrize("layout", ["AABB", "ABAB", "AAAB", "ABB"])
def test_hosts_of_several_ranks_go_hierarchical_and_match_numpy_and_flat(layout):
    # On by default wherever a host has several ranks (uneven and alternating too).
    hier = run(layout)
    flat = run(layout, allgather="0", broadcast="0")
    for rank in range(len(layout)):
        res = hier.result(rank)
        # (A group too large to fuse whole goes as several collectives.)
        assert res["stats"]["collectives"] >= res["ops"], res["stats"]
        assert hierarchical(hier, rank) == res["stats"]["collectives"], res["stats"]
        assert hierarchical(flat, rank) == 0, flat.result(rank)["stats"]
        # The same bytes either way.
        assert res["digest"] == flat.result(rank)["digest"], rank


def test_one_rank_per_host_goes_flat_and_knobs_are_separate():
    job = run("AB", allgather="1", broadcast="1")
    for rank in range(2):
        assert hierarchical(job, rank) == 0, job.result(rank)["stats"]
    # Only broadcast forced off: the allgathers still go through the leaders, the
    # broadcasts flat.
    job = run("AABB", broadcast="0")
    for rank in range(4):
        res = job.result(rank)
        assert res["broadcasts"] == 2 * 4 + 9 * 2, res["broadcasts"]
        assert hierarchical(job, rank) == res["stats"]["collectives"] - res["broadcasts"], res["stats"]


def test_knob_must_agree_and_horovod_alias_turns_allgather_off():
    from test_hierarchical_allreduce import check_knob_agrees_and_horovod_alias_turns_it_off

    check_knob_agrees_and_horovod_alias_turns_it_off(
        "HVDLITE_HIERARCHICAL_ALLGATHER", "HOROVOD_HIERARCHICAL_ALLGATHER", "allgather",
        [0, 1, 1, 2, 2, 2, 3, 3, 3, 3])
