"""Elastic training for PyTorch: ``hvd.elastic`` after ``import hvdlite.torch as hvd``.

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

See hvdlite/elastic/state.py for what a commit and a reset do.
"""
import io
import math
import random

import numpy as np
import torch
import torch.utils.data

from hvdlite import objects, ops, runtime
from hvdlite.elastic.state import ObjectState, State, run
from hvdlite.errors import HorovodInternalError, HostsUpdatedInterrupt
from hvdlite.torch import sharded_commit

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]


class TorchState(State):
    """A model, its optimizer and other values, committed and restored together.

    With a sharded optimizer (``DistributedOptimizer(..., shard=1|2)``) each rank commits
    its own part of the optimizer state (and, across hosts, a copy of one other rank's),
    and a new world of any size re-shards the commit (see hvdlite/torch/sharded_commit.py).

    Args:
        model: a ``torch.nn.Module`` (its ``state_dict``), or None.
        optimizer: a ``torch.optim.Optimizer`` (its ``state_dict``), or None.
        **kwargs: further values, each an attribute of the state; an ``ElasticSampler``
            among them keeps its progress through the epoch and is re-split over the
            new world after a reset.

    Raises:
        ValueError: a sharded optimizer a commit cannot keep (``shard=3``, or a process
            set other than the global one).
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self._shard = sharded_commit.stage_of(optimizer)
        self._copies = sharded_commit.Copies() if self._shard else None
        self._parts = None  # while a sharded commit is written: its optimizer sections
        self._keep_values(kwargs)
        self.save()

    def _samplers(self):
        return [getattr(self, n) for n in self._value_names
                if isinstance(getattr(self, n), ElasticSampler)]

    def _values(self):
        values = {}
        for name in self._value_names:
            value = getattr(self, name)
            values[name] = value.state_dict() if isinstance(value, ElasticSampler) else value
        return values

    def _serialize(self, f):
        if self._shard:
            parts = self._parts or [(runtime.rank(),
                                     sharded_commit.part_writer(self.optimizer))]
            sharded_commit.write(f, [(sharded_commit.SHARED, self._write_shared)] + parts,
                                 runtime.size(), runtime.rank(), self._shard)
            return
        torch.save({
            "model": self.model.state_dict() if self.model is not None else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "values": self._values(),
        }, f)

    def _write_shared(self, f):
        """What every rank of a sharded job holds whole: the model, the values and the
        commit id."""
        torch.save({"commit_id": self._commit_id, "values": self._values(),
                    "model": self.model.state_dict() if self.model is not None else None}, f)

    def _load_shared(self, data):
        saved = torch.load(io.BytesIO(data), weights_only=False)
        self._commit_id = saved["commit_id"]
        if self.model is not None:
            self.model.load_state_dict(saved["model"])
        self._load_values(saved["values"])

    def _load_values(self, values):
        for name, value in values.items():
            current = getattr(self, name, None)
            if isinstance(current, ElasticSampler):
                current.load_state_dict(value)
            else:
                setattr(self, name, value)

    def _deserialize(self, data):
        if sharded_commit.is_sectioned(data):
            manifest, sections = sharded_commit.parse(data)
            self._load_shared(sections[sharded_commit.SHARED])
            # This world's own commit (restore): its own part covers its share.
            self.optimizer.load_local_state_dicts(
                sharded_commit.load_part(sections[key])
                for key, _ in manifest["sections"] if key != sharded_commit.SHARED)
            return
        # Our own bytes from this job, not a file of unknown origin: full unpickling.
        saved = torch.load(io.BytesIO(data), weights_only=False)
        if self.model is not None:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        self._load_values(saved["values"])

    def _keep(self):
        if not self._shard or self._store is None:
            super()._keep()
            return
        self._parts = self._copies.sections(self.optimizer)
        try:
            self._store.write(self._write, self._commit_id, keep_previous=True)
        finally:
            self._parts = None
        # The commit is whole once every rank has written its part; only then may the
        # previous one go.
        ops.allreduce(np.zeros(1, np.int32), name="hvdlite.elastic.written", op=ops.Sum)
        self._store.drop_previous()

    def sync(self, root_rank=0):
        """Makes every rank's model and values ``root_rank``'s and keeps the state as the one
        ``restore`` returns to (see ``State.sync``). A sharded optimizer's parts are the
        one state already, each on its rank: they stay (load a checkpoint into it with
        ``load_state_dict`` on every rank, or ``broadcast_optimizer_state``, before).

        Args:
            root_rank: the rank whose model and values everyone takes.
        """
        if not self._shard:
            super().sync(root_rank)
            return
        shared = None
        if runtime.rank() == root_rank:
            shared = io.BytesIO()
            self._write_shared(shared)
            shared = shared.getbuffer()
        self._load_shared(objects.broadcast_bytes(shared, root_rank, "hvdlite.elastic.sync"))
        self._keep()

    def _hand_over(self):
        if not self._shard:
            super()._hand_over()
            return
        self._commit_id = sharded_commit.hand_over(self._store, self.optimizer,
                                                   self._load_shared)

    def on_reset(self):
        for sampler in self._samplers():
            sampler.reset()
        super().on_reset()


class ElasticSampler(torch.utils.data.Sampler):
    """Splits a dataset over the ranks and, after a reset, the rest of the epoch over the
    new world, each remaining sample once.

    Every rank calls ``record_batch`` after each batch of the epoch and ``set_epoch`` at
    the end of each epoch (it starts the next one from the first sample). Progress is
    counted in samples of the whole world, so it is the same number on every rank and a
    commit needs no communication for it.

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle each epoch's order (by ``seed + epoch``, the same on every rank).
        seed: the shuffle's base seed.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch ``epoch`` from its first sample (call it at the end of an epoch)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Counts one batch of ``batch_size`` samples per rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def get_indices(self, batch_idx, batch_size):
        """This rank's sample indices of batch ``batch_idx`` of the current split."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self):
        """Splits the epoch's unprocessed samples over the current world."""
        self.num_replicas = runtime.size() if runtime.is_initialized() else 1
        self.rank = runtime.rank() if runtime.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        remaining = order[self.processed_num:]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        total = self.num_samples * self.num_replicas
        # Pad by wrapping around so every rank gets as many samples (as DistributedSampler).
        padded = remaining + remaining[:total - len(remaining)]
        self.indices = padded[self.rank:total:self.num_replicas]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
