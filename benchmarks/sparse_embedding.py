"""Step time of an Embedding(sparse=True) trained through DistributedOptimizer: sparse
gradients gathered (sparse_as_dense=False) against the same gradients allreduced dense.

    hvdliterun -np 2 python benchmarks/sparse_embedding.py [--vocab 50000] [--dim 64]

Rank 0 prints the median and range of the step time (backward + step) over the timed
steps for both modes, interleaved run by run.
"""
import argparse
import statistics
import time

import torch

import hvdlite.torch as hvd


def step_times(sparse_as_dense, vocab, dim, ids, steps):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(vocab, dim, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.01),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    g = torch.Generator().manual_seed(hvd.rank())
    times = []
    for step in range(steps + 2):
        x = torch.randint(0, vocab, (ids,), generator=g)
        opt.zero_grad()
        loss = emb(x).pow(2).sum()
        hvd.barrier()
        start = time.perf_counter()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[2:]  # the first steps negotiate and warm the caches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=50000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    results = {"sparse (gathered)": [], "sparse_as_dense": []}
    for _ in range(args.runs):
        for label, as_dense in (("sparse (gathered)", False), ("sparse_as_dense", True)):
            results[label] += step_times(as_dense, args.vocab, args.dim, args.ids,
                                         args.steps)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, Embedding({args.vocab}, {args.dim}), {args.ids} ids per "
              f"rank, {args.runs} x {args.steps} steps")
        for label, times in results.items():
            ms = sorted(t * 1e3 for t in times)
            print(f"{label:>18}: median {statistics.median(ms):.2f} ms "
                  f"(range {ms[0]:.2f}-{ms[-1]:.2f})")


if __name__ == "__main__":
    main()
