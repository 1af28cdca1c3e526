"""Keras 3 callbacks for data-parallel training; backend-neutral (numpy through hvdlite.ops).

Put ``BroadcastGlobalVariablesCallback`` first and ``MetricAverageCallback`` before any
callback that reads metrics (ReduceLROnPlateau, checkpointing, logging).
"""
import logging

import keras
import numpy as np

from hvdlite import _names, ops, runtime

_log = logging.getLogger("hvdlite")


def broadcast_keras_variables(variables, root_rank, name=None):
    """Assigns ``root_rank``'s values to Keras variables on every rank.

    All broadcasts are enqueued before any wait, so they fuse. Each value is read
    into numpy (one copy) and assigned back (one copy); this runs once per training.

    Args:
        variables: keras.Variable objects, in the same order on every rank.
        root_rank: the rank whose values everyone receives.
        name: a base name, equal across ranks; None names them automatically.
    """
    base = name or _names.auto_name("broadcast_keras_variables")
    handles = []
    for i, variable in enumerate(variables):
        value = np.array(keras.ops.convert_to_numpy(variable), order="C")
        handles.append(ops.broadcast_async(value, root_rank, f"{base}.{i}"))
    for variable, handle in zip(variables, handles):
        variable.assign(ops.synchronize(handle))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's and the optimizer's variables from ``root_rank`` at the
    start of training, so every rank starts from the same state.

    Keras 3 builds the optimizer before ``on_train_begin``; if it is not built yet, its
    variables are broadcast again after the first batch.
    """

    def __init__(self, root_rank, device=""):
        """Args:
            root_rank: the rank whose values everyone receives.
            device: accepted for Horovod compatibility.
        """
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def _broadcast(self):
        variables, seen = [], set()
        optimizer = getattr(self.model, "optimizer", None)
        optimizer_built = optimizer is None or optimizer.built
        for v in list(self.model.variables) + (list(optimizer.variables)
                                               if optimizer is not None else []):
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
        broadcast_keras_variables(variables, self.root_rank)
        return optimizer_built

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self.broadcast_done = self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces the epoch's metrics in ``logs`` by their average over ranks.

    Every numeric log entry is averaged (one allreduce of all of them, by sorted key);
    ranks must log the same keys.
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0
                      and np.issubdtype(np.asarray(v).dtype, np.number))
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = ops.allreduce(values, name="MetricAverageCallback.epoch_end",
                                 op=ops.Average)
        for key, value in zip(keys, averaged.tolist()):
            logs[key] = value


def _get_value(value):
    return float(keras.ops.convert_to_numpy(value))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch``
    to ``end_epoch`` (Horovod's schedule callback).

    With ``staircase`` the rate changes at the first batch of each epoch; without it,
    every batch, with a fractional epoch (``multiplier`` must then be callable).
    Momentum correction scales the momentum by new_lr / old_lr for one batch; it is
    applied only when the optimizer keeps momentum in a variable (Keras 3's SGD keeps
    a Python float, fixed in the compiled train step, so it is skipped there).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None,
                 staircase=True, momentum_correction=True, steps_per_epoch=None):
        """Args:
            initial_lr: the base rate (usually the single-rank rate times size()).
            multiplier: a number, or ``multiplier(epoch) -> factor``.
            start_epoch, end_epoch: the epochs [start, end) in which it acts.
            staircase: change once per epoch (else every batch).
            momentum_correction: see the class doc.
            steps_per_epoch: batches per epoch; None reads it from fit's params.
        """
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        self._warned_momentum = False
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.staircase = True
            self.multiplier = lambda epoch: multiplier

    def _autodetect_steps_per_epoch(self):
        steps = (self.params or {}).get("steps")
        if steps:
            return steps
        raise ValueError("could not detect the steps per epoch; pass steps_per_epoch")

    def _momentum_variable(self):
        momentum = getattr(self.model.optimizer, "momentum", None)
        if momentum is None:
            return None
        if isinstance(momentum, keras.Variable):
            return momentum
        if not self._warned_momentum:
            _log.info("hvdlite: momentum correction skipped: the optimizer's momentum "
                      "is not a variable")
            self._warned_momentum = True
        return None

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_value(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = self._momentum_variable() if self.momentum_correction else None
        if momentum is not None and old_lr:
            self.restore_momentum = _get_value(momentum)
            momentum.assign(self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            self._momentum_variable().assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch
                or (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch)
                                       / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs``, per batch (Goyal et al., 2017; Horovod's formula):
    ``lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)`` with the
    fractional epoch ``epoch + (batch + 1) / steps_per_epoch``.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        """Args:
            initial_lr: the rate reached at the end of the warmup.
            warmup_epochs: how many epochs the ramp lasts.
            momentum_correction, steps_per_epoch: as for LearningRateScheduleCallback.
            verbose: log the end of the warmup.
        """
        def multiplier(epoch):
            # Shifted by one batch so that the rate reaches round values at epoch ends.
            epoch += 1.0 / self.steps_per_epoch
            size = runtime.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            _log.warning("hvdlite: epoch %d: finished the learning rate warmup to %g",
                         epoch + 1, _get_value(self.model.optimizer.learning_rate))


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ModelCheckpoint that keeps only the best model (``save_best_only=True``).

    Horovod's takes no file path (its estimators set ``filepath`` later); Keras 3
    requires one at construction, so ``filepath`` defaults to ``best.keras``
    (``best.weights.h5`` with ``save_weights_only``) and may be set afterwards. Give it
    to rank 0 only, as any checkpoint callback.
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", filepath=None):
        if filepath is None:
            filepath = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
