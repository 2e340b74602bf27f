"""The on-disk caches of compiled graphs: fusion/plan_cache.py (a warm process rebuilds
each ATen graph's FusionPlan from its entry instead of searching) and graph_cache.py (a
plain inference Dynamo graph's plan, found before AOTAutograd runs). Same plans, results
equal to eager on fresh inputs; a changed graph, input or option misses; corrupt or stale
entries are rebuilt; graphs AOTAutograd's wrapper does more for are never stored."""
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
from pypto_inductor import backend, graph_cache
from pypto_inductor.fusion import plan_cache, planner
from pypto_inductor.report import collect


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The plan cache on (the graph cache off), in a directory of its own (kernels stay in
    the shared cache)."""
    monkeypatch.setenv("PYPTO_INDUCTOR_PLAN_CACHE", "1")
    monkeypatch.setenv("PYPTO_INDUCTOR_GRAPH_CACHE", "0")
    monkeypatch.setattr(plan_cache, "cache_dir", lambda: tmp_path / "plans")
    monkeypatch.setattr(plan_cache, "stats", {"hits": 0, "misses": 0, "rejected": 0})
    return tmp_path / "plans"


@pytest.fixture
def graphs_cache(cache, tmp_path, monkeypatch):
    """Both caches on; the graph cache's directory."""
    monkeypatch.setenv("PYPTO_INDUCTOR_GRAPH_CACHE", "1")
    monkeypatch.setattr(graph_cache, "cache_dir", lambda: tmp_path / "graphs")
    monkeypatch.setattr(graph_cache, "stats", dict.fromkeys(graph_cache.stats, 0))
    return tmp_path / "graphs"


def _block(x, w, b):
    h = F.layer_norm(x, x.shape[-1:]) @ w + b
    return torch.softmax(F.gelu(h) * 0.5, dim=-1) + x.sum(-1, keepdim=True)


def _other(x, w, b):  # one op changed
    h = F.layer_norm(x, x.shape[-1:]) @ w + b
    return torch.softmax(F.silu(h) * 0.5, dim=-1) + x.sum(-1, keepdim=True)


def _inputs(rows=8, dtype=torch.float32):
    return (torch.randn(rows, 16, dtype=dtype), torch.randn(16, 16, dtype=dtype),
            torch.randn(16, dtype=dtype))


def _compile_run(fn, args, dynamic=None, grad=False, **options):
    torch._dynamo.reset()
    with collect() as graphs, torch.set_grad_enabled(grad):
        out = torch.compile(fn, backend="pypto", dynamic=dynamic,
                            options=options or None)(*args)
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
            plan_cache.write(path, graph_plan)

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


def _no_aot(*args, **kwargs):
    raise AssertionError("AOTAutograd ran on a graph-cache hit")


def test_graph_cache_hit_skips_aot_autograd_and_matches_eager(graphs_cache, monkeypatch, tol):
    args = _inputs()
    cold, cold_graphs = _compile_run(_block, args)
    assert graph_cache.stats["stored"] == 1 and plan_cache.stats["misses"] == 1
    (entry,) = graphs_cache.glob("*.pkl")
    for grad in (False, True):  # grad on, no input requiring grad: an inference graph too
        args = _inputs()
        with monkeypatch.context() as m:
            m.setattr(backend, "aot_autograd", _no_aot)
            warm, warm_graphs = _compile_run(_block, args, grad=grad)
        torch.testing.assert_close(warm, _block(*args), **tol(torch.float32))
        assert not warm.requires_grad and torch.is_grad_enabled()
        assert _plans(warm_graphs) == _plans(cold_graphs)
        if not grad:  # grad mode is part of the key: the first grad-on compile is a miss
            assert graph_cache.stats["hits"] == 1
            _compile_run(_block, _inputs(), grad=True)
            assert graph_cache.stats["stored"] == 2
    assert graph_cache.stats["hits"] == 2 and plan_cache.stats["hits"] == 1
    # another op, shape or option misses
    for fn, args, options in [(_other, _inputs(), {}), (_block, _inputs(rows=12), {}),
                              (_block, _inputs(), {"roi_threshold": 3.0})]:
        hits = graph_cache.stats["hits"]
        out, _ = _compile_run(fn, args, **options)
        assert graph_cache.stats["hits"] == hits
        torch.testing.assert_close(out, fn(*args), **tol(torch.float32))
    # a corrupt entry is ignored and rewritten
    entry.write_bytes(entry.read_bytes()[:100])
    args = _inputs()
    out, _ = _compile_run(_block, args)
    assert graph_cache.stats["rejected"] == 1
    torch.testing.assert_close(out, _block(*args), **tol(torch.float32))
    hits = graph_cache.stats["hits"]
    _compile_run(_block, args)
    assert graph_cache.stats["hits"] == hits + 1


