"""Randomised property tests of the pseudo-gradient codecs (dipaco/plan/codecs.py).

faiss style: many random cases from fixed seeds, each checked against the bound the
codec's docstring states, so a change to a codec that loosens a bound fails here with the
case that broke it. Sizes include 0, 1, odd lengths and lengths that are not a multiple
of the int8 block; magnitudes span several decades and include exact zeros.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dipaco.plan.codecs import CODECS, make_codec

SEEDS = range(6)
SIZES = (0, 1, 2, 7, 64, 255, 256, 257, 1000, 4099)


def random_vector(seed: int, n: int) -> torch.Tensor:
    """Values of mixed scale (1e-4 .. 1e3), signs, a few exact zeros and repeats."""
    rng = np.random.default_rng(seed * 7919 + n)
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 3, size=n)
    if n >= 4:
        x[rng.integers(0, n, size=max(1, n // 16))] = 0.0
        x[-1] = x[0]
    return torch.from_numpy(x.astype(np.float32))


def roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x), x.numel())


CASES = [(s, n) for s in SEEDS for n in SIZES]


@pytest.mark.parametrize("name,kw", [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {}),
                                     ("int8", {"block_size": 7}), ("int4", {}),
                                     ("int4", {"block_size": 7}), ("fp8", {}), ("fp8", {"block_size": 7}),
                                     ("topk", {}),
                                     ("topk", {"fraction": 0.3, "value_dtype": "fp16"})])
def test_shape_bytes_and_determinism(name: str, kw: dict) -> None:
    """Payload bytes are exactly nbytes_for(n); decode has n fp32 entries; encode is a function."""
    codec = make_codec(name, **kw)
    for seed, n in CASES:
        x = random_vector(seed, n)
        p1, p2 = codec.encode(x), codec.encode(x.clone())
        assert codec.payload_nbytes(p1) == codec.nbytes_for(n), (name, seed, n)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(p1, p2)), (name, seed, n)
        d = codec.decode(p1, n)
        assert d.dtype == torch.float32 and d.shape == (n,), (name, seed, n)
        assert torch.isfinite(d).all(), (name, seed, n)


def test_none_is_exact() -> None:
    codec = make_codec("none")
    for seed, n in CASES:
        x = random_vector(seed, n)
        assert torch.equal(roundtrip(codec, x), x)


@pytest.mark.parametrize("name,rel", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
def test_cast_codecs_relative_bound(name: str, rel: float) -> None:
    """|d − x| ≤ rel·|x| (fp16: plus half its smallest subnormal step below its normal range)."""
    codec = make_codec(name)
    floor = 2.0 ** -25 if name == "fp16" else 0.0
    for seed, n in CASES:
        x = random_vector(seed, n)
        if name == "fp16":
            x = x.clamp(-60000.0, 60000.0)
        err = (roundtrip(codec, x) - x).abs()
        bound = torch.maximum(rel * x.abs(), torch.full_like(x, floor))
        assert bool((err <= bound).all()), (name, seed, n, float((err - bound).max()))


def test_fp16_clamps_instead_of_overflowing() -> None:
    x = torch.tensor([1e6, -1e6, 70000.0, 3.0])
    d = roundtrip(make_codec("fp16"), x)
    assert d.tolist() == [65504.0, -65504.0, 65504.0, 3.0]


@pytest.mark.parametrize("block", [1, 7, 256])
def test_int8_blockwise_absmax_bound(block: int) -> None:
    """Per block: |d − x| ≤ absmax(block) / 254 (float rounding allowed for: 1e-6 relative)."""
    codec = make_codec("int8", block_size=block)
    for seed, n in CASES:
        x = random_vector(seed, n)
        err = (roundtrip(codec, x) - x).abs()
        pad = -n % block  # the codec zero-pads the last block; zeros change no absmax
        absmax = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, block).amax(dim=1)
        worst = torch.cat([err, err.new_zeros(pad)]).view(-1, block).amax(dim=1)
        assert bool((worst <= absmax / 254 * (1 + 1e-6)).all()), (seed, n, block)
        zeros = x == 0
        assert bool((roundtrip(codec, x)[zeros] == 0).all())  # 0 decodes to exactly 0


@pytest.mark.parametrize("block", [1, 7, 256])
def test_int4_and_fp8_blockwise_bounds(block: int) -> None:
    """int4: |d − x| ≤ absmax(block) / 14; fp8 (e4m3): |d − x| ≤ 2^-4·|x| + absmax·2^-10 / 448.
    Both decode 0 to exactly 0 and fit 1/8 (int4) and 1/4 (fp8) of fp32 plus the scales."""
    int4, fp8 = make_codec("int4", block_size=block), make_codec("fp8", block_size=block)
    for seed, n in CASES:
        x = random_vector(seed, n)
        pad = -n % block
        absmax = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, block).amax(dim=1)
        per_entry = absmax.repeat_interleave(block)[:n]
        e4 = (roundtrip(int4, x) - x).abs()
        assert bool((e4 <= per_entry / 14 * (1 + 1e-6)).all()), (seed, n, block)
        e8 = (roundtrip(fp8, x) - x).abs()
        assert bool((e8 <= 2.0 ** -4 * x.abs() + per_entry * 2.0 ** -10 / 448 + 1e-30).all()), (seed, n, block)
        zeros = x == 0
        assert bool((roundtrip(int4, x)[zeros] == 0).all()) and bool((roundtrip(fp8, x)[zeros] == 0).all())
    assert int4.nbytes_for(1000) == 500 + 4 * math.ceil(1000 / block)
    assert fp8.nbytes_for(1000) == 1000 + 4 * math.ceil(1000 / block)


def test_int4_uses_every_level_and_fp8_is_finer_than_int4() -> None:
    """The control: the bounds above are not loose. int4 hits all 15 levels on a ramp, and
    fp8's mean error on a ramp is well below int4's."""
    x = torch.linspace(-1.0, 1.0, 1001)
    q = roundtrip(make_codec("int4", block_size=1001), x)
    assert len(set((q * 7).round().tolist())) == 15
    err4 = (q - x).abs()
    err8 = (roundtrip(make_codec("fp8", block_size=1001), x) - x).abs()
    assert float(err4.max()) > 0.05 and float(err8.mean()) < float(err4.mean()) / 2


@pytest.mark.parametrize("fraction,value_dtype", [(0.01, "fp32"), (0.25, "fp32"), (0.5, "fp16"), (1.0, "fp32")])
def test_topk_keeps_the_largest_exactly(fraction: float, value_dtype: str) -> None:
    """ceil(f·n) entries survive (the largest |x|, exact or fp16-rounded); the rest decode to 0."""
    codec = make_codec("topk", fraction=fraction, value_dtype=value_dtype)
    for seed, n in CASES:
        if n == 0:
            continue
        x = random_vector(seed, n).clamp(-60000.0, 60000.0)
        d = roundtrip(codec, x)
        _, idx = codec.encode(x)
        k = min(n, max(1, math.ceil(fraction * n)))
        assert idx.numel() == k and len(set(idx.tolist())) == k, (seed, n)
        kept = torch.zeros(n, dtype=torch.bool)
        kept[idx.long()] = True
        assert bool((d[~kept] == 0).all())
        if value_dtype == "fp32":
            assert torch.equal(d[kept], x[kept])
        else:
            assert bool(((d[kept] - x[kept]).abs() <= 2.0 ** -11 * x[kept].abs() + 2.0 ** -25).all())
        if (~kept).any():  # nothing dropped is larger than anything kept
            assert float(x[~kept].abs().max()) <= float(x[kept].abs().min()), (seed, n)


@pytest.mark.parametrize("name,kw", [(n, {}) for n in sorted(CODECS)] + [("topk", {"fraction": 0.05})])
def test_error_feedback_identity_and_bounded_drift(name: str, kw: dict) -> None:
    """Error feedback as the sync code applies it: send decode(encode(x_t + r)), keep r = (x_t + r) − sent.

    Per round, residual + decoded == the compensated input (to fp32 rounding). Over T
    rounds the sums telescope: Σ x_t − Σ sent_t = r_T, so the drift stays within ONE
    encoding's error however many rounds pass, where without feedback it can grow with T.
    """
    codec = make_codec(name, **kw)
    n, T = 1000, 25
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        residual = torch.zeros(n)
        sent_sum = torch.zeros(n, dtype=torch.float64)
        true_sum = torch.zeros(n, dtype=torch.float64)
        worst_step = 0.0
        for _ in range(T):
            x = torch.randn(n, generator=g) * 1e-2 + 1e-3  # a small consistent bias, like a real Δ
            value = x + residual
            sent = roundtrip(codec, value)
            residual = value - sent
            assert torch.allclose(residual + sent, value, rtol=0, atol=1e-6 * float(value.abs().max()) + 1e-12)
            sent_sum += sent.double()
            true_sum += x.double()
            worst_step = max(worst_step, float((value - sent).abs().max()))
        drift = float((true_sum - sent_sum).abs().max())
        assert drift <= worst_step * (1 + 1e-3) + 1e-5, (name, seed, drift, worst_step)


def test_without_feedback_topk_drift_grows() -> None:
    """The control for the test above: the same stream without feedback drifts far more."""
    codec = make_codec("topk", fraction=0.05)
    g = torch.Generator().manual_seed(0)
    n, T = 1000, 25
    drift_ef = torch.zeros(n, dtype=torch.float64)
    drift_plain = torch.zeros(n, dtype=torch.float64)
    residual = torch.zeros(n)
    for _ in range(T):
        x = torch.randn(n, generator=g) * 1e-2 + 1e-3
        sent = roundtrip(codec, x + residual)
        residual = x + residual - sent
        drift_ef += (x - sent).double()
        drift_plain += (x - roundtrip(codec, x)).double()
    assert float(drift_plain.abs().max()) > 3 * float(drift_ef.abs().max())
