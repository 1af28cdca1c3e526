"""MLP training across hosts of a namespace cluster: hvdlite against torch DDP (gloo).

    sudo .venv/bin/python benchmarks/cluster_training.py [--hosts 2] [--rate 1gbit]
        [--rounds 3] [--steps 20]

Builds a cluster (hvdlite/runner/netns_cluster.py), one rank per host, and runs the
workers of benchmarks/train_throughput.py there (MLP 784-2048-2048-10, batch 64 per rank,
SGD, synthetic data, one compute thread): hvdlite's through hvdliterun -H h1:1,h2:1,...,
DDP's as one process per host with MASTER_ADDR at h1 and gloo on the hosts' links. The
two alternate round by round; each figure is the median over rounds of the samples/s
summed over ranks. Needs root.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "train_throughput.py")
RESULT = "THROUGHPUT "


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", default="784-2048-2048-10")
    p.add_argument("--timeout", type=float, default=300)
    return p.parse_args()


def _rates(text):
    for line in text.splitlines():
        body = line.split(":", 1)[1] if line.startswith("[") else line
        if body.startswith(RESULT):
            return json.loads(body[len(RESULT):])["rates"]
    raise RuntimeError("no result in the output:\n" + text[-3000:])


def _worker(args, kind):
    return [sys.executable, WORKER, "--worker", kind, "--layers", args.layers,
            "--steps", str(args.steps), "--warmup", str(args.warmup)]


def run_hvdlite(cluster, args, env):
    hosts = ",".join(f"{h.name}:1" for h in cluster.hosts)
    out = cluster.run("h1", [sys.executable, "-m", "hvdlite.runner", "-H", hosts]
                      + _worker(args, "hvdlite"), env=env, capture_output=True, text=True,
                      timeout=args.timeout)
    if out.returncode:
        raise RuntimeError(f"hvdlite run failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return _rates(out.stdout)


def run_ddp(cluster, args, env, port):
    procs = []
    for rank, host in enumerate(cluster.hosts):
        rank_env = dict(env, MASTER_ADDR=cluster.hosts[0].address, MASTER_PORT=str(port),
                        RANK=str(rank), WORLD_SIZE=str(len(cluster.hosts)), LOCAL_RANK="0",
                        GLOO_SOCKET_IFNAME="eth0")
        procs.append(cluster.popen(host.name, _worker(args, "ddp"), env=rank_env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("DDP run failed:\n" + "\n".join(e[-3000:] for _, e in outs))
    return _rates(outs[0][0])


def main():
    args = parse_args()
    sys.path.insert(0, REPO_ROOT)
    from hvdlite.runner.netns_cluster import NetnsCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"cluster_training.py: {reason}")
    runs = {"hvdlite": [], "ddp": []}
    with NetnsCluster(args.hosts, rate=args.rate) as cluster:
        env = cluster.mpi_env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        for round_ in range(args.rounds):
            order = ("hvdlite", "ddp") if round_ % 2 == 0 else ("ddp", "hvdlite")
            for kind in order:
                if kind == "hvdlite":
                    rates = run_hvdlite(cluster, args, env)
                else:
                    rates = run_ddp(cluster, args, env, 29500 + round_)
                runs[kind].append(sum(rates))
                print(f"round {round_ + 1}/{args.rounds} {kind:8s} samples/s per rank: "
                      + ", ".join(f"{r:.1f}" for r in rates), flush=True)
    h, d = (statistics.median(runs[k]) for k in ("hvdlite", "ddp"))
    print(f"\nMLP {args.layers}, batch 64 per rank, {args.hosts} hosts x 1 rank, links "
          f"{args.rate}, median of {args.rounds} interleaved rounds (samples/s, all ranks):")
    print(f"  hvdlite   {h:8.1f}  [{min(runs['hvdlite']):.1f}-{max(runs['hvdlite']):.1f}]")
    print(f"  DDP gloo  {d:8.1f}  [{min(runs['ddp']):.1f}-{max(runs['ddp']):.1f}]")
    print(f"  hvdlite / DDP  {h / d:.2f}x")


if __name__ == "__main__":
    main()
