"""pypto tile kernels and pypto's simulator (RunMode.SIM).

Every op family the pypto emitter claims is compiled and simulated by pypto
0.2.0 here, out of process; a fused add -> mul -> relu chain simulates fewer
cycles than its three separate kernels; ``report(..., options={"simulate":
True})`` fills the per-tile simulation fields. The module skips when pypto is
not installed (CI installs it through the ``pypto`` extra).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

import pytest
import sympy
import torch
import torch.nn.functional as F

if importlib.util.find_spec("pypto") is None:
    pytest.skip("pypto is not installed (pip install 'pypto-inductor[pypto]')",
                allow_module_level=True)

import pypto_inductor  # noqa: E402
from pypto_inductor import hardware  # noqa: E402
from pypto_inductor.codegen import TargetUnavailable  # noqa: E402
from pypto_inductor.codegen import pypto as npu  # noqa: E402
from pypto_inductor.codegen.pypto import sim as pypto_sim  # noqa: E402
from pypto_inductor.codegen.pypto.emit import (  # noqa: E402
    PyptoEmitError, emit_tile, single_op_tile, split_tile)
from pypto_inductor.models import LayerNormGeluResidual  # noqa: E402

R, C = 64, 256


def rand_x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# name -> (function, inputs, tile ops that must be in the emitted kernels)
FAMILIES = {
    "unary": (lambda x: torch.exp(x) + torch.relu(x) + torch.sigmoid(x) + torch.sqrt(x.abs())
              + torch.rsqrt(x.abs() + 1) + torch.log(x.abs() + 1) - torch.neg(x)
              + torch.reciprocal(x + 3), (rand_x(R, C),), {"exp", "relu", "sigmoid", "rsqrt", "log"}),
    "rounding_trig": (lambda x: torch.sin(x) + torch.cos(x) + torch.floor(x) + torch.ceil(x)
                      + torch.trunc(x) + torch.round(x) + torch.sign(x) + torch.exp2(x)
                      + torch.expm1(x) + torch.log1p(x.abs()), (rand_x(R, C),),
                      {"sin", "floor", "exp2", "log1p"}),
    "activations": (lambda x: torch.tanh(x) + F.silu(x) + F.gelu(x) + F.gelu(x, approximate="tanh")
                    + F.leaky_relu(x, 0.1) + F.hardswish(x) + F.hardsigmoid(x) + F.softplus(x)
                    + F.elu(x) + F.mish(x) + torch.erf(x), (rand_x(R, C),),
                    {"tanh", "gelu", "silu", "leaky_relu", "softplus", "elu", "erf"}),
    "binary_scalar": (lambda x, y: (x + y) * (x - y) / (y.abs() + 1) + torch.maximum(x, y)
                      + torch.minimum(x, y) + x ** 2 + (2.0 - x) + 3.0 / (x.abs() + 1)
                      + torch.pow(x.abs(), 1.5), (rand_x(R, C), rand_x(R, C)),
                      {"add", "sub", "mul", "div", "maximum", "pow"}),
    "compare_where": (lambda x, y: torch.where(x > y, x, y) + torch.where(x <= 0.5, 1.0, x)
                      + torch.clamp(x, -1, 1) + (x == y).float(), (rand_x(R, C), rand_x(R, C)),
                      {"gt", "where", "clamp", "eq"}),
    "cast_fp16": (lambda x: (x.float() * 2).half() + x, (rand_x(R, C, dtype=torch.float16),),
                  {"cast"}),
    "cast_int": (lambda x: (x * 10).to(torch.int32).float() + x, (rand_x(R, C),), {"cast"}),
    # float -> bool is "nonzero", not a rounded cast (0.3 is True)
    "cast_bool": (lambda x: (x * 0.3).bool().float() + x, (rand_x(R, C),), {"cast"}),
    "cast_int_bool": (lambda m, x: torch.where(m.bool(), x, 0.0),
                      (torch.randint(-3, 3, (R, C)), rand_x(R, C)), {"cast", "where"}),
    "broadcast": (lambda x, b: torch.relu(x + b) * b, (rand_x(R, C), rand_x(C)), {"add"}),
    "reductions": (lambda x: x.sum(-1, keepdim=True) + x.mean(-1, keepdim=True)
                   + x.amax(-1, keepdim=True) + x.amin(-1, keepdim=True)
                   + x.var(-1, keepdim=True), (rand_x(R, C),), {"sum", "mean", "amax", "amin", "var"}),
    "reduce_leading": (lambda x: x.sum(0), (rand_x(R, C),), {"sum"}),
    "softmax": (lambda x: torch.softmax(x, -1), (rand_x(R, C),), {"softmax"}),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), (rand_x(R, C),), {"log_softmax"}),
    "rms_norm": (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
                 (rand_x(R, C), rand_x(C)), {"pow", "mean", "rsqrt"}),
    "matmul": (lambda a, b: a @ b, (rand_x(R, C), rand_x(C, 128)), {"matmul"}),
    "matmul_epilogue": (lambda a, b, bias: torch.relu(torch.addmm(bias, a, b)),
                        (rand_x(R, C), rand_x(C, 128), rand_x(128)), {"matmul", "add", "relu"}),
    "matmul_fp16": (lambda a, b: torch.relu(a @ b),
                    (rand_x(R, C, dtype=torch.float16), rand_x(C, 128, dtype=torch.float16)),
                    {"matmul", "relu"}),
    "bmm": (lambda a, b: torch.bmm(a, b), (rand_x(4, R, 128), rand_x(4, 128, R)), {"matmul"}),
}


def plan_of(fn, *inputs):
    rep = pypto_inductor.report(fn, *inputs, options={"hardware": "ascend-a2"})
    (graph,) = rep.graphs
    return graph.plan


@pytest.fixture(scope="module")
def sim_cache(tmp_path_factory):
    """A fresh simulation cache: every simulation in this module really runs."""
    old = os.environ.get("PYPTO_INDUCTOR_CACHE_DIR")
    os.environ["PYPTO_INDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("pypto_cache"))
    yield Path(os.environ["PYPTO_INDUCTOR_CACHE_DIR"])
    if old is None:
        os.environ.pop("PYPTO_INDUCTOR_CACHE_DIR", None)
    else:
        os.environ["PYPTO_INDUCTOR_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def families(sim_cache, tmp_path_factory):
    """Every family's kernels emitted and simulated in one batch: name -> [(kernel, result)]."""
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))  # nothing may land in the caller's directory
    try:
        kernels, owners, ops = [], [], {}
        for name, (fn, inputs, _) in FAMILIES.items():
            plan = plan_of(fn, *inputs)
            ops[name] = {op.op for tile in plan.tiles for op in tile.ops}
            for tile in plan.tiles:
                kernels.append(emit_tile(tile, plan.graph))
                owners.append(name)
        results = pypto_sim.simulate_kernels(kernels)
        assert not Path("output").exists()
    finally:
        os.chdir(cwd)
    out: dict = {name: [] for name in FAMILIES}
    for name, kernel, result in zip(owners, kernels, results):
        out[name].append((kernel, result))
    return out, ops


