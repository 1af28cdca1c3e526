"""The launcher side of a job: start mpiexec, relay tagged output, end the job on failure.

Every rank wrapper (see rank_wrapper.py) connects back to a TCP socket the supervisor
listens on. Through it come each rank's hello, its output as whole lines and its exit
status; back through it goes the order to end the rank. The supervisor is one thread
with one selector: output is written in whole tagged lines with single writes, so ranks
never interleave mid-line, and the first failure is seen and acted on at once.

Lost ranks (one that exited with an error, a wrapper gone without an exit status, or
ranks silent for ``HVDLITE_PEER_TIMEOUT`` seconds: heartbeats flow both ways each
second, so a cut link shows as silence) are first announced to every surviving wrapper,
which passes the notice to its rank (hvdlite raises RankFailedError there, naming the
lost ranks and hosts); NOTICE_GRACE_S later every rank is ordered to end.
"""
import json
import logging
import os
import secrets
import selectors
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from hvdlite.runner import wire
from hvdlite.runner.remote_start import UNREACHABLE_PREFIX

logger = logging.getLogger("hvdlite")

# After the kill order, how long wrappers get to end their ranks before mpiexec's
# process group is terminated (wrappers escalate to SIGKILL after their own grace).
KILL_GRACE_S = wire.KILL_GRACE_S + 2.0
# After SIGTERM to mpiexec's group, how long before SIGKILL.
TERM_GRACE_S = 2.0
# After mpiexec exits, how long to wait for wrapper connections still draining output.
DRAIN_S = 5.0

_SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9, or ``signal N`` for unknown numbers."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_returncode(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by signal 9 (SIGKILL)``."""
    if returncode < 0:
        return f"was killed by signal {-returncode} ({signal_name(-returncode)})"
    return f"exited with code {returncode}"


def exit_code_for(returncode: int) -> int:
    """The launcher's exit code for a rank's return code: the code, or 128+signal."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class RankState:
    """What the supervisor knows about one rank."""

    rank: int
    host: str = ""
    pid: int = 0
    returncode: Optional[int] = None


@dataclass
class JobResult:
    """How a job ended.

    Attributes:
        exit_code: what the launcher exits with.
        failed_rank: the first rank that failed, if any.
        ranks: every rank that said hello, by rank.
        message: a one-line account of a failure, empty on success.
    """

    exit_code: int
    failed_rank: Optional[int] = None
    ranks: Dict[int, RankState] = field(default_factory=dict)
    message: str = ""


class _Connection:
    """One wrapper's control connection."""

    def __init__(self, sock):
        self.sock = sock
        self.reader = wire.FrameReader()
        self.rank: Optional[int] = None
        self.exited = False
        self.closed = False
        self.last_heard = time.monotonic()


class _OutputSink:
    """Writes tagged lines to the console and untagged ones to per-rank log files."""

    def __init__(self, output_dir: Optional[str], tag_hosts: bool = False):
        self.output_dir = output_dir
        self.tag_hosts = tag_hosts
        self.hosts: Dict[int, str] = {}   # rank -> host, from the hellos
        self.files = {}
        self.console_broken = {1: False, 2: False}
        if output_dir:
            os.makedirs(output_dir, exist_ok=True)

    def write(self, rank: int, kind: bytes, data: bytes):
        stream = "stdout" if kind == wire.MSG_STDOUT else "stderr"
        fd = 1 if kind == wire.MSG_STDOUT else 2
        where = f"@{self.hosts.get(rank, '?')}" if self.tag_hosts else ""
        prefix = f"[{rank}{where}]<{stream}>:".encode()
        lines = data.split(b"\n")[:-1]
        self.console(fd, b"".join(prefix + line + b"\n" for line in lines))
        if self.output_dir:
            log = self.files.get(rank)
            if log is None:
                log = open(os.path.join(self.output_dir, f"rank.{rank}.log"), "ab")
                self.files[rank] = log
            log.write(data)
            log.flush()

    def console(self, fd: int, data: bytes):
        # One write per batch of whole lines keeps lines intact on a shared terminal.
        if not self.console_broken[fd] and not wire.write_all(fd, data):
            self.console_broken[fd] = True

    def close(self):
        for log in self.files.values():
            log.close()
        self.files.clear()


