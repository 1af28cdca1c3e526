"""Rank script: every hvdlite.torch collective on CUDA tensors against values computed on
the CPU from rank and size (any number of ranks, 1 included).

Each rank can rebuild every rank's input (``base(dtype, r)``), so the expected values are
plain torch on the CPU; each result must also be on this rank's CUDA device. Inputs are
made by a kernel on the device just before each call, and results are read by a kernel
just after, so a core that does not order its copies with torch's current stream shows
here. The last line is ``HVDLITE_RESULT {"failures", "checks", "info": {"stats",
"device"}}``; the test reads which path ran from the stats' counters.

    python -m hvdlite.runner -np 2 python tests/gpu/gpu_scripts/collectives.py [--device cpu]
"""
import torch

import hvdlite.torch as hvd
from gpu_checks import Checks, core_stats, parse_args, pick_device

args = parse_args()
torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
DEV = pick_device(args.device)
c = Checks(DEV)

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.uint8, torch.int8]
DTYPES = FLOATS + INTS
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max}


def base(dtype, r, shape=(4, 3)):
    """Rank r's input on the CPU: small integers, so sums (and float16/bfloat16 values)
    are exact; -3..3 for signed types, 0..3 for uint8 (sums fit up to 3 ranks)."""
    n = 1
    for d in shape:
        n *= d
    v = (torch.arange(n) * 5 + r * 3) % 7
    if dtype == torch.uint8:
        return (v % 4).to(dtype).reshape(shape)
    return (v - 3).to(dtype).reshape(shape)


def on_device(t):
    """``t`` on this rank's device, produced by a kernel there (not only a copy)."""
    d = t.to(DEV)
    return d + torch.zeros_like(d) if d.dtype.is_floating_point else d ^ torch.zeros_like(d)


def used(t):
    """A kernel on the device reads ``t`` right away (before any host sync)."""
    return t * 1 if t.dtype.is_floating_point else t + 0


def reduce_expected(op, xs):
    stack = torch.stack([x.double() for x in xs])
    if op == "Sum":
        out = stack.sum(0)
    elif op == "Min":
        out = stack.min(0).values
    elif op == "Max":
        out = stack.max(0).values
    else:
        out = stack.sum(0) / len(xs)
    return out.to(xs[0].dtype)


def tol_of(dtype):
    return 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6


