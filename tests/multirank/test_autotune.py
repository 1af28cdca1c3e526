"""Autotune (HVDLITE_AUTOTUNE=1) in real jobs: every rank ends with the same knob values,
which are rank 0's, the log has one line per trial up to the bound and the choice is
its best-scoring trial (or, after the confirmation samples, whichever of it and the
defaults has the higher mean), allreduces stay right while the knobs change, and autotune off
leaves the defaults alone.

Each rank runs steps of a 22-tensor allreduce (small tensors that fuse, two of several
shared-memory chunks) until every rank reports the search settled; each result is
compared with numpy's sum of every rank's contribution, which each rank regenerates.
"""
import csv
import os

import pytest

from harness import assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("native")]

MIB = 1 << 20
DEFAULTS = {"fusion_threshold": 128 * MIB, "cycle_time_ms": 1.0, "shm_chunk_bytes": 1 << 19,
            "hierarchical": True}
KNOBS = ("fusion_threshold", "cycle_time_ms", "shm_chunk_bytes", "hierarchical")

SCRIPT = r"""
import json, os, sys
import numpy as np
# The "host" of each rank, before init ("-": this machine is one host).
layout = sys.argv[1]
if layout != "-":
    os.environ["HVDLITE_HOST_ID"] = "host-" + layout[int(os.environ["HVDLITE_RANK"])]
max_steps = int(sys.argv[2])
import hvdlite as hvd
hvd.init()
rank, size = hvd.rank(), hvd.size()
KNOBS = ("fusion_threshold", "cycle_time_ms", "shm_chunk_bytes", "hierarchical")
# Small tensors fuse (about 3 MiB together: more than the smallest fusion threshold
# tried, 1 MiB); the last two span several 512 KiB chunks and are reduced alone.
sizes = [1000 + 997 * i for i in range(20)] + [150_000 + i for i in range(4)] + [300_000, 400_003]
COUNTERS = ("collectives", "fused_collectives", "hierarchical_collectives", "shm_collectives")

def contribution(i, step, k):
    # Small integers: float32 sums are exact in any order.
    return ((np.arange(sizes[i]) + 7 * i + 3 * step + 11 * k) % 101).astype(np.float32)

seen, wrong, step, settled = [], [], 0, False
ran = []  # per step: the knobs before, after, and what the core's counters say ran
while step < max_steps:
    before_knobs = [hvd.autotune_state()[k] for k in KNOBS]
    before = hvd.stats()
    handles = [hvd.allreduce_async(contribution(i, step, rank), op=hvd.Sum, name=f"t{i}")
               for i in range(len(sizes))]
    for i, h in enumerate(handles):
        out = hvd.synchronize(h)
        expected = sum(contribution(i, step, k) for k in range(size))
        if not np.array_equal(out, expected):
            wrong.append([step, i])
    after = hvd.stats()
    state = hvd.autotune_state()
    knobs = [state[k] for k in KNOBS]
    ran.append([before_knobs, knobs, [after[c] - before[c] for c in COUNTERS]])
    if knobs not in seen:
        seen.append(knobs)
    step += 1
    everyone = hvd.allreduce(np.array([int(state["settled"])], np.int32), op=hvd.Min,
                             name="settled")
    if everyone[0] == 1:
        settled = True
        break
print("HVDLITE_RESULT", json.dumps({"state": hvd.autotune_state(), "seen": seen,
                                    "wrong": wrong, "steps": step, "settled": settled,
                                    "ran": ran,
                                    "stats": hvd.stats()}))
hvd.shutdown()
"""


def run(np_, env, layout="-", max_steps=400, timeout=300):
    result = assert_ok(run_job(np_, SCRIPT, args=(layout, max_steps), env=env, timeout=timeout))
    return result, [result.result(r) for r in range(np_)]


