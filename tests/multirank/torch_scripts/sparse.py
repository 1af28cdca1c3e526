"""Rank script: sparse gradients. ``sparse_allreduce_async`` against the dense sum of
every rank's tensor (each rank rebuilds all of them from rank and size), and
DistributedOptimizer training of ``Embedding(sparse=True)`` against one process
training on the concatenated batch (plain torch, no hvdlite, computed here).
"""
import copy

import torch
import torch.nn.functional as F

import hvdlite.torch as hvd
from checks import Checks

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()
c = Checks()


def sparse_of(k, seed, shape, sparse_dim, nnz):
    """Rank k's sparse tensor: uncoalesced, with repeated indices within the rank and
    indices shared with other ranks."""
    g = torch.Generator().manual_seed(seed * 100 + k)
    indices = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g)
                           for d in range(sparse_dim)])
    values = torch.randn((nnz,) + tuple(shape[sparse_dim:]), generator=g,
                         dtype=torch.float64)
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False)


# -- sparse_allreduce_async ---------------------------------------------------------------
cases = [((12, 3), 1, lambda k: 5 + k),   # embedding-like rows
         ((6, 7), 2, lambda k: 9 - k),    # element-wise entries
         ((5, 4), 1, lambda k: 0 if k == 0 else 3),  # rank 0 has no entries
         ((4,), 1, lambda k: 0)]          # no entries anywhere
for seed, (shape, sparse_dim, nnz) in enumerate(cases):
    mine = sparse_of(R, seed, shape, sparse_dim, nnz(R))
    dense_sum = sum(sparse_of(k, seed, shape, sparse_dim, nnz(k)).to_dense() for k in range(N))
    for op, label in ((hvd.Sum, "Sum"), (hvd.Average, "Average")):
        handle = hvd.sparse_allreduce_async(mine, f"sp.{seed}.{label}", op)
        got = handle() if seed % 2 else hvd.synchronize(handle)
        c.true(f"sparse {seed} {label} is sparse and coalesced",
               got.is_sparse and got.is_coalesced() and got.sparse_dim() == sparse_dim,
               repr(got))
        c.close(f"sparse {seed} {label}", got.to_dense(),
                dense_sum / (N if op == hvd.Average else 1), 1e-12)
        c.true(f"sparse {seed} {label} polls done", hvd.poll(handle))
# Horovod's call: keywords, the handle called; unnamed calls agree by order.
got = hvd.sparse_allreduce_async(sparse_of(R, 9, (8, 2), 1, 4), op=hvd.Average, name=None)()
c.close("sparse unnamed", got.to_dense(),
        sum(sparse_of(k, 9, (8, 2), 1, 4).to_dense() for k in range(N)) / N, 1e-12)
for bad, op, expect in ((torch.ones(3, 2), hvd.Sum, "sparse COO"),
                        (sparse_of(R, 0, (4, 2), 1, 2), hvd.Max, "Sum or Average")):
    try:
        hvd.sparse_allreduce_async(bad, "bad", op)
        c.true(f"refused {expect}", False, "did not raise")
    except hvd.InvalidArgumentError as e:
        c.true(f"refused {expect}", expect in str(e), str(e))


# -- DistributedOptimizer with sparse gradients -------------------------------------------
VOCAB, CLASSES, STEPS = 30, 4, 6


def bag_model(seed, with_linear):
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(VOCAB, 6 if with_linear else CLASSES, sparse=True)
    return torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(6, CLASSES)}) \
        if with_linear else torch.nn.ModuleDict({"emb": emb})


def logits(model, x):
    h = model["emb"](x).sum(1)
    return model["head"](h) if "head" in model else h


