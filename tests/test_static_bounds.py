"""Row kernels over constant rows print the row's bounds as constants (emit_rows.STATIC_BOUNDS)
only for loops whose results do not depend on them: every row kernel, forward and backward,
gives the same bits with the switch on and off (an ``omp simd`` sum's order follows what GCC
knows of its trip count, so those loops keep run-time bounds), and eager's values.
Rows of fewer columns than the 16 vector lanes, not a multiple of them, of two 256-column
sum blocks, and transposed inputs (the generic path)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import emit_rows
from same_bits import compiled_with_grads, same_bits, with_grads


def _bias_residual_ln(x, y, b, w, bias):
    return F.layer_norm(x + b + y, x.shape[-1:], w, bias, 1e-5)


def _rms_norm(x, y, b, w, bias):
    h = x + y
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _softmax(x, y, b, w, bias):
    return torch.softmax(x * 0.125 + b, -1) * y


def _cross_entropy(x, y, b, w, bias):
    target = torch.arange(x.shape[0]) % x.shape[-1]
    return F.cross_entropy(x + b, target) + (y * w).sum()


def _moments(x, y, b, w, bias):
    return torch.stack([x.var(-1), x.mean(-1), (x * y).sum(-1)])


CASES = {f.__name__.lstrip("_"): f for f in
         (_bias_residual_ln, _rms_norm, _softmax, _cross_entropy, _moments)}


def _inputs(case, cols, dtype, transposed, seed):
    g = torch.Generator().manual_seed(seed)
    rows = 12

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    x = r(cols, rows).t() if transposed else r(rows, cols)  # transposed: the generic path
    x = x * 3 + 1  # an offset: the variance's two passes matter
    return x, r(rows, cols), r(cols), r(cols), r(cols)


@pytest.mark.parametrize(("cols", "transposed"), [(10, False), (17, False), (64, False),
                                                  (300, False), (17, True)],
                         ids=["10", "17", "64", "300", "17-transposed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_constant_row_bounds_give_the_same_bits(case, cols, transposed, sources, monkeypatch):
    fn = CASES[case]
    args = _inputs(case, cols, torch.float32, transposed, seed=cols)
    with torch.no_grad():
        ref_out = fn(*args)
    grad_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(emit_rows, "STATIC_BOUNDS", False)
    off = compiled_with_grads(fn, args, grad_out)
    assert not any("constexpr int64_t s0" in s for s in sources)
    monkeypatch.setattr(emit_rows, "STATIC_BOUNDS", True)
    on = compiled_with_grads(fn, args, grad_out)
    assert any("constexpr int64_t s0" in s for s in sources)
    assert len(on) == len(off)
    for k, (a, b) in enumerate(zip(on, off)):
        same_bits(a, b, f"{case} {cols} columns, result {k}: STATIC_BOUNDS on vs off")
    # and eager's values
    eager = with_grads(fn, args, grad_out)
    for a, b in zip(on, eager):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [17, 64])
def test_constant_row_bounds_half_types(cols, dtype, monkeypatch):
    """fp16 rows staged into float rows on the stack, bf16 not: the same bits either way."""
    fn = CASES["bias_residual_ln"]
    args = _inputs("bias_residual_ln", cols, dtype, False, seed=cols + 1)
    grad_out = torch.randn(12, cols, generator=torch.Generator().manual_seed(2)).to(dtype)
    monkeypatch.setattr(emit_rows, "STATIC_BOUNDS", False)
    off = compiled_with_grads(fn, args, grad_out)
    monkeypatch.setattr(emit_rows, "STATIC_BOUNDS", True)
    on = compiled_with_grads(fn, args, grad_out)
    for k, (a, b) in enumerate(zip(on, off)):
        same_bits(a, b, f"{dtype} {cols} columns, result {k}: STATIC_BOUNDS on vs off")
