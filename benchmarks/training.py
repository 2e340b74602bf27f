"""Training steps for ``python -m benchmarks``: forward, loss and backward of the blocks.

Each step is ``zero_grad``, ``model(x).square().mean().backward()``; eager, Inductor
and pypto each train their own copy of one model. Every parameter's gradient is
checked against eager's after the first step, then steps are timed like the inference
cases (medians over repeats, three interleaved rounds). ``reference tiles`` counts the
FusionTiles of pypto's forward and backward graphs that do not run natively.
"""
from __future__ import annotations

import copy
import statistics

import torch

from pypto_inductor import models
from pypto_inductor.report import collect

from . import median_us

COLUMNS = ["case", "eager us", "inductor us", "pypto us", "eager/pypto", "inductor/pypto",
           "pypto FusionTiles", "reference tiles"]


def cases(scale: str):
    """(name, model factory, input)."""
    batch = 4 if scale == "full" else 1
    yield ("transformer_block_train", lambda: models.TransformerBlock(256, 4, 1024),
           torch.randn(batch, 128, 256))
    yield ("llama_block_train", lambda: models.LlamaBlock(256, 4, 688),
           torch.randn(batch, 128, 256))


def _step(model):
    def step(x):
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
    return step


def run(scale: str, repeats: int, target: str, inductor: bool, only: set) -> list[list[str]]:
    rows = []
    for name, make, x in cases(scale):
        if only and name not in only:
            continue
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = make()
        trained = {"eager": eager}
        if inductor:
            trained["inductor"] = torch.compile(copy.deepcopy(eager))
        trained["pypto"] = torch.compile(copy.deepcopy(eager), backend="pypto",
                                         options={"target": target})
        steps = {label: _step(m) for label, m in trained.items()}
        with collect() as graphs:
            for step in steps.values():
                step(x)
        expected = dict(eager.named_parameters())
        for label, m in trained.items():
            for pname, p in getattr(m, "_orig_mod", m).named_parameters():
                torch.testing.assert_close(p.grad, expected[pname].grad, rtol=1e-3, atol=1e-3,
                                           msg=lambda s, n=pname, b=label: f"{b} {n}: {s}")
        natives = [v["native"] for g in graphs for v in g.compiled.kernel_native.values()]
        natives += [False for g in graphs for _ in g.compiled.kernel_fallbacks]
        times = {label: [] for label in steps}
        for _ in range(3):
            for label, step in steps.items():
                times[label].append(median_us(step, (x,), repeats))
        med = {label: statistics.median(t) for label, t in times.items()}
        ind = med.get("inductor", float("nan"))
        rows.append([name, f"{med['eager']:.1f}", f"{ind:.1f}", f"{med['pypto']:.1f}",
                     f"{med['eager'] / med['pypto']:.2f}", f"{ind / med['pypto']:.2f}",
                     str(len(natives)), str(natives.count(False))])
        torch._dynamo.reset()
    return rows
