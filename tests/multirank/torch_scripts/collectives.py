"""Rank script: every hvdlite.torch collective against values recomputed from rank/size.

Each rank can rebuild every rank's input (``make(kind, dtype, r)``), so expectations are
computed locally with plain torch. Failures are collected, not raised, so that every
rank keeps making the same calls; the last line is ``HVDLITE_RESULT {"failures": [...]}``.
"""
import json

import torch

import hvdlite.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
failures = []
checks = [0]

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]


def check(label, got, want, tol=0.0):
    checks[0] += 1
    try:
        ok = (got.shape == want.shape and got.dtype == want.dtype
              and torch.allclose(got.double(), want.double(), atol=tol, rtol=tol))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        ok, got = False, f"{got!r} ({e})"
    if not ok:
        failures.append(f"{label}: got {got!r}, want {want!r}")


def base(dtype, r, shape=(4, 3)):
    """Rank r's input: small integers so that sums and products are exact."""
    n = 1
    for d in shape:
        n *= d
    v = (torch.arange(n) * 5 + r * 3) % 7  # 0..6
    if dtype == torch.bool:
        return ((v + r) % 3 == 0).reshape(shape)
    if dtype in (torch.uint8,):
        return (v % 4).to(dtype).reshape(shape)
    return (v % 7 - 3).to(dtype).reshape(shape)  # -3..3, products fit in int8 up to 3 ranks


def reduce_expected(op, xs):
    stack = torch.stack([x.double() for x in xs])
    dtype = xs[0].dtype
    if op == hvd.Sum:
        out = stack.sum(0)
    elif op == hvd.Min:
        out = stack.min(0).values
    elif op == hvd.Max:
        out = stack.max(0).values
    elif op == hvd.Product:
        out = stack.prod(0)
    else:
        out = stack.sum(0)
        if dtype.is_floating_point:
            out = out / len(xs)
        else:
            out = torch.div(out, len(xs), rounding_mode="trunc")
    return out.to(dtype)


OP_NAMES = {hvd.Sum: "Sum", hvd.Min: "Min", hvd.Max: "Max", hvd.Product: "Product",
            hvd.Average: "Average"}

# -- allreduce: every dtype and op, out of place, in place, async ---------------------------
for dtype in FLOATS + INTS + [torch.bool]:
    ops_ = [hvd.Min, hvd.Max] if dtype == torch.bool else list(OP_NAMES)
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    for op in ops_:
        label = f"allreduce {dtype} {OP_NAMES[op]}"
        x = base(dtype, R)
        want = reduce_expected(op, [base(dtype, r) for r in range(N)])
        got = hvd.allreduce(x, name=f"ar.{dtype}.{op}", op=op)
        check(label, got, want, tol)
        check(label + " input untouched", x, base(dtype, R))
        y = base(dtype, R)
        out = hvd.allreduce_(y, name=f"ar_.{dtype}.{op}", op=op)
        check(label + " in place", y, want, tol)
        if out is not y:
            failures.append(label + ": allreduce_ did not return its argument")
        h = hvd.allreduce_async(base(dtype, R), name=f"ara.{dtype}.{op}", op=op)
        check(label + " async", hvd.synchronize(h), want, tol)
        if not hvd.poll(h):
            failures.append(label + ": poll() False after synchronize")

# Scaling, scalars, average= compatibility, automatic names.
x = base(torch.float64, R)
want = reduce_expected(hvd.Sum, [base(torch.float64, r) for r in range(N)])
check("prescale/postscale", hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5,
                                          postscale_factor=3.0), want * 1.5, 1e-9)
check("average=False", hvd.allreduce(x, average=False), want, 1e-9)
check("scalar", hvd.allreduce(torch.tensor(float(R)), op=hvd.Sum),
      torch.tensor(float(sum(range(N)))))
h = hvd.allreduce_async_(base(torch.float32, R), op=hvd.Max)
check("async_ auto name", hvd.synchronize(h),
      reduce_expected(hvd.Max, [base(torch.float32, r) for r in range(N)]))

# -- grouped allreduce -----------------------------------------------------------------
group_dtypes = [torch.float32, torch.float64, torch.int32]
xs = [base(dt, R, (2 + i, 3)) for i, dt in enumerate(group_dtypes)]
wants = [reduce_expected(hvd.Sum, [base(dt, r, (2 + i, 3)) for r in range(N)])
         for i, dt in enumerate(group_dtypes)]
for i, got in enumerate(hvd.grouped_allreduce(xs, name="grp", op=hvd.Sum)):
    check(f"grouped_allreduce {i}", got, wants[i])
h = hvd.grouped_allreduce_async(xs, op=hvd.Sum)
for i, got in enumerate(hvd.synchronize(h)):
    check(f"grouped_allreduce_async {i}", got, wants[i])
ys = [x.clone() for x in xs]
hvd.grouped_allreduce_(ys, op=hvd.Sum)
for i, y in enumerate(ys):
    check(f"grouped_allreduce_ {i}", y, wants[i])
