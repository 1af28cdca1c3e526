"""The elastic driver: one world (mpiexec job) after another, from the last commit.

    hvdliterun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py

MPI cannot shrink or grow a world in place, so a reset ends the world and starts the
next one: with the surviving slots when a rank died, with the added ones when the
discovery script lists more. Each rank keeps its last commit in tmpfs on its host (see
hvdlite/elastic/store.py), where the next world's ranks find it and broadcast it from
the rank that has the newest (hvdlite/elastic/state.py).

The driver is one thread that runs the worlds (each supervised by a JobSupervisor),
plus two daemon threads: one runs the discovery script every interval, one answers
rank 0's "were hosts added?" at each commit. They share the SlotBook under its lock.
"""
import logging
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from hvdlite.elastic import protocol
from hvdlite.runner import hosts as hostlib
from hvdlite.runner import job
from hvdlite.runner.elastic_settings import ElasticSettings
from hvdlite.runner.supervisor import JobResult, JobSupervisor, describe_returncode

logger = logging.getLogger("hvdlite")

DISCOVERY_TIMEOUT_S = 10.0
HOST_PROBE_TIMEOUT_S = 10.0
# An exit reported this soon after the driver ordered the world to end, with a code
# the order does not produce, is a rank that died on its own at the same moment.
_OWN_DEATH_WINDOW_S = 1.0


def discover_hosts(script: str, timeout: float = DISCOVERY_TIMEOUT_S) -> List[hostlib.HostSlots]:
    """Runs the discovery script and parses its ``host[:slots]`` lines.

    Raises:
        RuntimeError: the script failed, timed out or printed something unreadable.
    """
    try:
        proc = subprocess.run(shlex.split(script), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"host discovery script {script!r}: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"host discovery script {script!r} "
                           f"{describe_returncode(proc.returncode)}: {proc.stderr.strip()}")
    lines = [line.strip() for line in proc.stdout.splitlines()
             if line.strip() and not line.strip().startswith("#")]
    if not lines:
        return []
    try:
        return hostlib.parse_host_string(",".join(lines))
    except hostlib.HostSpecError as exc:
        raise RuntimeError(f"host discovery script {script!r}: {exc}") from exc


class SlotBook:
    """Which slots may run ranks: the discovered hosts minus failed slots and lost hosts.

    A failed rank takes its slot out, a lost host takes all of its; with a cooldown range
    they come back after a random time in it, else never. Used by the driver thread and
    the discovery and update threads, always under ``lock``.
    """

    def __init__(self, cooldown_range: Optional[Tuple[float, float]]):
        self.lock = threading.Lock()
        self.cooldown_range = cooldown_range
        self.hosts: List[hostlib.HostSlots] = []   # Guarded by lock.
        self.dropped: Dict[str, List[float]] = {}   # host -> until when each slot is out
        self.lost: Dict[str, float] = {}            # host -> until when it is out

    def _until(self) -> float:
        if self.cooldown_range is None:
            return float("inf")
        return time.monotonic() + random.uniform(*self.cooldown_range)

    def set_hosts(self, hosts: List[hostlib.HostSlots]):
        with self.lock:
            self.hosts = list(hosts)

    def drop_slot(self, host: str):
        with self.lock:
            self.dropped.setdefault(host, []).append(self._until())

    def lose_host(self, host: str):
        with self.lock:
            self.lost[host] = self._until()

    def usable(self) -> List[hostlib.HostSlots]:
        """The hosts and slots ranks may use now, in discovery order."""
        now = time.monotonic()
        with self.lock:
            out = []
            for host, slots in self.hosts:
                if self.lost.get(host, 0) > now:
                    continue
                out_now = sum(1 for until in self.dropped.get(host, []) if until > now)
                if slots - out_now > 0:
                    out.append(hostlib.HostSlots(host, slots - out_now))
            return out

    def pending_return(self) -> bool:
        """Whether some slot or host that is out will come back."""
        now = time.monotonic()
        with self.lock:
            times = [t for ts in self.dropped.values() for t in ts] + list(self.lost.values())
            return any(now < t < float("inf") for t in times)


def plan_world(usable: List[hostlib.HostSlots], size: int) -> List[hostlib.HostSlots]:
    """Takes ``size`` slots from the usable hosts, in order."""
    plan, left = [], size
    for host, slots in usable:
        if left == 0:
            break
        take = min(slots, left)
        plan.append(hostlib.HostSlots(host, take))
        left -= take
    return plan


