"""Lost peers, as the launcher tells them: a rank that died or a host that went silent.

hvdliterun watches every rank's wrapper (exit statuses, heartbeats over its control
connection). When ranks are lost, the launcher tells every surviving wrapper, and the
wrapper writes one JSON line to a pipe its rank inherits (``HVDLITE_FAULT_FD``). Here a
daemon thread, blocked in ``read`` (no polling), takes that line and records the
failure; every wait on a collective (``Handle.wait`` checks between its one-second
slices) then raises :class:`~hvdlite.errors.RankFailedError` naming the lost ranks and
hosts, instead of waiting forever on a peer that will not answer (a cut link gives the
transport no error to report). The launcher ends the job a few seconds later.

A process whose peers are lost ends at exit with ``os._exit`` (status
:data:`EXIT_LOST_PEERS`), after flushing its
output: the interpreter's and the libraries' teardown (freeing tensors, MPI's and UCX's
destructors) would otherwise run while the core's thread may still be inside MPI, on a
collective with the lost peer, or parked there after MPI faulted (see
native/src/transport/mpi_fault_guard.h).

Outside hvdliterun (no ``HVDLITE_FAULT_FD``) nothing is started.
"""
import atexit
import json
import logging
import os
import sys
import threading
from typing import Optional

from hvdlite import errors

ENV_FAULT_FD = "HVDLITE_FAULT_FD"
# The exit status of a process that ends after lost peers.
EXIT_LOST_PEERS = 1
# How long await_notice waits by default: a peer on this host that the core saw end is
# reported by its wrapper within milliseconds, unless that wrapper is starved of CPU.
NOTICE_WAIT_S = 10.0

# How long an error for a peer the core saw end waits for the launcher's notice (see
# first_cause): the notice reaches every rank of a host within milliseconds of the others.
CAUSE_WAIT_S = 3.0

_failure: Optional[errors.RankFailedError] = None
_started = False
_lock = threading.Lock()
_noticed = threading.Event()  # set with _failure
_core_saw_loss = False  # the core failed an op on a peer it saw end (see note_core_saw_loss)
_cause_wait_spent = False  # first_cause waited once for a notice that did not come
_on_lost = []  # called once each, at the first notice (when_lost)


def failure() -> Optional[errors.RankFailedError]:
    """The error every wait raises once the launcher reported lost peers, else None."""
    return _failure


def await_notice(timeout: float = NOTICE_WAIT_S) -> Optional[errors.RankFailedError]:
    """Waits up to ``timeout`` seconds for the launcher's lost-peer notice.

    The core can see a peer's process end (a shared-memory wait checks its peers' pids)
    before the launcher has that peer's exit status: a rank that then ended at once would
    make mpiexec end the peer's wrapper before it reported, and the launcher would never
    learn which rank died. Waiting for the notice keeps that order. No notice comes when
    another rank's end ended the job first (the launcher then ends this rank) or when the
    peer exited with status 0 (then the wait runs to ``timeout``).

    Returns:
        :func:`failure` (at once None outside hvdliterun: no notice will come).
    """
    if _started:
        _noticed.wait(timeout)
    return _failure


def first_cause(error: errors.RankFailedError,
                timeout: float = CAUSE_WAIT_S) -> errors.RankFailedError:
    """``error`` (the core's: an op failed on a peer it saw end), led by the launcher's
    notice if one comes within ``timeout`` seconds.

    A peer on this host that heard the notice first may end before this rank hears it,
    and the core then sees that peer end: "rank 1 on host h1 ended" would name a
    survivor of a loss elsewhere (a host cut off) as the failure. The notice names the
    loss that started it; the core's words follow it. Outside hvdliterun, or with the
    notice already in ``error``, ``error`` is returned as it is, at once. A process waits
    once: after a wait in which no notice came, the errors that follow (a group's other
    ops, the next calls) are returned at once.
    """
    global _cause_wait_spent
    lost = _failure if _cause_wait_spent else await_notice(timeout)
    if lost is None:
        _cause_wait_spent = _started  # outside hvdliterun nothing was waited for
        return error
    if lost.message in error.message:
        return error
    return type(error)(error.status, error.status_name,
                       f"{lost.message} (this rank: {error.message})")


def note_core_saw_loss() -> None:
    """Records that the core failed an op because a peer ended (``RANK_FAILED``), which
    it may see before the launcher's notice: see :func:`core_saw_loss`."""
    global _core_saw_loss
    _core_saw_loss = True


def core_saw_loss() -> bool:
    """Whether the core failed an op because a peer ended: the process should then
    :func:`await_notice` before it ends, so that the launcher names the dead peer, not
    this rank, as the job's failure."""
    return _core_saw_loss


def describe(notice: dict) -> str:
    """The message for a notice ``{"ranks": [...], "hosts": [...], "reason": "..."}``."""
    ranks = notice.get("ranks") or []
    hosts = notice.get("hosts") or []
    parts = []
    if ranks:
        parts.append(("rank " if len(ranks) == 1 else "ranks ")
                     + ", ".join(str(r) for r in ranks))
    if hosts:
        parts.append(("on host " if len(hosts) == 1 else "on hosts ") + ", ".join(hosts))
    who = " ".join(parts) or "a peer"
    reason = notice.get("reason") or "lost"
    return f"lost {who}: {reason}; the job is ending"


def record(notice: dict) -> None:
    """Records a lost-peer notice (the first one wins) and tells the callbacks of
    :func:`when_lost`."""
    global _failure
    with _lock:
        if _failure is not None:
            return
        _failure = errors.RankFailedError(describe(notice))
        _noticed.set()
        told = list(_on_lost)
    for callback in told:
        _tell(callback)


def _tell(callback) -> None:
    try:
        callback()
    except Exception:  # one failing must not keep the notice from the others
        logging.getLogger("hvdlite").exception("hvdlite: a lost-peer callback failed")


def when_lost(callback) -> None:
    """Calls ``callback()`` once when the launcher reports lost peers (at once if it
    already has), from the notice's reader thread. The core's is
    ``hvdlite_note_lost_peers``: a thread that runs its own blocking call's cycle across
    hosts waits inside the core, out of reach of :func:`failure`'s checks, so the core
    itself must hear of the notice."""
    with _lock:
        if _failure is None:
            _on_lost.append(callback)
            return
    _tell(callback)


def _reader(fd: int) -> None:
    buffered = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return
        if not chunk:
            return  # the wrapper is gone; it ends this process too
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            try:
                notice = json.loads(line)
            except ValueError:
                continue
            if isinstance(notice, dict):
                record(notice)


def start_listening(env=None) -> bool:
    """Starts the reader thread when the launcher gave a fault pipe (once per process).

    Returns:
        Whether a pipe is being read.
    """
    global _started
    env = os.environ if env is None else env
    value = env.get(ENV_FAULT_FD, "")
    with _lock:
        if _started:
            return True
        if not value.isdigit():
            return False
        fd = int(value)
        try:
            os.fstat(fd)
        except OSError:
            return False
        _started = True
    # Registered before runtime's shutdown at exit, so it runs after it (last in first out).
    atexit.register(_exit_if_lost)
    threading.Thread(target=_reader, args=(fd,), name="hvdlite-peer-faults",
                     daemon=True).start()
    return True


def _exit_if_lost():
    """At exit after lost peers: flushes the output and ends the process at once."""
    if _failure is None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(EXIT_LOST_PEERS)
