"""HOROVOD_* environment variables as aliases of ours (hvdlite.env_aliases)."""
import json
import os

from hvdlite import env_aliases

# Horovod's knobs the issue names, with ours (the alias table must keep them).
EXPECTED = {
    "HOROVOD_FUSION_THRESHOLD": "HVDLITE_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME": "HVDLITE_CYCLE_TIME",
    "HOROVOD_CACHE_CAPACITY": "HVDLITE_CACHE_CAPACITY",
    "HOROVOD_TIMELINE": "HVDLITE_TIMELINE",
    "HOROVOD_TIMELINE_MARK_CYCLES": "HVDLITE_TIMELINE_MARK_CYCLES",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "HVDLITE_STALL_CHECK_TIME",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "HVDLITE_STALL_SHUTDOWN_TIME",
    "HOROVOD_LOG_LEVEL": "HVDLITE_LOG_LEVEL",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "HVDLITE_HIERARCHICAL_ALLGATHER",
    "HOROVOD_AUTOTUNE": "HVDLITE_AUTOTUNE",
    "HOROVOD_AUTOTUNE_LOG": "HVDLITE_AUTOTUNE_LOG",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "HVDLITE_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "HVDLITE_AUTOTUNE_MAX_SAMPLES",
}


def test_the_table_has_horovods_knobs():
    table = {horovod: ours for horovod, ours, _ in env_aliases.ALIASES}
    for horovod, ours in EXPECTED.items():
        assert table.get(horovod) == ours, horovod


def test_a_horovod_variable_sets_ours_and_ours_win():
    env = {"HOROVOD_CYCLE_TIME": "3.5", "HOROVOD_CACHE_CAPACITY": "7",
           "HVDLITE_CACHE_CAPACITY": "9", "HOROVOD_UNKNOWN_KNOB": "1"}
    applied = env_aliases.apply(env)
    assert applied == ["HVDLITE_CYCLE_TIME"]
    assert env["HVDLITE_CYCLE_TIME"] == "3.5"
    assert env["HVDLITE_CACHE_CAPACITY"] == "9"  # ours was set: kept
    assert "HVDLITE_UNKNOWN_KNOB" not in env


def test_stall_check_disable_turns_the_check_off():
    env = {"HOROVOD_STALL_CHECK_DISABLE": "1"}
    env_aliases.apply(env)
    assert env["HVDLITE_STALL_CHECK_TIME"] == "0"
    env = {"HOROVOD_STALL_CHECK_DISABLE": "0"}
    assert env_aliases.apply(env) == [] and "HVDLITE_STALL_CHECK_TIME" not in env


def test_the_core_reads_a_horovod_value_at_init(native, run_py):
    # A bad HOROVOD_CYCLE_TIME reaches the core's check, named by our variable...
    result = run_py("""
        import hvdlite
        import hvdlite.errors
        try:
            hvdlite.init()
        except hvdlite.errors.InvalidArgumentError as e:
            print("REFUSED", e)
    """, env={"HOROVOD_CYCLE_TIME": "soon", "HVDLITE_CYCLE_TIME": None})
    assert "REFUSED" in result.stdout and "HVDLITE_CYCLE_TIME='soon'" in result.stdout
    # ...and is ignored when ours is set.
    result = run_py("""
        import hvdlite
        hvdlite.init()
        print("STARTED")
    """, env={"HOROVOD_CYCLE_TIME": "soon", "HVDLITE_CYCLE_TIME": "2"})
    assert "STARTED" in result.stdout


def test_horovod_timeline_writes_the_timeline(native, run_py, tmp_path):
    path = tmp_path / "timeline.json"
    run_py("""
        import numpy as np
        import hvdlite
        hvdlite.init()
        hvdlite.allreduce(np.ones(4, np.float32), name="through.the.alias")
        hvdlite.shutdown()
    """, env={"HOROVOD_TIMELINE": str(path), "HVDLITE_TIMELINE": None})
    events = json.loads(path.read_text())
    assert any("through.the.alias" in json.dumps(event) for event in events)


def test_ours_win_for_the_timeline(native, run_py, tmp_path):
    theirs, ours = tmp_path / "theirs.json", tmp_path / "ours.json"
    run_py("""
        import numpy as np
        import hvdlite
        hvdlite.init()
        hvdlite.allreduce(np.ones(4, np.float32), name="ours")
        hvdlite.shutdown()
    """, env={"HOROVOD_TIMELINE": str(theirs), "HVDLITE_TIMELINE": str(ours)})
    assert os.path.exists(ours) and not os.path.exists(theirs)
