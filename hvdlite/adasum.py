"""Adasum: the adaptive summation of gradients (allreduce with ``op=Adasum``).

Two vectors combine as ``a * (1 - a.b / (2 |a|^2)) + b * (1 - a.b / (2 |b|^2))`` (a
coefficient stays 1 when its vector is zero): orthogonal vectors add, equal ones average.
Each vector is written as ``m * u``, ``m`` a power of two and ``u``'s largest entry in
[0.5, 1), and the formula is evaluated on ``u`` and ``m`` (``combine``): no square
underflows or overflows, so vectors with entries near the smallest normal number of
their type, or of magnitudes from there to the square root of its largest, combine as
well as any others (Horovod's stability tests: multiples of one vector give their mean).
Ranks combine along the binary tree of recursive
halving/doubling, level by level: rank r with rank r + 1 (r even), then each result with
the one at distance 2, 4, ... With a rank count that is not a power of two, the ranks
past the largest power of two p first fold into rank ``r - p`` (that pair combines
first). Dot products and norms are per tensor, never over a fused buffer.

Where it runs: in Python over the core's allgather. Every rank gathers every rank's
vector and evaluates the same tree in float64, in the same order, so every rank holds
the same result without the pairwise exchanges the tree's shape suggests. That moves
size() times the bytes of a halving/doubling exchange, which the core cannot do yet (no
point-to-point messages in its negotiated, ordered model), and it is the one place that
needs no new native code: Adasum is meant for a few large ranks and fp32/fp64 CPU
gradients, where the extra bytes matter less than an exact, independently checkable
result.
"""
import numpy as np

from hvdlite import _checks, _enqueue
from hvdlite._enqueue import from_buffer
from hvdlite.errors import InvalidArgumentError

#: The dtypes Adasum takes (Horovod: float16, float32, float64).
FLOAT_TYPES = ("float16", "float32", "float64")

def _unit(v):
    """(m, u) with v = m * u: m a power of two (exact), u's largest entry in [0.5, 1).
    A zero or non-finite vector gives (its largest entry, v)."""
    largest = float(np.max(np.abs(v), initial=0.0))
    if largest == 0.0 or not np.isfinite(largest):
        return largest, v
    m = np.ldexp(1.0, int(np.frexp(largest)[1]))
    return m, v / m


def combine(a, b):
    """The Adasum of two float64 vectors of one tensor.

    With a = ma * ua and b = mb * ub, ``a * (1 - a.b / 2|a|^2)`` is
    ``a - (ua.ub / 2) * (mb / ua.ua) * ua``, and alike for b: only the unit vectors'
    products, in [0.25 * n, n], and the ratio of the two magnitudes are formed.
    """
    ma, ua = _unit(a)
    mb, ub = _unit(b)
    if ma == 0.0 or mb == 0.0:  # a zero vector: both coefficients are 1
        return a + b
    half_dot = float(np.dot(ua, ub)) * 0.5
    return a + b - half_dot * ((mb / float(np.dot(ua, ua))) * ua
                               + (ma / float(np.dot(ub, ub))) * ub)


def reduce_vectors(vectors):
    """The Adasum of every rank's vector (a list in rank order), along the tree above."""
    v = list(vectors)
    n = len(v)
    p = 1
    while p * 2 <= n:
        p *= 2
    for r in range(p, n):
        v[r - p] = combine(v[r - p], v[r])
    distance = 1
    while distance < p:
        for r in range(0, p, 2 * distance):
            v[r] = combine(v[r], v[r + distance])
        distance *= 2
    return v[0]


def _check(arr, name):
    if arr.dtype.name not in FLOAT_TYPES:
        raise InvalidArgumentError(
            f"tensor '{name}': Adasum takes {', '.join(FLOAT_TYPES)} tensors, not "
            f"{arr.dtype}")


def _prepare(array, name, prescale_factor, postscale_factor, out):
    arr, code = _checks.input_array(array, name)
    _check(arr, name)
    _checks.check_scale(prescale_factor, postscale_factor, False, name)
    out = _checks.output_array(out, arr.shape, arr.dtype, name)
    flat = arr.reshape(1, -1)
    if prescale_factor != 1.0:
        flat = (flat.astype(np.float64) * prescale_factor).astype(arr.dtype)
    return flat, code, out


def _finish_one(gathered, out, postscale_factor):
    result = reduce_vectors([row.astype(np.float64) for row in gathered])
    if postscale_factor != 1.0:
        result = result * postscale_factor
    out[...] = result.reshape(out.shape).astype(out.dtype)
    return out


def allreduce_async(array, name, prescale_factor=1.0, postscale_factor=1.0, out=None,
                    result=None):
    """Starts the Adasum allreduce of ``array`` (see ``hvdlite.ops.allreduce_async``).

    Args:
        result: what the Handle returns (default: ``out`` or the new array).
    """
    flat, code, out = _prepare(array, name, prescale_factor, postscale_factor, out)

    def finish(handle):
        _finish_one(handle.output_array(0, flat.dtype, flat.shape[1:]), out,
                    postscale_factor)
        return out if result is None else result

    return _enqueue.enqueue(_enqueue.ALLGATHER, name, code, flat.shape, from_buffer(flat), None,
                            keepalive=(flat, out), finisher=finish)


def grouped_allreduce_async(arrays, group, prescale_factor=1.0, postscale_factor=1.0,
                            outs=None, results=None):
    """Adasum of several arrays negotiated together, each with its own dot products."""
    specs, keep, prepared = [], [], []
    for i, array in enumerate(arrays):
        tensor_name = f"{group}.{i}"
        flat, code, out = _prepare(array, tensor_name, prescale_factor, postscale_factor,
                                   None if outs is None else outs[i])
        specs.append(_enqueue.TensorSpec(_enqueue.ALLGATHER, tensor_name, code, flat.shape,
                                         from_buffer(flat)))
        keep += [flat, out]
        prepared.append((flat, out))

    def finish(handle):
        done = [_finish_one(handle.output_array(i, flat.dtype, flat.shape[1:]), out,
                            postscale_factor)
                for i, (flat, out) in enumerate(prepared)]
        return done if results is None else results

    return _enqueue.enqueue_group(specs, name=group, keepalive=keep, finisher=finish)
