"""The native flash-attention backward (``codegen.cpp.attention_backward``) against ATen's
``_scaled_dot_product_flash_attention_for_cpu_backward`` and eager autograd of
``F.scaled_dot_product_attention``: every mask kind, causal, GQA-expanded K/V, strided
inputs, odd sizes, 1 and 2 threads, result strides as ATen's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import attention_backward as ab

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}

pytestmark = pytest.mark.skipif(ab.native_kernel() is None,
                                reason="no C++ compiler or native call extension")


def _bhsd(b, h, s, d, dtype):
    """[B, H, S, D] as attention's projections give it: [B, S, H, D] transposed."""
    return torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2)


def _inputs(b, h, m, n, d, dtype, causal=False, mask=None, scale=None, kv_heads=None):
    q = _bhsd(b, h, m, d, dtype)
    if kv_heads is None:
        k, v = _bhsd(b, h, n, d, dtype), _bhsd(b, h, n, d, dtype)
    else:  # GQA after repeat_kv: a stride-0 dim
        k, v = (torch.randn(b, kv_heads, 1, n, d, dtype=dtype)
                .expand(b, kv_heads, h // kv_heads, n, d).flatten(1, 2) for _ in range(2))
    g = _bhsd(b, h, m, d, dtype)
    out, lse = FORWARD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return g, q, k, v, out, lse


def _check(args, causal, mask, scale=None):
    g, q, k, v, out, lse = args
    assert ab.eligible(g, q, k, v, out, lse, 0.0, causal, mask, scale) is None
    want = ab.ATEN_BACKWARD(g, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    got = ab.flash_attention_backward(g, q, k, v, out, lse, 0.0, causal, mask, scale)
    exact = None if q.dtype == torch.float32 else _float64_grads(args, causal, mask, scale)
    for i, (w, x) in enumerate(zip(want, got)):
        assert x.shape == w.shape and x.stride() == w.stride() and x.dtype == w.dtype
        torch.testing.assert_close(x, w, **TOL[q.dtype])
        if exact is not None:  # ATen rounds P and dS to the input type; here they stay float
            err_native = (x.double() - exact[i]).abs().max()
            err_aten = (w.double() - exact[i]).abs().max()
            assert err_native <= err_aten * 1.05 + 1e-3, (i, err_native, err_aten)
    return got


def _float64_grads(args, causal, mask, scale):
    g, q, k, v, _, _ = args
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    m = None if mask is None else mask.double()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=scale)
    o.backward(g.double())
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("shape", [(4, 4, 128, 128, 16), (2, 3, 1, 1, 16), (1, 2, 7, 7, 32),
                                   (2, 2, 129, 129, 64), (1, 2, 20, 300, 16),
                                   (1, 1, 300, 20, 128), (2, 2, 33, 47, 40), (1, 2, 9, 5, 3),
                                   (4, 4, 65, 65, 16)])  # ViT: 64 patches + CLS
@pytest.mark.parametrize("causal", [False, True])
def test_matches_aten_float32(shape, causal):
    torch.manual_seed(sum(shape) + causal)
    b, h, m, n, d = shape
    _check(_inputs(b, h, m, n, d, torch.float32, causal), causal, None)


@pytest.mark.parametrize("mask_shape", ["padding", "full", "2d", "rows", "heads"])
@pytest.mark.parametrize("mask_dtype", ["query", "float32"])
def test_additive_masks(mask_shape, mask_dtype):
    torch.manual_seed(1)
    b, h, m, n, d = 2, 3, 37, 45, 32
    shapes = {"padding": (b, 1, 1, n), "full": (b, h, m, n), "2d": (m, n), "rows": (b, 1, m, 1),
              "heads": (1, h, m, n)}
    for dtype in (torch.float32, torch.bfloat16):
        mdt = dtype if mask_dtype == "query" else torch.float32
        mask = torch.randn(shapes[mask_shape], dtype=mdt)
        if mask_shape == "padding":
            mask[1, ..., 30:] = -float("inf")
        if mask_shape == "full":
            mask[0, 1, 5] = -float("inf")  # a fully masked row: zero gradients, as ATen
        args = _inputs(b, h, m, n, d, dtype, mask=mask)
        got = _check(args, False, mask)
        if mask_shape == "full":
            assert (got[0][0, 1, 5] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_mask_as_a_tensor(dtype):
    """GPT-2/LLaMA's causal mask given as a tensor (-inf above the diagonal, plus padding):
    the blocks past each query block's last unmasked key are skipped."""
    torch.manual_seed(10)
    b, h, s, d = 2, 2, 100, 32
    mask = torch.zeros(b, 1, s, s, dtype=dtype).masked_fill(
        torch.ones(s, s, dtype=torch.bool).triu(1), -float("inf"))
    mask[1, ..., 70:] = torch.finfo(dtype).min
    args = _inputs(b, h, s, s, d, dtype, mask=mask)
    _check(args, False, mask)


def test_causal_with_mask_and_scale():
    torch.manual_seed(2)
    mask = torch.randn(2, 1, 50, 50)
    args = _inputs(2, 2, 50, 50, 16, torch.float32, causal=True, mask=mask, scale=0.3)
    _check(args, True, mask, 0.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_reduced_dtypes(dtype, causal):
    torch.manual_seed(3)
    _check(_inputs(2, 4, 130, 130, 64, dtype, causal), causal, None)


def test_gqa_expanded_key_value():
    torch.manual_seed(4)
    args = _inputs(2, 8, 40, 40, 32, torch.float32, kv_heads=2)
    assert args[2].stride()[1] == 0 or args[2].stride()[1] != args[1].stride()[1]
    got = _check(args, False, None)
    assert got[1].shape == (2, 8, 40, 32)


def test_contiguous_and_strided_inputs():
    torch.manual_seed(5)
    b, h, s, d = 2, 3, 24, 16
    q, k, v, g = (torch.randn(b, h, s, d) for _ in range(4))  # [B, H, S, D] contiguous
    wide = torch.randn(b, h, s, 3 * d)[..., d:2 * d]  # a row stride of 3 D
    out, lse = FORWARD(q, wide, v, 0.0, False)
    _check((g, q, wide, v, out, lse), False, None)


def test_broadcast_grad_out():
    """A gradient with a stride-0 head dim (from a broadcast) is copied, as ATen does."""
    torch.manual_seed(9)
    g, q, k, v, out, lse = _inputs(2, 2, 12, 12, 16, torch.float32)
    g = torch.randn(2, 2, 12, 1).expand(2, 2, 12, 16)
    _check((g, q, k, v, out, lse), False, None)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads(threads):
    torch.manual_seed(6)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(_inputs(3, 3, 70, 70, 16, torch.float32), False, None)
        _check(_inputs(1, 1, 70, 70, 16, torch.float32), False, None)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "float", "bool"])
def test_matches_eager_autograd(causal, mask_kind):
    """Eager autograd of SDPA (a bool mask converted by SDPA, as in a traced graph)."""
    torch.manual_seed(7)
    b, h, s, d = 2, 4, 33, 16
    q, k, v = (_bhsd(b, h, s, d, torch.float32).requires_grad_() for _ in range(3))
    mask = None
    if mask_kind == "float":
        mask = torch.randn(b, 1, s, s)
    elif mask_kind == "bool":
        mask = torch.rand(b, 1, 1, s) > 0.3
        mask[..., 0] = True
    g = torch.randn(b, h, s, d)
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).backward(g)
    float_mask = mask
    if mask_kind == "bool":  # SDPA's own conversion before the flash op
        float_mask = torch.zeros(mask.shape).masked_fill(~mask, -float("inf"))
    out, lse = FORWARD(q.detach(), k.detach(), v.detach(), 0.0, causal, attn_mask=float_mask)
    got = ab.flash_attention_backward(g, q.detach(), k.detach(), v.detach(), out, lse, 0.0,
                                      causal, float_mask)
    for x, ref in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)


