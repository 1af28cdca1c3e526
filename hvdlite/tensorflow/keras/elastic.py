"""Horovod's ``horovod.tensorflow.keras.elastic``: that of ``hvdlite.keras``."""
from hvdlite.keras.elastic import (CommitStateCallback, HorovodInternalError,
                                   HostsUpdatedInterrupt, KerasState, ObjectState, State,
                                   TensorFlowKerasState, UpdateBatchStateCallback,
                                   UpdateEpochStateCallback, run)

__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt",
           "KerasState", "ObjectState", "State", "TensorFlowKerasState",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
