"""A collective called again under one name reuses what its last call checked.

``hvd.broadcast``, ``allgather``, ``alltoall`` and ``reducescatter`` (and their
``_async`` forms) keep, per name, what a call checked and filled (the dtype's code, the
C struct, the splits, the result's shape); a later call with an array of the same dtype
and shape and the same other arguments skips the checks. A small allgather or alltoall
waited for at once is copied out of the core's buffer and its handle released in one
native call (``hvdlite_handle_take_output``), instead of being wrapped.

In real 2- and 3-rank jobs, one name per op called again and again while what the kept
call stands for changes under it: values changed in place, another array object, the
root, the dtype, the shape, ``out``, the splits (a tuple, another tuple, a list changed
in place between calls), the prescale factor (its sign of zero included), a process
set, and an allgather whose result outgrows the size the copy expected. Every result is
compared with numpy's, recomputed from every rank's regenerated contribution; the
checks that a repeated call skips are counted (they run again exactly when an argument
changed), and which results are copies and which view the core's memory is looked at.
"""
import pytest

from harness import assert_ok, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r"""
import json
import numpy as np
import hvdlite as hvd
from hvdlite import _checks

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"wrong": [], "checked": {}}

# Counts the first-call checks (the kept path skips them), per tensor name.
input_array = _checks.input_array
def counted(array, name, **kwargs):
    out["checked"][name] = out["checked"].get(name, 0) + 1
    return input_array(array, name, **kwargs)
_checks.input_array = counted

def value(k, n, dtype, step):
    return ((np.arange(n) * (step + 2) + 5 * k + step) % 89).astype(dtype)

def check(what, got, expected):
    if not (np.array_equal(got, expected) and np.asarray(got).dtype == np.asarray(expected).dtype):
        out["wrong"].append(what)

def views_core_memory(a):
    while a is not None:
        if type(a).__name__ == "_NativeBuffer":
            return True
        a = getattr(a, "base", None)
    return False

# Broadcast: one array changed in place (kept), another object (kept), the root, the
# dtype and the shape changing under the name (kept again), out= given.
x = value(rank, 1000, np.float32, 0)
for step in range(12):
    root = (step // 4) % size
    if step in (5, 6):
        x = value(rank, 1000, np.float32, step)  # another object, same dtype and shape
    elif step == 7:
        x = value(rank, 1000, np.int32, step)  # the dtype
    elif step == 8:
        x = value(rank, 1200, np.int32, step)  # the shape
    else:
        x[:] = value(rank, x.size, x.dtype, step)  # in place
    given = np.empty_like(x) if step == 10 else None
    got = hvd.broadcast(x, root, name="bc", out=given)
    check(["bc", step], got, value(root, x.size, x.dtype, step))
    if given is not None and got is not given:
        out["wrong"].append(["bc out", step])
    h = hvd.broadcast_async(x, root, name="bc.async")
    check(["bc.async", step], hvd.synchronize(h), value(root, x.size, x.dtype, step))
    # process_set=None (the global set) alternating with the set itself.
    check(["bc.none", step], hvd.broadcast(x, root, name="bc.none",
                                           process_set=None if step % 2 else hvd.global_process_set),
          value(root, x.size, x.dtype, step))

# Allgather: equal rows (the copy's size guessed right), then rank 0 sends more rows
# (the result outgrows the guess), then fewer; then a result over the copy's limit,
# which views the core's memory as before.
kinds = {}
for step in range(8):
    rows = lambda k: 3 + (k == 0) * (0 if step < 3 else 4 if step < 5 else -2)
    mine = value(rank, rows(rank) * 5, np.float64, step).reshape(-1, 5)
    got = hvd.allgather(mine, name="ag")
    check(["ag", step], got, np.concatenate([value(k, rows(k) * 5, np.float64, step).reshape(-1, 5)
                                             for k in range(size)]))
    kinds["small"] = kinds.get("small", []) + [views_core_memory(got)]
big = value(rank, 64 * 1024, np.float32, 1).reshape(64, -1)  # 256 KiB per rank
for step in range(2):
    got = hvd.allgather(big, name="ag.big")
    check(["ag.big", step], got, np.concatenate([value(k, 64 * 1024, np.float32, 1).reshape(64, -1)
                                                 for k in range(size)]))
    kinds["big"] = kinds.get("big", []) + [views_core_memory(got)]
out["views"] = kinds

# Alltoall: even splits (None), a tuple, another tuple, a list changed in place.
def expected_alltoall(splits_of, step):
    parts = []
    for k in range(size):
        theirs = value(k, sum(splits_of(k)) * 2, np.int64, step).reshape(-1, 2)
        start = sum(splits_of(k)[:rank])
        parts.append(theirs[start:start + splits_of(k)[rank]])
    return np.concatenate(parts), [splits_of(k)[rank] for k in range(size)]

listed = [1] * size
for step in range(10):
    if step < 3:
        splits_of = lambda k: [2] * size
        given = None
    elif step < 6:
        shift = 0 if step < 5 else 1
        splits_of = lambda k: [1 + (j + k + shift) % 3 for j in range(size)]
        given = tuple(splits_of(rank))
    else:
        listed[:] = [1 + (j * rank + step) % 3 for j in range(size)]  # the same list object
        splits_of = lambda k: [1 + (j * k + step) % 3 for j in range(size)]
        given = listed
    send = value(rank, sum(splits_of(rank)) * 2, np.int64, step).reshape(-1, 2)
    got, got_splits = hvd.alltoall(send, splits=given, name="a2a")
    rows_expected, splits_expected = expected_alltoall(splits_of, step)
    check(["a2a", step], got, rows_expected)
    check(["a2a splits", step], got_splits, np.asarray(splits_expected, np.int64))

# Reducescatter: Sum, then a prescale factor, then zero factors of either sign (whose
# sign shows in the result's zeros), out= given.
for step, (op, pre) in enumerate([(hvd.Sum, 1.0), (hvd.Sum, 1.0), (hvd.Sum, 2.0), (hvd.Sum, 2.0),
                                  (hvd.Sum, 0.0), (hvd.Sum, -0.0), (hvd.Sum, 0.0),
                                  (hvd.Max, 1.0)]):
    full = value(rank, size * 6, np.float32, step).reshape(size, 6)
    given = np.empty((1, 6), np.float32) if step == 3 else None
    got = hvd.reducescatter(full, name="rs", op=op, prescale_factor=pre, out=given)
    every = [value(k, size * 6, np.float32, step).reshape(size, 6)[rank:rank + 1] * np.float32(pre)
             for k in range(size)]
    check(["rs", step], got, sum(every) if op == hvd.Sum else np.max(every, axis=0))
    if pre == 0 and list(np.signbit(got).ravel()) != [np.signbit(pre)] * 6:
        out["wrong"].append(["rs zero sign", step, float(pre)])

# In a process set of ranks 0 and 1 (3 ranks: rank 2 outside), under the names used above.
if size > 2:
    pair = hvd.add_process_set([0, 1])
    if rank in pair.ranks:
        for step in range(3):
            x = value(rank, 1200, np.int32, step)
            check(["pair bc", step], hvd.broadcast(x, 1, name="bc", process_set=pair),
                  value(1, 1200, np.int32, step))
            mine = value(rank, 15, np.float64, step).reshape(-1, 5)
            check(["pair ag", step], hvd.allgather(mine, name="ag", process_set=pair),
                  np.concatenate([value(k, 15, np.float64, step).reshape(-1, 5) for k in (0, 1)]))
    hvd.barrier()
    hvd.remove_process_set(pair)
print("HVDLITE_RESULT", json.dumps(out), flush=True)
hvd.shutdown()
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_repeated_calls_right_whatever_changes_under_their_name(np_):
    result = assert_ok(run_job(np_, SCRIPT, timeout=240))
    for r in range(np_):
        body = result.result(r)
        assert body["wrong"] == [], f"rank {r}: wrong results {body['wrong'][:10]}"
        checked = body["checked"]
        # Checked again only where what the kept call stands for changed: broadcast at
        # its first call (step 0), the root (4 and 8), the dtype (7), the shape (8), and
        # in the process set; an array of another object alone is not a change.
        assert checked["bc"] == len({0, 4, 7, 8}) + (np_ > 2 and r < 2), (r, checked)
        assert checked["bc.async"] == checked["bc"] - (np_ > 2 and r < 2), (r, checked)
        # Allgather: a shape change at steps 3 and 5 (rank 0's rows), on rank 0 only.
        assert checked["ag"] == (3 if r == 0 else 1) + (np_ > 2 and r < 2), (r, checked)
        assert checked["ag.big"] == 1, (r, checked)
        # Alltoall: the first call, the tuples at steps 3 and 5, and every list call
        # (a list is never kept: it can change in place).
        assert checked["a2a"] == 1 + 2 + 4, (r, checked)
        # Reducescatter: the first call, prescale 2.0, each zero factor (never kept), Max.
        assert checked["rs"] == 1 + 1 + 3 + 1, (r, checked)
        # Small results are copies, unless one outgrew the rows expected from the
        # rank's own (rank 0's 7 rows at steps 3-4 on the others, its 1 row at steps
        # 5-7 on rank 0 itself): that one views the core's memory, as the result over
        # the copy's limit does.
        outgrown = [5, 6, 7] if r == 0 else [3, 4]
        assert body["views"]["small"] == [step in outgrown for step in range(8)], (
            r, body["views"])
        assert body["views"]["big"] == [True, True], (r, body["views"])
