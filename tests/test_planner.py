"""The fusion planner: capacity, dtype policy, ROI threshold, and the fusions it must find.

Every test also checks the compiled model against eager PyTorch (run_both), so a
plan is never only inspected, always executed.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from pypto_inductor import models
from pypto_inductor.ir import FusionTile, OpKind, TileOp


def _plans(run):
    return [g.plan for g in run.report.graphs if g.plan is not None]


def _decisions(run) -> list[dict]:
    return [d for g in run.report.to_dict()["graphs"] for d in g["decisions"]]


def _tile_of(plan, op_name: str) -> FusionTile:
    return next(t for t in plan.tiles if op_name in {op.name for op in t.ops})


def _ln_chain(dim=256, shape=(4, 16, 256)):
    torch.manual_seed(1)
    model = models.LayerNormGeluResidual(dim)
    with torch.no_grad():  # non-trivial affine parameters
        model.ln.weight.normal_()
        model.ln.bias.normal_()
    return model, torch.randn(*shape)


# --- (a) capacity -------------------------------------------------------------------------
def test_small_capacity_splits_kernels_and_says_why(run_both):
    model, x = _ln_chain()
    default = run_both(model, x)
    torch._dynamo.reset()
    small = run_both(model, x, options={"capacity_bytes": 4096})
    capacity_reasons = [d for d in _decisions(small) if "capacity" in d["reason"]]
    assert capacity_reasons, _decisions(small)
    assert all(not d["fused"] and d["roi"] is not None for d in capacity_reasons)
    assert small.summary["kernels_fused"] > default.summary["kernels_fused"]
    report = small.report.to_dict()
    for g in report["graphs"]:
        for t in g["fusion_tiles"]:
            assert t["capacity_bytes"] == 4096
            assert t["footprint_bytes"] <= 4096, t  # at this width even one row fits
    # The default capacity holds the whole chain.
    for g in default.report.to_dict()["graphs"]:
        assert all(t["footprint_bytes"] <= t["capacity_bytes"] for t in g["fusion_tiles"])


def test_a_row_too_long_for_capacity_is_flagged(run_both):
    """One reduction row over capacity cannot be split by fusion: the report says so."""
    model, x = _ln_chain(1024, (2, 8, 1024))
    run = run_both(model, x, options={"capacity_bytes": 4096})
    tiles = run.report.to_dict()["graphs"][0]["fusion_tiles"]
    over = [t for t in tiles if not t["fits"]]
    assert over and all(t["footprint_bytes"] > 4096 for t in over)
    assert all(t["fits"] == (t["footprint_bytes"] <= 4096) for t in tiles)
    assert all(len(t["ops"]) == 1 for t in over)  # merges never exceed the capacity
    text = str(run.report)
    assert all(f"over capacity: {t['name']}" in text for t in over)


def test_capacity_shrinks_tiles_before_splitting(run_both):
    """A pointwise chain under a small capacity keeps one kernel with a smaller tile."""
    def f(x, y):
        return torch.sigmoid(x * y + 1.0) * x - y

    x, y = torch.randn(64, 512), torch.randn(64, 512)
    big = run_both(f, x, y)
    torch._dynamo.reset()
    small = run_both(f, x, y, options={"capacity_bytes": 8192})
    (tb,), (ts,) = _plans(big)[0].tiles, _plans(small)[0].tiles
    assert len(tb.ops) == len(ts.ops) == 5
    assert ts.footprint_bytes <= 8192 < tb.footprint_bytes
    assert ts.tile_shape[0] * ts.tile_shape[1] < tb.tile_shape[0] * tb.tile_shape[1]


# --- (b) dtype policy ---------------------------------------------------------------------
def test_strict_dtype_policy_makes_casts_boundaries(run_both):
    torch.manual_seed(2)
    model = models.RMSNorm(256).half()
    with torch.no_grad():
        model.weight.normal_()
    x = torch.randn(4, 16, 256).half()
    strict = run_both(model, x, options={"dtype_policy": "strict"})
    torch._dynamo.reset()
    upcast = run_both(model, x)

    dtype_reasons = [d for d in _decisions(strict) if "dtype" in d["reason"]]
    assert dtype_reasons and all(not d["fused"] for d in dtype_reasons)
    assert all("float16" in d["reason"] and "float32" in d["reason"] for d in dtype_reasons)
    assert not [d for d in _decisions(upcast) if "dtype" in d["reason"]]
    assert upcast.summary["kernels_fused"] < strict.summary["kernels_fused"]

    # Under "upcast" the casts share a kernel with the fp32 reduction, which computes in
    # fp32 and says so.
    plan = _plans(upcast)[0]
    casts = [op for op in plan.graph.nodes if isinstance(op, TileOp) and op.kind is OpKind.CAST]
    reduction = next(op for op in plan.graph.nodes
                     if isinstance(op, TileOp) and op.kind is OpKind.REDUCTION)
    assert casts
    tile = _tile_of(plan, reduction.name)
    assert all(_tile_of(plan, c.name) is tile for c in casts)
    assert tile.dtype.startswith("float32") and "float16" in tile.dtype
    # Under "strict" no kernel mixes float dtypes except a lone cast.
    for tile in _plans(strict)[0].tiles:
        if len(tile.ops) > 1:
            assert not any(op.kind is OpKind.CAST for op in tile.ops), tile.op_names


# --- (c) no fusion ------------------------------------------------------------------------
@pytest.mark.parametrize("options,reason", [({"roi_threshold": 1e9}, "roi_threshold"),
                                            ({"fusion": False}, "fusion disabled")],
                         ids=["roi_threshold", "fusion_off"])
def test_no_fusion_options(options, reason, run_both):
    model, x = _ln_chain()
    run = run_both(model, x, options=options)
    s = run.summary
    assert s["kernels_fused"] == s["kernels_unfused"]
    assert s["gm_bytes_fused"] == s["gm_bytes_unfused"]
    decisions = _decisions(run)
    assert decisions and not any(d["fused"] for d in decisions)
    assert any(reason in d["reason"] for d in decisions)
    for tile in _plans(run)[0].tiles:
        assert len([op for op in tile.ops if not op.is_view]) == 1


def test_no_fusion_on_the_transformer_block(run_both):
    torch.manual_seed(0)
    model = models.TransformerBlock().eval()
    run = run_both(model, torch.randn(2, 8, 64), options={"fusion": False})
    assert run.summary["kernels_fused"] == run.summary["kernels_unfused"]


# --- (d) the fusions the default must find ------------------------------------------------
def test_layernorm_gelu_residual_is_one_kernel(run_both):
    model, x = _ln_chain()
    run = run_both(model, x)
    s = run.summary
    assert s["kernels_fused"] < s["kernels_unfused"]
    assert s["gm_bytes_fused"] < s["gm_bytes_unfused"]
    assert s["predicted_speedup"] > 1
    plan = _plans(run)[0]
    nodes = [n for n in plan.graph.nodes if isinstance(n, TileOp)]
    gelu = next(op for op in nodes if op.op == "gelu")
    residual = next(op for op in nodes if op.op == "add" and gelu.name in op.inputs)
    assert plan.graph.inputs[-1] in residual.inputs  # x + gelu(...)
    tile = _tile_of(plan, gelu.name)
    assert _tile_of(plan, residual.name) is tile
    assert any(op.kind is OpKind.REDUCTION for op in tile.ops)  # the layer-norm statistics
    assert len(plan.tiles) == 1
    # Only x and the affine parameters are read, and only the result written.
    assert tile.outputs == [residual.name]
    assert set(tile.inputs) == set(plan.graph.inputs)
    assert tile.gm_bytes < s["gm_bytes_unfused"] / 2
    fused = [d for d in _decisions(run) if d["fused"]]
    names = {op.name for op in tile.ops}
    # A merge may pull the kernels on paths between its two ends along with it.
    assert 1 <= len(fused) <= len(tile.ops) - 1
    assert all(d["producer"] in names and d["consumer"] in names for d in fused)


def test_matmul_epilogues_fuse(run_both):
    torch.manual_seed(0)
    run = run_both(models.MLP().eval(), torch.randn(8, 64))
    plan = _plans(run)[0]
    matmul_tiles = [t for t in plan.tiles if t.kind is OpKind.MATMUL]
    assert len(matmul_tiles) == 3  # one kernel per linear layer
    names = [t.op_names for t in matmul_tiles]
    assert ["matmul", "add", "gelu"] in names and ["matmul", "add", "relu"] in names
    rejected = [d for d in _decisions(run) if "prologue" in d["reason"]]
    assert rejected and not any(d["fused"] for d in rejected)


def test_gemm_bias_fuses_next_to_a_long_gemm(run_both):
    """The host's GEMM adds the bias (addmm): the pass it saves is scored against the
    pass, not diluted by the GEMM's compute (roi common_us), so even the attention's wide
    QKV projection takes its bias."""
    torch.manual_seed(0)
    run = run_both(models.TransformerBlock(128, 4, 512).eval(), torch.randn(2, 64, 128))
    plan = _plans(run)[0]
    qkv = next(t for t in plan.tiles if t.kind is OpKind.MATMUL
               and t.ops[0].out.shape[-1] == 3 * 128)
    assert qkv.op_names == ["matmul", "add"]
    decision = next(d for d in _decisions(run) if d["fused"] and d["consumer"] == qkv.ops[1].name)
    assert decision["roi"]["common_us"] > 0
    assert decision["roi"]["t_unfused_us"] / decision["roi"]["t_fused_us"] \
        < decision["roi"]["roi_score"]


class _ResidualBlock(torch.nn.Module):
    """conv -> BN -> ReLU -> conv -> BN, + the input, -> ReLU: ResNet's basic block."""

    def __init__(self, c: int):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)
        self.c2, self.b2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + x)


