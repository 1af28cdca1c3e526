"""The per-rank wrapper that mpiexec starts in place of the user's command.

    python rank_wrapper.py -- python train.py --epochs 3

mpiexec starts one wrapper per rank. The wrapper runs the user's command (an argument
vector, never a shell string) with its output on pipes, in a session of its own, and:

* reports to the launcher over a TCP control connection (address and secret in
  ``HVDLITE_LAUNCHER_ADDR`` / ``HVDLITE_LAUNCHER_TOKEN``): a hello with its rank and pid,
  the command's output as whole lines, and finally the exit status;
* ends the command's whole process group when the launcher says so, when the control
  connection drops (the launcher died), or when the wrapper itself is signalled;
* exchanges heartbeats with the launcher: a launcher silent for ``HVDLITE_PEER_TIMEOUT``
  seconds (a cut link) is lost, and the command is ended;
* passes the launcher's lost-peer notices (and its own, for a lost launcher) to the
  command through a pipe (``HVDLITE_FAULT_FD``): hvdlite raises RankFailedError in
  the rank's pending waits (see hvdlite/peer_faults.py) before the rank is ended;
* without a launcher (variables unset) writes the tagged lines to its own stdout/stderr.

This file is run by path, not as ``hvdlite.runner.rank_wrapper``, so that each rank
starts without importing the hvdlite package (and its native library): it must use the
standard library only, and it loads the protocol (wire.py, stdlib only too) by path.
"""
import ctypes
import importlib.util
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time


def _load_wire_by_path():
    # Run by path with -I (see job.rank_command): neither the hvdlite package nor the
    # script's folder is importable, and importing the package would load the core.
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wire.py")
    spec = importlib.util.spec_from_file_location("_hvdlite_rank_wire", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __package__:  # imported as hvdlite.runner.rank_wrapper (the launcher, tests)
    from hvdlite.runner import wire
else:
    wire = _load_wire_by_path()

# Rank variables set by the MPI launchers we know, in order of preference.
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
# Descriptors that MPICH's hydra hands each process for PMI; the command is the real MPI
# process, so they must survive into it (subprocess closes other descriptors).
_INHERITED_FD_VARS = ("PMI_FD", "HYDI_CONTROL_FD")

# After the command exits, how long its leftover children may hold the pipes open.
DRAIN_AFTER_EXIT_S = 1.0
# Lines longer than this are forwarded in pieces rather than buffered without bound.
MAX_LINE = 1 << 16


def _env_int(env, names, default):
    for name in names:
        value = env.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return default


def rank_info(env):
    """Reads rank, size, local rank and local size from the MPI launcher's variables.

    Args:
        env: the environment mapping to read.

    Returns:
        A dict with keys rank, size, local_rank, local_size (rank 0 of 1 when no MPI
        launcher variables are present).
    """
    return {
        "rank": _env_int(env, _RANK_VARS, 0),
        "size": _env_int(env, _SIZE_VARS, 1),
        "local_rank": _env_int(env, _LOCAL_RANK_VARS, 0),
        "local_size": _env_int(env, _LOCAL_SIZE_VARS, 1),
    }


def _inherited_fds(env):
    fds = []
    for name in _INHERITED_FD_VARS:
        value = env.get(name, "")
        if value.isdigit():
            fd = int(value)
            try:
                os.fstat(fd)
            except OSError:
                continue
            fds.append(fd)
    return fds


def _parent_death_setter():
    # Resolved before fork: the child between fork and exec should only make the call.
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None
    pr_set_pdeathsig = 1

    def set_parent_death_signal():
        # If the wrapper is SIGKILLed, the kernel kills the command too, so a killed
        # wrapper never leaves a rank behind.
        prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)

    return set_parent_death_signal


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# The shared-memory segments of a host's ranks: MPICH's (mpich_shm_*) and Open MPI's
# (sm_segment.<host>.<uid>.<job>.<rank> of its sm transport; vader_segment.* before 5.0)
# are unlinked by MPI_Finalize, so a rank that ends without it (killed, os._exit) leaves
# them in /dev/shm for good. (The core's exit of a rank alone knows the same names:
# MappedMpiSegments in native/src/backend/backend_mpi.cc; a new MPI's goes in both.)
SHM_DIR = "/dev/shm"
MPI_SEGMENT_PREFIXES = ("mpich_shm_", "sm_segment.", "vader_segment.")


