"""Process-wide state: init/shutdown, rank and size, counters, timeline.

``init`` starts the core (``hvdlite.core``) and registers the process sets it was given;
every other name here is the core's, re-exported (``hvdlite.runtime`` is where the
adapters and scripts find them). Registering sets made from mpi4py communicators
gathers them from every rank (``hvdlite.objects``), which is why ``init`` sits above the
collectives while the modules they are built on import ``hvdlite.core`` only.

Configuration is read by the core itself from the ``HVDLITE_*`` environment variables
at ``init()`` (fusion threshold, cycle time, cache capacity, stall times, timeline, log
level); a bad value makes ``init()`` raise InvalidArgumentError with the core's message.
Horovod's names of these (``HOROVOD_CYCLE_TIME``...) are copied to ours first, where
ours are unset (``env_aliases``).
"""
import logging
import os
import threading

from hvdlite import core, errors, objects
from hvdlite import process_sets as sets
from hvdlite.core import (add_init_hook, autotune_state, cross_rank, cross_size,  # noqa: F401
                          is_initialized, local_rank, local_size, mpi_library_version,
                          mpi_threads_supported, rank, shutdown, size, start_timeline,
                          stats, stop_timeline, version)

_log = logging.getLogger("hvdlite")

_init_lock = threading.Lock()


def init(comm=None, process_sets=None):
    """Starts hvdlite: MPI (unless already initialized, e.g. by mpi4py) and the core.

    Calling it again while initialized logs a warning and does nothing, as Horovod
    scripts sometimes call ``init()`` twice. Shutdown is registered to run at exit.

    Args:
        comm: an mpi4py communicator to run on (the core duplicates it); None runs on
            MPI_COMM_WORLD.
        process_sets: process sets to register, in order, on every rank: ProcessSet
            objects (of ranks, or of mpi4py communicators, which may differ between
            ranks) or lists of ranks; None or "dynamic" registers none (sets can be
            added at any time with ``add_process_set``).

    Raises:
        TypeError: ``comm`` is not an mpi4py communicator.
        InvalidArgumentError: a ``HVDLITE_*`` variable (or its ``HOROVOD_*`` alias)
            has a bad value.
        HvdliteError: the core could not start (the message says why).
    """
    with _init_lock:
        if core.is_initialized():
            _log.warning("hvdlite.init() called while already initialized; ignoring it")
            return
        core.start(comm)
        problem = launcher_mismatch(os.environ, core.size()) if comm is None else None
        if problem:
            core.shutdown()
            raise errors.HvdliteError(problem)
        _register_process_sets(process_sets)


# Process counts that launchers put in each process's environment before MPI is up:
# (variable, only inside a job step when this one is set, what to fix).
_LAUNCHER_SIZES = (
    ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID",
     "srun started them without a process manager this MPI speaks: run srun --mpi=pmi2 "
     "(or set MpiDefault=pmi2 in slurm.conf), or hvdliterun inside the allocation"),
    ("OMPI_COMM_WORLD_SIZE", None,
     "Open MPI's mpirun started them, and hvdlite's MPI is not Open MPI: use that MPI's "
     "mpiexec, or hvdliterun"),
    ("PMI_SIZE", None,
     "their launcher's PMI did not reach this MPI: use the mpiexec of the MPI hvdlite "
     "was built against, or hvdliterun"),
)


def launcher_mismatch(environ, mpi_size):
    """Why a process whose launcher started several cannot be an MPI world of one.

    A launcher whose process manager MPI does not understand (``srun`` without
    ``--mpi=pmi2``, another MPI's ``mpirun``) starts N processes that each become an MPI
    singleton: N worlds of size 1, every one rank 0. The launcher's own count, in the
    environment before MPI is up, tells them apart from a real one-process job.

    Args:
        environ: the process's environment.
        mpi_size: the size of the world MPI made.

    Returns:
        The message naming the launcher's variable and the fix, or None when the world
        agrees (or the process was started by hvdliterun, which sets HVDLITE_RANK).
    """
    if mpi_size != 1 or "HVDLITE_RANK" in environ:
        return None
    for variable, inside, fix in _LAUNCHER_SIZES:
        value = environ.get(variable, "").strip()
        if inside and inside not in environ:
            continue
        if value.isdigit() and int(value) > 1:
            return (f"MPI made this process a world of its own (size 1), but its launcher "
                    f"started {value} processes ({variable}={value}): {fix}")
    return None


def _comm_ranks(comm):
    """The global ranks of an mpi4py communicator's members (collective over it)."""
    return sorted(comm.allgather(core.rank()))


def _register_process_sets(process_sets):
    """Registers the sets given to ``init``; collective over every rank.

    Sets made from ranks are added in the order given (every rank gives the same list).
    Sets made from mpi4py communicators may differ between ranks (each passes the
    communicator it is in): their ranks are gathered from every rank and each distinct
    set is added once, in order of its ranks.
    """
    sets.forget_all()
    sets.global_process_set.ranks = list(range(core.size()))
    if process_sets is None or isinstance(process_sets, str):
        if process_sets not in (None, "dynamic"):
            raise ValueError(f"process_sets must be a list or 'dynamic', not {process_sets!r}")
        return
    given = [ps if isinstance(ps, sets.ProcessSet) else sets.ProcessSet(ps)
             for ps in process_sets]
    everyone = tuple(range(core.size()))
    from_comms = [ps for ps in given if ps.ranks is None]
    for ps in from_comms:
        ps.ranks = _comm_ranks(ps.mpi_comm)
    if from_comms:
        mine = sorted({tuple(ps.ranks) for ps in from_comms})
        for ranks in sorted({r for theirs in objects.allgather_object(mine) for r in theirs}):
            matching = [ps for ps in from_comms if tuple(ps.ranks) == ranks]
            if ranks == everyone:
                psid = 0
            else:
                psid = sets.add_process_set(sets.ProcessSet(list(ranks))).process_set_id
            for ps in matching:
                sets.register(ps, psid)
    for ps in given:
        if ps.mpi_comm is None:
            sets.add_process_set(ps)
