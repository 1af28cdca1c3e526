"""Hierarchical allreduce (reduce-scatter on the host through shared memory, allreduce of
each shard across hosts, allgather on the host) in real jobs on this machine, whose ranks
are put on "hosts" by ``HVDLITE_HOST_ID``: 2 hosts x 2 ranks, ranks placed alternately
(non-contiguous), 3 + 1 ranks (uneven: through the hosts' leaders), 2 x 1 (flat), and
2 x 2 and 3 + 1 with the hierarchy turned off.

Every dtype and reduction, with and without scale factors, alone and fused (grouped),
empty to several 512 KiB chunks, against numpy (``core_reference``: each rank regenerates
every rank's contribution), and every rank must hold the same bits. The hierarchical and
the flat run of the same cases are also compared with each other: exactly for integers,
within the reference's float tolerance for floats.
"""
import numpy as np
import pytest

import harness

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import json, os, sys
import numpy as np
# The "host" of each rank, before init: the core's topology reads it ("-": real hosts).
layout = sys.argv[1]
if layout != "-":
    os.environ["HVDLITE_HOST_ID"] = "host-" + layout[int(os.environ["HVDLITE_RANK"])]
import hvdlite as hvd
from core_reference import (Case, DTYPES, FLOAT_DTYPES, allreduce_case, check, contribution,
                            np_dtype, ops_for)

hvd.init()
rank, size = hvd.rank(), hvd.size()
CHUNK = 1 << 19  # the core's chunk size in bytes

