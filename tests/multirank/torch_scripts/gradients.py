"""Rank script: the autograd gradients of the hvdlite.torch collectives, as Horovod
defines them, against formulas evaluated locally from rank and size.

Rank k's loss is L_k = (op(x) * W_k).sum(), with W_k a fixed tensor every rank can
rebuild, so the gradient reaching op's output on rank k is W_k. Horovod's definitions:

* allreduce, grouped_allreduce: the allreduce of the W_k with the forward's op and
  scale factors.
* allgather: the W_k averaged over ranks, this rank's rows.
* broadcast: the W_k averaged over ranks on the root, zero elsewhere.
* reducescatter: the W_k stacked in rank order (allgather), times size for Sum and
  times the scale factors.
* alltoall: each gradient row goes back to the rank it came from.
"""
import torch

import hvdlite.torch as hvd
from checks import Checks

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
c = Checks()
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def W(k, shape, dtype):
    """Rank k's output gradient: distinct, exactly representable values."""
    n = torch.Size(shape).numel()
    return ((torch.arange(n, dtype=torch.float64) % 11 + 1 + 7 * k) / 4).reshape(shape).to(dtype)


def x_of(k, shape, dtype):
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float64) * (k + 2) % 13).reshape(shape).to(dtype)


def grad_of(fn, x):
    """The gradient of L_R = (fn(x) * W_R).sum() with respect to x."""
    x = x.clone().requires_grad_()
    y = fn(x)
    (y * W(R, y.shape, y.dtype)).sum().backward()
    return x.grad


def shape(rows, dim):
    return (rows,) + (3,) * (dim - 1)


for dtype in (torch.float32, torch.float64):
    tol = TOL[dtype]
    for dim in (1, 2, 3):
        s = shape(4, dim)
        label = f"{dtype} dim {dim}"
        x = x_of(R, s, dtype)
        all_w = [W(k, s, dtype) for k in range(N)]

        # allreduce / grouped_allreduce: the same reduction of the W_k.
        for op, name in ((hvd.Sum, "Sum"), (hvd.Average, "Average")):
            want = sum(all_w) / (N if op == hvd.Average else 1)
            c.close(f"allreduce {name} {label}", grad_of(lambda t: hvd.allreduce(t, op=op), x),
                    want, tol)
        c.close(f"allreduce scaled {label}",
                grad_of(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5,
                                                postscale_factor=3.0), x),
                1.5 * sum(all_w), tol)
        xa, xb = x.clone().requires_grad_(), (x * 2).requires_grad_()
        ya, yb = hvd.grouped_allreduce([xa, xb], op=hvd.Average)
        ((ya * W(R, s, dtype)).sum() + (yb * 2 * W(R, s, dtype)).sum()).backward()
        c.close(f"grouped_allreduce a {label}", xa.grad, sum(all_w) / N, tol)
        c.close(f"grouped_allreduce b {label}", xb.grad, 2 * sum(all_w) / N, tol)

        # allgather: rank k gives k + 1 rows (rank 0 of three gives none, to include an
        # empty contribution).
        rows = [k + 1 for k in range(N)]
        if N == 3:
            rows[0] = 0
        gathered = shape(sum(rows), dim)
        mean_w = sum(W(k, gathered, dtype) for k in range(N)) / N
        start = sum(rows[:R])
        c.close(f"allgather {label}",
                grad_of(hvd.allgather, x_of(R, shape(rows[R], dim), dtype)),
                mean_w[start:start + rows[R]], tol)
        # Horovod's own check: the same gradient on every rank comes back unchanged.
        xg = x_of(R, shape(rows[R], dim), dtype).requires_grad_()
        same = torch.cat([torch.full(shape(rows[k], dim), float(k), dtype=dtype)
                          for k in range(N)])
        hvd.allgather(xg).backward(same)
        c.close(f"allgather same gradient {label}", xg.grad,
                torch.full(shape(rows[R], dim), float(R), dtype=dtype), tol)

        # broadcast from every root.
        for root in range(N):
            want = sum(all_w) / N if R == root else torch.zeros(s, dtype=dtype)
            c.close(f"broadcast root {root} {label}",
                    grad_of(lambda t: hvd.broadcast(t, root), x), want, tol)

        # reducescatter over 2N+1 rows (uneven: the first ranks get one more row).
        total = 2 * N + 1
        mine = [2 + (1 if k < total % N else 0) for k in range(N)]
        stacked = torch.cat([W(k, shape(mine[k], dim), dtype) for k in range(N)])
        xr = x_of(R, shape(total, dim), dtype)
        c.close(f"reducescatter Sum {label}",
                grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum), xr), N * stacked, tol)
        c.close(f"reducescatter Average {label}",
                grad_of(lambda t: hvd.reducescatter(t, op=hvd.Average), xr), stacked, tol)
        c.close(f"reducescatter Sum scaled {label}",
                grad_of(lambda t: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=2.0,
                                                    postscale_factor=0.25), xr),
                N * 0.5 * stacked, tol)
        c.close(f"reducescatter Average scaled {label}",
                grad_of(lambda t: hvd.reducescatter(t, op=hvd.Average, prescale_factor=3.0),
                        xr), 3.0 * stacked, tol)

        # alltoall with splits: rank r sends (r + j) % 2 + 1 rows to rank j.
        def splits_of(k):
            return [(k + j) % 2 + 1 for j in range(N)]

        xt = x_of(R, shape(sum(splits_of(R)), dim), dtype)
        want = torch.empty(xt.shape, dtype=dtype)
        row = 0
        for j in range(N):
            sent = splits_of(R)[j]
            before = sum(splits_of(k)[j] for k in range(R))   # rows j got from ranks < R
            received = sum(splits_of(k)[j] for k in range(N))
            want[row:row + sent] = W(j, shape(received, dim), dtype)[before:before + sent]
            row += sent
        c.close(f"alltoall splits {label}",
                grad_of(lambda t: hvd.alltoall(t, splits=splits_of(R))[0], xt), want, tol)
        # Without splits: N * 2 rows, two to each rank.
        xe = x_of(R, shape(2 * N, dim), dtype)
        want = torch.cat([W(j, shape(2 * N, dim), dtype)[2 * R:2 * R + 2] for j in range(N)])
        c.close(f"alltoall even {label}", grad_of(hvd.alltoall, xe), want, tol)

# Min/Max reducescatter has no gradient (Horovod's is defined for Sum and Average).
xr = x_of(R, (2 * N,), torch.float64).requires_grad_()
try:
    hvd.reducescatter(xr, op=hvd.Max).sum().backward()
    c.true("reducescatter Max backward", False, "did not raise")
except RuntimeError as e:
    c.true("reducescatter Max backward message", "Sum or Average" in str(e), str(e))

c.report()