def _mapped_paths(directory):
    """Every file in ``directory`` that some live process of this host maps (as far as
    /proc lets us read)."""
    paths = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(directory + "/")
                    if at >= 0:
                        paths.add(line[at:].rstrip("\n"))
        except OSError:
            continue  # ended, or not ours to read
    return paths


def remove_orphaned_mpi_segments(since, directory=SHM_DIR):
    """Unlinks the MPI shared-memory segments made since ``since`` (a time.time()) that
    no process maps any more: what this host's ranks of a job that ended without
    MPI_Finalize left behind. The last rank wrapper of a host to see its rank end
    finds them unmapped; a segment of another job still running is mapped (its maker
    maps it right after making it: one younger than a second is left alone), and only
    this user's segments are looked at. Processes this one cannot see (another PID
    namespace sharing this /dev/shm) count as none: do not share /dev/shm between jobs
    so. Returns the names removed."""
    now = time.time()
    candidates = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not name.startswith(MPI_SEGMENT_PREFIXES):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.stat(path)
        except OSError:
            continue
        if info.st_uid == os.geteuid() and since - 1 <= info.st_ctime <= now - 1:
            candidates.append(path)
    if not candidates:
        return []
    mapped = _mapped_paths(directory)
    removed = []
    for path in candidates:
        if path in mapped:
            continue
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


class _Sink:
    """Where the command's lines go: the launcher's connection or our own stdout/stderr."""

    def __init__(self, rank, sock):
        self.rank = rank
        self.sock = sock
        self.broken = False

    def lines(self, kind, data):
        if not data:
            return
        if self.sock is not None:
            self.send(kind, data)
            return
        stream = "stdout" if kind == wire.MSG_STDOUT else "stderr"
        prefix = f"[{self.rank}]<{stream}>:".encode()
        out = b"".join(prefix + line + b"\n" for line in data.split(b"\n")[:-1])
        wire.write_all(1 if kind == wire.MSG_STDOUT else 2, out)

    def send(self, kind, payload=b""):
        if self.sock is None or self.broken:
            return
        try:
            self.sock.sendall(wire.encode_frame(kind, payload))
        except OSError:
            self.broken = True


def _connect(addr, attempts=10):
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    last = None
    for attempt in range(attempts):
        try:
            return socket.create_connection((host, int(port)), timeout=10)
        except OSError as exc:
            last = exc
            time.sleep(min(0.1 * (attempt + 1), 1.0))
    raise last


