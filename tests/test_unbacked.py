"""Graphs with data-dependent sizes (Dynamo's capture_dynamic_output_shape_ops and
capture_scalar_outputs) compile in parts split after each op binding such a size
(lowering/unbacked.py): only those ops run eagerly, the rest compiles, and the results and
gradients match eager on fresh random inputs whose data-dependent sizes differ per call."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pypto_inductor.report import collect

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def capture():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True,
                                    capture_scalar_outputs=True):
        torch._dynamo.reset()
        yield
    torch._dynamo.reset()


class MoE(nn.Module):
    """Top-1 routing as MoE layers write it: per expert, ``nonzero`` of its tokens, a gather,
    the expert and an ``index_add`` back."""

    def __init__(self, d=32, experts=4):
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx = (choice == i).nonzero().squeeze(-1)
            out = out.index_add(0, idx, F.gelu(expert(x[idx])))
        return out.relu()


def _no_eager_graphs(caught):
    assert not [w for w in caught if "runs eagerly" in str(w.message)], \
        [str(w.message) for w in caught]


def test_moe_routing_compiles_in_parts():
    torch.manual_seed(0)
    m = MoE().eval()
    f = torch.compile(m, backend="pypto")
    with warnings.catch_warnings(record=True) as caught, collect() as reports, \
            torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(3):  # other routings: other data-dependent sizes, one compile
            x = torch.randn(48, 32)
            torch.testing.assert_close(f(x), m(x), **TOL)
    _no_eager_graphs(caught)
    compiled = [r for r in reports if r.plan is not None]
    eager = [r for r in reports if r.plan is None]
    assert len(eager) == 4 and len(compiled) == 5  # a nonzero per expert, the parts between
    assert all("_submod_" in r.plan.graph.name for r in compiled)


def test_item_as_a_size():
    torch.manual_seed(0)

    def f(x, n):
        return x[:n.item()].cos().sum(0) * 2

    compiled = torch.compile(f, backend="pypto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in (10, 3, 17):
            x = torch.randn(20, 8)
            torch.testing.assert_close(compiled(x, torch.tensor(k)), f(x, torch.tensor(k)),
                                       **TOL)
    _no_eager_graphs(caught)


def test_moe_training_matches_eager():
    torch.manual_seed(0)
    m = MoE().train()
    f = torch.compile(m, backend="pypto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(40, 32, requires_grad=True)
            g = torch.randn(40, 32)
            wrt = [x, *m.experts.parameters()]  # the router's argmax passes no gradient
            got = torch.autograd.grad(f(x), wrt, g)
            ref = torch.autograd.grad(m(x), wrt, g)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, **TOL)
    _no_eager_graphs(caught)


def test_fallback_error_names_the_data_dependent_op():
    f = torch.compile(lambda x: x[x > 0].sin(), backend="pypto", options={"fallback": "error"})
    with pytest.raises(Exception, match="UnsupportedOpsError.*aten.index.*depend on data"):
        f(torch.randn(16))
