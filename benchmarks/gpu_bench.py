"""hvdlite on one GPU against what the hardware does without it, each peer measured in the
same run (issue 36).

    .venv/bin/python benchmarks/gpu_bench.py [--json PATH]

Three parts, each a job through hvdliterun (the figure of a repetition is the slowest
rank's; medians over the repetitions, with a rank's repetitions alternating with its
peer's so that drift hits both):

a. 1 rank, NCCL: ``grouped_allreduce_`` of 200 float32 CUDA tensors of 16 KiB against
   one device-to-device ``copy_`` of the same 3.2 MB; the ratio is the copy's time over
   the allreduce's (its bandwidth over the copy's; target >= 0.6).
b. 2 ranks sharing the GPU (the core stages through host memory): a 64 MiB float32
   allreduce against a pinned device-to-host plus host-to-device copy of 64 MiB made by
   both ranks at once (the most a staged allreduce could do); ratio as in a.
c. An MLP's training step on the GPU: 2 ranks sharing it, DistributedOptimizer, against
   1 process of plain torch (no hvdlite); samples/s of each, over ``--rounds`` rounds
   that alternate the order.

Every part prints which path the core took (the counters ``nccl_collectives`` and
``staged_collectives`` of ``hvdlite.core.stats()``, where this core has them).
``--device cpu`` runs the same parts on CPU tensors: a rehearsal of the script on a
machine without a GPU, not a measurement of anything this issue asks.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from rounds import commit, rotated, spread

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = "GPU_BENCH_RESULT "
KIB, MIB = 1024, 1024 * 1024
TARGET_SMALL_RATIO = 0.6  # (a): allreduce bandwidth >= 0.6x a device-to-device copy's


# -- the workers: one job's ranks ----------------------------------------------------------

def _setup(args):
    import torch

    import hvdlite.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        sync = torch.cuda.synchronize
    else:
        dev, sync = torch.device("cpu"), (lambda: None)
    return torch, hvd, dev, sync


def _paths():
    """The core's path counters, where it has them (else {})."""
    from hvdlite import core

    stats = core.stats()
    stats = stats if isinstance(stats, dict) else vars(stats)
    return {k: stats[k] for k in ("nccl_collectives", "staged_collectives", "nccl_us")
            if k in stats}


def _timed(sync, fn):
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _slowest(torch, hvd, times):
    """Each repetition's time on the slowest rank."""
    local = torch.tensor(times, dtype=torch.float64)
    return hvd.allreduce(local, op=hvd.Max, name=f"bench.slowest.{len(times)}").tolist()


def _report(hvd, body):
    if hvd.rank() == 0:
        print(RESULT + json.dumps(body), flush=True)


def worker_small(args):
    torch, hvd, dev, sync = _setup(args)
    count, numel = args.small_count, args.small_bytes // 4
    tensors = [torch.rand(numel, device=dev) for _ in range(count)]
    src = torch.rand(count * numel, device=dev)
    dst = torch.empty_like(src)
    t_enqueue = []

    def allreduce():
        start = time.perf_counter()
        handle = hvd.grouped_allreduce_async_(tensors, op=hvd.Average, name="bench.small")
        t_enqueue.append(time.perf_counter() - start)
        hvd.synchronize(handle)

    def copy():
        dst.copy_(src)

    for _ in range(args.warmup):
        allreduce()
        copy()
    before = _paths()
    t_ar, t_copy, t_enqueue[:] = [], [], []
    for _ in range(args.reps):
        t_ar.append(_timed(sync, allreduce))
        t_copy.append(_timed(sync, copy))
    after = _paths()
    paths = {k: after[k] - before.get(k, 0) for k in after}
    # The core's own part (events, pack, NCCL, unpack, the stream's end), per repetition.
    core = paths.pop("nccl_us", 0) / 1e6 / args.reps if "nccl_us" in after else None
    _report(hvd, {"allreduce": _slowest(torch, hvd, t_ar), "copy": _slowest(torch, hvd, t_copy),
                  "enqueue": t_enqueue, "core": core, "paths": paths, "size": hvd.size()})


def worker_large(args):
    torch, hvd, dev, sync = _setup(args)
    numel = args.large_bytes // 4
    x = torch.rand(numel, device=dev)
    out = torch.empty_like(x)
    host = torch.empty(numel, pin_memory=(args.device == "cuda"))
    on_host = torch.rand(numel)
    before = _paths()

    def allreduce():
        hvd.barrier()
        return _timed(sync, lambda: hvd.allreduce_(x, op=hvd.Average, name="bench.large"))

    def staged_copy():  # what staging costs at least: down to pinned memory and back
        hvd.barrier()
        return _timed(sync, lambda: (host.copy_(x, non_blocking=True),
                                     out.copy_(host, non_blocking=True)))

    def host_allreduce():  # the CPU path alone, on host tensors of the same size
        hvd.barrier()
        return _timed(sync, lambda: hvd.allreduce_(on_host, op=hvd.Average, name="bench.host"))

    for _ in range(args.warmup):
        allreduce()
        staged_copy()
    t_ar, t_copy, t_host = [], [], []
    for _ in range(args.reps):
        t_ar.append(allreduce())
        t_copy.append(staged_copy())
    after = _paths()
    for _ in range(args.reps):
        t_host.append(host_allreduce())
    _report(hvd, {"allreduce": _slowest(torch, hvd, t_ar), "copy": _slowest(torch, hvd, t_copy),
                  "host": _slowest(torch, hvd, t_host),
                  "paths": {k: after[k] - before.get(k, 0) for k in after}, "size": hvd.size()})


