"""Training throughput against the machine's ceiling.

    python benchmarks/train_throughput.py [--rounds 8] [--steps 60] [--np 2] [--phases]

Same model (an MLP 784-2048-2048-10 by default), same batch per rank (64), synthetic
data, SGD. The configurations run interleaved, round after round, in an order rotated
by one every round (benchmarks/rounds.py: each takes every position once in every
len(configurations) rounds), so that drift in the machine's load hits all of them alike:

  ceiling   N independent single-process trainings side by side, at the same time, with
            no communication: what N ranks could reach if the allreduce were free (the
            contention for cores and memory alone);
  hvdlite   N ranks through hvdlite.torch.DistributedOptimizer (its background thread
            real-time where the kernel permits it: the summary says whether it was);
  bound     the same with ``hvdliterun --bind-to core`` (each rank's threads on its
            share of the cores; the ceiling's processes are left unbound, which is
            their faster way: bound they ran ~2% slower);
  normal    with ``--normal-priority``: hvdlite with HVDLITE_BACKGROUND_REALTIME=0 (its
            background thread at normal priority), for real-time/normal per round;
  DDP       N ranks of torch DDP over gloo;
  single    one process alone.

Samples/sec are measured inside the workers after warm-up steps. The ceiling's workers
start their timed steps together (a file barrier) and keep training untimed until every
one of them is done, so none is timed alone. Every worker uses one compute thread
(``torch.set_num_threads(1)``). Each round prints hvdlite/ceiling and DDP/ceiling (per
rank against per process); the summary gives every round's figure, their median and
range, and the commit that ran (``+dirty`` when the tree had uncommitted changes).
``--no-bound`` leaves the bound configuration out.

Target of issue 19: hvdlite/ceiling median >= 0.85, no round below 0.75.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from rounds import commit, print_commit, rotated, spread

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "THROUGHPUT "
LABELS = {"hvdlite": "hvdlite", "bound": "hvdlite --bind-to core",
          "normal": "hvdlite normal priority", "ddp": "DDP"}


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


def _wait_for_files(paths):
    while not all(os.path.exists(p) for p in paths):
        time.sleep(0.002)


def _thread_stats():
    """tid -> (CPU ns, run-queue ns, minor faults, involuntary switches, voluntary
    switches, i.e. sleeps) of this process's threads, from /proc (Linux)."""
    stats = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, queued, _ = (int(v) for v in f.read().split())
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = {k: int(v) for k, v in (line.split(":") for line in f
                                                   if "ctxt_switches" in line)}
        except (OSError, ValueError):
            continue
        stats[int(tid)] = (run, queued, int(fields[7]), switches["nonvoluntary_ctxt_switches"],
                           switches["voluntary_ctxt_switches"])
    return stats


class Phases:
    """--phases: per-step milliseconds of forward, backward, waiting for the gradients'
    allreduce and the update, and per thread (the training thread; all others, i.e.
    hvdlite's background thread) CPU and run-queue ms, minor page faults, involuntary
    context switches and sleeps (voluntary switches) per step."""

    def __init__(self):
        self.ms = {"forward": 0.0, "backward": 0.0, "wait": 0.0, "update": 0.0}
        self.steps = 0

    def start(self):
        self.before = _thread_stats()

    def stop(self):
        after, main = _thread_stats(), threading.get_native_id()
        per = {"main": [0] * 5, "other": [0] * 5}
        for tid, now in after.items():
            was = self.before.get(tid, (0,) * 5)
            for i in range(5):
                per["main" if tid == main else "other"][i] += now[i] - was[i]
        out = {k: round(v / self.steps, 2) for k, v in self.ms.items()}
        for who, (run, queued, faults, nvcsw, vcsw) in per.items():
            out[who] = {"cpu_ms": round(run / 1e6 / self.steps, 2),
                        "runq_ms": round(queued / 1e6 / self.steps, 2),
                        "minflt": round(faults / self.steps, 1),
                        "nvcsw": round(nvcsw / self.steps, 1),
                        "sleeps": round(vcsw / self.steps, 1)}
        return out


