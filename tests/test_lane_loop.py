"""A row's float sums with their order written out (row_sums.vector_lanes) as an ``omp simd``
loop over the 16 lanes into an array of partial sums (row_sums.LANE_LOOP), instead of 16
named partial sums each with its own copy of the summed value's code: each lane adds the
same columns in the same order, so every row kernel, forward and backward, gives the same
bits with the switch on and off, and eager's values. Rows shorter than, not a multiple of,
and several 256-column blocks of the 16 lanes; a sum of squares (an fma into the lane);
LayerNorm's backward; a select on a bool mask over a long row."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import half_staging, row_loop, row_sums
from same_bits import compiled_with_grads, same_bits, with_grads


def layer_norm(x, y, b, w, bias, mask):
    return F.layer_norm(x + b + y, x.shape[-1:], w, bias, 1e-5)


def rms_norm(x, y, b, w, bias, mask):
    h = x + y
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def moments(x, y, b, w, bias, mask):
    return torch.stack([x.var(-1), x.mean(-1), (x * y).sum(-1),
                        torch.where(mask, 0.0, x * b).sum(-1)]) * w[:1]


CASES = {f.__name__: f for f in (layer_norm, rms_norm, moments)}


def inputs(cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = 12

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    x = r(rows, cols) * 3 + 1  # an offset: the variance's two passes matter
    mask = torch.rand(rows, cols, generator=g) < 0.5
    return x, r(rows, cols), r(cols), r(cols), r(cols), mask


@pytest.mark.parametrize("cols", [10, 17, 64, 300, 1100])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lane_loop_gives_the_same_bits(case, cols, sources, monkeypatch):
    fn = CASES[case]
    args = inputs(cols, torch.float32, seed=cols)
    with torch.no_grad():
        ref_out = fn(*args)
    grad_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(row_sums, "LANE_LOOP", False)
    off = compiled_with_grads(fn, args, grad_out)
    named = any("_s15 += " in s or "_s15 = PI_FMA" in s for s in sources)
    sources.clear()
    monkeypatch.setattr(row_sums, "LANE_LOOP", True)
    on = compiled_with_grads(fn, args, grad_out)
    looped = any("_v[l] += " in s or "_v[l] = PI_FMA" in s for s in sources)
    assert named == looped  # a kernel with the written-out order had it both ways
    if cols >= 64:
        assert looped
    assert not any("_s15" in s for s in sources)
    assert len(on) == len(off)
    for k, (a, b) in enumerate(zip(on, off)):
        same_bits(a, b, f"{case} {cols} columns, result {k}: LANE_LOOP on vs off")
    eager = with_grads(fn, args, grad_out)
    for a, b in zip(on, eager):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_lane_loop_half_types(dtype, monkeypatch):
    """fp16 rows staged into float blocks, bf16 not: the same bits either way."""
    args = inputs(300, dtype, seed=5)
    grad_out = torch.randn(12, 300, generator=torch.Generator().manual_seed(2)).to(dtype)
    monkeypatch.setattr(row_sums, "LANE_LOOP", False)
    off = compiled_with_grads(layer_norm, args, grad_out)
    monkeypatch.setattr(row_sums, "LANE_LOOP", True)
    on = compiled_with_grads(layer_norm, args, grad_out)
    for k, (a, b) in enumerate(zip(on, off)):
        same_bits(a, b, f"{dtype} result {k}: LANE_LOOP on vs off")


def masked_softmax(x, bias, mask, low):
    """T5's masked attention weights: a bool mask selects the bias or a broadcast floor,
    softmax over the row, fully masked rows zeroed (SDPA's math path)."""
    s = x + torch.where(mask, bias, low)
    fully = torch.logical_not(torch.logical_not(s == float("-inf")).any(-1, keepdim=True))
    return torch.where(fully, 0.0, torch.softmax(s, -1))


@pytest.mark.parametrize("cols", [16, 40, 128])
@pytest.mark.parametrize("switch", [(half_staging, "BOOL_ROWS"),
                                    (row_loop, "HOIST_BROADCAST_LOADS")], ids=lambda s: s[1])
def test_masked_softmax_switches_give_the_same_bits(cols, switch, sources, monkeypatch):
    """A multi-pass row kernel's bool mask through a float row (half_staging.BOOL_ROWS; GCC 12
    ran the byte mask's 16-lane loop with 2 lanes) and the broadcast floor loaded before the
    softmax's lane loop (row_loop.HOIST_BROADCAST_LOADS; else a branch per element): the
    same bits either way, and eager's values, forward and backward."""
    g = torch.Generator().manual_seed(cols)
    args = (torch.randn(3, 4, 8, cols, generator=g), torch.randn(1, 4, 8, cols, generator=g),
            torch.rand(3, 1, 8, cols, generator=g) > 0.3, torch.full((1, 1, 1, 1), -30.0))
    grad_out = torch.randn(3, 4, 8, cols, generator=g)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(*switch, on)
        sources.clear()
        results[on] = compiled_with_grads(masked_softmax, args, grad_out)
        if switch[1] == "BOOL_ROWS":
            assert any(" != 0.0f)" in s for s in sources) == on
    for k, (a, b) in enumerate(zip(results[True], results[False])):
        same_bits(a, b, f"{cols} columns, result {k}: {switch[1]} on vs off")
    for a, b in zip(results[True], with_grads(masked_softmax, args, grad_out)):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
