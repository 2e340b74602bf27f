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
from pypto_inductor.codegen import cpp, cpp_build

OPTS = {"target": "cpu"}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One temporary cache for the module (kernels shared across tests), a fresh memory cache."""
    root = tmp_path_factory.getbasetemp() / "cpp_cache"
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(root))
    monkeypatch.setattr(cpp_build, "_loaded", dict(cpp_build._loaded))
    yield


@pytest.fixture
def built(monkeypatch):
    """A list receiving every (tile, kernel) the cpp target builds."""
    kernels = []
    real = cpp.build

    def spy(tile, graph):
        k = real(tile, graph)
        kernels.append((tile, k))
        return k

    monkeypatch.setattr(cpp, "build", spy)
    return kernels


def check(fn, *inputs, built=None, native=True, dynamic=False, **tol):
    compiled = torch.compile(fn, backend="pypto", options={**OPTS, "fallback": "error"},
                             dynamic=dynamic)
    with torch.no_grad():
        out, ref = compiled(*inputs), fn(*inputs)
    torch.testing.assert_close(out, ref, equal_nan=True, **tol)
    if built is not None and native:
        assert built, "no kernel was built"
        bad = [(t.name, k.reason) for t, k in built if not k.native]
        assert not bad, bad
    return out


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


def test_non_native_tile_runs_reference_without_warning(built):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(lambda x: x.argmax(-1), rand(16, 32), built=built, native=False)
    assert built and not any(k.native for _, k in built)
    assert all(k.reason for _, k in built)


def test_report_shows_native(built):
    rep = pypto_inductor.report(lambda x, w: ((torch.softmax(x, -1) @ w).relu(), x.argmax(-1)),
                                rand(8, 16), rand(16, 4), options=OPTS)
    tiles = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    natives = {t["name"]: t["native"] for t in tiles}
    assert any(v["native"] for v in natives.values()), natives
    assert any(v["native"] is False and v["reason"] for v in natives.values()), natives


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
    assert all(k.native and k.program is not None for _, k in tiles)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_linear_bias_residual(dtype, built, tol):
    lin = torch.nn.Linear(32, 32).to(dtype)
    check(lambda x, r: lin(x) + r, rand(6, 9, 32, dtype=dtype), rand(6, 9, 32, dtype=dtype),
          built=built, **tol(dtype))
    _matmul_tiles(built)


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
        return y, F.gelu(y) * x[..., :16].sum()

    def g(x, w, r):
        return (x @ w).view(2, 3, 4, 8) + r
    check(f, rand(4, 5, 32), built=built)
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
    compiled = torch.compile(fn, backend="pypto", options={**OPTS, "fallback": "error"},
                             dynamic=True)
    counts = []
    for batch in (3, 7, 12):
        x, r = rand(batch, 5, 32), rand(batch, 5, 16)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, r), fn(x, r), **tol(torch.float32))
        counts.append(cpp_build.stats["compiles"] + cpp_build.stats["disk_hits"])
    assert counts[0] == counts[1] == counts[2]
    assert all(k.native for _, k in _matmul_tiles(built))


# --- dynamic sizes and the cache ---------------------------------------------------------
def test_dynamic_sizes_compile_once(built):
    def fn(x, w):
        return F.silu(x * w).sum(-1) + torch.softmax(x, -1).amax(-1)
    compiled = torch.compile(fn, backend="pypto", options={**OPTS, "fallback": "error"},
                             dynamic=True)
    w = rand(96)
    counts = []
    for rows in (5, 17, 64):
        x = rand(rows, 96)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, w), fn(x, w))
        counts.append(cpp_build.stats["compiles"] + cpp_build.stats["disk_hits"])
    assert counts[0] == counts[1] == counts[2]
    assert all(k.native for _, k in built)


_SRC = 'extern "C" int pi_kernel(void) { return %d; }\n'


def test_cache_hit_and_miss(monkeypatch):
    before = dict(cpp_build.stats)
    f = cpp_build.load(_SRC % 7, "pi_kernel")
    assert f() == 7 and cpp_build.stats["compiles"] == before["compiles"] + 1
    assert cpp_build.load(_SRC % 7, "pi_kernel")() == 7
    assert cpp_build.stats["memory_hits"] == before["memory_hits"] + 1
    monkeypatch.setattr(cpp_build, "_loaded", {})  # a new process: the disk cache answers
    assert cpp_build.load(_SRC % 7, "pi_kernel")() == 7
    assert cpp_build.stats["disk_hits"] == before["disk_hits"] + 1
    assert cpp_build.stats["compiles"] == before["compiles"] + 1


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_cache_entry_is_rebuilt(monkeypatch, damage):
    src = _SRC % (11 if damage == "truncated" else 12)
    compiler = cpp_build.find_compiler()
    so = cpp_build.cache_dir() / f"{cpp_build.cache_key(src, compiler)}.so"
    cpp_build._compile(src, compiler, so)  # an entry another process wrote
    if damage == "truncated":  # checksum no longer matches
        so.write_bytes(so.read_bytes()[:100])
    else:  # checksum matches, but the file is no shared library
        so.write_bytes(b"not an ELF file" * 10)
        so.with_suffix(".sha256").write_text(cpp_build._checksum(so))
    before = dict(cpp_build.stats)
    assert cpp_build.load(src, "pi_kernel")() == int(src.split("return ")[1].split(";")[0])
    assert cpp_build.stats["rebuilt"] == before["rebuilt"] + 1
    assert so.stat().st_size > 150


def test_two_processes_compile_same_graph(tmp_path):
    script = textwrap.dedent("""
        import torch, pypto_inductor
        from pypto_inductor.codegen import cpp_build
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
    monkeypatch.setattr(cpp, "_warned_no_compiler", False)
    monkeypatch.setattr(cpp_build, "_loaded", {})
    fn = lambda x: torch.softmax(x, -1) + x.exp()  # noqa: E731
    with pytest.warns(UserWarning, match="no C.. compiler") as rec:
        check(fn, rand(8, 16), built=built, native=False)
    assert sum("compiler" in str(w.message) for w in rec) == 1
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
