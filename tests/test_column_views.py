"""Views inside a column reduction (codegen/cpp/reduction.ReductionAnalysis.lower_kept_view):
GQA's repeat_kv backward sums the key/value gradient over the repeats (a sum over a middle
dim, keepdim), squeezes the reduced 1 away and multiplies by RoPE's cos. That tile is native
(fallback="error" raises otherwise) and matches eager, also where the squeezed shape fits
the domain's trailing dims as well as its kept dims (repeats == kv heads: LLaMA's zoo
config), and the gradients of a RoPE + repeat_kv block match eager's (that tile native)."""
from __future__ import annotations

import pytest
import torch


def _sum_squeeze_mul(x, cos):
    b, h, _, s, d = x.shape
    q = x.sum(2, keepdim=True).view(b, h, s, d)
    return q, q * cos


@pytest.mark.parametrize("shape", [(2, 2, 2, 16, 16), (2, 2, 3, 16, 16), (3, 2, 4, 8, 16),
                                   (2, 4, 2, 5, 24)],
                         ids=["repeats-eq-heads", "3-repeats", "4-repeats", "odd"])
def test_sum_over_repeats_then_view_is_native(shape, run_both, built):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    cos = torch.randn(1, 1, shape[3], shape[4], generator=g)
    run_both(_sum_squeeze_mul, x, cos)
    assert built and all(k.native for _, k in built), [(t.name, k.reason) for t, k in built]


def test_a_view_moving_elements_between_dims_is_refused(run_both):
    """A reshape of the reduced value that merges dims is not a unit view: reference."""
    def f(x, w):
        s = x.sum(2, keepdim=True)
        return s.reshape(2, 2, 16 * 16) * w
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 2, 2, 16, 16, generator=g), torch.randn(256, generator=g)
    run_both(f, x, w)  # right values, whichever executor runs it


def _rope_repeat_kv(k, cos, sin, w):
    """LLaMA's keys: RoPE, then repeat_kv (GQA), then read (here scaled)."""
    b, h, s, d = k.shape
    half = d // 2
    rot = torch.cat([-k[..., half:], k[..., :half]], -1)
    k = k * cos + rot * sin
    rep = k[:, :, None].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)
    return rep * w


@pytest.mark.parametrize("heads", [2, 3])
def test_repeat_kv_rope_gradients(heads, built):
    g = torch.Generator().manual_seed(heads)
    k = torch.randn(2, heads, 16, 16, generator=g)
    cos, sin = torch.randn(1, 1, 16, 16, generator=g), torch.randn(1, 1, 16, 16, generator=g)
    w = torch.randn(16, generator=g)
    grad = torch.randn(2, 2 * heads, 16, 16, generator=g)
    grads = []
    for fn in (_rope_repeat_kv, torch.compile(_rope_repeat_kv, backend="pypto")):
        leaf = k.clone().requires_grad_()
        fn(leaf, cos, sin, w).backward(grad)
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1.3e-6)
    assert any(t.kind.value == "reduction" and "view" in [op.op for op in t.ops]
               for t, _ in built), [t.name for t, _ in built]
    assert all(k.native for _, k in built), [(t.name, k.reason) for t, k in built]
