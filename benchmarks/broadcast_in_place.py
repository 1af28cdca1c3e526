"""A large broadcast with a new result on the root, and in place, against mpi4py's
``Bcast`` (which is in place): how much of a large broadcast's time is the root's copy
into its new result.

    .venv/bin/python -m hvdlite.runner -np 2 .venv/bin/python benchmarks/broadcast_in_place.py

Per size, five blocks of calls, the three kinds alternating block by block; a barrier
before every call, inside the timing (its few microseconds are in every kind's time); a
block's time per call as rank 0 sees it. Prints each kind's median
(range) over the blocks and hvdlite's ratios to mpi4py's median.
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from rounds import print_commit

BLOCKS = 5


def main():
    comm = MPI.COMM_WORLD
    hvd.init(comm=comm)
    rank = hvd.rank()
    if rank == 0:
        print_commit()
        print(f"{hvd.size()} ranks, broadcast from rank 0, us per call: median (range)")
    for nbytes in (1 << 20, 4 << 20, 16 << 20):
        x = np.arange(nbytes // 4, dtype=np.float32) + rank
        y = x.copy()
        out = np.empty_like(x)
        calls = 100 if nbytes <= (1 << 20) else 20
        kinds = [("hvdlite, new result", lambda: hvd.broadcast(x, 0, name=f"bip.new.{nbytes}")),
                 ("hvdlite, in place", lambda: hvd.broadcast(y, 0, name=f"bip.in.{nbytes}",
                                                             out=y)),
                 ("mpi4py Bcast", lambda: comm.Bcast(out if rank else x, root=0))]
        times = {label: [] for label, _ in kinds}
        for _ in range(BLOCKS):
            for label, call in kinds:
                call()
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    comm.Barrier()
                    call()
                times[label].append((time.perf_counter() - start) / calls * 1e6)
        if rank == 0:
            medians = {label: statistics.median(t) for label, t in times.items()}
            mpi = medians["mpi4py Bcast"]
            for label, t in times.items():
                ratio = "" if label.startswith("mpi4py") else f"  {medians[label] / mpi:.2f}x mpi4py"
                print(f"{nbytes >> 20:3d} MiB  {label:20s} {medians[label]:9.1f} "
                      f"({min(t):.1f}-{max(t):.1f}){ratio}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