@pytest.mark.parametrize("family", list(FAMILIES))
def test_op_family_compiles_and_simulates(families, family):
    by_family, ops = families
    assert FAMILIES[family][2] <= ops[family], f"{family} lowered to {sorted(ops[family])}"
    assert by_family[family], f"{family} produced no FusionTile"
    for kernel, result in by_family[family]:
        assert "@pypto.frontend.jit" in kernel.source
        assert result.error is None, f"{kernel.name}:\n{kernel.source}\n{result.error}"
        assert isinstance(result.cycles, int) and result.cycles > 0
        assert result.pto_ir_path and Path(result.pto_ir_path).is_file()


def test_dtype_mapping_and_tile_shapes(families):
    by_family, _ = families
    (kernel, _), = by_family["cast_fp16"]
    assert "pypto.DT_FP16" in kernel.source and "pypto.cast(" in kernel.source
    (kernel, _), = by_family["cast_int"]
    assert "pypto.DT_INT32" in kernel.source
    # The fitted A2 ROI model (docs/ascend_calibration.md) keeps this small matmul apart
    # from its add -> relu epilogue (pypto simulates them fused 1% slower): the matmul kernel.
    kernel = next(k for k, _ in by_family["matmul_epilogue"] if "pypto.matmul(" in k.source)
    assert "pypto.set_cube_tile_shapes(" in kernel.source and "pypto.matmul(" in kernel.source
    assert all(t % 16 == 0 for pair in kernel.cube_tile for t in pair)
    (kernel, _), = by_family["softmax"]
    assert "pypto.softmax(" in kernel.source
    (kernel, _), = by_family["rms_norm"]
    assert "pypto.rms_norm(" in kernel.source  # the decomposed chain matched as one op
    for runs in by_family.values():
        for kernel, _ in runs:
            assert "pypto.set_vec_tile_shapes(" in kernel.source
            assert len(kernel.vec_tile) >= 2


