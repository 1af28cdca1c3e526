"""What a process set's ops cost while a rank outside the set does something else.

    python -m hvdlite.runner -np 3 python benchmarks/process_sets.py [--ops 300]

Times a loop of small allreduces (256 float32, synchronous, one at a time) on ranks 1
and 2, three ways:

* global: the same loop on every rank, in the global set (the reference);
* set, rank 0 waits: in the set {1, 2} while rank 0 blocks in a global barrier;
* set, rank 0 idle: in the set {1, 2} while rank 0 sleeps in Python (no op in flight,
  so its background loop would cycle at the idle time if nobody told it otherwise).

The three ways run in an order rotated by one every repetition (benchmarks/rounds.py),
so that drift in the machine's load hits them alike. Prints the commit, then one JSON
line per way and rank that ran it (ranks 1 and 2; rank 0 for global too): every
repetition's per-op time, their median and range (microseconds).
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

import hvdlite as hvd
from rounds import commit, rotated


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

    def global_way(rep):
        results["global"].append(loop(args.ops, hvd.global_process_set))

    def waits_way(rep):  # rank 0 blocks in the barrier that follows
        if pair.included():
            results["set, rank 0 waits"].append(loop(args.ops, pair))

    def idle_way(rep):
        done = os.path.join(signal, f"done.{rep}")
        if pair.included():
            results["set, rank 0 idle"].append(loop(args.ops, pair))
            if rank == 1:
                open(done, "w").close()
        else:
            while not os.path.exists(done):
                time.sleep(0.005)

    ways = [global_way, waits_way, idle_way]
    for rep in range(args.reps):
        for way in rotated(ways, rep):
            hvd.barrier()
            way(rep)
        hvd.barrier()
    everyone = hvd.allgather_object(results)
    if rank == 0:
        print(json.dumps({"commit": commit(), "order": "rotated by one every repetition"}))
        for way in results:
            for r, theirs in enumerate(everyone):
                times = theirs[way]
                if times:
                    print(json.dumps({"way": way, "rank": r,
                                      "us_per_op_median": round(float(np.median(times)), 1),
                                      "min": round(min(times), 1), "max": round(max(times), 1),
                                      "per_rep": [round(t, 1) for t in times],
                                      "ops": args.ops, "reps": args.reps}))


if __name__ == "__main__":
    main()
