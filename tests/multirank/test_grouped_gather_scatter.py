"""grouped_allgather and grouped_reducescatter (numpy and torch) on 2 and 3 real ranks.

Every rank recomputes every rank's inputs from (rank, tensor index), so the expected
gathers, sums, averages and scaled results come from numpy alone. The torch part also
checks the gradients as Horovod defines them: a grouped allgather's gradient is this
rank's rows of the average over ranks of the output gradient; a grouped reducescatter's
is the allgather of the output gradient, times size() for Sum (and the scale factors).
"""
import pytest

import needs

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

PRELUDE = r'''
import json
import numpy as np
import hvdlite as hvd
from hvdlite import errors

hvd.init()
rank, size = hvd.rank(), hvd.size()
failures = []


def check(label, got, expected, tol=1e-9):
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        failures.append(f"{label}: got {got.dtype}{got.shape}, expected "
                        f"{expected.dtype}{expected.shape}")
    elif not np.allclose(got.astype(np.float64), expected.astype(np.float64), atol=tol,
                         rtol=tol):
        failures.append(f"{label}: got {got.tolist()}, expected {expected.tolist()}")


def data(r, i, rows, dtype=np.float64):
    """Rank r's input for tensor i: rows x 3 small integers (exact in every dtype)."""
    v = (np.arange(rows * 3).reshape(rows, 3) * (i + 2) + r * 7 + i) % 23 - 11
    return v.astype(dtype)


def split_rows(total):
    base, extra = divmod(total, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    return sum(counts[:rank]), counts[rank]
'''

NUMPY_BODY = r'''
DTYPES = [np.float32, np.float64, np.int32, np.int16, np.uint8]
# -- grouped allgather: uneven rows (zero on some ranks), several dtypes, one group.
for step in range(3):
    rows = lambda r, i: (r + i + step) % 3
    arrays = [data(rank, i, rows(rank, i), dt) for i, dt in enumerate(DTYPES)]
    got = hvd.grouped_allgather(arrays, name=f"gag.{step}")
    for i, dt in enumerate(DTYPES):
        check(f"grouped_allgather step {step} tensor {i}", got[i],
              np.concatenate([data(r, i, rows(r, i), dt) for r in range(size)]))
# async, automatically named, polled to completion
handle = hvd.grouped_allgather_async([data(rank, 0, rank + 1), data(rank, 1, 2)])
got = hvd.synchronize(handle)
check("grouped_allgather_async 0", got[0],
      np.concatenate([data(r, 0, r + 1) for r in range(size)]))
check("grouped_allgather_async 1", got[1], np.concatenate([data(r, 1, 2) for r in range(size)]))

# -- grouped reducescatter: Sum, Average, scaled; rows not divisible by size.
for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
    for pre, post in ((1.0, 1.0), (0.5, 3.0)):
        shapes = [size * 2 + 1, 5, 1, size]
        arrays = [data(rank, i, n) for i, n in enumerate(shapes)]
        got = hvd.grouped_reducescatter(arrays, op=op, prescale_factor=pre,
                                        postscale_factor=post,
                                        name=f"grs.{op_name}.{pre}")
        for i, n in enumerate(shapes):
            total = np.sum([data(r, i, n) * pre for r in range(size)], axis=0) * post
            if op == hvd.Average:
                total = total / size
            at, count = split_rows(n)
            check(f"grouped_reducescatter {op_name} pre {pre} tensor {i}", got[i],
                  total[at:at + count])
# integer Average truncates toward zero; async
arrays = [data(rank, i, size + 2, np.int32) for i in range(2)]
got = hvd.synchronize(hvd.grouped_reducescatter_async(arrays, op=hvd.Average))
for i in range(2):
    total = np.sum([data(r, i, size + 2, np.int64) for r in range(size)], axis=0)
    at, count = split_rows(size + 2)
    check(f"grouped_reducescatter int average {i}", got[i],
          np.trunc(total / size).astype(np.int32)[at:at + count])

# -- all or nothing: a bad member refuses the whole group on every rank (all ranks
# make the same bad call), and the names are free again right after.
try:
    hvd.grouped_allgather([data(rank, 0, 2), np.ones((2, 2), np.complex64)], name="bad")
    failures.append("complex member was not refused")
except errors.InvalidArgumentError as e:
    if "bad.1" not in str(e):
        failures.append(f"refusal does not name the member: {e}")
got = hvd.grouped_allgather([data(rank, 0, 1), data(rank, 1, 1)], name="bad")
check("group after refusal", got[1], np.concatenate([data(r, 1, 1) for r in range(size)]))
print("HVDLITE_RESULT " + json.dumps({"failures": failures}), flush=True)
'''

