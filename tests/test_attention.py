"""Attention chains written op by op become one SDPA call (lowering/attention.py).

Every variant is compared with eager on fresh random inputs, forward and backward;
the report says which chains were rewritten, and chains whose intermediates are used
elsewhere (or whose dropout is live) are left as they are.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.ir import ExternOp, op_name
from pypto_inductor.report import FusionReport, collect

B, H, KV, L, E = 2, 4, 2, 16, 8
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def repeat_kv(x, n):  # transformers' GQA form
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


def bert_like(q, k, v, mask):  # scale by mul, additive (B, 1, 1, S) mask, dropout p=0
    s = torch.matmul(q, k.transpose(-1, -2)) * (1 / math.sqrt(E))
    p = F.softmax(s + mask, dim=-1)
    p = F.dropout(p, p=0.0, training=True)
    return torch.matmul(p, v)


def divided(q, k, v, mask):  # scale by division, nn.Dropout in eval
    s = q @ k.transpose(2, 3) / math.sqrt(E)
    return F.dropout(torch.softmax(s + mask, -1), 0.1, training=False) @ v


def t5_like(q, k, v, bias):  # no scale, a learned position bias plus a padding mask
    s = torch.matmul(q, k.transpose(3, 2))
    s = s + bias
    s = s + _padding_mask(q)
    return torch.matmul(F.softmax(s.float(), dim=-1).type_as(s), v)


def causal_bool(q, k, v, _):  # boolean causal mask via masked_fill(-inf)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    s = torch.matmul(q, k.transpose(-1, -2)) * E ** -0.5
    s = s.masked_fill(~causal, float("-inf"))
    return torch.matmul(s.softmax(dim=-1), v)


def where_mask(q, k, v, keep):  # boolean padding mask via where(keep, s, -inf)
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.3
    s = torch.where(keep, s, float("-inf"))
    return torch.matmul(s.softmax(-1), v)


def gqa_llama(q, k, v, mask):  # repeat_kv, softmax in float32 cast back, additive causal mask
    k, v = repeat_kv(k, H // KV), repeat_kv(v, H // KV)
    s = torch.matmul(q, k.transpose(2, 3)) * E ** -0.5 + mask
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(p, p=0.0, training=False), v)


def _padding_mask(q):
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool, device=q.device)
    keep[1, ..., L - 5:] = False
    return torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)


def _inputs(variant, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(map(ord, variant.__name__)))
    kv_heads = KV if variant is gqa_llama else H
    q = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    k = torch.randn(B, kv_heads, L, E, generator=g, dtype=dtype)
    v = torch.randn(B, kv_heads, L, E, generator=g, dtype=dtype)
    if variant in (bert_like, divided):
        extra = _padding_mask(q)
    elif variant is t5_like:
        extra = torch.randn(1, H, L, L, generator=g, dtype=dtype)  # learned: gets a gradient
    elif variant is where_mask:
        extra = torch.ones(B, 1, L, L, dtype=torch.bool)
        extra[0, :, :, L - 3:] = False
    elif variant is gqa_llama:
        extra = torch.full((L, L), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
    else:
        extra = torch.zeros(())
    return q, k, v, extra


def _run(fn, inputs, grad: bool, autocast: bool = False, options=None):
    """(outputs, grads) of fn on copies of ``inputs``, eager and compiled, and the reports."""
    results = []
    for compiled in (False, True):
        # q, k, v get gradients, and a learned bias (T5's); masks do not
        learned = (0, 1, 2, 3) if fn is t5_like else (0, 1, 2)
        args = [t.clone().requires_grad_(grad and i in learned and t.is_floating_point())
                for i, t in enumerate(inputs)]
        f = torch.compile(fn, backend="pypto", options=options or {}) if compiled else fn
        torch._dynamo.reset()
        with collect() as reports, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = f(*args)
        grads = []
        if grad:
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                                     dtype=out.dtype))
            grads = [a.grad for a in args if a.requires_grad]
        results.append((out, grads, list(reports)))
    return results


def _decisions(reports):
    d = FusionReport(reports).to_dict()
    # the attention rewrite's decisions ("attention -> ...", "attention left unfused: ..."),
    # not the planner's naming the SDPA extern in a cycle
    fused = [x for g in d["graphs"] for x in g["decisions"]
             if x["reason"].startswith("attention")]
    eager_ops = {k: v for g in d["graphs"] for k, v in g["fallback_ops"].items()}
    return fused, eager_ops


def _tol(dtype):
    return dict(rtol=1e-4, atol=2e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


VARIANTS = [bert_like, divided, t5_like, causal_bool, where_mask, gqa_llama]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda f: f.__name__)
def test_attention_rewritten_matches_eager(variant, grad):
    inputs = _inputs(variant)
    (eo, eg, _), (co, cg, reports) = _run(variant, inputs, grad)
    torch.testing.assert_close(co, eo, **_tol(torch.float32))
    for c, e in zip(cg, eg):
        torch.testing.assert_close(c, e, **_tol(torch.float32))
    decisions, eager_ops = _decisions(reports)
    assert [x["fused"] for x in decisions] == [True], decisions
    assert "scaled_dot_product_attention call" in decisions[0]["reason"]
    if not (grad and variant is t5_like):
        # one attention call, no softmax of ours (a bias that needs a gradient makes SDPA
        # take its math form, which ATen writes out op by op)
        assert eager_ops.get(SDPA) == 1, eager_ops
    assert not any("softmax" in k for k in eager_ops)


@pytest.mark.parametrize("variant", [bert_like, t5_like, gqa_llama], ids=lambda f: f.__name__)
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_attention_bf16(variant, grad):
    # bf16 inputs, and fp32 inputs under bf16 autocast
    for dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
        inputs = _inputs(variant, dtype)
        (eo, eg, _), (co, cg, reports) = _run(variant, inputs, grad, autocast=autocast)
        assert co.dtype == eo.dtype
        torch.testing.assert_close(co, eo, **_tol(torch.bfloat16))
        for c, e in zip(cg, eg):
            torch.testing.assert_close(c, e, **_tol(torch.bfloat16))
        assert [x["fused"] for x in _decisions(reports)[0]] == [True]


def returns_probs(q, k, v, mask):  # output_attentions: the probabilities are an output
    p = F.softmax(q @ k.transpose(-1, -2) * 0.5 + mask, dim=-1)
    return p @ v, p


def scores_reused(q, k, v, mask):  # the scores feed something else too
    s = q @ k.transpose(-1, -2) * 0.5
    return F.softmax(s + mask, dim=-1) @ v + s.mean()


def scale_after_mask(q, k, v, mask):  # (s + mask) * c: not SDPA's form
    return F.softmax((q @ k.transpose(-1, -2) + mask) * 0.5, dim=-1) @ v


def softmax_over_queries(q, k, v, mask):
    return F.softmax(q @ k.transpose(-1, -2) + mask, dim=2) @ v


@pytest.mark.parametrize("fn,why", [
    (returns_probs, "also used elsewhere"), (scores_reused, "also used elsewhere"),
    (scale_after_mask, "between q @ k^T and the softmax"),
    (softmax_over_queries, "not the keys")], ids=lambda x: getattr(x, "__name__", ""))
def test_attention_not_rewritten(fn, why):
    inputs = _inputs(bert_like)
    (eo, _, _), (co, _, reports) = _run(fn, inputs, grad=False)
    torch.testing.assert_close(co, eo, **_tol(torch.float32))
    decisions, eager_ops = _decisions(reports)
    assert [x["fused"] for x in decisions] == [False] and why in decisions[0]["reason"]
    assert SDPA not in eager_ops


def test_live_dropout_not_rewritten():
    # dropout in training draws random numbers SDPA would draw differently
    def fn(q, k, v, mask):
        return F.dropout(F.softmax(q @ k.transpose(-1, -2) + mask, -1), 0.5, True) @ v

    (_, _, _), (_, _, reports) = _run(fn, _inputs(bert_like), grad=False)
    decisions, eager_ops = _decisions(reports)
    assert [x["fused"] for x in decisions] == [False] and "dropout" in decisions[0]["reason"]
    assert SDPA not in eager_ops


def test_fuse_attention_option_off():
    inputs = _inputs(bert_like)
    (eo, _, _), (co, _, reports) = _run(bert_like, inputs, grad=False,
                                        options={"fuse_attention": False})
    torch.testing.assert_close(co, eo, **_tol(torch.float32))
    decisions, eager_ops = _decisions(reports)
    assert decisions == [] and SDPA not in eager_ops


def test_bert_eager_attention_training_step():
    transformers = pytest.importorskip("transformers")
    from pypto_inductor import zoo

    model = zoo.build("bert")
    model.config._attn_implementation = "eager"
    model.train()
    batch = zoo.batch("bert")
    ref = model(**batch)
    ref["loss"].backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch._dynamo.reset()
    with collect() as reports:
        out = torch.compile(model, backend="pypto")(**batch)
        out["loss"].backward()
    torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-3, atol=1e-5, msg=n)
    decisions, eager_ops = _decisions(list(reports))
    assert [x["fused"] for x in decisions] == [True] * zoo.LAYERS
    assert transformers is not None


def test_dynamic_sizes():
    # symbolic batch and sequence sizes: matched without guarding on them, no recompile
    def fn(q, k, v, mask):
        s = torch.matmul(q, k.transpose(-1, -2)) * 0.25 + mask
        return torch.matmul(F.softmax(s, dim=-1), v)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="pypto", dynamic=True)
    with collect() as reports:
        for b, n in ((2, 16), (3, 24), (4, 9)):
            q, k, v = (torch.randn(b, H, n, E) for _ in range(3))
            mask = torch.randn(b, 1, 1, n)
            torch.testing.assert_close(compiled(q, k, v, mask), fn(q, k, v, mask),
                                       **_tol(torch.float32))
    reports = list(reports)
    assert len(reports) == 1
    assert [x["fused"] for x in _decisions(reports)[0]] == [True]


def test_causal_tril_mask_becomes_is_causal():
    # ones(n, n, bool).tril() built in the graph: SDPA's is_causal (no mask read at all),
    # as models.TransformerBlock writes it
    from pypto_inductor import models

    torch.manual_seed(0)
    block = models.TransformerBlock(32, 4, 64).eval()
    x = torch.randn(2, 12, 32)
    torch._dynamo.reset()
    with torch.no_grad(), collect() as reports:
        out = torch.compile(block, backend="pypto")(x)
    torch.testing.assert_close(out, block(x), **_tol(torch.float32))
    graph = list(reports)[0].plan.graph
    sdpa = [n for n in graph.nodes if isinstance(n, ExternOp) and op_name(n.fn) == SDPA]
    assert len(sdpa) == 1, [str(n) for n in graph.nodes]
    args, kwargs = sdpa[0].args, sdpa[0].kwargs
    assert kwargs.get("is_causal", args[4] if len(args) > 4 else False) is True
    assert kwargs.get("attn_mask") is None


def _sdpa_calls(reports):
    """(is_causal, has a mask) of every SDPA call in the compiled graphs."""
    calls = []
    for r in reports:
        for n in r.plan.graph.nodes:
            if isinstance(n, ExternOp) and op_name(n.fn) == SDPA:
                causal = n.kwargs.get("is_causal", n.args[4] if len(n.args) > 4 else False)
                calls.append((causal, n.kwargs.get("attn_mask") is not None))
    return calls


def _zoo_forward(name, impl, padding):
    """Logits of a zoo model, eager and compiled, and the compiled graphs' reports."""
    pytest.importorskip("transformers")
    from pypto_inductor import zoo

    model = zoo.build(name)
    model.config._attn_implementation = impl
    batch = zoo.batch(name)
    batch.pop("labels")
    if padding:  # the second sequence padded at the end
        batch["attention_mask"][1, -5:] = 0
    else:
        batch.pop("attention_mask")
    torch._dynamo.reset()
    with torch.no_grad(), collect() as reports:
        ref = model(**batch).logits
        out = torch.compile(model, backend="pypto")(**batch).logits
    return out, ref, list(reports)