@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("bandwidth", [10e9, 36e9])
def test_relu_backward_masks_join_their_reader_at_any_bandwidth(bandwidth, absorb, monkeypatch):
    """ReLU's backward mask (``le``) next to BatchNorm's backward sums, the residual's
    gradient added in: the merge scores ~1.09 against the host's 1.1 (it saves the mask's
    write and read-back and a launch of a kernel reading much more), so whether it fused
    depended on the calibrated bandwidth. ``roi.ABSORB_POINTWISE``: a pointwise kernel
    absorbed whole fuses whenever it saves time; off, a lone ``le`` kernel is left."""
    from pypto_inductor import calibrate
    from pypto_inductor.fusion import roi
    from pypto_inductor.report import collect

    monkeypatch.setattr(roi, "ABSORB_POINTWISE", absorb)
    monkeypatch.setattr(calibrate, "host_numbers", lambda: {
        "gm_bandwidth_bytes_per_s": bandwidth, "launch_us": 1.25, "vector_flops_per_s": 3e10})
    calibrate.host_model.cache_clear()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(_ResidualBlock(16), _ResidualBlock(16))
        x = torch.randn(4, 16, 32, 32)
        twin = copy.deepcopy(model)
        with collect() as graphs:
            torch.compile(model, backend="pypto")(x).square().mean().backward()
    finally:
        calibrate.host_model.cache_clear()
    twin(x).square().mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    backward = next(g.plan for g in graphs if g.name.endswith("backward"))
    lone = [t for t in backward.tiles if t.op_names == ["le"]]
    assert bool(lone) != absorb, [t.op_names for t in backward.tiles]
    if absorb:
        fused = [d for d in backward.decisions if d.fused and "absorbs a pointwise" in d.reason]
        assert fused and all(d.roi.roi_score < 1.1 and d.roi.saving_us > 0 for d in fused)


