"""DistributedOptimizer(shard=1) and (shard=2) on real 2- and 3-rank jobs: training equals
the unsharded optimizer's and one process's on the whole batch (SGD with momentum, Adam,
AdamW, Adagrad, LAMB, LARS), each rank holds the state of its own parameters (stage 1) or
pieces (stage 2) only, a consolidated checkpoint equals the unsharded state and loads into
another rank count, and broadcast_optimizer_state sends the root's whole state.

Each rank records failed checks (PRELUDE's ``check``) and reports them in one
``HVDLITE_RESULT`` line; the expected values come from the same model trained with the
unsharded DistributedOptimizer in the same job.
"""
import os

import pytest

from harness import assert_checks_pass

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

PRELUDE = r'''
import copy, json, os, sys
import numpy as np
import torch
import hvdlite.torch as hvd

torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
failures, checks = [], [0]


def check(label, ok, detail=""):
    checks[0] += 1
    if not ok:
        failures.append(f"{label}: {detail}")


def close(label, a, b, tol=1e-10):
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    check(label, a.shape == b.shape and diff <= tol, f"max diff {diff}")


def same_state(label, full, want):
    """Checks a consolidated state dict against the unsharded optimizer's."""
    check(f"{label}: consolidated keys", sorted(full["state"]) == sorted(want["state"]),
          f"{sorted(full['state'])} vs {sorted(want['state'])}")
    for index, entries in want["state"].items():
        for key, value in entries.items():
            got = full["state"][index][key]
            if isinstance(value, torch.Tensor):
                close(f"{label}: state {index}.{key}", got.double(), value.double())
            else:
                check(f"{label}: state {index}.{key}", got == value, f"{got} vs {value}")


def model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(6 * size, 7, generator=g, dtype=torch.float64)
    return x[rank::size], x[rank::size].sum(1, keepdim=True).sin()


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "lamb": lambda ps: hvd.LAMB(ps, lr=0.02, weight_decay=0.01),
    "lars": lambda ps: hvd.LARS(ps, lr=0.5, momentum=0.9, weight_decay=1e-4,
                                trust_coefficient=0.01),
}
MORE_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
}


def whole_batch(step):
    """Every rank's rows of ``batch(step)`` at once: what one process trains on."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(6 * size, 7, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def numpy_layerwise(kind, net, steps):
    """Trains ``net`` on the whole batch with OPTIMIZERS' LARS or LAMB written out in numpy
    (the papers' formulas; torch only computes the gradients)."""
    def ratio(w, u, coefficient=1.0):
        wn, un = np.linalg.norm(w), np.linalg.norm(u)
        return coefficient * wn / un if wn > 0 and un > 0 else 1.0

    params = list(net.parameters())
    ws = [p.detach().numpy().copy() for p in params]
    bufs, ms, vs = [None] * len(ws), [0.0] * len(ws), [0.0] * len(ws)
    for t, step in enumerate(range(steps), start=1):
        with torch.no_grad():
            for p, w in zip(params, ws):
                p.copy_(torch.from_numpy(w))
        net.zero_grad()
        x, y = whole_batch(step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        for i, p in enumerate(params):
            g = p.grad.numpy()
            if kind == "lars":
                d = g + 1e-4 * ws[i]
                scaled = 0.5 * ratio(ws[i], d, 0.01) * d
                bufs[i] = scaled if bufs[i] is None else 0.9 * bufs[i] + scaled
                ws[i] = ws[i] - bufs[i]
            else:
                ms[i] = 0.9 * ms[i] + 0.1 * g
                vs[i] = 0.999 * vs[i] + 0.001 * g * g
                r = (ms[i] / (1 - 0.9 ** t)) / (np.sqrt(vs[i] / (1 - 0.999 ** t)) + 1e-6) \
                    + 0.01 * ws[i]
                ws[i] = ws[i] - 0.02 * ratio(ws[i], r) * r
    with torch.no_grad():
        for p, w in zip(params, ws):
            p.copy_(torch.from_numpy(w))


def train(net, opt, steps, first=0, data=batch, passes=1):
    """``steps`` steps, each of ``passes`` backward passes over equal parts of the batch
    (their losses divided by ``passes``: the gradients add up to the batch's mean)."""
    for step in range(first, first + steps):
        x, y = data(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
            (torch.nn.functional.mse_loss(net(xs), ys) / passes).backward()
        opt.step()


def report(**extra):
    hvd.barrier()
    print("HVDLITE_RESULT", json.dumps({"failures": failures, "checks": checks[0], **extra}),
          flush=True)
'''