# A third argument names the dtypes to run (a lighter job of more ranks).
dtypes = sys.argv[3].split(",") if len(sys.argv) > 3 else DTYPES
cases, groups = [], []
for dtype in dtypes:
    item = np_dtype(dtype).itemsize
    for op in ops_for(dtype):
        for k, n in enumerate((0, 1, 2 * size - 1, 1000)):
            cases.append(Case(f"{dtype}.{op}.{k}", dtype, op, (n,)))
        if dtype in FLOAT_DTYPES:
            cases.append(Case(f"{dtype}.{op}.scaled", dtype, op, (37,), 0.5, 3.0))
        elif dtype != "bool" and op != "Product":
            cases.append(Case(f"{dtype}.{op}.scaled", dtype, op, (37,), 2.0, 3.0))
        # Fused: one grouped allreduce of tensors of several sizes.
        groups.append([Case(f"{dtype}.{op}.group.{k}", dtype, op, (n,))
                       for k, n in enumerate((3, 0, 129, 1))])
    # Several rounds of shards (each round moves 1/local_size of a chunk per shard),
    # the last one partial; 2-D, so rows do not line up with shards.
    big_op = "Max" if dtype == "bool" else "Sum"
    cases.append(Case(f"{dtype}.{big_op}.big", dtype, big_op, (2 * CHUNK // item // 3 + 5, 3)))
# Several blocks of the pipeline (2 MiB each), the last one partial.
BLOCK = 2 << 20
for dtype, op in (("float32", "Sum"), ("int64", "Product")):
    if dtype in dtypes:
        cases.append(Case(f"{dtype}.{op}.blocks", dtype, op,
                          (2 * BLOCK // np_dtype(dtype).itemsize + 4099,)))
if "float64" in dtypes:
    cases.append(Case("float64.Average.big.scaled", "float64", "Average", (CHUNK // 8 * 3 + 7,),
                      0.5, 3.0))

failures, disagree, results = [], [], {}

def record(case, got):
    problem = check(got, [contribution(1, r, case) for r in range(size)], case)
    if problem:
        failures.append(problem)
    results[case.name] = got
    raw = np.ascontiguousarray(got).view(np.uint8).ravel()
    every = hvd.allgather(raw[None, :] if raw.size else raw.reshape(1, 0), name=case.name + ".bits")
    if not all(np.array_equal(every[0], every[r]) for r in range(size)):
        disagree.append(case.name)

allreduces = tensors = 0  # collectives (a group fuses into one); tensors
for i, case in enumerate(cases):
    allreduces += 1
    record(case, allreduce_case(hvd, case, rank, in_place=i % 2 == 1))
tensors += allreduces
for group in groups:
    got = hvd.grouped_allreduce([contribution(1, rank, c) for c in group], name=group[0].name,
                                op=getattr(hvd, group[0].op))
    allreduces += 1
    tensors += len(group)
    for case, g in zip(group, got):
        record(case, g)
if rank == 0 and len(sys.argv) > 2 and sys.argv[2]:
    np.savez(sys.argv[2], **{k: (v.view(np.uint16) if v.dtype.itemsize == 2 and v.dtype.kind == "V"
                                 else v) for k, v in results.items()})
print("HVDLITE_RESULT", json.dumps({
    "allreduces": allreduces, "tensors": tensors, "failures": failures, "disagree": disagree, "stats": hvd.stats(),
    "topology": [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]}))
hvd.shutdown()
"""


def _run(layout, hierarchical, tmp_path, fusion=None, dtypes=None):
    # The script's allgathers (the bits check) flat: the count of hierarchical
    # collectives is then that of allreduces.
    env = {"HVDLITE_FUSION_THRESHOLD": fusion, "HVDLITE_SHM_ALLREDUCE": None,
           "HVDLITE_HIERARCHICAL_ALLREDUCE": hierarchical, "HOROVOD_HIERARCHICAL_ALLREDUCE": None,
           "HVDLITE_HIERARCHICAL_ALLGATHER": "0"}
    out = str(tmp_path / f"{layout}-{hierarchical}-{fusion}.npz")
    args = (layout, out) + ((dtypes,) if dtypes else ())
    job = harness.assert_ok(harness.run_job(len(layout), SCRIPT, timeout=400, env=env,
                                            args=args))
    for rank in range(len(layout)):
        res = job.result(rank)
        assert not res["failures"], (f"rank {rank}: {len(res['failures'])} wrong:\n"
                                     + "\n".join(res["failures"][:20]))
        assert not res["disagree"], f"rank {rank}: ranks hold different bits for {res['disagree']}"
        # local: ranks of its host in rank order; cross: the ranks of its local rank.
        local = [r for r in range(len(layout)) if layout[r] == layout[rank]]
        local_rank = [[q for q in range(len(layout)) if layout[q] == layout[r]].index(r)
                      for r in range(len(layout))]
        cross = [r for r in range(len(layout)) if local_rank[r] == local_rank[rank]]
        assert res["topology"] == [local.index(rank), len(local), cross.index(rank),
                                   len(cross)], res["topology"]
    return job, out


def _hierarchical_count(job, rank):
    return job.result(rank)["stats"]["hierarchical_collectives"]


@pytest.mark.parametrize("layout", ["AABB", "ABAB"])
def test_two_hosts_of_two_go_hierarchical_and_match_numpy(layout, tmp_path):
    job, _ = _run(layout, None, tmp_path)
    for rank in range(4):
        res = job.result(rank)
        # On by default: every allreduce above took the hierarchical path, none the
        # single-host shared-memory one.
        assert _hierarchical_count(job, rank) == res["allreduces"], res["stats"]
        assert res["stats"]["shm_collectives"] == 0, res["stats"]


def test_three_hosts_of_two_ring_across_hosts(tmp_path):
    # Three hosts: the cross-host ring takes two steps each way (two hosts take one), so
    # a segment index off by one shows here. Six ranks on this machine: fewer dtypes.
    job, _ = _run("ABCABC", None, tmp_path, dtypes="int32,float16,float64,bool")
    for rank in range(6):
        assert _hierarchical_count(job, rank) == job.result(rank)["allreduces"]


def test_unfused_hierarchical_matches_numpy(tmp_path):
    job, _ = _run("AABB", "1", tmp_path, fusion="0")
    for rank in range(4):
        # Every tensor of every group went alone, each through the hierarchy.
        assert _hierarchical_count(job, rank) == job.result(rank)["tensors"]


def test_uneven_hosts_reduce_through_the_leaders(tmp_path):
    # 3 + 1: shards cannot line up across hosts, so the hosts' leaders carry the
    # host's sum across (on by default); the script checks every case against numpy.
    job, _ = _run("AAAB", None, tmp_path)
    for rank in range(4):
        assert _hierarchical_count(job, rank) == job.result(rank)["allreduces"], \
            job.result(rank)["stats"]


@pytest.mark.parametrize("layout", ["AB", "ABC"])
def test_one_rank_per_host_goes_flat(layout, tmp_path):
    # 2 x 1 and 3 x 1: the hierarchy would be the flat allreduce. Forced on, right
    # results through MPI (nonblocking across hosts: MpiBackend::Collective).
    job, _ = _run(layout, "1", tmp_path)
    for rank in range(len(layout)):
        assert _hierarchical_count(job, rank) == 0, job.result(rank)["stats"]


FLOATS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
          "float64": 2.0 ** -52}


def _as_float64(values, dtype):
    if dtype == "bfloat16":  # saved as its raw 16 bits: the top half of a float32
        return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return values.astype(np.float64)


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("layout", ["AABB", "AAAB"])
def test_hierarchical_and_flat_give_the_same_results(layout, tmp_path):
    hier_job, hier_path = _run(layout, "1", tmp_path)
    flat_job, flat_path = _run(layout, "0", tmp_path)
    assert _hierarchical_count(hier_job, 0) > 0
    assert _hierarchical_count(flat_job, 0) == 0, flat_job.result(0)["stats"]
    hier, flat = _load(hier_path), _load(flat_path)
    assert hier.keys() == flat.keys()
    for name in hier:
        a, b = hier[name], flat[name]
        dtype = name.split(".")[0]
        if dtype in FLOATS:
            a, b = _as_float64(a, dtype), _as_float64(b, dtype)
            # Both are within the reference's bound of the exact value, so within twice
            # that of each other; values are at most ~100 in magnitude.
            tol = 2 * 7 * FLOATS[dtype] * np.maximum(100.0, np.maximum(np.abs(a), np.abs(b)))
            assert np.all(np.abs(a - b) <= tol), name
        else:
            assert np.array_equal(a, b), name


KNOB_SCRIPT = r"""
import os, sys, json
os.environ["HVDLITE_HOST_ID"] = "host-" + "AABB"[int(os.environ["HVDLITE_RANK"])]
knob, collective = sys.argv[2], sys.argv[3]
if sys.argv[1] == "disagree" and os.environ["HVDLITE_RANK"] == "3":
    os.environ[knob] = "0"
import numpy as np
import hvdlite as hvd
try:
    hvd.init()
except hvd.errors.InvalidArgumentError as e:
    print("HVDLITE_RESULT", json.dumps({"error": str(e)}))
    sys.exit(0)
if collective == "allreduce":
    got = hvd.allreduce(np.full(10, hvd.rank() + 1.0), op=hvd.Sum, name="x").tolist()
else:
    got = hvd.allgather(np.full((hvd.rank() + 1, 2), hvd.rank()), name="x")[:, 0].tolist()
print("HVDLITE_RESULT", json.dumps({"got": got, "stats": hvd.stats()}))
hvd.shutdown()
"""


def check_knob_agrees_and_horovod_alias_turns_it_off(knob, horovod_knob, collective, want):
    """On 2 x 2 fake hosts: ``knob`` forced on with rank 3 off is an init error on every
    rank naming rank 3; Horovod's name alone at 0 sends ``collective`` flat, ours at 1
    wins over it. ``want``: the collective's result on every rank."""
    args = (knob, collective)
    job = harness.assert_ok(harness.run_job(4, KNOB_SCRIPT, timeout=120,
                                            args=("disagree",) + args, env={knob: "1"}))
    for rank in range(4):
        err = job.result(rank).get("error", "")
        assert f"{knob} must be the same on every rank" in err, err
        assert "rank 3" in err, err
    for env, expect in (({horovod_knob: "0", knob: None}, 0), ({horovod_knob: "0", knob: "1"}, 1)):
        job = harness.assert_ok(harness.run_job(4, KNOB_SCRIPT, timeout=120,
                                                args=("agree",) + args, env=env))
        for rank in range(4):
            res = job.result(rank)
            assert res["got"] == want
            assert res["stats"]["hierarchical_collectives"] == expect, (env, res["stats"])


def test_knob_must_agree_and_horovod_alias_forces_flat():
    check_knob_agrees_and_horovod_alias_turns_it_off(
        "HVDLITE_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE", "allreduce", [10.0] * 10)


SETS_SCRIPT = r"""
import dataclasses, json, os
import numpy as np
# 5 ranks: host A holds 0, 1, 4 and host B 2, 3 (uneven: the world reduces through the
# hosts' leaders).
os.environ["HVDLITE_HOST_ID"] = "host-" + "AABBA"[int(os.environ["HVDLITE_RANK"])]
import hvdlite as hvd
from core_reference import Case, allreduce_case, check, contribution

hvd.init()
rank = hvd.rank()
# Each set's layers come from its own members' hosts: 2 x 2 (hierarchical), one host
# (shared memory), one rank per host (flat MPI).
sets = {"hier": hvd.add_process_set([0, 1, 2, 3]), "shm": hvd.add_process_set([0, 1, 4]),
        "flat": hvd.add_process_set([0, 2])}
failures, counts = [], {}
CHUNK = 1 << 19
cases = [Case("float32.Sum", "float32", "Sum", (1000,)),
         Case("float64.Average.scaled", "float64", "Average", (37,), 0.5, 3.0),
         Case("int32.Min", "int32", "Min", (2 * 5 - 1,)),
         Case("float32.Sum.big", "float32", "Sum", (2 * CHUNK // 4 // 3 + 5, 3))]
for tag in ["world"] + list(sets):
    ps = sets.get(tag, hvd.global_process_set)
    if not ps.included():
        continue
    before = hvd.stats()
    for case in cases:
        case = dataclasses.replace(case, name=tag + "." + case.name)
        mine = contribution(1, rank, case)
        kwargs = dict(name=case.name, op=getattr(hvd, case.op), prescale_factor=case.prescale,
                      postscale_factor=case.postscale, process_set=ps)
        got = hvd.allreduce(mine, **kwargs)
        problem = check(got, [contribution(1, r, case) for r in ps.ranks], case)
        if problem:
            failures.append(problem)
    after = hvd.stats()
    counts[tag] = {k: after[k] - before[k] for k in ("hierarchical_collectives", "shm_collectives",
                                                      "collectives")}
# Removing a set with layers closes them on its members together.
hvd.remove_process_set(sets["hier"])
got = hvd.allreduce(np.full(4, rank + 1.0), op=hvd.Sum, name="after", process_set=sets["shm"]) \
    if sets["shm"].included() else None
if got is not None and got.tolist() != [float(1 + 2 + 5)] * 4:
    failures.append(f"after removal: {got.tolist()}")
hvd.barrier()  # no rank shuts the job down while the set {0, 1, 4} still works
print("HVDLITE_RESULT", json.dumps({"failures": failures, "counts": counts}))
hvd.shutdown()
"""


def test_process_sets_get_layers_of_their_own():
    job = harness.assert_ok(harness.run_job(5, SETS_SCRIPT, timeout=400,
                                            env={"HVDLITE_SHM_ALLREDUCE": None,
                                                 "HVDLITE_HIERARCHICAL_ALLREDUCE": None,
                                                 "HOROVOD_HIERARCHICAL_ALLREDUCE": None}))
    members = {"world": range(5), "hier": [0, 1, 2, 3], "shm": [0, 1, 4], "flat": [0, 2]}
    for rank in range(5):
        res = job.result(rank)
        assert not res["failures"], f"rank {rank}: " + "\n".join(res["failures"])
        assert sorted(res["counts"]) == sorted(t for t, m in members.items() if rank in m), res
        for tag, got in res["counts"].items():
            # Every allreduce of the set on this rank counts once, on its set's path.
            assert got["collectives"] == 4, (rank, tag, got)
            want = {"hierarchical_collectives": 4 if tag in ("hier", "world") else 0,
                    "shm_collectives": 4 if tag == "shm" else 0}
            assert {k: got[k] for k in want} == want, (rank, tag, got)
