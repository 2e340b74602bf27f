"""``pypto_inductor.report(model, *inputs)``: compile, run and explain a model.

It compiles the model through the backend with the given options, runs it
(``repeats`` times with ``profile``), collects the report of every graph
compiled, and with ``simulate`` runs each FusionTile in pypto's simulator
(fused and one kernel per op). :mod:`.report` holds the report's data model
and renderers.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .backend import pypto_backend
from .calibrate import hardware_model
from .codegen.pypto.attention import simulate_plan_attention
from .codegen.pypto.sim import simulate_plan
from .codegen.pypto.verify import verify_plan
from .config import parse_options
from .progress import Progress
from .report import FusionReport, GraphReport, collect, measured_total


def report(model_or_fn, *example_inputs, options: dict[str, Any] | None = None,
           backward: bool = False, dynamic: bool | None = None,
           repeats: int = 10) -> FusionReport:
    """Compile ``model_or_fn`` through the pypto backend and return its FusionReport.

    With ``backward=True`` the backward graph is compiled too (gradients of the
    outputs' sum are computed with torch.autograd.grad and not accumulated). With
    ``options={"profile": True}`` the model runs ``repeats`` times so each
    ``measured_us`` is a median, and the same model compiled with ``fusion=False``
    (one kernel per op) is timed alike for the summary's ``measured_speedup``.
    """
    config = parse_options(options)
    calls = max(repeats, 1) if config.profile else 1
    graphs = _compile_and_run(model_or_fn, example_inputs, config, backward, dynamic, calls)
    unfused = None
    if config.profile and config.fusion:
        unfused = _compile_and_run(model_or_fn, example_inputs,
                                   dataclasses.replace(config, fusion=False, simulate=False),
                                   backward, dynamic, calls)
    hw = hardware_model(config.hardware_name, config.capacity_bytes)
    if config.simulate or config.verify or config.autotune:  # verify, autotune imply simulate
        planned = [g for g in graphs if g.plan is not None]
        tunings = {}
        if config.autotune:  # tile shapes tuned in the simulator, kept in the tiling cache
            from .codegen.pypto.autotune import tune_plan
            with Progress(sum(len(g.plan.tiles) for g in planned), "autotuning") as bar:
                for graph_report in planned:
                    tunings[id(graph_report)] = tune_plan(
                        graph_report.plan, config.autotune_seconds / max(1, len(planned)),
                        progress=bar)
        with Progress(sum(len(g.plan.tiles) for g in planned), "simulating") as bar:
            for graph_report in planned:
                graph_report.simulation = simulate_plan(graph_report.plan,
                                                        buffering=config.buffering, progress=bar,
                                                        tunings=tunings.get(id(graph_report)))
                if config.verify:  # values: every pypto kernel run in pypto's interpreter
                    for name, check in verify_plan(graph_report.plan,
                                                   per_pass=config.verify_passes).items():
                        if name in graph_report.simulation:
                            graph_report.simulation[name].verification = check
                # SDPA calls (the attention rewrite): the pypto flash-attention kernel
                graph_report.attention = simulate_plan_attention(
                    graph_report.plan, verify=config.verify, per_pass=config.verify_passes)
    rep = FusionReport(graphs, target=config.target, hardware=hw)
    if unfused is not None:
        rep.measured_us_unfused = measured_total([g.to_dict() for g in unfused])
    return rep


def _compile_and_run(model_or_fn, example_inputs, config, backward, dynamic,
                     calls: int) -> list[GraphReport]:
    torch._dynamo.reset()  # a report always reflects a fresh compile with these options
    compiled = torch.compile(model_or_fn, dynamic=dynamic,
                             backend=lambda gm, ex: pypto_backend(gm, ex, options=config))
    params = [p for p in _parameters(model_or_fn) if p.requires_grad]
    params += [x for x in example_inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    with collect() as graphs:
        for _ in range(calls):
            out = compiled(*example_inputs)
            if backward:
                outs = [o for o in torch.utils._pytree.tree_leaves(out)
                        if isinstance(o, torch.Tensor) and o.requires_grad]
                if outs and params:
                    torch.autograd.grad(sum(o.float().sum() for o in outs), params,
                                        allow_unused=True)
    torch._dynamo.reset()
    return graphs


def _parameters(model_or_fn):
    return list(model_or_fn.parameters()) if isinstance(model_or_fn, torch.nn.Module) else []
