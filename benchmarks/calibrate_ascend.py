"""ROI calibration for Ascend A2 against pypto's simulator.

``python -m benchmarks.calibrate_ascend [--no-write] [--only NAME ...] [--skip-zoo]``

Builds a calibration set of fusion candidates (elementwise chains, broadcasts,
reductions, softmax, layer/rms norm, matmul epilogues; fp32/fp16/bf16; small to
large shapes) as small torch functions. For each candidate:

1. the planner fuses everything it legally can (``roi_threshold`` ~ 0): every
   multi-op FusionTile of that plan is one calibration point;
2. our ROI model predicts its ``roi_score`` = sum(t(op alone)) / t(fused);
3. pypto's simulator (RunMode.SIM, ``codegen.pypto.sim``) runs it fused and each
   of its ops as its own kernel: simulated speedup = unfused / fused cycles.

Then the Ascend cost-model parameters (launch_us, op_us, cube_epilogue_us, GM
bandwidth, vector flops, vector element rate, effective cube flops) are fitted
by a coordinate search over log grids minimising the squared log error of
roi_score against the simulated speedup, plus a quarter of that of every
kernel's predicted time against its simulated time; the script reports decision
agreement (fuse or not), Spearman rank correlation of predicted roi_score vs
simulated speedup, and the worst misses, before (the original A2 model) and with
the current ``hardware.ascend_a2()`` (the fitted numbers are written there by hand).

It also simulates the default plans (threshold 1.2) of the calibration set and
of the model zoo: every multi-op FusionTile the planner fuses must be faster
fused than unfused, and every zoo FusionTile either simulates or is split with
the unsupported op named.

Simulations are cached by kernel source under $PYPTO_INDUCTOR_CACHE_DIR
(``codegen.pypto.sim``): a re-run only plans. Writes docs/ascend_calibration.md
(and the raw data to docs/ascend_calibration.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import pypto_inductor
from pypto_inductor import models
from pypto_inductor.codegen.pypto import sim as pypto_sim
from pypto_inductor.codegen.pypto.emit import emit_tile
from pypto_inductor.fusion.roi import CostModel
from pypto_inductor.hardware import ascend_a2
from pypto_inductor.ir import OpKind

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ascend_calibration.md"
DATA = ROOT / "docs" / "ascend_calibration.json"
THRESHOLD = ascend_a2().default_roi_threshold  # the planner default for ascend-a2
FORCE = 1e-6  # a threshold every legal merge clears: the "fuse everything" plan

# The A2 model before calibration (hardware.ascend_a2() as first written).
BASELINE = {"launch_us": 3.0, "op_us": 0.0, "cube_epilogue_us": 0.0,
            "gm_bandwidth_bytes_per_s": 1.6e12,
            "vector_flops_per_s": 48 * 64 * 1.85e9, "vector_elems_per_s": None,
            "cube_flops_per_s": 24 * 2 * 16 ** 3 * 1.85e9}


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# --- the calibration set: name -> (category, builder() -> (fn, inputs)) -------------------
def _rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def candidates():
    c = {}

    def add(name, category, fn, *inputs):
        c[name] = (category, fn, inputs)

    f16, bf16 = torch.float16, torch.bfloat16
    # elementwise chains
    add("add_mul_relu_2048x1024", "elementwise", lambda x, y, z: torch.relu((x + y) * z),
        _r(2048, 1024), _r(2048, 1024), _r(2048, 1024))
    add("add_mul_relu_256x1024", "elementwise", lambda x, y, z: torch.relu((x + y) * z),
        _r(256, 1024), _r(256, 1024), _r(256, 1024))
    add("exp_relu_1024x1024", "elementwise", lambda x: torch.exp(torch.relu(x)), _r(1024, 1024))
    add("chain6_512x1024", "elementwise",
        lambda x: (torch.sigmoid(x * 2.0 + 1.0) * x - 0.5).abs(), _r(512, 1024))
    add("silu_mul_1024x512", "elementwise", lambda x, y: x * torch.sigmoid(x) * y,
        _r(1024, 512), _r(1024, 512))
    add("gelu_tanh_add_512x1024", "elementwise",
        lambda x, y: F.gelu(x + y, approximate="tanh"), _r(512, 1024), _r(512, 1024))
    add("fp16_add_relu_1024x1024", "elementwise", lambda x, y: torch.relu(x + y),
        _r(1024, 1024, dtype=f16), _r(1024, 1024, dtype=f16))
    add("bf16_mul_add_512x512", "elementwise", lambda x, y: x * y + x,
        _r(512, 512, dtype=bf16), _r(512, 512, dtype=bf16))
    add("add_relu_64x64", "elementwise", lambda x, y: torch.relu(x + y), _r(64, 64), _r(64, 64))
    add("mul_add_8x32", "elementwise", lambda x, y: x * y + 1.0, _r(8, 32), _r(8, 32))
    add("mul_add_100x100", "elementwise", lambda x, y: x * y + y, _r(100, 100), _r(100, 100))
    add("add_mul_3d_4x128x256", "elementwise", lambda x, y: (x + y) * y,
        _r(4, 128, 256), _r(4, 128, 256))
    add("where_gt_512x512", "elementwise", lambda x, y: torch.where(x > 0, x, y * 0.1),
        _r(512, 512), _r(512, 512))
    add("clamp_max_1024x256", "elementwise",
        lambda x, y: torch.clamp(torch.maximum(x, y) * 2.0, -1.0, 1.0), _r(1024, 256), _r(1024, 256))
    add("two_outputs_512x1024", "elementwise",
        lambda x: (lambda y: (y, torch.relu(y)))(x * 2.0 + 1.0), _r(512, 1024))
    add("add_relu_4096x4096", "elementwise", lambda x, y: torch.relu(x + y),
        _r(4096, 4096), _r(4096, 4096))
    # broadcasts
    add("bias_relu_1024x1024", "broadcast", lambda x, b: torch.relu(x + b), _r(1024, 1024), _r(1024))
    add("rowscale_bias_1024x512", "broadcast", lambda x, s, b: x * s + b,
        _r(1024, 512), _r(1024, 1), _r(512))
    add("bias_gelu_mul_512x1024", "broadcast", lambda x, b: F.gelu(x + b) * b,
        _r(512, 1024), _r(1024))
    add("bias_sigmoid_256x256", "broadcast", lambda x, b: torch.sigmoid(x + b), _r(256, 256), _r(256))
    # reductions
    add("mul_sum_1024x1024", "reduction", lambda x, y: (x * y).sum(-1), _r(1024, 1024), _r(1024, 1024))
    add("center_512x1024", "reduction", lambda x: x - x.mean(-1, keepdim=True), _r(512, 1024))
    add("amax_sub_exp_512x512", "reduction",
        lambda x: torch.exp(x - x.amax(-1, keepdim=True)), _r(512, 512))
    add("scale_sum_dim0_1024x256", "reduction", lambda x: (x * 2.0).sum(0), _r(1024, 256))
    add("normalize_by_sum_256x1024", "reduction",
        lambda x: x.abs() / x.abs().sum(-1, keepdim=True), _r(256, 1024))
    add("sq_mean_64x4096", "reduction", lambda x: (x * x).mean(-1), _r(64, 4096))
    # softmax
    add("scaled_softmax_512x512", "softmax", lambda x: torch.softmax(x * 0.125, -1), _r(512, 512))
    add("softmax_mask_add_8x128x128", "softmax", lambda x, m: torch.softmax(x + m, -1),
        _r(8, 128, 128), _r(128, 128))
    add("log_softmax_mul_256x1024", "softmax", lambda x: torch.log_softmax(x, -1) * 2.0,
        _r(256, 1024))
    add("softmax_mul_1024x1024", "softmax", lambda x, y: torch.softmax(x, -1) * y,
        _r(1024, 1024), _r(1024, 1024))
    # layer / rms norm
    ln = torch.nn.LayerNorm(1024)
    add("layernorm_512x1024", "norm", lambda x: ln(x), _r(512, 1024))
    ln256 = torch.nn.LayerNorm(256)
    add("layernorm_2048x256", "norm", lambda x: ln256(x), _r(2048, 256))
    lngr = models.LayerNormGeluResidual(256).eval()
    add("ln_gelu_residual_4x32x256", "norm", lambda x: lngr(x), _r(4, 32, 256))
    add("rmsnorm_512x1024", "norm", _rmsnorm, _r(512, 1024), _r(1024))
    add("rmsnorm_fp16_256x1024", "norm", _rmsnorm, _r(256, 1024, dtype=f16), _r(1024, dtype=f16))
    add("add_rmsnorm_1024x512", "norm", lambda x, r, w: _rmsnorm(x + r, w),
        _r(1024, 512), _r(1024, 512), _r(512))
    # matmul epilogues
    add("addmm_relu_256x512x256", "matmul", lambda a, b, bias: torch.relu(torch.addmm(bias, a, b)),
        _r(256, 512), _r(512, 256), _r(256))
    add("mm_bias_gelu_512x256x512", "matmul", lambda a, b, bias: F.gelu(a @ b + bias),
        _r(512, 256), _r(256, 512), _r(512))
    add("mm_fp16_relu_256x256x256", "matmul", lambda a, b: torch.relu(a @ b),
        _r(256, 256, dtype=f16), _r(256, 256, dtype=f16))
    add("bmm_scale_4x128x64", "matmul", lambda q, k: torch.bmm(q, k) * 0.125,
        _r(4, 128, 64), _r(4, 64, 128))
    add("mm_residual_512x512x512", "matmul", lambda a, b, r: a @ b + r,
        _r(512, 512), _r(512, 512), _r(512, 512))
    add("mm_bias_32x64x64", "matmul", lambda a, b, bias: a @ b + bias,
        _r(32, 64), _r(64, 64), _r(64))
    add("addmm_128x256x256", "matmul", lambda a, b, bias: torch.addmm(bias, a, b),
        _r(128, 256), _r(256, 256), _r(256))
    add("mm_bias_small_64x64x64", "matmul", lambda a, b, bias: torch.relu(a @ b + bias),
        _r(64, 64), _r(64, 64), _r(64))
    return c


# --- planning and simulation -----------------------------------------------------------------
def plans_at(fn, inputs, threshold: float):
    rep = pypto_inductor.report(fn, *inputs, options={"hardware": "ascend-a2",
                                                      "roi_threshold": threshold})
    return [g.plan for g in rep.graphs if g.plan is not None]


def _features(cost: CostModel, ops) -> dict:
    k = cost.kernel_cost(ops)
    return {"gm_bytes": k.gm_bytes, "flops": k.flops,
            "elems": max((cost.op_elems[id(op)] for op in ops), default=0),
            "cube": any(op.kind is OpKind.MATMUL for op in ops),
            "n_ops": sum(1 for op in ops if not op.is_view),
            "mixed": any(op.kind is OpKind.MATMUL for op in ops) and any(
                op.kind is not OpKind.MATMUL and not op.is_view for op in ops),
            "time_us": k.time_us}


def simulate_many(jobs):
    """jobs: [(key, tile, graph, hw)] -> {key: TileSimulation}; one batch of kernels."""
    staged, kernels = [], []
    for key, tile, graph, hw, *rest in jobs:
        if rest and rest[0]:  # the fused kernel only
            try:
                fused, singles, errors = emit_tile(tile, graph), [], []
            except Exception as e:  # noqa: BLE001 - recorded, as pypto_sim does
                fused, singles, errors = None, [], [f"split: {e}"]
        else:
            fused, singles, errors = pypto_sim.emit_variants(tile, graph, hw, 2)
        slots = {}
        if fused is not None:
            slots["fused"] = len(kernels)
            kernels.append(fused)
        for name, k in singles:
            if k is not None:
                slots[name] = len(kernels)
                kernels.append(k)
        staged.append((key, tile, fused, singles, errors, slots))
    results = pypto_sim.simulate_kernels(kernels)
    out = {}
    for key, tile, fused, singles, errors, slots in staged:
        sim = pypto_sim.TileSimulation(tile.name, pypto_source=fused.source if fused else None)
        errors = list(errors)
        if "fused" in slots:
            r = results[slots["fused"]]
            sim.simulated_cycles_fused, sim.work_cycles_fused = r.cycles, r.work_cycles
            if r.error:
                errors.append(f"fused kernel: {r.error}")
        pypto_sim.record_unfused(sim, singles, slots, results, errors)
        sim.simulation_error = "\n".join(errors) if errors else None
        out[key] = sim
    return out


REAL_MODELS = ("transformer", "llama", "ln_gelu_residual", "mlp")  # models.ZOO
REAL_ZOO = ("gpt2", "llama")  # pypto_inductor.zoo (transformers models)


def _real_candidates():
    """(name, fn, inputs) of real models: the small model zoo and transformers models
    of ``pypto_inductor.zoo`` (forward graphs)."""
    from pypto_inductor import zoo

    for name in REAL_MODELS:
        model, inputs = models.build(name)
        yield f"model:{name}", model.eval(), inputs
    for name in REAL_ZOO:
        try:
            model, batch = zoo.build(name).eval(), zoo.batch(name)
        except Exception as e:  # noqa: BLE001 - transformers missing or the model not built
            print(f"# real model {name} skipped: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        keys = list(batch)

        class Wrap(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, *xs):
                out = self.m(**dict(zip(keys, xs)))
                return out.logits if hasattr(out, "logits") else out[0]
        yield f"zoo:{name}", Wrap(model), tuple(batch.values())


def collect(names=None, log=print, real: bool = False) -> tuple[list[dict], list[dict], list[dict]]:
    """(calibration points, default-plan multi-op tiles, planner splits) of the set.

    A planner split is a candidate whose default plan (threshold 1.2) has other
    FusionTiles than the fuse-everything plan: both plans are simulated (each tile
    fused) and compared with the ROI model's ratio of their predicted times.
    """
    torch.manual_seed(0)
    cands = candidates()
    names = list(names or cands)
    if real:
        for name, fn, inputs in _real_candidates():
            cands[name] = ("real model", fn, inputs)
            names.append(name)
    jobs, points, defaults, splits = [], [], [], []
    for name in names:
        category, fn, inputs = cands[name]
        with torch.no_grad():
            forced = plans_at(fn, inputs, FORCE)
            default = plans_at(fn, inputs, THRESHOLD)
        for gi, plan in enumerate(forced):
            cost = CostModel(plan.graph, plan.hardware)
            for ti, tile in enumerate(plan.tiles):
                compute = [op for op in tile.ops if not op.is_view]
                if len(compute) < 2:
                    continue
                key = f"{name}#{gi}.{ti}" if (len(forced) > 1 or ti) else name
                points.append({
                    "name": key, "candidate": name, "category": category,
                    "ops": [op.op for op in tile.ops], "tile_shape": list(tile.tile_shape),
                    "dtype": tile.dtype,
                    "fused": _features(cost, tile.ops),
                    "singles": {op.name: _features(cost, [op]) for op in compute},
                })
                jobs.append((("cal", key), tile, plan.graph, plan.hardware))
        for gi, (fp, dp) in enumerate(zip(forced, default) if len(forced) == len(default) else ()):
            parts = lambda plan: sorted(tuple(op.name for op in t.ops) for t in plan.tiles)  # noqa: E731
            if parts(fp) == parts(dp):
                continue
            fc, dc = CostModel(fp.graph, fp.hardware), CostModel(dp.graph, dp.hardware)
            rec = {"name": f"{name}#{gi}", "candidate": name,
                   "forced": [" ".join(op.op for op in t.ops) for t in fp.tiles],
                   "default": [" ".join(op.op for op in t.ops) for t in dp.tiles],
                   "pred_ratio": sum(dc.kernel_cost(t.ops).time_us for t in dp.tiles)
                   / sum(fc.kernel_cost(t.ops).time_us for t in fp.tiles),
                   "n_forced": len(fp.tiles), "n_default": len(dp.tiles)}
            splits.append(rec)
            for ti, tile in enumerate(fp.tiles):
                jobs.append((("forced_all", rec["name"], ti), tile, fp.graph, fp.hardware, True))
            for ti, tile in enumerate(dp.tiles):
                jobs.append((("default_all", rec["name"], ti), tile, dp.graph, dp.hardware, True))
        for gi, plan in enumerate(default):
            for ti, tile in enumerate(plan.tiles):
                if sum(not op.is_view for op in tile.ops) < 2:
                    continue
                key = f"{name}#{gi}.{ti}"
                defaults.append({"name": key, "candidate": name, "ops": [op.op for op in tile.ops],
                                 "tile_shape": list(tile.tile_shape)})
                jobs.append((("default", key), tile, plan.graph, plan.hardware))
    t0 = time.monotonic()
    sims = simulate_many(jobs)
    log(f"# simulated {len(jobs)} tiles (fused + each op alone) in {time.monotonic() - t0:.0f} s")
    for p in points:
        s = sims[("cal", p["name"])]
        # the kernels' work (task span + an empty kernel's cost), not the quantized totals
        p["sim_fused"], p["sim_unfused"] = s.work_cycles_fused, s.work_cycles_unfused
        p["sim_by_op"] = dict(s.unfused_work_by_op)
        p["total_fused"], p["total_unfused"] = s.simulated_cycles_fused, s.simulated_cycles_unfused
        p["sim_error"] = s.simulation_error
    for d in defaults:
        s = sims[("default", d["name"])]
        d["sim_fused"], d["sim_unfused"] = s.work_cycles_fused, s.work_cycles_unfused
        d["sim_error"] = s.simulation_error
    for rec in splits:
        totals = {}
        for side, n in (("forced_all", rec["n_forced"]), ("default_all", rec["n_default"])):
            cycles = [sims[(side, rec["name"], ti)].work_cycles_fused for ti in range(n)]
            totals[side] = None if any(c is None for c in cycles) else sum(cycles)
        rec["sim_forced"], rec["sim_default"] = totals["forced_all"], totals["default_all"]
        rec["sim_ratio"] = (rec["sim_default"] / rec["sim_forced"]
                            if rec["sim_default"] and rec["sim_forced"] else None)
    return points, defaults, splits


TILE_CASES = ("add_mul_relu_2048x1024", "chain6_512x1024", "bias_relu_1024x1024",
              "softmax_mul_1024x1024", "layernorm_512x1024")


def tile_choice(log=print) -> list[dict]:
    """Fused kernels simulated at the old tile choice (the host's footprint rules on the
    A2 buffers) and at the current ascend-a2 one."""
    from pypto_inductor.fusion.capacity import plan_tile

    hw = ascend_a2()
    old_hw = dataclasses.replace(hw, footprint_model="all_live", max_tile_buffer_fraction=None,
                                 preferred_max_tile_cols=None, tile_col_align_bytes=0,
                                 min_tile_rows=1)
    cands = candidates()
    rows, kernels = [], []
    for name in TILE_CASES:
        _, fn, inputs = cands[name]
        with torch.no_grad():
            (plan,) = plans_at(fn, inputs, FORCE)
        tile = max(plan.tiles, key=lambda t: len(t.ops))
        old = plan_tile(tile.ops, plan.graph, old_hw, 2).tile_shape
        new_k = emit_tile(tile, plan.graph)
        old_k = emit_tile(dataclasses.replace(tile, tile_shape=tuple(old)), plan.graph)
        rows.append({"name": name, "ops": [op.op for op in tile.ops], "old_tile": list(old),
                     "old_vec_tile": list(old_k.vec_tile), "new_tile": list(tile.tile_shape),
                     "new_vec_tile": list(new_k.vec_tile)})
        kernels += [old_k, new_k]
    results = pypto_sim.simulate_kernels(kernels)
    for i, r in enumerate(rows):
        r["old_cycles"], r["new_cycles"] = results[2 * i].cycles, results[2 * i + 1].cycles
    log(f"# tile choice: {len(rows)} cases")
    return rows


def empty_kernel(log=print) -> dict:
    """An empty kernel's cost: a one-op 8x32 kernel (one task); its "Total Cycles" minus
    its task span is the fixed cost every kernel pays (``sim.LAUNCH_CYCLES``)."""
    with torch.no_grad():
        (plan,) = plans_at(lambda x: x + 1.0, (_r(8, 32),), FORCE)
    (r,) = pypto_sim.simulate_kernels([emit_tile(plan.tiles[0], plan.graph)])
    out = {"total": r.cycles, "span": r.span_cycles,
           "launch": (r.cycles - r.span_cycles) if r.ok and r.span_cycles is not None else None,
           "stats": r.stats}
    log(f"# empty kernel: {out['total']} total, {out['span']} task span -> launch {out['launch']}"
        f" (sim.LAUNCH_CYCLES = {pypto_sim.LAUNCH_CYCLES})")
    return out


# --- the model and the fit ------------------------------------------------------------------
KEYS = ("launch_us", "op_us", "cube_epilogue_us", "gm_bandwidth_bytes_per_s",
        "vector_flops_per_s", "vector_elems_per_s", "cube_flops_per_s")


def params_of(hw) -> dict:
    return {k: getattr(hw, k) for k in KEYS}


def kernel_us(f: dict, p: dict, cube_flops: float | None = None) -> float:
    """The ROI model's kernel time (fusion/roi.py CostModel.kernel_cost) under parameters p."""
    cube_flops = p.get("cube_flops_per_s") or cube_flops
    peak = cube_flops if f["cube"] else p["vector_flops_per_s"]
    s = max(f["gm_bytes"] / p["gm_bandwidth_bytes_per_s"], f["flops"] / peak)
    if p.get("vector_elems_per_s"):
        s = max(s, f["elems"] / p["vector_elems_per_s"])
    fixed = p["launch_us"] + (p.get("op_us") or 0.0) * f.get("n_ops", 1)
    if f.get("mixed"):
        fixed += p.get("cube_epilogue_us") or 0.0
    return fixed + s * 1e6