def test_softmax_fuses_with_its_producers(run_both):
    def f(scores, bias):
        return torch.softmax(scores * 0.125 + bias, dim=-1) * 2.0

    run = run_both(f, torch.randn(2, 4, 16, 16), torch.randn(16, 16))
    plan = _plans(run)[0]
    assert len(plan.tiles) == 1
    assert plan.tiles[0].op_names == ["mul", "add", "softmax", "mul"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_fill_constant_folds_into_one_kernel(dtype, run_both):
    """masked_fill's 0-d fill value becomes a literal of the where: no kernel of its own."""
    def f(scores, mask):
        return torch.softmax((scores * 0.125).masked_fill(mask, float("-inf")), dim=-1)

    mask = torch.rand(16, 16) > 0.7
    mask[:, 0] = False  # no fully masked row (eager gives NaN there, as do we)
    run = run_both(f, torch.randn(2, 4, 16, 16, dtype=dtype), mask)
    plan = _plans(run)[0]
    assert [t.op_names for t in plan.tiles] == [["mul", "where", "softmax"]]
    assert all(op.op != "full" for op in plan.graph.nodes if isinstance(op, TileOp))


def test_copies_feeding_matmuls_read_contiguous_rows(run_both):
    """q @ k^T: the copy of the transposed K writes K's rows as they are and the bmm gets
    a transposed view, so no copy for the bmm reads with a stride; a copy that is
    returned stays contiguous."""
    def f(qkv):
        q, k, _ = qkv.split(32, dim=2)
        q = q.view(2, 8, 4, 8).transpose(1, 2)
        k = k.view(2, 8, 4, 8).transpose(1, 2)
        return q @ k.transpose(-2, -1), k.transpose(-2, -1).contiguous()

    run = run_both(f, torch.randn(2, 8, 96))
    assert run.out[1].is_contiguous()
    graph = _plans(run)[0].graph
    copies = [op for op in graph.nodes if isinstance(op, TileOp) and op.op == "copy"]
    assert len(copies) == 3  # q and k for the bmm, k^T for the output
    inner = [int(graph.specs[op.args[0]].stride[-1]) for op in copies]
    assert sorted(inner) == [1, 1, 96]  # only the returned k^T reads with a stride


def test_readers_of_views_of_one_value_are_siblings(run_both):
    """Ops reading different views of one value (the chunks of x here; attention's Q and
    K copies from the QKV output) are sibling candidates: one kernel call instead of two."""
    def f(x):
        a, b = x.chunk(2, dim=-1)
        return torch.sigmoid(a) * 2.0, torch.tanh(b) + 1.0

    plan = _plans(run_both(f, torch.randn(64, 32)))[0]
    assert len(plan.tiles) == 1, [t.op_names for t in plan.tiles]
    assert {"sigmoid", "tanh"} <= set(plan.tiles[0].op_names)


def test_rotary_cat_joins_its_consumers_on_the_host(run_both):
    """q * cos + cat(-q2, q1) * sin: on the host the cat is read part by part inside the
    kernel of the muls and the add; pypto has no cat, so ascend-a2 keeps it apart."""
    def f(y, cos, sin):
        q = y.view(2, 8, 4, 16).transpose(1, 2)
        return q * cos + models.rotate_half(q) * sin

    args = (torch.randn(2, 8, 64), torch.randn(8, 16), torch.randn(8, 16))
    host = _plans(run_both(f, *args))[0]
    assert any("cat" in t.op_names and "add" in t.op_names for t in host.tiles)
    ascend = _plans(run_both(f, *args, options={"hardware": "ascend-a2"}))[0]
    assert [t.op_names for t in ascend.tiles if "cat" in t.op_names] == [["cat"]]


# --- invariants of every plan -------------------------------------------------------------
def _check_plan_invariants(plan, threshold=None):
    threshold = threshold or plan.hardware.default_roi_threshold
    graph = plan.graph
    kernel_ops = [n for n in graph.nodes if isinstance(n, TileOp) and n.kind is not OpKind.LAYOUT]
    in_tiles = [op for t in plan.tiles for op in t.ops if op.kind is not OpKind.LAYOUT]
    # Every compute op is in exactly one kernel.
    assert sorted(map(id, kernel_ops)) == sorted(map(id, in_tiles))
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    defined = set(graph.inputs)
    for step in plan.steps:
        if isinstance(step, FusionTile):
            assert [order[id(op)] for op in step.ops] == sorted(order[id(op)] for op in step.ops)
            inside = {op.name for op in step.ops}
            for op in step.ops:  # every operand: a kernel input or defined inside
                assert all(n in inside or n in step.inputs for n in op.inputs)
            assert all(n in defined for n in step.inputs), (step.name, step.inputs)
            defined |= set(step.outputs)
            assert step.footprint_bytes > 0 and step.gm_bytes > 0
            if len([op for op in step.ops if not op.is_view]) > 1:
                assert step.footprint_bytes <= step.capacity_bytes
        else:
            assert all(n in defined for n in step.inputs), step
            defined |= {step.name} if isinstance(step, TileOp) else set(filter(None, step.outputs))
    assert all(o in defined for o in graph.outputs if isinstance(o, str))
    for d in plan.decisions:
        if d.fused:
            assert d.roi.roi_score >= threshold
        roi = d.to_dict()["roi"]
        if roi is not None:
            assert roi["roi_score"] > 0
            assert roi["bandwidth_saving_pct"] <= 100
            assert 0 <= roi["launch_overhead_reduction_pct"] <= 100


@pytest.mark.parametrize("name", ["mlp", "transformer", "llama", "conv_bn_relu",
                                  "ln_gelu_residual"])
def test_plan_invariants_on_the_zoo(name, run_both):
    model, inputs = models.build(name)
    torch.manual_seed(5)
    run = run_both(model, *(torch.randn_like(x) for x in inputs))
    plans = _plans(run)
    assert plans
    for plan in plans:
        _check_plan_invariants(plan)
    s = run.summary
    assert s["gm_bytes_fused"] <= s["gm_bytes_unfused"]
    assert s["kernels_fused"] <= s["kernels_unfused"]


def test_plan_invariants_on_a_backward_graph():
    graphs = _transformer_training_reports()
    assert {gr.name.rsplit("_", 1)[-1] for gr in graphs} == {"forward", "backward"}
    for gr in graphs:
        _check_plan_invariants(gr.plan)


def test_hardware_model_changes_capacity(run_both):
    model, x = _ln_chain()
    run = run_both(model, x, options={"hardware": "ascend-a2"})
    d = run.report.to_dict()
    for t in d["graphs"][0]["fusion_tiles"]:
        assert t["capacity_bytes"] == 192 * 1024  # Ascend A2 unified buffer


def test_buffering_scales_footprint(run_both):
    def f(x):
        return torch.relu(x * 2.0 + 1.0)

    x = torch.randn(16, 64)
    runs = {}
    for b in (1, 2, 3):
        torch._dynamo.reset()
        runs[b] = _plans(run_both(f, x, options={"buffering": b}))[0].tiles[0]
    assert runs[1].tile_shape == runs[2].tile_shape == runs[3].tile_shape
    assert runs[2].footprint_bytes == 2 * runs[1].footprint_bytes
    assert runs[3].footprint_bytes == 3 * runs[1].footprint_bytes


# --- random op DAGs under random planner options -------------------------------------------
# Values are [B, N], [B, 1], [1, N] or [N]: every pair broadcasts. Ops stay bounded
# (no exp/div), so fp32 results compare tightly at any depth.
_UNARY = [torch.tanh, torch.sigmoid, torch.relu, torch.neg, torch.abs, torch.sin]
_BINARY = [torch.add, torch.sub, torch.mul, torch.maximum]


def _random_program(draw):
    from hypothesis import strategies as st

    steps = []
    shapes = ["bn", "bn", "b1", "n"]  # the inputs
    for _ in range(draw(st.integers(2, 9))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "reduce", "softmax", "where"]))
        i = draw(st.integers(0, len(shapes) - 1))
        if kind == "unary":
            steps.append(("unary", draw(st.integers(0, len(_UNARY) - 1)), i))
            shapes.append(shapes[i])
        elif kind in ("binary", "where"):
            j = draw(st.integers(0, len(shapes) - 1))
            steps.append((kind, draw(st.integers(0, len(_BINARY) - 1)), i, j))
            pair = {shapes[i], shapes[j]}
            shapes.append(shapes[i] if len(pair) == 1 else "bn")
        elif kind == "reduce" and shapes[i] == "bn":
            op, dim = draw(st.sampled_from(["sum", "mean", "amax"])), draw(st.sampled_from([0, 1]))
            steps.append(("reduce", op, dim, i))
            shapes.append("b1" if dim == 1 else "1n")
        elif kind == "softmax" and shapes[i] == "bn":
            steps.append(("softmax", i))
            shapes.append("bn")
    outs = draw(st.lists(st.integers(0, len(shapes) - 1), min_size=0, max_size=2))
    return steps, outs + [len(shapes) - 1]


