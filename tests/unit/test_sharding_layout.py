"""How shard=2 cuts the parameters, in one process: buckets in backward's order, one
dtype each; near-equal contiguous pieces as a reduce-scatter splits them; and on a job of
one the sharded optimizer steps like the wrapped one."""
import pytest
import torch

from hvdlite.torch.sharding import buckets, piece_bounds


@pytest.mark.parametrize("elements, ranks", [(180, 2), (180, 3), (7, 3), (2, 3), (0, 2)])
def test_pieces_are_contiguous_and_near_equal(elements, ranks):
    bounds = piece_bounds(elements, ranks)
    sizes = [bounds[r + 1] - bounds[r] for r in range(ranks)]
    assert bounds[0] == 0 and bounds[-1] == elements
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_buckets_run_backwards_split_by_dtype_and_size():
    p = [torch.zeros(100), torch.zeros(100), torch.zeros(10, dtype=torch.float64),
         torch.zeros(50), torch.zeros(300), torch.zeros(5)]
    units = buckets(p, limit_bytes=1000)  # 250 float32 elements
    order = [[next(i for i, q in enumerate(p) if q is t) for t in unit] for unit in units]
    # From the last parameter: 300 elements (1200 bytes) go alone, 100 + 100 together;
    # the float64 one is alone.
    assert order == [[5], [4], [3], [2], [0, 1]]
    assert all(len({t.dtype for t in unit}) == 1 for unit in units)


def test_one_process_steps_as_the_wrapped_optimizer():
    import hvdlite.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3).double() for _ in range(3)]
    for net in nets[1:]:
        net.load_state_dict(nets[0].state_dict())
    opts = [torch.optim.Adam(nets[0].parameters(), lr=0.1)] + [
        hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.1),
                                 named_parameters=net.named_parameters(), shard=shard)
        for net, shard in zip(nets[1:], (1, 2))]
    x = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(3):
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for net in nets[1:]:
        for p, q in zip(nets[0].parameters(), net.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-12)
