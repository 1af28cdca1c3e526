"""An elastic training job (PyTorch) that records what the tests check, and dies where told.

    train_elastic.py LOG_DIR [--kill WORLD:RANK:STEP:WHERE ...] [--grow-file F --grow-at S]
                     [--process-set evens|fixed] [--shard 1|2] [--weights DIR]

The records and the kill orders are probe.py's. WHERE is, besides probe's, backward (in
the middle of the backward pass) or allreduce (gradients in flight on the others).
With --process-set each step also sums the members' ranks over a process set made at
the start of each world: ``evens`` (the even ranks of that world) or ``fixed`` ([0, 2],
whatever the world's size). With --shard the optimizer is sharded (its digest is of the
consolidated state); with --weights rank 0 saves the model's weights there when the
first world starts (initial.pt) and when training ends (final.pt), for a replay.
"""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.nn.functional as F

import hvdlite.torch as hvd
from probe import Probe

parser = argparse.ArgumentParser()
parser.add_argument("log_dir")
parser.add_argument("--kill", action="append", default=[])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=36)
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--grow-file", help="write this file (the discovery script's input) ...")
parser.add_argument("--grow-at", type=int, default=-1, help="... at this step on rank 0")
parser.add_argument("--grow-hosts", default="localhost:3")
parser.add_argument("--death-note", help="a victim creates this file before it dies")
parser.add_argument("--wrapper-stall", type=float,
                    help="a victim stops its rank wrapper for this many seconds first")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
parser.add_argument("--process-set", choices=["evens", "fixed"])
parser.add_argument("--shard", type=int, default=0)
parser.add_argument("--grow-world", type=int, default=0, help="the world --grow-at counts in")
parser.add_argument("--weights")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
RANK = hvd.rank()
probe = Probe(args.log_dir, args.kill, RANK, args.death_note, args.wrapper_stall)
GEN = probe.gen
pset = None
if args.process_set:  # made anew in every world, as every line of the script
    pset = hvd.add_process_set(range(0, hvd.size(), 2) if args.process_set == "evens"
                               else [0, 2])


def digest(model, optimizer):
    if args.shard:  # the whole state, gathered on rank 0 (collective: every rank calls it)
        optimizer.consolidate_state_dict(to=0)
        whole = digest_of(model, optimizer.state_dict()) if RANK == 0 else None
        return hvd.broadcast_object(whole, 0, name="test.digest")
    return digest_of(model, optimizer.state_dict())


def digest_of(model, optimizer_state):
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().numpy().tobytes())
    for index, per_param in sorted(optimizer_state["state"].items()):
        for key, value in sorted(per_param.items()):
            h.update(f"{index}.{key}".encode())
            h.update(value.numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    return h.hexdigest()


probe.install(lambda state: state.step, lambda: digest(model, optimizer))

torch.manual_seed(1234 + RANK)  # different on each rank: the first sync must fix it
data = torch.randn(args.samples, 8, generator=torch.Generator().manual_seed(7))
target = (data.sum(dim=1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     shard=args.shard)
sampler = hvd.elastic.ElasticSampler(range(args.samples), shuffle=True, seed=3)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


@hvd.elastic.run
def train(state):
    probe.log("start", size=hvd.size(), step=state.step, pid=os.getpid(),
              commit=state.commit_id, epoch=state.epoch, processed=sampler.processed_num,
              resets=list(resets), digest=digest(model, optimizer), time=time.time(),
              pset=pset.ranks if pset else None)
    if args.weights and RANK == 0 and GEN == 0:
        torch.save(model.state_dict(), os.path.join(args.weights, "initial.pt"))
    while state.epoch < args.epochs:
        indices = list(sampler)  # this rank's share of the epoch's unprocessed samples
        for batch in range(-(-len(indices) // args.batch)):
            probe.step_now = state.step
            mine = indices[batch * args.batch:(batch + 1) * args.batch]
            # Before the step: a rank may die once its gradients are out, before "trained".
            probe.log("batch", step=state.step, epoch=state.epoch, indices=mine)
            optimizer.zero_grad()
            hidden = model[1](model[0](data[mine]))
            if probe.ordered("backward", state.step):
                hidden.register_hook(lambda g: probe.kill_here("backward", state.step))
            loss = F.cross_entropy(model[2](hidden), target[mine])
            loss.backward()
            probe.kill_here("allreduce", state.step)
            probe.kill_here("host", state.step)
            optimizer.step()
            pset_sum = None
            if pset is not None and pset.included():
                pset_sum = int(hvd.allreduce(torch.tensor([RANK]), op=hvd.Sum,
                                             name="pset.ranks", process_set=pset)[0])
            probe.log("trained", step=state.step, epoch=state.epoch, indices=mine,
                      pset_sum=pset_sum)
            sampler.record_batch(batch, len(mine))
            state.step += 1
            if (RANK == 0 and state.step == args.grow_at and args.grow_file
                    and GEN == args.grow_world):
                with open(args.grow_file, "w") as f:
                    f.write(args.grow_hosts + "\n")
                time.sleep(2.0)  # the driver reads the discovery script every second
            time.sleep(args.step_sleep)
            state.commit()
        state.epoch += 1
        sampler.set_epoch(state.epoch)
    return digest(model, optimizer)


final = train(state)
if args.weights and RANK == 0:
    torch.save(model.state_dict(), os.path.join(args.weights, "final.pt"))
probe.log("done", size=hvd.size(), step=state.step, digest=final)
print("HVDLITE_RESULT", json.dumps({"digest": final, "size": hvd.size()}), flush=True)