def _make_fn(program):
    steps, outs = program

    def f(a, b, c, d):
        vals = [a, b, c, d]
        for step in steps:
            kind = step[0]
            if kind == "unary":
                vals.append(_UNARY[step[1]](vals[step[2]]))
            elif kind == "binary":
                vals.append(_BINARY[step[1]](vals[step[2]], vals[step[3]]))
            elif kind == "where":
                x, y = vals[step[2]], vals[step[3]]
                vals.append(torch.where(x > 0, x, y * 0.5))
            elif kind == "reduce":
                vals.append(getattr(torch, step[1])(vals[step[3]], step[2], keepdim=True)
                            if step[1] != "amax" else vals[step[3]].amax(step[2], keepdim=True))
            else:
                vals.append(torch.softmax(vals[step[1]], -1))
        return tuple(vals[i] for i in outs)

    return f


def test_random_programs_under_random_options():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from pypto_inductor.report import collect

    options = st.fixed_dictionaries({}, optional={
        "capacity_bytes": st.sampled_from([256, 4096, 65536]),
        "roi_threshold": st.sampled_from([0.5, 1.2, 3.0]),
        "dtype_policy": st.sampled_from(["upcast", "strict"]),
        "buffering": st.sampled_from([1, 2, 3]),
    })

    @settings(max_examples=int(os.environ.get("PYPTO_TEST_EXAMPLES", 15)), deadline=None,
              database=None, derandomize=not os.environ.get("PYPTO_TEST_EXAMPLES"),
              suppress_health_check=list(HealthCheck))
    @given(program=st.composite(lambda draw: _random_program(draw))(), opts=options,
           b=st.integers(2, 9), n=st.integers(2, 40))
    def check(program, opts, b, n):
        torch._dynamo.reset()
        torch.manual_seed(b * 100 + n)
        args = (torch.randn(b, n), torch.randn(b, n), torch.randn(b, 1), torch.randn(n))
        f = _make_fn(program)
        with torch.no_grad(), collect() as graphs:
            out = torch.compile(f, backend="pypto", options=opts)(*args)
        torch.testing.assert_close(out, f(*args), atol=1e-5, rtol=1e-5)
        for g in graphs:
            if g.plan is not None:
                _check_plan_invariants(g.plan, opts.get("roi_threshold"))

    check()