@pytest.mark.parametrize("name,impl", [("gpt2", "sdpa"), ("gpt2", "eager"), ("llama", "sdpa"),
                                       ("qwen2", "eager")])
def test_transformers_causal_mask_becomes_is_causal(name, impl):
    # transformers' masking utils build the causal mask from aranges (a float mask of the
    # dtype's minimum above the diagonal for eager attention, a bool one for SDPA): computed
    # from no input, it is evaluated at compile time and found equal to is_causal's mask
    out, ref, reports = _zoo_forward(name, impl, padding=False)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    from pypto_inductor import zoo

    assert _sdpa_calls(reports) == [(True, False)] * zoo.LAYERS


@pytest.mark.parametrize("name,impl,padding", [
    ("gpt2", "sdpa", True), ("gpt2", "eager", True), ("llama", "eager", True),
    ("mistral", "sdpa", True), ("mistral", "sdpa", False), ("mistral", "eager", False)])
def test_masks_that_are_not_only_causal_stay(name, impl, padding):
    # a padding mask reads an input; Mistral's sliding window (shorter than the sequence)
    # is not the causal mask: the mask stays, is_causal does not appear
    out, ref, reports = _zoo_forward(name, impl, padding)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    from pypto_inductor import zoo

    assert _sdpa_calls(reports) == [(False, True)] * zoo.LAYERS


def _masked_later(q, k, v, _):
    n = q.shape[-2]
    m = torch.ones(n, n, dtype=torch.bool).tril()
    m[0, 1] = True  # written in place after it was built: not the causal mask any more
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def _mild_float_mask(q, k, v, _):
    n = q.shape[-2]
    bias = torch.full((n, n), -1e4).triu(1)  # masks with -1e4, not the dtype's minimum
    return torch.matmul(F.softmax(q @ k.transpose(-1, -2) * 0.3 + bias, dim=-1), v)


def _all_true(q, k, v, _):
    n = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool))


@pytest.mark.parametrize("fn,want", [(_masked_later, [(False, True)]),
                                     (_mild_float_mask, [(False, True)]),
                                     (_all_true, [(False, False)])],
                         ids=["written_in_place", "mild_float", "all_true"])
def test_constant_masks_judged_by_value(fn, want):
    inputs = _inputs(causal_bool)
    (eo, _, _), (co, _, reports) = _run(fn, inputs, grad=False)
    torch.testing.assert_close(co, eo, **_tol(torch.float32))
    assert _sdpa_calls(reports) == want
