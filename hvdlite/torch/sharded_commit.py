"""Elastic commits of a sharded optimizer: ``TorchState(model, optimizer)`` with
``optimizer = hvd.DistributedOptimizer(..., shard=1|2)``.

A rank of a sharded optimizer holds only its part of the state, so a commit of that rank
alone is not the state. What a commit keeps (see docs/elastic.md for the figures):

* **Parts, not the whole.** Each rank writes to its host's tmpfs the model and the other
  values (every rank has them whole) and its own part of the optimizer state
  (``local_state_dict()``: its entries and the elements they cover). A killed process's
  file stays in tmpfs, so on one host every part outlives any number of deaths.
* **A copy on another host.** When the world spans several hosts, each rank also sends
  its part to its *holder* on the next host (``holders``; one alltoall of a part's
  bytes per commit). The loss of any one host then leaves each
  part in its own file or in its holder's. On one host nothing is copied.
* **Whole only once everyone wrote.** A rank keeps its previous file until every rank
  has written the new one (one small allreduce): a death halfway through a commit leaves
  the previous commit whole, and no rank returns from a commit that is not.

A new world (any size) lists the commit files on its hosts (their manifests, a few
bytes each), takes the newest commit whose parts are all there, and broadcasts the
model and values once and the parts one at a time from a rank that can read them; each
rank keeps the elements of its new share (``load_local_state_dicts``): the optimizer is
re-sharded for the new world. When some part of every commit is gone (more hosts lost
than one copy covers) the new world stops with an error that names the missing parts.

File layout, after the commit id that ``State`` writes: ``MAGIC``, the sections' bytes
(each a ``torch.save`` blob, written straight into the file), then the pickled manifest
(``world``, ``rank``, ``shard`` and ``sections``: each a key, "shared" or an old rank,
and its length, in the file's order) and, last, the manifest's length.
"""
import collections
import io
import logging
import pickle
import socket
import struct

import numpy as np
import torch

from hvdlite import core, objects, ops
from hvdlite.elastic.state import COMMIT_HEADER

MAGIC = b"HVDLSHC1"
_LENGTH = struct.Struct("<Q")
SHARED = "shared"

log = logging.getLogger("hvdlite")


def stage_of(optimizer):
    """The sharding stage of ``optimizer`` (0 when it is not sharded).

    Raises:
        ValueError: a sharded optimizer a commit cannot keep: one over a process set
            other than the global one, or a stage other than 1 and 2.
    """
    stage = getattr(optimizer, "shard", 0) or 0
    if not stage:
        return 0
    if stage not in (1, 2):
        raise ValueError(f"TorchState keeps optimizers of shard=1 and shard=2; this one has "
                         f"shard={stage}")
    if getattr(optimizer.process_set, "process_set_id", 0):
        raise ValueError("TorchState with a sharded optimizer needs it over the global "
                         "process set (a reset makes the world anew, and its sets with it)")
    return stage


def host_name():
    """The name that tells this rank's host from the others' (where its tmpfs is)."""
    return socket.gethostname()


def holders(hosts):
    """Per rank, the rank that keeps a copy of its part: on the next host round the ring of
    hosts (in the order of their first rank), the rank with the same place among that
    host's ranks (modulo their number), so that equal hosts each keep one copy per rank;
    None for every rank when all are on one host.

    Args:
        hosts: each rank's host name, in rank order.
    """
    ranks_on = {}
    for rank, host in enumerate(hosts):
        ranks_on.setdefault(host, []).append(rank)
    order = list(ranks_on)
    if len(order) < 2:
        return [None] * len(hosts)
    out = []
    for rank, host in enumerate(hosts):
        there = ranks_on[order[(order.index(host) + 1) % len(order)]]
        out.append(there[ranks_on[host].index(rank) % len(there)])
    return out


def load_part(data):
    """A part serialized by ``part_writer``, on the CPU (an old rank's GPU may not be this
    rank's; ``load_local_state_dicts`` moves its share to the parameters' device)."""
    # Our own bytes from this job, not a file of unknown origin: full unpickling.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def part_writer(optimizer):
    """``writer(file)`` that serializes this rank's part of the optimizer state into it."""
    return lambda f: torch.save(optimizer.local_state_dict(), f)