def test_ineligible_cases_go_to_aten():
    torch.manual_seed(8)
    g, q, k, v, out, lse = _inputs(1, 2, 8, 8, 16, torch.float32)
    assert ab.eligible(g, q, k, v, out, lse, 0.1, False) == "dropout"
    bool_mask = torch.ones(8, 8, dtype=torch.bool)
    assert ab.eligible(g, q, k, v, out, lse, 0.0, False, bool_mask) is not None
    want = ab.ATEN_BACKWARD(g, q, k, v, out, lse, 0.0, False, attn_mask=bool_mask)
    got = ab.flash_attention_backward(g, q, k, v, out, lse, 0.0, False, bool_mask)
    for w, x in zip(want, got):
        torch.testing.assert_close(x, w, rtol=0, atol=0)
    assert ab.eligible(*(t.to("meta") for t in (g, q, k, v, out, lse)), 0.0, False) \
        == "not on the CPU"
    big = _inputs(1, 1, 4, 4, 160, torch.float32)
    assert "head dim" in ab.eligible(*big, 0.0, False)


def test_switch_off_calls_aten(monkeypatch):
    monkeypatch.setattr(ab, "NATIVE_BACKWARD", False)
    args = _inputs(1, 2, 8, 8, 16, torch.float32)
    want = ab.ATEN_BACKWARD(*args, 0.0, False)
    got = ab.flash_attention_backward(*args, 0.0, False)
    for w, x in zip(want, got):
        torch.testing.assert_close(x, w, rtol=0, atol=0)


