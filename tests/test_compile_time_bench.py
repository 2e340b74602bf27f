"""benchmarks/compile_time.py: the training mode measures a first forward+backward step;
the aot modes a saved function's load and first call (forward, or training step)."""
from __future__ import annotations

import math

import pytest

from benchmarks import compile_time


def test_train_mode_times_a_cold_and_a_warm_training_step():
    r = compile_time.measure(compile_time.TINY, ("pypto",), "train")
    cold, warm = r["pypto", "cold"], r["pypto", "warm"]
    for t in (cold, warm):
        assert t["first_s"] > 0 and t["cpu_s"] > 0 and t["start_s"] >= t["first_s"]
    cells = compile_time.row("tiny", r)
    assert len(cells) == len(compile_time.COLUMNS) and cells[3] == "-"  # no inductor column


def test_train_mode_step_runs_a_backward():
    model, kw = compile_time.model_and_batch(compile_time.TINY, "train")
    assert model.training and "labels" in kw
    model(**kw)["loss"].backward()
    assert all(p.grad is not None and math.isfinite(p.grad.abs().sum().item())
               for p in model.parameters())
    model, kw = compile_time.model_and_batch(compile_time.TINY, "forward")
    assert not model.training and "labels" not in kw


@pytest.mark.parametrize("mode", ["aot", "aot-train"])
def test_aot_mode_loads_the_saved_function_in_a_new_process(mode):
    r = compile_time.measure(compile_time.TINY, ("pypto",), mode)
    cold, warm = r["pypto", "cold"], r["pypto", "warm"]
    # cold: Dynamo's trace, our compile and the save; warm: the file loaded, no trace
    assert 0 < warm["first_s"] < cold["first_s"] and warm["start_s"] >= warm["first_s"]


def test_eager_backend_gives_the_dynamo_floor_column():
    r = compile_time.measure(compile_time.TINY, ("eager",), "forward")
    cells = compile_time.row("tiny", r)
    assert cells[-1] != "-" and float(cells[-1]) > 0 and cells[1] == "-"  # no pypto column
