"""hvdlite.torch in one process (rank 0 of 1): dtype mapping, bad input, API surface,
zero-copy results, compression, optimizer wrapping."""
import numpy as np
import pytest

import needs

torch = needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def thvd(hvd):
    """hvdlite.torch on the session's initialized core."""
    import hvdlite.torch

    return hvdlite.torch


def _collectives(thvd):
    """(label, call(tensor, name)) for every tensor collective."""
    return [
        ("allreduce", lambda t, n: thvd.allreduce(t, name=n)),
        ("allreduce_", lambda t, n: thvd.allreduce_(t, name=n)),
        ("allreduce_async", lambda t, n: thvd.allreduce_async(t, name=n)),
        ("allreduce_async_", lambda t, n: thvd.allreduce_async_(t, name=n)),
        ("grouped_allreduce", lambda t, n: thvd.grouped_allreduce([t], name=n)),
        ("grouped_allreduce_", lambda t, n: thvd.grouped_allreduce_([t], name=n)),
        ("allgather", lambda t, n: thvd.allgather(t, name=n)),
        ("allgather_async", lambda t, n: thvd.allgather_async(t, name=n)),
        ("broadcast", lambda t, n: thvd.broadcast(t, 0, name=n)),
        ("broadcast_", lambda t, n: thvd.broadcast_(t, 0, name=n)),
        ("broadcast_async", lambda t, n: thvd.broadcast_async(t, 0, name=n)),
        ("alltoall", lambda t, n: thvd.alltoall(t, name=n)),
        ("reducescatter", lambda t, n: thvd.reducescatter(t, name=n)),
    ]


# -- dtype mapping ---------------------------------------------------------------------


def test_every_mapped_dtype_uses_the_core_table(thvd):
    from hvdlite import dtypes
    from hvdlite.torch import mpi_ops

    # Every core type but uint16, which horovod.torch refuses too.
    assert set(mpi_ops.TORCH_DTYPE_NAMES.values()) == set(dtypes.SUPPORTED) - {"uint16"}
    for torch_dtype, name in mpi_ops.TORCH_DTYPE_NAMES.items():
        assert mpi_ops.torch_dtype_name(torch_dtype) == name
        assert mpi_ops.native_dtype_code(torch_dtype) == dtypes.native_code(name)
        # The element sizes agree, so the core reads the tensor's memory right.
        assert torch.empty(0, dtype=torch_dtype).element_size() == \
            dtypes.numpy_dtype(name).itemsize


@pytest.mark.parametrize("dtype", sorted(
    ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int16", "int8", "uint8",
     "bool"]))
def test_each_dtype_round_trips(thvd, dtype):
    torch_dtype = getattr(torch, dtype)
    x = (torch.arange(12) % 3).to(torch_dtype).reshape(3, 4)
    op = thvd.Max if torch_dtype == torch.bool else thvd.Sum
    assert torch.equal(thvd.allreduce(x, name=f"rt.ar.{dtype}", op=op), x)
    gathered = thvd.allgather(x, name=f"rt.ag.{dtype}")
    assert gathered.dtype == torch_dtype and torch.equal(gathered, x)
    received = thvd.alltoall(x, name=f"rt.a2a.{dtype}")
    assert received.dtype == torch_dtype and torch.equal(received, x)
    assert torch.equal(thvd.broadcast(x, 0, name=f"rt.bc.{dtype}"), x)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16,
                                   torch.uint32, torch.float8_e4m3fn], ids=str)
def test_unsupported_dtype_is_refused_naming_the_tensor(thvd, dtype):
    x = torch.zeros(2, 2, dtype=dtype)
    for label, call in _collectives(thvd):
        with pytest.raises(thvd.InvalidArgumentError) as info:
            call(x, f"bad.{label}")
        message = str(info.value)
        assert f"bad.{label}" in message and "unsupported dtype" in message, message
        assert "torch.float32" in message, message


# -- bad input -------------------------------------------------------------------------


