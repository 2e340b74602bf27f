"""dynamic=True: one captured graph serves every size, and stays correct at each.

Sizes start at 2: Dynamo specialises sizes 0 and 1 by design, so a size-1 call
would be a legitimate recompile, not a bug of ours.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from pypto_inductor import models
from pypto_inductor.report import collect


def _run_sizes(model, shapes, tol, dtype=torch.float32, grad=False):
    compiled = torch.compile(model, backend="pypto", dynamic=True)
    counters.clear()
    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, shape in enumerate(shapes):
            torch.manual_seed(i)
            x = torch.randn(*shape, dtype=dtype)
            if grad:
                xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
                out, ref = compiled(xc), model(xe)
                torch.testing.assert_close(out, ref, **tol(dtype))
                w = torch.randn_like(ref)
                g = torch.autograd.grad((out * w).sum(), [xc] + list(model.parameters()))
                r = torch.autograd.grad((ref * w).sum(), [xe] + list(model.parameters()))
                for a, b in zip(g, r):
                    torch.testing.assert_close(a, b, **tol(dtype), msg=lambda m: f"{shape}: {m}")
            else:
                with torch.no_grad():
                    out, ref = compiled(x), model(x)
                torch.testing.assert_close(out, ref, **tol(dtype), msg=lambda m: f"{shape}: {m}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    return graphs


def _symbolic(graphs) -> bool:
    """Some compiled graph has a size symbol (it really is shape-generic)."""
    return any(g.plan is not None and g.plan.graph.symbol_bindings for g in graphs)


def test_transformer_block_batch_and_sequence(tol):
    torch.manual_seed(0)
    model = models.TransformerBlock().eval()
    graphs = _run_sizes(model, [(2, 16, 64), (3, 8, 64), (4, 23, 64)], tol)
    assert _symbolic(graphs)
    assert all(g.eager_reason is None for g in graphs)


def test_transformer_block_dynamic_training(tol):
    torch.manual_seed(0)
    model = models.TransformerBlock(dim=32, heads=2, hidden=64).train()
    graphs = _run_sizes(model, [(2, 8, 32), (3, 5, 32), (2, 12, 32)], tol, grad=True)
    assert sorted({g.name.rsplit("_", 1)[-1] for g in graphs}) == ["backward", "forward"]
    assert _symbolic(graphs)


def test_llama_block_sequence_lengths(tol):
    torch.manual_seed(0)
    model = models.LlamaBlock().eval()
    graphs = _run_sizes(model, [(2, 16, 64), (2, 9, 64), (3, 30, 64)], tol)
    assert _symbolic(graphs)


class ElementwiseReduction(torch.nn.Module):
    def forward(self, x):
        y = torch.sigmoid(x) * x + 1.0
        z = y.sum(-1, keepdim=True) / y.amax(-1, keepdim=True)
        return z + y.mean(dim=0, keepdim=True).sum() - y.var(dim=(0, 1)).mean(), y.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_elementwise_reduction_every_dim_dynamic(dtype, tol):
    graphs = _run_sizes(ElementwiseReduction(), [(4, 32), (7, 32), (9, 33), (2, 5), (16, 100)],
                        tol, dtype=dtype)
    assert _symbolic(graphs)
    plan = next(g.plan for g in graphs if g.plan is not None)
    assert len(plan.graph.symbol_bindings) == 2  # both dims are symbols
    # Kernels were planned (and fused) over symbolic sizes; footprints stay sympy.
    assert plan.tiles and len(plan.tiles) < len([n for n in plan.graph.nodes])
    assert any(tile.footprint_expr.free_symbols for tile in plan.tiles)


def test_layernorm_gelu_residual_dynamic_rows(tol):
    model = models.LayerNormGeluResidual(128)
    graphs = _run_sizes(model, [(2, 8, 128), (5, 3, 128), (3, 17, 128)], tol)
    plan = next(g.plan for g in graphs if g.plan is not None)
    assert len(plan.tiles) == 1  # the whole chain is one kernel at every size


def test_dynamic_slice_and_cat(tol):
    def f(x):
        n = x.shape[1]
        head, tail = x[:, : n // 2], x[:, n // 2:]
        return torch.cat([tail, head * 2], dim=1).relu() + x[:, -1:]

    _run_sizes(f, [(3, 8), (4, 10), (5, 7), (2, 13)], tol)


@pytest.mark.parametrize("keeps", [(3, 5, 0), (0, 3, 5)])
def test_slice_from_an_int_input_counts_from_the_end(keeps):
    """``hidden[:, -keep:]`` for an int input (transformers' ``logits_to_keep``, 0: every
    position): under dynamic=True ``-keep`` is a symbolic start whose sign sympy cannot
    tell. Its backward's slice_scatter needs the start counted from the end (a negative
    narrow length raised), and with ``keep`` 0 the zero rows before it are an empty part
    only at run time (the fused LayerNorm backward read it out of bounds: a segfault)."""
    torch.manual_seed(5)
    norm = torch.nn.LayerNorm(16)
    w = torch.randn(16, 8, requires_grad=True)

    def f(h, keep):
        y = norm(h * 2)
        return y[:, -keep:, :] @ w, y

    compiled = torch.compile(f, backend="pypto", dynamic=True)
    for keep in keeps:
        h = torch.randn(2, 6, 16, requires_grad=True)
        out, ref = compiled(h, keep), f(h, keep)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        grads = [torch.randn_like(r) for r in ref]
        got = torch.autograd.grad(out, (h, w, *norm.parameters()), grads)
        want = torch.autograd.grad(ref, (h, w, *norm.parameters()), grads)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
