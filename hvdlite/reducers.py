"""Gradient reducers that change the collective: top-k, quantization, PowerSGD.

A cast compressor (``Compression.fp16``) fits compress -> allreduce -> decompress. These
do not: top-k exchanges values and indices, quantization exchanges b-bit codes with a
scale per chunk, and PowerSGD runs two small allreduces with a local step between them.
Each is a *reducer*: the distributed optimizer hands it a unit of named gradients with
``start`` as soon as backward has produced them, and collects the averaged updates with
``finish_all`` before stepping. ``CompressedAllreduce`` (each framework's plain path) is
the reducer that serves the cast compressors through the same interface.

The reducers here are framework-free: they work on numpy arrays (a CPU tensor's
``.numpy()`` view, a TensorFlow eager tensor's ``.numpy()``). Every rank ends with the
same update, bit for bit: what each rank adds up (the gathered values, the averaged
factors) is the same on every rank and is added in the same order.

Error feedback (top-k, PowerSGD): what a rank did not send this step is kept and added
to its next gradient, so over steps the applied updates add up to the gradients' sum,
less what is still held back (``residual``).
"""
import math

import numpy as np

from hvdlite import core, ops
from hvdlite.errors import InvalidArgumentError


class Reducer:
    """Interface of a gradient reducer (see the module docstring).

    ``start(names, arrays)`` begins reducing one unit of gradients (numpy arrays of the
    parameters' shapes) and returns a token; ``finish_all(tokens)`` returns, for each
    token in order, the list of averaged updates. Subclasses keep per-name state (the
    residuals of error feedback) between steps, so a reducer object serves one optimizer.
    """

    #: Horovod compressors are classes used as such; reducers are instances with state.
    is_reducer = True

    def start(self, names, arrays):
        raise NotImplementedError

    def finish_all(self, tokens):
        return [self.finish(token) for token in tokens]

    def finish(self, token):
        raise NotImplementedError

    def residual(self, name):
        """What error feedback holds back for ``name`` (zeros when nothing), or None if
        this reducer keeps no residual."""
        return None


def is_reducer(compression):
    """Whether an optimizer's ``compression`` is a reducer (else a cast compressor)."""
    return getattr(compression, "is_reducer", False)


def check_reducer(reducer, op, scaled, process_set_id, error=ValueError):
    """The preconditions of a reducer given as an optimizer's compression, one rule for
    the torch, TensorFlow and Keras optimizers.

    Args:
        reducer: the ``compression`` argument (``is_reducer`` holds).
        op: the optimizer's reduce op.
        scaled: whether a gradient_predivide_factor scales the gradients.
        process_set_id: the id of the optimizer's process set.
        error: the exception class the caller's framework raises for bad arguments.

    Raises:
        error: a reducer class rather than an instance, an op other than Average, a
            predivide factor, or a process set other than the global one.
    """
    if isinstance(reducer, type):
        raise error(f"{reducer.__name__} is a reducer class: pass an instance, "
                    f"e.g. Compression.topk(0.01)")
    if op != ops.Average or scaled:
        raise error(f"{reducer!r} averages gradients: it takes op=Average and no "
                    "gradient_predivide_factor")
    if process_set_id != 0:
        raise error(f"{reducer!r} runs on the global process set only")


def _as_float32(array):
    return np.ascontiguousarray(array, dtype=np.float32).reshape(-1)


def _check_float(name, array):
    if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
        raise InvalidArgumentError(
            f"gradient '{name}' has dtype {array.dtype}; compression reducers take "
            "floating-point gradients")


class _TwoGathers(Reducer):
    """A reducer that sends two arrays per gradient by allgather (``gathers`` names
    them) and adds up, on every rank, what every rank sent: subclasses say what to send
    (``send``) and how the gathered arrays decode into the sum over ranks (``total``)."""

    gathers = ("first", "second")

    def send(self, name, flat):
        raise NotImplementedError

    def total(self, count, first, second):
        """The sum over ranks, ``count`` float32 entries, from the gathered arrays."""
        raise NotImplementedError

    def start(self, names, arrays):
        pending = []
        for name, array in zip(names, arrays):
            _check_float(name, array)
            first, second = self.send(name, _as_float32(array))
            pending.append((name, array,
                            ops.allgather_async(first, name=f"{self.gathers[0]}.{name}"),
                            ops.allgather_async(second, name=f"{self.gathers[1]}.{name}")))
        return pending

    def applied(self, name, mean):
        """The update handed to the optimizer for ``name`` given the mean over ranks
        (float32, flat); the mean itself unless a subclass corrects it."""
        return mean

    def finish(self, token):
        size = core.size()
        return [self.applied(name, self.total(array.size, ops.synchronize(first),
                                              ops.synchronize(second)) / size)
                .reshape(array.shape).astype(array.dtype, copy=False)
                for name, array, first, second in token]


