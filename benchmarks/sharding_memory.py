"""Memory and throughput of the sharded optimizers against the unsharded one.

    python benchmarks/sharding_memory.py [--np 2 3] [--rounds 2] [--steps 4]
        [--layers 2048-4096-4096-4096-4096-4096-4096-2048] [--batch 32] [--no-zero]
        [--only CONFIG ...] [--cap MIB] [--collectives]

An MLP of about 100M float32 parameters (by default) trained with Adam on synthetic data,
the same batch per rank, one compute thread per rank, in these configurations:

  unsharded  hvd.DistributedOptimizer(Adam)
  shard=1    ... shard=1 (optimizer state sharded)
  shard=2    ... shard=2 (gradients sharded too)
  shard=3    hvd.ShardedModule(model) (each Linear a block) with ... shard=3 (parameters
             sharded too)
  ZeRO       torch's ZeroRedundancyOptimizer(Adam) under DistributedDataParallel on gloo
             (torch.distributed's own stage 1), where it runs
  FSDP       torch's fully_shard (FSDP2) on each Linear and the model, on gloo
             (torch.distributed's own stage 3), where it runs

Each rank reports its peak resident memory (``ru_maxrss``: the whole process, torch's
own ~0.3 GiB included; also the peak once the model is built, before any collective,
and the peak while training: VmHWM, reset once the model is wrapped, which leaves out
the whole model that every configuration builds first),
the bytes it holds of optimizer state and of gradients just
before the update (after ``synchronize()``; for ZeRO, DDP's gradients), and its
samples/s over the timed steps (after one warm-up step). A job's samples/s is the sum
of its ranks'. The configurations run in rounds, rotated by one each round
(benchmarks/rounds.py), so that the machine's drift hits all of them alike; the summary
gives each figure's median over the rounds, and the throughput of each against the
unsharded optimizer of the same rank count.

Target of issue 34: shard=1 and shard=2 within 10% of the unsharded samples/s, shard=3
within 25%.

``--cap MIB`` finds instead, for each configuration, the largest model of a ladder (six
hidden layers of width 2048, 3072, ... 7168) that trains within MIB MiB per rank: each
rank process puts itself, before it imports torch, in a memory cgroup of its own limited
to MIB (cgroup v1 or v2; root), so that a rank that needs more is killed by the kernel.
Every configuration builds the whole model first (before ShardedModule cuts it), so
that is stage 3's limit here. hvdlite's configurations only: a killed gloo rank (ZeRO,
FSDP) leaves its peers waiting.

``--collectives`` times instead the collectives a step runs on a buffer of the model's
size, at each rank count: the allreduce of shard=0 (and shard=1), and the reduce-scatter
and allgather of shard=2, whole and in 16 MiB buckets.
"""
import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

from rounds import print_commit, rotated, spread
from train_throughput import build  # the same MLP (args.layers) and synthetic batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "SHARDING "
CONFIGS = {"unsharded": 0, "shard=1": 1, "shard=2": 2, "shard=3": 3, "ZeRO": None,
           "FSDP": None}
TORCH_CONFIGS = ("ZeRO", "FSDP")  # run by torch.distributed on gloo
MIB = 1 << 20


def tensor_bytes(values):
    import torch

    values = [getattr(v, "to_local", lambda v=v: v)() for v in values]  # FSDP's DTensors
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def reset_peak():
    """Starts the process's peak resident memory (VmHWM) afresh (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_since_reset():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def held_state(opt):
    """Bytes of the optimizer state this rank holds (ZeRO: its own shard)."""
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps a local optimizer
    return tensor_bytes(v for state in inner.state.values() for v in state.values())


CAP_ENV = "HVDLITE_BENCH_MEMORY_CAP"  # "MIB:TAG", set by --cap for the ranks
WIDTHS = (2048, 3072, 4096, 5120, 6144, 7168)


def cgroup_root():
    """The memory cgroup hierarchy's root directory and whether it is cgroup v2."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return "/sys/fs/cgroup", True
    return "/sys/fs/cgroup/memory", False


def join_memory_cap(value):
    """Moves this process into a new memory cgroup limited to the MiB of ``value``."""
    mib, tag = value.split(":", 1)
    root, v2 = cgroup_root()
    path = os.path.join(root, f"{tag}-{os.getpid()}")
    os.mkdir(path)
    limit = str(int(mib) << 20)
    writes = [("memory.max", limit), ("memory.swap.max", "0")] if v2 else \
        [("memory.limit_in_bytes", limit), ("memory.swappiness", "0")]
    for name, text in writes + [("cgroup.procs", str(os.getpid()))]:
        with open(os.path.join(path, name), "w") as f:
            f.write(text)


