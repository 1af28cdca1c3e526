"""Horovod's environment variables, honoured as aliases of ours.

A job script written for Horovod sets ``HOROVOD_FUSION_THRESHOLD=...`` and the like;
``init()`` copies each such value to the ``HVDLITE_*`` variable the core reads, unless
that one is set too (ours win). ``ALIASES`` is the one table; the README's
"Environment variables" section lists it. Horovod variables with no counterpart here
(e.g. ``HOROVOD_GPU_ALLREDUCE``) are ignored.
"""
import logging
import os

_log = logging.getLogger("hvdlite")


def _negate_flag(value):
    # HOROVOD_STALL_CHECK_DISABLE=1 -> a stall check time of 0 (off) here.
    return "0" if value.strip().lower() in ("1", "true", "yes", "on") else None


# (Horovod's name, ours, conversion of the value or None to copy it as is; a
# conversion returning None sets nothing). Units agree: bytes, milliseconds, seconds.
ALIASES = (
    ("HOROVOD_FUSION_THRESHOLD", "HVDLITE_FUSION_THRESHOLD", None),
    ("HOROVOD_CYCLE_TIME", "HVDLITE_CYCLE_TIME", None),
    ("HOROVOD_CACHE_CAPACITY", "HVDLITE_CACHE_CAPACITY", None),
    ("HOROVOD_TIMELINE", "HVDLITE_TIMELINE", None),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "HVDLITE_TIMELINE_MARK_CYCLES", None),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "HVDLITE_STALL_CHECK_TIME", None),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "HVDLITE_STALL_SHUTDOWN_TIME", None),
    ("HOROVOD_STALL_CHECK_DISABLE", "HVDLITE_STALL_CHECK_TIME", _negate_flag),
    ("HOROVOD_LOG_LEVEL", "HVDLITE_LOG_LEVEL", None),
    ("HOROVOD_MPI_THREADS_DISABLE", "HVDLITE_MPI_THREAD_FUNNELED", None),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "HVDLITE_HIERARCHICAL_ALLGATHER", None),
    ("HOROVOD_AUTOTUNE", "HVDLITE_AUTOTUNE", None),
    ("HOROVOD_GPU_OPERATIONS", "HVDLITE_GPU_OPERATIONS", None),
    ("HOROVOD_AUTOTUNE_LOG", "HVDLITE_AUTOTUNE_LOG", None),
    ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "HVDLITE_AUTOTUNE_WARMUP_SAMPLES", None),
    ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE", None),
    ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "HVDLITE_AUTOTUNE_MAX_SAMPLES", None),
)


def apply(environ=None):
    """Sets each unset ``HVDLITE_*`` variable from its Horovod alias, if that is set.

    Args:
        environ: the mapping to read and update; None means ``os.environ`` (which the
            core reads at ``init()``).

    Returns:
        The names of the variables that were set, in table order.
    """
    environ = os.environ if environ is None else environ
    applied = []
    for horovod_name, ours, convert in ALIASES:
        value = environ.get(horovod_name)
        if value is None or ours in environ:
            continue
        value = value if convert is None else convert(value)
        if value is None:
            continue
        environ[ours] = value
        applied.append(ours)
        _log.debug("hvdlite: %s=%s from %s", ours, value, horovod_name)
    return applied
