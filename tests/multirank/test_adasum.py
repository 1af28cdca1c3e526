"""hvd.Adasum on 2, 3 and 4 real ranks against an independent numpy implementation.

The reference below is written from Adasum's definition alone: two vectors combine as
a * (1 - a.b / (2 |a|^2)) + b * (1 - a.b / (2 |b|^2)); ranks combine along recursive
doubling (r with r+1, then pairs at distance 2, 4, ...), ranks past the largest power
of two p first folding into rank r - p; dot products per tensor. It is evaluated
recursively (a tree of sub-ranges), not with the library's level loop.
"""
import pytest

import needs

from harness import assert_body_passed, run_bodies

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

PRELUDE = r'''
import json
import numpy as np
import hvdlite as hvd
from hvdlite import errors

hvd.init()
rank, size = hvd.rank(), hvd.size()
failures = []


def pair(a, b):
    dot = np.sum(a * b)
    na, nb = np.sum(a * a), np.sum(b * b)
    ca = 1.0 if na == 0.0 else 1.0 - dot / (2.0 * na)
    cb = 1.0 if nb == 0.0 else 1.0 - dot / (2.0 * nb)
    return ca * a + cb * b


def tree(vs):
    """Adasum of a power-of-two list: both halves first, then the pair."""
    if len(vs) == 1:
        return vs[0]
    half = len(vs) // 2
    return pair(tree(vs[:half]), tree(vs[half:]))


def reference(vs):
    vs = [np.asarray(v, np.float64) for v in vs]
    p = 2 ** int(np.floor(np.log2(len(vs))))
    folded = [pair(vs[r], vs[r + p]) if r + p < len(vs) else vs[r] for r in range(p)]
    return tree(folded)


def data(r, i, shape):
    rng = np.random.default_rng([r, i, 7])
    return rng.standard_normal(shape)


def check(label, got, expected, tol):
    got = np.asarray(got, np.float64)
    if got.shape != np.shape(expected) or not np.allclose(got, expected, rtol=tol, atol=tol):
        failures.append(f"{label}: got {got.ravel()[:6].tolist()}..., expected "
                        f"{np.ravel(expected)[:6].tolist()}...")
'''

NUMPY_BODY = r'''
# The reference is not a plain sum or mean (else this test could not tell).
a, b = np.array([1.0, 0.0]), np.array([1.0, 1.0])
assert np.allclose(pair(a, b), [1.25, 0.75]) and np.allclose(pair(a, a), a)

for dt, tol in ((np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 2e-2)):
    for i, shape in enumerate([(7,), (3, 4), ()]):
        x = data(rank, i, shape).astype(dt)
        got = hvd.allreduce(x, op=hvd.Adasum, name=f"ada.{np.dtype(dt).name}.{i}")
        if got.dtype != dt:
            failures.append(f"dtype {got.dtype} != {dt}")
        exp = reference([data(r, i, shape).astype(dt).astype(np.float64)
                         for r in range(size)])
        check(f"adasum {np.dtype(dt).name} {shape}", got, exp, tol)
        if size > 1 and np.allclose(exp, np.sum([data(r, i, shape) for r in range(size)], 0)):
            failures.append("reference equals the sum: inputs too weak")

# prescale and postscale
x = data(rank, 5, (6,))
got = hvd.allreduce(x, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0)
check("scaled", got, 3.0 * reference([0.5 * data(r, 5, (6,)) for r in range(size)]), 1e-12)

# grouped: each tensor has its own dot products (not one over the fused buffer)
xs = [data(rank, 10, (5,)), 100.0 * data(rank, 11, (2, 2))]
got = hvd.grouped_allreduce(xs, op=hvd.Adasum, name="ada.group")
for k, (i, scale, shape) in enumerate(((10, 1.0, (5,)), (11, 100.0, (2, 2)))):
    check(f"grouped {k}", got[k], reference([scale * data(r, i, shape) for r in range(size)]),
          1e-12)
fused = reference([np.concatenate([data(r, 10, (5,)), 100.0 * data(r, 11, (4,))])
                   for r in range(size)])
if size > 1 and np.allclose(np.concatenate([got[0], got[1].ravel()]), fused):
    failures.append("grouped Adasum equals the fused-buffer Adasum")

# orthogonal vectors add up; equal vectors stay as they are
e = np.zeros(size * 2)
e[rank] = 1.0
check("orthogonal", hvd.allreduce(e, op=hvd.Adasum, name="ortho"),
      np.r_[np.ones(size), np.zeros(size)], 1e-12)
same = np.arange(4.0) + 1
check("equal", hvd.allreduce(same, op=hvd.Adasum, name="same"), same, 1e-12)

# integers are refused (as in Horovod), and so is Adasum outside allreduce
for label, call in (("int", lambda: hvd.allreduce(np.ones(3, np.int32), op=hvd.Adasum)),
                    ("reducescatter", lambda: hvd.reducescatter(np.ones((size, 2)),
                                                                op=hvd.Adasum))):
    try:
        call()
        failures.append(f"{label}: Adasum was not refused")
    except errors.InvalidArgumentError:
        pass
'''