def allreduce_section():
    for dtype in DTYPES:
        ops = ["Sum", "Average", "Min", "Max"] if dtype.is_floating_point else ["Sum", "Min", "Max"]
        for op in ops:
            label = f"allreduce {dtype} {op}"
            want = reduce_expected(op, [base(dtype, r) for r in range(N)])
            x = on_device(base(dtype, R))
            got = used(hvd.allreduce(x, name=f"ar.{dtype}.{op}", op=OPS[op]))
            c.close(label, got, want, tol_of(dtype))
            c.close(label + " input untouched", x, base(dtype, R))
            y = on_device(base(dtype, R))
            out = hvd.allreduce_(y, name=f"ar_.{dtype}.{op}", op=OPS[op])
            c.close(label + " in place", used(y), want, tol_of(dtype))
            c.true(label + " in place returns its argument", out is y)
            h = hvd.allreduce_async(on_device(base(dtype, R)), name=f"ara.{dtype}.{op}",
                                    op=OPS[op])
            c.close(label + " async", used(hvd.synchronize(h)), want, tol_of(dtype))
        if dtype.is_floating_point:
            # (0.5 * v) summed, times 3: exact in every float type for these values.
            want = reduce_expected("Sum", [base(dtype, r) for r in range(N)]).double() * 1.5
            got = hvd.allreduce(on_device(base(dtype, R)), name=f"ar.scaled.{dtype}",
                                op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
            c.close(f"allreduce {dtype} prescale/postscale", used(got), want.to(dtype),
                    tol_of(dtype))
            want = reduce_expected("Average", [base(dtype, r) for r in range(N)]).double() * 2
            got = hvd.allreduce(on_device(base(dtype, R)), name=f"ar.avg_scaled.{dtype}",
                                op=hvd.Average, postscale_factor=2.0)
            c.close(f"allreduce {dtype} Average postscale", used(got), want.to(dtype),
                    tol_of(dtype))
    # A 0-d tensor, an odd length, and one large enough to go in several pieces.
    c.close("allreduce 0-d", hvd.allreduce(torch.tensor(float(R), device=DEV), op=hvd.Sum,
                                           name="ar.scalar"),
            torch.tensor(float(sum(range(N)))))
    for n in (1, 1023, (1 << 22) + 3):
        pattern = torch.arange(n, dtype=torch.float32) % 17
        x = on_device(pattern + R)
        c.close(f"allreduce float32 x{n}", used(hvd.allreduce(x, op=hvd.Sum, name=f"ar.n{n}")),
                pattern * N + sum(range(N)))


def grouped_section():
    for dtype in DTYPES:
        shapes = [(2, 3), (5,), (1, 4, 2)]
        xs = [on_device(base(dtype, R, s)) for s in shapes]
        wants = [reduce_expected("Sum", [base(dtype, r, s) for r in range(N)]) for s in shapes]
        for i, got in enumerate(hvd.grouped_allreduce(xs, name=f"grp.{dtype}", op=hvd.Sum)):
            c.close(f"grouped_allreduce {dtype} {i}", used(got), wants[i], tol_of(dtype))
        ys = [on_device(base(dtype, R, s)) for s in shapes]
        hvd.grouped_allreduce_(ys, name=f"grp_.{dtype}", op=hvd.Max)
        for i, (y, s) in enumerate(zip(ys, shapes)):
            c.close(f"grouped_allreduce_ {dtype} Max {i}", used(y),
                    reduce_expected("Max", [base(dtype, r, s) for r in range(N)]))
    # Mixed dtypes and many small tensors in one group (fused).
    xs = [on_device(base(dt, R, (3, i + 1))) for i, dt in enumerate(DTYPES)]
    outs = hvd.grouped_allreduce(xs, name="grp.mixed", op=hvd.Sum)
    for i, (dt, got) in enumerate(zip(DTYPES, outs)):
        c.close(f"grouped_allreduce mixed {dt}", used(got),
                reduce_expected("Sum", [base(dt, r, (3, i + 1)) for r in range(N)]), tol_of(dt))
    many = [on_device(torch.full((4096,), float(i % 7 + R))) for i in range(200)]
    outs = hvd.grouped_allreduce(many, name="grp.many", op=hvd.Average)
    for i, got in enumerate(outs):
        c.close(f"grouped_allreduce 200 x 16 KiB [{i}]", got,
                torch.full((4096,), i % 7 + (N - 1) / 2.0))


def allgather_section():
    for dtype in DTYPES:
        x = on_device(base(dtype, R, (R + 1, 2)))
        want = torch.cat([base(dtype, r, (r + 1, 2)) for r in range(N)])
        c.close(f"allgather {dtype}", used(hvd.allgather(x, name=f"ag.{dtype}")), want)
        h = hvd.allgather_async(x, name=f"aga.{dtype}")
        c.close(f"allgather_async {dtype}", used(hvd.synchronize(h)), want)
    x = on_device(torch.full((R % 2, 3), float(R)))
    c.close("allgather zero rows", hvd.allgather(x, name="ag.zero"),
            torch.cat([torch.full((r % 2, 3), float(r)) for r in range(N)]))


def broadcast_section():
    root = N - 1
    for dtype in DTYPES:
        x = on_device(base(dtype, R))
        c.close(f"broadcast {dtype}", used(hvd.broadcast(x, root, name=f"bc.{dtype}")),
                base(dtype, root))
        c.close(f"broadcast {dtype} input untouched", x, base(dtype, R))
        y = on_device(base(dtype, R))
        hvd.broadcast_(y, 0, name=f"bc_.{dtype}")
        c.close(f"broadcast_ {dtype}", used(y), base(dtype, 0))


def a2a_input(r, dtype):
    splits = [(r + j) % 2 + 1 for j in range(N)]
    rows = (torch.arange(sum(splits)) % 5 + r * 2).to(dtype)
    return rows.reshape(-1, 1).repeat(1, 3), splits


def alltoall_section():
    for dtype in DTYPES:
        x, splits = a2a_input(R, dtype)
        received, recv_splits = hvd.alltoall(on_device(x), splits=splits, name=f"a2a.{dtype}")
        parts = []
        for j in range(N):
            xj, sj = a2a_input(j, dtype)
            start = sum(sj[:R])
            parts.append(xj[start:start + sj[R]])
        c.close(f"alltoall {dtype}", used(received), torch.cat(parts))
        c.true(f"alltoall {dtype} received splits",
               [int(s) for s in recv_splits] == [a2a_input(j, dtype)[1][R] for j in range(N)],
               repr(recv_splits))
    even = on_device(torch.arange(2 * N, dtype=torch.int64) + 10 * R)
    c.close("alltoall even", used(hvd.alltoall(even, name="a2a.even")),
            torch.cat([(torch.arange(2 * N, dtype=torch.int64) + 10 * j)[2 * R:2 * R + 2]
                       for j in range(N)]))


def reducescatter_section():
    rows = 2 * N + 1
    mine = [rows // N + (1 if r < rows % N else 0) for r in range(N)]
    start = sum(mine[:R])
    for dtype in DTYPES:
        ops = ["Sum", "Average"] if dtype.is_floating_point else ["Sum"]
        for op in ops:
            xs = [base(dtype, r, (rows, 2)) for r in range(N)]
            full = reduce_expected(op, xs)
            got = hvd.reducescatter(on_device(xs[R]), op=OPS[op], name=f"rs.{dtype}.{op}")
            c.close(f"reducescatter {dtype} {op}", used(got), full[start:start + mine[R]],
                    tol_of(dtype))


def compression_section():
    for name in ("fp16", "bf16"):
        compression = getattr(hvd.Compression, name)
        x = on_device(base(torch.float32, R, (64,)))
        got = hvd.allreduce(x, op=hvd.Sum, compression=compression, name=f"ar.{name}")
        c.close(f"allreduce compression={name}", used(got),
                reduce_expected("Sum", [base(torch.float32, r, (64,)) for r in range(N)]))


for section in (allreduce_section, grouped_section, allgather_section, broadcast_section,
                alltoall_section, reducescatter_section, compression_section):
    c.attempt(section.__name__, section)
hvd.barrier()
c.info["device"] = str(DEV)
c.info["stats"] = core_stats()
c.failures = c.failures[:60]
c.report()