TRAINING = PRELUDE + r'''
owned_counts = {}
for kind, make in {**OPTIMIZERS, **MORE_OPTIMIZERS}.items():
    plain, sharded = model(), model()
    a = hvd.DistributedOptimizer(make(plain.parameters()), named_parameters=plain.named_parameters())
    b = hvd.DistributedOptimizer(make(sharded.parameters()),
                                 named_parameters=sharded.named_parameters(), shard=1)
    train(plain, a, 4)
    train(sharded, b, 4)
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        close(f"{kind} {name}", p.detach(), q.detach())
    mine = [p for p in sharded.parameters() if b.owns(p)]
    check(f"{kind}: state for its own parameters only",
          set(b.state) == set(mine),
          f"{len(b.state)} states, {len(mine)} owned")
    owned = torch.tensor([len(mine)])
    total = hvd.allreduce(owned, op=hvd.Sum, name=f"owned.{kind}").item()
    check(f"{kind}: every parameter has one owner", total == len(list(sharded.parameters())),
          str(total))
    owned_counts[kind] = [len(mine), sum(p.numel() for p in mine)]
    # The consolidated state equals the unsharded optimizer's, on the rank asked.
    b.consolidate_state_dict(to=size - 1)
    if rank == size - 1:
        full, want = b.state_dict(), a.state_dict()
        same_state(kind, full, want)
        if kind == "adam":
            torch.save(full, os.environ["CHECKPOINT"])
    else:
        try:
            b.state_dict()
        except RuntimeError as e:
            check("state_dict off the consolidating rank names the remedy",
                  "consolidate_state_dict" in str(e), str(e))
        else:
            check("state_dict off the consolidating rank raises", False)
report(owned=owned_counts)
'''

RESUME = PRELUDE + r'''
# A checkpoint written by a job of another size: loaded on every rank of a sharded
# optimizer, and on rank 0 only then broadcast; both continue as the unsharded one.
ckpt = torch.load(os.environ["CHECKPOINT"])
nets = [model() for _ in range(3)]
a = hvd.DistributedOptimizer(torch.optim.Adam(nets[0].parameters(), lr=0.01),
                             named_parameters=nets[0].named_parameters())
b = hvd.DistributedOptimizer(torch.optim.Adam(nets[1].parameters(), lr=0.01),
                             named_parameters=nets[1].named_parameters(), shard=1)
c = hvd.DistributedOptimizer(torch.optim.Adam(nets[2].parameters(), lr=0.01),
                             named_parameters=nets[2].named_parameters(), shard=1)
# Each its own copy: torch's load_state_dict keeps the given tensors where their dtype
# and device fit, and the optimizers would then update one another's state.
a.load_state_dict(copy.deepcopy(ckpt))
b.load_state_dict(copy.deepcopy(ckpt))
if rank == 0:
    c.load_state_dict(copy.deepcopy(ckpt))
hvd.broadcast_optimizer_state(c, root_rank=0)
check("loaded: own parameters' state only", set(b.state) == {p for p in nets[1].parameters()
                                                             if b.owns(p)})
check("broadcast: own parameters' state only", set(c.state) == {p for p in nets[2].parameters()
                                                                if c.owns(p)})
for net, opt in zip(nets, (a, b, c)):
    train(net, opt, 3, first=10)
for (name, p), q, r in zip(nets[0].named_parameters(), nets[1].parameters(), nets[2].parameters()):
    close(f"resumed {name}", p.detach(), q.detach())
    close(f"broadcast {name}", p.detach(), r.detach())
report()
'''


