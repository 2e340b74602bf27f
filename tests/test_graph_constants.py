"""Graph constants and higher-order ops: one node never sends a whole graph to eager.

A tensor constant in a forward (FX ``get_attr``, e.g. a lifted ``torch.tensor``)
is a graph constant the runtime hands to kernels; a higher-order op
(``torch.cond``, ``flex_attention``, ``invoke_subgraph``, ``wrap_with_set_grad_enabled``,
``wrap_with_autocast``) runs as one extern step calling its subgraphs while the
rest of the graph compiles. Where a whole graph must still run eagerly, the
warning and the report name the node.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo

import pypto_inductor
from pypto_inductor.backend import UnsupportedOpsError, compile_graph
from pypto_inductor.report import collect

CONST = torch.tensor([1.0, -2.0, 3.0, 0.5])


def _with_constant(x):
    return (x * 2).relu() + torch.tensor([1.0, -2.0, 3.0, 0.5])


def _summary(graphs) -> dict:
    return pypto_inductor.FusionReport(graphs).to_dict()["summary"]


def _externs(graphs) -> dict[str, str]:
    out = {}
    for g in graphs:
        out.update(g.to_dict().get("extern_reasons", {}))
    return out


def _train(fn, inputs, compiled: bool):
    """Output and gradients of ``fn(*inputs)`` with a fixed random cotangent."""
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = (torch.compile(fn, backend="pypto") if compiled else fn)(*inputs)
    torch.manual_seed(123)
    grads = torch.autograd.grad(out, [x for x in inputs if x.requires_grad],
                                torch.randn_like(out))
    return out.detach(), grads


def _check_training(fn, *inputs, tol):
    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, grads = _train(fn, inputs, compiled=True)
    ref, ref_grads = _train(fn, inputs, compiled=False)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol(torch.float32))
    assert sorted(g.name.rsplit("_", 1)[-1] for g in graphs) == ["backward", "forward"]
    return graphs


# --- tensor constants -----------------------------------------------------------------
@pytest.mark.parametrize("target", ["cpu", "reference"])
def test_tensor_constant_is_a_kernel_input(run_both, target):
    x = torch.randn(3, 4)
    run = run_both(_with_constant, x, options={"target": target})
    assert run.summary["eager_graphs"] == 0
    assert run.fallback_ops() == {}
    graph = run.report.graphs[0].plan.graph
    assert list(graph.constants) == ["_tensor_constant0"]
    torch.testing.assert_close(graph.constants["_tensor_constant0"], CONST)
    tiles = run.report.to_dict()["graphs"][0]["fusion_tiles"]
    assert any("_tensor_constant0" in t.inputs for t in run.report.graphs[0].plan.tiles)
    assert len(tiles) == 1  # mul, relu, the constant's copy and add: one kernel


def test_tensor_constant_across_calls_and_sizes(tol):
    """The runtime refills the constant's slot every call (it is dropped after its last
    reader), and it broadcasts against inputs of any leading size."""
    compiled = torch.compile(_with_constant, backend="pypto", dynamic=True)
    with collect() as graphs:
        for rows in (3, 5, 3, 7):
            x = torch.randn(rows, 4)
            torch.testing.assert_close(compiled(x), _with_constant(x), **tol(torch.float32))
    assert _summary(graphs)["eager_graphs"] == 0


def test_tensor_constant_in_training(tol):
    def f(x, w):
        scale = torch.tensor([[0.5], [2.0], [-1.0]])
        return torch.tanh(x @ w) * scale + torch.tensor(3.0)

    graphs = _check_training(f, torch.randn(3, 8), torch.randn(8, 6), tol=tol)
    assert _summary(graphs)["eager_graphs"] == 0


def test_returned_constant_is_a_copy(tol):
    """A returned constant is the lifted copy: the caller mutating it changes nothing
    the next call computes or returns."""
    def f(x):
        c = torch.tensor([1.0, 2.0, 3.0])
        return x * c, c.t()

    compiled = torch.compile(f, backend="pypto")
    x = torch.randn(2, 3)
    with collect() as graphs:
        for _ in range(2):
            out, c = compiled(x)
            torch.testing.assert_close(out, f(x)[0], **tol(torch.float32))
            torch.testing.assert_close(c, torch.tensor([1.0, 2.0, 3.0]))
            c.mul_(100)
    assert _summary(graphs)["eager_graphs"] == 0


def test_module_constant_and_buffer(run_both):
    class Shift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("bias", torch.randn(16))

        def forward(self, x):
            return torch.sigmoid(x + self.bias) * torch.tensor([2.0]) - torch.tensor(0.25)

    run = run_both(Shift(), torch.randn(4, 16))
    assert run.summary["eager_graphs"] == 0 and run.fallback_ops() == {}


def test_integer_constant_used_as_an_index(run_both):
    def f(x):
        return x[:, torch.tensor([2, 0, 1])] * 3

    run = run_both(f, torch.randn(4, 3))
    assert run.summary["eager_graphs"] == 0


# --- higher-order ops -----------------------------------------------------------------
def _cond(x):
    y = x * 2
    return torch.cond(y.sum() > 0, lambda t: t.sin(), lambda t: t.cos() * 3, (y,)) + 1


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_runs_as_an_extern_step(tol, sign):
    x = torch.rand(4, 8) * sign  # the sign picks the branch
    graphs = _check_training(_cond, x, tol=tol)
    assert _summary(graphs)["eager_graphs"] == 0
    reasons = _externs(graphs)
    assert reasons and all(r.startswith("higher_order.cond: higher-order op") for r in
                           reasons.values())
    assert _summary(graphs)["kernels_fused"] >= 2  # the forward's mul/sum and the + 1


def test_cond_fallback_error_names_the_node():
    compiled = torch.compile(_cond, backend="pypto", options={"fallback": "error"})
    with pytest.raises(Exception, match=r"cond = higher_order\.cond") as info:
        compiled(torch.randn(4, 8))
    causes = []
    e = info.value
    while e is not None:
        causes.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None)
    assert any(isinstance(c, UnsupportedOpsError) for c in causes)


def test_flex_attention_runs_as_an_extern_step(run_both):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q, kv):
        return q >= kv

    mask = create_block_mask(causal, None, None, 32, 32, device="cpu")

    def attend(q, k, v):
        out = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j).abs(),
                             block_mask=mask)
        return out.relu() * 2

    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    run = run_both(attend, q, k, v)
    assert run.summary["eager_graphs"] == 0
    assert run.fallback_ops()["higher_order.flex_attention"] == 1
    assert run.summary["kernels_fused"] >= 1  # relu * 2 after it


def test_invoke_subgraph_forward_and_backward(tol):
    @torch.compiler.nested_compile_region
    def block(y):
        return torch.sin(y * 2) + y

    def f(x):
        return block(x) * block(x + 1)

    graphs = _check_training(f, torch.randn(6, 5), tol=tol)
    assert _summary(graphs)["eager_graphs"] == 0
    assert any("higher_order.invoke_subgraph" in r for r in _externs(graphs).values())


class _Regions(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = torch.sin(x) * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = x @ x.t()
        return torch.relu(x * y.sum()) + z.float().mean()


def test_set_grad_and_autocast_regions_run_as_extern_steps(tol):
    """torch.export's training IR keeps no_grad and autocast regions as the HOPs
    wrap_with_set_grad_enabled and wrap_with_autocast; compile such a graph directly."""
    x = torch.randn(6, 5)
    ep = torch.export.export(_Regions(), (x,))
    gm = ep.graph_module
    hops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"wrap_with_set_grad_enabled", "wrap_with_autocast"} <= hops
    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = compile_graph(gm, [x], pypto_inductor.parse_options(None), "inference")
        out = compiled([x])
    ref = ep.module()(x)
    torch.testing.assert_close(out[0], ref, **tol(torch.bfloat16))
    torch.testing.assert_close(out[0], _Regions()(x), **tol(torch.bfloat16))
    assert _summary(graphs)["eager_graphs"] == 0
    ops = graphs[0].to_dict()["fallback_ops"]
    assert ops["higher_order.wrap_with_set_grad_enabled"] == 1
    assert ops["higher_order.wrap_with_autocast"] == 1
    assert _summary(graphs)["kernels_fused"] >= 1  # relu(x * sum) + mean


def test_export_regions_compiled_end_to_end(tol):
    """The module torch.export returns, compiled: AOTAutograd inlines the regions."""
    x = torch.randn(6, 5, requires_grad=True)
    m = torch.export.export(_Regions(), (x.detach(),)).module()
    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(m, backend="pypto")(x)
        (g,) = torch.autograd.grad(out.sum(), x)
    ref = _Regions()(x)
    (ref_g,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(out, ref, **tol(torch.bfloat16))
    torch.testing.assert_close(g, ref_g, **tol(torch.bfloat16))
    assert _summary(graphs)["eager_graphs"] == 0


# --- data-dependent sizes: the op binding them runs eagerly, named in the report ---------
def test_data_dependent_size_op_runs_eagerly_and_is_named(tol):
    """The graph compiles in parts (lowering/unbacked.py); the part running ``nonzero``
    eagerly says why in the report."""
    def f(x):
        return torch.nonzero(x > 0).float() * 2

    x = torch.randn(5, 6)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), \
            collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("error")  # no graph runs eagerly as a whole
        out = torch.compile(f, backend="pypto")(x)
    torch.testing.assert_close(out, f(x), **tol(torch.float32))
    eager = [g.to_dict() for g in graphs if g.plan is None]
    assert len(eager) == 1 and "aten.nonzero" in eager[0]["eager_reason"], eager
    assert any(g.plan is not None for g in graphs)


def test_unbacked_size_training_asserts_its_size_predicates(tol):
    """The backward of a graph with an unbacked size gets the size as an input and asserts
    its range (``_assert_scalar(u0 >= 0)``): the predicate is a size expression, evaluated in
    the compiled backward (it once reached the assert as None and raised)."""
    def f(w, x):
        return (w * x)[torch.nonzero(x > 0, as_tuple=True)].pow(2).sum()

    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(8, 16)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), collect() as graphs, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(f, backend="pypto")(w, x)
        (g,) = torch.autograd.grad(out, w)
    ref = f(w, x)
    (ref_g,) = torch.autograd.grad(ref, w)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    torch.testing.assert_close(g, ref_g, **tol(torch.float32))
    backward = [d for d in (gr.to_dict() for gr in graphs) if d["name"].endswith("_backward")]
    assert backward and "eager_reason" not in backward[0], backward