@pytest.mark.parametrize("name", ["transformer", "llama"])
def test_closure_search_pruned_by_topological_order_plans_the_same(name, monkeypatch):
    """closure() stops its two searches outside the candidates' topological range: the
    same decisions and kernels as the full searches, and the model still matches eager."""
    from pypto_inductor.config import parse_options
    from pypto_inductor.fusion import planner
    from pypto_inductor.calibrate import hardware_model
    from pypto_inductor.report import collect

    model, inputs = models.build(name)
    torch.manual_seed(6)
    inputs = [torch.randn_like(x) for x in inputs]
    with torch.no_grad(), collect() as graphs:
        out = torch.compile(model, backend="pypto")(*inputs)
    torch.testing.assert_close(out, model(*inputs), atol=1e-5, rtol=1e-5)
    config = parse_options({})
    hw = hardware_model(config.hardware_name, config.capacity_bytes)

    def signature(graph):
        plan = planner.plan_fusion(graph, hw, config)
        return ([(d.producer, d.consumer, d.fused, d.reason) for d in plan.decisions],
                [[op.name for op in t.ops] for t in plan.tiles])

    graphs = [g.plan.graph for g in graphs if g.plan is not None]
    assert graphs
    pruned = [signature(g) for g in graphs]
    monkeypatch.setattr(planner.Planner, "topological", lambda self, succ, pred: None)
    assert [signature(g) for g in graphs] == pruned