class Copies:
    """Sends each rank's part to its holder at a commit (collective: every rank calls
    ``sections`` at the same commit). The world's hosts are asked once."""

    def __init__(self):
        self._holders = None

    def sections(self, optimizer):
        """Returns this commit's optimizer sections of this rank, as ``write`` takes them:
        its own part (serialized straight into the file when it goes nowhere else) and
        the parts it keeps for others (their exchange is on the wire while ``write``
        serializes the model)."""
        if self._holders is None:
            hosts = objects.allgather_object(host_name(), name="hvdlite.elastic.hosts")
            self._holders = holders(hosts)
        me = core.rank()
        if not any(h is not None for h in self._holders):
            return [(me, part_writer(optimizer))]
        buffer = io.BytesIO()
        part_writer(optimizer)(buffer)
        own = buffer.getbuffer()
        splits = [0] * core.size()
        splits[self._holders[me]] = len(own)
        handle = ops.alltoall_async(np.frombuffer(own, dtype=np.uint8), splits,
                                    name="hvdlite.elastic.copies")
        received = []  # (bytes, offsets by sender), once the exchange has ended

        def wait():
            if not received:
                data, counts = ops.synchronize(handle)
                received.append((data, np.concatenate([[0], np.cumsum(counts)]).tolist()))
            return received[0]

        def copy_of(rank):
            def write_copy(f):
                data, offsets = wait()
                f.write(data[offsets[rank]:offsets[rank + 1]])
            return write_copy

        senders = [rank for rank, holder in enumerate(self._holders) if holder == me]
        if not senders:  # nothing to keep: the exchange still ends before the commit does
            wait()
        return sorted([(me, own)] + [(rank, copy_of(rank)) for rank in senders],
                      key=lambda section: section[0])


def write(f, sections, world, rank, stage):
    """Writes a commit's sections into the binary file ``f``, each straight into it.

    Args:
        sections: (key, payload) pairs: the shared section first (key ``SHARED``), then
            the parts (key: the old rank); a payload is bytes, or ``writer(file)``.
        world, rank, stage: the world's size, this rank, the sharding stage.
    """
    f.write(MAGIC)
    lengths = []
    for key, payload in sections:
        start = f.tell()
        if callable(payload):
            payload(f)
        else:
            f.write(payload)
        lengths.append((key, f.tell() - start))
    manifest = pickle.dumps({"world": world, "rank": rank, "shard": stage,
                             "sections": lengths})
    f.write(manifest)
    f.write(_LENGTH.pack(len(manifest)))


def is_sectioned(data):
    """Whether ``data`` (a commit after its id) was written by ``write``."""
    return bytes(data[:len(MAGIC)]) == MAGIC


def parse(data):
    """Returns (manifest, {key: memoryview}) of a commit written by ``write``."""
    view = memoryview(data).cast("B")
    (length,) = _LENGTH.unpack_from(view, len(view) - _LENGTH.size)
    manifest = pickle.loads(view[len(view) - _LENGTH.size - length:len(view) - _LENGTH.size])
    offset, sections = len(MAGIC), {}
    for key, size in manifest["sections"]:
        sections[key] = view[offset:offset + size]
        offset += size
    return manifest, sections


