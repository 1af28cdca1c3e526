"""Single-process simulation of N data-parallel workers on the digits example (no MPI).

Replays examples/pytorch_digits.py's model, data shards (DistributedSampler), seeds, lr
and epochs, with the gradient exchange done in numpy per worker: none (the mean), top-k
with error feedback as hvdlite.reducers.TopK does it ("ef": the residual of the
accumulated gradient, the optimizer's momentum applied after the exchange), and top-k
with DGC's local momentum correction and momentum factor masking ("dgc"), optionally
with the ratio warmed up over the first epochs. Prints the final test accuracy per
variant and seed, to find why top-k loses accuracy without the launcher's noise.

    python scripts/topk_digits_simulation.py --variants none,ef:0.01,dgc:0.01 --seeds 1-24

A variant is KIND:RATIO[:WARMUP_STEPS[:FLAGS]], KIND none, ef or dgc, FLAGS containing
"mask" (momentum factor masking) and/or "opt" (the optimizer keeps its momentum and gets
S_t - m S_(t-1), as hvdlite does; the same trajectory as DGC's momentum-free optimizer).
--clip C clips each rank's gradient to C / sqrt(size) (DGC's local clipping).
"""
import argparse
import math
import os
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from pytorch_digits import datasets  # noqa: E402 - the example's data, split by seed


def topk_mask(acc, ratio, dense_below):
    n = acc.size
    k = n if n < dense_below else max(1, math.ceil(ratio * n))
    if k >= n:
        return np.ones(n, bool)
    mask = np.zeros(n, bool)
    mask[np.argpartition(np.abs(acc), n - k)[n - k:]] = True
    return mask


class Worker:
    """One rank's exchange state: residual (v) and, for DGC, local momentum (u)."""

    def __init__(self):
        self.v, self.u = {}, {}

    def send(self, kind, name, g, ratio, momentum, dense_below, masking):
        if kind == "ef":
            acc = g + self.v.get(name, 0.0)
        else:  # dgc: momentum correction
            u = momentum * self.u.get(name, 0.0) + g
            acc = u + self.v.get(name, 0.0)
        mask = topk_mask(acc, ratio, dense_below)
        sent = np.where(mask, acc, 0.0).astype(np.float32)
        self.v[name] = np.where(mask, 0.0, acc).astype(np.float32)
        if kind == "dgc":
            self.u[name] = np.where(mask, 0.0, u) if masking else u
        return sent


def warm_ratio(ratio, step, warmup_steps):
    """DGC's warm-up of the sparsity, per step: the ratio falls geometrically from 25% to
    its target over the first ``warmup_steps`` steps (DGC: by 4x per epoch)."""
    if step >= warmup_steps or ratio >= 0.25:
        return ratio
    return 0.25 * (ratio / 0.25) ** (step / warmup_steps)


def run(seed, variant, size, epochs, lr, batch, dense_below, clip):
    kind, _, arg = variant.partition(":")
    opts = arg.split(":")
    ratio = float(opts[0]) if opts[0] else 1.0
    warmup = int(opts[1]) if len(opts) > 1 else 0
    flags = opts[2] if len(opts) > 2 else ""
    masking = "mask" in flags
    # "opt": the optimizer keeps its momentum and the exchange hands it S_t - m S_{t-1}
    # (its momentum buffer then equals the corrected velocity S_t).
    via_optimizer = "opt" in flags
    torch.manual_seed(seed)
    train_set, test_set = datasets(seed)
    samplers = [DistributedSampler(train_set, num_replicas=size, rank=r, shuffle=True,
                                   seed=seed) for r in range(size)]
    loaders = [DataLoader(train_set, batch_size=batch, sampler=s) for s in samplers]
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    momentum = 0.9
    # DGC does momentum itself (locally, before selection): the optimizer steps plain SGD.
    opt = torch.optim.SGD(model.parameters(), lr=lr * size,
                          momentum=0.0 if kind == "dgc" and not via_optimizer else momentum)
    last = {}
    step = 0
    names = [n for n, _ in model.named_parameters()]
    workers = [Worker() for _ in range(size)]
    for epoch in range(1, epochs + 1):
        for s in samplers:
            s.set_epoch(epoch)
        for batches in zip(*loaders):
            r_now = warm_ratio(ratio, step, warmup) if warmup else ratio
            step += 1
            grads = []
            for x, y in batches:
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
                gs = {n: p.grad.detach().numpy().reshape(-1).copy()
                      for n, p in model.named_parameters()}
                if clip and kind != "none":  # DGC's local clipping: the global norm's share of this rank
                    norm = math.sqrt(sum(float(g @ g) for g in gs.values()))
                    limit = clip / math.sqrt(size)
                    if norm > limit:
                        gs = {n: g * (limit / norm) for n, g in gs.items()}
                grads.append(gs)
            for n, p in model.named_parameters():
                if kind == "none":
                    total = sum(g[n] for g in grads)
                else:
                    total = sum(w.send(kind, n, g[n], r_now, momentum, dense_below, masking)
                                for w, g in zip(workers, grads))
                total = total / size
                if via_optimizer:
                    total, last[n] = total - momentum * last.get(n, 0.0), total
                p.grad = torch.from_numpy((total).reshape(p.shape).astype(np.float32))
            opt.step()
    x_test, y_test = test_set.tensors
    with torch.no_grad():
        return float((model(x_test).argmax(1) == y_test).float().mean())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="none,ef:0.01")
    parser.add_argument("--seeds", default="42", help="a seed or a range, e.g. 1-24")
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dense-below", type=int, default=1024)
    parser.add_argument("--clip", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    first, _, last = args.seeds.partition("-")
    seeds = range(int(first), int(last or first) + 1)
    reference = None
    for variant in args.variants.split(","):
        accs = [run(s, variant, args.size, args.epochs, args.lr, args.batch,
                    args.dense_below, args.clip) * 100 for s in seeds]
        reference = reference or accs  # the first variant: per-seed differences to it
        diff = statistics.median(a - b for a, b in zip(accs, reference))
        print(f"{variant:24s} median {statistics.median(accs):6.2f}  range "
              f"{min(accs):6.2f}-{max(accs):6.2f}  {diff:+6.2f} points against the first",
              flush=True)


if __name__ == "__main__":
    main()
