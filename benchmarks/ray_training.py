"""hvdliterun against RayExecutor on a namespace cluster: start-up and MLP training.

    sudo .venv/bin/python benchmarks/ray_training.py [--rounds 3] [--steps 20]
        [--rate 1gbit]

Builds 2 hosts (hvdlite/runner/netns_cluster.py), starts a Ray node on each (the head
on h1, 2 CPUs each), and runs 4 ranks, 2 per host, the same way twice per round, in
alternating order:

* ``hvdliterun -H h1:2,h2:2 python ray_training.py --worker`` started in h1;
* a Ray driver started in h1 (``--driver``): ``ray.init`` to the running cluster,
  ``RayExecutor(num_hosts=2, num_workers_per_host=2).start()``, then ``run``.

Each reports the time from submit (the benchmark starting the command) to the end of
the first allreduce (a scalar, right after ``hvd.init()``), and the training throughput
of benchmarks/train_throughput.py's MLP (784-2048-2048-10, batch 64 per rank, SGD,
synthetic data, one compute thread), summed over ranks. Medians over rounds, with the
range. Needs root. Figures: docs/ray.md ("Measured").
"""
import argparse
import json
import os
import secrets
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
RESULT = "RAYBENCH "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--layers", default="784-2048-2048-10")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--phases", action="store_true",
                   help="also print rank 0's time per step by phase, and its threads' CPU")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--driver", default=None, metavar="HEAD", help=argparse.SUPPRESS)
    p.add_argument("--submitted", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def rank_body(layers, steps, warmup, submitted, phases=False):
    """One rank: the first allreduce's time since submit, then the training rate.

    Returns (seconds to the first allreduce, samples/s, phases or None), the same on
    every path."""
    import torch

    import hvdlite.torch as hvd

    sys.path.insert(0, HERE)
    import train_throughput

    torch.set_num_threads(1)
    hvd.init()
    hvd.allreduce(torch.tensor(1.0), name="first")
    first = time.time() - submitted
    args = argparse.Namespace(layers=layers, batch=64, steps=steps, warmup=warmup,
                              phases=phases)
    model, x, y = train_throughput.build(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rate, measured = train_throughput.timed_loop(args, model, opt, x, y)
    return first, rate, measured


def worker_main(args):
    import hvdlite as hvd

    first, rate, phases = rank_body(args.layers, args.steps, args.warmup, args.submitted,
                                    args.phases)
    firsts, rates = hvd.allgather_object(first), hvd.allgather_object(rate)
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"first": max(firsts), "rates": rates, "phases": phases}),
              flush=True)


def driver_main(args):
    import ray

    from hvdlite.ray import RayExecutor

    ray.init(address=args.driver, logging_level="warning")
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2,
                           num_workers_per_host=2)
    executor.start()
    try:
        out = executor.run(rank_body, args=[args.layers, args.steps, args.warmup,
                                            args.submitted, args.phases])
    finally:
        executor.shutdown()
    print(RESULT + json.dumps({"first": max(f for f, _, _ in out),
                               "rates": [r for _, r, _ in out], "phases": out[0][2]}),
          flush=True)


def _result(done, what):
    for line in done.stdout.splitlines():
        body = line.split(":", 1)[1] if line.startswith("[") else line
        if body.startswith(RESULT):
            return json.loads(body[len(RESULT):])
    raise RuntimeError(f"{what}: no result (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                       f"{done.stderr[-4000:]}")


def main():
    args = parse_args()
    if args.worker:
        return worker_main(args)
    if args.driver:
        return driver_main(args)
    sys.path.insert(0, REPO_ROOT)
    from hvdlite.runner.netns_cluster import NetnsCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"ray_training.py: {reason}")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    me = os.path.abspath(__file__)
    common = ["--layers", args.layers, "--steps", str(args.steps), "--warmup",
              str(args.warmup)] + (["--phases"] if args.phases else [])
    runs = {"hvdliterun": [], "RayExecutor": []}
    with NetnsCluster(2, rate=args.rate) as cluster:
        env = cluster.mpi_env(dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
                                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                                   PYTHONPATH=os.pathsep.join([REPO_ROOT, HERE])))
        head = f"{cluster.host('h1').address}:6379"
        try:
            for host in cluster.hosts:
                argv = [ray_bin, "start", f"--node-ip-address={host.address}", "--num-cpus=2",
                        "--disable-usage-stats",
                        f"--temp-dir=/tmp/hvdlite-ray-{cluster.prefix}-{host.name}"]
                argv += (["--head", "--port=6379", "--include-dashboard=false"]
                         if host.name == "h1" else [f"--address={head}"])
                done = cluster.run(host.name, argv, env=env, capture_output=True, text=True,
                                   timeout=120)
                if done.returncode:
                    raise RuntimeError(f"ray start on {host.name}: {done.stderr[-2000:]}")
            for round_ in range(args.rounds):
                order = ("hvdliterun", "RayExecutor") if round_ % 2 == 0 else \
                    ("RayExecutor", "hvdliterun")
                for kind in order:
                    submitted = time.time()
                    if kind == "hvdliterun":
                        argv = [sys.executable, "-m", "hvdlite.runner", "-H", "h1:2,h2:2",
                                sys.executable, me, "--worker"]
                    else:
                        argv = [sys.executable, me, "--driver", head]
                    argv += common + ["--submitted", repr(submitted)]
                    done = cluster.run("h1", argv, env=env, capture_output=True, text=True,
                                       timeout=args.timeout, cwd=REPO_ROOT)
                    result = _result(done, kind)
                    runs[kind].append((result["first"], sum(result["rates"])))
                    print(f"round {round_ + 1}/{args.rounds} {kind:11s} first allreduce "
                          f"{result['first']:.2f} s after submit; samples/s per rank: "
                          + ", ".join(f"{r:.1f}" for r in result["rates"]), flush=True)
                    if args.phases:
                        print(f"  rank 0 per step: {json.dumps(result['phases'])}", flush=True)
        finally:
            for host in cluster.hosts:
                cluster.run(host.name, [ray_bin, "stop", "--force"], env=env,
                            capture_output=True, timeout=60)
    print(f"\n4 ranks on 2 hosts (2 each), links {args.rate}; MLP {args.layers}, batch 64 "
          f"per rank, {args.steps} steps; median of {args.rounds} interleaved rounds [range]:")
    for kind, values in runs.items():
        firsts, rates = [v[0] for v in values], [v[1] for v in values]
        print(f"  {kind:11s} submit to first allreduce {statistics.median(firsts):6.2f} s "
              f"[{min(firsts):.2f}-{max(firsts):.2f}]; training {statistics.median(rates):7.1f} "
              f"samples/s [{min(rates):.1f}-{max(rates):.1f}]")
    h = statistics.median(v[1] for v in runs["hvdliterun"])
    r = statistics.median(v[1] for v in runs["RayExecutor"])
    print(f"  throughput RayExecutor / hvdliterun: {r / h:.2f}x")


if __name__ == "__main__":
    main()
