"""Two source trees of hvdlite against each other on the hot-path benchmarks, interleaved.

    python benchmarks/compare_trees.py BEFORE_TREE AFTER_TREE [--rounds 4]

Each tree is a checkout with its native library built in it (``setup.py build_native``),
for example a ``git worktree`` of the commit before a change. Round after round, each
tree runs, alternating which goes first (so drift in the machine's load hits both
alike), with its own copy of each benchmark and ``PYTHONPATH`` set to it:

  allreduce   benchmarks/allreduce.py on 2 ranks: synchronous allreduce time 4 KiB .. 64 MiB
              and its ratio to mpi4py's in the same run, the 200 x 16 KiB async step;
  training    benchmarks/train_throughput.py --rounds 1: the MLP against its ceiling.

Printed per figure: each tree's median and range over the rounds and the median of the
per-round ratios after/before (for times, above 1 means slower). This is the before and
after that a change on a hot path owes (the rule in docs/contributing.md).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from rounds import rotated

KIB, MIB = 1024, 1024 * 1024


def run_allreduce(tree, args):
    """{figure: seconds} from one run of the tree's benchmarks/allreduce.py."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        python = sys.executable
        cmd = [python, "-m", "hvdlite.runner", "-np", "2", python,
               os.path.join(tree, "benchmarks", "allreduce.py"), "--skip-cpu",
               "--reps", str(args.reps), "--max-size", str(args.max_size), "--json", out]
        subprocess.run(cmd, env=env_for(tree), check=True, timeout=args.timeout,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            data = json.load(f)
    figures = {}
    for r in data["sizes"]:
        figures[f"allreduce {size_label(r['bytes'])} (s)"] = r["hvd_s"]
        # Against mpi4py in the same run: a time ratio, so below 1 is faster than MPI.
        figures[f"allreduce {size_label(r['bytes'])} / mpi4py"] = r["hvd_s"] / r["mpi_s"]
    figures["200 x 16 KiB async step (s)"] = data["small"]["hvd_s"]
    return figures


def run_training(tree, args):
    """{figure: value} from one round of the tree's benchmarks/train_throughput.py."""
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "train_throughput.py"),
           "--rounds", "1", "--no-bound", "--json"]
    done = subprocess.run(cmd, env=env_for(tree), check=True, timeout=args.timeout,
                          capture_output=True, text=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {"MLP hvdlite/ceiling": summary["hvdlite_over_ceiling_median"],
            "MLP hvdlite samples/s per rank": summary["hvdlite_samples_per_sec_per_rank"]}


def env_for(tree):
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    env.pop("HVDLITE_LIBRARY", None)  # each tree loads the library built in it
    return env


def size_label(n):
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=7, help="allreduce.py repetitions per size")
    p.add_argument("--only", choices=["allreduce", "training"])
    p.add_argument("--max-size", type=int, default=64 * MIB,
                   help="largest allreduce (bytes); a small one gives many rounds of latency")
    p.add_argument("--timeout", type=int, default=600)
    args = p.parse_args()
    trees = [os.path.abspath(args.before), os.path.abspath(args.after)]
    benches = [(name, fn) for name, fn in (("allreduce", run_allreduce), ("training", run_training))
               if args.only in (None, name)]
    samples = [{}, {}]  # per tree: figure -> [value per round]
    for round_ in range(args.rounds):
        for name, fn in benches:
            for t in rotated((0, 1), round_):  # which tree goes first alternates
                for figure, value in fn(trees[t], args).items():
                    samples[t].setdefault(figure, []).append(value)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"\nbefore: {trees[0]}\nafter:  {trees[1]}\nmedians (ranges) of {args.rounds} "
          "interleaved rounds; ratio: median of the per-round after/before")
    print(f"{'figure':34s} {'before':>24s} {'after':>24s} {'after/before':>12s}")
    for figure in samples[0]:
        b, a = samples[0][figure], samples[1][figure]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(f"{figure:34s} {fmt(figure, b):>24s} {fmt(figure, a):>24s} {ratio:12.3f}")


def fmt(figure, values):
    """Median (range); a figure in seconds, "(s)", is shown in us or ms."""
    scale, unit, digits = 1, "", 3
    if figure.endswith("(s)"):
        scale, unit, digits = (1e6, "us", 1) if max(values) < 1e-3 else (1e3, "ms", 2)
    lo, mid, hi = (v * scale for v in (min(values), statistics.median(values), max(values)))
    return f"{mid:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


if __name__ == "__main__":
    main()
