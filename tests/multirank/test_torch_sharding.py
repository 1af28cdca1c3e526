"""DistributedOptimizer(shard=1) on real 2- and 3-rank jobs: training equals the unsharded
optimizer's (SGD with momentum, Adam, LAMB, LARS), each rank holds the state of its own
parameters only, a consolidated checkpoint equals the unsharded state and loads into
another rank count, and broadcast_optimizer_state sends the root's whole state.

Each rank records failed checks (PRELUDE's ``check``) and reports them in one
``HVDLITE_RESULT`` line; the expected values come from the same model trained with the
unsharded DistributedOptimizer in the same job.
"""
import os

import pytest

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

PRELUDE = r'''
import copy, json, os, sys
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


def train(net, opt, steps, first=0):
    for step in range(first, first + steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def report(**extra):
    hvd.barrier()
    print("HVDLITE_RESULT", json.dumps({"failures": failures, "checks": checks[0], **extra}),
          flush=True)
'''

TRAINING = PRELUDE + r'''
owned_counts = {}
for kind, make in OPTIMIZERS.items():
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
        check(f"{kind}: consolidated keys", sorted(full["state"]) == sorted(want["state"]),
              f"{sorted(full['state'])} vs {sorted(want['state'])}")
        for index, entries in want["state"].items():
            for key, value in entries.items():
                got = full["state"][index][key]
                if isinstance(value, torch.Tensor):
                    close(f"{kind}: state {index}.{key}", got.double(), value.double())
                else:
                    check(f"{kind}: state {index}.{key}", got == value, f"{got} vs {value}")
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


def _run(np_, script, env, least):
    result = run_job(np_, script, env=env, timeout=150)
    assert_ok(result)
    outcomes = [result.result(r) for r in range(np_)]
    problems = [f"rank {r}: {f}" for r, o in enumerate(outcomes) for f in o["failures"]]
    assert not problems, "\n".join(problems) + "\n" + describe(result)
    assert all(o["checks"] >= least for o in outcomes), outcomes
    return outcomes


@pytest.mark.parametrize("np_", [2, 3])
def test_sharded_training_equals_unsharded_and_state_is_split(np_, tmp_path):
    outcomes = _run(np_, TRAINING, {"CHECKPOINT": str(tmp_path / "adam.pt")}, least=30)
    # 6 parameters of 91, 13, 65, 5, 5 and 1 elements (180): dealt out largest first to
    # the rank holding the fewest elements, no rank holds more than its share plus the
    # largest parameter.
    for kind in ("adam", "lamb"):
        counts = [o["owned"][kind][0] for o in outcomes]
        elements = [o["owned"][kind][1] for o in outcomes]
        assert sum(counts) == 6 and sum(elements) == 180, outcomes
        assert max(elements) <= 180 / np_ + 91 and min(elements) > 0, elements
    assert os.path.exists(tmp_path / "adam.pt")


def test_a_checkpoint_from_two_ranks_resumes_on_three(tmp_path):
    env = {"CHECKPOINT": str(tmp_path / "adam.pt")}
    _run(2, TRAINING, env, least=30)
    _run(3, RESUME, env, least=14)
