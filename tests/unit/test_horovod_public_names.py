"""Horovod 0.28.1's public names of ``horovod.tensorflow`` and
``horovod.tensorflow.keras`` and their ``elastic`` modules (written here from its modules: the names they define or
import for their users, without modules imported for their own use, such as ``os``,
``tf``, ``warnings``), and which ``hvdlite.tensorflow`` / ``hvdlite.tensorflow.keras``
have. ``ABSENT`` lists, with the reason, the names this build does not have; a name
that appears must leave that list (the test says so), so the list stays true.
"""
import importlib

import pytest

import needs

pytestmark = needs.needs("tensorflow", needs.installed("tensorflow"), "tensorflow is not installed")

HOROVOD_TENSORFLOW = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression",
    "DistributedGradientTape", "DistributedOptimizer", "LocalGradientAggregationHelper",
    "Max", "Min", "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum",
    "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object",
    "allreduce", "alltoall", "broadcast", "broadcast_", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables", "ccl_built",
    "check_num_rank_power_of_2", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "handle_average_backwards_compatibility",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op",
    "local_size", "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "process_set_included_op", "rank", "rank_op", "reducescatter",
    "refs_to_vars", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline", "vars_to_refs",
]

HOROVOD_TENSORFLOW_KERAS = [
    "Average", "Compression", "DistributedOptimizer", "ProcessSet", "Sum",
    "add_process_set", "allgather", "allreduce", "broadcast", "broadcast_global_variables",
    "callbacks", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "elastic", "global_process_set", "gloo_built", "gloo_enabled", "init",
    "is_initialized", "load_model", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
    "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline",
]

HOROVOD_TENSORFLOW_KERAS_CALLBACKS = [
    "BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
]

HOROVOD_TENSORFLOW_ELASTIC = [
    "ObjectState", "TensorFlowKerasState", "TensorFlowState", "run",
]

HOROVOD_TENSORFLOW_KERAS_ELASTIC = [
    "CommitStateCallback", "KerasState", "UpdateBatchStateCallback",
    "UpdateEpochStateCallback", "run",
]

ABSENT = {
    "hvdlite.tensorflow": {
        "LocalGradientAggregationHelper": "TF1 graph-mode gradient accumulation, "
                                          "not built",
    },
    "hvdlite.tensorflow.keras": {},
    "hvdlite.tensorflow.keras.callbacks": {},
    "hvdlite.tensorflow.elastic": {},
    "hvdlite.tensorflow.keras.elastic": {},
}


@pytest.mark.parametrize("module, names", [
    ("hvdlite.tensorflow", HOROVOD_TENSORFLOW),
    ("hvdlite.tensorflow.keras", HOROVOD_TENSORFLOW_KERAS),
    ("hvdlite.tensorflow.keras.callbacks", HOROVOD_TENSORFLOW_KERAS_CALLBACKS),
    ("hvdlite.tensorflow.elastic", HOROVOD_TENSORFLOW_ELASTIC),
    ("hvdlite.tensorflow.keras.elastic", HOROVOD_TENSORFLOW_KERAS_ELASTIC),
])
def test_horovods_public_names_are_there(module, names):
    mod = importlib.import_module(module)
    missing = {name for name in names if not hasattr(mod, name)}
    absent = set(ABSENT[module])
    assert missing <= absent, f"{module} lacks {sorted(missing - absent)}"
    assert absent <= missing, (f"{module} now has {sorted(absent - missing)}: "
                               "remove them from ABSENT")


def test_the_built_queries_answer_like_a_cpu_mpi_horovod():
    import hvdlite.tensorflow as hvd

    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not any(f() for f in (hvd.gloo_built, hvd.gloo_enabled, hvd.ddl_built,
                                 hvd.ccl_built, hvd.rocm_built))
    # cuda_built/nccl_built say whether the core opens those libraries on this machine
    # (tests/multirank/test_gpu_paths_on_cpu.py checks both answers with stand-ins).
    assert isinstance(hvd.cuda_built(), bool) and isinstance(hvd.nccl_built(), int)
    assert [hvd.check_num_rank_power_of_2(n) for n in (1, 2, 3, 4, 6, 8)] == [
        True, True, False, True, False, True]


def test_horovods_private_helpers_that_its_suites_use():
    import tensorflow as tf

    import hvdlite.tensorflow as hvd
    from hvdlite.tensorflow.util import _executing_eagerly

    assert hvd._executing_eagerly() and hvd.util._executing_eagerly() and _executing_eagerly()
    # Horovod's process-set suites reach the table through hvd.mpi_ops._basics; its
    # Adasum suite asks hvd.gpu_available('tensorflow').
    import hvdlite.tensorflow.mpi_ops as mpi_ops

    assert hvd.mpi_ops is mpi_ops
    assert callable(hvd.mpi_ops._basics._get_process_set_ids_and_ranks)
    assert hvd.gpu_available("tensorflow") is False
    with tf.Graph().as_default():
        assert not hvd._executing_eagerly()


def test_keras_callbacks_are_hvdlite_keras_ones():
    import hvdlite.keras.callbacks as shared
    import hvdlite.tensorflow.keras as hvd

    for name in HOROVOD_TENSORFLOW_KERAS_CALLBACKS:
        assert getattr(hvd.callbacks, name) is getattr(shared, name)
    checkpoint = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    assert checkpoint.save_best_only and checkpoint.monitor == "loss"
