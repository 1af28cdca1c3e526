"""Elastic training for Keras 3: ``hvd.elastic`` after ``import hvdlite.keras as hvd`` (or
``hvdlite.tensorflow.keras``).

    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]

    @hvd.elastic.run
    def train(state):
        model.fit(data_from(state.epoch, state.batch), steps_per_epoch=steps,
                  initial_epoch=state.epoch, epochs=epochs, callbacks=callbacks)

A reset starts the script again in a new world (hvdlite/elastic/state.py); ``run`` hands
it the last commit, and ``fit`` goes on from ``state.epoch`` and ``state.batch``. The
data of the epoch's remaining batches are the script's to give (Keras 3 starts its
iterator over). Put the callbacks in this order, after MetricAverageCallback: the
commit sees the epoch and batch the others updated.
"""
import keras

from hvdlite.elastic import state as _state
from hvdlite.elastic.state import ObjectState, State
from hvdlite.elastic.variables import ModelState
from hvdlite.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt",
           "KerasState", "ObjectState", "State", "TensorFlowKerasState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(ModelState):
    """A Keras model, its optimizer and other values, committed and restored together
    (any Keras 3 backend).

    Args:
        model: a built Keras model.
        optimizer: its optimizer; None takes ``model.optimizer``.
        **kwargs: further values, each an attribute of the state.
    """


TensorFlowKerasState = KerasState


def run(func):
    """Decorator for the training function, as ``hvdlite.elastic.run``; on the
    TensorFlow backend a collective that failed inside ``fit``'s graph counts too."""
    if keras.backend.backend() == "tensorflow":
        # hvdlite.tensorflow is imported when the tensorflow backend runs, never on the others.
        from hvdlite.tensorflow import elastic as tf_elastic

        return tf_elastic.run(func)
    return _state.run(func)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits the state every ``batches_per_commit`` batches and at each epoch's end.

    The epoch's last batch is committed by the epoch's end (with the next epoch and
    batch 0), not twice: a reset between the two would resume an epoch with no batch
    left, which Keras cannot run.

    Args:
        state: the elastic state.
        batches_per_commit: batches between commits (counted from the start of each
            ``fit``, alike on every rank).
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be at least 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit
        self._epoch_start = 0

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = getattr(self.state, "batch", 0) or 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.batches_remaining = self.batches_per_commit
            steps = self.params.get("steps") if self.params else None
            if not steps or self._epoch_start + batch + 1 < steps:
                self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch``: the batches of the current epoch done (0 at its start).

    After a reset ``fit`` starts the epoch over at Keras' step 0; this callback counts on
    from ``state.batch`` and ends that epoch once it has its ``steps_per_epoch``
    batches in all (the following epochs run whole). ``state.batch`` counts the
    batches done, so a commit after batch ``b`` resumes at batch ``b + 1``: nothing
    done twice.

    Args:
        state: the elastic state (with a ``batch`` value).
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._offset = 0
        self._ended_early = False

    def on_epoch_begin(self, epoch, logs=None):
        self._offset = self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1
        steps = self.params.get("steps") if self.params else None
        if self._offset and steps and self.state.batch >= steps:
            # The resumed epoch is complete: stop_training ends its batch loop; it is
            # cleared at the epoch's end so that fit goes on with the next epoch.
            self.model.stop_training = True
            self._ended_early = True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._offset = 0
        if self._ended_early:
            self.model.stop_training = False
            self._ended_early = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch``: the epochs done, across resets.

    Keras numbers the epochs of each ``fit`` from its ``initial_epoch``; the first one
    is taken to be ``state.epoch``, so both ``fit(epochs=total - state.epoch)`` and
    ``fit(initial_epoch=state.epoch, epochs=total)`` count right.

    Args:
        state: the elastic state (with an ``epoch`` value).
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._offset = None

    def on_train_begin(self, logs=None):
        self._offset = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._offset is None:
            self._offset = self.state.epoch - epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + self._offset + 1
