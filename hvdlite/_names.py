"""Automatic names of unnamed tensors.

Unnamed tensors are named ``"<op>.noname.<n>"`` with one counter per op kind and
process set (``"<op>.ps<id>.noname.<n>"`` in set ``id`` other than the global one),
reset when the core starts (and a set's by adding or removing it), so names agree across
the ranks of a set as long as they make the same unnamed calls in it in the same order.
Calls a rank makes one at a time (the barrier, the object collectives) have one fixed
name per kind and set instead (``fixed_name``), so that they repeat a cached one.
"""
import threading

from hvdlite import core, process_sets


class _AutoNames:
    """Per-kind and per-set counters for unnamed tensors; reset on every init(), and a
    set's when it is added or removed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counters = {}

    def next(self, kind, process_set_id=0):
        key = (kind, process_set_id)
        with self._lock:
            n = self._counters.get(key, 0)
            self._counters[key] = n + 1
        return f"{fixed_name(kind, process_set_id)}.{n}"

    def reset(self, process_set_id=None):
        with self._lock:
            if process_set_id is None:
                self._counters.clear()
            else:
                for key in [k for k in self._counters if k[1] == process_set_id]:
                    del self._counters[key]


_auto_names = _AutoNames()
core.add_init_hook(_auto_names.reset)
process_sets.add_change_hook(_auto_names.reset)


def auto_name(kind, process_set_id=0):
    """Returns the next automatic name for an op kind in a process set, e.g.
    ``"allreduce.noname.3"``.

    Adapters use it so their unnamed tensors follow the same rule as numpy ones.
    """
    return _auto_names.next(kind, process_set_id)


def fixed_name(kind, process_set_id=0):
    """The one name of an op kind's unnamed calls in a process set that a rank makes one
    at a time (blocking, under a lock), e.g. ``"barrier.noname"``, ``"barrier.ps2.noname"``:
    a repeated call is then a response-cache hit, where an automatic name is new each
    time (and negotiated through the set's rank 0)."""
    if process_set_id:
        return f"{kind}.ps{process_set_id}.noname"
    return f"{kind}.noname"