STAGE2 = PRELUDE + r'''
# shard=2 against the unsharded DistributedOptimizer and one process on the whole batch
# (for LAMB and LARS: their formulas in numpy).
pieces = {}
for kind, make in {**OPTIMIZERS, **MORE_OPTIMIZERS}.items():
    plain, sharded, alone = model(), model(), model()
    a = hvd.DistributedOptimizer(make(plain.parameters()),
                                 named_parameters=plain.named_parameters())
    b = hvd.DistributedOptimizer(make(sharded.parameters()),
                                 named_parameters=sharded.named_parameters(), shard=2)
    train(plain, a, 4)
    train(sharded, b, 4)
    if kind in ("lamb", "lars"):
        numpy_layerwise(kind, alone, 4)
    else:
        train(alone, make(alone.parameters()), 4, data=whole_batch)
    for (name, p), q, r in zip(plain.named_parameters(), sharded.parameters(), alone.parameters()):
        close(f"{kind} {name} vs unsharded", q.detach(), p.detach())
        close(f"{kind} {name} vs one process", q.detach(), r.detach())
        check(f"{kind} {name}: full gradient dropped", q.grad is None, str(q.grad))
    # State for this rank's pieces only: per-element entries as long as its piece, and
    # the pieces of a parameter cover it once across the ranks.
    spans = [b._span[i] for i in range(len(b._params))]
    for i, (start, stop) in enumerate(spans):
        for key, value in b.state.get(b._stepped[i], {}).items():
            if isinstance(value, torch.Tensor) and value.dim():
                check(f"{kind}: state {i}.{key} is the piece's", value.numel() == stop - start,
                      f"{value.numel()} vs piece of {stop - start}")
    held = torch.tensor([float(stop - start) for start, stop in spans], dtype=torch.float64)
    whole = torch.tensor([float(p.numel()) for p in b._params], dtype=torch.float64)
    close(f"{kind}: pieces cover each parameter once",
          hvd.allreduce(held, op=hvd.Sum, name=f"held.{kind}"), whole)
    pieces[kind] = [stop - start for start, stop in spans]
    if kind == "adam":
        b.consolidate_state_dict(to=0)
        if rank == 0:
            full = b.state_dict()
            same_state("consolidated", full, a.state_dict())
            if "SAVE" in os.environ:
                torch.save(full, os.environ["SAVE"])

# Gradient accumulation, the user's groups (several reduce-scatters), fp16 on the wire.
variants = {
    "passes=2": (dict(backward_passes_per_step=2), 2, 1e-10),
    "groups=2": (dict(groups=2), 1, 1e-10),
    "fp16": (dict(compression=hvd.Compression.fp16), 1, 1e-3),
}
for label, (options, passes, tol) in variants.items():
    plain, sharded = model(), model()
    a = hvd.DistributedOptimizer(torch.optim.Adam(plain.parameters(), lr=0.01),
                                 named_parameters=plain.named_parameters(), **options)
    b = hvd.DistributedOptimizer(torch.optim.Adam(sharded.parameters(), lr=0.01),
                                 named_parameters=sharded.named_parameters(), shard=2, **options)
    train(plain, a, 3, passes=passes)
    train(sharded, b, 3, passes=passes)
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        close(f"{label} {name}", q.detach(), p.detach(), tol)
    if passes > 1:
        alone = model()
        train(alone, torch.optim.Adam(alone.parameters(), lr=0.01), 3, data=whole_batch)
        for (name, p), q in zip(alone.named_parameters(), sharded.parameters()):
            close(f"{label} {name} vs one process", q.detach(), p.detach())

# A process set (ranks 0 and 2 of 3; rank 1 alone of 2): the others take no part.
ps = hvd.add_process_set([0, size - 1] if size > 2 else [size - 1])
if ps.included():
    plain, sharded = model(), model()
    a = hvd.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=plain.named_parameters(), process_set=ps)
    b = hvd.DistributedOptimizer(torch.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=sharded.named_parameters(), process_set=ps,
                                 shard=2)
    train(plain, a, 3)
    train(sharded, b, 3)
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        close(f"process set {name}", q.detach(), p.detach())
hvd.barrier()
hvd.remove_process_set(ps)

# What stage 2 refuses, with the reason.
net = model()
for label, make, options, word in [
        ("Adasum", torch.optim.SGD, dict(op=hvd.Adasum), "Adasum"),
        ("LBFGS", torch.optim.LBFGS, {}, "LBFGS"),
        ("top-k", torch.optim.SGD, dict(compression=hvd.Compression.topk(0.1)), "shard=1"),
        ("shard=3", torch.optim.SGD, dict(shard=3), "shard=3")]:
    try:
        hvd.DistributedOptimizer(make(net.parameters(), lr=0.1),
                                 named_parameters=net.named_parameters(),
                                 **{"shard": 2, **options})
    except ValueError as e:
        check(f"refused {label} names it", word in str(e), str(e))
    else:
        check(f"refused {label}", False, "accepted")
'''

