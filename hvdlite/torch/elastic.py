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

import torch
import torch.utils.data

from hvdlite import runtime
from hvdlite.elastic.state import ObjectState, State, run
from hvdlite.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]


class TorchState(State):
    """A model, its optimizer and other values, committed and restored together.

    Args:
        model: a ``torch.nn.Module`` (its ``state_dict``), or None.
        optimizer: a ``torch.optim.Optimizer`` (its ``state_dict``), or None.
        **kwargs: further values, each an attribute of the state; an ``ElasticSampler``
            among them keeps its progress through the epoch and is re-split over the
            new world after a reset.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self._keep_values(kwargs)
        self.save()

    def _samplers(self):
        return [getattr(self, n) for n in self._value_names
                if isinstance(getattr(self, n), ElasticSampler)]

    def _serialize(self, f):
        values = {}
        for name in self._value_names:
            value = getattr(self, name)
            values[name] = value.state_dict() if isinstance(value, ElasticSampler) else value
        torch.save({
            "model": self.model.state_dict() if self.model is not None else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "values": values,
        }, f)

    def _deserialize(self, data):
        # Our own bytes from this job, not a file of unknown origin: full unpickling.
        saved = torch.load(io.BytesIO(data), weights_only=False)
        if self.model is not None:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        for name, value in saved["values"].items():
            current = getattr(self, name, None)
            if isinstance(current, ElasticSampler):
                current.load_state_dict(value)
            else:
                setattr(self, name, value)

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