TORCH_BODY = r'''
import torch
import hvdlite.torch as thvd
torch.set_num_threads(1)

x = torch.from_numpy(data(rank, 0, (3, 5))).float()
got = thvd.allreduce(x, op=thvd.Adasum, name="t.ada")
check("torch adasum", got.double().numpy(),
      reference([data(r, 0, (3, 5)).astype(np.float32) for r in range(size)]), 1e-5)
inplace = torch.from_numpy(data(rank, 1, (4,)))
thvd.allreduce_(inplace, op=thvd.Adasum, name="t.ada.inplace")
check("torch adasum in place", inplace.numpy(), reference([data(r, 1, (4,)) for r in range(size)]),
      1e-12)

# DistributedOptimizer(op=Adasum): each rank steps SGD on its own gradient; the
# parameter updates combine with Adasum, per parameter.
torch.manual_seed(0)
model = torch.nn.Linear(4, 2).double()
thvd.broadcast_parameters(model.state_dict(), root_rank=0)
start = {n: p.detach().clone().numpy() for n, p in model.named_parameters()}
opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), op=thvd.Adasum)


def batch(r, step):
    return data(r, 100 + step, (3, 4)), data(r, 200 + step, (3, 2))


def local_grads(params, r, step):
    xb, yb = batch(r, step)
    w, b = params["weight"], params["bias"]
    err = xb @ w.T + b - yb            # loss = mean over elements of err**2
    g = 2.0 * err / err.size
    return {"weight": g.T @ xb, "bias": g.sum(0)}


params = dict(start)
for step in range(3):
    xb, yb = batch(rank, step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(torch.from_numpy(xb)), torch.from_numpy(yb))
    loss.backward()
    opt.step()
    updates = {n: [-0.1 * local_grads(params, r, step)[n] for r in range(size)]
               for n in params}
    params = {n: params[n] + reference(updates[n]) for n in params}
for n, p in model.named_parameters():
    check(f"adasum optimizer {n}", p.detach().numpy(), params[n], 1e-10)
'''


TF_BODY = r'''
import tensorflow as tf
import hvdlite.tensorflow as hvd_tf

for i, shape in enumerate([(5,), (3, 4)]):
    vs = [data(r, i, shape) for r in range(size)]
    expected = reference(vs)
    mine = tf.constant(vs[rank])
    check(f"tf eager {shape}", hvd_tf.allreduce(mine, name=f"tf.e{i}", op=hvd_tf.Adasum).numpy(),
          expected, 1e-10)
    graph = tf.function(lambda t, i=i: hvd_tf.allreduce(t, name=f"tf.g{i}", op=hvd_tf.Adasum))
    check(f"tf function {shape}", graph(mine).numpy(), expected, 1e-10)
'''