def predicted_roi(point: dict, p: dict, cube_flops: float | None = None) -> float:
    unfused = sum(kernel_us(f, p, cube_flops) for f in point["singles"].values())
    return unfused / kernel_us(point["fused"], p, cube_flops)


def _freq() -> float:
    return float(dict(ascend_a2().details)["freq_hz"])


def _kernel_table(points):
    """Every simulated kernel: (features, simulated us)."""
    freq = _freq()
    rows = []
    for p in points:
        if not ok(p):
            continue
        rows.append((p["fused"], p["sim_fused"] / freq * 1e6))
        for name, f in p["singles"].items():
            rows.append((f, p["sim_by_op"][name] / freq * 1e6))
    return rows


class _Fit:
    """Vectorised kernel times of every calibration kernel, for the parameter search."""

    def __init__(self, points):
        pts = [p for p in points if ok(p)]
        feats, self.owner, self.is_fused, sim = [], [], [], []
        freq = _freq()
        for i, p in enumerate(pts):
            feats.append(p["fused"]); self.owner.append(i); self.is_fused.append(True)
            sim.append(p["sim_fused"] / freq * 1e6)
            for name, f in p["singles"].items():
                feats.append(f); self.owner.append(i); self.is_fused.append(False)
                sim.append(p["sim_by_op"][name] / freq * 1e6)
        arr = lambda key: np.array([float(f.get(key, 1)) for f in feats])  # noqa: E731
        self.gm, self.fl, self.el, self.n = arr("gm_bytes"), arr("flops"), arr("elems"), arr("n_ops")
        self.cube = np.array([f["cube"] for f in feats], bool)
        self.mixed = np.array([bool(f.get("mixed")) for f in feats], float)
        self.owner, self.is_fused = np.array(self.owner), np.array(self.is_fused)
        self.log_sim = np.log(np.array(sim))
        self.log_speed = np.log(np.array([p["sim_unfused"] / p["sim_fused"] for p in pts]))
        self.npts = len(pts)

    def times(self, p: dict) -> np.ndarray:
        peak = np.where(self.cube, p["cube_flops_per_s"], p["vector_flops_per_s"])
        s = np.maximum(self.gm / p["gm_bandwidth_bytes_per_s"], self.fl / peak)
        if p.get("vector_elems_per_s"):
            s = np.maximum(s, self.el / p["vector_elems_per_s"])
        return (p["launch_us"] + p.get("op_us", 0.0) * self.n
                + (p.get("cube_epilogue_us") or 0.0) * self.mixed + s * 1e6)

    def errors(self, p: dict) -> tuple[float, float]:
        """(mean squared log error of kernel times, of roi_score vs simulated speedup)."""
        t = self.times(p)
        e_time = float(np.mean((np.log(t) - self.log_sim) ** 2))
        e_speed = float(np.mean((self.log_roi(t) - self.log_speed) ** 2))
        return e_time, e_speed

    def log_roi(self, t: np.ndarray) -> np.ndarray:
        unfused = np.bincount(self.owner[~self.is_fused], t[~self.is_fused], self.npts)
        return np.log(unfused / t[self.is_fused])



