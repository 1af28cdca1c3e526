"""Ranks that disagree, and a tensor only one rank submits: every rank that took part
gets an error naming the tensor, and the job goes on (the next 100 steps work)."""
import pytest

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

NP = 3

SCRIPT = r'''
import json, os, sys, time
import numpy as np
import hvdlite as hvd
from hvdlite import ops

hvd.init()
r, n = hvd.rank(), hvd.size()
odd = r == 1  # the rank that disagrees

def f32(*shape):
    return np.ones(shape, np.float32)

# name -> (function run on every rank, ranks that submit)
CASES = {
    "ar_shape": lambda: hvd.allreduce(f32(4 if odd else 3), name="ar_shape"),
    "ar_dtype": lambda: hvd.allreduce(np.ones(3, np.float64 if odd else np.float32),
                                      name="ar_dtype"),
    "ar_op": lambda: hvd.allreduce(f32(3), name="ar_op", op=hvd.Max if odd else hvd.Sum),
    "ar_scale": lambda: hvd.allreduce(f32(3), name="ar_scale",
                                      prescale_factor=2.0 if odd else 1.0),
    "ag_trailing": lambda: hvd.allgather(f32(2, 4 if odd else 3), name="ag_trailing"),
    "ag_dtype": lambda: hvd.allgather(np.ones((2, 3), np.int32 if odd else np.float32),
                                      name="ag_dtype"),
    "bc_shape": lambda: hvd.broadcast(f32(2 if odd else 3), 0, name="bc_shape"),
    "bc_root": lambda: hvd.broadcast(f32(3), 1 if odd else 0, name="bc_root"),
    "a2a_trailing": lambda: hvd.alltoall(f32(n, 2 if odd else 1), name="a2a_trailing"),
    "a2a_dtype": lambda: hvd.alltoall(np.ones((n, 1), np.int64 if odd else np.float32),
                                      name="a2a_dtype"),
    "a2a_splits": lambda: hvd.alltoall(f32(n + 1, 2 if odd else 1),
                                       splits=[1] * (n - 1) + [2], name="a2a_splits"),
    "rs_shape": lambda: hvd.reducescatter(f32(n + (1 if odd else 0), 2), name="rs_shape"),
    "rs_op": lambda: hvd.reducescatter(f32(n, 2), name="rs_op", op=hvd.Min if odd else hvd.Sum),
    "op_kind": lambda: (hvd.allgather(f32(3), name="op_kind") if odd
                        else hvd.allreduce(f32(3), name="op_kind")),
    "group_shape": lambda: hvd.grouped_allreduce([f32(2), f32(5 if odd else 4)],
                                                 name="group_shape"),
    # Process set 1 does not exist: refused at the call on rank 1, so the others stall.
    "process_set": lambda: hvd.synchronize(ops.enqueue(
        ops.ALLREDUCE, "process_set", 6, (3,), f32(3).ctypes.data, f32(3).ctypes.data,
        process_set_id=1 if odd else 0)),
}
STALL_S = float(os.environ["HVDLITE_STALL_SHUTDOWN_TIME"])
out = {}
for name, fn in CASES.items():
    try:
        fn()
        out[name] = ["ok", ""]
    except hvd.errors.InvalidArgumentError as e:
        out[name] = [type(e).__name__, str(e)]
        # Refused here, but the others wait for this rank until the stall time: don't
        # submit the next tensor before they give up, or it would stall as well.
        time.sleep(STALL_S + 1.5)
    except hvd.errors.HvdliteError as e:
        out[name] = [type(e).__name__, str(e)]
# A tensor only the last rank submits; the others wait until it has failed there.
if r == n - 1:
    try:
        hvd.allreduce(f32(3), name="lonely")
        out["lonely"] = ["ok", ""]
    except hvd.errors.HvdliteError as e:
        out["lonely"] = [type(e).__name__, str(e)]
else:
    time.sleep(STALL_S + 1.5)
# The job goes on: 100 steps of every op, every result checked.
for step in range(100):
    s = hvd.allreduce(np.full(5, r + step, np.float32), name="after", op=hvd.Sum)
    assert (s == sum(range(n)) + n * step).all(), (step, s)
    g = hvd.allgather(np.full((r + 1, 2), r, np.int32), name="after_ag")
    assert g.shape == (n * (n + 1) // 2, 2)
    b = hvd.broadcast(np.full(3, r + step, np.float64), n - 1, name="after_bc")
    assert (b == n - 1 + step).all()
    rs = hvd.reducescatter(np.ones((n, 2), np.float32), name="after_rs", op=hvd.Sum)
    assert (rs == n).all()
print("HVDLITE_RESULT", json.dumps(out))
hvd.shutdown()
'''

MISMATCH_CASES = ["ar_shape", "ar_dtype", "ar_op", "ar_scale", "ag_trailing", "ag_dtype",
                  "bc_shape", "bc_root", "a2a_trailing", "a2a_dtype", "a2a_splits",
                  "rs_shape", "rs_op", "op_kind", "group_shape"]


def test_mismatches_fail_every_rank_and_the_job_goes_on():
    result = assert_ok(run_job(NP, SCRIPT, timeout=240, env={
        "HVDLITE_STALL_CHECK_TIME": "1", "HVDLITE_STALL_SHUTDOWN_TIME": "3"}))
    outcomes = {r: result.result(r) for r in range(NP)}
    problems = []
    for case in MISMATCH_CASES:
        for r in range(NP):
            kind, message = outcomes[r][case]
            if kind != "MismatchError" or f"'{case}" not in message or "rank 1" not in message:
                problems.append(f"{case} on rank {r}: {kind}: {message}")
    # Rank 1 is refused at the call; ranks 0 and 2 stall on rank 1.
    kind, message = outcomes[1]["process_set"]
    if kind != "InvalidArgumentError" or "process set 1" not in message:
        problems.append(f"process_set on rank 1: {kind}: {message}")
    for r in (0, 2):
        kind, message = outcomes[r]["process_set"]
        if kind != "StalledError" or "rank 1 did not submit" not in message:
            problems.append(f"process_set on rank {r}: {kind}: {message}")
    kind, message = outcomes[NP - 1]["lonely"]
    if kind != "StalledError" or "'lonely'" not in message or "ranks 0, 1" not in message:
        problems.append(f"lonely on rank {NP - 1}: {kind}: {message}")
    assert not problems, "\n".join(problems) + "\n" + describe(result)
