"""hvdlite allreduce against plain mpi4py on the same MPI, in one interleaved run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py
    .venv/bin/python -m hvdlite.runner -np 2 .venv/bin/python benchmarks/allreduce.py

Measures, with the two systems alternating repetition by repetition (so drift in the
machine's load hits both alike) and medians quoted:

1. for float32 buffers of 4 KiB .. 64 MiB: the latency of a synchronous
   ``hvdlite.allreduce(op=Sum, out=...)`` and of ``comm.Allreduce``, both into preallocated
   results, their
   bus bandwidth 2(n-1)/n * bytes / time, and the ratio hvdlite / mpi4py;
2. the "many small tensors" step: 200 float32 tensors of 16 KiB, hvdlite
   async-all-then-wait against three MPI peers, all writing into preallocated results,
   as in 1: 200 sequential ``comm.Allreduce`` calls (what a naive loop costs: this ratio
   measures fusion more than the core), one ``comm.Allreduce`` of the 200 tensors packed
   into one buffer (batched: the copies in and out are timed, as hvdlite's fusion
   buffer's are), and 200 ``comm.Iallreduce`` + ``MPI.Request.Waitall`` (overlapped);
   the ratio against each; and the same step as 200 blocking ``hvdlite.allreduce`` calls
   ("each" mode) against the sequential mpi4py one (target <= 2x). For the record also: hvdlite's step with a new
   result array per call (the default without ``out=``; it pays for the allocator's
   fresh pages, hundreds of page faults per step on some ranks here, as the heap is
   trimmed and regrown every step), and the same step submitted from C through a test
   entry point of the core, which shows the core's cost without Python's per call;
3. CPU use (time.process_time: every thread of the process): a rank waiting 2 s inside a
   synchronous allreduce for a peer that sleeps 2 s before submitting, and an idle
   initialized process over 2 s.

A repetition's time is the slowest rank's. Rank 0 prints the table and the issue's
targets; ``--json PATH`` also writes the figures.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI  # initializes MPI (THREAD_MULTIPLE); hvdlite.init() reuses it

import hvdlite as hvd
from hvdlite._native import check, ffi, lib
from rounds import commit, spread

KIB, MIB = 1024, 1024 * 1024
TARGET_BUSBW_RATIO = 0.9       # hvdlite >= 0.9x mpi4py bus bandwidth from 1 MiB up
TARGET_SMALL_SPEEDUP = 1.5     # 200-tensor step >= 1.5x faster than sequential mpi4py
TARGET_SYNC_4K_US = 300.0      # synchronous 4 KiB allreduce under 300 us
TARGET_EACH_RATIO = 2.0       # the step as 200 blocking calls <= 2x mpi4py's sequential ones
TARGET_WAIT_CPU = 0.10         # waiting rank under 10% of a core
TARGET_IDLE_CPU = 0.05         # idle initialized process under 5% of a core


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-size", type=int, default=4 * KIB, help="smallest buffer (bytes)")
    p.add_argument("--max-size", type=int, default=64 * MIB, help="largest buffer (bytes)")
    p.add_argument("--reps", type=int, default=11, help="repetitions per system and size")
    p.add_argument("--rep-seconds", type=float, default=0.03,
                   help="target length of one repetition (sets the inner iterations)")
    p.add_argument("--small-count", type=int, default=200)
    p.add_argument("--small-bytes", type=int, default=16 * KIB)
    p.add_argument("--wait-seconds", type=float, default=2.0)
    p.add_argument("--skip-cpu", action="store_true", help="skip the CPU-use measurements")
    p.add_argument("--json", help="also write the figures to this file (rank 0)")
    return p.parse_args()


class Bench:
    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def slowest(self, seconds):
        return self.comm.allreduce(seconds, op=MPI.MAX)

    def timed(self, fn, iters):
        """Seconds per call of fn(), the slowest rank's, over iters calls."""
        self.comm.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return self.slowest((time.perf_counter() - start) / iters)

    def iterations(self, fns, rep_seconds):
        """Inner iterations so that one repetition of the slower fn takes ~rep_seconds."""
        per_call = max(self.timed(fn, 2) for fn in fns)  # also warms both paths up
        return max(1, min(2000, int(rep_seconds / max(per_call, 1e-7))))

    def interleaved(self, fns, reps, iters):
        """Runs each fn iters times per repetition, in ABBA order (reversed every other
        repetition); returns medians. Every repetition's times stay in self.samples."""
        samples = [[] for _ in fns]
        for rep in range(reps):
            order = range(len(fns)) if rep % 2 == 0 else reversed(range(len(fns)))
            for k in order:
                samples[k].append(self.timed(fns[k], iters))
        self.samples = samples
        return [statistics.median(s) for s in samples]