class TopK(_TwoGathers):
    """Sends the ``ratio`` largest-magnitude entries of each gradient, with error feedback.

    Each rank adds its residual to the gradient, keeps the k = ceil(ratio * n) entries
    of largest magnitude, sends their values and indices (allgather), and keeps the
    rest as its next residual. Every rank sums what all ranks sent, duplicates summed,
    and divides by the number of ranks. Gradients of fewer than ``dense_below`` entries
    (biases, small layers: few bytes, and starved by a per-tensor k of one or two) are
    sent whole, through the same exchange.

    Momentum correction (Deep Gradient Compression, Lin et al. 2018), with ``momentum``
    m > 0, the momentum of the optimizer that steps on the updates (SGD, dampening 0, no
    Nesterov): a rank accumulates its *velocity* u = m u + g, rather than the raw
    gradient, into what it selects from (acc = residual + u), so an entry held back for
    many steps is sent with the momentum it would have gathered. The optimizer then must
    not add momentum to the exchanged sum S_t a second time: the update handed to it is
    S_t - m S_(t-1), whose momentum buffer (m buf + update) is S_t itself. With m = 0
    this is plain error feedback. ``momentum=None`` (the default) lets torch's and Keras'
    ``DistributedOptimizer`` take m from the SGD they wrap (0 for other optimizers and
    for TensorFlow's ``DistributedGradientTape``, which sees no optimizer).

    ``momentum_masking`` (DGC's momentum factor masking): the velocity of the entries a
    rank sent is zeroed with their residual. Off by default: at the ratios measured on
    the digits example it cost accuracy (README, "Gradient compression").

    ``warmup_steps`` (DGC's warm-up of the sparsity): the ratio falls geometrically from
    25% to ``ratio`` over each gradient's first ``warmup_steps`` steps.
    """

    def __init__(self, ratio, dense_below=1024, momentum=None, momentum_masking=False,
                 warmup_steps=0):
        if not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        if momentum is not None and not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"top-k momentum must be in [0, 1), got {momentum}")
        if int(warmup_steps) < 0:
            raise ValueError(f"top-k warmup_steps must be >= 0, got {warmup_steps}")
        self.ratio = float(ratio)
        self.dense_below = int(dense_below)
        self.momentum = None if momentum is None else float(momentum)
        self.momentum_masking = bool(momentum_masking)
        self.warmup_steps = int(warmup_steps)
        self._residuals, self._velocities, self._sums, self._steps = {}, {}, {}, {}

    def __repr__(self):
        return f"Compression.topk({self.ratio})"

    gathers = ("topk.values", "topk.index")

    def use_optimizer_momentum(self, momentum, plain=True):
        """Takes the momentum correction from the optimizer's momentum (the
        DistributedOptimizers call this): ``momentum`` its factor (0 for an optimizer
        without SGD's momentum), ``plain`` False for Nesterov or dampening. Nothing
        changes when this reducer was given ``momentum=0`` (plain error feedback).

        Raises:
            ValueError: Nesterov or dampening (the correction assumes buf = m buf +
                update), or a momentum given that is not the optimizer's.
        """
        if self.momentum == 0.0:
            return
        if momentum and not plain:
            raise ValueError(f"{self!r}: momentum correction assumes SGD's momentum without "
                             "dampening or Nesterov; pass Compression.topk(ratio, momentum=0)")
        if self.momentum is None:
            self.momentum = float(momentum)
        elif self.momentum != momentum:
            raise ValueError(f"{self!r} was given momentum={self.momentum}, but the "
                             f"optimizer's momentum is {momentum}: they must be equal (or "
                             "leave it None to take the optimizer's)")

    def ratio_at(self, step):
        """The ratio of a gradient's ``step``-th exchange (counting from 0): ``ratio``,
        or during the warm-up 25% falling geometrically to it."""
        if step >= self.warmup_steps or self.ratio >= 0.25:
            return self.ratio
        return 0.25 * (self.ratio / 0.25) ** (step / self.warmup_steps)

    def send(self, name, flat):
        m = self.momentum or 0.0
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        if m:
            velocity = m * self._velocities.get(name, 0.0) + flat
            acc = velocity + self._residuals.get(name, 0.0)
        else:
            acc = flat + self._residuals.get(name, 0.0)
        n = acc.size
        k = n if n < self.dense_below else max(1, math.ceil(self.ratio_at(step) * n))
        if k < n:
            index = np.argpartition(np.abs(acc), n - k)[n - k:]
        else:
            index = np.arange(n)
        index = np.sort(index).astype(np.int32 if n < 2**31 else np.int64)
        values = acc[index]
        acc[index] = 0.0
        self._residuals[name] = acc
        if m:
            if self.momentum_masking:
                velocity[index] = 0.0
            self._velocities[name] = velocity
        return values, index

    def total(self, count, values, index):
        total = np.zeros(count, np.float32)
        np.add.at(total, index, values)  # duplicates (same index from two ranks) add
        return total

    def applied(self, name, mean):
        m = self.momentum or 0.0
        if not m:
            return mean
        # The optimizer's momentum buffer becomes m * S_(t-1) + (S_t - m * S_(t-1)) = S_t.
        update = mean - m * self._sums.get(name, 0.0)
        self._sums[name] = mean
        return update

    def residual(self, name):
        return self._residuals.get(name)

    def velocity(self, name):
        """This rank's momentum-corrected velocity of ``name`` (None without momentum)."""
        return self._velocities.get(name)


