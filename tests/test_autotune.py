"""Tile autotuning (codegen/pypto/autotune.py): the persistent tiling cache (reused across
processes, safe under concurrent writers), the time bound, tuned never slower than the
rule's tile in simulated cycles, and the report's tuning fields.

The cache tests run without pypto; the rest simulate (simulations are cached by kernel
source in the shared cache directory; the tiling cache goes to a temporary folder).
"""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pypto_inductor
from pypto_inductor.codegen.pypto import autotune

ROOT = Path(__file__).resolve().parent.parent
HAS_PYPTO = importlib.util.find_spec("pypto") is not None
needs_pypto = pytest.mark.skipif(not HAS_PYPTO, reason="pypto is not installed")


@pytest.fixture
def tiling_cache(tmp_path, monkeypatch):
    root = tmp_path / "tiling"
    monkeypatch.setattr(autotune, "cache_root", lambda: root)
    return root


def plan_of(fn, *inputs):
    with torch.no_grad():
        rep = pypto_inductor.report(fn, *inputs, options={"hardware": "ascend-a2"})
    (plan,) = [g.plan for g in rep.graphs if g.plan is not None]
    return plan


def _store_worker(args):
    root, key, i = args
    autotune.cache_root = lambda: Path(root)  # a fresh process: its own module state
    entry = {"key": key, "tile_shape": [i, 8], "buffering": 1, "rule_buffering": 1,
             "tried": [{"tile_shape": [i, 8], "buffering": 1, "cycles": 100 + i}], "writer": i}
    return autotune.cache_store(key, entry)["writer"]


def test_concurrent_writers_keep_one_valid_entry(tmp_path):
    """Eight processes store an entry for one key at once: every one of them gets the same
    entry back (the first writer's), the file is whole JSON, no temporary file is left."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        writers = pool.map(_store_worker, [(str(tmp_path), "k" * 24, i) for i in range(8)])
    stored = json.loads((tmp_path / ("k" * 24 + ".json")).read_text())
    assert set(writers) == {stored["writer"]}
    assert not list(tmp_path.glob("*.tmp"))


REPORT = """=================ASC++ MachineModel Report==================
Total Cycles.....................................:     26470
Core Machine Count...............................:        72
================DeviceMachine 72 Statistics=================
Total Submit Tasks...............................:        16
  |--Cube Tasks..................................:         0    0.00%
  |--Vector Tasks................................:        16  100.00%
Average Task Cycles..............................:   5256.00
  |--Max Task Cycles.............................:      5256
