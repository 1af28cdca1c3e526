"""Rank script of test_compression.py: the reducers on real ranks.

Each rank makes its gradients from a seed of (step, rank), so the test can make them too
and compute the expected values independently. Prints one HVDLITE_RESULT with, per
reducer, the updates it applied and the residuals it kept (as lists), and the core's
wire bytes per step (one HVDLITE_RESULT line per reducer, then one with the rest).
"""
import json
import sys

import numpy as np
import torch

import hvdlite.torch as hvd
from hvdlite import reducers

STEPS = 4
SHAPES = {"w": (16, 12), "b": (12,)}


def gradient(name, step, rank):
    rng = np.random.default_rng([step, rank, len(name), *SHAPES[name]])
    return rng.standard_normal(SHAPES[name]).astype(np.float32)


def run_reducer(make):
    reducer = make()
    applied = {name: [] for name in SHAPES}
    wire = []
    for step in range(STEPS):
        before = hvd.stats()["wire_bytes"]
        names = sorted(SHAPES)
        token = reducer.start(names, [gradient(n, step, hvd.rank()) for n in names])
        (updates,) = reducer.finish_all([token])
        wire.append(hvd.stats()["wire_bytes"] - before)
        for name, update in zip(names, updates):
            applied[name].append(update.tolist())
    residuals, velocities = {}, {}
    for name in SHAPES:
        r = reducer.residual(name)
        residuals[name] = None if r is None else np.asarray(r).reshape(-1).tolist()
        v = getattr(reducer, "velocity", lambda _: None)(name)
        velocities[name] = None if v is None else np.asarray(v).reshape(-1).tolist()
    return {"applied": applied, "residuals": residuals, "velocities": velocities,
            "wire": wire}


def regression():
    """The training runs' model (seeded) and data: the test builds them too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 20, generator=gen)
    y = x @ torch.randn(20, 1, generator=gen)
    return model, x, y


def batch(x, y, step, rank, size):
    lo = (step * size + rank) * 16 % 512
    return x[lo:lo + 16], y[lo:lo + 16]


def train(compression, momentum=0.0, steps=60):
    """A small regression model, the same data split over ranks; returns the losses, a
    digest of the parameters (equal on every rank when every rank applies the same
    update) and the parameters."""
    model, x, y = regression()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                   momentum=momentum),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    losses = []
    for step in range(steps):
        xb, yb = batch(x, y, step, hvd.rank(), hvd.size())
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        with torch.no_grad():
            losses.append(float(torch.nn.functional.mse_loss(model(x), y)))
    digest = float(sum(p.double().sum() * (i + 1) for i, p in enumerate(model.parameters())))
    run = {"first": losses[0], "last": losses[-1], "digest": digest}
    if momentum:
        run.update(params=[p.detach().reshape(-1).tolist() for p in model.parameters()],
                   momentum=compression.momentum)
    return run


def main():
    torch.set_num_threads(1)
    hvd.init()
    # One result line per part: the launcher forwards lines longer than 64 KiB in pieces.
    for label, make in (("topk", lambda: reducers.TopK(0.1, dense_below=0)),
                        ("quantize8", lambda: reducers.Quantize(8, chunk=64, seed=5)),
                        ("quantize4", lambda: reducers.Quantize(4, chunk=64, seed=5)),
                        ("powersgd", lambda: reducers.PowerSGD(rank=2)),
                        # DGC's momentum correction, factor masking and warm-up.
                        ("topk_mc", lambda: reducers.TopK(0.1, dense_below=0, momentum=0.9)),
                        ("topk_mask", lambda: reducers.TopK(0.1, dense_below=0, momentum=0.9,
                                                            momentum_masking=True)),
                        ("topk_warm", lambda: reducers.TopK(0.05, dense_below=0,
                                                            warmup_steps=3))):
        print("HVDLITE_RESULT", json.dumps({label: run_reducer(make)}), flush=True)
    before = hvd.stats()["wire_bytes"]
    hvd.allreduce(torch.zeros(SHAPES["w"]), name="dense.w")
    hvd.allreduce(torch.zeros(SHAPES["b"]), name="dense.b")
    dense_wire = hvd.stats()["wire_bytes"] - before
    train_runs = {label: train(c) for label, c in (
        ("none", hvd.Compression.none), ("topk", hvd.Compression.topk(0.25)),
        ("quantize8", hvd.Compression.quantize(8)),
        ("powersgd", hvd.Compression.powersgd(2)))}
    # Momentum correction taken from the optimizer (SGD momentum 0.9).
    momentum_run = train(hvd.Compression.topk(0.25, dense_below=0), momentum=0.9, steps=20)
    print("HVDLITE_RESULT", json.dumps({"dense_wire": dense_wire, "train": train_runs}),
          flush=True)
    print("HVDLITE_RESULT", json.dumps({"topk_sgd_momentum": momentum_run}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
