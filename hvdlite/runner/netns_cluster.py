"""A test cluster on one machine: N "hosts" made of Linux network namespaces.

    from hvdlite.runner.netns_cluster import NetnsCluster

    with NetnsCluster(2, rate="1gbit") as cluster:
        cluster.run("h1", ["hostname"])            # prints h1
        cluster.run("h1", ["hvdliterun", "-np", "4", "-H", "h1:2,h2:2",
                           "--remote-shell", cluster.remote_shell(), "python", "x.py"],
                    env=cluster.mpi_env())

Layout, all of it inside namespaces this module creates (nothing is added to the
machine's own network namespace, so clusters of several processes never collide):

    switch namespace  <prefix>-sw : bridge ``br0``, one port ``p<i>`` per host
    host namespace    <prefix>-h<i>: ``eth0`` with address 10.a.b.i/24, peer of ``p<i>``

A host's link is the veth pair ``eth0``/``p<i>``; its shape (rate, delay, loss) applies to
both directions: a rate limit (``tbf``) on the egress of each end, loss as an ``nft``
rule dropping a share of the packets arriving at each end, delay through ``netem``
(where the kernel has it). A command runs in a host through ``ip netns exec`` (which
also gives it the host's ``/etc/hosts``) and ``unshare --uts`` (its own host name), so
``socket.gethostname()`` inside says ``h1``, ``h2``...

Teardown kills every process left in the namespaces and deletes them (deleting a
namespace deletes its interfaces). It runs on ``close()``, on leaving the ``with``
block, at interpreter exit and on SIGTERM/SIGHUP; :func:`cleanup_stale` removes what
creators that died by SIGKILL left behind (every cluster records its creator's pid and
start time under ``/run/hvdlite-cluster``).

Needs root and ``ip``/``tc``/``unshare``; :func:`unavailable_reason` says why not.
"""
import atexit
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

STATE_DIR = "/run/hvdlite-cluster"
NETNS_DIR = "/run/netns"
ETC_NETNS_DIR = "/etc/netns"
HOST_INTERFACE = "eth0"
# Netns names are files (no 15-character limit); interface names live inside our own
# namespaces, so they can be short and fixed.
_NAME_RE = re.compile(r"^hvdlc(\d+)x(\d+)-")
_REQUIRED_TOOLS = ("ip", "tc", "unshare")


class ClusterUnavailable(RuntimeError):
    """The machine cannot build a namespace cluster (not root, a tool or feature missing)."""


class ClusterError(RuntimeError):
    """A command building or changing the cluster failed."""


@dataclass(frozen=True)
class LinkShape:
    """How a host's link behaves, in both directions.

    Attributes:
        rate: a ``tc`` rate such as ``"1gbit"`` or ``"100mbit"``; None for unlimited.
        delay_ms: one-way delay added at each end (needs the kernel's ``sch_netem``).
        loss_percent: share of packets dropped at each end, 0-100 (needs ``nft``).
    """

    rate: Optional[str] = None
    delay_ms: float = 0.0
    loss_percent: float = 0.0

    def __post_init__(self):
        if self.rate is not None and not re.match(r"^\d+(\.\d+)?([kmg]?bit|[kmg]?bps)$",
                                                  self.rate, re.IGNORECASE):
            raise ValueError(f"link rate {self.rate!r} is not a tc rate such as 1gbit, 100mbit")
        if self.delay_ms < 0:
            raise ValueError(f"link delay must be >= 0 ms, got {self.delay_ms}")
        if not 0 <= self.loss_percent <= 100:
            raise ValueError(f"link loss must be 0-100 %, got {self.loss_percent}")


@dataclass(frozen=True)
class Host:
    """One host of a cluster.

    Attributes:
        name: its host name (what ``hostname`` says inside), e.g. ``h1``.
        netns: the network namespace it lives in.
        address: its IPv4 address on the cluster's bridge.
        switch_port: the switch's end of its link (in the switch namespace).
    """

    name: str
    netns: str
    address: str
    switch_port: str


def rate_bits_per_second(rate: str) -> float:
    """Converts a ``tc`` rate (``1gbit``, ``100mbit``, ``10mbps``) to bits per second."""
    match = re.match(r"^(\d+(?:\.\d+)?)([kmg]?)(bit|bps)$", rate.strip().lower())
    if not match:
        raise ValueError(f"rate {rate!r} is not a tc rate such as 1gbit, 100mbit")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return value * (8 if match.group(3) == "bps" else 1)