def test_non_contiguous_is_refused_with_the_fix(thvd):
    x = torch.zeros(4, 6)[:, ::2]
    for label, call in _collectives(thvd):
        with pytest.raises(thvd.InvalidArgumentError, match=f"nc.{label}.*contiguous"):
            call(x, f"nc.{label}")
    thvd.allreduce(x.contiguous(), name="nc.fixed")


def test_lazily_negated_view_is_refused_with_the_fix(thvd):
    # Its memory holds the values before negation: taken by pointer, the core would
    # reduce the wrong numbers.
    x = torch._neg_view(torch.arange(4.0))
    assert x.is_neg()
    for label, call in _collectives(thvd):
        with pytest.raises(thvd.InvalidArgumentError, match=f"neg.{label}.*resolve_neg"):
            call(x, f"neg.{label}")
    assert torch.equal(thvd.allreduce(x.resolve_neg(), name="neg.fixed"), -torch.arange(4.0))


def test_tensors_neither_on_the_cpu_nor_on_a_cuda_gpu_are_refused(thvd):
    # A CPU build of torch cannot make CUDA tensors (tests/gpu runs those on a GPU);
    # "meta" stands for every other device.
    x = torch.zeros(2, device="meta")
    for label, call in _collectives(thvd):
        with pytest.raises(thvd.InvalidArgumentError, match="takes CPU and CUDA tensors"):
            call(x, f"dev.{label}")


def test_sparse_and_non_tensors_are_refused(thvd):
    sparse = torch.zeros(3, 3).to_sparse()
    with pytest.raises(thvd.InvalidArgumentError, match="layout"):
        thvd.allreduce(sparse, name="sparse")
    with pytest.raises(thvd.InvalidArgumentError, match="must be a torch.Tensor"):
        thvd.allreduce(np.zeros(2, np.float32), name="numpy")


def test_bad_ops_roots_splits_and_scales(thvd):
    x = torch.ones(4, 2)
    with pytest.raises(thvd.InvalidArgumentError, match="op"):
        thvd.allreduce(x, name="badop", op=17)
    with pytest.raises(thvd.InvalidArgumentError, match="bool tensors support only Min"):
        thvd.allreduce(torch.ones(2, dtype=torch.bool), name="boolsum", op=thvd.Sum)
    with pytest.raises(thvd.InvalidArgumentError, match="root_rank 1 is out of range"):
        thvd.broadcast(x, 1, name="badroot")
    with pytest.raises(thvd.InvalidArgumentError, match="splits"):
        thvd.alltoall(x, splits=[3], name="badsplits")
    with pytest.raises(thvd.InvalidArgumentError, match="prescale_factor"):
        thvd.allreduce(x, name="badscale", prescale_factor="2")
    with pytest.raises(thvd.InvalidArgumentError, match="at least 1 dimension"):
        thvd.allgather(torch.tensor(1.0), name="scalar.gather")
    with pytest.raises(ValueError, match="supersedes"):
        thvd.allreduce(x, average=True, op=thvd.Sum)
    with pytest.raises(ValueError, match="list of ranks"):
        thvd.ProcessSet(3)
    with pytest.raises(thvd.InvalidArgumentError, match="not registered"):
        thvd.allreduce(x, process_set=thvd.ProcessSet([0]))


