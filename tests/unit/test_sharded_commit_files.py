"""A sharded optimizer's elastic commit in one process (a job of one, its store set by
hand as ``hvd.elastic.run`` sets it in a driver's world): the previous commit file stays
until every rank has written the new one, so a peer's death in between leaves it whole,
and a commit restores bit for bit from its file."""
import pytest
import torch


def _copy(model, optimizer):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in e.items()}
             for i, e in optimizer.local_state_dict()["state"].items()})


@pytest.mark.parametrize("shard", [1, 2])
def test_a_commit_cut_short_keeps_the_previous_and_restore_is_bit_for_bit(
        hvd, tmp_path, monkeypatch, shard):
    import hvdlite.torch as hvdt
    from hvdlite import ops
    from hvdlite.elastic.store import CommitStore
    from hvdlite.errors import HorovodInternalError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    optimizer = hvdt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(),
                                          shard=shard)

    def step():
        optimizer.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()

    state = hvdt.elastic.TorchState(model, optimizer, step=0)
    state._store = CommitStore(str(tmp_path), generation=0, rank=0)
    step()
    state.commit()
    committed = _copy(model, optimizer)
    assert [entry[0] for entry in state._store.files()] == [state.commit_id]

    def peer_died(*args, **kwargs):
        raise HorovodInternalError("a peer died")

    step()
    with monkeypatch.context() as patch:
        patch.setattr(ops, "allreduce", peer_died)  # the barrier after the write
        with pytest.raises(HorovodInternalError):
            state.commit()
    # Both: the new one (this rank's part of it) and the previous, whole on every rank.
    ids = [entry[0] for entry in state._store.files()]
    assert ids == [state.commit_id - 1, state.commit_id], ids

    state._store.path, state._commit_id = state._store.files()[0][3], ids[0]
    state.restore()  # from the previous commit's file
    model_now, optimizer_now = _copy(model, optimizer)
    assert all(torch.equal(model_now[k], v) for k, v in committed[0].items())
    assert optimizer_now.keys() == committed[1].keys()
    for index, entries in committed[1].items():
        assert all(torch.equal(optimizer_now[index][k], v) for k, v in entries.items())

    state.commit()  # a whole commit: the older files go
    assert [entry[0] for entry in state._store.files()] == [ids[0] + 1]
