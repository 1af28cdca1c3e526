"""Rank script: DistributedOptimizer against single-process training, plus state helpers.

Every section compares with plain torch computed in this process on the concatenated
batch of all ranks (the single-process reference, no hvdlite involved). Results go out
as one ``HVDLITE_RESULT`` line: {"failures": [...], "info": {...}}.
"""
import copy
import json
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import hvdlite.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
failures = []
info = {}
SECTIONS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["all"]
STEPS, B = 20, 8


def wanted(section):
    return "all" in SECTIONS or section in SECTIONS


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def batch(step, rows):
    """The global batch of a step: N * rows samples, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(N * rows, 10, generator=g)
    y = torch.randint(0, 3, (N * rows,), generator=g)
    return x, y


def max_diff(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def train_reference(make_opt, clip=None):
    model = make_model(0)
    opt = make_opt(model.parameters())
    for step in range(STEPS):
        x, y = batch(step, B)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def train_distributed(make_opt, passes=1, clip=None, **kwargs):
    model = make_model(100 + R)  # different on every rank until broadcast
    if kwargs.get("groups") == "lists":
        params = list(model.parameters())
        kwargs["groups"] = [params[:3], params[3:5]]  # the last one goes alone
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # Root's initial weights are make_model(100): give every rank the reference's
    # instead, through the root, to test broadcast_parameters on real values.
    if R == 0:
        model.load_state_dict(make_model(0).state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        x, y = batch(step, B)
        mine = slice(R * B, (R + 1) * B)
        x, y = x[mine], y[mine]
        opt.zero_grad()
        micro = B // passes
        for k in range(passes):
            part = slice(k * micro, (k + 1) * micro)
            (F.cross_entropy(model(x[part]), y[part]) / passes).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return model


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def sgd_plain(params):
    """No momentum, no decay: the update is lr times the gradient, so a gradient summed
    instead of averaged (or divided twice) moves the weights N times as far. Adam (and
    Adagrad, SparseAdam) would take nearly the same step at any scale of the gradient."""
    return torch.optim.SGD(params, lr=0.1)


def compare(label, make_opt, tol=2e-5, ref_kwargs=None, **kwargs):
    ref = train_reference(make_opt, **(ref_kwargs or {}))
    dist = train_distributed(make_opt, **kwargs)
    diff = max_diff(ref, dist)
    info[label] = diff
    if not diff <= tol:
        failures.append(f"{label}: parameters differ from single-process training by "
                        f"{diff:.3g} (> {tol})")
    return diff


if wanted("equivalence"):
    compare("sgd_momentum", sgd)
    compare("adam", adam)
    compare("sgd_passes2", sgd, passes=2)
    compare("adam_passes2", adam, passes=2)
    compare("sgd_groups2", sgd, groups=2)
    compare("adam_groups_lists", adam, groups="lists")
    compare("sgd_predivide", sgd, gradient_predivide_factor=2.0)
    compare("sgd_clip", sgd, clip=0.5, ref_kwargs={"clip": 0.5})
    # fp16 on the wire: close to, not equal to, the uncompressed run.
    fp16 = compare("adam_fp16", adam, tol=5e-3, compression=hvd.Compression.fp16)
    bf16 = compare("adam_bf16", adam, tol=5e-2, compression=hvd.Compression.bf16)
    # The same paths with the scale-sensitive optimizer.
    compare("sgd_plain", sgd_plain)
    compare("sgd_plain_groups_lists", sgd_plain, groups="lists")
    compare("sgd_plain_fp16", sgd_plain, tol=1e-3, compression=hvd.Compression.fp16)
    compare("sgd_plain_bf16", sgd_plain, tol=5e-3, compression=hvd.Compression.bf16)

if wanted("optimizer_state"):
    def state_of(opt):
        sd = opt.state_dict()
        return {"groups": [{k: v for k, v in g.items()} for g in sd["param_groups"]],
                "state": {i: {k: (v.tolist() if torch.is_tensor(v) else v)
                              for k, v in s.items()} for i, s in sd["state"].items()}}

    # Ranks with different histories and hyper-parameters end up with the root's.
    for root in (0, N - 1):
        for make in (lambda p: torch.optim.Adam(p, lr=0.01 * (R + 1), betas=(0.9, 0.99 - R / 100)),
                     lambda p: torch.optim.SGD(p, lr=0.1 + R, momentum=0.5)):
            model = make_model(R)
            opt = make(model.parameters())
            # The root has state; rank 1 (when it is not the root) has none yet.
            local_steps = 0 if (R == 1 and root != 1) else R + 1
            for step in range(local_steps):
                x, y = batch(step + 50 * R, B)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            hvd.broadcast_optimizer_state(opt, root_rank=root)
            states = hvd.allgather_object(state_of(opt))
            if any(s != states[root] for s in states):
                failures.append(f"broadcast_optimizer_state root {root} "
                                f"{type(opt).__name__}: states differ")
            if not states[root]["state"]:
                failures.append("broadcast_optimizer_state: the root had no state")
    # A fresh root leaves every optimizer fresh (as a single process would start).
    model = make_model(R)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if R != 0:
        x, y = batch(0, B)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if len(opt.state) != 0:
        failures.append(f"broadcast_optimizer_state from a fresh root left {len(opt.state)} "
                        "state entries")
    # Horovod's case of a parameter that never gets a gradient (requires_grad False) in
    # a fresh DistributedOptimizer: it keeps None; the other gets a zero gradient.
    index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
    table = torch.nn.Parameter(torch.rand(4) + R)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([index, table], lr=0.001, weight_decay=1e-6, momentum=0.9,
                        nesterov=True),
        named_parameters=[("index", index), ("table", table)])
    hvd.broadcast_parameters({"index": index, "table": table}, root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grads = hvd.allgather_object(None if table.grad is None else table.grad.tolist())
    if index.grad is not None or opt.state or grads != [[0.0] * 4] * N:
        failures.append(f"broadcast_optimizer_state without gradients: {index.grad}, {grads}")
    # SparseAdam's zero gradients are sparse.
    emb = torch.nn.Embedding(5, 2, sparse=True)
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1 * (R + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if (opt.param_groups[0]["lr"] != 0.1 or not emb.weight.grad.is_sparse
            or emb.weight.grad._nnz() != 0):
        failures.append(f"broadcast_optimizer_state SparseAdam: {emb.weight.grad}")
    # Works on a DistributedOptimizer too (no step is taken, so no collective hangs).
    model = make_model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * (R + 1)),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if opt.param_groups[0]["lr"] != 0.1:
        failures.append(f"broadcast_optimizer_state: lr {opt.param_groups[0]['lr']}")

if wanted("unused"):
    # A layer used only on rank 0, and one used nowhere: step() must not hang.
    torch.manual_seed(0)
    trunk = torch.nn.Linear(4, 4)
    branch = torch.nn.Linear(4, 4)
    never = torch.nn.Linear(4, 4)
    model = torch.nn.ModuleDict({"trunk": trunk, "branch": branch, "never": never})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.ones(2, 4) * (R + 1)
    t0 = time.monotonic()
    for step in range(3):
        opt.zero_grad()
        if R == 0:
            # branch's gradient on rank 0 before the average, from copies without hooks:
            # the real gradient is averaged in place, possibly before backward() returns.
            trunk_copy, branch_copy = copy.deepcopy(trunk), copy.deepcopy(branch)
            branch_copy(trunk_copy(x)).sum().backward()
            local = branch_copy.weight.grad
        else:
            local = None
        out = trunk(x)
        if R == 0:
            out = branch(out)
        out.sum().backward()
        opt.step()
    info["unused_seconds"] = time.monotonic() - t0
    ref_local = hvd.broadcast_object(local, root_rank=0)
    if not torch.allclose(branch.weight.grad, ref_local / N, atol=1e-6):
        failures.append("unused parameter: branch grad is not rank 0's grad / size")
    if never.weight.grad is None or never.weight.grad.abs().max() != 0:
        failures.append("parameter unused everywhere: expected a zero gradient")

if wanted("overlap"):
    # Several layers; each gradient hook of the test sleeps to stand for a slow layer.
    torch.manual_seed(0)
    layers = [torch.nn.Linear(128, 128) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    names = {p: n for n, p in model.named_parameters()}
    events = []

    def record(p):
        # Runs after DistributedOptimizer's own hook for p (hooks run in order).
        if len(events) == len(names) - 1 and events[0]["enqueued"]:
            # The last gradient: the earlier ones, enqueued during backward, can have
            # been reduced by now. Whether they have, after the sleeps below, depends on
            # when the peer's backward is scheduled; so wait for a collective here (a
            # core that runs nothing before step() times out and fails the check below).
            deadline = time.monotonic() + 30
            while (hvd.stats()["collectives"] <= events[0]["collectives"]
                   and time.monotonic() < deadline):
                time.sleep(0.005)
        s = hvd.stats()
        events.append({"name": names[p], "t": time.perf_counter(),
                       "enqueued": opt._unit_of[p] in opt._handles,
                       "collectives": s["collectives"], "tensors": s["tensors"]})
        time.sleep(0.01)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(record)
    x = torch.randn(32, 128)
    for step in range(2):
        events.clear()
        opt.zero_grad()
        before = hvd.stats()
        t_start = time.perf_counter()
        model(x).pow(2).mean().backward()
        t_end = time.perf_counter()
        opt.step()
    first, last = events[0], events[-1]
    info["overlap"] = {
        "order": [e["name"] for e in events],
        "first_hook_ms": (first["t"] - t_start) * 1e3,
        "backward_ms": (t_end - t_start) * 1e3,
        "collectives_before_backward": before["collectives"],
        "collectives_at_first_hook": first["collectives"],
        "collectives_at_last_hook": last["collectives"],
        "tensors_done_at_last_hook": last["tensors"] - before["tensors"],
    }
    if not first["enqueued"] or first["t"] >= t_end:
        failures.append("overlap: the first gradient was not enqueued during backward")
    if not first["name"].startswith("5."):
        failures.append(f"overlap: first gradient ready was {first['name']}, expected the "
                        "last layer's")
    if last["collectives"] <= first["collectives"]:
        failures.append("overlap: no collective ran before the last gradient was ready "
                        f"({info['overlap']})")

if wanted("mismatch"):
    # Ranks whose models differ: step() raises on every rank, no rank hangs.
    model = torch.nn.Linear(4, 3 + R)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 4)).sum().backward()
    try:
        opt.step()
        failures.append("mismatch: step() did not raise")
    except hvd.HorovodInternalError as e:
        info["mismatch_error"] = f"{type(e).__name__}: {e}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hvd.allreduce(torch.ones(2, dtype=torch.float32 if R == 0 else torch.float64),
                          name="mismatch.dtype")
            failures.append("mismatch: dtype mismatch did not raise")
        except hvd.MismatchError as e:
            info["dtype_mismatch_error"] = str(e)
    # The core goes on after a failed op.
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after.mismatch")
    if float(total) != N:
        failures.append(f"after mismatch: allreduce gave {float(total)}")

print("HVDLITE_RESULT", json.dumps({"failures": failures, "info": info}))
