"""Host value checks of pypto kernels: pypto's interpreter on real inputs vs the reference.

Every pypto kernel emitted for the small test zoo runs through pypto 0.2.0's
host interpreter ("pass verify", :mod:`pypto_inductor.codegen.pypto.verify`) on
seeded random inputs and must match the reference executor; a kernel made wrong
on purpose (a bias added twice) must be caught. Skips when pypto is not
installed; the interpreter's calculator library is built once into the cache
(cmake and a C++ compiler are needed; without them the tiles say why).
"""
from __future__ import annotations

import importlib.util
import re
import shutil

import pytest
import torch

if importlib.util.find_spec("pypto") is None:
    pytest.skip("pypto is not installed (pip install 'pypto-inductor[pypto]')",
                allow_module_level=True)

import pypto_inductor  # noqa: E402
from pypto_inductor.codegen import reference  # noqa: E402
from pypto_inductor.codegen.pypto import verify  # noqa: E402
from pypto_inductor.codegen.pypto.emit import emit_tile  # noqa: E402
from pypto_inductor.models import ZOO, build  # noqa: E402

# Zoo tiles with no pypto kernel at all (nothing to value-check), by their ops: arange
# has no pypto form; rotate_half's cat of a half-width neg (a broadcast with no 2-D
# form yet). Anything else must emit and verify.
NO_KERNEL_OPS = {("arange",), ("cat",)}


def _plan(fn, *inputs, **options):
    rep = pypto_inductor.report(fn, *inputs, options={"hardware": "ascend-a2", **options})
    return [g.plan for g in rep.graphs if g.plan is not None]


@pytest.fixture(scope="module")
def zoo_checks():
    groups, ops = [], {}
    for name in ZOO:
        model, inputs = build(name)
        for plan in _plan(model, *inputs):
            groups.append((plan.tiles, plan.graph))
            ops.update({t.name: tuple(op.op for op in t.ops) for t in plan.tiles})
    assert len(ops) == sum(len(ts) for ts, _ in groups), "tile names must be unique"
    return verify.verify_graphs(groups), ops


def test_every_zoo_pypto_kernel_is_verified(zoo_checks):
    checks, ops = zoo_checks
    verified = [c for c in checks.values() if c.verified]
    wrong = {n: (c.max_abs_err, c.verify_error) for n, c in checks.items() if c.verified is False}
    assert not wrong, wrong
    for name, c in checks.items():
        if c.verified is None:
            assert ops[name] in NO_KERNEL_OPS and "emit failed" in c.verify_error, \
                (name, ops[name], c.verify_error)
    assert len(verified) >= 40, len(verified)
    for c in verified:
        assert c.max_abs_err is not None and c.max_abs_err < 1e-3
        # pypto's own verdict against our reference output agrees
        verdicts = [v for k in c.kernels for v in k.pypto_verdicts]
        assert verdicts and all(v["result"] == "PASS" for v in verdicts), verdicts


def test_a_kernel_with_the_bias_added_twice_is_caught():
    def fn(a, b, bias):
        return torch.relu(a @ b + bias)
    a, b, bias = torch.randn(64, 128), torch.randn(128, 64), torch.randn(64)
    (plan,) = _plan(fn, a, b, bias)
    (tile,) = [t for t in plan.tiles if any(op.op == "add" for op in t.ops)]
    kernel = emit_tile(tile, plan.graph)
    # inject the bug: the first add adds its second operand once more
    m = re.search(r"^(\s*)(\w+) = pypto\.add\((\w+), (\w+)\)$", kernel.source, re.M)
    assert m, kernel.source
    wrong = kernel.source.replace(
        m.group(0), f"{m.group(1)}{m.group(2)} = pypto.add(pypto.add({m.group(3)}, "
        f"{m.group(4)}), {m.group(4)})")
    inputs = verify.random_inputs(kernel, seed=1)
    expected = reference.build(tile, plan.graph).fn(inputs, ())
    import dataclasses
    good, bad = verify.verify_kernels([(kernel, inputs, expected),
                                       (dataclasses.replace(kernel, source=wrong), inputs,
                                        expected)])
    assert good.verified is True, good
    assert bad.verified is False and bad.max_abs_err > 0.5, bad
    assert any(v["result"] == "FAILED" for v in bad.pypto_verdicts), bad.pypto_verdicts


def test_report_verify_fills_tile_fields(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rep = pypto_inductor.report(lambda x, w: torch.nn.functional.silu(x @ w) + x,
                                torch.randn(32, 64), torch.randn(64, 64),
                                options={"simulate": True, "verify": True})
    d = rep.to_dict()
    tiles = d["graphs"][0]["fusion_tiles"]
    for t in tiles:
        assert t["verified"] is True, t
        assert t["max_abs_err"] < 1e-3 and t["pypto_verdicts"]
    assert d["summary"]["tiles_verified"] == len(tiles)
    assert d["summary"]["tiles_verify_failed"] == 0


def test_no_cmake_gives_a_reason_not_an_exception(tmp_path, monkeypatch):
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(tmp_path))  # no library built here
    real_which = shutil.which
    monkeypatch.setattr(verify.shutil, "which",
                        lambda name, *a, **k: None if name == "cmake" else real_which(name, *a, **k))
    with pytest.raises(verify.VerifyUnavailable, match="cmake"):
        verify.calculator_library()
    (plan,) = _plan(lambda x: torch.relu(x) * 2, torch.randn(16, 32))
    checks = verify.verify_plan(plan)
    for c in checks.values():
        assert c.verified is None and "cmake" in c.verify_error