def sizes(lo, hi):
    s = lo
    while s <= hi:
        yield s
        s *= 4


def bench_sizes(b, args):
    rows = []
    factor = 2 * (b.size - 1) / b.size
    for nbytes in sizes(args.min_size, args.max_size):
        x = np.full(nbytes // 4, b.rank + 1, dtype=np.float32)
        out = np.empty_like(x)
        hvd_out = np.empty_like(x)
        name = f"bench.{nbytes}"

        # Both sides write into a preallocated result, so neither pays for first
        # touching fresh pages (about 0.3 ms per 4 MiB here).
        def run_hvd():
            hvd.allreduce(x, name=name, op=hvd.Sum, out=hvd_out)

        def run_mpi():
            b.comm.Allreduce(x, out, op=MPI.SUM)

        expect = b.size * (b.size + 1) / 2
        got = hvd.allreduce(x, name=name, op=hvd.Sum)
        assert got[0] == expect and got[-1] == expect, (got[:4], expect)
        iters = b.iterations([run_hvd, run_mpi], args.rep_seconds)
        t_hvd, t_mpi = b.interleaved([run_hvd, run_mpi], args.reps, iters)
        rows.append({"bytes": nbytes, "iters": iters, "hvd_s": t_hvd, "mpi_s": t_mpi,
                     "hvd_busbw": factor * nbytes / t_hvd, "mpi_busbw": factor * nbytes / t_mpi})
        del x, out, hvd_out
    return rows


def bench_small(b, args):
    count, elems = args.small_count, args.small_bytes // 4
    tensors = [np.full(elems, b.rank + i, dtype=np.float32) for i in range(count)]
    outs = [np.empty_like(t) for t in tensors]
    hvd_outs = [np.empty_like(t) for t in tensors]
    names = [f"small.{i}" for i in range(count)]

    def run_hvd():
        handles = [hvd.allreduce_async(t, name=n, op=hvd.Sum, out=o)
                   for t, n, o in zip(tensors, names, hvd_outs)]
        for h in handles:
            hvd.synchronize(h)

    each_outs = [np.empty_like(t) for t in tensors]

    def run_hvd_each():
        # "each" mode: one blocking call per tensor, as a loop of hvd.allreduce would;
        # its peer is mpi4py's sequential step (run_mpi).
        for t, n, o in zip(tensors, names, each_outs):
            hvd.allreduce(t, name=n, op=hvd.Sum, out=o)

    def run_hvd_new_arrays():
        handles = [hvd.allreduce_async(t, name=n, op=hvd.Sum) for t, n in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    def run_mpi():
        for t, o in zip(tensors, outs):
            b.comm.Allreduce(t, o, op=MPI.SUM)

    packed, packed_out = np.empty(count * elems, np.float32), np.empty(count * elems, np.float32)
    batched_outs = [np.empty_like(t) for t in tensors]

    def run_mpi_batched():
        np.concatenate(tensors, out=packed)
        b.comm.Allreduce(packed, packed_out, op=MPI.SUM)
        for i, o in enumerate(batched_outs):
            o[:] = packed_out[i * elems:(i + 1) * elems]

    overlapped_outs = [np.empty_like(t) for t in tensors]

    def run_mpi_overlapped():
        MPI.Request.Waitall([b.comm.Iallreduce(t, o, op=MPI.SUM)
                             for t, o in zip(tensors, overlapped_outs)])

    # The same step driven from C (a test entry point of the core): what the core
    # costs without Python's per-call cost, for the record; the target is on run_hvd.
    ins = ffi.new("void *[]", [ffi.from_buffer(t) for t in tensors])
    core_outs = [np.empty_like(t) for t in tensors]
    outs_c = ffi.new("void *[]", [ffi.from_buffer(o) for o in core_outs])

    def run_core():
        check(lib.hvdlite_test_allreduce_step(count, ins, outs_c, elems, b"core"))

    handles = [hvd.allreduce_async(t, name=n, op=hvd.Sum) for t, n in zip(tensors, names)]
    results = [hvd.synchronize(h) for h in handles]
    run_hvd()
    run_hvd_each()
    run_core()
    run_mpi_batched()
    run_mpi_overlapped()
    base = b.size * (b.size - 1) / 2
    for peer in (batched_outs, overlapped_outs, each_outs):
        assert all(np.all(o == base + b.size * i) for i, o in enumerate(peer))
    assert all(r[0] == base + b.size * i for i, r in enumerate(results))
    assert all(o[0] == base + b.size * i for i, o in enumerate(hvd_outs))
    assert all(o[0] == base + b.size * i for i, o in enumerate(core_outs))
    del results
    fns = [run_hvd, run_hvd_new_arrays, run_hvd_each, run_mpi, run_mpi_batched, run_mpi_overlapped,
           run_core]
    t_hvd, t_new, t_each, t_mpi, t_batched, t_overlapped, t_core = b.interleaved(
        fns, args.reps, b.iterations(fns, args.rep_seconds))
    per_rep = dict(zip(("hvd", "hvd_new_arrays", "hvd_each", "mpi", "mpi_batched", "mpi_overlapped",
                        "core"), b.samples))
    # Collectives per step of the Python step alone: a few more steps, not timed.
    before = hvd.stats()
    for _ in range(args.reps):
        run_hvd()
    collectives = hvd.stats()["collectives"] - before["collectives"]
    return {"count": count, "bytes": args.small_bytes, "hvd_s": t_hvd, "mpi_s": t_mpi,
            "mpi_batched_s": t_batched, "mpi_overlapped_s": t_overlapped,
            "per_rep_s": per_rep,
            "hvd_new_arrays_s": t_new, "hvd_each_s": t_each, "core_s": t_core,
            "hvd_collectives_per_step": collectives / args.reps}


def cpu_of(fn):
    """(wall seconds, CPU seconds of the whole process) spent in fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_cpu(b, args):
    wait_s = args.wait_seconds
    x = np.ones(1024, dtype=np.float32)
    # Uncached and cached tensor: the rank waits in negotiation (coordinator) or on its
    # cache bit. Rank 0 waits; the others sleep, then submit.
    result = {}
    for label, name in (("wait_uncached", "cpu.wait.fresh"), ("wait_cached", "cpu.wait.cached")):
        if label == "wait_cached":
            hvd.allreduce(x, name=name, op=hvd.Sum)
        b.comm.Barrier()
        if b.rank == 0:
            wall, cpu = cpu_of(lambda: hvd.allreduce(x, name=name, op=hvd.Sum))
        else:
            time.sleep(wait_s)
            hvd.allreduce(x, name=name, op=hvd.Sum)
            wall = cpu = 0.0
        result[label] = {"wall_s": wall, "cpu_s": cpu}
    # Idle: every rank initialized, nothing submitted.
    b.comm.Barrier()
    wall, cpu = cpu_of(lambda: time.sleep(wait_s))
    idle = b.comm.gather((wall, cpu), root=0)
    b.comm.Barrier()
    if b.rank == 0:
        result["idle"] = [{"wall_s": w, "cpu_s": c} for w, c in idle]
    return result


def fmt_bytes(n):
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def fmt_time(s):
    return f"{s * 1e6:9.1f} us" if s < 1e-2 else f"{s * 1e3:9.2f} ms"


def report(out, args, comm_size):
    ok = lambda passed: "PASS" if passed else "MISS"  # noqa: E731
    lines = [f"hvdlite {hvd.__version__} vs mpi4py {__import__('mpi4py').__version__} "
             f"on {out['mpi'].splitlines()[0]}; {comm_size} ranks; medians of "
             f"{args.reps} interleaved repetitions; time = slowest rank; commit {out['commit']}", ""]
    lines.append(f"{'size':>8} | {'hvdlite':>12} {'busbw':>10} | {'mpi4py':>12} {'busbw':>10} "
                 f"| {'busbw ratio':>11} | target")
    lines.append("-" * 88)
    for r in out["sizes"]:
        ratio = r["hvd_busbw"] / r["mpi_busbw"]
        target = ""
        if r["bytes"] >= MIB:
            target = f">= {TARGET_BUSBW_RATIO}x {ok(ratio >= TARGET_BUSBW_RATIO)}"
        elif r["bytes"] == 4 * KIB:
            target = f"< {TARGET_SYNC_4K_US:.0f} us {ok(r['hvd_s'] * 1e6 < TARGET_SYNC_4K_US)}"
        lines.append(f"{fmt_bytes(r['bytes']):>8} | {fmt_time(r['hvd_s']):>12} "
                     f"{r['hvd_busbw'] / 1e9:7.3f} GB/s | {fmt_time(r['mpi_s']):>12} "
                     f"{r['mpi_busbw'] / 1e9:7.3f} GB/s | {ratio:10.2f}x | {target}")
    s = out.get("small")
    if s:
        speedup = s["mpi_s"] / s["hvd_s"]
        lines += ["", f"many small tensors: {s['count']} x {fmt_bytes(s['bytes'])} float32 per step, "
                  "results into preallocated arrays",
                  f"  hvdlite async-all-then-wait {fmt_time(s['hvd_s'])}  "
                  f"({s['hvd_collectives_per_step']:.1f} collectives per step after fusion)",
                  f"  mpi4py sequential Allreduce {fmt_time(s['mpi_s'])}  "
                  f"hvdlite {speedup:.2f}x faster   target >= {TARGET_SMALL_SPEEDUP}x "
                  f"{ok(speedup >= TARGET_SMALL_SPEEDUP)} (measures fusion more than the core)",
                  f"  hvdlite one blocking allreduce per tensor (each mode) {fmt_time(s['hvd_each_s'])}  "
                  f"{s['hvd_each_s'] / s['mpi_s']:.2f}x mpi4py sequential   target <= {TARGET_EACH_RATIO}x "
                  f"{ok(s['hvd_each_s'] / s['mpi_s'] <= TARGET_EACH_RATIO)}",
                  f"  mpi4py one Allreduce of the packed tensors {fmt_time(s['mpi_batched_s'])}  "
                  f"hvdlite {s['mpi_batched_s'] / s['hvd_s']:.2f}x faster",
                  f"  mpi4py Iallreduce all + Waitall {fmt_time(s['mpi_overlapped_s'])}  "
                  f"hvdlite {s['mpi_overlapped_s'] / s['hvd_s']:.2f}x faster",
                  *[f"  {name:15s} us per repetition: " + spread([t * 1e6 for t in ts], "{:.0f}")
                    for name, ts in s["per_rep_s"].items()],
                  f"  (hvdlite with a new result array per call: {fmt_time(s['hvd_new_arrays_s'])}, "
                  f"{s['mpi_s'] / s['hvd_new_arrays_s']:.2f}x mpi4py)",
                  f"  (the same step submitted from C, no Python per call: "
                  f"{fmt_time(s['core_s'])}, {s['mpi_s'] / s['core_s']:.2f}x mpi4py)"]
    c = out.get("cpu")
    if c:
        lines.append("")
        for label, text in (("wait_uncached", "waiting 2 s for a sleeping peer (new tensor)"),
                            ("wait_cached", "waiting 2 s for a sleeping peer (cached tensor)")):
            w = c[label]
            frac = w["cpu_s"] / w["wall_s"]
            lines.append(f"CPU {text}: {w['cpu_s'] * 1e3:7.1f} ms in {w['wall_s']:.2f} s = "
                         f"{frac:6.1%} of a core   target < {TARGET_WAIT_CPU:.0%} "
                         f"{ok(frac < TARGET_WAIT_CPU)}")
        for rank, w in enumerate(c["idle"]):
            frac = w["cpu_s"] / w["wall_s"]
            lines.append(f"CPU idle initialized process, rank {rank}: {w['cpu_s'] * 1e3:7.1f} ms "
                         f"in {w['wall_s']:.2f} s = {frac:6.1%} of a core   target < "
                         f"{TARGET_IDLE_CPU:.0%} {ok(frac < TARGET_IDLE_CPU)}")
    return "\n".join(lines)


def main():
    args = parse_args()
    hvd.init()
    comm = MPI.COMM_WORLD
    b = Bench(comm)
    out = {"commit": commit(), "ranks": b.size, "mpi": MPI.Get_library_version().strip(),
           "env": {k: v for k, v in __import__("os").environ.items()
                   if k.startswith("HVDLITE_")}}
    if not args.skip_cpu:
        # First, while the machine is quiet: nothing else of ours is running.
        out["cpu"] = bench_cpu(b, args)
    out["sizes"] = bench_sizes(b, args)
    out["small"] = bench_small(b, args)
    out["stats"] = hvd.stats()
    if b.rank == 0:
        print(report(out, args, b.size), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    comm.Barrier()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
