"""Step time with the timeline on against off, on the many-small-tensors step.

    .venv/bin/python -m hvdlite.runner -np 2 .venv/bin/python benchmarks/timeline_overhead.py

One step: 200 float32 tensors of 16 KiB, all enqueued with ``allreduce_async`` and then
waited for (the gradient pattern of a model with many small layers). Whole runs
alternate between timeline on and off, in ABBA order, so that drift in the machine's
load hits both alike. A run is ``--run-seconds`` long (3 s by default: 30 periods of the
writer thread, which wakes every 100 ms), and everything in it is measured: for "on",
``start_timeline`` .. the steps .. ``stop_timeline`` (rank 0 writes the file), so the
writer's work (the JSON, the file) falls inside the figures, not between them. Two
figures per run, both per step: the wall time of the whole run (rank 0's clock: a step
ends when every rank's contribution is in) and rank 0's process CPU time (all its
threads: Python, the background loop, the writer). Every run's figures are printed, with
the median and range per mode, the overhead (median on / median off, and the median of
the ABBA pairs' ratios) and the commit.

On a small shared machine the figure is noisy: run it a few times and quote the range.
``--json PATH`` also writes the figures.

``--recorder`` instead measures the timeline alone, in one process with no MPI (through
testing.h): the CPU time per step that recording takes on the calling thread (what the
background loop pays) and what the writer thread takes, over ``--recorder-steps`` steps
of the same 200 tensors (pausing for the writer every 100), written to /dev/null and to
a file:

    .venv/bin/python benchmarks/timeline_overhead.py --recorder
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

import hvdlite as hvd
from rounds import commit, spread

TARGET_OVERHEAD = 0.05  # issues 6 and 19: under 5% of step time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--kib", type=int, default=16, help="size of one tensor (KiB)")
    p.add_argument("--runs", type=int, default=8, help="runs per mode")
    p.add_argument("--run-seconds", type=float, default=3.0,
                   help="length of one run (sets its steps; the writer's period is 0.1 s)")
    p.add_argument("--path", help="the timeline file (default: a temporary one); "
                   "/dev/null separates the cost of recording from that of the disk")
    p.add_argument("--json", help="also write the figures to this file (rank 0)")
    p.add_argument("--recorder", action="store_true",
                   help="measure the timeline alone (one process, no MPI)")
    p.add_argument("--recorder-steps", type=int, default=2000)
    return p.parse_args()


def recorder_cost(tensors, steps, path):
    """CPU time per step (recording thread, writer thread) in microseconds, through
    hvdlite_test_timeline_steps: the background loop's calls for a cached, fused
    allreduce of `tensors` tensors, `steps` times, written to path."""
    from hvdlite._native import ffi, lib
    asked, dropped = ffi.new("int64_t *"), ffi.new("int64_t *")
    thread, process = time.thread_time(), time.process_time()
    # Every 100 steps, wait for the writer (faster than any training loop, the steps
    # would otherwise overflow the ring and the writer would write less than all).
    status = lib.hvdlite_test_timeline_steps(path.encode(), tensors, steps, 1 << 21, 0, 100,
                                             asked, dropped)
    thread, process = time.thread_time() - thread, time.process_time() - process
    if status != lib.HVDLITE_OK:
        raise RuntimeError(ffi.string(lib.hvdlite_last_error()).decode())
    return thread / steps * 1e6, (process - thread) / steps * 1e6, dropped[0]


def main_recorder(args):
    tmpdir = tempfile.mkdtemp(prefix="hvdlite-timeline-bench-")
    for path in ("/dev/null", os.path.join(tmpdir, "timeline.json")):
        runs = []
        for _ in range(5):
            runs.append(recorder_cost(args.tensors, args.recorder_steps, path))
            if path != "/dev/null":
                os.unlink(path)  # not truncated by the next run's start: not its cost
        rec = statistics.median(r[0] for r in runs)
        wri = statistics.median(r[1] for r in runs)
        print(f"{args.tensors} tensors, {args.recorder_steps} steps to {path}: CPU per step "
              f"(median of 5) recording {rec:.1f} us, writer {wri:.1f} us; "
              f"{sum(r[2] for r in runs)} dropped")


def main():
    args = parse_args()
    if args.recorder:
        main_recorder(args)
        return
    hvd.init()
    rank = hvd.rank()
    n = args.kib * 1024 // 4
    tensors = [np.full(n, rank, np.float32) for _ in range(args.tensors)]
    names = [f"layer{i}.grad" for i in range(args.tensors)]

    def step():
        start = time.perf_counter()
        handles = [hvd.allreduce_async(t, name=name, op=hvd.Sum)
                   for t, name in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)
        return time.perf_counter() - start

    tmpdir = tempfile.mkdtemp(prefix="hvdlite-timeline-bench-")
    path = args.path or os.path.join(tmpdir, "timeline.json")
    warm = [step() for _ in range(10)]  # the response cache, the fusion buffer
    # The same number of steps on every rank: rank 0's estimate.
    steps = hvd.broadcast_object(max(10, int(args.run_seconds / statistics.median(warm))))
    wall = {"off": [], "on": []}  # per run: seconds per step, the whole run
    cpu = {"off": [], "on": []}   # per run: rank 0's CPU seconds per step, all threads
    for run in range(2 * args.runs):
        mode = "on" if run % 4 in (1, 2) else "off"  # off on on off off on on off ...
        hvd.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        if mode == "on":
            hvd.start_timeline(path)
        for _ in range(steps):
            step()
        if mode == "on":
            hvd.stop_timeline()  # the writer's last flush: part of the run
        wall[mode].append((time.perf_counter() - start) / steps)
        cpu[mode].append((time.process_time() - start_cpu) / steps)

    if rank == 0:
        events = []
        if os.path.isfile(path):
            with open(path) as f:
                events = json.load(f)  # the last "on" run's file
        dropped = sum(e.get("args", {}).get("count", 0) for e in events
                      if e.get("name") == "EVENTS_DROPPED")
        off, on = statistics.median(wall["off"]), statistics.median(wall["on"])
        overhead = on / off - 1
        pairs = [b / a - 1 for a, b in zip(wall["off"], wall["on"])]
        cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
        figures = {
            "commit": commit(), "ranks": hvd.size(), "tensors": args.tensors,
            "tensor_kib": args.kib, "runs_per_mode": args.runs, "steps_per_run": steps,
            "step_ms_per_run": {m: [t * 1e3 for t in v] for m, v in wall.items()},
            "cpu_ms_per_step_per_run": {m: [t * 1e3 for t in v] for m, v in cpu.items()},
            "median_step_off_ms": off * 1e3, "median_step_on_ms": on * 1e3,
            "overhead": overhead, "overhead_median_of_pairs": statistics.median(pairs),
            "cpu_per_step_off_ms": cpu_off * 1e3, "cpu_per_step_on_ms": cpu_on * 1e3,
            "events_per_step": len(events) / steps, "dropped_events": dropped,
        }
        print(f"commit {figures['commit']}; {hvd.size()} ranks, {args.tensors} x {args.kib} "
              f"KiB float32 per step; {args.runs} runs per mode in ABBA order, {steps} steps "
              f"per run ({steps * off:.1f} s off: {steps * off / 0.1:.0f} writer periods)")
        for mode in ("off", "on"):
            print(f"timeline {mode:3s} wall ms per step (whole run): "
                  + spread([t * 1e3 for t in wall[mode]]))
            print(f"timeline {mode:3s} rank 0 CPU ms per step (all threads): "
                  + spread([t * 1e3 for t in cpu[mode]]))
        print(f"wall overhead: {100 * overhead:+.1f}% (median of ABBA pairs: "
              f"{100 * statistics.median(pairs):+.1f}%, range {100 * min(pairs):+.1f}% to "
              f"{100 * max(pairs):+.1f}%); target < {100 * TARGET_OVERHEAD:.0f}%: "
              f"{'met' if overhead < TARGET_OVERHEAD else 'NOT met'}")
        print(f"rank 0 CPU per step: off {cpu_off * 1e3:.3f} ms, on {cpu_on * 1e3:.3f} ms "
              f"({(cpu_on - cpu_off) * 1e6:+.0f} us, {100 * (cpu_on / cpu_off - 1):+.1f}%)")
        print(f"~{len(events) / steps:.0f} events per step written, {dropped} dropped")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