TIME_WEIGHT = 0.25  # objective = speedup error + TIME_WEIGHT x kernel time error (both log)


def fit(points, start: dict, rounds: int = 8) -> tuple[dict, float, tuple[float, float]]:
    """Coordinate search (log grids, x1/30..x30 around the current value, refined each
    round) of every parameter in KEYS on squared log errors: the roi_score against the
    simulated speedup of every calibration point, plus TIME_WEIGHT x every simulated
    kernel's time (which pins the absolute scale)."""
    f = _Fit(points)
    p = {k: (start.get(k) or {"op_us": 0.1, "cube_epilogue_us": 1.0,
                              "vector_elems_per_s": 1e11}.get(k)) for k in KEYS}

    def objective(q):
        et, es = f.errors(q)
        return es + TIME_WEIGHT * et

    p, best = _coordinate_search(objective, p, rounds, span=30.0, steps=61, shrink=0.6,
                                 floor=1.5)
    return p, best, f.errors(p)


def _coordinate_search(objective, p: dict, rounds: int, span: float, steps: int,
                       shrink: float, floor: float) -> tuple[dict, float]:
    """Each parameter in turn over a geometric grid of ``steps`` values within a factor
    ``span`` of its value, keeping any improvement; the span narrows every round."""
    best = objective(p)
    for _ in range(rounds):
        for k in KEYS:
            for v in p[k] * np.geomspace(1 / span, span, steps):
                q = dict(p, **{k: float(v)})
                e = objective(q)
                if e < best - 1e-12:
                    best, p = e, q
        span = max(span ** shrink, floor)
    return p, best


