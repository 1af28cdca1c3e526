"""How long the other ranks wait when rank 1 refuses an op they submitted.

    .venv/bin/python -m hvdlite.runner -np 2 .venv/bin/python benchmarks/refusal_latency.py

For each repetition every rank but 1 submits an allreduce of a float32 tensor, and rank 1
makes the same call with a complex64 tensor, which it refuses at the call; the others
time their call from submission to the AbortedError that names rank 1. Uncached
(a new name each time) and cached (a name whose previous steps went through the
response cache) are measured separately; medians and ranges are printed by rank 0.
The stall shutdown time is left at its default (off), so without the refusal the others
would wait forever.
"""
import statistics
import time

import numpy as np

import hvdlite as hvd
from hvdlite import errors

REPS = 30


def one(name, bad):
    began = time.perf_counter()
    try:
        hvd.allreduce(np.ones(4, np.complex64 if bad else np.float32), name=name)
    except (errors.AbortedError, errors.InvalidArgumentError):
        pass
    return time.perf_counter() - began


def main():
    hvd.init()
    rank = hvd.rank()
    results = {"uncached": [], "cached": []}
    for i in range(REPS):
        hvd.barrier()
        results["uncached"].append(one(f"fresh.{i}", rank == 1))
        for _ in range(3):  # a name that goes through the response cache
            hvd.allreduce(np.ones(4, np.float32), name="cached")
        hvd.barrier()
        results["cached"].append(one("cached", rank == 1))
    if rank == 0:
        for kind, times in results.items():
            ms = sorted(t * 1e3 for t in times)
            print(f"{kind}: median {statistics.median(ms):.2f} ms, range {ms[0]:.2f}-"
                  f"{ms[-1]:.2f} ms over {len(ms)} refusals")
    hvd.shutdown()


if __name__ == "__main__":
    main()