================Core Machine Top Statistics=================
Total Cycles.....................................:     26470
Average Vector Usage.............................:   1977.00    7.47%
"""


def test_work_cycles_from_stat_report_and_trace(tmp_path):
    """A kernel's cost: its task span in the trace (core task events, not the AICPU's nor
    the init events) plus an empty kernel's fixed cost; stat numbers parsed by name."""
    from pypto_inductor.codegen.pypto import sim

    stats = sim.parse_stats(REPORT)
    assert stats["total_cycles"] == 26470 and stats["total_submit_tasks"] == 16
    assert stats["vector_tasks"] == 16 and stats["average_task_cycles"] == 5256.0
    assert stats["average_vector_usage"] == 1977.0
    meta = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
            for p, n in ((1, "AICPU_0"), (2, "AIV_0"), (3, "AIC_0"))]
    meta += [{"ph": "M", "name": "thread_name", "pid": p, "tid": 9,
              "args": {"name": "AIV_Machien_View"}} for p in (1, 2, 3)]
    events = [{"ph": "X", "pid": 1, "tid": 9, "name": "task", "ts": 0, "dur": 99999},
              {"ph": "X", "pid": 2, "tid": 9, "name": "Core Machine Init", "ts": 0, "dur": 5},
              {"ph": "X", "pid": 3, "tid": 9, "name": "0-0-0 (a)", "ts": 3000, "dur": 1000},
              {"ph": "X", "pid": 2, "tid": 9, "name": "0-0-1 (b)", "ts": 4200, "dur": 800}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": meta + events}))
    assert sim.task_span(trace) == 2000
    r = sim.SimResult("k", cycles=26470, perfetto_trace_path=str(trace)).measure()
    assert r.work_cycles == 2000 + sim.LAUNCH_CYCLES


def test_signature_ignores_names_and_bucket_rounds_sizes():
    f = lambda x, y: torch.relu(x + y) * 2.0  # noqa: E731
    a = plan_of(f, torch.randn(100, 200), torch.randn(100, 200))
    b = plan_of(f, torch.randn(128, 256), torch.randn(128, 256))
    c = plan_of(f, torch.randn(300, 256), torch.randn(300, 256))
    ta, tb, tc = a.tiles[0], b.tiles[0], c.tiles[0]
    assert autotune.signature(ta, a.graph) == autotune.signature(tb, b.graph)
    assert autotune.shape_bucket(ta, a.graph) == autotune.shape_bucket(tb, b.graph)
    assert autotune.shape_bucket(tc, c.graph) != autotune.shape_bucket(tb, b.graph)
    g = plan_of(lambda x, y: torch.sigmoid(x + y) * 2.0, torch.randn(128, 256), torch.randn(128, 256))
    assert autotune.signature(g.tiles[0], g.graph) != autotune.signature(tb, b.graph)


def test_rule_buffering_follows_one_task_per_ai_core():
    """The buffers that fit UB at the domain's share of the 24 AI cores: split finer, the
    tasks queue in pypto's simulator; coarser, cores idle (docs/autotune_gains.md).
    512x512 gt-mul-where (4 UB buffers per op): 262144 / 24 -> 16384-element tasks,
    256 KiB > the 192 KiB UB -> 1; 256x256 add-relu: 4096-element tasks -> 3; a small
    tile fits three whatever the split; a 512x1024 LayerNorm -> 1."""
    hw = pypto_inductor.hardware.ascend_a2()
    cases = [((lambda x, y: torch.where(x > y, x * 2.0, y)), [(512, 512)] * 2, 1),
             ((lambda x, y: torch.relu(x + y)), [(256, 256)] * 2, 3),
             ((lambda x, y: torch.relu(x + y)), [(32, 64)] * 2, 3),
             ((lambda x, w: F.layer_norm(x, (1024,), w)), [(512, 1024), (1024,)], 1)]
    for fn, shapes, want in cases:
        plan = plan_of(fn, *[torch.randn(*s) for s in shapes])
        (tile,) = [t for t in plan.tiles if len(t.ops) > 1]
        assert autotune.rule_buffering(tile, plan.graph, hw) == want, (shapes, tile.ops)


@needs_pypto
def test_tuned_never_slower_than_rule_and_cached(tiling_cache):
    plan = plan_of(lambda x, y: torch.softmax(x, -1) * y, torch.randn(256, 1024), torch.randn(256, 1024))
    tunings = autotune.tune_plan(plan, seconds=300, limit=3)
    (t,) = tunings.values()
    assert t.rule is not None and t.rule.cycles and t.chosen is not None
    assert t.chosen.cycles <= t.rule.cycles
    assert len([c for c in t.tried if c.cycles]) >= 2  # the rule and at least one candidate
    assert t.rule_buffering in (1, 2, 3) and t.chosen.buffering in (1, 2, 3)
    # each candidate's buffering: the copies of the vector tile it was emitted with that fit UB
    from pypto_inductor.codegen.pypto.tiling import vec_operands
    for c in t.tried:
        if c.vec_tile:
            assert c.buffering == autotune.fitted_buffering(
                c.vec_tile, vec_operands(plan.tiles[0]), plan.hardware), c
    assert not t.from_cache and (tiling_cache / f"{t.key}.json").exists()
    # every tile shape tried computes the right values (pypto's interpreter vs the reference)
    import dataclasses
    from pypto_inductor.codegen.pypto import verify
    (tile,) = plan.tiles
    cases = [c for cand in t.tried if cand.cycles
             for c in verify.tile_case(dataclasses.replace(tile, tile_shape=cand.tile_shape),
                                       plan.graph, kernel=autotune.emit_candidate(
                                           tile, plan.graph, cand.tile_shape, plan.hardware))]
    checks = verify.verify_kernels(cases)
    assert len(checks) >= 2 and all(c.verified is True for c in checks), checks
    again = autotune.tune_plan(plan, seconds=300, limit=3)[t.tile]
    assert again.from_cache and again.chosen.tile_shape == t.chosen.tile_shape
    # the npu build emits at the cached shape
    (tile,) = plan.tiles
    assert autotune.cached_tile(tile, plan.graph).tile_shape == t.chosen.tile_shape


@needs_pypto
def test_cache_reused_by_another_process(tiling_cache):
    """A second process finds the first one's entry and simulates nothing."""
    code = textwrap.dedent(f"""
        import json, sys, torch
        from pathlib import Path
        import pypto_inductor
        from pypto_inductor.codegen.pypto import autotune, sim
        autotune.cache_root = lambda: Path({str(tiling_cache)!r})
        calls = []
        real = autotune.simulate_kernels
        autotune.simulate_kernels = lambda ks, **kw: calls.append(len(ks)) or real(ks, **kw)
        f = lambda x, y: torch.relu(x + y) * y
        rep = pypto_inductor.report(f, torch.randn(64, 256), torch.randn(64, 256),
                                    options={{"hardware": "ascend-a2"}})
        plan = [g.plan for g in rep.graphs if g.plan is not None][0]
        (t,) = autotune.tune_plan(plan, seconds=300, limit=2).values()
        print(json.dumps({{"from_cache": t.from_cache, "shape": list(t.chosen.tile_shape),
                          "simulated": sum(calls)}}))
    """)
    env = {"PYPTO_INDUCTOR_NO_CALIBRATE": "1", "PYTHONPATH": str(ROOT)}
    import os
    env = {**os.environ, **env}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                                      capture_output=True, text=True, check=True,
                                      timeout=600).stdout.strip().splitlines()[-1])
            for _ in range(2)]
    assert not runs[0]["from_cache"] and runs[0]["simulated"] >= 2
    assert runs[1]["from_cache"] and runs[1]["simulated"] == 0
    assert runs[1]["shape"] == runs[0]["shape"]