def remove_memory_cgroups(tag):
    """Removes the cgroups of ``join_memory_cap`` for ``tag`` (their processes ended)."""
    root, _ = cgroup_root()
    for name in os.listdir(root):
        if name.startswith(tag + "-"):
            for _ in range(50):  # the killed ranks' last pages may take a moment to go
                try:
                    os.rmdir(os.path.join(root, name))
                    break
                except OSError:
                    time.sleep(0.1)


def largest_within_cap(config, np_, args):
    """The ladder's widest model that trains within ``args.cap`` MiB a rank, with its
    reports; None if even the narrowest does not."""
    tag = f"hvdlite-cap-{os.getpid()}"
    best = None
    for width in WIDTHS:
        layers = "-".join(["2048"] + [str(width)] * 6 + ["2048"])
        trial = argparse.Namespace(**dict(vars(args), layers=layers))
        os.environ[CAP_ENV] = f"{args.cap}:{tag}"
        try:
            reports = run_config(config, np_, trial, quiet=True)
        except subprocess.TimeoutExpired:
            reports = None
        finally:
            del os.environ[CAP_ENV]
            remove_memory_cgroups(tag)
        if reports is None:
            break
        best = (width, reports)
    return best


def worker(args):
    if os.environ.get(CAP_ENV):
        join_memory_cap(os.environ[CAP_ENV])
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model, x, y = build(args)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    params = sum(p.numel() for p in model.parameters())
    if args.worker in TORCH_CONFIGS:
        import torch.distributed as dist

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=size)
        if args.worker == "ZeRO":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            net = torch.nn.parallel.DistributedDataParallel(model)
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam,
                                          lr=1e-4)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            net = fully_shard(model)
            opt = torch.optim.Adam(net.parameters(), lr=1e-4)
        barrier, grads_after = dist.barrier, lambda: tensor_bytes(
            p.grad for p in net.parameters())

        def step():
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            return grads_after()
    else:
        import hvdlite.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        net = hvd.ShardedModule(model) if args.worker == "shard=3" else model
        opt = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-4),
                                       named_parameters=net.named_parameters(),
                                       shard=CONFIGS[args.worker])
        del model
        barrier = hvd.barrier

        def step():
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.synchronize()
            # Stage 2 holds its pieces' gradients (the parameters' are None by now);
            # stage 3's parameters are the pieces.
            pieces = [s.grad for s in opt._stepped] if getattr(opt, "shard", 0) == 2 else []
            return tensor_bytes([p.grad for p in net.parameters()] + pieces)

    reset_peak()

    def train_step():
        grads = step()
        if args.worker in TORCH_CONFIGS:
            opt.step()
        else:
            with opt.skip_synchronize():
                opt.step()
        return grads

    grads = train_step()  # warm-up: the optimizer's state is created
    barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        grads = train_step()
    elapsed = time.perf_counter() - start
    barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(RESULT + json.dumps({
        "rank": rank, "size": size, "params": params, "peak_mib": peak / MIB,
        "built_mib": built / MIB, "train_peak_mib": peak_since_reset() / MIB,
        "state_mib": held_state(opt) / MIB, "grads_mib": grads / MIB,
        "samples_per_s": args.steps * args.batch / elapsed}), flush=True)


