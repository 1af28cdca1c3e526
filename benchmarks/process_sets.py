"""What a process set's ops cost while a rank outside the set does something else.

    python -m hvdlite.runner -np 3 python benchmarks/process_sets.py [--ops 300]

Times a loop of small allreduces (256 float32, synchronous, one at a time) on ranks 1
and 2, three ways:

* global: the same loop on every rank, in the global set (the reference);
* set, rank 0 waits: in the set {1, 2} while rank 0 blocks in a global barrier;
* set, rank 0 idle: in the set {1, 2} while rank 0 sleeps in Python (no op in flight,
  so its background loop would cycle at the idle time if nobody told it otherwise).

Prints one JSON line per way from rank 1: the median and quartiles of the per-op time
over 5 repetitions (microseconds).
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

import hvdlite as hvd


def loop(n, process_set):
    x = np.ones(256, np.float32)
    start = time.perf_counter()
    for _ in range(n):
        hvd.allreduce(x, name="bench", op=hvd.Sum, process_set=process_set)
    return (time.perf_counter() - start) / n * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    hvd.init()
    rank = hvd.rank()
    assert hvd.size() == 3, "run with -np 3"
    pair = hvd.add_process_set([1, 2])
    signal = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvdlite-ps-") if rank == 0 else None)
    results = {"global": [], "set, rank 0 waits": [], "set, rank 0 idle": []}
    for rep in range(args.reps):
        hvd.barrier()
        results["global"].append(loop(args.ops, hvd.global_process_set))
        hvd.barrier()
        if pair.included():
            results["set, rank 0 waits"].append(loop(args.ops, pair))
        hvd.barrier()
        done = os.path.join(signal, f"done.{rep}")
        if pair.included():
            results["set, rank 0 idle"].append(loop(args.ops, pair))
            if rank == 1:
                open(done, "w").close()
        else:
            while not os.path.exists(done):
                time.sleep(0.005)
        hvd.barrier()
    if rank == 1:
        for way, times in results.items():
            q1, med, q3 = np.percentile(times, [25, 50, 75])
            print(json.dumps({"way": way, "us_per_op_median": round(med, 1),
                              "q1": round(q1, 1), "q3": round(q3, 1), "ops": args.ops,
                              "reps": args.reps}))


if __name__ == "__main__":
    main()
