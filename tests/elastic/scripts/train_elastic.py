"""An elastic training job that records what the tests check, and dies where told.

    train_elastic.py LOG_DIR [--kill WORLD:RANK:STEP:WHERE ...] [--grow-file F --grow-at S]

Each rank appends JSON lines to LOG_DIR/g<world>-r<rank>.jsonl:
  {"ev": "start", ...}    after the world's state was handed over (before any step)
  {"ev": "trained", ...}  after each optimizer step: the step and the sample indices
                          this rank trained on
  {"ev": "saved", ...}    after each save reached host memory: the step count and a
                          digest of the weights and optimizer state that were saved
  {"ev": "done", ...}     after training
WHERE is backward (in the middle of the backward pass), allreduce (gradients in flight
on the others), commit (halfway through writing the commit), handover (while the new
world's state is being handed over) or host (as allreduce, and the rank's wrapper is
killed too: what the launcher sees when the rank's host goes down).
"""
import argparse
import hashlib
import io
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import hvdlite.torch as hvd
from hvdlite.elastic import protocol
from hvdlite.elastic import state as state_module
from hvdlite.elastic import store as store_module

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
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
GEN = protocol.generation()
RANK = hvd.rank()
KILLS = [k.split(":") for k in args.kill]
LOG = open(os.path.join(args.log_dir, f"g{GEN}-r{RANK}.jsonl"), "a", buffering=1)


def kill_here(where, step):
    for world, rank, at, what in KILLS:
        if int(world) == GEN and int(rank) == RANK and int(at) == step and what == where:
            LOG.write(json.dumps({"ev": "kill", "where": where, "step": step,
                                  "time": time.time()}) + "\n")
            if args.death_note:
                open(args.death_note, "w").close()
            if where == "host":  # the rank's wrapper too, as when its host goes down
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def digest(model, optimizer):
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().numpy().tobytes())
    for index, per_param in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(per_param.items()):
            h.update(f"{index}.{key}".encode())
            h.update(value.numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    return h.hexdigest()


# Death in the middle of a commit: the victim writes half of its file, then dies.
_write = store_module.CommitStore.write


def write_or_die(self, writer, commit_id):
    if any(int(w) == GEN and int(r) == RANK and int(at) == step_now[0] and what == "commit"
           for w, r, at, what in KILLS):
        os.makedirs(self.directory, exist_ok=True)
        blob = io.BytesIO()
        writer(blob)
        with open(os.path.join(self.directory, f".tmp-{os.getpid()}-half"), "wb") as f:
            f.write(blob.getbuffer()[:len(blob.getbuffer()) // 2])
        kill_here("commit", step_now[0])
    _write(self, writer, commit_id)


store_module.CommitStore.write = write_or_die

# Death while the new world's state is handed over (after the newest commit was found).
_broadcast_bytes = state_module._broadcast_bytes


def broadcast_or_die(blob, root_rank, name):
    if name == "hvdlite.elastic.handover":
        kill_here("handover", 0)
    return _broadcast_bytes(blob, root_rank, name)


state_module._broadcast_bytes = broadcast_or_die
step_now = [-1]

# Every save that reached the rank's host memory, with the digest of what was saved.
_save = state_module.State.save


def save_and_log(self):
    _save(self)
    if self._store is not None:  # the saves that reach host memory
        LOG.write(json.dumps({"ev": "saved", "step": self.step, "commit": self.commit_id,
                              "digest": digest(model, optimizer)}) + "\n")


state_module.State.save = save_and_log

torch.manual_seed(1234 + RANK)  # different on each rank: the first sync must fix it
data = torch.randn(args.samples, 8, generator=torch.Generator().manual_seed(7))
target = (data.sum(dim=1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(args.samples), shuffle=True, seed=3)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


@hvd.elastic.run
def train(state):
    LOG.write(json.dumps({"ev": "start", "size": hvd.size(), "step": state.step, "pid": os.getpid(),
                          "commit": state.commit_id, "epoch": state.epoch,
                          "processed": sampler.processed_num, "resets": list(resets),
                          "digest": digest(model, optimizer), "time": time.time()}) + "\n")
    while state.epoch < args.epochs:
        indices = list(sampler)  # this rank's share of the epoch's unprocessed samples
        for batch in range(-(-len(indices) // args.batch)):
            step_now[0] = state.step
            mine = indices[batch * args.batch:(batch + 1) * args.batch]
            optimizer.zero_grad()
            hidden = model[1](model[0](data[mine]))
            if any(int(w) == GEN and int(r) == RANK and int(at) == state.step
                   and what == "backward" for w, r, at, what in KILLS):
                hidden.register_hook(lambda g: kill_here("backward", state.step))
            loss = F.cross_entropy(model[2](hidden), target[mine])
            loss.backward()
            kill_here("allreduce", state.step)
            kill_here("host", state.step)
            optimizer.step()
            LOG.write(json.dumps({"ev": "trained", "step": state.step, "epoch": state.epoch,
                                  "indices": mine}) + "\n")
            sampler.record_batch(batch, len(mine))
            state.step += 1
            if RANK == 0 and state.step == args.grow_at and args.grow_file and GEN == 0:
                with open(args.grow_file, "w") as f:
                    f.write(args.grow_hosts + "\n")
                time.sleep(2.0)  # the driver reads the discovery script every second
            time.sleep(args.step_sleep)
            state.commit()
        state.epoch += 1
        sampler.set_epoch(state.epoch)
    return digest(model, optimizer)


final = train(state)
LOG.write(json.dumps({"ev": "done", "size": hvd.size(), "step": state.step,
                      "digest": final}) + "\n")
print("HVDLITE_RESULT", json.dumps({"digest": final, "size": hvd.size()}), flush=True)
