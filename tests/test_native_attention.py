"""The cpu target's native flash-attention forward (codegen/cpp/attention.py) against ATen's
``_scaled_dot_product_flash_attention_for_cpu`` and eager ``F.scaled_dot_product_attention``:
values, logsumexp, output strides, masks, causal, GQA views, dtypes, threads, ATen's
backward on its (out, lse), and its use in compiled graphs and a zoo model."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor import FusionReport, zoo
from pypto_inductor.codegen.cpp import attention
from pypto_inductor.report import collect
from pypto_inductor.report.html import render

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
       torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


def _qkv(B, H, Lq, Lk, D, dtype=torch.float32, seed=0, kv_heads=None):
    """Q, K, V as the models' views: [B, L, H, D] storage seen as [B, H, L, D]; with
    kv_heads, K/V expanded from fewer heads (GQA's repeat_kv without the copy)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=g).to(dtype).transpose(1, 2)
    hk = kv_heads or H
    k = torch.randn(B, Lk, hk, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, Lk, hk, D, generator=g).to(dtype).transpose(1, 2)
    if kv_heads:
        rep = H // kv_heads
        k = k.unsqueeze(2).expand(B, hk, rep, Lk, D).flatten(1, 2)
        v = v.unsqueeze(2).expand(B, hk, rep, Lk, D).flatten(1, 2)
    return q, k, v


def _check(q, k, v, **kw):
    out, lse = attention.flash_forward(q, k, v, **kw)
    ref, ref_lse = FLASH(q, k, v, **kw)
    torch.testing.assert_close(out, ref, **TOL[q.dtype])
    # half types: ATen's GEMM rounds its operands (the scaled scores) where the kernel keeps fp32
    lse_tol = TOL[torch.float32] if q.dtype == torch.float32 else {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(lse, ref_lse, **lse_tol)
    assert out.stride() == ref.stride() and lse.stride() == ref_lse.stride()
    assert out.dtype == ref.dtype and lse.dtype == ref_lse.dtype == torch.float32
    return out, lse


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.setattr(attention, "NATIVE_ATTENTION", True)
    assert attention.unsupported(*_qkv(1, 1, 2, 2, 16)) is None, "the kernel is not built here"


@pytest.mark.parametrize("shape", [(4, 4, 128, 128, 16), (2, 3, 1, 1, 16), (2, 3, 7, 7, 32),
                                   (1, 2, 129, 129, 64), (2, 2, 5, 130, 16),
                                   (1, 2, 200, 70, 128), (1, 1, 9, 9, 8), (1, 2, 66, 66, 80),
                                   (4, 4, 65, 65, 16)])  # ViT: 64 patches + CLS
@pytest.mark.parametrize("causal", [False, True])
def test_matches_aten_fp32(shape, causal):
    _check(*_qkv(*shape, seed=sum(shape)), is_causal=causal)


def test_matches_eager_sdpa_and_scale():
    q, k, v = _qkv(2, 4, 17, 23, 32, seed=3)
    out, _ = attention.flash_forward(q, k, v, scale=0.3)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.3),
                               **TOL[torch.float32])
    _check(q, k, v, scale=0.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_aten_half_types(dtype, causal):
    q, k, v = _qkv(2, 4, 65, 65, 64, dtype=dtype, seed=5)
    _check(q, k, v, is_causal=causal)
    mask = torch.randn(2, 1, 65, 65).to(dtype)
    _check(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 37), (2, 1, 13, 37), (1, 1, 13, 37),
                                        (2, 3, 13, 37), (13, 37)])
def test_additive_masks_broadcast(mask_shape):
    q, k, v = _qkv(2, 3, 13, 37, 16, seed=7)
    g = torch.Generator().manual_seed(8)
    mask = torch.randn(mask_shape, generator=g)
    mask[..., :5] = torch.finfo(torch.float32).min  # the models' padding value
    _check(q, k, v, attn_mask=mask)
    torch.testing.assert_close(attention.flash_forward(q, k, v, attn_mask=mask)[0],
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               **TOL[torch.float32])


