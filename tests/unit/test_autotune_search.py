"""Autotune's search alone (KnobSearch through hvdlite_test_knob_search): no MPI, no clocks.

The search is replayed from the start with the scores given so far, so each test drives
it like the tuner does: measure the candidate it names, hand back its score.
"""
import pytest

MIB = 1 << 20
DEFAULT = {"fusion_threshold": 128 * MIB, "cycle_time_ms": 1.0, "hierarchical": True}
FIXED_FUSION, FIXED_CYCLE, FIXED_HIERARCHICAL, NO_SHARED_MEMORY = 1, 2, 4, 8


@pytest.fixture(scope="module")
def core(native):
    from hvdlite._native import ffi, lib

    assert hasattr(lib, "hvdlite_test_knob_search"), "library built without testing.h"
    return ffi, lib


def knobs(entry):
    return (int(entry.fusion_threshold), float(entry.cycle_time_ms), int(entry.shm_chunk_bytes),
            bool(entry.hierarchical))


def search(core, scores, hierarchy=False, fixed=0, max_trials=20):
    """Returns (candidates so far, done, best) after the given scores."""
    ffi, lib = core
    cap = len(scores) + 1
    candidates = ffi.new("hvdlite_autotune_t[]", cap)
    count, done, best = ffi.new("int64_t *"), ffi.new("int32_t *"), ffi.new("hvdlite_autotune_t *")
    status = lib.hvdlite_test_knob_search(int(hierarchy), fixed, max_trials,
                                          ffi.new("double[]", scores), len(scores),
                                          candidates, cap, count, done, best)
    assert status == 0, ffi.string(lib.hvdlite_last_error()).decode()
    return [knobs(candidates[i]) for i in range(count[0])], bool(done[0]), best[0]


def drive(core, objective, **kwargs):
    """Runs the search to its end; returns (trials with their scores, best)."""
    scores = []
    while True:
        candidates, done, best = search(core, scores, **kwargs)
        if done:
            return list(zip(candidates, scores)), best
        scores.append(objective(candidates[-1]))


def separable(target):
    """A score that peaks at `target` and falls with the distance from it in each knob."""
    def score(k):
        fusion, cycle, chunk, hier = k
        return 1000.0 - abs(fusion - target[0]) / MIB - 10 * abs(cycle - target[1]) \
            - abs(chunk - target[2]) / 65536 - 50 * (hier != target[3])
    return score


def test_first_trial_is_the_defaults(core):
    candidates, done, _ = search(core, [])
    assert not done and len(candidates) == 1
    fusion, cycle, chunk, hier = candidates[0]
    assert (fusion, cycle, hier) == (DEFAULT["fusion_threshold"], DEFAULT["cycle_time_ms"], True)
    assert chunk >= 64 * 1024


def test_finds_the_peak_of_a_separable_score(core):
    start = search(core, [])[0][0]
    target = (4 * MIB, 2.0, start[2] // 4, True)
    trials, best = drive(core, separable(target))
    assert knobs(best) == target
    assert len({k for k, _ in trials}) == len(trials), "a configuration was tried twice"


def test_best_is_the_highest_scoring_trial_even_when_scores_are_noise(core):
    import random
    rng = random.Random(7)
    trials, best = drive(core, lambda k: rng.random())
    top = max(trials, key=lambda t: t[1])
    assert knobs(best) == top[0]
    assert best.trials == len(trials)


@pytest.mark.parametrize("bound", [1, 3, 7])
def test_no_more_trials_than_the_bound(core, bound):
    trials, best = drive(core, separable((MIB, 5.0, 65536, True)), max_trials=bound)
    assert len(trials) == bound
    assert knobs(best) in [k for k, _ in trials]


def test_hierarchical_is_searched_only_where_there_is_a_hierarchy(core):
    target = (128 * MIB, 1.0, search(core, [])[0][0][2], False)
    flat, best_flat = drive(core, separable(target), hierarchy=False)
    assert all(k[3] for k, _ in flat) and best_flat.hierarchical
    layered, best = drive(core, separable(target), hierarchy=True)
    assert any(not k[3] for k, _ in layered)
    assert not best.hierarchical


def test_fixed_knobs_stay_as_set(core):
    target = (MIB, 5.0, 65536, False)
    trials, best = drive(core, separable(target), hierarchy=True,
                         fixed=FIXED_FUSION | FIXED_CYCLE | FIXED_HIERARCHICAL)
    assert {(k[0], k[1], k[3]) for k, _ in trials} == {(128 * MIB, 1.0, True)}
    assert len({k[2] for k, _ in trials}) > 1  # the chunk is still tuned
    assert knobs(best)[2] == 65536


def test_the_chunk_is_left_alone_without_shared_memory(core):
    trials, best = drive(core, separable((MIB, 5.0, 65536, True)), fixed=NO_SHARED_MEMORY)
    assert len({k[2] for k, _ in trials}) == 1
    assert len({k[0] for k, _ in trials}) > 1 and len({k[1] for k, _ in trials}) > 1