def _transformer_training_reports():
    """The GraphReports of a small transformer block's training step (static sizes)."""
    from pypto_inductor.report import collect

    torch.manual_seed(0)
    model = models.TransformerBlock(dim=32, heads=2, hidden=64)
    x = torch.randn(2, 8, 32, requires_grad=True)
    with collect() as graphs:
        out = torch.compile(model, backend="pypto")(x)
        (g,) = torch.autograd.grad(out.square().sum(), [x])
    (ref,) = torch.autograd.grad(model(x).square().sum(), [x])
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
    return [gr for gr in graphs if gr.plan is not None]


def _transformer_training_graphs():
    return [gr.plan.graph for gr in _transformer_training_reports()]


def test_group_edges_follow_every_merge(monkeypatch):
    """merge() contracts the merged groups in the group edges it keeps (not rebuilt per
    greedy iteration): after every merge they are the edges rebuilt from the ops."""
    from pypto_inductor.config import parse_options
    from pypto_inductor.fusion import planner
    from pypto_inductor.hardware import get_hardware

    merges = []
    merge = planner.Planner.merge

    def checked(self, gids):
        merge(self, gids)
        assert self.group_edges() == self.rebuilt_group_edges()
        merges.append(gids)

    monkeypatch.setattr(planner.Planner, "merge", checked)
    for graph in _transformer_training_graphs():
        planner.plan_fusion(graph, get_hardware("host"), parse_options({}))
    assert len(merges) > 5