def quick_env(log, **more):
    """Autotune on, logging to `log`, with short samples and no warm-up, plus `more`."""
    env = {"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_LOG": log,
           "HVDLITE_AUTOTUNE_SAMPLE_SECONDS": "0", "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "0",
           "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE": "2"}
    env.update(more)
    return env


def read_log(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def as_knobs(row):
    """The knob values of a log row, as the ranks report them."""
    return [int(row[1]), float(row[2]), int(row[3]), row[4] == "1"]


def counters_by_knob(bodies, knob):
    """{value of ``knob``: [per step {counter: delta}]} over every rank's steps that ran
    with one value of ``knob`` (the same before and after the step)."""
    index, by_value = KNOBS.index(knob), {}
    for body in bodies:
        for before, after, deltas in body["ran"]:
            if before[index] == after[index]:
                by_value.setdefault(before[index], []).append(
                    dict(zip(("collectives", "fused", "hierarchical", "shm"), deltas)))
    return by_value


def check_agreement_and_log(result, bodies, log, bound):
    """Every rank settled on the same values, rank 0's, and the log accounts for them."""
    info = describe(result)
    for r, body in enumerate(bodies):
        assert body["wrong"] == [], f"rank {r}: wrong results at (step, tensor) {body['wrong']}"
        assert body["settled"], f"rank {r} never saw the search settle in {body['steps']} steps"
    finals = [[b["state"][k] for k in KNOBS] + [b["state"]["trials"]] for b in bodies]
    assert all(f == finals[0] for f in finals), f"ranks ended with different knobs: {finals}\n{info}"

    header, rows = read_log(log)
    assert header == ["trial", "fusion_threshold_bytes", "cycle_time_ms", "shm_chunk_bytes",
                      "hierarchical", "score_bytes_per_s"]
    trials = [row for row in rows if row[0].isdigit()]
    chosen = [row for row in rows if row[0] == "chosen"]
    assert [int(row[0]) for row in trials] == list(range(len(trials)))
    assert 1 <= len(trials) <= bound
    assert len(trials) == bodies[0]["state"]["trials"]
    assert len(chosen) == 1 and rows[-1] == chosen[0], rows
    tried = [as_knobs(row) for row in trials]
    assert as_knobs(chosen[0]) in tried
    best = max(trials, key=lambda row: float(row[5]))
    confirms = [row for row in rows if row[0] == "confirm"]
    if as_knobs(best) == tried[0]:
        # The defaults won outright: nothing to confirm.
        assert confirms == [] and float(chosen[0][5]) == float(best[5])
        assert as_knobs(chosen[0]) == tried[0]
    else:
        # The search's best and the defaults, measured twice more each, alternately;
        # the higher mean over all of a configuration's samples is chosen.
        assert [as_knobs(row) for row in confirms] == [tried[0], as_knobs(best)] * 2
        means = {}
        for row in [trials[0], best] + confirms:
            means.setdefault(tuple(as_knobs(row)), []).append(float(row[5]))
        means = {k: sum(v) / len(v) for k, v in means.items()}
        winner = max(means, key=means.get)
        assert as_knobs(chosen[0]) == list(winner)
        assert float(chosen[0][5]) == pytest.approx(means[winner], rel=1e-4)
    assert finals[0][:4] == as_knobs(chosen[0]), "the ranks do not use the logged choice"
    # The first trial is the defaults, and every rank only ever ran values rank 0 chose.
    assert tried[0] == [DEFAULTS[k] for k in KNOBS]
    for r, body in enumerate(bodies):
        strangers = [k for k in body["seen"] if k not in tried]
        assert strangers == [], f"rank {r} ran values rank 0 never tried: {strangers}"
    return tried


@pytest.mark.parametrize("np_,horovod_names", [(2, False), (3, True)])
def test_every_rank_settles_on_rank_0s_best_trial_within_the_bound(np_, horovod_names, tmp_path):
    log = str(tmp_path / "autotune.csv")
    prefix = "HOROVOD_" if horovod_names else "HVDLITE_"
    env = {prefix + "AUTOTUNE": "1", prefix + "AUTOTUNE_LOG": log,
           prefix + "AUTOTUNE_WARMUP_SAMPLES": "2", prefix + "AUTOTUNE_STEPS_PER_SAMPLE": "3",
           ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES" if horovod_names
            else "HVDLITE_AUTOTUNE_MAX_SAMPLES"): "6"}
    result, bodies = run(np_, env)  # samples of at least the default 0.25 s
    tried = check_agreement_and_log(result, bodies, log, bound=6)
    assert len(tried) == 6  # the grid is larger than the bound
    _, rows = read_log(log)
    assert sum(row[0] == "warmup" for row in rows) == 2
    # The knobs did change under the allreduces (whose results were all right).
    assert max(len(b["seen"]) for b in bodies) >= 2