AGREE_WEIGHT = 20.0  # per disagreeing decision, against the log objective (~0.05-0.2)


def fit_decisions(points, start: dict, rounds: int = 6) -> tuple[dict, float]:
    """From ``start`` (the log fit), a coordinate search of the same parameters on the
    fuse-or-not decisions: AGREE_WEIGHT x (share of points where roi >= THRESHOLD and
    simulated speedup > 1 disagree) plus the log objective of :func:`fit` (so the
    kernel times stay pinned)."""
    f = _Fit(points)
    sim_fuse = f.log_speed > 0.0

    def objective(q):
        t = f.times(q)
        et, es = f.errors(q)
        miss = float(np.mean((f.log_roi(t) >= math.log(THRESHOLD)) != sim_fuse))
        return AGREE_WEIGHT * miss + es + TIME_WEIGHT * et

    return _coordinate_search(objective, dict(start), rounds, span=3.0, steps=41, shrink=0.7,
                              floor=1.2)


def log_rmse(points, p, cube_flops=None) -> float:
    rows = _kernel_table(points)
    e = [(math.log(kernel_us(f, p, cube_flops)) - math.log(us)) ** 2 for f, us in rows]
    return math.sqrt(sum(e) / len(e))


def ok(p: dict) -> bool:
    return bool(p.get("sim_fused")) and bool(p.get("sim_unfused"))