def read_manifest(path):
    """Returns (manifest, where its sections start in the file), or None for a file that
    is not a sharded commit (or is gone)."""
    try:
        with open(path, "rb") as f:
            if f.read(COMMIT_HEADER.size + len(MAGIC))[COMMIT_HEADER.size:] != MAGIC:
                return None
            f.seek(-_LENGTH.size, io.SEEK_END)
            (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
            f.seek(-_LENGTH.size - length, io.SEEK_END)
            manifest = pickle.loads(f.read(length))
    except (OSError, EOFError, pickle.UnpicklingError, struct.error):
        return None
    return manifest, COMMIT_HEADER.size + len(MAGIC)


def read_section(path, start, manifest, key):
    """Reads section ``key`` of the commit file ``path``."""
    offset = start
    for name, size in manifest["sections"]:
        if name == key:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(size)
            if len(data) != size:
                raise RuntimeError(f"hvdlite elastic: {path} is cut short")
            return data
        offset += size
    raise KeyError(key)


Source = collections.namedtuple("Source", "reader path start manifest")
Plan = collections.namedtuple("Plan", "commit_id world shared parts skipped")


def plan_handover(listings):
    """Which commit a new world takes and where each of its sections is read.

    Args:
        listings: per rank of the new world, ``(host, [(commit id, path, manifest,
            start)])``: the sharded commit files on its host.

    Returns:
        A Plan: the commit id, the old world's size, the Source of the shared section,
        one Source per old rank's part (in rank order), and the newer commits skipped
        as (commit id, missing old ranks).

    Raises:
        RuntimeError: no commit has all its parts on the new world's hosts.
    """
    files = {}  # (host, path) -> (commit id, Source): the first rank on the host reads it
    for rank, (host, entries) in enumerate(listings):
        for commit_id, path, manifest, start in entries:
            files.setdefault((host, path), (commit_id, Source(rank, path, start, manifest)))
    by_commit = collections.defaultdict(list)
    for commit_id, source in files.values():
        by_commit[commit_id].append(source)
    skipped = []
    for commit_id in sorted(by_commit, reverse=True):
        sources = by_commit[commit_id]
        world = sources[0].manifest["world"]
        where = {}
        # A part from its own rank's file first, then from a holder's.
        for source in sorted(sources, key=lambda s: (s.manifest["rank"], s.reader)):
            for key, _ in source.manifest["sections"]:
                if key == SHARED or key == source.manifest["rank"]:
                    where.setdefault(key, source)
        for source in sources:
            for key, _ in source.manifest["sections"]:
                where.setdefault(key, source)
        missing = [rank for rank in range(world) if rank not in where]
        if not missing:
            return Plan(commit_id, world, where[SHARED], [where[r] for r in range(world)],
                        skipped)
        skipped.append((commit_id, missing))
    newest = ", ".join(f"commit {c}: parts of old rank(s) {m}" for c, m in skipped[:2])
    raise RuntimeError(
        "hvdlite elastic: the sharded optimizer's committed state is not whole on the new "
        f"world's hosts ({newest or 'no commit found'} missing): more hosts were lost "
        "between commits than one copy covers (each part is kept by its rank and by one "
        "rank on another host)")


def hand_over(store, optimizer, load_shared):
    """Brings this rank to the newest whole commit on the world's hosts (collective: every
    rank of the new world calls it): the shared section from one rank, then each old
    part from one rank, one at a time, each rank keeping its new share.

    Args:
        store: this rank's CommitStore.
        optimizer: the sharded optimizer, made for the new world.
        load_shared: ``load_shared(data)`` loads the model and values.

    Returns:
        The commit id taken.
    """
    entries = []
    for commit_id, _, _, path in store.files():
        found = read_manifest(path)
        if found is not None:
            entries.append((commit_id, path, *found))
    listings = objects.allgather_object((host_name(), entries), name="hvdlite.elastic.listing")
    plan = plan_handover(listings)
    me = core.rank()
    for commit_id, missing in plan.skipped if me == 0 else ():
        log.warning("hvdlite elastic: commit %d was not written whole (no part from old "
                    "rank(s) %s: a rank died writing it); resuming from commit %d",
                    commit_id, missing, plan.commit_id)

    def read(source, key):
        if source.reader != me:
            return None
        return read_section(source.path, source.start, source.manifest, key)

    shared = objects.broadcast_bytes(read(plan.shared, SHARED), plan.shared.reader,
                                     "hvdlite.elastic.handover")
    load_shared(shared)

    def parts():
        for old_rank, source in enumerate(plan.parts):
            data = objects.broadcast_bytes(read(source, old_rank), source.reader,
                                           "hvdlite.elastic.handover.part")
            yield load_part(data)

    optimizer.load_local_state_dicts(parts())
    return plan.commit_id
