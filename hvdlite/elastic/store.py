"""Committed states in host memory (tmpfs), where the next world finds them.

A world's processes end at a reset (MPI cannot shrink or grow a world in place), so a
commit that must outlive them is written to tmpfs on the rank's host: the file is the
commit, in memory, and survives the death of every process on the host. One file per
rank, named ``c<commit id>-g<generation>-r<rank>.state``, written under a temporary name
and renamed, so a rank killed while it writes leaves its previous commit intact. The
commit id goes up by one with every save on every rank alike, so the newest file on any
host is the last commit of the world, whoever died.
"""
import os
import re

_NAME = re.compile(r"^c(\d+)-g(\d+)-r(\d+)\.state$")


class CommitStore:
    """One rank's view of the job's state directory on its host.

    Args:
        directory: the job's state directory on this host (created on first write).
        generation: the current world's generation.
        rank: this rank in the current world.
    """

    def __init__(self, directory, generation, rank):
        self.directory = directory
        self.generation = generation
        self.rank = rank
        self.path = None  # this rank's newest commit file
        self._previous = None  # the file before it, while write(keep_previous=True) keeps it

    def write(self, writer, commit_id, keep_previous=False):
        """Writes commit ``commit_id`` and drops this rank's previous file.

        Args:
            writer: ``writer(file)`` writes the serialized state into a binary file.
            commit_id: the commit's id.
            keep_previous: keep the previous file until ``drop_previous`` (a commit that
                is whole only once every rank has written its part: the previous one must
                outlive a write that another rank's death leaves unfinished).
        """
        os.makedirs(self.directory, exist_ok=True)
        name = f"c{commit_id:012d}-g{self.generation}-r{self.rank}.state"
        path = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".tmp-{os.getpid()}-{name}")
        with open(tmp, "wb") as f:
            writer(f)
        os.replace(tmp, path)
        previous, self.path = self.path, path
        if previous and previous != path:
            if keep_previous:
                self.drop_previous()  # one kept file at most
                self._previous = previous
            else:
                _remove(previous)

    def drop_previous(self):
        """Removes the file ``write(..., keep_previous=True)`` kept, if any."""
        previous, self._previous = self._previous, None
        if previous and previous != self.path:
            _remove(previous)

    def read_own(self):
        """Returns this rank's last commit, or None before its first."""
        if self.path is None:
            return None
        with open(self.path, "rb") as f:
            return f.read()

    def newest(self):
        """Returns (commit id, path) of the newest commit on this host, or (-1, None)."""
        best = (-1, None)
        for name in _listdir(self.directory):
            match = _NAME.match(name)
            if match and int(match.group(1)) > best[0]:
                best = (int(match.group(1)), os.path.join(self.directory, name))
        return best

    def files(self):
        """Returns [(commit id, generation, rank, path)] of every commit file on this host."""
        found = []
        for name in _listdir(self.directory):
            match = _NAME.match(name)
            if match:
                found.append((*map(int, match.groups()), os.path.join(self.directory, name)))
        return sorted(found)

    def drop_older_generations(self):
        """Removes the files of earlier worlds and of writes cut short, on this host.

        Called once every rank of the current world has written its own commit file.
        """
        for name in _listdir(self.directory):
            match = _NAME.match(name)
            if name.startswith(".tmp-") or (match and int(match.group(2)) < self.generation):
                _remove(os.path.join(self.directory, name))

    def remove_own(self):
        """Removes this rank's file, and the directory once it is empty (job finished)."""
        self.drop_previous()
        if self.path is not None:
            _remove(self.path)
            self.path = None
        try:
            os.rmdir(self.directory)
        except OSError:
            pass


def _listdir(directory):
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