def rankdata(x) -> np.ndarray:
    x = np.asarray(x, float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):  # average ranks of ties
        m = x == v
        if m.sum() > 1:
            ranks[m] = ranks[m].mean()
    return ranks


def spearman(a, b) -> float:
    ra, rb = rankdata(a), rankdata(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def evaluate(points, p: dict, cube_flops: float, threshold: float = THRESHOLD) -> dict:
    """Agreement, rank correlation and misses of parameters p on the calibration points."""
    rows = []
    for pt in points:
        if not ok(pt):
            continue
        roi = predicted_roi(pt, p, cube_flops)
        speed = pt["sim_unfused"] / pt["sim_fused"]
        rows.append({"name": pt["name"], "roi": roi, "speedup": speed,
                     "pred_fuse": roi >= threshold, "sim_fuse": speed > 1.0,
                     "miss": abs(math.log(roi) - math.log(speed))})
    n = len(rows)
    agree = sum(r["pred_fuse"] == r["sim_fuse"] for r in rows)
    agree_t = sum((r["roi"] >= threshold) == (r["speedup"] >= threshold) for r in rows)
    worst = sorted(rows, key=lambda r: (r["pred_fuse"] == r["sim_fuse"], -r["miss"]))[:5]
    return {"n": n, "agreement": agree / n if n else float("nan"),
            "agreement_same_threshold": agree_t / n if n else float("nan"),
            "spearman": spearman([r["roi"] for r in rows], [r["speedup"] for r in rows]),
            "log_rmse_time": log_rmse(points, p, cube_flops), "rows": rows, "worst": worst}


# --- the zoo ---------------------------------------------------------------------------------
def _coverage_models():
    """The model zoo, then the benchmark suite's cases (small scale)."""
    from benchmarks.__main__ import cases

    for name in models.ZOO:
        yield (name, *models.build(name))
    for name, fn, inputs, *_ in cases("small"):
        yield f"bench:{name}", fn, inputs


def zoo_coverage(log=print) -> dict:
    out = {"models": {}, "simulated": 0, "split": 0, "failed": 0, "split_ops": {},
           "multi_op": 0, "multi_op_faster": 0, "slower": [], "failures": [],
           "splits": []}
    for name, model, inputs in _coverage_models():
        with torch.no_grad():
            rep = pypto_inductor.report(model, *inputs, options={"hardware": "ascend-a2",
                                                                  "simulate": True})
        d = rep.to_dict()
        counts = {"tiles": 0, "simulated": 0, "split": 0, "failed": 0}
        for g in d["graphs"]:
            for t in g["fusion_tiles"]:
                counts["tiles"] += 1
                err = t["simulation_error"] or ""
                split_ops = t.get("split_ops") or []
                if split_ops and t["simulated_cycles_fused"] is not None and not err:
                    counts["split"] += 1  # split at ops with no pypto form; every part simulated
                    for op in split_ops:
                        out["split_ops"][op] = out["split_ops"].get(op, 0) + 1
                    out["splits"].append((name, t["name"], ", ".join(split_ops), "parts simulated"))
                elif t["simulated_cycles_fused"] is not None and not err:
                    counts["simulated"] += 1
                    if len(t["ops"]) > 1:
                        out["multi_op"] += 1
                        f, u = t["simulated_cycles_fused"], t["simulated_cycles_unfused"]
                        if u is not None and f < u:
                            out["multi_op_faster"] += 1
                        else:
                            out["slower"].append((name, t["name"], f, u))
                elif err.startswith("split:"):
                    counts["split"] += 1
                    what = err.split("split: ", 1)[1].split(" has no pypto form")[0]
                    kinds = dict(zip(t["ops"], t["op_kinds"]))
                    # the emitter names an op kind, or the value whose layout it cannot express
                    op = f"{kinds[what]} ({what})" if what in kinds else what
                    out["split_ops"][op] = out["split_ops"].get(op, 0) + 1
                    out["splits"].append((name, t["name"], op, err.splitlines()[0][7:170]))
                else:
                    counts["failed"] += 1
                    out["failures"].append((name, t["name"], err.splitlines()[0][:160] if err else "?"))
        out["models"][name] = counts
        for k in ("simulated", "split", "failed"):
            out[k] += counts[k]
        log(f"# zoo {name}: {counts}")
    return out


# --- the report ------------------------------------------------------------------------------
def _fmt_params(p: dict) -> str:
    rate = p.get("vector_elems_per_s")
    return (f"launch_us={p['launch_us']:.3g}, op_us={p.get('op_us') or 0:.3g}, "
            f"cube_epilogue_us={p.get('cube_epilogue_us') or 0:.3g}, "
            f"gm_bandwidth={p['gm_bandwidth_bytes_per_s'] / 1e9:.4g} GB/s, "
            f"vector_flops={p['vector_flops_per_s'] / 1e12:.4g} TFLOP/s, "
            f"vector_elems_per_s={'none' if not rate else f'{rate / 1e9:.4g} G/s'}, "
            f"cube_flops={p['cube_flops_per_s'] / 1e12:.4g} TFLOP/s")


COMMAND = "PYPTO_INDUCTOR_NO_CALIBRATE=1 python -m benchmarks.calibrate_ascend"


def write_doc(points, defaults, before, after, fitted, fit_err, current, zoo, seconds,
              tiles=(), splits=(), empty=None) -> str:
    e_time, e_speed = fit_err
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        pv = importlib.metadata.version("pypto")
    except importlib.metadata.PackageNotFoundError:
        pv = "none"
    hw = ascend_a2()
    L = [
        "# ROI calibration for Ascend A2 (pypto simulator)", "",
        f"Generated by `{COMMAND}` on {today}; pypto {pv}, "
        f"torch {torch.__version__}; {seconds:.0f} s (simulations cached by kernel source).", "",
        "Each calibration point is a multi-op FusionTile of a candidate function, or of a real "
        "model (category *real model*: `model:` = pypto_inductor.models.ZOO, `zoo:` = the "
        "transformers models of pypto_inductor.zoo, forward graphs), planned for "
        "`hardware=\"ascend-a2\"` with every legal merge taken (roi_threshold ~ 0). "
        "*roi* is our ROI model's roi_score for the whole tile (sum of the per-op kernel "
        "times over the fused kernel time); *sim fused/unfused* are the simulated work "
        "cycles of the fused kernel and of one kernel per op; *speedup* = unfused / fused.", "",
        "**What a kernel costs.** pypto's \"Total Cycles\" moves in steps of 2881 cycles and "
        "mostly counts tasks (an RMSNorm on 512x512 and a LayerNorm + residual on 256x1024 both "
        "give 32232), so the costs here are the kernels' *work cycles* "
        "(`SimResult.work_cycles`): the task span in pypto's Perfetto trace (first core task's "
        "start to the last one's end: per-task cycles, waves of tasks, cube -> vector "
        "dependencies) plus an empty kernel's fixed cost `sim.LAUNCH_CYCLES` = "
        f"{pypto_sim.LAUNCH_CYCLES} (measured: a one-task 8x32 kernel, "
        f"{(empty or {}).get('total')} total - {(empty or {}).get('span')} task span = "
        f"{(empty or {}).get('launch')}). Each point also keeps the totals "
        "(`total_fused`, `total_unfused` in the JSON) and the stat report's per-task and "
        "per-pipe numbers are in every SimResult (`stats`).", "",
        f"The model says fuse when roi >= {THRESHOLD} (the default roi_threshold); the "
        "simulator says fuse when the fused kernel is faster (speedup > 1). Columns *roi "
        "before/after* use the original A2 parameters and the fitted ones.", "",
        "## Vector tile choice for ascend-a2", "",
        "The planner's tile choice is now driven by HardwareModel fields consumed by "
        "`fusion/capacity.py` `plan_tile` (the host keeps the defaults, i.e. the old behaviour): "
        f"`footprint_model={hw.footprint_model!r}` (largest per-op operand+result working set, "
        "fp32 compute, as pypto places UB buffers per op), "
        f"`max_tile_buffer_fraction={hw.max_tile_buffer_fraction:.3f}` (no tile buffer above a "
        f"third of UB: pypto fails to place it), `preferred_max_tile_cols={hw.preferred_max_tile_cols}`, "
        f"`tile_col_align_bytes={hw.tile_col_align_bytes}`, `min_tile_rows={hw.min_tile_rows}`. "
        "Fused kernels simulated at the old choice (the host's footprint rules on A2's UB) "
        "and the new one (*vec* is the tile the emitter sets, clamped to a third of UB):", "",
        "| candidate | old tile (vec) | cycles | new tile (vec) | cycles | old / new |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {r['name']} | {'x'.join(map(str, r['old_tile']))} "
          f"({'x'.join(map(str, r['old_vec_tile']))}) | {r['old_cycles'] or 'error'} | "
          f"{'x'.join(map(str, r['new_tile']))} ({'x'.join(map(str, r['new_vec_tile']))}) | "
          f"{r['new_cycles'] or 'error'} | "
          f"{(r['old_cycles'] / r['new_cycles']) if r['old_cycles'] and r['new_cycles'] else float('nan'):.2f} |"
          for r in tiles], "",
        "## Fitted parameters", "",
        f"- before (original A2 model): {_fmt_params(BASELINE)}",
        f"- search optimum (log RMSE {math.sqrt(e_speed):.3f} of roi_score vs simulated "
        f"speedup, {math.sqrt(e_time):.3f} of kernel times): {_fmt_params(fitted)}",
        f"- in `hardware.ascend_a2()` now (rounded): {_fmt_params(current)}", "",
        "The search: coordinate descent over log grids (x1/30..x30 around the current value, "
        "narrowing each round, 8 rounds) from the original parameters, minimising the mean "
        "squared log error of roi_score against the simulated speedup of every calibration "
        f"point plus {TIME_WEIGHT} x that of every simulated kernel's time (fused kernels and "
        "one-op kernels; it pins the absolute scale); then, from that optimum, the same "
        f"search (x1/3..x3, 6 rounds) on {AGREE_WEIGHT:g} x the share of fuse-or-not "
        "decisions that disagree with the simulator plus that log objective "
        "(`fit_decisions`).", "",
        "Two terms are new in the ROI model (`fusion/roi.py`; zero/None on the host): "
        "`HardwareModel.vector_elems_per_s`, since in pypto's simulator a kernel costs about "
        "one pass over its iteration domain whatever its bytes (relu, add and exp on "
        "2048x1024 simulate within 5% of each other), which a bytes-only roofline misses; and "
        "`HardwareModel.op_us`, a fixed cost per op inside a kernel (a fused 2-op kernel on "
        "64x64 simulates 18% slower than one op alone). The cube rate is an effective one: "
        "simulated matmuls run far below the cube unit's peak. "
        "`HardwareModel.cube_epilogue_us` is the fixed cost of a kernel mixing cube and "
        "vector work (a matmul with an epilogue: A2 runs them on separate cores), so a "
        "small matmul + one-op epilogue is no longer predicted to gain a whole launch.", "",
        "## Results", "",
        "| | before | after |", "| --- | --- | --- |",
        f"| calibration points (simulated) | {before['n']} | {after['n']} |",
        f"| decision agreement (roi >= {THRESHOLD} vs speedup > 1) | {before['agreement']:.1%} | "
        f"{after['agreement']:.1%} |",
        f"| agreement at {THRESHOLD} on both sides | {before['agreement_same_threshold']:.1%} | "
        f"{after['agreement_same_threshold']:.1%} |",
        f"| Spearman rank correlation, roi vs simulated speedup | {before['spearman']:.3f} | "
        f"{after['spearman']:.3f} |",
        f"| log-time RMSE per kernel | {before['log_rmse_time']:.3f} | {after['log_rmse_time']:.3f} |",
        "",
        "### Worst misses (after fitting; disagreements first, then by |log roi - log speedup|)", "",
        "| point | roi | simulated speedup | model fuses | simulator fuses |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in after["worst"]:
        L.append(f"| {r['name']} | {r['roi']:.2f} | {r['speedup']:.2f} | {r['pred_fuse']} | "
                 f"{r['sim_fuse']} |")
    L += ["", "### Worst misses before fitting", "",
          "| point | roi | simulated speedup | model fuses | simulator fuses |",
          "| --- | --- | --- | --- | --- |"]
    for r in before["worst"]:
        L.append(f"| {r['name']} | {r['roi']:.2f} | {r['speedup']:.2f} | {r['pred_fuse']} | "
                 f"{r['sim_fuse']} |")
    L += ["", "## Calibration set", "",
          "| point | category | ops | dtype | tile | roi before | roi after | sim fused | "
          "sim unfused | speedup | agree (after) |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_b = {r["name"]: r for r in before["rows"]}
    by_a = {r["name"]: r for r in after["rows"]}
    for p in points:
        b, a = by_b.get(p["name"]), by_a.get(p["name"])
        ops = " ".join(p["ops"])
        if len(ops) > 60:
            ops = ops[:57] + "..."
        if a is None:
            err = (p.get("sim_error") or "not simulated").splitlines()[0][:80]
            L.append(f"| {p['name']} | {p['category']} | {ops} | {p['dtype']} | "
                     f"{'x'.join(map(str, p['tile_shape']))} | | | | | | error: {err} |")
            continue
        L.append(f"| {p['name']} | {p['category']} | {ops} | {p['dtype']} | "
                 f"{'x'.join(map(str, p['tile_shape']))} | {b['roi']:.2f} | {a['roi']:.2f} | "
                 f"{p['sim_fused']:,} | {p['sim_unfused']:,} | {a['speedup']:.2f} | "
                 f"{'yes' if a['pred_fuse'] == a['sim_fuse'] else '**no**'} |")
    slow = [d for d in defaults if ok(d) and d["sim_fused"] >= d["sim_unfused"]]
    sim_def = [d for d in defaults if ok(d)]
    L += ["", f"## Default plans (roi_threshold {THRESHOLD}) of the calibration set", "",
          f"{len(defaults)} multi-op FusionTiles fused by the planner; {len(sim_def)} simulated; "
          f"faster fused than unfused: {len(sim_def) - len(slow)} of {len(sim_def)}."]
    for d in slow:
        L.append(f"- slower fused: {d['name']} ({' '.join(d['ops'])}): {d['sim_fused']:,} vs "
                 f"{d['sim_unfused']:,}")
    for d in defaults:
        if not ok(d):
            L.append(f"- not simulated: {d['name']}: {(d.get('sim_error') or '').splitlines()[0][:120]}")
    L += ["", "## Where the planner leaves legal merges unfused", "",
          "Candidates whose default plan has other kernels than the fuse-everything plan "
          "(the planner merges pairwise and greedily, so a merge it declines is judged on the "
          "groups it has built so far, e.g. matmul + an already fused add -> relu). "
          "*ratio* = time of the default plan / time of the fuse-everything plan (> 1: "
          "fusing everything would be faster).", "",
          "| candidate | default kernels | predicted ratio | simulated ratio | "
          f"right (sim <= 1) | right (sim < {THRESHOLD}) |",
          "| --- | --- | --- | --- | --- | --- |"]
    for r in splits:
        sr = r.get("sim_ratio")
        right = "" if sr is None else ("yes" if sr <= 1.0 else "no")
        right_t = "" if sr is None else ("yes" if sr < THRESHOLD else "no")
        L.append(f"| {r['name']} | {' / '.join(r['default'])} | {r['pred_ratio']:.2f} | "
                 f"{'' if sr is None else f'{sr:.2f}'} | {right} | {right_t} |")
    if not splits:
        L.append("(none: the default plan of every candidate is the fuse-everything plan)")
    if zoo is not None:
        L += ["", "## Model zoo and benchmark models (pypto_inductor.models.ZOO, then `bench:` = benchmarks cases at small scale; ascend-a2, default options)", "",
              "| model | FusionTiles | simulated | split (op has no pypto form) | failed |",
              "| --- | --- | --- | --- | --- |"]
        for name, c in zoo["models"].items():
            L.append(f"| {name} | {c['tiles']} | {c['simulated']} | {c['split']} | {c['failed']} |")
        L += ["", f"Total: {zoo['simulated']} simulated, {zoo['split']} split "
              f"({', '.join(f'{k} x{v}' for k, v in sorted(zoo['split_ops'].items())) or 'none'}), "
              f"{zoo['failed']} failed. Multi-op FusionTiles faster fused than unfused: "
              f"{zoo['multi_op_faster']} of {zoo['multi_op']}."]
        for m, t, f, u in zoo["slower"]:
            L.append(f"- slower fused: {m} {t}: {f} vs {u}")
        L += ["", "Split FusionTiles (the op, or the input value, the emitter has no pypto form for):", ""]
        for m, t, op, e in zoo["splits"]:
            L.append(f"- {m} `{t}`: {op}: {e}")
        for m, t, e in zoo["failures"]:
            L.append(f"- failed: {m} {t}: {e}")
    L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.calibrate_ascend")
    ap.add_argument("--only", nargs="*", help="candidate names (default: all)")
    ap.add_argument("--skip-zoo", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print only; write no docs")
    ap.add_argument("--no-real", action="store_true",
                    help="leave out the real-model points (models.ZOO, pypto_inductor.zoo)")
    args = ap.parse_args(argv)
    if not pypto_sim.pypto_available():
        print("pypto is not installed", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    torch.set_num_threads(1)
    empty = empty_kernel()
    points, defaults, splits = collect(args.only, real=not args.no_real)
    hw = ascend_a2()
    cube = hw.cube_flops_per_s
    logfit, _, _ = fit(points, BASELINE)
    fitted, _ = fit_decisions(points, logfit)
    err = _Fit(points).errors(fitted)
    current = params_of(hw)
    before, after = evaluate(points, BASELINE, cube), evaluate(points, current, cube)
    zoo = None if args.skip_zoo else zoo_coverage()
    tiles = [] if args.only else tile_choice()
    seconds = time.monotonic() - t0
    text = write_doc(points, defaults, before, after, fitted, err, current, zoo, seconds, tiles,
                     splits, empty)
    print(text)
    if not args.no_write and not args.only:
        DOC.write_text(text)
        DATA.write_text(json.dumps({"points": points, "defaults": defaults, "fitted": fitted,
                                    "current": current, "baseline": BASELINE,
                                    "zoo": zoo, "tile_choice": tiles, "splits": splits,
                                    "empty_kernel": empty, "command": COMMAND},
                                   indent=1,
                                   default=str))
        print(f"# wrote {DOC.relative_to(ROOT)} and {DATA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