def test_fused_chain_simulates_fewer_cycles_than_separate_kernels(sim_cache):
    x, y, z = (rand_x(512, 1024) for _ in range(3))
    plan = plan_of(lambda x, y, z: torch.relu((x + y) * z), x, y, z)
    (tile,) = plan.tiles
    assert tile.op_names == ["add", "mul", "relu"]
    sim = pypto_sim.simulate_tile(tile, plan.graph, plan.hardware)
    assert sim.simulation_error is None, sim.simulation_error
    assert set(sim.unfused_cycles_by_op) == {op.name for op in tile.ops}
    assert sim.simulated_cycles_unfused == sum(sim.unfused_cycles_by_op.values())
    assert 0 < sim.simulated_cycles_fused < sim.simulated_cycles_unfused


def test_report_simulate_fills_tile_fields(sim_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = LayerNormGeluResidual(256).eval()
    rep = pypto_inductor.report(model, torch.randn(4, 16, 256), options={"simulate": True})
    d = rep.to_dict()
    assert d["hardware"]["name"] == "ascend-a2"  # simulate defaults the hardware to the NPU
    tiles = [t for g in d["graphs"] for t in g["fusion_tiles"]]
    assert tiles
    for t in tiles:
        assert t["simulation_error"] is None, t["simulation_error"]
        assert "@pypto.frontend.jit" in t["pypto_source"]
        assert t["simulated_cycles_fused"] > 0
        if len(t["ops"]) > 1:
            assert t["simulated_cycles_unfused"] > t["simulated_cycles_fused"]
        else:
            assert t["simulated_cycles_unfused"] is None
        assert Path(t["pto_ir_path"]).is_file()
        trace = Path(t["perfetto_trace_path"])  # kept in the cache beside the stat report
        assert trace.is_file() and trace.parent == Path(t["pto_ir_path"]).parent
        assert '"traceEvents"' in trace.read_text()[:200]
    html_text = rep.save(tmp_path / "report.html").read_text()
    for t in tiles:
        assert Path(t["perfetto_trace_path"]).resolve().as_uri() in html_text
    assert html_text.count(">perfetto trace</a>") == len(tiles)
    summary = d["summary"]
    assert summary["simulated_speedup"] > 1.0
    assert summary["simulation_failures"] == 0
    assert "simulated_speedup" in str(rep)
    assert not (tmp_path / "output").exists()


def test_op_without_pypto_form_is_recorded_not_raised(sim_cache):
    plan = plan_of(lambda x: torch.argmax(x, -1), rand_x(R, C))
    (tile,) = plan.tiles
    with pytest.raises(PyptoEmitError, match="argmax has no pypto form"):
        emit_tile(tile, plan.graph)
    sims = pypto_sim.simulate_plan(plan)
    assert sims[tile.name].simulation_error.startswith("split: argmax has no pypto form")
    assert sims[tile.name].simulated_cycles_fused is None


def test_failed_kernel_is_an_error_string_and_the_batch_goes_on(sim_cache):
    plan = plan_of(lambda x: torch.relu(x), rand_x(R, C))
    good = emit_tile(plan.tiles[0], plan.graph)
    bad = dataclasses.replace(good, source=good.source.replace("pypto.relu(", "pypto.no_such_op("))
    results = pypto_sim.simulate_kernels([bad, good], workers=1)
    assert results[0].cycles is None and "no_such_op" in results[0].error
    assert results[1].error is None and results[1].cycles > 0


def test_single_op_tile_and_npu_build_path(families):
    plan = plan_of(lambda x, y: torch.relu(x + y), rand_x(R, C), rand_x(R, C))
    (tile,) = plan.tiles
    one = single_op_tile(tile.ops[1], plan.graph, tile.tile_shape, plan.hardware)
    assert one.ops == [tile.ops[1]] and one.outputs == [tile.ops[1].name]
    kernel = emit_tile(tile, plan.graph, run_mode="NPU")
    assert "RUN_MODE = pypto.RunMode.NPU" in kernel.source
    launcher = npu.PyptoLauncher(kernel.to_json(), fn=lambda *args: None)
    x = torch.randn(R, C)
    with pytest.raises(ValueError, match="static shapes"):
        launcher([x, torch.randn(R + 1, C)])
    (out,) = launcher([x, x])
    assert out.shape == (R, C)
    if npu.missing_requirements():
        with pytest.raises(TargetUnavailable, match="torch_npu"):
            npu.build(tile, plan.graph)


def test_ascend_model_reads_pypto_ini(monkeypatch):
    hw = hardware.ascend_a2()
    d = dict(hw.details)
    assert d["source"] == "pypto A2A3.ini"
    assert hw.vector_capacity_bytes == 196608 and hw.cube_capacity_bytes == 524288
    assert d["l0a_bytes"] == 65536 and d["l0c_bytes"] == 131072 and d["cube_cores"] == 24
    assert d["freq_hz"] == 1.85e9 and d["ub_to_ddr_bytes_per_cycle"] == 64
    monkeypatch.setattr(hardware, "pypto_a2a3_ini", lambda: {})
    fallback = hardware.ascend_a2()
    assert dict(fallback.details)["source"] == "built-in"
    assert (fallback.vector_capacity_bytes, fallback.cube_flops_per_s) == \
        (hw.vector_capacity_bytes, hw.cube_flops_per_s)


# --- dynamic sizes: rows from the graph's size symbols, one kernel source for every size ------
def _simulate_both_sizes(out: dict) -> dict:
    """name -> (kernel, small, large) to name -> (kernel, small, large, their results)."""
    results = iter(pypto_sim.simulate_kernels([k for _, s, l in out.values() for k in (s, l)]))
    return {name: (k, s, l, next(results), next(results)) for name, (k, s, l) in out.items()}


def dynamic_tiles(fn, x, *rest):
    """FusionTiles of ``fn`` with x's leading two dims dynamic (the trailing one static)."""
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    plan = plan_of(fn, x, *rest)
    return plan, plan.graph.specs[plan.graph.inputs[-1 - len(rest)]].shape


DYNAMIC = {
    "broadcast": lambda x, b: torch.relu(x + b) * b,
    "row_reduction": lambda x, w: (torch.softmax(x, -1) * w + x.amax(-1, keepdim=True),
                                   x.sum(-1)),
}


@pytest.fixture(scope="module")
def dynamic_runs(sim_cache):
    """Each dynamic kernel simulated at two sizes in one batch: name -> (kernel, results)."""
    out = {}
    for name, fn in DYNAMIC.items():
        plan, x_shape = dynamic_tiles(fn, rand_x(4, 48, C), rand_x(C))
        (tile,) = plan.tiles
        kernel = emit_tile(tile, plan.graph)
        rows = x_shape[:2]  # (s0, s1): the tile's rows are s0*s1
        assert all(isinstance(s, sympy.Symbol) for s in rows), x_shape
        small = kernel.at_sizes({rows[0]: 2, rows[1]: 50})
        large = kernel.at_sizes({rows[0]: 8, rows[1]: 512})
        out[name] = (kernel, small, large)
    return _simulate_both_sizes(out)


@pytest.mark.parametrize("name", list(DYNAMIC))
def test_dynamic_kernel_simulates_at_two_sizes_with_one_source(dynamic_runs, name):
    kernel, small, large, r_small, r_large = dynamic_runs[name]
    src = kernel.source
    assert kernel.dynamic and small.source == large.source == src
    assert 'R = pypto.frontend.dynamic("R")' in src and "pypto.Tensor((R, 256)" in src
    assert "pypto.loop(" in src and "pypto.view(" in src and "pypto.assemble(" in src
    assert small.inputs[0].graph_shape == (2, 50, C) and small.inputs[0].shape == (100, C)
    assert large.inputs[0].graph_shape == (8, 512, C) and large.inputs[0].shape == (4096, C)
    for r in (r_small, r_large):
        assert r.error is None, f"{src}\n{r.error}"
        assert r.cycles > 0 and Path(r.perfetto_trace_path).is_file()
    assert r_large.cycles > r_small.cycles  # 41x the rows
    print(f"{name}: {r_small.cycles} cycles at 100 rows, {r_large.cycles} at 4096")


def test_dynamic_launcher_reshapes_per_call():
    plan, _ = dynamic_tiles(DYNAMIC["row_reduction"], rand_x(4, 48, C), rand_x(C))
    (tile,) = plan.tiles
    kernel = emit_tile(tile, plan.graph, run_mode="NPU")
    seen = []
    launcher = npu.PyptoLauncher(kernel.to_json(), fn=lambda *args: seen.append(
        [tuple(a.shape) for a in args]))
    for b, s in ((2, 50), (3, 7)):
        outs = launcher([torch.randn(b, s, C), torch.randn(C)],
                        [(b, s, C), (b, s)])
        assert [tuple(o.shape) for o in outs] == [(b, s, C), (b, s)]
        assert seen[-1] == [(b * s, C), (1, C), (b * s, C), (b * s, 1)]
    with pytest.raises(ValueError, match="does not fit"):
        launcher([torch.randn(5, C + 1), torch.randn(C)])


# --- dynamic columns / reduced length: passes over column chunks, reductions accumulated ----
def _mark(x, *dims):
    for d in dims:
        torch._dynamo.mark_dynamic(x, d)
    return x


def _layer_norm_var(x, w):
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5) * w


