"""Shared test fixtures: a clean Dynamo state per test, dtype tolerances, eager comparison.

Every test compares the pypto backend with eager PyTorch on fresh seeded random
inputs. Helpers are exposed as fixtures (``tol``, ``run_both``) so test modules
need no imports from this file.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import pypto_inductor
from pypto_inductor.report import collect

# Planner decisions must not depend on this machine's timing: the host model keeps
# its built-in numbers (tests/test_calibrate.py exercises the calibration itself).
os.environ.setdefault("PYPTO_INDUCTOR_NO_CALIBRATE", "1")
# A bug while compiling fails the test instead of a quiet eager fallback (config.strict);
# tests/test_reliability.py checks the non-strict default with strict=False.
os.environ.setdefault("PYPTO_INDUCTOR_STRICT", "1")
# Tests plan every graph (some replace the planner or its inputs in ways no cache key sees);
# tests/test_plan_cache.py turns the plan cache on where it tests it.
os.environ.setdefault("PYPTO_INDUCTOR_PLAN_CACHE", "0")

# (atol, rtol) per dtype: fp32 near PyTorch's defaults (reductions may reorder
# sums), half types at their resolution after a few chained ops.
TOLERANCES = {
    torch.float32: (1e-5, 1.3e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (4e-2, 4e-2),
}


def tolerances(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES.get(dtype, (0.0, 0.0))
    return {"atol": atol, "rtol": rtol}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, with a fixed seed and clean Dynamo counters."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def tol():
    """tol(dtype) -> {"atol": .., "rtol": ..} for torch.testing.assert_close."""
    return tolerances


@dataclasses.dataclass
class Run:
    out: Any  # the compiled model's output
    ref: Any  # eager PyTorch's output
    report: pypto_inductor.FusionReport  # every graph compiled for the call

    @property
    def summary(self) -> dict:
        return self.report.to_dict()["summary"]

    def fallback_ops(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for g in self.report.to_dict()["graphs"]:
            for k, v in g["fallback_ops"].items():
                total[k] = total.get(k, 0) + v
        return total


def _first_float_dtype(inputs) -> torch.dtype:
    return next((x.dtype for x in inputs
                 if isinstance(x, torch.Tensor) and x.is_floating_point()), torch.float32)


@pytest.fixture
def run_both():
    """run_both(model, *inputs, options=None, dynamic=None, dtype=None, **tol) -> Run.

    Compiles ``model`` with backend="pypto", runs it and eager PyTorch under
    no_grad on the same inputs, asserts the outputs match within the dtype's
    tolerance (that of the first floating input unless ``dtype`` is given; atol /
    rtol keywords override) and returns outputs and the FusionReport of the compile.
    """

    def run(model, *inputs, options=None, dynamic=None, dtype=None, **overrides) -> Run:
        dtype = dtype or _first_float_dtype(inputs)
        compiled = torch.compile(model, backend="pypto", options=options, dynamic=dynamic)
        with torch.no_grad(), warnings.catch_warnings(), collect() as graphs:
            warnings.simplefilter("ignore")
            out = compiled(*inputs)
            ref = model(*inputs)
        torch.testing.assert_close(out, ref, **{**tolerances(dtype), **overrides})
        config = pypto_inductor.parse_options(options)
        return Run(out, ref, pypto_inductor.FusionReport(graphs, target=config.target))

    return run


def _spy_builds(monkeypatch, record) -> None:
    """Call ``record(tiles, kernels)`` for every batch of tiles the cpu target builds."""
    from pypto_inductor.codegen import cpp
    real = cpp.build_many

    def spy(tiles, graph):
        kernels = real(tiles, graph)
        record(tiles, kernels)
        return kernels

    monkeypatch.setattr(cpp, "build_many", spy)


@pytest.fixture
def built(monkeypatch):
    """(tile, kernel) of every tile the cpu target builds during the test."""
    out = []
    _spy_builds(monkeypatch, lambda tiles, kernels: out.extend(zip(tiles, kernels)))
    return out


@pytest.fixture
def sources(monkeypatch):
    """The C++ source of every native kernel the cpu target builds during the test."""
    from pypto_inductor.codegen import cpp
    out = []
    _spy_builds(monkeypatch, lambda tiles, kernels: out.extend(
        cpp.generate_source(k.program) for k in kernels if getattr(k, "native", False)))
    return out


@pytest.fixture
def threads():
    """``threads(n)`` sets torch's thread count for the test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
