"""The compression reducers in one process (rank 0 of 1): round trips and error feedback.

The multi-rank behaviour (every rank the same update, against numpy) is in
tests/multirank/test_compression.py.
"""
import math

import numpy as np
import pytest

import needs

from hvdlite import reducers


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_round_trip_is_within_one_quantum(hvd, bits):
    q = reducers.Quantize(bits, chunk=32, seed=1)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    x[100:132] = 0.0  # a chunk of zeros decodes to zeros
    packed, scales = q.encode(x)
    assert packed.dtype == np.uint8 and packed.size == math.ceil(1000 / 32) * 32 * bits // 8
    back = q.decode(packed, scales)[:x.size]
    quantum = np.repeat(scales / q.levels, 32)[:x.size]
    assert (np.abs(back - x) <= quantum * (1 + 1e-6)).all()
    assert (back[100:132] == 0).all()


def test_quantize_is_unbiased(hvd):
    q = reducers.Quantize(4, chunk=16, seed=2)
    x = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    mean = np.mean([q.decode(*q.encode(x))[:x.size] for _ in range(4000)], axis=0)
    quantum = np.repeat(q.encode(x)[1] / q.levels, 16)
    # The standard error of 4000 draws of a value within one quantum: < quantum / 60.
    assert (np.abs(mean - x) < quantum / 20).all()


def test_topk_keeps_the_rest_for_the_next_step(hvd):
    topk = reducers.TopK(0.25, dense_below=0)
    g1 = np.array([4.0, -1.0, 0.5, -3.0, 0.1, 2.0, 0.0, -0.2], np.float32)
    (u1,) = topk.finish_all([topk.start(["g"], [g1])])[0]
    np.testing.assert_array_equal(u1, [4.0, 0, 0, -3.0, 0, 0, 0, 0])
    np.testing.assert_array_equal(topk.residual("g"), np.float32([0, -1.0, 0.5, 0, 0.1, 2.0, 0, -0.2]))
    g2 = np.zeros(8, np.float32)
    (u2,) = topk.finish_all([topk.start(["g"], [g2])])[0]
    np.testing.assert_array_equal(u2, [0, -1.0, 0, 0, 0, 2.0, 0, 0])
    np.testing.assert_allclose(u1 + u2 + topk.residual("g"), g1 + g2)


def test_topk_momentum_correction_at_ratio_one_hands_back_the_gradient(hvd):
    """Everything sent: the exchanged sum S_t is the velocity u_t = m u_(t-1) + g_t, and
    the update handed to the optimizer, S_t - m S_(t-1), is g_t itself (so an SGD with
    momentum m steps exactly as without compression)."""
    topk = reducers.TopK(1.0, dense_below=0, momentum=0.9)
    rng = np.random.default_rng(5)
    velocity = np.zeros(50)
    for _ in range(4):
        g = rng.standard_normal(50).astype(np.float32)
        (update,) = topk.finish_all([topk.start(["g"], [g])])[0]
        velocity = 0.9 * velocity + g
        np.testing.assert_allclose(update, g, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(topk.velocity("g"), velocity, rtol=1e-5, atol=1e-5)
        assert not topk.residual("g").any()


def test_topk_momentum_factor_masking_zeroes_the_sent_velocity(hvd):
    g = np.array([4.0, -1.0, 0.5, -3.0], np.float32)
    masked = reducers.TopK(0.5, dense_below=0, momentum=0.5, momentum_masking=True)
    kept = reducers.TopK(0.5, dense_below=0, momentum=0.5)
    for topk in (masked, kept):
        (u1,) = topk.finish_all([topk.start(["g"], [g])])[0]
        np.testing.assert_array_equal(u1, [4.0, 0, 0, -3.0])
    np.testing.assert_array_equal(masked.velocity("g"), [0, -1.0, 0.5, 0])
    np.testing.assert_array_equal(kept.velocity("g"), g)
    # Step 2 (g again): masked u = [4, -1.5, 0.75, -3], acc = u + residual [0, -1, .5, 0].
    (u2,) = masked.finish_all([masked.start(["g"], [g])])[0]
    np.testing.assert_allclose(u2, np.float32([4.0, 0, 0, -3.0]) - 0.5 * np.float32(
        [4.0, 0, 0, -3.0]))
    np.testing.assert_allclose(masked.residual("g"), [0, -2.5, 1.25, 0])


def test_topk_warmup_lowers_the_ratio_geometrically(hvd):
    topk = reducers.TopK(0.01, warmup_steps=4)
    ratios = [topk.ratio_at(step) for step in range(6)]
    np.testing.assert_allclose(ratios, [0.25, 0.25 * 0.04 ** 0.25, 0.25 * 0.04 ** 0.5,
                                        0.25 * 0.04 ** 0.75, 0.01, 0.01])
    g = np.random.default_rng(6).standard_normal(2000).astype(np.float32)
    counts = [np.count_nonzero(topk.finish_all([topk.start(["g"], [g])])[0][0])
              for _ in range(5)]
    assert counts == [500, 224, 100, 45, 20]


def test_powersgd_recovers_a_low_rank_gradient(hvd):
    rng = np.random.default_rng(4)
    g = (rng.standard_normal((30, 2)) @ rng.standard_normal((2, 20))).astype(np.float32)
    psgd = reducers.PowerSGD(rank=2)
    updates = [psgd.finish_all([psgd.start(["m"], [g])])[0][0] for _ in range(3)]
    # Rank 2 spans a rank-2 gradient exactly (one power step suffices); error ~ 0.
    np.testing.assert_allclose(updates[-1], g, rtol=1e-3, atol=1e-3)
    assert psgd.residual("m") is not None and np.abs(psgd.residual("m")).max() < 1e-3


def test_topk_sends_small_gradients_whole(hvd):
    topk = reducers.TopK(0.01, dense_below=100)
    small, large = np.arange(99, dtype=np.float32), np.arange(100, dtype=np.float32)
    u_small, u_large = topk.finish_all([topk.start(["s", "l"], [small, large])])[0]
    np.testing.assert_array_equal(u_small, small)
    assert np.count_nonzero(u_large) == 1 and u_large[99] == 99


def test_bad_reducer_arguments_are_refused():
    with pytest.raises(ValueError, match="ratio"):
        reducers.TopK(0)
    with pytest.raises(ValueError, match="bits"):
        reducers.Quantize(3)
    with pytest.raises(ValueError, match="rank"):
        reducers.PowerSGD(0)
    with pytest.raises(ValueError, match="momentum"):
        reducers.TopK(0.1, momentum=1.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        reducers.TopK(0.1, warmup_steps=-1)


def test_compression_names_for_command_lines():
    torch = needs.import_or_skip("torch")  # noqa: F841
    from hvdlite.torch import Compression

    assert Compression.parse("fp16") is Compression.fp16
    assert Compression.parse("none") is Compression.none
    assert Compression.parse("topk:0.01").ratio == 0.01
    assert Compression.parse("quantize:4").bits == 4
    assert Compression.parse("powersgd:4").rank == 4
    topk = Compression.parse("topk:0.01:momentum=0:warmup_steps=36:momentum_masking=true")
    assert (topk.ratio, topk.momentum, topk.warmup_steps, topk.momentum_masking) == (
        0.01, 0, 36, True)
    assert Compression.parse("topk:0.01").momentum is None  # the optimizer's
    for bad in ("gzip", "topk", "fp16:2", "quantize:x", "topk:0.1:speed=2", "topk:0.1:x"):
        with pytest.raises(ValueError):
            Compression.parse(bad)