def test_a_repeated_call_is_checked_like_a_first_one(thvd):
    # A call that repeats a kept one (hvdlite.torch.repeats: same name, dtype, shape and
    # arguments) skips the first call's path; any tensor or argument that path refuses
    # must still be refused under the same name.
    from hvdlite.torch import repeats
    good = torch.arange(12.0).reshape(6, 2)
    bad = {
        "contiguous": torch.zeros(6, 4)[:, ::2],
        "resolve_neg": torch._neg_view(torch.arange(12.0).reshape(6, 2)),
        "layout": torch.zeros(6, 2).to_sparse(),
        "CPU and CUDA": torch.zeros(6, 2, device="meta"),
    }
    calls = {
        "allreduce": lambda t, **kw: thvd.allreduce(t, name="again", **kw),
        "allreduce_": lambda t, **kw: thvd.allreduce_(t, name="again_", **kw),
        "broadcast": lambda t, root=0: thvd.broadcast(t, root, name="again.bc"),
        "broadcast_": lambda t, root=0: thvd.broadcast_(t, root, name="again.bc_"),
        "allgather": lambda t: thvd.allgather(t, name="again.ag"),
        "alltoall": lambda t: thvd.alltoall(t, name="again.a2a"),
        "reducescatter": lambda t, **kw: thvd.reducescatter(t, name="again.rs", **kw),
    }
    for label, call in calls.items():
        for _ in range(2):
            assert torch.equal(call(good.clone()), good), label
        for needle, tensor in bad.items():
            with pytest.raises(thvd.InvalidArgumentError, match=needle):
                call(tensor)
        assert torch.equal(call(good.clone()), good), label
    assert all(repeats._kept[kind] for kind in repeats._kept)
    for label in ("allreduce", "allreduce_", "reducescatter"):
        with pytest.raises(thvd.InvalidArgumentError, match="op True"):
            calls[label](good.clone(), op=True)
        with pytest.raises(thvd.InvalidArgumentError, match="prescale_factor"):
            calls[label](good.clone(), prescale_factor=True)
    for label in ("broadcast", "broadcast_"):
        for root in (False, 0.0, torch.tensor(0)):  # equal to 0, refused as ranks
            with pytest.raises(thvd.InvalidArgumentError, match="root_rank"):
                calls[label](good.clone(), root=root)
    with pytest.raises(thvd.InvalidArgumentError, match="op 1.0"):
        calls["allreduce"](good.clone(), op=1.0)
    for _ in range(2):  # None: the global set
        assert torch.equal(thvd.allreduce(good, name="again.none", process_set=None), good)
        assert torch.equal(thvd.broadcast(good, 0, name="again.none", process_set=None), good)
    # Another dtype or shape under the name: checked and run as such.
    assert torch.equal(thvd.allreduce(good.double(), name="again"), good.double())
    # Adasum runs as hvdlite.adasum's ops, not one core allreduce: never kept.
    for _ in range(2):
        assert torch.equal(thvd.allreduce(good.clone(), name="again.ad", op=thvd.Adasum), good)
        assert torch.equal(thvd.allreduce_(good.clone(), name="again.ad_", op=thvd.Adasum), good)
    # 0.0 == -0.0, yet the sign shows: zero factors are never kept either.
    assert not torch.signbit(thvd.reducescatter(good, name="again.rs0", postscale_factor=0.0)).any()
    assert torch.signbit(thvd.reducescatter(good, name="again.rs0", postscale_factor=-0.0)).all()
    assert torch.equal(thvd.allgather(good.reshape(3, 4), name="again.ag"), good.reshape(3, 4))


def test_grouped_allreduce_is_all_or_nothing(thvd):
    good = torch.ones(2)
    with pytest.raises(thvd.InvalidArgumentError, match="grp.bad.1"):
        thvd.grouped_allreduce([good, torch.zeros(2, dtype=torch.complex64)], name="grp.bad")
    # Nothing was enqueued: the same names are free again.
    out = thvd.grouped_allreduce([good, good.clone()], name="grp.bad")
    assert all(torch.equal(o, good) for o in out)


def test_a_repeated_group_reads_and_writes_each_calls_own_tensors(thvd):
    # A group submitted again under one name reuses what the core reads (the kept
    # structs): each call must still hand over its own buffers, and a change of shape or
    # dtype under the same name must be seen.
    for step in range(4):
        xs = [torch.full((3,), float(step + k)) for k in range(3)]
        outs = thvd.grouped_allreduce(xs, name="grp.repeat", op=thvd.Sum, postscale_factor=2.0)
        assert [o.tolist() for o in outs] == [[2.0 * (step + k)] * 3 for k in range(3)]
        ys = [x.clone() for x in xs]
        assert thvd.grouped_allreduce_(ys, name="grp.repeat_", op=thvd.Sum) == ys
        assert all(torch.equal(y, x) for y, x in zip(ys, xs))
    other = [torch.arange(5, dtype=torch.float64), torch.ones(2, 2, dtype=torch.int32)]
    got = thvd.grouped_allreduce(other, name="grp.repeat", op=thvd.Sum)
    assert [g.dtype for g in got] == [torch.float64, torch.int32]
    assert all(torch.equal(g, o) for g, o in zip(got, other))


