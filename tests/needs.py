"""Skips that CI must not take.

A test that cannot run on this machine (no root for a namespace cluster, a kernel that
refuses real-time threads, a framework not installed or broken) skips with its reason,
for a developer. CI names the areas it is expected to run in ``HVDLITE_REQUIRE`` (comma
separated, ``all`` for every area; scripts/test.sh sets it), and there the same test
fails instead, naming the switch, so that a whole area cannot pass CI by skipping.

* ``need(area, reason)``: skip, or fail under the switch (call inside a test or fixture)
* ``import_or_skip(module, area)``: ``pytest.importorskip`` under the same rule
* ``needs(area, available, reason)``: a marker; the test skips (or fails) at set-up
  when ``available`` is false (tests/conftest.py applies it)

``HVDLITE_REQUIRE_NATIVE=1`` (the native library, harness.require_native) is the older
switch of the same kind and stays as it is.
"""
import importlib
import importlib.util
import os

import pytest

SWITCH = "HVDLITE_REQUIRE"

# What each area needs on the machine; CI (scripts/test.sh, running as root after
# scripts/setup_venv.sh) provides all of them.
AREAS = {
    "cluster": "root, and ip/tc (iproute2), unshare (util-linux), nft (nftables): tests/cluster",
    "realtime": "a kernel that lets this user make a thread SCHED_FIFO (root, CAP_SYS_NICE or "
                "RLIMIT_RTPRIO > 0) and at least 2 cores: tests/multirank/test_thread_sched.py",
    "torch": "torch importable",
    "lightning": "lightning (PyTorch Lightning 2.x, the package) importable, with torch",
    "spark": "pyspark importable and Java 17+ (java on PATH or JAVA_HOME): tests/spark, "
             "tests/cluster/test_cluster_spark.py",
    "slurm": "root and Debian's slurm-wlm and munge (slurmctld, slurmd, munged, srun, sbatch): "
             "tests/cluster/test_cluster_slurm.py",
    "tensorflow": "tensorflow importable",
    "keras": "keras importable (with tensorflow or torch as its backend)",
    "sklearn": "scikit-learn importable (the examples' data set)",
    "mpi4py": "mpi4py importable",
    "matplotlib": "matplotlib importable (hvdlite timeline's plots)",
    "ray": "ray[train] (Ray 2.x) importable: tests/on_ray (hvdlite.ray)",
}


def required_areas():
    """The areas named in HVDLITE_REQUIRE; an unknown name is an error, not ignored."""
    names = {n.strip() for n in os.environ.get(SWITCH, "").split(",") if n.strip()}
    if "all" in names:
        return set(AREAS)
    unknown = names - set(AREAS)
    if unknown:
        raise pytest.UsageError(f"{SWITCH}: unknown area(s) {sorted(unknown)}; "
                                f"known: {sorted(AREAS)} or all")
    return names


def required(area):
    assert area in AREAS, area
    return area in required_areas()


def need(area, reason):
    """Skips the calling test with ``reason``; fails it instead when CI requires ``area``."""
    if required(area):
        pytest.fail(f"{SWITCH} includes {area!r} ({AREAS[area]}), but: {reason}",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def import_or_skip(module, area=None):
    """Imports ``module`` and returns it; when it cannot be imported, ``need(area)``
    (``area`` defaults to the module's top-level name)."""
    area = area or module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as error:  # missing, or installed but broken
        need(area, f"could not import {module}: {error}")


def installed(*modules):
    """Whether every module can be found (without importing it)."""
    return all(importlib.util.find_spec(m) is not None for m in modules)


def needs(area, available, reason):
    """A marker: the test skips with ``reason`` when ``available`` is false, or fails
    under the switch. Checked at set-up (tests/conftest.py)."""
    return pytest.mark.hvdlite_needs(area=area, available=bool(available), reason=reason)