def timed_loop(args, model, opt, x, y, before=None, after=None):
    """Samples/sec over args.steps steps after args.warmup, and the Phases (or None);
    before() runs between the two, after(step) once the timed steps are done (the
    ceiling's barriers)."""
    import torch.nn.functional as F

    phases = None

    def step():
        if phases is None:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            return
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if hasattr(opt, "skip_synchronize"):  # hvdlite: the wait apart from the update
            opt.synchronize()
            t3 = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
        else:
            t3 = t2
            opt.step()
        t4 = time.perf_counter()
        for name, dt in zip(phases.ms, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases.ms[name] += dt * 1e3
        phases.steps += 1

    for _ in range(args.warmup):
        step()
    if args.phases:
        phases = Phases()
        phases.start()
    if before:
        before()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    measured = phases.stop() if phases else None
    if after:
        after(step)
    return args.steps * args.batch / elapsed, measured


def worker_single(args):
    import torch

    torch.set_num_threads(1)
    model, x, y = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    before = after = None
    if args.sync_dir:
        # One of the ceiling's processes: start the timed steps with the others, and
        # keep the core busy until every one has finished its own.
        mine = f"{args.sync_id}"
        peers = range(args.sync_count)
        before = lambda: (open(os.path.join(args.sync_dir, "ready." + mine), "w").close(),
                          _wait_for_files([os.path.join(args.sync_dir, f"ready.{k}")
                                           for k in peers]))
        done = [os.path.join(args.sync_dir, f"done.{k}") for k in peers]

        def after(step):
            open(os.path.join(args.sync_dir, "done." + mine), "w").close()
            while not all(os.path.exists(p) for p in done):
                step()

    rate, phases = timed_loop(args, model, opt, x, y, before, after)
    print(RESULT + json.dumps({"rate": rate, "phases": phases}), flush=True)


def background_realtime():
    """Whether this process's hvdlite background thread runs real-time (SCHED_FIFO): the
    first thread of its name (threads MPI starts from it inherit the name)."""
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "hvdlite-loop":
                return os.sched_getscheduler(int(tid)) & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO
    return False


def worker_hvdlite(args):
    import torch

    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model, x, y = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rate, phases = timed_loop(args, model, opt, x, y)
    rates = hvd.allgather_object(rate)
    phases = hvd.allgather_object(phases)
    realtime = all(hvd.allgather_object(background_realtime()))
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"rates": rates, "phases": phases, "realtime": realtime}), flush=True)