# name -> (function, inputs with their dynamic dims, {symbol index: (small, large)} sizes)
DYNAMIC_COLUMNS = {
    # rows s0*s1 and reduced length s2 dynamic: softmax (max, sum of exp) and mean
    "softmax_mean": (lambda x: torch.softmax(x, -1) + x.mean(-1, keepdim=True),
                     lambda: (_mark(rand_x(4, 48, C), 0, 1, 2),), ((2, 50, 200), (4, 100, 700))),
    # static rows, dynamic reduced length: mean, var (two passes), a (1, C) weight
    "layer_norm": (_layer_norm_var, lambda: (_mark(rand_x(64, C), 1), _mark(rand_x(C), 0)),
                   ((200,), (700,))),
    # pointwise, every dim dynamic: one loop over column chunks inside the row loop
    "pointwise": (lambda x: torch.relu(x) * 2, lambda: (_mark(rand_x(64, C), 0, 1),),
                  ((50, 200), (300, 700))),
}


@pytest.fixture(scope="module")
def dynamic_column_runs(sim_cache):
    out = {}
    for name, (fn, inputs, (small, large)) in DYNAMIC_COLUMNS.items():
        plan = plan_of(fn, *inputs())
        (tile,) = plan.tiles
        kernel = emit_tile(tile, plan.graph)
        x = plan.graph.specs[tile.inputs[0]].shape
        syms = [s for s in x if isinstance(s, sympy.Symbol)]
        assert len(syms) == len(small), x
        k_small = kernel.at_sizes(dict(zip(syms, small)))
        k_large = kernel.at_sizes(dict(zip(syms, large)))
        out[name] = (kernel, k_small, k_large)
    return _simulate_both_sizes(out)


