"""Python objects across ranks, framework-free: pickled into uint8 arrays.

Eager only (they return Python objects). The adapters re-export them.
"""
import pickle as _plain_pickle
import struct
import threading

import numpy as np

from hvdlite import _names, core, ops, process_sets
from hvdlite._native import lib
from hvdlite.process_sets import global_process_set

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle otherwise.
    import cloudpickle as pickle
except ImportError:  # pragma: no cover - cloudpickle is optional
    import pickle


# An object's first bytes travel with its length in one fixed-size array, the head: a
# small object (the usual: an epoch, a metric dict, a config) takes one collective, and
# a repeated call of the same name is then a response-cache hit carried by the
# coordination round (docs/performance.md). A larger one sends the rest in a second.
# A name's first call has a head of HEAD_BYTES; every later one a head that would have
# held the name's last object (a power of two, at most what the round carries): every
# member received that object's length, so every member picks the same size, and a
# name that repeats objects of about one size takes one collective for each up to
# HEAD_MAX_BYTES.
HEAD_BYTES = 1024
HEAD_MAX_BYTES = lib.HVDLITE_CARRIED_MAX_BYTES
_LENGTH = 8  # the head's first bytes: the payload's length (int64)
_LENGTH_FORMAT = struct.Struct("<q")
_put_length, _get_length = _LENGTH_FORMAT.pack_into, _LENGTH_FORMAT.unpack_from

# Process set id -> {name -> the head of the name's next call, where not HEAD_BYTES};
# forgotten when the core starts and when a set is added or removed, as the names of
# unnamed calls are. A set learns at most HEADS_PER_SET names (later ones keep
# HEAD_BYTES: forgetting any would be at a different call on each member when threads
# interleave their calls differently). Should members still disagree on a head (a
# call cut short on one rank by Ctrl-C), the call fails on every member with the
# shapes they had, and each then forgets the name: the next call agrees again.
_heads = {}
_heads_lock = threading.Lock()
HEADS_PER_SET = 4096


def _forget_heads(process_set_id=None):
    with _heads_lock:
        if process_set_id is None:
            _heads.clear()
        else:
            _heads.pop(process_set_id, None)


core.add_init_hook(_forget_heads)
process_sets.add_change_hook(_forget_heads)


def _head_bytes(process_set_id, name):
    names = _heads.get(process_set_id)
    return HEAD_BYTES if names is None else names.get(name, HEAD_BYTES)


def _learn(process_set_id, name, length):
    """Sizes the next head of ``name`` for an object of ``length`` bytes (the one every
    member just received)."""
    need = min(length + _LENGTH, HEAD_MAX_BYTES)
    size = HEAD_BYTES if need <= HEAD_BYTES else 1 << (need - 1).bit_length()
    if _head_bytes(process_set_id, name) == size:
        return  # the usual: a name that repeats objects of about one size
    with _heads_lock:
        names = _heads.setdefault(process_set_id, {})
        if size == HEAD_BYTES:
            names.pop(name, None)
        elif name in names or len(names) < HEADS_PER_SET:
            names[name] = size


def _unlearn(process_set_id, name):
    """Forgets ``name``'s head after its head collective failed."""
    with _heads_lock:
        _heads.get(process_set_id, {}).pop(name, None)


# Objects that plain pickle and cloudpickle write alike (no function or class to write
# by value), pickled by the first: a tenth of the time (cloudpickle builds its pickler
# in Python on every call). A list, tuple or dict of at most _PLAIN_ITEMS of them too.
_PLAIN = frozenset({bytes, str, int, float, bool, type(None)})
_PLAIN_ITEMS = 64


def _dumps(obj):
    kind = type(obj)
    if kind in _PLAIN or (
            kind in (list, tuple, dict) and len(obj) <= _PLAIN_ITEMS
            and all(type(v) in _PLAIN for v in (obj.values() if kind is dict else obj))
            and (kind is not dict or all(type(k) in _PLAIN for k in obj))):
        return _plain_pickle.dumps(obj, pickle.DEFAULT_PROTOCOL)
    return pickle.dumps(obj)


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
    payload = broadcast_bytes(_dumps(obj) if is_root else None, root_rank, base, process_set)
    return obj if is_root else pickle.loads(payload)


def _head(payload, size):
    """A head of ``size`` bytes for ``payload`` (a uint8 array): its length, then its
    first bytes."""
    head = np.zeros(size, dtype=np.uint8)
    _put_length(head, 0, payload.size)
    first = min(payload.size, size - _LENGTH)
    head[_LENGTH:_LENGTH + first] = payload[:first]
    return head


def _length(head):
    return _get_length(head)[0]


def broadcast_bytes(blob, root_rank, name, process_set=global_process_set):
    """Returns ``root_rank``'s bytes on every rank (a writable uint8 array): a head with
    their count and first bytes (tensor ``"<name>.sz"``; sized as the module's comment
    says), then the rest if any (``"<name>.t"``).

    Args:
        blob: on the root, any buffer (bytes, memoryview, array); ignored elsewhere.
        root_rank: the rank whose bytes everyone receives.
        name: the base name of the tensors, equal across ranks.
        process_set: the ProcessSet whose members receive them.

    Raises:
        InvalidArgumentError, HorovodInternalError: as for ``broadcast``.
    """
    psid = process_sets.process_set_id(process_set)
    size = _head_bytes(psid, name)
    room = size - _LENGTH
    is_root = core.rank() == root_rank
    payload = np.frombuffer(blob, dtype=np.uint8) if is_root else None
    head = _head(payload, size) if is_root else np.empty(size, dtype=np.uint8)
    try:
        ops.broadcast(head, root_rank, f"{name}.sz", out=head, process_set=process_set)
    except BaseException:
        _unlearn(psid, name)
        raise
    length = payload.size if is_root else _length(head)
    _learn(psid, name, length)
    if length <= room:
        return head[_LENGTH:_LENGTH + length]
    if is_root:
        payload = np.require(payload, requirements="W")  # writable, as the others' are
    else:
        payload = np.empty(length, dtype=np.uint8)
        payload[:room] = head[_LENGTH:]
    rest = payload[room:]  # a contiguous view: the broadcast writes in place
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
    psid = process_sets.process_set_id(process_set)
    size = _head_bytes(psid, base)
    room = size - _LENGTH
    payload = np.frombuffer(_dumps(obj), dtype=np.uint8)
    # Every rank's head in one allgather; the rests, where any rank has one, in another.
    try:
        heads = ops.allgather(_head(payload, size), f"{base}.sz",
                              process_set=process_set).reshape(-1, size)
    except BaseException:
        _unlearn(psid, base)
        raise
    lengths = [_length(head) for head in heads]
    longest = max(lengths)
    _learn(psid, base, longest)
    rests = None
    if longest > room:
        rests = ops.allgather(payload[room:], f"{base}.t",  # empty where all fit the head
                              process_set=process_set).tobytes()
    out, offset = [], 0
    for head, length in zip(heads, lengths):
        if length <= room:
            out.append(pickle.loads(head[_LENGTH:_LENGTH + length]))
            continue
        data = head[_LENGTH:].tobytes() + rests[offset:offset + length - room]
        offset += length - room
        out.append(pickle.loads(data))
    return out