def test_the_search_ends_by_itself_and_chunk_sizes_stay_correct(tmp_path):
    log = str(tmp_path / "autotune.csv")
    # Samples of 24 cycles that moved data: under the 1 MiB threshold a job step takes 7-10
    # cycles, so a sample spans about 3 steps and at least one runs wholly under one trial's
    # knobs (counters_by_knob). With 12, a trial of 1 MiB sometimes straddled two steps and
    # left none (seen in CI).
    env = quick_env(log, HVDLITE_AUTOTUNE_WARMUP_SAMPLES="1", HVDLITE_AUTOTUNE_MAX_SAMPLES="50",
                    HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE="24")
    result, bodies = run(3, env)
    tried = check_agreement_and_log(result, bodies, log, bound=50)
    assert len(tried) < 50, "a search over a small grid should end before the bound"
    # Every grid value of every knob was tried once the search ran a full pass.
    assert {k[2] for k in tried} >= {1 << 16, 1 << 17, 1 << 18, 1 << 19}
    assert {k[1] for k in tried} >= {0.5, 1.0, 2.0, 5.0}
    # The fusion threshold tried changed what ran: the 24 small tensors (3.09 MiB of
    # float32) need at least 4 collectives under 1 MiB, plus the 2 large ones: 6 a step
    # at least, every step. Under 128 MiB they can go in one (how many depends on how
    # the submissions fall into cycles): the best step needs fewer than under 1 MiB.
    by_fusion = counters_by_knob(bodies, "fusion_threshold")
    seen = {k: sorted({s["collectives"] for s in v}) for k, v in by_fusion.items()}
    assert by_fusion.get(1 * MIB) and by_fusion.get(128 * MIB), seen
    assert min(seen[1 * MIB]) >= 6 and min(seen[128 * MIB]) < min(seen[1 * MIB]), seen


def test_knobs_the_user_set_stay_as_set(tmp_path):
    log = str(tmp_path / "autotune.csv")
    env = quick_env(log, HVDLITE_FUSION_THRESHOLD=str(8 * MIB), HVDLITE_CYCLE_TIME="2.5")
    result, bodies = run(2, env)
    _, rows = read_log(log)
    for body in bodies:
        assert body["wrong"] == []
        assert {(k[0], k[1]) for k in body["seen"]} == {(8 * MIB, 2.5)}
    assert {(int(row[1]), float(row[2])) for row in rows} == {(8 * MIB, 2.5)}
    assert len({row[3] for row in rows}) > 1  # the chunk size is still tuned


