"""The worker's side of forming a world: what runs inside each Ray actor.

The driver (see world.py) calls these functions in every worker process, through the
actors of RayExecutor or Ray Train's worker group, in this order: :func:`describe_node`,
:func:`open_node_shell` (one worker per node), :func:`listen`, :func:`join`; and
:func:`leave` at the end. A worker process belongs to at most one world: its state
lives here, one per process.
"""
import logging
import os
import secrets
import socket
from typing import Dict, Optional

from hvdlite.elastic import protocol
from hvdlite.ray.handoff import RESET, HandoffListener
from hvdlite.ray.node_shell import NodeShellServer

logger = logging.getLogger("hvdlite")


class _WorkerState:
    """This process's part of a world: its node shell (if any) and its rank's handoff."""

    def __init__(self):
        self.node_shell: Optional[NodeShellServer] = None
        self.listener: Optional[HandoffListener] = None
        self.rank: Optional[int] = None


_state = _WorkerState()


def describe_node() -> Dict[str, str]:
    """Where this worker runs: its node's address, host name and Ray node id."""
    import ray  # the worker is a Ray process: ray is there

    context = ray.get_runtime_context()
    return {"ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(),
            "node_id": context.get_node_id(), "pid": os.getpid()}


def check_installation() -> Optional[str]:
    """What this node lacks to run a rank, or None: hvdlite's core and its MPI library
    must load, and mpiexec's proxy (started here with this Python's path) must exist."""
    try:
        import hvdlite._native  # noqa: F401  (loads libmpi, then the core)
    except ImportError as exc:
        return f"hvdlite's native core cannot be loaded: {exc}"
    from hvdlite.runner import mpi_command

    try:
        mpi_command.find_mpiexec()
    except mpi_command.MpiNotFoundError as exc:
        return f"no MPI launcher: {exc}"
    return None


def open_node_shell(token: str) -> int:
    """Starts this node's shell server (see node_shell.py); returns its port."""
    if _state.node_shell is None:
        import ray

        _state.node_shell = NodeShellServer(ray.util.get_node_ip_address(), token)
    return _state.node_shell.port


def listen(job: str, rank: int) -> None:
    """Starts listening for the process of ``rank`` that mpiexec will start on this node."""
    _state.listener = HandoffListener(job, rank)
    _state.rank = rank


def join(timeout: float, extra_env: Optional[Dict[str, str]] = None) -> str:
    """Takes over the rank's MPI identity: ``hvd.init()`` here then makes this process
    that rank. Returns the host name of the process mpiexec started (this node's).

    Raises:
        TimeoutError: the rank's process did not come within ``timeout`` seconds.
    """
    variables, host, nice = _state.listener.accept(timeout)
    os.environ.update(variables)
    # An elastic rank leaving for a reset exits at once (hvdlite/elastic/state.py): its
    # stand-in must then exit with the reset code, not as a lost rank.
    protocol.on_leave_for_reset(_leave_for_reset)
    os.environ.update(extra_env or {})
    if nice is not None:
        take_priority(nice)
    return host


def take_priority(nice: int) -> bool:
    """Runs this process's threads at niceness ``nice``: its stand-in's, which is the
    launcher's (node_shell.py starts MPI's proxy at its caller's niceness), as a rank's
    under hvdliterun.

    Ray starts workers at a low priority (``RAY_worker_niceness``, 15), meant for tasks
    beside the raylet; a rank is the job's main work, and at that priority every idle
    process of the node (Ray's own, the driver) comes first: on a busy node a rank then
    trains measurably slower than under hvdliterun (docs/ray.md). Raising the priority
    needs CAP_SYS_NICE (root) or RLIMIT_NICE; without them the worker stays as Ray made
    it. Linux keeps a niceness per thread, and new threads inherit their creator's, so
    every thread there is now is set. Returns whether it was.
    """
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if current <= nice:
            return True
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        return True
    except (OSError, ValueError) as exc:
        logger.info("hvdlite ray: rank stays at Ray's worker niceness %s (%s)", current, exc)
        return False


def leave() -> None:
    """Ends this worker's rank well: its process (under mpiexec) ends with success once
    this process has exited, after MPI_Finalize.

    The node shell detaches from its commands: the node's MPI proxy serves every rank of
    the node until their processes end, and then ends by itself.
    """
    if _state.listener is not None:
        _state.listener.release()
    if _state.node_shell is not None:
        _state.node_shell.detach()


def _leave_for_reset() -> None:
    if _state.listener is not None:
        _state.listener.release(RESET)


def new_token() -> str:
    """A fresh secret for a world's node shells."""
    return secrets.token_hex(16)
