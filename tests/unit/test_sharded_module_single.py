"""ShardedModule in one process (a job of one: each piece is the whole group): the blocks
it makes, the root's own parameters, two dtypes, a frozen parameter and a block run twice
per forward train as the plain module does; the checkpoint keys are the plain module's;
and what is refused names the remedy. The multi-rank behaviour is in
tests/multirank/test_torch_sharded_module.py."""
import pytest
import torch


class Net(torch.nn.Module):
    """Two dtypes, a parameter of the root itself, a frozen layer, a ModuleList and a
    layer used twice in one forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = torch.nn.Linear(5, 6).double()
        self.mix = torch.nn.ModuleList([torch.nn.Linear(6, 6, bias=False).double(),
                                        torch.nn.LayerNorm(6).float()])
        self.frozen = torch.nn.Linear(6, 6).double().requires_grad_(False)
        self.scale = torch.nn.Parameter(torch.ones(6, dtype=torch.float64))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = self.mix[1](self.mix[0](h).float()).double()
        h = self.frozen(h) * self.scale
        return self.mix[0](h).sum(1)  # mix[0] a second time


@pytest.fixture(scope="module")
def hvd():
    import hvdlite.torch as hvd

    hvd.init()
    return hvd


def _train(net, opt, steps=3):
    for step in range(steps):
        x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("named", [False, True])
def test_trains_as_the_plain_module(hvd, named):
    plain, net = Net(), Net()
    blocks = [net.mix[0], net.inp] if named else None
    sm = hvd.ShardedModule(net, blocks=blocks)
    names = [b.name for b in sm._blocks]
    assert names == (["mix.0", "inp", "root"] if named
                     else ["inp", "mix.0", "mix.1", "frozen", "root"])
    # Named: the root's block holds float64 and float32 parameters (one group each) and
    # the frozen ones (a group that takes no gradient).
    assert len(sm.pieces) == 5
    _train(plain, torch.optim.Adam(plain.parameters(), lr=0.05))
    _train(sm, hvd.DistributedOptimizer(torch.optim.Adam(sm.parameters(), lr=0.05),
                                        named_parameters=sm.named_parameters(), shard=3))
    got = sm.state_dict()
    assert list(got) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
    assert sm.gathered_bytes() == 0 and not list(sm.module.parameters())
    # An ordinary state dict loads back, each piece its part.
    fresh = hvd.ShardedModule(Net(), blocks=None)
    fresh.load_state_dict(plain.state_dict())
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name


def test_refusals_name_the_remedy(hvd):
    net = Net()
    with pytest.raises(ValueError, match="ShardedModule"):
        hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), shard=3)
    sm = hvd.ShardedModule(Net())
    with pytest.raises(ValueError, match="compression"):
        hvd.DistributedOptimizer(torch.optim.SGD(sm.parameters(), lr=0.1), shard=3,
                                 compression=hvd.Compression.fp16)
    tied = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="shared by blocks"):
        hvd.ShardedModule(tied)
    with pytest.raises(RuntimeError, match="missing keys"):
        sm.load_state_dict({})