@needs_pypto
def test_time_bound_honoured(tiling_cache):
    """With no time left after the rule's kernels, no candidate is simulated, the tuning
    says it timed out, keeps the rule's tile and is not cached (it could still improve)."""
    plan = plan_of(lambda x, y: torch.relu(x * y) + x, torch.randn(512, 512), torch.randn(512, 512))
    (t,) = autotune.tune_plan(plan, seconds=1e-3).values()
    assert t.timed_out
    assert [c.rule for c in t.tried] == [True]
    assert t.chosen is t.rule
    assert not (tiling_cache / f"{t.key}.json").exists()


@needs_pypto
def test_report_shows_tuning(tiling_cache):
    f = lambda x, b: torch.nn.functional.gelu(x + b) * 2.0  # noqa: E731
    rep = pypto_inductor.report(f, torch.randn(256, 512), torch.randn(512),
                                options={"simulate": True, "autotune": True,
                                         "autotune_seconds": 300})
    (tile,) = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    tuning = tile["tuning"]
    assert tuning["tile_shape"] and tuning["buffering"] in (1, 2, 3)
    assert tuning["tried"] and all("cycles" in c and "vec_tile" in c for c in tuning["tried"])
    assert tuning["cycles"] <= tuning["rule_cycles"]
    # the tile was simulated at the tuned shape
    assert tile["simulated_work_cycles_fused"] is not None
    # ... fused and each op alone (the unfused cost baseline): those one-op kernels, at
    # the tuned shape, compute their op (pypto's interpreter vs the reference executor)
    import dataclasses

    from pypto_inductor.codegen.pypto import verify
    (plan,) = [g.plan for g in rep.graphs if g.plan is not None]
    (t,) = plan.tiles
    tuned = dataclasses.replace(t, tile_shape=tuple(tuning["tile_shape"]))
    cases = verify.unfused_cases(tuned, plan.graph, plan.hardware)
    assert len(cases) == len(tile["simulated_cycles_unfused_by_op"]) >= 2
    assert all(c.verified is True for c in verify.verify_kernels(cases)), cases
