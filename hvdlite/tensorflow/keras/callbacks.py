"""Horovod's ``horovod.tensorflow.keras.callbacks``: those of ``hvdlite.keras``."""
from hvdlite.keras.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,
                                     LearningRateScheduleCallback,
                                     LearningRateWarmupCallback, MetricAverageCallback)

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]
