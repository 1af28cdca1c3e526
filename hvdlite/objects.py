"""Python objects across ranks, framework-free: pickled into uint8 arrays.

Eager only (they return Python objects). The adapters re-export them.
"""
import numpy as np

from hvdlite import _names, core, ops, process_sets
from hvdlite.process_sets import global_process_set

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle otherwise.
    import cloudpickle as pickle
except ImportError:  # pragma: no cover - cloudpickle is optional
    import pickle


# An object's first bytes travel with its length in one fixed-size array: a small
# object (the usual: an epoch, a metric dict, a config) takes one collective, and a
# repeated call of the same name is then a response-cache hit carried by the
# coordination round (docs/performance.md). A larger one sends the rest in a second.
HEAD_BYTES = 1024
_LENGTH = 8  # the head's first bytes: the payload's length (int64)


def _default_name(kind, process_set):
    """The base name of an unnamed object call: one per kind and process set (as
    Horovod's, one per type of object), so that a repeated call is a cache hit; the
    calls are blocking, so one of a thread never meets its own earlier one in flight."""
    return _names.fixed_name(kind, process_sets.process_set_id(process_set))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``obj`` on every rank (pickled; eager only).

    Args:
        obj: any picklable object (only the root's is used).
        root_rank: the rank whose object everyone receives.
        name: a base name for its tensors, equal across ranks; None: one per process
            set (two threads broadcasting objects at once must name them).
        process_set: the ProcessSet whose members receive it (root_rank is a global
            rank, a member).

    Returns:
        The root's object (the root gets ``obj`` itself back).

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``broadcast``.
    """
    base = name or _default_name("broadcast_object", process_set)
    is_root = core.rank() == root_rank
    payload = broadcast_bytes(pickle.dumps(obj) if is_root else None, root_rank, base,
                              process_set)
    return obj if is_root else pickle.loads(payload)


def _head(payload):
    """The fixed-size head of ``payload`` (a uint8 array): its length, then its first
    bytes."""
    head = np.zeros(HEAD_BYTES, dtype=np.uint8)
    head[:_LENGTH] = np.array([payload.size], dtype=np.int64).view(np.uint8)
    first = min(payload.size, HEAD_BYTES - _LENGTH)
    head[_LENGTH:_LENGTH + first] = payload[:first]
    return head


def _length(head):
    return int(head[:_LENGTH].view(np.int64)[0])


def broadcast_bytes(blob, root_rank, name, process_set=global_process_set):
    """Returns ``root_rank``'s bytes on every rank (a uint8 array): a head of
    ``HEAD_BYTES`` with their count and first bytes (tensor ``"<name>.sz"``), then the
    rest if any (``"<name>.t"``).

    Args:
        blob: on the root, any buffer (bytes, memoryview, array); ignored elsewhere.
        root_rank: the rank whose bytes everyone receives.
        name: the base name of the tensors, equal across ranks.
        process_set: the ProcessSet whose members receive them.

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``broadcast``.
    """
    is_root = core.rank() == root_rank
    payload = np.frombuffer(blob, dtype=np.uint8) if is_root else None
    head = _head(payload) if is_root else np.empty(HEAD_BYTES, dtype=np.uint8)
    ops.broadcast(head, root_rank, f"{name}.sz", out=head, process_set=process_set)
    if is_root:
        payload = np.require(payload, requirements="W")  # writable, as the others' are
    length = payload.size if is_root else _length(head)
    first = min(length, HEAD_BYTES - _LENGTH)
    if first == length:
        return payload if is_root else head[_LENGTH:_LENGTH + length]
    if not is_root:
        payload = np.empty(length, dtype=np.uint8)
        payload[:first] = head[_LENGTH:]
    rest = payload[first:]  # a contiguous view: the broadcast writes in place
    ops.broadcast(rest, root_rank, f"{name}.t", out=rest, process_set=process_set)
    return payload


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every rank's ``obj``, in rank order (pickled; eager only).

    Args:
        obj: any picklable object.
        name: a base name, equal across ranks; None: one per process set (two threads
            gathering objects at once must name them).
        process_set: the ProcessSet whose members' objects are gathered (in the order
            of their ranks).

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``allgather``.
    """
    base = name or _default_name("allgather_object", process_set)
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    # Every rank's head in one allgather; the rests, where any rank has one, in another.
    heads = ops.allgather(_head(payload), f"{base}.sz",
                          process_set=process_set).reshape(-1, HEAD_BYTES)
    lengths = [_length(head) for head in heads]
    room = HEAD_BYTES - _LENGTH
    rests = None
    if max(lengths) > room:
        rests = ops.allgather(payload[room:], f"{base}.t",  # empty where all fit the head
                              process_set=process_set).tobytes()
    out, offset = [], 0
    for head, length in zip(heads, lengths):
        data = head[_LENGTH:_LENGTH + min(length, room)].tobytes()
        if length > room:
            data += rests[offset:offset + length - room]
            offset += length - room
        out.append(pickle.loads(data))
    return out