@pytest.mark.parametrize("hardware", ["host", "ascend-a2"])
def test_tiles_sized_without_sympy(hardware, monkeypatch):
    """plan_tile sizes a tile in plain integers (planning GPT-2's step sizes ~1000
    candidate tiles, each substitution in sympy ~0.5 ms): no sympy substitution on static
    sizes, and each kept tile's bytes are its footprint expression at its tile shape
    (ascend-a2: per-op footprints and a largest-buffer limit)."""
    import sys

    import sympy

    from pypto_inductor.config import parse_options
    from pypto_inductor.fusion import capacity, planner
    from pypto_inductor.hardware import get_hardware

    graphs = _transformer_training_graphs()
    subs = []
    real_subs = sympy.Basic.subs

    def counted(self, *args, **kwargs):  # called by our code (sympy's Max calls it itself)
        if "pypto_inductor" in sys._getframe(1).f_code.co_filename:
            subs.append(self)
        return real_subs(self, *args, **kwargs)

    monkeypatch.setattr(sympy.Basic, "subs", counted)
    plans = [planner.plan_fusion(g, get_hardware(hardware), parse_options({})) for g in graphs]
    monkeypatch.undo()
    assert subs == []
    tiles = [t for plan in plans for t in plan.tiles]
    assert any(t.kind is OpKind.MATMUL for t in tiles) and len(tiles) > 5
    for t in tiles:
        names = ((capacity.TILE_M, capacity.TILE_N, capacity.TILE_K)
                 if len(t.tile_shape) == 3 else (capacity.TILE_ROWS, capacity.TILE_COLS))
        at = dict(zip(names, t.tile_shape))
        assert t.footprint_expr.free_symbols <= set(names), t.footprint_expr
        assert int(t.footprint_expr.subs(at)) == t.footprint_bytes, (t.name, t.footprint_expr)


def _resnet_training_graphs():
    """The forward and backward TileGraphs of the zoo's ResNet training step."""
    from pypto_inductor import zoo
    from pypto_inductor.report import collect

    model = zoo.build("resnet").train()
    batch = zoo.batch("resnet", seed=3)
    with collect() as graphs:
        torch.compile(model, backend="pypto")(**batch)["loss"].backward()
    return [gr.plan.graph for gr in graphs if gr.plan is not None]


def test_incremental_greedy_loop_plans_the_same(monkeypatch):
    """The greedy loop re-evaluating only the candidates a merge can change, closures from
    reach.GroupReach's bitsets (planner.INCREMENTAL): the same decisions, reasons and
    kernels as evaluating every candidate after every merge with searched closures; and
    after every merge the bitsets hold exactly the groups the searches reach."""
    from pypto_inductor.config import parse_options
    from pypto_inductor.fusion import planner
    from pypto_inductor.hardware import get_hardware

    config, hw = parse_options({}), get_hardware("host")
    merge = planner.Planner.merge
    checked = []

    def merge_and_check(self, gids):
        merge(self, gids)
        if self.reach is not None:
            succ, pred = self.group_edges()
            for g in succ:
                assert set(planner.bit_members(self.reach.desc[g])) == self._reach({g}, succ)
                assert set(planner.bit_members(self.reach.anc[g])) == self._reach({g}, pred)
            checked.append(len(gids))

    def signature(graph):
        plan = planner.plan_fusion(graph, hw, config)
        return ([(d.producer, d.consumer, d.fused, d.reason) for d in plan.decisions],
                [[op.name for op in t.ops] for t in plan.tiles])

    graphs = _transformer_training_graphs() + _resnet_training_graphs()
    monkeypatch.setattr(planner.Planner, "merge", merge_and_check)
    incremental = [signature(g) for g in graphs]
    assert checked and any(n > 2 for n in checked)  # merges of views and closures included
    monkeypatch.setattr(planner, "INCREMENTAL", False)
    assert [signature(g) for g in graphs] == incremental
