"""What a reset costs: time from a rank's death to training resuming, the handover of the
last commit to the new world, and a commit, for a model of --mb megabytes.

    hvdliterun -np 3 --min-np 2 --max-np 3 python benchmarks/elastic_reset.py --mb 100

Rank 2 of the first world SIGKILLs itself after --steps commits; rank 0 of the second
world prints one JSON line: death_to_resume_s (the kill to the first step of the new
world), init_s (the kill to hvd.init done in the new world: process start, imports, MPI),
handover_s (finding the newest commit, reading it, broadcasting and loading it, and the
new world's own first save), and commit_s (median of the first world's commits). The
state is the weights plus SGD momentum, so about twice --mb. With --shard 1 or 2 the
optimizer is sharded (one weight matrix: stage 1 gives it to one rank, stage 2 splits it).
"""
import argparse
import json
import os
import signal
import statistics
import time

import torch

import hvdlite.torch as hvd
from hvdlite.elastic import protocol

parser = argparse.ArgumentParser()
parser.add_argument("--mb", type=float, default=4.0, help="model size (float32 weights)")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--shard", type=int, default=0, help="DistributedOptimizer(shard=...)")
parser.add_argument("--stamp", default="/tmp/hvdlite-elastic-reset-kill.txt")
args = parser.parse_args()

hvd.init()
init_done = time.time()
torch.set_num_threads(1)
width = 1024
rows = max(1, int(args.mb * 1024 * 1024 / 4 / width))
model = torch.nn.Linear(width, rows, bias=False)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     shard=args.shard)
state = hvd.elastic.TorchState(model, optimizer, step=0)
first = protocol.generation() == 0
entered = []


@hvd.elastic.run
def train(state):
    resumed = time.time()
    if not first:
        if hvd.rank() != 0:
            return
        with open(args.stamp) as f:
            killed = float(f.read())
        print("HVDLITE_RESULT", json.dumps({
            "mb": args.mb, "state_mb": round(2 * rows * width * 4 / 2**20, 1),
            "death_to_resume_s": round(resumed - killed, 3),
            "init_s": round(init_done - killed, 3),
            "handover_s": round(resumed - entered[0], 3)}), flush=True)
        return
    commits = []
    x = torch.randn(4, width)
    for _ in range(args.steps):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        state.step += 1
        begin = time.perf_counter()
        state.commit()
        commits.append(time.perf_counter() - begin)
    if hvd.rank() == 0:
        print("HVDLITE_RESULT", json.dumps({"commit_s": round(statistics.median(commits), 4)}),
              flush=True)
    time.sleep(0.5)
    if hvd.rank() == 2:
        with open(args.stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()  # the survivors wait here for the dead rank's gradient


entered.append(time.time())
train(state)