RESUME2 = r'''
# A stage-2 checkpoint from another rank count: loaded by stage 2 on every rank, by stage 2
# on rank 0 then broadcast, and by stage 1; each continues as the unsharded optimizer.
ckpt = torch.load(os.environ["LOAD"])
nets = [model() for _ in range(4)]
opts = [hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                 named_parameters=net.named_parameters(), shard=shard)
        for net, shard in zip(nets, (0, 2, 2, 1))]
opts[0].load_state_dict(copy.deepcopy(ckpt))
opts[1].load_state_dict(copy.deepcopy(ckpt))
if rank == 0:
    opts[2].load_state_dict(copy.deepcopy(ckpt))
hvd.broadcast_optimizer_state(opts[2], root_rank=0)
opts[3].load_state_dict(copy.deepcopy(ckpt))
for label, opt in (("loaded", opts[1]), ("broadcast", opts[2])):
    for i, (start, stop) in enumerate(opt._span):
        got = opt.state[opt._stepped[i]]["exp_avg"]
        want = ckpt["state"][i]["exp_avg"].reshape(-1)[start:stop]
        close(f"{label}: piece of exp_avg {i}", got, want, 0.0)
for net, opt in zip(nets, opts):
    train(net, opt, 3, first=10)
for (name, p), *others in zip(nets[0].named_parameters(), *(n.parameters() for n in nets[1:])):
    for label, q in zip(("stage 2 loaded", "stage 2 broadcast", "stage 1 loaded"), others):
        close(f"{label} {name}", q.detach(), p.detach())
'''


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """Runs TRAINING once per rank count, on first use: {np: (outcomes, checkpoint)}. The
    2-rank job's checkpoint is also the one the 3-rank resume starts from."""
    jobs = {}

    def at(np_):
        if np_ not in jobs:
            checkpoint = tmp_path_factory.mktemp(f"training{np_}") / "adam.pt"
            jobs[np_] = assert_checks_pass(np_, TRAINING, min_checks=45, timeout=150,
                                           env={"CHECKPOINT": str(checkpoint)}), checkpoint
        return jobs[np_]
    return at


@pytest.mark.parametrize("np_", [2, 3])
def test_sharded_training_equals_unsharded_and_state_is_split(np_, training):
    outcomes, checkpoint = training(np_)
    # 6 parameters of 91, 13, 65, 5, 5 and 1 elements (180): dealt out largest first to
    # the rank holding the fewest elements, no rank holds more than its share plus the
    # largest parameter.
    for kind in ("adam", "lamb"):
        counts = [o["owned"][kind][0] for o in outcomes]
        elements = [o["owned"][kind][1] for o in outcomes]
        assert sum(counts) == 6 and sum(elements) == 180, outcomes
        assert max(elements) <= 180 / np_ + 91 and min(elements) > 0, elements
    assert os.path.exists(checkpoint)


def test_a_checkpoint_from_two_ranks_resumes_on_three(training):
    _, checkpoint = training(2)  # the 2-rank training job (run by the test above)
    assert_checks_pass(3, RESUME, min_checks=14, timeout=150,
                       env={"CHECKPOINT": str(checkpoint)})


def test_stage2_at_three_ranks_then_two_resuming_its_checkpoint(tmp_path):
    # One job per rank count: 3 ranks train (unequal pieces) and save a consolidated
    # checkpoint; 2 ranks train, then resume from it.
    checkpoint = tmp_path / "adam.pt"
    three = assert_checks_pass(3, STAGE2 + "report(pieces=pieces)\n", min_checks=150,
                               timeout=150, env={"SAVE": str(checkpoint)})
    two = assert_checks_pass(2, STAGE2 + RESUME2 + "report(pieces=pieces)\n", min_checks=170,
                             timeout=150, env={"LOAD": str(checkpoint)})
    # 6 parameters of 91, 13, 65, 5, 5 and 1 elements in one bucket of 180, cut in
    # contiguous pieces of 180 // size (+1): some parameter lies on two ranks.
    for outcomes in (three, two):
        for kind in ("sgd", "adam", "adagrad", "lars"):
            held = [o["pieces"][kind] for o in outcomes]
            totals = [sum(h) for h in held]
            assert max(totals) - min(totals) <= 1 and sum(totals) == 180, held
            assert any(sum(1 for h in held if h[i]) >= 2 for i in range(6)), held
