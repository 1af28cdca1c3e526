"""Blocking collectives of CPU tensors repeated under one name: the torch side of
``hvdlite.ops``' kept calls.

A loss or metric averaged every step (``hvd.allreduce(loss.detach(), name="loss")``), a
value broadcast every step: the same name, dtype, shape and arguments each time. Its
first call goes the whole way (checks, naming, autograd, a Handle); what that checked
and filled (the C struct) holds for the next call with a tensor of the same dtype and
shape, the same other arguments and nothing for autograd to record, which then only
hands the core its buffers and waits in the same call (``_enqueue.run``). That whole
way costs about as much as the collective itself on one host (a 4 KiB allreduce on 2
ranks: ~13 us against ~7 us for numpy's, whose kept path this mirrors).
"""
import torch

from hvdlite import _enqueue, core, process_sets
from hvdlite._enqueue import pointer_at, run
from hvdlite._native import ffi
from hvdlite.errors import InvalidArgumentError
from hvdlite.torch.tensors import tensor_code

# kind -> {name -> _Kept}, each bounded like _enqueue's caches.
_kept = {_enqueue.ALLREDUCE: {}, _enqueue.BROADCAST: {}, _enqueue.ALLGATHER: {},
         _enqueue.ALLTOALL: {}, _enqueue.REDUCESCATTER: {}}


class _Kept:
    __slots__ = ("dtype", "shape", "args", "types", "psid", "world", "template", "out_shape",
                 "finisher")

    def __init__(self, tensor, args, psid, template, out_shape, finisher):
        self.dtype, self.shape, self.args, self.psid = tensor.dtype, tensor.shape, args, psid
        self.types = tuple(map(type, args))
        self.world = core._world
        self.template, self.out_shape, self.finisher = template, out_shape, finisher


def repeat(kind, name, tensor, output, args):
    """The result of a blocking call of ``kind`` that repeats the kept one under
    ``name`` (into ``output``, or a new tensor), or None where it does not.

    ``args``: the call's other arguments as given, the process set last, equal and of
    the same types (a bool, a float, a numpy scalar or a tensor where the first call
    had an int is what the first call's checks refuse or convert). Not a repeat:
    another dtype or shape, a tensor that is not a plain contiguous CPU tensor, or one
    autograd would record.
    """
    kept = _kept[kind].get(name) if type(name) is str else None
    if (kept is None or type(tensor) is not torch.Tensor or tensor.dtype is not kept.dtype
            or tensor.shape != kept.shape or not tensor.is_cpu
            or tensor.layout is not torch.strided or not tensor.is_contiguous()
            or tensor.is_neg() or tensor.is_conj()
            or (tensor.requires_grad and torch.is_grad_enabled())
            or tuple(map(type, args)) != kept.types or args != kept.args
            or kept.world is not core._world
            or args[-1].process_set_id != kept.psid):
        return None
    if kept.finisher is not None:  # the core allocates the result
        return run(kept.template, pointer_at(tensor.data_ptr()), ffi.NULL, (tensor,),
                   kept.finisher, name, None)
    if output is None:
        # (Contiguous, as the tensor is; sizes as arguments cost torch the least.)
        output = (torch.empty_like(tensor) if kept.out_shape is None
                  else torch.empty(*kept.out_shape, dtype=tensor.dtype))
    return run(kept.template, pointer_at(tensor.data_ptr()), pointer_at(output.data_ptr()),
               (tensor, output), None, name, output)


def keep(kind, name, tensor, args, reduce_op=_enqueue.Average, prescale=1.0, postscale=1.0,
         root_rank=0, out_shape=None, finisher=None):
    """Keeps a call of ``kind`` that ended well for ``repeat`` (``args`` as there; the
    rest as the core's struct has them: the op resolved, the root a global rank; then
    the result's shape where it is not the tensor's, or the finisher of a result the
    core allocates), where its name was given and its tensor was a plain CPU tensor.
    Not kept: Adasum (its ops run in ``hvdlite.adasum``, not as one core allreduce), and
    zero factors (0.0 == -0.0, yet the sign shows in the results: see
    ``_enqueue.template``)."""
    if (type(name) is not str or type(tensor) is not torch.Tensor or not tensor.is_cpu
            or reduce_op == _enqueue.Adasum or not prescale or not postscale
            or args[-1] is None):  # (None: the global set, not an object to compare)
        return
    try:  # no error after the op ended well (this runs inside the refusal wrapper)
        psid = process_sets.process_set_id(args[-1])
    except InvalidArgumentError:  # removed meanwhile by another thread: not kept
        return
    template = _enqueue.template(kind, name, tensor_code(tensor, name), tuple(tensor.shape),
                                 reduce_op, prescale, postscale, root_rank, psid, -1)
    _enqueue.remember(_kept[kind], name, _Kept(tensor, args, psid, template,
                                               out_shape and tuple(out_shape), finisher))
