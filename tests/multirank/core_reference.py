"""Independent numpy reference for allreduce, imported by the core tests' rank scripts.

Every rank regenerates every rank's contribution from (seed, rank, tensor name), so each
rank can compute the expected result of a reduction on its own, without asking hvdlite.

The reference follows the core's documented element semantics, written here from the
numbers, not from the core's code:

* integers wrap in the element type (two's complement), so Sum and Product are exact in
  any reduction order;
* Average on integers is the wrapped sum divided by the number of ranks, truncating toward
  zero (as Horovod's: its test divides with rounding_mode='trunc');
* integer scale factors multiply in double and truncate toward zero (only integral
  factors are used on integer tensors here, so that is exact);
* float16 and bfloat16 reduce pairwise in float32 and round after every step, in an
  order MPI chooses: results are compared with a bound of a few ulps per rank.
"""
import zlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

INT_DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
DTYPES = INT_DTYPES + FLOAT_DTYPES + ("bool",)
OPS = ("Sum", "Average", "Min", "Max", "Product")

# Unit of the last place (machine epsilon) per float type.
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
        "float64": 2.0 ** -52}


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def ops_for(dtype):
    """The reductions a dtype supports: bool has Min and Max only."""
    return ("Min", "Max") if dtype == "bool" else OPS


@dataclass(frozen=True)
class Case:
    """One allreduce: its name and every property the ranks must agree on."""

    name: str
    dtype: str
    op: str
    shape: tuple
    prescale: float = 1.0
    postscale: float = 1.0


def matrix_cases(shapes=((), (5,), (3, 4))):
    """Every dtype x op x shape, plus scaled variants of every (dtype, op)."""
    cases = []
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for k, shape in enumerate(shapes):
                cases.append(Case(f"{dtype}.{op}.{k}", dtype, op, tuple(shape)))
            if dtype in FLOAT_DTYPES:
                cases.append(Case(f"{dtype}.{op}.scaled", dtype, op, (6,), 0.5, 3.0))
                cases.append(Case(f"{dtype}.{op}.neg", dtype, op, (2, 3), -2.0, 0.25))
            elif dtype in INT_DTYPES and op in ("Sum", "Average", "Min", "Max"):
                cases.append(Case(f"{dtype}.{op}.scaled", dtype, op, (6,), 2.0, 3.0))
    return cases


def _rng(seed, rank, name):
    return np.random.default_rng([seed, rank, zlib.crc32(name.encode())])


def contribution(seed, rank, case):
    """The array rank ``rank`` contributes to ``case`` (same on every process)."""
    rng = _rng(seed, rank, case.name)
    dt = np_dtype(case.dtype)
    shape = case.shape
    if case.dtype == "bool":
        return rng.random(shape) < 0.5 if shape else np.asarray(rng.random() < 0.5)
    if case.dtype in INT_DTYPES:
        info = np.iinfo(dt)
        lo, hi = int(info.min), int(info.max)
        if case.prescale != 1.0 or case.postscale != 1.0:
            # Scaled integers: small values keep the double arithmetic exact.
            lo, hi = max(lo, -1000), min(hi, 1000)
        # Full range: sums and products wrap, and negative averages truncate toward zero.
        return np.asarray(rng.integers(lo, hi, size=shape, endpoint=True, dtype=np.int64)
                          .astype(dt))
    if case.op == "Product":
        mag = rng.uniform(0.5, 2.0, size=shape)
        sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)
        values = mag * sign
    elif case.op in ("Min", "Max"):
        values = rng.uniform(-100.0, 100.0, size=shape)
    else:
        values = rng.uniform(-8.0, 8.0, size=shape)
    return np.asarray(np.asarray(values).astype(dt))


def _trunc_div(v, n):
    """Integer division truncating toward zero of int64 array v by n > 0."""
    q = np.abs(v) // n
    return np.where(v < 0, -q, q)