def worker_ddp(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, x, y = build(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    rate, _ = timed_loop(args, ddp, opt, x, y)
    rates = [None] * dist.get_world_size()
    dist.all_gather_object(rates, rate)
    if dist.get_rank() == 0:
        print(RESULT + json.dumps({"rates": rates}), flush=True)
    dist.destroy_process_group()


# Every worker gets a session of its own, as hvdliterun gives each rank: with the
# kernel's autogroup scheduling, CPU time is shared between sessions first, so workers
# sharing the benchmark's session would get less of a loaded machine than the ranks.
_SESSION = {"start_new_session": True}


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
            "--warmup", str(args.warmup)] + (["--phases"] if args.phases else [])


def run_single(args):
    out = subprocess.run(_worker_args(args, "single"), capture_output=True, text=True,
                         env=_env(), timeout=args.timeout, check=True, **_SESSION)
    res = _parse(out.stdout)
    return [res["rate"]], [res["phases"]]


def run_ceiling(args):
    """args.np single-process trainings at the same time, no communication."""
    with tempfile.TemporaryDirectory(prefix="hvdlite-ceiling-") as sync:
        procs = [subprocess.Popen(_worker_args(args, "single") + [
                     "--sync-dir", sync, "--sync-id", str(k), "--sync-count", str(args.np)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                     **_SESSION)
                 for k in range(args.np)]
        outs = [p.communicate(timeout=args.timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("ceiling run failed:\n" + "\n".join(e[-3000:] for _, e in outs))
    results = [_parse(out) for out, _ in outs]
    return [r["rate"] for r in results], [r["phases"] for r in results]


# Per hvdlite configuration, per run: whether every rank's background thread was real-time.
hvdlite_realtime = {}


def run_hvdlite(args, launcher_flags=(), variables=None, kind="hvdlite"):
    cmd = [sys.executable, "-m", "hvdlite.runner", "-np", str(args.np), *launcher_flags] + \
        _worker_args(args, "hvdlite")
    env = {**_env(), **(variables or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if out.returncode:
        raise RuntimeError(f"hvdlite run failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    res = _parse(out.stdout)
    hvdlite_realtime.setdefault(kind, []).append(res["realtime"])
    return res["rates"], res["phases"]


def run_bound(args):
    return run_hvdlite(args, ["--bind-to", "core"], kind="bound")


def run_normal(args):
    return run_hvdlite(args, variables={"HVDLITE_BACKGROUND_REALTIME": "0"}, kind="normal")


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
                                      stderr=subprocess.PIPE, text=True, env=env,
                                      **_SESSION))
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    if any(p.returncode for p in procs):
        # gloo now and then aborts in its teardown ("terminate called without an active
        # exception") after the workers have reported: keep a complete report, say so.
        if RESULT in outs[0][0]:
            print("    (a DDP worker exited with code "
                  f"{[p.returncode for p in procs]} after reporting its rate)", flush=True)
        else:
            raise RuntimeError("DDP run failed:\n" + "\n".join(e[-3000:] for _, e in outs))
    return _parse(outs[0][0])["rates"], []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["single", "hvdlite", "ddp"])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--layers", default="784-2048-2048-10")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-bound", action="store_true",
                        help="leave out hvdlite with --bind-to core")
    parser.add_argument("--normal-priority", action="store_true",
                        help="also run hvdlite with its background thread at normal priority "
                             "(HVDLITE_BACKGROUND_REALTIME=0)")
    parser.add_argument("--phases", action="store_true",
                        help="also print, per process, ms per step of forward, backward, "
                             "waiting for the allreduce and the update, and per thread CPU "
                             "and run-queue ms, page faults, involuntary switches and sleeps")
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    parser.add_argument("--sync-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sync-count", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        {"single": worker_single, "hvdlite": worker_hvdlite, "ddp": worker_ddp}[args.worker](args)
        return

    print_commit()
    family = [("hvdlite", run_hvdlite)] + ([] if args.no_bound else [("bound", run_bound)]) + \
        ([("normal", run_normal)] if args.normal_priority else [])
    kinds = [("ceiling", run_ceiling)] + family + [("ddp", run_ddp), ("single", run_single)]
    runs = {kind: [] for kind, _ in kinds}
    ratios = {kind: [] for kind in ("hvdlite", "bound", "normal", "ddp") if kind in runs}
    for round_ in range(args.rounds):
        for kind, fn in rotated(kinds, round_):
            rates, phases = fn(args)
            runs[kind].append(statistics.mean(rates))
            print(f"round {round_ + 1}/{args.rounds} {kind:8s} samples/sec per rank: "
                  + ", ".join(f"{r:.1f}" for r in rates), flush=True)
            for k, p in enumerate(p for p in phases if p):
                print(f"    {kind} process {k}: " + json.dumps(p), flush=True)
        for kind in ratios:
            ratios[kind].append(runs[kind][-1] / runs["ceiling"][-1])
        print(f"round {round_ + 1}/{args.rounds} "
              + "  ".join(f"{LABELS[kind]}/ceiling {r[-1]:.3f}" for kind, r in ratios.items()),
              flush=True)

    median = {kind: statistics.median(rates) for kind, rates in runs.items()}
    summary = {
        "commit": commit(), "order": "rotated by one every round",
        "model": args.layers, "batch_per_rank": args.batch, "np": args.np,
        "rounds": args.rounds, "steps": args.steps,
        "ceiling_samples_per_sec_per_process": median["ceiling"],
        "single_samples_per_sec": median["single"],
        "hvdlite_samples_per_sec_per_rank": median["hvdlite"],
        "hvdlite_samples_per_sec_total": median["hvdlite"] * args.np,
        "ddp_samples_per_sec_per_rank": median["ddp"],
        "ddp_samples_per_sec_total": median["ddp"] * args.np,
        "hvdlite_over_ceiling_per_round": ratios["hvdlite"],
        "ddp_over_ceiling_per_round": ratios["ddp"],
        "hvdlite_over_ceiling_median": statistics.median(ratios["hvdlite"]),
        "ddp_over_ceiling_median": statistics.median(ratios["ddp"]),
        "hvdlite_over_ddp": median["hvdlite"] / median["ddp"],
        "hvdlite_over_ddp_per_round": [h / d for h, d in zip(runs["hvdlite"], runs["ddp"])],
        "samples_per_sec_per_round": runs,
        "background_realtime_runs": {kind: f"{sum(r)}/{len(r)}" for kind, r in hvdlite_realtime.items()},
        "hvdlite_scaling_efficiency": median["hvdlite"] / median["single"],
        "ddp_scaling_efficiency": median["ddp"] / median["single"],
    }
    # Two hvdlite configurations against each other, round by round.
    pairs = [(a, b, label) for a, b, label in (("bound", "hvdlite", "bound/unbound hvdlite"),
                                               ("hvdlite", "normal", "real-time/normal hvdlite"))
             if a in runs and b in runs]
    for kind in ("bound", "normal"):
        if kind in runs:
            summary.update({
                f"{kind}_samples_per_sec_per_rank": median[kind],
                f"{kind}_over_ceiling_per_round": ratios[kind],
                f"{kind}_over_ceiling_median": statistics.median(ratios[kind]),
            })
    for a, b, _ in pairs:
        summary[f"{a}_over_{b}_per_round"] = [x / y for x, y in zip(runs[a], runs[b])]
    print(f"\nmodel {args.layers}, batch {args.batch} per rank, {args.np} ranks, "
          f"{args.steps} timed steps, medians of {args.rounds} rotated rounds, commit {commit()}")
    for kind in runs:
        print(f"  {kind:8s} samples/sec per rank (process): " + spread(runs[kind], "{:.1f}"))
    print(f"  ceiling ({args.np} independent) {median['ceiling']:9.1f} samples/sec per process")
    print(f"  hvdlite {args.np} ranks         {median['hvdlite']:9.1f} samples/sec per rank")
    if "bound" in runs:
        print(f"  hvdlite --bind-to core  {median['bound']:9.1f} samples/sec per rank")
    if "normal" in runs:
        print(f"  hvdlite normal priority {median['normal']:9.1f} samples/sec per rank")
    print(f"  DDP gloo {args.np} ranks        {median['ddp']:9.1f} samples/sec per rank")
    print(f"  1 process alone         {median['single']:9.1f} samples/sec")
    for kind, r in ratios.items():
        label = f"{LABELS[kind]}/ceiling"
        print(f"  {label:31s} " + spread(r)
              + ("  (target: median >= 0.85, none below 0.75)" if kind == "hvdlite" else ""))
    for a, b, label in pairs:
        r = summary[f"{a}_over_{b}_per_round"]
        print(f"  {label:31s} " + spread(r))
    for kind, flags in hvdlite_realtime.items():
        print(f"  background thread, {LABELS[kind]}: " + (
            "real-time (SCHED_FIFO) in every run" if all(flags) else
            "normal priority in every run" if not any(flags) else
            f"real-time in {sum(flags)} of {len(flags)} runs"))
    print(f"  hvdlite / DDP     {summary['hvdlite_over_ddp']:.2f}x (of the medians); per round "
          + spread(summary["hvdlite_over_ddp_per_round"], "{:.2f}"))
    print(f"  scaling vs 1 process: hvdlite {summary['hvdlite_scaling_efficiency']:.0%}, "
          f"DDP {summary['ddp_scaling_efficiency']:.0%}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
