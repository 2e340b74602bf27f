"""Column sums computed by a row kernel over its rows (fusion.capacity.row_column_sums,
row_column_sums.column_sum_runs): bias and LayerNorm weight gradients in the LayerNorm
backward's kernel. Bit for bit the unfused column-sum kernel's sums (same 16-row runs,
same double totals, same split between threads), and eager's within dtype tolerances."""
from __future__ import annotations

import copy

import pytest
import torch

import pypto_inductor.fusion.planner as planner
from pypto_inductor.fusion.capacity import column_sum
from pypto_inductor.report import collect
from test_cpp_target import rand


class Block(torch.nn.Module):
    """Linear -> residual -> LayerNorm -> Linear: the LayerNorm backward's row kernel can
    sum the LayerNorm's weight and bias gradients and the first Linear's bias gradient."""

    def __init__(self, d: int):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(d, d), torch.nn.LayerNorm(d), \
            torch.nn.Linear(d, d)

    def forward(self, x):
        return self.b(self.norm(self.a(x) + x))


def _train(model, x, g, fused: bool, monkeypatch):
    monkeypatch.setattr(planner, "ROW_COLUMN_SUMS", fused)
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    with collect() as graphs:
        (torch.compile(model, backend="pypto", options={"target": "cpu", "fallback": "error"})(x)
         * g).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return grads, [gr for gr in graphs if gr.plan is not None and "backward" in gr.name]


def _tol(dtype, ref):
    if dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4 * max(ref.abs().max().item(), 1.0)}
    return {"rtol": 2e-2, "atol": 2e-2 * max(ref.abs().max().item(), 1.0)}


@pytest.mark.parametrize("nt,dtype,shape", [
    (1, torch.float32, (4, 64, 128)),
    (2, torch.float32, (4, 64, 128)),  # 256 rows >= 64 x 2: the column kernel splits rows
    (2, torch.float32, (3, 50, 256)),  # 150 rows: runs not a multiple of 16, parts of 75
    (1, torch.bfloat16, (2, 40, 64)),
    (2, torch.float16, (2, 30, 64)),
], ids=str)
def test_layernorm_backward_sums_columns_bit_identical(nt, dtype, shape, threads, monkeypatch):
    threads(nt)
    torch.manual_seed(0)
    model = Block(shape[-1]).to(dtype)
    x, g = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    ref = copy.deepcopy(model)
    (ref(x) * g).sum().backward()
    unfused, graphs_u = _train(model, x, g, False, monkeypatch)
    fused, graphs_f = _train(model, x, g, True, monkeypatch)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(fused[n], unfused[n], rtol=0, atol=0, msg=n)
        torch.testing.assert_close(fused[n], p.grad, msg=n, **_tol(dtype, p.grad))
    (gu,), (gf,) = graphs_u, graphs_f
    assert len(gf.plan.tiles) <= len(gu.plan.tiles) - 3, (gu.plan.tiles, gf.plan.tiles)
    # the LayerNorm backward's kernel: its row sums and three column sums
    sums = [sum(column_sum(op, gf.plan.graph) for op in t.ops) for t in gf.plan.tiles]
    assert 3 in sums, sums
    assert all(v["native"] for v in gf.compiled.kernel_native.values())
    fused_sums = [d for d in gf.plan.decisions if d.fused and "summing" in d.reason]
    assert fused_sums and all(d.roi is not None and d.roi.roi_score >= 1.0 for d in fused_sums)
    assert "column partials" in fused_sums[-1].reason, fused_sums[-1].reason


def _forward(fn, args, fused: bool, monkeypatch, dynamic=False):
    monkeypatch.setattr(planner, "ROW_COLUMN_SUMS", fused)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="pypto", dynamic=dynamic,
                             options={"target": "cpu", "fallback": "error"})
    with torch.no_grad(), collect() as graphs:
        out = compiled(*args)
    return out, graphs


@pytest.mark.parametrize("nt", [1, 2])
def test_row_kernel_and_column_sums_of_its_input(nt, threads, monkeypatch):
    """A softmax over rows and sums over its rows of the same scaled input (siblings), one
    of them cast to bf16 (the cast is the sum's store): one kernel."""
    threads(nt)

    def fn(x, w):
        h = x * w
        return torch.softmax(h, -1), h.sum((0, 1)), (h * h).sum((0, 1)).to(torch.bfloat16)

    x, w = rand(5, 77, 96), rand(96)
    ref = fn(x, w)
    unfused, _ = _forward(fn, (x, w), False, monkeypatch)
    fused, graphs = _forward(fn, (x, w), True, monkeypatch)
    for a, b, r in zip(fused, unfused, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, r, **_tol(r.dtype, r.float()))
    (g,) = graphs
    assert len(g.plan.tiles) == 1, [t.name for t in g.plan.tiles]