@pytest.mark.parametrize("name", list(DYNAMIC_COLUMNS))
def test_dynamic_columns_simulate_at_two_sizes_with_one_source(dynamic_column_runs, name):
    kernel, small, large, r_small, r_large = dynamic_column_runs[name]
    src = kernel.source
    assert small.source == large.source == src and "C" in kernel.dynamic_dims
    assert 'C = pypto.frontend.dynamic("C")' in src and "pypto.loop((C + " in src
    assert "valid_shape=[" in src and "cn_1]" in src
    if name != "pointwise":  # reductions: accumulators carried across the column loop
        assert "pypto.full([" in src and "acc1[:] = pypto." in src
    if name == "softmax_mean":
        assert 'R = pypto.frontend.dynamic("R")' in src and "pypto.Tensor((R, C)" in src
        assert "pypto.maximum(acc" in src and "pypto.exp(" in src
        # mean divides by the dynamic count, a sum of ones over the chunks (see columns.py)
        assert "pypto.full([1, 256], 1.0, pypto.DT_FP32, valid_shape=[1, cn_" in src
        assert small.inputs[0].shape == (100, 200) and large.inputs[0].shape == (400, 700)
        # max, sum of exp, mean's sum, the count, the outputs
        assert src.count("pypto.loop((C + ") == 5
    if name == "layer_norm":
        assert "pypto.Tensor((64, C)" in src and "pypto.Tensor((1, C)" in src
        assert src.count("pypto.full([1, 256], 1.0,") == 1  # one count for mean and var
        assert re.search(r"pypto.sub\(count\d+, 1.0\)", src)  # var's correction
        assert small.inputs[1].shape == (1, 200) and large.inputs[0].shape == (64, 700)
    for r in (r_small, r_large):
        assert r.error is None, f"{src}\n{r.error}"
        assert r.cycles > 0 and Path(r.perfetto_trace_path).is_file()
    assert r_large.cycles > r_small.cycles
    print(f"{name}: {r_small.cycles} cycles at {[p.shape for p in small.inputs]}, "
          f"{r_large.cycles} at {[p.shape for p in large.inputs]}")


