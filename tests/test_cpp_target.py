"""The native C++ target (target="cpu"): kernels against eager, the compiler cache, fallbacks.

Every compiled kernel is recorded (``built`` fixture) so tests assert the tile ran
natively, not through the reference executor. Outputs are compared with
torch.testing.assert_close at torch's default per-dtype tolerances.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import pypto_inductor
from pypto_inductor.codegen import cpp
from pypto_inductor.codegen.cpp import compiler as cpp_build
from pypto_inductor.sizes import is_symbolic

OPTS = {"target": "cpu"}


@pytest.fixture(autouse=True)
def isolated_cpp_cache(tmp_path_factory, monkeypatch):
    """One temporary cache for the module (kernels shared across tests), a fresh memory cache."""
    root = tmp_path_factory.getbasetemp() / "cpp_cache"
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(root))
    monkeypatch.setattr(cpp_build, "loaded", dict(cpp_build.loaded))
    yield


@pytest.fixture
def built(monkeypatch):
    """A list receiving every (tile, kernel) the cpp target builds."""
    kernels = []
    real, real_many = cpp.build, cpp.build_many

    def spy(tile, graph):
        k = real(tile, graph)
        kernels.append((tile, k))
        return k

    def spy_many(tiles, graph):
        ks = real_many(tiles, graph)
        kernels.extend((t, k) for t, k in zip(tiles, ks) if not isinstance(k, Exception))
        return ks

    monkeypatch.setattr(cpp, "build", spy)
    monkeypatch.setattr(cpp, "build_many", spy_many)
    return kernels


def check(fn, *inputs, built=None, native=True, dynamic=False, options=None, **tol):
    compiled = torch.compile(fn, backend="pypto",
                             options={**OPTS, "fallback": "error", **(options or {})},
                             dynamic=dynamic)
    with torch.no_grad():
        out, ref = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(out, ref, equal_nan=True, **tol)
    if built is not None and native:
        assert built, "no kernel was built"
        bad = [(t.name, k.reason) for t, k in built if not k.native]
        assert not bad, bad
    return out


def check_sizes(fn, arg_sets, **tol):
    """Compile ``fn`` once with dynamic=True, compare it with eager at every argument set,
    and assert that no size after the first compiled or loaded C++."""
    compiled = torch.compile(fn, backend="pypto", options={**OPTS, "fallback": "error"},
                             dynamic=True)
    counts = []
    for args in arg_sets:
        with torch.no_grad():
            torch.testing.assert_close(compiled(*args), fn(*args), **tol)
        counts.append(cpp_build.stats["compiles"] + cpp_build.stats["disk_hits"])
    assert len(set(counts)) == 1, counts


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
UNARY = [torch.neg, torch.exp, torch.tanh, torch.sigmoid, torch.relu, F.silu, torch.erf,
         torch.abs, lambda x: F.gelu(x), lambda x: F.gelu(x, approximate="tanh"),
         lambda x: torch.log(x.abs() + 0.5), lambda x: torch.sqrt(x.abs()),
         lambda x: torch.rsqrt(x.abs() + 0.1), lambda x: x.pow(2), lambda x: x.pow(3),
         lambda x: (x.abs() + 0.1).pow(1.7), lambda x: x.clamp(-0.5, 0.7),
         lambda x: x.clamp(min=0.1), lambda x: F.leaky_relu(x, 0.2)]


# --- pointwise -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unary(dtype, built):
    """Every unary op at once (output i is UNARY[i]); one compile per dtype keeps this quick."""
    check(lambda x: tuple(fn(x * 2.0) for fn in UNARY), rand(33, 70, dtype=dtype), built=built)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_binary_broadcast(dtype, built):
    def fn(a, b, c):
        return torch.maximum(a + b, c) - torch.minimum(a * c, b) / (c.abs() + 1.0)
    check(fn, rand(16, 8, 64, dtype=dtype), rand(64, dtype=dtype), rand(8, 1, dtype=dtype),
          built=built)


def test_comparisons_where_cast(built):
    def fn(x, y):
        m = (x > y) | (x <= -1.0)
        w = torch.where(m, x, y * 3.0)
        return w.to(torch.float16), (x == y).float() + (x != 0).to(torch.float32), x.ge(y), \
            torch.where(x < 0.5, 1.0, x).to(torch.bfloat16)
    x = rand(40, 96)
    y = x.clone()
    y[::3] = rand(14, 96)
    check(fn, x, y, built=built)


def test_full_and_scalar_tensor(built):
    check(lambda x: torch.where(x > 0, x, torch.zeros_like(x)) + torch.full_like(x, 0.25),
          rand(7, 9), built=built)


def test_integer_and_bool_inputs(built):
    def fn(i, b, x):
        return i * 3 + 1, (i.float() / 7.0) * x, torch.where(b, x, -x), i > 4, b.to(torch.int32)
    check(fn, torch.randint(-9, 9, (12, 33)), torch.rand(12, 33) > 0.5, rand(12, 33),
          built=built)


@pytest.mark.parametrize("layout", ["permuted", "expanded", "sliced", "scalar"])
def test_strided_inputs(layout, built):
    base = rand(48, 80)
    if layout == "permuted":
        x = base.t()  # (80, 48), strides (1, 80)
        fn = lambda x: torch.sigmoid(x) * 2.0 + x  # noqa: E731
    elif layout == "expanded":
        x = rand(1, 80).expand(48, 80)
        fn = lambda x: x.exp() - 1.0  # noqa: E731
    elif layout == "sliced":
        x = base[3:40:2, 5:70]
        fn = lambda x: torch.tanh(x) + x * x  # noqa: E731
    else:
        x = torch.tensor(1.5)
        fn = lambda x: x * 4.0 + 1.0  # noqa: E731
    check(fn, x, built=built)


def test_permute_inside_graph(built):
    check(lambda x, y: (x.permute(1, 0) + y).relu(), rand(64, 32), rand(32, 64), built=built)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_transposed_reads_in_row_blocks(dtype, built):
    """Strided inputs run in blocks of cpp_emit.BLOCK_ROWS x BLOCK_COLS: sizes with partial
    blocks on both sides, several work items (both threads), a broadcast operand."""
    from pypto_inductor.codegen.cpp import emit_rows as cpp_emit

    assert (cpp_emit.BLOCK_ROWS, cpp_emit.BLOCK_COLS) != (1, 1)
    check(lambda x, b: x.transpose(1, 2) * b + 1.0, rand(3, 150, 97, dtype=dtype),
          rand(150, dtype=dtype), built=built)
    check(lambda q: q.view(4, 37, 5, 24).permute(0, 2, 3, 1).contiguous(),
          rand(4, 37, 120, dtype=dtype), built=built)  # attention's K^T copy


def test_transposed_reads_dynamic_sizes(built, tol):
    fn = lambda x: torch.relu(x.transpose(0, 1)) - 0.5  # noqa: E731
    compiled = torch.compile(fn, backend="pypto", options={**OPTS, "fallback": "error"},
                             dynamic=True)
    compiles = cpp_build.stats["compiles"]
    with torch.no_grad():
        for rows, cols in ((70, 45), (129, 200)):
            x = rand(rows, cols)
            torch.testing.assert_close(compiled(x), fn(x), **tol(torch.float32))
    assert cpp_build.stats["compiles"] - compiles <= 1


# --- reductions ----------------------------------------------------------------------
REDUCTIONS = {
    "sum": lambda x: x.sum(-1), "mean": lambda x: x.mean(-1, keepdim=True),
    "amax": lambda x: x.amax(-1), "amin": lambda x: x.amin(-1, keepdim=True),
    "var": lambda x: x.var(-1), "var0": lambda x: x.var(-1, correction=0),
    "std": lambda x: x.std(-1), "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "sum2": lambda x: x.sum((-1, -2)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions(name, dtype, built, tol):
    x = rand(6, 24, 257, dtype=dtype) * 3.0
    check(REDUCTIONS[name], x, built=built, **tol(dtype))


def test_reduction_epilogues_with_per_row_inputs(built, tol):
    def fn(x, b, c):
        return (x.sum(-1) + b) * 2.0, x.amax(-1, keepdim=True) - c, torch.softmax(x, -1) * c
    check(fn, rand(4, 30, 65), rand(4, 30), rand(4, 30, 1), built=built, **tol(torch.float32))


def test_integer_reductions(built):
    def fn(i, b):
        return i.sum(-1), i.amax(-1), i.amin(-1, keepdim=True), b.sum(-1)
    check(fn, torch.randint(-50, 50, (9, 70), dtype=torch.int32), torch.rand(9, 70) > 0.5,
          built=built)


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager var() on empty input warns
@pytest.mark.parametrize("shape", [(3, 0), (0, 5)])
def test_reductions_of_empty_tensors(shape, built):
    check(lambda x: (x.sum(-1), x.mean(-1), x.var(-1), x.sum()), rand(*shape), built=built)


def test_reduction_of_strided_input(built):
    check(lambda x: torch.softmax(x, -1) * 2.0, rand(64, 40).t(), built=built)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_gelu_residual_one_kernel(dtype, built, tol):
    ln = torch.nn.LayerNorm(384).to(dtype)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()

    def fn(x, r):
        return F.gelu(ln(x), approximate="tanh") + r
    check(fn, rand(4, 50, 384, dtype=dtype), rand(4, 50, 384, dtype=dtype), built=built,
          **tol(dtype))
    assert len(built) == 1, [t.name for t, _ in built]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm(dtype, built, tol):
    w = rand(256, dtype=dtype)

    def fn(x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y.to(dtype) * w
    check(fn, rand(100, 256, dtype=dtype), built=built, **tol(dtype))


def test_softmax_with_scale_and_mask(built):
    mask = torch.rand(128, 128) > 0.3
    check(lambda s: torch.softmax((s * 0.125).masked_fill(~mask, float("-inf")), -1),
          rand(2, 128, 128), built=built)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_keeps_its_exps_for_the_last_pass(dtype, built, tol):
    """exp(x - max) is stored in a per-thread row scratch by the sum pass and read back
    by the division pass; rows of a new, longer length grow the scratch."""
    check_sizes(lambda x, y: (torch.softmax(x, -1), torch.log_softmax(y, -1).exp()),
                [(rand(33, cols, dtype=dtype) * 4, rand(5, 3, cols, dtype=dtype))
                 for cols in (100, 700, 30)], **tol(dtype))
    sources = [cpp.generate_source(k.program) for _, k in built if k.native]
    assert any("pi_sc" in src for src in sources)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_sums_in_lanes_at_every_remainder(dtype, built, tol):
    """Cheap row sums run in REDUCTION_LANES parts plus a remainder loop: rows shorter
    than the lanes and every remainder, at the sizes of one compile."""
    def fn(x, w):
        rms = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w
        return rms, x.var(-1, correction=0), x.sum(-1), x.amax(-1), torch.softmax(x, -1)
    check_sizes(fn, [(rand(7, cols, dtype=dtype) * 3, rand(cols, dtype=dtype))
                     for cols in (67, 3, 4, 5, 8, 130)], **tol(dtype))
    # rows of one column: Dynamo specialises size 1, so a graph (and kernels) of its own
    check(fn, rand(7, 1, dtype=dtype) * 3, rand(1, dtype=dtype), built=built, **tol(dtype))
    sources = [cpp.generate_source(k.program) for _, k in built if k.native]
    assert any("const int64_t cq =" in src for src in sources)  # the lanes ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_long_row_sums_in_vector_lanes(dtype, built, tol):
    """Float sums of cheap values over a long row (1024+ columns) add LONG_VECTOR_LANES
    columns at a time into named partial sums (vectorised by GCC's SLP, no `omp simd
    reduction` and its scalar per-lane epilogue) and combine them as a tree; every pass,
    the first (from memory) and the later ones (from L1). LayerNorm (mean, then variance)
    and RMSNorm (sum of squares) at row lengths with and without a remainder."""
    def fn(x, w, b):
        ln = F.layer_norm(x, x.shape[-1:], w, b, 1e-5)
        rms = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
               ).to(x.dtype) * w
        return ln, rms
    for cols in (1024, 1031):
        check(fn, rand(6, cols, dtype=dtype) * 3 + 1, rand(cols, dtype=dtype),
              rand(cols, dtype=dtype), built=built, **tol(dtype))
    sources = [cpp.generate_source(k.program) for _, k in built if k.native]
    lanes = cpp.row_sums.LONG_VECTOR_LANES
    # the lanes' partial sums: a loop over a lane array (LANE_LOOP), or named variables
    lane_sum = f"_v[{lanes}] = {{}};" if cpp.row_sums.LANE_LOOP else f"_s{lanes - 1} +="
    assert sources and all(lane_sum in src for src in sources)
    for src in sources:  # no float sum runs in the 4-part split (only the double redos)
        assert not any(line.strip().startswith("float acc") and "_1 = " in line
                       for line in src.splitlines())


def test_long_row_sum_of_a_select_on_a_bool_input(built):
    """A sum over a long row of ``where(mask, 0, x)`` with ``mask`` a bool input: GCC 12
    miscompiled it with 64 unrolled lanes (fuzz seed 50047, a gradient of amin), which is
    why LONG_VECTOR_LANES is 16. Row lengths with and without a remainder of the lanes."""
    def fn(mask, x):
        return torch.where(mask, 0.0, x).sum(-1)
    for rows, cols in ((1, 1024), (3, 1152), (2, 4101)):
        check(fn, torch.rand(rows, cols) > 0.5, rand(rows, cols), built=built)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_short_static_row_sums_in_vector_lanes(dtype, built, tol):
    """Float sums over a short static row add VECTOR_LANES columns at a time and combine the
    lanes as a tree, the remainder in order: rows below, at and between multiples of the
    lanes, a LayerNorm with a residual add (two sums) and an RMSNorm (one)."""
    def fn(x, r, w):
        h = x + r
        ln = F.layer_norm(h, h.shape[-1:], w, None, 1e-5)
        rms = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype) * w
        return ln, rms, h.sum(-1)
    for cols in (3, 16, 37, 64, 100):
        check(fn, rand(9, cols, dtype=dtype) * 3, rand(9, cols, dtype=dtype),
              rand(cols, dtype=dtype), built=built, **tol(dtype))
    sources = [cpp.generate_source(k.program) for _, k in built if k.native]
    assert any("const int64_t cv =" in src for src in sources)  # the vector lanes ran
    assert not any("const int64_t cq =" in src for src in sources)  # not the 4-part split


def test_layernorm_sums_its_row_once_for_mean_and_var(built, tol):
    """var_mean's mean and the normalisation's mean are one accumulator, not two."""
    ln = torch.nn.LayerNorm(96)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    check(lambda x: ln(x), rand(33, 96) * 3, built=built, **tol(torch.float32))
    (_, kernel), = built
    reductions = [n for n in kernel.program.nodes if n.kind == "reduce"]
    # mean, variance; each with its double redo, a pass only rows that overflowed run
    assert sorted(n.attrs["red"] for n in reductions if not n.attrs.get("when")) == ["sum", "sum"]
    assert len([n for n in reductions if n.attrs.get("when")]) == 2


def test_non_native_tile_runs_reference_without_warning(built):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # kept dims 0 and 2 with a reduced one between them: not native (emit_mixed takes
        # one kept block only)
        check(lambda x: x.sum((1, 3)), rand(4, 6, 8, 5), built=built, native=False)
    assert built and not any(k.native for _, k in built)
    assert all(k.reason for _, k in built)


def test_report_shows_native(built):
    rep = pypto_inductor.report(
        lambda x, w: ((torch.softmax(x, -1) @ w).relu(), x.view(2, 4, 2, 8).sum((1, 3))),
        rand(8, 16), rand(16, 4), options=OPTS)
    tiles = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    natives = {t["name"]: t["native"] for t in tiles}
    assert any(v["native"] for v in natives.values()), natives
    assert any(v["native"] is False and v["reason"] for v in natives.values()), natives


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_argmin_last_dim(dtype, built):
    """First index of the extreme (ties and NaN as eager), with max(dim) and the flat form."""
    x = rand(24, 40, dtype=dtype)
    x[3, 7] = x[3, 20] = 50.0  # a tie: the first wins
    x[5, 11] = float("nan")  # NaN is the maximum and the minimum
    x[6, 2] = x[6, 30] = -50.0

    def fn(x):
        v, i = (x * 2.0).max(-1)
        return x.argmax(-1), x.argmin(-1, keepdim=True), v, i, x.argmax(), \
            torch.softmax(x, -1).argmin(-1)
    check(fn, x, built=built)


def test_chunks_keep_their_strides(built):
    """chunk/split views carry their real strides, so a tile reading one plans the row
    layout it has (a flat layout over a strided chunk took 4x as long)."""
    from pypto_inductor.report import collect

    def fn(x):
        a, b = x.chunk(2, dim=-1)
        return -b, a * 2.0
    x = rand(4, 6, 64)
    with collect() as graphs:
        check(fn, x, built=built)
    graph = graphs[0].plan.graph
    slices = [graph.specs[op.name] for op in graph.nodes if getattr(op, "op", None) == "slice"]
    assert len(slices) == 2
    assert all(tuple(map(int, s.stride)) == x[..., 32:].stride() for s in slices)


# --- reshapes (view) inside pointwise and row-reduction tiles -------------------------------
def _view_tiles(built):
    tiles = [(t, k) for t, k in built if any(op.op == "view" for op in t.ops)]
    assert tiles, [t.name for t, _ in built]
    return tiles


VIEW_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_view_in_pointwise_tile(dtype, built, tol):
    """`add view gelu` (a linear's bias add, reshaped to [B, S, H]), with broadcast
    operands read before the view ([H], [B*S, 1]) and after it ([S, H], [B, 1, 1])."""
    def fn(y, bias, rowscale, pos, gate):
        h = (y + bias) * rowscale
        return F.gelu(h.view(4, 8, 64)) * pos + gate
    check(fn, rand(32, 64, dtype=dtype), rand(64, dtype=dtype), rand(32, 1, dtype=dtype),
          rand(8, 64, dtype=dtype), rand(4, 1, 1, dtype=dtype), built=built, **tol(dtype))
    assert all(k.native for _, k in _view_tiles(built))


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_view_residual_layer_norm(dtype, built, tol):
    """`add view add var mean rsqrt sub mul mul add`: residual + LayerNorm across a view;
    the residual is broadcast over the batch after the view."""
    ln = torch.nn.LayerNorm(64).to(dtype)

    def fn(y, bias, res):
        z = (y + bias).view(4, 8, 64) + res
        return ln(z), z
    check(fn, rand(32, 64, dtype=dtype), rand(64, dtype=dtype), rand(8, 64, dtype=dtype),
          built=built, **tol(dtype))
    tiles = _view_tiles(built)
    assert all(k.native for _, k in tiles)
    assert any(t.kind.value == "reduction" for t, _ in tiles)


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_view_of_row_values_and_into_reduction(dtype, built, tol):
    """Per-row values reshaped ([B*S, 1] -> [B, S, 1]) and a reduction reading a reshaped
    value; the reduced input is also read transposed (a strided column)."""
    def fn(x, xt, w):
        mu = (x * 2.0).mean(-1, keepdim=True).view(4, 8, 1)
        z = (x + xt.t()).view(4, 8, 64) - mu
        return torch.softmax(z * w, -1), z.amax(-1)
    x = rand(32, 64, dtype=dtype)
    check(fn, x, rand(64, 32, dtype=dtype), rand(8, 1, dtype=dtype), built=built,
          **tol(dtype))
    assert all(k.native for _, k in _view_tiles(built))


def test_view_adding_unit_dims_to_a_broadcast_input(built):
    def fn(y, b):
        return torch.tanh(y * 3.0).view(4, 8, 64) * b.view(1, 1, 64) + b.view(64)
    check(fn, rand(32, 64), rand(1, 64), built=built)


def test_views_of_tile_inputs_against_reference():
    """Views whose source is a tile input (the planner keeps those outside kernels today):
    a full-size input read in its own shape, strided; a broadcast input through 1s."""
    import sympy

    from pypto_inductor.codegen import reference
    from pypto_inductor.ir import FusionTile, OpKind, TensorSpec, TileGraph, TileOp

    def spec(shape, stride=None, dtype=torch.float32):
        if stride is None:
            stride = torch.empty(shape, device="meta").stride()
        return TensorSpec(tuple(sympy.Integer(s) for s in shape),
                          tuple(sympy.Integer(s) for s in stride), dtype)

    specs = {"x": spec((32, 64), (1, 32)), "b": spec((1, 64)), "r": spec((4, 8, 64)),
             "xv": spec((4, 8, 64)), "bv": spec((64,)), "bv2": spec((1, 1, 64)),
             "t": spec((4, 8, 64)), "o": spec((4, 8, 64))}
    ops = [TileOp("xv", "view", OpKind.LAYOUT, ("x",), specs["xv"], {"shape": (4, 8, 64)}),
           TileOp("bv", "view", OpKind.LAYOUT, ("b",), specs["bv"], {"shape": (64,)}),
           TileOp("bv2", "view", OpKind.LAYOUT, ("bv",), specs["bv2"], {"shape": (1, 1, 64)}),
           TileOp("t", "mul", OpKind.BROADCAST, ("xv", "bv2"), specs["t"]),
           TileOp("o", "add", OpKind.BROADCAST, ("t", "r"), specs["o"])]
    graph = TileGraph("g", ["x", "b", "r"], specs, [], ["o"], {})
    tile = FusionTile("k", ops, ["x", "b", "r"], ["o"], "float32", (8, 64), sympy.Integer(0),
                      0, 0, OpKind.BROADCAST)
    kernel = cpp.build(tile, graph)
    assert kernel.native, kernel.reason
    inputs = [rand(64, 32).t(), rand(1, 64), rand(4, 8, 64)]
    torch.testing.assert_close(kernel(inputs, ()), reference.build(tile, graph)(inputs, ()))


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_view_tiles_dynamic_two_sizes(dtype, built, tol):
    ln = torch.nn.LayerNorm(48).to(dtype)

    def fn(y, bias, res):
        z = (y + bias).view(res.shape[0], res.shape[1], 48)
        return ln(z + res), F.gelu(z) * res[0]
    bias = rand(48, dtype=dtype)
    check_sizes(fn, [(rand(b * s, 48, dtype=dtype), bias, rand(b, s, 48, dtype=dtype))
                     for b, s in ((2, 8), (3, 5))], **tol(dtype))
    tiles = _view_tiles(built)
    assert all(k.native for _, k in tiles)
    assert any(is_symbolic(d) for _, k in tiles for d in k.program.shape)


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_view_splitting_last_dim(dtype, built, tol):
    """[B, S, H*D] <-> [B, S, H, D] in a pointwise tile (the columns become D), and a
    per-head reduction after the split; the operands broadcast before and after it,
    one is read transposed."""
    def fn(y, yt, bias, w):
        h = (torch.sigmoid(y) + bias + yt.transpose(0, 2)).view(4, 8, 4, 16)
        return h * w, torch.softmax(h * 2.0, -1), (h - 1.0).reshape(4, 8, 64).exp()
    check(fn, rand(4, 8, 64, dtype=dtype), rand(64, 8, 4, dtype=dtype), rand(64, dtype=dtype),
          rand(8, 1, 16, dtype=dtype), built=built, **tol(dtype))
    assert all(k.native for _, k in _view_tiles(built))


def test_view_merging_reduced_dim_is_not_native(built):
    """A reduction over H*D of a value computed as [.., H, D] would read a split row:
    the tile runs the reference executor, saying why."""
    def fn(y, w):
        return torch.softmax(((y * w).view(4, 8, 64) + 1.0), -1)
    check(fn, rand(4, 8, 4, 16), rand(16), built=built, native=False)
    for _, k in _view_tiles(built):
        assert k.native or "last dim" in k.reason, k.reason


@pytest.mark.parametrize("model", ["transformer", "llama"])
def test_benchmark_blocks_have_no_view_tiles_on_reference(model):
    from pypto_inductor import models
    m = (models.TransformerBlock(64, 4, 128) if model == "transformer"
         else models.LlamaBlock(64, 4, 176)).eval()
    rep = pypto_inductor.report(m, rand(2, 16, 64), options=OPTS)
    tiles = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    bad = [(t["name"], t["native"]) for t in tiles
           if any(o.startswith("view") for o in t["ops"]) and not t["native"]["native"]]
    assert not bad, bad


# --- cat along the columns ---------------------------------------------------------------
def _cat_tiles(built):
    tiles = [(t, k) for t, k in built if any(op.op == "cat" for op in t.ops)]
    assert tiles, [t.name for t, _ in built]
    return tiles


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_cat_last_dim_two_and_three_inputs(dtype, built, tol):
    """rotate_half (cat([-x2, x1]) * sin + x * cos, the halves strided slices, sin/cos
    broadcast) and a 3-way cat with ops before and after it, at odd sizes."""
    def rope(x, sin, cos):
        return x * cos + _rotate_half(x) * sin

    def cat3(a, b, c, s, w):
        return torch.cat([torch.exp(a), b * s, c], -1) * w + 1.0
    check(rope, rand(3, 2, 7, 10, dtype=dtype), rand(7, 10, dtype=dtype),
          rand(7, 10, dtype=dtype), built=built, **tol(dtype))
    check(cat3, rand(3, 5, 7, dtype=dtype), rand(3, 5, 1, dtype=dtype),
          rand(3, 5, 4, dtype=dtype), rand(5, 1, dtype=dtype), rand(12, dtype=dtype),
          built=built, **tol(dtype))
    tiles = _cat_tiles(built)
    assert all(k.native for _, k in tiles)
    assert {len(k.program.cat_bounds) for _, k in tiles} == {1, 2}


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_cat_last_dim_dynamic_two_sizes(dtype, built, tol):
    def fn(x, sin, cos):
        return x * cos + _rotate_half(x) * sin
    check_sizes(fn, [(rand(b, s, d, dtype=dtype), rand(s, d, dtype=dtype),
                      rand(s, d, dtype=dtype)) for b, s, d in ((2, 5, 8), (3, 9, 14))],
                **tol(dtype))
    tiles = _cat_tiles(built)
    assert all(k.native for _, k in tiles)
    assert any(is_symbolic(b) for _, k in tiles for b in k.program.cat_bounds)


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_cat_fused_with_ops_before_and_after_against_reference(dtype, tol):
    """Tiles the planner does not form today (it keeps cat apart): ops feeding the parts
    (each part's ops computed at its columns), broadcast operands, strided halves, ops
    after the cat, a second cat splitting alike, a softmax over the cat, and a cat along
    a row dim beside a column cat."""
    import sympy

    from pypto_inductor.codegen import reference
    from pypto_inductor.ir import FusionTile, OpKind, TensorSpec, TileGraph, TileOp

    def spec(shape, stride=None):
        if stride is None:
            stride = torch.empty(shape, device="meta").stride()
        return TensorSpec(tuple(sympy.Integer(s) for s in shape),
                          tuple(sympy.Integer(s) for s in stride), dtype)

    half, full = (2, 3, 5, 4), (2, 3, 5, 8)
    big = (240, 40, 8, 1)  # the halves are slices of a [2, 3, 5, 8] tensor
    specs = {"x1": spec(half, big), "x2": spec(half, big), "x": spec(full), "sin": spec((5, 8)),
             "cos": spec((5, 8)), "s": spec((5, 1)), "n": spec(half), "e": spec(half),
             "c": spec(full), "c2": spec(full), "t": spec(full), "u": spec(full),
             "o": spec(full), "p": spec(full), "y": spec((2, 3, 2, 8)), "z": spec((2, 3, 3, 8)),
             "ny": spec((2, 3, 2, 8)), "rc": spec(full), "q": spec(full)}
    ops = [TileOp("n", "neg", OpKind.ELEMENTWISE, ("x2",), specs["n"]),
           TileOp("e", "mul", OpKind.BROADCAST, ("x1", "s"), specs["e"]),
           TileOp("c", "cat", OpKind.LAYOUT, ("n", "x1"), specs["c"], {"dim": 3}),
           TileOp("c2", "cat", OpKind.LAYOUT, ("x1", "e"), specs["c2"], {"dim": 3}),
           TileOp("t", "mul", OpKind.BROADCAST, ("c", "sin"), specs["t"]),
           TileOp("u", "mul", OpKind.BROADCAST, ("x", "cos"), specs["u"]),
           TileOp("o", "add", OpKind.ELEMENTWISE, ("t", "u"), specs["o"]),
           TileOp("p", "softmax", OpKind.REDUCTION, ("c2",), specs["p"],
                  {"dims": (3,), "keepdim": True, "dtype": dtype}),
           TileOp("ny", "mul", OpKind.ELEMENTWISE, ("y", 2.0), specs["ny"]),
           TileOp("rc", "cat", OpKind.LAYOUT, ("ny", "z"), specs["rc"], {"dim": 2}),
           TileOp("q", "add", OpKind.ELEMENTWISE, ("rc", "c"), specs["q"])]
    inputs = ["x1", "x2", "x", "sin", "cos", "s", "y", "z"]
    graph = TileGraph("g", inputs, specs, [], ["o", "p", "q"], {})
    whole = torch.randn(2, 3, 5, 8).to(dtype)
    args = [whole[..., :4], whole[..., 4:], rand(*full, dtype=dtype), rand(5, 8, dtype=dtype),
            rand(5, 8, dtype=dtype), rand(5, 1, dtype=dtype), rand(2, 3, 2, 8, dtype=dtype),
            rand(2, 3, 3, 8, dtype=dtype)]
    for outs, kind, tile_ops in (
            (["o", "c2"], OpKind.BROADCAST, ops[:7]),
            (["p"], OpKind.REDUCTION, [ops[1], ops[3], ops[7]]),
            (["q"], OpKind.ELEMENTWISE, [ops[0], ops[2], ops[8], ops[9], ops[10]])):  # + a row cat
        tile = FusionTile("k", tile_ops, inputs, outs, "float32", (8, 8), sympy.Integer(0), 0,
                          0, kind)
        kernel = cpp.build(tile, graph)
        assert kernel.native, kernel.reason
        assert len(kernel.program.cat_bounds) == 1
        torch.testing.assert_close(kernel(args, ()), reference.build(tile, graph)(args, ()),
                                   **tol(dtype))


@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=str)
def test_cat_along_a_row_dim(dtype, built, tol):
    """cat along a leading dim: a select on the row index, each part's rows clamped into it;
    one part strided, 2 and 3 parts, then at two sizes under dynamic=True."""
    check(lambda a, b: torch.exp(torch.cat([a * 2.0, b], 1)), rand(2, 3, 7, dtype=dtype),
          rand(2, 5, 7, dtype=dtype), built=built, **tol(dtype))
    check(lambda a, b, c: torch.cat([a, b, c], 0) + 1.0, rand(2, 3, 10, dtype=dtype)[..., ::2],
          rand(1, 3, 5, dtype=dtype), rand(3, 3, 5, dtype=dtype), built=built, **tol(dtype))
    check_sizes(lambda a, b: torch.cat([a, b], 1) * 3.0,
                [(rand(b, s0, d, dtype=dtype), rand(b, s1, d, dtype=dtype))
                 for b, s0, s1, d in ((2, 3, 5, 8), (3, 4, 2, 9))], **tol(dtype))
    tiles = _cat_tiles(built)
    assert all(k.native and not k.program.cat_bounds for _, k in tiles)


def test_llama_block_has_no_cat_tile_on_reference():
    from pypto_inductor import models
    m = models.LlamaBlock(64, 4, 176).eval()
    rep = pypto_inductor.report(m, rand(2, 16, 64), options=OPTS)
    tiles = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    cats = [(t["name"], t["native"]) for t in tiles if "cat" in t["ops"]]
    assert cats and all(n["native"] for _, n in cats), cats


# --- matmul tiles: torch's BLAS + one native epilogue pass ---------------------------------
def _matmul_tiles(built):
    tiles = [(t, k) for t, k in built if t.kind.value == "matmul"]
    assert tiles, [t.name for t, _ in built]
    return tiles


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_linear_gelu(dtype, built, tol):
    lin = torch.nn.Linear(64, 48).to(dtype)
    check(lambda x: F.gelu(lin(x)), rand(4, 10, 64, dtype=dtype), built=built,
          **tol(dtype))
    tiles = _matmul_tiles(built)
    # the GELU is the GEMM's oneDNN post-op where torch has oneDNN (no program of ours:
    # tests/test_gemm_epilogue.py), else a native pass
    assert all(k.native for _, k in tiles)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_linear_bias_residual(dtype, built, tol):
    lin = torch.nn.Linear(32, 32).to(dtype)
    check(lambda x, r: lin(x) + r, rand(6, 9, 32, dtype=dtype), rand(6, 9, 32, dtype=dtype),
          built=built, **tol(dtype))
    _matmul_tiles(built)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_bias_runs_in_the_gemm(dtype, built, tol):
    """A bias add right after the GEMM is planned into the matmul tile on the host and
    done by addmm / baddbmm: no native epilogue pass is left."""
    lin = torch.nn.Linear(32, 24).to(dtype)
    check(lambda x: lin(x), rand(5, 7, 32, dtype=dtype), built=built, **tol(dtype))
    check(lambda b, x, y: torch.baddbmm(b, x, y), rand(24, dtype=dtype),
          rand(3, 9, 16, dtype=dtype), rand(3, 16, 24, dtype=dtype), built=built, **tol(dtype))
    check(lambda c, x, w: x @ w + c, rand(9, 24, dtype=dtype), rand(9, 16, dtype=dtype),
          rand(16, 24, dtype=dtype), built=built, **tol(dtype))
    tiles = _matmul_tiles(built)
    assert len(tiles) == 3 and all(t.op_names[:2] == ["matmul", "add"] for t, _ in tiles)
    # (half-precision baddbmm keeps a cast after the add: that stays a native pass)
    assert all(k.native and (k.program is None) == (t.op_names == ["matmul", "add"])
               for t, k in tiles)
    assert tiles[0][1].program is None


def test_matmul_bias_stays_in_the_epilogue_when_the_product_is_read(built, tol):
    w = rand(16, 24)

    def fn(x, b):
        y = x @ w
        return y + b, torch.relu(y) * 2.0
    check(fn, rand(9, 16), rand(24), built=built, options={"roi_threshold": 0.5},
          **tol(torch.float32))
    (tile, kernel), = _matmul_tiles(built)
    assert "add" in tile.op_names and kernel.program is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_bmm_scale(dtype, built, tol):
    check(lambda a, b: torch.bmm(a, b) * 0.125, rand(3, 17, 24, dtype=dtype),
          rand(3, 24, 11, dtype=dtype), built=built, **tol(dtype))
    _matmul_tiles(built)


def test_matmul_epilogue_cast_and_two_outputs(built, tol):
    w = rand(40, 24)

    def fn(x, b):
        y = x @ w
        return y, torch.sigmoid(y + b).to(torch.bfloat16)
    check(fn, rand(20, 40), rand(24), built=built, **tol(torch.bfloat16))
    _matmul_tiles(built)


def test_matmul_epilogue_reshapes_and_reshaped_output(built):
    lin = torch.nn.Linear(32, 16)

    def f(x):
        y = lin(x)
        return y, F.gelu(y) * x[..., :16]

    def g(x, w, r):
        return (x @ w).view(2, 3, 4, 8) + r
    # planned for ascend-a2, whose model fuses epilogues into the matmul (the host's
    # does not: there the epilogue re-reads the GEMM result and saves no traffic)
    check(f, rand(4, 5, 32), built=built, options={"hardware": "ascend-a2"})
    check(g, rand(6, 16), rand(16, 32), rand(4, 8), built=built)
    assert len(_matmul_tiles(built)) == 2


def test_matmul_one_op(built):
    check(lambda a, b: a @ b, rand(16, 32), rand(32, 8), built=built)
    tiles = _matmul_tiles(built)
    assert all(k.native and k.program is None for _, k in tiles)


def test_matmul_dynamic_batch_no_recompile(built, tol):
    lin = torch.nn.Linear(32, 16)

    def fn(x, r):
        return F.silu(lin(x)) * 2.0 + r
    check_sizes(fn, [(rand(batch, 5, 32), rand(batch, 5, 16)) for batch in (3, 7, 12)],
                **tol(torch.float32))
    assert all(k.native for _, k in _matmul_tiles(built))


# --- dynamic sizes and the cache ---------------------------------------------------------
def test_dynamic_sizes_compile_once(built):
    def fn(x, w):
        return F.silu(x * w).sum(-1) + torch.softmax(x, -1).amax(-1)
    w = rand(96)
    check_sizes(fn, [(rand(rows, 96), w) for rows in (5, 17, 64)])
    assert all(k.native for _, k in built)


_SRC = 'extern "C" int pi_kernel(void) { return %d; }\n'


def test_cache_hit_and_miss(monkeypatch):
    before = dict(cpp_build.stats)
    f = cpp_build.load(_SRC % 7, "pi_kernel")
    assert f() == 7 and cpp_build.stats["compiles"] == before["compiles"] + 1
    assert cpp_build.load(_SRC % 7, "pi_kernel")() == 7
    assert cpp_build.stats["memory_hits"] == before["memory_hits"] + 1
    monkeypatch.setattr(cpp_build, "loaded", {})  # a new process: the disk cache answers
    assert cpp_build.load(_SRC % 7, "pi_kernel")() == 7
    assert cpp_build.stats["disk_hits"] == before["disk_hits"] + 1
    assert cpp_build.stats["compiles"] == before["compiles"] + 1


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_cache_entry_is_rebuilt(monkeypatch, damage):
    src = _SRC % (11 if damage == "truncated" else 12)
    compiler = cpp_build.find_compiler()
    so = cpp_build.cache_dir() / f"{cpp_build.cache_key(src, compiler)}.so"
    cpp_build.compile_library(src, compiler, so)  # an entry another process wrote
    if damage == "truncated":  # checksum no longer matches
        so.write_bytes(so.read_bytes()[:100])
    else:  # checksum matches, but the file is no shared library
        so.write_bytes(b"not an ELF file" * 10)
        so.with_suffix(".sha256").write_text(cpp_build.checksum(so))
    before = dict(cpp_build.stats)
    assert cpp_build.load(src, "pi_kernel")() == int(src.split("return ")[1].split(";")[0])
    assert cpp_build.stats["rebuilt"] == before["rebuilt"] + 1
    assert so.stat().st_size > 150


def test_two_processes_compile_same_graph(tmp_path):
    script = textwrap.dedent("""
        import torch, pypto_inductor
        from pypto_inductor.codegen.cpp import compiler as cpp_build
        torch.manual_seed(0)
        x = torch.randn(64, 200)
        fn = lambda x: torch.tanh(torch.log_softmax(x * 1.7, -1)) + 0.123
        out = torch.compile(fn, backend="pypto", options={"target": "cpu", "fallback": "error"})(x)
        torch.testing.assert_close(out, fn(x))
        print("OK", cpp_build.stats["compiles"] + cpp_build.stats["disk_hits"])
    """)
    env = {**os.environ, "PYPTO_INDUCTOR_CACHE_DIR": str(tmp_path / "shared")}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and "OK" in out, err[-2000:]
    assert len(list((tmp_path / "shared" / "cpp").glob("*.so"))) >= 1
    assert not list((tmp_path / "shared" / "cpp").glob("*.tmp"))


# --- fallbacks ------------------------------------------------------------------------
def test_missing_compiler_falls_back_with_one_warning(monkeypatch, tmp_path, built):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("PATH", str(tmp_path))  # no compilers on PATH
    monkeypatch.setattr(cpp, "warned_no_compiler", False)
    monkeypatch.setattr(cpp_build, "loaded", {})
    fn = lambda x: torch.softmax(x, -1) + x.exp()  # noqa: E731
    monkeypatch.setattr(cpp_build, "compilers", {})
    with pytest.warns(UserWarning, match="no C.. compiler") as rec:
        check(fn, rand(8, 16), built=built, native=False)
    assert sum("compiler" in str(w.message) for w in rec) == 1
    assert "CXX='/nonexistent/c++'" in str(rec[0].message)  # the one says why CXX is not used
    assert built and not any(k.native for _, k in built)


def test_compile_error_runs_tile_eagerly_with_warning_and_report(monkeypatch):
    monkeypatch.setattr(cpp, "generate_source", lambda program: "this is not C++ {")
    fn = lambda x: torch.sigmoid(x) * x.sum(-1, keepdim=True)  # noqa: E731
    x = rand(8, 16)
    with pytest.warns(UserWarning, match="failed to build"):
        rep = pypto_inductor.report(fn, x, options=OPTS)
    tiles = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    assert tiles and all("CompileError" in (t["kernel_fallback"] or "") for t in tiles)
    compiled = torch.compile(fn, backend="pypto", options=OPTS)
    with pytest.warns(UserWarning, match="failed to build"):
        torch.testing.assert_close(compiled(x), fn(x))


# --- one library per graph ----------------------------------------------------------------
def _three_tiles(x, y, w):  # permutes keep the three kernels apart
    a = torch.tanh(x * 1.5).permute(1, 0)
    b = torch.softmax(a + y, -1).permute(1, 0)
    return torch.sigmoid(b - x) * w


def test_graph_compiles_as_few_libraries(monkeypatch, built):
    monkeypatch.setenv("PYPTO_INDUCTOR_COMPILE_JOBS", "2")
    before = dict(cpp_build.stats)
    args = rand(48, 40) + 0.25, rand(40, 48), rand(40)  # new sizes: a cold compile
    check(_three_tiles, *args, built=built)
    assert len(built) == 3 and all(k.native for _, k in built)
    assert cpp_build.stats["compiles"] - before["compiles"] == 2  # two chunks, not three


def test_chunks_balance_sources():
    pend = [(i, cpp.Pending(None, "head" + cpp.HEAD + "x" * n, None))
            for i, n in enumerate([100, 100, 100, 100, 400])]
    assert [[i for i, _ in c] for c in cpp.plan_chunks(pend, 2)] == [[0, 1, 2, 3], [4]]
    assert [[i for i, _ in c] for c in cpp.plan_chunks(pend, 3)] == [[0, 2], [1, 3], [4]]
    assert len(cpp.plan_chunks(pend, 8)) == 5
    assert len(cpp.plan_chunks(pend, 1)) == 1 and len(cpp.plan_chunks(pend[:2], 8)) == 2
    odd = (5, cpp.Pending(None, "no marker", None))  # never shares a library
    assert [[i for i, _ in c] for c in cpp.plan_chunks(pend + [odd], 1)] == [[0, 1, 2, 3, 4], [5]]
    source, symbols = cpp.library_source(cpp.plan_chunks(pend, 1)[0])
    assert source.count("head") == 1 and symbols == tuple(f"pi_kernel_{i}" for i in range(5))


def test_compile_error_in_one_tile_of_a_library(monkeypatch):
    monkeypatch.setenv("PYPTO_INDUCTOR_COMPILE_JOBS", "1")  # all three in one library
    real = cpp.generate_source

    def broken_softmax(program):
        src = real(program)
        return src + "\nnot C++ {" if program.reduction else src
    monkeypatch.setattr(cpp, "generate_source", broken_softmax)
    args = rand(24, 40), rand(40, 24), rand(40)
    compiled = torch.compile(_three_tiles, backend="pypto", options=OPTS)
    with pytest.warns(UserWarning, match="failed to build") as rec:
        torch.testing.assert_close(compiled(*args), _three_tiles(*args))
    failed = [str(w.message) for w in rec if "failed to build" in str(w.message)]
    assert len(failed) == 1 and "softmax" in failed[0], failed
    with pytest.warns(UserWarning, match="failed to build"):
        rep = pypto_inductor.report(_three_tiles, *args, options=OPTS)
    tiles = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    assert sum(bool(t["kernel_fallback"]) for t in tiles) == 1
    assert sum(bool(t["native"]["native"]) for t in tiles if not t["kernel_fallback"]) == 2
    with pytest.raises(Exception, match="failed"):
        torch.compile(_three_tiles, backend="pypto",
                      options={**OPTS, "fallback": "error"})(*args)
