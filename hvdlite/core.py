"""The running core as Python sees it: start and shutdown, rank and size, counters,
timeline.

Configuration is read by the core itself from the ``HVDLITE_*`` environment variables
when it starts (fusion threshold, cycle time, cache capacity, stall times, timeline, log
level); a bad value makes ``start()`` raise InvalidArgumentError with the core's message.
Horovod's names of these (``HOROVOD_CYCLE_TIME``...) are copied to ours first, where
ours are unset (``env_aliases``).

``hvdlite.runtime.init`` starts the core through ``start()`` and then registers the
process sets it was given; it lives above the modules that registering needs
(``process_sets``, ``objects``), which themselves need only this module.
"""
import atexit
import logging
import os

from hvdlite import _native, env_aliases, peer_faults
from hvdlite._native import check, ffi, lib

_log = logging.getLogger("hvdlite")

_atexit_registered = False
# Called after every successful start(), e.g. to reset the counters of unnamed tensors.
_init_hooks = []
# The world's (size, rank) from start() to shutdown(): the collectives' checks read them
# every call, where a native query costs about a microsecond.
_world = None


def add_init_hook(fn):
    """Registers ``fn()`` to run after every successful start of the core (in order)."""
    _init_hooks.append(fn)


def _comm_f2c(comm):
    if comm is None:
        return -1
    py2f = getattr(comm, "py2f", None)
    if py2f is None:
        raise TypeError(f"hvdlite.init(comm=...) takes an mpi4py communicator, "
                        f"not {type(comm).__name__}")
    return int(py2f())


def start(comm=None):
    """Starts MPI (unless already initialized, e.g. by mpi4py) and the core; runs the
    init hooks. ``hvdlite.runtime.init`` is the public entry point (it holds the lock and
    skips a second call).

    Args:
        comm: an mpi4py communicator to run on (the core duplicates it); None runs on
            MPI_COMM_WORLD.

    Raises:
        TypeError: ``comm`` is not an mpi4py communicator.
        InvalidArgumentError: a ``HVDLITE_*`` variable (or its ``HOROVOD_*`` alias)
            has a bad value.
        HvdliteError: the core could not start (the message says why).
    """
    global _atexit_registered, _world
    env_aliases.apply()
    options = ffi.new("hvdlite_init_options_t *")
    options.comm_f2c = _comm_f2c(comm)
    check(lib.hvdlite_init(options))
    _world = (_int_query(lib.hvdlite_size), _int_query(lib.hvdlite_rank))
    peer_faults.start_listening()
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        peer_faults.when_lost(_tell_core_peers_lost)
        _atexit_registered = True
    for hook in _init_hooks:
        hook()


def _tell_core_peers_lost():
    """``peer_faults.when_lost``'s callback for the core, with the notice's words (the
    ops that it then fails name the lost ranks)."""
    lib.hvdlite_note_lost_peers(str(peer_faults.failure()).encode("utf-8", "replace"))


def shutdown():
    """Stops the core on every rank; pending handles fail with ShutdownError.

    Idempotent: calling it when not initialized does nothing. After the launcher
    reported lost peers it does nothing either: the core's thread may be blocked on a
    peer that will never answer, and the launcher ends the job. When the core saw a peer
    end before the launcher's notice came, it first waits for the notice (10 s at most):
    a rank that ended first would be the failure the launcher reports, not the dead peer.

    Raises:
        HvdliteError: the core reported an error while stopping.
    """
    if peer_faults.core_saw_loss():
        peer_faults.await_notice()
    if peer_faults.failure() is not None:
        _log.warning("hvdlite: not shutting down the core after lost peers (%s)",
                     peer_faults.failure())
        return
    global _world
    _world = None
    check(lib.hvdlite_shutdown())


def _shutdown_at_exit():
    try:
        shutdown()
    except Exception as e:  # at exit there is no caller left to raise to
        _log.warning("hvdlite: shutdown at exit failed: %s", e)


def is_initialized():
    """Returns True between ``init()`` and ``shutdown()``."""
    out = ffi.new("int32_t *")
    check(lib.hvdlite_is_initialized(out))
    return bool(out[0])


def _int_query(fn):
    out = ffi.new("int32_t *")
    check(fn(out))
    return int(out[0])


def size():
    """Returns the number of ranks.

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    world = _world
    return world[0] if world is not None else _int_query(lib.hvdlite_size)


def rank():
    """Returns this process's rank, 0 <= rank < size().

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    world = _world
    return world[1] if world is not None else _int_query(lib.hvdlite_rank)