def _mutates(x, w, b):
    x.add_(1.0)
    return x @ w + b


def _returns_a_view(x, w, b):
    return x @ w + b, x.t()


def _returns_alias_of_output(x, w, b):
    y = torch.relu(x @ w + b)
    return y, y.view(-1)


@pytest.mark.parametrize("case", ["dynamic", "training", "mutation", "input view",
                                  "output view", "autocast"])
def test_graphs_aot_autograd_wraps_are_not_stored(graphs_cache, case, tol):
    fn, args, kw = _block, _inputs(), {}
    if case == "dynamic":
        kw["dynamic"] = True
    elif case == "training":
        args = tuple(a.requires_grad_() for a in args)
        kw["grad"] = True
    elif case == "mutation":
        fn = _mutates
    elif case == "input view":
        fn = _returns_a_view
    elif case == "output view":
        fn = _returns_alias_of_output
    eager_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = _compile_run(fn, args)
            want = fn(*eager_args)
    else:
        out, _ = _compile_run(fn, args, **kw)
        want = fn(*eager_args)
    tolerance = tol(torch.bfloat16 if case == "autocast" else torch.float32)
    torch.testing.assert_close(out, want, **tolerance)
    if case == "output view":  # AOTAutograd's inference wrapper leaves such outputs alone
        assert graph_cache.stats["stored"] == 1
        args = _inputs()
        out, _ = _compile_run(fn, args)
        assert graph_cache.stats["hits"] == 1
        torch.testing.assert_close(out, fn(*args), **tolerance)
        return
    assert graph_cache.stats["stored"] == 0 and not graphs_cache.exists()
    if case == "mutation":
        torch.testing.assert_close(args[0], eager_args[0])


_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch, torch.nn.functional as F
    from pypto_inductor import graph_cache, training_cache
    from pypto_inductor.fusion import plan_cache
    from pypto_inductor.report import collect
    plan_cache.cache_dir = lambda: Path(sys.argv[1], "plans")
    graph_cache.cache_dir = lambda: Path(sys.argv[1], "graphs")
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
    print(json.dumps({"stats": plan_cache.stats, "graphs": graph_cache.stats,
                      "training": training_cache.stats, "plans": plans}))
""")


def _process(plans_dir, seed):
    env = dict(os.environ, PYPTO_INDUCTOR_PLAN_CACHE="1",  # AOTAutograd's cache too:
               TORCHINDUCTOR_CACHE_DIR=str(plans_dir / "inductor"))
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(plans_dir), str(seed)],
                         capture_output=True, text=True, env=env, timeout=900,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_warm_process_plans_nothing_and_matches_eager(tmp_path):
    """Static and dynamic=True inference and a training graph (forward and backward), in a
    cold process and in a warm one on its caches, each on fresh random inputs: the static
    inference graph comes from the graph cache, the training forward and backward from
    AOTAutograd's cache (training_cache.py), the others' plans from the plan cache."""
    cold = _process(tmp_path, 1)
    graphs = cold["stats"]["misses"]
    assert graphs >= 4 and cold["stats"]["hits"] == 0  # static, dynamic, forward, backward
    stored = cold["graphs"]["stored"]
    assert stored >= 1 and cold["training"]["loaded"] == 0
    warm = _process(tmp_path, 2)
    assert warm["graphs"]["hits"] == stored and warm["graphs"]["stored"] == 0
    assert warm["training"]["loaded"] == 2
    assert warm["stats"] == {"hits": graphs - stored - 2, "misses": 0, "rejected": 0}
    assert warm["plans"] == cold["plans"]