def _mlp(torch, dev, layers):
    sizes = [int(s) for s in layers.split("-")]
    mods = []
    for a, b in zip(sizes, sizes[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1]).to(dev), sizes


def worker_train(args):
    """hvdlite ranks (DistributedOptimizer), or with --plain one process of plain torch."""
    import torch
    import torch.nn.functional as F

    if args.plain:
        torch.set_num_threads(1)
        dev = torch.device(args.device)
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        hvd = None
    else:
        torch, hvd, dev, sync = _setup(args)
    torch.manual_seed(0)
    model, sizes = _mlp(torch, dev, args.layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if hvd is not None:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        before = _paths()
    x = torch.randn(args.batch, sizes[0], device=dev)
    y = torch.randint(0, sizes[-1], (args.batch,), device=dev)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    rate = args.steps * args.batch / (time.perf_counter() - start)  # this process's
    if hvd is None:
        print(RESULT + json.dumps({"rates": [rate], "paths": {}}), flush=True)
        return
    after = _paths()
    rates = hvd.allgather(torch.tensor([rate], dtype=torch.float64), name="bench.rates")
    _report(hvd, {"rates": rates.tolist(), "paths": {k: after[k] - before.get(k, 0)
                                                     for k in after}})


# -- the driver ----------------------------------------------------------------------------

def _worker_cmd(args, part, np=None, extra=()):
    script = [sys.executable, os.path.abspath(__file__), "--worker", part, "--device",
              args.device, "--reps", str(args.reps), "--warmup", str(args.warmup),
              "--steps", str(args.steps), "--batch", str(args.batch), "--layers", args.layers,
              "--small-count", str(args.small_count), "--small-bytes", str(args.small_bytes),
              "--large-bytes", str(args.large_bytes), *extra]
    if np is None:
        return script
    return [sys.executable, "-m", "hvdlite.runner", "-np", str(np), *script]


def _run(args, cmd, env=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout,
                         stdin=subprocess.DEVNULL, cwd=os.path.dirname(HERE))
    for line in out.stdout.splitlines():
        body = line.split(RESULT, 1)
        if len(body) == 2:
            result = json.loads(body[1])
            # What the core said of its GPU path (with HVDLITE_LOG_LEVEL=INFO).
            result["said"] = [l.split("INFO: ", 1)[1] for l in out.stderr.splitlines()
                              if "INFO: " in l and ("pack" in l or "NCCL" in l)]
            return result
    sys.stderr.write(f"gpu_bench: {' '.join(cmd)} exited with {out.returncode} and no "
                     f"result\n--- stdout ---\n{out.stdout[-3000:]}\n--- stderr ---\n"
                     f"{out.stderr[-3000:]}\n")
    return None


def _ratio_part(args, title, part, np, nbytes, peer, env=None):
    print(f"\n{title}", flush=True)
    body = _run(args, _worker_cmd(args, part, np), env)
    if body is None:
        print("  FAILED (see stderr)", flush=True)
        return None
    ar, cp = statistics.median(body["allreduce"]), statistics.median(body["copy"])
    us = [t * 1e6 for t in body["allreduce"]]
    print(f"  hvdlite allreduce  {ar * 1e6:10.1f} us  {nbytes / ar / 1e9:8.2f} GB/s  "
          f"(us: {spread(us, '{:.0f}')})")
    print(f"  {peer:18s} {cp * 1e6:10.1f} us  {nbytes / cp / 1e9:8.2f} GB/s")
    print(f"  ratio (peer time / allreduce time): {cp / ar:.3f}")
    print(f"  core path counters during the part: {body['paths'] or 'not counted by this core'}")
    for line in body.get("said", []):
        print(f"  the core said: {line}")
    result = {"allreduce_s": ar, "peer_s": cp, "ratio": cp / ar, "paths": body["paths"],
              "allreduce_all_s": body["allreduce"], "peer_all_s": body["copy"]}
    if body.get("host"):
        host = statistics.median(body["host"])
        print(f"  the same allreduce_ of host tensors (the CPU path alone): {host * 1e6:.1f} us  "
              f"{nbytes / host / 1e9:8.2f} GB/s; host time / staged time {host / ar:.3f}")
        result["host_s"] = host
    if body.get("enqueue"):
        enqueue = statistics.median(body["enqueue"])
        print(f"  of the allreduce, the caller's enqueue (Python, rank 0): {enqueue * 1e6:.1f} us")
        result["enqueue_s"] = enqueue
    if body.get("core"):
        core = body["core"]
        print(f"  of the allreduce, the core's part (pack + NCCL + unpack, mean, rank 0): "
              f"{core * 1e6:.1f} us  {nbytes / core / 1e9:8.2f} GB/s; ratio to the peer "
              f"{cp / core:.3f}")
        result["core_s"], result["core_ratio"] = core, cp / core
    return result


def driver(args):
    print(f"commit {commit()}; device {args.device}", flush=True)
    if args.device == "cuda":
        import torch

        print(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}", flush=True)
    summary = {"device": args.device, "commit": commit()}
    small_bytes = args.small_count * args.small_bytes
    summary["small"] = _ratio_part(
        args, f"(a) 1 rank: grouped_allreduce_ of {args.small_count} x "
              f"{args.small_bytes // KIB} KiB float32 vs one {args.device} copy_ of "
              f"{small_bytes / MIB:.2f} MiB ({args.reps} reps)",
        "small", 1, small_bytes, "copy_ (same bytes)", env={"HVDLITE_LOG_LEVEL": "INFO"})
    if summary["small"]:
        for key, what in (("ratio", "end to end"), ("core_ratio", "the core's part")):
            if key in summary["small"]:
                verdict = "meets" if summary["small"][key] >= TARGET_SMALL_RATIO else "misses"
                print(f"  target ratio >= {TARGET_SMALL_RATIO}, {what}: {verdict}")
    if args.device == "cuda":
        # The same part with the other ways of packing: what the kernel saves.
        for key, pack in (("small_batch", "batch"), ("small_copies", "copies")):
            summary[key] = _ratio_part(
                args, f"(a, {pack}) as (a), with HVDLITE_GPU_PACK={pack}", "small", 1,
                small_bytes, "copy_ (same bytes)",
                env={"HVDLITE_GPU_PACK": pack, "HVDLITE_LOG_LEVEL": "INFO"})
    summary["large"] = _ratio_part(
        args, f"(b) 2 ranks sharing the device: allreduce_ of {args.large_bytes // MIB} MiB "
              f"float32 vs a pinned D2H+H2D copy of it on both ranks at once ({args.reps} reps)",
        "large", 2, args.large_bytes, "pinned D2H+H2D")
    if args.device == "cuda":
        # The staged allreduce in one piece (no copy overlapping a reduction: what the
        # chunk pipeline saves) and in smaller chunks than the default 4 MiB.
        for key, chunk, what in (("large_one_piece", "0", "one piece"),
                                 ("large_1mib", str(MIB), "1 MiB chunks")):
            summary[key] = _ratio_part(
                args, f"(b, {what}) as (b), with HVDLITE_GPU_STAGE_CHUNK={chunk}", "large", 2,
                args.large_bytes, "pinned D2H+H2D", env={"HVDLITE_GPU_STAGE_CHUNK": chunk})

    print(f"\n(c) MLP {args.layers}, batch {args.batch} per process, {args.steps} steps: "
          f"2 ranks sharing the device (DistributedOptimizer) vs 1 process of plain torch",
          flush=True)
    runs = {"one": [], "two": []}
    paths = {}
    for round_ in range(args.rounds):
        for kind in rotated(("one", "two"), round_):
            if kind == "one":
                body = _run(args, _worker_cmd(args, "train", None, ["--plain"]))
            else:
                body = _run(args, _worker_cmd(args, "train", 2))
            if body is None:
                print(f"  round {round_ + 1} {kind}: FAILED (see stderr)", flush=True)
                continue
            total = sum(body["rates"])
            runs[kind].append(total)
            paths = body["paths"] or paths
            print(f"  round {round_ + 1} {'1 process' if kind == 'one' else '2 ranks  '}: "
                  f"{total:10.1f} samples/s in all ("
                  + ", ".join(f"{r:.1f}" for r in body["rates"]) + " per process)", flush=True)
    if runs["one"] and runs["two"]:
        one, two = statistics.median(runs["one"]), statistics.median(runs["two"])
        print(f"  1 process: {spread(runs['one'], '{:.1f}')} samples/s")
        print(f"  2 ranks:   {spread(runs['two'], '{:.1f}')} samples/s (both ranks together)")
        print(f"  ratio 2 ranks / 1 process: {two / one:.3f}")
        print(f"  core path counters (2 ranks, rank 0): {paths or 'not counted by this core'}")
        summary["train"] = {"one_process": runs["one"], "two_ranks": runs["two"],
                            "ratio": two / one, "paths": paths}
    else:
        summary["train"] = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    failed = [k for k in ("small", "large", "train") if summary[k] is None]
    if failed:
        print(f"\nparts that failed: {', '.join(failed)}")
    return 1 if failed else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per system")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--small-count", type=int, default=200)
    p.add_argument("--small-bytes", type=int, default=16 * KIB)
    p.add_argument("--large-bytes", type=int, default=64 * MIB)
    p.add_argument("--layers", default="784-2048-2048-10")
    p.add_argument("--batch", type=int, default=64, help="per process")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=2, help="rounds of part c")
    p.add_argument("--timeout", type=int, default=120, help="seconds per job")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--worker", choices=("small", "large", "train"), help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main():
    args = parse_args()
    if args.worker:
        {"small": worker_small, "large": worker_large, "train": worker_train}[args.worker](args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