def unavailable_reason() -> Optional[str]:
    """Why this process cannot build a cluster, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a namespace cluster needs root (ip netns, tc); run as root"
    missing = [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return ("a namespace cluster needs " + ", ".join(missing) + " (apt-get install "
                "iproute2 util-linux)")
    return None


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise ClusterError(f"{shlex.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def _process_start_time(pid: int) -> Optional[str]:
    """The start time field of /proc/PID/stat (tells a pid apart from a reused one)."""
    try:
        with open(f"/proc/{pid}/stat", "r", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22 counted after the command name, which may contain spaces and parentheses.
    return stat.rsplit(")", 1)[1].split()[19]


def _netns_pids(netns: str) -> List[int]:
    result = _run(["ip", "netns", "pids", netns], check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _kill_netns_processes(netns: str, grace_s: float = 0.0) -> None:
    """SIGKILLs every process in ``netns`` until none is left (new ones may be forking)."""
    if grace_s > 0:
        for pid in _netns_pids(netns):
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _netns_pids(netns) and time.monotonic() < deadline:
            time.sleep(0.05)
    for _ in range(50):
        pids = [pid for pid in _netns_pids(netns) if pid != os.getpid()]
        if not pids:
            return
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.02)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_netns(netns: str) -> None:
    _kill_netns_processes(netns)
    if os.path.exists(os.path.join(NETNS_DIR, netns)):
        _run(["ip", "netns", "delete", netns], check=False)
    shutil.rmtree(os.path.join(ETC_NETNS_DIR, netns), ignore_errors=True)


def _subnet_for(pid: int, serial: int) -> ipaddress.IPv4Network:
    # Unique per (creator pid, cluster serial) among live creators on this machine; the
    # subnet only exists inside our own namespaces, so even a collision would be harmless.
    index = (pid * 8 + serial) % (250 * 256)
    return ipaddress.IPv4Network(f"10.{index // 256 + 1}.{index % 256}.0/24")


class NetnsCluster:
    """N hosts as network namespaces behind one bridge, links shaped by :class:`LinkShape`.

    Built by ``start()`` (or entering the ``with`` block), torn down by ``close()``
    (idempotent; also at exit and on SIGTERM/SIGHUP). Not thread-safe: one thread
    builds, changes and closes a cluster.
    """

    _serial = 0
    _live: Dict[str, "NetnsCluster"] = {}
    _live_lock = threading.Lock()
    _handlers_installed = False

    def __init__(self, num_hosts: int, rate: Optional[str] = None, delay_ms: float = 0.0,
                 loss_percent: float = 0.0, hostnames: Optional[Sequence[str]] = None):
        """Describes a cluster; nothing is created before ``start()``.

        Args:
            num_hosts: hosts to create (1-200).
            rate, delay_ms, loss_percent: every host link's shape (see :class:`LinkShape`).
            hostnames: the hosts' names; ``h1``..``hN`` by default.

        Raises:
            ValueError: a bad count, name or shape.
        """
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"a cluster has 1-200 hosts, got {num_hosts}")
        names = list(hostnames) if hostnames else [f"h{i + 1}" for i in range(num_hosts)]
        if len(names) != num_hosts or len(set(names)) != num_hosts:
            raise ValueError(f"need {num_hosts} distinct host names, got {names}")
        for name in names:
            if not re.match(r"^[a-z][a-z0-9-]{0,30}$", name):
                raise ValueError(f"host name {name!r}: use lower-case letters, digits and '-'")
        self.shape = LinkShape(rate, delay_ms, loss_percent)
        with NetnsCluster._live_lock:
            NetnsCluster._serial += 1
            serial = NetnsCluster._serial
        self.prefix = f"hvdlc{os.getpid()}x{serial}"
        self.subnet = _subnet_for(os.getpid(), serial)
        self.switch_netns = f"{self.prefix}-sw"
        addresses = list(self.subnet.hosts())
        self.hosts: List[Host] = [
            Host(name, f"{self.prefix}-{name}", str(addresses[i]), f"p{i + 1}")
            for i, name in enumerate(names)]
        self._started = False
        self._closed = False

    @classmethod
    def attach(cls, prefix: str) -> "NetnsCluster":
        """A handle on a running cluster made by another process (``scripts/cluster.py up``).

        The handle runs commands and changes links; ``close()`` on it removes nothing
        (the creator owns the cluster).

        Raises:
            KeyError: no live cluster has that prefix.
        """
        path = os.path.join(STATE_DIR, prefix + ".json")
        try:
            with open(path, "r", encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError) as exc:
            raise KeyError(f"no cluster {prefix!r} recorded in {STATE_DIR}") from exc
        cluster = cls.__new__(cls)
        cluster.prefix = prefix
        cluster.subnet = ipaddress.IPv4Network(state["subnet"])
        cluster.switch_netns = f"{prefix}-sw"
        cluster.shape = LinkShape(**state["shape"])
        cluster.hosts = [Host(**h) for h in state["hosts"]]
        cluster._started = True
        cluster._closed = True  # not ours to remove
        return cluster

    # ----- building and tearing down -------------------------------------------------

    def start(self) -> "NetnsCluster":
        """Creates the namespaces, bridge and links.

        Raises:
            ClusterUnavailable: not root or a tool is missing; a shape the kernel cannot do.
            ClusterError: a command failed (everything created so far is removed).
        """
        if self._started:
            return self
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        self._started = True
        self._register()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        _run(["ip", "netns", "add", self.switch_netns])
        sw = ["ip", "-n", self.switch_netns]
        _run(sw + ["link", "add", "br0", "type", "bridge"])
        _run(sw + ["link", "set", "br0", "up"])
        _run(sw + ["link", "set", "lo", "up"])
        hosts_file = "127.0.0.1\tlocalhost\n" + "".join(
            f"{host.address}\t{host.name}\n" for host in self.hosts)
        for host in self.hosts:
            _run(["ip", "netns", "add", host.netns])
            etc = os.path.join(ETC_NETNS_DIR, host.netns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w", encoding="ascii") as f:
                f.write(hosts_file)
            with open(os.path.join(etc, "hostname"), "w", encoding="ascii") as f:
                f.write(host.name + "\n")
            # Created in the switch namespace, the host's end then moved into its own.
            _run(sw + ["link", "add", host.switch_port, "type", "veth", "peer", "name",
                       HOST_INTERFACE, "netns", host.netns])
            _run(sw + ["link", "set", host.switch_port, "master", "br0"])
            _run(sw + ["link", "set", host.switch_port, "up"])
            hn = ["ip", "-n", host.netns]
            _run(hn + ["link", "set", "lo", "up"])
            _run(hn + ["addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev",
                       HOST_INTERFACE])
            _run(hn + ["link", "set", HOST_INTERFACE, "up"])
            self._apply_shape(host, self.shape)

    def close(self) -> None:
        """Kills every process in the cluster's namespaces and deletes them. Idempotent."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        for host in self.hosts:
            _kill_netns_processes(host.netns)
        for host in self.hosts:
            _remove_netns(host.netns)
        _remove_netns(self.switch_netns)
        try:
            os.unlink(self._state_path())
        except OSError:
            pass
        with NetnsCluster._live_lock:
            NetnsCluster._live.pop(self.prefix, None)

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _state_path(self) -> str:
        return os.path.join(STATE_DIR, self.prefix + ".json")

    def _register(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(self._state_path(), "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "start_time": _process_start_time(os.getpid()),
                       "netns": [self.switch_netns] + [h.netns for h in self.hosts],
                       "subnet": str(self.subnet), "shape": vars(self.shape),
                       "hosts": [vars(h) for h in self.hosts]}, f)
        with NetnsCluster._live_lock:
            NetnsCluster._live[self.prefix] = self
            if not NetnsCluster._handlers_installed:
                NetnsCluster._handlers_installed = True
                atexit.register(_close_all)
                _install_signal_handlers()

    # ----- link shapes and faults ----------------------------------------------------

    def _apply_shape(self, host: Host, shape: LinkShape) -> None:
        ends = [(host.netns, HOST_INTERFACE), (self.switch_netns, host.switch_port)]
        for netns, dev in ends:
            tc = ["ip", "netns", "exec", netns, "tc", "qdisc"]
            _run(tc + ["del", "dev", dev, "root"], check=False)
            if shape.delay_ms > 0:
                netem = ["netem", "delay", f"{shape.delay_ms}ms"]
                if shape.rate:
                    netem += ["rate", shape.rate]
                result = _run(tc + ["add", "dev", dev, "root"] + netem + ["limit", "10000"],
                              check=False)
                if result.returncode != 0:
                    raise ClusterUnavailable(
                        "link delay needs the kernel's netem qdisc (sch_netem), which this "
                        f"kernel lacks: {result.stderr.strip()}")
            elif shape.rate:
                bits = rate_bits_per_second(shape.rate)
                # A bucket of ~4 ms at the rate (at least 64 KiB, one GSO packet) and a
                # queue of ~50 ms: the link runs at its rate without bursts beyond it.
                burst = max(65536, int(bits / 8 * 0.004))
                _run(tc + ["add", "dev", dev, "root", "tbf", "rate", shape.rate,
                           "burst", str(burst), "latency", "50ms"])
            self._apply_loss(netns, dev, shape.loss_percent)

    def _apply_loss(self, netns: str, dev: str, loss_percent: float) -> None:
        table = f"hvdlc_{dev}"
        nft = ["ip", "netns", "exec", netns, "nft"]
        if shutil.which("nft") is None:
            if loss_percent > 0:
                raise ClusterUnavailable("link loss needs nft (apt-get install nftables)")
            return
        _run(nft + ["delete", "table", "netdev", table], check=False)
        if loss_percent <= 0:
            return
        # Dropped where packets arrive at each end, so TCP sees real losses on the wire
        # rather than local send errors.
        per_million = int(round(loss_percent * 10000))
        match = "" if per_million >= 1000000 else f"numgen random mod 1000000 < {per_million} "
        rules = (f"table netdev {table} {{\n  chain ingress {{\n    type filter hook ingress "
                 f"device {dev} priority 0;\n    {match}drop\n  }}\n}}\n")
        result = subprocess.run(nft + ["-f", "-"], input=rules, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        if result.returncode != 0:
            raise ClusterUnavailable(f"cannot set link loss with nft: {result.stderr.strip()}")

    def shape_link(self, host: str, rate: Optional[str] = None, delay_ms: float = 0.0,
                   loss_percent: float = 0.0) -> None:
        """Changes one host's link shape while the cluster runs."""
        self._apply_shape(self.host(host), LinkShape(rate, delay_ms, loss_percent))

    def set_link(self, host: str, up: bool) -> None:
        """Cuts (``up=False``) or restores a host's link, at the switch's end."""
        port = self.host(host).switch_port
        _run(["ip", "-n", self.switch_netns, "link", "set", port, "up" if up else "down"])

    # ----- running commands ----------------------------------------------------------

    def host(self, name: str) -> Host:
        """The host called ``name`` (its host name, e.g. ``h1``)."""
        for host in self.hosts:
            if host.name == name or host.address == name:
                return host
        raise KeyError(f"no host {name!r} in cluster {self.prefix} "
                       f"({', '.join(h.name for h in self.hosts)})")

    def command(self, host: str, argv: Sequence[str]) -> List[str]:
        """The argv that runs ``argv`` inside ``host`` (its network, /etc/hosts, host name)."""
        target = self.host(host)
        return enter_host_command(target.netns, target.name, argv)

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts ``argv`` inside ``host``; keyword arguments go to ``subprocess.Popen``."""
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def run(self, host: str, argv: Sequence[str], timeout: Optional[float] = None,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs ``argv`` inside ``host`` to completion (``subprocess.run`` semantics)."""
        return subprocess.run(self.command(host, argv), timeout=timeout, **kwargs)

    def remote_shell(self) -> str:
        """A remote-start command for this cluster's hosts, used like ``ssh``/``rsh``.

        ``<remote_shell> HOST WORDS...`` joins WORDS into one shell command and runs it on
        HOST, as ``ssh HOST WORDS...`` would: give it to ``hvdliterun --remote-shell`` or
        to hydra's ``-launcher rsh -launcher-exec``.
        """
        # The file is run as a script (it needs only the standard library), so the remote
        # shell works whatever PYTHONPATH the caller has.
        return f"{sys.executable} {os.path.abspath(__file__)} enter {self.prefix}"

    def pids(self, host: str) -> List[int]:
        """Processes running inside ``host``."""
        return _netns_pids(self.host(host).netns)

    def mpi_env(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """An environment whose MPI traffic between hosts goes over the cluster's links.

        The mpich wheel's UCX would otherwise use shared memory between namespaces of one
        kernel (they share /dev/shm), bypassing the shaped links. ``HVDLITE_REMOTE_SHELL``
        makes ``hvdliterun -H ...`` started in a host reach the other hosts.
        """
        env = dict(os.environ if base is None else base)
        env.update({"HVDLITE_REMOTE_SHELL": self.remote_shell(), "UCX_TLS": "tcp,self",
                    "UCX_NET_DEVICES": HOST_INTERFACE, "FI_PROVIDER": "tcp",
                    "FI_TCP_IFACE": HOST_INTERFACE})
        return env


def enter_host_command(netns: str, hostname: str, argv: Sequence[str]) -> List[str]:
    """The argv that runs ``argv`` in ``netns`` with its own UTS namespace named ``hostname``."""
    return ["ip", "netns", "exec", netns, "unshare", "--uts", "sh", "-c",
            'echo "$0" > /proc/sys/kernel/hostname && exec "$@"', hostname] + list(argv)


def _close_all() -> None:
    with NetnsCluster._live_lock:
        clusters = list(NetnsCluster._live.values())
    for cluster in clusters:
        try:
            cluster.close()
        except Exception:  # pylint: disable=broad-except
            pass


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            _close_all()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):
            pass


def list_clusters() -> List[Dict[str, object]]:
    """Clusters recorded on this machine: prefix, creator pid, alive, namespaces."""
    found = []
    if os.path.isdir(STATE_DIR):
        for entry in sorted(os.listdir(STATE_DIR)):
            if not entry.endswith(".json"):
                continue
            try:
                with open(os.path.join(STATE_DIR, entry), "r", encoding="utf-8") as f:
                    state = json.load(f)
            except (OSError, ValueError):
                continue
            pid = int(state.get("pid", 0))
            alive = pid > 0 and _process_start_time(pid) == state.get("start_time")
            found.append({"prefix": entry[:-5], "pid": pid, "alive": alive,
                          "netns": list(state.get("netns", []))})
    return found


def cleanup_stale() -> List[str]:
    """Removes namespaces left by cluster creators that are no longer running.

    Returns:
        The namespaces removed.
    """
    removed = []
    recorded = {c["prefix"]: c for c in list_clusters()}
    names = os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []
    for name in names:
        match = _NAME_RE.match(name)
        if not match:
            continue
        prefix = name.split("-", 1)[0]
        state = recorded.get(prefix)
        if state is not None:
            alive = state["alive"]
        else:
            alive = _process_start_time(int(match.group(1))) is not None
        if not alive:
            _remove_netns(name)
            removed.append(name)
    for prefix, state in recorded.items():
        if not state["alive"]:
            try:
                os.unlink(os.path.join(STATE_DIR, prefix + ".json"))
            except OSError:
                pass
    return removed


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python netns_cluster.py enter PREFIX HOST WORDS...``: an rsh-like
    remote start into a cluster's host (see :meth:`NetnsCluster.remote_shell`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] != "enter":
        sys.stderr.write("usage: netns_cluster.py enter PREFIX HOST "
                         "COMMAND...\n")
        return 2
    prefix, rest = args[1], args[2:]
    while rest and rest[0].startswith("-"):
        rest = rest[1:]  # ssh-style options (hydra's -x) mean nothing here
    if len(rest) < 2:
        sys.stderr.write("netns_cluster enter: need a host and a command\n")
        return 2
    host, words = rest[0], rest[1:]
    netns = f"{prefix}-{host}"
    if not os.path.exists(os.path.join(NETNS_DIR, netns)):
        sys.stderr.write(f"{host}: no such host in cluster {prefix} (no namespace {netns})\n")
        return 255
    argv_in_host = enter_host_command(netns, host, ["sh", "-c", " ".join(words)])
    os.execvp(argv_in_host[0], argv_in_host)
    return 255  # not reached


if __name__ == "__main__":
    sys.exit(main())
