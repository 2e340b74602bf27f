"""Backend options: validation, forced and strict fallback, targets, dumps, registration."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import pypto_inductor
from pypto_inductor import codegen, models
from pypto_inductor.config import Config, ConfigError, parse_options
from pypto_inductor.runtime import KernelBuildError


def _chain(x):
    return x + F.gelu(torch.layer_norm(x, x.shape[-1:]) * 1.5)


def _causes(exc: BaseException):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


# --- validation ---------------------------------------------------------------------------
def test_unknown_option_names_key_and_valid_options():
    with pytest.raises(ConfigError) as info:
        parse_options({"capacity": 4096})
    msg = str(info.value)
    assert "'capacity'" in msg
    for valid in ("capacity_bytes", "roi_threshold", "dtype_policy", "fallback_ops", "target"):
        assert valid in msg


@pytest.mark.parametrize("key,value,expected", [
    ("target", "gpu", ["'cpu'", "'npu'", "'reference'"]),
    ("dtype_policy", "loose", ["'upcast'", "'strict'"]),
    ("fallback", "ignore", ["'eager'", "'error'"]),
    ("hardware", "a100", ["'ascend-a2'", "'host'"]),
    ("capacity_bytes", -1, ["> 0"]),
    ("capacity_bytes", "1MiB", ["int"]),
    ("capacity_bytes", True, ["int"]),
    ("roi_threshold", 0, ["> 0"]),
    ("roi_threshold", "high", ["number"]),
    ("buffering", 4, ["1, 2 or 3"]),
    ("fusion", "yes", ["True or False"]),
    ("profile", 1, ["True or False"]),
    ("keep_buffers", "no", ["True or False"]),
    ("verify_passes", 1, ["True or False"]),
    ("fallback_ops", ["gelu"], ["aten.gelu"]),
    ("fallback_ops", ["aten.gelux"], ["'aten.gelux' is not an ATen operator"]),
    ("fallback_ops", ["aten.gelu.nope"], ["'aten.gelu.nope' is not an ATen operator"]),
    ("report_path", 3, ["path"]),
])
def test_bad_value_names_key_and_valid_values(key, value, expected):
    with pytest.raises(ConfigError) as info:
        parse_options({key: value})
    msg = str(info.value)
    assert repr(key) in msg
    for text in expected:
        assert text in msg, msg


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune",
                                  "max-autotune-no-cudagraphs"])
def test_torch_compile_modes_run(mode, tol):
    """torch.compile hands mode= to the backend: Inductor's mode names are accepted."""
    torch._dynamo.reset()
    x = torch.randn(4, 16)
    out = torch.compile(_chain, backend="pypto", mode=mode)(x)
    torch.testing.assert_close(out, _chain(x), **tol(torch.float32))


def test_unknown_torch_compile_mode_names_valid_modes():
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(_chain, backend="pypto", mode="fastest")(torch.randn(4, 16))
    msg = " ".join(str(e) for e in _causes(info.value))
    assert "'mode'" in msg and "'max-autotune'" in msg, msg


def test_good_options_parse():
    cfg = parse_options({"target": "reference", "capacity_bytes": 4096, "roi_threshold": 2,
                         "fallback_ops": "aten.gelu", "report_path": None, "buffering": 3})
    assert cfg == Config(target="reference", capacity_bytes=4096, roi_threshold=2.0,
                         fallback_ops=("aten.gelu",), buffering=3)
    assert parse_options(None) == Config()
    # per-pass verdicts are a value check: verify_passes implies verify (and the A2 model)
    cfg = parse_options({"verify_passes": True})
    assert cfg.verify and cfg.verify_passes and cfg.hardware_name == "ascend-a2"
    assert not parse_options({"verify": True}).verify_passes
    assert parse_options(cfg) is cfg
    # OpOverloads are accepted as fallback_ops and matched by name.
    cfg = parse_options({"fallback_ops": [torch.ops.aten.gelu.default]})
    assert cfg.forced_fallback("aten.gelu.default")
    assert not cfg.forced_fallback("aten.gelu.other")
    with pytest.raises(ConfigError, match="must be a dict"):
        parse_options(["target", "cpu"])


