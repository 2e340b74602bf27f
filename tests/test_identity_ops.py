"""Products and quotients by one are dropped before lowering (lowering/identity_ops.py), never
at the cost of an output aliasing an input or another output, and never changing a dtype.

Against eager on fresh random inputs; a spy counts the products each graph dropped."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor import backend

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def dropped(monkeypatch):
    counts = []

    def spy(gm, visible=None, _fn=backend.drop_identity_ops):
        counts.append(_fn(gm, visible))
        return counts[-1]
    monkeypatch.setattr(backend, "drop_identity_ops", spy)
    return counts


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="pypto", dynamic=False)


def test_unscaled_attention_with_a_trained_bias_trains_as_eager(dropped):
    """T5's attention: SDPA with scale=1 and a bias that needs a gradient (traced in its math
    form, which multiplies q and k by one)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 4, 32, 32, requires_grad=True)

    def attn(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    out = _compile(attn)(q, k, v, bias)
    ref = attn(q, k, v, bias)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, bias), g),
                    torch.autograd.grad(ref, (q, k, v, bias), g)):
        torch.testing.assert_close(a, b, **TOL)
    assert sum(dropped) >= 2  # the forward's two at least


def test_returned_products_never_alias_inputs_or_each_other(dropped):
    torch.manual_seed(0)
    x = torch.randn(8, 16)

    def f(x):
        y = x.sin()
        return x * 1, y * 1, y / 1, y, x.cos() * 1.0

    out = _compile(f)(x)
    for a, b in zip(out, f(x)):
        torch.testing.assert_close(a, b, **TOL)
    storages = [t.untyped_storage().data_ptr() for t in out] + [x.untyped_storage().data_ptr()]
    assert len(set(storages)) == len(storages)
    assert dropped == [1]  # only x.cos() * 1.0: a buffer of the graph's own no one else holds


def test_products_that_change_dtype_or_shape_stay():
    torch.manual_seed(0)
    i = torch.randint(-5, 5, (4, 6))
    row = torch.randn(1, 6)

    def f(i, row):
        return i * 1.0, (i * 1).sum(), row * torch.ones(3, 1) * 1, row.expand(3, 6) * 1

    out = _compile(f)(i, row)
    ref = f(i, row)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    out[3][0, 0] = 7.0  # a fresh tensor, as eager's: row is untouched
    assert row[0, 0] != 7.0


def test_training_output_times_one(dropped):
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)

    def f(x, w):
        h = (x @ w).relu()
        return h * 1.0, (h * 1).sum()

    out = _compile(f)(x, w)
    ref = f(x, w)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **TOL)
    g = torch.randn_like(ref[0])
    for a, b in zip(torch.autograd.grad(out[0].mul(g).sum() + out[1], (x, w)),
                    torch.autograd.grad(ref[0].mul(g).sum() + ref[1], (x, w))):
        torch.testing.assert_close(a, b, **TOL)
    assert out[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_graph_returning_a_size_compiles(dropped):
    """A graph whose outputs include a size (no storage: a dynamic decode step returns the
    cache's length) compiles: comparing storages with that output raised and sent Mistral's
    decode graphs eagerly."""
    torch.manual_seed(0)

    def f(x):
        return x.sin() * 1.0, x.shape[0] * 2

    torch._dynamo.reset()
    g = torch.compile(f, backend="pypto", dynamic=True, options={"strict": True})
    for n in (5, 7):
        x = torch.randn(n, 3)
        out, size = g(x)
        torch.testing.assert_close(out, x.sin(), **TOL)
        assert size == 2 * n
    assert sum(dropped) >= 1
