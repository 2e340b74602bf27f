"""cumsum lowered as a masked sum over the [n, n] triangle (lowering/reduction.py)."""
from __future__ import annotations

import warnings

import pytest
import torch

import pypto_inductor
from pypto_inductor.lowering.reduction import CUMSUM_MAX
from pypto_inductor.report import collect


def _compiled(fn, *args, dynamic=False):
    torch._dynamo.reset()
    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(fn, backend="pypto", dynamic=dynamic)(*args)
    return out, pypto_inductor.FusionReport(graphs).to_dict()["graphs"]


CASES = {
    # Whisper's decoder positions: a 0/1 mask's running count (exact)
    "int_mask_last": (lambda m: m.cumsum(-1) * m - 1, lambda: torch.randint(0, 2, (2, 16))),
    "float_middle": (lambda x: torch.cumsum(x * 2, 1) + 1, lambda: torch.randn(3, 7, 5)),
    "float_first_to_double": (lambda x: torch.cumsum(x, 0, dtype=torch.float64),
                              lambda: torch.randn(6, 4)),
    "bool_1d": (lambda x: torch.cumsum(x > 0, 0), lambda: torch.randn(5)),
    "scalar": (lambda x: torch.cumsum(x, 0) + 1, lambda: torch.tensor(3.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cumsum_matches_eager_with_no_extern_op(case):
    fn, make = CASES[case]
    x = make()
    out, graphs = _compiled(fn, x)
    ref = fn(x)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert all(not g["fallback_ops"] and not g.get("eager_reason") for g in graphs), graphs


def test_cumsum_backward_matches_eager():
    x = torch.randn(4, 12)
    w = torch.randn(4, 12)

    def f(x):
        return (torch.cumsum(x.tanh(), 1) * w).sum()

    leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch._dynamo.reset()
    with collect() as reports, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(f, backend="pypto")(leaf).backward()  # backward compiles here
    graphs = pypto_inductor.FusionReport(reports).to_dict()["graphs"]
    f(ref_leaf).backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, atol=1e-5, rtol=1e-5)
    assert {g["name"].rsplit("_", 1)[-1] for g in graphs} == {"forward", "backward"}
    # the forward's scan is lowered; the backward's (cumsum of the flipped gradient) too,
    # while aten.flip itself has no lowering yet and runs as an extern op
    assert all(set(g["fallback_ops"]) <= {"aten.flip.default"} for g in graphs), graphs


def test_long_or_symbolic_scans_run_atens_cumsum():
    """Past CUMSUM_MAX (n^2 work) or along a symbolic size, ATen's cumsum runs (extern)."""
    x = torch.randn(2, CUMSUM_MAX + 1)
    out, graphs = _compiled(lambda t: t.cumsum(1) * 2, x)
    torch.testing.assert_close(out, x.cumsum(1) * 2)
    assert any("aten.cumsum.default" in g["fallback_ops"] for g in graphs)
    y = torch.randn(3, 9)
    out, graphs = _compiled(lambda t: t.cumsum(1) * 2, y, dynamic=True)
    torch.testing.assert_close(out, y.cumsum(1) * 2, atol=1e-5, rtol=1e-5)