# One job per rank count runs every body of that count (harness.run_bodies: the ranks
# start, and import torch and TensorFlow, once), each reported by name; a framework
# that is not installed leaves its bodies out (their tests skip, or fail in CI).
_jobs = {}


def _assert_passed(np_, name):
    if np_ not in _jobs:
        bodies = {"numpy": NUMPY_BODY}
        if np_ in (2, 3) and needs.installed("tensorflow"):
            bodies["tensorflow"] = TF_BODY
        if np_ in (2, 3) and needs.installed("torch"):
            bodies.update(torch=TORCH_BODY, stability=STABILITY_BODY)
        _jobs[np_], _ = run_bodies(np_, bodies, prelude=PRELUDE, timeout=280)
    assert_body_passed(_jobs[np_], name)


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_numpy_adasum_matches_the_reference(np_):
    _assert_passed(np_, "numpy")


@pytest.mark.parametrize("np_", [2, 3])
def test_tensorflow_adasum_allreduce(np_):
    needs.import_or_skip("tensorflow")
    _assert_passed(np_, "tensorflow")


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_adasum_and_distributed_optimizer(np_):
    needs.import_or_skip("torch")
    _assert_passed(np_, "torch")


STABILITY_BODY = r'''
# Horovod's stability tests: every rank's vector is a multiple of one vector whose
# entries are near the smallest normal number of the type (or, second case, multiples
# spanning tiny to sqrt(max)). Adasum of parallel vectors is their mean, pair by pair
# along the tree: the expectation is that tree of means, taken here of the scalars.
import torch
torch.set_num_threads(1)
import hvdlite.torch as hvd_torch


def tree_of_means(values):
    v = list(values)
    p = 2 ** int(np.floor(np.log2(len(v))))
    for r in range(p, len(v)):
        v[r - p] = (v[r - p] + v[r]) / 2
    distance = 1
    while distance < p:
        for r in range(0, p, 2 * distance):
            v[r] = (v[r] + v[r + distance]) / 2
        distance *= 2
    return v[0]


for dt in (np.float16, np.float32, np.float64):
    tiny, huge = float(np.finfo(dt).tiny), float(np.sqrt(np.finfo(dt).max))
    rng = np.random.default_rng(2)
    cases = {"tiny": (rng.normal(0, 1, 64) * tiny, rng.normal(0, 1, size)),
             "spread": (rng.normal(0, 1, 64),
                        np.array([huge ** ((i + 1) / size) * tiny ** ((size - i - 1) / size)
                                  for i in range(size)]))}
    for case, (a, r) in cases.items():
        q = [(a * r[k]).astype(dt) for k in range(size)]  # what each rank holds
        wide = [x.astype(np.float64) for x in q]
        unit = np.max(np.abs(wide))  # compare in units of the largest entry
        expected = np.asarray(tree_of_means([x / unit for x in wide]))
        for api in ("numpy", "torch"):
            if api == "numpy":
                got = hvd.allreduce(q[rank], op=hvd.Adasum,
                                    name=f"st.{case}.{np.dtype(dt).name}")
            else:
                t = torch.from_numpy(q[rank].copy())
                hvd_torch.allreduce_(t, op=hvd_torch.Adasum,
                                     name=f"st.t.{case}.{np.dtype(dt).name}")
                got = t.numpy()
            got = np.asarray(got, np.float64) / unit
            err = np.linalg.norm(got - expected) / np.linalg.norm(expected)
            # The result is rounded to the type, whose subnormals hold fewer digits.
            if not err < 100 * float(np.finfo(dt).eps):
                failures.append(f"{api} {case} {np.dtype(dt).name}: relative error {err:.3g}")
            if size > 1 and np.allclose(np.sum(wide, 0) / unit, expected):
                failures.append("the mean equals the sum: inputs too weak")
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_adasum_of_tiny_and_spread_multiples_is_their_mean(np_):
    needs.import_or_skip("torch")
    _assert_passed(np_, "stability")
