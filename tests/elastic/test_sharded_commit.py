"""Elastic commits of a sharded optimizer (hvdlite/torch/sharded_commit.py) without a
driver or a death: which rank keeps which copy and which commit a new world takes (no
job), then a 3-rank world that commits, trains on and restores, and a 2-rank world that
re-shards its commit with one "host" lost (stage 1 and stage 2 in each job).

The jobs stand in for the elastic driver with its variables (job id, generation, state
directory) and call the state's world entry themselves; ranks 0 and 2 of the 3-rank world
claim host "h0", rank 1 "h1", so that each commit also copies parts across "hosts" and
deleting rank 1's files is what losing h1 leaves on the disk.
"""
import json
import os
import shutil

import pytest

from harness import describe, run_job

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("native")]


# -- no job ------------------------------------------------------------------------------

def test_each_part_is_copied_to_a_rank_on_the_next_host():
    from hvdlite.torch.sharded_commit import holders

    assert holders(["a", "a", "a"]) == [None, None, None]
    assert holders(["a", "b", "a"]) == [1, 0, 1]
    assert holders(["a", "a", "b", "b"]) == [2, 3, 0, 1]  # one copy each
    assert holders(["a", "b", "c", "a", "b", "c"]) == [1, 2, 0, 4, 5, 3]


def test_what_a_commit_cannot_keep_is_refused_by_name():
    from types import SimpleNamespace

    from hvdlite.torch.sharded_commit import stage_of

    everyone = SimpleNamespace(process_set_id=0)
    assert stage_of(None) == 0 and stage_of(SimpleNamespace(shard=2, process_set=everyone)) == 2
    with pytest.raises(ValueError, match="shard=1 and shard=2; this one has shard=3"):
        stage_of(SimpleNamespace(shard=3, process_set=everyone))
    with pytest.raises(ValueError, match="over the global process set"):
        stage_of(SimpleNamespace(shard=1, process_set=SimpleNamespace(process_set_id=1)))


def test_a_kept_previous_commit_outlives_the_new_one_until_dropped(tmp_path):
    from hvdlite.elastic.store import CommitStore

    store = CommitStore(str(tmp_path), generation=0, rank=1)
    for commit_id in (1, 2):
        store.write(lambda f, c=commit_id: f.write(b"%d" % c), commit_id, keep_previous=True)
    # A death now (another rank not done writing 2) leaves commit 1 whole on the disk.
    assert [entry[0] for entry in store.files()] == [1, 2]
    store.drop_previous()
    assert [entry[0] for entry in store.files()] == [2]
    store.write(lambda f: f.write(b"3"), 3)  # without keep_previous: the old one goes now
    assert [entry[0] for entry in store.files()] == [3]


def _file(host, reader, commit_id, rank, world, parts):
    sections = [("shared", 1)] + [(p, 1) for p in parts]
    manifest = {"world": world, "rank": rank, "shard": 2, "sections": sections}
    return reader, host, (commit_id, f"/s/c{commit_id}-r{rank}", manifest, 0)


def _listings(files, ranks):
    listings = [(f"host{r}", []) for r in range(ranks)]
    for reader, host, entry in files:
        listings[reader] = (host, listings[reader][1] + [entry])
    return listings


def test_the_new_world_takes_the_newest_whole_commit_and_names_what_is_missing():
    from hvdlite.torch.sharded_commit import plan_handover

    # Commit 5 of 3 ranks on two hosts (copies 0->1, 1->0, 2->1); h1 (rank 1's) is lost:
    # part 1 comes from rank 0's copy.
    files = [_file("h0", 0, 5, 0, 3, [0, 1]), _file("h0", 0, 5, 2, 3, [2]),
             _file("h0", 1, 5, 0, 3, [0, 1]), _file("h0", 1, 5, 2, 3, [2])]
    plan = plan_handover(_listings(files, 2))
    assert plan.commit_id == 5 and plan.world == 3 and not plan.skipped
    assert [s.path for s in plan.parts] == ["/s/c5-r0", "/s/c5-r0", "/s/c5-r2"]
    assert {s.reader for s in plan.parts} == {0}  # the first rank that sees the file

    # Commit 6 lacks rank 2's part (it died writing it): commit 5, whole, is taken.
    files = [_file("h0", 0, 6, 0, 3, [0]), _file("h0", 0, 6, 1, 3, [1]),
             _file("h0", 0, 5, 0, 3, [0]), _file("h0", 0, 5, 1, 3, [1]),
             _file("h0", 0, 5, 2, 3, [2])]
    plan = plan_handover(_listings(files, 2))
    assert plan.commit_id == 5 and plan.skipped == [(6, [2])]

    # Part 1 is in no file: the error names it.
    files = [_file("h0", 0, 5, 0, 3, [0]), _file("h0", 0, 5, 2, 3, [2])]
    with pytest.raises(RuntimeError, match=r"commit 5: parts of old rank\(s\) \[1\] missing"):
        plan_handover(_listings(files, 2))


# -- a 3-rank world commits, a 2-rank world re-shards --------------------------------------