def expected_int(contribs, case):
    """Exact result for an integer or bool case; contribs in rank order."""
    dt = np_dtype(case.dtype)
    n = len(contribs)
    xs = [np.atleast_1d(np.asarray(c)) for c in contribs]
    if case.dtype == "bool":
        fn = np.logical_and if case.op == "Min" else np.logical_or
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return out.reshape(case.shape)
    if case.prescale != 1.0:
        xs = [np.trunc(x.astype(np.float64) * case.prescale).astype(np.int64).astype(dt)
              for x in xs]
    with np.errstate(over="ignore"):
        acc = xs[0].copy()
        for x in xs[1:]:
            if case.op in ("Sum", "Average"):
                acc = (acc + x).astype(dt)  # wraps in the element type
            elif case.op == "Product":
                acc = (acc * x).astype(dt)
            elif case.op == "Min":
                acc = np.minimum(acc, x)
            else:
                acc = np.maximum(acc, x)
        v = acc.astype(np.int64)
        if case.postscale != 1.0:
            v = np.trunc(v.astype(np.float64) * case.postscale).astype(np.int64)
        if case.op == "Average":
            v = _trunc_div(v, n)
        return v.astype(dt).reshape(case.shape)


def expected_float(contribs, case):
    """(exact value in float64, allowed absolute error) for a float case."""
    dt = np_dtype(case.dtype)
    n = len(contribs)
    eps = _EPS[case.dtype]
    # The prescaled input is rounded to the element type before the reduction.
    xs = [np.asarray(np.asarray(c, dtype=np.float64) * case.prescale).astype(dt)
          .astype(np.float64) for c in contribs]
    stack = np.stack([np.atleast_1d(x) for x in xs])
    divisor = n if case.op == "Average" else 1
    post = case.postscale / divisor
    if case.op in ("Sum", "Average"):
        exact = stack.sum(axis=0) * post
        magnitude = np.abs(stack).sum(axis=0) * abs(post)
    elif case.op == "Product":
        exact = stack.prod(axis=0) * post
        magnitude = np.abs(exact)
    elif case.op == "Min":
        exact = stack.min(axis=0) * post
        magnitude = np.abs(exact)
    else:
        exact = stack.max(axis=0) * post
        magnitude = np.abs(exact)
    # One rounding per reduction step, per scaling and for the final store.
    tol = (n + 3) * eps * magnitude + 1e-300
    return exact.reshape(case.shape), tol.reshape(case.shape)


def check(got, contribs, case):
    """Returns None if ``got`` is the right result for ``case``, else a description."""
    dt = np_dtype(case.dtype)
    if not isinstance(got, np.ndarray) or got.dtype != dt or got.shape != case.shape:
        return (f"{case.name}: got {type(got).__name__} dtype={getattr(got, 'dtype', None)} "
                f"shape={getattr(got, 'shape', None)}, expected {dt} {case.shape}")
    if case.dtype in FLOAT_DTYPES:
        exact, tol = expected_float(contribs, case)
        err = np.abs(got.astype(np.float64) - exact)
        if not np.all(err <= tol):
            i = int(np.argmax(err - tol))
            return (f"{case.name}: element {i}: got {got.astype(np.float64).ravel()[i]!r}, "
                    f"expected {exact.ravel()[i]!r} +- {tol.ravel()[i]:.3g}")
        return None
    want = expected_int(contribs, case)
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got.ravel() != want.ravel())
        i = int(bad[0])
        return (f"{case.name}: element {i} of {got.size}: got {got.ravel()[i]!r}, expected "
                f"{want.ravel()[i]!r} (inputs "
                f"{[np.asarray(c).ravel()[i].item() for c in contribs]})")
    return None


def allreduce_case(hvd, case, rank, in_place):
    """Runs ``case`` through ``hvd.allreduce`` with this rank's contribution (into a copy
    of it when ``in_place``) and returns the result."""
    mine = contribution(1, rank, case)
    kwargs = dict(name=case.name, op=getattr(hvd, case.op), prescale_factor=case.prescale,
                  postscale_factor=case.postscale)
    if in_place:
        got = mine.copy()
        hvd.allreduce(got, out=got, **kwargs)
        return got
    return hvd.allreduce(mine, **kwargs)


def grouped_allreduce_counted(hvd, arrays, **kwargs):
    """``hvd.grouped_allreduce(arrays, **kwargs)``'s results and how many collectives
    went through shared memory for it (one, when the group fused)."""
    before = hvd.stats()["shm_collectives"]
    got = hvd.grouped_allreduce(arrays, **kwargs)
    return got, hvd.stats()["shm_collectives"] - before
