"""TensorFlow tensors <-> host memory the core can read and write, with as few copies as TF allows.

Nothing here is compiled against TensorFlow. The paths, per case:

* Input, CPU EagerTensor (also inside ``tf.py_function``, whose arguments are
  EagerTensors): ``np.asarray(tensor)`` goes through ``EagerTensor.__array__``, a view
  of the tensor's own buffer: zero-copy. (``tensor.numpy()`` would copy.) A tensor on
  an accelerator is copied to host by TF; this adapter runs collectives on host memory.
* Input, ``tf.Variable``: read once (``tf.convert_to_tensor``, which shares the variable's buffer
  until the next write), then as above: zero-copy.
* Output of ALLREDUCE, BROADCAST, REDUCESCATTER (and grouped allreduce): the result
  buffer is allocated here, aligned to ``ALIGNMENT`` bytes, the core writes into it,
  and it becomes a tensor through DLPack (``tf.experimental.dlpack.from_dlpack``):
  zero-copy. bfloat16, which DLPack cannot describe for numpy, travels as uint16 and
  is reinterpreted with ``tf.bitcast`` (also zero-copy).
* Output of ALLGATHER, ALLTOALL: the core allocates the buffer (its size is known only
  after negotiation) with ``new[]``, which aligns to 16 bytes only; it becomes a tensor
  zero-copy when it happens to be aligned, else it is copied once by
  ``tf.convert_to_tensor``.
* Assigning results into variables (``broadcast_variables``, Keras callbacks):
  ``Variable.assign``, one copy.

Why the alignment: TF kernels CHECK-fail (abort the process) on a buffer that is not
aligned to ``EIGEN_MAX_ALIGN_BYTES`` (64 on x86 builds with AVX-512), and DLPack
import does not copy unaligned buffers, so only aligned buffers are handed over.
"""
import math

import numpy as np
import tensorflow as tf

from hvdlite import dtypes

#: Byte alignment of buffers handed to TF without a copy (TF's EIGEN_MAX_ALIGN_BYTES).
ALIGNMENT = 64

_BFLOAT16 = dtypes.numpy_dtype("bfloat16")


def numpy_dtype(tf_dtype):
    """Returns the numpy dtype matching a TF dtype (object for strings and the like)."""
    try:
        return np.dtype(tf.as_dtype(tf_dtype).as_numpy_dtype)
    except TypeError:
        return np.dtype(object)


def check_dtype(tensor, name):
    """Refuses an unsupported dtype at the call (also while tracing a tf.function).

    Raises:
        InvalidArgumentError: the dtype is not one of ``hvdlite.dtypes.SUPPORTED``.
    """
    dtypes.code_of_numpy(numpy_dtype(tensor.dtype), name)


def host_array(tensor):
    """Returns a numpy array over an eager tensor's host memory (zero-copy on CPU).

    Args:
        tensor: an EagerTensor, a variable (read once), or anything convert_to_tensor takes.
    """
    if not isinstance(tensor, tf.Tensor):
        tensor = tf.convert_to_tensor(tensor)  # a variable is read once here
    return np.asarray(tensor)


def empty_aligned(shape, dtype):
    """Returns an uninitialized C-contiguous array whose data is ALIGNMENT-aligned."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def to_tensor(array):
    """Returns an EagerTensor with ``array``'s values, sharing its memory when TF allows.

    Zero-copy (DLPack) when the array is C-contiguous, writeable and ALIGNMENT-aligned;
    otherwise TF copies it. The tensor keeps the array (and whatever owns its memory,
    e.g. a native handle) alive.
    """
    array = np.asarray(array)
    if (array.size == 0 or not array.flags.c_contiguous or not array.flags.writeable
            or array.ctypes.data % ALIGNMENT):
        return tf.convert_to_tensor(array)
    if array.dtype == _BFLOAT16:
        carrier = tf.experimental.dlpack.from_dlpack(array.view(np.uint16).__dlpack__())
        return tf.bitcast(carrier, tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
