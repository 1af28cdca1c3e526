"""Rank script: hvd.SyncBatchNorm against torch's BatchNorm on the concatenated batch of
every rank, computed here in one process (every rank rebuilds the whole batch from a
shared seed and feeds its own rows; batch sizes differ per rank).
"""
import torch
import torch.nn.functional as F

import hvdlite.torch as hvd
from checks import Checks

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
c = Checks()
C = 3
REFERENCE = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
             5: torch.nn.BatchNorm3d}


def rows_of(step, ndim):
    """Rows per rank, different on every rank; 3D inputs include a rank with none."""
    rows = [1 + (k + step) % 3 + k for k in range(N)]
    if ndim == 3 and step == 1:
        rows[0] = 0
    return rows


def global_data(seed, rows, ndim, dtype):
    g = torch.Generator().manual_seed(seed)
    shape = (sum(rows), C) + (3, 2, 2)[:ndim - 2]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, dy


def run(ndim, dtype, momentum, affine, track, tol):
    label = f"{ndim}d {dtype} momentum={momentum} affine={affine} track={track}"
    reference = REFERENCE[ndim](C, momentum=momentum, affine=affine,
                                track_running_stats=track).to(dtype)
    sync = hvd.SyncBatchNorm(C, momentum=momentum, affine=affine,
                             track_running_stats=track).to(dtype)
    if affine:
        with torch.no_grad():
            for module in (reference, sync):
                module.weight.copy_(torch.tensor([0.5, -1.5, 2.0], dtype=dtype))
                module.bias.copy_(torch.tensor([0.1, 0.0, -0.3], dtype=dtype))
    for step in range(3):
        rows = rows_of(step, ndim)
        x, dy = global_data(100 * ndim + step, rows, ndim, dtype)
        mine = slice(sum(rows[:R]), sum(rows[:R + 1]))
        xr = x[mine].clone().requires_grad_()
        x = x.clone().requires_grad_()
        for module in (reference, sync):
            module.zero_grad()
        y = reference(x)
        (y * dy).sum().backward()
        yr = sync(xr)
        (yr * dy[mine]).sum().backward()
        c.close(f"{label} step {step} output", yr, y[mine], tol)
        c.close(f"{label} step {step} input grad", xr.grad, x.grad[mine], tol)
        if affine:
            # Each rank's weight and bias gradients are its rows' share: they add up.
            for name in ("weight", "bias"):
                total = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum,
                                      name=f"sbn.{name}")
                c.close(f"{label} step {step} {name} grad", total,
                        getattr(reference, name).grad, tol)
        if track:
            c.close(f"{label} step {step} running_mean", sync.running_mean,
                    reference.running_mean, tol)
            c.close(f"{label} step {step} running_var", sync.running_var,
                    reference.running_var, tol)
            c.true(f"{label} step {step} num_batches_tracked",
                   int(sync.num_batches_tracked) == int(reference.num_batches_tracked))
    # Eval: running statistics where tracked, without a collective; synchronized batch
    # statistics where not.
    sync.eval()
    reference.eval()
    rows = rows_of(5, ndim)
    x, _ = global_data(999, rows, ndim, dtype)
    mine = slice(sum(rows[:R]), sum(rows[:R + 1]))
    before = hvd.stats()["tensors"]
    with torch.no_grad():
        got = sync(x[mine])
    collectives = hvd.stats()["tensors"] - before
    c.close(f"{label} eval output", got, reference(x)[mine], tol)
    c.true(f"{label} eval collectives", collectives == (0 if track else 1),
           f"{collectives} tensors communicated")


for ndim in (2, 3, 4, 5):
    run(ndim, torch.float64, 0.1, True, True, 1e-10)
    run(ndim, torch.float32, None, True, True, 2e-5)
run(4, torch.float32, 0.3, False, True, 2e-5)
run(3, torch.float64, 0.1, True, False, 1e-10)

# Training through DistributedOptimizer equals one process on the whole batch.
def net():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Conv2d(2, C, 3), torch.nn.BatchNorm2d(C),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(C * 4, 2))


reference = net()
model = net()
model[1] = hvd.SyncBatchNorm(C)
model[1].load_state_dict(reference[1].state_dict())
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                               named_parameters=model.named_parameters())
B = 3
for step in range(5):
    g = torch.Generator().manual_seed(40 + step)
    x = torch.randn(N * B, 2, 4, 4, generator=g)
    y = torch.randint(0, 2, (N * B,), generator=g)
    ref_opt.zero_grad()
    F.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    opt.zero_grad()
    mine = slice(R * B, (R + 1) * B)
    F.cross_entropy(model(x[mine]), y[mine]).backward()
    opt.step()
diff = max(float((p - q).detach().abs().max())
           for p, q in zip(model.parameters(), reference.parameters()))
c.info["training_max_diff"] = diff
c.true("training equals one process", diff < 2e-5, f"max diff {diff}")
c.close("training running_var", model[1].running_var, reference[1].running_var, 2e-5)

# One value per channel over all ranks cannot be normalized: refused on every rank.
try:
    hvd.SyncBatchNorm(C)(torch.ones((1 if R == 0 else 0, C)))
    c.true("one value refused", False, "did not raise")
except ValueError as e:
    c.true("one value refused", "more than 1 value per channel" in str(e), str(e))
try:
    hvd.SyncBatchNorm(C)(torch.ones(C))
    c.true("1D input refused", False, "did not raise")
except ValueError as e:
    c.true("1D input refused", "expected at least 2D input" in str(e), str(e))

c.report()
