"""A rank's MPI identity, handed from the process mpiexec started to a Ray actor.

    python -I handoff.py            (the command hvdliterun's rank wrapper runs)

MPI's launcher (hydra) starts each rank itself and gives it its identity: the PMI
variables and a socket to its node's proxy (``PMI_FD``), plus, under hvdliterun, the
launcher's lost-peer pipe (``HVDLITE_FAULT_FD``). On Ray the rank must be the actor
that runs the user's functions, a process hydra did not start. So the process hydra
starts (this file, under the rank wrapper) passes its identity on: it connects to the
actor of its rank over a Unix socket of the actor's node, sends its MPI variables and
the descriptors (SCM_RIGHTS), and then stands in for the actor towards mpiexec until
the actor says goodbye (exit 0), leaves for an elastic reset (exit 75, as a rank of
hvdliterun's elastic driver) or goes away (exit 1: the launcher then ends the job as for
any lost rank). The actor calls MPI_Init later, with the variables and
descriptors it received, and becomes that rank.

The socket's name is abstract (``\\0hvdlite-ray-<job>-<rank>``): it lives in the
node's network namespace, so an actor and its rank meet only on the same node.

Run by path with ``-I`` (like the rank wrapper): standard library only; the actor side
(:class:`HandoffListener`) is imported as ``hvdlite.ray.handoff``.
"""
import array
import json
import os
import socket
import sys
import time

ENV_JOB = "HVDLITE_RAY_JOB"
# Variables that make up a rank's identity and settings, copied into the actor.
COPIED_PREFIXES = ("PMI_", "PMIX_", "MPI_", "MPIR_", "HYDI_", "HYDRA_", "OMPI_",
                   "HVDLITE_", "UCX_", "FI_")
# Descriptors a rank inherits (hydra's, then hvdliterun's lost-peer pipe).
FD_VARS = ("PMI_FD", "HYDI_CONTROL_FD", "HVDLITE_FAULT_FD")
GOODBYE = b"bye"
# The actor left its world for an elastic reset (hvdlite/elastic/protocol.py): the
# process exits with the reset code, so that the elastic driver counts the rank as a
# survivor, not as a failure.
RESET = b"reset"
RESET_EXIT_CODE = 75  # protocol.RESET_EXIT_CODE (this file imports nothing of hvdlite)
MAX_MESSAGE = 1 << 20


def socket_name(job: str, rank: int) -> str:
    """The abstract Unix socket name where the actor of ``rank`` in ``job`` listens."""
    return f"\0hvdlite-ray-{job}-{rank}"


def rank_of(env) -> int:
    """This process's MPI rank from the launcher's variables (hydra's or Open MPI's)."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if env.get(name, "").isdigit():
            return int(env[name])
    raise RuntimeError("no MPI rank variable (PMI_RANK/OMPI_COMM_WORLD_RANK): not started "
                       "by mpiexec")


def identity(env):
    """The variables to copy and the descriptors to pass: (variables, names, fds)."""
    variables = {k: v for k, v in env.items() if k.startswith(COPIED_PREFIXES)}
    names, fds = [], []
    for name in FD_VARS:
        value = env.get(name, "")
        if value.isdigit():
            try:
                os.fstat(int(value))
            except OSError:
                continue
            names.append(name)
            fds.append(int(value))
    return variables, names, fds


def _connect(name: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(name)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    """Hands this rank over to its actor and waits; returns the exit code."""
    env = dict(os.environ)
    job = env.get(ENV_JOB, "")
    try:
        rank = rank_of(env)
        sock = _connect(socket_name(job, rank), float(env.get("HVDLITE_RAY_HANDOFF_TIMEOUT",
                                                               "30")))
    except (OSError, RuntimeError) as exc:
        sys.stderr.write(f"hvdlite ray: rank process on {socket.gethostname()} cannot reach "
                         f"its actor (job {job}): {exc}\n")
        return 1
    variables, names, fds = identity(env)
    message = json.dumps({"variables": variables, "fds": names,
                          "host": socket.gethostname(),
                          "nice": os.getpriority(os.PRIO_PROCESS, 0)}).encode()
    sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    for fd in fds:
        # The actor holds them now; the proxy must see the actor's end, not ours.
        os.close(fd)
    # The actor says goodbye when its rank is done, and its end of the socket closes
    # when its process exits, after MPI_Finalize: only then may mpiexec see this rank
    # end (its proxy takes an earlier end for a rank that died before finalizing).
    reply = b""
    while True:
        data = sock.recv(64)
        if not data:
            break
        reply += data
    if reply.startswith(GOODBYE):
        return 0
    return RESET_EXIT_CODE if reply.startswith(RESET) else 1


class HandoffListener:
    """The actor's side: listens for its rank's process, takes its identity.

    Used by one thread of the actor: :meth:`accept` once, :meth:`release` at the end.
    """

    def __init__(self, job: str, rank: int):
        self.job, self.rank = job, rank
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(socket_name(job, rank))
        self._server.listen(1)
        self._conn = None

    def accept(self, timeout: float):
        """Waits for the rank process; returns (variables, host, niceness of the process).

        The variables already name this process's copies of the descriptors.

        Raises:
            TimeoutError: nothing came within ``timeout`` seconds.
        """
        self._server.settimeout(timeout)
        try:
            conn, _ = self._server.accept()
        except socket.timeout as exc:
            raise TimeoutError(f"rank {self.rank}'s process did not reach its actor "
                               f"within {timeout:g} s") from exc
        finally:
            self._server.close()
        conn.settimeout(timeout)
        fds = array.array("i")
        message, ancillary, _, _ = conn.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(16 * fds.itemsize))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - (len(data) % fds.itemsize)])
        info = json.loads(message.decode())
        variables = dict(info["variables"])
        for name, fd in zip(info["fds"], fds):
            os.set_inheritable(fd, True)
            variables[name] = str(fd)
        conn.settimeout(None)
        # A bare descriptor, which nothing in Python closes: the kernel closes it when
        # this process ends, after MPI_Finalize ran at exit (see main()).
        self._conn = conn.detach()
        return variables, info.get("host", ""), info.get("nice")

    def release(self, message=GOODBYE):
        """Tells the rank process that this rank ends well (``GOODBYE``: it exits with
        success) or leaves for a reset (``RESET``), once this process has exited (the
        connection is left open until then)."""
        if self._conn is not None:
            try:
                os.write(self._conn, message)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
