"""A group of many small tensors through ``hvdlite.torch.grouped_allreduce_`` against
mpi4py on the same MPI, in one interleaved run.

    .venv/bin/python -m hvdlite.runner -np 2 .venv/bin/python benchmarks/grouped_step.py

One step: 200 float32 CPU tensors of 16 KiB (``--count``, ``--bytes``) averaged across
the ranks, in place. Systems, alternating step by step (which goes first alternates):

* hvdlite: one ``grouped_allreduce_`` (one negotiation, one fused collective); its
  enqueue (the Python call that hands the group over) is also timed on its own;
* mpi4py batched: the tensors packed into one buffer, one ``comm.Allreduce``, unpacked
  and divided by the size (the copies are timed, as hvdlite's fusion buffer's are).

A step's time is the slowest rank's; rank 0 prints medians and ranges over ``--rounds``
rounds and the ratio mpi4py / hvdlite (above 1: hvdlite is faster). The same group
repeats every step, as a training step's would.
"""
import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI  # initializes MPI; hvdlite.init() reuses it

import hvdlite.torch as hvd
from rounds import print_commit, spread


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--bytes", type=int, default=16 * 1024)
    p.add_argument("--steps", type=int, default=100, help="timed steps per system and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    hvd.init(comm=comm)
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    elems = args.bytes // 4
    ours = [torch.full((elems,), float(rank + i)) for i in range(args.count)]
    theirs = [t.clone() for t in ours]
    packed, reduced = np.empty(args.count * elems, np.float32), np.empty(args.count * elems, np.float32)
    enqueue = []

    def run_hvdlite():
        start = time.perf_counter()
        handle = hvd.grouped_allreduce_async_(ours, op=hvd.Average, name="grouped.step")
        enqueue.append(time.perf_counter() - start)
        hvd.synchronize(handle)

    def run_mpi():
        np.concatenate([t.numpy() for t in theirs], out=packed)
        comm.Allreduce(packed, reduced, op=MPI.SUM)
        np.divide(reduced, size, out=reduced)
        for i, t in enumerate(theirs):
            t.numpy()[:] = reduced[i * elems:(i + 1) * elems]

    if rank == 0:
        print_commit()
    figures = {"hvdlite": [], "mpi4py": [], "enqueue": []}
    for round_ in range(args.rounds):
        for t in ours + theirs:  # values that stay finite step after step
            t.fill_(float(rank))
        run_hvdlite()
        run_mpi()
        enqueue.clear()
        times = np.empty((args.steps, 2))
        for s in range(args.steps):
            order = (0, 1) if s % 2 == 0 else (1, 0)
            for which in order:
                comm.Barrier()
                start = time.perf_counter()
                (run_hvdlite if which == 0 else run_mpi)()
                times[s, which] = time.perf_counter() - start
        slowest = np.empty_like(times)
        comm.Allreduce(times, slowest, op=MPI.MAX)
        figures["hvdlite"].append(statistics.median(slowest[:, 0]) * 1e6)
        figures["mpi4py"].append(statistics.median(slowest[:, 1]) * 1e6)
        figures["enqueue"].append(statistics.median(enqueue) * 1e6)
        mean = float(sum(range(size))) / size
        assert all(torch.all(t == mean) for t in ours), "hvdlite's result is wrong"
        assert all(torch.all(t == mean) for t in theirs), "mpi4py's result is wrong"
    if rank == 0:
        print(f"{size} ranks, {args.count} x {args.bytes // 1024} KiB float32 per step, "
              f"{args.rounds} rounds of {args.steps} steps (slowest rank; medians in us)")
        print(f"  hvdlite grouped_allreduce_  {spread(figures['hvdlite'], '{:.0f}')}")
        print(f"    of which the enqueue      {spread(figures['enqueue'], '{:.0f}')} (rank 0)")
        print(f"  mpi4py packed Allreduce     {spread(figures['mpi4py'], '{:.0f}')}")
        ratios = [m / h for m, h in zip(figures["mpi4py"], figures["hvdlite"])]
        print(f"  mpi4py / hvdlite            {spread(ratios, '{:.2f}')}")


if __name__ == "__main__":
    main()
