"""Process sets: groups of ranks that run collectives of their own.

    even = hvd.add_process_set([0, 2])
    if even.included():
        hvd.allreduce(x, name="x", process_set=even)

Each set negotiates, caches and fuses its ops on its own, with its own communicator, so
ops of different sets run concurrently without waiting for each other. Set 0,
``global_process_set``, is every rank.

``init(process_sets=[...])``, ``add_process_set`` and ``remove_process_set`` are
collective over every rank: all ranks call them in the same order with the same
arguments (a rank that differs makes the call raise MismatchError on every rank).
Only a set's members may call its collectives; ``broadcast``'s ``root_rank`` is a
global rank (a member's), results of ``allgather`` and ``alltoall`` come in the order
of the members' global ranks, ``reducescatter`` splits rows among the members.
"""
import threading

from hvdlite import core
from hvdlite._native import check, ffi, lib
from hvdlite.elastic import protocol
from hvdlite.errors import InvalidArgumentError

_lock = threading.Lock()
# id -> the ProcessSet objects this process knows for it (invalidated on removal).
_known = {}


class ProcessSet:
    """A set of ranks that runs collectives together.

    Made from a list of global ranks (any order; kept sorted) or an mpi4py
    communicator (its ranks, at ``init``), then registered by ``hvdlite.init
    (process_sets=[...])`` or ``add_process_set``, which set ``process_set_id``.

    Attributes:
        process_set_id: the set's id once registered, else None.
        ranks: the global ranks, increasing (None for a communicator not registered yet).
        mpi_comm: the mpi4py communicator it was made from, or None.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.ranks = None
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "py2f") and hasattr(ranks_or_comm, "allgather"):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator, "
                             f"not {type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be ints, got {ranks!r}")
        self.ranks = ranks

    def size(self):
        """Returns the number of ranks in the set, or None if it is not registered."""
        if self.process_set_id is None:
            return None
        return _query(lib.hvdlite_process_set_size, self.process_set_id)

    def rank(self):
        """Returns this process's rank within the set (-1 outside it), or None if it
        is not registered.

        Collectives still take global ranks (``broadcast``'s root_rank); this one
        indexes results such as ``allgather``'s.
        """
        if self.process_set_id is None:
            return None
        return _query(lib.hvdlite_process_set_rank, self.process_set_id)

    def included(self):
        """Returns whether this process is in the set, or None if its ranks are unknown.
        Every process is in the global set."""
        if self is global_process_set:
            return True
        if self.ranks is None:
            return None
        return core.rank() in self.ranks

    def invalidate(self):
        """Forgets the registration (after the set was removed)."""
        self.process_set_id = None

    def __str__(self):
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _query(fn, process_set_id):
    out = ffi.new("int32_t *")
    check(fn(process_set_id, out))
    return int(out[0])


def process_set_ranks(process_set_id):
    """Returns the global ranks of set ``process_set_id``, increasing.

    Raises:
        InvalidArgumentError: there is no such set.
    """
    n = ffi.new("int32_t *")
    check(lib.hvdlite_process_set_ranks(process_set_id, ffi.NULL, 0, n))
    ranks = ffi.new("int32_t[]", max(1, n[0]))
    check(lib.hvdlite_process_set_ranks(process_set_id, ranks, n[0], n))
    return [int(ranks[i]) for i in range(n[0])]


def process_set_by_id(process_set_id):
    """Returns a registered ProcessSet of that id (the global one for 0).

    Raises:
        ValueError: no set of that id is registered in this process.
    """
    if process_set_id == 0:
        return global_process_set
    with _lock:
        known = _known.get(process_set_id)
    if not known:
        raise ValueError(f"No known process set with id {process_set_id}")
    return known[0]


def process_set_ids_and_ranks():
    """Returns {id: global ranks} of every set, set 0 included."""
    n = ffi.new("int32_t *")
    check(lib.hvdlite_process_set_ids(ffi.NULL, 0, n))
    ids = ffi.new("int32_t[]", max(1, n[0]))
    check(lib.hvdlite_process_set_ids(ids, n[0], n))
    return {int(ids[i]): process_set_ranks(int(ids[i])) for i in range(n[0])}


class _Basics:
    """The one internal query Horovod's own tests make of ``mpi_ops._basics``."""

    @staticmethod
    def _get_process_set_ids_and_ranks():
        return process_set_ids_and_ranks()


basics = _Basics()


def process_set_id(process_set):
    """The id to hand the core for ``process_set`` (a ProcessSet, or None for the
    global set), checked to be registered.

    Raises:
        InvalidArgumentError: not a ProcessSet, or one not registered (never added, or
            removed).
    """
    if process_set is None or process_set is global_process_set:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(
            f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise InvalidArgumentError(
            f"{process_set} is not registered: pass it to hvdlite.init(process_sets=...) "
            "or hvdlite.add_process_set() first (or it was removed)")
    return process_set.process_set_id


def members(process_set):
    """(size, rank) of this process in ``process_set``: what splits, rows and result
    offsets are computed from. The global set answers without a native call per op."""
    psid = process_set_id(process_set)
    if psid == 0:
        return core.size(), core.rank()
    return (_query(lib.hvdlite_process_set_size, psid),
            _query(lib.hvdlite_process_set_rank, psid))


def set_size(process_set):
    """The number of ranks in ``process_set`` (a registered set, or None: the global)."""
    return members(process_set)[0]


def add_process_set(process_set):
    """Adds a process set; collective over every rank (same call, same order).

    Args:
        process_set: a ProcessSet or a sequence of global ranks.

    A set of the same ranks that is registered already (say, left behind by code that
    failed before its ``remove_process_set``) is not added twice: ``process_set`` is
    registered under that set's id and returned, on every rank alike (every rank holds
    the same table). Horovod raises ValueError there instead; answering with the set
    keeps one failure from making every later ``add_process_set`` of the job fail.
    Removing either object removes the set.

    Returns:
        The registered ProcessSet (the one given, or a new one).

    Raises:
        ValueError (InvalidArgumentError): bad ranks, or the ranks of the global set.
        MismatchError: ranks made different calls.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError(
            "adding a process set made from an MPI communicator after init is not "
            "supported; build it from a list of ranks")
    if process_set.process_set_id is not None:
        raise InvalidArgumentError(f"{process_set} is already registered")
    same = [psid for psid, ranks in process_set_ids_and_ranks().items()
            if psid != 0 and ranks == process_set.ranks]
    if same:
        register(process_set, same[0])
        _changed(same[0])
        return process_set
    ranks = ffi.new("int32_t[]", process_set.ranks or [0])
    out = ffi.new("int32_t *")
    try:
        check(lib.hvdlite_add_process_set(ranks, len(process_set.ranks), out))
    except InvalidArgumentError as exc:
        _explain_for_elastic(exc, process_set.ranks)
        raise
    register(process_set, int(out[0]))
    _changed(int(out[0]))
    return process_set


def _explain_for_elastic(exc, ranks):
    """Adds to ``exc`` what to do when a set names ranks the current elastic world lacks.

    A reset starts the script again in a world of another size, and the script makes its
    sets again (``init(process_sets=...)``, ``add_process_set``): sets written for one
    size (``[0, 2]``) do not fit a world of 2.
    """
    if protocol.in_elastic_job() and any(r >= core.size() for r in ranks):
        exc.message += (
            f" (world {protocol.generation()} of an elastic job has {core.size()} "
            "ranks: a reset starts the script again with the new world's size, so make "
            "process sets from hvdlite.size(), e.g. range(0, hvd.size(), 2), not from "
            "fixed ranks)")
        exc.args = (exc.message,)


def register(process_set, psid):
    """Records ``process_set`` as registered under id ``psid`` (in this process only: a
    set of the core's it names, not a change of one, so no change hook runs)."""
    process_set.process_set_id = psid
    with _lock:
        _known.setdefault(psid, []).append(process_set)


def remove_process_set(process_set):
    """Removes a process set; collective over every rank (same call, same order).

    Ops of the set still in flight fail with an error naming it. Every ProcessSet
    object of this set is invalidated.

    Args:
        process_set: a registered ProcessSet.

    Returns:
        True if it was removed; False for the global set (which stays) or a set that is
        not registered.

    Raises:
        MismatchError: ranks made different calls.
    """
    psid = process_set.process_set_id
    if psid is None or psid == 0:
        return False
    check(lib.hvdlite_remove_process_set(psid))
    with _lock:
        stale = _known.pop(psid, [])
    for ps in stale + [process_set]:
        ps.invalidate()
    _changed(psid)
    return True


# Called with the id of every set added or removed (the automatic names of its
# unnamed tensors start over, alike on every member).
_change_hooks = []


def add_change_hook(fn):
    """Registers ``fn(process_set_id)`` to run after every add or remove."""
    _change_hooks.append(fn)


def _changed(psid):
    """Runs the change hooks for set ``psid``, added or removed on every rank at once."""
    for hook in _change_hooks:
        hook(psid)


def forget_all():
    """Invalidates every ProcessSet this process knows (a new world starts)."""
    with _lock:
        stale = [ps for sets in _known.values() for ps in sets]
        _known.clear()
    for ps in stale:
        ps.invalidate()
