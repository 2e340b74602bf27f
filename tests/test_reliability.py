"""Reliability faults of issue 12: no crash, no silent wrong answer.

- tensors on a device the target does not run (meta) run eagerly, never a native call;
- long reductions do not saturate their fp32 accumulators (rows and columns);
- casts to integers inside fused kernels convert as eager does (NaN/inf -> INT_MIN);
- the compiler cache, ``CXX`` and build errors fail loudly and recover (see the end).
Special values through every native op: tests/test_special_values.py.
"""
from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import pypto_inductor
from pypto_inductor.codegen import cpp
from pypto_inductor.codegen.cpp import compiler as cpp_build
from pypto_inductor.report import collect
from pypto_inductor.runtime import CompiledGraph, DeviceError


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "cpp_cache"
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(root))
    monkeypatch.setattr(cpp_build, "loaded", dict(cpp_build.loaded))


def _compile(fn, **options):
    return torch.compile(fn, backend="pypto", options={"target": "cpu", **options})


def _quiet(fn, *args):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


# --- devices ---------------------------------------------------------------------------
def _pointwise(x):
    return torch.relu(x) * 2.0 + 1.0


@pytest.mark.parametrize("target", ["cpu", "reference"])
@pytest.mark.parametrize("cpu_first", [False, True])
def test_meta_inputs_run_eagerly(target, cpu_first):
    """A meta call gets eager's meta result (no native call: it used to SIGSEGV)."""
    f = _compile(_pointwise, target=target)
    if cpu_first:
        x = torch.randn(8, 8)
        torch.testing.assert_close(_quiet(f, x), _pointwise(x))
    with pytest.warns(UserWarning, match="meta tensor"):
        out = f(torch.empty(8, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (8, 8)
    x = torch.randn(5, 3)  # and CPU calls still run the plan afterwards
    torch.testing.assert_close(_quiet(f, x), _pointwise(x))


def test_meta_value_inside_the_graph_runs_eagerly():
    fn = lambda x: torch.relu(x.to("meta")) * 2.0  # noqa: E731
    with pytest.warns(UserWarning, match="meta tensor"):
        out = _compile(fn)(torch.randn(8, 8))
    assert out.device.type == "meta" and out.shape == (8, 8)


def test_meta_under_fallback_error_raises_clearly():
    f = _compile(_pointwise, fallback="error")
    with pytest.raises(Exception, match="meta tensor"):
        f(torch.empty(4, device="meta"))


def test_direct_call_with_other_device_runs_eager_or_raises(monkeypatch):
    """A CompiledGraph called straight (no Dynamo guards) with meta tensors never reaches a
    native kernel: it runs its ATen module, or raises DeviceError without one."""
    graphs = []
    real = CompiledGraph.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        graphs.append(self)
    monkeypatch.setattr(CompiledGraph, "__init__", spy)
    x = torch.randn(6, 7)
    _quiet(_compile(_pointwise), x)
    graph = graphs[-1]
    assert graph.kernel_native and all(k["native"] for k in graph.kernel_native.values())
    meta = torch.empty(6, 7, device="meta")
    out = graph([meta])[0]
    assert out.device.type == "meta" and out.shape == (6, 7)
    graph.eager = None
    with pytest.raises(DeviceError, match="runs cpu tensors; it was called with a meta"):
        graph([meta])
    torch.testing.assert_close(graph([x])[0], _pointwise(x))


# --- long reductions ---------------------------------------------------------------------
def _relative_error(out, exact):
    return ((out.double() - exact).abs() / exact.abs()).max().item()


def _exact(case: str, x: torch.Tensor) -> torch.Tensor:
    """The float64 result without a float64 copy of x (256 MiB stays 256 MiB)."""
    dim = 0 if case.startswith("col") else -1
    n = x.shape[dim]
    parts = x.split(1 << 22, dim)  # sum(dtype=float64) would copy all of x to float64
    total = sum(part.double().sum(dim) for part in parts)
    if case.endswith("sum"):
        return total
    if case.endswith("mean"):
        return total / n
    mean = (total / n).unsqueeze(dim)
    squares = sum(((part.double() - mean) ** 2).sum(dim) for part in parts)
    return squares / (n - 1)


@pytest.mark.parametrize("case", ["col_sum", "col_mean", "col_var", "row_sum", "row_var"])
def test_long_reductions_do_not_saturate(case):
    """2^26 elements reduced (256 MiB of fp32): the result is as accurate as eager's (one
    fp32 accumulator gave 2^25 for 2^27 rows of rand(), 0.5 relative error at 2^26 x 2)."""
    n = 2 ** 26
    fns = {"col_sum": ((n, 1), lambda x: x.sum(0)), "col_mean": ((n, 1), lambda x: x.mean(0)),
           "col_var": ((n // 2, 2), lambda x: x.var(0)),
           "row_sum": ((1, n), lambda x: x.sum(-1)), "row_var": ((2, n // 2), lambda x: x.var(-1))}
    shape, fn = fns[case]
    x = torch.rand(*shape)
    exact = _exact(case, x)
    out = _quiet(_compile(fn, fallback="error"), x)
    eager = _relative_error(fn(x), exact)
    assert _relative_error(out, exact) <= max(4 * eager, 2e-7), (case, eager)


def test_column_sum_split_between_threads_stays_accurate():
    """Few kept elements and two threads: the reduced elements split in parts, each a
    double total, combined in double."""
    x = torch.rand(2 ** 22, 3) + 1000.0  # large offset: fp32 would lose the fractions
    exact = x.double().sum(0)  # 96 MiB
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = _quiet(_compile(lambda x: x.sum(0), fallback="error"), x)
    finally:
        torch.set_num_threads(threads)
    assert _relative_error(out, exact) <= max(4 * _relative_error(x.sum(0), exact), 2e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_reductions_of_ordinary_shapes_match_eager(dtype):
    """The blocked accumulation is exact where blocks do not matter (integers) and within
    tolerance elsewhere, for rows and columns longer than one block."""
    x = torch.randn(5000, 37).to(dtype)
    xi = torch.randint(-50, 50, (9000, 5))

    def fn(x, xi):
        return x.sum(0), x.float().mean(0), x.sum(-1), xi.sum(0), xi.sum(-1), \
            x.float().t().contiguous().var(-1)
    out, ref = _quiet(_compile(fn, fallback="error"), x, xi), fn(x, xi)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.3, "rtol": 2e-2}
    torch.testing.assert_close(out, ref, **tol)


# --- casts --------------------------------------------------------------------------------
_CAST_VALUES = [float("nan"), float("inf"), -float("inf"), 3e9, -3e9, 1e20, -1e20, 300.7,
                -300.7, 255.9, 128.5, -129.5, 65537.0, 2.5, -2.5, -0.0, 2147483520.0, 1.7, -0.4]
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def _cast_input(dtype=torch.float32):
    v = torch.tensor(_CAST_VALUES)
    return torch.cat([v, v.flip(0), torch.randn(40) * 1e3]).to(dtype)


@pytest.mark.parametrize("fusion", [True, False])
def test_clamp_after_int_cast_keeps_eager_semantics(fusion):
    """The issue's repro: NaN/inf cast to int32 is INT_MIN, then promoted back to float."""
    fn = lambda t: torch.clamp(t.to(torch.int32), max=1.801)  # noqa: E731
    t = _cast_input()
    out = _quiet(_compile(fn, fallback="error", fusion=fusion), t)
    torch.testing.assert_close(out, fn(t), rtol=0, atol=0)


@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dst", INT_DTYPES, ids=str)
def test_float_to_integer_casts_in_fused_kernels(src, dst):
    """Every integer dtype from every float dtype, followed by integer arithmetic (wraps in
    the narrow type) and by float promotion, fused in one kernel."""
    def fn(t):
        i = t.to(dst)
        return i, i + 1 if dst != torch.bool else i | (t > 0), i * 0.5 + t
    t = _cast_input(src)
    out, ref = _quiet(_compile(fn, fallback="error"), t), fn(t)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=0, equal_nan=True)


# --- the compiler cache, CXX, build errors ---------------------------------------------------
_SRC = 'extern "C" int pi_kernel(void) { return %d; }\n'


@pytest.mark.parametrize("opened", [False, True])
def test_stale_library_lacking_the_symbol_is_rebuilt_and_loads(opened):
    """A cache entry whose checksum holds but which lacks the kernel's symbol (another
    version wrote it) is rebuilt and the rebuild loads in this process: dlopen would hand
    back a library it loaded under that path before, so such a path is reopened through a
    fresh link. ``opened``: the stale library names the symbol in a string (it passes the
    file check, is dlopen'ed, and its dlsym fails)."""
    value = 31 if opened else 32
    src = _SRC % value
    compiler = cpp_build.find_compiler()
    so = cpp_build.cache_dir() / f"{cpp_build.cache_key(src, compiler)}.so"
    stale = ('extern "C" const char* other(void) { return "pi_kernel"; }\n' if opened else
             'extern "C" int other(void) { return 1; }\n')
    cpp_build.compile_library(stale, compiler, so)
    before = dict(cpp_build.stats)
    assert cpp_build.load(src, "pi_kernel")() == value
    assert cpp_build.stats["rebuilt"] == before["rebuilt"] + 1
    assert not list(so.parent.glob("*.reload*.so"))  # the fresh link is gone once loaded


def test_temporaries_of_killed_builds_are_swept(tmp_path, monkeypatch):
    """A kill -9 mid-compile leaves ``<key>.<random>.so.tmp``: the next process removes it
    when its entry's lock is free, and keeps those of builds running now (lock held)."""
    from filelock import FileLock

    root = tmp_path / "cache" / "cpp"
    root.mkdir(parents=True)
    dead, live = "a" * 64, "b" * 64
    stale = [root / f"{dead}.x1.so.tmp", root / f"{dead}.x1.so.tmp.sha256"]
    building = root / f"{live}.x2.so.tmp"
    old_unkeyed, new_unkeyed = root / "tmpold.so.tmp", root / "tmpnew.so.tmp"
    for f in [*stale, building, old_unkeyed, new_unkeyed]:
        f.write_bytes(b"partial")
    hour_ago = cpp_build.time.time() - 3600
    os_utime = __import__("os").utime
    os_utime(old_unkeyed, (hour_ago, hour_ago))
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    with FileLock(str(root / f"{live}.lock")):  # another process is building `live`
        assert cpp_build.cache_dir() == root
        assert all(f.exists() for f in stale)  # only a compile sweeps (a warm start lists nothing)
        assert cpp_build.load(_SRC % 51, "pi_kernel")() == 51  # this process's first compile
    assert not any(f.exists() for f in [*stale, old_unkeyed])
    assert building.exists() and new_unkeyed.exists()


def test_loading_cached_libraries_lists_no_directory(tmp_path, monkeypatch):
    """A warm start (every library on disk) and each compile touch only their own entry's
    files: listing a cache of 50-100k files cost 0.1-1.4 s per compile and per process."""
    import os

    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_build, "swept", set())
    assert cpp_build.load(_SRC % 52, "pi_kernel")() == 52  # built; the first compile sweeps
    monkeypatch.setattr(cpp_build, "loaded", {})  # a new process: nothing in memory
    monkeypatch.setattr(cpp_build, "swept", set())

    def no_listing(*a, **k):
        raise AssertionError("the cache directory was listed")

    monkeypatch.setattr(os, "scandir", no_listing)
    monkeypatch.setattr(type(tmp_path), "glob", no_listing)
    hits = cpp_build.stats["disk_hits"]
    assert cpp_build.load(_SRC % 52, "pi_kernel")() == 52
    assert cpp_build.stats["disk_hits"] == hits + 1
    # a compile with the sweep done lists nothing either, and overwrites a temporary a
    # killed build of its entry left
    monkeypatch.setattr(cpp_build, "swept", {str(tmp_path / "cpp")})
    compiler = cpp_build.find_compiler()
    src = _SRC % 53
    key = cpp_build.cache_key(src, compiler)
    (tmp_path / "cpp" / f"{key}.build.so.tmp").write_bytes(b"partial")
    assert cpp_build.load(src, "pi_kernel")() == 53
    assert not (tmp_path / "cpp" / f"{key}.build.so.tmp").exists()


def test_a_killed_build_leaves_nothing_after_the_next_start(tmp_path):
    """The real thing: a process killed (SIGKILL) while its compiler runs; a new process
    using the cache removes the temporary, and builds the kernel."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYPTO_INDUCTOR_CACHE_DIR": str(tmp_path)}
    big = "".join(f'extern "C" double f{i}(double x) {{ return x * {i} + {i}; }}\n'
                  for i in range(6000))  # a few seconds of compiling
    script = ("import sys; from pypto_inductor.codegen.cpp import compiler as cpp_build; "
              "cpp_build.load(sys.stdin.read(), 'f1')")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                            text=True)
    proc.stdin.write(big)
    proc.stdin.close()
    root = tmp_path / "cpp"
    deadline = time.time() + 120
    while time.time() < deadline and not list(root.glob("*.so.tmp")):
        time.sleep(0.05)
    assert list(root.glob("*.so.tmp")), "the build never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)  # the orphaned compiler may still be writing
    done = subprocess.run([sys.executable, "-c", script.replace("sys.stdin.read()", repr(
        'extern "C" double f1(double x) { return x; }\n'))], env=env, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    leftovers = [p.name for p in root.glob("*.so.tmp*")]
    assert not leftovers or all(time.time() - (root / n).stat().st_mtime < 5 for n in leftovers)


@pytest.mark.parametrize("cxx, why", [("/bin/true", "wrote no library"),
                                      ("/nonexistent/g++", "not found"),
                                      ("g++ -fno-such-flag-at-all", "failed on a test file")])
def test_cxx_that_is_not_a_working_compiler_warns(cxx, why, monkeypatch):
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(cpp_build, "compilers", {})
    with pytest.warns(UserWarning, match=f"CXX='{re.escape(cxx)}' is not a working C.. "
                      f"compiler.*{why}.*; using .*c.."):
        found = cpp_build.find_compiler()
    assert found is not None and found[0] != cxx  # the next candidate, which works
    assert cpp_build.load(_SRC % 41, "pi_kernel")() == 41


def test_cxx_not_working_and_no_other_compiler_is_one_warning(monkeypatch, tmp_path):
    """No compiler at all: the cpu target's one warning says why CXX was not used."""
    monkeypatch.setenv("CXX", "/bin/true")
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++, clang++
    monkeypatch.setattr(cpp_build, "compilers", {})
    monkeypatch.setattr(cpp, "warned_no_compiler", False)
    fn = lambda x: torch.tanh(x) + 1.0  # noqa: E731
    x = torch.randn(3, 5)
    with pytest.warns(UserWarning) as rec:
        out = _compile(fn)(x)
    torch.testing.assert_close(out, fn(x))
    compiler = [str(w.message) for w in rec if "compiler" in str(w.message)]
    assert len(compiler) == 1 and "no C++ compiler" in compiler[0] \
        and "CXX='/bin/true'" in compiler[0] and "wrote no library" in compiler[0], compiler


def test_cxx_with_flags_is_used_with_them(monkeypatch):
    monkeypatch.setenv("CXX", "g++ -O0")
    monkeypatch.setattr(cpp_build, "compilers", {})
    monkeypatch.setattr(cpp_build, "loaded", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a working CXX: no warning
        path, _, flags = cpp_build.find_compiler()
    assert path.endswith("g++") and flags[-1] == "-O0"
    x = torch.randn(9, 20)
    fn = lambda x: torch.softmax(x, -1) * 3.0  # noqa: E731
    torch.testing.assert_close(_quiet(_compile(fn, fallback="error"), x), fn(x))


@pytest.mark.parametrize("key", ["roi_threshold", "capacity_bytes", "buffering"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_numeric_options_reject_nan_and_inf(key, value):
    with pytest.raises(pypto_inductor.ConfigError, match=f"'{key}'"):
        pypto_inductor.parse_options({key: value})
    with pytest.raises(pypto_inductor.ConfigError, match=f"'{key}'"):
        pypto_inductor.Config(**{key: value})


def test_emitter_failure_names_the_tile_and_op(monkeypatch):
    """A bug while writing a tile's C++ (here a KeyError) says which tile and op, and why."""
    from pypto_inductor.codegen.cpp import ops as cpp_emit

    def broken(a, n):
        raise KeyError("cat")
    monkeypatch.setitem(cpp_emit.OPS, "sigmoid", broken)
    fn = lambda x: torch.sigmoid(x * 2.0) + 1.0  # noqa: E731
    x = torch.randn(4, 8)
    with pytest.raises(Exception, match=r"(?s)kernel \S*sigmoid\S* failed.*sigmoid.*KeyError"):
        _quiet(_compile(fn, fallback="error"), x)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"(?s)failed to build.*sigmoid.*KeyError: 'cat'"):
        out = _compile(fn)(x)
    torch.testing.assert_close(out, fn(x))


# --- unexpected compile-time exceptions -------------------------------------------------
@pytest.mark.parametrize("where", ["lower_graph", "plan_fusion", "decomposition_table"])
def test_unexpected_compile_error_runs_the_graph_eagerly(where, monkeypatch):
    """A bug while lowering, planning (one ATen graph) or tracing (AOTAutograd, the whole
    Dynamo graph) makes that graph run eagerly with a warning naming the exception, and an
    eager graph in the report; strict mode and fallback='error' raise it (the tests and the
    fuzzer run strict)."""
    from pypto_inductor import backend

    def broken(*args, **kwargs):
        raise ZeroDivisionError("planted bug")
    monkeypatch.setattr(backend, where, broken)
    x = torch.randn(6, 5, requires_grad=True)
    with collect() as graphs, pytest.warns(UserWarning, match=r"runs eagerly: compiling it "
                                           r"raised ZeroDivisionError: planted bug"):
        out = _compile(_pointwise, strict=False)(x)
        torch.testing.assert_close(out, _pointwise(x))
        out.sum().backward()  # the eager graph's backward too
    torch.testing.assert_close(x.grad, (x > 0).float() * 2.0)
    eager = [g.to_dict()["eager_reason"] for g in graphs if g.eager_reason]
    assert eager and all("ZeroDivisionError: planted bug" in r for r in eager), eager
    for strict in ({"strict": True}, {"strict": False, "fallback": "error"}):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="planted bug"):
            _quiet(_compile(_pointwise, **strict), x.detach())


def test_strict_defaults_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYPTO_INDUCTOR_STRICT", "0")
    assert not pypto_inductor.parse_options({}).strict
    monkeypatch.setenv("PYPTO_INDUCTOR_STRICT", "1")
    assert pypto_inductor.parse_options({}).strict
    assert not pypto_inductor.parse_options({"strict": False}).raise_compile_errors
    with pytest.raises(pypto_inductor.ConfigError, match="'strict'"):
        pypto_inductor.parse_options({"strict": "yes"})


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_dynamo_restarts_pass_through_the_default_mode(train, tol):
    """Dynamo restarts its analysis from inside a backend (dynamic=True and BatchNorm's
    float eps: TensorifyScalarRestartAnalysis) and expects the exception back: the
    non-strict default once caught it, ran every such graph eagerly and warned."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                            torch.nn.ReLU()).train(train)
    ref = copy.deepcopy(m)
    x = torch.randn(2, 3, 8, 8)

    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs eagerly" warning
        with torch.set_grad_enabled(train):
            out = torch.compile(m, backend="pypto", dynamic=True,
                                options={"strict": False})(x)
    torch.testing.assert_close(out, ref(x), **tol(torch.float32))
    assert graphs and not any("eager_reason" in g.to_dict() for g in graphs)