def test_bad_option_through_torch_compile():
    compiled = torch.compile(_chain, backend="pypto", options={"dtype_policy": "loose"})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, 8))
    assert any(isinstance(e, ConfigError) for e in _causes(info.value))
    assert "'dtype_policy'" in str(info.value) and "'upcast'" in str(info.value)

    torch._dynamo.reset()
    compiled = torch.compile(_chain, backend="pypto", options={"bogus_key": 1})
    with pytest.raises(Exception, match="bogus_key") as info:
        compiled(torch.randn(4, 8))
    assert "capacity_bytes" in str(info.value)  # the valid options are listed


def test_bad_option_through_report():
    with pytest.raises(ConfigError, match="'roi_threshold'"):
        pypto_inductor.report(_chain, torch.randn(4, 8), options={"roi_threshold": -1})


# --- forced and strict fallback -----------------------------------------------------------
@pytest.mark.parametrize("name", ["aten.gelu", "aten.gelu.default"])
def test_fallback_ops_forces_gelu_eager(name, run_both):
    run = run_both(_chain, torch.randn(4, 16, 32), options={"fallback_ops": [name]})
    assert run.fallback_ops() == {"aten.gelu.default": 1}
    graph = run.report.to_dict()["graphs"][0]
    assert any("fallback_ops" in r for r in graph["extern_reasons"].values())
    kinds = [k for t in graph["fusion_tiles"] for k in t["op_kinds"]]
    assert "gelu" not in kinds and kinds  # the rest still runs as kernels


def test_fallback_ops_on_the_mlp(run_both):
    torch.manual_seed(0)
    run = run_both(models.MLP().eval(), torch.randn(8, 64),
                   options={"fallback_ops": ["aten.gelu", "aten.relu"]})
    assert run.fallback_ops() == {"aten.gelu.default": 1, "aten.relu.default": 1}


def test_fallback_error_names_the_unsupported_op():
    model, (x,) = models.build("conv_bn_relu")
    compiled = torch.compile(model, backend="pypto", options={"fallback": "error"})
    with pytest.raises(Exception, match="aten.convolution") as info:
        compiled(torch.randn_like(x))
    assert any(isinstance(e, pypto_inductor.UnsupportedOpsError) for e in _causes(info.value))


def test_fallback_error_allows_ops_forced_eager(run_both):
    torch.manual_seed(0)
    model, (x,) = models.build("conv_bn_relu")
    run = run_both(model, torch.randn_like(x),
                   options={"fallback": "error", "fallback_ops": ["aten.convolution"]})
    assert run.fallback_ops() == {"aten.convolution.default": 1}


def test_fallback_error_passes_a_fully_lowered_model(run_both):
    torch.manual_seed(0)
    run_both(models.MLP().eval(), torch.randn(8, 64), options={"fallback": "error"})


# --- targets ------------------------------------------------------------------------------
def test_npu_target_unavailable_here():
    from pypto_inductor.codegen import pypto as npu

    if not npu.missing_requirements():  # pragma: no cover - an Ascend machine
        pytest.skip("an NPU is available on this machine")
    with pytest.raises(pypto_inductor.TargetUnavailable) as info:
        codegen.get_target("npu")
    msg = str(info.value)
    assert "target='npu'" in msg and ("torch_npu" in msg or "NPU" in msg)
    assert "target='cpu'" in msg  # says what to use instead

    compiled = torch.compile(_chain, backend="pypto", options={"target": "npu"})
    with pytest.raises(Exception, match="target='npu' needs") as info:
        compiled(torch.randn(4, 8))
    assert any(isinstance(e, pypto_inductor.TargetUnavailable) for e in _causes(info.value))


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_targets_match_eager(target, run_both):
    torch.manual_seed(0)
    model = models.TransformerBlock().eval()
    run = run_both(model, torch.randn(2, 8, 64), options={"target": target})
    assert run.report.to_dict()["target"] == target


# --- report_path and debug_dir ------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".html"])
def test_report_path_is_written_by_torch_compile(tmp_path, suffix, run_both):
    path = tmp_path / "sub" / f"r{suffix}"
    run_both(_chain, torch.randn(4, 16, 32), options={"report_path": path})
    assert path.exists()
    text = path.read_text()
    if suffix == ".json":
        data = json.loads(text)
        assert data["target"] == "cpu"
        assert len(data["graphs"]) == 1 and data["graphs"][0]["fusion_tiles"]
        assert data["summary"]["kernels_fused"] >= 1
    else:
        assert text.startswith("<!doctype html>") and "gelu" in text