def test_dynamic_rows_and_columns_launcher_reshapes_per_call():
    fn, inputs, _ = DYNAMIC_COLUMNS["softmax_mean"]
    plan = plan_of(fn, *inputs())
    (tile,) = plan.tiles
    kernel = emit_tile(tile, plan.graph, run_mode="NPU")
    (x,) = kernel.inputs
    assert x.dims == ("R", "C") and x.row_dims == 2
    seen = []
    launcher = npu.PyptoLauncher(kernel.to_json(), fn=lambda *args: seen.append(
        [tuple(a.shape) for a in args]))
    for b, s, h in ((2, 50, 200), (3, 7, 33)):
        (out,) = launcher([torch.randn(b, s, h)], [(b, s, h)])
        assert tuple(out.shape) == (b, s, h)
        assert seen[-1] == [(b * s, h), (b * s, h)]
    with pytest.raises(ValueError, match="does not fit"):
        launcher([torch.randn(6, 200)])  # not the graph's rank: where do the rows end?


def test_dynamic_cases_not_supported_yet_name_themselves():
    plan = plan_of(lambda x: (x * 3).to(torch.int32).sum(-1), _mark(rand_x(4, 48, C), 2))
    tile = next(t for t in plan.tiles if "sum" in t.op_names)
    with pytest.raises(PyptoEmitError, match="reduction over a dynamic reduced extent is not "
                                             "supported yet"):
        emit_tile(tile, plan.graph)
    plan, _ = dynamic_tiles(lambda x: x.sum(0), rand_x(4, 48, C))
    with pytest.raises(PyptoEmitError, match="leading extent .* is not supported yet"):
        emit_tile(plan.tiles[0], plan.graph)
    # batched matmul with a dynamic batch; a dynamic K (x @ x^T)
    x, w = rand_x(4, 48, C), rand_x(4, C, 128)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(w, 0)
    plan = plan_of(lambda x, w: torch.bmm(x, w), x, w)
    with pytest.raises(PyptoEmitError, match="not supported yet in batched matmul tiles"):
        emit_tile(next(t for t in plan.tiles if "matmul" in t.op_names), plan.graph)
    plan = pypto_inductor.report(lambda x, w: x @ w, rand_x(64, C), rand_x(C, 128), dynamic=True,
                                 options={"hardware": "ascend-a2"}).graphs[0].plan
    with pytest.raises(PyptoEmitError, match="dynamic K or N extent .* not supported yet"):
        emit_tile(next(t for t in plan.tiles if "matmul" in t.op_names), plan.graph)