# -- semantics in one process ----------------------------------------------------------


def test_in_place_forms_return_and_fill_their_argument(thvd):
    x = torch.arange(6, dtype=torch.float32)
    before = x.data_ptr()
    assert thvd.allreduce_(x, op=thvd.Sum, postscale_factor=2.0) is x
    assert x.data_ptr() == before and torch.equal(x, torch.arange(6.0) * 2)
    y = torch.arange(3.0)
    assert thvd.synchronize(thvd.broadcast_async_(y, 0)) is y


def test_async_handles_poll_and_synchronize(thvd):
    handle = thvd.allreduce_async(torch.ones(3), name="h.async")
    result = thvd.synchronize(handle)
    assert thvd.poll(handle) and torch.equal(result, torch.ones(3))
    assert thvd.synchronize(handle) is result  # a second wait returns the same result


def test_allgather_result_is_zero_copy_and_outlives_the_handle(thvd):
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    handle = thvd.allgather_async(x, name="zc.gather")
    out = thvd.synchronize(handle)
    arr = out.numpy()
    # The tensor views core memory (not x's, not a fresh torch allocation).
    assert out.data_ptr() != x.data_ptr() and arr.base is not None
    del handle
    import gc

    gc.collect()
    assert torch.equal(out, x)  # still valid: the tensor keeps the native buffer
    out.add_(1)
    assert torch.equal(out, x + 1)


def test_zero_size_and_scalar_tensors(thvd):
    empty = torch.empty(0, 3)
    assert thvd.allreduce(empty).shape == (0, 3)
    assert thvd.allgather(empty).shape == (0, 3)
    assert float(thvd.allreduce(torch.tensor(2.5), op=thvd.Sum)) == 2.5


def test_differentiable_ops_in_one_process(thvd):
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    for fn in (lambda t: thvd.allreduce(t), lambda t: thvd.allgather(t),
               lambda t: thvd.broadcast(t, 0), lambda t: thvd.reducescatter(t, op=thvd.Sum),
               lambda t: thvd.alltoall(t)):
        # With one rank every op is the identity: gradcheck can run here.
        assert torch.autograd.gradcheck(fn, (x,))


def test_objects_and_control(thvd):
    assert thvd.broadcast_object({"a": [1, 2]}, root_rank=0) == {"a": [1, 2]}
    assert thvd.allgather_object(lambda: 3)[0]() == 3  # cloudpickle, as Horovod
    thvd.barrier()
    assert thvd.join() == 0


def test_compression_round_trip(thvd):
    x = torch.randn(5)
    for comp, wire in ((thvd.Compression.fp16, torch.float16),
                       (thvd.Compression.bf16, torch.bfloat16)):
        sent, ctx = comp.compress(x)
        assert sent.dtype == wire
        back = comp.decompress(sent, ctx)
        assert back.dtype == torch.float32 and torch.allclose(back, x, rtol=1e-2, atol=1e-2)
        ints = torch.arange(3)
        sent, ctx = comp.compress(ints)
        assert sent is ints and comp.decompress(sent, ctx) is ints
    sent, ctx = thvd.Compression.none.compress(x)
    assert sent is x and thvd.Compression.none.decompress(sent, ctx) is x


def test_horovod_surface_is_there(thvd):
    for name in ("init", "shutdown", "size", "rank", "local_size", "local_rank",
                 "cross_size", "cross_rank", "is_initialized", "Average", "Sum", "Min",
                 "Max", "Product", "allreduce", "allreduce_", "allreduce_async",
                 "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
                 "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
                 "allgather_async", "broadcast", "broadcast_", "broadcast_async",
                 "broadcast_async_", "alltoall", "reducescatter", "synchronize", "poll",
                 "join", "barrier", "broadcast_parameters", "broadcast_optimizer_state",
                 "broadcast_object", "allgather_object", "Compression",
                 "DistributedOptimizer", "mpi_threads_supported", "global_process_set",
                 "nccl_built", "HorovodInternalError"):
        assert hasattr(thvd, name), name
    assert thvd.is_initialized() and thvd.size() == 1 and thvd.rank() == 0