def global_batch(step, rows):
    """Every rank's rows of a step (rows[k] for rank k), the same on every rank."""
    g = torch.Generator().manual_seed(500 + step)
    total = sum(rows)
    # Few distinct ids so that ranks hit the same rows of the table.
    return (torch.randint(0, VOCAB // 2, (total, 3), generator=g),
            torch.randint(0, CLASSES, (total,), generator=g))


def train(make_opt, with_linear, rows_of, distributed, op=hvd.Average, **kwargs):
    """STEPS steps of the mean loss over the global batch; distributed, each rank feeds
    its own rows. Returns the model. With op=Sum each rank's loss is its rows' sum over
    the global count (the ranks' gradients then add up to the global mean's)."""
    model = bag_model(0, with_linear)
    opt = make_opt(model.parameters())
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=op,
                                       **kwargs)
    for step in range(STEPS):
        rows = rows_of(step)
        x, y = global_batch(step, rows)
        opt.zero_grad()
        if distributed:
            start = sum(rows[:R])
            x, y = x[start:start + rows[R]], y[start:start + rows[R]]
            if len(x) == 0:
                # No rows here: the embedding gets no gradient at all on this rank.
                loss = sum(p.sum() * 0 for n, p in model.named_parameters() if "head" in n)
                if not torch.is_tensor(loss):
                    loss = None
            elif op == hvd.Sum:
                loss = F.cross_entropy(logits(model, x), y, reduction="sum") / sum(rows)
            else:
                loss = F.cross_entropy(logits(model, x), y)
        else:
            loss = F.cross_entropy(logits(model, x), y)
        if loss is not None:
            loss.backward()
        opt.step()
    return model


def max_diff(a, b):
    return max(float((p - q).detach().abs().max())
               for p, q in zip(a.parameters(), b.parameters()))


def sparse_adam(params):
    return torch.optim.SparseAdam(list(params), lr=0.05)


def adagrad(params):
    return torch.optim.Adagrad(params, lr=0.1)


def sgd_plain(params):
    """Scale-sensitive (no momentum): a summed gradient where the average is due moves
    the weights N times as far; SparseAdam and Adagrad barely notice the scale."""
    return torch.optim.SGD(params, lr=0.5)


def even(step):
    return [4] * N


def uneven(step):
    """Different batch sizes per rank; the last rank has none at step 3 (after its
    embedding gradient was sparse in earlier steps)."""
    rows = [2 + (k + step) % 3 for k in range(N)]
    if step == 3:
        rows[-1] = 0
    return rows


runs = {
    "sparse_adam": (sparse_adam, False, even, {}),
    "sparse_adam_as_dense": (sparse_adam, False, even, {"sparse_as_dense": True}),
    "sparse_adam_sum_uneven": (sparse_adam, False, uneven, {"op": hvd.Sum}),
    "adagrad_mixed_group": (adagrad, True, even, {"groups": 1}),
    "adagrad_mixed_uneven": (adagrad, True, uneven, {"op": hvd.Sum}),
    "sgd_sparse": (sgd_plain, False, even, {}),
    "sgd_sparse_as_dense": (sgd_plain, False, even, {"sparse_as_dense": True}),
    "sgd_sparse_sum_uneven": (sgd_plain, False, uneven, {"op": hvd.Sum}),
    "sgd_mixed_group": (sgd_plain, True, even, {"groups": 1}),
    "sgd_mixed_uneven": (sgd_plain, True, uneven, {"op": hvd.Sum}),
}
for label, (make_opt, with_linear, rows_of, kwargs) in runs.items():
    reference = train(make_opt, with_linear, rows_of, distributed=False)
    model = train(make_opt, with_linear, rows_of, distributed=True, **kwargs)
    diff = max_diff(model, reference)
    c.info[label] = diff
    c.true(f"{label} equals one process", diff < 1e-5, f"max diff {diff}")
    moved = max_diff(model, bag_model(0, with_linear))
    c.true(f"{label} trained", moved > 1e-3, f"moved {moved}")

# An op with no meaning for gathered entries is refused on every rank.
model = bag_model(0, False)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), op=hvd.Max)
try:
    F.cross_entropy(logits(model, torch.tensor([[1, 2, 3]])), torch.tensor([0])).backward()
    opt.step()
    c.true("sparse Max refused", False, "did not raise")
except ValueError as e:
    c.true("sparse Max refused", "sparse_as_dense" in str(e), str(e))

c.report()