def test_autotune_off_leaves_the_defaults_and_writes_no_log(tmp_path):
    log = str(tmp_path / "autotune.csv")
    result, bodies = run(2, {"HVDLITE_AUTOTUNE": None, "HOROVOD_AUTOTUNE": None,
                             "HVDLITE_AUTOTUNE_LOG": log}, max_steps=8)
    for body in bodies:
        assert body["wrong"] == []
        assert body["steps"] == 8 and not body["settled"]
        assert body["seen"] == [[DEFAULTS[k] for k in KNOBS]]
        assert not body["state"]["enabled"] and body["state"]["trials"] == 0
    assert not os.path.exists(log)
    # Values set by hand are what the core reports (and uses) with autotune off.
    _, bodies = run(2, {"HVDLITE_FUSION_THRESHOLD": str(4 * MIB), "HVDLITE_CYCLE_TIME": "3"},
                    max_steps=3)
    for body in bodies:
        assert body["seen"] == [[4 * MIB, 3.0, DEFAULTS["shm_chunk_bytes"], True]]


def test_autotune_on_some_ranks_only_fails_init_on_every_rank():
    script = """
        import os
        if os.environ["HVDLITE_RANK"] == "0":
            os.environ["HVDLITE_AUTOTUNE"] = "1"
        import hvdlite as hvd
        try:
            hvd.init()
        except hvd.errors.HvdliteError as e:
            print("REFUSED", e)
    """
    result = run_job(2, script, env={"HVDLITE_AUTOTUNE": None, "HOROVOD_AUTOTUNE": None})
    for r in range(2):
        out = "\n".join(result.rank_stdout.get(r, []))
        assert "REFUSED" in out and "HVDLITE_AUTOTUNE must be the same on every rank" in out, \
            describe(result)


def test_a_log_rank_0_cannot_write_fails_init_on_every_rank(tmp_path):
    script = """
        import hvdlite as hvd
        try:
            hvd.init()
        except hvd.errors.HvdliteError as e:
            print("REFUSED", e)
    """
    log = str(tmp_path / "missing-dir" / "autotune.csv")
    result = run_job(2, script, env={"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_LOG": log})
    assert "cannot be opened" in "\n".join(result.rank_stdout.get(0, [])), describe(result)
    assert "HVDLITE_AUTOTUNE_LOG" in "\n".join(result.rank_stdout.get(1, [])), describe(result)


def test_hierarchical_allreduce_is_switched_alike_on_every_rank(tmp_path):
    # 2 "hosts" x 2 ranks, placed alternately: the hierarchy exists, so its on/off is a
    # knob; the search is bounded to reach it (fusion 4 values, cycle 3, chunk 3, then it).
    log = str(tmp_path / "autotune.csv")
    env = quick_env(log, HVDLITE_AUTOTUNE_MAX_SAMPLES="13")
    result, bodies = run(4, env, layout="ABAB", timeout=420)
    tried = check_agreement_and_log(result, bodies, log, bound=13)
    assert {k[3] for k in tried} == {True, False}, tried
    for body in bodies:
        assert body["stats"]["hierarchical_collectives"] > 0


def test_the_hierarchical_setting_tried_changes_what_runs(tmp_path):
    # As above, with fusion and cycle time fixed (set by hand) so the search reaches
    # hierarchical off within a few trials, and samples long enough (60 loop steps) that
    # some of the job's steps run wholly under it: then no collective of theirs is
    # hierarchical, and every collective of a step under "on" is.
    log = str(tmp_path / "autotune.csv")
    env = quick_env(log, HVDLITE_AUTOTUNE_MAX_SAMPLES="8", HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE="60",
                    HVDLITE_FUSION_THRESHOLD=str(128 * MIB), HVDLITE_CYCLE_TIME="1")
    result, bodies = run(4, env, layout="ABAB", timeout=420)
    tried = check_agreement_and_log(result, bodies, log, bound=8)
    assert {k[3] for k in tried} == {True, False}, tried
    by_setting = counters_by_knob(bodies, "hierarchical")
    assert by_setting.get(True) and by_setting.get(False), sorted(by_setting)
    assert all(step["hierarchical"] == 0 for step in by_setting[False]), by_setting[False]
    assert all(step["hierarchical"] == step["collectives"] > 0 for step in by_setting[True]), \
        by_setting[True]