def _compiled_sdpa_step(monkeypatch, native: bool):
    """One compiled forward + backward of masked SDPA: (grads, the graphs' extern choices,
    native backward calls)."""
    from pypto_inductor.report import collect

    calls = []
    real = ab.flash_attention_backward_bound

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    spy._schema = real._schema
    monkeypatch.setattr(ab, "flash_attention_backward_bound", spy)
    monkeypatch.setattr(ab, "NATIVE_BACKWARD", native)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 1, 1, 33, generator=g)

    def f(q, k, v, mask):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 1.5).sum()

    with collect() as graphs:
        torch.compile(f, backend="pypto")(q, k, v, mask).backward()
    got = [t.grad for t in (q, k, v)]
    want = torch.autograd.grad(f(q, k, v, mask), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    choices = {e["reason"].split(" (")[0]: e["native"] for gr in graphs
               for e in gr.to_dict()["extern_native"].values()}
    return choices, calls


def test_compiled_training_step_runs_the_native_backward(monkeypatch):
    """The cpu target binds SDPA's backward extern to this kernel (codegen/cpp/attention.py's
    NATIVE_EXTERNS), the report says so, and the gradients are eager's."""
    choices, calls = _compiled_sdpa_step(monkeypatch, native=True)
    assert calls == [torch.Size([2, 4, 33, 16])]
    assert choices.get("native flash-attention backward") is True, choices


def test_compiled_training_step_switch_off_keeps_aten(monkeypatch):
    choices, calls = _compiled_sdpa_step(monkeypatch, native=False)
    assert not calls
    assert choices.get("NATIVE_BACKWARD is off") is False, choices


def test_a_library_per_dtype_and_head_dim_block(monkeypatch):
    """SPLIT_INSTANCES: each (dtype, head-dim block) its own library, built when first
    used; the gradients are bit for bit those of the library with every instance."""
    monkeypatch.setattr(ab, "libraries", {})
    cases = [(torch.float32, 16), (torch.bfloat16, 40)]
    inputs = [_inputs(2, 2, 33, 20, d, dtype, causal=True) for dtype, d in cases]
    got = [_check(args, True, None) for args in inputs]
    assert set(ab.libraries) == {(0, 1), (2, 4)}
    monkeypatch.setattr(ab, "SPLIT_INSTANCES", False)
    whole = [ab.flash_attention_backward(*args, 0.0, True, None, None) for args in inputs]
    assert (-1, 0) in ab.libraries
    for g, w in zip(got, whole):
        for x, y in zip(g, w):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