# --- dynamic M in a matmul tile: x @ W with its epilogue, in row tiles of M -----------------
def matmul_epilogue_fn(x, w, b, r):
    return torch.relu(x @ w + b) + r


@pytest.fixture(scope="module")
def dynamic_matmul(sim_cache):
    """x [s0, s1, 256] @ W [256, 128] + bias, relu, + residual: one tile, two sizes simulated."""
    x, r = rand_x(4, 48, C), rand_x(4, 48, 128)
    for t in (x, r):
        torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(t, 1)
    # A low ROI threshold keeps the epilogue in the matmul's tile (the fitted A2 model
    # keeps a matmul this small apart from its epilogue).
    rep = pypto_inductor.report(matmul_epilogue_fn, x, rand_x(C, 128), rand_x(128), r,
                                options={"hardware": "ascend-a2", "roi_threshold": 0.5})
    plan = rep.graphs[0].plan
    (tile,) = plan.tiles
    kernel = emit_tile(tile, plan.graph)
    rows = plan.graph.specs[tile.inputs[-1]].shape[:2]  # the residual's (s0, s1)
    assert all(isinstance(s, sympy.Symbol) for s in rows), rows
    small = kernel.at_sizes({rows[0]: 2, rows[1]: 50})
    large = kernel.at_sizes({rows[0]: 8, rows[1]: 512})
    r_small, r_large = pypto_sim.simulate_kernels([small, large])
    return tile, kernel, small, large, r_small, r_large


def test_dynamic_matmul_epilogue_simulates_at_two_sizes_with_one_source(dynamic_matmul):
    tile, kernel, small, large, r_small, r_large = dynamic_matmul
    assert {"matmul", "add", "relu"} <= set(tile.op_names)
    src = kernel.source
    assert kernel.dynamic and small.source == large.source == src
    assert 'R = pypto.frontend.dynamic("R")' in src and "pypto.loop(" in src
    assert "pypto.Tensor((R, 256)" in src and "pypto.Tensor((256, 128)" in src
    assert "pypto.Tensor((1, 128)" in src and "pypto.Tensor((R, 128)" in src
    row_tile = kernel.vec_tile[0]
    assert f"pypto.view(in_view, [{row_tile}, 256], [r0, 0], valid_shape=[rn, 256])" in src
    assert "pypto.matmul(" in src and "pypto.assemble(" in src
    assert kernel.cube_tile[0][0] <= row_tile and "pypto.set_cube_tile_shapes(" in src
    a, w, bias, res = small.inputs
    assert (a.shape, w.shape, bias.shape, res.shape) == ((100, C), (C, 128), (1, 128), (100, 128))
    assert res.graph_shape == (2, 50, 128) and small.outputs[0].shape == (100, 128)
    assert large.inputs[0].shape == (4096, C) and large.outputs[0].graph_shape == (8, 512, 128)
    for r in (r_small, r_large):
        assert r.error is None, f"{src}\n{r.error}"
        assert r.cycles > 0 and Path(r.perfetto_trace_path).is_file()
    assert r_large.cycles > r_small.cycles  # 41x the rows
    print(f"matmul_epilogue: {r_small.cycles} cycles at 100 rows, {r_large.cycles} at 4096")


