"""Gradient compression on slow links: step time, bytes per step and accuracy.

    sudo python benchmarks/compression.py [--rates 1gbit,100mbit] [--rounds 3]

For each link rate, a namespace cluster of 2 hosts (hvdlite.runner.netns_cluster) runs
one job of 2 ranks (1 per host, MPI over the shaped links) that trains the MLP
784-2048-2048-10 (batch 64 per rank, SGD) with each compression in turn, interleaved
round after round in an order rotated by one every round (benchmarks/rounds.py) so that
the machine's drift hits all alike, and prints per compression every round's step time
with their median and range, the bytes each rank sent per step (``hvdlite.stats()``'s
wire_bytes) and the speed-up against no compression. Then, on this machine (the link
does not change what is learnt), ``examples/pytorch_digits.py`` runs 2 ranks for the
same epochs with each compression and the final test accuracies are printed beside
none's.

Needs root (the cluster); ``--local`` runs the step timing on this host instead, and
``--accuracy-only --seeds 1-10`` only the accuracies, over several seeds.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from rounds import print_commit, rotated, spread

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "COMPRESSION "
CHOICES = ("none", "fp16", "topk:0.01", "quantize:8", "quantize:4", "powersgd:4")


def rank_part(args):
    """Runs in every rank: interleaved timing of each compression's training step."""
    import torch
    import torch.nn.functional as F

    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    sizes = [784, 2048, 2048, 10]
    x = torch.randn(64, sizes[0])
    y = torch.randint(0, sizes[-1], (64,))
    setups = {}
    for choice in args.choices.split(","):
        layers = []
        for i in range(len(sizes) - 1):
            layers += [torch.nn.Linear(sizes[i], sizes[i + 1]), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers[:-1])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.parse(choice))
        setups[choice] = (model, opt)
    times = {c: [] for c in setups}
    wire = {c: [] for c in setups}

    def step(model, opt):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for model, opt in setups.values():  # warm-up: first-use costs, PowerSGD's start
        step(model, opt)
    for round_ in range(args.rounds):
        for choice in rotated(setups, round_):
            model, opt = setups[choice]
            hvd.barrier()
            before = hvd.stats()["wire_bytes"]
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, opt)
            times[choice].append((time.perf_counter() - start) / args.steps)
            wire[choice].append((hvd.stats()["wire_bytes"] - before) / args.steps)
    merged = {c: [max(ts) for ts in zip(*hvd.allgather_object(times[c]))] for c in setups}
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"times": merged, "wire": wire}), flush=True)
    hvd.shutdown()


def _parse(text):
    for line in text.splitlines():
        body = line.split(":", 1)[1] if line.startswith("[") else line
        if body.startswith(RESULT):
            return json.loads(body[len(RESULT):])
    raise RuntimeError("no result in the job's output:\n" + text[-4000:])


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def time_steps(args, rate):
    """The rank part on 2 hosts x 1 rank at ``rate`` (or on this host with --local)."""
    worker = [sys.executable, os.path.abspath(__file__), "--rank-part",
              "--choices", args.choices, "--rounds", str(args.rounds),
              "--steps", str(args.steps)]
    launcher = [sys.executable, "-m", "hvdlite.runner", "-np", "2"]
    if args.local:
        out = subprocess.run(launcher + worker, capture_output=True, text=True,
                             env=_env(), timeout=args.timeout, cwd=REPO)
        return _parse(out.stdout + out.stderr)
    from hvdlite.runner.netns_cluster import NetnsCluster

    with NetnsCluster(2, rate=rate) as cluster:
        command = launcher + ["-H", "h1:1,h2:1", "--remote-shell", cluster.remote_shell()]
        out = cluster.run("h1", command + worker, capture_output=True, text=True,
                          env=cluster.mpi_env(_env()), timeout=args.timeout, cwd=REPO)
        return _parse(out.stdout + out.stderr)


def accuracy(args, choice, seed):
    """The digits example's last test accuracy with ``choice``, 2 ranks on this host."""
    out = subprocess.run(
        [sys.executable, "-m", "hvdlite.runner", "-np", "2", sys.executable,
         os.path.join(REPO, "examples", "pytorch_digits.py"), "--epochs", str(args.epochs),
         "--compression", choice, "--seed", str(seed)],
        capture_output=True, text=True, env=_env(), timeout=args.timeout, cwd=REPO)
    found = re.findall(r"test accuracy ([\d.]+)%", out.stdout)
    if not found:
        raise RuntimeError(f"digits with {choice}: no accuracy\n{out.stdout[-2000:]}"
                           f"{out.stderr[-2000:]}")
    return float(found[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1gbit,100mbit")
    parser.add_argument("--choices", default=",".join(CHOICES))
    parser.add_argument("--rounds", type=int, default=len(CHOICES),
                        help="rounds (each rotates the order by one; default: one full turn)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--epochs", type=int, default=10, help="digits example's epochs")
    parser.add_argument("--local", action="store_true", help="time on this host, no cluster")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--accuracy-only", action="store_true", help="no step timing")
    parser.add_argument("--seeds", default="42",
                        help="digits example's seeds (init, split, shuffling), e.g. 1-10")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--rank-part", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_part:
        return rank_part(args)
    print_commit()
    choices = args.choices.split(",")
    rates = ["local"] if args.local else args.rates.split(",")
    for rate in ([] if args.accuracy_only else rates):
        result = time_steps(args, rate)
        base = statistics.median(result["times"]["none"])
        print(f"\nMLP 784-2048-2048-10, batch 64/rank, 2 hosts x 1 rank, link {rate} "
              f"(medians of {args.rounds} rotated rounds of {args.steps} steps)")
        print(f"{'compression':<12} {'step ms':>9} {'range ms':>15} {'MB sent/step':>13} "
              f"{'speed-up':>9}")
        for choice in choices:
            ts = result["times"][choice]
            med = statistics.median(ts)
            sent = statistics.median(result["wire"][choice]) / 1e6
            print(f"{choice:<12} {med * 1e3:9.1f} {min(ts) * 1e3:7.1f}-{max(ts) * 1e3:<7.1f} "
                  f"{sent:13.3f} {base / med:8.2f}x")
        for choice in choices:
            ts = result["times"][choice]
            speedups = [b / t for b, t in zip(result["times"]["none"], ts)]
            print(f"  {choice:<10} step ms per round: " + spread([t * 1e3 for t in ts], "{:.1f}")
                  + "; speed-up against none, same round: " + spread(speedups, "{:.2f}"))
    if not args.skip_accuracy:
        first, _, last = args.seeds.partition("-")
        seeds = list(range(int(first), int(last or first) + 1))
        print(f"\ndigits example, 2 ranks, {args.epochs} epochs, seeds {args.seeds}: final "
              "test accuracy (median, range) and the median of the per-seed difference "
              "against none (same seed: same init, split and batches)")
        runs = {}
        for i, seed in enumerate(seeds):  # interleaved and rotated: the machine's load
            for choice in rotated(choices, i):  # hits every choice alike
                runs.setdefault(choice, []).append(accuracy(args, choice, seed))
        for choice in choices:
            accs = runs[choice]
            diffs = [a - b for a, b in zip(accs, runs[choices[0]])]
            print(f"{choice:<12} median {statistics.median(accs):6.2f}%  range "
                  f"{min(accs):6.2f}-{max(accs):6.2f}%  {statistics.median(diffs):+.2f} "
                  f"points against {choices[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
