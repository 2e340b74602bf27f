"""torch.compile(fn, backend="pypto", fullgraph=True).aot_compile(...): saved to a file,
loaded in a new process without Dynamo's trace or our compile (precompile.py)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pypto_inductor  # noqa: F401 - registers the backend
from pypto_inductor.precompile import PrecompiledGraph

ROOT = Path(__file__).resolve().parents[1]

MODEL = textwrap.dedent("""
    import torch

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(),
                                   torch.nn.LayerNorm(48), torch.nn.Linear(48, 8)).eval()

    def run(model, x):
        return torch.softmax(model(x), -1) * x[:, :8].sigmoid()
""")


def _child(tmp_path: Path, body: str) -> str:
    (tmp_path / "model_def.py").write_text(MODEL)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_saved_function_runs_in_a_new_process_without_compiling(tmp_path):
    _child(tmp_path, """
        import torch, pypto_inductor
        from model_def import build, run
        model = build()
        with torch.no_grad():
            f = torch.compile(run, backend="pypto", fullgraph=True).aot_compile(
                ((model, torch.randn(6, 24)), {}))
        f.save_compiled_function("saved.bin")
        torch.save(model.state_dict(), "weights.pt")
    """)
    out = _child(tmp_path, """
        import torch, pypto_inductor
        from torch._dynamo.utils import counters
        from model_def import build, run
        model = build()
        model.load_state_dict(torch.load("weights.pt"))
        with open("saved.bin", "rb") as f:
            loaded = torch.compiler.load_compiled_function(f)
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(6, 24)
                torch.testing.assert_close(loaded(model, x), run(model, x),
                                           rtol=1e-5, atol=1e-5)
        assert not counters["frames"], dict(counters["frames"])  # no Dynamo trace, no compile
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_loaded_graph_is_ours_and_round_trips(tmp_path):
    """In one process: aot_compile's graph is a PrecompiledGraph (not an eager fallback),
    computing eager's values, and its bytes rebuild it."""
    exec(compile(MODEL, "model_def", "exec"), ns := {})
    model = ns["build"]()
    with torch.no_grad():
        f = torch.compile(ns["run"], backend="pypto", fullgraph=True).aot_compile(
            ((model, torch.randn(6, 24)), {}))
        graph = f._artifacts.compiled_fn
        assert isinstance(graph, PrecompiledGraph)
        again = PrecompiledGraph.deserialize_compile_artifacts(
            PrecompiledGraph.serialize_compile_artifacts(graph))
        x = torch.randn(6, 24)
        torch.testing.assert_close(f(model, x), ns["run"](model, x), rtol=1e-5, atol=1e-5)
        assert again.plan.graph.name == graph.plan.graph.name


def test_training_step_is_saved_and_trains_in_a_new_process(tmp_path):
    """A training graph is saved as AOTAutograd's entry of our forward and backward
    (training_cache.py): loaded in a new process with no Dynamo trace, its loss and
    gradients match eager's on fresh inputs."""
    _child(tmp_path, """
        import torch, pypto_inductor
        from model_def import build, run
        model = build().train()
        step = lambda m, x: run(m, x).square().sum()
        f = torch.compile(step, backend="pypto", fullgraph=True).aot_compile(
            ((model, torch.randn(6, 24)), {}))
        f.save_compiled_function("saved.bin")
        torch.save(model.state_dict(), "weights.pt")
    """)
    out = _child(tmp_path, """
        import torch, pypto_inductor
        from torch._dynamo.utils import counters
        from pypto_inductor import training_cache
        from model_def import build, run
        model, ref = build().train(), build().train()
        model.load_state_dict(torch.load("weights.pt"))
        ref.load_state_dict(torch.load("weights.pt"))
        with open("saved.bin", "rb") as f:
            loaded = torch.compiler.load_compiled_function(f)
        for _ in range(2):
            x = torch.randn(6, 24)
            loss = loaded(model, x)
            loss.backward()
            want = run(ref, x).square().sum()
            want.backward()
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
        assert training_cache.stats["loaded"] == 2  # our forward and backward
        assert not counters["frames"], dict(counters["frames"])  # no Dynamo trace, no compile
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_graph_it_cannot_save_is_refused_with_a_clear_error():
    with torch.no_grad(), pytest.raises(Exception, match="pypto can save .*static shapes"):
        torch.compile(lambda x: x.view(-1)[:4] * 2, backend="pypto", fullgraph=True,
                      dynamic=True).aot_compile(((torch.randn(3, 8),), {}))