def test_dynamic_matmul_launcher_reshapes_per_call():
    x, r = rand_x(4, 48, C), rand_x(4, 48, 128)
    for t in (x, r):
        torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(t, 1)
    plan = pypto_inductor.report(matmul_epilogue_fn, x, rand_x(C, 128), rand_x(128), r, options={
        "hardware": "ascend-a2", "roi_threshold": 0.5}).graphs[0].plan
    (tile,) = plan.tiles
    kernel = emit_tile(tile, plan.graph, run_mode="NPU")
    seen = []
    launcher = npu.PyptoLauncher(kernel.to_json(), fn=lambda *args: seen.append(
        [tuple(a.shape) for a in args]))
    for b, s in ((2, 50), (3, 7)):
        (out,) = launcher([torch.randn(b * s, C), torch.randn(C, 128), torch.randn(128),
                           torch.randn(b, s, 128)], [(b, s, 128)])
        assert tuple(out.shape) == (b, s, 128)
        assert seen[-1] == [(b * s, C), (C, 128), (1, 128), (b * s, 128), (b * s, 128)]
    with pytest.raises(ValueError, match="does not fit"):  # A and the residual disagree on R
        launcher([torch.randn(6, C), torch.randn(C, 128), torch.randn(128),
                  torch.randn(7, 128)])


# --- splitting a FusionTile at an op with no pypto form ------------------------------------
def with_bitwise_not(x, y):
    a = torch.relu(x + y)
    return torch.where(~(a > 0.5), a * 2, x) + 1


def test_tile_split_at_op_without_pypto_form(sim_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = rand_x(R, C), rand_x(R, C)
    rep = pypto_inductor.report(with_bitwise_not, x, y, options={"simulate": True})
    plan = rep.graphs[0].plan
    (tile,) = plan.tiles  # the planner keeps one tile: splitting is the target's business
    assert "bitwise_not" in tile.op_names
    with pytest.raises(PyptoEmitError, match="bitwise_not has no pypto form"):
        emit_tile(tile, plan.graph)
    split = split_tile(tile, plan.graph)
    assert [op.op for op in split.split_ops] == ["bitwise_not"]
    assert [(kind, x.name if kind == "pypto" else x.op) for kind, x in split.steps] == [
        ("pypto", f"{tile.name}_part0"), ("extern", "bitwise_not"),
        ("pypto", f"{tile.name}_part1")]
    before, after = split.parts
    assert before.op_names == ["add", "relu", "gt", "mul"] and after.op_names == ["where", "add"]
    assert set(before.outputs) == {"gt", "mul"} and set(after.inputs) >= {"bitwise_not", "mul"}

    (entry,) = rep.to_dict()["graphs"][0]["fusion_tiles"]
    assert entry["split_ops"] == ["bitwise_not"]
    assert entry["simulation_error"] is None, entry["simulation_error"]
    parts = entry["split_parts"]
    assert [p["name"] for p in parts] == [before.name, after.name]
    assert all(p["simulated_cycles"] > 0 and Path(p["perfetto_trace_path"]).is_file()
               for p in parts)
    assert entry["simulated_cycles_fused"] == sum(p["simulated_cycles"] for p in parts)
    assert "bitwise_not" not in entry["simulated_cycles_unfused_by_op"]
    assert entry["simulated_cycles_unfused"] > entry["simulated_cycles_fused"]
    assert entry["pypto_source"].count("@pypto.frontend.jit") == 2
    assert "<td>bitwise_not</td>" in rep.save(tmp_path / "r.html").read_text()

    # the NPU path runs the same steps: pypto parts (here the reference) and the op eagerly
    from pypto_inductor.codegen import reference
    run = npu.build_split(split, plan.graph, reference.build)
    assert run.split_ops == ["bitwise_not"]
    (out,) = run([x, y], ())
    torch.testing.assert_close(out, with_bitwise_not(x, y))


def test_prod_splits_because_the_simulator_has_no_rowprod(sim_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rep = pypto_inductor.report(lambda x: x.prod(-1, keepdim=True) * 2 + x, rand_x(R, C),
                                options={"simulate": True})
    (entry,) = rep.to_dict()["graphs"][0]["fusion_tiles"]
    assert entry["split_ops"] == ["prod"]
    assert entry["simulation_error"] is None, entry["simulation_error"]
    assert entry["simulated_cycles_fused"] > 0
