"""The on-disk plan cache (fusion/plan_cache.py): a warm process rebuilds each graph's
FusionPlan from its entry instead of searching, with the same plan and results equal to
eager; a changed graph, input or option misses; corrupt or stale entries are rebuilt."""
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pypto_inductor
from pypto_inductor.fusion import plan_cache, planner
from pypto_inductor.report import collect


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The plan cache on, in a directory of its own (kernels stay in the shared cache)."""
    monkeypatch.setenv("PYPTO_INDUCTOR_PLAN_CACHE", "1")
    monkeypatch.setattr(plan_cache, "cache_dir", lambda: tmp_path / "plans")
    monkeypatch.setattr(plan_cache, "stats", {"hits": 0, "misses": 0, "rejected": 0})
    return tmp_path / "plans"


def _block(x, w, b):
    h = F.layer_norm(x, x.shape[-1:]) @ w + b
    return torch.softmax(F.gelu(h) * 0.5, dim=-1) + x.sum(-1, keepdim=True)


def _other(x, w, b):  # one op changed
    h = F.layer_norm(x, x.shape[-1:]) @ w + b
    return torch.softmax(F.silu(h) * 0.5, dim=-1) + x.sum(-1, keepdim=True)


def _inputs(rows=8, dtype=torch.float32):
    return (torch.randn(rows, 16, dtype=dtype), torch.randn(16, 16, dtype=dtype),
            torch.randn(16, dtype=dtype))


def _compile_run(fn, args, **options):
    torch._dynamo.reset()
    with collect() as graphs, torch.no_grad():
        out = torch.compile(fn, backend="pypto", options=options or None)(*args)
    return out, graphs


def _plans(graphs):
    return [([[op.name for op in t.ops] for t in g.plan.tiles],
             [d.to_dict() for d in g.plan.decisions]) for g in graphs]


def test_hit_rebuilds_the_same_plan_and_matches_eager(cache, tol):
    args = _inputs()
    cold, cold_graphs = _compile_run(_block, args)
    assert plan_cache.stats == {"hits": 0, "misses": 1, "rejected": 0}
    assert len(list(cache.glob("*.json"))) == 1
    args = _inputs()  # fresh inputs for the warm compile
    warm, warm_graphs = _compile_run(_block, args)
    assert plan_cache.stats == {"hits": 1, "misses": 1, "rejected": 0}
    assert _plans(warm_graphs) == _plans(cold_graphs)  # tiles and the report's decisions
    assert len(warm_graphs[0].plan.tiles) >= 2
    torch.testing.assert_close(warm, _block(*args), **tol(torch.float32))


def test_changed_graph_inputs_or_options_miss(cache, monkeypatch):
    _compile_run(_block, _inputs())
    changes = [(_other, _inputs(), {}),  # another op
               (_block, _inputs(rows=12), {}),  # another shape
               (_block, _inputs(dtype=torch.float64), {}),  # another dtype
               (_block, _inputs(), {"roi_threshold": 3.0}),  # another option
               (_block, _inputs(), {"fallback_ops": ["aten.gelu"]})]
    for i, (fn, args, options) in enumerate(changes):
        _compile_run(fn, args, **options)
        assert plan_cache.stats["misses"] == i + 2 and plan_cache.stats["hits"] == 0, (i, fn)
    monkeypatch.setattr(planner, "MAX_GROUPS_PER_MERGE", 2)  # a module setting
    _compile_run(_block, _inputs())
    assert plan_cache.stats["hits"] == 0
    monkeypatch.undo()
    assert len(list(cache.glob("*.json"))) == len(changes) + 2


@pytest.mark.parametrize("damage", ["garbage", "truncated", "unknown op", "op twice",
                                    "old format"])
def test_a_corrupt_or_stale_entry_is_ignored_and_rewritten(cache, damage, tol):
    args = _inputs()
    _, cold_graphs = _compile_run(_block, args)
    (path,) = cache.glob("*.json")
    text = path.read_text()
    entry = json.loads(text)
    tile = next(s for s in entry["steps"] if "tile" in s)
    if damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "truncated":
        path.write_text(text[:len(text) // 2])
    else:
        if damage == "unknown op":
            tile["tile"][0] = "no_such_op"
        elif damage == "op twice":
            tile["tile"].append(tile["tile"][0])
        else:
            entry["format"] = -1
        path.write_text(json.dumps(entry))
    args = _inputs()
    out, graphs = _compile_run(_block, args)
    assert plan_cache.stats == {"hits": 0, "misses": 2, "rejected": 1}
    torch.testing.assert_close(out, _block(*args), **tol(torch.float32))
    assert _plans(graphs) == _plans(cold_graphs)
    assert json.loads(path.read_text()) == json.loads(text)  # rewritten whole
    _compile_run(_block, args)
    assert plan_cache.stats["hits"] == 1


def test_disabled_by_the_environment(cache, monkeypatch):
    monkeypatch.setenv("PYPTO_INDUCTOR_PLAN_CACHE", "0")
    _compile_run(_block, _inputs())
    assert plan_cache.stats == {"hits": 0, "misses": 0, "rejected": 0}
    assert not cache.exists()


def test_concurrent_writers_leave_a_whole_entry(cache):
    """Writers of one key (threads here; processes alike: each writes its own temporary and
    renames it) never leave a reader a partial entry."""
    x, w, b = _inputs()
    _compile_run(_block, (x, w, b))
    (path,) = cache.glob("*.json")
    graph_plan = None
    with collect() as graphs, torch.no_grad():
        torch._dynamo.reset()
        torch.compile(_block, backend="pypto")(x, w, b)
    graph_plan = graphs[0].plan
    seen, errors = [], []

    def write():
        for _ in range(30):
            plan_cache._write(path, graph_plan)

    def read():
        for _ in range(200):
            try:
                seen.append(json.loads(path.read_text())["format"])
            except Exception as e:  # noqa: BLE001 - what the test looks for
                errors.append(e)

    threads = [threading.Thread(target=f) for f in (write, write, write, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and seen
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporaries left


_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch, torch.nn.functional as F
    from pypto_inductor.fusion import plan_cache
    from pypto_inductor.report import collect
    plan_cache.cache_dir = lambda: Path(sys.argv[1])
    torch.manual_seed(0)  # the same model in both processes
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    torch.manual_seed(int(sys.argv[2]))  # fresh inputs per process
    plans = []
    def check(got, want, what):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-5, msg=what)
    for dynamic in (False, True):
        torch._dynamo.reset()
        f = torch.compile(model, backend="pypto", dynamic=dynamic)
        with collect() as graphs, torch.no_grad():
            for rows in (4, 6):
                x = torch.randn(rows, 16)
                check(f(x), model(x), f"inference dynamic={dynamic}")
        plans += [[[op.name for op in t.ops] for t in g.plan.tiles] for g in graphs]
    torch._dynamo.reset()  # training: forward and backward graphs
    f = torch.compile(model, backend="pypto")
    with collect() as graphs:
        x = torch.randn(5, 16, requires_grad=True)
        got = f(x)
        got.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        model.zero_grad()
        x2 = x.detach().requires_grad_()
        want = model(x2)
        want.square().sum().backward()
        check(got, want, "training forward")
        for g, w in zip(grads, [p.grad for p in model.parameters()] + [x2.grad]):
            check(g, w, "training gradients")
    plans += [[[op.name for op in t.ops] for t in g.plan.tiles] for g in graphs]
    print(json.dumps({"stats": plan_cache.stats, "plans": plans}))
""")


def _process(plans_dir, seed):
    env = dict(os.environ, PYPTO_INDUCTOR_PLAN_CACHE="1")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(plans_dir), str(seed)],
                         capture_output=True, text=True, env=env, timeout=900,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_warm_process_plans_nothing_and_matches_eager(tmp_path):
    """Static and dynamic=True inference and a training graph (forward and backward), in a
    cold process and in a warm one on its cache, each on fresh random inputs."""
    cold = _process(tmp_path, 1)
    graphs = cold["stats"]["misses"]
    assert graphs >= 4 and cold["stats"]["hits"] == 0  # static, dynamic, forward, backward
    warm = _process(tmp_path, 2)
    assert warm["stats"] == {"hits": graphs, "misses": 0, "rejected": 0}
    assert warm["plans"] == cold["plans"]
