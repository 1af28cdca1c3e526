"""Reads the records of scripts/train_elastic.py and checks that a reset lost nothing.

The checks, world by world (a world is one generation of the elastic job):
* every rank of a new world starts from the same state, and that state is bit for bit
  (sha256 of every weight and optimizer tensor) the newest state any rank of the
  previous world that began training saved to host memory: the last commit (a world
  that died while its state was handed over began nothing and saved nothing);
* each rank's trained steps run from the world's start step on, one after another:
  across the whole job every committed step was trained once, none twice, none skipped;
* in each epoch, the samples of the committed steps cover the dataset: every sample at
  least once, and exactly as many repeats as the padding of the world that finished the
  epoch (the ElasticSampler pads its split to a multiple of the world size).
"""
import collections
import glob
import json
import math
import os
import re


def load(log_dir):
    """Returns {generation: {rank: [records]}}."""
    worlds = collections.defaultdict(dict)
    for path in glob.glob(os.path.join(log_dir, "g*-r*.jsonl")):
        gen, rank = map(int, re.match(r"g(\d+)-r(\d+)\.jsonl", os.path.basename(path)).groups())
        with open(path) as f:
            worlds[gen][rank] = [json.loads(line) for line in f if line.strip()]
    return dict(sorted(worlds.items()))


def _events(records, ev):
    return [r for r in records if r["ev"] == ev]


def _batch(records, step):
    """The "batch" record of ``step`` (logged before the step's forward): what a rank that
    died after its gradients went out, before it logged "trained", trained."""
    found = [r for r in _events(records, "batch") if r["step"] == step]
    assert found, f"no batch record of step {step}"
    return found[-1]


def check(log_dir, samples, epochs):
    """Asserts the properties above; returns a summary dict for the test's own checks."""
    worlds = load(log_dir)
    gens = sorted(worlds)
    assert gens == list(range(len(gens))), f"worlds without records: {gens}"
    starts = {}
    for gen in gens:
        begun = {rank: _events(r, "start") for rank, r in worlds[gen].items()}
        begun = {rank: s[0] for rank, s in begun.items() if s}
        if not begun:
            continue  # a world that died while its state was handed over: it began nothing
        size = next(iter(begun.values()))["size"]
        assert sorted(begun) == list(range(size)), \
            f"world {gen}: ranks {sorted(begun)} started, expected {size}"
        digests = {s["digest"] for s in begun.values()}
        steps = {s["step"] for s in begun.values()}
        assert len(digests) == 1 and len(steps) == 1, \
            f"world {gen}: ranks started from different states: {begun}"
        previous = max(starts) if starts else None
        starts[gen] = next(iter(begun.values()))
        if previous is None:
            assert gen == 0 and starts[gen]["step"] == 0
            continue
        saved = [s for r in worlds[previous].values() for s in _events(r, "saved")]
        newest = max(s["step"] for s in saved)
        assert starts[gen]["step"] == newest, \
            f"world {gen} started at step {starts[gen]['step']}, but world {previous} " \
            f"saved step {newest}"
        of_newest = {s["digest"] for s in saved if s["step"] == newest}
        assert of_newest == {starts[gen]["digest"]}, \
            f"world {gen} started from a state other than the last commit (step {newest}): " \
            f"{starts[gen]['digest'][:12]} vs {sorted(d[:12] for d in of_newest)}"

    # Steps: world g trains steps [start_g, start_{g+1}) for good; later ones were lost
    # with the world and trained again by the next.
    per_epoch = collections.defaultdict(collections.Counter)  # epoch -> sample -> times
    final_world = {}
    began = sorted(starts)
    for gen, later in zip(began, began[1:] + [None]):
        begin = starts[gen]["step"]
        end = starts[later]["step"] if later is not None else None
        for rank, records in worlds[gen].items():
            trained = [t for t in _events(records, "trained") if end is None or t["step"] < end]
            got = [t["step"] for t in trained]
            if end is not None and rank < starts[gen]["size"]:
                want = list(range(begin, end))
                # A rank that died after its gradients went out but before it logged the
                # step has not recorded the last committed step.
                assert got == want or got == want[:-1], \
                    f"world {gen} rank {rank}: trained steps {got}, expected {want}"
                if got != want:  # the last one: its gradients of that step were in the commit
                    trained.append(_batch(records, want[-1]))
            else:
                assert got == list(range(begin, begin + len(got))), \
                    f"world {gen} rank {rank}: trained steps {got} are not consecutive from {begin}"
            for t in trained:
                final_world[t["epoch"]] = gen
                per_epoch[t["epoch"]].update(t["indices"])
    for epoch in range(epochs):
        counts = per_epoch[epoch]
        missing = sorted(set(range(samples)) - set(counts))
        assert not missing, f"epoch {epoch}: samples never trained: {missing}"
        gen = final_world[epoch]
        start = starts[gen]
        remaining = samples - start["processed"] if start["epoch"] == epoch else samples
        size = start["size"]
        pad = math.ceil(remaining / size) * size - remaining
        repeats = sum(c - 1 for c in counts.values())
        assert repeats == pad, \
            f"epoch {epoch}: {repeats} repeated samples, expected the {pad} of the padding " \
            f"({remaining} samples over {size} ranks); counts {dict(counts)}"
    done = [d for r in worlds[began[-1]].values() for d in _events(r, "done")]
    return {"worlds": [starts[g]["size"] for g in began], "starts": starts, "done": done}


def committed_batches(log_dir, summary):
    """The committed steps' batches, in step order: per step, each rank's sample indices
    (rank order) in the world that trained it for good; for a one-process replay.

    Args:
        summary: ``check``'s result for the same records.
    """
    worlds = load(log_dir)
    starts = summary["starts"]
    began = sorted(starts)
    batches = []
    for gen, later in zip(began, began[1:] + [None]):
        begin = starts[gen]["step"]
        end = starts[later]["step"] if later is not None else None
        per_rank = []
        for rank in range(starts[gen]["size"]):
            records = worlds[gen][rank]
            trained = {t["step"]: t["indices"] for t in _events(records, "trained")}
            if end is not None and end > begin and end - 1 not in trained:
                trained[end - 1] = _batch(records, end - 1)["indices"]  # died after it
            per_rank.append(trained)
        stop = end if end is not None else max(per_rank[0]) + 1
        for step in range(begin, stop):
            missing = [rank for rank, trained in enumerate(per_rank) if step not in trained]
            assert not missing, f"world {gen}: ranks {missing} did not record step {step}"
            batches.append([trained[step] for trained in per_rank])
    return batches