def collectives(args):
    """--collectives, in each rank: seconds per collective on the model's bytes."""
    import torch

    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    sizes = [int(s) for s in args.layers.split("-")]
    n = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    n -= n % hvd.size()
    bucket = (16 << 20) // 4
    grads, piece = torch.ones(n), torch.ones(n // hvd.size())

    def in_buckets(start):
        handles = [start(i, min(n, i + bucket)) for i in range(0, n, bucket)]
        for handle in handles:
            hvd.synchronize(handle)

    ops = {
        "allreduce": lambda: hvd.allreduce_(grads, name="c.ar"),
        "reducescatter": lambda: hvd.reducescatter(grads, name="c.rs"),
        "allgather": lambda: hvd.allgather(piece, name="c.ag"),
        "reducescatter 16 MiB buckets": lambda: in_buckets(
            lambda i, j: hvd.reducescatter_async(grads[i:j], name=f"c.rs.{i}")),
        "allgather 16 MiB buckets": lambda: in_buckets(
            lambda i, j: hvd.allgather_async(piece[i // hvd.size():j // hvd.size()],
                                             name=f"c.ag.{i}")),
    }
    for label, op in ops.items():
        op()
        hvd.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            op()
        seconds = (time.perf_counter() - start) / args.steps
        if hvd.rank() == 0:
            print(f"  np {hvd.size()} {label:30s} {n * 4 / MIB:6.0f} MiB  {seconds:.3f} s",
                  flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(config, np_, args, quiet=False):
    """One job: the ranks' reports, or None if it failed (its output is printed unless
    ``quiet``)."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", config,
               "--layers", args.layers, "--batch", str(args.batch), "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    if config in TORCH_CONFIGS:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        procs = [subprocess.Popen(command, env=dict(env, RANK=str(r), WORLD_SIZE=str(np_)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(np_)]
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        failed = any(p.returncode for p in procs)
        output = "".join(outputs)
    else:
        done = subprocess.run([sys.executable, "-m", "hvdlite.runner", "-np", str(np_)] + command,
                              env=env, capture_output=True, text=True, timeout=args.timeout)
        failed, output = done.returncode != 0, done.stdout + done.stderr
    reports = [json.loads(line.split(RESULT, 1)[1]) for line in output.splitlines()
               if RESULT in line]
    if failed or len(reports) != np_:
        if not quiet:
            print(f"  {config} at {np_} ranks failed:\n{output[-3000:]}", flush=True)
        return None
    return sorted(reports, key=lambda r: r["rank"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", default="2048-4096-4096-4096-4096-4096-4096-2048")
    parser.add_argument("--no-zero", action="store_true", help="leave ZeRO and FSDP out")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS),
                        help="run these configurations only")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--cap", type=int, metavar="MIB",
                        help="find each configuration's largest model within MIB per rank")
    parser.add_argument("--collectives", action="store_true",
                        help="time the collectives of a step instead (see above)")
    parser.add_argument("--worker", choices=list(CONFIGS) + ["collectives"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "collectives":
        return collectives(args)
    if args.worker:
        return worker(args)

    print_commit()
    if args.collectives:
        for np_ in args.np:
            command = [sys.executable, "-m", "hvdlite.runner", "-np", str(np_), sys.executable,
                       os.path.abspath(__file__), "--worker", "collectives", "--layers",
                       args.layers, "--steps", str(args.steps)]
            done = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                    PYTHONPATH=REPO),
                                  capture_output=True, text=True, timeout=args.timeout)
            print("\n".join(line.split(":", 1)[1] for line in done.stdout.splitlines()
                            if " MiB " in line), flush=True)
        return 0
    configs = [c for c in (args.only or CONFIGS)
               if not (args.no_zero and c in TORCH_CONFIGS)]
    if args.cap:
        for np_ in args.np:
            print(f"\n{np_} ranks, at most {args.cap} MiB per rank (a memory cgroup each): "
                  "the widest model that trains", flush=True)
            for config in configs:
                if config in TORCH_CONFIGS:  # a killed gloo rank leaves its peers waiting
                    print(f"  {config:9s} not run under a cap", flush=True)
                    continue
                found = largest_within_cap(config, np_, args)
                if found is None:
                    print(f"  {config:9s} none of the ladder", flush=True)
                    continue
                width, reports = found
                print(f"  {config:9s} width {width}: {reports[0]['params'] / 1e6:6.1f}M "
                      f"parameters, peak {max(r['peak_mib'] for r in reports):.0f} MiB, "
                      f"samples/s {sum(r['samples_per_s'] for r in reports):.1f}", flush=True)
        return 0
    for np_ in args.np:
        figures = {c: [] for c in configs}  # config -> one list of rank reports per round
        for round_ in range(args.rounds):
            for config in rotated(configs, round_):
                reports = run_config(config, np_, args)
                if reports is None:
                    continue
                figures[config].append(reports)
                print(f"  np {np_} round {round_} {config}: "
                      f"samples/s {sum(r['samples_per_s'] for r in reports):.1f}, peak MiB "
                      + " ".join(f"{r['peak_mib']:.0f}" for r in reports) + ", training "
                      + " ".join(f"{r['train_peak_mib']:.0f}" for r in reports), flush=True)
        summarize(np_, figures)


def summarize(np_, figures):
    ran = {c: rounds for c, rounds in figures.items() if rounds}
    if not ran:
        return
    params = next(iter(ran.values()))[0][0]["params"]
    print(f"\n{np_} ranks, {params / 1e6:.1f}M parameters (float32, Adam); per rank, median "
          "over rounds: peak RSS, optimizer state, gradients held before the update")
    base = [sum(r["samples_per_s"] for r in reports) for reports in ran.get("unsharded", [])]
    for config, rounds in ran.items():
        def median(key, rounds=rounds):
            return statistics.median(max(r[key] for r in reports) for reports in rounds)
        speeds = [sum(r["samples_per_s"] for r in reports) for reports in rounds]
        versus = ""
        if base and config != "unsharded":
            versus = (f", {statistics.median(speeds) / statistics.median(base):.2f}x "
                      "unsharded")
        print(f"  {config:9s} peak {median('peak_mib'):6.0f} MiB (built "
              f"{median('built_mib'):5.0f}, training {median('train_peak_mib'):6.0f})  "
              f"state {median('state_mib'):6.0f} MiB  grads {median('grads_mib'):6.0f} MiB  samples/s "
              f"{spread(speeds, '{:.1f}')}{versus}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