def test_bool_mask_through_eager_sdpa_and_fully_masked_rows():
    """F.sdpa turns a bool mask into -inf / 0 of the query's dtype; a row with every key
    masked gives ATen's output (0) and ATen's logsumexp."""
    q, k, v = _qkv(2, 2, 9, 150, 16, seed=9)
    keep = torch.rand(2, 1, 9, 150, generator=torch.Generator().manual_seed(10)) > 0.3
    keep[:, :, 0] = False  # fully masked rows
    keep[:, :, 1, :140] = False  # only the second key block seen
    mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    out, lse = _check(q, k, v, attn_mask=mask)
    assert (out[:, :, 0] == 0).all()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(out[:, :, 1:], ref[:, :, 1:], **TOL[torch.float32])


def test_gqa_expanded_and_strided_views_are_read_in_place():
    q, k, v = _qkv(2, 8, 31, 31, 32, seed=11, kv_heads=2)
    _check(q, k, v, is_causal=True)
    # non-unit stride along the head dim (a transposed view): ATen's kernel gives NaN here
    # (torch 2.13), so against the math of a contiguous copy
    qt = torch.randn(2, 8, 32, 31).transpose(2, 3)
    out, _ = attention.flash_forward(qt, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(qt.contiguous(), k, v),
                               **TOL[torch.float32])
    assert out.stride() == qt.stride()  # empty_like(query), as ATen


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_fewer_kv_heads(causal):
    """ATen's kernel takes K/V with fewer heads (query head h reads K/V head h // group):
    LLaMA's decode steps reach it so."""
    q = _qkv(2, 4, 10, 10, 16, seed=16)[0]
    k, v = _qkv(2, 2, 11, 11, 16, seed=17)[1:]
    _check(q, k, v, is_causal=causal)
    _check(q[:, :, :1], k, v)
    out, _ = attention.flash_forward(q, k, v)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("threads", [1, 2])
