"""The Ascend ROI model agrees with pypto's simulator on a few calibration candidates.

A handful of candidates from ``benchmarks.calibrate_ascend`` (the full set and its
report: docs/ascend_calibration.md) are planned for ascend-a2, predicted by the
fitted ROI model and simulated fused and unfused by pypto; the model's fuse-or-not
decision must match the simulator's. Simulations are cached by kernel source
($PYPTO_INDUCTOR_CACHE_DIR), so a re-run only plans. Skips without pypto.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("pypto") is None:
    pytest.skip("pypto is not installed (pip install 'pypto-inductor[pypto]')",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import calibrate_ascend as cal  # noqa: E402

import pypto_inductor  # noqa: E402
from pypto_inductor.hardware import ascend_a2  # noqa: E402

NAMES = ["add_mul_relu_256x1024", "bias_relu_1024x1024", "scaled_softmax_512x512",
         "rmsnorm_512x1024", "addmm_relu_256x512x256"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))  # nothing may land in the caller's directory
    try:
        points, defaults, _ = cal.collect(NAMES, log=lambda *a: None)
    finally:
        os.chdir(cwd)
    return points, defaults


def test_fitted_model_decisions_agree_with_simulation(calibrated):
    points, _ = calibrated
    hw = ascend_a2()
    assert hw.vector_elems_per_s, "ascend_a2() carries the fitted element rate"
    result = cal.evaluate(points, cal.params_of(hw), hw.cube_flops_per_s)
    assert result["n"] >= len(NAMES), [p.get("sim_error") for p in points]
    for row in result["rows"]:
        assert row["pred_fuse"] == row["sim_fuse"], row
    # the planner's own ROI (CostModel on the plan) is what evaluate() re-computes
    for p in points:
        assert abs(cal.kernel_us(p["fused"], cal.params_of(hw), hw.cube_flops_per_s)
                   - p["fused"]["time_us"]) < 1e-6


def test_fused_tiles_of_default_plans_beat_unfused(calibrated):
    _, defaults = calibrated
    assert defaults
    for d in defaults:
        assert d["sim_error"] is None, d
        assert d["sim_fused"] < d["sim_unfused"], d


def test_ascend_tiles_are_pypto_friendly_and_host_tiles_unchanged():
    x, y, z = (torch.randn(2048, 1024) for _ in range(3))
    f = lambda x, y, z: torch.relu((x + y) * z)  # noqa: E731
    asc = pypto_inductor.report(f, x, y, z, options={"hardware": "ascend-a2"})
    (tile,) = asc.graphs[0].plan.tiles
    assert tile.tile_shape == (64, 256)
    assert tile.footprint_bytes <= tile.capacity_bytes
    host = pypto_inductor.report(f, x, y, z, options={"hardware": "host"})
    (htile,) = host.graphs[0].plan.tiles
    # host: buffering x 6 fp32 buffers per element within one core's L2, full rows
    assert htile.tile_shape[1] == 1024
    assert htile.footprint_bytes == 2 * 6 * 4 * htile.tile_shape[0] * 1024


def test_calibration_kernels_compute_the_right_values():
    """The kernels these candidates simulate (the fuse-everything and the default plan's
    tiles, fused and each op alone) also run in pypto's interpreter against the
    reference executor."""
    from pypto_inductor.codegen.pypto import verify
    cands = cal.candidates()
    cases, names = [], []
    for name in NAMES:
        _category, fn, inputs = cands[name]
        with torch.no_grad():
            plans = cal.plans_at(fn, inputs, cal.FORCE) + cal.plans_at(fn, inputs, cal.THRESHOLD)
        for plan in plans:
            for tile in plan.tiles:
                for case in verify.tile_case(tile, plan.graph):
                    cases.append(case)
                    names.append(f"{name}/{tile.name}")
        # ... and the one-op kernels simulated as their unfused alternative (the cost
        # baselines of every calibration point and default-plan tile: simulate_many ->
        # emit_variants at the plan's hardware, buffering 2)
        for plan in plans:
            for tile in plan.tiles:
                if sum(not op.is_view for op in tile.ops) < 2:
                    continue
                for case in verify.unfused_cases(tile, plan.graph, plan.hardware):
                    cases.append(case)
                    names.append(f"{name}/{tile.name}/unfused {case[0].tile_name}")
    checks = verify.verify_kernels(cases)
    assert len(checks) >= 2 * len(NAMES)
    assert sum("/unfused " in n for n in names) >= 2 * len(NAMES), names
    bad = {n: (c.verified, c.max_abs_err, c.error) for n, c in zip(names, checks)
           if c.verified is not True}
    assert not bad, bad