class _UpdateService:
    """Answers each rank 0's commit-time question: should this world reset to grow?

    One daemon thread; a connection carries ``<token> <generation>`` and gets ``1`` or
    ``0`` back.
    """

    def __init__(self, driver: "ElasticDriver", bind_host: str, advertise_host: str):
        self.driver = driver
        self.token = secrets.token_hex(16)
        self.server = socket.create_server((bind_host, 0))
        self.server.settimeout(0.5)
        port = self.server.getsockname()[1]
        host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        self.address = f"{host}:{port}"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="hvdlite-elastic-updates",
                                       daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(protocol.QUERY_TIMEOUT_S)
                    token, _, gen = conn.makefile("rb").readline().decode().strip().partition(" ")
                    grow = secrets.compare_digest(token, self.token) and \
                        self.driver.should_grow(int(gen))
                    conn.sendall(b"1\n" if grow else b"0\n")
                except (OSError, ValueError, UnicodeDecodeError):
                    pass

    def stop(self):
        self.stopped.set()
        self.server.close()


class _WorldSupervisor(JobSupervisor):
    """A JobSupervisor that tells survivors from the dead.

    A rank that exits with the reset code, or is ended by the driver's order, survived;
    one that exited on its own (a crash, a signal from elsewhere) or whose wrapper
    vanished did not.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exits: Dict[int, Tuple[int, Optional[float]]] = {}  # rank -> (code, s after order)
        self.vanished: Dict[int, Optional[float]] = {}  # rank -> s after the order
        self.signalled = False

    def _dispatch(self, key):
        if key.data[0] == "signal" and not self.ended_by_owner:
            self.signalled = True  # the user's: the job ends (an owner's end is a reset)
        super()._dispatch(key)

    def _since_order(self) -> Optional[float]:
        return None if self.kill_time is None else time.monotonic() - self.kill_time

    def _on_rank_exit(self, conn, returncode):
        self.exits[conn.rank] = (returncode, self._since_order())
        if returncode == protocol.RESET_EXIT_CODE and self.kill_time is None:
            conn.exited = True
            self.ranks[conn.rank].returncode = returncode
            logger.debug("rank %d left for a reset; ending world", conn.rank)
            self.result = JobResult(exit_code=returncode, failed_rank=conn.rank,
                                    message=f"rank {conn.rank} left for a reset")
            self._kill_all()
            return
        super()._on_rank_exit(conn, returncode)

    def _fail(self, exit_code, message, rank=None, lost=(), reason=""):
        if self.kill_time is None:
            for r in lost:  # silent past the peer timeout: their host or link is down
                if r not in self.exits:
                    self.vanished[r] = None
        super()._fail(exit_code, message, rank, lost, reason)

    def _on_conn_closed(self, key, conn):
        since = self._since_order()
        if conn.rank is not None and not conn.exited and (
                since is None or since < _OWN_DEATH_WINDOW_S):
            self.vanished[conn.rank] = since
        super()._on_conn_closed(key, conn)

    def fate(self, rank: int) -> str:
        """``finished``, ``survived``, ``failed``, ``gone`` (never started, or its wrapper
        vanished) or ``vanished late`` (just after the order: gone with its host, or
        ended by mpiexec's own cleanup; the host's other ranks decide)."""
        if rank not in self.ranks:
            return "gone"
        if rank in self.vanished:
            return "gone" if self.vanished[rank] is None else "vanished late"
        if rank not in self.exits:
            return "survived"   # ended with the world, its exit status lost on the way
        code, since = self.exits[rank]
        if since is None:  # before the order to end the world
            return {0: "finished", protocol.RESET_EXIT_CODE: "survived"}.get(code, "failed")
        # The order's own ends: SIGTERM, and SIGKILL after the wrappers' grace.
        if code in (0, protocol.RESET_EXIT_CODE, -signal.SIGTERM):
            return "survived"
        if code == -signal.SIGKILL and since > _OWN_DEATH_WINDOW_S:
            return "survived"
        return "failed" if since < _OWN_DEATH_WINDOW_S else "survived"


class ElasticDriver:
    """Runs an elastic job: worlds one after another until one finishes or it cannot go on.

    Args:
        config: the launcher's validated request (config.elastic set).
        launch_world: ``(supervisor, hosts or None, size, extra env) -> JobResult``,
            starts and supervises one world.
        make_supervisor: ``(size, hosts or None) -> _WorldSupervisor``.
        bind_host, advertise_host: where the update service listens, and its address
            for the ranks.
        discover: ``() -> [HostSlots]``, the hosts and slots usable now, asked every
            discovery interval (default: the settings' discovery script, if any).
    """

    def __init__(self, config, launch_world, make_supervisor, bind_host="127.0.0.1",
                 advertise_host="127.0.0.1", discover=None):
        self.config = config
        self.settings: ElasticSettings = config.elastic
        script = self.settings.discovery_script
        if discover is None and script is not None:
            def discover():
                return discover_hosts(script)
        # () -> the hosts and slots now, or None: the hosts are fixed (config.hosts).
        self.discover = discover
        self.plan: List[hostlib.HostSlots] = []  # the current world's hosts, in rank order
        self.launch_world = launch_world
        self.make_supervisor = make_supervisor
        self.book = SlotBook(self.settings.cooldown_range)
        self.job_id = uuid.uuid4().hex[:12]
        self.generation = 0
        self.world_size = 0       # Guarded by book.lock (read by the update service).
        self.stopped = threading.Event()
        self.bind_host, self.advertise_host = bind_host, advertise_host

    # -- slots -------------------------------------------------------------------------

    def _refresh_hosts(self) -> bool:
        if self.discover is None:
            return True
        try:
            self.book.set_hosts(self.discover())
            return True
        except RuntimeError as exc:
            logger.warning("%s (keeping the last host list)", exc)
            return False

    def _discovery_loop(self):
        while not self.stopped.wait(self.settings.discovery_interval):
            self._refresh_hosts()

    def should_grow(self, generation: int) -> bool:
        """Whether world ``generation`` should reset now to take in added slots."""
        usable = hostlib.total_slots(self.book.usable())
        with self.book.lock:
            current = generation == self.generation
            size = self.world_size
        return current and size < min(usable, self.settings.max_np)

    def _wait_for_slots(self, why: str) -> Optional[List[hostlib.HostSlots]]:
        """Waits up to --elastic-timeout for --min-np usable slots; None if they never come."""
        deadline = time.monotonic() + self.settings.elastic_timeout
        while True:
            usable = self.book.usable()
            if hostlib.total_slots(usable) >= self.settings.min_np:
                return usable
            can_change = self.discover is not None or \
                self.book.pending_return()
            if not can_change or time.monotonic() >= deadline:
                self._say(f"only {hostlib.total_slots(usable)} usable slot(s) "
                          f"({_format(usable) or 'none'}), fewer than --min-np "
                          f"{self.settings.min_np}, "
                          + (f"for {self.settings.elastic_timeout:g} s (--elastic-timeout)"
                             if can_change else "and none can come back")
                          + f" after {why}; ending the job")
                return None
            time.sleep(min(self.settings.discovery_interval, 0.5))

    # -- the job -----------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job; returns hvdliterun's exit code."""
        if self.discover is None:
            hosts = self.config.hosts or [hostlib.HostSlots("localhost", self.config.num_ranks)]
            self.book.set_hosts(hosts)
        elif not self._refresh_hosts():
            self._say("the host discovery failed at start; ending the job")
            return 1
        service = _UpdateService(self, self.bind_host, self.advertise_host)
        discovery = threading.Thread(target=self._discovery_loop, daemon=True,
                                     name="hvdlite-elastic-discovery")
        discovery.start()
        try:
            return self._run_worlds(service)
        except KeyboardInterrupt:
            return 130
        finally:
            self.stopped.set()
            service.stop()
            shutil.rmtree(protocol.state_dir({**os.environ, protocol.ENV_JOB: self.job_id}),
                          ignore_errors=True)

    def _run_worlds(self, service: _UpdateService) -> int:
        resets = 0
        why = "start"
        target = self.config.num_ranks or self.settings.max_np
        while True:
            usable = self._wait_for_slots(why)
            if usable is None:
                return 1
            size = min(hostlib.total_slots(usable), target)
            plan = plan_world(usable, size)
            with self.book.lock:
                self.world_size = size
            self.plan = plan
            self._say(f"world {self.generation}: {size} rank(s) on {_format(plan)}"
                      + ("" if self.generation == 0 else f" after {why}, from the last commit"))
            local = hostlib.all_local(plan)
            supervisor = self.make_supervisor(size, None if local else plan)
            env = {protocol.ENV_JOB: self.job_id,
                   protocol.ENV_GENERATION: str(self.generation),
                   protocol.ENV_DRIVER_ADDR: service.address,
                   protocol.ENV_DRIVER_TOKEN: service.token}
            result = self.launch_world(supervisor, None if local else plan, size, env)
            if supervisor.signalled:
                return result.exit_code
            outcome = self._account(supervisor, plan, size)
            if outcome is None:
                return 0
            why = outcome
            if self.settings.reset_limit is not None and resets >= self.settings.reset_limit:
                self._say(f"{why}, but the job has had {resets} reset(s), the --reset-limit; "
                          "ending the job")
                return result.exit_code if result.exit_code not in (0, protocol.RESET_EXIT_CODE) \
                    else 1
            resets += 1
            self.generation += 1
            target = self.settings.max_np

    def _account(self, supervisor: _WorldSupervisor, plan, size) -> Optional[str]:
        """Takes failed slots and lost hosts out; returns why the world reset (None: done)."""
        rank_host = [host for host, slots in plan for _ in range(slots)]
        fates = [supervisor.fate(r) for r in range(size)]
        if "finished" in fates and not {"failed", "gone"} & set(fates):
            # The training function returned: a rank that did not is no reason to train
            # again (a script whose ranks finish apart would otherwise never end).
            unfinished = [r for r in range(size) if fates[r] != "finished"]
            if unfinished:
                self._say(f"rank(s) {_ranks(unfinished)} ended without finishing after "
                          "the others finished; the job is done")
            return None
        reasons = []
        for host in dict.fromkeys(rank_host):
            ranks = [r for r in range(size) if rank_host[r] == host]
            # mpiexec may kill every wrapper when one dies (its cleanup, or its own end
            # when a proxy vanishes): a wrapper that vanished just after the order is gone
            # only on a host that lost one before it, and a host whose wrappers all
            # vanished is lost only if it cannot be reached.
            host_lost_one = any(fates[r] == "gone" for r in ranks)
            for r in ranks:
                if fates[r] == "vanished late":
                    fates[r] = "gone" if host_lost_one else "survived"
            vanished = all(fates[r] == "gone" for r in ranks)
            if vanished and self.host_alive(host):
                for r in ranks:
                    fates[r] = "survived"
                reasons.append(f"host {host} dropped its ranks but answers")
                continue
            if vanished:
                self.book.lose_host(host)
                reasons.append(f"host {host} lost (ranks {_ranks(ranks)})")
                continue
            for r in ranks:
                if fates[r] in ("gone", "failed"):
                    self.book.drop_slot(host)
                    code = supervisor.exits.get(r, (None, None))[0]
                    how = describe_returncode(code) if code is not None else "vanished"
                    reasons.append(f"rank {r} on {host} {how}")
        if reasons:
            return "; ".join(reasons)
        return ("its ranks were ended from outside them" if supervisor.ended_by_owner
                else "hosts were added")

    def host_alive(self, host: str) -> bool:
        """Whether ``host`` runs a command (this machine always does)."""
        if hostlib.is_local_host(host):
            return True
        shell = shlex.split(self.config.remote_shell) if self.config.remote_shell else \
            ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
        try:
            return subprocess.run(shell + [host, "true"], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=HOST_PROBE_TIMEOUT_S
                                  ).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _say(self, message: str):
        sys.stderr.write(f"hvdliterun: elastic: {message}\n")
        sys.stderr.flush()


def _format(hosts) -> str:
    return ",".join(f"{h}:{s}" for h, s in hosts)


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in ranks)


def run(config, launcher, bind_host: str, advertise_host: str, peer_timeout=None) -> int:
    """Runs an elastic job for hvdliterun.

    Args:
        config: the validated LaunchConfig (config.elastic set).
        launcher: the probed mpiexec.
        bind_host, advertise_host: where the supervisors and the update service listen.
        peer_timeout: each world's supervisor's (see wire.peer_timeout).

    Returns:
        0 when a world finished, else non-zero (below --min-np, past --reset-limit, a
        signal to the launcher).
    """
    def make_supervisor(size, hosts):
        world = replace(config, num_ranks=size, hosts=hosts)
        return job.new_supervisor(world, bind_host, advertise_host, _WorldSupervisor,
                                     peer_timeout)

    def launch_world(supervisor, hosts, size, extra_env):
        world = replace(config, num_ranks=size, hosts=hosts)
        return job.supervise_job(world, launcher, supervisor, extra_env)

    return ElasticDriver(config, launch_world, make_supervisor, bind_host,
                         advertise_host).run()


__all__ = ["ElasticDriver", "SlotBook", "discover_hosts", "plan_world", "run"]