TORCH_BODY = r'''
import torch
import hvdlite.torch as thvd
torch.set_num_threads(1)

# forward, torch dtypes incl. int16
for dt in (torch.float32, torch.float64, torch.int16, torch.int64):
    ts = [torch.from_numpy(data(rank, i, rank + i + 1)).to(dt) for i in range(3)]
    got = thvd.grouped_allgather(ts, name=f"t.gag.{dt}")
    for i in range(3):
        exp = np.concatenate([data(r, i, r + i + 1) for r in range(size)])
        check(f"torch grouped_allgather {dt} {i}", got[i].double().numpy(), exp)
    ts = [torch.from_numpy(data(rank, i, size + i)).to(dt) for i in range(3)]
    got = thvd.synchronize(thvd.grouped_reducescatter_async(ts, op=thvd.Sum,
                                                             name=f"t.grs.{dt}"))
    for i in range(3):
        total = np.sum([data(r, i, size + i) for r in range(size)], axis=0)
        at, count = split_rows(size + i)
        check(f"torch grouped_reducescatter {dt} {i}", got[i].double().numpy(),
              total[at:at + count])

# gradients of grouped allgather: the same output gradient on every rank, so the
# average over ranks is that gradient itself; this rank gets its own rows of it.
ts = [torch.from_numpy(data(rank, i, rank + 1 + i)).requires_grad_() for i in range(2)]
outs = thvd.grouped_allgather(ts, name="t.gag.grad")
weights = [torch.from_numpy(data(0, 10 + i, sum(r + 1 + i for r in range(size))))
           for i in range(2)]
sum((o * w).sum() for o, w in zip(outs, weights)).backward()
for i in range(2):
    at = sum(r + 1 + i for r in range(rank))
    check(f"grouped_allgather grad {i}", ts[i].grad.numpy(),
          weights[i].numpy()[at:at + rank + 1 + i])

# gradients of grouped reducescatter, Sum and Average, with scale factors
for op, factor in ((thvd.Sum, size), (thvd.Average, 1)):
    for pre, post in ((1.0, 1.0), (2.0, 0.5)):
        ts = [torch.from_numpy(data(rank, i, size * 2)).requires_grad_() for i in range(2)]
        outs = thvd.grouped_reducescatter(ts, op=op, prescale_factor=pre,
                                          postscale_factor=post)
        at, count = split_rows(size * 2)
        # Each rank weighs its own rows; the allgather of those weights comes back.
        weights = [torch.from_numpy(data(9, 20 + i, size * 2)) for i in range(2)]
        sum((o * w[at:at + count]).sum() for o, w in zip(outs, weights)).backward()
        for i in range(2):
            check(f"grouped_reducescatter grad op {op} pre {pre} tensor {i}",
                  ts[i].grad.numpy(), weights[i].numpy() * factor * pre * post)
print("HVDLITE_RESULT " + json.dumps({"failures": failures}), flush=True)
'''


def _run(np_, body):
    result = assert_ok(run_job(np_, PRELUDE + body, timeout=150))
    problems = [f"rank {r}: {f}" for r in range(np_) for f in result.result(r)["failures"]]
    assert not problems, "\n".join(problems) + "\n" + describe(result)


@pytest.mark.parametrize("np_", [2, 3])
def test_numpy_grouped_allgather_and_reducescatter(np_):
    _run(np_, NUMPY_BODY)


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_grouped_allgather_and_reducescatter_with_gradients(np_):
    needs.import_or_skip("torch")
    _run(np_, TORCH_BODY)
