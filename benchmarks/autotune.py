"""Autotune against the defaults, on the MLP and on the 200-small-tensors step.

    python benchmarks/autotune.py [--rounds 4] [--np 2] [--workloads mlp,small]

Each job runs one workload on --np ranks, with HVDLITE_AUTOTUNE=1 or without. Both kinds
first run the same number of steps (the workload's --pre-steps, each followed by a
one-integer allreduce asking whether every rank's search has settled; the autotuned job
goes on past them until it has, and reports how many steps tuning took), then measure
the same steps: the figure compares what training runs at once tuned with what it runs
at the defaults, at the same point of a job. Jobs of the two kinds alternate in
ABBA order, round after round, so drift in the machine's load hits both alike; each
figure is the median (and range) over rounds of rank 0's rate, with the ratio of the
medians.

Workloads: "mlp", the MLP 784-2048-2048-10 of benchmarks/train_throughput.py (batch 64
per rank, SGD through hvdlite.torch's DistributedOptimizer, one compute thread per
rank), in samples/s per rank; "small", the step of benchmarks/timeline_overhead.py (200
float32 tensors of 16 KiB enqueued with allreduce_async, then waited for), in steps/s.
``--json PATH`` also writes the figures.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "AUTOTUNE_BENCH "
KNOBS = ("fusion_threshold", "cycle_time_ms", "shm_chunk_bytes", "hierarchical")
# Per workload: steps before the measurement (enough for the default search to settle
# on this machine: ~23 samples of at least 0.25 s), and measured steps (several seconds).
PRE_STEPS = {"mlp": 120, "small": 800}
STEPS = {"mlp": 100, "small": 400}


def mlp_step(batch):
    """Returns a function that runs one training step of the MLP."""
    import torch
    import torch.nn.functional as F

    import hvdlite.torch as hvd
    from train_throughput import build  # the same model, data and seed

    torch.set_num_threads(1)
    model, x, y = build(argparse.Namespace(layers="784-2048-2048-10", batch=batch))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step, batch


def small_step(tensors=200, kib=16):
    """Returns a function that runs the many-small-tensors step."""
    import numpy as np

    import hvdlite as hvd

    data = [np.full(kib * 256, hvd.rank(), np.float32) for _ in range(tensors)]
    names = [f"layer{i}.grad" for i in range(tensors)]

    def step():
        handles = [hvd.allreduce_async(t, name=n, op=hvd.Sum) for t, n in zip(data, names)]
        for h in handles:
            hvd.synchronize(h)
    return step, 1


def worker(args):
    import numpy as np

    import hvdlite as hvd

    hvd.init()
    step, per_step = mlp_step(args.batch) if args.worker == "mlp" else small_step()
    tuning = hvd.autotune_state()["enabled"]
    pre_steps = args.pre_steps or PRE_STEPS[args.worker]
    tune_steps = None
    for done in range(1, args.max_tune_steps + 1):
        step()
        settled = np.array([int(hvd.autotune_state()["settled"])], np.int32)
        everyone = hvd.allreduce(settled, op=hvd.Min, name="autotune.settled")[0] == 1
        if tuning and everyone and tune_steps is None:
            tune_steps = done
        if done >= pre_steps and (everyone or not tuning):
            break
    for _ in range(args.warmup):
        step()
    steps = args.steps or STEPS[args.worker]
    start = time.perf_counter()
    for _ in range(steps):
        step()
    rate = steps * per_step / (time.perf_counter() - start)
    if hvd.rank() == 0:
        state = hvd.autotune_state()
        print(RESULT + json.dumps({"rate": rate, "tune_steps": tune_steps, "settled": state["settled"],
                                   "trials": state["trials"],
                                   "knobs": [state[k] for k in KNOBS]}), flush=True)
    hvd.shutdown()


def run_job(args, workload, autotune):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    for name in ("HVDLITE_AUTOTUNE", "HOROVOD_AUTOTUNE"):
        env.pop(name, None)
    if autotune:
        env["HVDLITE_AUTOTUNE"] = "1"
    cmd = [sys.executable, "-m", "hvdlite.runner", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), "--worker", workload, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--max-tune-steps", str(args.max_tune_steps), "--pre-steps", str(args.pre_steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in out.stdout.splitlines():
        body = line.split(":", 1)[1] if line.startswith("[") else line
        if body.startswith(RESULT):
            return json.loads(body[len(RESULT):])
    raise RuntimeError(f"{workload} job failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["mlp", "small"])
    p.add_argument("--workloads", default="mlp,small")
    p.add_argument("--rounds", type=int, default=4, help="ABBA pairs of jobs per workload")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="measured steps per job (default: "
                   + ", ".join(f"{k} {v}" for k, v in STEPS.items()) + ")")
    p.add_argument("--pre-steps", type=int, default=0, help="steps before the measurement "
                   "(default: " + ", ".join(f"{k} {v}" for k, v in PRE_STEPS.items()) + ")")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tune-steps", type=int, default=20000,
                   help="steps at most before measuring, tuned or not (the small step "
                   "runs ~1000 steps/s on a quiet machine: 0.25 s samples need thousands)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    figures = {}
    for workload in args.workloads.split(","):
        runs = {"defaults": [], "autotune": []}
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)  # ABBA
            for autotune in order:
                res = run_job(args, workload, autotune)
                runs["autotune" if autotune else "defaults"].append(res)
        unit = "samples/s per rank" if workload == "mlp" else "steps/s"
        rates = {k: [res["rate"] for res in v] for k, v in runs.items()}
        ratio = statistics.median(rates["autotune"]) / statistics.median(rates["defaults"])
        figures[workload] = {"unit": unit, "ratio_of_medians": ratio,
                             **{k: {**summary(v), "runs": v} for k, v in rates.items()},
                             "tune_steps": [res["tune_steps"] for res in runs["autotune"]],
                             "chosen": [res["knobs"] for res in runs["autotune"]]}
        print(f"\n{workload}: {args.np} ranks, {args.steps or STEPS[workload]} measured steps per job "
              f"after {args.pre_steps or PRE_STEPS[workload]}, "
              f"{args.rounds} jobs per kind (ABBA), {unit}")
        for kind, v in rates.items():
            s = summary(v)
            print(f"  {kind:9s} median {s['median']:9.1f}  range {s['min']:9.1f} .. {s['max']:9.1f}")
        print(f"  autotune / defaults (medians): {ratio:.3f}")
        print(f"  steps spent tuning: {figures[workload]['tune_steps']}")
        for knobs in figures[workload]["chosen"]:
            print(f"  chosen: fusion {knobs[0] / 2**20:g} MiB, cycle {knobs[1]:g} ms, "
                  f"chunk {knobs[2] // 1024} KiB, hierarchical {knobs[3]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