def local_size():
    """Returns the number of ranks on this host.

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    return _int_query(lib.hvdlite_local_size)


def local_rank():
    """Returns this process's rank among the ranks on its host.

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    return _int_query(lib.hvdlite_local_rank)


def cross_size():
    """Returns the number of hosts that have a rank with this local rank.

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    return _int_query(lib.hvdlite_cross_size)


def cross_rank():
    """Returns this host's index among the ranks with this local rank.

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    return _int_query(lib.hvdlite_cross_rank)


def mpi_threads_supported():
    """Returns True if MPI runs with MPI_THREAD_MULTIPLE (mpi4py can be used alongside).

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    return bool(_int_query(lib.hvdlite_mpi_threads_supported))


def stats():
    """Returns the core's counters since init, as a dict of ints.

    Keys are the fields of ``hvdlite_stats_t``: cycles, coordinator_gathers, cache_hits,
    cache_misses, collectives, fused_collectives, tensors, bytes, errors,
    shm_collectives (allreduces, reducescatters, allgathers, broadcasts and alltoalls
    through shared memory), wire_bytes (bytes this rank
    sent to the others, counted as a bandwidth-optimal algorithm sends them: an
    allreduce of S bytes on n ranks counts 2(n-1)/n S, an allgather whose result is S
    bytes (n-1)/n S; what compression saves shows here), hierarchical_collectives
    (allreduces over hosts in layers: README, "Hierarchical collectives"),
    nccl_collectives and staged_collectives (collectives on GPU tensors through NCCL, or
    staged through host memory), nccl_us (microseconds the core spent on the NCCL ones:
    packing, the collective, unpacking, to the end of its stream), caller_cycles (cycles
    run by a thread blocked on its own small op rather than by the background thread:
    ``HVDLITE_CALLER_CYCLE``), carried_collectives (of the collectives, those
    whose data rode with the coordination round: one host, or up to 8 hosts,
    ``HVDLITE_CARRY_DATA``); and
    one that is not a count since init,
    waiting_threads: the threads waiting for a result right now (a blocking op's caller
    from its enqueue on). The core answers at any time (after
    ``shutdown()`` it keeps the last counts).
    """
    out = ffi.new("hvdlite_stats_t *")
    check(lib.hvdlite_stats(out))
    return {name: int(getattr(out, name)) for name, _ in ffi.typeof("hvdlite_stats_t").fields}


def autotune_state():
    """Returns what autotune (``HVDLITE_AUTOTUNE=1``) uses now on this rank, as a dict.

    Keys: enabled, settled (the search ended and the values stay), trials (measured so
    far), fusion_threshold (bytes), cycle_time_ms, shm_chunk_bytes, hierarchical (the
    hierarchical allreduce is used where there are several hosts). Every rank holds the
    same values from one cycle to the next; with autotune off they are the defaults (or
    what ``HVDLITE_*`` set). README, "Autotune".

    Returns:
        The dict; cycle_time_ms is a float, the rest ints (enabled, settled and
        hierarchical as bools).
    """
    out = ffi.new("hvdlite_autotune_t *")
    check(lib.hvdlite_autotune_state(out))
    state = {name: getattr(out, name) for name, _ in ffi.typeof("hvdlite_autotune_t").fields}
    for flag in ("enabled", "settled", "hierarchical"):
        state[flag] = bool(state[flag])
    return state


def start_timeline(path, mark_cycles=False):
    """Starts writing a Chrome-trace timeline (rank 0 writes it; elsewhere a no-op).

    A timeline already running is stopped first. The file is overwritten; it is valid
    JSON once ``stop_timeline()`` or ``shutdown()`` returns. Summarize it with
    ``hvdlite timeline summary PATH`` (README, "Timeline").

    Args:
        path: the JSON file to write (on rank 0's machine).
        mark_cycles: also mark every background-loop cycle.

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
        InvalidArgumentError: on rank 0, the file cannot be opened for writing (the
            message names the path and the reason); no timeline runs then.
    """
    check(lib.hvdlite_start_timeline(os.fsencode(path), 1 if mark_cycles else 0))


def stop_timeline():
    """Stops the timeline: writes what is queued, closes open spans, ends the JSON array.

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    check(lib.hvdlite_stop_timeline())


def version():
    """Returns the version string of the loaded core."""
    return ffi.string(lib.hvdlite_version()).decode("utf-8", "replace")


def mpi_library_version():
    """Returns the linked MPI library's version string."""
    return _native.mpi_library_version()