PRELUDE = r'''
import json, os, sys
import torch
import hvdlite.torch as hvd
from hvdlite.elastic import protocol
from hvdlite.torch import sharded_commit

torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
base = sys.argv[1]
failures = []
sharded_commit.host_name = lambda: "h1" if size == 3 and rank == 1 else "h0"


def make(stage, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), shard=stage)
    return model, opt


def train(model, opt, steps, first):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * size, 6, generator=g)[rank::size]
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()


def whole(model, opt):
    """The model and the consolidated optimizer state, on rank 0 (None elsewhere)."""
    opt.consolidate_state_dict(to=0)
    if rank != 0:
        return None
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in e.items()}
                      for i, e in opt.state_dict()["state"].items()}}


def differences(got, want):
    if not want["model"] or not want["state"]:  # a comparison of nothing proves nothing
        return ["nothing to compare: the model or the optimizer state is empty"]
    out = [k for k in want["model"] if not torch.equal(got["model"][k], want["model"][k])]
    if sorted(got["state"]) != sorted(want["state"]):
        return out + [f"state keys {sorted(got['state'])} vs {sorted(want['state'])}"]
    for i, entries in want["state"].items():
        for k, v in entries.items():
            g = got["state"][i][k]
            if not (torch.equal(g, v) if torch.is_tensor(v) else g == v):
                out.append(f"state {i}.{k}")
    return out


def world(stage, directory, generation):
    os.environ[protocol.ENV_JOB] = f"s{stage}"
    os.environ[protocol.ENV_GENERATION] = str(generation)
    os.environ[protocol.ENV_STATE_DIR] = directory
'''

COMMIT = PRELUDE + r'''
# Outside an elastic job (plain hvdliterun): the commit stays in process memory.
model, opt = make(2, 100 + rank)
state = hvd.elastic.TorchState(model, opt)
state._enter_world()
train(model, opt, 2, 0)
state.commit()
committed = whole(model, opt)
train(model, opt, 1, 2)
state.restore()
back = whole(model, opt)
if rank == 0:
    failures += [f"in memory, restore: {d}" for d in differences(back, committed)]

for stage in (1, 2):
    world(stage, base, 0)
    model, opt = make(stage, 100 + rank)  # different on each rank: the sync must fix it
    state = hvd.elastic.TorchState(model, opt, step=0)
    state._enter_world()  # what hvd.elastic.run does first
    train(model, opt, 3, 0)
    state.step = 3
    state.commit()
    committed = whole(model, opt)
    train(model, opt, 2, 3)
    state.step = 5
    moved = whole(model, opt)
    state.restore()
    back = whole(model, opt)
    if rank == 0:
        torch.save(committed, os.path.join(base, f"want-s{stage}.pt"))
        if not differences(moved, committed):
            failures.append(f"stage {stage}: training after the commit changed nothing")
        failures += [f"stage {stage} restore: {d}" for d in differences(back, committed)]
    if state.step != 3:
        failures.append(f"stage {stage} restore: step {state.step}")
print("HVDLITE_RESULT", json.dumps({"failures": failures}), flush=True)
'''

RESHARD = PRELUDE + r'''
lost = sys.argv[2]
for stage in (1, 2):
    # Both copies of rank 1's part gone (its own file and its holder's, rank 0's, which
    # had rank 0's own part too): refused, by name.
    world(stage, lost, 1)
    model, opt = make(stage, 7)
    try:
        hvd.elastic.TorchState(model, opt, step=0)._enter_world()
        failures.append(f"stage {stage}: a commit without a part was taken")
    except RuntimeError as e:
        if "parts of old rank(s) [0, 1] missing" not in str(e):
            failures.append(f"stage {stage}: {e}")
    # One copy of it left (host h1 lost): the commit, re-sharded for 2 ranks.
    world(stage, base, 1)
    model, opt = make(stage, 7)
    state = hvd.elastic.TorchState(model, opt, step=0)
    state._enter_world()
    if state.step != 3:
        failures.append(f"stage {stage}: step {state.step} after the handover")
    held = sum(b - a for a, b in opt.local_state_dict()["spans"].values())
    if not 0 < held < sum(p.numel() for p in model.parameters()):  # a part, not the whole
        failures.append(f"stage {stage}: this rank holds the state of {held} elements")
    got = whole(model, opt)
    if rank == 0:
        want = torch.load(os.path.join(base, f"want-s{stage}.pt"))
        failures += [f"stage {stage} handover: {d}" for d in differences(got, want)]
    train(model, opt, 1, 3)  # and it trains on
print("HVDLITE_RESULT", json.dumps({"failures": failures}), flush=True)
'''


def _failures(result, np):
    assert result.returncode == 0, describe(result)
    got = {rank: values[-1]["failures"] for rank, values in result.results.items()}
    assert sorted(got) == list(range(np)), describe(result)
    assert not any(got.values()), got


def test_a_commit_restores_bit_for_bit_and_reshards_from_3_to_2_ranks_after_a_host_loss(tmp_path):
    base = tmp_path / "state"
    base.mkdir()
    _failures(run_job(3, COMMIT, args=[base], timeout=120), 3)
    files = {stage: sorted(os.listdir(base / f"hvdlite-elastic-s{stage}")) for stage in (1, 2)}
    for stage, names in files.items():  # one file per rank: the previous commit went
        assert [n.split("-")[-1] for n in names] == ["r0.state", "r1.state", "r2.state"], names
    lost = tmp_path / "lost"
    shutil.copytree(base, lost)
    for stage in (1, 2):
        for name in files[stage]:
            if name.endswith("-r1.state"):  # host h1
                os.remove(base / f"hvdlite-elastic-s{stage}" / name)
            if not name.endswith("-r2.state"):  # h1, and rank 0 that kept h1's copy
                os.remove(lost / f"hvdlite-elastic-s{stage}" / name)
    _failures(run_job(2, RESHARD, args=[base, lost], timeout=120), 2)
    # The new world's commit replaced the old world's files.
    for stage in (1, 2):
        names = sorted(os.listdir(base / f"hvdlite-elastic-s{stage}"))
        assert [n.split("-", 2)[1] for n in names] == ["g1", "g1"], names
