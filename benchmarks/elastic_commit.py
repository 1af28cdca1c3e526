"""What an elastic commit costs with a sharded optimizer: time of ``state.commit()`` and
the bytes each rank writes to tmpfs, for an MLP of about 10M float32 parameters and Adam,
unsharded and ``shard=1``/``shard=2``.

    hvdliterun -np 3 python benchmarks/elastic_commit.py --shard 0 1 2 --commits 5

The ranks stand in for an elastic driver's world (its variables point the commits at
/dev/shm) and call the state's world entry themselves, so no death and no driver are
needed. ``--two-hosts`` makes the odd ranks claim another host name, so that each
sharded commit also sends its part to a rank "on another host" (the alltoall a real
multi-host job pays; the bytes still go through this host's shared memory).
Rank 0 prints one JSON line per stage: the median and range of the commits' time (the
slowest rank of each commit) and the bytes of each rank's commit file.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import hvdlite.torch as hvd
from hvdlite.elastic import protocol
from hvdlite.torch import sharded_commit

parser = argparse.ArgumentParser()
parser.add_argument("--shard", type=int, nargs="+", default=[0, 1, 2])
parser.add_argument("--commits", type=int, default=5)
parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 2048, 1024, 1024])
parser.add_argument("--two-hosts", action="store_true")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
rank, size = hvd.rank(), hvd.size()
if args.two_hosts:
    sharded_commit.host_name = lambda: f"host{rank % 2}"
root = tempfile.mkdtemp(prefix="hvdlite-commit-bench-", dir=protocol.default_state_root()) \
    if rank == 0 else None
root = hvd.broadcast_object(root, 0, name="bench.root")


def mlp():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(args.widths, args.widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


for stage in args.shard:
    os.environ[protocol.ENV_JOB] = f"bench-s{stage}"
    os.environ[protocol.ENV_GENERATION] = "0"
    os.environ[protocol.ENV_STATE_DIR] = root
    model = mlp()
    params = sum(p.numel() for p in model.parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                         named_parameters=model.named_parameters(),
                                         shard=stage)
    model(torch.randn(8, args.widths[0])).sum().backward()
    optimizer.step()  # Adam's moments exist (for this rank's part)
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    state._enter_world()  # what hvd.elastic.run does first
    times = []
    for _ in range(args.commits):
        hvd.allreduce(torch.zeros(1), name="bench.align")
        started = time.perf_counter()
        state.commit()
        took = hvd.allreduce(torch.tensor([time.perf_counter() - started]), op=hvd.Max,
                             name="bench.took")
        times.append(float(took[0]))
    file_bytes = hvd.allgather_object(os.path.getsize(state._store.path), name="bench.bytes")
    if rank == 0:
        print("HVDLITE_RESULT", json.dumps({
            "shard": stage, "ranks": size, "two_hosts": args.two_hosts,
            "parameters": params, "commit_s_median": round(statistics.median(times), 3),
            "commit_s_range": [round(min(times), 3), round(max(times), 3)],
            "file_mib_per_rank": [round(b / 2**20, 1) for b in file_bytes]}), flush=True)
    state._store.remove_own()
    hvd.allreduce(torch.zeros(1), name="bench.done")
    del state, optimizer, model

if rank == 0:
    shutil.rmtree(root, ignore_errors=True)