def test_column_sums_join_only_where_the_sums_match(monkeypatch):
    """Not fused: columns not a multiple of 16 (the column kernel's narrow blocks add in
    another order), and a column sum another op of the kernel would read (it is final only
    after the last row). The planner says why."""
    def fn(x):
        return torch.softmax(x, -1), x.sum(0)

    _, graphs = _forward(fn, (rand(64, 100),), True, monkeypatch)
    assert len(graphs[0].plan.tiles) == 2
    assert any("multiple of 16" in d.reason for d in graphs[0].plan.decisions)

    def reads(x):
        s = x.sum(0)
        return torch.softmax(x, -1) * s

    x = rand(64, 128)
    out, graphs = _forward(reads, (x,), True, monkeypatch)
    torch.testing.assert_close(out, reads(x))
    assert any("has only after its last row" in d.reason for d in graphs[0].plan.decisions)


def test_column_sums_in_row_kernel_dynamic_rows(monkeypatch):
    """Rows from a size symbol: the runs and parts are computed per call, one compile."""
    def fn(x, w):
        h = x * w
        return torch.log_softmax(h, -1), h.sum(0)

    monkeypatch.setattr(planner, "ROW_COLUMN_SUMS", True)
    compiled = torch.compile(fn, backend="pypto", dynamic=True,
                             options={"target": "cpu", "fallback": "error"})
    w = rand(64)
    for rows in (33, 130, 7):
        x = rand(rows, 64)
        with torch.no_grad():
            for a, r in zip(compiled(x, w), fn(x, w)):
                torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


class MLP(torch.nn.Module):
    """Linear -> GELU -> Linear: the first Linear's bias gradient sums GELU's backward,
    computed in the epilogue of the matmul before it, over a reshape ([B, T, H] as [B*T, H])."""

    def __init__(self, d: int, h: int, approximate: str):
        super().__init__()
        self.a, self.b, self.approximate = torch.nn.Linear(d, h), torch.nn.Linear(h, d), approximate

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x), approximate=self.approximate))


@pytest.mark.parametrize("nt,approximate,shape,h", [
    (1, "none", (2, 16, 64), 256),
    (2, "tanh", (2, 16, 64), 256),
    (2, "none", (4, 100, 32), 128),  # 400 rows >= 64 x 2: the column kernel splits rows
    (1, "tanh", (3, 7, 48), 96),  # 21 rows: a run of 16 and one of 5
    (2, "none", (300, 64), 64),  # 2-D: the sum reads the epilogue's own shape
], ids=str)
def test_gelu_backward_sums_bias_gradient_in_matmul_epilogue(nt, approximate, shape, h, threads,
                                                               monkeypatch):
    threads(nt)
    torch.manual_seed(0)
    model = MLP(shape[-1], h, approximate)
    x, g = rand(*shape), rand(*shape)
    ref = copy.deepcopy(model)
    (ref(x) * g).sum().backward()
    unfused, graphs_u = _train(model, x, g, False, monkeypatch)
    fused, graphs_f = _train(model, x, g, True, monkeypatch)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(fused[n], unfused[n], rtol=0, atol=0, msg=n)
        torch.testing.assert_close(fused[n], p.grad, msg=n, **_tol(torch.float32, p.grad))
    (gu,), (gf,) = graphs_u, graphs_f
    assert len(gf.plan.tiles) == len(gu.plan.tiles) - 1, (gu.plan.tiles, gf.plan.tiles)
    epilogue = [t for t in gf.plan.tiles if any(op.op == "matmul" for op in t.ops)
                and any(column_sum(op, gf.plan.graph) for op in t.ops)]
    assert len(epilogue) == 1 and any(op.op in ("erf", "tanh") for op in epilogue[0].ops)
    assert all(v["native"] for v in gf.compiled.kernel_native.values())
    (decision,) = [d for d in gf.plan.decisions if d.fused and "matmul epilogue summing" in d.reason]
    assert decision.roi.roi_score >= 1.0 and "column partials" in decision.reason