class Quantize(_TwoGathers):
    """Sends each gradient as ``bits``-bit codes with one float32 scale per chunk.

    A chunk of ``chunk`` entries is scaled by its largest magnitude onto the integers
    -L..L (L = 2**(bits-1) - 1) with stochastic rounding (round up with probability
    equal to the fractional part), so the decoded value's expectation is the input.
    Codes (two per byte at 4 bits) and scales are exchanged with allgather; every rank
    decodes and averages all of them.
    """

    def __init__(self, bits=8, chunk=512, seed=None):
        if bits not in (2, 4, 8):
            raise ValueError(f"quantize supports 2, 4 or 8 bits, got {bits}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.bits, self.chunk = int(bits), int(chunk)
        self.levels = 2 ** (self.bits - 1) - 1
        self._per_byte = 8 // self.bits
        self._seed = seed
        self._rng = None

    def __repr__(self):
        return f"Compression.quantize({self.bits})"

    def _generator(self):
        if self._rng is None:  # independent rounding per rank, reproducible with a seed
            seed = None if self._seed is None else (self._seed, core.rank())
            self._rng = np.random.default_rng(seed)
        return self._rng

    def encode(self, flat):
        """Returns (packed codes as uint8, float32 scales) of a float32 vector."""
        chunks = -(-flat.size // self.chunk)
        padded = np.zeros(chunks * self.chunk, np.float32)
        padded[:flat.size] = flat
        padded = padded.reshape(chunks, self.chunk)
        scales = np.abs(padded).max(axis=1)
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
        scaled = padded / safe[:, None] * self.levels
        codes = np.floor(scaled + self._generator().random(scaled.shape, np.float32))
        codes = np.clip(codes, -self.levels, self.levels).astype(np.int16)
        unsigned = (codes + self.levels).astype(np.uint8).reshape(-1)
        if self._per_byte > 1:
            unsigned = unsigned.reshape(-1, self._per_byte)
            shifts = np.arange(self._per_byte, dtype=np.uint8) * self.bits
            unsigned = np.bitwise_or.reduce(unsigned << shifts, axis=1).astype(np.uint8)
        return unsigned, scales.astype(np.float32)

    def decode(self, packed, scales):
        """Inverse of ``encode`` for the whole chunks (float32, padded length)."""
        if self._per_byte > 1:
            shifts = np.arange(self._per_byte, dtype=np.uint8) * self.bits
            mask = np.uint8(2 ** self.bits - 1)
            packed = ((packed[:, None] >> shifts) & mask).reshape(-1)
        codes = packed.astype(np.float32) - self.levels
        return (codes.reshape(-1, self.chunk) * (scales[:, None] / self.levels)).reshape(-1)

    gathers = ("quant.codes", "quant.scales")

    def send(self, name, flat):
        return self.encode(flat)

    def total(self, count, codes, scales):
        ranks = core.size()
        total = np.zeros(scales.size // ranks * self.chunk, np.float32)
        for part_codes, part_scales in zip(np.split(codes, ranks), np.split(scales, ranks)):
            total += self.decode(part_codes, part_scales)
        return total[:count]


class PowerSGD(Reducer):
    """Low-rank gradients (PowerSGD, as PyTorch DDP's hook defines it), with error feedback.

    A gradient of two or more dimensions is viewed as an n x m matrix M (first dimension
    by the rest) and, with this rank's error added, approximated by P Q^T of rank r: P =
    M Q is averaged across ranks and orthonormalized, Q = M^T P is averaged, and the
    update is P Q^T; what it misses stays as the error for the next step. Q starts from
    the same random matrix on every rank and is kept from step to step (warm start).
    Vectors, and matrices that rank r would not shrink, are averaged uncompressed, as
    are all gradients during the first ``start_iter`` steps.
    """

    def __init__(self, rank=4, start_iter=0, seed=0):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank, self.start_iter, self._seed = int(rank), int(start_iter), seed
        self._errors, self._qs = {}, {}
        self._steps = {}

    def __repr__(self):
        return f"Compression.powersgd({self.rank})"

    def _compressible(self, name, array):
        if array.ndim < 2 or self._steps.get(name, 0) < self.start_iter:
            return False
        n, m = array.shape[0], array.size // array.shape[0]
        return (n + m) * min(self.rank, n, m) < n * m

    def start(self, names, arrays):
        token = []
        for name, array in zip(names, arrays):
            _check_float(name, array)
            compress = self._compressible(name, array)
            self._steps[name] = self._steps.get(name, 0) + 1
            if not compress:
                flat = _as_float32(array)
                token.append((name, array, None, ops.allreduce_async(
                    flat, name=f"powersgd.dense.{name}")))
                continue
            n = array.shape[0]
            matrix = _as_float32(array).reshape(n, -1) + self._errors.get(name, 0.0)
            r = min(self.rank, *matrix.shape)
            q = self._qs.get(name)
            if q is None:
                # The same start on every rank: the seed and the name decide it.
                rng = np.random.default_rng([self._seed, *name.encode()])
                q = _orthonormal(rng.standard_normal((matrix.shape[1], r)).astype(np.float32))
            token.append((name, array, matrix, ops.allreduce_async(
                matrix @ q, name=f"powersgd.p.{name}")))
        return token

    def finish_all(self, tokens):
        # Phase 2 of every compressed gradient is started before any is waited on.
        second = []
        for token in tokens:
            parts = []
            for name, array, matrix, handle in token:
                reduced = ops.synchronize(handle)
                if matrix is None:
                    parts.append((array, reduced, None, None))
                    continue
                p = _orthonormal(reduced)
                parts.append((array, matrix, p, ops.allreduce_async(
                    matrix.T @ p, name=f"powersgd.q.{name}")))
            second.append((token, parts))
        results = []
        for token, parts in second:
            out = []
            for (name, _, _, _), (array, matrix, p, handle) in zip(token, parts):
                if p is None:
                    out.append(matrix.reshape(array.shape).astype(array.dtype, copy=False))
                    continue
                q = ops.synchronize(handle)
                self._qs[name] = q
                approx = p @ q.T
                self._errors[name] = matrix - approx
                out.append(approx.reshape(array.shape).astype(array.dtype, copy=False))
            results.append(out)
        return results

    def residual(self, name):
        error = self._errors.get(name)
        return None if error is None else error.reshape(-1)


def _orthonormal(matrix):
    """Orthonormal columns spanning ``matrix``'s (QR; a zero column stays zero)."""
    q, r = np.linalg.qr(matrix.astype(np.float64))
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    q = q * signs
    q[:, np.abs(np.diag(r)) < 1e-30] = 0.0
    return q.astype(np.float32)