ys = [x.clone() for x in xs]
outs = hvd.synchronize(hvd.grouped_allreduce_async_(ys, name="grp_a_", op=hvd.Sum))
for i, (y, o) in enumerate(zip(ys, outs)):
    check(f"grouped_allreduce_async_ {i}", y, wants[i])
    if o is not y:
        failures.append("grouped_allreduce_async_ did not return its tensors")

# -- allgather: ranks differ in the first dimension -------------------------------------
for dtype in FLOATS + INTS + [torch.bool]:
    x = base(dtype, R, (R + 1, 2))
    want = torch.cat([base(dtype, r, (r + 1, 2)) for r in range(N)])
    check(f"allgather {dtype}", hvd.allgather(x, name=f"ag.{dtype}"), want)
    check(f"allgather_async {dtype}", hvd.synchronize(hvd.allgather_async(x)), want)
# A rank with zero rows.
x = torch.full((R % 2, 3), float(R))
want = torch.cat([torch.full((r % 2, 3), float(r)) for r in range(N)])
check("allgather zero rows", hvd.allgather(x), want)
gathered = hvd.allgather(torch.ones(2, 2))
gathered += 1  # the zero-copy result is an ordinary writable tensor
check("allgather result writable", gathered, torch.full((2 * N, 2), 2.0))

# -- broadcast ---------------------------------------------------------------------------
root = N - 1
for dtype in FLOATS + INTS + [torch.bool]:
    x = base(dtype, R)
    want = base(dtype, root)
    check(f"broadcast {dtype}", hvd.broadcast(x, root, name=f"bc.{dtype}"), want)
    check(f"broadcast input untouched {dtype}", x, base(dtype, R))
    y = base(dtype, R)
    hvd.broadcast_(y, root)
    check(f"broadcast_ {dtype}", y, want)
    check(f"broadcast_async {dtype}", hvd.synchronize(hvd.broadcast_async(x, 0)),
          base(dtype, 0))
    y = base(dtype, R)
    hvd.synchronize(hvd.broadcast_async_(y, 0))
    check(f"broadcast_async_ {dtype}", y, base(dtype, 0))

# -- alltoall: rank r sends (r + j) % 2 + 1 rows to rank j --------------------------------


def a2a_input(r):
    splits = [(r + j) % 2 + 1 for j in range(N)]
    rows = torch.arange(sum(splits), dtype=torch.float32) + 100 * r
    return rows.reshape(-1, 1).repeat(1, 2), splits


x, splits = a2a_input(R)
received, recv_splits = hvd.alltoall(x, splits=splits, name="a2a")
parts = []
for j in range(N):
    xj, sj = a2a_input(j)
    start = sum(sj[:R])
    parts.append(xj[start:start + sj[R]])
check("alltoall", received, torch.cat(parts))
check("alltoall recv splits", recv_splits,
      torch.tensor([a2a_input(j)[1][R] for j in range(N)], dtype=torch.int32))
even = torch.arange(2 * N, dtype=torch.int64) + 10 * R
check("alltoall even", hvd.alltoall(even),
      torch.cat([(torch.arange(2 * N, dtype=torch.int64) + 10 * j)[2 * R:2 * R + 2]
                 for j in range(N)]))
got, _ = hvd.synchronize(hvd.alltoall_async(x, splits=torch.tensor(splits)))
check("alltoall_async tensor splits", got, torch.cat(parts))

# -- reducescatter: 2N+1 rows, the first rank gets one more ------------------------------
rows = 2 * N + 1
for op in (hvd.Sum, hvd.Average, hvd.Max):
    xs_all = [base(torch.float32, r, (rows, 2)) for r in range(N)]
    full = reduce_expected(op, xs_all)
    mine = [2 + (1 if r < rows % N else 0) for r in range(N)]
    start = sum(mine[:R])
    check(f"reducescatter {OP_NAMES[op]}", hvd.reducescatter(xs_all[R], op=op),
          full[start:start + mine[R]], 1e-6)
    check(f"reducescatter_async {OP_NAMES[op]}",
          hvd.synchronize(hvd.reducescatter_async(xs_all[R], op=op)),
          full[start:start + mine[R]], 1e-6)

# -- objects, join, barrier ----------------------------------------------------------------
obj = hvd.broadcast_object({"rank": R, "payload": list(range(R + 3))}, root_rank=1)
if obj != {"rank": 1, "payload": list(range(4))}:
    failures.append(f"broadcast_object: {obj!r}")
objs = hvd.allgather_object(("r", R, "x" * R))
if objs != [("r", r, "x" * r) for r in range(N)]:
    failures.append(f"allgather_object: {objs!r}")
hvd.barrier()
last = hvd.join()
if not 0 <= last < N:
    failures.append(f"join returned {last}")

# Compression.fp16 through the differentiable allreduce: float32 in, float32 out.
x = base(torch.float32, R)
got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
check("allreduce fp16 compression", got,
      reduce_expected(hvd.Sum, [base(torch.float32, r) for r in range(N)]), 1e-3)
got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.bf16)
check("allreduce bf16 compression", got,
      reduce_expected(hvd.Sum, [base(torch.float32, r) for r in range(N)]), 1e-2)

print("HVDLITE_RESULT", json.dumps({"failures": failures, "checks": checks[0]}))