def test_threads(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in [(1, 1, 300, 300, 16), (4, 4, 128, 128, 16), (1, 2, 1, 257, 64)]:
            _check(*_qkv(*shape, seed=12), is_causal=shape[2] > 1)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("causal", [False, True])
def test_aten_backward_on_native_out_and_lse_gives_eager_grads(causal):
    q, k, v = _qkv(2, 3, 40, 40, 32, seed=13)
    mask = torch.randn(2, 1, 1, 40) if not causal else None
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    with torch.no_grad():
        out, lse = attention.flash_forward(q, k, v, is_causal=causal, attn_mask=mask)
        grads = FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_ineligible_operands_keep_aten():
    q, k, v = _qkv(1, 2, 5, 5, 144, seed=14)
    assert "head dim" in attention.unsupported(q, k, v)
    out, lse = attention.flash_forward(q, k, v)  # ATen's kernel
    torch.testing.assert_close(out, FLASH(q, k, v)[0], rtol=0, atol=0)
    assert "dropout" in attention.unsupported(*_qkv(1, 1, 2, 2, 16), dropout_p=0.1)
    q64 = _qkv(1, 1, 2, 2, 16, dtype=torch.float64)
    assert "dtype" in attention.unsupported(*q64)


def _spy(monkeypatch) -> list:
    calls = []
    run = attention.run_kernel

    def spy(*args):
        calls.append(args[0].shape)
        return run(*args)

    monkeypatch.setattr(attention, "run_kernel", spy)
    return calls


def test_compiled_dynamic_shapes_one_kernel(monkeypatch):
    """dynamic=True over three sequence lengths: one graph, the native kernel each call,
    one graph compiled (no recompilation)."""
    calls = _spy(monkeypatch)
    torch._dynamo.reset()

    def f(q, k, v, m):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2

    compiled = torch.compile(f, backend="pypto", dynamic=True)
    with collect() as graphs:
        for s in (20, 33, 70):
            q, k, v = _qkv(2, 4, s, s, 16, seed=s)
            m = torch.randn(2, 1, 1, s)
            torch.testing.assert_close(compiled(q, k, v, m), f(q, k, v, m), **TOL[torch.float32])
    assert len(calls) == 3 and [c[2] for c in calls] == [20, 33, 70]
    assert len(graphs) == 1
    native = graphs[0].to_dict()["extern_native"]
    assert native and all(e["native"] for e in native.values()), native


def test_switch_off_keeps_aten_and_reports_why(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setattr(attention, "NATIVE_ATTENTION", False)
    torch._dynamo.reset()
    q, k, v = _qkv(2, 2, 8, 8, 16, seed=15)
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True) + 1  # noqa: E731
    with collect() as graphs:
        out = torch.compile(f, backend="pypto")(q, k, v)
    torch.testing.assert_close(out, f(q, k, v), **TOL[torch.float32])
    assert not calls
    native = graphs[0].to_dict()["extern_native"]
    assert [e["reason"] for e in native.values()] == ["NATIVE_ATTENTION is off"]
    assert "ATen (NATIVE_ATTENTION is off)" in str(FusionReport(graphs))
    html = render(FusionReport(graphs))
    assert "id='extern-native'" in html and "NATIVE_ATTENTION is off" in html


@pytest.mark.parametrize("dtype, causal, d, native_fw, native_bw", [
    (torch.float32, False, 64, False, True), (torch.float32, False, 96, False, False),
    (torch.float32, True, 64, True, True), (torch.bfloat16, False, 64, True, True),
    (torch.float32, False, 32, True, True)])
def test_aten_runs_where_it_measured_faster(dtype, causal, d, native_fw, native_bw):
    """float32 without a causal mask: ATen's forward from head dim 48, its backward for
    head dims padded to 128 (attention.aten_faster); eager's values and gradients either
    way, and the report says which kernel runs and why."""
    torch._dynamo.reset()
    q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(2, 2, 9, 9, d, seed=d))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal) * 2

    go = torch.randn(2, 2, 9, d, dtype=dtype)
    with collect() as graphs:
        out = torch.compile(f, backend="pypto")(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), go)
    ref = f(q, k, v)
    want = torch.autograd.grad(ref, (q, k, v), go)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    # sums over keys in another order (ATen's blocks or ours); bfloat16: ATen rounds P, dS
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(grads, want, **tol)
    decisions = {g.to_dict()["name"].split("_")[-1]: list(g.to_dict()["extern_native"].values())
                 for g in graphs}
    assert [e["native"] for e in decisions["forward"]] == [native_fw], decisions
    assert [e["native"] for e in decisions["backward"]] == [native_bw], decisions
    for e in decisions["forward"] + decisions["backward"]:
        assert e["native"] or "measured faster" in e["reason"], e


@pytest.mark.parametrize("name", ["bert", "llama"])  # llama: GQA
def test_zoo_model_forward_uses_native_kernel(name, monkeypatch):
    calls = _spy(monkeypatch)
    torch._dynamo.reset()
    model = zoo.build(name)
    batch = zoo.batch(name, seed=1)
    with warnings.catch_warnings(), torch.no_grad(), collect() as graphs:
        warnings.simplefilter("ignore")
        out = torch.compile(model, backend="pypto")(**batch)
    with torch.no_grad():
        ref = model(**batch)
    out, ref = zoo.output_tensors(out), zoo.output_tensors(ref)
    for key in ref:
        torch.testing.assert_close(out[key], ref[key], atol=1e-5, rtol=1e-4)
    assert calls, "the native kernel did not run"
    native = [e for g in graphs for e in g.to_dict()["extern_native"].values()]
    assert native and all(e["native"] for e in native), native
