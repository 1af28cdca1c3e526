"""Host lists for hvdliterun: ``-H host1:2,host2:2`` and ``--hostfile`` files.

Everything here is pure (no network, no processes) so that bad input can be refused
before anything is started, with a message that names the offending entry.
"""
import re
import socket
from typing import List, NamedTuple, Sequence

# A host name or an IPv4 address: letters, digits, '-', '_' and '.'. Anything else
# (spaces, shell metacharacters, '@') is refused rather than handed to ssh.
_HOST_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
# Bracketed IPv6 literal, e.g. [fe80::1]:2 in a -H list.
_IPV6_RE = re.compile(r"^\[([0-9A-Fa-f:.]+)\]$")

_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


class HostSpecError(ValueError):
    """A host string or host file that cannot be understood."""


class HostSlots(NamedTuple):
    """One host and the number of ranks (slots) it may run."""

    host: str
    slots: int


def _check_host_name(host: str, where: str) -> str:
    match = _IPV6_RE.match(host)
    if match:
        return match.group(1)
    if not host:
        raise HostSpecError(f"{where}: empty host name")
    if not _HOST_RE.match(host) or host.startswith(("-", ".")):
        raise HostSpecError(f"{where}: {host!r} is not a valid host name")
    return host


def _parse_slots(text: str, where: str) -> int:
    if not text.isdigit():
        raise HostSpecError(f"{where}: slot count {text!r} is not a positive integer")
    slots = int(text)
    if slots < 1:
        raise HostSpecError(f"{where}: slot count must be at least 1, got {slots}")
    return slots


def _merge(entries: List[HostSlots], where: str) -> List[HostSlots]:
    seen = set()
    for entry in entries:
        if entry.host in seen:
            raise HostSpecError(f"{where}: host {entry.host!r} is listed more than once")
        seen.add(entry.host)
    return entries


def parse_host_string(spec: str) -> List[HostSlots]:
    """Parses a ``-H`` value such as ``host1:2,host2:2``.

    A host without ``:slots`` gets one slot. IPv6 literals are written in brackets,
    ``[::1]:2``.

    Args:
        spec: the comma-separated host list.

    Returns:
        The hosts in the order given.

    Raises:
        HostSpecError: empty entries, bad host names, bad or zero slot counts, or a host
            listed twice.
    """
    if spec is None or not spec.strip():
        raise HostSpecError("-H: empty host list")
    entries = []
    for index, item in enumerate(spec.split(",")):
        where = f"-H entry {index + 1} ({item!r})"
        item = item.strip()
        if not item:
            raise HostSpecError(f"-H entry {index + 1}: empty entry in {spec!r}")
        if item.startswith("["):
            host_part, sep, slots_part = item.rpartition("]:")
            if sep:
                host_part += "]"
            else:
                host_part, slots_part = item, ""
        else:
            host_part, sep, slots_part = item.partition(":")
            if sep and ":" in slots_part:
                raise HostSpecError(f"{where}: expected host or host:slots")
        host = _check_host_name(host_part, where)
        slots = _parse_slots(slots_part, where) if sep else 1
        entries.append(HostSlots(host, slots))
    return _merge(entries, "-H")


def parse_hostfile_text(text: str, source: str = "hostfile") -> List[HostSlots]:
    """Parses hostfile content: one host per line, as Open MPI writes it
    (``host [slots=N]``) or as MPICH's hydra does (``host:N``); ``#`` comments.

    Args:
        text: the file's content.
        source: a name used in error messages (the file's path).

    Returns:
        The hosts in file order.

    Raises:
        HostSpecError: a malformed line (with its line number), or no hosts at all.
    """
    entries = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        fields = line.split()
        name, colon, count = fields[0].partition(":")
        if colon:
            if len(fields) > 1:
                raise HostSpecError(f"{where}: expected 'host:N' or 'host slots=N', got "
                                    f"{raw.strip()!r}")
            entries.append(HostSlots(_check_host_name(name, where), _parse_slots(count, where)))
            continue
        host = _check_host_name(fields[0], where)
        slots = 1
        for field in fields[1:]:
            key, sep, value = field.partition("=")
            if not sep or key not in ("slots", "max_slots", "max-slots"):
                raise HostSpecError(f"{where}: expected 'host slots=N' or 'host:N', got "
                                    f"{raw.strip()!r}")
            if key == "slots":
                slots = _parse_slots(value, where)
            else:
                # Accepted for Open MPI hostfile compatibility; the launcher never
                # oversubscribes beyond slots, so the value only has to be valid.
                _parse_slots(value, where)
        entries.append(HostSlots(host, slots))
    if not entries:
        raise HostSpecError(f"{source}: no hosts listed")
    return _merge(entries, source)


def parse_hostfile(path: str) -> List[HostSlots]:
    """Reads and parses a hostfile (see :func:`parse_hostfile_text`).

    Args:
        path: the file to read.

    Returns:
        The hosts in file order.

    Raises:
        HostSpecError: the file cannot be read or is malformed.
    """
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise HostSpecError(f"cannot read hostfile {path!r}: {exc.strerror}") from exc
    return parse_hostfile_text(text, source=path)


def total_slots(hosts: Sequence[HostSlots]) -> int:
    """Returns the sum of the hosts' slots."""
    return sum(h.slots for h in hosts)


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (without resolving names over the network).

    Args:
        host: a host name or address from a host list.

    Returns:
        True for loopback names and this machine's own short or fully qualified name.
    """
    if host in _LOCAL_NAMES or host.startswith("127."):
        return True
    own = socket.gethostname()
    return host in (own, own.split(".", 1)[0])


def rank_hosts(hosts, num_ranks: int) -> List[str]:
    """The host each rank runs on when ranks fill hosts in order (hydra's and Open MPI's
    ``--map-by slot`` placement for a host list): rank -> host name.

    Args:
        hosts: the host list, or None (every rank on this machine).
        num_ranks: the job's size.
    """
    if not hosts:
        return [socket.gethostname()] * num_ranks
    placed = [entry.host for entry in hosts for _ in range(entry.slots)]
    return placed[:num_ranks]


def all_local(hosts: Sequence[HostSlots]) -> bool:
    """Whether every host in ``hosts`` is this machine."""
    return all(is_local_host(h.host) for h in hosts)
