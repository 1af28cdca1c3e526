"""The differentiable torch collectives skip autograd where it would record nothing.

``hvd.allreduce``, ``broadcast``, ``allgather``, ``alltoall``, ``reducescatter`` and the
grouped forms run through a ``torch.autograd.Function`` so that their gradients are
Horovod's; ``Function.apply`` costs a few microseconds a call, as much as a small
collective. With grad mode off, or no tensor argument requiring grad (a loss or metric
averaged every step), only the forward runs (``hvdlite.torch.autograd.run``).

On 2 and 3 ranks, in the torch scripts' shared job: every collective of tensors without
grad gives numpy-computed values, no graph, and no ``apply``; tensors requiring grad go
through ``apply`` and their backward gives Horovod's gradients; under ``torch.no_grad()``
they skip it again.
"""
import pytest

import needs

from harness import describe, share_script, shared_checks

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

SCRIPT = r'''
import torch
from checks import Checks
import hvdlite.torch as hvd
from hvdlite.torch import autograd

torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
c = Checks()

applied = []
FUNCTIONS = (autograd.AllreduceFunction, autograd.BroadcastFunction,
             autograd.AllgatherFunction, autograd.AlltoallFunction,
             autograd.ReducescatterFunction, autograd.GroupedAllreduceFunction)
originals = {f: f.apply for f in FUNCTIONS}
for f in FUNCTIONS:
    def counted(*args, _f=f):
        applied.append(_f.__name__)
        return originals[_f](*args)
    f.apply = counted

def mine(r, n=6):
    return torch.arange(n, dtype=torch.float64) * (r + 1) + r

def untracked(label, got):
    c.true(label + " has no graph", got.grad_fn is None and not got.requires_grad)

# Tensors without grad: the forward alone, the same values.
t = mine(rank)
every = [mine(r) for r in range(size)]
got = hvd.allreduce(t, op=hvd.Sum, name="u.ar")
c.close("allreduce", got, sum(every), 1e-12)
untracked("allreduce", got)
root = size - 1
got = hvd.broadcast(t, root, name="u.bc")
c.close("broadcast", got, every[root], 0)
untracked("broadcast", got)
got = hvd.allgather(t.reshape(2, 3), name="u.ag")
c.close("allgather", got, torch.cat([e.reshape(2, 3) for e in every]), 0)
untracked("allgather", got)
rows = torch.stack([mine(rank, 2) + 10 * k for k in range(size)])
got = hvd.alltoall(rows, name="u.a2a")
c.close("alltoall", got, torch.stack([mine(r, 2) + 10 * rank for r in range(size)]), 0)
untracked("alltoall", got)
full = torch.stack([mine(rank) + k for k in range(size)])
got = hvd.reducescatter(full, op=hvd.Sum, name="u.rs")
c.close("reducescatter", got, sum(mine(r) + rank for r in range(size)).reshape(1, -1), 1e-12)
untracked("reducescatter", got)
got = hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum, name="u.gar")
c.close("grouped allreduce", got[1], 2 * sum(every), 1e-12)
untracked("grouped allreduce", got[0])
c.true("no apply without grad", applied == [], str(applied))

# A tensor requiring grad: through apply, with Horovod's gradients.
w = mine(rank).requires_grad_()
y = hvd.allreduce(w, op=hvd.Sum, name="g.ar")
(y * torch.arange(6, dtype=torch.float64)).sum().backward()
c.close("allreduce grad", w.grad, size * torch.arange(6, dtype=torch.float64), 1e-12)
v = mine(rank).requires_grad_()
hvd.broadcast(v, 0, name="g.bc").sum().backward()
c.close("broadcast grad", v.grad, torch.ones(6, dtype=torch.float64) * (rank == 0), 0)
c.true("apply with grad", applied == ["AllreduceFunction", "BroadcastFunction"], str(applied))

# Under no_grad: the forward alone again.
with torch.no_grad():
    got = hvd.allreduce(w, op=hvd.Sum, name="n.ar")
c.close("allreduce under no_grad", got, sum(every), 1e-12)
untracked("allreduce under no_grad", got)
c.true("no apply under no_grad", len(applied) == 2, str(applied))

# Repeated under their names (hvdlite.torch.repeats): new values, the same dtype and
# shape, through the kept path; another dtype, op, or a tensor requiring grad, the
# whole way again.
from hvdlite.torch import repeats
kept_runs = []
kept_run = repeats.run
def counted_run(*args):
    kept_runs.append(args[5])  # the name
    return kept_run(*args)
repeats.run = counted_run
for step in range(1, 4):
    t = mine(rank) + step
    every = [mine(r) + step for r in range(size)]
    c.close(f"repeat {step} allreduce", hvd.allreduce(t, op=hvd.Sum, name="u.ar"), sum(every), 1e-12)
    c.close(f"repeat {step} broadcast", hvd.broadcast(t, root, name="u.bc"), every[root], 0)
    c.close(f"repeat {step} allgather", hvd.allgather(t.reshape(2, 3), name="u.ag"),
            torch.cat([e.reshape(2, 3) for e in every]), 0)
    rows = torch.stack([mine(rank, 2) + 10 * k + step for k in range(size)])
    c.close(f"repeat {step} alltoall", hvd.alltoall(rows, name="u.a2a"),
            torch.stack([mine(r, 2) + 10 * rank + step for r in range(size)]), 0)
    full = torch.stack([t + k for k in range(size)])
    c.close(f"repeat {step} reducescatter", hvd.reducescatter(full, op=hvd.Sum, name="u.rs"),
            sum(e + rank for e in every).reshape(1, -1), 1e-12)
    inplace = t.clone()
    c.true(f"repeat {step} allreduce_ in place", hvd.allreduce_(inplace, op=hvd.Sum, name="u.ar_") is inplace)
    c.close(f"repeat {step} allreduce_", inplace, sum(every), 1e-12)
    inplace = t.clone()
    c.true(f"repeat {step} broadcast_ in place", hvd.broadcast_(inplace, root, name="u.bc_") is inplace)
    c.close(f"repeat {step} broadcast_", inplace, every[root], 0)
counts = {n: kept_runs.count(n) for n in ("u.ar", "u.bc", "u.ag", "u.a2a", "u.rs", "u.ar_",
                                           "u.bc_")}
c.true("repeats take the kept path", counts == {"u.ar": 3, "u.bc": 3, "u.ag": 3, "u.a2a": 3,
                                                 "u.rs": 3, "u.ar_": 2, "u.bc_": 2}, str(counts))
kept_runs.clear()
c.close("repeat as float32", hvd.allreduce(t.float(), op=hvd.Sum, name="u.ar"), sum(every).float(), 1e-5)
c.close("repeat with Max", hvd.allreduce(t, op=hvd.Max, name="u.ar"), every[-1], 0)
c.close("repeat with a shape", hvd.broadcast(t.reshape(3, 2), root, name="u.bc"), every[root].reshape(3, 2), 0)
got, got_splits = hvd.alltoall(rows, splits=[1] * size, name="u.a2a")  # splits: never kept
c.close("repeat with splits", got, torch.stack([mine(r, 2) + 10 * rank + 3 for r in range(size)]), 0)
c.true("repeat with splits' splits", got_splits.tolist() == [1] * size, str(got_splits))
c.true("others take the whole way", kept_runs == [], str(kept_runs))
applied.clear()
w = mine(rank).requires_grad_()
hvd.allreduce(w, op=hvd.Max, name="u.ar")  # kept, as Max; requiring grad, applied
y = hvd.allreduce(w, op=hvd.Max, name="u.ar")
c.true("a repeat requiring grad is applied", applied == ["AllreduceFunction"] * 2 and y.grad_fn is not None, str(applied))
repeats.run = kept_run

for f in FUNCTIONS:
    del f.apply  # Function's own again
c.report()
hvd.shutdown()
'''

share_script("torch_scripts", (2, 3), "untracked.py", SCRIPT)


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_collectives_skip_autograd_where_it_records_nothing(np_):
    needs.import_or_skip("torch")
    bodies, job = shared_checks("torch_scripts", np_, "untracked.py")
    for r, body in enumerate(bodies):
        assert body["checks"] >= 40, (r, body)
        assert body["failures"] == [], f"rank {r}: {body['failures']}\n" + describe(job)