def _pointwise_sums(x, w):
    """An elementwise value [B, T, C] stored, and its columns summed through a reshape."""
    h = torch.tanh(x * w)
    return h, h.reshape(-1, h.shape[-1]).sum(0), (h * x).view(-1, h.shape[-1]).sum(0).to(
        torch.bfloat16)


def _cat_sums(q, k, v):
    """GPT-2's fused QKV projection backward: the gradients' cat, its bias gradient summed
    over a reshape of it."""
    c = torch.cat([q * 2.0, k, v], -1)
    return c, c.view(-1, c.shape[-1]).sum(0)


@pytest.mark.parametrize("nt", [1, 2])
@pytest.mark.parametrize("case", ["pointwise", "cat"])
def test_pointwise_kernel_sums_columns_of_a_reshape(nt, case, threads, monkeypatch):
    """A column sum over a reshape of a pointwise kernel's values (which a column kernel,
    iterating the sum's input shape, cannot hold) is computed over that kernel's rows:
    one kernel, the unfused sums' bits."""
    threads(nt)
    if case == "pointwise":
        fn, args = _pointwise_sums, (rand(3, 50, 96), rand(96))
    else:
        fn, args = _cat_sums, tuple(rand(4, 40, 32) for _ in range(3))
    ref = fn(*args)
    unfused, graphs_u = _forward(fn, args, False, monkeypatch)
    fused, graphs = _forward(fn, args, True, monkeypatch)
    for a, b, r in zip(fused, unfused, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, r, **_tol(r.dtype, r.float()))
    (g,), (gu,) = graphs, graphs_u
    assert len(g.plan.tiles) == 1 < len(gu.plan.tiles), [t.name for t in g.plan.tiles]
    assert all(v["native"] for v in g.compiled.kernel_native.values())
    assert any(d.fused and "pointwise kernel summing" in d.reason for d in g.plan.decisions)


def test_matmul_epilogue_sums_only_what_it_computes(monkeypatch):
    """A column sum of a matmul's input (a sibling reading the same value) or of its bare
    product stays a column-sum kernel: the epilogue pass would only read it again; and a
    sum over a reshape of columns not a multiple of 16 stays apart. The plan says why."""
    def sibling(x, w, y):
        return (x @ w) * y, x.sum(0)

    x, w, y = rand(64, 64), rand(64, 64), rand(64, 64)
    out, graphs = _forward(sibling, (x, w, y), True, monkeypatch)
    for a, r in zip(out, sibling(x, w, y)):
        torch.testing.assert_close(a, r)
    assert len(graphs[0].plan.tiles) == 2
    assert any("reads from memory" in d.reason for d in graphs[0].plan.decisions)

    def bare(x, w):
        return (x @ w).sum(0)

    _, graphs = _forward(bare, (x, w), True, monkeypatch)
    assert len(graphs[0].plan.tiles) == 2
    assert any("only epilogue is a column sum" in d.reason for d in graphs[0].plan.decisions)

    def narrow(x):
        h = x * 3.0
        return h, h.view(-1, 40).sum(0)

    x = rand(4, 30, 40)
    out, graphs = _forward(narrow, (x,), True, monkeypatch)
    torch.testing.assert_close(out[1], narrow(x)[1], rtol=1e-4, atol=1e-4)
    assert len(graphs[0].plan.tiles) == 2
    assert any("multiple of 16" in d.reason for d in graphs[0].plan.decisions)


def test_pointwise_kernel_sums_columns_dynamic_rows(monkeypatch):
    """Rows from size symbols (batch and sequence), constant columns: one kernel, one
    compile, the runs computed per call."""
    monkeypatch.setattr(planner, "ROW_COLUMN_SUMS", True)
    torch._dynamo.reset()

    def fn(x, w):
        h = torch.tanh(x * w)
        return h, h.reshape(-1, h.shape[-1]).sum(0)

    compiled = torch.compile(fn, backend="pypto", options={"target": "cpu", "fallback": "error"})
    w = rand(64)
    with torch.no_grad(), collect() as graphs:
        for b, t in ((2, 33), (3, 130), (4, 7)):
            x = rand(b, t, 64)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            for a, r in zip(compiled(x, w), fn(x, w)):
                torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    (g,) = graphs
    assert len(g.plan.tiles) == 1
