"""hvdliterun's remote shell on Ray: commands run on a node by a worker actor there.

    python -I node_shell.py HOST COMMAND      (as ssh: mpiexec's remote-start program)

hvdliterun starts ranks on other hosts through a remote shell (ssh, or any command
called like rsh; see hvdlite/runner/remote_start.py). On Ray the nodes need no ssh:
one worker actor per node runs a :class:`NodeShellServer`, a thread that accepts
commands on the node's address from holders of the job's secret, runs each with
``/bin/sh -c`` in a session of its own, streams its output back and finally its exit
status; when the caller goes away (mpiexec ended or was killed) the command's whole
process group is ended. When the actor itself is about to end (the job is ending), it
detaches: the caller exits with 0 and the command (MPI's proxy) ends by itself once its
ranks have finalized. This file's ``main`` is the caller: it finds the node's server
in ``HVDLITE_RAY_NODE_SHELLS`` (``host=port,...``), with the secret in
``HVDLITE_RAY_NODE_SHELL_TOKEN``, and exits with the command's status, or with 255
(as ssh) when the node cannot be reached, so that hvdliterun names the host.

Run by path with ``-I``: standard library only.
"""
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading

ENV_SHELLS = "HVDLITE_RAY_NODE_SHELLS"
ENV_TOKEN = "HVDLITE_RAY_NODE_SHELL_TOKEN"
_HEADER = struct.Struct("!cI")
OUT, ERR, EXIT, DETACH = b"O", b"E", b"X", b"D"
UNREACHABLE = 255
CONNECT_TIMEOUT_S = 10.0


def parse_shells(value: str):
    """``host=port,...`` -> {host: port}."""
    shells = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        host, _, port = item.rpartition("=")
        shells[host] = int(port)
    return shells


def format_shells(shells) -> str:
    """{host: port} -> ``host=port,...``."""
    return ",".join(f"{host}={port}" for host, port in shells.items())


def _recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data


def _send(sock, kind, payload=b""):
    sock.sendall(_HEADER.pack(kind, len(payload)) + payload)


def _recv(sock):
    kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return kind, _recv_exact(sock, length)


def run_remote(host: str, command: str, env=None) -> int:
    """Runs ``command`` on ``host``'s node shell; returns its exit status (255: unreachable).

    Its output goes to this process's stdout and stderr as it comes.
    """
    env = os.environ if env is None else env
    shells = parse_shells(env.get(ENV_SHELLS, ""))
    if host not in shells:
        sys.stderr.write(f"hvdlite ray node shell: no worker actor on host {host} "
                         f"(known: {', '.join(shells) or 'none'})\n")
        return UNREACHABLE
    try:
        sock = socket.create_connection((host, shells[host]), timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(None)
        _send(sock, b"C", json.dumps({"token": env.get(ENV_TOKEN, ""), "command": command,
                                      "nice": os.getpriority(os.PRIO_PROCESS, 0)}).encode())
    except OSError as exc:
        sys.stderr.write(f"hvdlite ray node shell: cannot reach the worker actor on host "
                         f"{host} (port {shells[host]}): {exc}\n")
        return UNREACHABLE
    try:
        while True:
            kind, payload = _recv(sock)
            if kind == EXIT:
                return int(payload.decode())
            if kind == DETACH:
                return 0
            os.write(1 if kind == OUT else 2, payload)
    except (OSError, ConnectionError, ValueError) as exc:
        sys.stderr.write(f"hvdlite ray node shell: lost the worker actor on host {host} "
                         f"while it ran the command: {exc}\n")
        return UNREACHABLE


def main(argv=None) -> int:
    """Entry point: ``HOST COMMAND`` (the command as one shell string, as ssh sends it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        sys.stderr.write("usage: node_shell.py HOST COMMAND\n")
        return 2
    return run_remote(args[0], " ".join(args[1:]))


class NodeShellServer:
    """Runs the commands of the job's secret holders on this node (one per node).

    A daemon thread accepts; each connection gets a thread that runs one command and
    relays its output. :meth:`close` stops accepting and ends the commands still running.
    """

    def __init__(self, host: str, token: str):
        self.token = token
        self._sock = socket.create_server((host, 0))
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._children = {}  # child -> its caller's connection. Guarded by _lock.
        self._closed = False
        threading.Thread(target=self._accept, name="hvdlite-node-shell", daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            kind, payload = _recv(conn)
            request = json.loads(payload.decode())
            if kind != b"C" or request.get("token") != self.token:
                return
            conn.settimeout(None)
            self._run(conn, request["command"], request.get("nice"))
        except (OSError, ConnectionError, ValueError, KeyError):
            pass
        finally:
            conn.close()

    def _run(self, conn, command, nice=None):
        # The command runs at its caller's niceness, as under sshd, not at the Ray
        # worker's (15): the ranks it starts are the job's main work (see worker.py).
        child = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True,
                                 preexec_fn=None if nice is None else _niceness_setter(nice))
        with self._lock:
            if self._closed:
                _killpg(child.pid)
            self._children[child] = conn
        sel = selectors.DefaultSelector()
        sel.register(child.stdout, selectors.EVENT_READ, OUT)
        sel.register(child.stderr, selectors.EVENT_READ, ERR)
        sel.register(conn, selectors.EVENT_READ, None)
        open_streams = 2
        try:
            while open_streams:
                for key, _ in sel.select():
                    if key.data is None:
                        # The caller went away: the job ended (or mpiexec was killed), so
                        # the command goes too, unless the actor detached from it.
                        self._end_unless_detached(child)
                        return
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                    else:
                        _send(conn, key.data, data)
            returncode = child.wait()
            _send(conn, EXIT, str(returncode if returncode >= 0
                                  else 128 - returncode).encode())
        except OSError:
            self._end_unless_detached(child)
        finally:
            sel.close()
            with self._lock:
                self._children.pop(child, None)

    def _end_unless_detached(self, child):
        with self._lock:
            attached = child in self._children
        if attached:
            _killpg(child.pid)

    def detach(self):
        """Lets every caller go (exit 0) and every command run on to its own end."""
        with self._lock:
            self._closed = True
            connections = list(self._children.values())
            self._children.clear()
        for conn in connections:
            try:
                _send(conn, DETACH)
            except OSError:
                pass

    def close(self):
        """Stops accepting and ends every command still running (SIGKILL to its group)."""
        with self._lock:
            self._closed = True
            children = list(self._children)
            self._children.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        for child in children:
            _killpg(child.pid)


def _niceness_setter(nice):
    def set_niceness():
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError:  # not permitted: the command keeps this process's niceness
            pass

    return set_niceness


def _killpg(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