def test_report_path_accumulates_forward_and_backward(tmp_path):
    path = tmp_path / "train.json"
    torch.manual_seed(0)
    model = models.MLP()
    compiled = torch.compile(model, backend="pypto", options={"report_path": str(path)})
    x = torch.randn(8, 64)
    out = compiled(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    names = [g["name"] for g in json.loads(path.read_text())["graphs"]]
    assert [n.rsplit("_", 1)[-1] for n in names] == ["forward", "backward"]


def test_debug_dir_dumps_tilegraph_and_kernels(tmp_path, run_both):
    debug = tmp_path / "dbg"
    run = run_both(_chain, torch.randn(4, 16, 32), options={"debug_dir": str(debug)})
    tilegraphs = sorted(debug.glob("*.tilegraph.txt"))
    kernels = sorted(debug.glob("*.pto.txt"))
    assert len(tilegraphs) == 1
    plan = run.report.graphs[0].plan
    assert len(kernels) == len(plan.tiles) >= 1
    text = tilegraphs[0].read_text()
    assert text.startswith(f"graph {plan.graph.name}(") and "gelu" in text
    pto = kernels[0].read_text()
    assert pto.startswith("kernel ") and "footprint" in pto and "store" in pto


# --- registration -------------------------------------------------------------------------
def test_backend_is_registered():
    assert "pypto" in torch._dynamo.list_backends()


def test_backend_works_without_importing_the_package():
    code = textwrap.dedent("""
        import sys, torch
        assert "pypto_inductor" not in sys.modules
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
        x = torch.randn(4, 16)
        out = torch.compile(m, backend="pypto")(x)
        torch.testing.assert_close(out, m(x))
        assert "pypto_inductor" in sys.modules
        print("OK")
    """)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")


# --- kernel build failures ----------------------------------------------------------------
def _flaky_target(fail_on: str) -> types.ModuleType:
    """A target (see codegen.Target) whose build fails for tiles containing op ``fail_on``;
    else the reference."""
    from pypto_inductor.codegen import reference

    module = types.ModuleType("pypto_test_flaky_target")
    module.built = []

    def build(tile, graph):
        if fail_on in tile.op_names:
            raise RuntimeError(f"fake compiler error on {fail_on}")
        module.built.append(tile.name)
        return reference.build(tile, graph)

    module.build = build
    module.build_many = lambda tiles, graph: codegen.build_each(build, tiles, graph)
    module.check_available = lambda: None
    module.DEVICES = None
    return module


@pytest.fixture
def flaky_target(monkeypatch):
    module = _flaky_target("gelu")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(codegen.TARGETS, "cpu", module.__name__)
    return module


def test_kernel_build_failure_falls_back_to_eager(flaky_target):
    def f(x, y):
        a = torch.softmax(x, -1) * y  # a row-reduction kernel: builds
        return a, F.gelu(a.sum(0) + 1.0)  # a kernel with gelu: fails to build

    x, y = torch.randn(6, 32), torch.randn(6, 32)
    compiled = torch.compile(f, backend="pypto")
    from pypto_inductor.report import collect
    with warnings.catch_warnings(record=True) as caught, collect() as graphs:
        warnings.simplefilter("always")
        out = compiled(x, y)
        out2 = compiled(x * 2, y)  # the fallback keeps working on later calls
    torch.testing.assert_close(out, f(x, y))
    torch.testing.assert_close(out2, f(x * 2, y))
    ours = [w for w in caught if "failed to build" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "fake compiler error" in str(ours[0].message)
    tiles = pypto_inductor.FusionReport(graphs).to_dict()["graphs"][0]["fusion_tiles"]
    failed = [t for t in tiles if t["kernel_fallback"]]
    assert len(failed) == 1 and "gelu" in failed[0]["op_kinds"]
    assert "fake compiler error" in failed[0]["kernel_fallback"]
    assert all(t["kernel_fallback"] is None for t in tiles if t is not failed[0])
    assert flaky_target.built  # the other kernels were built by the target


def test_kernel_build_failure_with_fallback_error_raises(flaky_target):
    compiled = torch.compile(_chain, backend="pypto", options={"fallback": "error"})
    with pytest.raises(Exception, match="fake compiler error") as info:
        compiled(torch.randn(4, 8))
    assert any(isinstance(e, KernelBuildError) for e in _causes(info.value))
