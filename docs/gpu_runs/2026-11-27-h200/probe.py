"""Where the 1-rank grouped allreduce of 200 x 16 KiB spends its time (issue 36 probe)."""
import cProfile, io, os, pstats, statistics, sys, time
import torch
import hvdlite.torch as hvd
from hvdlite import handle as H, core

hvd.init(); torch.set_num_threads(1)
dev = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else None
cuda = dev == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
orig = H._wait_slices
marks = []
def ws(*a):
    r = orig(*a); marks.append(time.perf_counter()); return r
H._wait_slices = ws

def nccl_us():
    s = core.stats(); s = s if isinstance(s, dict) else vars(s)
    return s.get("nccl_us", 0)

def run(n, reps, tag):
    tensors = [torch.rand(int(os.environ.get("NUMEL", 4096)), device=dev) for _ in range(n)]
    res = []
    for i in range(reps + 20):
        sync(); marks.clear()
        c0 = nccl_us()
        t0 = time.perf_counter()
        h = hvd.grouped_allreduce_async_(tensors, op=hvd.Average, name=f"{tag}.{n}")
        t1 = time.perf_counter()
        hvd.synchronize(h)
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        if i >= 20:
            res.append((t1 - t0, marks[0] - t1, marks[-1] - marks[0], t3 - t2, t3 - t0, (nccl_us() - c0) * 1e-6))
    names = ["enqueue", "first wait", "other waits", "final sync", "total", "core part"]
    print(f"{dev} n={n}: " + ", ".join(f"{nm} {statistics.median(r[k] for r in res)*1e6:.0f}" for k, nm in enumerate(names)) + " us", flush=True)

for n in [int(x) for x in os.environ.get("NS", "1,20,200").split(",")]:
    run(n, int(os.environ.get("REPS", 100)), "p")
if os.environ.get("ONLY"): sys.exit(0)
ev = []
for _ in range(200):
    t0 = time.perf_counter()
    if cuda:
        e = torch.cuda.Event(); e.record()
    ev.append(time.perf_counter() - t0)
print(f"event create+record {statistics.median(ev)*1e6:.1f} us", flush=True)
tensors = [torch.rand(int(os.environ.get("NUMEL", 4096)), device=dev) for _ in range(200)]
pr = cProfile.Profile(); pr.enable()
for _ in range(50):
    hvd.synchronize(hvd.grouped_allreduce_async_(tensors, op=hvd.Average, name="prof"))
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue()[:4000], flush=True)
if out:
    hvd.start_timeline(os.path.join(out, f"timeline_{dev}.json"), mark_cycles=True)
    for _ in range(5):
        sync(); hvd.synchronize(hvd.grouped_allreduce_async_(tensors, op=hvd.Average, name="tl"))
    sync(); time.sleep(0.2)
    hvd.stop_timeline()