class JobSupervisor:
    """Runs one job: mpiexec plus a control server for the rank wrappers.

    Args:
        num_ranks: how many wrappers will connect.
        start_timeout: seconds for every rank to connect before the job is ended.
        output_dir: --output-filename directory, or None.
        bind_host: address to listen on (127.0.0.1 for one machine, 0.0.0.0 for many).
        advertise_host: the name ranks connect to.
        rank_hosts: the host each rank is placed on (for messages), if known.
        tag_hosts: tag output lines with the host too (``[1@host]<stdout>:``).
    """

    def __init__(self, num_ranks: int, start_timeout: float, output_dir: Optional[str] = None,
                 bind_host: str = "127.0.0.1", advertise_host: str = "127.0.0.1",
                 rank_hosts: Optional[Sequence[str]] = None, tag_hosts: bool = False):
        self.num_ranks = num_ranks
        self.start_timeout = start_timeout
        self.token = secrets.token_hex(16)
        self.sel = selectors.DefaultSelector()
        self.server = socket.create_server((bind_host, 0), backlog=max(128, num_ranks))
        self.server.setblocking(False)
        port = self.server.getsockname()[1]
        host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        self.address = f"{host}:{port}"
        self.output = _OutputSink(output_dir, tag_hosts)
        self.rank_hosts = list(rank_hosts or [])
        self._mpiexec_partial = b""
        self.peer_timeout = wire.DEFAULT_PEER_TIMEOUT_S
        self.kill_due: Optional[float] = None   # the kill order after a lost-peer notice
        self.last_heartbeat = time.monotonic()
        self.ranks: Dict[int, RankState] = {}
        self.connections: List[_Connection] = []
        self.proc: Optional[subprocess.Popen] = None
        self.result: Optional[JobResult] = None   # set at the first failure or signal
        self.kill_time: Optional[float] = None
        self.term_time: Optional[float] = None
        self.killed_group = False
        self.mpiexec_stderr: List[bytes] = []
        self.signals = wire.SignalPipe()
        self.ended_by_owner = False   # end() was called: no signal, the owner's order

    def rank_env(self) -> Dict[str, str]:
        """The variables that tell a rank wrapper where the launcher is."""
        return {wire.ENV_ADDR: self.address, wire.ENV_TOKEN: self.token}

    # -- ending the job ----------------------------------------------------------------

    def _fail(self, exit_code: int, message: str, rank: Optional[int] = None,
              lost: Sequence[int] = (), reason: str = ""):
        """Records the first failure, reports it and orders every rank to end: at once,
        or, when ranks were ``lost`` (for ``reason``), after telling the others."""
        if self.result is not None:
            return
        self.result = JobResult(exit_code=exit_code, failed_rank=rank, message=message)
        self.output.console(2, f"hvdliterun: {message}\n".encode())
        if not lost:
            self._kill_all()
            return
        hosts = sorted({h for h in map(self._host_of, lost) if h})
        notice = json.dumps({"ranks": sorted(lost), "hosts": hosts, "reason": reason}).encode()
        for conn in self.connections:
            if not conn.exited and conn.rank is not None and conn.rank not in lost:
                self._send(conn, wire.MSG_PEER_LOST, notice)
        self.kill_due = time.monotonic() + wire.NOTICE_GRACE_S

    def _send(self, conn, kind, payload=b""):
        try:
            conn.sock.sendall(wire.encode_frame(kind, payload))
        except OSError:
            pass

    def _kill_all(self):
        if self.kill_time is not None:
            return
        self.kill_time = time.monotonic()
        # Also the wrappers of ranks that failed: they wait for this order (see
        # rank_wrapper.RankWrapper._linger).
        others = [c for c in self.connections if not c.closed]
        logger.debug("ordering %d rank(s) to end", len(others))
        for conn in others:
            try:
                conn.sock.sendall(wire.encode_frame(wire.MSG_KILL))
            except OSError:
                pass
        if not self.connections and self.proc is not None:
            # No wrapper to tell (none started yet): end mpiexec itself.
            self._terminate_group(signal.SIGTERM)

    def _terminate_group(self, sig):
        if self.proc is None or self.proc.poll() is not None and sig == signal.SIGTERM:
            return
        if sig == signal.SIGTERM:
            self.term_time = time.monotonic()
        else:
            self.killed_group = True
        logger.debug("sending %s to mpiexec's process group %d", signal_name(sig),
                     self.proc.pid)
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # -- the loop ----------------------------------------------------------------------

    def end(self):
        """Ends the job from another thread of this process, as SIGTERM would: the order
        of the program running the launcher (hvdlite.ray), not a signal it received."""
        self.ended_by_owner = True
        self.signals.send(signal.SIGTERM)

    def run(self, argv: Sequence[str], env: Mapping[str, str]) -> JobResult:
        """Starts ``argv`` (the mpiexec command) and supervises the job to its end.

        Args:
            argv: the mpiexec command line.
            env: its environment (must include :meth:`rank_env`).

        Returns:
            How the job ended.
        """
        previous = self.signals.install(tuple(_SIGNAL_EXIT))
        try:
            return self._run(argv, env)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.output.close()
            self.server.close()
            for conn in self.connections:
                conn.sock.close()

    def _run(self, argv, env) -> JobResult:
        # mpiexec gets a session of its own: a Ctrl-C at the terminal reaches only us,
        # and we end the job in order; its whole group can be signalled at the end.
        # Its stdin is /dev/null so that it never competes for the terminal.
        try:
            self.proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True)
        except OSError as exc:
            return JobResult(exit_code=1, message=f"cannot start {argv[0]}: {exc.strerror}")
        started = time.monotonic()
        self.sel.register(self.signals.reader, selectors.EVENT_READ, ("signal", None))
        self.sel.register(self.server, selectors.EVENT_READ, ("accept", None))
        self.sel.register(self.proc.stdout, selectors.EVENT_READ, ("mpi_out", 1))
        self.sel.register(self.proc.stderr, selectors.EVENT_READ, ("mpi_err", 2))
        pidfd = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(self.proc.pid)
                self.sel.register(pidfd, selectors.EVENT_READ, ("mpiexec", None))
            except OSError:
                pidfd = None
        mpiexec_done = None
        try:
            while True:
                now = time.monotonic()
                if mpiexec_done is None and self.proc.poll() is not None:
                    mpiexec_done = now
                    logger.debug("mpiexec %s", describe_returncode(self.proc.returncode))
                self._check_deadlines(now, started)
                if mpiexec_done is not None and now - mpiexec_done > DRAIN_S:
                    break
                # Once mpiexec is gone, wait only for what is already in flight: the
                # wrappers' last frames and connections still in the listen backlog.
                if mpiexec_done is not None:
                    timeout = 0.05
                else:
                    timeout = 0.5 if pidfd is not None else 0.1
                events = self.sel.select(timeout)
                for key, _ in events:
                    self._dispatch(key)
                if mpiexec_done is not None and not events and \
                        all(c.exited for c in self.connections):
                    break
        finally:
            if pidfd is not None:
                os.close(pidfd)
        self._on_mpiexec_exit()
        # Anything mpiexec left in its group (a stuck proxy) goes with it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self._finish()

    def _check_deadlines(self, now, started):
        if self.result is None and len(self.ranks) < self.num_ranks \
                and now - started > self.start_timeout:
            self._fail(1, f"only {len(self.ranks)} of {self.num_ranks} ranks started within "
                          f"{self.start_timeout:g} s (--start-timeout); "
                          f"{self._missing_ranks()}")
        if self.kill_due is not None and now >= self.kill_due:
            self.kill_due = None
            self._kill_all()
        if now - self.last_heartbeat >= wire.HEARTBEAT_INTERVAL_S:
            self.last_heartbeat = now
            self._keep_alive(now)
        if self.kill_time is not None:
            if self.term_time is None and now - self.kill_time > KILL_GRACE_S:
                self._terminate_group(signal.SIGTERM)
            elif self.term_time is not None and not self.killed_group \
                    and now - self.term_time > TERM_GRACE_S:
                self._terminate_group(signal.SIGKILL)

    def _keep_alive(self, now):
        """Heartbeats to every wrapper; ranks silent past the peer timeout are lost."""
        missed = min(2 * wire.HEARTBEAT_INTERVAL_S, self.peer_timeout)
        quiet = {}  # rank -> seconds since its last word, for those that missed beats
        for conn in self.connections:
            if conn.exited or conn.rank is None:
                continue
            self._send(conn, wire.MSG_HEARTBEAT)
            if now - conn.last_heard > missed:
                quiet[conn.rank] = now - conn.last_heard
        # A host or link that goes down silences all its ranks at once, but their last
        # beats were up to an interval apart: once one is past the timeout, its host's
        # others that missed beats too go with it (one report names them all).
        gone = [r for r, s in quiet.items() if s > self.peer_timeout]
        if gone and self.result is None:
            hosts = {self._host_of(r) for r in gone}
            silent = sorted(r for r in quiet if r in gone or self._host_of(r) in hosts)
            reason = (f"no word from them for {self.peer_timeout:g} s "
                      f"({wire.ENV_PEER_TIMEOUT}): their host or its link is down")
            self._fail(1, f"lost ranks {_short_list(silent)}{self._hosts_of(silent, True)}: "
                          f"{reason}; ending the job", lost=silent, reason=reason)

    def _host_of(self, rank):
        """The host a rank said it runs on (None before its hello)."""
        info = self.ranks.get(rank)
        return None if info is None else info.host

    def _missing_ranks(self) -> str:
        """``missing ranks: 2, 3 on host h2`` for the ranks that have not said hello."""
        missing = sorted(set(range(self.num_ranks)) - set(self.ranks))
        return f"missing ranks: {_short_list(missing)}{self._hosts_of(missing)}"

    def _hosts_of(self, ranks, started=False) -> str:
        """`` on host h2`` / `` on hosts h2, h3`` for ranks placed there (``started``:
        where they said they run), or ``""``."""
        if started:
            hosts = sorted({h for h in map(self._host_of, ranks) if h is not None})
        else:
            hosts = sorted({self.rank_hosts[r] for r in ranks if r < len(self.rank_hosts)})
        if not hosts:
            return ""
        return (" on host " if len(hosts) == 1 else " on hosts ") + ", ".join(hosts)

    def _dispatch(self, key):
        tag, extra = key.data
        if tag == "signal":
            for signum in self.signals.received():
                said = ("ended by the program that runs it" if self.ended_by_owner
                        else f"received {signal_name(signum)}")
                self._fail(_SIGNAL_EXIT.get(signum, 128 + signum), f"{said}, ending all ranks")
        elif tag == "accept":
            self._accept()
        elif tag == "conn":
            self._on_conn_readable(key, extra)
        elif tag == "mpiexec":
            self.sel.unregister(key.fileobj)
        else:
            self._on_mpiexec_output(key, extra)

    def _accept(self):
        while True:
            try:
                sock, _ = self.server.accept()
            except BlockingIOError:
                return
            sock.setblocking(True)
            conn = _Connection(sock)
            self.connections.append(conn)
            self.sel.register(sock, selectors.EVENT_READ, ("conn", conn))

    def _on_conn_readable(self, key, conn):
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._on_conn_closed(key, conn)
            return
        conn.last_heard = time.monotonic()
        try:
            frames = conn.reader.feed(data)
        except ValueError:
            frames = []
            self._on_conn_closed(key, conn)
        for kind, payload in frames:
            if conn.rank is None and kind != wire.MSG_HELLO:
                self._on_conn_closed(key, conn)
                return
            if kind == wire.MSG_HELLO:
                if not self._on_hello(conn, payload):
                    self._on_conn_closed(key, conn)
                    return
            elif kind in (wire.MSG_STDOUT, wire.MSG_STDERR):
                self.output.write(conn.rank, kind, payload)
            elif kind == wire.MSG_EXIT:
                try:
                    returncode = int(json.loads(payload)["returncode"])
                except (ValueError, KeyError, TypeError):
                    returncode = 1
                self._on_rank_exit(conn, returncode)

    def _on_hello(self, conn, payload) -> bool:
        try:
            hello = json.loads(payload)
        except ValueError:
            return False
        if not secrets.compare_digest(str(hello.get("token", "")), self.token):
            logger.warning("dropped a control connection with a wrong token")
            return False
        conn.rank = int(hello["rank"])
        self.output.hosts[conn.rank] = str(hello.get("host", ""))
        self.ranks[conn.rank] = RankState(rank=conn.rank, host=str(hello.get("host", "")),
                                          pid=int(hello.get("pid", 0)))
        logger.debug("rank %d started: pid %s on %s", conn.rank, hello.get("pid"),
                     hello.get("host"))
        if self.kill_time is not None:
            # The job is already ending; a late rank ends too.
            try:
                conn.sock.sendall(wire.encode_frame(wire.MSG_KILL))
            except OSError:
                pass
        return True

    def _on_rank_exit(self, conn, returncode):
        conn.exited = True
        state = self.ranks[conn.rank]
        state.returncode = returncode
        logger.debug("rank %d %s", conn.rank, describe_returncode(returncode))
        if returncode != 0 and self.kill_time is None:
            where = f" (pid {state.pid} on {state.host})" if state.pid else ""
            self._fail(exit_code_for(returncode),
                       f"rank {conn.rank}{where} {describe_returncode(returncode)}; "
                       f"ending the other ranks", rank=conn.rank, lost=[conn.rank],
                       reason=describe_returncode(returncode))

    def _on_conn_closed(self, key, conn):
        try:
            self.sel.unregister(key.fileobj)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.closed = True
        if conn.rank is not None and not conn.exited:
            conn.exited = True
            if self.kill_time is None and len(self.ranks) < self.num_ranks:
                # mpiexec gave up starting the job (a host it could not set up) and
                # ended the ranks it had started.
                self._fail(1, f"the job did not start: only {len(self.ranks)} of "
                              f"{self.num_ranks} ranks started before rank {conn.rank} was "
                              f"ended; {self._missing_ranks()}", rank=conn.rank)
            elif self.kill_time is None:
                self._fail(1, f"lost contact with rank {conn.rank} (its wrapper ended without "
                              f"an exit status); ending the other ranks", rank=conn.rank,
                           lost=[conn.rank], reason="its wrapper ended without an exit status")
        else:
            conn.exited = True

    def _on_mpiexec_output(self, key, fd):
        data = os.read(key.fd, 1 << 16)
        if not data:
            self.sel.unregister(key.fileobj)
            return
        if fd == 2:
            self.mpiexec_stderr.append(data)
            self._scan_for_unreachable(data)
        # Once the job is being ended, mpiexec's complaints about killed ranks are noise.
        if self.kill_time is None or logger.isEnabledFor(logging.DEBUG):
            self.output.console(fd, data)

    def _scan_for_unreachable(self, data: bytes):
        """Ends the job naming the host when the remote start reports it unreachable."""
        text = self._mpiexec_partial + data
        lines = text.split(b"\n")
        self._mpiexec_partial = lines.pop()
        for line in lines:
            message = line.decode("utf-8", "replace").strip()
            if not message.startswith(UNREACHABLE_PREFIX):
                continue
            host, _, reason = message[len(UNREACHABLE_PREFIX):].partition(": ")
            ranks = [r for r, h in enumerate(self.rank_hosts) if h == host]
            what = f"ranks {_short_list(ranks)}" if ranks else "ranks"
            self._fail(1, f"cannot start {what} on host {host}: it cannot be reached "
                          f"({reason})")

    def _on_mpiexec_exit(self):
        code = self.proc.returncode
        if self.result is None and len(self.ranks) < self.num_ranks:
            self._fail(exit_code_for(code) or 1,
                       f"mpiexec {describe_returncode(code)} before all ranks started "
                       f"({len(self.ranks)} of {self.num_ranks}); {self._missing_ranks()}")

    def _finish(self) -> JobResult:
        # Pick up output that mpiexec wrote just before it ended.
        for stream, fd in ((self.proc.stdout, 1), (self.proc.stderr, 2)):
            # Non-blocking: a proxy in a session of its own may still hold the pipe.
            try:
                os.set_blocking(stream.fileno(), False)
                rest = stream.read() or b""
            except (OSError, ValueError):
                rest = b""
            if rest and (self.kill_time is None or logger.isEnabledFor(logging.DEBUG)):
                self.output.console(fd, rest)
        if self.result is not None:
            self.result.ranks = self.ranks
            return self.result
        code = self.proc.returncode
        if code != 0:
            self.output.console(2, f"hvdliterun: mpiexec {describe_returncode(code)}\n".encode())
            return JobResult(exit_code=exit_code_for(code), ranks=self.ranks,
                             message=f"mpiexec {describe_returncode(code)}")
        return JobResult(exit_code=0, ranks=self.ranks)


def _short_list(items, limit=16):
    text = ", ".join(str(i) for i in items[:limit])
    return text + (", ..." if len(items) > limit else "")