# -- DistributedOptimizer wrapping -------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_wrapped_optimizer_is_still_its_class_and_shares_state(thvd):
    model = _model()
    base = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = thvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    assert opt.param_groups is base.param_groups and opt.state is base.state
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert len(opt.state) == 4
    opt.zero_grad()
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        thvd.DistributedOptimizer(opt)


def test_topk_takes_its_momentum_correction_from_the_wrapped_sgd(thvd):
    def wrap(optimizer, **topk):
        compression = thvd.Compression.topk(0.01, **topk)
        thvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                  compression=compression)
        return compression.momentum

    model = _model()
    params = list(model.parameters())
    assert wrap(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == 0.9
    assert wrap(torch.optim.SGD(params, lr=0.1)) == 0.0
    assert wrap(torch.optim.Adam(params)) == 0.0  # Adam's moments are not SGD's momentum
    assert wrap(torch.optim.SGD(params, lr=0.1, momentum=0.9), momentum=0) == 0.0
    assert wrap(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True), momentum=0) == 0
    with pytest.raises(ValueError, match="Nesterov"):
        wrap(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True))
    with pytest.raises(ValueError, match="must be equal"):
        wrap(torch.optim.SGD(params, lr=0.1, momentum=0.5), momentum=0.9)
    with pytest.raises(ValueError, match="one momentum"):
        wrap(torch.optim.SGD([{"params": params[:1], "momentum": 0.9},
                              {"params": params[1:], "momentum": 0.5}], lr=0.1))


def test_one_process_steps_like_the_plain_optimizer(thvd):
    ref, dist = _model(), _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = thvd.DistributedOptimizer(torch.optim.SGD(dist.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=dist.named_parameters())
    x = torch.randn(5, 3)
    for _ in range(3):
        for m, o in ((ref, ref_opt), (dist, opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for p, q in zip(ref.parameters(), dist.parameters()):
        assert torch.equal(p, q)


def test_optimizer_argument_errors(thvd):
    model = _model()
    named = list(model.named_parameters())
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match="unique"):
        thvd.DistributedOptimizer(sgd(), named_parameters=[named[0], ("0.weight", named[1][1]),
                                                           *named[2:]])
    with pytest.raises(ValueError, match="not in it"):
        thvd.DistributedOptimizer(sgd(), named_parameters=named[:2])
    with pytest.raises(ValueError, match="tuples"):
        thvd.DistributedOptimizer(sgd(), named_parameters=[p for _, p in named])
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        thvd.DistributedOptimizer(sgd(), op=thvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        thvd.DistributedOptimizer(sgd(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="not a parameter"):
        thvd.DistributedOptimizer(sgd(), groups=[[torch.zeros(2, requires_grad=True)]])
    with pytest.raises(ValueError, match="more than one"):
        thvd.DistributedOptimizer(sgd(), groups=[[named[0][1]], [named[0][1]]])


def test_broadcast_helpers_in_one_process(thvd):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    thvd.broadcast_parameters(model.state_dict(), root_rank=0)
    thvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    thvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    with pytest.raises(ValueError, match="invalid params"):
        thvd.broadcast_parameters(3, root_rank=0)
    # A fresh optimizer stays fresh; parameters get zero gradients (None where frozen).
    model[1].bias.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    thvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 0 and opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert model[1].bias.grad is None and not model[0].weight.grad.any()
    with pytest.raises(ValueError, match="LBFGS"):
        thvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)


def test_adasum_optimizer_refuses_a_compression_it_would_ignore(hvd):
    import hvdlite.torch as hvd_torch

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Adasum takes no compression"):
        hvd_torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       op=hvd_torch.Adasum,
                                       compression=hvd_torch.Compression.fp16)