class RankWrapper:
    """Runs one rank's command and relays its output and exit status."""

    def __init__(self, command, env=None):
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.info = rank_info(self.env)
        self.child = None
        self.sel = selectors.DefaultSelector()
        self.kill_started = None      # monotonic time of the SIGTERM to the command
        self.killed_hard = False
        self.child_exit_time = None
        self.open_streams = 0
        self.partial = {}
        self.sink = None
        self.signals = wire.SignalPipe()
        try:
            self.peer_timeout = wire.peer_timeout(self.env)
        except ValueError:
            self.peer_timeout = wire.DEFAULT_PEER_TIMEOUT_S
        self.last_heard = self.last_sent = time.monotonic()
        self.kill_at = None           # monotonic time of a kill scheduled after a notice
        self.fault_r = self.fault_w = None
        self.started = time.time()

    def _child_env(self):
        env = dict(self.env)
        # The secret belongs to this wrapper; the command has no use for it.
        env.pop(wire.ENV_ADDR, None)
        env.pop(wire.ENV_TOKEN, None)
        env["HVDLITE_RANK"] = str(self.info["rank"])
        env["HVDLITE_SIZE"] = str(self.info["size"])
        env["HVDLITE_LOCAL_RANK"] = str(self.info["local_rank"])
        env["HVDLITE_LOCAL_SIZE"] = str(self.info["local_size"])
        if self.fault_r is not None:
            env[wire.ENV_FAULT_FD] = str(self.fault_r)
        return env

    def notify(self, notice):
        """Passes a lost-peer notice (a dict) to the command, once."""
        if self.fault_w is None:
            return
        try:
            os.write(self.fault_w, json.dumps(notice).encode() + b"\n")
        except OSError:
            pass

    def start_kill(self):
        """SIGTERM the command's process group now, SIGKILL it after wire.KILL_GRACE_S."""
        if self.kill_started is None and self.child is not None:
            self.kill_started = time.monotonic()
            _killpg(self.child.pid, signal.SIGTERM)

    def run(self):
        """Runs the command to the end; returns the wrapper's exit code."""
        addr = self.env.get(wire.ENV_ADDR)
        sock = None
        if addr:
            try:
                sock = _connect(addr)
            except (OSError, ValueError) as exc:
                wire.write_all(2, f"[{self.info['rank']}]<stderr>:hvdlite rank wrapper: "
                                  f"cannot reach the launcher at {addr}: {exc}\n".encode())
                return 1
            # A send blocked this long (a cut link) breaks the connection, not the wrapper.
            sock.settimeout(self.peer_timeout)
            self.fault_r, self.fault_w = os.pipe()
        self.sink = _Sink(self.info["rank"], sock)

        self.signals.install((signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
        try:
            self.child = subprocess.Popen(
                self.command, env=self._child_env(), stdin=None,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=_inherited_fds(self.env) + ([self.fault_r] if self.fault_r else []),
                start_new_session=True, preexec_fn=_parent_death_setter())
        except OSError as exc:
            self.sink.send(wire.MSG_HELLO, self._hello(os.getpid()))
            self.sink.lines(wire.MSG_STDERR, f"hvdliterun: cannot run {self.command[0]!r}: "
                                        f"{exc.strerror}\n".encode())
            returncode = 127
            self.sink.send(wire.MSG_EXIT, json.dumps(
                {"rank": self.info["rank"], "returncode": returncode}).encode())
            return returncode
        self.sink.send(wire.MSG_HELLO, self._hello(self.child.pid))
        if self.fault_r is not None:
            os.close(self.fault_r)  # the command's now

        self.sel.register(self.signals.reader, selectors.EVENT_READ, "signal")
        for stream, kind in ((self.child.stdout, wire.MSG_STDOUT),
                             (self.child.stderr, wire.MSG_STDERR)):
            self.sel.register(stream, selectors.EVENT_READ, kind)
            self.partial[kind] = b""
            self.open_streams += 1
        if sock is not None:
            self.sel.register(sock, selectors.EVENT_READ, "control")
        pidfd = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(self.child.pid)
                self.sel.register(pidfd, selectors.EVENT_READ, "child")
            except OSError:
                pidfd = None
        reader = wire.FrameReader()
        try:
            self._loop(sock, reader, pidfd is not None)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        # Whatever the command left in its group (daemons, stuck workers) ends with it,
        # and so does MPI's shared memory where the job's ranks died without finalizing.
        _killpg(self.child.pid, signal.SIGKILL)
        remove_orphaned_mpi_segments(self.started)
        returncode = self.child.returncode
        self.sink.send(wire.MSG_EXIT, json.dumps(
            {"rank": self.info["rank"], "returncode": returncode}).encode())
        if returncode != 0 and self.kill_started is None and not self.sink.broken:
            self._linger(sock, reader)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_WR)
                sock.close()
            except OSError:
                pass
        return returncode if returncode >= 0 else 128 - returncode

    def _hello(self, pid):
        return json.dumps({
            "token": self.env.get(wire.ENV_TOKEN, ""), "pid": pid, "wrapper_pid": os.getpid(),
            "host": socket.gethostname(), **self.info}).encode()

    def _loop(self, sock, reader, have_pidfd):
        while True:
            if self.child.returncode is None:
                if self.child.poll() is not None:
                    self.child_exit_time = time.monotonic()
                    # Leftover children of the command get the same end as the command.
                    _killpg(self.child.pid, signal.SIGTERM)
            if self.child.returncode is not None and self.open_streams == 0:
                return
            now = time.monotonic()
            if (self.kill_started is not None and not self.killed_hard
                    and now - self.kill_started > wire.KILL_GRACE_S):
                self.killed_hard = True
                _killpg(self.child.pid, signal.SIGKILL)
            if sock is not None:
                self._keep_alive(now)
            if self.kill_at is not None and now >= self.kill_at:
                self.kill_at = None
                self.start_kill()
            if (self.child_exit_time is not None
                    and now - self.child_exit_time > DRAIN_AFTER_EXIT_S):
                _killpg(self.child.pid, signal.SIGKILL)
                if now - self.child_exit_time > DRAIN_AFTER_EXIT_S + wire.KILL_GRACE_S:
                    # Someone outside the group holds the pipes; stop waiting for them.
                    return
            # Without a pidfd the only way to notice the exit is to look again soon.
            timeout = 0.5 if have_pidfd else 0.1
            for key, _ in self.sel.select(timeout):
                tag = key.data
                if tag == "signal":
                    self.signals.received()
                    self.start_kill()
                elif tag == "child":
                    self.sel.unregister(key.fileobj)
                elif tag == "control":
                    self._on_control(sock, reader, key)
                else:
                    self._on_output(key, tag)

    def _linger(self, sock, reader):
        """After the command failed on its own: stays until the launcher's kill order.

        mpiexec ends every rank as soon as one of its processes fails; staying lets the
        launcher first tell the survivors which rank was lost (they raise, naming it).
        """
        deadline = time.monotonic() + wire.NOTICE_GRACE_S + wire.KILL_GRACE_S
        sock.settimeout(0.5)
        while time.monotonic() < deadline:
            try:
                data = sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                frames = reader.feed(data)
            except ValueError:
                return
            if any(kind == wire.MSG_KILL for kind, _ in frames):
                return

    def _keep_alive(self, now):
        """Sends a heartbeat when one is due; a launcher silent too long is lost."""
        if self.sink.broken:
            return
        if now - self.last_sent >= wire.HEARTBEAT_INTERVAL_S:
            self.last_sent = now
            self.sink.send(wire.MSG_HEARTBEAT)
        if now - self.last_heard > self.peer_timeout and self.kill_at is None \
                and self.kill_started is None:
            self.sink.broken = True
            self.notify({"reason": f"no word from the launcher at {self.env.get(wire.ENV_ADDR)} "
                                   f"for {self.peer_timeout:g} s ({wire.ENV_PEER_TIMEOUT}): "
                                   f"this host's link or the launcher's host is down"})
            self.kill_at = now + wire.NOTICE_GRACE_S

    def _on_control(self, sock, reader, key):
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        self.last_heard = time.monotonic()
        if not data:
            # The launcher is gone: nobody can end this job any more but us.
            self.sel.unregister(key.fileobj)
            self.sink.broken = True
            self.start_kill()
            return
        try:
            frames = reader.feed(data)
        except ValueError:
            frames = [(wire.MSG_KILL, b"")]
        for kind, payload in frames:
            if kind == wire.MSG_PEER_LOST:
                try:
                    self.notify(json.loads(payload))
                except ValueError:
                    self.notify({"reason": "lost peers"})
        if any(kind == wire.MSG_KILL for kind, _ in frames):
            self.start_kill()

    def _on_output(self, key, kind):
        data = os.read(key.fd, 65536)
        buf = self.partial[kind] + data
        if not data:
            self.sel.unregister(key.fileobj)
            key.fileobj.close()
            self.open_streams -= 1
            self.partial[kind] = b""
            if buf:
                self.sink.lines(kind, buf + b"\n")
            return
        cut = buf.rfind(b"\n") + 1
        if cut == 0 and len(buf) >= MAX_LINE:
            self.sink.lines(kind, buf + b"\n")
            self.partial[kind] = b""
            return
        self.partial[kind] = buf[cut:]
        self.sink.lines(kind, buf[:cut])


def main(argv=None):
    """Entry point: ``rank_wrapper.py -- command [args...]``.

    Returns:
        The command's exit code, 128+N when it died of signal N, 127 when it could
        not be started, 1 when the launcher could not be reached, 2 for bad usage.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        wire.write_all(2, b"usage: rank_wrapper.py -- command [args...]\n")
        return 2
    return RankWrapper(args).run()


if __name__ == "__main__":
    sys.exit(main())
