"""Rank script: training on CUDA with hvdlite.torch against one process's computation.

* DistributedOptimizer (SGD with momentum, Adam; gradients as they are, fp16 and bf16
  compressed) for a few steps, each rank on its rows of a global batch, against plain
  torch on the whole batch in this process (the single-process reference, same device).
* broadcast_parameters and broadcast_optimizer_state of CUDA models and Adam state.
* SyncBatchNorm on CUDA against torch's BatchNorm1d on the whole batch.

The last line is ``HVDLITE_RESULT {"failures", "checks", "info"}``; info holds each
comparison's largest difference and the core's counters.

    python -m hvdlite.runner -np 2 python tests/gpu/gpu_scripts/training.py [--device cpu]
"""
import torch
import torch.nn.functional as F

import hvdlite.torch as hvd
from gpu_checks import Checks, core_stats, parse_args, pick_device

args = parse_args()
torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
DEV = pick_device(args.device)
c = Checks(DEV)
STEPS, B = 8, 16
if DEV.type == "cuda":
    # The reference and the ranks must compute alike: no TF32 in the matrix products.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4)).to(DEV)


def batch(step):
    """The global batch of a step (N * B rows), the same on every rank, on the device."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(N * B, 20, generator=g)
    y = torch.randint(0, 4, (N * B,), generator=g)
    return x.to(DEV), y.to(DEV)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def train_reference(make_opt):
    model = make_model(0)
    opt = make_opt(model.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def train_distributed(make_opt, compression):
    model = make_model(100 + R)  # different on every rank until the broadcast
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    if R == 0:
        model.load_state_dict(make_model(0).state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(STEPS):
        x, y = batch(step)
        mine = slice(R * B, (R + 1) * B)
        opt.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    return model


def max_diff(a, b):
    return max(float((p.detach().cpu() - q.detach().cpu()).abs().max())
               for p, q in zip(a.parameters(), b.parameters()))


def optimizer_section():
    reference = {"sgd": train_reference(sgd), "adam": train_reference(adam)}
    # fp16/bf16 gradients carry 11 and 8 significant bits: looser bounds for those.
    for comp_name, tol in (("none", 1e-4), ("fp16", 5e-3), ("bf16", 3e-2)):
        for opt_name, make_opt in (("sgd", sgd), ("adam", adam)):
            label = f"DistributedOptimizer {opt_name} compression={comp_name}"
            model = train_distributed(make_opt, getattr(hvd.Compression, comp_name))
            c.true(label + " parameters on the device",
                   all(p.device == DEV for p in model.parameters()))
            diff = max_diff(model, reference[opt_name])
            c.info[label] = diff
            c.true(label, diff <= tol,
                   f": parameters differ from one process on the whole batch by {diff:.3g} "
                   f"(> {tol})")


def broadcast_state_section():
    model = make_model(100 + R)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    want = make_model(100)
    for (name, p), q in zip(model.state_dict().items(), want.state_dict().values()):
        c.close(f"broadcast_parameters {name}", p, q)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=N - 1)
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        c.close(f"broadcast_parameters named list {name}", p, q)

    # Adam state that differs per rank (one step on rank-dependent gradients), then the
    # root's state everywhere; the root's is recomputed here.
    def adam_after_step(model, grad_value):
        opt = torch.optim.Adam(model.parameters(), lr=0.01 * (grad_value + 1))
        for p in model.parameters():
            p.grad = torch.full_like(p, float(grad_value))
        opt.step()
        return opt

    opt = adam_after_step(model, R + 1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    want_opt = adam_after_step(make_model(100), 1)
    c.true("broadcast_optimizer_state lr", opt.param_groups[0]["lr"] ==
           want_opt.param_groups[0]["lr"], repr(opt.param_groups[0]["lr"]))
    for i, (p, q) in enumerate(zip(model.parameters(), want_opt.param_groups[0]["params"])):
        got_state, want_state = opt.state[p], want_opt.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            c.close(f"broadcast_optimizer_state {key} [{i}]", got_state[key],
                    want_state[key], 1e-6)
        c.true(f"broadcast_optimizer_state step [{i}]",
               float(got_state["step"]) == float(want_state["step"]))


def sync_batch_norm_section():
    C = 3
    reference = torch.nn.BatchNorm1d(C).to(DEV)
    sync = hvd.SyncBatchNorm(C).to(DEV)
    with torch.no_grad():
        for module in (reference, sync):
            module.weight.copy_(torch.tensor([0.5, -1.5, 2.0]))
            module.bias.copy_(torch.tensor([0.1, 0.0, -0.3]))
    for step in range(3):
        rows = [2 + (k + step) % 3 + k for k in range(N)]
        g = torch.Generator().manual_seed(50 + step)
        x = (torch.randn(sum(rows), C, generator=g) * 2 + 1).to(DEV)
        dy = torch.randn(sum(rows), C, generator=g).to(DEV)
        mine = slice(sum(rows[:R]), sum(rows[:R + 1]))
        xr = x[mine].clone().requires_grad_()
        x = x.clone().requires_grad_()
        y = reference(x)
        (y * dy).sum().backward()
        yr = sync(xr)
        (yr * dy[mine]).sum().backward()
        c.close(f"SyncBatchNorm step {step} output", yr, y[mine], 1e-4)
        c.close(f"SyncBatchNorm step {step} input grad", xr.grad, x.grad[mine], 1e-4)
    c.close("SyncBatchNorm running_mean", sync.running_mean, reference.running_mean, 1e-5)
    c.close("SyncBatchNorm running_var", sync.running_var, reference.running_var, 1e-5)


for section in (optimizer_section, broadcast_state_section, sync_batch_norm_section):
    c.attempt(section.__name__, section)
hvd.barrier()
c.info["device"] = str(DEV)
c.info["stats"] = core_stats()
c.failures = c.failures[:60]
c.report()
