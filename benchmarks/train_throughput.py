"""Training throughput: 1 process vs hvdlite on N ranks vs torch DDP (gloo) on N ranks.

    python benchmarks/train_throughput.py [--rounds 3] [--steps 30] [--np 2]

Same model (an MLP 784-2048-2048-10 by default), same batch per rank (64), synthetic
data, SGD. The three configurations run interleaved, round after round, so that drift in
the machine's load hits all of them alike; each figure is the median over rounds of
samples/sec measured inside the workers after warm-up steps. Every worker uses one
compute thread (``torch.set_num_threads(1)``): on a machine with few cores that keeps
ranks from fighting over them, and it is the same for the single process, so scaling
efficiency = (per-rank samples/sec on N ranks) / (1-process samples/sec).

Targets of issue 5: hvdlite >= 1.15x DDP, scaling efficiency >= 70%.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "THROUGHPUT "


def build(args):
    import torch

    torch.manual_seed(0)
    sizes = [int(s) for s in args.layers.split("-")]
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    x = torch.randn(args.batch, sizes[0])
    y = torch.randint(0, sizes[-1], (args.batch,))
    return model, x, y


def timed_loop(args, model, opt, x, y):
    import torch
    import torch.nn.functional as F

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    return args.steps * args.batch / elapsed


def worker_single(args):
    import torch

    torch.set_num_threads(1)
    model, x, y = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    print(RESULT + json.dumps({"rate": timed_loop(args, model, opt, x, y)}), flush=True)


def worker_hvdlite(args):
    import torch

    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model, x, y = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rate = timed_loop(args, model, opt, x, y)
    rates = hvd.allgather_object(rate)
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"rates": rates}), flush=True)


def worker_ddp(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, x, y = build(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    rate = timed_loop(args, ddp, opt, x, y)
    rates = [None] * dist.get_world_size()
    dist.all_gather_object(rates, rate)
    if dist.get_rank() == 0:
        print(RESULT + json.dumps({"rates": rates}), flush=True)
    dist.destroy_process_group()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _parse(text):
    for line in text.splitlines():
        body = line.split(":", 1)[1] if line.startswith("[") else line
        if body.startswith(RESULT):
            return json.loads(body[len(RESULT):])
    raise RuntimeError("no result in output:\n" + text[-3000:])


def _worker_args(args, kind):
    return [sys.executable, os.path.abspath(__file__), "--worker", kind,
            "--layers", args.layers, "--batch", str(args.batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup)]


def run_single(args):
    out = subprocess.run(_worker_args(args, "single"), capture_output=True, text=True,
                         env=_env(), timeout=args.timeout, check=True)
    return [_parse(out.stdout)["rate"]]


def run_hvdlite(args):
    cmd = [sys.executable, "-m", "hvdlite.runner", "-np", str(args.np)] + _worker_args(
        args, "hvdlite")
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=args.timeout)
    if out.returncode:
        raise RuntimeError(f"hvdlite run failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return _parse(out.stdout)["rates"]


def run_ddp(args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.np):
        env = _env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(args.np), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen(_worker_args(args, "ddp"), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("DDP run failed:\n" + "\n".join(e[-3000:] for _, e in outs))
    return _parse(outs[0][0])["rates"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["single", "hvdlite", "ddp"])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--layers", default="784-2048-2048-10")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    if args.worker:
        {"single": worker_single, "hvdlite": worker_hvdlite, "ddp": worker_ddp}[args.worker](args)
        return

    runs = {"single": [], "hvdlite": [], "ddp": []}
    for round_ in range(args.rounds):
        for kind, fn in (("single", run_single), ("hvdlite", run_hvdlite), ("ddp", run_ddp)):
            rates = fn(args)
            runs[kind].append(rates)
            print(f"round {round_ + 1}/{args.rounds} {kind:8s} samples/sec per rank: "
                  + ", ".join(f"{r:.1f}" for r in rates), flush=True)

    single = statistics.median(r[0] for r in runs["single"])
    per_rank = {k: statistics.median(statistics.mean(r) for r in runs[k])
                for k in ("hvdlite", "ddp")}
    summary = {
        "model": args.layers, "batch_per_rank": args.batch, "np": args.np,
        "single_samples_per_sec": single,
        "hvdlite_samples_per_sec_per_rank": per_rank["hvdlite"],
        "hvdlite_samples_per_sec_total": per_rank["hvdlite"] * args.np,
        "ddp_samples_per_sec_per_rank": per_rank["ddp"],
        "ddp_samples_per_sec_total": per_rank["ddp"] * args.np,
        "hvdlite_over_ddp": per_rank["hvdlite"] / per_rank["ddp"],
        "hvdlite_scaling_efficiency": per_rank["hvdlite"] / single,
        "ddp_scaling_efficiency": per_rank["ddp"] / single,
    }
    print(f"\nmodel {args.layers}, batch {args.batch} per rank, {args.np} ranks, "
          f"median of {args.rounds} interleaved rounds")
    print(f"  1 process           {single:9.1f} samples/sec")
    print(f"  hvdlite {args.np} ranks     {summary['hvdlite_samples_per_sec_total']:9.1f} "
          f"samples/sec total, {per_rank['hvdlite']:.1f} per rank")
    print(f"  DDP gloo {args.np} ranks    {summary['ddp_samples_per_sec_total']:9.1f} "
          f"samples/sec total, {per_rank['ddp']:.1f} per rank")
    print(f"  hvdlite / DDP                 {summary['hvdlite_over_ddp']:.2f}x  (target >= 1.15)")
    print(f"  scaling efficiency hvdlite    {summary['hvdlite_scaling_efficiency']:.0%}  "
          "(target >= 70%)")
    print(f"  scaling efficiency DDP        {summary['ddp_scaling_efficiency']:.0%}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
