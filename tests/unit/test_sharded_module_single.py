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


class _Mixed(torch.nn.Module):
    """A float64 layer and a float32 scale that the first pass does not use."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x, use_scale):
        h = self.lin(x)
        return h * self.scale.double() if use_scale else h


class _TwoDtypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.block = _Mixed()

    def forward(self, x, use_scale):
        return self.block(x, use_scale)


def test_accumulated_passes_count_a_group_once_when_another_missed_a_pass(hvd):
    plain, net = _TwoDtypes(), _TwoDtypes()
    sm = hvd.ShardedModule(net, blocks=[net.block])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(sm.parameters(), lr=1.0), shard=3,
                                   named_parameters=sm.named_parameters(),
                                   backward_passes_per_step=2)
    x = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for use_scale in (False, True):
        plain(x, use_scale).sum().backward()
        sm(x, use_scale).sum().backward()
    opt.synchronize()
    grads = {p.dtype: p.grad for p in sm.parameters()}
    want = torch.cat([plain.block.lin.weight.grad.flatten(), plain.block.lin.bias.grad])
    torch.testing.assert_close(grads[torch.float64], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[torch.float32], plain.block.scale.grad)


class _Prompt(torch.nn.Module):
    """Learned prompt tokens: the output is a view of the parameter."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(1, 8))

    def forward(self, x):
        return self.p.expand(x.shape[0], -1)


class _Prompted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.prompt = _Prompt()
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.lin(self.frozen(x + self.prompt(x)))


def test_outputs_viewing_parameters_and_frozen_blocks(hvd):
    plain, net = _Prompted(), _Prompted()
    sm = hvd.ShardedModule(net, blocks=[net.prompt, net.frozen, net.lin])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the prompt's output outlives the release of its buffer
        torch.testing.assert_close(sm(x), plain(x), rtol=0, atol=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(sm.parameters(), lr=1.0), shard=3,
                                   named_parameters=sm.named_parameters())
    sm(x).sum().backward()
    plain(x).sum().backward()
    # The frozen block has no gradient hook; its backward was over before the prompt's.
    assert [b.name for b in sm._blocks if b.gathered] == [], sm.gathered_bytes()
    opt.synchronize()
    prompt, frozen, lin = sm.pieces
    torch.testing.assert_close(prompt.grad, plain.prompt.p.grad.flatten())
    assert frozen.grad is None
    torch.testing.assert_close(lin.grad, torch.cat([plain.lin.weight.grad.flatten(),
                                                    plain.lin.bias.grad]))


def test_a_parameter_used_outside_its_block_is_refused(hvd):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Linear(4, 4, bias=False)
            self.mid = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 4, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.mid(self.emb(x)))

    tied = Tied()
    with pytest.raises(ValueError, match="'emb' is also 'head.weight', outside that block"):
        hvd.ShardedModule(tied, blocks=[tied.emb, tied.mid])
